"""The stateful fuzzer of the engine-facing surface, run in a child process by
tests/transfer/test_fuzz_stateful.py next to the KV machine (tests/transfer/fuzz_machine.py).

Random sequences of calls in the engines' own call shapes and through the transfer-engine
adapters, on the emulated device, good and bad input mixed:

* ``pointerdomain.compat.sgl_kernel``: ``transfer_kv_per_layer`` (tensors) and
  ``transfer_kv_all_layer`` (raw ``uint64`` tables of ``data_ptr()`` values in device memory),
  device <-> registered host and device <-> device;
* ``pointerdomain.compat.vllm``: ``swap_blocks`` (block tensors and a mapping) and
  ``swap_blocks_batch`` (raw address runs);
* ``pointerdomain.compat.lmcache``: ``multi_layer_kv_transfer`` (memory object <-> per-layer
  paged caches, the vLLM flash layout, padding slots);
* ``pointerdomain.adapters.mooncake.HostTransferEngine`` and
  ``pointerdomain.adapters.nixl.HostNixlAgent`` over loop-back engines that copy the raw
  addresses they are handed (``ctypes.memmove``), so a wrong address shows in the bytes.

* graph capture on the emulated device (``pointerdomain.testing.EmulatedGraph``): a host
  pool's load or backup captured, the indices rewritten in place, replayed; closing the
  captured pool, replaying a reset graph, capturing twice, out-of-range slots at capture;
* the layer pipeline (``HostKVPool.load_layers``, ``pointerdomain.load_layers``) and its
  per-layer waits.

After each call: a call either raised a typed ``PointerDomainError`` and no tracked byte
changed (every buffer is compared with its snapshot), or its destination equals the
plain-torch reference and every other buffer is unchanged. A fault the wrapper must refuse
that it accepts is a failure.

Usage: ``python -m tests.transfer.fuzz_surface --profile ci --summary out.json``.
"""

from __future__ import annotations

import ctypes
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters.mooncake import HostTransferEngine
from pointerdomain.adapters.nixl import HostNixlAgent, dram_desc
from pointerdomain.compat import lmcache, sgl_kernel, vllm
from pointerdomain.testing import EmulatedGraph
from tests.reference import reference_transfer
from tests.transfer import fuzz_runner

DEV = pd.Device("emulated", 0)
OTHER = pd.Device("emulated", 1)
#: per-layer K / V buffers: SLOTS items of ITEM bytes (float32 [SLOTS, 4])
LAYERS, SLOTS, ITEM = 2, 8, 16
#: vLLM blocks: BLOCKS rows of BLOCK bytes
BLOCKS, BLOCK = 8, 64
#: LMCache: flash layout [2, NB, BS, NH, HS] bf16 per layer; T tokens in the memory object
NB, BS, NH, HS, T = 2, 4, 1, 8, 4
#: pools for the adapters: page_first, PAGES pages
POOL = pd.KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=2, num_heads=1, head_dim=4, dtype="float32")

settings.register_profile("ci", max_examples=3200, stateful_step_count=6, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("dev", max_examples=300, stateful_step_count=6, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=20000, stateful_step_count=12, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))

STATS: dict[str, int] = {"sequences": 0, "steps": 0, "calls_ok": 0, "calls_refused": 0}
CALLS = ("sgl_per_layer", "sgl_all_layer", "vllm_swap_blocks", "vllm_swap_blocks_batch", "lmcache_multi_layer",
         "mooncake", "nixl", "graph_capture", "layer_pipeline")
