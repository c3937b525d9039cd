"""Pointer tables: the two builders return tables of their domain, indexing and
iteration keep it, and code generic over the domain keeps it too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from _support import DEVICE
from typing_extensions import assert_type

from pointerdomain import (
    Address,
    Device,
    DeviceAlias,
    HostVA,
    PointerTable,
    alloc_registered,
    device_empty,
    host_ptr_table,
    make_kernel_ptr_table,
    register_host_tensor,
    resolve_alias,
)

D = TypeVar("D", bound=Address)

with alloc_registered(1 << 16, DEVICE) as memory:
    halves = [memory.tensor[: 1 << 15], memory.tensor[1 << 15 :]]

    kernel = make_kernel_ptr_table(halves, DEVICE)
    host = host_ptr_table(halves)
    assert_type(kernel, PointerTable[DeviceAlias])
    assert_type(host, PointerTable[HostVA])

    # Entries keep the table's domain.
    assert_type(kernel[0], DeviceAlias)
    assert_type(host[0], HostVA)
    assert_type(list(kernel), list[DeviceAlias])
    assert_type([a.value for a in host], list[int])
    assert_type(kernel.domain, type[DeviceAlias])
    assert_type(host.domain, type[HostVA])
    assert_type(kernel.device, Device)  # a kernel table always has a device
    assert_type(host.device, None)
    assert_type(host.sizes, tuple[int, ...])
    assert_type(kernel.as_uint64_tensor(), torch.Tensor)
    assert_type(kernel.kernel_table_address(), int)
    assert kernel.as_uint64_tensor().data_ptr() != kernel.kernel_table_address()  # a copy, never the table itself
    assert kernel.domain is DeviceAlias and host.domain is HostVA
    assert host.device is None and kernel.device == Device("emulated", 0)

    # The host VA of an entry resolves to the alias the kernel table holds.
    assert_type(resolve_alias(host[1], DEVICE), DeviceAlias)
    assert resolve_alias(host[1], DEVICE) == kernel[1]
    assert_type(memory.host_va, HostVA)
    assert host[0] == memory.host_va

    # Device memory builds kernel tables too (its own address is the alias).
    on_device = make_kernel_ptr_table([device_empty((8, 64), torch.float16, DEVICE)], DEVICE)
    assert_type(on_device, PointerTable[DeviceAlias])

    # Generic code over the domain keeps the caller's domain (no widening).
    def first(table: PointerTable[D]) -> D:
        return table[0]

    def bases(tables: Sequence[PointerTable[D]]) -> list[D]:
        return [t[0] for t in tables]

    assert_type(first(host), HostVA)
    assert_type(first(kernel), DeviceAlias)
    assert_type(bases([host, host]), list[HostVA])
    assert first(host) == host[0]

    # A base-typed *address* is fine to hold (e.g. for logging); it cannot reach
    # an API, which all take HostVA or DeviceAlias (see fail_variance.py).
    def describe(address: Address) -> str:
        return f"{type(address).__name__}({address.value:#x})"

    assert_type(describe(host[0]), str)
    assert describe(kernel[0]).startswith("DeviceAlias(")

    # What the per-launch liveness check compares: the storages' recorded spans, as ints.
    assert_type(kernel.storages_intact(), bool)
    assert_type(kernel.storage_spans(), tuple[tuple[int, int], ...])
    assert kernel.storages_intact() and all(end > start for start, end in kernel.storage_spans())
    # What a custom kernel's boundary asks: pinned, and registered in this process.
    assert_type(kernel.check_kernel_readable(), None)
    assert_type(kernel.check_this_process(), None)


# A registered tensor that released its storage resolves nothing (ClosedError at run time).
_released = torch.zeros(1 << 16, dtype=torch.uint8)
_reg = register_host_tensor(_released, DEVICE)
assert_type(_reg.backing_released(), bool)
assert not _reg.backing_released()
_released.untyped_storage().resize_(0)
assert _reg.backing_released()
_reg.close()
