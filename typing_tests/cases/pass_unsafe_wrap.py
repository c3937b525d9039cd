"""The explicit spelling that wraps a raw int: HostVA.unsafe_from_int /
DeviceAlias.unsafe_from_int, typed with their domain, with the runtime checks of the
plain constructors. Runs on the emulated device."""

from __future__ import annotations

import json
from typing import Any

import torch
from _support import raises
from typing_extensions import assert_type

from pointerdomain import BufferInfo, Device, DeviceAlias, HostVA
from pointerdomain.errors import DomainError, InvalidArgumentError, InvalidDeviceError

dev = Device("emulated", 0)
buf = torch.zeros(64, dtype=torch.uint8)

va = HostVA.unsafe_from_int(buf.data_ptr())
assert_type(va, HostVA)
assert va.value == buf.data_ptr()
alias = DeviceAlias.unsafe_from_int(0x7F00_0000, dev)
assert_type(alias, DeviceAlias)
assert alias.device == dev and alias.value == 0x7F00_0000
assert_type(HostVA.unsafe_from_int(va.value) + 8, HostVA)
assert_type(DeviceAlias.unsafe_from_int(alias.value, alias.device) - alias, int)

# the explicit spelling also takes Any (that is what makes it explicit: it says unsafe)
rows: list[Any] = json.loads("[4096, 8192]")
assert_type([HostVA.unsafe_from_int(v) for v in rows], list[HostVA])
assert HostVA.unsafe_from_int(json.loads("4096")) == HostVA.unsafe_from_int(0x1000)
info = BufferInfo(address=HostVA.unsafe_from_int(0x1000), nbytes=64, item_bytes=64)
assert_type(info.address, HostVA)

# what unsafe_from_int checks (the value, never the domain)
with raises(DomainError, "built from an int"):
    HostVA.unsafe_from_int(json.loads('"0x1000"'))
with raises(InvalidArgumentError, "outside [0, 2**64)"):
    HostVA.unsafe_from_int(-1)
with raises(InvalidArgumentError, "outside [0, 2**64)"):
    DeviceAlias.unsafe_from_int(2**64, dev)
with raises(InvalidDeviceError, "needs a Device"):
    DeviceAlias.unsafe_from_int(0x1000, json.loads('"emulated:0"'))
