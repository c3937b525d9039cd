"""Rule 0 of pointerdomain.transfer.overlap: a launch never writes one byte through two
destination entries (K and V, or two layers, given the same memory). Refused with
OverlapError before anything is copied; sources may share memory."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.transfer.overlap import allow_interleaved, entry_clashes, first_shared, rows_clash
from pointerdomain.transfer.plan import plan_for
from tests.reference import DEV, fill_pool, model_layout, same

POISON = 0xA5


def _layer_views(layout: pd.KVLayout, count: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One registered-to-be host buffer of ``count`` per-layer buffers of ``layout``, and its views."""
    pool = pd.DeviceKVPool(layout, DEV)  # only for a buffer's shape and dtype
    shape, dtype = pool.buffers[0].shape, pool.buffers[0].dtype
    whole = torch.empty(count, *shape, dtype=dtype)
    whole.view(torch.uint8).fill_(POISON)
    return whole, [whole[i] for i in range(count)]


@pytest.mark.parametrize("backend", ["kernel", "copy_engine", "auto"])
def test_k_and_v_destination_entries_over_one_buffer_are_refused(backend: str) -> None:
    layout = model_layout("layer_first")
    gpu = pd.DeviceKVPool(layout, DEV)
    fill_pool(gpu, 3)
    whole, views = _layer_views(layout, layout.num_layers)
    with pd.register_host_tensor(whole, DEV):
        table = pd.make_kernel_ptr_table(views + views, DEV)  # V entries over the K entries' bytes
        before = whole.clone()
        with pytest.raises(errors.OverlapError, match=r"entry 0 \(K, layer 0\) and entry 3 \(V, layer 0\)") as info:
            pd.transfer_kv_all_layer(gpu.table, table, torch.tensor([0, 1]), torch.tensor([2, 3]), src_layout=layout,
                                     dst_layout=layout, backend=backend)  # type: ignore[arg-type]
        assert isinstance(info.value, ValueError)
        with pytest.raises(errors.OverlapError):  # one layer: K and V of that layer still meet
            pd.transfer_kv_per_layer(gpu.table, table, torch.tensor([0]), torch.tensor([2]), layer_id=1,
                                     src_layout=layout, dst_layout=layout, backend=backend)  # type: ignore[arg-type]
        assert same(whole, before)


def test_partly_overlapping_entries_are_refused() -> None:
    """Entries that meet part way (a view shifted by one token): refused as well."""
    layout = model_layout("layer_first")
    gpu = pd.DeviceKVPool(layout, DEV)
    n = gpu.buffers[0].numel()
    flat = torch.full((n * (2 * layout.num_layers + 1),), 0, dtype=gpu.buffers[0].dtype)
    flat.view(torch.uint8).fill_(POISON)
    row = n // layout.num_slots
    starts = [i * n for i in range(2 * layout.num_layers - 1)] + [(2 * layout.num_layers - 2) * n + row]
    views = [flat[s:s + n].view(gpu.buffers[0].shape) for s in starts]
    with pd.register_host_tensor(flat, DEV):
        table = pd.make_kernel_ptr_table(views, DEV)
        before = flat.clone()
        with pytest.raises(errors.OverlapError, match="share memory"):
            pd.transfer_kv_all_layer(gpu.table, table, torch.tensor([0]), torch.tensor([9]), src_layout=layout,
                                     dst_layout=layout)
        assert same(flat, before)


def test_source_entries_may_share_memory() -> None:
    """Reads only: a source table whose K and V entries are one buffer copies both from it."""
    layout = model_layout("layer_first")
    src_pool = pd.DeviceKVPool(layout, DEV)
    fill_pool(src_pool, 5)
    k_only = pd.make_kernel_ptr_table(src_pool.buffers[:layout.num_layers] * 2, DEV)
    dst_pool = pd.DeviceKVPool(layout, DEV)
    fill_pool(dst_pool, 9)
    pd.transfer_kv_all_layer(k_only, dst_pool.table, torch.tensor([1, 2]), torch.tensor([6, 7]), src_layout=layout,
                             dst_layout=layout)
    for kv in range(2):
        for layer in range(layout.num_layers):
            got = dst_pool.buffers[kv * layout.num_layers + layer]
            want = src_pool.buffers[layer]  # V read through the K entries
            assert same(got[6:8], want[1:3])


