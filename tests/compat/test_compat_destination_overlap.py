"""sgl_kernel's call shapes refuse destination buffers that overlap each other or a
source buffer, naming the arguments, before anything is written (a copy writing one
byte twice, or reading bytes it writes, depends on an order a GPU does not define)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import lmcache as lmc
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import sgl_kernel as sk
from tests.helpers.compat import POISON, rand, u8
from tests.helpers.compat import dev as _dev
from tests.helpers.compat import table

DEV = pd.validate_device("emulated:0")
DT = torch.bfloat16
L, H, D, PS = 3, 2, 8, 4
ITEM = H * D * 2
T = 16
PAGES = 5
HT = PAGES * PS
S_IDX = torch.tensor([4, 5, 6, 7], dtype=torch.int64)
D_IDX = torch.tensor([8, 9, 10, 11], dtype=torch.int64)

Host = Callable[..., torch.Tensor]


@pytest.fixture
def host() -> Iterator[Host]:
    owners: list[pd.RegisteredHostMemory] = []

    def make(*shape: int) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        size = numel * 2
        mem = pd.alloc_registered(size, DEV)
        owners.append(mem)
        return mem.tensor[:size].view(DT).view(shape)

    yield make
    for mem in owners:
        mem.close()


def dev(*shape: int) -> torch.Tensor:
    t = _dev(*shape, dtype=DT, device=DEV)
    u8(t).fill_(POISON)
    return t


def untouched(*ts: torch.Tensor) -> bool:
    return all(bool(torch.all(u8(t) == POISON)) for t in ts)


def test_per_layer_pf_lf_same_destination_for_k_and_v(host: Host) -> None:
    hk, hv = rand(host(HT, L, H, D)), rand(host(HT, L, H, D))
    dk = dev(T, H, D)
    with pytest.raises(errors.OverlapError, match="dst_k and dst_v share memory"):
        sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dk, S_IDX, D_IDX, layer_id=1, item_size=ITEM,
                                       src_layout_dim=L * ITEM)
    assert untouched(dk)


def test_per_layer_pf_lf_destinations_overlapping_part_way(host: Host) -> None:
    hk, hv = rand(host(HT, L, H, D)), rand(host(HT, L, H, D))
    both = dev(T + 1, H, D)
    dk, dv = both[:T], both[1:]  # V one token after K: V's slot 0 is K's slot 1
    with pytest.raises(errors.OverlapError, match="dst_k and dst_v share memory"):
        sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S_IDX, D_IDX, layer_id=1, item_size=ITEM,
                                       src_layout_dim=L * ITEM)
    assert untouched(both)


def test_all_layer_lf_pf_same_destination_for_k_and_v(host: Host) -> None:
    """The host side is the destination, one buffer passed as both dst_k and dst_v."""
    hk, hv = host(HT, L, H, D), host(HT, L, H, D)
    u8(hk).fill_(POISON)
    u8(hv).fill_(POISON)
    dks = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(L)]
    dvs = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(L)]
    with pytest.raises(errors.OverlapError, match="dst_k and dst_v share memory"):
        sk.transfer_kv_all_layer_lf_pf(table(dks, DEV), hk, table(dvs, DEV), hk, S_IDX, D_IDX, ITEM, L * ITEM, L)
    assert untouched(hk, hv)


def test_per_layer_lf_destination_is_a_source() -> None:
    k, v = rand(_dev(T, H, D, dtype=DT, device=DEV)), rand(_dev(T, H, D, dtype=DT, device=DEV))
    dk = dev(T, H, D)
    before = u8(v).clone()
    with pytest.raises(errors.OverlapError, match="dst_v overlaps src_v"):
        sk.transfer_kv_per_layer(k, dk, v, v, S_IDX, D_IDX, ITEM)
    assert untouched(dk) and torch.equal(u8(v), before)


def test_per_layer_ph_lf_same_destination(host: Host) -> None:
    hk, hv = rand(host(PAGES, H, PS, L, D)), rand(host(PAGES, H, PS, L, D))
    dk = dev(T, H, D)
    with pytest.raises(errors.OverlapError, match="dst_k and dst_v share memory"):
        sk.transfer_kv_per_layer_ph_lf(hk, dk, hv, dk, S_IDX, D_IDX, 2, ITEM, L * ITEM, PS, H)
    assert untouched(dk)


def test_all_layer_lf_ph_same_destination(host: Host) -> None:
    hk = host(PAGES, H, PS, L, D)
    u8(hk).fill_(POISON)
    dks = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(L)]
    dvs = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(L)]
    with pytest.raises(errors.OverlapError, match="dst_k and dst_v share memory"):
        sk.transfer_kv_all_layer_lf_ph(table(dks, DEV), hk, table(dvs, DEV), hk, S_IDX, D_IDX, ITEM, L * ITEM, L, PS, H)
    assert untouched(hk)


def test_all_layer_lf_pfdhg_same_destination(host: Host) -> None:
    hk = host(PAGES, 2, L, PS, 1, D)
    u8(hk).fill_(POISON)
    dks = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(L)]
    dvs = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(L)]
    with pytest.raises(errors.OverlapError, match="dst_k and dst_v share memory"):
        sk.transfer_kv_all_layer_lf_pfdhg(table(dks, DEV), hk.view(-1), table(dvs, DEV), hk.view(-1), S_IDX, D_IDX, ITEM,
                                          L * ITEM, L, PS, 2)
    assert untouched(hk)


def test_disjoint_buffers_still_copy(host: Host) -> None:
    """The same calls over separate buffers run (and a repeat takes the prepared path)."""
    hk, hv = rand(host(HT, L, H, D)), rand(host(HT, L, H, D))
    dk, dv = dev(T, H, D), dev(T, H, D)
    for _ in range(2):
        sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S_IDX, D_IDX, layer_id=1, item_size=ITEM,
                                       src_layout_dim=L * ITEM)
    assert torch.equal(u8(dk)[D_IDX], u8(hk)[S_IDX, 1]) and torch.equal(u8(dv)[D_IDX], u8(hv)[S_IDX, 1])


# -- sgl_hicache -------------------------------------------------------------------------------

def test_hicache_one_layer_same_destination_for_k_and_v(host: Host) -> None:
    hk, hv = rand(host(HT, H, D)), rand(host(HT, H, D))
    dk = dev(T, H, D)
    with pytest.raises(errors.OverlapError, match="k_cache_dst and v_cache_dst share memory"):
        hc.transfer_hicache_one_layer(dk, dk, D_IDX, hk, hv, S_IDX)
    assert untouched(dk)


def test_hicache_one_layer_destination_is_a_source() -> None:
    hk = rand(_dev(T, H, D, dtype=DT, device=DEV))
    dk, dv = dev(T, H, D), dev(T, H, D)
    u8(dv).copy_(u8(rand(_dev(T, H, D, dtype=DT, device=DEV))))
    before = u8(dv).clone()
    with pytest.raises(errors.OverlapError, match="v_cache_dst overlaps v_cache_src"):
        hc.transfer_hicache_one_layer(dk, dv, D_IDX, hk, dv, S_IDX)
    assert untouched(dk) and torch.equal(u8(dv), before)


def test_hicache_all_layer_same_destination_table_for_k_and_v(host: Host) -> None:
    hk, hv = rand(host(L, HT, H, D)), rand(host(L, HT, H, D))
    dks = [dev(T, H, D) for _ in range(L)]
    with pytest.raises(errors.OverlapError, match="k_ptr_dst and v_ptr_dst share memory"):
        hc.transfer_hicache_all_layer(table(dks, DEV), table(dks, DEV), D_IDX, table([hk[i] for i in range(L)], DEV),
                                      table([hv[i] for i in range(L)], DEV), S_IDX, kv_cache_src_stride_bytes=ITEM,
                                      kv_cache_dst_stride_bytes=ITEM)
    assert untouched(*dks)


def test_hicache_all_layer_backup_into_page_first_rows(host: Host) -> None:
    """Destination rows of every layer interleave in one page_first pool (rows L items apart):
    by design, not an overlap; the bytes land as upstream's kernel puts them."""
    hk, hv = host(HT, L, H, D), host(HT, L, H, D)
    u8(hk).fill_(POISON)
    u8(hv).fill_(POISON)
    dks = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(L)]
    dvs = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(L)]
    hk_t = table([hk.transpose(0, 1)[i] for i in range(L)], DEV)
    hv_t = table([hv.transpose(0, 1)[i] for i in range(L)], DEV)
    hc.transfer_hicache_all_layer(hk_t, hv_t, S_IDX, table(dks, DEV), table(dvs, DEV), D_IDX,
                                  kv_cache_src_stride_bytes=ITEM, kv_cache_dst_stride_bytes=L * ITEM, element_size=ITEM)
    want_k, want_v = u8(hk).clone().fill_(POISON), u8(hv).clone().fill_(POISON)
    for i in range(L):
        want_k[S_IDX, i] = u8(dks[i])[D_IDX]
        want_v[S_IDX, i] = u8(dvs[i])[D_IDX]
    assert torch.equal(u8(hk), want_k) and torch.equal(u8(hv), want_v)
    # the same tables for K and V are still refused
    with pytest.raises(errors.OverlapError, match="k_ptr_dst and v_ptr_dst share memory"):
        hc.transfer_hicache_all_layer(hk_t, hk_t, S_IDX, table(dks, DEV), table(dvs, DEV), D_IDX,
                                      kv_cache_src_stride_bytes=ITEM, kv_cache_dst_stride_bytes=L * ITEM,
                                      element_size=ITEM)


