"""Issue 11's typing gaps, closed: the correct code each fix must keep accepting (no
false positive), with the inferred types pinned, and the runtime behaviour behind
each type. Runs on the emulated device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from _support import DEVICE, raises, small_layout
from typing_extensions import assert_type

from pointerdomain import (
    Address,
    AddressT,
    BufferInfo,
    Device,
    DeviceAlias,
    HostVA,
    KVLayout,
    PointerTable,
    alloc_registered,
    device_empty,
    host_ptr_table,
    is_host_table,
    is_kernel_table,
    make_kernel_ptr_table,
)
from pointerdomain.adapters import mooncake, vllm
from pointerdomain.errors import DomainError, LayoutError

D = TypeVar("D", bound=Address)
dev = Device("emulated", 0)
va = HostVA.unsafe_from_int(0x10_0000)
alias = DeviceAlias.unsafe_from_int(0x20_0000, dev)


# 1. Generic address helpers take one concrete domain (AddressT), checked per domain.
def span(lo: AddressT, hi: AddressT) -> int:
    return hi - lo


def lowest(addresses: Sequence[AddressT]) -> AddressT:
    return min(addresses)


def end(start: AddressT, nbytes: int) -> AddressT:
    return start + nbytes


assert_type(span(va, va + 64), int)
assert_type(span(alias, alias + 64), int)
assert span(va, va + 64) == 64 and span(alias, alias + 64) == 64
assert_type(lowest([va + 8, va]), HostVA)
assert_type(lowest([alias + 8, alias]), DeviceAlias)
assert lowest([alias + 8, alias]) == alias
assert_type(end(alias, 64), DeviceAlias)
assert end(alias, 64).device == dev
assert_type(va < va + 1, bool)
assert_type((alias + 64) - alias, int)
assert_type(sorted([va + 8, va]), list[HostVA])

# 2. KVLayout.replace: typed field names and values, validated like a new layout.
layout = small_layout("layer_first")
assert_type(layout.replace(num_pages=8), KVLayout)
assert_type(layout.replace(kind="page_first", dtype="bfloat16"), KVLayout)
assert layout.replace(num_pages=8).num_pages == 8 and layout.num_pages == 4
assert layout.replace(kind="page_first") == KVLayout.model_validate({**layout.model_dump(), "kind": "page_first"})
with raises(LayoutError, "greater than 0"):  # a LayoutFieldError (LayoutError, ValueError) naming the field
    layout.replace(num_pages=0)
with raises(LayoutError, "num_heads must be 1"):
    layout.replace(attention="mla")

# 3. model_construct is refused at run time too (it would skip validation).
with raises(DomainError, "model_construct() skips validation"):
    BufferInfo.model_construct()
with raises(DomainError, "model_construct() skips validation"):
    KVLayout.model_construct()
assert_type(BufferInfo(address=va, nbytes=64, item_bytes=64), BufferInfo)
assert_type(BufferInfo.model_validate({"address": va, "nbytes": 64, "item_bytes": 64}), BufferInfo)

# 4. Device.torch_device is a torch.device.
assert_type(dev.torch_device, torch.device)
assert dev.torch_device == torch.device("cpu")
assert_type(torch.empty(4, device=dev.torch_device), torch.Tensor)


class FakeEngine:
    """Mooncake's TransferEngine call shapes (raw ints); satisfies TransferEngineLike."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def register_memory(self, addr: int, length: int) -> int:
        self.calls.append(("register", addr, length))
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.calls.append(("unregister", addr, 0))
        return 0

    def transfer_sync_read(self, target: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        self.calls.append(("read", buffer, length))
        return 0

    def transfer_sync_write(self, target: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        self.calls.append(("write", buffer, length))
        return 0

    def batch_transfer_sync_read(self, target: str, buffers: list[int], peers: list[int], lengths: list[int]) -> int:
        self.calls.append(("batch_read", buffers[0], sum(lengths)))
        return 0

    def batch_transfer_sync_write(self, target: str, buffers: list[int], peers: list[int], lengths: list[int]) -> int:
        self.calls.append(("batch_write", buffers[0], sum(lengths)))
        return 0

    def get_rpc_port(self) -> int:
        return 4242


with alloc_registered(1 << 14, DEVICE) as memory:
    halves = [memory.tensor[: 1 << 13], memory.tensor[1 << 13 :]]
    kernel = make_kernel_ptr_table(halves, DEVICE)
    host = host_ptr_table(halves)

    # 5. Tables are Sequences of their domain.
    assert_type([*host], list[HostVA])
    assert_type([*kernel], list[DeviceAlias])
    assert_type(host[0:1], tuple[HostVA, ...])
    assert_type(kernel[::-1], tuple[DeviceAlias, ...])
    assert kernel[::-1] == (kernel[1], kernel[0]) and [*host] == [host[0], host[1]]
    first, *rest = kernel
    assert_type(first, DeviceAlias)
    assert_type(rest, list[DeviceAlias])
    assert host[0] in host and host.index(host[1]) == 1 and list(reversed(host)) == [host[1], host[0]]

    def starts(addresses: Sequence[HostVA]) -> list[int]:
        return [a.value for a in addresses]

    assert_type(starts(host), list[int])
    assert starts(host) == [memory.host_va.value, memory.host_va.value + (1 << 13)]

    # 10. A kernel table's device is a Device (no `assert t.device is not None`); a host
    #     table's is None; a table of unknown domain keeps Device | None.
    assert_type(kernel.device, Device)
    assert_type(host.device, None)
    assert_type(kernel.device.ordinal, int)
    assert kernel.device == dev and host.device is None

    def device_of(table: PointerTable[D]) -> Device | None:
        return table.device

    assert_type(device_of(kernel), Device | None)
    with raises(AttributeError, "immutable"):
        setattr(kernel, "device", Device("emulated", 1))

    # 11. TypeIs guards narrow a union of tables in both branches.
    def where(t: PointerTable[HostVA] | PointerTable[DeviceAlias]) -> str:
        if is_kernel_table(t):
            assert_type(t, PointerTable[DeviceAlias])
            return str(t.device)
        assert_type(t, PointerTable[HostVA])
        return "host"

    def host_starts(t: PointerTable[HostVA] | PointerTable[DeviceAlias]) -> list[HostVA]:
        if is_host_table(t):
            assert_type(t, PointerTable[HostVA])
            return list(t)
        assert_type(t, PointerTable[DeviceAlias])
        return []

    assert where(kernel) == "emulated:0" and where(host) == "host"
    assert host_starts(host) == [*host] and host_starts(kernel) == []
    assert not is_kernel_table(kernel.as_uint64_tensor()) and not is_host_table([va])
    assert_type(is_kernel_table(kernel), bool)

    # 8 and 9. The engine is a TransferEngineLike; a BufferInfo carries its size, a
    #     bare HostVA comes with nbytes.
    fake = FakeEngine()
    engine = mooncake.HostTransferEngine(fake, "127.0.0.1")
    assert_type(engine.engine, mooncake.TransferEngineLike)
    protocol_typed: mooncake.TransferEngineLike = fake
    info = BufferInfo(address=host[0], nbytes=host.sizes[0], item_bytes=64)
    engine.register_memory(info)
    engine.register_memory(host[1], 1 << 13)
    engine.transfer_sync_read("peer:1", info, HostVA.unsafe_from_int(0x9000_0000))
    engine.transfer_sync_write("peer:1", host[1], HostVA.unsafe_from_int(0x9000_0000), 64)
    engine.transfer_sync_read("peer:1", info, info, None)
    assert_type(mooncake.as_host_va(info), HostVA)
    assert_type(engine.session_id, str)
    assert engine.session_id == "127.0.0.1:4242"
    assert [c[0] for c in fake.calls] == ["register", "register", "read", "write", "read"]
    assert fake.calls[3] == ("write", host[1].value, 64)
    engine.close()

    # 7. The batch comes from its factory; a look-alike is refused by the runner.
    gpu = [device_empty((4, 1 << 11), torch.uint8, DEVICE)]
    offload = vllm.CpuGpuBlockOffload(gpu, [memory.tensor.view(8, 1 << 11)], DEVICE)
    batch = offload.store([0, 1], [6, 7])
    assert_type(batch, vllm.BlockCopyBatch)
    assert_type(vllm.run_batch_copy(batch, lambda s, d, n: None), int)
    assert batch.src_aliases()[0].device == dev