def test_layers_over_one_buffer_per_layer_only() -> None:
    """Every layer's entries naming one buffer (a per-layer table): one-layer launches are
    sound (each writes its layer once); a launch over two of those layers is refused."""
    layout = model_layout("layer_first")
    gpu = pd.DeviceKVPool(layout, DEV)
    fill_pool(gpu, 7)
    whole, views = _layer_views(layout, 2)
    k, v = views
    with pd.register_host_tensor(whole, DEV):
        table = pd.make_kernel_ptr_table([k] * layout.num_layers + [v] * layout.num_layers, DEV)
        s, d = torch.tensor([4, 5]), torch.tensor([0, 3])
        before = whole.clone()
        with pytest.raises(errors.OverlapError, match=r"\(K, layer 0\) and entry 1 \(K, layer 1\)"):
            pd.transfer_kv_all_layer(gpu.table, table, s, d, src_layout=layout, dst_layout=layout)
        with pytest.raises(errors.OverlapError, match="share memory"):
            pd.explain_transfer(gpu.table, table, s, d, src_layout=layout, dst_layout=layout)
        assert same(whole, before)
        pd.transfer_kv_per_layer(gpu.table, table, s, d, layer_id=2, src_layout=layout, dst_layout=layout)
        for kv, buf in enumerate((k, v)):
            src = gpu.buffers[kv * layout.num_layers + 2]
            want = before[kv].clone()
            want[d] = src[s]
            assert same(buf, want)


def test_disjoint_destination_entries_pay_nothing() -> None:
    """A pool table: no clash recorded, so the per-launch check never runs."""
    layout = model_layout("layer_first")
    gpu = pd.DeviceKVPool(layout, DEV)
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        assert plan_for(gpu.table, gpu.layout, host.kernel_table, host.layout).dst_clashes == ()
        assert plan_for(host.kernel_table, host.layout, gpu.table, gpu.layout).dst_clashes == ()


def _row_bytes(start: int, rows: int, stride: int, row: int) -> set[int]:
    return {start + i * stride + k for i in range(rows) for k in range(row)}


@pytest.mark.parametrize(("stride", "row"), [(8, 4), (12, 4), (10, 3), (6, 4), (4, 4)])
def test_rows_clash_matches_the_bytes_rows_touch(stride: int, row: int) -> None:
    """rows_clash against the byte sets of two entries of ``rows`` rows each: exact wherever
    the second entry starts inside the first's rows (not at its last row), and it never
    misses a byte written twice at the edges."""
    rows = 6
    a = 5 * stride
    span = (rows - 1) * stride + row
    a_bytes = _row_bytes(a, rows, stride, row)
    for b in range(a - span - stride, a + span + stride):
        truth = bool(a_bytes & _row_bytes(b, rows, stride, row))
        got = rows_clash(a, a + span, b, b + span, (stride, row))
        if abs(b - a) < (rows - 2) * stride:
            assert got == truth, (b - a)
            if truth:  # the address an error names: the first byte both write
                lo, hi = min(a, b), max(a, b)
                assert first_shared(lo, hi, (stride, row)) == min(a_bytes & _row_bytes(b, rows, stride, row))
        else:
            assert got or not truth, (b - a)  # conservative at the edges, never lenient
        assert rows_clash(a, a + span, b, b + span, None) == (b < a + span and a < b + span)


@pytest.mark.parametrize(("offset_rows", "refused"), [(1.0, False), (0.5, True), (2.0, True), (0.0, True),
                                                      (1.5, True)])