STATS.update({f"{name}_ok": 0 for name in CALLS})
STATS.update({f"{name}_refused": 0 for name in CALLS})


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def fill(t: torch.Tensor, gen: torch.Generator) -> None:
    flat = u8(t)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def host(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, pd.RegisteredHostMemory]:
    """A registered host tensor (its own registration) and its owner."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    mem = pd.alloc_registered(nbytes, DEV)
    return mem.tensor[:nbytes].view(dtype).view(shape), mem


def device_table(ptrs: list[int], dtype: torch.dtype = torch.uint64) -> torch.Tensor:
    """A raw pointer table in emulated device memory (where sglang keeps its tables)."""
    table = pd.device_empty((len(ptrs),), dtype, DEV)
    table.copy_(torch.tensor(ptrs, dtype=torch.uint64).view(dtype) if dtype != torch.uint64
                else torch.tensor(ptrs, dtype=torch.uint64))
    return table


class Loopback:
    """A transfer engine / NIXL agent stand-in whose peers live in this process: it copies
    the raw addresses it is handed (memmove), records every call, and fails on request
    (``fail``: the next transfer reports an error without copying)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()  # calls per method (a count: the engine lives across sequences)
        self.fail = False
        self._xfers: dict[int, tuple[str, list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}

    def _copy(self, dst: int, src: int, n: int) -> None:
        ctypes.memmove(dst, src, n)

    # Mooncake's TransferEngine
    def register_memory(self, *args: Any) -> Any:
        self.calls["register_memory"] += 1
        return ("handle", self.calls.total()) if len(args) >= 2 and isinstance(args[0], list) else 0

    def unregister_memory(self, addr: int) -> int:
        self.calls["unregister_memory"] += 1
        return 0

    def transfer_sync_read(self, target: str, buffer: int, peer: int, length: int) -> int:
        self.calls["transfer_sync_read"] += 1
        if self.fail:
            return -1
        self._copy(buffer, peer, length)
        return 0

    def transfer_sync_write(self, target: str, buffer: int, peer: int, length: int) -> int:
        self.calls["transfer_sync_write"] += 1
        if self.fail:
            return -1
        self._copy(peer, buffer, length)
        return 0

    def batch_transfer_sync_read(self, target: str, buffers: list[int], peers: list[int], lengths: list[int]) -> int:
        self.calls["batch_transfer_sync_read"] += 1
        if self.fail:
            return -1
        for b, p, n in zip(buffers, peers, lengths):
            self._copy(b, p, n)
        return 0

    def batch_transfer_sync_write(self, target: str, buffers: list[int], peers: list[int], lengths: list[int]) -> int:
        self.calls["batch_transfer_sync_write"] += 1
        if self.fail:
            return -1
        for b, p, n in zip(buffers, peers, lengths):
            self._copy(p, b, n)
        return 0

    # NIXL's nixl_agent
    def deregister_memory(self, handle: Any) -> None:
        self.calls["deregister_memory"] += 1

    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str) -> list[tuple[int, int, int]]:
        return list(descs)

    def initialize_xfer(self, op: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
                        peer: str, notif: bytes, backends: list[str]) -> int:
        handle = len(self._xfers) + 1
        self._xfers[handle] = (op, local, remote)
        return handle

    def transfer(self, handle: int) -> str:
        self.calls["transfer"] += 1
        if self.fail:
            return "ERR"
        op, local, remote = self._xfers[handle]
        for (l_addr, n, _), (r_addr, _, _) in zip(local, remote):
            if op == "READ":
                self._copy(l_addr, r_addr, n)
            else:
                self._copy(r_addr, l_addr, n)
        return "DONE"

    def check_xfer_state(self, handle: int) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: int) -> None:
        self._xfers.pop(handle, None)


def transfers(engine: Loopback) -> int:
    """Transfer calls that reached ``engine`` so far (registrations not counted)."""
    return sum(n for name, n in engine.calls.items() if "transfer" in name)


@dataclass
class World:
    """The buffers every sequence works on (allocated once; refilled per sequence)."""

    dev_k: list[torch.Tensor]
    dev_v: list[torch.Tensor]
    dev2_k: list[torch.Tensor]
    dev2_v: list[torch.Tensor]
    host_k: list[torch.Tensor]
    host_v: list[torch.Tensor]
    dev_blocks: torch.Tensor
    dev2_blocks: torch.Tensor
    host_blocks: torch.Tensor
    caches: list[torch.Tensor]
    mem_dev: torch.Tensor
    mem_host: torch.Tensor
    local: pd.HostKVPool
    remote: pd.HostKVPool
    stray: pd.HostKVPool  # a pool never registered with the engines
    kv_host: pd.HostKVPool  # graph capture and the layer pipeline: host pool <-> device pool
    kv_dev: pd.DeviceKVPool
    owners: list[pd.RegisteredHostMemory]
    engine: HostTransferEngine
    moon: Loopback
    agent: HostNixlAgent
    nix: Loopback

    def tracked(self) -> dict[str, torch.Tensor]:
        named: dict[str, torch.Tensor] = {}
        for side in ("dev_k", "dev_v", "dev2_k", "dev2_v", "host_k", "host_v", "caches"):
            for i, t in enumerate(getattr(self, side)):
                named[f"{side}{i}"] = t
        for name in ("dev_blocks", "dev2_blocks", "host_blocks", "mem_dev", "mem_host"):
            named[name] = getattr(self, name)
        for name in ("local", "remote", "stray", "kv_host"):
            named[name] = getattr(self, name).buffer
        for i, t in enumerate(self.kv_dev.buffers):
            named[f"kv_dev{i}"] = t
        return named


_world: World | None = None


