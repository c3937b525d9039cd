"""The launch functions (pointerdomain.transfer.kernels) against the torch reference (tests/reference.py)."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import filled_pools, DEV, as_bytes, fill_pool, fill_random, items, model_layout, pool_bytes, pool_items, reference_transfer


def test_host_table_at_launch_raises_before_launch() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    host_layout = model_layout("page_first")
    host = torch.zeros(host_layout.buffer_shape, dtype=torch.bfloat16)
    fill_random(host, 1)
    before = [as_bytes(b).clone() for b in pool.buffers]
    bad = pd.host_ptr_table([host])
    idx = torch.arange(4)
    with pytest.raises(errors.DomainError, match="PointerTable\\[HostVA\\]"):
        pd.transfer_kv_all_layer(bad, pool.table, idx, idx, src_layout=host_layout, dst_layout=pool.layout)  # type: ignore[arg-type]
    assert all(torch.equal(as_bytes(b), w) for b, w in zip(pool.buffers, before))


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("chunked", [False, True])
def test_round_trip_matches_reference(kind: str, attention: str, chunked: bool) -> None:
    dev_layout = model_layout("layer_first", pages=6, attention=attention)
    host_layout = model_layout(kind, pages=10, attention=attention)
    with filled_pools(dev_layout, host_layout, DEV, chunk_blocks=3 if chunked else None, seed=0) as (pool, host):
        host_before = as_bytes(host.buffer).clone()
        dev_slots = torch.tensor([0, 5, 23, 7, 12, 13])
        host_slots = torch.tensor([39, 2, 8, 17, 30, 31])
        expected = reference_transfer(pool_bytes(pool), dev_layout, host_before, host_layout, dev_slots, host_slots)
        host.backup(pool, dev_slots, host_slots)
        # D2H: every moved item equals the device item; every other byte is unchanged
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected)
        # H2D per layer into a poisoned pool
        fill_pool(pool, 1000)
        expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, host_slots, dev_slots)
        for layer in range(3):
            host.load_layer(pool, host_slots, dev_slots, layer)
        assert torch.equal(pool_bytes(pool), expected)


def test_per_layer_touches_one_layer() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 0)
    before = [as_bytes(b).clone() for b in pool.buffers]
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        fill_random(host.buffer, 5)
        idx = torch.arange(8)
        host.load_layer(pool, idx, idx, 1)
        for kv in range(2):
            for layer in range(3):
                same = torch.equal(as_bytes(pool.buffer(kv, layer)), before[kv * 3 + layer])
                assert same == (layer != 1)


def test_index_validation() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        ok = torch.arange(4)
        cases = [
            (ok.to(torch.int32), ok, "dtype"),
            (ok, ok[:3], "has 3"),
            (ok.view(2, 2), ok.view(2, 2), "1-D"),
            (torch.tensor([0, 1, 2, 32]), ok, "slot 32 outside"),
            (torch.tensor([0, -1, 2, 3]), ok, "slot -1"),
            (ok, torch.tensor([0, 1, 2, 32]), "slot 32 outside"),
        ]
        for dev_idx, host_idx, msg in cases:
            with pytest.raises(errors.IndexValidationError, match=msg):
                host.backup(pool, dev_idx, host_idx)
        with pytest.raises(errors.IndexValidationError, match="layer_id"):
            host.load_layer(pool, ok, ok, 3)


def test_layout_mismatch_is_rejected() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    other = model_layout("page_first").model_copy(update={"head_dim": 8})
    with pd.HostKVPool(other, DEV) as host:
        idx = torch.arange(2)
        with pytest.raises(errors.LayoutError, match="head_dim"):
            host.backup(pool, idx, idx)
    with pytest.raises(Exception, match="num_heads must be 1"):
        pd.KVLayout(kind="page_first", attention="mla", num_layers=1, num_pages=1, page_size=1, num_heads=2, head_dim=4)


@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("chunked", [False, True])
def test_copy_engine_path_matches_kernel(kind: str, chunked: bool) -> None:
    dev_layout = model_layout("layer_first", pages=6)
    host_layout = model_layout(kind, pages=10)
    pool = pd.DeviceKVPool(dev_layout, DEV)
    fill_pool(pool, 0)
    max_chunk = host_layout.page_block_bytes() * 3 if chunked else 1 << 40
    # runs of consecutive slots, crossing page boundaries, plus singletons
    dev_slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 20, 21, 22, 23, 17])
    host_slots = torch.tensor([2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 12, 13, 14, 15, 39])
    results = []
    for backend in ("kernel", "copy_engine", "auto"):
        with pd.HostKVPool(host_layout, DEV, max_chunk_bytes=max_chunk) as host:
            fill_random(host.buffer, 5)
            host.backup(pool, dev_slots, host_slots, backend=backend)
            results.append(as_bytes(host.buffer).clone())
            for kv in range(2):
                for layer in range(3):
                    assert torch.equal(as_bytes(items(host.buffer, host_layout, kv, layer, host_slots)),
                                       as_bytes(pool_items(pool, kv, layer, dev_slots)))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_copy_runs_merge_consecutive_slots_within_pages() -> None:
    from pointerdomain.transfer.plan import plan_for

    dev_layout = model_layout("layer_first", pages=6)
    host_layout = model_layout("page_first_direct", pages=10)
    pool = pd.DeviceKVPool(dev_layout, DEV)
    with pd.HostKVPool(host_layout, DEV) as host:
        s = torch.tensor([0, 1, 2, 3, 4, 5, 9])
        d = torch.tensor([4, 5, 6, 7, 8, 9, 20])
        plan = plan_for(pool.table, dev_layout, host.kernel_table, host_layout)
        dsts, srcs, sizes = plan.copy_runs(s, d, 0, 3)
        item = dev_layout.item_bytes
        # per (kv, layer): pages of 4 -> runs [0..3], [4,5], [9]
        assert sizes.tolist() == [4 * item, 2 * item, item] * 6
        assert int(sizes.sum()) == 7 * 6 * item


def test_bad_arguments_get_typed_errors_before_launch() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        fill_random(host.buffer, 4)
        before = [as_bytes(b).clone() for b in pool.buffers]
        idx = torch.arange(4)
        for kwargs in ({"stream": "abc"}, {"stream": -1}, {"stream": 2**64}, {"max_ctas": 0}, {"max_ctas": 2**31},
                       {"max_ctas": 10**30}, {"max_ctas": True}, {"backend": "cuda"}, {"validate_indices": "no"}):
            with pytest.raises(errors.InvalidArgumentError):
                host.load(pool, idx, idx, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidArgumentError, match="KVLayout"):
            pd.transfer_kv_all_layer(host.kernel_table, pool.table, idx, idx, src_layout=None,  # type: ignore[arg-type]
                                     dst_layout=pool.layout)
        assert all(torch.equal(as_bytes(b), w) for b, w in zip(pool.buffers, before))
    with pytest.raises(errors.InvalidArgumentError):
        pd.DeviceKVPool("layer_first", DEV)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError):
        pd.register_host_tensor([1, 2, 3], DEV)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError):
        pd.HostVA(1 << 64)
    import pydantic
    with pytest.raises(pydantic.ValidationError, match="whole number"):
        pd.BufferInfo(address=pd.HostVA(4096), nbytes=10, item_bytes=4)
    with pytest.raises(pydantic.ValidationError):
        pd.BufferInfo(address=4096, nbytes=8, item_bytes=4)  # type: ignore[arg-type]