def test_interleaved_table_refuses_entries_whose_rows_meet(offset_rows: float, refused: bool) -> None:
    """A table marked interleaved with rows ``B`` bytes every ``2B``: V of layer 0 starting
    ``offset_rows * B`` after K of layer 0 passes only where its rows fall between K's."""
    layout = model_layout("layer_first")
    gpu = pd.DeviceKVPool(layout, DEV)
    n = gpu.buffers[0].numel() * gpu.buffers[0].element_size()
    row = n // layout.num_slots
    flat = torch.full((2 * n * 2 * layout.num_layers + n,), POISON, dtype=torch.uint8)
    starts = [2 * n * i for i in range(2 * layout.num_layers)]
    starts[layout.num_layers] = int(offset_rows * row)  # V of layer 0 against K of layer 0
    views = [flat[s:s + n] for s in starts]
    with pd.register_host_tensor(flat, DEV):
        table = pd.make_kernel_ptr_table(views, DEV)
        geo = layout.geometry(len(table), tuple(table.sizes), "dst")
        with pytest.raises(errors.OverlapError, match=r"entry 0 \(K, layer 0\) and entry \d+ \(V, layer 0\)"):
            entry_clashes(table, geo)  # unmarked: intersecting entries always clash
        allow_interleaved(table, (2 * row, row))
        if refused:
            with pytest.raises(errors.OverlapError, match=r"entry 0 \(K, layer 0\) and entry \d+ \(V, layer 0\)"):
                entry_clashes(table, geo)
        else:
            assert entry_clashes(table, geo) == ()
        allow_interleaved(table, None)
        with pytest.raises(errors.OverlapError):
            entry_clashes(table, geo)
    with pytest.raises(errors.InvalidArgumentError):
        allow_interleaved(table, (0, 1))


@pytest.mark.strict_alias  # also run in strict alias mode by CI
@pytest.mark.parametrize("backend", ["kernel", "copy_engine"])
@pytest.mark.parametrize("second", [None, "rows_meet"])
def test_a_cached_plan_follows_a_changed_interleave_mark(backend: str, second: str | None) -> None:
    """Rule 0's verdict is the table's as marked at the launch, not as marked when the plan was
    first built: V of layer 0 one row after K of layer 0 passes while marked (rows of B bytes
    every 2B), and once the mark is cleared (or says rows of 1.5B, which meet) the same
    table, layouts and slots are refused with every destination byte as it was."""
    layout = model_layout("layer_first")
    gpu = pd.DeviceKVPool(layout, DEV)
    fill_pool(gpu, 7)
    n = gpu.buffers[0].numel() * gpu.buffers[0].element_size()
    row = n // layout.num_slots
    flat = torch.full((2 * n * 2 * layout.num_layers + n,), POISON, dtype=torch.uint8)
    starts = [2 * n * i for i in range(2 * layout.num_layers)]
    starts[layout.num_layers] = row  # V of layer 0: its rows between K of layer 0's
    views = [flat[s:s + n] for s in starts]
    with pd.register_host_tensor(flat, DEV):
        table = pd.make_kernel_ptr_table(views, DEV)
        allow_interleaved(table, (2 * row, row))
        src, dst = torch.tensor([1, 4]), torch.tensor([0, 2])  # even slots: K and V rows interleave
        pd.transfer_kv_all_layer(gpu.table, table, src, dst, src_layout=layout, dst_layout=layout,
                                 backend=backend)  # type: ignore[arg-type]
        k0, v0 = gpu.buffers[0].view(torch.uint8), gpu.buffers[layout.num_layers].view(torch.uint8)
        assert torch.equal(views[0].view(-1, row)[dst], k0.view(-1, row)[src])
        assert torch.equal(views[layout.num_layers].view(-1, row)[dst], v0.view(-1, row)[src])
        allow_interleaved(table, None if second is None else (2 * row, row + row // 2))
        before = flat.clone()
        for launch in range(2):  # the plan built before the change, and a launch after the refusal
            with pytest.raises(errors.OverlapError, match=r"entry 0 \(K, layer 0\) and entry \d+ \(V, layer 0\)"):
                pd.transfer_kv_all_layer(gpu.table, table, torch.tensor([3, 5]), torch.tensor([1, 3]),
                                         src_layout=layout, dst_layout=layout, backend=backend)  # type: ignore[arg-type]
            with pytest.raises(errors.OverlapError):
                pd.transfer_kv_per_layer(gpu.table, table, torch.tensor([3]), torch.tensor([1]), layer_id=0,
                                         src_layout=layout, dst_layout=layout, backend=backend)  # type: ignore[arg-type]
            assert torch.equal(flat, before)
        allow_interleaved(table, (2 * row, row))  # marked again: launches again
        pd.transfer_kv_all_layer(gpu.table, table, torch.tensor([3]), torch.tensor([4]), src_layout=layout,
                                 dst_layout=layout, backend=backend)  # type: ignore[arg-type]
        assert torch.equal(views[0].view(-1, row)[4], k0.view(-1, row)[3])
