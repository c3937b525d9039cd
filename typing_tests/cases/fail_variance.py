"""PointerTable is invariant in its domain: a PointerTable[HostVA] is not a
PointerTable[Address] (widening would let an inline call into a base-typed
parameter accept either domain), and a PointerTable[Address] is not a
PointerTable[HostVA]. Both directions together lock invariance in."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pointerdomain import Address, DeviceAlias, HostVA, PointerTable, host_ptr_table, make_kernel_ptr_table


def takes_any_domain(table: PointerTable[Address]) -> None: ...


def takes_host(table: PointerTable[HostVA]) -> None: ...


def takes_kernel(table: PointerTable[DeviceAlias]) -> None: ...


def takes_many(tables: Sequence[PointerTable[Address]]) -> None: ...


def widening(host: PointerTable[HostVA], kernel: PointerTable[DeviceAlias], base: PointerTable[Address]) -> None:
    # Covariance refused: a variable, a call with a variable, an inline call.
    a: PointerTable[Address] = host  # type: ignore[assignment]
    b: PointerTable[Address] = kernel  # type: ignore[assignment]
    takes_any_domain(host)  # type: ignore[arg-type]
    takes_any_domain(kernel)  # type: ignore[arg-type]
    takes_any_domain(host_ptr_table([torch.zeros(4)]))  # type: ignore[arg-type]
    takes_any_domain(make_kernel_ptr_table([torch.zeros(4)], "cuda:0"))  # type: ignore[arg-type]
    # ... also inside a covariant container.
    takes_many([host])  # type: ignore[list-item]
    many: list[PointerTable[Address]] = [host, kernel]  # type: ignore[list-item]
    # Contravariance refused: a base table is neither domain.
    c: PointerTable[HostVA] = base  # type: ignore[assignment]
    takes_host(base)  # type: ignore[arg-type]
    takes_kernel(base)  # type: ignore[arg-type]
    # The two domains never convert into each other.
    d: PointerTable[DeviceAlias] = host  # type: ignore[assignment]
    takes_host(kernel)  # type: ignore[arg-type]
    takes_kernel(host_ptr_table([torch.zeros(4)]))  # type: ignore[arg-type]
    del a, b, c, d, many


def returns_base(host: PointerTable[HostVA]) -> PointerTable[Address]:
    return host  # type: ignore[return-value]


def returns_kernel() -> PointerTable[DeviceAlias]:
    return host_ptr_table([torch.zeros(4)])  # type: ignore[return-value]


# The domain must be an address type.
bad: PointerTable[int]  # type: ignore[type-var]
