"""The library's own adapters (pointerdomain.adapters), used as an embedding cache
would: sglang-style host cache over a HostKVPool, vLLM-style block offload, an
LMCache-style layer-table cache, and the HostVA-only transfer-engine wrapper
around a stand-in engine. Must type-check clean; runs on the emulated device."""

from __future__ import annotations

import torch
from _support import DEVICE, slots, small_layout
from typing_extensions import assert_type

from pointerdomain import BufferInfo, Device, DeviceAlias, HostKVPool, HostVA, PointerTable, alloc_registered, device_empty
from pointerdomain.adapters import lmcache, mooncake, sglang, vllm


class FakeEngine:
    """Mooncake's TransferEngine call shapes (raw ints; the wrapper is what is typed)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def register_memory(self, addr: int, length: int) -> int:
        self.calls.append(("register", addr, length))
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.calls.append(("unregister", addr, 0))
        return 0

    def transfer_sync_read(self, target: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return 0

    def transfer_sync_write(self, target: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return 0

    def batch_transfer_sync_read(self, target: str, buffers: list[int], peers: list[int], lengths: list[int]) -> int:
        return 0

    def batch_transfer_sync_write(self, target: str, buffers: list[int], peers: list[int], lengths: list[int]) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 4242


layout = small_layout("layer_first")

# sglang: device buffers per layer, a HiCache-style host cache over a host pool.
k = [device_empty((layout.num_slots, 2, 8), torch.float16, DEVICE) for _ in range(layout.num_layers)]
v = [device_empty((layout.num_slots, 2, 8), torch.float16, DEVICE) for _ in range(layout.num_layers)]
device_buffers = sglang.DeviceKVBuffers(k, v, DEVICE, page_size=layout.page_size)
assert_type(device_buffers.table, PointerTable[DeviceAlias])
with HostKVPool(small_layout("page_first"), DEVICE) as pool:
    cache = sglang.HostKVCacheAdapter.from_pool(pool)
    assert_type(cache.kernel_table, PointerTable[DeviceAlias])
    assert_type(cache.host_table, PointerTable[HostVA])
    cache.backup_from_device_all_layer(device_buffers, slots(0, 1, 2, 3), slots(0, 1, 2, 3))
    cache.load_to_device_per_layer(device_buffers, slots(0), slots(4), 1)
    infos = cache.get_contiguous_buf_infos()
    assert_type(infos.data_ptrs, list[HostVA])
    assert_type(infos.buffer_infos(), list[BufferInfo])
    ptrs, lens, items = infos
    assert_type(ptrs[0], HostVA)
    meta = cache.get_page_buffer_meta([0, 1, 2, 3])
    assert_type(meta.ptr_list, list[HostVA])
    assert all(pool.memory.host_va <= p for p in meta.ptr_list)
    table = sglang.make_kernel_ptr_table([pool.buffer], DEVICE, host_memory_registered=True)
    assert_type(table, PointerTable[DeviceAlias])
    assert_type(table.as_uint64_tensor(), torch.Tensor)

    # Mooncake: the wrapper takes BufferInfo / HostVA only.
    engine = mooncake.HostTransferEngine(FakeEngine(), "127.0.0.1")
    engine.batch_register_memory(infos.buffer_infos())
    engine.unregister_memory(ptrs[0])
    assert_type(mooncake.as_host_va(infos.buffer_infos()[0]), HostVA)

# vLLM: block-major tensors on both sides, batch descriptors of device aliases.
with alloc_registered(8 * 256, DEVICE) as memory:
    gpu = [device_empty((4, 256), torch.uint8, DEVICE)]
    cpu = [memory.tensor.view(8, 256)]
    offload = vllm.CpuGpuBlockOffload(gpu, cpu, DEVICE)
    assert_type(offload.cpu_table, PointerTable[DeviceAlias])
    batch = offload.store([0, 1], [6, 7])
    assert_type(batch, vllm.BlockCopyBatch)
    assert_type(batch.src_aliases(), list[DeviceAlias])
    assert_type(batch.device, Device)
    copied: list[int] = []
    assert_type(vllm.run_batch_copy(batch, lambda s, d, n: copied.append(int(n.sum()))), int)
    assert copied == [512]

# LMCache: per-device cached layer tables.
layer_cache = lmcache.LayerPointerCache()
assert_type(layer_cache.get(k, DEVICE), PointerTable[DeviceAlias])
assert layer_cache.get(k, DEVICE) is layer_cache.get(k, DEVICE)
