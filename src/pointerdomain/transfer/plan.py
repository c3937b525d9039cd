"""The launch plan: everything a transfer needs that depends only on its tables
and layouts, checked and computed once and cached while the tables live.

:func:`plan_for` checks the tables' domain and device, that the layouts agree,
and that each table fits its layout, then builds a :class:`TransferPlan`: the
device and its platform backend, both :class:`~pointerdomain.layouts.Geometry`,
the copy word width, the longest contiguous run (for the copy engine) and the
bound launch struct (``_C.KernelPlan``) the backend hands to C++ in one piece.
Per call only the indices, the layer range, the stream and the SM budget vary.
Checked mode (:mod:`pointerdomain.transfer.checked`) verifies a plan; it does not
recompute it.

Where a layout splits its items into several runs (``page_head``, ``page_unified``
with head groups: :func:`pointerdomain.layouts.lower_pair`), the plan is built once
over the lowered layouts (items of one part), and each launch expands its slot
indices to the parts' slots (:meth:`TransferPlan.expand`, torch ops on the indices'
device: no host sync) before anything else sees them, so the kernel, the copy engine,
the staged path and checked mode all work on an ordinary geometry. Plans of the other
layouts have no lowering and pay nothing for it.
"""

from __future__ import annotations

import bisect
import ctypes
import weakref
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from pointerdomain._platform import Backend, backend_for, kernel_plan, on_backend_change
from pointerdomain._platform.graph_holds import CaptureCount
from pointerdomain._platform.host_indices import native_slots_problem, slots_problem
from pointerdomain._platform.liveness import JointWatch, cpu_index_reader, device_index_reader, joint_watch
from pointerdomain.devices import Device, DeviceRuntime
from pointerdomain.domains import DeviceAlias
from pointerdomain.errors import DeviceMismatchError, IndexValidationError, InvalidArgumentError, LayoutError
from pointerdomain.transfer.launch_errors import error_word_address, host_word
from pointerdomain.layouts import Geometry, KVLayout, Lowering, lower_pair
from pointerdomain.registration.leases import LeaseSet
from pointerdomain.registration.memory import RegisteredHostMemory
from pointerdomain.transfer.overlap import (
    LayerClash,
    check_distinct_destinations,
    entry_clashes,
    entry_spans,
    on_interleave_change,
    shared_memory,
)
from pointerdomain.registration.tables import PointerTable, require_domain

if TYPE_CHECKING:
    from pointerdomain._platform.native import KernelPlan

__all__ = ["TransferPlan", "plan_for"]

