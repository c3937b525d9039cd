"""sglang's kvcacheio and JIT HiCache transfers (pointerdomain.compat.sgl_kernel, .sgl_hicache) on
the emulated device: every function, both directions where they exist, MHA and MLA, against plain
torch indexing on bytes (destinations poisoned first: untouched bytes must stay poisoned), the
upstream test's shapes in small, and bad arguments as typed errors before anything is written."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import sgl_kernel as sk
from tests.helpers.compat import POISON, rand, same, u8
from tests.helpers.compat import dev as _dev
from tests.helpers.compat import table as _table

DEV = pd.validate_device("emulated:0")
OTHER = pd.validate_device("emulated:1")
DT = torch.bfloat16
L, H, D, PS = 3, 2, 8, 4  # layers, heads, head_dim (bf16), tokens per page
ITEM = H * D * 2  # bytes of one token's K of one layer
T = 16  # device tokens
PAGES = 5  # host pages
HT = PAGES * PS  # host tokens

Host = Callable[..., torch.Tensor]


@pytest.fixture(params=["one chunk", "chunked"])
def host(request: pytest.FixtureRequest) -> Iterator[Host]:
    """Registered host tensors (each its own registration), closed after the test; "chunked":
    registered in chunks of two leading-dimension blocks (pages, for token rows; a pool above
    max_chunk_bytes in small), each chunk with its own device alias."""
    owners: list[pd.RegisteredHostMemory] = []

    def make(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        size = numel * torch.empty(0, dtype=dtype).element_size()
        if request.param == "chunked" and len(shape) > 1 and shape[0] > 2:
            block = size // shape[0]
            if shape[0] % PS == 0 and shape[0] >= 2 * PS:
                block *= PS  # token rows: cut on pages (the direct ops copy whole pages)
            mem = pd.alloc_registered(size, DEV, granularity=block, max_chunk_bytes=2 * block)
            assert len(mem.chunks) > 1
        else:
            mem = pd.alloc_registered(size, DEV)
        owners.append(mem)
        return mem.tensor[:size].view(dtype).view(shape)

    yield make
    for mem in owners:
        mem.close()


def poison(t: torch.Tensor) -> torch.Tensor:
    u8(t).fill_(POISON)
    return t


def dev(*shape: int, dtype: torch.dtype = DT, device: pd.Device = DEV) -> torch.Tensor:
    return _dev(*shape, dtype=dtype, device=device)


def table(ts: list[torch.Tensor], device: pd.Device = DEV) -> torch.Tensor:
    """An upstream uint64 table of data_ptr() values, itself in device memory."""
    return _table(ts, device)


def raw_table(values: list[int]) -> torch.Tensor:
    t = pd.device_empty((len(values),), dtype=torch.uint64, device=DEV)
    t.copy_(torch.tensor(values, dtype=torch.uint64))
    return t


def pages_runs(pages: list[int], ps: int = PS) -> torch.Tensor:
    """Token slots of whole pages, in order (upstream's src/dst indices)."""
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])


