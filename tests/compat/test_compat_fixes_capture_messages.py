"""Compat call shapes under graph capture and in their error wording: vLLM's pageable
``swap_blocks`` refused while capturing (it would copy at once and record nothing), a
duplicate HiCache destination named in the caller's own argument and positions, and
LMCache's ``block_size`` where a format does not address by blocks."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import lmcache as lmc
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import vllm as ops
from pointerdomain.testing import EmulatedGraph

DEV = pd.validate_device("emulated:0")


def _on_device(values: list[int]) -> torch.Tensor:
    return pd.device_empty((len(values),), torch.uint64, DEV).copy_(torch.tensor(values, dtype=torch.uint64))


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_swap_blocks_pageable_refused_under_capture(direction: str) -> None:
    gpu = pd.device_empty((8, 256), torch.uint8, DEV)
    gpu.copy_(torch.randint(1, 256, (8, 256), dtype=torch.uint8))
    pageable = torch.zeros(8, 256, dtype=torch.uint8)
    gpu_before, host_before = gpu.clone(), pageable.clone()
    src, dst = (gpu, pageable) if direction == "d2h" else (pageable, gpu)
    graph = EmulatedGraph()
    try:
        with pytest.raises(errors.InvalidArgumentError, match="captur"):
            with graph.capture(DEV):
                ops.swap_blocks(src, dst, 256, torch.tensor([[1, 0]]))
        assert torch.equal(pageable, host_before)  # nothing copied during capture
        assert torch.equal(gpu, gpu_before)
    finally:
        graph.reset()
    # outside capture the same call copies
    ops.swap_blocks(src, dst, 256, torch.tensor([[1, 0]]))
    assert torch.equal(dst[0], src[1])


@pytest.mark.parametrize(("dst", "pos", "value"), [([1, 1], (0, 1), 1), ([3, 5, 3], (0, 2), 3), ([0, 7, 7], (1, 2), 7)])
@pytest.mark.parametrize("dst_stride_factor", [1, 2])
def test_hicache_duplicate_destination_named_as_caller(dst: list[int], pos: tuple[int, int], value: int,
                                                       dst_stride_factor: int) -> None:
    L, S, E = 2, 16, 32
    dk = [pd.device_empty((S, E), torch.uint8, DEV) for _ in range(2 * L)]
    mem = pd.alloc_registered(2 * L * S * dst_stride_factor * E, DEV)
    try:
        hb = mem.tensor.view(2 * L, S, dst_stride_factor * E)
        hb.fill_(0xA5)
        hk = _on_device([hb[l].data_ptr() for l in range(L)])
        hv = _on_device([hb[L + l].data_ptr() for l in range(L)])
        sk = _on_device([x.data_ptr() for x in dk[:L]])
        sv = _on_device([x.data_ptr() for x in dk[L:]])
        src = torch.arange(len(dst))
        # a good call first: a repeat of the call shape takes its prepared path, which must word it the same
        hc.transfer_hicache_all_layer(hk, hv, torch.arange(len(dst)) + 8, sk, sv, src, kv_cache_src_stride_bytes=E,
                                      kv_cache_dst_stride_bytes=dst_stride_factor * E, element_size=E)
        hb.fill_(0xA5)
        with pytest.raises(errors.OverlapError) as info:
            hc.transfer_hicache_all_layer(hk, hv, torch.tensor(dst), sk, sv, src, kv_cache_src_stride_bytes=E,
                                          kv_cache_dst_stride_bytes=dst_stride_factor * E, element_size=E)
        msg = str(info.value)
        assert msg.startswith("indices_dst"), msg
        assert f"indices_dst[{pos[0]}]" in msg and f"indices_dst[{pos[1]}]" in msg, msg
        assert f"row {value}" in msg, msg
        assert "dst_indices" not in msg and "slot" not in msg, msg
        assert bool((hb.view(torch.uint8) == 0xA5).all())  # nothing written
    finally:
        mem.close()


def test_hicache_one_layer_duplicate_destination_named_as_caller() -> None:
    S, E = 16, 32
    k_src, v_src = (pd.device_empty((S, E), torch.uint8, DEV) for _ in range(2))
    mem = pd.alloc_registered(2 * S * E, DEV)
    try:
        host = mem.tensor.view(2, S, E)
        host.fill_(0xA5)
        with pytest.raises(errors.OverlapError) as info:
            hc.transfer_hicache_one_layer(host[0], host[1], torch.tensor([4, 2, 4]), k_src, v_src,
                                          torch.tensor([0, 1, 2]))
        msg = str(info.value)
        assert msg.startswith("indices_dst") and "indices_dst[0]" in msg and "indices_dst[2]" in msg, msg
        assert "row 4" in msg, msg
        assert bool((host.view(torch.uint8) == 0xA5).all())
    finally:
        mem.close()


def test_direct_pageable_refused_under_capture() -> None:
    from pointerdomain.compat import sgl_kernel as sk

    d = pd.device_empty((16, 2, 8), torch.bfloat16, DEV)
    d.copy_(torch.randn(16, 2, 8).to(torch.bfloat16))
    h = torch.zeros(16, 2, 8, dtype=torch.bfloat16)
    graph = EmulatedGraph()
    try:
        with pytest.raises(errors.InvalidArgumentError, match=r"dst_layers\[0\]: plain pageable host memory"):
            with graph.capture(DEV):
                sk.transfer_kv_direct([d], [h], torch.arange(4), torch.arange(4), 4)
        assert bool((h == 0).all())
    finally:
        graph.reset()
    sk.transfer_kv_direct([d], [h], torch.arange(4), torch.arange(4), 4)
    assert torch.equal(h[:4], d[:4])


@pytest.mark.parametrize("mla", [False, True])
def test_page_unified_duplicate_destination_named_as_caller(mla: bool) -> None:
    L, PS, G, D = 3, 4, 2, 8
    shape = (3, L, PS, D) if mla else (3, G, L, 2, PS, 1, D)
    mem = pd.alloc_registered(torch.Size(shape).numel() * 2, DEV)
    try:
        pool = mem.tensor.view(torch.bfloat16).view(shape)
        out = [pd.device_empty((16, 1 if mla else G, D), torch.bfloat16, DEV) for _ in range(1 if mla else 2)]
        for t in out:
            t.view(torch.uint8).fill_(0xA5)
        with pytest.raises(errors.OverlapError) as info:
            if mla:
                hc.transfer_hicache_one_layer_mla_page_unified_lf(out[0], pool, torch.tensor([9, 0, 3]),
                                                                  torch.tensor([1, 15, 1]), 1)
            else:
                hc.transfer_hicache_one_layer_page_unified_lf(out[0], out[1], pool, torch.tensor([9, 0, 3]),
                                                              torch.tensor([1, 15, 1]), layer_id=1)
        msg = str(info.value)
        assert msg.startswith("dst_indices[0] and dst_indices[2] both write slot 1"), msg
        assert all(bool((t.view(torch.uint8) == 0xA5).all()) for t in out)
    finally:
        mem.close()