#: Layout fields src and dst must agree on (``kind`` and ``num_pages`` may differ).
_SHARED_FIELDS = ("attention", "num_layers", "page_size", "num_heads", "head_dim", "dtype")


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A checked launch plan (see the module docstring).

    Attributes:
        device: the tables' device.
        platform: its backend (``pointerdomain._platform.backend_for(device)`` when built).
        src_layout, dst_layout: the layouts the kernels address: the given ones, or with a
            :attr:`lowering`, the lowered ones (items of one part).
        given_src_layout, given_dst_layout: the layouts the plan was built for (the caller's).
        src_geometry, dst_geometry: how the kernels address each table.
        src_values, dst_values: the tables' addresses as ints (host-side; copy-engine runs).
        vec_bytes: copy word width in {16, 8, 4, 1} that every address and stride allows.
        run_bytes: longest contiguous run a page gives on both sides (``page_size *
            item_bytes`` when both token strides equal the item, else ``item_bytes``).
        kernel: the bound struct passed to C++ (tables, geometries, sizes, word width),
            with the device's error word (:mod:`pointerdomain.transfer.launch_errors`).
        unchecked: the same without the error word (``validate_indices=False``).
        owners: the registrations both tables point into (leased by every launch).
        same_memory: src and dst are the same memory with the same geometry, so a
            launch must not read and write one slot (see :mod:`pointerdomain.transfer.overlap`).
        dst_starts, dst_ends: the byte ranges of the storages of dst's buffers (for a table
            resolved from raw addresses, of what its entries address), sorted and merged
            (:meth:`indices_in_dst`).
        unpinned: the first owner kernels cannot read (the ``unpinned`` rung), or None.
        lowering: how a launch between layouts that split items runs over per-part items
            (:func:`~pointerdomain.layouts.lower_pair`), or None (the common case).
        host_memory, launch_sets_device, streams: the device's
            :class:`~pointerdomain.devices.DeviceRuntime` flags, read once per plan.
        src_slots, dst_slots: ``num_slots`` of the given layouts (the slot range a launch checks).
        runtime: that runtime (its current device, asked per launch).
        host_word: the CPU view of the device's error word where it is host-readable.
        watch: both tables' liveness words in one native check, or None (each table's own
            check then).
        dst_clashes: layers whose dst entries share memory (:func:`~pointerdomain.transfer.overlap.entry_clashes`):
            a launch over both is refused; empty for every table whose entries are disjoint.
        auto_host_kernel: ``backend="auto"`` with indices in host memory takes the kernel
            (it reads host memory: the emulated device, whose runtime never auto-picks the
            staged path), fixed with the device's runtime.
        slots_problem: :func:`~pointerdomain._platform.host_indices.slots_problem`, the
            native function itself where the device's indices are host memory.
        lease: the one owner's lease set where :attr:`owners` is one registration (the
            common case: one host pool), else None.
        index_pair, index_meta: where this process found how torch lays out a tensor, the
            native test of two index tensors and the dtype word it compares: for a device
            whose indices are host memory, CPU tensors (:func:`~pointerdomain._platform.liveness.cpu_index_reader`;
            only where the backend looks up its memory with the emulated device's native
            look-up), else tensors in the device's own memory
            (:func:`~pointerdomain._platform.liveness.device_index_reader`, called with
            ordinal -1); else None (the launch asks torch and the backend).
        captures: the backend's count of open graph captures
            (:class:`~pointerdomain._platform.graph_holds.CaptureCount`), or None where it
            cannot count them (a launch that recorded no event then asks for a capture).
    """

    device: Device
    platform: Backend
    src_layout: KVLayout
    dst_layout: KVLayout
    given_src_layout: KVLayout
    given_dst_layout: KVLayout
    src_geometry: Geometry
    dst_geometry: Geometry
    src_values: tuple[int, ...]
    dst_values: tuple[int, ...]
    vec_bytes: int
    run_bytes: int
    kernel: KernelPlan
    dst_ref: weakref.ref[PointerTable[DeviceAlias]]
    src_ref: weakref.ref[PointerTable[DeviceAlias]]
    unchecked: KernelPlan | None = None
    owners: tuple[RegisteredHostMemory, ...] = ()
    same_memory: bool = False
    unpinned: RegisteredHostMemory | None = None
    dst_starts: tuple[int, ...] = ()
    dst_ends: tuple[int, ...] = ()
    lowering: Lowering | None = None
    host_memory: bool = False
    launch_sets_device: bool = False
    streams: bool = True
    src_slots: int = 0
    dst_slots: int = 0
    runtime: DeviceRuntime | None = None
    host_word: ctypes.c_uint32 | None = None
    watch: JointWatch | None = None
    dst_clashes: tuple[LayerClash, ...] = ()
    captures: CaptureCount | None = None
    auto_host_kernel: bool = False
    slots_problem: Callable[[int, int, int, int, int], int] = slots_problem
    index_pair: Callable[[object, object, int, int], tuple[int, int, int, int, bool] | None] | None = None
    index_meta: int = 0
    lease: LeaseSet | None = None

    def check_slot_range(self, s_idx: torch.Tensor, d_idx: torch.Tensor) -> None:
        """Raise when a slot of ``s_idx`` / ``d_idx`` (``int64``, 1-D, equal length > 0, both
        on one device: the caller's indices) lies outside ``[0, num_slots)`` of its given
        layout; before anything is copied. CUDA indices cost one host sync for both.

        Raises:
            IndexValidationError: the first side with a slot out of range, and that slot.
        """
        _check_ranges(s_idx, d_idx, self.given_src_layout.num_slots, self.given_dst_layout.num_slots)

    def check_addressed_range(self, s_idx: torch.Tensor, d_idx: torch.Tensor) -> None:
        """:meth:`check_slot_range` for indices the kernels address (after :meth:`expand`
        where the plan has a lowering; the same check otherwise)."""
        _check_ranges(s_idx, d_idx, self.src_layout.num_slots, self.dst_layout.num_slots)

    def expand(
        self, s_idx: torch.Tensor, d_idx: torch.Tensor, stream: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The caller's slot indices (``int64``, 1-D, equal length ``n``) as the ``n *
        parts`` slots of the lowered layouts (see :class:`~pointerdomain.layouts.Lowering`),
        pair ``i``'s parts at ``[i * parts, (i + 1) * parts)``: new contiguous ``int64``
        tensors on the indices' device, computed there with torch ops (no host sync, so
        a CUDA graph may capture it; on CUDA the ops run on ``stream``, default the current
        one). A slot outside its given layout becomes parts all outside the lowered
        layout's slots, which the kernels skip and report like any slot out of range
        (never a slot of another item: the range is clamped before the arithmetic)."""
        low = self.lowering
        assert low is not None
        on_gpu = s_idx if s_idx.is_cuda else d_idx
        if stream is not None and on_gpu.is_cuda:
            cuda: Any = torch.cuda  # ExternalStream is untyped in torch's stubs
            with cuda.stream(cuda.ExternalStream(stream, device=on_gpu.device)):
                return (_expand(s_idx, low.parts, low.src_blocked, self.given_src_layout),
                        _expand(d_idx, low.parts, low.dst_blocked, self.given_dst_layout))
        return (_expand(s_idx, low.parts, low.src_blocked, self.given_src_layout),
                _expand(d_idx, low.parts, low.dst_blocked, self.given_dst_layout))

    def indices_in_dst(self, src_idx: int, dst_idx: int, nbytes: int) -> bool:
        """Whether either index array (``nbytes`` > 0 bytes from address ``src_idx`` /
        ``dst_idx``, in the domain of tensors' ``data_ptr()``: host VAs and device addresses)
        meets the storage of a buffer the destination table was built from: indices there
        would be overwritten by the copy that reads them."""
        starts, ends = self.dst_starts, self.dst_ends
        if len(starts) == 1:  # a pool table: one allocation
            lo, hi = starts[0], ends[0]
            return (src_idx < hi and src_idx + nbytes > lo) or (dst_idx < hi and dst_idx + nbytes > lo)
        for address in (src_idx, dst_idx):
            i = bisect.bisect_left(starts, address + nbytes)  # the last storage starting before the end
            if i > 0 and ends[i - 1] > address:
                return True
        return False

    def live(self, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias]) -> bool:
        """Both tables' ``check_live`` in one pass over the owners, without raising: False
        when a registration was closed or a storage released or reallocated (the caller
        then runs each table's ``check_live`` for the error). The plan keeps no storage
        itself: dst's memory must not outlive dst through src's cached plan."""
        for owner in self.owners:
            if owner.closed or owner.inherited:
                return False
        watch = self.watch  # reads words of objects src and dst hold: both are this call's
        if watch is not None:
            return watch.intact()
        return src.storages_intact() and dst.storages_intact()

    def copy_runs(
        self, s_idx: torch.Tensor, d_idx: torch.Tensor, layer_begin: int, layer_count: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-copy ``(dst, src, nbytes)`` int64 arrays on the host, for
        :meth:`Backend.copy_runs`: the items of slot pairs ``s_idx[i] -> d_idx[i]``
        (layers ``[layer_begin, layer_begin + layer_count)``, every kv) merged into runs
        of consecutive slots that stay inside one page on both sides (a run never
        crosses a table entry, so never two registrations). Slots must be in range."""
        layout = self.src_layout
        item, ps = layout.item_bytes, layout.page_size
        s = s_idx.cpu()
        d = d_idx.cpu()
        kv = torch.arange(layout.num_kv).view(1, -1, 1)
        layer = torch.arange(layer_begin, layer_begin + layer_count).view(1, 1, -1)

        def addresses(table: tuple[int, ...], g: Geometry, slots: torch.Tensor) -> torch.Tensor:
            # the uint64 addresses' bit patterns (aliases may set the top bit); int64 sums wrap as uint64's
            values = torch.tensor([v - (1 << 64) if v >> 63 else v for v in table], dtype=torch.int64)
            page, tok = (slots // ps).view(-1, 1, 1), (slots % ps).view(-1, 1, 1)
            entry = kv * g.e_kv + layer * g.e_layer + page * g.e_page
            return values[entry] + kv * g.s_kv + layer * g.s_layer + page * g.s_page + tok * g.s_tok

        # (kv, layer, i) order: runs along i
        sa = addresses(self.src_values, self.src_geometry, s).permute(1, 2, 0).reshape(-1)
        da = addresses(self.dst_values, self.dst_geometry, d).permute(1, 2, 0).reshape(-1)
        same_page = torch.zeros(s.numel(), dtype=torch.bool)  # slot i continues slot i-1's page on both sides
        same_page[1:] = (s[1:] // ps == s[:-1] // ps) & (d[1:] // ps == d[:-1] // ps)
        same_page = same_page.repeat(layout.num_kv * layer_count)
        cont = torch.zeros_like(same_page)
        cont[1:] = (sa[1:] == sa[:-1] + item) & (da[1:] == da[:-1] + item) & same_page[1:]
        starts = torch.nonzero(~cont).view(-1)
        lengths = torch.diff(starts, append=torch.tensor([sa.numel()])) * item
        return da[starts], sa[starts], lengths


def _check_ranges(s_idx: torch.Tensor, d_idx: torch.Tensor, src_slots: int, dst_slots: int) -> None:
    if (s_idx.is_cpu and d_idx.is_cpu and s_idx.dtype is _INT64 and d_idx.dtype is _INT64 and s_idx.is_contiguous()
            and d_idx.is_contiguous() and s_idx.numel() == d_idx.numel()):
        # host memory: one native pass; the checks below word the error where it finds one
        if slots_problem(s_idx.data_ptr(), d_idx.data_ptr(), s_idx.numel(), src_slots, dst_slots) == 0:
            return
    d_list: list[int] | None = None
    if not s_idx.is_cuda and s_idx.numel() <= 512:  # small CPU index sets: list min/max beats tensor ops
        s_list, d_list = s_idx.tolist(), d_idx.tolist()
        lo_s, hi_s, lo_d, hi_d = min(s_list), max(s_list), min(d_list), max(d_list)
    else:  # one host sync for both tensors
        (lo_s, hi_s), (lo_d, hi_d) = torch.stack([*torch.aminmax(s_idx), *torch.aminmax(d_idx)]).view(2, 2).tolist()
    for name, lo, hi, slots in (("src_indices", lo_s, hi_s, src_slots), ("dst_indices", lo_d, hi_d, dst_slots)):
        if lo < 0 or hi >= slots:
            raise IndexValidationError(f"{name}: slot {lo if lo < 0 else hi} outside [0, {slots}); nothing was copied")
    check_distinct_destinations(d_idx, d_list)  # read on the host already: two writes to one slot race


_INT64 = torch.int64

#: ``j * step`` for ``j`` in ``range(parts)``, per (device, parts, step): made once, outside
#: any graph capture (a captured arange would hold its values only in replays).
_patterns: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _pattern(device: torch.device, parts: int, step: int) -> torch.Tensor:
    key = (device, parts, step)
    pattern = _patterns.get(key)
    if pattern is None:
        pattern = torch.arange(0, parts * step, step, dtype=torch.int64, device=device)
        if not pattern.is_cuda:
            _patterns[key] = pattern
        else:
            with torch.cuda.device(device):
                if not torch.cuda.is_current_stream_capturing():
                    _patterns[key] = pattern
    return pattern


def _expand(idx: torch.Tensor, parts: int, blocked: bool, layout: KVLayout) -> torch.Tensor:
    """Slots of ``layout`` as the slots of its ``parts`` parts (:class:`Lowering`), in
    few torch ops (each costs microseconds of host time on the launch path)."""
    # Out of range first, to -1 or num_slots, whose parts are all out of range of the
    # lowered layout: no arithmetic on a wild value can wrap into range.
    t = idx.clamp(-1, layout.num_slots)
    if blocked:  # page * parts * ps + j * ps + tok == t + page * (parts - 1) * ps + j * ps
        ps = layout.page_size
        base = torch.add(t, torch.div(t, ps, rounding_mode="floor"), alpha=(parts - 1) * ps)
        return torch.add(base.unsqueeze(1), _pattern(idx.device, parts, ps)).view(-1)
    return torch.add(_pattern(idx.device, parts, 1), t.unsqueeze(1), alpha=parts).view(-1)


def check_table_layout(name: str, table: PointerTable[DeviceAlias], layout: KVLayout) -> None:
    """A table built for a layout (pool tables) launches with exactly that layout.

    Raises:
        LayoutError: ``layout`` differs from the table's own in any field (kind, model
            shape, page count, dtype: so also in byte size).
    """
    own = table.layout
    if own is not None and own != layout:
        diff = [f"{f}: {getattr(layout, f)!r} (table: {getattr(own, f)!r})"
                for f in type(own).model_fields if getattr(layout, f) != getattr(own, f)]
        raise LayoutError(
            f"{name}_layout does not match the layout the {name} table was built for ({'; '.join(diff)}): the "
            "kernel would address the buffer with the wrong strides. Fix: pass the pool's own layout "
            "(pool.layout)"
        )


def _check_table(name: str, table: object) -> Device:
    kernel_table = require_domain(
        name, table, DeviceAlias, "a kernel launch",
        "kernels need PointerTable[DeviceAlias] (host VAs are not device addresses where "
        "CanUseHostPointerForRegisteredMem is 0). Build it with make_kernel_ptr_table(tensors, device)",
    )
    device: Device | None = kernel_table.device
    assert device is not None  # a DeviceAlias table always has one
    kernel_table.check_live()
    return device


def _build(src: PointerTable[DeviceAlias], src_layout: KVLayout, dst: PointerTable[DeviceAlias], dst_layout: KVLayout) -> TransferPlan:
    device = _check_table("src", src)
    dst_device = _check_table("dst", dst)
    if dst_device != device:
        raise DeviceMismatchError(f"src table is for {device} but dst table is for {dst_device}")
    for name, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"{name} must be a KVLayout, got {type(layout).__name__}")
    for field in _SHARED_FIELDS:
        if getattr(src_layout, field) != getattr(dst_layout, field):
            raise LayoutError(
                f"src and dst layouts differ in {field}: "
                f"{getattr(src_layout, field)!r} vs {getattr(dst_layout, field)!r}"
            )
    check_table_layout("src", src, src_layout)
    check_table_layout("dst", dst, dst_layout)
    src_geo = src_layout.geometry(len(src), src.sizes, "src")
    dst_geo = dst_layout.geometry(len(dst), dst.sizes, "dst")
    given_src, given_dst = src_layout, dst_layout
    lowering = lower_pair(src_layout, dst_layout) if src_layout.item_parts > 1 or dst_layout.item_parts > 1 else None
    if lowering is not None:  # the tables fit the given layouts (checked above): address the lowered ones
        sides = (("src", src, given_src, lowering.src), ("dst", dst, given_dst, lowering.dst))
        for name, table, given, lowered in sides:
            if len(table) not in lowered.table_splits():  # only a layer_first table cut per page
                allowed = sorted(set(given.table_splits()) & set(lowered.table_splits()))
                raise LayoutError(
                    f"{name}: a {given.kind} table of {len(table)} entries (one per page) cannot be copied to or from "
                    f"a page_unified layout with {lowering.parts} head groups: each group of a page is copied as a "
                    "page of its own, which an entry per page no longer holds whole. Fix: build the table with "
                    f"{' or '.join(map(str, allowed))} entries (a DeviceKVPool's table has one per kv and layer)"
                )
        src_layout, dst_layout = lowering.src, lowering.dst
        src_geo = src_layout.geometry(len(src), src.sizes, "src")
        dst_geo = dst_layout.geometry(len(dst), dst.sizes, "dst")
    clashes = entry_clashes(dst, dst_geo)  # before the src/dst rules: a table over itself is caught here
    same_memory = shared_memory(src, src_geo, dst, dst_geo)
    vec = src_layout.vector_bytes(src.alignment, dst.alignment, *src_geo.byte_strides, *dst_geo.byte_strides)
    item = src_layout.item_bytes
    run = src_layout.page_size * item if src_geo.s_tok == item and dst_geo.s_tok == item else item
    args = (src.kernel_table_address(), src_geo, dst.kernel_table_address(), dst_geo,
            src_layout.page_size, src_layout.num_kv, item, vec)
    kernel = kernel_plan(*args, error_word_address(device))
    owners = tuple({id(o): o for o in (*src.registrations(), *dst.registrations())}.values())
    unpinned = next((o for o in owners if not o.kernel_readable), None)  # fixed at registration
    # a table resolved from raw addresses keeps no storages: what its entries address instead
    starts, ends = _merged_ranges(dst.storage_spans() if dst.kept_tensors() else entry_spans(dst))
    platform = backend_for(device)
    runtime = device.runtime
    if runtime.host_memory:
        reader = cpu_index_reader()
        if reader is not None and getattr(platform, "device_lookup", None) is not _emulated_lookup():
            reader = None  # a backend with its own look-up: asked as before
    elif not platform.is_capturing(device):  # indices in the device's memory: the tensor words hold the device
        # (found once per device with a few allocations: never inside a capture, whose plans ask torch)
        reader = device_index_reader(device.torch_device)
    else:
        reader = None
    return TransferPlan(device, platform, src_layout, dst_layout, given_src, given_dst, src_geo, dst_geo,
                        src.raw_values(), dst.raw_values(), vec, run, kernel, weakref.ref(dst), weakref.ref(src),
                        kernel_plan(*args),
                        owners, same_memory, unpinned, starts, ends, lowering, device.runtime.host_memory,
                        device.runtime.launch_sets_device, device.runtime.streams, given_src.num_slots,
                        given_dst.num_slots, device.runtime, host_word(device),
                        joint_watch(src.storage_watch(), dst.storage_watch()),
                        captures=getattr(platform, "graph_captures", None), dst_clashes=clashes,
                        auto_host_kernel=device.runtime.host_memory and not platform.staged_auto,
                        slots_problem=native_slots_problem() if device.runtime.host_memory else slots_problem,
                        index_pair=None if reader is None else reader.native,
                        index_meta=0 if reader is None else reader.meta,
                        lease=owners[0].leases if len(owners) == 1 else None)


def _emulated_lookup() -> object:
    from pointerdomain import _C

    return getattr(_C, "emu_device_lookup", None)


def _merged_ranges(spans: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(start, end)`` byte ranges as sorted, merged ``(starts, ends)``."""
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if hi <= lo:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple(m[0] for m in merged), tuple(m[1] for m in merged)


