"""Example tests of the adapters, each mimicking how its host cache uses it, on the
emulated device (device aliases differ from host VAs there). Expected bytes come
from plain torch indexing; copies through raw addresses use ctypes.memmove (no
extension), so they prove the addresses are right."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import lmcache, sglang, vllm
from tests.reference import fill_random, items, same

DEV = "emulated:0"


def raw(t: torch.Tensor) -> bytes:
    """The bytes of a (contiguous view of a) tensor, from torch."""
    return bytes(t.contiguous().view(torch.uint8).view(-1).tolist())


def registered(nbytes: int, **kw: int) -> pd.RegisteredHostMemory:
    return pd.alloc_registered(nbytes, DEV, **kw)


@pytest.fixture
def owners() -> Iterator[list[pd.RegisteredHostMemory]]:
    """Registrations a test makes, closed at the end."""
    made: list[pd.RegisteredHostMemory] = []
    yield made
    for m in made:
        m.close()


# --------------------------------------------------------------------------- sglang


def sglang_device_pool(layers: int, slots: int, heads: int, dim: int, page: int, mla: bool, seed: int) -> sglang.DeviceKVBuffers:
    """An MHATokenToKVPool / MLATokenToKVPool-style device pool: per-layer buffers of ``size + page_size`` slots."""
    k = [pd.device_empty((slots + page, heads, dim), torch.bfloat16, DEV) for _ in range(layers)]
    v = None if mla else [pd.device_empty((slots + page, heads, dim), torch.bfloat16, DEV) for _ in range(layers)]
    for i, t in enumerate(k + (v or [])):
        fill_random(t, seed + i)
    return sglang.DeviceKVBuffers(k, v, DEV, page_size=page)


@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_sglang_host_pool_backup_meta_and_load(kind: str, mla: bool, owners: list[pd.RegisteredHostMemory]) -> None:
    layers, heads, dim, page, pages = 3, 1 if mla else 2, 32 if mla else 16, 4, 6
    dev_pool = sglang_device_pool(layers, 8 * page, heads, dim, page, mla, seed=10)
    layout = pd.KVLayout(
        kind=kind, attention="mla" if mla else "mha", num_layers=layers, num_pages=pages, page_size=page,
        num_heads=heads, head_dim=dim,
    )
    mem = registered(layout.nbytes, granularity=layout.page_block_bytes())
    owners.append(mem)
    host = sglang.HostKVCacheAdapter(mem.tensor.view(torch.bfloat16).view(layout.buffer_shape), layout, DEV)
    fill_random(host.kv_buffer, 99)
    assert host.layout == kind and host.size == pages * page and host.layer_num == layers

    # HiCache write-back: device pages 2 and 5 -> host pages 4 and 1, every layer, through the kernels.
    device_idx = torch.cat([torch.arange(2 * page, 3 * page), torch.arange(5 * page, 6 * page)])
    host_idx = torch.cat([torch.arange(4 * page, 5 * page), torch.arange(1 * page, 2 * page)])
    host.backup_from_device_all_layer(dev_pool, host_idx, device_idx, "kernel")
    buffers = dev_pool.k_buffer + (dev_pool.v_buffer or [])
    for kv in range(layout.num_kv):
        for layer in range(layers):
            assert same(items(host.kv_buffer, layout, kv, layer, host_idx), buffers[kv * layers + layer][device_idx])

    # Storage back-end: zero-copy page metadata, read by the CPU at the HostVAs.
    ptrs, sizes = host.get_page_buffer_meta(host_idx)
    assert all(type(p) is pd.HostVA for p in ptrs)
    expected: list[bytes] = []
    for p in (4, 1):
        slots = torch.arange(p * page, (p + 1) * page)
        if kind == "layer_first":
            expected += [raw(items(host.kv_buffer, layout, kv, layer, slots))
                         for layer in range(layers) for kv in range(layout.num_kv)]
        else:
            expected += [raw(torch.stack([items(host.kv_buffer, layout, kv, layer, slots) for layer in range(layers)],
                                         dim=1 if kind == "page_first" else 0))
                         for kv in range(layout.num_kv)]
    assert [ctypes.string_at(p.value, n) for p, n in zip(ptrs, sizes)] == expected

    # Transfer-engine registration: the regions tile the buffer exactly.
    infos = host.get_contiguous_buf_infos()
    data_ptrs, data_lens, item_lens = infos
    assert data_ptrs[0] == pd.HostVA(host.kv_buffer.data_ptr()) and sum(data_lens) == layout.nbytes
    assert all(b - a == n for a, b, n in zip(data_ptrs, data_ptrs[1:], data_lens))
    assert set(item_lens) == {layout.page_block_bytes()}
    assert [i.nbytes for i in infos.buffer_infos()] == data_lens

    # Layer-by-layer load back into other device slots.
    target = torch.arange(0, 2 * page)
    for layer in range(layers):
        host.load_to_device_per_layer(dev_pool, host_idx, target, layer, "kernel")
    for kv in range(layout.num_kv):
        for layer in range(layers):
            assert same(buffers[kv * layers + layer][target], buffers[kv * layers + layer][device_idx])


def untyped_copy_kernel(
    src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, src_slots: list[int], dst_slots: list[int], item_bytes: int
) -> None:
    """A cache's own 'kernel' that takes untyped uint64 pointer tensors (one entry per
    buffer) and copies item-sized slots; it trusts the addresses it is given."""
    for s_base, d_base in zip(src_ptrs.tolist(), dst_ptrs.tolist()):
        for s, d in zip(src_slots, dst_slots):
            ctypes.memmove(d_base + d * item_bytes, s_base + s * item_bytes, item_bytes)


def test_sglang_make_kernel_ptr_table_feeds_untyped_kernel(owners: list[pd.RegisteredHostMemory]) -> None:
    layers, slots, heads, dim = 2, 16, 2, 8
    item = heads * dim * 2
    device = [pd.device_empty((slots, heads, dim), torch.bfloat16, DEV) for _ in range(layers)]
    for i, t in enumerate(device):
        fill_random(t, i)
    mem = registered(layers * slots * item)
    owners.append(mem)
    host = [mem.tensor[i * slots * item:(i + 1) * slots * item].view(torch.bfloat16).view(slots, heads, dim)
            for i in range(layers)]

    dev_table = sglang.make_kernel_ptr_table(device, DEV, host_memory_registered=False)
    host_table = sglang.make_kernel_ptr_table(host, DEV, host_memory_registered=True)
    assert isinstance(host_table, pd.PointerTable) and host_table.domain is pd.DeviceAlias
    ptrs = host_table.as_uint64_tensor()
    assert ptrs.dtype == torch.uint64 and tuple(ptrs.shape) == (layers,)
    # the kernel gets aliases, not the host VAs (they differ on the emulated device)
    for t, alias in zip(host, ptrs.tolist()):
        assert alias == pd.resolve_alias(pd.HostVA(t.data_ptr()), DEV).value != t.data_ptr()

    untyped_copy_kernel(dev_table.as_uint64_tensor(), ptrs, [3, 7, 0], [0, 1, 15], item)
    for layer in range(layers):
        assert same(host[layer][torch.tensor([0, 1, 15])], device[layer][torch.tensor([3, 7, 0])])


def test_sglang_make_kernel_ptr_table_checks_the_flag(owners: list[pd.RegisteredHostMemory]) -> None:
    mem = registered(4096)
    owners.append(mem)
    device = pd.device_empty((64,), torch.float32, DEV)
    with pytest.raises(errors.DomainError, match="host_memory_registered=False"):
        sglang.make_kernel_ptr_table([mem.tensor], DEV, host_memory_registered=False)
    with pytest.raises(errors.DomainError, match="host_memory_registered=True"):
        sglang.make_kernel_ptr_table([device], DEV, host_memory_registered=True)
    with pytest.raises(errors.DomainError, match="unregistered"):
        sglang.make_kernel_ptr_table([torch.zeros(64)], DEV, host_memory_registered=True)
    with pytest.raises(errors.DomainError):  # a host (not device) buffer is not a device pool either
        sglang.DeviceKVBuffers([torch.zeros(8, 1, 4)], None, DEV, page_size=4)


def test_sglang_page_meta_rejects_partial_pages(owners: list[pd.RegisteredHostMemory]) -> None:
    layout = pd.KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=4, num_heads=1, head_dim=8)
    mem = registered(layout.nbytes)
    owners.append(mem)
    host = sglang.HostKVCacheAdapter(mem.tensor.view(torch.bfloat16).view(layout.buffer_shape), layout, DEV)
    for bad in (torch.arange(1, 5), torch.arange(0, 3), torch.tensor([0, 1, 3, 2]), torch.arange(12, 20)):
        with pytest.raises(errors.IndexValidationError):
            host.get_page_buffer_meta(bad)
    assert host.get_page_buffer_meta(torch.arange(0)) == ([], [])
    with pytest.raises(ValueError, match="io_backend"):
        host.backup_from_device_all_layer(sglang_device_pool(2, 16, 1, 8, 4, False, 0), torch.arange(4), torch.arange(4), "direct")


def test_sglang_adapter_over_chunked_pool() -> None:
    """A pool registered in several chunks: the adapter's kernel table has one entry per
    page block, so no alias arithmetic crosses a chunk; bytes still land."""
    layout = pd.KVLayout(kind="page_first", num_layers=2, num_pages=8, page_size=4, num_heads=2, head_dim=16)
    with pd.HostKVPool(layout, DEV, max_chunk_bytes=3 * layout.page_block_bytes()) as pool:
        assert len(pool.memory.chunks) > 1
        host = sglang.HostKVCacheAdapter.from_pool(pool)
        assert len(host.kernel_table) == layout.split_for_page_blocks()
        dev_pool = sglang_device_pool(2, 32, 2, 16, 4, False, seed=3)
        idx = torch.arange(8, 32)
        host.backup_from_device_all_layer(dev_pool, idx, idx)
        buffers = dev_pool.k_buffer + (dev_pool.v_buffer or [])
        for kv in range(2):
            for layer in range(2):
                assert same(items(pool.buffer, layout, kv, layer, idx), buffers[kv * 2 + layer][idx])


# --------------------------------------------------------------------------- vLLM


def cpu_batch_copy_log() -> tuple[vllm.BatchCopyFn, list[tuple[list[int], list[int], list[int]]]]:
    """A CPU stand-in for ``ops.swap_blocks_batch(src, dst, sizes)``: copies through the
    raw addresses with ctypes.memmove (like a DMA engine, it translates nothing)."""
    calls: list[tuple[list[int], list[int], list[int]]] = []

    def copy(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
        assert src.dtype == torch.uint64 and dst.dtype == torch.uint64 and sizes.dtype == torch.int64
        assert src.device.type == "cpu" and src.shape == dst.shape == sizes.shape
        s, d, n = src.tolist(), dst.tolist(), sizes.tolist()
        calls.append((s, d, n))
        for a, b, k in zip(s, d, n):
            ctypes.memmove(b, a, k)

    return copy, calls


def vllm_tensors(layers: int, gpu_blocks: int, cpu_blocks: int, owners: list[pd.RegisteredHostMemory]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer block-major KV tensors ``[num_blocks, 2, block_size, heads, head_size]``:
    device memory on the GPU side, one registered host allocation on the CPU side."""
    shape = (2, 16, 2, 8)
    gpu = [pd.device_empty((gpu_blocks, *shape), torch.float16, DEV) for _ in range(layers)]
    for i, t in enumerate(gpu):
        fill_random(t, 100 + i)
    per_layer = cpu_blocks * 2 * 16 * 2 * 8 * 2
    mem = registered(layers * per_layer)
    owners.append(mem)
    cpu = [mem.tensor[i * per_layer:(i + 1) * per_layer].view(torch.float16).view(cpu_blocks, *shape)
           for i in range(layers)]
    return gpu, cpu


