"""Metadata for transfer engines and storage back-ends: pydantic models whose
address fields are typed HostVA, built from host tables only."""

from __future__ import annotations

from typing import Any

import pydantic
from _support import DEVICE, raises, small_layout
from typing_extensions import assert_type

from pointerdomain import BufferInfo, HostKVPool, HostVA, buffer_infos, page_buffer_meta

va = HostVA.unsafe_from_int(0x10_0000)

# A model field typed HostVA takes a HostVA and gives a HostVA back.
info = BufferInfo(address=va, nbytes=4096, item_bytes=64)
assert_type(info, BufferInfo)
assert_type(info.address, HostVA)
assert_type(info.address + info.nbytes, HostVA)
assert_type(info.nbytes, int)

# Plain ints come in only through JSON (what serialisation writes): the validated
# field is a HostVA again. In Python the field takes a HostVA only: a bare int may
# be a device alias's value.
parsed = BufferInfo.model_validate_json('{"address": 1048576, "nbytes": 4096, "item_bytes": 64}')
assert_type(parsed.address, HostVA)
assert parsed == info and parsed.address == va
with raises(pydantic.ValidationError, "HostVA"):
    BufferInfo.model_validate({"address": 0x10_0000, "nbytes": 4096, "item_bytes": 64})
assert_type(info.model_dump(), dict[str, Any])
assert info.model_dump()["address"] == 0x10_0000
again = BufferInfo.model_validate_json(info.model_dump_json())
assert_type(again, BufferInfo)
assert again.address == va

# A host pool's metadata comes from its host table.
with HostKVPool(small_layout("page_first"), DEVICE) as pool:
    infos = buffer_infos(pool.host_table, pool.layout.item_bytes)
    assert_type(infos, list[BufferInfo])
    assert [i.address for i in infos] == [pool.memory.host_va]
    pages = page_buffer_meta(pool.host_table, pool.layout, [0, 3])
    assert_type(pages, list[BufferInfo])
    assert_type(pages[0].address, HostVA)
    assert_type(pool.get_contiguous_buf_infos(), list[BufferInfo])
    assert_type(pool.get_page_buffer_meta([1]), list[BufferInfo])
    assert pool.get_page_buffer_meta([0]) == page_buffer_meta(pool.host_table, pool.layout, [0])
    assert all(pool.memory.host_va <= p.address for p in pages)
