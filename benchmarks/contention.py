"""What :mod:`benchmarks.interference` and :mod:`benchmarks.duplex` share: a KV case (a
device pool and a registered host pool, the slots of one call) with its byte-for-byte
checks of both directions, and the timed loops they run on two streams at once.

A check poisons the destination, runs the call, and compares every moved item with the
source's item by plain torch indexing; every other destination byte must still be the
poison.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import pointerdomain as pd

__all__ = ["DIM", "HEADS", "IN_FLIGHT", "KVCase", "LAYERS", "PAGE_SIZE", "concurrently", "sync", "time_loop"]

LAYERS, PAGE_SIZE, HEADS, DIM = 32, 16, 4, 128  # 1 KiB bf16 items
IN_FLIGHT = 4  # calls a timed loop keeps queued ahead of the device
POISON = 0xA5


@dataclass
class KVCase:
    """A device pool (layer_first) and a registered host pool (page_first) on one device,
    the host filled with random bytes, and the slots of one call."""

    device: pd.Device
    pool: pd.DeviceKVPool
    host: pd.HostKVPool
    host_slots: torch.Tensor  # on the device (CPU for the emulated device)
    dev_slots: torch.Tensor
    bytes_per_call: int

    @classmethod
    def build(cls, device: pd.Device, tokens: int, seed: int = 0) -> KVCase:
        pages = 2 * tokens // PAGE_SIZE + 2
        common: dict[str, Any] = dict(attention="mha", num_layers=LAYERS, page_size=PAGE_SIZE, num_heads=HEADS,
                                      head_dim=DIM, dtype="bfloat16")
        pool = pd.DeviceKVPool(pd.KVLayout(kind="layer_first", num_pages=pages, **common), device)
        host = pd.HostKVPool(pd.KVLayout(kind="page_first", num_pages=2 * pages, **common), device)
        flat = host.buffer.view(torch.uint8).reshape(-1)
        g = torch.Generator().manual_seed(seed)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
        hs = torch.randperm(host.layout.num_slots, generator=g)[:tokens]
        ds = torch.randperm(pool.layout.num_slots, generator=g)[:tokens]
        moved = tokens * pool.layout.num_kv * LAYERS * pool.layout.item_bytes
        return cls(device, pool, host, hs.to(device.torch_device), ds.to(device.torch_device), moved)

    def _host_bytes(self) -> torch.Tensor:
        """The host pool's page_first buffer as ``[kv, slots, layers, item bytes]`` uint8."""
        lay = self.host.layout
        return self.host.buffer.view(torch.uint8).reshape(lay.num_kv, lay.num_slots, LAYERS, lay.item_bytes)

    def _device_items(self, kv: int, layer: int) -> torch.Tensor:
        """Every item of one device buffer, ``[slots, item bytes]`` uint8 on the CPU."""
        return self.pool.buffer(kv, layer).view(torch.uint8).reshape(-1, self.pool.layout.item_bytes).cpu()

    def host_items(self, kv: int, layer: int) -> torch.Tensor:
        """The host items of the call's slots by plain torch indexing of the page_first
        buffer ``[kv, slots, layers, item bytes]``."""
        return self._host_bytes()[kv][self.host_slots.cpu(), layer]

    def check(self, load: Callable[[], None], name: str) -> None:
        """``load`` (H2D) moves exactly the call's items: nothing else of the poisoned device
        pool changes."""
        for b in self.pool.buffers:
            b.view(torch.uint8).fill_(POISON)
        load()
        sync(self.device)
        d = self.dev_slots.cpu()
        for kv in range(self.pool.layout.num_kv):
            for layer in range(LAYERS):
                got = self._device_items(kv, layer)
                if not torch.equal(got[d], self.host_items(kv, layer)):
                    raise SystemExit(f"{name}: kv {kv} layer {layer}: moved items are not the host's")
                rest = torch.ones(got.shape[0], dtype=torch.bool)
                rest[d] = False
                if not bool((got[rest] == POISON).all()):
                    raise SystemExit(f"{name}: kv {kv} layer {layer}: a byte outside the moved slots changed")

    def check_backup(self, backup: Callable[[], None], name: str) -> None:
        """``backup`` (D2H) writes exactly the call's items into the poisoned host pool."""
        self.host.buffer.view(torch.uint8).reshape(-1).fill_(POISON)
        backup()
        sync(self.device)
        host = self._host_bytes()
        h, d = self.host_slots.cpu(), self.dev_slots.cpu()
        for kv in range(self.host.layout.num_kv):
            for layer in range(LAYERS):
                if not torch.equal(host[kv][h, layer], self._device_items(kv, layer)[d]):
                    raise SystemExit(f"{name}: D2H kv {kv} layer {layer}: moved items are not the device's")
        rest = torch.ones(self.host.layout.num_slots, dtype=torch.bool)
        rest[h] = False
        if not bool((host[:, rest] == POISON).all()):
            raise SystemExit(f"{name}: D2H wrote outside the moved slots")

    def close(self) -> None:
        self.host.close()


def sync(device: pd.Device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device.ordinal)


def time_loop(device: pd.Device, stream: Any, fn: Callable[[], object], seconds: float) -> tuple[float, int]:
    """Calls ``fn`` enqueued on ``stream`` until ``seconds`` of host time passed; returns the
    device seconds between the first and the last call's end and the call count."""
    if device.type != "cuda":
        start, n = time.perf_counter(), 0
        while n == 0 or time.perf_counter() - start < seconds:
            fn()
            n += 1
        return time.perf_counter() - start, n
    # At most IN_FLIGHT calls queued ahead of the device: the loop then lasts about as long
    # on the device as on the host, so two loops started together overlap on the device.
    from collections import deque

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pending: deque[Any] = deque()
    with torch.cuda.stream(stream):
        begin.record()
        start, n = time.perf_counter(), 0
        while n == 0 or time.perf_counter() - start < seconds:
            fn()
            n += 1
            pending.append(torch.cuda.Event())
            pending[-1].record()
            if len(pending) > IN_FLIGHT:
                pending.popleft().synchronize()
        end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3, n


def concurrently(device: pd.Device, a: Callable[[], tuple[float, int]], b: Callable[[], tuple[float, int]]
                 ) -> tuple[tuple[float, int], tuple[float, int]]:
    """Run two enqueue loops from two host threads (each on its own stream), so both streams
    hold work at the same time; on the emulated device one after the other."""
    if device.type != "cuda":
        return a(), b()
    import threading

    out: dict[str, tuple[float, int]] = {}

    def run(key: str, fn: Callable[[], tuple[float, int]]) -> None:
        torch.cuda.set_device(device.ordinal)
        out[key] = fn()

    threads = [threading.Thread(target=run, args=("a", a)), threading.Thread(target=run, args=("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["a"], out["b"]
