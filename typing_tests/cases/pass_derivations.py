"""Every derivation of a public model is validated; the typed spellings type-check.
Runs on the emulated device."""

from __future__ import annotations

from typing import Any

from _support import raises, small_layout
from typing_extensions import assert_type

from pointerdomain import BufferInfo, BufferInfoChanges, Device, DeviceAlias, HostVA, KVLayout
from pointerdomain.adapters import nixl
from pointerdomain.audit import AuditConfig
from pointerdomain.errors import InvalidArgumentError, MetadataValidationError

va = HostVA.unsafe_from_int(0x10_0000)
alias = DeviceAlias.unsafe_from_int(0x20_0000, Device("emulated", 0))
info = BufferInfo(address=va, nbytes=128, item_bytes=64)

assert_type(info.replace(nbytes=64), BufferInfo)
assert_type(info.replace(address=va + 64, nbytes=64), BufferInfo)
assert info.replace(address=va + 64, nbytes=64) == BufferInfo(address=va + 64, nbytes=64, item_bytes=64)
assert_type(info.model_copy(), BufferInfo)
assert_type(info.model_copy(deep=True), BufferInfo)
assert info.model_copy() == info
layout = small_layout()
assert_type(layout.model_copy(), KVLayout)
assert_type(layout.replace(num_pages=8), KVLayout)
changes: BufferInfoChanges = {"nbytes": 64}
assert_type(info.replace(**changes), BufferInfo)
config = AuditConfig()
assert_type(config.model_copy(), AuditConfig)

# untyped code still reaches model_copy(update=...): validated like a new model
untyped: Any = info
with raises(MetadataValidationError, "instance of HostVA"):
    untyped.model_copy(update={"address": alias})
with raises(MetadataValidationError, "greater than 0"):
    untyped.model_copy(update={"nbytes": -1})
with raises(MetadataValidationError, "Extra inputs are not permitted"):
    untyped.model_copy(update={"adress": va})
with raises(MetadataValidationError, "greater than 0"):
    info.replace(nbytes=-1)

# a range past 2**64 is refused where it is built
top = HostVA.unsafe_from_int(2**64 - 64)
with raises(MetadataValidationError, "runs past 2**64"):
    BufferInfo(address=top, nbytes=128, item_bytes=64)
assert_type(BufferInfo(address=top, nbytes=64, item_bytes=64), BufferInfo)
with raises(InvalidArgumentError, "runs past 2**64"):
    nixl.dram_desc(HostVA.unsafe_from_int(2**64 - 8), 64)
assert_type(nixl.dram_desc(top, 64), nixl.NixlDesc)
