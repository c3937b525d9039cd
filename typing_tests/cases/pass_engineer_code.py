"""Correct code as engineers write it, accepted by mypy and pyright without a false
positive: a stand-in transfer engine with only the documented calls, generic helpers
over one address domain (AddressT), narrowing a table by its domain (has_domain),
comparisons of a table's device with an Optional[Device]. Runs on the emulated device."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Optional, TypeVar

import torch
from _support import DEVICE, OTHER_DEVICE, raises, slots, small_layout
from typing_extensions import assert_type

from pointerdomain import (
    Address,
    AddressT,
    BufferInfo,
    Device,
    DeviceAlias,
    DeviceKVPool,
    HostKVPool,
    HostVA,
    PointerTable,
    alloc_registered,
    has_domain,
    host_ptr_table,
    make_kernel_ptr_table,
    transfer_kv_all_layer,
)
from pointerdomain.adapters import mooncake, nixl
from pointerdomain.errors import DeviceMismatchError, InvalidTypeError

D = TypeVar("D", bound=Address)


# 1. An engine with the four documented calls only (its own parameter names, no batch
#    calls, no get_rpc_port) is a TransferEngineLike.
class MinimalEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        self.calls.append(("register", buffer_addr, capacity))
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        self.calls.append(("unregister", buffer_addr, 0))
        return 0

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        self.calls.append(("read", buffer, length))
        return 0

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        self.calls.append(("write", buffer, length))
        return 0


# 2. Generic helpers over one domain.
@dataclass(frozen=True)
class Region(Generic[AddressT]):
    start: AddressT
    end: AddressT

    def size(self) -> int:
        return self.end - self.start

    def contains(self, a: AddressT) -> bool:
        return self.start <= a < self.end

    def shifted(self, nbytes: int) -> Region[AddressT]:
        return Region(self.start + nbytes, self.end + nbytes)


def span(lo: AddressT, hi: AddressT) -> int:
    return hi - lo


def back(a: AddressT, nbytes: int) -> AddressT:
    return a - nbytes


def mid(lo: AddressT, hi: AddressT) -> AddressT:
    return lo + (hi - lo) // 2


def extent(xs: Sequence[AddressT]) -> int:
    return max(xs) - min(xs)


def offsets(base: AddressT, xs: Iterable[AddressT]) -> list[int]:
    return [x - base for x in xs]


def table_span(t: PointerTable[AddressT]) -> int:
    return t[len(t) - 1] - t[0]


def gaps(t: PointerTable[AddressT]) -> list[int]:
    return [b - a for a, b in zip(t, t[1:])]


dev = Device("emulated", 0)
va = HostVA.unsafe_from_int(0x10_0000)
alias = DeviceAlias.unsafe_from_int(0x20_0000, dev)
assert_type(span(va, va + 64), int)
assert_type(back(alias, 64), DeviceAlias)
assert back(alias, 64).value == 0x20_0000 - 64 and back(alias, 64).device == dev
assert_type(mid(va, va + 64), HostVA)
assert mid(va, va + 64) == va + 32
assert_type(extent([alias, alias + 256, alias + 8]), int)
assert extent([alias, alias + 256, alias + 8]) == 256
assert_type(offsets(va, [va + 8, va + 16]), list[int])
region = Region(alias, alias + 4096)
assert_type(region, Region[DeviceAlias])
assert_type(region.shifted(64), Region[DeviceAlias])
assert region.size() == 4096 and region.contains(alias + 1) and not region.contains(alias + 4096)
assert_type(Region(va, va + 64).size(), int)


# 3. Narrowing a table by its domain: has_domain (a TypeIs), in both branches.
def kernel_device(t: PointerTable[HostVA] | PointerTable[DeviceAlias]) -> Optional[Device]:
    if has_domain(t, DeviceAlias):
        assert_type(t, PointerTable[DeviceAlias])
        return t.device
    assert_type(t, PointerTable[HostVA])
    return None


def host_entries(t: object) -> list[HostVA]:
    if has_domain(t, HostVA):
        return list(t)
    return []


def launch(src: PointerTable[HostVA] | PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias],
           idx: torch.Tensor, layout_src: object, layout_dst: object) -> bool:
    from pointerdomain import KVLayout

    if has_domain(src, DeviceAlias) and isinstance(layout_src, KVLayout) and isinstance(layout_dst, KVLayout):
        transfer_kv_all_layer(src, dst, idx, idx, src_layout=layout_src, dst_layout=layout_dst)
        return True
    return False


# 4. A table's device against an Optional[Device].
def same_device(t: PointerTable[DeviceAlias], want: Optional[Device]) -> bool:
    return want is None or t.device == want


def device_or_none(t: PointerTable[D]) -> Optional[Device]:
    device = t.device
    if device is None:
        return None
    return device


with alloc_registered(1 << 13, DEVICE) as memory:
    halves = [memory.tensor[: 1 << 12], memory.tensor[1 << 12 :]]
    kernel = make_kernel_ptr_table(halves, DEVICE)
    host = host_ptr_table(halves)
    assert_type(table_span(kernel), int)
    assert table_span(kernel) == 1 << 12 and table_span(host) == 1 << 12
    assert_type(gaps(host), list[int])
    assert gaps(host) == [1 << 12]
    assert kernel_device(kernel) == dev and kernel_device(host) is None
    assert host_entries(host) == [*host] and host_entries(kernel) == [] and host_entries("x") == []
    assert has_domain(kernel, DeviceAlias) and has_domain(host, HostVA) and not has_domain(None, HostVA)
    assert host_entries(kernel) == []  # has_domain(kernel, HostVA) is False
    assert same_device(kernel, None) and same_device(kernel, dev) and not same_device(kernel, Device("emulated", 1))
    assert device_or_none(kernel) == dev and device_or_none(host) is None
    assert kernel.device is not None  # a redundant check is accepted in an assert

    # the minimal engine: registration, single transfers, a batch moved block by block
    fake = MinimalEngine()
    typed: mooncake.TransferEngineLike = fake
    assert not isinstance(fake, mooncake.BatchTransferEngineLike)
    with mooncake.HostTransferEngine(fake, "127.0.0.1") as engine:
        assert_type(engine.engine, mooncake.TransferEngineLike)
        info = BufferInfo(address=host[0], nbytes=1 << 12, item_bytes=64)
        engine.register_memory(info)
        engine.transfer_sync_write("peer:1", info, HostVA.unsafe_from_int(0x9000_0000))
        blocks = [info.replace(nbytes=64), info.replace(address=host[0] + 64, nbytes=64)]
        assert_type(engine.batch_transfer_sync_read("peer:1", blocks, blocks), int)
        assert fake.calls[-2:] == [("read", host[0].value, 64), ("read", host[0].value + 64, 64)]
        with raises(InvalidTypeError, "without get_rpc_port"):
            assert_type(engine.session_id, str)

# 5. Two pools' kernel tables of two devices have one static type; the launch refuses them.
layout = small_layout("layer_first")
pool0, pool1 = DeviceKVPool(layout, DEVICE), DeviceKVPool(layout, OTHER_DEVICE)
host_pool = HostKVPool(layout.replace(kind="page_first"), DEVICE)
assert_type(pool1.table, PointerTable[DeviceAlias])
with raises(DeviceMismatchError, "emulated:0 but dst table is for emulated:1"):
    launch(pool0.table, pool1.table, slots(0), layout, layout)
assert launch(host_pool.host_table, pool0.table, slots(0), layout, layout) is False


# 6. A stand-in NIXL agent with the calls HostNixlAgent makes is a NixlAgentLike.
class FakeNixlAgent:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str, backends: list[str]) -> int:
        self.calls.append("register_memory")
        return 1

    def deregister_memory(self, handle: int) -> None:
        self.calls.append("deregister_memory")

    def get_agent_metadata(self) -> bytes:
        return b"meta"

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return b"peer"

    def remove_remote_agent(self, agent: str) -> None:
        self.calls.append("remove_remote_agent")

    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str) -> list[tuple[int, int, int]]:
        return descs

    def initialize_xfer(self, operation: str, local_descs: object, remote_descs: object, remote_agent: str,
                        notif_msg: bytes, backends: list[str]) -> int:
        self.calls.append(operation)
        return 7

    def transfer(self, handle: int) -> str:
        return "DONE"

    def check_xfer_state(self, handle: int) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: int) -> None:
        self.calls.append("release_xfer_handle")


fake_agent = FakeNixlAgent()
agent_typed: nixl.NixlAgentLike = fake_agent
with nixl.HostNixlAgent("fake", agent=fake_agent) as nixl_agent:
    assert_type(nixl_agent.agent, nixl.NixlAgentLike)
    with HostKVPool(small_layout("page_first"), DEVICE) as pool:
        nixl_agent.register_pool(pool)
        assert nixl_agent.add_remote(nixl_agent.metadata()) == "peer"
        blocks = pool.get_page_buffer_meta([0])
        nixl_agent.write("peer", blocks, blocks)
assert fake_agent.calls == ["register_memory", "WRITE", "release_xfer_handle", "deregister_memory",
                            "remove_remote_agent"]
