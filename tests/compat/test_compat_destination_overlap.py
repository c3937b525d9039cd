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
from tests.helpers.compat import POISON, rand, same, u8
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


@pytest.fixture(params=["one chunk", "chunked"])
def host(request: pytest.FixtureRequest) -> Iterator[Host]:
    """Registered host tensors; "chunked": registered in chunks of two leading-dimension
    blocks, each chunk with its own device alias (overlaps are found all the same)."""
    owners: list[pd.RegisteredHostMemory] = []

    def make(*shape: int) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        size = numel * 2
        if request.param == "chunked" and len(shape) > 1 and shape[0] > 2:
            block = size // shape[0]
            mem = pd.alloc_registered(size, DEV, granularity=block, max_chunk_bytes=2 * block)
        else:
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
    with pytest.raises(errors.OverlapError, match=r"k_ptr_dst\[\d\] and v_ptr_dst\[\d\] share memory"):
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
    owner = pd.find_registration(pd.HostVA.unsafe_from_int(hk.data_ptr()))
    if owner is not None and len(owner.chunks) > 1:
        # per-chunk entries cannot keep interleaved rows apart: refused, nothing written
        with pytest.raises(errors.RegistrationSpanError, match=r"k_ptr_dst, v_ptr_dst: destination rows of several "
                                                               r"entries interleave"):
            hc.transfer_hicache_all_layer(hk_t, hv_t, S_IDX, table(dks, DEV), table(dvs, DEV), D_IDX,
                                          kv_cache_src_stride_bytes=ITEM, kv_cache_dst_stride_bytes=L * ITEM,
                                          element_size=ITEM)
        assert bool((u8(hk) == POISON).all()) and bool((u8(hv) == POISON).all())
        return
    hc.transfer_hicache_all_layer(hk_t, hv_t, S_IDX, table(dks, DEV), table(dvs, DEV), D_IDX,
                                  kv_cache_src_stride_bytes=ITEM, kv_cache_dst_stride_bytes=L * ITEM, element_size=ITEM)
    want_k, want_v = u8(hk).clone().fill_(POISON), u8(hv).clone().fill_(POISON)
    for i in range(L):
        want_k[S_IDX, i] = u8(dks[i])[D_IDX]
        want_v[S_IDX, i] = u8(dvs[i])[D_IDX]
    assert torch.equal(u8(hk), want_k) and torch.equal(u8(hv), want_v)
    # the same tables for K and V are still refused
    with pytest.raises(errors.OverlapError, match=r"k_ptr_dst\[\d\] and v_ptr_dst\[\d\] share memory"):
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


# -- interleaved destinations: rows that meet at different addresses ---------------------------

def _registered_rows(rows: int, width: int) -> tuple[torch.Tensor, object]:
    """``rows`` poisoned bf16 rows of ``width`` elements in registered host memory, and the
    registration (kept alive by the caller)."""
    r = pd.alloc_registered(rows * width * 2, DEV)
    x = r.tensor.view(torch.uint8)[: rows * width * 2]
    x.fill_(POISON)
    return x.view(DT).view(rows, width), r


def _ptrs(values: list[int]) -> torch.Tensor:
    t = pd.device_empty((len(values),), torch.uint64, DEV)
    t.copy_(torch.tensor(values, dtype=torch.uint64))
    return t


def test_hicache_one_layer_v_rows_one_row_after_k_rows() -> None:
    """k_dst = X[0:2N:2], v_dst = X[2:2N+2:2]: V row i is K row i+1, every other row untouched
    in between, so the buffers start apart but rows meet."""
    n, width = 8, 16
    ks, vs = rand(_dev(n, width, dtype=DT, device=DEV)), rand(_dev(n, width, dtype=DT, device=DEV))
    x, _keep = _registered_rows(2 * n + 2, width)
    with pytest.raises(errors.OverlapError, match="k_cache_dst and v_cache_dst share memory"):
        hc.transfer_hicache_one_layer(x[0:2 * n:2], x[2:2 * n + 2:2], torch.tensor([1, 0]), ks, vs,
                                      torch.tensor([3, 5]))
    assert untouched(x)
    # V half a row after K: rows still meet
    with pytest.raises(errors.OverlapError, match="k_cache_dst and v_cache_dst share memory"):
        hc.transfer_hicache_one_layer(x[0:2 * n:2], x.view(-1)[width // 2: width // 2 + 2 * n * width].view(
            2 * n, width)[0::2], torch.tensor([1, 0]), ks, vs, torch.tensor([3, 5]))
    assert untouched(x)
    # V one row after K, rows 2 apart: interleaved by design, exact bytes
    hc.transfer_hicache_one_layer(x[0:2 * n:2], x[1:2 * n + 1:2], torch.tensor([1, 0]), ks, vs, torch.tensor([3, 5]))
    want = u8(x).clone().fill_(POISON).view(2 * n + 2, -1)
    want[2], want[0] = u8(ks)[3], u8(ks)[5]
    want[3], want[1] = u8(vs)[3], u8(vs)[5]
    assert torch.equal(u8(x).view(2 * n + 2, -1), want)


