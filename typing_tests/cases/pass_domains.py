"""Addresses: construction, arithmetic inside one domain, ordering and the
explicit escape to a raw int. Everything here must type-check clean and infer
exactly the asserted types; it also runs on CPU."""

from __future__ import annotations

from typing_extensions import assert_type

from pointerdomain import Device, DeviceAlias, HostVA, as_device

dev = Device("emulated", 0)
va = HostVA.unsafe_from_int(0x1000)
alias = DeviceAlias.unsafe_from_int(0x7F00_0000, dev)

# Construction and the raw value (the only way out to an int is .value).
assert_type(va, HostVA)
assert_type(alias, DeviceAlias)
assert_type(va.value, int)
assert_type(alias.value, int)
assert_type(alias.device, Device)
assert_type(as_device("emulated:1"), Device)
assert_type(as_device("cpu"), Device)
assert_type(dev.ordinal, int)

# addr + nbytes and addr - nbytes keep the domain (and, for aliases, the device).
assert_type(va + 64, HostVA)
assert_type(va - 64, HostVA)
assert_type(va.offset(64), HostVA)
assert_type(alias + 64, DeviceAlias)
assert_type(alias - 64, DeviceAlias)
assert_type(alias.offset(64), DeviceAlias)
assert (alias + 64).device == dev

# A distance exists only inside one domain.
assert_type(va.offset(4096) - va, int)
assert_type((alias + 4096) - alias, int)
assert (va + 4096) - va == 4096

# Ordering and equality inside one domain.
assert_type(va < va + 1, bool)
assert_type(alias >= alias, bool)
assert_type(va == HostVA.unsafe_from_int(0x1000), bool)
assert va == HostVA.unsafe_from_int(0x1000) and va != va + 1
assert sorted([va + 8, va]) == [va, va + 8]
assert_type(sorted([va + 8, va]), list[HostVA])
assert_type(max(alias, alias + 8), DeviceAlias)

# Addresses are hashable values (frozen dataclasses).
seen: dict[HostVA, str] = {va: "pool"}
assert_type(seen[HostVA.unsafe_from_int(0x1000)], str)
