"""sglang's ``page_head`` and ``page_unified`` host layouts.

Every expected byte comes from plain torch indexing of the one-buffer shapes sglang
allocates (``MHATokenToKVPoolHost.init_kv_buffer``: ``[2, page_num, head_num,
page_size, layer_num, head_dim]``; ``PageUnifiedLayout.page_dims``: ``[page_num,
head_group_num, layer_num, 2, page_size, head_in_group, head_dim]``), never from the
library's geometry: transfers of random bytes into poisoned destinations for every
backend the CPU runs, byte offsets against the addresses of torch elements, the
metadata blocks against torch slices, and the typed errors of bad input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.layouts import KVLayout, lower_pair
from pointerdomain.transfer.plan import plan_for
from tests.reference import DEV, fill_pool, fill_random

POISON = 0xA5
PAGE = 4  # tokens per page
LAYERS = 3


def layout(kind: str, *, attention: str = "mha", heads: int = 4, groups: int = 1, pages: int = 5) -> KVLayout:
    """A small model: 3 layers, pages of 4 tokens, bf16; MHA 4 heads of 8 (16-byte
    heads, 64-byte items), MLA one latent of 40."""
    dim = 40 if attention == "mla" else 8
    return KVLayout.model_validate(
        {"kind": kind, "attention": attention, "num_layers": LAYERS, "num_pages": pages, "page_size": PAGE,
         "num_heads": 1 if attention == "mla" else heads, "head_dim": dim, "head_groups": groups}
    )


def item(buffer: torch.Tensor, lay: KVLayout, kv: int, layer: int, slot: int) -> torch.Tensor:
    """The ``[num_heads, head_dim]`` item of ``(kv, layer, slot)`` of a one-buffer tensor
    of ``lay.buffer_shape``, by indexing the documented shapes."""
    page, tok = divmod(slot, lay.page_size)
    if lay.kind == "layer_first":  # [kv, L, P*ps, H, D]
        return buffer[kv, layer, slot]
    if lay.kind == "page_first":  # [kv, P*ps, L, H, D]
        return buffer[kv, slot, layer]
    if lay.kind == "page_first_direct":  # [kv, P, L, ps, H, D]
        return buffer[kv, page, layer, tok]
    if lay.kind == "page_head":  # [kv, P, H, ps, L, D]
        return buffer[kv, page, :, tok, layer]
    assert lay.kind == "page_unified"  # [P, G, L, kv, ps, H/G, D]
    return buffer[page, :, layer, kv, tok].reshape(lay.num_heads, lay.head_dim)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


@dataclass
class Side:
    """One pool: its layout, its one-buffer tensor (typed view) and its kernel table."""

    layout: KVLayout
    buffer: torch.Tensor
    table: pd.PointerTable[pd.DeviceAlias]
    device_pool: pd.DeviceKVPool | None = None
    host_pool: pd.HostKVPool | None = None

    def item(self, kv: int, layer: int, slot: int) -> torch.Tensor:
        if self.device_pool is not None:
            return self.device_pool.buffer(kv, layer)[slot]
        return item(self.buffer, self.layout, kv, layer, slot)

    def snapshot(self) -> list[torch.Tensor]:
        if self.device_pool is not None:
            return [raw(b).clone() for b in self.device_pool.buffers]
        return [raw(self.buffer).clone()]


@contextlib.contextmanager
def device_side(lay: KVLayout, seed: int) -> Iterator[Side]:
    pool = pd.DeviceKVPool(lay, DEV)
    fill_pool(pool, seed)
    yield Side(lay, torch.empty(0), pool.table, device_pool=pool)


@contextlib.contextmanager
def host_side(lay: KVLayout, seed: int, *, chunk_blocks: int | None = None) -> Iterator[Side]:
    max_chunk = lay.page_block_bytes() * chunk_blocks if chunk_blocks else 1 << 40
    with pd.HostKVPool(lay, DEV, max_chunk_bytes=max_chunk) as pool:
        assert (len(pool.memory.chunks) > 1) == (chunk_blocks is not None)
        fill_random(pool.buffer, seed)
        yield Side(lay, pool.buffer, pool.kernel_table, host_pool=pool)


def poison(side: Side) -> None:
    if side.device_pool is not None:
        for b in side.device_pool.buffers:
            b.view(torch.uint8).fill_(POISON)
    else:
        side.buffer.view(torch.uint8).fill_(POISON)


def put(buffer: torch.Tensor, lay: KVLayout, kv: int, layer: int, slot: int, value: torch.Tensor) -> None:
    """Write the ``[num_heads, head_dim]`` item of ``(kv, layer, slot)`` (as :func:`item` reads it)."""
    page, tok = divmod(slot, lay.page_size)
    if lay.kind == "page_unified":
        buffer[page, :, layer, kv, tok] = value.reshape(lay.head_groups, -1, lay.head_dim)
    else:
        item(buffer, lay, kv, layer, slot).copy_(value)


def expected_after(src: Side, dst: Side, s: list[int], d: list[int], layers: list[int]) -> list[torch.Tensor]:
    """dst's bytes after copying ``s[i] -> d[i]`` of ``layers`` and every kv: plain torch
    indexing on copies of the buffers."""
    if dst.device_pool is not None:
        want = [b.clone() for b in dst.device_pool.buffers]
        for kv in range(dst.layout.num_kv):
            for layer in layers:
                for si, di in zip(s, d):
                    want[kv * dst.layout.num_layers + layer][di] = src.item(kv, layer, si)
        return [raw(b) for b in want]
    buffer = dst.buffer.clone()
    for kv in range(dst.layout.num_kv):
        for layer in layers:
            for si, di in zip(s, d):
                put(buffer, dst.layout, kv, layer, di, src.item(kv, layer, si))
    return [raw(buffer)]


def run(src: Side, dst: Side, s: list[int], d: list[int], *, layer: int | None, backend: str) -> None:
    si, di = torch.tensor(s, dtype=torch.int64), torch.tensor(d, dtype=torch.int64)
    if layer is None:
        pd.transfer_kv_all_layer(src.table, dst.table, si, di, src_layout=src.layout, dst_layout=dst.layout,
                                 backend=backend)  # type: ignore[arg-type]
    else:
        pd.transfer_kv_per_layer(src.table, dst.table, si, di, layer_id=layer, src_layout=src.layout,
                                 dst_layout=dst.layout, backend=backend)  # type: ignore[arg-type]


def check_transfer(src: Side, dst: Side, s: list[int], d: list[int], *, layer: int | None, backend: str) -> None:
    poison(dst)
    want = expected_after(src, dst, s, d, list(range(src.layout.num_layers)) if layer is None else [layer])
    src_before = src.snapshot()
    run(src, dst, s, d, layer=layer, backend=backend)
    got = dst.snapshot()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # the poison is still where nothing was copied (want holds it there), and src is untouched
    assert all(torch.equal(a, b) for a, b in zip(src.snapshot(), src_before))


SRC_DEVICE = [22, 3, 7, 3, 0, 17]  # a duplicate: reading a slot twice is fine
DST_HOST = [1, 19, 2, 4, 12, 8]  # unique: two writes to one slot would race
HOST_KINDS = [
    pytest.param(dict(kind="page_head"), id="page_head-4heads"),
    pytest.param(dict(kind="page_head", heads=1), id="page_head-1head"),
    pytest.param(dict(kind="page_unified"), id="page_unified-1group"),
    pytest.param(dict(kind="page_unified", groups=2), id="page_unified-2groups"),
    pytest.param(dict(kind="page_unified", groups=4), id="page_unified-4groups"),
    pytest.param(dict(kind="page_head", attention="mla"), id="page_head-mla"),
    pytest.param(dict(kind="page_unified", attention="mla"), id="page_unified-mla"),
]


def staged_supported(host: KVLayout) -> bool:
    return host.kind == "page_head"  # page_unified: a slot's layers are not adjacent


@pytest.mark.parametrize("spec", HOST_KINDS)
@pytest.mark.parametrize("backend", ["kernel", "copy_engine", "staged", "auto"])
@pytest.mark.parametrize("chunk_blocks", [None, 2])
def test_device_layer_first_to_and_from_host(spec: dict[str, object], backend: str, chunk_blocks: int | None) -> None:
    host_layout = layout(**spec, pages=5)  # type: ignore[arg-type]
    dev_layout = host_layout.replace(kind="layer_first", head_groups=1, num_pages=6)
    with device_side(dev_layout, 1) as dev, host_side(host_layout, 2, chunk_blocks=chunk_blocks) as host:
        if backend == "staged" and not staged_supported(host_layout):
            before = host.snapshot()
            with pytest.raises(errors.LayoutError, match="page_unified"):
                run(dev, host, SRC_DEVICE, DST_HOST, layer=None, backend=backend)
            assert all(torch.equal(a, b) for a, b in zip(host.snapshot(), before))
            return
        check_transfer(dev, host, SRC_DEVICE, DST_HOST, layer=None, backend=backend)  # D2H, all layers
        fill_random(host.buffer, 3)
        check_transfer(host, dev, DST_HOST, [3, 7, 23, 0, 17, 5], layer=None, backend=backend)  # H2D
        if backend != "staged":  # staged moves all layers only
            check_transfer(host, dev, DST_HOST, [9, 3, 7, 11, 0, 23], layer=1, backend=backend)  # H2D, one layer
            check_transfer(dev, host, SRC_DEVICE, DST_HOST, layer=2, backend=backend)  # D2H, one layer


@pytest.mark.parametrize(
    ("src_spec", "dst_spec"),
    [
        (dict(kind="page_head"), dict(kind="page_head", pages=3)),
        (dict(kind="page_head"), dict(kind="page_first_direct")),
        (dict(kind="page_first_direct"), dict(kind="page_head")),
        (dict(kind="page_head"), dict(kind="page_unified")),
        (dict(kind="page_unified", groups=2), dict(kind="page_unified", groups=2, pages=3)),
        (dict(kind="page_unified", groups=4), dict(kind="layer_first")),
        (dict(kind="page_unified"), dict(kind="page_first")),
        (dict(kind="page_head", heads=1), dict(kind="page_first", heads=1)),
    ],
)
@pytest.mark.parametrize("backend", ["kernel", "copy_engine"])
def test_host_to_host(src_spec: dict[str, object], dst_spec: dict[str, object], backend: str) -> None:
    src_layout = layout(**src_spec)  # type: ignore[arg-type]
    dst_layout = layout(**dst_spec)  # type: ignore[arg-type]
    dst_slots = dst_layout.num_slots
    with host_side(src_layout, 4, chunk_blocks=2) as src, host_side(dst_layout, 5) as dst:
        s = [0, 19, 6, 6, 13]
        d = [dst_slots - 1, 2, 0, 5, 9]
        check_transfer(src, dst, s, d, layer=None, backend=backend)
        check_transfer(src, dst, s, d, layer=0, backend=backend)


@pytest.mark.parametrize(
    ("src_spec", "dst_spec", "why"),
    [
        (dict(kind="page_head"), dict(kind="page_first"), "page_first"),
        (dict(kind="page_first"), dict(kind="page_head"), "page_first"),
        (dict(kind="page_unified", groups=2), dict(kind="page_unified", groups=4), "cut items differently"),
        (dict(kind="page_unified", groups=2), dict(kind="page_first_direct"), "page_first_direct"),
        (dict(kind="page_unified", groups=2), dict(kind="page_unified"), "1 head groups"),
        (dict(kind="page_head"), dict(kind="page_unified", groups=2), "cut items differently"),
    ],
)
def test_pairs_that_cannot_be_lowered_are_refused_before_anything_is_written(
    src_spec: dict[str, object], dst_spec: dict[str, object], why: str
) -> None:
    src_layout = layout(**src_spec)  # type: ignore[arg-type]
    dst_layout = layout(**dst_spec)  # type: ignore[arg-type]
    with pytest.raises(errors.LayoutError, match=why):
        lower_pair(src_layout, dst_layout)
    with host_side(src_layout, 6) as src, host_side(dst_layout, 7) as dst:
        poison(dst)
        for backend in ("kernel", "copy_engine", "auto"):
            with pytest.raises(errors.LayoutError, match=why):
                run(src, dst, [1, 2], [3, 4], layer=None, backend=backend)
        assert torch.equal(raw(dst.buffer), torch.full_like(raw(dst.buffer), POISON))


def test_a_layer_first_table_cut_per_page_cannot_meet_head_groups() -> None:
    """A head group of a page_unified page is copied as a page of its own: a layer_first
    table with one entry per (kv, layer, page) does not hold those pages whole."""
    dev_layout = layout("layer_first", pages=6)
    flat = pd.device_empty((dev_layout.nbytes,), torch.uint8, DEV)
    n = dev_layout.num_kv * LAYERS * 6
    assert n in dev_layout.table_splits()
    size = dev_layout.nbytes // n
    per_page = pd.make_kernel_ptr_table([flat[i * size : (i + 1) * size] for i in range(n)], DEV)
    with host_side(layout("page_unified", groups=2), 16) as host:
        poison(host)
        with pytest.raises(errors.LayoutError, match=r"36 entries \(one per page\).*Fix: build the table with 1 or 2 or 6"):
            pd.transfer_kv_all_layer(per_page, host.table, torch.tensor([1]), torch.tensor([2]), src_layout=dev_layout,
                                     dst_layout=host.layout)
        assert torch.equal(raw(host.buffer), torch.full_like(raw(host.buffer), POISON))
    with host_side(layout("page_head"), 17) as host:  # page_head keeps the pages: the same table works
        dev = Side(dev_layout, flat.view(torch.bfloat16).view(dev_layout.buffer_shape), per_page)
        fill_random(flat, 18)
        check_transfer(dev, host, [0, 23, 5], [19, 0, 7], layer=None, backend="kernel")


def test_lower_pair_checks_its_arguments() -> None:
    with pytest.raises(errors.InvalidTypeError, match="dst: found a str"):
        lower_pair(layout("page_head"), "page_first")  # type: ignore[arg-type]
    with pytest.raises(errors.LayoutError, match="differ in num_heads"):
        lower_pair(layout("page_head"), layout("layer_first", heads=2))


def test_lowering_only_where_an_item_is_split() -> None:
    """The existing kinds (and split kinds of one part) get no lowering: their plans and
    launches are what they were."""
    for kind in ("page_first", "page_first_direct", "layer_first"):
        assert lower_pair(layout("layer_first"), layout(kind)) is None
    assert lower_pair(layout("layer_first", heads=1), layout("page_head", heads=1)) is None
    assert lower_pair(layout("layer_first"), layout("page_unified")) is None
    assert lower_pair(layout("layer_first", attention="mla"), layout("page_head", attention="mla")) is None
    with device_side(layout("layer_first", pages=6), 8) as dev, host_side(layout("page_first"), 9) as host:
        plan = plan_for(dev.table, dev.layout, host.table, host.layout)
        assert plan.lowering is None and plan.src_layout is dev.layout and plan.dst_layout is host.layout
    low = lower_pair(layout("layer_first", pages=6), layout("page_head"))
    assert low is not None and low.parts == 4 and (low.src_blocked, low.dst_blocked) == (False, True)
    assert low.dst == layout("page_first", heads=1).replace(page_size=4 * PAGE)
    assert low.src == layout("layer_first", heads=1, pages=6).replace(page_size=4 * PAGE)
    low = lower_pair(layout("page_unified", groups=2), layout("layer_first", pages=6))
    assert low is not None and low.parts == 2 and (low.src_blocked, low.dst_blocked) == (True, False)
    assert low.src == layout("page_unified", heads=2, pages=10)
    assert low.dst == layout("layer_first", heads=2, pages=12)


def test_expanded_slots_name_each_part() -> None:
    """Slot ``s`` of the split side becomes the slots of its parts in the part layout
    (page_head: head ``h`` of token ``t`` of page ``p`` is token ``h * ps + t`` of page
    ``p``), the other side's ``s * parts + h``; a slot out of range, parts all out of
    the lowered range (never wrapped into it)."""
    with device_side(layout("layer_first", pages=6), 10) as dev, host_side(layout("page_head"), 11) as host:
        plan = plan_for(dev.table, dev.layout, host.table, host.layout)
        s = torch.tensor([0, 5, 23, 24, -3], dtype=torch.int64)
        d = torch.tensor([0, 6, 19, 2**62, -1], dtype=torch.int64)
        xs, xd = plan.expand(s, d)
        assert xs.dtype == torch.int64 and xs.is_contiguous() and xs.numel() == 5 * 4
        want_s = [v * 4 + h if 0 <= v < 24 else None for v in s.tolist() for h in range(4)]
        want_d = [(v // PAGE) * 4 * PAGE + h * PAGE + v % PAGE if 0 <= v < 20 else None
                  for v in d.tolist() for h in range(4)]
        for got, want, slots in ((xs.tolist(), want_s, 24 * 4), (xd.tolist(), want_d, 20 * 4)):
            assert slots == (plan.src_layout if slots == 96 else plan.dst_layout).num_slots
            for g, w in zip(got, want):
                assert g == w if w is not None else not 0 <= g < slots


def test_out_of_range_slot_is_reported_in_the_callers_slots_and_nothing_is_written() -> None:
    with device_side(layout("layer_first", pages=6), 12) as dev, host_side(layout("page_head"), 13) as host:
        poison(host)
        for backend in ("kernel", "copy_engine", "staged"):
            with pytest.raises(errors.IndexValidationError, match=r"dst_indices: slot 20 outside \[0, 20\)"):
                run(dev, host, [1, 2], [3, 20], layer=None, backend=backend)
            with pytest.raises(errors.IndexValidationError, match=r"src_indices: slot -1 outside \[0, 24\)"):
                run(dev, host, [-1, 2], [3, 4], layer=None, backend=backend)
        assert torch.equal(raw(host.buffer), torch.full_like(raw(host.buffer), POISON))
        # validate_indices=False: the kernel skips the bad pair (all its parts) and copies the rest
        si, di = torch.tensor([1, 2]), torch.tensor([3, 2**40])
        want = expected_after(dev, host, [1], [3], list(range(LAYERS)))
        pd.transfer_kv_all_layer(dev.table, host.table, si, di, src_layout=dev.layout, dst_layout=host.layout,
                                 backend="kernel", validate_indices=False)
        assert torch.equal(raw(host.buffer), want[0])


def test_moves_inside_one_page_head_pool_follow_the_overlap_rule() -> None:
    lay = layout("page_head")
    with host_side(lay, 14) as host:
        before = Side(lay, host.buffer.clone(), host.table)
        want = expected_after(before, host, [0, 1, 2], [9, 10, 11], list(range(LAYERS)))
        run(host, host, [0, 1, 2], [9, 10, 11], layer=None, backend="kernel")
        assert torch.equal(raw(host.buffer), want[0])
        with pytest.raises(errors.OverlapError, match="slot 9"):
            run(host, host, [9, 1], [2, 9], layer=None, backend="kernel")
        # the same memory read as another layout: refused whatever the slots
        other = pd.make_kernel_ptr_table([host.buffer], DEV)
        with pytest.raises(errors.OverlapError, match="address it differently"):
            pd.transfer_kv_all_layer(host.table, other, torch.tensor([0]), torch.tensor([5]), src_layout=lay,
                                     dst_layout=lay.replace(kind="page_first_direct"))
        assert torch.equal(raw(host.buffer), want[0])


# -- offsets -----------------------------------------------------------------------------

ALL_KINDS = [
    pytest.param(dict(kind=k, **extra), id=f"{k}-{i}")
    for k in ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
    for i, extra in enumerate([dict(), dict(attention="mla")] + ([dict(groups=2), dict(groups=4)]
                                                                  if k == "page_unified" else []))
]


def first_head(buffer: torch.Tensor, lay: KVLayout, kv: int, layer: int, slot: int) -> torch.Tensor:
    """Element ``[.., head 0, dim 0]`` of the item, as a 0-d view of ``buffer``."""
    page, tok = divmod(slot, lay.page_size)
    if lay.kind == "layer_first":
        return buffer[kv, layer, slot, 0, 0]
    if lay.kind == "page_first":
        return buffer[kv, slot, layer, 0, 0]
    if lay.kind == "page_first_direct":
        return buffer[kv, page, layer, tok, 0, 0]
    if lay.kind == "page_head":
        return buffer[kv, page, 0, tok, layer, 0]
    return buffer[page, 0, layer, kv, tok, 0, 0]


@pytest.mark.parametrize("spec", ALL_KINDS)
def test_byte_offset_and_host_va_match_torch_views(spec: dict[str, object]) -> None:
    lay = layout(pages=3, **spec)  # type: ignore[arg-type]
    with pd.HostKVPool(lay, DEV) as pool:
        buffer = pool.buffer
        assert tuple(buffer.shape) == lay.buffer_shape
        base = buffer.data_ptr()
        size = buffer.element_size()
        for page in range(lay.num_pages):
            for layer in range(lay.num_layers):
                for kv in range(lay.num_kv):
                    for token in range(lay.page_size):
                        slot = page * lay.page_size + token
                        first = first_head(buffer, lay, kv, layer, slot)
                        offset = lay.byte_offset(page, layer, kv, token=token)
                        assert offset == first.data_ptr() - base
                        assert pool.host_va(page, layer, kv, token=token) == pd.HostVA(first.data_ptr())
                        # every run of the item, against the heads' elements
                        heads = item(buffer, lay, kv, layer, slot) if lay.kind != "page_unified" else None
                        spans = lay.item_spans(page, layer, kv, token=token)
                        assert sum(n for _, n in spans) == lay.item_bytes
                        assert len(spans) == lay.item_parts
                        if heads is not None and lay.item_parts > 1:
                            assert [o for o, _ in spans] == [heads[h].data_ptr() - base for h in range(lay.num_heads)]
                        elif lay.kind == "page_unified":
                            group = buffer[page, :, layer, kv, token]  # [G, H/G, D]
                            assert [o for o, _ in spans] == [group[g].data_ptr() - base for g in range(lay.head_groups)]
                            assert all(n == group[0].numel() * size for _, n in spans)
                        else:
                            assert spans == [(offset, lay.item_bytes)]
        assert lay.byte_offset(0, 0, 0) == 0


def test_byte_offset_bad_input_is_typed() -> None:
    lay = layout("page_head")
    for bad in (True, 1.0, "1", None):
        with pytest.raises(errors.InvalidTypeError, match="expected an int"):
            lay.byte_offset(bad, 0, 0)  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidTypeError):
            lay.byte_offset(0, 0, 0, token=bad)  # type: ignore[arg-type]
    for args, what in (((5, 0, 0), "page 5 outside"), ((0, 3, 0), "layer 3 outside"), ((0, 0, 2), "kv 2 outside"),
                       ((-1, 0, 0), "page -1 outside")):
        with pytest.raises(errors.IndexValidationError, match=what):
            lay.byte_offset(*args)
    with pytest.raises(errors.IndexValidationError, match="token 4 outside"):
        lay.item_spans(0, 0, 0, token=4)
    with pytest.raises(errors.IndexValidationError, match="kv 1 outside"):
        layout("page_unified", attention="mla").byte_offset(0, 0, 1)
    pool = pd.HostKVPool(lay, DEV)
    with pytest.raises(errors.InvalidTypeError):
        pool.host_va(0, False, 0)  # a bool is an int to the type checker, not here
    pool.close()
    with pytest.raises(errors.ClosedError):
        pool.host_va(0, 0, 0)


def test_head_groups_is_validated() -> None:
    with pytest.raises(errors.LayoutFieldError, match="head_groups") as info:
        layout("page_unified", groups=3)
    assert info.value.field == "head_groups"
    with pytest.raises(errors.LayoutFieldError, match="head_groups"):
        layout("page_first", groups=2)
    with pytest.raises(errors.LayoutFieldError, match="head_groups"):
        layout("page_unified", attention="mla", groups=2)
    with pytest.raises(errors.LayoutFieldError, match="head_groups"):
        layout("page_unified").replace(head_groups=0)
    with pytest.raises(errors.LayoutFieldError, match="kind"):
        layout("page_unified").replace(kind="page_heads")  # type: ignore[arg-type]
    assert layout("page_unified", groups=4).model_dump()["head_groups"] == 4
    assert KVLayout.model_validate_json(layout("page_unified", groups=2).model_dump_json()) == layout(
        "page_unified", groups=2)


# -- metadata ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [dict(kind="page_head"), dict(kind="page_head", attention="mla"),
                                  dict(kind="page_unified"), dict(kind="page_unified", groups=2)])
def test_page_metadata_is_the_pages_bytes(spec: dict[str, object]) -> None:
    lay = layout(pages=3, **spec)  # type: ignore[arg-type]
    with pd.HostKVPool(lay, DEV) as pool:
        fill_random(pool.buffer, 15)
        flat = raw(pool.buffer)
        for page in range(lay.num_pages):
            blocks = lay.page_blocks(page)
            if lay.kind == "page_head":  # one block per kv: all heads, tokens and layers of K, then V
                pieces = [raw(pool.buffer[kv, page]) for kv in range(lay.num_kv)]
                assert lay.page_blocks(page, order="layer_major") == blocks
            else:  # one block: the whole page
                pieces = [raw(pool.buffer[page])]
            assert [torch.equal(flat[o : o + n], p) for (o, n), p in zip(blocks, pieces)] == [True] * len(pieces)
            assert [n for _, n in blocks] == [lay.page_block_bytes()] * len(pieces)
            meta = pool.get_page_buffer_meta([page])
            assert [(m.address, m.nbytes) for m in meta] == [(pd.HostVA(flat.data_ptr()) + o, n) for o, n in blocks]
        regions = lay.page_regions()
        assert sum(n for _, n in regions) == lay.nbytes
        assert len(regions) == (lay.num_kv if lay.kind == "page_head" else 1)
        views = lay.page_block_views(pool.buffer)
        assert len(views) == lay.split_for_page_blocks()
        if lay.kind == "page_unified":  # per page and head group: the entries a launch addresses
            assert [torch.equal(v, raw(pool.buffer[p, g])) for v, (p, g) in zip(
                views, [(p, g) for p in range(lay.num_pages) for g in range(lay.head_groups)])] == [True] * len(views)
        else:
            assert [torch.equal(v, raw(pool.buffer[kv, p])) for v, (kv, p) in zip(
                views, [(kv, p) for kv in range(lay.num_kv) for p in range(lay.num_pages)])] == [True] * len(views)
        assert len(lay.page_block_views(pool.buffer)) in lay.table_splits()
    with pytest.raises(errors.InvalidArgumentError, match="order"):
        lay.page_blocks(0, order="page_major")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidTypeError, match="merge"):
        lay.page_blocks(0, merge=1)  # type: ignore[arg-type]


def test_sglang_page_head_buffer_meta_formula() -> None:
    """sglang's ``get_page_buffer_meta`` for page_head: per page ``(k_ptr, v_ptr)`` with
    ``k_ptr = base + page_start * layer_num * head_num * head_dim * itemsize``, ``v_ptr =
    k_ptr + layer_num * size * head_num * head_dim * itemsize``, each ``layer_num *
    page_size * head_num * head_dim * itemsize`` bytes (pool_host/mha.py)."""
    lay = layout("page_head")
    with pd.HostKVPool(lay, DEV) as pool:
        base, itemsize = pool.buffer.data_ptr(), 2
        per_token = LAYERS * 4 * 8 * itemsize
        v_offset = LAYERS * lay.num_slots * 4 * 8 * itemsize
        for page in (0, 3):
            k_ptr = base + page * PAGE * per_token
            meta = pool.get_page_buffer_meta([page])
            assert [(m.address.value, m.nbytes) for m in meta] == [(k_ptr, PAGE * per_token),
                                                                   (k_ptr + v_offset, PAGE * per_token)]


# -- any pair, any shape ---------------------------------------------------------------

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KINDS = ["layer_first", "page_first", "page_first_direct", "page_head", "page_unified"]


@st.composite
def pairs(draw: st.DrawFn) -> dict[str, object]:
    attention = draw(st.sampled_from(["mha", "mla"]))
    heads = 1 if attention == "mla" else draw(st.integers(1, 4))
    model = dict(attention=attention, num_layers=draw(st.integers(1, 3)), page_size=draw(st.integers(1, 4)),
                 num_heads=heads, head_dim=draw(st.sampled_from([1, 3, 8])),
                 dtype=draw(st.sampled_from(["bfloat16", "float32", "uint8"])))
    sides = []
    for _ in range(2):
        kind = draw(st.sampled_from(KINDS + ["page_head", "page_unified"] * 2))  # the split kinds more often
        divisors = [g for g in range(1, heads + 1) if heads % g == 0]
        groups = draw(st.sampled_from(divisors)) if kind == "page_unified" else 1
        pages = draw(st.integers(1, 3))
        lay = KVLayout.model_validate({**model, "kind": kind, "num_pages": pages, "head_groups": groups})
        sides.append((lay, draw(st.sampled_from(["device", "host", "host_pool"])), draw(st.integers(0, 9))))
    n = draw(st.integers(1, min(sides[0][0].num_slots, sides[1][0].num_slots, 12)))
    src = draw(st.lists(st.integers(0, sides[0][0].num_slots - 1), min_size=n, max_size=n))
    dst = draw(st.permutations(range(sides[1][0].num_slots)))[:n]
    layer = draw(st.none() | st.integers(0, model["num_layers"] - 1))  # type: ignore[operator]
    backend = draw(st.sampled_from(["kernel", "copy_engine", "auto"]))
    return dict(sides=sides, src=src, dst=dst, layer=layer, backend=backend, seed=draw(st.integers(0, 2**16)))


def any_side(stack: contextlib.ExitStack, lay: KVLayout, memory: str, split: int, seed: int) -> Side:
    if memory == "host_pool":
        pool = stack.enter_context(pd.HostKVPool(lay, DEV, max_chunk_bytes=lay.page_block_bytes()))
        fill_random(pool.buffer, seed)
        return Side(lay, pool.buffer, pool.kernel_table, host_pool=pool)
    if memory == "device":
        flat = pd.device_empty((lay.nbytes,), torch.uint8, DEV)
    else:
        flat = stack.enter_context(pd.alloc_registered(lay.nbytes, DEV)).tensor[: lay.nbytes]
    fill_random(flat, seed)
    splits = lay.table_splits()
    n = splits[split % len(splits)]
    size = lay.nbytes // n
    table = pd.make_kernel_ptr_table([flat[i * size : (i + 1) * size] for i in range(n)], DEV, layout=lay)
    return Side(lay, flat.view(lay.torch_dtype).view(lay.buffer_shape), table)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_any_pair_of_layouts_copies_exact_bytes_or_is_refused(case: dict[str, object]) -> None:
    sides = cast("list[tuple[KVLayout, str, int]]", case["sides"])
    s, d, layer = cast("list[int]", case["src"]), cast("list[int]", case["dst"]), cast("int | None", case["layer"])
    seed, backend = cast(int, case["seed"]), cast(str, case["backend"])
    (src_layout, src_mem, src_split), (dst_layout, dst_mem, dst_split) = sides
    with contextlib.ExitStack() as stack:
        src = any_side(stack, src_layout, src_mem, src_split, 1 + seed)
        dst = any_side(stack, dst_layout, dst_mem, dst_split, 2 + seed)
        try:
            low = lower_pair(src_layout, dst_layout)
            refusal = ""
        except errors.LayoutError:
            low, refusal = None, "one run per item"
        # a layer_first table cut per page cannot meet head groups (see lower_pair)
        if low is not None and (len(src.table) not in low.src.table_splits()
                                or len(dst.table) not in low.dst.table_splits()):
            refusal = "one per page"
        event(refusal or ("direct" if low is None else "lowered"))
        if refusal:
            poison(dst)
            with pytest.raises(errors.LayoutError, match=refusal):
                run(src, dst, s, d, layer=layer, backend=backend)
            assert torch.equal(raw(dst.buffer), torch.full_like(raw(dst.buffer), POISON))
            return
        check_transfer(src, dst, s, d, layer=layer, backend=backend)
