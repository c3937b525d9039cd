"""Graph replays follow the caller's indices whatever their dtype, and the pageable route
refuses what the table route refuses.

* ``int32`` indices (HiCache's call shapes take them, as upstream) are widened to a copy;
  under capture the emulated stand-in widens again at each replay (a CUDA graph captures
  the widening's torch op), so a replay after the caller rewrote its indices in place
  writes the rows a call made then would.
* The page_unified write-back reads ``dst_pages`` on the host: refused under capture.
* The direct ops' torch route (a side in plain pageable memory) refuses a destination
  given twice, as the table route does, before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import sgl_kernel as sk
from pointerdomain.testing import EmulatedGraph
from tests.reference import DEV

POISON = 0xA5
T, H, D = 16, 2, 8


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _device(*shape: int) -> torch.Tensor:
    t = pd.device_empty(shape, torch.bfloat16, DEV)
    _u8(t).copy_(torch.randint(0, 256, _u8(t).shape, dtype=torch.uint8))
    return t


def _registered(keep: list[pd.RegisteredHostMemory], *shape: int) -> torch.Tensor:
    n = 2 * int(torch.Size(shape).numel())
    mem = pd.alloc_registered(n, DEV)
    keep.append(mem)
    return mem.tensor[:n].view(torch.bfloat16).view(shape)


def _ptr_table(ts: list[torch.Tensor]) -> torch.Tensor:
    t = pd.device_empty((len(ts),), torch.uint64, DEV)
    return t.copy_(torch.tensor([x.data_ptr() for x in ts], dtype=torch.uint64))


def _replay_matches_a_fresh_call(call: Callable[[torch.Tensor, torch.Tensor], None], outs: list[torch.Tensor],
                                 s: torch.Tensor, d: torch.Tensor, new_s: list[int], new_d: list[int]) -> None:
    """Capture ``call(s, d)``, rewrite ``s`` / ``d`` in place, replay on poisoned outputs:
    the bytes equal those of a call made with the new indices (copies of them)."""
    call(s, d)
    graph = EmulatedGraph()
    with graph.capture(DEV):
        call(s, d)
    s.copy_(torch.tensor(new_s))
    d.copy_(torch.tensor(new_d))
    for t in outs:
        _u8(t).fill_(POISON)
    graph.replay()
    pd.check_errors(DEV)
    replayed = [t.clone() for t in outs]
    for t in outs:
        _u8(t).fill_(POISON)
    call(s.clone(), d.clone())
    for got, want in zip(replayed, outs):
        assert torch.equal(_u8(got), _u8(want))
    assert any(bool((_u8(t) != POISON).any()) for t in outs)  # the reference wrote something
    graph.reset()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_hicache_one_layer_replay_reads_the_callers_indices(dtype: torch.dtype) -> None:
    keep: list[pd.RegisteredHostMemory] = []
    hk, hv = _registered(keep, 32, H, D), _registered(keep, 32, H, D)
    dk, dv = _device(T, H, D), _device(T, H, D)
    _replay_matches_a_fresh_call(
        lambda s, d: hc.transfer_hicache_one_layer(hk, hv, d, dk, dv, s), [hk, hv],
        torch.tensor([1, 2, 3], dtype=dtype), torch.tensor([4, 5, 6], dtype=dtype), [7, 8, 9], [20, 21, 22])


def test_hicache_all_layer_replay_reads_int32_indices() -> None:
    layers, item = 2, H * D * 2
    srcs = [_device(T, H, D) for _ in range(2 * layers)]
    dsts = [_device(T, H, D) for _ in range(2 * layers)]
    sk_t, sv_t = _ptr_table(srcs[:layers]), _ptr_table(srcs[layers:])
    dk_t, dv_t = _ptr_table(dsts[:layers]), _ptr_table(dsts[layers:])
    _replay_matches_a_fresh_call(
        lambda s, d: hc.transfer_hicache_all_layer(dk_t, dv_t, d, sk_t, sv_t, s, kv_cache_src_stride_bytes=item,
                                                   kv_cache_dst_stride_bytes=item),
        dsts, torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([4, 5, 6], dtype=torch.int32),
        [9, 10, 11], [12, 13, 14])


def test_page_unified_load_back_replay_reads_int32_indices() -> None:
    keep: list[pd.RegisteredHostMemory] = []
    pages, groups, layers, page = 4, 2, 2, 4
    pool = _registered(keep, pages, groups, layers, 2, page, 1, D)
    _u8(pool).copy_(torch.randint(0, 256, _u8(pool).shape, dtype=torch.uint8))
    pk, pv = _device(T, groups, D), _device(T, groups, D)
    _replay_matches_a_fresh_call(
        lambda s, d: hc.transfer_hicache_one_layer_page_unified_lf(pk, pv, pool, s, d, 1), [pk, pv],
        torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([4, 5, 6], dtype=torch.int32),
        [9, 10, 11], [12, 13, 14])


def test_page_unified_write_back_refused_under_capture() -> None:
    keep: list[pd.RegisteredHostMemory] = []
    pages, groups, layers, page = 4, 2, 2, 4
    dst = _registered(keep, pages, groups, layers, 2, page, 1, D)
    ks = [_device(T, groups, D) for _ in range(layers)]
    vs = [_device(T, groups, D) for _ in range(layers)]
    staging = pd.device_empty((1, groups, layers, 2, page, 1, D), torch.bfloat16, DEV)
    src_pages, dst_pages = torch.tensor([0, 1]), torch.tensor([2, 3])
    k_t, v_t = _ptr_table(ks), _ptr_table(vs)
    _u8(dst).fill_(POISON)
    graph = EmulatedGraph()
    with pytest.raises(errors.InvalidArgumentError, match="capture"):
        with graph.capture(DEV):
            hc.transfer_hicache_all_layer_staged_lf_page_unified(k_t, v_t, src_pages, dst_pages, staging, dst)
    pd.check_errors(DEV)
    assert bool((_u8(dst) == POISON).all())
    # outside capture the same call moves the pages
    hc.transfer_hicache_all_layer_staged_lf_page_unified(k_t, v_t, src_pages, dst_pages, staging, dst)
    pd.check_errors(DEV)
    want = ks[0][0:page].reshape(page, groups, D).transpose(0, 1)  # page 0, layer 0, K: [group, token, dim]
    assert torch.equal(_u8(dst[2, :, 0, 0, :, 0].contiguous()), _u8(want.contiguous()))  # bytes: random NaNs


def _pageable(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("host", ["registered", "pageable"])
def test_direct_ops_refuse_a_destination_twice_on_either_route(host: str) -> None:
    keep: list[pd.RegisteredHostMemory] = []

    def make(*shape: int) -> torch.Tensor:
        return _registered(keep, *shape) if host == "registered" else _pageable(*shape)

    layers, page, pages = 2, 4, 4
    src = [_device(T, H, D) for _ in range(2)]
    dst = [make(T, H, D) for _ in range(2)]
    for t in dst:
        _u8(t).fill_(POISON)
    with pytest.raises(errors.OverlapError, match="dst_indices"):
        sk.transfer_kv_direct(src, dst, torch.tensor([1, 2]), torch.tensor([5, 5]), 1)
    device_layers = [_device(T, H, D) for _ in range(2 * layers)]
    pool = [make(pages, layers, page, H, D), make(pages, layers, page, H, D)]
    for t in pool:
        _u8(t).fill_(POISON)
    with pytest.raises(errors.OverlapError, match="dst_indices"):  # two pages into host page 1
        sk.transfer_kv_all_layer_direct_lf_pf(device_layers, pool, torch.arange(8),
                                              torch.tensor([4, 5, 6, 7, 4, 5, 6, 7]), page)
    loaded = [_device(T, H, D) for _ in range(2)]
    before = [t.clone() for t in loaded]
    with pytest.raises(errors.OverlapError, match="dst_indices"):  # two pages into device rows 8..11
        sk.transfer_kv_per_layer_direct_pf_lf(pool, loaded, torch.arange(8),
                                              torch.tensor([8, 9, 10, 11, 8, 9, 10, 11]), 0, page)
    pd.check_errors(DEV)
    for t in dst + pool:
        assert bool((_u8(t) == POISON).all())
    for t, b in zip(loaded, before):
        assert torch.equal(_u8(t), _u8(b))
    # the same calls with distinct destinations move the bytes on either route
    sk.transfer_kv_direct(src, dst, torch.tensor([1, 2]), torch.tensor([5, 6]), 1)
    pd.check_errors(DEV)
    for s, d in zip(src, dst):
        assert torch.equal(_u8(d[5:7]), _u8(s[1:3]))
