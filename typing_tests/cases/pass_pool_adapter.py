"""Real-world usage: a device pool, a host pool in registered memory, and an
adapter (the shape of a serving engine's KV-offload layer) that builds its own
tables, launches the transfer kernels and hands host-VA metadata to a transfer
engine. Must type-check clean; runs on the emulated device and checks the bytes."""

from __future__ import annotations

import torch
from _support import DEVICE, slots, small_layout
from typing_extensions import assert_type

from pointerdomain import (
    BufferInfo,
    Device,
    DeviceAlias,
    DeviceKVPool,
    HostKVPool,
    HostVA,
    KVLayout,
    PointerTable,
    RegisteredHostMemory,
    alloc_registered,
    buffer_infos,
    host_ptr_table,
    make_kernel_ptr_table,
    page_buffer_meta,
    transfer_kv_all_layer,
    transfer_kv_per_layer,
)
from pointerdomain.devices import validate_device


class TransferEngine:
    """Stands in for Mooncake / NIXL: registers host VAs, never device aliases."""

    def __init__(self) -> None:
        self.registered: list[tuple[HostVA, int]] = []

    def register_memory(self, address: HostVA, nbytes: int) -> None:
        self.registered.append((address, nbytes))

    def batch_register(self, infos: list[BufferInfo]) -> None:
        for info in infos:
            self.register_memory(info.address, info.nbytes)


class OffloadAdapter:
    """Owns a registered host buffer of ``host_layout`` and both of its tables."""

    def __init__(self, device_pool: DeviceKVPool, host_layout: KVLayout, device: Device | str) -> None:
        self.device_pool = device_pool
        self.layout = host_layout
        self.device = validate_device(device)
        self.memory: RegisteredHostMemory = alloc_registered(
            host_layout.nbytes, self.device, granularity=host_layout.page_block_bytes()
        )
        self.buffer = self.memory.tensor[: host_layout.nbytes].view(host_layout.torch_dtype)
        self.kernel_table: PointerTable[DeviceAlias] = make_kernel_ptr_table([self.buffer], self.device)
        self.host_table: PointerTable[HostVA] = host_ptr_table([self.buffer])

    def offload(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        transfer_kv_all_layer(
            self.device_pool.table, self.kernel_table, device_slots, host_slots,
            src_layout=self.device_pool.layout, dst_layout=self.layout,
        )

    def load_layer(self, host_slots: torch.Tensor, device_slots: torch.Tensor, layer: int) -> None:
        transfer_kv_per_layer(
            self.kernel_table, self.device_pool.table, host_slots, device_slots,
            layer_id=layer, src_layout=self.layout, dst_layout=self.device_pool.layout,
        )

    def publish(self, engine: TransferEngine, pages: list[int]) -> None:
        engine.batch_register(buffer_infos(self.host_table, self.layout.item_bytes))
        engine.batch_register(page_buffer_meta(self.host_table, self.layout, pages))

    def close(self) -> None:
        self.memory.close()


device_layout = small_layout("layer_first")
device_pool = DeviceKVPool(device_layout, DEVICE)
assert_type(device_pool.table, PointerTable[DeviceAlias])
assert_type(device_pool.buffer(0, 1), torch.Tensor)
for kv in range(device_layout.num_kv):
    for layer in range(device_layout.num_layers):
        device_pool.buffer(kv, layer).copy_(
            torch.arange(device_layout.num_slots * 16, dtype=torch.float16).view(-1, 2, 8) + 100 * kv + 10 * layer
        )

# The library's host pool: backup (D2H), then load back (H2D) into other slots.
with HostKVPool(small_layout("page_first"), DEVICE) as pool:
    assert_type(pool.kernel_table, PointerTable[DeviceAlias])
    assert_type(pool.host_table, PointerTable[HostVA])
    assert_type(pool.buffer, torch.Tensor)
    pool.backup(device_pool, slots(0, 1, 2, 3), slots(4, 5, 6, 7))
    pool.load(device_pool, slots(4, 5), slots(8, 9))
    pool.load_layer(device_pool, slots(6), slots(10), 1)
    for layer in range(device_layout.num_layers):
        k = device_pool.buffer(0, layer)
        assert torch.equal(k[8:10], k[0:2])
    assert torch.equal(device_pool.buffer(1, 1)[10], device_pool.buffer(1, 1)[2])
    assert_type(pool.get_contiguous_buf_infos()[0].address, HostVA)

# The adapter: its own tables, both launch functions, metadata to an engine.
adapter = OffloadAdapter(device_pool, small_layout("page_first_direct"), DEVICE)
try:
    adapter.offload(slots(0, 1, 2, 3), slots(12, 13, 14, 15))
    before = device_pool.buffer(0, 0)[0].clone()
    device_pool.buffer(0, 0)[0].zero_()
    adapter.load_layer(slots(12), slots(0), 0)
    assert torch.equal(device_pool.buffer(0, 0)[0], before)
    engine = TransferEngine()
    adapter.publish(engine, [3])
    assert_type(engine.registered, list[tuple[HostVA, int]])
    assert engine.registered[0] == (adapter.memory.host_va, adapter.layout.nbytes)
    assert all(adapter.memory.host_va <= va for va, _ in engine.registered)
finally:
    adapter.close()