# -- LMCache -------------------------------------------------------------------------------------

def test_lmcache_flash_same_cache_for_k_and_v() -> None:
    nb, bs, nh, hs, tokens = 3, 4, 2, 4, 5
    kv = rand(_dev(2, 2, tokens, nh * hs, dtype=DT, device=DEV))
    cache = dev(nb, bs, nh, hs)
    slots = torch.tensor([0, 3, 5, 7, 9], dtype=torch.int64)
    with pytest.raises(errors.OverlapError, match="key_cache and value_cache share memory"):
        lmc.reshape_and_cache_back_flash(kv, cache, cache, slots, 0)
    assert untouched(cache)
    # sources may share memory: K and V both read from one cache
    u8(cache).copy_(u8(rand(_dev(nb, bs, nh, hs, dtype=DT, device=DEV))))
    mem = dev(2, 2, tokens, nh * hs)
    lmc.load_and_reshape_flash(mem, cache, cache, slots, 1)
    rows = u8(cache).view(nb * bs, -1)
    assert torch.equal(u8(mem)[0, 1], rows[slots]) and torch.equal(u8(mem)[1, 1], rows[slots])
    assert untouched(mem[:, 0])


# -- direct (copy engine) -----------------------------------------------------------------------

def test_direct_destination_list_naming_one_buffer_twice(host: Host) -> None:
    src = [rand(host(HT, H, D)) for _ in range(2)]
    d = dev(T, H, D)
    idx = torch.arange(4, dtype=torch.int64)
    with pytest.raises(errors.OverlapError, match=r"dst_layers\[0\] and dst_layers\[1\] share memory"):
        sk.transfer_kv_direct(src, [d, d], idx, idx, 4)
    assert untouched(d)
    layers = [rand(_dev(T, H, D, dtype=DT, device=DEV)) for _ in range(2)]
    before = u8(layers[1]).clone()
    with pytest.raises(errors.OverlapError, match=r"dst_layers\[0\] overlaps src_layers\[1\]"):
        sk.transfer_kv_direct(layers, [layers[1], dev(T, H, D)], idx, idx + 4, 4)
    assert torch.equal(u8(layers[1]), before)
