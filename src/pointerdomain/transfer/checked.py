"""Checked mode: before a launch, every address the launch will use is looked up
in the registry of known registrations and device allocations.

Off by default; on with ``POINTERDOMAIN_CHECKED=1`` in the environment (read at
import), :func:`set_enabled`, or for a block with :func:`checked_mode`. The
launch functions call :func:`verify_launch` after their own argument checks
(table domain and device, open registrations, layouts, index dtype/shape/range)
and before the kernel; it does not repeat those: it verifies the call the backend is
about to receive (its :class:`~pointerdomain._platform.LaunchArgs` name the checked index
tensors, their slot count, a layer range of the layouts, the plan's device; the plan is
the tables' own) and then the addresses it will use.

What it checks, for the ``src`` and the ``dst`` table:

1. **The addresses the kernel will read.** On an emulated device that is the
   table's ``uint64`` tensor itself (it lives in CPU-readable memory), and it must
   still equal the addresses the table was built with (an overwrite of the
   table's own array is caught: a stray write from native code; ``as_uint64_tensor()`` is a copy).
   On CUDA it is the table's host copy of the same values: reading the device copy
   would synchronise the GPU.
2. **Every entry is looked up**, for each table, in

   * the registrations the table holds: each must still be open and in
     :mod:`pointerdomain.registration.memory`'s registry (``find_registration``), and each of
     its chunks is taken in **device-alias space**: the alias of the chunk is asked
     of the backend again at every launch (``emu_get_device_pointer`` /
     ``cudaHostGetDevicePointer``; the host VA itself under the host-pointer
     fallback), so a range unregistered behind pointerdomain's back is seen.
     Registrations are portable (``cudaHostRegisterPortable``): memory registered
     for any device of the launch's device type is accepted;
   * the device allocations the table keeps alive: for an emulated device each is
     looked up in the emulated backend's allocation registry (``emu_device_lookup``,
     which gives its ordinal), for CUDA it is the storage of a kept CUDA tensor and
     its ordinal (no caching-allocator query, no sync): a CUDA table's entries were
     built from exactly those tensors;
   * on CUDA only, host memory pinned by the runtime itself (``pin_memory()``)
     that a kept CPU tensor holds (the one kind of host memory tables accept
     without a pointerdomain registration).

   An entry must lie inside one of these regions, all of the **device-alias
   domain of the launch's device**. Memory the table does not hold is refused even
   if it is valid elsewhere (it could be closed or freed under the launch). Anything
   else is an error naming the table, the entry, the domain found (a host VA of
   registered memory, another device's memory, the alias of a registration the
   table does not hold, unregistered host memory, unknown memory), the domain
   expected, and the fix; the diagnosis of a miss looks through the whole registry.
3. **Every page the launch touches** lies inside the region of the entry the
   kernel reaches it through. The pages come from the index tensors on an
   emulated device (exact, the indices are CPU tensors); on CUDA every page of the
   layout is taken (a superset) so that the indices, which live on the GPU, are
   never read: checked mode adds no synchronisation to the one the range check
   already does. The addresses are recomputed from the geometry the kernel uses
   (``item_address`` in ``transfer.h``): each dimension feeds either the entry or
   the offset, so the touched entries are the products of the touched leading
   coordinates and, inside each, the hull of the touched pages is one interval
   from the extreme ``(kv, layer, page)``; it must lie inside the entry's region.

A launch lowered to per-part items (``page_head``, ``page_unified`` with head groups:
:func:`pointerdomain.layouts.lower_pair`) is verified as the kernels run it: with the
plan's lowered layouts and geometries and the parts' slots.

Errors (all raised before anything is copied):

* :class:`~pointerdomain.errors.DomainError`: a host VA, unregistered host memory
  or unknown memory in a kernel table; a modified table tensor.
* :class:`~pointerdomain.errors.DeviceMismatchError`: memory of another device.
* :class:`~pointerdomain.errors.NotRegisteredError`: a registration the table
  uses was unregistered outside pointerdomain.
* :class:`~pointerdomain.errors.RegistrationSpanError`: a touched page runs past
  its registration chunk (chunks' aliases are not contiguous).
* :class:`~pointerdomain.errors.LayoutError`: a touched page runs past its device
  allocation.
* :class:`~pointerdomain.errors.ClosedError`: a registration was closed.

Cost: see ``docs/reliability.md`` (measured by ``benchmarks/checked_mode_cost.py``).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from pointerdomain.arguments import describe
from pointerdomain import env

from pointerdomain._platform import backend_for, device_holding, memory_device, pointer_info
from pointerdomain.devices import Device
from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain.errors import (
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    LayoutError,
    NotRegisteredError,
    PointerDomainError,
    RegistrationSpanError,
)
from pointerdomain.errors import with_address
from pointerdomain.registration.memory import RegisteredHostMemory, find_registration, open_registrations
from pointerdomain.registration.resolve import AliasPolicy, cached_policy

if TYPE_CHECKING:
    from pointerdomain._platform import LaunchArgs
    from pointerdomain.layouts import Geometry, KVLayout
    from pointerdomain.transfer.plan import TransferPlan
    from pointerdomain.registration.tables import PointerTable

__all__ = ["checked_mode", "enabled", "set_enabled", "verify_launch"]

_enabled = env.flag(env.CHECKED)
_state_lock = threading.Lock()

_FIX_BUILD = (
    "build kernel tables only with make_kernel_ptr_table(tensors, device) (it resolves device aliases) and "
    "never write over a table's array from native code (as_uint64_tensor() is a copy)"
)


def enabled() -> bool:
    """Whether checked mode is on."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn checked mode on or off for this process (all threads).

    Raises:
        InvalidArgumentError: ``on`` is not a bool.
    """
    global _enabled
    if type(cast(object, on)) is not bool:
        from pointerdomain.errors import InvalidArgumentError

        raise InvalidArgumentError(f"on: found {describe(on)}, expected a bool (True or False). Fix: pass True or False")
    with _state_lock:
        _enabled = bool(on)


@contextlib.contextmanager
def checked_mode(on: bool = True) -> Iterator[None]:
    """Turn checked mode on (or off) for a block; the previous setting comes back on exit.

    The setting is process-wide: other threads see it while the block runs.
    """
    global _enabled
    with _state_lock:
        previous = _enabled
        _enabled = bool(on)
    try:
        yield
    finally:
        with _state_lock:
            _enabled = previous


class _Region(NamedTuple):
    """A range of addresses a kernel on ``device`` may use, in device-alias space."""

    lo: int
    hi: int
    kind: str  # "registered" | "device" | "pinned"
    device: Device
    owner: RegisteredHostMemory | None = None
    chunk: int = 0
    chunks: int = 1

    def describe(self) -> str:
        if self.kind == "registered":
            assert self.owner is not None
            return (
                f"chunk {self.chunk + 1}/{self.chunks} of host memory registered for {self.device} "
                f"(HostVA {self.owner.host_va.value:#x}, +{self.owner.nbytes} bytes), device-alias range "
                f"[{self.lo:#x}, {self.hi:#x})"
            )
        if self.kind == "pinned":
            return f"runtime-pinned host memory, device-alias range [{self.lo:#x}, {self.hi:#x})"
        return f"device memory of {self.device} [{self.lo:#x}, {self.hi:#x})"


def _expected(device: Device) -> str:
    return (
        f"a DeviceAlias for {device}: the device alias of registered host memory or device memory of {device}"
    )


class _Regions:
    """The regions one table's entries may point into on ``device``, sorted by address:
    the registration chunks the table holds (in alias space) and the device
    allocations it keeps alive."""

    def __init__(self, device: Device, name: str, table: PointerTable[DeviceAlias]) -> None:
        self.device = device
        self.other: list[_Region] = []  # allocations of other devices (for the diagnosis only)
        found: list[_Region] = []
        for owner in table.registrations():
            owner.check_open()
            if find_registration(owner.host_va, owner.nbytes) is not owner:
                raise NotRegisteredError(
                    f"checked mode: the {name} table uses host memory registered at {owner.host_va!r} "
                    f"(+{owner.nbytes} bytes) that is no longer in pointerdomain's registry. Found: no registration; "
                    "expected: an open registration. Fix: keep the RegisteredHostMemory open while tables use it"
                )
            chunks, odev = owner.chunks, owner.device
            lookup = _alias_lookup(device)
            for k, chunk in enumerate(chunks):
                # unpinned memory is read by the copy engine at its host VA; strict: the registered mapping
                alias = chunk.host_va.value if not owner.kernel_readable else lookup(chunk.registered_address)
                if alias is None:
                    raise NotRegisteredError(
                        f"checked mode: the {name} table uses host memory registered at {owner.host_va!r} "
                        f"(+{owner.nbytes} bytes; chunk {k + 1}/{len(owner.chunks)} at {chunk.host_va!r}) that "
                        "pointerdomain holds open, but the backend reports that chunk not registered: it was "
                        "unregistered outside pointerdomain (a double unregister). Found: no device alias; "
                        f"expected: a registered range with a DeviceAlias for {device}. Fix: unregister only "
                        "through RegisteredHostMemory.close(), then re-register and rebuild the table"
                    )
                found.append(_Region(alias, alias + chunk.nbytes, "registered", odev, owner, k, len(chunks)))
        for lo, hi, kind in table.resolved_regions():  # a raw table's ranges, checked when it was resolved
            if kind == "device":  # still one allocation of this device? (freed under a cached table: refused)
                info = pointer_info(device, lo)
                if info is None or info.kind != "device" or not info.start <= lo < hi <= info.start + info.size:
                    raise with_address(DomainError(
                        f"checked mode: the {name} table was resolved from raw addresses into device memory "
                        f"[{lo:#x}, {hi:#x}) of {device} that is no longer one allocation there (freed or "
                        "reallocated since the table was resolved). Found: no such allocation; expected: the "
                        "device memory the table was resolved into. Fix: keep the buffers alive while their "
                        "addresses are in use, and rebuild the engine's table after reallocating them"
                    ), lo)
            found.append(_Region(lo, hi, kind, device))
        seen: set[int] = set()
        for t in table.kept_tensors():
            storage = t.untyped_storage()
            lo = int(storage.data_ptr())
            if lo in seen:
                continue
            seen.add(lo)
            region = _device_region(t, lo, max(int(storage.nbytes()), 1), device)
            if region is not None:
                (found if region.device == device else self.other).append(region)
        found.sort(key=lambda r: r.lo)
        self.regions = found
        self._los = [r.lo for r in found]

    def find(self, value: int) -> _Region | None:
        i = bisect.bisect_right(self._los, value) - 1
        while i >= 0:
            region = self.regions[i]
            if value < region.hi:
                return region
            if i == 0 or self.regions[i - 1].hi <= value:
                return None
            i -= 1
        return None

    def diagnose(self, name: str, table: PointerTable[DeviceAlias], i: int, value: int) -> PointerDomainError:
        """The error for an entry found in no region of the launch's device."""
        head = f"checked mode: {name} table entry {i} (of {len(table)}) holds address {value:#x}"
        want = _expected(self.device)
        for region in self.other:
            if region.lo <= value < region.hi:
                return DeviceMismatchError(
                    f"{head}, found: {region.describe()}; expected: {want}. Fix: build the table for the device "
                    "whose memory it holds, or copy the data to that device first"
                )
        where = device_holding(value, 1)
        if where is not None:
            if where == self.device:
                return DomainError(
                    f"{head}, found: device memory of {where} that this table does not keep alive (not one of "
                    f"its tensors); expected: {want} that the table holds. Fix: {_FIX_BUILD}"
                )
            return DeviceMismatchError(
                f"{head}, found: device memory of {where}; expected: {want}. Fix: build the table for {where}, "
                f"or copy the data to {self.device} first"
            )
        for region in _registry_alias_regions(self.device):
            if region.lo <= value < region.hi:
                return DomainError(
                    f"{head}, found: the device alias of {region.describe()}, a registration this table does not "
                    f"hold (it can be closed under the launch); expected: {want} of memory the table holds. "
                    f"Fix: {_FIX_BUILD}"
                )
        owner = find_registration(HostVA.unsafe_from_int(value))
        if owner is not None and not owner.device.same_type(self.device):
            return DeviceMismatchError(
                f"{head}, found: host memory registered for {owner.device} (at {owner.host_va!r}, +{owner.nbytes} "
                f"bytes), not for a {self.device.type} device; expected: {want}. Fix: register the memory for "
                f"{self.device} and build the table with make_kernel_ptr_table(tensors, {str(self.device)!r})"
            )
        if owner is not None:
            return DomainError(
                f"{head}, found: a HostVA (a CPU address) inside host memory registered at {owner.host_va!r} "
                f"(+{owner.nbytes} bytes) for {owner.device}; expected: {want}. A kernel must never read a host "
                f"VA (it is not a device address where CanUseHostPointerForRegisteredMem is 0). Fix: {_FIX_BUILD}"
            )
        for t in table.kept_tensors():
            if t.is_cpu:
                storage = t.untyped_storage()
                if storage.data_ptr() <= value < storage.data_ptr() + storage.nbytes():
                    return DomainError(
                        f"{head}, found: a HostVA of unregistered host memory (a tensor this table keeps); "
                        f"expected: {want}. Fix: allocate the buffer with alloc_registered or register it with "
                        "register_host_tensor, then rebuild the table"
                    )
        return DomainError(
            f"{head}, found: an address in no open registration and no device allocation this table keeps "
            f"(unknown or freed memory); expected: {want}. Fix: {_FIX_BUILD}, and keep the memory registered "
            "while tables use it"
        )


