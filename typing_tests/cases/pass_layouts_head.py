"""sglang's page_head and page_unified host layouts: their kinds and head_groups are
typed fields, byte offsets are ints, and a host pool's item address is a HostVA."""

from __future__ import annotations

import torch
from _support import DEVICE, raises, slots, small_layout
from typing_extensions import assert_type

from pointerdomain import DeviceKVPool, HostKVPool, HostVA, KVLayout, errors
from pointerdomain.layouts import LayoutKind, Lowering, lower_pair

head = small_layout("page_head")
unified = small_layout("layer_first").replace(kind="page_unified", head_groups=2)
assert_type(head.kind, LayoutKind)
assert_type(unified.head_groups, int)
assert_type(head.item_parts, int)
assert_type(head.part_layout(), KVLayout)
assert head.item_parts == 2 and unified.item_parts == 2 and head.part_bytes == 16

assert_type(head.byte_offset(1, 0, 1, token=2), int)
assert_type(head.item_spans(1, 0, 1), list[tuple[int, int]])
with raises(errors.InvalidTypeError, "bool"):
    head.byte_offset(True, 0, 0)

lowering = lower_pair(small_layout(), head)
assert_type(lowering, Lowering | None)
assert lowering is not None and lowering.parts == 2 and lowering.dst.kind == "page_first"
assert lower_pair(small_layout(), small_layout("page_first")) is None

with HostKVPool(head, DEVICE) as host:
    va = host.host_va(3, 1, 0, token=1)
    assert_type(va, HostVA)
    assert va == HostVA.unsafe_from_int(host.buffer[0, 3, 0, 1, 1].data_ptr())
    device = DeviceKVPool(small_layout(), DEVICE)
    for buffer in device.buffers:
        buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float16).view(buffer.shape))
    host.backup(device, slots(5), slots(13))
    assert torch.equal(host.buffer[0, 3, :, 1, 0], device.buffer(0, 0)[5])
