"""The typing gaps a new user hit, closed: every line below type-checked before (see
docs/typing.md, "Gaps closed"); now each is rejected by mypy and pyright."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pointerdomain import (
    Address,
    AddressT,
    BufferInfo,
    Device,
    DeviceAlias,
    HostVA,
    KVLayout,
    PointerTable,
    is_host_table,
    is_kernel_table,
)
from pointerdomain.adapters import mooncake, vllm


# 1. Distance and ordering exist only on one concrete domain: a helper typed with the
#    base Address no longer mixes domains; a generic helper uses AddressT.
def widened(a: Address, b: Address) -> None:
    a - b  # type: ignore[operator]
    a < b  # type: ignore[operator]
    a >= b  # type: ignore[operator]
    sorted([a, b])  # type: ignore[type-var]


def span(lo: AddressT, hi: AddressT) -> int:
    return hi - lo


def generic(va: HostVA, alias: DeviceAlias) -> None:
    span(va, alias)  # type: ignore[type-var]
    span(alias, va)  # type: ignore[type-var]
    d: HostVA = span(va, va)  # type: ignore[assignment]
    del d


# 2. Deriving a layout: KVLayout.replace(**changes) checks field names and types.
def derive(layout: KVLayout) -> None:
    layout.replace(num_page=8)  # type: ignore[call-arg]
    layout.replace(num_pages="8")  # type: ignore[arg-type]
    layout.replace(kind="paged")  # type: ignore[arg-type]
    layout.replace(dtype=torch.float16)  # type: ignore[arg-type]
    layout.replace(attention="gqa")  # type: ignore[arg-type]


# 3. model_construct (no validation) is refused on the metadata models.
def construct(alias: DeviceAlias, va: HostVA) -> None:
    BufferInfo.model_construct(address=alias, nbytes=64, item_bytes=64)  # type: ignore[arg-type]
    BufferInfo.model_construct(address=va, nbytes=64, item_bytes=64)  # type: ignore[arg-type]
    BufferInfo.model_construct(None, address=va)  # type: ignore[arg-type]
    KVLayout.model_construct(num_pages=0)  # type: ignore[arg-type]


# 4. Device.torch_device is a torch.device, not Any.
def torch_dev(device: Device) -> None:
    s: str = device.torch_device  # type: ignore[assignment]
    device.torch_device.no_such_attribute  # type: ignore[attr-defined]
    del s


# 5. A table is a Sequence of its domain: unpacking and slicing keep the domain.
def iterate(host: PointerTable[HostVA], kernel: PointerTable[DeviceAlias]) -> None:
    a: list[DeviceAlias] = [*host]  # type: ignore[list-item]
    b: list[HostVA] = [*kernel, *host]  # type: ignore[list-item]
    c: Sequence[DeviceAlias] = host  # type: ignore[assignment]
    d: tuple[DeviceAlias, ...] = host[1:]  # type: ignore[assignment]
    first, *rest = kernel
    e: HostVA = first  # type: ignore[assignment]
    del a, b, c, d, e, rest


# 6. The constructor's token has a private type.
def hand_built_table(device: Device) -> None:
    PointerTable(object(), HostVA, None, (0x1000,), (64,), (), ())  # type: ignore[arg-type]
    PointerTable(None, DeviceAlias, device, (0x1000,), (64,), (), ())  # type: ignore[arg-type]


# 7. A vLLM block-copy batch comes only from block_copy_batch().
def hand_built_batch(ptrs: torch.Tensor, device: Device, kernel: PointerTable[DeviceAlias]) -> None:
    vllm.BlockCopyBatch(ptrs, ptrs, ptrs, device, (kernel,))  # type: ignore[call-arg]
    vllm.BlockCopyBatch(ptrs, ptrs, ptrs, device, (kernel,), token=object())  # type: ignore[arg-type]


# 8. The transfer-engine wrapper's engine is a Protocol, and as_host_va is typed.
class WrongEngine:
    """Takes typed addresses where Mooncake takes ints, and lacks the transfer calls."""

    def register_memory(self, addr: HostVA, length: int) -> int:
        return 0


def engine_types(engine: mooncake.HostTransferEngine, alias: DeviceAlias, va: HostVA) -> None:
    mooncake.HostTransferEngine(WrongEngine(), "127.0.0.1")  # type: ignore[arg-type]
    mooncake.HostTransferEngine(object(), "127.0.0.1")  # type: ignore[arg-type]
    engine.engine.register_memory(va, 64)  # type: ignore[arg-type]
    engine.engine.no_such_call()  # type: ignore[attr-defined]
    mooncake.as_host_va(alias)  # type: ignore[arg-type]
    mooncake.as_host_va(0x1000)  # type: ignore[arg-type]


# 9. register_memory and the transfer calls: a bare HostVA needs nbytes.
def overloads(engine: mooncake.HostTransferEngine, va: HostVA, info: BufferInfo) -> None:
    engine.register_memory(va)  # type: ignore[call-overload]
    engine.register_memory(va, None)  # type: ignore[call-overload]
    engine.transfer_sync_read("peer:1", va, info)  # type: ignore[call-overload]
    engine.transfer_sync_write("peer:1", va, va)  # type: ignore[call-overload]


# 10. A kernel table's device is a Device; a host table's is None; both read-only.
def devices(kernel: PointerTable[DeviceAlias], host: PointerTable[HostVA]) -> None:
    a: None = kernel.device  # type: ignore[assignment]
    b: Device = host.device  # type: ignore[assignment]
    host.device.type  # type: ignore[attr-defined]
    kernel.device = Device("emulated", 1)  # type: ignore[assignment]
    del a, b


# 11. TypeIs guards narrow a union of tables, in both branches.
def narrow(t: PointerTable[HostVA] | PointerTable[DeviceAlias]) -> None:
    if is_kernel_table(t):
        a: PointerTable[HostVA] = t  # type: ignore[assignment]
        del a
    else:
        b: PointerTable[DeviceAlias] = t  # type: ignore[assignment]
        del b
    if is_host_table(t):
        t.device.ordinal  # type: ignore[attr-defined]
