"""The runtime side of the typing gaps (docs/typing.md, "Gaps closed"): what the types now reject statically is
refused at run time as well (for untyped callers, casts and Any), and the new typed
APIs behave as their annotations say. The static side is typing_tests/cases/
fail_typing_gaps.py and pass_typing_gaps.py."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import types
import typing
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import mooncake, vllm
from tests.reference import fill_random, model_layout, same

DEV = "emulated:0"


@pytest.fixture
def memory() -> Iterator[pd.RegisteredHostMemory]:
    with pd.alloc_registered(1 << 14, DEV) as mem:
        yield mem


@pytest.fixture
def tables(memory: pd.RegisteredHostMemory) -> tuple[pd.PointerTable[pd.DeviceAlias], pd.PointerTable[pd.HostVA]]:
    parts = [memory.tensor[: 1 << 12], memory.tensor[1 << 12 : 1 << 13], memory.tensor[1 << 13 :]]
    return pd.make_kernel_ptr_table(parts, DEV), pd.host_ptr_table(parts)


# --------------------------------------------------------------------------- addresses


def test_distance_and_ordering_still_checked_at_runtime() -> None:
    """Moved from Address to each domain class: untyped callers get the same errors."""
    va = pd.HostVA(0x10_0000)
    a0 = pd.DeviceAlias(0x20_0000, pd.Device("emulated", 0))
    a1 = pd.DeviceAlias(0x20_0000, pd.Device("emulated", 1))
    other: Any = a0
    with pytest.raises(errors.DomainError, match="only defined inside one domain"):
        va - other
    for compare in (va.__lt__, va.__le__, va.__gt__, va.__ge__):
        with pytest.raises(errors.DomainError, match="cannot order HostVA against DeviceAlias"):
            compare(other)
    with pytest.raises(errors.DeviceMismatchError):
        a0 - a1
    with pytest.raises(errors.DeviceMismatchError):
        a0 < a1
    with pytest.raises(errors.DomainError, match="cannot order"):
        min(va, other)
    assert (va + 96) - va == 96 and (a0 + 96) - a0 == 96
    assert va - 16 == pd.HostVA(0x10_0000 - 16) and (a0 - 16).device == a0.device
    assert sorted([va + 8, va, va + 4]) == [va, va + 4, va + 8]
    assert (va < va + 1, va <= va, va > va + 1, va >= va) == (True, True, False, True)
    # the base class no longer offers a cross-domain distance or ordering at all
    assert "__sub__" not in vars(pd.Address) and "__lt__" not in vars(pd.Address)


def test_address_typevar_is_constrained_to_the_two_domains() -> None:
    assert pd.AddressT.__constraints__ == (pd.HostVA, pd.DeviceAlias)


def test_torch_device() -> None:
    dev = pd.Device("emulated", 1)
    assert isinstance(dev.torch_device, torch.device) and dev.torch_device == torch.device("cpu")
    assert pd.Device("cuda", 3).torch_device == torch.device("cuda", 3)


# --------------------------------------------------------------------------- tables


def test_table_is_a_sequence_of_its_domain(
    memory: pd.RegisteredHostMemory, tables: tuple[pd.PointerTable[pd.DeviceAlias], pd.PointerTable[pd.HostVA]]
) -> None:
    kernel, host = tables
    from collections.abc import Sequence

    assert isinstance(kernel, Sequence) and isinstance(host, Sequence)
    assert typing.get_args(pd.PointerTable[pd.HostVA]) == (pd.HostVA,)  # still a typing.Generic at run time
    base = memory.host_va
    assert [*host] == [base, base + (1 << 12), base + (1 << 13)]
    assert host[1:] == (base + (1 << 12), base + (1 << 13)) and host[::-2] == (host[2], host[0])
    assert kernel[-1] == kernel[2] and kernel[0:0] == ()
    assert all(type(a) is pd.DeviceAlias and a.device == pd.Device("emulated", 0) for a in kernel[:])
    assert [a.value for a in kernel] == [pd.resolve_alias(v, DEV).value for v in host]
    assert host.index(base + (1 << 13)) == 2 and host.count(base) == 1 and base in host
    assert list(reversed(kernel)) == [kernel[2], kernel[1], kernel[0]]
    with pytest.raises(IndexError):
        kernel[3]


def test_table_device_by_domain_and_read_only(
    tables: tuple[pd.PointerTable[pd.DeviceAlias], pd.PointerTable[pd.HostVA]],
) -> None:
    kernel, host = tables
    assert kernel.device == pd.Device("emulated", 0) and host.device is None
    for table in (kernel, host):
        with pytest.raises(AttributeError, match="immutable"):
            table.device = pd.Device("emulated", 1)  # type: ignore[assignment]
    assert kernel.device == pd.Device("emulated", 0)


def test_constructor_token_is_private(memory: pd.RegisteredHostMemory) -> None:
    for token in (object(), None, pd.HostVA(0)):
        with pytest.raises(TypeError, match="make_kernel_ptr_table"):
            pd.PointerTable(token, pd.HostVA, None, (memory.host_va.value,), (64,), (), ())  # type: ignore[arg-type]


def test_type_guards(tables: tuple[pd.PointerTable[pd.DeviceAlias], pd.PointerTable[pd.HostVA]]) -> None:
    kernel, host = tables
    assert pd.is_kernel_table(kernel) and not pd.is_kernel_table(host)
    assert pd.is_host_table(host) and not pd.is_host_table(kernel)
    for other in (None, kernel.as_uint64_tensor(), [kernel[0]], kernel[0], host.raw_values()):
        assert not pd.is_kernel_table(other) and not pd.is_host_table(other)


# --------------------------------------------------------------------------- models


def test_model_construct_refused() -> None:
    alias = pd.DeviceAlias(0x1000, pd.Device("emulated", 0))
    construct: Any = pd.BufferInfo.model_construct
    for call in (lambda: construct(address=alias, nbytes=64, item_bytes=64), lambda: construct()):
        with pytest.raises(errors.DomainError, match="model_construct\\(\\) skips validation"):
            call()
    with pytest.raises(TypeError, match="KVLayout.model_construct"):  # DomainError is a TypeError too
        pd.KVLayout.model_construct()
    # the validated ways still work, and an alias still cannot become a HostVA field
    info = pd.BufferInfo(address=pd.HostVA(0x1000), nbytes=128, item_bytes=64)
    assert pd.BufferInfo.model_validate_json(info.model_dump_json()) == info
    assert json.loads(info.model_dump_json())["address"] == 0x1000
    with pytest.raises(pydantic.ValidationError):
        pd.BufferInfo.model_validate({"address": alias, "nbytes": 64, "item_bytes": 64})


def test_layout_replace_is_validated() -> None:
    layout = model_layout("layer_first", pages=8)
    bigger = layout.replace(num_pages=16, kind="page_first")
    assert (bigger.num_pages, bigger.kind, bigger.num_layers) == (16, "page_first", layout.num_layers)
    assert bigger.nbytes == 2 * layout.nbytes and layout.num_pages == 8  # the original is unchanged
    assert layout.replace() == layout
    untyped: Any = layout.replace
    for bad, match in (
        ({"num_pages": 0}, "greater than 0"),
        ({"num_pages": "8"}, "int"),
        ({"kind": "paged"}, "kind"),
        ({"attention": "mla"}, "num_heads must be 1"),
        ({"num_page": 8}, "Extra inputs are not permitted"),
    ):
        with pytest.raises(errors.LayoutFieldError, match=match):  # LayoutError + ValueError
            untyped(**bad)


# --------------------------------------------------------------------------- adapters


def _memmove_copy(calls: list[int]) -> vllm.BatchCopyFn:
    def copy(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
        calls.append(int(sizes.numel()))
        for a, b, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(b, a, n)

    return copy


def test_batch_only_from_its_factory(memory: pd.RegisteredHostMemory) -> None:
    block = 1 << 11
    gpu = [pd.device_empty((4, block), torch.uint8, DEV)]
    cpu = [memory.tensor[: 8 * block].view(8, block)]
    fill_random(gpu[0], 7)
    cpu[0].fill_(0xA5)  # poison: a copy that went elsewhere shows
    offload = vllm.CpuGpuBlockOffload(gpu, cpu, DEV)
    good = offload.store([1, 3], [6, 0])
    calls: list[int] = []
    copy = _memmove_copy(calls)

    # hand-built batches (here: host VAs, which a DMA engine would not translate) are refused
    host_ptrs = torch.tensor([cpu[0][0].data_ptr()], dtype=torch.uint64)
    sizes = torch.tensor([block], dtype=torch.int64)
    untyped: Any = vllm.BlockCopyBatch
    for kwargs in ({}, {"token": object()}, {"token": None}):
        with pytest.raises((errors.DomainError, TypeError)):
            untyped(host_ptrs, host_ptrs, sizes, pd.Device("emulated", 0), (), **kwargs)
    with pytest.raises(ValueError, match="token"):
        dataclasses.replace(good, src_ptrs=host_ptrs)
    look_alike: Any = types.SimpleNamespace(src_ptrs=host_ptrs, dst_ptrs=host_ptrs, sizes=sizes, num_ops=1,
                                            total_bytes=block, check_live=lambda: None)
    with pytest.raises(errors.DomainError, match="expected a BlockCopyBatch"):
        vllm.run_batch_copy(look_alike, copy)
    assert calls == [] and bool((cpu[0] == 0xA5).all())

    # the factory's batch copies exactly the blocks asked for, nothing else
    assert vllm.run_batch_copy(good, copy) == 2 * block and calls == [2]
    assert same(cpu[0][6], gpu[0][1]) and same(cpu[0][0], gpu[0][3])
    assert bool((cpu[0][1:6] == 0xA5).all()) and bool((cpu[0][7] == 0xA5).all())


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append((name, args))
            return 0

        return call


def test_engine_wrapper_runtime_matches_overloads(memory: pd.RegisteredHostMemory) -> None:
    fake = _Engine()
    engine = mooncake.HostTransferEngine(fake, "127.0.0.1")
    va = memory.host_va
    info = pd.BufferInfo(address=va, nbytes=4096, item_bytes=64)
    untyped: Any = engine
    with pytest.raises(ValueError, match="a bare HostVA with nbytes=None"):
        untyped.register_memory(va)
    with pytest.raises(ValueError, match="a bare HostVA with nbytes=None"):
        untyped.transfer_sync_read("peer:1", va, info)
    assert fake.calls == []
    engine.register_memory(info)
    engine.register_memory(va + 8192, 4096)
    engine.transfer_sync_read("peer:1", info, pd.HostVA(0x9000_0000))
    engine.transfer_sync_write("peer:1", va + 8192, pd.HostVA(0x9000_0000), 64)
    assert fake.calls == [
        ("register_memory", (va.value, 4096)),
        ("register_memory", (va.value + 8192, 4096)),
        ("transfer_sync_read", ("peer:1", va.value, 0x9000_0000, 4096)),
        ("transfer_sync_write", ("peer:1", va.value + 8192, 0x9000_0000, 64)),
    ]
    kernel_entry = pd.make_kernel_ptr_table([memory.tensor], DEV)[0]
    for bad in (kernel_entry, va.value, None):
        with pytest.raises(errors.DomainError):
            mooncake.as_host_va(untyped_value(bad))
    engine.close()


def untyped_value(value: object) -> Any:
    return value
