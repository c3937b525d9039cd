"""The stateful fuzzer, run in a child process by
tests/transfer/test_fuzz_stateful.py so that a crash is a test failure, not a dead pytest.

Random sequences of: allocate a host pool (one piece or chunked) or a device pool,
register an ordinary tensor that starts mid-page, close, build tables (good and bad
input), launch (every layout pair, kernel / copy engine / auto, all layers or one,
indices in range, out of range, wrong dtype / length / device), close from another
thread, mutate indices from another thread during a launch, derive layouts (valid and
invalid), call an engine's own transfer shapes through ``pointerdomain.compat`` (raw
``data_ptr()`` tables, good and bad). Every buffer sits between poisoned guard regions. After each step:

* a launch either raised a typed ``PointerDomainError`` and left every destination
  unchanged, or the destination matches ``tests/reference.py``'s torch model;
* no byte changed outside the tables: guards of every pool, and every pool that was
  not the destination, are byte-identical to their snapshots.

The rules that race ``close()`` or an index write against a launch need the launch
leases (``pointerdomain.registration.leases``) and the copy engine's single index read; without
that module they are skipped (both races crashed the process before them), not dropped.

Usage: ``python -m tests.transfer.fuzz_machine --profile ci --summary out.json``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import as_bytes, fill_random, reference_transfer
from tests.transfer import fuzz_runner

DEV = pd.Device("emulated", 0)
GUARD = 4096
#: The model every pool shares: 2 layers, 2-token pages, 1 head of 4 float32 (16-byte items).
MODEL = pd.KVLayout(kind="layer_first", num_layers=2, num_pages=2, page_size=2, num_heads=1, head_dim=4,
                    dtype="float32")
#: The race rules run with the launch leases, or when forced (``FUZZ_FORCE_RACES=1``,
#: to reproduce the crash on code without them).
HAS_LEASES = importlib.util.find_spec("pointerdomain.registration.leases") is not None or os.environ.get("FUZZ_FORCE_RACES") == "1"

settings.register_profile(
    "ci", max_examples=2000, stateful_step_count=10, deadline=None, database=None,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "dev", max_examples=200, stateful_step_count=10, deadline=None, database=None,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "long", max_examples=20000, stateful_step_count=20, deadline=None, database=None,
    suppress_health_check=list(HealthCheck),
)

STATS: dict[str, int] = {"sequences": 0, "steps": 0, "launches_ok": 0, "launches_refused": 0, "races": 0,
                         "compat_calls": 0}


@dataclass
class Pool:
    """One pool: its layout, kernel table, the one-buffer view (host) or the per-layer
    buffers (device), the whole poisoned allocation and where the buffers lie in it."""

    name: str
    layout: pd.KVLayout
    table: pd.PointerTable[pd.DeviceAlias]
    whole: torch.Tensor  # uint8, guards included
    spans: list[tuple[int, int]]  # byte ranges of the buffers inside `whole`
    memory: pd.RegisteredHostMemory | None
    buffer: torch.Tensor | None = None  # host: the one-buffer view
    buffers: list[torch.Tensor] = field(default_factory=list)  # device: per (kv, layer)
    closed: bool = False

    def one_buffer(self) -> torch.Tensor:
        """The pool's bytes in its layout's one-buffer form."""
        if self.buffer is not None:
            return as_bytes(self.buffer).reshape(-1)
        return torch.cat([as_bytes(b).reshape(-1) for b in self.buffers])

    def guards(self) -> torch.Tensor:
        keep = torch.ones(self.whole.numel(), dtype=torch.bool)
        for lo, hi in self.spans:
            keep[lo:hi] = False
        return self.whole[keep].clone()


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        STATS["sequences"] += 1
        self.pools: list[Pool] = []
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.extra: list[pd.RegisteredHostMemory] = []
        self.seed = 0

    # helpers -----------------------------------------------------------------
    def _next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def _snap(self) -> None:
        self.snapshots = [(p.whole.clone(), p.guards()) for p in self.pools]

    def _add(self, pool: Pool) -> None:
        fill_random(pool.whole, self._next_seed())
        self.pools.append(pool)
        self._snap()

    # rules: allocation and registration -----------------------------------------
    @precondition(lambda self: len(self.pools) < 4)
    @rule(kind=st.sampled_from(["layer_first", "page_first", "page_first_direct"]), pages=st.integers(1, 4),
          chunked=st.booleans())
    def new_host_pool(self, kind: str, pages: int, chunked: bool) -> None:
        layout = MODEL.replace(kind=kind, num_pages=pages)
        block = layout.page_block_bytes()
        mem = pd.alloc_registered(2 * GUARD + layout.nbytes, DEV, granularity=block,
                                  max_chunk_bytes=2 * block if chunked else 1 << 30)
        buffer = mem.tensor[GUARD : GUARD + layout.nbytes].view(layout.torch_dtype).view(layout.buffer_shape)
        entries = layout.page_block_views(buffer) if chunked else [buffer]
        table = pd.make_kernel_ptr_table(entries, DEV)
        self._add(Pool(f"host{len(self.pools)}", layout, table, mem.tensor, [(GUARD, GUARD + layout.nbytes)], mem,
                       buffer=buffer))

    @precondition(lambda self: len(self.pools) < 4)
    @rule(pages=st.integers(1, 4))
    def new_device_pool(self, pages: int) -> None:
        layout = MODEL.replace(num_pages=pages)
        per = layout.num_slots * layout.item_bytes
        n = layout.num_kv * layout.num_layers
        whole = pd.device_empty(((n + 1) * GUARD + n * per,), torch.uint8, DEV)
        spans = [(GUARD + i * (per + GUARD), GUARD + i * (per + GUARD) + per) for i in range(n)]
        buffers = [whole[lo:hi].view(layout.torch_dtype) for lo, hi in spans]
        table = pd.make_kernel_ptr_table(buffers, DEV)
        self._add(Pool(f"dev{len(self.pools)}", layout, table, whole, spans, None, buffers=buffers))

    @precondition(lambda self: len(self.pools) < 4)
    @rule(offset=st.integers(1, 255).map(lambda k: 16 * k), pages=st.integers(1, 3))  # mid-page, item-aligned
    def register_mid_page_tensor(self, offset: int, pages: int) -> None:
        layout = MODEL.replace(kind="page_first", num_pages=pages)
        block = layout.page_block_bytes()
        backing = torch.empty(layout.nbytes + 2 * GUARD + 4096, dtype=torch.uint8)
        start = -backing.data_ptr() % 4096 + offset
        whole = backing[start : start + layout.nbytes + 2 * GUARD]
        view = whole[GUARD : GUARD + layout.nbytes]
        mem = pd.register_host_tensor(view, DEV, granularity=block, max_chunk_bytes=block)
        buffer = view.view(layout.torch_dtype).view(layout.buffer_shape)
        table = pd.make_kernel_ptr_table(layout.page_block_views(buffer), DEV)
        self._add(Pool(f"reg{len(self.pools)}", layout, table, whole, [(GUARD, GUARD + layout.nbytes)], mem,
                       buffer=buffer))

    @rule(data=st.data())
    def close_a_pool(self, data: st.DataObject) -> None:
        host = [p for p in self.pools if p.memory is not None]
        if not host:
            return
        pool = data.draw(st.sampled_from(host))
        assert pool.memory is not None
        pool.memory.close()
        pool.closed = True

    # rules: tables -------------------------------------------------------------
    @rule(bad=st.sampled_from(["bare", "unregistered", "closed", "not_tensor", "strided", "empty"]))
    def build_a_bad_table(self, bad: str) -> None:
        args: Any
        if bad == "bare":
            args = torch.zeros(4, 4)
        elif bad == "unregistered":
            args = [torch.zeros(64)]
        elif bad == "closed":
            mem = pd.alloc_registered(4096, DEV)
            mem.close()
            args = [mem.tensor]
        elif bad == "not_tensor":
            args = [1234]
        elif bad == "strided":
            args = [torch.zeros(8, 8)[:, 0]]
        else:
            args = [torch.zeros(0)]
        try:
            pd.make_kernel_ptr_table(args, DEV)
        except errors.PointerDomainError:
            return
        raise AssertionError(f"make_kernel_ptr_table accepted {bad} input")

    # rules: layouts ------------------------------------------------------------
    @rule(field_=st.sampled_from(["kind", "num_pages", "head_dim", "dtype", "num_heads", "attention", "page_size"]),
          value=st.one_of(st.integers(-4, 6), st.sampled_from(["page_first", "pagefirst", "mla", "mha", "float32"]),
                          st.just(torch.float32)))
    def derive_a_layout(self, field_: str, value: object) -> None:
        try:
            derived = MODEL.replace(**{field_: value})
        except errors.LayoutError as exc:
            assert isinstance(exc, ValueError) and f"KVLayout.{field_}" in str(exc), exc
            return
        assert derived.nbytes > 0 and getattr(derived, field_) == value

    # rules: launches -----------------------------------------------------------
    @precondition(lambda self: len(self.pools) >= 2)
    @rule(data=st.data(), n=st.integers(0, 6), backend=st.sampled_from(["kernel", "copy_engine", "auto"]),
          layer=st.one_of(st.none(), st.integers(-1, 2)), validate=st.booleans(),
          fault=st.sampled_from(["none"] * 6 + ["out_of_range", "negative", "dtype", "length", "other_device",
                                                "layout"]))
    def launch(self, data: st.DataObject, n: int, backend: str, layer: int | None, validate: bool, fault: str) -> None:
        src, dst = data.draw(st.permutations(self.pools))[:2]
        s_slots = data.draw(st.lists(st.integers(0, src.layout.num_slots - 1), min_size=n, max_size=n))
        d_slots = data.draw(st.permutations(range(dst.layout.num_slots)))[: min(n, dst.layout.num_slots)]
        s_slots = s_slots[: len(d_slots)]
        s_idx, d_idx = torch.tensor(s_slots, dtype=torch.int64), torch.tensor(d_slots, dtype=torch.int64)
        src_layout, dst_layout = src.layout, dst.layout
        if fault == "out_of_range" and len(d_slots):
            d_idx[0] = dst.layout.num_slots + data.draw(st.integers(0, 5))
        elif fault == "negative" and len(s_slots):
            s_idx[0] = -1
        elif fault == "dtype":
            s_idx = s_idx.to(torch.int32)
        elif fault == "length":
            d_idx = torch.cat([d_idx, torch.zeros(1, dtype=torch.int64)])
        elif fault == "other_device":
            moved = pd.device_empty((max(len(s_slots), 1),), torch.int64, "emulated:1")
            moved[: len(s_slots)].copy_(s_idx)
            s_idx = moved[: len(s_slots)]
        elif fault == "layout":
            dst_layout = dst_layout.replace(num_pages=dst_layout.num_pages + 1)
        before = dst.one_buffer().clone()
        ok_pairs = [(s, d) for s, d in zip(s_idx.tolist(), d_idx.tolist())
                    if 0 <= s < src.layout.num_slots and 0 <= d < dst.layout.num_slots]
        try:
            if layer is None:
                pd.transfer_kv_all_layer(src.table, dst.table, s_idx, d_idx, src_layout=src_layout,
                                         dst_layout=dst_layout, backend=backend,  # type: ignore[arg-type]
                                         validate_indices=validate)
            else:
                pd.transfer_kv_per_layer(src.table, dst.table, s_idx, d_idx, layer_id=layer, src_layout=src_layout,
                                         dst_layout=dst_layout, backend=backend,  # type: ignore[arg-type]
                                         validate_indices=validate)
        except errors.PointerDomainError:
            STATS["launches_refused"] += 1
            assert torch.equal(dst.one_buffer(), before), "a refused launch changed its destination"
            return
        STATS["launches_ok"] += 1
        assert not src.closed and not dst.closed, "a launch over closed memory was accepted"
        assert fault in ("none", "out_of_range", "negative") or (fault == "other_device" and not s_slots), fault
        if ok_pairs:
            s_ok = torch.tensor([s for s, _ in ok_pairs]); d_ok = torch.tensor([d for _, d in ok_pairs])
        else:
            s_ok = d_ok = torch.zeros(0, dtype=torch.int64)
        src_bytes = src.one_buffer().view(src.layout.torch_dtype).view(src.layout.buffer_shape)
        dst_before = before.view(dst.layout.torch_dtype).view(dst.layout.buffer_shape)
        layers = None if layer is None else [layer]
        want = reference_transfer(src_bytes, src.layout, dst_before, dst.layout, s_ok, d_ok, layers)
        assert torch.equal(dst.one_buffer(), want), "the launch does not match the torch reference"
        dst_index = self.pools.index(dst)
        whole, guards = self.snapshots[dst_index]
        self.snapshots[dst_index] = (dst.whole.clone(), guards)

    @precondition(lambda self: any(p.memory is None for p in self.pools)
                  and any(p.buffer is not None and p.layout.kind == "page_first" for p in self.pools))
    @rule(data=st.data(), n=st.integers(0, 6), per_layer=st.booleans(),
          fault=st.sampled_from(["none"] * 6 + ["unknown_address", "host_va_in_device_table", "short_reach",
                                                "out_of_range", "int32_table", "layer_count"]))
    def compat_sgl_backup(self, data: st.DataObject, n: int, per_layer: bool, fault: str) -> None:
        """An engine's own call shapes (sgl_kernel.kvcacheio, through pointerdomain.compat):
        the all-layer backup lf_pf takes raw uint64 tables of the device pool's data_ptr()s
        and the host pool's K and V halves as tensors; the per-layer load pf_lf takes the
        tensors. Same invariants as a typed launch."""
        from pointerdomain.compat import sgl_kernel

        STATS["compat_calls"] += 1
        dev_pool = data.draw(st.sampled_from([p for p in self.pools if p.memory is None]))
        host = data.draw(st.sampled_from([p for p in self.pools if p.buffer is not None
                                           and p.layout.kind == "page_first"]))
        assert host.buffer is not None
        layers, item = dev_pool.layout.num_layers, dev_pool.layout.item_bytes
        src, dst = (host, dev_pool) if per_layer else (dev_pool, host)
        ptrs = [b.data_ptr() for b in dev_pool.buffers]  # kv-major: K of every layer, then V
        if fault == "unknown_address":
            ptrs[data.draw(st.integers(0, len(ptrs) - 1))] = 12345 * 4096
        elif fault == "host_va_in_device_table":
            ptrs[0] = host.buffer.data_ptr()  # a host VA where the kernel reads device memory
        elif fault == "short_reach":
            ptrs[-1] = dev_pool.whole.data_ptr() + dev_pool.whole.numel() - 8  # runs off the allocation
        k_tab = torch.tensor(ptrs[:layers], dtype=torch.uint64)
        v_tab = torch.tensor(ptrs[layers:], dtype=torch.uint64)
        if fault == "int32_table":
            k_tab = k_tab.to(torch.int32)
        n_slots = min(n, src.layout.num_slots, dst.layout.num_slots)
        s_slots = data.draw(st.lists(st.integers(0, src.layout.num_slots - 1), min_size=n_slots, max_size=n_slots))
        d_slots = data.draw(st.permutations(range(dst.layout.num_slots)))[:n_slots]
        s_idx, d_idx = torch.tensor(s_slots, dtype=torch.int64), torch.tensor(d_slots, dtype=torch.int64)
        if fault == "out_of_range" and n_slots:
            d_idx[0] = dst.layout.num_slots + data.draw(st.integers(0, 3))
        before = dst.one_buffer().clone()
        layer = data.draw(st.integers(0, layers - 1))
        try:
            if per_layer:
                sgl_kernel.transfer_kv_per_layer_pf_lf(host.buffer[0], dev_pool.buffers[layer], host.buffer[1],
                                                       dev_pool.buffers[layers + layer], s_idx, d_idx, layer, item,
                                                       layers * item + (fault == "layer_count") * item)
            else:
                sgl_kernel.transfer_kv_all_layer_lf_pf(k_tab, host.buffer[0], v_tab, host.buffer[1], s_idx, d_idx, item,
                                                       layers * item, layers + (fault == "layer_count"))
        except errors.PointerDomainError:
            STATS["launches_refused"] += 1
            assert torch.equal(dst.one_buffer(), before), "a refused compat call changed its destination"
            return
        STATS["launches_ok"] += 1
        assert not src.closed and not dst.closed, "a compat call over closed memory was accepted"
        raw_faults = ("unknown_address", "host_va_in_device_table", "short_reach", "int32_table")
        assert fault == "none" or (fault == "out_of_range" and not n_slots) or (per_layer and fault in raw_faults), fault
        src_bytes = src.one_buffer().view(src.layout.torch_dtype).view(src.layout.buffer_shape)
        dst_before = before.view(dst.layout.torch_dtype).view(dst.layout.buffer_shape)
        want = reference_transfer(src_bytes, src.layout, dst_before, dst.layout, s_idx, d_idx,
                                  [layer] if per_layer else None)
        assert torch.equal(dst.one_buffer(), want), "the compat call does not match the torch reference"
        k = self.pools.index(dst)
        self.snapshots[k] = (dst.whole.clone(), self.snapshots[k][1])

    @precondition(lambda self: HAS_LEASES and any(p.memory is not None and not p.closed for p in self.pools))
    @rule(data=st.data())
    def close_from_another_thread_during_a_launch(self, data: st.DataObject) -> None:
        """Needs the launch leases (pointerdomain.registration.leases): before them this crashed."""
        STATS["races"] += 1
        host = data.draw(st.sampled_from([p for p in self.pools if p.memory is not None and not p.closed]))
        others = [p for p in self.pools if p is not host and not p.closed]
        if not others:
            return
        dst = others[0]
        idx = torch.arange(min(host.layout.num_slots, dst.layout.num_slots))
        assert host.memory is not None
        closer = threading.Thread(target=host.memory.close)
        closer.start()
        try:
            pd.transfer_kv_all_layer(host.table, dst.table, idx, idx, src_layout=host.layout, dst_layout=dst.layout)
        except errors.PointerDomainError:
            pass
        closer.join()
        host.closed = True
        self.snapshots[self.pools.index(dst)] = (dst.whole.clone(), self.snapshots[self.pools.index(dst)][1])

    @precondition(lambda self: len(self.pools) >= 2)
    @rule(data=st.data(), backend=st.sampled_from(["kernel", "copy_engine"]))
    def mutate_indices_during_a_launch(self, data: st.DataObject, backend: str) -> None:
        """Another thread writes out-of-range slots into the index tensor while the launch
        runs. The kernel re-checks each slot; the copy engine reads the indices once only
        with the launch leases (pointerdomain.registration.leases), so that backend waits for them."""
        if backend == "copy_engine" and not HAS_LEASES:
            backend = "kernel"
        STATS["races"] += 1
        src, dst = data.draw(st.permutations(self.pools))[:2]
        n = min(src.layout.num_slots, dst.layout.num_slots)
        s_idx, d_idx = torch.arange(n), torch.randperm(dst.layout.num_slots)[:n]
        stop = threading.Event()

        def scribble() -> None:
            while not stop.is_set():
                d_idx[0] = 1 << 40
                d_idx[0] = 0
        writer = threading.Thread(target=scribble)
        writer.start()
        try:
            pd.transfer_kv_all_layer(src.table, dst.table, s_idx, d_idx, src_layout=src.layout, dst_layout=dst.layout,
                                     backend=backend)  # type: ignore[arg-type]
        except errors.PointerDomainError:
            pass
        finally:
            stop.set()
            writer.join()
        i = self.pools.index(dst)
        self.snapshots[i] = (dst.whole.clone(), self.snapshots[i][1])  # contents racy by design; guards checked

    # invariants ----------------------------------------------------------------
    @invariant()
    def nothing_changed_outside_the_tables(self) -> None:
        STATS["steps"] += 1
        for pool, (whole, guards) in zip(self.pools, self.snapshots):
            assert torch.equal(pool.guards(), guards), f"{pool.name}: a guard byte changed"
            assert torch.equal(pool.whole, whole), f"{pool.name}: changed without being a launch's destination"

    def teardown(self) -> None:
        for pool in self.pools:
            if pool.memory is not None:
                pool.memory.close()


def main(argv: list[str] | None = None) -> int:
    return fuzz_runner.main(KVMachine, STATS, __doc__.splitlines()[0], argv, extra={"leases": HAS_LEASES})


if __name__ == "__main__":
    sys.exit(main())
