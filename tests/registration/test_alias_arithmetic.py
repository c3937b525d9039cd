"""Arithmetic on an address taken from a table entry or a registration stays inside
it: a step past the end (into another registration's alias range) is refused with
RegistrationSpanError before the value can reach anything."""

from __future__ import annotations

import pickle

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import DEV, model_layout


def test_alias_of_a_registration_cannot_step_into_the_next() -> None:
    a = pd.alloc_registered(8192, DEV)
    b = pd.alloc_registered(8192, DEV)
    alias = pd.resolve_alias(a.host_va + 100, DEV)
    assert (alias + 8092).value == pd.resolve_alias(a.host_va, DEV).value + 8192  # one past the end: a range's end
    with pytest.raises(errors.RegistrationSpanError, match="leaves the buffer"):
        alias + 8093
    with pytest.raises(errors.RegistrationSpanError):
        alias - 101
    assert (alias - 100).value == pd.resolve_alias(a.host_va, DEV).value
    b_alias = pd.resolve_alias(b.host_va, DEV)
    with pytest.raises(errors.RegistrationSpanError):
        b_alias.offset(-1)
    a.close()
    b.close()


def test_chunked_registration_bounds_each_chunk() -> None:
    mem = pd.alloc_registered(3 * 4096, DEV, max_chunk_bytes=4096)
    assert len(mem.chunks) == 3
    alias = pd.resolve_alias(mem.host_va + 4096, DEV)  # chunk 2: its aliases are not next to chunk 1's
    with pytest.raises(errors.RegistrationSpanError):
        alias - 1
    with pytest.raises(errors.RegistrationSpanError):
        alias + 4097
    mem.close()


def test_table_entries_stay_in_their_buffers() -> None:
    with pd.HostKVPool(model_layout("page_first"), DEV) as pool:
        entry = pool.kernel_table[0]
        size = pool.kernel_table.sizes[0]
        assert (entry + size).value == entry.value + size
        with pytest.raises(errors.RegistrationSpanError):
            entry + (size + 1)
        va = pool.host_table[0]
        with pytest.raises(errors.RegistrationSpanError):
            va + (size + 64)
        last = pool.host_va(7, 2, 1)
        with pytest.raises(errors.RegistrationSpanError):
            last + pool.layout.nbytes
        info = pool.get_contiguous_buf_infos()[0]
        assert info.address == va  # the span takes no part in equality, hashing or JSON
        assert hash(info.address) == hash(pd.HostVA.unsafe_from_int(va.value))
        assert pd.BufferInfo.model_validate_json(info.model_dump_json()) == info
        assert pickle.loads(pickle.dumps(va)) == va


def test_unbounded_addresses_keep_plain_arithmetic() -> None:
    t = torch.zeros(16, dtype=torch.uint8)
    va = pd.HostVA.unsafe_from_int(t.data_ptr())
    assert (va + (1 << 20)).value == va.value + (1 << 20)  # a hand-made HostVA knows no span


def test_host_va_of_a_registration_knows_its_span() -> None:
    """``memory.host_va`` steps anywhere inside its registration (host VAs are contiguous
    across chunks) and is refused past either end."""
    mem = pd.alloc_registered(3 * 4096, DEV, max_chunk_bytes=4096)
    try:
        assert (mem.host_va + 3 * 4096).value == mem.host_va.value + mem.nbytes  # the end: a range's end
        assert (mem.host_va + 5000).value == mem.host_va.value + 5000  # across a chunk boundary: host side
        with pytest.raises(errors.RegistrationSpanError, match="leaves the buffer"):
            mem.host_va + (3 * 4096 + 1)
        with pytest.raises(errors.RegistrationSpanError):
            mem.host_va - 1
    finally:
        mem.close()