@pytest.mark.parametrize("shift", [2.0, 0.5, 1.5])
def test_hicache_all_layer_mla_layer_pointers_rows_apart(shift: float) -> None:
    """Layer 1's destination pointer = layer 0's + ``shift`` rows, rows two rows apart: rows
    of the two layers meet (two rows, one stride: layer 1 row i is layer 0 row i+1; half a
    row or one and a half: rows half over each other)."""
    layers, n, width = 2, 8, 16
    el = 2 * width
    stride = layers * el
    src = [rand(_dev(n, width, dtype=DT, device=DEV)) for _ in range(layers)]
    y, _keep = _registered_rows(2 * (n + 2), width)
    base = y.data_ptr()
    with pytest.raises(errors.OverlapError, match=r"ptr_dst\[0\] and ptr_dst\[1\] share memory"):
        hc.transfer_hicache_all_layer_mla(_ptrs([base, base + int(shift * el)]), torch.tensor([1, 0]),
                                          _ptrs([s.data_ptr() for s in src]), torch.tensor([3, 5]),
                                          cache_src_stride_bytes=el, cache_dst_stride_bytes=stride, element_size=el)
    assert untouched(y)


def test_hicache_all_layer_mla_page_first_layers_interleave() -> None:
    """Layer l's pointer = base + l * row in a page_first pool (rows ``layers`` items apart):
    by design; exact bytes."""
    layers, n, width = 3, 8, 16
    el = 2 * width
    src = [rand(_dev(n, width, dtype=DT, device=DEV)) for _ in range(layers)]
    y, _keep = _registered_rows(n * layers, width)
    hc.transfer_hicache_all_layer_mla(_ptrs([y.data_ptr() + l * el for l in range(layers)]), torch.tensor([1, 0, 6]),
                                      _ptrs([s.data_ptr() for s in src]), torch.tensor([3, 5, 2]),
                                      cache_src_stride_bytes=el, cache_dst_stride_bytes=layers * el, element_size=el)
    want = u8(y).clone().fill_(POISON).view(n, layers, el)
    for l in range(layers):
        want[[1, 0, 6], l] = u8(src[l])[[3, 5, 2]]
    assert torch.equal(u8(y).view(n, layers, el), want)


