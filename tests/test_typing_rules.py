"""The run-time side of the typing rules whose static side is in typing_tests/cases
(fail_unsafe_wrap.py, fail_engineer_code.py, fail_derivations.py and their pass files):
what the checkers refuse is still refused, or still works, at run time, and what they
cannot express (which device a kernel table is for; ``Any`` from ``tolist()`` under mypy)
is checked before anything is written."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import mooncake, nixl
from tests.reference import fill_pool, model_layout, pool_bytes

DEV = "emulated:0"


# --------------------------------------------------------------------------- raw wrapping


def test_plain_constructor_still_works_at_run_time() -> None:
    # the static rule (use unsafe_from_int) does not break untyped or older code
    plain: Any = pd.HostVA
    assert plain(0x1000) == pd.HostVA.unsafe_from_int(0x1000)
    dev = pd.Device("emulated", 0)
    alias: Any = pd.DeviceAlias
    assert alias(0x1000, dev) == pd.DeviceAlias.unsafe_from_int(0x1000, dev)
    assert type(pd.HostVA.unsafe_from_int(0x1000)) is pd.HostVA
    assert pd.DeviceAlias.unsafe_from_int(0x1000, dev).device == dev


@pytest.mark.parametrize(("call", "error", "needle"), [
    (lambda: pd.HostVA.unsafe_from_int("0x1000"), errors.DomainError, "built from an int"),
    (lambda: pd.HostVA.unsafe_from_int(1.0), errors.DomainError, "built from an int"),
    (lambda: pd.HostVA.unsafe_from_int(True), errors.DomainError, "built from an int"),
    (lambda: pd.HostVA.unsafe_from_int(pd.HostVA.unsafe_from_int(1)), errors.DomainError, "built from an int"),
    (lambda: pd.HostVA.unsafe_from_int(-1), errors.InvalidArgumentError, "outside [0, 2**64)"),
    (lambda: pd.HostVA.unsafe_from_int(2**64), errors.InvalidArgumentError, "outside [0, 2**64)"),
    (lambda: pd.DeviceAlias.unsafe_from_int(1, "emulated:0"), errors.InvalidDeviceError, "needs a Device"),
    (lambda: pd.DeviceAlias.unsafe_from_int(-8, pd.Device("emulated", 0)), errors.InvalidArgumentError, "outside"),
])
def test_unsafe_from_int_checks_the_value(call: Any, error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=re.escape(needle)):
        call()


def test_address_stays_abstract_at_run_time() -> None:
    address: Any = pd.Address
    with pytest.raises(errors.DomainError, match="abstract"):
        address(0x1000)


# --------------------------------------------------------------------------- engines


class MinimalEngine:
    """The four documented calls only."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def register_memory(self, addr: int, length: int) -> int:
        self.calls.append(("register", addr, length))
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.calls.append(("unregister", addr))
        return 0

    def transfer_sync_read(self, target: str, buffer: int, peer: int, length: int) -> int:
        self.calls.append(("read", target, buffer, peer, length))
        return 0

    def transfer_sync_write(self, target: str, buffer: int, peer: int, length: int) -> int:
        self.calls.append(("write", target, buffer, peer, length))
        return 0


class BatchEngine(MinimalEngine):
    def batch_transfer_sync_read(self, target: str, buffers: list[int], peers: list[int], lengths: list[int]) -> int:
        self.calls.append(("batch_read", target, buffers, peers, lengths))
        return 0

    def batch_transfer_sync_write(self, target: str, buffers: list[int], peers: list[int], lengths: list[int]) -> int:
        self.calls.append(("batch_write", target, buffers, peers, lengths))
        return 0

    def get_rpc_port(self) -> int:
        return 4242


@pytest.fixture
def memory() -> Iterator[pd.RegisteredHostMemory]:
    with pd.alloc_registered(1 << 13, DEV) as mem:
        yield mem


def _blocks(memory: pd.RegisteredHostMemory, base: int) -> list[pd.BufferInfo]:
    start = memory.host_va if base == 0 else pd.HostVA.unsafe_from_int(base)
    return [pd.BufferInfo(address=start + i * 128, nbytes=64, item_bytes=64) for i in range(3)]


def test_protocols_at_run_time() -> None:
    assert isinstance(MinimalEngine(), mooncake.TransferEngineLike)
    assert not isinstance(MinimalEngine(), mooncake.BatchTransferEngineLike)
    assert not isinstance(MinimalEngine(), mooncake.RpcPortEngineLike)
    assert isinstance(BatchEngine(), mooncake.BatchTransferEngineLike)
    assert isinstance(BatchEngine(), mooncake.RpcPortEngineLike)