def snapshot(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [u8(t).clone() for t in ts]


def unchanged(ts: list[torch.Tensor], before: list[torch.Tensor]) -> bool:
    return all(torch.equal(u8(t), b) for t, b in zip(ts, before))


S_IDX = torch.tensor([3, 17, 8, 0, 19, 12])  # host tokens
D_IDX = torch.tensor([15, 2, 7, 0, 9, 4])  # device tokens


# -- layer_first <-> layer_first ------------------------------------------------------------------

@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("h2d", [True, False])
def test_per_layer(host: Host, mla: bool, h2d: bool) -> None:
    hk, hv = rand(host(HT, H, D)), rand(host(HT, H, D))
    dk, dv = rand(dev(T, H, D)), rand(dev(T, H, D))
    h_idx, d_idx = S_IDX, D_IDX
    if h2d:
        src, dst, s, d = (hk, hv), (poison(dk), poison(dv)), h_idx, d_idx
    else:
        src, dst, s, d = (dk, dv), (poison(hk), poison(hv)), d_idx, h_idx
    want = [u8(t).clone() for t in dst]
    for w, t in zip(want, src):
        w[d] = u8(t)[s]
    if mla:
        sk.transfer_kv_per_layer_mla(src[0], dst[0], s, d, ITEM)
        assert same(dst[0], want[0]) and torch.all(u8(dst[1]) == POISON)
    else:
        sk.transfer_kv_per_layer(src[0], dst[0], src[1], dst[1], s, d, item_size=ITEM)
        assert same(dst[0], want[0]) and same(dst[1], want[1])


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("h2d", [True, False])
def test_all_layer(host: Host, mla: bool, h2d: bool) -> None:
    """transfer_kv_all_layer(_mla): uint64 tables of per-layer buffers on both sides (one host
    pool of all layers in one registration, device layers each their own allocation)."""
    hk, hv = rand(host(L, HT, H, D)), rand(host(L, HT, H, D))
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    dvs = [rand(dev(T, H, D)) for _ in range(L)]
    h_k, h_v = [hk[i] for i in range(L)], [hv[i] for i in range(L)]
    if h2d:
        src_k, src_v, dst_k, dst_v, s, d = h_k, h_v, dks, dvs, S_IDX, D_IDX
    else:
        src_k, src_v, dst_k, dst_v, s, d = dks, dvs, h_k, h_v, D_IDX, S_IDX
    for t in dst_k + dst_v:
        poison(t)
    want = [u8(t).clone() for t in dst_k + dst_v]
    for w, t in zip(want, src_k + src_v):
        w[d] = u8(t)[s]
    if mla:
        sk.transfer_kv_all_layer_mla(table(src_k), table(dst_k), s, d, item_size=ITEM, num_layers=L)
        assert all(same(t, w) for t, w in zip(dst_k, want[:L]))
        assert all(torch.all(u8(t) == POISON) for t in dst_v)
    else:
        sk.transfer_kv_all_layer(table(src_k), table(dst_k), table(src_v), table(dst_v), s, d, ITEM, L)
        assert all(same(t, w) for t, w in zip(dst_k + dst_v, want))


def test_upstream_shapes_page_runs(host: Host) -> None:
    """The upstream test's case in small: whole random pages, per-layer and all-layer, MHA."""
    gen = torch.Generator().manual_seed(7)
    pages = torch.randperm(HT // PS, generator=gen).tolist()
    s, d = pages_runs(pages[:2]), pages_runs([3, 1])
    src_k, src_v = rand(host(L, HT, H, D)), rand(host(L, HT, H, D))
    dst_k, dst_v = poison(dev(L, T, H, D)), poison(dev(L, T, H, D))
    sk.transfer_kv_all_layer(table([src_k[i] for i in range(L)]), table([dst_k[i] for i in range(L)]),
                             table([src_v[i] for i in range(L)]), table([dst_v[i] for i in range(L)]),
                             s, d, item_size=ITEM, num_layers=L)
    want_k, want_v = poison(torch.empty_like(dst_k)), poison(torch.empty_like(dst_v))
    want_k[:, d], want_v[:, d] = src_k[:, s], src_v[:, s]
    assert same(dst_k, want_k) and same(dst_v, want_v)


# -- page_first ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mla", [False, True])
def test_per_layer_pf_lf(host: Host, mla: bool) -> None:
    hk, hv = rand(host(HT, L, H, D)), rand(host(HT, L, H, D))
    dk, dv = poison(dev(T, H, D)), poison(dev(T, H, D))
    layer = 2
    want_k, want_v = u8(dk).clone(), u8(dv).clone()
    want_k[D_IDX] = u8(hk)[S_IDX, layer]
    want_v[D_IDX] = u8(hv)[S_IDX, layer]
    if mla:
        sk.transfer_kv_per_layer_mla_pf_lf(hk, dk, S_IDX, D_IDX, layer, ITEM, L * ITEM)
        assert same(dk, want_k) and torch.all(u8(dv) == POISON)
    else:
        sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S_IDX, D_IDX, layer_id=layer, item_size=ITEM,
                                       src_layout_dim=L * ITEM)
        assert same(dk, want_k) and same(dv, want_v)


@pytest.mark.parametrize("mla", [False, True])
def test_all_layer_lf_pf(host: Host, mla: bool) -> None:
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    dvs = [rand(dev(T, H, D)) for _ in range(L)]
    hk, hv = poison(host(HT, L, H, D)), poison(host(HT, L, H, D))
    want_k, want_v = u8(hk).clone(), u8(hv).clone()
    for i in range(L):
        want_k[S_IDX, i] = u8(dks[i])[D_IDX]
        want_v[S_IDX, i] = u8(dvs[i])[D_IDX]
    if mla:
        sk.transfer_kv_all_layer_mla_lf_pf(table(dks), hk, D_IDX, S_IDX, ITEM, L * ITEM, L)
        assert same(hk, want_k) and torch.all(u8(hv) == POISON)
    else:
        sk.transfer_kv_all_layer_lf_pf(table(dks), hk, table(dvs), hv, D_IDX, S_IDX, item_size=ITEM,
                                       dst_layout_dim=L * ITEM, num_layers=L)
        assert same(hk, want_k) and same(hv, want_v)


def test_repeated_calls_follow_their_arguments(host: Host) -> None:
    """A call shape repeated with the same buffers checks only its indices; a table
    rewritten in place, a buffer replaced, or a registration closed is seen again."""
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    dvs = [rand(dev(T, H, D)) for _ in range(L)]
    hk, hv = poison(host(HT, L, H, D)), poison(host(HT, L, H, D))
    k_tab, v_tab = table(dks), table(dvs)

    def backup(s: torch.Tensor, d: torch.Tensor) -> None:
        sk.transfer_kv_all_layer_lf_pf(k_tab, hk, v_tab, hv, s, d, ITEM, L * ITEM, L)

    for _ in range(3):  # the same call again and again, new indices each time
        s, d = torch.randperm(T)[:4], torch.randperm(HT)[:4]
        backup(s, d)
        for i in range(L):
            assert same(hk[d, i], dks[i][s]) and same(hv[d, i], dvs[i][s])
    with pytest.raises(errors.IndexValidationError):  # indices still checked on a repeat
        backup(torch.tensor([T]), torch.tensor([0]))
    other = rand(dev(T, H, D))
    k_tab[1] = other.data_ptr()  # the engine rewrites its table in place: the new buffer is read
    backup(torch.tensor([2]), torch.tensor([7]))
    assert same(hk[7, 1], other[2])
    k_tab[0] = 12345 * 4096  # and a bad entry written in place is refused
    before = snapshot(hk, hv)
    with pytest.raises(errors.NotRegisteredError, match=r"src_k_layers\[0\]"):
        backup(torch.tensor([2]), torch.tensor([7]))
    assert unchanged([hk, hv], before)
    k_tab[0] = dks[0].data_ptr()
    hs = host(HT, 2 * L, H, D)  # a different host tensor: checked again (wrong layer count)
    with pytest.raises(errors.PointerDomainError):
        sk.transfer_kv_all_layer_lf_pf(k_tab, hs, v_tab, hv, torch.tensor([1]), torch.tensor([1]), ITEM, L * ITEM, L)
    # the per-layer load, repeated, then over a closed registration
    mem = pd.alloc_registered(HT * L * ITEM * 2, DEV)
    hk2 = mem.tensor.view(DT).view(2, HT, L, H, D)
    rand(hk2)
    dst_k, dst_v = poison(dev(T, H, D)), poison(dev(T, H, D))
    for layer in range(L):
        sk.transfer_kv_per_layer_pf_lf(hk2[0], dst_k, hk2[1], dst_v, torch.tensor([3]), torch.tensor([5]), layer,
                                       ITEM, L * ITEM)
        assert same(dst_k[5], hk2[0, 3, layer]) and same(dst_v[5], hk2[1, 3, layer])
    mem.close()
    with pytest.raises(errors.ClosedError):
        sk.transfer_kv_per_layer_pf_lf(hk2[0], dst_k, hk2[1], dst_v, torch.tensor([3]), torch.tensor([5]), 0,
                                       ITEM, L * ITEM)


# -- page_head -----------------------------------------------------------------------------------

def _ph_ref_load(hp: torch.Tensor, dst: torch.Tensor, s: torch.Tensor, d: torch.Tensor, layer: int) -> None:
    """upstream's ref_copy_with_indices_page_head (ph -> lf): dst[d][h] = src[s // P][h][s % P][layer]."""
    for i in range(s.numel()):
        for h in range(H):
            dst[int(d[i]), h] = hp[int(s[i]) // PS, h, int(s[i]) % PS, layer]


def test_per_layer_ph_lf(host: Host) -> None:
    hk, hv = rand(host(PAGES, H, PS, L, D)), rand(host(PAGES, H, PS, L, D))
    dk, dv = poison(dev(T, H, D)), poison(dev(T, H, D))
    want_k, want_v = dk.clone(), dv.clone()
    _ph_ref_load(hk, want_k, S_IDX, D_IDX, 1)
    _ph_ref_load(hv, want_v, S_IDX, D_IDX, 1)
    sk.transfer_kv_per_layer_ph_lf(hk, dk, hv, dv, S_IDX, D_IDX, 1, ITEM, L * ITEM, PS, H)
    assert same(dk, want_k) and same(dv, want_v)


def test_all_layer_lf_ph_and_back(host: Host) -> None:
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    dvs = [rand(dev(T, H, D)) for _ in range(L)]
    hk, hv = poison(host(PAGES, H, PS, L, D)), poison(host(PAGES, H, PS, L, D))
    want_k, want_v = hk.clone(), hv.clone()
    for layer in range(L):
        for i in range(D_IDX.numel()):
            s, d = int(D_IDX[i]), int(S_IDX[i])
            for h in range(H):  # upstream's ref (lf -> ph): dst[d // P][h][d % P][layer] = src[layer][s][h]
                want_k[d // PS, h, d % PS, layer] = dks[layer][s, h]
                want_v[d // PS, h, d % PS, layer] = dvs[layer][s, h]
    sk.transfer_kv_all_layer_lf_ph(table(dks), hk, table(dvs), hv, D_IDX, S_IDX, ITEM, L * ITEM, L, PS, H)
    assert same(hk, want_k) and same(hv, want_v)
    back = poison(dev(T, H, D)), poison(dev(T, H, D))
    sk.transfer_kv_per_layer_ph_lf(hk, back[0], hv, back[1], S_IDX, D_IDX, 2, ITEM, L * ITEM, PS, H)
    assert torch.equal(u8(back[0])[D_IDX], u8(dks[2])[D_IDX]) and torch.equal(u8(back[1])[D_IDX], u8(dvs[2])[D_IDX])


# -- head-group-major (pfdhg) ------------------------------------------------------------------------

@pytest.mark.parametrize("groups", [1, 2, 4])
def test_pfdhg_round_trip(host: Host, groups: int) -> None:
    """The upstream head-group tests in small: H2D against host[s // P, :, l, s % P] reshaped,
    D2H against host[d // P, g, l, d % P] = device[l][s, g * hg : (g + 1) * hg], and D2H then
    H2D along the inverse mapping gives the original bytes."""
    heads, hd = 4, 4  # 4 bf16 heads of 4 elements: item 32 bytes, groups of 4 * hd * 2 / groups bytes
    hg = heads // groups
    item = heads * hd * 2
    rows = PAGES * PS
    shape = (PAGES, groups, L, PS, hg, hd)
    host_k, host_v = rand(host(*shape)), rand(host(*shape))
    dev_k = [poison(dev(rows, heads, hd)) for _ in range(L)]
    dev_v = [poison(dev(rows, heads, hd)) for _ in range(L)]
    src = torch.arange(rows, dtype=torch.int64)
    dst = torch.flip(src, [0]).contiguous()
    for layer in range(L):
        sk.transfer_kv_per_layer_pfdhg_lf(host_k.view(-1), dev_k[layer], host_v.view(-1), dev_v[layer], src, dst,
                                          layer_id=layer, item_size=item, src_layout_dim=item * L, page_size=PS,
                                          head_num=groups)
    for layer in range(L):
        for h, dv in ((host_k, dev_k), (host_v, dev_v)):
            want = torch.empty(rows, heads, hd, dtype=DT)
            for i in range(rows):
                s, d = int(src[i]), int(dst[i])
                want[d] = h[s // PS, :, layer, s % PS].reshape(heads, hd)
            assert same(dv[layer], want)
    # D2H into a poisoned pool, then compare with the inverse contract
    back_k, back_v = poison(host(*shape)), poison(host(*shape))
    sk.transfer_kv_all_layer_lf_pfdhg(table(dev_k), back_k.view(-1), table(dev_v), back_v.view(-1), src, dst,
                                      item_size=item, dst_layout_dim=item * L, num_layers=L, page_size=PS,
                                      head_num=groups)
    for h, dv in ((back_k, dev_k), (back_v, dev_v)):
        want_h = poison(torch.empty(shape, dtype=DT))
        for i in range(rows):
            s, d = int(src[i]), int(dst[i])
            for layer in range(L):
                for g in range(groups):
                    want_h[d // PS, g, layer, d % PS] = dv[layer][s, g * hg:(g + 1) * hg]
        assert same(h, want_h)
    # the round trip: the first load read host_k; the write-back of what it loaded must give host_k back
    assert same(back_k, host_k) and same(back_v, host_v)


def test_pfdhg_same_buffers_for_k_and_v(host: Host) -> None:
    """The upstream quota test passes one host buffer and one device layer as both K and V:
    K and V then write the same bytes, in no defined order (a race on a GPU): refused, nothing written."""
    item = H * D * 2
    hbuf = rand(host(PAGES, 2, L, PS, 1, D))
    layer = poison(dev(HT, H, D))
    src = torch.arange(HT, dtype=torch.int64)
    dst = torch.flip(src, [0]).contiguous()
    with pytest.raises(errors.OverlapError, match="dst_k"):
        sk.transfer_kv_per_layer_pfdhg_lf(hbuf.view(-1), layer, hbuf.view(-1), layer, src, dst, 0, item, item * L,
                                          PS, 2, block_quota=8)
    assert torch.all(u8(layer) == POISON)
    empty = torch.empty(0, dtype=torch.int64)  # refused whatever the indices
    with pytest.raises(errors.OverlapError, match="dst_k"):
        sk.transfer_kv_per_layer_pfdhg_lf(hbuf.view(-1), layer, hbuf.view(-1), layer, empty, empty, 0, item,
                                          item * L, PS, 2)


def test_pfdhg_empty_is_a_noop(host: Host) -> None:
    hbuf = poison(host(PAGES * 2 * L * PS * D))
    layer_k, layer_v = poison(dev(T, H, D)), poison(dev(T, H, D))
    empty = torch.empty(0, dtype=torch.int64)
    sk.transfer_kv_per_layer_pfdhg_lf(hbuf, layer_k, hbuf, layer_v, empty, empty, 0, ITEM, ITEM * L, PS, H)
    assert torch.all(u8(layer_k) == POISON) and torch.all(u8(layer_v) == POISON)


# -- direct (copy engine) --------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [1, L])
@pytest.mark.parametrize("h2d", [True, False])
def test_direct(host: Host, layers: int, h2d: bool) -> None:
    hs = [rand(host(HT, H, D)) for _ in range(2 * layers)]
    ds = [rand(dev(T, H, D)) for _ in range(2 * layers)]
    s, d = pages_runs([4, 1]), pages_runs([0, 3])
    if h2d:
        src, dst, si, di = hs, [poison(t) for t in ds], s, d
    else:
        src, dst, si, di = ds, [poison(t) for t in hs], d, s
    want = [t.clone() for t in dst]
    for w, t in zip(want, src):
        w[di] = t[si]
    sk.transfer_kv_direct(src, dst, si, di, page_size=PS)
    assert all(same(t, w) for t, w in zip(dst, want))


@pytest.mark.parametrize("mla", [False, True])
def test_direct_page_first_direct(host: Host, mla: bool) -> None:
    """Both page_first_direct ops: host page s0 // P (s0 page-aligned or not), device rows
    d0 + [0, P), every P-th index only (the others differ on purpose)."""
    kv = 1 if mla else 2
    hp = [rand(host(PAGES, L, PS, H, D)) for _ in range(kv)]
    dl = [poison(dev(T + 1, H, D)) for _ in range(kv)]  # T + 1 rows: not a whole number of pages
    s = torch.tensor([9, 99, 99, 99, 0, 99, 99, 99])  # chunks start at host token 9 (page 2) and 0
    d = torch.tensor([5, -7, -7, -7, 13, -7, -7, -7])  # device rows 5.. and 13..
    layer = 1
    want = [t.clone() for t in dl]
    for w, h in zip(want, hp):
        for p in range(2):
            s0, d0 = int(s[p * PS]), int(d[p * PS])
            w[d0:d0 + PS] = h[s0 // PS, layer]
    sk.transfer_kv_per_layer_direct_pf_lf(hp, dl, s, d, layer, PS)
    assert all(same(t, w) for t, w in zip(dl, want))
    # and back: device layers K..., V... into poisoned pages
    dev_layers = [rand(dev(T + 1, H, D)) for _ in range(kv * L)]
    back = [poison(host(PAGES, L, PS, H, D)) for _ in range(kv)]
    want_b = [t.clone() for t in back]
    for k in range(kv):
        for j in range(L):
            for p in range(2):
                s0, d0 = int(d[p * PS]), int(s[p * PS])
                want_b[k][d0 // PS, j] = dev_layers[k * L + j][s0:s0 + PS]
    sk.transfer_kv_all_layer_direct_lf_pf(dev_layers, back, d, s, PS)
    assert all(same(t, w) for t, w in zip(back, want_b))


def test_direct_pageable_host_is_copied_by_torch() -> None:
    """A plain (pageable) CPU tensor on the host side of a direct op, as upstream's pf_direct
    test passes (torch.zeros_like of a pinned tensor is not pinned): copied by torch, exact rows."""
    dl = [rand(dev(T, H, D)) for _ in range(2 * L)]
    pool = [poison(torch.empty(PAGES, L, PS, H, D, dtype=DT)) for _ in range(2)]
    s, d = pages_runs([1, 3]), pages_runs([4, 0])
    want = [t.clone() for t in pool]
    for k in range(2):
        for j in range(L):
            for p in range(2):
                s0, d0 = int(s[p * PS]), int(d[p * PS])
                want[k][d0 // PS, j] = dl[k * L + j][s0:s0 + PS]
    sk.transfer_kv_all_layer_direct_lf_pf(dl, pool, s, d, PS)
    assert all(same(t, w) for t, w in zip(pool, want))
    lf = [rand(torch.empty(HT, H, D, dtype=DT)) for _ in range(2)]
    out = [poison(dev(T, H, D)) for _ in range(2)]
    sk.transfer_kv_direct(lf, out, pages_runs([4, 2]), pages_runs([3, 0]), PS)
    for o, src in zip(out, lf):
        w = poison(torch.empty(T, H, D, dtype=DT))
        w[pages_runs([3, 0])] = src[pages_runs([4, 2])]
        assert same(o, w)
    emb = poison(torch.empty(10, 12, dtype=DT))
    rows = rand(dev(6, 12))
    sk.transfer_embedding_ranges_direct(rows, emb, [1], [7], [3])
    w = poison(torch.empty(10, 12, dtype=DT))
    w[7:10] = rows[1:4]
    assert same(emb, w)
    before = snapshot(*pool)
    with pytest.raises(errors.IndexValidationError):  # checked before the torch copy too
        sk.transfer_kv_all_layer_direct_lf_pf(dl, pool, s, d + PAGES * PS, PS)
    assert unchanged(pool, before)


@pytest.mark.parametrize("h2d", [True, False])
def test_embedding_ranges(host: Host, h2d: bool) -> None:
    emb = 37
    hrows, drows = 28, 16
    h, dd = rand(host(hrows, emb)), rand(dev(drows, emb))
    frag, cont, lengths = [1, 11, 23], [2, 6, 10], [PS, PS, 2]
    if h2d:
        src, dst, ss, ds = h, poison(dd), frag, cont
    else:
        src, dst, ss, ds = dd, poison(h), cont, frag
    want = dst.clone()
    for a, b, n in zip(ss, ds, lengths):
        want[b:b + n] = src[a:a + n]
    sk.transfer_embedding_ranges_direct(src, dst, ss, ds, lengths)
    assert same(dst, want)


# -- JIT HiCache ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("h2d", [True, False])
def test_hicache_one_layer_page_first_views(host: Host, mla: bool, h2d: bool) -> None:
    """sglang's page_first path: a host layer is k_buffer.transpose(0, 1)[layer], rows
    L * item apart; the device layer packed rows."""
    hk, hv = rand(host(HT, L, H, D)), rand(host(HT, L, H, D))
    layer = 1
    h_k, h_v = hk.transpose(0, 1)[layer], hv.transpose(0, 1)[layer]
    dk, dv = rand(dev(T, H, D)), rand(dev(T, H, D))
    if h2d:
        (sk_, sv), (dk_, dv_), si, di = (h_k, h_v), (poison(dk), poison(dv)), S_IDX, D_IDX
        whole = (dk, dv)
    else:
        (sk_, sv), (dk_, dv_), si, di = (dk, dv), (h_k, h_v), D_IDX, S_IDX
        poison(hk)
        poison(hv)
        whole = (hk, hv)
    want = [u8(t).clone() for t in whole]
    if h2d:
        want[0][di], want[1][di] = u8(sk_)[si], u8(sv)[si]
    else:
        want[0][di, layer], want[1][di, layer] = u8(sk_)[si], u8(sv)[si]
    if mla:
        hc.transfer_hicache_one_layer_mla(dk_, di, sk_, si, element_dim=H * D)
        assert same(whole[0], want[0])
        assert torch.all(u8(whole[1]) == POISON)
    else:
        hc.transfer_hicache_one_layer(k_cache_dst=dk_, v_cache_dst=dv_, indices_dst=di, k_cache_src=sk_,
                                      v_cache_src=sv, indices_src=si, element_dim=H * D)
        assert same(whole[0], want[0]) and same(whole[1], want[1])


def test_hicache_one_layer_int32_indices_and_odd_strides(host: Host) -> None:
    """Rows 48 bytes apart holding 32-byte elements (stride not a multiple of the element:
    copied in 16-byte sub-items), int32 indices widened."""
    hbuf = rand(host(HT, 24))  # bf16 rows of 48 bytes; the element is the first 16 elements
    src = hbuf[:, :16]
    dk, dv = poison(dev(T, 16)), poison(dev(T, 16))
    si, di = S_IDX.to(torch.int32), D_IDX.to(torch.int32)
    hc.transfer_hicache_one_layer(dk, dv, di, src, src, si)
    want = poison(torch.empty(T, 16, dtype=DT))
    want[D_IDX] = src[S_IDX]
    assert same(dk, want) and same(dv, want)


@pytest.mark.parametrize("mla", [False, True])
def test_hicache_all_layer_page_first_tables(host: Host, mla: bool) -> None:
    """The JIT all-layer op over sglang's host k_data_ptrs of a page_first pool (per-layer
    views base + l * item, rows L * item apart) and packed device layers."""
    hk, hv = rand(host(HT, L, H, D)), rand(host(HT, L, H, D))
    dks = [poison(dev(T, H, D)) for _ in range(L)]
    dvs = [poison(dev(T, H, D)) for _ in range(L)]
    hk_t, hv_t = table([hk.transpose(0, 1)[i] for i in range(L)]), table([hv.transpose(0, 1)[i] for i in range(L)])
    if mla:
        hc.transfer_hicache_all_layer_mla(table(dks), D_IDX, hk_t, S_IDX, cache_src_stride_bytes=L * ITEM,
                                          cache_dst_stride_bytes=ITEM, element_size=ITEM)
    else:
        hc.transfer_hicache_all_layer(table(dks), table(dvs), D_IDX, hk_t, hv_t, S_IDX,
                                      kv_cache_src_stride_bytes=L * ITEM, kv_cache_dst_stride_bytes=ITEM,
                                      element_size=ITEM)
    for i in range(L):
        want = poison(torch.empty(T, H, D, dtype=DT))
        want[D_IDX] = hk[S_IDX, i]
        assert same(dks[i], want)
        if mla:
            assert torch.all(u8(dvs[i]) == POISON)
        else:
            want[D_IDX] = hv[S_IDX, i]
            assert same(dvs[i], want)


@pytest.mark.parametrize("mla", [False, True])
def test_hicache_all_layer_layer_first_backup(host: Host, mla: bool) -> None:
    """sglang's layer_first backup: device tables to host tables, both strides the item."""
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    dvs = [rand(dev(T, H, D)) for _ in range(L)]
    hk, hv = poison(host(L, HT, H, D)), poison(host(L, HT, H, D))
    want_k, want_v = hk.clone(), hv.clone()
    for i in range(L):
        want_k[i, S_IDX] = dks[i][D_IDX]
        want_v[i, S_IDX] = dvs[i][D_IDX]
    hkt, hvt = table([hk[i] for i in range(L)]), table([hv[i] for i in range(L)])
    if mla:
        hc.transfer_hicache_all_layer_mla(hkt, S_IDX, table(dks), D_IDX, cache_src_stride_bytes=ITEM,
                                          cache_dst_stride_bytes=ITEM)
        assert same(hk, want_k) and torch.all(u8(hv) == POISON)
    else:
        hc.transfer_hicache_all_layer(hkt, hvt, S_IDX, table(dks), table(dvs), D_IDX,
                                      kv_cache_src_stride_bytes=ITEM, kv_cache_dst_stride_bytes=ITEM)
        assert same(hk, want_k) and same(hv, want_v)


@pytest.mark.parametrize("mla", [False, True])
def test_hicache_staged_lf_pf(host: Host, mla: bool) -> None:
    kv = 1 if mla else 2
    d_layers = [[rand(dev(T, H, D)) for _ in range(L)] for _ in range(kv)]
    staging = [poison(dev(2 * PS, L, H, D)) for _ in range(kv)]  # two pages: the chunks upstream loops over
    hp = [poison(host(HT, L, H, D)) for _ in range(kv)]
    s = torch.tensor([4, 5, 6, 7, 9, 10, 11, 12, 0, 1, 2, 3])  # device runs from 4, 9 and 0
    d = pages_runs([4, 0, 2])  # host pages
    want = [t.clone() for t in hp]
    for k in range(kv):
        for p in range(3):
            s0, d0 = int(s[p * PS]), int(d[p * PS])
            for i in range(L):
                want[k][d0:d0 + PS, i] = d_layers[k][i][s0:s0 + PS]
    before = snapshot(*staging)
    if mla:
        hc.transfer_hicache_all_layer_mla_staged_lf_pf(table(d_layers[0]), s, d, staging[0], hp[0], page_size=PS)
    else:
        hc.transfer_hicache_all_layer_staged_lf_pf(table(d_layers[0]), table(d_layers[1]), s, d, staging[0],
                                                   staging[1], hp[0], hp[1], page_size=PS)
    assert all(same(t, w) for t, w in zip(hp, want))
    assert unchanged(staging, before)


G, HG, PU_DIM = 2, 1, 8  # head groups, heads a group, dim: a group's token row 16 bytes


@pytest.mark.parametrize("mla", [False, True])
def test_hicache_page_unified_round_trip(host: Host, mla: bool) -> None:
    """page_unified write-back of whole device pages, against plain indexing of the
    (page, group, layer, kv, token, head, dim) host block, then the load-back of one layer."""
    hpages = 3
    shape = (hpages, L, PS, PU_DIM) if mla else (hpages, G, L, 2, PS, HG, PU_DIM)
    heads = 1 if mla else G * HG
    kv = 1 if mla else 2
    d_layers = [[rand(dev(T, heads, PU_DIM)) for _ in range(L)] for _ in range(kv)]
    pool = poison(host(*shape))
    staging = poison(dev(1, *shape[1:]))
    src_pages, dst_pages = torch.tensor([3, 0]), torch.tensor([2, 0])
    want = pool.clone()
    for sp, dp in zip(src_pages.tolist(), dst_pages.tolist()):
        for t in range(PS):
            for i in range(L):
                if mla:
                    want[dp, i, t] = d_layers[0][i][sp * PS + t, 0]
                    continue
                for g in range(G):
                    for k in range(2):
                        want[dp, g, i, k, t] = d_layers[k][i][sp * PS + t, g * HG:(g + 1) * HG]
    before = snapshot(staging)
    if mla:
        hc.transfer_hicache_all_layer_mla_staged_lf_page_unified(table(d_layers[0]), src_pages, dst_pages, staging,
                                                                 pool)
    else:
        hc.transfer_hicache_all_layer_staged_lf_page_unified(table(d_layers[0]), table(d_layers[1]), src_pages,
                                                             dst_pages, staging, pool)
    assert same(pool, want)
    assert unchanged([staging], before)
    # load-back of layer 1 into fresh device rows, host tokens of the written pages
    s_idx = torch.tensor([9, 0, 3, 11, 8])  # host pages 2 and 0
    d_idx = torch.tensor([1, 15, 7, 2, 0])
    out = [poison(dev(T, heads, PU_DIM)) for _ in range(kv)]
    want_out = [t.clone() for t in out]
    for i in range(s_idx.numel()):
        s, d = int(s_idx[i]), int(d_idx[i])
        for k in range(kv):
            if mla:
                want_out[k][d, 0] = pool[s // PS, 1, s % PS]
            else:
                for g in range(G):
                    want_out[k][d, g * HG:(g + 1) * HG] = pool[s // PS, g, 1, k, s % PS]
    if mla:
        hc.transfer_hicache_one_layer_mla_page_unified_lf(out[0], pool, s_idx, d_idx, 1)
    else:
        hc.transfer_hicache_one_layer_page_unified_lf(out[0], out[1], pool, s_idx, d_idx, layer_id=1)
    assert all(same(t, w) for t, w in zip(out, want_out))


def test_can_use_answers_as_upstream() -> None:
    assert hc.can_use_hicache_jit_kernel(element_size=256)
    assert not hc.can_use_hicache_jit_kernel(element_size=64)
    assert hc.can_use_write_back_jit_kernel(element_size=144)
    assert not hc.can_use_write_back_jit_kernel(element_size=24)
    assert hc.can_use_page_unified_load_back_jit_kernel(group_bytes=16)
    assert not hc.can_use_page_unified_load_back_jit_kernel(group_bytes=0)
    with pytest.raises(errors.InvalidArgumentError):
        hc.can_use_hicache_jit_kernel(element_size=256, unroll=3)
    with pytest.raises(errors.InvalidArgumentError):
        hc.can_use_write_back_jit_kernel(element_size="256")  # type: ignore[arg-type]


def test_defaults_match_upstream() -> None:
    import inspect

    assert sk.DEFAULT_WARPS_PER_BLOCK == (16 if torch.version.hip else 32)
    sig = inspect.signature(sk.transfer_kv_per_layer_pfdhg_lf)
    assert sig.parameters["block_quota"].default is None
    assert inspect.signature(sk.transfer_kv_per_layer).parameters["block_quota"].default == 2
    assert list(inspect.signature(sk.transfer_kv_all_layer_lf_ph).parameters) == [
        "src_k_layers", "dst_k", "src_v_layers", "dst_v", "src_indices", "dst_indices", "item_size",
        "dst_layout_dim", "num_layers", "page_size", "head_num", "block_quota", "num_warps_per_block"]
    assert hc.DEFAULT_BLOCK_QUOTA == (32 if torch.version.hip else 2)


# -- bad arguments: typed errors, nothing written ---------------------------------------------------

class Pools:
    """A page_first host pool and device layers for the error cases."""

    def __init__(self, host: Host) -> None:
        self.hk, self.hv = rand(host(HT, L, H, D)), rand(host(HT, L, H, D))
        self.dk, self.dv = poison(dev(T, H, D)), poison(dev(T, H, D))
        self.dks = [poison(dev(T, H, D)) for _ in range(L)]
        self.dvs = [poison(dev(T, H, D)) for _ in range(L)]

    def written(self) -> list[torch.Tensor]:
        return [self.dk, self.dv, *self.dks, *self.dvs, self.hk, self.hv]


@pytest.fixture
def pools(host: Host) -> Pools:
    return Pools(host)


def _pf_lf(p: Pools, **kw: object) -> Callable[[], None]:
    args: dict[str, object] = dict(src_k=p.hk, dst_k=p.dk, src_v=p.hv, dst_v=p.dv, src_indices=S_IDX,
                                   dst_indices=D_IDX, layer_id=1, item_size=ITEM, src_layout_dim=L * ITEM)
    args.update(kw)
    return lambda: sk.transfer_kv_per_layer_pf_lf(**args)  # type: ignore[arg-type]


def _lf_pf(p: Pools, **kw: object) -> Callable[[], None]:
    args: dict[str, object] = dict(src_k_layers=table(p.dks), dst_k=p.hk, src_v_layers=table(p.dvs), dst_v=p.hv,
                                   src_indices=D_IDX, dst_indices=S_IDX, item_size=ITEM, dst_layout_dim=L * ITEM,
                                   num_layers=L)
    args.update(kw)
    return lambda: sk.transfer_kv_all_layer_lf_pf(**args)  # type: ignore[arg-type]


BAD: list[tuple[str, Callable[[Pools], Callable[[], None]], type[Exception]]] = [
    ("int32 indices", lambda p: _pf_lf(p, src_indices=S_IDX.to(torch.int32)), errors.IndexValidationError),
    ("float indices", lambda p: _pf_lf(p, dst_indices=D_IDX.float()), errors.IndexValidationError),
    ("2-D indices", lambda p: _pf_lf(p, src_indices=S_IDX.view(2, 3)), errors.IndexValidationError),
    ("strided indices", lambda p: _pf_lf(p, src_indices=torch.arange(12)[::2]), errors.IndexValidationError),
    ("lengths differ", lambda p: _pf_lf(p, dst_indices=D_IDX[:4]), errors.IndexValidationError),
    ("src slot out of range", lambda p: _pf_lf(p, src_indices=torch.tensor([0, 1, 2, 3, 4, HT])),
     errors.IndexValidationError),
    ("negative dst slot", lambda p: _pf_lf(p, dst_indices=torch.tensor([0, 1, 2, 3, 4, -1])),
     errors.IndexValidationError),
    ("layer_id out of range", lambda p: _pf_lf(p, layer_id=L), errors.IndexValidationError),
    ("negative layer_id", lambda p: _pf_lf(p, layer_id=-1), errors.IndexValidationError),
    ("item_size not a multiple of 8", lambda p: _pf_lf(p, item_size=ITEM - 4, src_layout_dim=L * (ITEM - 4)),
     errors.InvalidArgumentError),
    ("item_size in elements, not bytes", lambda p: _pf_lf(p, item_size=ITEM // 2, src_layout_dim=L * ITEM // 2),
     errors.LayoutError),
    ("layout_dim not whole items", lambda p: _pf_lf(p, src_layout_dim=L * ITEM + 8), errors.LayoutError),
    ("layout_dim of the wrong layer count", lambda p: _pf_lf(p, src_layout_dim=2 * ITEM), errors.LayoutError),
    ("block_quota 0", lambda p: _pf_lf(p, block_quota=0), errors.InvalidArgumentError),
    ("num_warps_per_block too big", lambda p: _pf_lf(p, num_warps_per_block=sk.MAX_WARPS_PER_BLOCK + 1),
     errors.InvalidArgumentError),
    ("item_size a bool", lambda p: _pf_lf(p, item_size=True), errors.InvalidArgumentError),
    ("K and V differ in size", lambda p: _pf_lf(p, src_v=p.hv[: HT - 1]), errors.LayoutError),
    ("strided device layer", lambda p: _pf_lf(p, dst_k=p.dks[0][:, :1].expand(T, H, D)), errors.NonContiguousError),
    ("dst is not a tensor", lambda p: _pf_lf(p, dst_k=[p.dk]), errors.InvalidTypeError),
    ("host memory where device memory is expected", lambda p: _pf_lf(p, dst_k=p.hk[:T, 0], dst_v=p.hv[:T, 0]),
     errors.DomainError),
    ("memory of another device", lambda p: _pf_lf(p, dst_v=poison(dev(T, H, D, device=OTHER))),
     errors.DeviceMismatchError),
    ("table of int64", lambda p: _lf_pf(p, src_k_layers=table(p.dks).view(torch.int64)), errors.InvalidTypeError),
    ("table of the wrong length", lambda p: _lf_pf(p, src_v_layers=table(p.dvs[:2])), errors.LayoutError),
    ("table in host memory", lambda p: _lf_pf(p, src_k_layers=torch.tensor([t.data_ptr() for t in p.dks],
                                                                           dtype=torch.uint64),
                                              src_v_layers=torch.tensor([t.data_ptr() for t in p.dvs],
                                                                        dtype=torch.uint64)),
     errors.DomainError),
    ("unknown address in a table", lambda p: _lf_pf(p, src_v_layers=raw_table([p.dvs[0].data_ptr(), 12345,
                                                                               p.dvs[2].data_ptr()])),
     errors.NotRegisteredError),
    ("entry with less than an item to its allocation's end",
     lambda p: _lf_pf(p, src_k_layers=raw_table([p.dks[0].data_ptr(), p.dks[1].data_ptr() + T * ITEM - 8,
                                                 p.dks[2].data_ptr()])),
     errors.RegistrationSpanError),
    ("entry whose allocation holds too few slots for an index",
     lambda p: _lf_pf(p, src_k_layers=raw_table([p.dks[0].data_ptr(), p.dks[1].data_ptr() + (T - 2) * ITEM,
                                                 p.dks[2].data_ptr()])),
     errors.IndexValidationError),
    ("num_layers and dst_layout_dim disagree", lambda p: _lf_pf(p, num_layers=2, src_k_layers=table(p.dks[:2]),
                                                                src_v_layers=table(p.dvs[:2])),
     errors.LayoutError),
    ("device slot out of range", lambda p: _lf_pf(p, src_indices=torch.tensor([0, 1, 2, 3, 4, T])),
     errors.IndexValidationError),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_arguments(pools: Pools, case: tuple[str, Callable[[Pools], Callable[[], None]], type[Exception]]) -> None:
    _, make, kind = case
    call = make(pools)
    before = snapshot(*pools.written())
    with pytest.raises(kind):
        call()
    assert unchanged(pools.written(), before)


def test_unknown_address_names_the_entry(pools: Pools) -> None:
    bad = raw_table([pools.dvs[0].data_ptr(), 12345, pools.dvs[2].data_ptr()])
    with pytest.raises(errors.NotRegisteredError, match=r"src_v_layers\[1\].*0x3039"):
        _lf_pf(pools, src_v_layers=bad)()


def test_bad_head_and_group_geometry(pools: Pools) -> None:
    """The upstream pfdhg rejection cases: head_num 0, item_size not splitting, per-group run
    not whole 8-byte words, page_size 0, block_quota 0, src_layout_dim not whole items."""
    hbuf, layer = pools.hk.view(-1), pools.dk
    base: dict[str, object] = dict(src_k=hbuf, dst_k=layer, src_v=hbuf, dst_v=layer, src_indices=D_IDX,
                                   dst_indices=D_IDX, layer_id=0, item_size=ITEM, src_layout_dim=ITEM * L,
                                   page_size=PS, head_num=2)
    cases: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"block_quota": 0}, errors.InvalidArgumentError, "block_quota"),
        ({"page_size": 0}, errors.InvalidArgumentError, "page_size"),
        ({"head_num": 0}, errors.InvalidArgumentError, "head_num"),
        ({"head_num": 3}, errors.InvalidArgumentError, "item_size"),
        ({"item_size": 24, "src_layout_dim": 24 * L, "head_num": 2}, errors.InvalidArgumentError, "Per-head-group"),
        ({"src_layout_dim": ITEM * L + 1}, errors.LayoutError, "src_layout_dim"),
    ]
    before = snapshot(*pools.written())
    for change, kind, word in cases:
        with pytest.raises(kind, match=word):
            sk.transfer_kv_per_layer_pfdhg_lf(**{**base, **change})  # type: ignore[arg-type]
        with pytest.raises(kind):
            sk.transfer_kv_per_layer_ph_lf(**{k: v for k, v in {**base, **change}.items()})  # type: ignore[arg-type]
    assert unchanged(pools.written(), before)


def test_bad_direct_and_hicache_arguments(host: Host, pools: Pools) -> None:
    hp = [rand(host(PAGES, L, PS, H, D)) for _ in range(2)]
    runs = pages_runs([1, 0])
    before = snapshot(*pools.written())
    with pytest.raises(errors.IndexValidationError):  # not whole pages
        sk.transfer_kv_direct([pools.hk[:, 0].contiguous()], [pools.dk], runs[:5], runs[:5], PS)
    with pytest.raises(errors.InvalidTypeError):  # a bare tensor, not a list
        sk.transfer_kv_direct(pools.dk, pools.dv, runs, runs, PS)  # type: ignore[arg-type]
    with pytest.raises(errors.LayoutError):  # lists of different lengths
        sk.transfer_kv_direct([pools.dk, pools.dv], [pools.dks[0]], runs, runs, PS)
    with pytest.raises(errors.LayoutError):  # page_size not the host's page dimension
        sk.transfer_kv_per_layer_direct_pf_lf(hp, [pools.dk, pools.dv], pages_runs([1], 2), pages_runs([0], 2), 0, 2)
    with pytest.raises(errors.LayoutError):  # rows of another size than a host token
        sk.transfer_kv_per_layer_direct_pf_lf(hp, [pools.dk[:, :1].contiguous(), pools.dv[:, :1].contiguous()],
                                              runs, runs, 0, PS)
    with pytest.raises(errors.IndexValidationError):  # a device run past the layer's rows
        sk.transfer_kv_per_layer_direct_pf_lf(hp, [pools.dk, pools.dv], runs, runs + (T - PS - 3), 0, PS)
    with pytest.raises(errors.IndexValidationError):  # layer past the host's layers
        sk.transfer_kv_per_layer_direct_pf_lf(hp, [pools.dk, pools.dv], runs, runs, L, PS)
    with pytest.raises(errors.IndexValidationError):  # a range past the tensor
        sk.transfer_embedding_ranges_direct(pools.hk[:, 0].contiguous(), pools.dk, [0], [T - 1], [2])
    with pytest.raises(errors.IndexValidationError):  # index dtypes differ
        hc.transfer_hicache_one_layer(pools.dk, pools.dv, D_IDX.to(torch.int32), pools.hk.transpose(0, 1)[0],
                                      pools.hv.transpose(0, 1)[0], S_IDX)
    with pytest.raises(errors.LayoutError):  # rows that are not whole elements
        hc.transfer_hicache_one_layer(pools.dk, pools.dv, D_IDX, pools.hk, pools.hv, S_IDX, element_dim=5)
    with pytest.raises(errors.InvalidArgumentError):  # strides differ and no element_size
        hc.transfer_hicache_all_layer(table(pools.dks), table(pools.dvs), D_IDX, table(pools.dks), table(pools.dvs),
                                      D_IDX, kv_cache_src_stride_bytes=ITEM, kv_cache_dst_stride_bytes=2 * ITEM)
    with pytest.raises(errors.NotRegisteredError):
        hc.transfer_hicache_all_layer(table(pools.dks), table(pools.dvs), D_IDX, raw_table([12345] * L),
                                      table(pools.dvs), S_IDX, kv_cache_src_stride_bytes=ITEM,
                                      kv_cache_dst_stride_bytes=ITEM)
    with pytest.raises(errors.DomainError):  # staging in host memory
        hc.transfer_hicache_all_layer_mla_staged_lf_pf(table(pools.dks), runs, runs, pools.hk[:2 * PS], pools.hk,
                                                       page_size=PS)
    with pytest.raises(errors.IndexValidationError):  # dst pages repeat
        hc.transfer_hicache_all_layer_mla_staged_lf_page_unified(
            table(pools.dks), torch.tensor([0, 1]), torch.tensor([1, 1]), poison(dev(1, L, PS, 32)),
            host(2, L, PS, 32))
    with pytest.raises(errors.InvalidArgumentError):  # a group row of 8 bytes (upstream: 16-byte aligned)
        hc.transfer_hicache_one_layer_mla_page_unified_lf(pools.dk.view(T, -1)[:, :4].contiguous(),
                                                          host(2, L, PS, 4), D_IDX, D_IDX, 0)
    with pytest.raises(errors.IndexValidationError):  # layer out of range
        hc.transfer_hicache_one_layer_mla_page_unified_lf(pools.dk.view(T, 1, -1), host(2, L, PS, 16), D_IDX[:2],
                                                          D_IDX[:2], L)
    assert unchanged(pools.written(), before)


# -- on a GPU: the upstream call shapes with runtime-pinned host memory and CUDA tables --------------

def _pinned(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)  # pinned by the runtime, not registered here


def _cuda(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cuda")


def _cuda_table(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, device="cuda")


@pytest.mark.gpu
def test_gpu_page_first_both_ways_and_graph_replay() -> None:
    """pf_lf per layer into device layers, lf_pf back from CUDA tables into pinned pages, the
    per-layer load captured in a CUDA graph and replayed with new indices."""
    tokens, layers, heads, hd, dtoks = 256, 4, 8, 64, 128
    item = heads * hd * 2
    hk, hv = rand(_pinned(tokens, layers, heads, hd)), rand(_pinned(tokens, layers, heads, hd))
    dks = [poison(_cuda(dtoks, heads, hd)) for _ in range(layers)]
    dvs = [poison(_cuda(dtoks, heads, hd)) for _ in range(layers)]
    s = torch.randperm(tokens)[:100].cuda()
    d = torch.randperm(dtoks)[:100].cuda()
    for layer in range(layers):
        sk.transfer_kv_per_layer_pf_lf(hk, dks[layer], hv, dvs[layer], s, d, layer, item, layers * item)
    pd.synchronize("cuda:0")
    for layer in range(layers):
        want = poison(torch.empty(dtoks, heads, hd, dtype=DT))
        want[d.cpu()] = hk[s.cpu(), layer]
        assert same(dks[layer].cpu(), want)
    back_k, back_v = poison(_pinned(tokens, layers, heads, hd)), poison(_pinned(tokens, layers, heads, hd))
    sk.transfer_kv_all_layer_lf_pf(_cuda_table(dks), back_k, _cuda_table(dvs), back_v, d, s, item, layers * item,
                                   layers)
    pd.synchronize("cuda:0")
    assert torch.equal(u8(back_k)[s.cpu()], u8(hk)[s.cpu()]) and torch.equal(u8(back_v)[s.cpu()], u8(hv)[s.cpu()])
    rest = torch.ones(tokens, dtype=torch.bool)
    rest[s.cpu()] = False
    assert bool((u8(back_k)[rest] == POISON).all())
    # graph capture of the per-layer load, replayed with other indices
    s_buf, d_buf = s.clone(), d.clone()
    out = poison(_cuda(dtoks, heads, hd)), poison(_cuda(dtoks, heads, hd))
    sk.transfer_kv_per_layer_pf_lf(hk, out[0], hv, out[1], s_buf, d_buf, 1, item, layers * item)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sk.transfer_kv_per_layer_pf_lf(hk, out[0], hv, out[1], s_buf, d_buf, 1, item, layers * item)
    poison(out[0])
    new_s, new_d = torch.randperm(tokens)[:100].cuda(), torch.randperm(dtoks)[:100].cuda()
    s_buf.copy_(new_s)
    d_buf.copy_(new_d)
    graph.replay()
    pd.synchronize("cuda:0")
    want = poison(torch.empty(dtoks, heads, hd, dtype=DT))
    want[new_d.cpu()] = hk[new_s.cpu(), 1]
    assert same(out[0].cpu(), want)


@pytest.mark.gpu
def test_gpu_head_layouts_round_trip() -> None:
    pages, ps, layers, heads, hd, dtoks = 16, 8, 3, 4, 64, 96
    item = heads * hd * 2
    dks = [rand(_cuda(dtoks, heads, hd)) for _ in range(layers)]
    dvs = [rand(_cuda(dtoks, heads, hd)) for _ in range(layers)]
    s = torch.randperm(dtoks)[:40].cuda()
    h = torch.randperm(pages * ps)[:40].cuda()
    ph = poison(_pinned(pages, heads, ps, layers, hd)), poison(_pinned(pages, heads, ps, layers, hd))
    sk.transfer_kv_all_layer_lf_ph(_cuda_table(dks), ph[0], _cuda_table(dvs), ph[1], s, h, item, layers * item,
                                   layers, ps, heads)
    groups = 2
    dh = poison(_pinned(pages * groups * layers * ps * (heads // groups) * hd)), poison(
        _pinned(pages * groups * layers * ps * (heads // groups) * hd))
    sk.transfer_kv_all_layer_lf_pfdhg(_cuda_table(dks), dh[0], _cuda_table(dvs), dh[1], s, h, item, layers * item,
                                      layers, ps, groups)
    outs = [poison(_cuda(dtoks, heads, hd)) for _ in range(4)]
    sk.transfer_kv_per_layer_ph_lf(ph[0], outs[0], ph[1], outs[1], h, s, 2, item, layers * item, ps, heads)
    sk.transfer_kv_per_layer_pfdhg_lf(dh[0], outs[2], dh[1], outs[3], h, s, 2, item, layers * item, ps, groups)
    pd.synchronize("cuda:0")
    sc = s.cpu()
    for out, src in zip(outs, (dks[2], dvs[2], dks[2], dvs[2])):
        want = poison(torch.empty(dtoks, heads, hd, dtype=DT))
        want[sc] = src.cpu()[sc]
        assert same(out.cpu(), want)
    hc_ = h.cpu()
    for i in range(40):
        t, r = int(hc_[i]), int(sc[i])
        assert torch.equal(u8(ph[0][t // ps, :, t % ps, 1]), u8(dks[1][r].cpu()))


@pytest.mark.gpu
def test_gpu_direct_and_hicache() -> None:
    tokens, layers, heads, hd, dtoks, ps = 128, 3, 4, 64, 64, 16
    item = heads * hd * 2
    hk = rand(_pinned(tokens, layers, heads, hd))
    dks = [poison(_cuda(dtoks, heads, hd)) for _ in range(layers)]
    s_cpu, d_cpu = pages_runs([5, 2], ps), pages_runs([1, 3], ps)
    # direct, CPU src indices and CUDA dst indices as upstream's test
    lf = [rand(_pinned(tokens, heads, hd)) for _ in range(2)]
    sk.transfer_kv_direct(lf, dks[:2], s_cpu, d_cpu.cuda(), page_size=ps)
    # JIT one layer over page_first views, int32 CUDA indices
    # (K and V destinations apart: one buffer for both is refused, OverlapError)
    v_dst = poison(_cuda(dtoks, heads, hd))
    hc.transfer_hicache_one_layer(dks[2], v_dst, d_cpu.cuda().int(), hk.transpose(0, 1)[1], hk.transpose(0, 1)[1],
                                  s_cpu.cuda().int(), element_dim=heads * hd)
    pd.synchronize("cuda:0")
    assert torch.equal(u8(dks[0]).cpu()[d_cpu], u8(lf[0])[s_cpu])
    assert torch.equal(u8(dks[2]).cpu()[d_cpu], u8(hk)[s_cpu, 1])
    assert torch.equal(u8(v_dst).cpu()[d_cpu], u8(hk)[s_cpu, 1])
    # JIT all layer over host tables (host VAs of pinned memory in a CUDA uint64 tensor)
    hkt = _cuda_table([hk.transpose(0, 1)[i] for i in range(layers)])
    fresh = [poison(_cuda(dtoks, heads, hd)) for _ in range(layers)]
    hc.transfer_hicache_all_layer_mla(_cuda_table(fresh), d_cpu.cuda(), hkt, s_cpu.cuda(),
                                      cache_src_stride_bytes=layers * item, cache_dst_stride_bytes=item,
                                      element_size=item)
    # staged write-back of whole pages into a fresh pinned pool
    back = poison(_pinned(tokens, layers, heads, hd))
    staging = _cuda(2 * ps, layers, heads, hd)
    hc.transfer_hicache_all_layer_mla_staged_lf_pf(_cuda_table(fresh), d_cpu.cuda(), s_cpu, staging, back,
                                                   page_size=ps)
    pd.synchronize("cuda:0")
    assert torch.equal(u8(back)[s_cpu], u8(hk)[s_cpu])
    rest = torch.ones(tokens, dtype=torch.bool)
    rest[s_cpu] = False
    assert bool((u8(back)[rest] == POISON).all())


@pytest.mark.gpu
def test_gpu_page_unified_and_reported_slots() -> None:
    hpages, groups, layers, ps, hg, dim, dtoks = 6, 2, 3, 8, 2, 64, 64
    d_k = [rand(_cuda(dtoks, groups * hg, dim)) for _ in range(layers)]
    d_v = [rand(_cuda(dtoks, groups * hg, dim)) for _ in range(layers)]
    pool = poison(_pinned(hpages, groups, layers, 2, ps, hg, dim))
    staging = _cuda(2, groups, layers, 2, ps, hg, dim)
    src_pages, dst_pages = torch.tensor([3, 0, 7], device="cuda"), torch.tensor([5, 1, 2])
    hc.transfer_hicache_all_layer_staged_lf_page_unified(_cuda_table(d_k), _cuda_table(d_v), src_pages, dst_pages,
                                                         staging, pool)
    out_k, out_v = poison(_cuda(dtoks, groups * hg, dim)), poison(_cuda(dtoks, groups * hg, dim))
    hs = pages_runs([5, 1, 2], ps).cuda()
    ds = pages_runs([3, 0, 7], ps).cuda()
    hc.transfer_hicache_one_layer_page_unified_lf(out_k, out_v, pool, hs, ds, 2)
    pd.synchronize("cuda:0")
    dsc = ds.cpu()
    assert torch.equal(u8(out_k).cpu()[dsc], u8(d_k[2]).cpu()[dsc])
    assert torch.equal(u8(out_v).cpu()[dsc], u8(d_v[2]).cpu()[dsc])
    assert bool((u8(pool)[[0, 3, 4]] == POISON).all())
    # a CUDA slot out of range: skipped by the kernel, reported by synchronize, nothing else written
    before = u8(out_k).clone()
    sk.transfer_kv_per_layer(d_k[0], out_k, d_v[0], out_v, torch.tensor([0, dtoks], device="cuda"),
                             torch.tensor([1, 2], device="cuda"), item_size=groups * hg * dim * 2)
    with pytest.raises(errors.IndexValidationError):
        pd.synchronize("cuda:0")
    after = u8(out_k)
    assert torch.equal(after[1], u8(d_k[0])[0]) and torch.equal(after[2], before[2])


def test_lowered_indices_of_a_wild_slot_are_all_negative() -> None:
    """On CUDA the indices are not read on the host: a slot outside its buffer must become
    parts the kernel skips and reports (negative), never another slot's parts."""
    idx = torch.tensor([5, -1, 20, 19, -7, 2**40])
    parts = sk.page_parts(idx, 20, PS, 3, outer=2, inner=1).view(-1, 3)
    assert torch.equal(parts[0], torch.tensor([((1 * 3 + j) * 2 + 1) * PS + 1 for j in range(3)]))
    assert torch.equal(parts[3], torch.tensor([((4 * 3 + j) * 2 + 1) * PS + 3 for j in range(3)]))
    assert bool((parts[[1, 2, 4, 5]] < 0).all())
    rows = sk.row_parts(idx, 20, 2, 5).view(-1, 2)
    assert torch.equal(rows[0], torch.tensor([25, 26])) and bool((rows[[1, 2, 4, 5]] < 0).all())
    run = sk.runs(torch.tensor([16, 17, -1]), 20, PS).view(-1, PS)
    assert torch.equal(run[0], torch.arange(16, 20)) and bool((run[1:] < 0).all())
    paged = sk.runs(torch.tensor([9, 20]), 20, PS, aligned_to=PS, scale=L * PS, offset=PS).view(-1, PS)
    assert torch.equal(paged[0], torch.arange(2 * L * PS + PS, 2 * L * PS + 2 * PS)) and bool((paged[1] < 0).all())


# -- graph capture of call shapes that derive their indices ------------------------------------
# A row as several slots (per head, per head group, strided rows): the launch reads indices
# computed from the caller's. A CUDA graph captures those torch ops with the launch; the
# emulated stand-in must run them again at each replay, or a replay writes where the
# caller's indices pointed at capture. Reference: the same call made eagerly.

def _derived_case(name: str) -> tuple[Callable[..., None], pd.RegisteredHostMemory]:
    tokens, heads, head_dim, ps = 8, 2, 8, 2
    item = heads * head_dim
    mem = pd.alloc_registered(2 * tokens * item * 2, DEV)
    k = rand(pd.device_empty((tokens, item), dtype=torch.uint8, device=DEV))
    v = rand(pd.device_empty((tokens, item), dtype=torch.uint8, device=DEV))
    if name == "lf_ph":
        hk, hv = mem.tensor[:tokens * item], mem.tensor[tokens * item:2 * tokens * item]
        kt, vt = _table([k], DEV), _table([v], DEV)

        def call(s: torch.Tensor, d: torch.Tensor, kv: tuple[torch.Tensor, ...] = (k, v)) -> None:
            sk.transfer_kv_all_layer_lf_ph(kt, hk, vt, hv, s, d, item, item, 1, ps, heads)  # kv: held
    else:  # strided host rows: 16 bytes of every 24
        hk = mem.tensor[:tokens * 24].view(tokens, 24)
        hv = mem.tensor[tokens * 24:2 * tokens * 24].view(tokens, 24)

        def call(s: torch.Tensor, d: torch.Tensor) -> None:
            hc.transfer_hicache_one_layer(hk[:, :item], hv[:, :item], d, k, v, s)  # device -> host rows
    return call, mem


@pytest.mark.strict_alias
@pytest.mark.parametrize("name", ["lf_ph", "hicache_strided"])
@pytest.mark.parametrize("where", ["cpu", "device"])
def test_a_captured_derived_call_replays_the_indices_as_they_are_then(name: str, where: str) -> None:
    from pointerdomain.testing import EmulatedGraph

    call, mem = _derived_case(name)
    host = mem.tensor

    def idx(values: list[int]) -> torch.Tensor:
        t = torch.tensor(values)
        return t if where == "cpu" else pd.device_empty((len(values),), dtype=torch.int64, device=DEV).copy_(t)

    s, d = idx([0, 1]), idx([3, 4])
    call(s, d)  # eager once
    graph = EmulatedGraph()
    with graph.capture(DEV):
        call(s, d)
    s.copy_(torch.tensor([2, 5]))
    d.copy_(torch.tensor([6, 1]))
    host.fill_(POISON)
    graph.replay()
    pd.check_errors(DEV)
    got = host.clone()
    host.fill_(POISON)
    call(torch.tensor([2, 5]), torch.tensor([6, 1]))
    assert torch.equal(got, host)
    assert not bool((got == POISON).all())
    graph.reset()
    mem.close()