def _lmc_case(fmt: int, shift_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layers, nb, bs, nh, hs, tokens = 2, 2, 4, 2, 8, 3
    e = nh * hs
    kv_size = 1 if fmt == 3 else 2
    kv = rand(_dev(kv_size, layers, tokens, e, dtype=DT, device=DEV))
    cache = pd.device_empty((4 * nb * bs * e,), DT, DEV)
    u8(cache).fill_(POISON)
    ptrs = torch.tensor([cache.data_ptr(), cache.data_ptr() + shift_tokens * e * 2], dtype=torch.int64)
    return kv, cache, ptrs


@pytest.mark.parametrize("fmt", [1, 2, 3])
def test_lmcache_key_value_ptrs_one_token_apart(fmt: int) -> None:
    kv, cache, ptrs = _lmc_case(fmt, 1)
    with pytest.raises(errors.OverlapError, match=r"key_value_ptrs\[0\].* and key_value_ptrs\[1\].* share memory"):
        lmc.multi_layer_kv_transfer(kv, ptrs, torch.tensor([0, 5, 6]), DEV, 8, 0, fmt, block_size=4)
    assert untouched(cache)


def test_lmcache_unilateral_key_value_ptrs_one_token_apart() -> None:
    e, p, tokens = 16, 8, 3
    kv = rand(_dev(2, 1, tokens, e, dtype=DT, device=DEV))
    cache = pd.device_empty((4 * p * e,), DT, DEV)
    u8(cache).fill_(POISON)
    base = cache.data_ptr()
    ptrs = torch.tensor([base, base + e * 2], dtype=torch.int64)  # V = K shifted by one token
    with pytest.raises(errors.OverlapError, match=r"key_value_ptrs\[0\] and key_value_ptrs\[1\] share memory"):
        lmc.multi_layer_kv_transfer_unilateral(kv, ptrs, torch.tensor([0, 5, 6]), DEV, p, 0, 0)
    assert untouched(cache)


# -- embedding ranges ----------------------------------------------------------------------------

EMB = 12  # bf16 elements a row


def _pageable(rows: int) -> torch.Tensor:
    """Plain pageable host memory (the torch route), poisoned."""
    t = torch.empty(rows, EMB, dtype=DT)
    u8(t).fill_(POISON)
    return t


@pytest.mark.parametrize("route", ["registered", "pageable"])
@pytest.mark.parametrize(("dst_starts", "lengths"), [([2, 2], [3, 3]), ([2, 4], [3, 1]), ([0, 5, 3], [4, 2, 2])])
def test_embedding_ranges_writing_one_destination_row_twice(host: Host, route: str, dst_starts: list[int],
                                                            lengths: list[int]) -> None:
    """Two ranges whose destination rows meet: which one lands would be the copy order's choice."""
    src = rand(_dev(16, EMB, dtype=DT, device=DEV))
    dst = _pageable(10) if route == "pageable" else host(10, EMB)
    u8(dst).fill_(POISON)
    starts = [0, 6, 12][: len(lengths)]
    with pytest.raises(errors.OverlapError, match=r"range \d and range \d write dst row"):
        sk.transfer_embedding_ranges_direct(src, dst, starts, dst_starts, lengths)
    assert untouched(dst)


@pytest.mark.parametrize(("src_start", "dst_start", "src_view", "dst_view"),
                         [(0, 2, 0, 0), (4, 0, 0, 2), (0, 0, 3, 0), (5, 5, 0, 0)])
def test_embedding_ranges_destination_meeting_the_source(src_start: int, dst_start: int, src_view: int,
                                                         dst_view: int) -> None:
    """src and dst over one device buffer (the same tensor, or views at other rows) where a
    destination range's bytes are bytes a source range reads."""
    whole = rand(_dev(20, EMB, dtype=DT, device=DEV))
    before = u8(whole).clone()
    src, dst = whole[src_view:src_view + 12], whole[dst_view:dst_view + 12]
    with pytest.raises(errors.OverlapError, match=r"range 0 writes dst rows .* that range 0 reads"):
        sk.transfer_embedding_ranges_direct(src, dst, [src_start], [dst_start], [4])
    assert torch.equal(u8(whole), before)


def test_embedding_ranges_destination_outside_the_tensor_is_refused() -> None:
    src = rand(_dev(8, EMB, dtype=DT, device=DEV))
    whole = _dev(12, EMB, dtype=DT, device=DEV)
    u8(whole).fill_(POISON)
    dst = whole[:6]  # rows 6.. of the allocation are not dst's
    with pytest.raises(errors.IndexValidationError, match="outside a tensor"):
        sk.transfer_embedding_ranges_direct(src, dst, [0, 2], [0, 4], [2, 3])
    assert untouched(whole)


def test_embedding_ranges_into_released_storage_are_refused() -> None:
    src = rand(_dev(8, EMB, dtype=DT, device=DEV))
    dst = _pageable(10)
    dst.untyped_storage().resize_(0)  # the torch route would write (or torch refuse, untyped) there
    with pytest.raises(errors.ClosedError, match="dst: .*storage holds fewer bytes"):
        sk.transfer_embedding_ranges_direct(src, dst, [0], [0], [2])


@pytest.mark.parametrize("route", ["registered", "pageable"])
def test_embedding_ranges_disjoint_destinations_still_copy(host: Host, route: str) -> None:
    """Adjacent and out-of-order disjoint ranges, zero-length ranges at a used row, and a
    move inside one device buffer whose ranges do not meet: exact bytes, the rest poison."""
    src = rand(_dev(16, EMB, dtype=DT, device=DEV))
    dst = _pageable(10) if route == "pageable" else host(10, EMB)
    u8(dst).fill_(POISON)
    ss, ds, ls = [0, 9, 3, 5], [5, 0, 8, 5], [3, 2, 2, 0]
    sk.transfer_embedding_ranges_direct(src, dst, ss, ds, ls)
    want = _pageable(10)
    for a, b, n in zip(ss, ds, ls):
        want[b:b + n] = src[a:a + n]
    assert same(dst, want)
    whole = rand(_dev(20, EMB, dtype=DT, device=DEV))
    want = whole.clone()
    want[10:14] = whole[0:4]
    sk.transfer_embedding_ranges_direct(whole, whole, [0], [10], [4])
    assert same(whole, want)


# -- raw destination entries in one larger registration ------------------------------------------

def _arena(nbytes: int) -> tuple[torch.Tensor, pd.RegisteredHostMemory]:
    """``nbytes`` poisoned bytes of registered host memory and its registration."""
    mem = pd.alloc_registered(nbytes, DEV)
    x = mem.tensor.view(torch.uint8)[:nbytes]
    x.fill_(POISON)
    return x, mem


@pytest.mark.parametrize("slack", [0, 64, 3 * 16 + 5])
def test_hicache_all_layer_backup_into_layers_of_a_larger_registration(slack: int) -> None:
    """Per-layer K and V buffers carved one after another from one registration with spare
    bytes after the last: each entry holds its rows up to the next entry (not to the end of
    the registration), so the layers do not meet; exact bytes, the rest untouched."""
    layers, rows, el = 2, 8, 16
    x, mem = _arena(2 * layers * rows * el + slack)
    base = x.data_ptr()
    srcs = [rand(_dev(rows, el, dtype=torch.uint8, device=DEV)) for _ in range(2 * layers)]
    s_idx, d_idx = torch.tensor([1, 6, 2]), torch.tensor([5, 0, 7])
    hc.transfer_hicache_all_layer(_ptrs([base + l * rows * el for l in range(layers)]),
                                  _ptrs([base + (layers + l) * rows * el for l in range(layers)]), d_idx,
                                  _ptrs([s.data_ptr() for s in srcs[:layers]]),
                                  _ptrs([s.data_ptr() for s in srcs[layers:]]), s_idx,
                                  kv_cache_src_stride_bytes=el, kv_cache_dst_stride_bytes=el)
    want = x.clone().fill_(POISON)
    blocks = want[:2 * layers * rows * el].view(2 * layers, rows, el)
    for i, s in enumerate(srcs):
        blocks[i, d_idx] = s[s_idx]
    assert torch.equal(x, want)
    # a row past a layer's last is the next layer's first: still refused, nothing written (no
    # slack: past the last layer's allocation, so out of range)
    x.fill_(POISON)
    refused = (pytest.raises(errors.IndexValidationError, match=r"indices_dst: slot 8 outside \[0, 8\)") if slack < el
               else pytest.raises(errors.OverlapError, match=r"k_ptr_dst\[0\] and k_ptr_dst\[1\] share memory"))
    with refused:
        hc.transfer_hicache_all_layer(_ptrs([base + l * rows * el for l in range(layers)]),
                                      _ptrs([base + (layers + l) * rows * el for l in range(layers)]),
                                      torch.tensor([rows]), _ptrs([s.data_ptr() for s in srcs[:layers]]),
                                      _ptrs([s.data_ptr() for s in srcs[layers:]]), torch.tensor([0]),
                                      kv_cache_src_stride_bytes=el, kv_cache_dst_stride_bytes=el)
    assert untouched(x)
    mem.close()


def test_hicache_all_layer_mla_layers_rows_apart_in_a_larger_registration() -> None:
    """Layer 1 starts three rows after layer 0 in a registration that runs on: rows 0..2 of
    layer 0 are its own (exact bytes); row 3 is layer 1's row 0 (refused); entries less than
    a row apart, or at one address, share every row (refused)."""
    rows, el = 3, 32
    x, mem = _arena(8 * rows * el)
    base = x.data_ptr()
    src = [rand(_dev(8, el, dtype=torch.uint8, device=DEV)) for _ in range(2)]
    src_t = _ptrs([s.data_ptr() for s in src])
    hc.transfer_hicache_all_layer_mla(_ptrs([base, base + rows * el]), torch.tensor([2, 0]), src_t,
                                      torch.tensor([4, 7]), cache_src_stride_bytes=el, cache_dst_stride_bytes=el)
    want = x.clone().fill_(POISON).view(-1, el)
    want[[2, 0]] = src[0][[4, 7]]
    want[[rows + 2, rows]] = src[1][[4, 7]]
    assert torch.equal(x.view(-1, el), want)
    for shift, d_idx in ((rows * el, [rows, 0]), (el // 2, [0]), (0, [0])):
        x.fill_(POISON)
        with pytest.raises(errors.OverlapError, match=r"ptr_dst\[0\] and ptr_dst\[1\] share memory"):
            hc.transfer_hicache_all_layer_mla(_ptrs([base, base + shift]), torch.tensor(d_idx), src_t,
                                              torch.tensor([4, 7][:len(d_idx)]), cache_src_stride_bytes=el,
                                              cache_dst_stride_bytes=el)
        assert untouched(x)
    mem.close()
