"""Host buffers registered in several chunks (pools above ``max_chunk_bytes``, 64 GiB by
default) through the compat call shapes: each chunk has its own device alias on the emulated
device (and in strict alias mode), so an item is reached through its own chunk's alias. Chunks
are made tiny here with a small ``max_chunk_bytes``; every result is compared byte for byte
with plain torch on poisoned destinations."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import sgl_kernel as kvcacheio
from pointerdomain.compat import vllm as ops

DEV = pd.validate_device("emulated:0")
LAYERS, HEADS, DIM, PAGES, PAGE = 2, 2, 8, 8, 4
SLOTS = PAGES * PAGE
ITEM = HEADS * DIM * 2  # bf16 bytes of one token's K (or V) of one layer
POISON = 0xA5


@contextlib.contextmanager
def _mode(strict: bool) -> Iterator[None]:
    if strict:
        with pd.strict_alias(True):
            yield
    else:
        yield


def _random(t: torch.Tensor) -> torch.Tensor:
    u = t.view(torch.uint8)
    u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8))
    return t


def _table(bufs: list[torch.Tensor]) -> torch.Tensor:
    return pd.device_empty((len(bufs),), torch.uint64, DEV).copy_(
        torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64))


def _host_pool(chunk_pages: int) -> pd.HostKVPool:
    lay = pd.KVLayout(kind="page_first", num_layers=LAYERS, num_pages=PAGES, page_size=PAGE, num_heads=HEADS,
                      head_dim=DIM)
    return pd.HostKVPool(lay, DEV, max_chunk_bytes=lay.page_block_bytes() * chunk_pages)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("chunk_pages", [1, 3])
def test_sgl_kernel_round_trip_through_a_chunked_host_pool(strict: bool, chunk_pages: int) -> None:
    with _mode(strict):
        host = _host_pool(chunk_pages)
        try:
            assert len(host.memory.chunks) > 1
            k = [_random(pd.device_empty((SLOTS, HEADS, DIM), torch.bfloat16, DEV)) for _ in range(LAYERS)]
            v = [_random(pd.device_empty((SLOTS, HEADS, DIM), torch.bfloat16, DEV)) for _ in range(LAYERS)]
            hk, hv = host.buffer[0], host.buffer[1]
            hk.view(torch.uint8).fill_(POISON)
            hv.view(torch.uint8).fill_(POISON)
            # every page of every chunk, out of order, including an item at a chunk's last slot
            src = torch.tensor([3, 0, 17, 30, 9, 22, 5, 12, 31, 26])
            dst = torch.tensor([31, 0, 7, 16, 4, 27, 12, 3, 20, 11])
            want_k = hk.view(torch.uint8).clone().view(SLOTS, LAYERS, ITEM)
            want_v = hv.view(torch.uint8).clone().view(SLOTS, LAYERS, ITEM)
            for layer in range(LAYERS):
                want_k[dst, layer] = k[layer].view(torch.uint8).view(SLOTS, ITEM)[src]
                want_v[dst, layer] = v[layer].view(torch.uint8).view(SLOTS, ITEM)[src]
            kvcacheio.transfer_kv_all_layer_lf_pf(_table(k), hk, _table(v), hv, src, dst, ITEM, LAYERS * ITEM,
                                                  LAYERS)
            assert torch.equal(hk.view(torch.uint8).view(SLOTS, LAYERS, ITEM), want_k)
            assert torch.equal(hv.view(torch.uint8).view(SLOTS, LAYERS, ITEM), want_v)
            # and back, one layer at a time, into poisoned device buffers
            k2 = [pd.device_empty((SLOTS, HEADS, DIM), torch.bfloat16, DEV) for _ in range(LAYERS)]
            v2 = [pd.device_empty((SLOTS, HEADS, DIM), torch.bfloat16, DEV) for _ in range(LAYERS)]
            for t in k2 + v2:
                t.view(torch.uint8).fill_(POISON)
            back = torch.arange(len(dst))
            for layer in range(LAYERS):
                kvcacheio.transfer_kv_per_layer_pf_lf(hk, k2[layer], hv, v2[layer], dst, back, layer, ITEM,
                                                      LAYERS * ITEM)
                for t, ref in ((k2[layer], k[layer]), (v2[layer], v[layer])):
                    got = t.view(torch.uint8).view(SLOTS, ITEM)
                    assert torch.equal(got[: len(dst)], ref.view(torch.uint8).view(SLOTS, ITEM)[src])
                    assert bool((got[len(dst):] == POISON).all())
        finally:
            host.close()


@pytest.mark.parametrize("strict", [False, True])
def test_sgl_kernel_refuses_a_page_block_across_a_chunk_boundary(strict: bool) -> None:
    # a buffer over a chunk cut whose rows (the layout's page block: one token of every
    # layer) are not cut on it: the row across the cut has no one alias
    with _mode(strict):
        row = LAYERS * ITEM
        mem = pd.alloc_registered(4 * 4096, DEV, max_chunk_bytes=4096)
        try:
            assert len(mem.chunks) == 4
            buf = mem.tensor[4096 - row // 2: 4096 - row // 2 + 2 * row]
            buf.fill_(POISON)
            k = [_random(pd.device_empty((2, HEADS, DIM), torch.bfloat16, DEV)) for _ in range(LAYERS)]
            with pytest.raises(errors.RegistrationSpanError, match="crosses a chunk boundary"):
                kvcacheio.transfer_kv_all_layer_lf_pf(_table(k), buf, None, None, torch.tensor([0]),
                                                      torch.tensor([1]), ITEM, row, LAYERS)
            assert bool((buf == POISON).all())
        finally:
            mem.close()


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_vllm_swap_blocks_with_a_chunked_host_cache(strict: bool, direction: str) -> None:
    with _mode(strict):
        blocks, block = 12, 1024
        mem = pd.alloc_registered(blocks * block, DEV, max_chunk_bytes=4096)
        try:
            assert len(mem.chunks) == 3
            host = mem.tensor[: blocks * block].view(blocks, block)
            gpu = pd.device_empty((blocks, block), torch.uint8, DEV)
            src, dst = (gpu, host) if direction == "d2h" else (host, gpu)
            _random(src)
            dst.fill_(POISON)
            mapping = torch.tensor([[0, 11], [5, 3], [11, 4], [7, 8], [3, 0]])
            want = dst.clone()
            want[mapping[:, 1]] = src[mapping[:, 0]]
            ops.swap_blocks(src, dst, block, mapping)
            assert torch.equal(dst, want)
            # a repeat takes the prepared path: same bytes again
            dst.fill_(POISON)
            ops.swap_blocks(src, dst, block, mapping)
            assert torch.equal(dst, want)
        finally:
            mem.close()


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("dst_stride", [1, 2])
def test_hicache_raw_tables_into_a_chunked_host_pool(strict: bool, dst_stride: int) -> None:
    # engine-style raw tables: one data_ptr() per layer of a host pool registered in 4 KiB
    # chunks, each layer over several chunks; rows of E bytes every dst_stride * E bytes
    with _mode(strict):
        layers, rows, e = 2, 256, 32
        mem = pd.alloc_registered(2 * layers * rows * dst_stride * e, DEV, max_chunk_bytes=4096)
        try:
            assert len(mem.chunks) >= 4 * layers
            host = mem.tensor.view(2 * layers, rows, dst_stride * e)
            host.fill_(POISON)
            dk = [_random(pd.device_empty((rows, e), torch.uint8, DEV)) for _ in range(2 * layers)]
            src = torch.tensor([0, 5, 255, 127, 128, 9])
            dst = torch.tensor([127, 0, 255, 128, 63, 64])  # rows on both sides of 4 KiB cuts
            want = host.clone()
            for i in range(2 * layers):
                want[i, dst, :e] = dk[i][src]
            hk = _table([host[l] for l in range(layers)])
            hv = _table([host[layers + l] for l in range(layers)])
            sk, sv = _table(dk[:layers]), _table(dk[layers:])
            hc.transfer_hicache_all_layer(hk, hv, dst, sk, sv, src, kv_cache_src_stride_bytes=e,
                                          kv_cache_dst_stride_bytes=dst_stride * e, element_size=e)
            assert torch.equal(host, want)
            # and back into poisoned device rows
            back = [pd.device_empty((rows, e), torch.uint8, DEV) for _ in range(2 * layers)]
            for t in back:
                t.fill_(POISON)
            order = torch.arange(len(dst))
            hc.transfer_hicache_all_layer(_table(back[:layers]), _table(back[layers:]), order, hk, hv, dst,
                                          kv_cache_src_stride_bytes=dst_stride * e, kv_cache_dst_stride_bytes=e,
                                          element_size=e)
            for i in range(2 * layers):
                assert torch.equal(back[i][: len(dst)], dk[i][src])
                assert bool((back[i][len(dst):] == POISON).all())
        finally:
            mem.close()


@pytest.mark.parametrize("strict", [False, True])
def test_raw_entry_past_its_registration_still_refused(strict: bool) -> None:
    with _mode(strict):
        mem = pd.alloc_registered(4 * 4096, DEV, max_chunk_bytes=4096)
        try:
            host = mem.tensor
            host.fill_(POISON)
            dk = [_random(pd.device_empty((64, 32), torch.uint8, DEV))]
            # an entry 1 KiB before the registration's end cannot hold 64 rows of 32 bytes
            with pytest.raises(errors.PointerDomainError):
                hc.transfer_hicache_all_layer_mla(_table([host[-1024:]]), torch.tensor([40]), _table(dk),
                                                  torch.tensor([0]), cache_src_stride_bytes=32,
                                                  cache_dst_stride_bytes=32, element_size=32)
            assert bool((host == POISON).all())
        finally:
            mem.close()


def test_chunks_at_one_alias_offset_keep_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # where every chunk's alias is its host VA plus one offset (CUDA's unified addressing), the
    # first chunk's alias holds for the whole buffer: no per-block table is made
    from pointerdomain.compat import _raw

    host = _host_pool(2)
    try:
        table = _raw.tensor_table("dst", [host.buffer[0]], DEV, across_chunks=True)
        lay = kvcacheio.layout("page_first", 1, LAYERS, SLOTS, 1, ITEM)
        assert len(_raw.split_chunked(table, lay)) == SLOTS  # per-chunk aliases differ here: per block
        _raw.clear_cache()
        table = _raw.tensor_table("dst", [host.buffer[0]], DEV, across_chunks=True)
        monkeypatch.setattr(_raw, "alias_of", lambda va, device: pd.DeviceAlias.unsafe_from_int(va.value + 4096,
                                                                                                   device))
        assert _raw.split_chunked(table, lay) is table
    finally:
        host.close()