def world() -> World:
    global _world
    if _world is None:
        owners: list[pd.RegisteredHostMemory] = []

        def h(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            t, mem = host(shape, dtype)
            owners.append(mem)
            return t

        def d(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return pd.device_empty(shape, dtype, DEV)

        moon, nix = Loopback(), Loopback()
        local, remote, stray = (pd.HostKVPool(POOL, DEV) for _ in range(3))
        engine = HostTransferEngine(moon, "127.0.0.1")
        engine.batch_register_memory(local.get_contiguous_buf_infos())
        agent = HostNixlAgent("fuzz", agent=nix)  # type: ignore[arg-type]
        agent.register_pool(local)
        _world = World(
            dev_k=[d((SLOTS, 4)) for _ in range(LAYERS)], dev_v=[d((SLOTS, 4)) for _ in range(LAYERS)],
            dev2_k=[d((SLOTS, 4)) for _ in range(LAYERS)], dev2_v=[d((SLOTS, 4)) for _ in range(LAYERS)],
            host_k=[h((SLOTS, 4)) for _ in range(LAYERS)], host_v=[h((SLOTS, 4)) for _ in range(LAYERS)],
            dev_blocks=d((BLOCKS, BLOCK), torch.uint8), dev2_blocks=d((BLOCKS, BLOCK), torch.uint8),
            host_blocks=h((BLOCKS, BLOCK), torch.uint8),
            caches=[d((2, NB, BS, NH, HS), torch.bfloat16) for _ in range(LAYERS)],
            mem_dev=d((2, LAYERS, T, NH * HS), torch.bfloat16), mem_host=h((2, LAYERS, T, NH * HS), torch.bfloat16),
            local=local, remote=remote, stray=stray, kv_host=pd.HostKVPool(POOL, DEV),
            kv_dev=pd.DeviceKVPool(POOL.replace(kind="layer_first"), DEV), owners=owners, engine=engine, moon=moon, agent=agent, nix=nix,
        )
    return _world


class SurfaceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        STATS["sequences"] += 1
        self.w = world()
        self.w.moon.fail = self.w.nix.fail = False
        gen = torch.Generator().manual_seed(STATS["sequences"])
        for t in self.w.tracked().values():
            fill(t, gen)
        self.snap = {k: u8(t).clone() for k, t in self.w.tracked().items()}
        self.keep: list[pd.RegisteredHostMemory] = []

    def closed_host(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A host tensor whose registration was closed; the owner is kept alive until the
        call is checked (a collected owner leaves plain pageable memory, which some call
        shapes take)."""
        t, mem = host(shape, dtype)
        mem.close()
        self.keep.append(mem)
        return t

    # helpers -----------------------------------------------------------------------
    def _call(self, name: str, fault: str, call: Any, expect: dict[str, torch.Tensor], accepted: bool = False) -> bool:
        """Run ``call``; a refusal must leave every tracked byte as it was; a success must
        give ``expect`` (tracked name -> its bytes after) and leave the rest. ``accepted``:
        the fault is one the call may take (e.g. an out-of-range slot that is skipped)."""
        try:
            try:
                call()
            finally:
                self.keep.clear()
        except errors.PointerDomainError:
            STATS["calls_refused"] += 1
            STATS[f"{name}_refused"] += 1
            for key, t in self.w.tracked().items():
                assert torch.equal(u8(t), self.snap[key]), f"{name} ({fault}): refused, but {key} changed"
            return False
        STATS["calls_ok"] += 1
        STATS[f"{name}_ok"] += 1
        assert fault == "none" or accepted, f"{name}: accepted the fault {fault!r}"
        for key, t in self.w.tracked().items():
            want = expect.get(key, self.snap[key])
            assert torch.equal(u8(t), want), f"{name} ({fault}): {key} differs from the torch reference"
            self.snap[key] = u8(t).clone()
        return True

    @staticmethod
    def _slots(data: st.DataObject, n: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = data.draw(st.lists(st.integers(0, count - 1), min_size=n, max_size=n))
        d = data.draw(st.permutations(range(count)))[:n]
        return torch.tensor(s, dtype=torch.int64), torch.tensor(d, dtype=torch.int64)

    def _sides(self, direction: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                                              list[torch.Tensor], str, str]:
        w = self.w
        if direction == "d2h":
            return w.dev_k, w.dev_v, w.host_k, w.host_v, "dev", "host"
        if direction == "h2d":
            return w.host_k, w.host_v, w.dev_k, w.dev_v, "host", "dev"
        return w.dev_k, w.dev_v, w.dev2_k, w.dev2_v, "dev", "dev2"

    # sglang ------------------------------------------------------------------------
    @rule(data=st.data(), n=st.integers(0, SLOTS), direction=st.sampled_from(["d2h", "h2d", "d2d"]),
          layer=st.integers(0, LAYERS - 1),
          fault=st.sampled_from(["none"] * 5 + ["out_of_range", "negative", "int32", "length", "item_size",
                                                "strided", "closed", "other_device", "k_v_sizes"]))
    def sgl_per_layer(self, data: st.DataObject, n: int, direction: str, layer: int, fault: str) -> None:
        sk, sv, dk, dv, s_name, d_name = self._sides(direction)
        src_k, src_v, dst_k, dst_v = sk[layer], sv[layer], dk[layer], dv[layer]
        s_idx, d_idx = self._slots(data, n, SLOTS)
        item = ITEM
        if fault == "out_of_range":
            d_idx = torch.cat([d_idx, torch.tensor([SLOTS + data.draw(st.integers(0, 4))])])
            s_idx = torch.cat([s_idx, torch.tensor([0])])
        elif fault == "negative":
            s_idx = torch.cat([s_idx, torch.tensor([-1])])
            d_idx = torch.cat([d_idx, torch.tensor([0])])
        elif fault == "int32":
            s_idx = s_idx.to(torch.int32)
        elif fault == "length":
            d_idx = torch.cat([d_idx, torch.tensor([0])])
        elif fault == "item_size":
            item = data.draw(st.sampled_from([ITEM + 8, ITEM - 4, 0, -16]))
        elif fault == "strided":
            src_k = src_k[:, :2]
        elif fault == "closed":
            src_k = src_v = self.closed_host((SLOTS, 4))
            s_name = "closed"
        elif fault == "other_device":
            moved = pd.device_empty((max(len(s_idx), 1),), torch.int64, OTHER)
            moved[: len(s_idx)].copy_(s_idx)
            s_idx = moved[: len(s_idx)]
        elif fault == "k_v_sizes":
            dst_v = dst_v[: SLOTS // 2]
        expect: dict[str, torch.Tensor] = {}
        if fault == "none":
            for kv, (src, dst) in enumerate(((src_k, dst_k), (src_v, dst_v))):
                want = u8(dst).clone().view(SLOTS, ITEM)
                want[d_idx] = u8(src).view(SLOTS, ITEM)[s_idx]
                expect[f"{d_name}_{'kv'[kv]}{layer}"] = want.reshape(-1)
        accepted = fault == "other_device" and n == 0  # no index to read: nothing on the other device is used
        self._call("sgl_per_layer", fault, lambda: sgl_kernel.transfer_kv_per_layer(
            src_k, dst_k, src_v, dst_v, s_idx, d_idx, item), expect, accepted)

    @rule(data=st.data(), n=st.integers(0, SLOTS), direction=st.sampled_from(["d2h", "h2d", "d2d"]),
          fault=st.sampled_from(["none"] * 5 + ["unknown_address", "short_reach", "int32_table", "layer_count",
                                                "closed_entry", "cpu_tables", "out_of_range"]))
    def sgl_all_layer(self, data: st.DataObject, n: int, direction: str, fault: str) -> None:
        sk, sv, dk, dv, s_name, d_name = self._sides(direction)
        s_idx, d_idx = self._slots(data, n, SLOTS)
        ptrs = [[t.data_ptr() for t in side] for side in (sk, dk, sv, dv)]
        layers = LAYERS
        keep: list[torch.Tensor] = []
        if fault == "unknown_address":
            ptrs[data.draw(st.integers(0, 3))][data.draw(st.integers(0, LAYERS - 1))] = 12345 * 4096
        elif fault == "short_reach":
            # dst K of layer 0 is a buffer of half the slots: the indices reach past it
            short = pd.device_empty((SLOTS // 2, 4), torch.float32, DEV)
            keep.append(short)
            ptrs[1][0] = short.data_ptr()
            if n == 0:
                s_idx, d_idx = torch.tensor([0]), torch.tensor([SLOTS - 1])
            elif SLOTS - 1 not in d_idx.tolist():
                d_idx[0] = SLOTS - 1
        elif fault == "layer_count":
            layers = LAYERS + 1
        elif fault == "closed_entry":
            t = self.closed_host((SLOTS, 4))
            keep.append(t)
            ptrs[0][0] = t.data_ptr()
        elif fault == "out_of_range":
            d_idx = torch.cat([d_idx, torch.tensor([SLOTS + data.draw(st.integers(0, 3))])])
            s_idx = torch.cat([s_idx, torch.tensor([0])])
        dtype = torch.int32 if fault == "int32_table" else torch.uint64
        if fault == "cpu_tables" and direction != "d2d":
            tables = [torch.tensor(p, dtype=torch.uint64) for p in ptrs]
        elif fault == "int32_table":
            tables = [device_table(p) for p in ptrs]
            tables[0] = pd.device_empty((LAYERS,), torch.int32, DEV)
            tables[0].copy_(torch.tensor([x & 0x7FFFFFFF for x in ptrs[0]], dtype=torch.int32))
        else:
            tables = [device_table(p) for p in ptrs]
        accepted = fault == "cpu_tables"  # host tables beside device buffers are read where they are
        expect: dict[str, torch.Tensor] = {}
        if fault in ("none", "cpu_tables"):
            for kv, (src_side, dst_side) in enumerate(((sk, dk), (sv, dv))):
                for layer in range(LAYERS):
                    want = u8(dst_side[layer]).clone().view(SLOTS, ITEM)
                    want[d_idx] = u8(src_side[layer]).view(SLOTS, ITEM)[s_idx]
                    expect[f"{d_name}_{'kv'[kv]}{layer}"] = want.reshape(-1)
        self._call("sgl_all_layer", fault, lambda: sgl_kernel.transfer_kv_all_layer(
            tables[0], tables[1], tables[2], tables[3], s_idx, d_idx, ITEM, layers), expect, accepted)

    # vLLM --------------------------------------------------------------------------
    @rule(data=st.data(), n=st.integers(0, BLOCKS), direction=st.sampled_from(["d2h", "h2d", "d2d"]),
          fault=st.sampled_from(["none"] * 5 + ["out_of_range", "negative", "duplicate_dst", "int32", "shape",
                                                "block_size", "both_host", "closed", "not_a_tensor"]))
    def vllm_swap_blocks(self, data: st.DataObject, n: int, direction: str, fault: str) -> None:
        w = self.w
        src, dst, d_name = {"d2h": (w.dev_blocks, w.host_blocks, "host_blocks"),
                            "h2d": (w.host_blocks, w.dev_blocks, "dev_blocks"),
                            "d2d": (w.dev_blocks, w.dev2_blocks, "dev2_blocks")}[direction]
        s_idx, d_idx = self._slots(data, n, BLOCKS)
        mapping: Any = torch.stack([s_idx, d_idx], dim=1) if n else torch.zeros((0, 2), dtype=torch.int64)
        size = BLOCK
        if fault == "out_of_range":
            mapping = torch.cat([mapping, torch.tensor([[0, BLOCKS + data.draw(st.integers(0, 3))]])])
        elif fault == "negative":
            mapping = torch.cat([mapping, torch.tensor([[-1, 0]])])
        elif fault == "duplicate_dst":
            mapping = torch.tensor([[0, 1], [2, 1]]) if n < 2 else torch.cat([mapping, mapping[:1]])
        elif fault == "int32":
            mapping = mapping.to(torch.int32)
        elif fault == "shape":
            mapping = mapping.reshape(-1)
            if not n:
                mapping = torch.zeros(3, dtype=torch.int64)
        elif fault == "block_size":
            size = data.draw(st.sampled_from([BLOCK // 2, BLOCK + 8, 0, -BLOCK]))
        elif fault == "both_host":
            src, dst = w.host_blocks, self.closed_host((BLOCKS, BLOCK), torch.uint8)
            dst = w.host_blocks if data.draw(st.booleans()) else dst
        elif fault == "closed":  # the host side (d2d: the source) is memory whose registration was closed
            closed = self.closed_host((BLOCKS, BLOCK), torch.uint8)
            src, dst = (src, closed) if direction == "d2h" else (closed, dst)
        elif fault == "not_a_tensor":
            mapping = mapping.tolist()
        expect: dict[str, torch.Tensor] = {}
        if fault == "none":
            want = u8(dst).clone().view(BLOCKS, BLOCK)
            want[d_idx] = u8(src).view(BLOCKS, BLOCK)[s_idx]
            expect[d_name] = want.reshape(-1)
        self._call("vllm_swap_blocks", fault, lambda: vllm.swap_blocks(src, dst, size, mapping), expect)

    @rule(data=st.data(), direction=st.sampled_from(["d2h", "h2d", "d2d"]),
          runs=st.lists(st.tuples(st.integers(0, BLOCKS * BLOCK // 8 - 1), st.integers(1, 4)), min_size=0, max_size=6),
          fault=st.sampled_from(["none"] * 5 + ["unknown_address", "past_the_end", "overlap_dst", "zero_size",
                                                "int32", "lengths", "pageable", "not_bool"]))
    def vllm_swap_blocks_batch(self, data: st.DataObject, direction: str, runs: list[tuple[int, int]],
                               fault: str) -> None:
        w = self.w
        src, dst, d_name = {"d2h": (w.dev_blocks, w.host_blocks, "host_blocks"),
                            "h2d": (w.host_blocks, w.dev_blocks, "dev_blocks"),
                            "d2d": (w.dev_blocks, w.dev2_blocks, "dev2_blocks")}[direction]
        total = BLOCKS * BLOCK
        # destination runs: disjoint 8-byte-aligned pieces, laid one after another from a random start
        lay, at = [], data.draw(st.integers(0, 16)) * 8
        for start, words in runs:
            n = words * 8
            if at + n > total:
                break
            src_off = min(start * 8, total - n)
            lay.append((src_off, at, n))
            at += n + data.draw(st.integers(0, 2)) * 8
        s_ptrs = [src.data_ptr() + s for s, _, _ in lay]
        d_ptrs = [dst.data_ptr() + d for _, d, _ in lay]
        sizes = [n for _, _, n in lay]
        flag: Any = False
        keep: list[torch.Tensor] = []
        if fault == "unknown_address":
            s_ptrs.append(12345 * 4096); d_ptrs.append(dst.data_ptr()); sizes.append(8)
        elif fault == "past_the_end":
            s_ptrs.append(src.data_ptr() + total - 8); d_ptrs.append(dst.data_ptr()); sizes.append(16)
        elif fault == "overlap_dst":
            s_ptrs += [src.data_ptr(), src.data_ptr() + 64]; d_ptrs += [dst.data_ptr(), dst.data_ptr() + 8]
            sizes += [16, 16]
        elif fault == "zero_size":
            s_ptrs.append(src.data_ptr()); d_ptrs.append(dst.data_ptr()); sizes.append(0)
        elif fault == "pageable":
            plain = torch.zeros(64, dtype=torch.uint8)
            keep.append(plain)
            # pageable host memory has no device alias: refused (its destination is device memory)
            s_ptrs.append(plain.data_ptr()); d_ptrs.append(w.dev2_blocks.data_ptr()); sizes.append(8)
        elif fault == "not_bool":
            flag = 1
        s_t = torch.tensor(s_ptrs, dtype=torch.int64)
        if fault == "int32":
            s_t = s_t.to(torch.int32)
        d_t, z_t = torch.tensor(d_ptrs, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64)
        if fault == "lengths":
            z_t = torch.cat([z_t, torch.tensor([8])])
        expect: dict[str, torch.Tensor] = {}
        if fault == "none":
            want = u8(dst).clone()
            for s, d, n in lay:
                want[d : d + n] = u8(src)[s : s + n]
            expect[d_name] = want
        self._call("vllm_swap_blocks_batch", fault, lambda: vllm.swap_blocks_batch(s_t, d_t, z_t, flag), expect)

    # LMCache -----------------------------------------------------------------------
    @rule(data=st.data(), direction=st.sampled_from([0, 1]), where=st.sampled_from(["device", "host"]),
          pads=st.integers(0, T),
          fault=st.sampled_from(["none"] * 5 + ["out_of_capacity", "int32_slots", "unknown_ptr", "host_ptr",
                                                "pageable_object", "closed_object", "short_slots", "bad_direction",
                                                "bad_format"]))
    def lmcache_multi_layer(self, data: st.DataObject, direction: int, where: str, pads: int, fault: str) -> None:
        w = self.w
        mem, m_name = (w.mem_dev, "mem_dev") if where == "device" else (w.mem_host, "mem_host")
        slots = data.draw(st.permutations(range(NB * BS)))[:T]
        for i in data.draw(st.permutations(range(T)))[:pads]:
            slots[i] = -1
        slot_t = torch.tensor(slots, dtype=torch.int64)
        ptrs = [c.data_ptr() for c in w.caches]
        fmt, dirn = int(lmcache.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS), direction
        if fault == "out_of_capacity":
            slot_t[data.draw(st.integers(0, T - 1))] = NB * BS + data.draw(st.integers(0, 3))
        elif fault == "int32_slots":
            slot_t = slot_t.to(torch.int32)
        elif fault == "unknown_ptr":
            ptrs[data.draw(st.integers(0, LAYERS - 1))] = 12345 * 4096
        elif fault == "host_ptr":
            ptrs[0] = w.host_k[0].data_ptr()
        elif fault == "pageable_object":
            mem = torch.zeros_like(w.mem_host)
        elif fault == "closed_object":
            mem = self.closed_host(tuple(w.mem_host.shape), torch.bfloat16)
        elif fault == "short_slots":
            slot_t = slot_t[:-1]
        elif fault == "bad_direction":
            dirn = data.draw(st.sampled_from([2, -1]))
        elif fault == "bad_format":
            fmt = data.draw(st.sampled_from([99, -1]))
        table = torch.tensor(ptrs, dtype=torch.int64)
        expect: dict[str, torch.Tensor] = {}
        if fault == "none":
            obj = u8(mem).clone().view(2, LAYERS, T, -1)
            caches = [u8(c).clone().view(2, NB * BS, -1) for c in w.caches]
            for layer in range(LAYERS):
                for t, s in enumerate(slots):
                    if s < 0:
                        continue
                    if direction == 1:  # D2H: caches -> memory object
                        obj[:, layer, t] = caches[layer][:, s]
                    else:
                        caches[layer][:, s] = obj[:, layer, t]
            if direction == 1:
                expect[m_name] = obj.reshape(-1)
            else:
                expect.update({f"caches{i}": c.reshape(-1) for i, c in enumerate(caches)})
        self._call("lmcache_multi_layer", fault, lambda: lmcache.multi_layer_kv_transfer(
            mem, table, slot_t, DEV, NB * BS, dirn, fmt, BS, HS), expect)

    # transfer-engine adapters -----------------------------------------------------------
    def _pages(self, data: st.DataObject) -> tuple[list[int], list[int]]:
        n = data.draw(st.integers(1, POOL.num_pages))
        return (data.draw(st.permutations(range(POOL.num_pages)))[:n],
                data.draw(st.lists(st.integers(0, POOL.num_pages - 1), min_size=n, max_size=n)))

    def _page_expect(self, dst: pd.HostKVPool, d_name: str, src: pd.HostKVPool, d_pages: list[int],
                     s_pages: list[int]) -> dict[str, torch.Tensor]:
        want = u8(dst.buffer).clone().view(POOL.num_kv, POOL.num_pages, -1)
        want[:, d_pages] = u8(src.buffer).view(POOL.num_kv, POOL.num_pages, -1)[:, s_pages]
        return {d_name: want.reshape(-1)}

    @rule(data=st.data(), op=st.sampled_from(["read", "write", "read_one", "write_one"]),
          fault=st.sampled_from(["none"] * 5 + ["device_alias", "plain_int", "unregistered", "lengths", "sizes",
                                                "engine_fails", "closed", "bare_va"]))
    def mooncake(self, data: st.DataObject, op: str, fault: str) -> None:
        w = self.w
        local_pages, remote_pages = self._pages(data)
        if op.endswith("_one") and fault == "lengths":
            fault = "none"  # one block per call: no lists whose lengths could differ
        local_pool = w.stray if fault == "unregistered" else w.local
        local: list[Any] = local_pool.get_page_buffer_meta(local_pages)
        remote: list[Any] = w.remote.get_page_buffer_meta(remote_pages)
        keep: list[Any] = []
        if fault == "device_alias":
            local[0] = w.local.kernel_table[0]
        elif fault == "plain_int":
            (local if data.draw(st.booleans()) else remote)[0] = local[0].address.value
        elif fault == "lengths":
            remote = remote[:-1] if len(remote) > 1 else remote + remote
        elif fault == "sizes":
            first = remote[0]
            remote[0] = pd.BufferInfo(address=first.address, nbytes=first.nbytes // 2, item_bytes=first.item_bytes)
        elif fault == "closed":
            pool = pd.HostKVPool(POOL, DEV)
            w.engine.register_memory(pool.get_contiguous_buf_infos()[0])
            local = pool.get_page_buffer_meta(local_pages)
            keep.append(pool)
            pool.close()
        elif fault == "bare_va":
            local[0] = local[0].address
        w.moon.fail = fault == "engine_fails"
        expect: dict[str, torch.Tensor] = {}
        if fault == "none":
            if op.startswith("read"):
                pages = local_pages[:1] if op == "read_one" else local_pages
                expect = self._page_expect(w.local, "local", w.remote, pages, remote_pages[: len(pages)])
            else:
                pages = remote_pages[:1] if op == "write_one" else remote_pages
                # a page written twice takes the later block: the engine copies in list order
                want = u8(w.remote.buffer).clone().view(POOL.num_kv, POOL.num_pages, -1)
                for lp, rp in zip(local_pages[: len(pages)], pages):
                    want[:, rp] = u8(w.local.buffer).view(POOL.num_kv, POOL.num_pages, -1)[:, lp]
                expect = {"remote": want.reshape(-1)}
        engine = w.engine

        def call() -> None:
            try:
                if op == "read":
                    engine.batch_transfer_sync_read("peer", local, remote)
                elif op == "write":
                    engine.batch_transfer_sync_write("peer", local, remote)
                else:  # one block per kv half of the first page: the single-block calls
                    for lb, rb in zip(local[:2], remote[:2]):
                        fn = engine.transfer_sync_read if op == "read_one" else engine.transfer_sync_write
                        fn("peer", lb, rb)
            finally:
                if fault == "closed":
                    engine.unregister_memory(keep[0].memory.host_va)
        moved = transfers(w.moon)
        if not self._call("mooncake", fault, call, expect) and fault != "engine_fails":
            assert transfers(w.moon) == moved, f"mooncake ({fault}): refused, but a transfer reached the engine"
        w.moon.fail = False

    @rule(data=st.data(), op=st.sampled_from(["READ", "WRITE"]),
          fault=st.sampled_from(["none"] * 5 + ["device_alias", "unregistered", "sizes", "lengths", "agent_fails",
                                                "bad_op", "empty", "closed"]))
    def nixl(self, data: st.DataObject, op: str, fault: str) -> None:
        w = self.w
        local_pages, remote_pages = self._pages(data)
        local_pool = w.stray if fault == "unregistered" else w.local
        local_meta: list[Any] = local_pool.get_page_buffer_meta(local_pages)
        remote_meta: list[Any] = w.remote.get_page_buffer_meta(remote_pages)
        kind: str = op
        keep: list[Any] = []
        if fault == "device_alias":
            local_meta[0] = w.local.kernel_table[0]
        elif fault == "sizes":
            first = remote_meta[0]
            remote_meta[0] = pd.BufferInfo(address=first.address, nbytes=first.nbytes // 2, item_bytes=first.item_bytes)
        elif fault == "lengths":
            remote_meta = remote_meta[:-1]
        elif fault == "bad_op":
            kind = data.draw(st.sampled_from(["read", "COPY", ""]))
        elif fault == "empty":
            local_meta, remote_meta = [], []
        elif fault == "closed":
            pool = pd.HostKVPool(POOL, DEV)
            w.agent.register_pool(pool)
            local_meta = pool.get_page_buffer_meta(local_pages)
            keep.append(pool)
            pool.close()  # its NIXL registration goes first (register_pool's close hook)
        w.nix.fail = fault == "agent_fails"
        expect: dict[str, torch.Tensor] = {}
        if fault == "none":
            if op == "READ":
                expect = self._page_expect(w.local, "local", w.remote, local_pages, remote_pages)
            else:
                want = u8(w.remote.buffer).clone().view(POOL.num_kv, POOL.num_pages, -1)
                for lp, rp in zip(local_pages, remote_pages):
                    want[:, rp] = u8(w.local.buffer).view(POOL.num_kv, POOL.num_pages, -1)[:, lp]
                expect = {"remote": want.reshape(-1)}

        def call() -> None:
            w.agent.transfer(kind, [dram_desc(b) for b in local_meta],  # type: ignore[arg-type]
                             [dram_desc(b) for b in remote_meta], "peer")
        moved = transfers(w.nix)
        if not self._call("nixl", fault, call, expect) and fault != "agent_fails":
            assert transfers(w.nix) == moved, f"nixl ({fault}): refused, but a transfer reached the agent"
        w.nix.fail = False

    # graph capture (the emulated stand-in) and the layer pipeline ------------------------
    def _kv_expect(self, load: bool, s_idx: torch.Tensor, d_idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a host pool load (H2D) or backup (D2H) of every layer leaves, from the torch model."""
        w = self.w
        dev_bytes = torch.cat([u8(b) for b in w.kv_dev.buffers])
        if load:
            want = reference_transfer(u8(w.kv_host.buffer), POOL, dev_bytes, w.kv_dev.layout, s_idx, d_idx)
            per = want.numel() // len(w.kv_dev.buffers)
            return {f"kv_dev{i}": want[i * per : (i + 1) * per] for i in range(len(w.kv_dev.buffers))}
        want = reference_transfer(dev_bytes, w.kv_dev.layout, u8(w.kv_host.buffer), POOL, s_idx, d_idx)
        return {"kv_host": want}

    @rule(data=st.data(), load=st.booleans(), n=st.integers(0, POOL.num_slots),
          fault=st.sampled_from(["none"] * 5 + ["close_under_graph", "replay_after_reset", "capture_twice",
                                                "capture_other_type", "out_of_range_at_capture"]))
    def graph_capture(self, data: st.DataObject, load: bool, n: int, fault: str) -> None:
        """Capture a pool load or backup into an EmulatedGraph: nothing runs at capture; a
        replay copies with the index values at replay time (rewritten in place after
        capture); memory the graph captured refuses to close; a reset graph refuses to
        replay; a second capture or a capture of a non-emulated device is refused."""
        w = self.w
        if fault == "close_under_graph" and n == 0:
            n = 1  # a capture of no slots launches nothing and holds nothing: the close would be right
        s_idx, d_idx = self._slots(data, n, POOL.num_slots)
        graph = EmulatedGraph("fuzz step")
        op = w.kv_host.load if load else w.kv_host.backup
        if fault == "out_of_range_at_capture":
            d_idx = torch.cat([d_idx, torch.tensor([POOL.num_slots + 1])])
            s_idx = torch.cat([s_idx, torch.tensor([0])])
        if fault == "capture_other_type":
            self._call("graph_capture", fault, lambda: graph.capture("cuda:0").__enter__(), {})
            return
        try:
            def capture() -> None:
                with graph.capture(DEV):
                    op(w.kv_dev, s_idx, d_idx)
            # a capture may take an out-of-range slot: under a graph the indices are read at replay
            if not self._call("graph_capture", fault, capture, {}, accepted=True):
                return  # refused at capture: nothing recorded, nothing written (checked)
            if fault == "out_of_range_at_capture":  # replayed as they are: refused, or the slot is skipped
                keep = d_idx < POOL.num_slots
                if self._call("graph_capture", fault, graph.replay, self._kv_expect(load, s_idx[keep], d_idx[keep]),
                              accepted=True):
                    # a replay reads nothing back (as on CUDA): the skipped slot is reported by check_errors
                    try:
                        pd.check_errors(DEV)
                    except errors.IndexValidationError:
                        return
                    raise AssertionError("a replay skipped an out-of-range slot and check_errors reported nothing")
                return
            if fault == "capture_twice":
                self._call("graph_capture", fault, lambda: graph.capture(DEV).__enter__(), {})
            if fault == "close_under_graph":
                self._call("graph_capture", fault, lambda: w.kv_host.close(timeout=0), {})
                assert not w.kv_host.memory.closed, "a pool a live graph captured was closed"
            # rewrite the indices in place (a replay reads them then), in range
            s_idx.copy_(torch.tensor(data.draw(st.lists(st.integers(0, POOL.num_slots - 1), min_size=n, max_size=n)),
                                     dtype=torch.int64))
            d_idx.copy_(torch.tensor(data.draw(st.permutations(range(POOL.num_slots)))[:n], dtype=torch.int64))
            if fault == "replay_after_reset":
                graph.reset()
                self._call("graph_capture", fault, graph.replay, {})
                return
            self._call("graph_capture", "none", graph.replay, self._kv_expect(load, s_idx, d_idx))
        finally:
            graph.reset()

    @rule(data=st.data(), n=st.integers(0, POOL.num_slots), how=st.sampled_from(["pool", "tables"]),
          backend=st.sampled_from(["auto", "kernel", "copy_engine"]),
          fault=st.sampled_from(["none"] * 5 + ["out_of_range", "int32", "staged", "bad_stream", "layout",
                                                "wait_out_of_range", "closed"]))
    def layer_pipeline(self, data: st.DataObject, n: int, how: str, backend: str, fault: str) -> None:
        """HostKVPool.load_layers / pd.load_layers: every layer's H2D queued at once, a
        completion per layer; bad input refused before the first layer is queued."""
        w = self.w
        s_idx, d_idx = self._slots(data, n, POOL.num_slots)
        kw: dict[str, Any] = {"backend": backend}
        host_layout = POOL
        table = w.kv_host.kernel_table
        if fault == "out_of_range":
            d_idx = torch.cat([d_idx, torch.tensor([POOL.num_slots + data.draw(st.integers(0, 3))])])
            s_idx = torch.cat([s_idx, torch.tensor([0])])
        elif fault == "int32":
            s_idx = s_idx.to(torch.int32)
        elif fault == "staged":
            kw["backend"] = "staged"
        elif fault == "bad_stream":
            kw["stream"] = data.draw(st.sampled_from([-1, 1 << 64, "0"]))
        elif fault == "layout":
            host_layout = POOL.replace(num_pages=POOL.num_pages + 1)
            how = "tables"
        elif fault == "closed":
            pool = pd.HostKVPool(POOL, DEV)
            table = pool.kernel_table
            pool.close()
            how = "tables"
        expect = self._kv_expect(True, s_idx, d_idx) if fault in ("none", "wait_out_of_range") else {}
        holder: list[Any] = []

        def call() -> None:
            if how == "pool":
                holder.append(w.kv_host.load_layers(w.kv_dev, s_idx, d_idx, **kw))
            else:
                holder.append(pd.load_layers(table, w.kv_dev.table, s_idx, d_idx, src_layout=host_layout,
                                             dst_layout=w.kv_dev.layout, **kw))
        if not self._call("layer_pipeline", fault, call, expect, accepted=fault == "wait_out_of_range"):
            return
        load = holder[0]
        assert load.num_layers == POOL.num_layers
        for layer in range(POOL.num_layers):
            load.wait(layer)
            assert load.ready(layer)
        load.synchronize()
        if fault == "wait_out_of_range":
            for bad in (POOL.num_layers, -1):
                try:
                    load.wait(bad)
                except errors.IndexValidationError:
                    continue
                raise AssertionError(f"LayerLoad.wait({bad}) was accepted")

    @invariant()
    def count_steps(self) -> None:
        STATS["steps"] += 1


def main(argv: list[str] | None = None) -> int:
    return fuzz_runner.main(SurfaceMachine, STATS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