def _registry_alias_regions(device: Device) -> list[_Region]:
    """Alias ranges of every open registration for ``device``'s type (diagnosis only)."""
    regions: list[_Region] = []
    lookup = _alias_lookup(device)
    for owner in open_registrations():
        if not owner.device.same_type(device):
            continue
        for k, chunk in enumerate(owner.chunks):
            # unpinned memory is read by the copy engine at its host VA; strict: the registered mapping
            alias = chunk.host_va.value if not owner.kernel_readable else lookup(chunk.registered_address)
            if alias is not None:
                regions.append(_Region(alias, alias + chunk.nbytes, "registered", owner.device, owner, k, len(owner.chunks)))
    return regions


def _alias_lookup(device: Device) -> Callable[[int], int | None]:
    """``va -> alias or None`` for registered host addresses on ``device``: asked of the
    backend again (so a range unregistered behind pointerdomain's back is seen); the
    host VA itself under the host-pointer fallback. Never counts as a resolver fallback."""
    try:
        policy = cached_policy(device)
    except PointerDomainError:
        return lambda va: None
    if policy is AliasPolicy.HOST_POINTER_FALLBACK:
        return lambda va: va
    backend = backend_for(device)

    def ask(va: int) -> int | None:
        status, alias = backend.alias(va, device)
        return alias if status == 0 else None

    return ask


