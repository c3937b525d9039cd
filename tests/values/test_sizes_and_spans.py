"""Sizes of 2**64 bytes or more, ranges that wrap past the end of the address space,
and memory the machine cannot back: typed errors before any page is touched."""

from __future__ import annotations

import json

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import mooncake, nixl
from pointerdomain.registration.memory import pinned_bytes
from tests.reference import DEV

TOP = 1 << 64


def test_sizes_beyond_the_address_space() -> None:
    with pytest.raises(errors.InvalidRegistrationError, match="nbytes"):
        pd.alloc_registered(TOP, DEV)
    with pytest.raises(errors.InvalidArgumentError, match="shape"):
        pd.device_empty((TOP,), torch.uint8, DEV)
    with pytest.raises(errors.InvalidArgumentError, match="shape"):
        pd.device_empty((1 << 32, 1 << 32), torch.bfloat16, DEV)
    with pytest.raises(errors.LayoutFieldError, match="num_layers") as info:
        pd.KVLayout(kind="page_first", num_layers=1 << 70, num_pages=4, page_size=2, num_heads=1, head_dim=8)
    assert info.value.field == "num_layers"
    with pytest.raises(errors.LayoutFieldError, match="num_pages"):
        pd.KVLayout(kind="layer_first", num_layers=2, num_pages=1 << 62, page_size=16, num_heads=8, head_dim=128)
    layout = pd.KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=2, num_heads=1, head_dim=8)
    with pytest.raises(errors.LayoutFieldError):
        layout.replace(num_layers=1 << 70)


def test_ranges_that_wrap_are_refused() -> None:
    end = pd.HostVA.unsafe_from_int(TOP - 64)
    with pytest.raises(errors.MetadataValidationError, match="2\\*\\*64"):
        pd.BufferInfo(address=end, nbytes=128, item_bytes=64)
    with pytest.raises(errors.MetadataValidationError):
        pd.BufferInfo.model_validate_json(json.dumps({"address": TOP - 64, "nbytes": 128, "item_bytes": 64}))
    assert pd.BufferInfo(address=end, nbytes=64, item_bytes=64).nbytes == 64  # ends exactly at 2**64
    with pytest.raises(errors.InvalidArgumentError, match="region"):
        nixl.dram_desc(pd.HostVA.unsafe_from_int(TOP - 8), 64)
    with pytest.raises(errors.InvalidArgumentError, match="offset"):
        nixl.file_desc(3, TOP - 8, 64)

    class Engine:
        calls: list[object] = []

        def register_memory(self, *args: object) -> int:
            self.calls.append(args)
            return 0

    engine = Engine()
    with pytest.raises(errors.InvalidArgumentError, match="region"):
        mooncake.HostTransferEngine(engine, "127.0.0.1").register_memory(pd.HostVA.unsafe_from_int(TOP - 8), 64)  # type: ignore[arg-type]
    assert engine.calls == []


def test_memory_the_machine_cannot_back_is_refused_before_touching_pages() -> None:
    before = pinned_bytes()
    with pytest.raises(errors.OutOfMemoryError, match="nothing was allocated") as info:
        pd.alloc_registered(1 << 50, DEV)  # 1 PiB: more than any machine here backs
    assert info.value.nbytes == 1 << 50 and isinstance(info.value, MemoryError)
    with pytest.raises(errors.OutOfMemoryError, match="shape"):
        pd.device_empty((1 << 50,), torch.uint8, DEV)
    layout = pd.KVLayout(kind="page_first", num_layers=64, num_pages=1 << 30, page_size=16, num_heads=8, head_dim=128)
    with pytest.raises(errors.OutOfMemoryError):
        pd.HostKVPool(layout, DEV)
    assert pinned_bytes() == before
    with pd.alloc_registered(1 << 20, DEV) as small:  # what fits is still allocated
        assert small.nbytes == 1 << 20


def test_ids_beyond_int64() -> None:
    with pytest.raises(errors.IndexValidationError, match="x"):
        pd.index_tensor("x", [1 << 70])
    with pytest.raises(errors.IndexValidationError, match="uint64"):
        pd.index_tensor("x", torch.tensor([1 << 63], dtype=torch.uint64))
    assert pd.index_tensor("x", torch.tensor([(1 << 63) - 1], dtype=torch.uint64)).tolist() == [(1 << 63) - 1]