def test_vllm_block_offload_store_and_load(owners: list[pd.RegisteredHostMemory]) -> None:
    gpu, cpu = vllm_tensors(layers=3, gpu_blocks=10, cpu_blocks=6, owners=owners)
    offload = vllm.CpuGpuBlockOffload(gpu, cpu, DEV)
    copy, calls = cpu_batch_copy_log()

    # offload GPU blocks [7, 2, 9] to CPU blocks [0, 5, 3]
    batch = offload.store([7, 2, 9], torch.tensor([0, 5, 3]))
    assert batch.num_ops == 3 * 3 and batch.total_bytes == 3 * 3 * offload.block_bytes[0]
    assert vllm.run_batch_copy(batch, copy) == batch.total_bytes
    for g, c in zip(gpu, cpu):
        assert same(c[torch.tensor([0, 5, 3])], g[torch.tensor([7, 2, 9])])

    # only aliases reached the copy: the CPU side's addresses are the aliases of the
    # registered blocks, not their host VAs (which differ on this device)
    (src, dst, sizes), = calls
    block = offload.block_bytes[0]
    want_dst = [pd.resolve_alias(pd.HostVA(c.data_ptr()), DEV).value + b * block for c in cpu for b in (0, 5, 3)]
    assert dst == want_dst and all(d != c.data_ptr() + b * block for d, c, b in zip(dst, [c for c in cpu for _ in range(3)], [0, 5, 3] * 3))
    assert src == [g.data_ptr() + b * block for g in gpu for b in (7, 2, 9)]
    assert batch.dst_aliases()[0] == pd.DeviceAlias(want_dst[0], pd.Device("emulated", 0))

    # load them back into other GPU blocks
    vllm.run_batch_copy(offload.load([0, 5, 3], [0, 1, 4]), copy)
    for g in gpu:
        assert same(g[torch.tensor([0, 1, 4])], g[torch.tensor([7, 2, 9])])


