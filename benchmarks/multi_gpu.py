"""Aggregate H2D and D2H bandwidth of KV page transfers on several GPUs at once, from
one registered host pool, against one GPU alone. Public API only.

One :class:`pointerdomain.HostKVPool` (``page_first``, registered once, portable) holds
a disjoint range of host pages for every device; each device has its own
:class:`pointerdomain.DeviceKVPool` (``layer_first``) and its own stream, and the host
pool reaches it through ``HostKVPool.kernel_table_for(device)``. Every page of the
device pools moves, in random page order on both sides. Each direction is checked
byte for byte once (destination poisoned first, every moved item compared with its
source by plain torch indexing, every other byte still poison) before it is timed.

Timing: ``--iters`` rounds; a round enqueues one all-layer transfer per device (one
host thread for all CUDA devices: launches are asynchronous; one thread per device
with ``--threads`` and always on emulated devices, whose launches are synchronous),
then waits for every stream. Bandwidth = bytes moved by all devices / wall time, GB/s
(10^9 bytes per second). The one-device row is device 0 alone with the same per-device
bytes, so the ratio is the scaling (2.0 = perfect for two GPUs; host memory bandwidth,
the PCIe topology and the host pool's NUMA node bound it).

Usage::

    python -m benchmarks.multi_gpu                          # all CUDA devices, 1 GiB per device
    python -m benchmarks.multi_gpu --devices 2 --mib-per-device 2048 --item-bytes 1024 --max-ctas 2
    python -m benchmarks.multi_gpu --emulated --quick       # smoke test without a GPU (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

try:
    import pointerdomain as pd
except ImportError:  # a source checkout that was not installed: use src/ (needs the built extension there)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))
    import pointerdomain as pd

__all__ = ["Result", "main", "parse_args"]

MiB = 1 << 20
DIRECTIONS = ("H2D", "D2H")


@dataclass(frozen=True)
class Result:
    """One measured row: ``devices`` devices at once, one direction."""

    direction: str
    devices: list[str]
    bytes_per_device: int
    iters: int
    seconds: float
    gbps: float


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multi_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=0, help="devices to use (default: every CUDA device; >= 2)")
    p.add_argument("--emulated", action="store_true", help="emulated devices (a CPU smoke test, not a measurement)")
    p.add_argument("--mib-per-device", type=int, default=1024, help="bytes each device moves per transfer, MiB")
    p.add_argument("--item-bytes", type=int, default=1024, help="bytes per token per layer per K/V (bf16: even)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--iters", type=int, default=20, help="timed rounds per row")
    p.add_argument("--max-ctas", default="whole", help="SM budget per launch: a positive int or 'whole'")
    p.add_argument("--threads", action="store_true", help="one host thread per device (CUDA)")
    p.add_argument("--quick", action="store_true", help="8 MiB per device, 2 rounds (smoke test)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.mib_per_device, args.iters, args.layers = 8, 2, 4
    if args.item_bytes <= 0 or args.item_bytes % 2:
        p.error("--item-bytes must be a positive even number (bf16 items)")
    if args.max_ctas != "whole" and not (args.max_ctas.isdigit() and int(args.max_ctas) > 0):
        p.error("--max-ctas must be a positive int or 'whole'")
    return args


def _devices(args: argparse.Namespace) -> list[pd.Device]:
    kind = "emulated" if args.emulated else "cuda"
    if kind == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    else:
        from pointerdomain.devices import emulated_device_count

        have = emulated_device_count()
    want = args.devices or have
    if want < 2 or want > have:
        raise SystemExit(
            f"multi_gpu: needs at least 2 {kind} devices and at most the {have} this process sees (asked {want}); "
            + ("set POINTERDOMAIN_EMULATED_DEVICES" if kind == "emulated" else "run on a machine with two GPUs")
        )
    return [pd.validate_device(f"{kind}:{i}") for i in range(want)]


class Setup:
    """The host pool, one device pool and stream per device, and each device's slots."""

    def __init__(self, args: argparse.Namespace, devices: list[pd.Device]) -> None:
        self.devices = devices
        page_bytes = args.page_size * args.item_bytes * 2 * args.layers  # K and V
        self.pages = max(1, args.mib_per_device * MiB // page_bytes)
        dims = dict(attention="mha", num_layers=args.layers, page_size=args.page_size, num_heads=1,
                    head_dim=args.item_bytes // 2, dtype="bfloat16")
        self.dev_layout = pd.KVLayout(kind="layer_first", num_pages=self.pages, **dims)  # type: ignore[arg-type]
        self.host_layout = pd.KVLayout(kind="page_first", num_pages=self.pages * len(devices), **dims)  # type: ignore[arg-type]
        self.bytes_per_device = self.pages * page_bytes
        self.host = pd.HostKVPool(self.host_layout, devices[0])
        self.pools = {d: pd.DeviceKVPool(self.dev_layout, d) for d in devices}
        self.streams = {d: torch.cuda.Stream(device=d.torch_device) if d.type == "cuda" else None for d in devices}
        g = torch.Generator().manual_seed(0)
        ps = args.page_size
        self.slots: dict[pd.Device, tuple[torch.Tensor, torch.Tensor]] = {}
        for k, d in enumerate(devices):  # random page order on both sides; device k owns host pages [kP, (k+1)P)
            dev_pages = torch.randperm(self.pages, generator=g)
            host_pages = torch.randperm(self.pages, generator=g) + k * self.pages
            tok = torch.arange(ps)
            dev_slots = (dev_pages.view(-1, 1) * ps + tok).reshape(-1)
            host_slots = (host_pages.view(-1, 1) * ps + tok).reshape(-1)
            where = d.torch_device
            self.slots[d] = (dev_slots.to(where), host_slots.to(where))
        self.max_ctas: pd.MaxCtas = pd.WHOLE_GPU if args.max_ctas == "whole" else int(args.max_ctas)

    def launch(self, direction: str, d: pd.Device) -> None:
        pool, (dev_slots, host_slots) = self.pools[d], self.slots[d]
        stream = self.streams[d]
        kw = dict(stream=None if stream is None else stream.cuda_stream, max_ctas=self.max_ctas, backend="kernel",
                  validate_indices=False)  # no host sync per launch; the kernel still skips bad slots
        if direction == "D2H":
            self.host.backup(pool, dev_slots, host_slots, **kw)  # type: ignore[arg-type]
        else:
            self.host.load(pool, host_slots, dev_slots, **kw)  # type: ignore[arg-type]

    def wait(self) -> None:
        for s in self.streams.values():
            if s is not None:
                s.synchronize()

    def check(self, direction: str) -> None:
        """Poison the destination, run once on every device, compare every byte."""
        g = torch.Generator().manual_seed(1)

        def poison(t: torch.Tensor) -> torch.Tensor:
            noise = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
            t.view(torch.uint8).view(-1).copy_(noise.to(t.device))
            return noise

        host_noise = poison(self.host.buffer)
        for d in self.devices:
            for b in self.pools[d].buffers:
                poison(b)
        for d in self.devices:
            self.launch(direction, d)
        self.wait()
        host = self.host.buffer  # [kv, slots, layers, heads, dim]
        moved = torch.zeros(self.host_layout.num_slots, dtype=torch.bool)
        for d in self.devices:
            dev_slots, host_slots = (s.cpu() for s in self.slots[d])
            moved[host_slots] = True
            for kv in range(2):
                hk = host[kv][host_slots].view(torch.uint8)  # [n, layers, heads, item bytes]
                for layer in range(self.dev_layout.num_layers):
                    dev = self.pools[d].buffer(kv, layer).cpu()
                    if not torch.equal(hk[:, layer], dev[dev_slots].view(torch.uint8)):
                        raise SystemExit(f"multi_gpu: {direction} on {d}: kv {kv} layer {layer} differs from its source")
        if direction == "D2H":  # the host slots no device owns keep their poison
            rest = host.view(torch.uint8)[:, ~moved]
            want = host_noise.view(host.view(torch.uint8).shape)[:, ~moved]
            if not torch.equal(rest, want):
                raise SystemExit("multi_gpu: D2H wrote host slots outside the transfer")

    def time(self, direction: str, devices: list[pd.Device], iters: int, threads: bool) -> float:
        def rounds(devs: list[pd.Device]) -> Callable[[], None]:
            def run() -> None:
                for _ in range(iters):
                    for d in devs:
                        self.launch(direction, d)
            return run

        for d in devices:  # warm-up: plans, occupancy queries, first-touch
            self.launch(direction, d)
        self.wait()
        start = time.perf_counter()
        if threads and len(devices) > 1:
            workers = [threading.Thread(target=rounds([d])) for d in devices]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        else:
            rounds(devices)()
        self.wait()
        return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    devices = _devices(args)
    setup = Setup(args, devices)
    threads = args.threads or args.emulated
    print(f"multi_gpu: {len(devices)} x {devices[0].type}, {setup.bytes_per_device / MiB:.0f} MiB per device per "
          f"transfer ({args.layers} layers, {args.item_bytes} B items, {args.page_size}-token pages, random page "
          f"order), max_ctas={args.max_ctas}, {args.iters} rounds, {'a thread per device' if threads else 'one thread'}")
    results: list[Result] = []
    with setup.host:
        for direction in DIRECTIONS:
            setup.check(direction)
            for devs in ([devices[0]], devices):
                seconds = setup.time(direction, devs, args.iters, threads)
                moved = setup.bytes_per_device * len(devs) * args.iters
                results.append(Result(direction, [str(d) for d in devs], setup.bytes_per_device, args.iters, seconds,
                                      moved / seconds / 1e9))
    print(f"{'direction':<10}{'devices':>10}{'GB/s':>10}{'x one':>8}")
    for r in results:
        one = next(o for o in results if o.direction == r.direction and len(o.devices) == 1)
        print(f"{r.direction:<10}{len(r.devices):>10}{r.gbps:>10.1f}{r.gbps / one.gbps:>8.2f}")
    if args.emulated:
        print("(emulated devices: a smoke test of the multi-device path, not a bandwidth measurement)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