@pytest.mark.parametrize("op", ["read", "write"])
def test_batch_without_batch_calls_goes_block_by_block(memory: pd.RegisteredHostMemory, op: str) -> None:
    local, remote = _blocks(memory, 0), _blocks(memory, 0x9000_0000)
    engine = MinimalEngine()
    with mooncake.HostTransferEngine(engine, "127.0.0.1") as wrapper:
        wrapper.register_memory(memory.host_va, memory.nbytes)
        call = wrapper.batch_transfer_sync_read if op == "read" else wrapper.batch_transfer_sync_write
        assert call("peer:1", local, remote) == 3 * 64
        assert engine.calls[1:] == [(op, "peer:1", lb.address.value, rb.address.value, 64)
                                    for lb, rb in zip(local, remote)]
        assert call("peer:1", [], []) == 0 and len(engine.calls) == 4  # nothing to move: no call


@pytest.mark.parametrize("op", ["read", "write"])
def test_batch_with_batch_calls_is_one_call(memory: pd.RegisteredHostMemory, op: str) -> None:
    local, remote = _blocks(memory, 0), _blocks(memory, 0x9000_0000)
    engine = BatchEngine()
    with mooncake.HostTransferEngine(engine, "127.0.0.1") as wrapper:
        wrapper.register_memory(memory.host_va, memory.nbytes)
        call = wrapper.batch_transfer_sync_read if op == "read" else wrapper.batch_transfer_sync_write
        assert call("peer:1", local, remote) == 3 * 64
        assert engine.calls[1:] == [(f"batch_{op}", "peer:1", [b.address.value for b in local],
                                     [b.address.value for b in remote], [64, 64, 64])]
        assert wrapper.session_id == "127.0.0.1:4242"


def test_session_id_needs_get_rpc_port() -> None:
    wrapper = mooncake.HostTransferEngine(MinimalEngine(), "127.0.0.1")
    with pytest.raises(errors.InvalidTypeError, match="without get_rpc_port"):
        wrapper.session_id


def test_tolist_ints_never_reach_an_engine(memory: pd.RegisteredHostMemory) -> None:
    """mypy types ``tolist()`` as Any, which passes the wrapper's HostVA parameters: the
    wrapper's own check refuses the int before the engine is called."""
    rows = torch.tensor([memory.host_va.value], dtype=torch.int64).tolist()
    raw: Any = json.loads(json.dumps(rows))[0]
    engine = MinimalEngine()
    wrapper = mooncake.HostTransferEngine(engine, "127.0.0.1")
    for value in (rows[0], raw):
        with pytest.raises(errors.DomainError, match="plain int"):
            wrapper.register_memory(value, 64)
        with pytest.raises(errors.DomainError, match="plain int"):
            wrapper.transfer_sync_write("peer:1", value, pd.HostVA.unsafe_from_int(0x9000), 64)
        with pytest.raises(errors.DomainError, match="plain int"):
            nixl.dram_desc(value, 64)
    assert engine.calls == []


# --------------------------------------------------------------------------- tables


def test_has_domain(memory: pd.RegisteredHostMemory) -> None:
    parts = [memory.tensor[:4096], memory.tensor[4096:]]
    kernel, host = pd.make_kernel_ptr_table(parts, DEV), pd.host_ptr_table(parts)
    assert pd.has_domain(kernel, pd.DeviceAlias) and not pd.has_domain(kernel, pd.HostVA)
    assert pd.has_domain(host, pd.HostVA) and not pd.has_domain(host, pd.DeviceAlias)
    for other in (None, [memory.host_va], kernel.as_uint64_tensor(), memory.host_va, "table"):
        assert not pd.has_domain(other, pd.HostVA) and not pd.has_domain(other, pd.DeviceAlias)
    assert not pd.has_domain(kernel, pd.Address)  # only a concrete domain matches


@pytest.mark.parametrize("per_layer", [False, True])
def test_tables_of_two_devices_in_one_launch_are_refused(per_layer: bool) -> None:
    """Which device a kernel table is for is a value, not a type: both pools' tables are
    PointerTable[DeviceAlias]. The launch refuses the pair before anything is written."""
    layout = model_layout("layer_first", pages=4)
    src, dst = pd.DeviceKVPool(layout, "emulated:0"), pd.DeviceKVPool(layout, "emulated:1")
    fill_pool(src, 1)
    fill_pool(dst, 2)
    before = pool_bytes(dst).clone()
    idx = torch.arange(layout.num_pages * layout.page_size, dtype=torch.int64)  # every token
    with pytest.raises(errors.DeviceMismatchError, match="src table is for emulated:0 but dst table is for emulated:1"):
        if per_layer:
            pd.transfer_kv_per_layer(src.table, dst.table, idx, idx, layer_id=0, src_layout=layout, dst_layout=layout)
        else:
            pd.transfer_kv_all_layer(src.table, dst.table, idx, idx, src_layout=layout, dst_layout=layout)
    assert torch.equal(pool_bytes(dst), before)
    # the same pair on one device goes through, and moves the bytes
    same_dev = pd.DeviceKVPool(layout, "emulated:0")
    pd.transfer_kv_all_layer(src.table, same_dev.table, idx, idx, src_layout=layout, dst_layout=layout)
    assert torch.equal(pool_bytes(same_dev), pool_bytes(src))