_plans: weakref.WeakKeyDictionary[PointerTable[DeviceAlias], dict[tuple[int, int, int], TransferPlan]] = (
    weakref.WeakKeyDictionary()
)
# The same plans by the ids of (src, dst, src_layout, dst_layout), for the launch path: one
# dict lookup instead of the weak dictionary's reference per call. An entry is taken only
# where the plan's own references say it is for these very objects (an id can be reused
# once its object is gone), and dropped with its src.
_by_ids: dict[tuple[int, int, int, int], TransferPlan] = {}
#: The plan each src (by id) was last launched with, checked by the same references: the
#: launch path's first look (one id, one lookup), ahead of :func:`plan_for`.
LAST_BY_SRC: dict[int, TransferPlan] = {}


def _clear() -> None:
    _plans.clear()
    _by_ids.clear()
    LAST_BY_SRC.clear()


on_backend_change(_clear)


def _forget_dst(table: PointerTable[DeviceAlias]) -> None:
    """Drop every cached plan whose destination is ``table``: its interleave mark changed,
    and rule 0's verdict (:func:`~pointerdomain.transfer.overlap.entry_clashes`, taken when
    the plan was built) must be taken again at the next launch."""
    for ids, plan in list(_by_ids.items()):
        if plan.dst_ref() is table:
            _by_ids.pop(ids, None)
    for src_id, plan in list(LAST_BY_SRC.items()):
        if plan.dst_ref() is table:
            LAST_BY_SRC.pop(src_id, None)
    for per_src in list(_plans.values()):
        for sub, plan in list(per_src.items()):
            if plan.dst_ref() is table:
                per_src.pop(sub, None)