def test_vllm_block_copy_batch_is_typed_and_checked(owners: list[pd.RegisteredHostMemory]) -> None:
    gpu, cpu = vllm_tensors(layers=2, gpu_blocks=4, cpu_blocks=4, owners=owners)
    offload = vllm.CpuGpuBlockOffload(gpu, cpu, DEV)
    host_table = pd.host_ptr_table(cpu)
    with pytest.raises(errors.DomainError, match="PointerTable\\[HostVA\\]"):
        vllm.block_copy_batch(offload.gpu_table, host_table, [0], [0], block_bytes=offload.block_bytes)  # type: ignore[arg-type]
    with pytest.raises(errors.IndexValidationError, match="outside"):
        offload.store([4], [0])
    with pytest.raises(errors.IndexValidationError):
        offload.store([0, 1], [0])
    other = pd.make_kernel_ptr_table([pd.device_empty((4 * 512,), torch.uint8, "emulated:1")] * 2, "emulated:1")
    with pytest.raises(errors.DeviceMismatchError):
        vllm.block_copy_batch(offload.gpu_table, other, [0], [0], block_bytes=512)
    with pytest.raises(errors.DomainError, match="host_memory_registered"):
        vllm.CpuGpuBlockOffload(cpu, cpu, DEV)  # host memory on the GPU side
    with pytest.raises(errors.LayoutError):
        vllm.CpuGpuBlockOffload(gpu, [c[:, 0] for c in cpu], DEV)
    batch = offload.store([], [])
    assert batch.num_ops == 0 and batch.src_ptrs.dtype == torch.uint64
    pending = offload.store([1], [1])
    owners[-1].close()  # the CPU blocks are unregistered before the copy runs
    copy, calls = cpu_batch_copy_log()
    with pytest.raises(errors.ClosedError):
        vllm.run_batch_copy(pending, copy)
    assert calls == []