def _device_region(t: torch.Tensor, lo: int, nbytes: int, device: Device) -> _Region | None:
    """The device allocation (or runtime-pinned memory) behind kept tensor ``t``, or None
    for host memory (registered host memory comes from the registry instead)."""
    where = memory_device(t, whole_storage=True)
    if where is not None:
        return _Region(lo, lo + nbytes, "device", where)
    if not t.is_cpu:
        return None
    if find_registration(HostVA.unsafe_from_int(lo)) is None and backend_for(device).pointer_is_host(lo):
        alias = _alias_lookup(device)(lo)
        if alias is not None:
            return _Region(alias, alias + nbytes, "pinned", device)
    return None


def _kernel_values(name: str, table: PointerTable[DeviceAlias], device: Device) -> list[int]:
    """The addresses the kernel will read for ``table``."""
    recorded = list(table.raw_values())
    if not backend_for(device).host_readable:
        return recorded  # the device copy: reading it would synchronise the GPU
    actual = [int(v) for v in table.as_uint64_tensor().tolist()]
    if len(actual) != len(recorded):
        raise DomainError(
            f"checked mode: the {name} table's uint64 tensor has {len(actual)} entries but the table was built "
            f"with {len(recorded)}. Fix: {_FIX_BUILD}"
        )
    return actual


