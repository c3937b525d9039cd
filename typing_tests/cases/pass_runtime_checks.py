"""What the types cannot express, and the runtime check that catches it.

Every statement below type-checks clean (the static types are asserted) and
raises at runtime, before any kernel launch or runtime call:

* which device an alias or kernel table belongs to (``DeviceAlias`` and
  ``PointerTable[DeviceAlias]`` have no device parameter): DeviceMismatchError;
* what kind of memory a ``torch.Tensor`` is (host, registered, device): DomainError;
* whether a registration is still open: ClosedError / NotRegisteredError;
* values that bypass the types on purpose: ``typing.cast``, untyped dicts / JSON.
"""

from __future__ import annotations

from typing import Any, cast

import pydantic
import torch
from _support import DEVICE, OTHER_DEVICE, raises, slots, small_layout
from typing_extensions import assert_type

from pointerdomain import (
    BufferInfo,
    Device,
    DeviceAlias,
    DeviceKVPool,
    HostKVPool,
    HostVA,
    PointerTable,
    alloc_registered,
    buffer_infos,
    device_empty,
    host_ptr_table,
    make_kernel_ptr_table,
    resolve_alias,
    transfer_kv_all_layer,
)
from pointerdomain.errors import ClosedError, DeviceMismatchError, DomainError, NotRegisteredError

dev0, dev1 = Device("emulated", 0), Device("emulated", 1)
a0 = DeviceAlias.unsafe_from_int(0x10_0000, dev0)
a1 = DeviceAlias.unsafe_from_int(0x10_0000, dev1)

# 1. Aliases of two devices have the same static type: subtraction and ordering
#    type-check, and raise DeviceMismatchError.
with raises(DeviceMismatchError, "emulated:0 and emulated:1"):
    assert_type(a0 - a1, int)
with raises(DeviceMismatchError):
    assert_type(a0 < a1, bool)
assert a0 != a1  # equality compares the device too (no error: they are simply different)

# 2. Kernel tables of two devices: both PointerTable[DeviceAlias]; the launch refuses.
layout = small_layout("layer_first")
pool0 = DeviceKVPool(layout, DEVICE)
pool1 = DeviceKVPool(layout, OTHER_DEVICE)
assert_type(pool1.table, PointerTable[DeviceAlias])
with raises(DeviceMismatchError, "src table is for emulated:0 but dst table is for emulated:1"):
    transfer_kv_all_layer(pool0.table, pool1.table, slots(0), slots(0), src_layout=layout, dst_layout=layout)

# 3. Device memory of one device in a kernel table for another.
other_mem = device_empty((64,), torch.uint8, OTHER_DEVICE)
with raises(DeviceMismatchError, "device memory of emulated:1"):
    make_kernel_ptr_table([other_mem], DEVICE)

# 4. A tensor's memory kind is not in its type: device memory in a host table,
#    unregistered host memory in a kernel table.
with raises(DomainError, "is not host memory"):
    assert_type(host_ptr_table([other_mem]), PointerTable[HostVA])
with raises(DomainError, "unregistered host memory"):
    assert_type(make_kernel_ptr_table([torch.zeros(64)], DEVICE), PointerTable[DeviceAlias])

# 5. Registration state: resolving an unregistered VA, launching on closed memory.
with raises(NotRegisteredError):
    assert_type(resolve_alias(HostVA.unsafe_from_int(torch.zeros(64).data_ptr()), DEVICE), DeviceAlias)
host_pool = HostKVPool(small_layout("page_first"), DEVICE)
host_pool.close()
with raises(ClosedError):
    host_pool.backup(pool0, slots(0), slots(0))

# 6. cast() silences the checker; the launch and metadata checks still hold.
with alloc_registered(4096, DEVICE) as memory:
    host = host_ptr_table([memory.tensor])
    kernel = make_kernel_ptr_table([memory.tensor], DEVICE)
    with raises(DomainError, "PointerTable[HostVA] reached a kernel launch"):
        transfer_kv_all_layer(
            cast(PointerTable[DeviceAlias], host), kernel, slots(0), slots(0), src_layout=layout, dst_layout=layout
        )
    with raises(DomainError, "metadata needs a PointerTable[HostVA]"):
        buffer_infos(cast(PointerTable[HostVA], kernel), 64)

# 7. Untyped data (a dict, JSON) reaches a HostVA field only through validation.
untyped: dict[str, Any] = {"address": a0, "nbytes": 64, "item_bytes": 64}
with raises(pydantic.ValidationError):
    BufferInfo.model_validate(untyped)
with raises(pydantic.ValidationError):
    BufferInfo.model_validate({"address": -1, "nbytes": 64, "item_bytes": 64})
with raises(pydantic.ValidationError):
    BufferInfo.model_validate_json('{"address": "0x1000", "nbytes": 64, "item_bytes": 64}')