# --------------------------------------------------------------------------- LMCache


def lmcache_caches(layers: int, blocks: int, block_size: int, heads: int, dim: int, mla: bool, seed: int,
                   device: str = DEV) -> list[torch.Tensor]:
    shape = (blocks, block_size, dim) if mla else (2, blocks, block_size, heads, dim)
    caches = [pd.device_empty(shape, torch.bfloat16, device) for _ in range(layers)]
    for i, t in enumerate(caches):
        fill_random(t, seed + i)
    return caches


def paged_items(cache: torch.Tensor, kv: int, slots: torch.Tensor, mla: bool) -> torch.Tensor:
    """Reference: the tokens at ``slots`` of one layer's paged cache."""
    flat = cache.reshape(-1, cache.shape[-1]) if mla else cache[kv].reshape(-1, cache.shape[-2], cache.shape[-1])
    return flat[slots]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_lmcache_multi_layer_transfer(mla: bool, owners: list[pd.RegisteredHostMemory]) -> None:
    layers, blocks, bs, heads, dim = 4, 8, 4, 2, 16
    caches = lmcache_caches(layers, blocks, bs, heads, dim, mla, seed=5)
    g = torch.Generator().manual_seed(1)
    slot_mapping = torch.randperm(blocks * bs, generator=g)[:20]
    start, end = 4, 16
    count = end - start
    num_kv = 1 if mla else 2
    shape = (1, layers, count, dim) if mla else (2, layers, count, heads * dim)  # LMCache KV_2LTD
    mem = registered(num_kv * layers * count * heads ** (0 if mla else 1) * dim * 2)
    owners.append(mem)
    chunk = mem.tensor.view(torch.bfloat16).view(shape)

    connector = lmcache.PagedKVConnector()
    connector.from_gpu(chunk, start, end, kvcaches=caches, slot_mapping=slot_mapping)
    slots = slot_mapping[start:end]
    for layer, cache in enumerate(caches):
        for kv in range(num_kv):
            assert same(chunk[kv, layer].reshape(count, -1), paged_items(cache, kv, slots, mla).reshape(count, -1))

    # store the chunk into fresh caches at other slots (a retrieve on another engine)
    fresh = lmcache_caches(layers, blocks, bs, heads, dim, mla, seed=50)
    targets = torch.arange(blocks * bs - count, blocks * bs)
    connector.to_gpu(chunk, 0, count, kvcaches=fresh, slot_mapping=targets)
    for layer in range(layers):
        for kv in range(num_kv):
            assert same(paged_items(fresh[layer], kv, targets, mla), paged_items(caches[layer], kv, slots, mla))