on_interleave_change(_forget_dst)


def plan_for(src: PointerTable[DeviceAlias], src_layout: KVLayout, dst: PointerTable[DeviceAlias], dst_layout: KVLayout) -> TransferPlan:
    """The plan for (src, src_layout, dst, dst_layout), cached while ``src`` lives
    (dropped when a backend is replaced, e.g. under the test hook).

    Raises:
        DomainError: a table is not a PointerTable[DeviceAlias].
        DeviceMismatchError: the tables are for different devices.
        ClosedError: a table's registered memory was closed.
        InvalidArgumentError: a layout that is not a KVLayout.
        LayoutError: layouts disagree, a table does not fit its layout, or a layout that
            splits its items is paired with one it cannot be lowered with
            (:func:`~pointerdomain.layouts.lower_pair`).
        OverlapError: two entries of one layer of ``dst`` share memory, or ``src`` and ``dst`` share
            memory with different geometries (:mod:`pointerdomain.transfer.overlap`).
    """
    ids = (id(src), id(dst), id(src_layout), id(dst_layout))
    plan = _by_ids.get(ids)
    if (plan is not None and plan.src_ref() is src and plan.dst_ref() is dst and plan.given_src_layout is src_layout
            and plan.given_dst_layout is dst_layout):
        LAST_BY_SRC[ids[0]] = plan  # (dropped with src by _by_ids's finalizer, which has this id)
        return plan
    key = ids[1:]
    per_src = _plans.get(src) if isinstance(cast(object, src), PointerTable) else None
    plan = per_src.get(key) if per_src is not None else None
    if (plan is not None and plan.dst_ref() is dst and plan.given_src_layout is src_layout
            and plan.given_dst_layout is dst_layout):
        return plan
    plan = _build(src, src_layout, dst, dst_layout)
    _plans.setdefault(src, {})[key] = plan
    if _by_ids.get(ids) is None:
        weakref.finalize(src, _by_ids.pop, ids, None)
        weakref.finalize(src, LAST_BY_SRC.pop, ids[0], None)
    _by_ids[ids] = plan
    LAST_BY_SRC[ids[0]] = plan
    return plan
