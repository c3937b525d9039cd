"""Addresses of the two domains do not mix: no cross-domain arithmetic,
comparison or assignment, no address + address, and no implicit int in either
direction (no __int__ / __index__; the raw value is .value)."""

from __future__ import annotations

import operator

from pointerdomain import Device, DeviceAlias, HostVA


def arithmetic(va: HostVA, alias: DeviceAlias) -> None:
    # Cross-domain distance.
    va - alias  # type: ignore[operator]
    alias - va  # type: ignore[operator]
    # address + address, in one domain or across.
    va + va  # type: ignore[operator]
    alias + alias  # type: ignore[operator]
    va + alias  # type: ignore[operator]
    # offset() takes a byte count only.
    va.offset(alias)  # type: ignore[arg-type]
    alias.offset(va)  # type: ignore[arg-type]
    # int + address (no __radd__), scaling, a float offset.
    1 + va  # type: ignore[operator]
    va * 2  # type: ignore[operator]
    va + 1.5  # type: ignore[operator]


def comparison(va: HostVA, alias: DeviceAlias) -> None:
    # Ordering across domains, or against an int.
    va < alias  # type: ignore[operator]
    alias >= va  # type: ignore[operator]
    va <= 0x1000  # type: ignore[operator]
    # Equality across domains or against an int (strict_equality).
    va == alias  # type: ignore[comparison-overlap]
    alias != va  # type: ignore[comparison-overlap]
    va == 0x1000  # type: ignore[comparison-overlap]
    va in [alias]  # type: ignore[comparison-overlap]


def assignment(va: HostVA, alias: DeviceAlias) -> None:
    a: HostVA = alias  # type: ignore[assignment]
    b: DeviceAlias = va  # type: ignore[assignment]
    c: HostVA = 0x1000  # type: ignore[assignment]
    d: int = va  # type: ignore[assignment]
    e: DeviceAlias = va + 64  # type: ignore[assignment]
    # Frozen: an address never changes in place.
    va.value = 0x2000  # type: ignore[misc]
    # A dict keyed by host VAs is not indexed by an alias.
    by_va: dict[HostVA, int] = {va: 1}
    by_va[alias]  # type: ignore[index]
    del a, b, c, d, e


def plain_int(va: HostVA, alias: DeviceAlias, device: Device) -> None:
    # Construction: an int, and only an int (re-wrapping needs .value, explicitly).
    HostVA.unsafe_from_int(alias)  # type: ignore[arg-type]
    DeviceAlias.unsafe_from_int(va, device)  # type: ignore[arg-type]
    DeviceAlias.unsafe_from_int(0x1000)  # type: ignore[call-arg]
    HostVA.unsafe_from_int(0x1000, device)  # type: ignore[call-arg]
    DeviceAlias.unsafe_from_int(0x1000, "cuda:0")  # type: ignore[arg-type]
    Device("rocm", 0)  # type: ignore[arg-type]
    # No implicit conversion to int: __int__, __index__, format as hex.
    int(va)  # type: ignore[call-overload]
    operator.index(alias)  # type: ignore[arg-type]
    hex(va)  # type: ignore[arg-type]
    [0, 1][va]  # type: ignore[call-overload]
    range(va)  # type: ignore[call-overload]