def test_lmcache_pointer_tables_cached_per_device_and_invalidated(owners: list[pd.RegisteredHostMemory]) -> None:
    layers, blocks, bs, heads, dim = 2, 4, 4, 1, 8
    count = 4
    mem = registered(2 * layers * count * heads * dim * 2)
    owners.append(mem)
    chunk = mem.tensor.view(torch.bfloat16).view(2, layers, count, heads * dim)
    fill_random(chunk, 7)
    connector = lmcache.PagedKVConnector()
    cache = connector.pointer_cache
    slots = torch.tensor([3, 9, 12, 0])

    caches = lmcache_caches(layers, blocks, bs, heads, dim, False, seed=1)
    connector.to_gpu(chunk, 0, count, kvcaches=caches, slot_mapping=slots)
    connector.to_gpu(chunk, 0, count, kvcaches=caches, slot_mapping=slots)
    assert (cache.builds, cache.hits) == (1, 1)

    # the engine reallocates its KV caches (sleep/wake): the cached table must not be reused
    before = [c.clone() for c in caches]
    caches = lmcache_caches(layers, blocks, bs, heads, dim, False, seed=2)
    connector.to_gpu(chunk, 0, count, kvcaches=caches, slot_mapping=slots)
    assert (cache.builds, cache.hits) == (2, 1)
    for layer in range(layers):
        for kv in range(2):
            assert same(paged_items(caches[layer], kv, slots, False), chunk[kv, layer].view(count, heads, dim))

    # a second device gets its own entry; the first stays cached
    caches1 = lmcache_caches(layers, blocks, bs, heads, dim, False, seed=3, device="emulated:1")
    slots1 = slots.clone()
    mem1 = pd.alloc_registered(chunk.numel() * 2, "emulated:1")
    owners.append(mem1)
    chunk1 = mem1.tensor.view(torch.bfloat16).view(chunk.shape)
    connector.from_gpu(chunk1, 0, count, kvcaches=caches1, slot_mapping=slots1)
    connector.to_gpu(chunk, 0, count, kvcaches=caches, slot_mapping=slots)
    assert len(cache) == 2 and (cache.builds, cache.hits) == (3, 2)
    for layer in range(layers):
        assert same(chunk1[0, layer].view(count, heads, dim), paged_items(caches1[layer], 0, slots1, False))
    del before


def test_lmcache_pointer_cache_rebuilds_after_reregistration() -> None:
    """Host buffers re-registered at the same VA get a new alias: the cached table must follow."""
    cache = lmcache.LayerPointerCache()
    base = torch.zeros(2 * 4096, dtype=torch.uint8)
    views = [base[:4096], base[4096:]]
    first = pd.register_host_tensor(base, DEV)
    table = cache.get(views, DEV)
    assert cache.get(views, DEV) is table and cache.hits == 1
    first.close()
    with pd.register_host_tensor(base, DEV):
        again = cache.get(views, DEV)
        assert again is not table and cache.builds == 2
        assert again[0] == pd.resolve_alias(pd.HostVA(base.data_ptr()), DEV)
    cache.invalidate(DEV)
    assert len(cache) == 0


# --------------------------------------------------------------------------- docs


def test_embedding_doc_runs() -> None:
    """Every ``python`` block of docs/embedding.md runs as written, in order, on the
    emulated device (blocks starting with ``# not run`` are shown, not run)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "embedding.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    runnable = [b for b in blocks if not b.startswith("# not run")]
    assert len(runnable) >= 6
    namespace: dict[str, object] = {"__name__": "embedding_doc"}
    for i, block in enumerate(runnable):
        exec(compile(block, f"docs/embedding.md[python block {i}]", "exec"), namespace)