def _touched_pages(indices: torch.Tensor, layout: KVLayout) -> list[int]:
    """The pages the launch touches through ``indices`` (sorted), or every page of the
    layout when the indices live on a GPU (reading them would synchronise). Slots out
    of range are skipped by the kernels and touch nothing."""
    if not indices.is_cpu:
        return list(range(layout.num_pages))
    page_size, num_pages = layout.page_size, layout.num_pages
    # The kernels skip slots outside [0, num_slots) (validate_indices=False lets them through).
    if indices.numel() <= 512:  # cheaper in Python than a few torch ops
        pages = sorted({slot // page_size for slot in indices.tolist()})
        return pages[bisect.bisect_left(pages, 0) : bisect.bisect_left(pages, num_pages)]
    q = torch.div(indices, page_size, rounding_mode="floor")
    lo, hi = (int(v) for v in torch.aminmax(q))
    if lo < 0 or hi >= num_pages:
        q = q[(q >= 0) & (q < num_pages)]
    found: list[int] = torch.bincount(q, minlength=num_pages).nonzero().view(-1).tolist()  # sorted, unique
    return found


def _verify_table(
    name: str,
    table: PointerTable[DeviceAlias],
    layout: KVLayout,
    geometry: Geometry,
    indices: torch.Tensor,
    layer_begin: int,
    layer_count: int,
    regions: _Regions,
) -> None:
    device = regions.device
    values = _kernel_values(name, table, device)
    n = len(values)
    # 2. every entry: inside a region of the launch device's alias domain
    hit: list[_Region] = []
    for i, value in enumerate(values):
        region = regions.find(value)
        if region is None:
            raise with_address(regions.diagnose(name, table, i, value), value)
        hit.append(region)
    # 1. (emulated) the tensor the kernel reads still holds what the table was built with
    if backend_for(device).host_readable:
        for i, (value, built) in enumerate(zip(values, table.raw_values())):
            if value != built:
                raise DomainError(
                    f"checked mode: {name} table entry {i} (of {n}): the kernel would read {value:#x} but the "
                    f"table was built with {built:#x} ({hit[i].describe()}); found: an address written into "
                    "the table's uint64 tensor after it was built (e.g. an alias that lost its interior offset); "
                    f"expected: the table's own {_expected(device)}. Fix: {_FIX_BUILD}"
                )
    # (before step 3: an overwritten entry is a DomainError, not a page-span error)
    # 3. every touched page: inside the region of the entry the kernel reaches it through.
    # The kernel forms  table[kv*e_kv + layer*e_layer + page*e_page]
    #                   + kv*s_kv + layer*s_layer + page*s_page + tok*s_tok  (+ item_bytes)
    # and each dimension feeds either the entry (e != 0, a leading dimension) or the
    # offset (s != 0). So the touched entries are the products of the leading
    # dimensions' touched coordinates, and inside every touched entry the touched
    # bytes' hull is [sum of min coord * s, sum of max coord * s + (page_size-1)*s_tok
    # + item_bytes): each touched page span lies in the region iff the hull does
    # (the region is one interval and the extreme (kv, layer, page) are touched).
    g = geometry
    page_size, item_bytes = layout.page_size, layout.item_bytes
    pages = _touched_pages(indices, layout)
    if not pages:
        return
    dims = (
        ("kv", list(range(layout.num_kv)), g.e_kv, g.s_kv),
        ("layer", list(range(layer_begin, layer_begin + layer_count)), g.e_layer, g.s_layer),
        ("page", pages, g.e_page, g.s_page),
    )
    if any(e and s for _, _, e, s in dims):
        raise LayoutError(f"checked mode: {name} geometry mixes entry and offset strides: {dims}")
    off_min = sum(min(coords) * s for _, coords, _, s in dims)
    end_max = sum(max(coords) * s for _, coords, _, s in dims) + (page_size - 1) * g.s_tok + item_bytes
    entries: dict[int, dict[str, int]] = {0: {}}
    for dim, coords, e, _s in dims:
        if e:
            entries = {k + c * e: {**where, dim: c} for k, where in entries.items() for c in coords}
    for e_i, where in entries.items():
        region, value = hit[e_i], values[e_i]
        low = value + off_min < region.lo
        if not low and value + end_max <= region.hi:
            continue
        pick = min if low else max
        coord = {dim: where.get(dim, pick(coords)) for dim, coords, _, _ in dims}
        a = value + sum(coord[dim] * s for dim, _, _, s in dims)
        b = a + (page_size - 1) * g.s_tok + item_bytes
        what = (
            f"checked mode: {name} table entry {e_i} (of {n}) at {value:#x}: page {coord['page']} "
            f"(kv {coord['kv']}, layer {coord['layer']}) spans [{a:#x}, {b:#x}), which is not inside "
            f"{region.describe()}"
        )
        if region.kind == "registered":
            raise with_address(RegistrationSpanError(
                f"{what}. Found: a page crossing the end of its registration chunk (aliases of separate chunks "
                "are not contiguous); expected: every touched page inside one chunk. Fix: register with a "
                "granularity that is a multiple of layout.page_block_bytes() (HostKVPool does) and give the "
                "table one entry per chunk-aligned block"
            ), a)
        raise LayoutError(
            f"{what}. Found: a page past the end of its allocation; expected: every touched page inside the "
            "buffer its entry points at. Fix: size each buffer for the layout (layout.nbytes / table length) "
            "and build the table from those buffers"
        )


def verify_launch(
    plan: TransferPlan,
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    args: LaunchArgs,
) -> None:
    """Verify the call about to be launched: that ``args`` (what the backend receives) is
    the checked call of these index tensors and ``plan`` the plan of these tables, then
    every table entry and every page the launch touches against the registry of open
    registrations and device allocations (see the module docstring), with the plan's
    geometry (``src_indices``, ``dst_indices``: the slots the kernels address, after
    :meth:`TransferPlan.expand` where the plan has a lowering).

    Called by the launch functions after their own argument checks (which it does not
    repeat), when :func:`enabled`. Reads no GPU memory (no synchronisation).

    Raises:
        DomainError: an entry that is not a device address of the launch's device
            (a host VA, unregistered or unknown memory), a modified table tensor, or
            a plan that is not the tables' own.
        DeviceMismatchError: an entry in memory of another device, or ``args`` for
            another device than the plan's.
        IndexValidationError: ``args`` names other index arrays or another slot count
            than the index tensors.
        NotRegisteredError: a registration the tables use was unregistered outside pointerdomain.
        RegistrationSpanError: a touched page crosses the end of its registration chunk.
        LayoutError: a touched page crosses the end of its device allocation, or
            ``args``' layer range is not inside the layouts.
        ClosedError: a table's registration was closed.
    """
    device = plan.device
    if args.device != device or src.device != device or dst.device != device:
        raise DeviceMismatchError(
            f"checked mode: the plan is for {device}, the launch arguments for {args.device}, the tables for "
            f"{src.device} and {dst.device}"
        )
    n = src_indices.numel()
    if args.n != n or dst_indices.numel() != n:
        raise IndexValidationError(
            f"checked mode: the launch arguments move {args.n} slot pairs but the index tensors hold {n} and "
            f"{dst_indices.numel()}"
        )
    if n and (args.src_idx != src_indices.data_ptr() or args.dst_idx != dst_indices.data_ptr()):
        raise IndexValidationError(
            f"checked mode: the launch arguments read the indices at {args.src_idx:#x} and {args.dst_idx:#x}, "
            f"not the checked index tensors at {src_indices.data_ptr():#x} and {dst_indices.data_ptr():#x}"
        )
    if not (args.layer_count >= 1 and 0 <= args.layer_begin <= plan.src_layout.num_layers - args.layer_count):
        raise LayoutError(
            f"checked mode: the launch arguments name layers [{args.layer_begin}, "
            f"{args.layer_begin + args.layer_count}) of a layout of {plan.src_layout.num_layers}"
        )
    kernel = plan.kernel
    for name, table, values, address in (("src", src, plan.src_values, kernel.src_table),
                                         ("dst", dst, plan.dst_values, kernel.dst_table)):
        if values != table.raw_values() or address != table.kernel_table_address():
            raise DomainError(f"checked mode: the launch plan's {name} table is not this {name} table. Fix: {_FIX_BUILD}")
    if tuple(kernel.src_geometry) != plan.src_geometry or tuple(kernel.dst_geometry) != plan.dst_geometry:
        raise LayoutError("checked mode: the bound launch struct's geometry differs from the plan's")
    layer_begin, layer_count = args.layer_begin, args.layer_count
    _verify_table("src", src, plan.src_layout, plan.src_geometry, src_indices, layer_begin, layer_count,
                  _Regions(device, "src", src))
    _verify_table("dst", dst, plan.dst_layout, plan.dst_geometry, dst_indices, layer_begin, layer_count,
                  _Regions(device, "dst", dst))
