"""The extension's stub (src/pointerdomain/_C.pyi, from nanobind's stubgen):
raw ints only, exact arity; an address object, a table, a tensor where an int
is taken, or a missing / extra argument is a static error. The library's own
calls (pointerdomain._platform) are checked against the same stub by
``mypy --strict src``; fail_platform.py checks the layer above it."""

from __future__ import annotations

import torch

from pointerdomain import DeviceAlias, HostVA, PointerTable, _C


def stub(va: HostVA, alias: DeviceAlias, table: PointerTable[DeviceAlias], geometry: tuple[int, ...], idx: torch.Tensor) -> None:
    # Address objects where the binding takes the raw int (use .value).
    _C.emu_register(va, 4096)  # type: ignore[arg-type]
    _C.emu_unregister(va)  # type: ignore[arg-type]
    _C.emu_get_device_pointer(va)  # type: ignore[arg-type]
    _C.emu_device_lookup(alias, 64)  # type: ignore[arg-type]
    _C.gpu_host_register(va, 4096, 0)  # type: ignore[arg-type]
    _C.gpu_host_unregister(va, 0)  # type: ignore[arg-type]
    _C.gpu_host_get_device_pointer(va, 0)  # type: ignore[arg-type]
    _C.gpu_pointer_is_host(alias)  # type: ignore[arg-type]
    plan = _C.KernelPlan(0, geometry, 0, geometry, 1, 2, 64, 16)
    # A table or a tensor where the binding takes the table's address (an int).
    _C.KernelPlan(table, geometry, 0, geometry, 1, 2, 64, 16)  # type: ignore[arg-type]
    _C.cpu_transfer(plan, idx, 0, 1, 0, 1, 1)  # type: ignore[arg-type]
    _C.gpu_transfer(plan, table.as_uint64_tensor(), 0, 1, 0, 1, 0, 0, 0)  # type: ignore[arg-type]
    _C.cpu_copy_runs(table, 0, 0, 1)  # type: ignore[arg-type]
    # A geometry is a sequence of ints; a launch takes the bound plan, not loose geometry.
    _C.KernelPlan(0, "geometry", 0, geometry, 1, 2, 64, 16)  # type: ignore[arg-type]
    _C.cpu_transfer(geometry, 0, 0, 1, 0, 1, 1)  # type: ignore[arg-type]
    # The device is an ordinal, not an alias.
    _C.gpu_multiprocessor_count(alias)  # type: ignore[arg-type]
    _C.emu_device_alloc(4096, alias)  # type: ignore[arg-type]
    # Wrong arity: a missing device, an extra argument, the CPU call with the GPU's arguments.
    _C.gpu_host_get_device_pointer(va.value)  # type: ignore[call-arg]
    _C.emu_register(va.value, 4096, 0)  # type: ignore[call-arg]
    _C.cpu_transfer(plan, 0, 0, 1, 0, 1, 0, 0, 0)  # type: ignore[call-arg]
    _C.gpu_transfer(plan, 0, 0, 1, 0, 1, 1)  # type: ignore[call-arg]
    # Results are raw: a status tuple is not a status, an int is not an address.
    status: int = _C.emu_register(va.value, 4096)  # type: ignore[assignment]
    mapped: DeviceAlias = _C.emu_get_device_pointer(va.value)[1]  # type: ignore[assignment]
    # No such binding.
    _C.emu_alias_of(va.value)  # type: ignore[attr-defined]
    del status, mapped
