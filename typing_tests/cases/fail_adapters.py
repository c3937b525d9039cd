"""The adapters keep the two domains apart with the same static types: their kernel
tables reach no metadata, their host-VA results reach no kernel, and the
transfer-engine wrapper takes no alias, table or bare int."""

from __future__ import annotations

import torch

from pointerdomain import BufferInfo, DeviceAlias, HostVA, PointerTable, buffer_infos
from pointerdomain.adapters import lmcache, mooncake, sglang, vllm


def sglang_cache(cache: sglang.HostKVCacheAdapter, device: sglang.DeviceKVBuffers, idx: torch.Tensor) -> None:
    buffer_infos(cache.kernel_table, 64)  # type: ignore[arg-type]
    buffer_infos(device.table, 64)  # type: ignore[arg-type]
    cache.kernel_table = cache.host_table  # type: ignore[assignment]
    host: PointerTable[HostVA] = sglang.make_kernel_ptr_table([idx], "cuda:0", host_memory_registered=True)  # type: ignore[assignment]
    aliases: list[DeviceAlias] = cache.get_contiguous_buf_infos().data_ptrs  # type: ignore[assignment]
    kernel_ptrs: list[DeviceAlias] = cache.get_page_buffer_meta(idx).ptr_list  # type: ignore[assignment]
    cache.get_page_buffer_meta(cache.host_table)  # type: ignore[arg-type]
    cache.load_to_device_per_layer(device, idx, idx, layer_id=cache.host_table[0])  # type: ignore[arg-type]
    sglang.ContiguousBufInfos([DeviceAlias.unsafe_from_int(0, device.table[0].device)], [64], [64])  # type: ignore[list-item]
    del host, aliases, kernel_ptrs


def transfer_engine(engine: mooncake.HostTransferEngine, alias: DeviceAlias, info: BufferInfo,
                    kernel: PointerTable[DeviceAlias], host: PointerTable[HostVA]) -> None:
    engine.register_memory(alias, 64)  # type: ignore[call-overload]
    engine.register_memory(info.address.value, 64)  # type: ignore[call-overload]
    engine.register_memory(host, 64)  # type: ignore[call-overload]
    engine.unregister_memory(kernel[0])  # type: ignore[arg-type]
    engine.transfer_sync_read("peer:1", alias, info)  # type: ignore[call-overload]
    engine.transfer_sync_write("peer:1", info, info.address.value, 64)  # type: ignore[call-overload]
    engine.batch_register_memory([info.address])  # type: ignore[list-item]
    engine.batch_transfer_sync_read("peer:1", [info], [alias])  # type: ignore[list-item]


def block_offload(host: PointerTable[HostVA], kernel: PointerTable[DeviceAlias], batch: vllm.BlockCopyBatch) -> None:
    vllm.block_copy_batch(host, kernel, [0], [0], block_bytes=64)  # type: ignore[arg-type]
    vllm.block_copy_batch(kernel, host, [0], [0], block_bytes=64)  # type: ignore[arg-type]
    va: list[HostVA] = batch.src_aliases()  # type: ignore[assignment]
    lmcache.LayerPointerCache().get(host, "cuda:0")  # type: ignore[arg-type]
    table: PointerTable[HostVA] = lmcache.LayerPointerCache().get([], "cuda:0")  # type: ignore[assignment]
    del va, table
