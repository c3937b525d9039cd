"""The overlap rule (pointerdomain.transfer.overlap): a launch never reads and writes the same
bytes. One memory with one geometry: src and dst slot sets must be disjoint; memory
shared with different geometries: refused. Both launch backends, CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import DEV, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer, same

BACKENDS = ["kernel", "copy_engine"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src,dst", [([0, 1], [1, 0]), ([0, 1, 2], [1, 2, 3]), ([5], [5])])
def test_intersecting_slots_in_one_pool_are_refused(backend: str, src: list[int], dst: list[int]) -> None:
    """A swap, a shift, a self-copy inside one host pool: OverlapError, nothing copied."""
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        fill_random(host.buffer, 21)
        before = host.buffer.clone()
        with pytest.raises(errors.OverlapError, match="both read") as info:
            pd.transfer_kv_all_layer(host.kernel_table, host.kernel_table, torch.tensor(src), torch.tensor(dst),
                                     src_layout=host.layout, dst_layout=host.layout, backend=backend)  # type: ignore[arg-type]
        assert isinstance(info.value, ValueError)
        assert same(host.buffer, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disjoint_slots_in_one_pool_match_the_reference(backend: str) -> None:
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        fill_random(host.buffer, 22)
        before = host.buffer.clone()
        s, d = torch.tensor([0, 1, 2, 3]), torch.tensor([8, 9, 10, 11])
        pd.transfer_kv_all_layer(host.kernel_table, host.kernel_table, s, d, src_layout=host.layout,
                                 dst_layout=host.layout, backend=backend)  # type: ignore[arg-type]
        assert same(host.buffer.reshape(-1).view(torch.uint8),
                    reference_transfer(before, host.layout, before, host.layout, s, d))


def test_two_tables_of_one_device_pool_same_geometry() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 23)
    other = pd.make_kernel_ptr_table(pool.buffers, DEV)  # same memory, same entries
    with pytest.raises(errors.OverlapError):
        pd.transfer_kv_all_layer(pool.table, other, torch.tensor([3, 4]), torch.tensor([4, 5]),
                                 src_layout=pool.layout, dst_layout=pool.layout)
    before = pool_bytes(pool)
    s, d = torch.tensor([3, 4]), torch.tensor([6, 7])
    pd.transfer_kv_all_layer(pool.table, other, s, d, src_layout=pool.layout, dst_layout=pool.layout)
    assert same(pool_bytes(pool), reference_transfer(before, pool.layout, before, pool.layout, s, d))


def test_shared_memory_with_another_geometry_is_refused() -> None:
    """One registered buffer seen as one page_first entry and as per-page-block entries:
    which bytes a slot touches differs per side, so every launch between them is refused."""
    layout = model_layout("page_first")
    with pd.HostKVPool(layout, DEV) as host:
        blocks = pd.make_kernel_ptr_table(layout.page_block_views(host.buffer), DEV)
        whole = host.kernel_table
        before = host.buffer.clone()
        with pytest.raises(errors.OverlapError, match="address it differently"):
            pd.transfer_kv_all_layer(whole, blocks, torch.tensor([0]), torch.tensor([9]),
                                     src_layout=layout, dst_layout=layout)
        assert same(host.buffer, before)


def test_separate_pools_pay_nothing_and_work() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 24)
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        idx = torch.tensor([0, 1])
        host.backup(pool, idx, idx.flip(0))  # same slot numbers on both sides: different memory, fine
        from pointerdomain.transfer.plan import plan_for
        assert not plan_for(pool.table, pool.layout, host.kernel_table, host.layout).same_memory


@pytest.mark.gpu
def test_gpu_overlap_in_one_device_pool() -> None:
    dev = pd.Device("cuda", 0)
    pool = pd.DeviceKVPool(model_layout(), dev)
    fill_pool(pool, 25)
    before = pool_bytes(pool)
    with pytest.raises(errors.OverlapError):
        pd.transfer_kv_all_layer(pool.table, pool.table, torch.tensor([0, 1], device="cuda"),
                                 torch.tensor([1, 0], device="cuda"), src_layout=pool.layout, dst_layout=pool.layout)
    torch.cuda.synchronize()
    assert same(pool_bytes(pool), before)
    s, d = torch.tensor([0, 1], device="cuda"), torch.tensor([5, 6], device="cuda")
    pd.transfer_kv_all_layer(pool.table, pool.table, s, d, src_layout=pool.layout, dst_layout=pool.layout)
    torch.cuda.synchronize()
    assert same(pool_bytes(pool), reference_transfer(before, pool.layout, before, pool.layout, s, d))


def _int64_view(t: torch.Tensor, n: int, offset: int = 0) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)[offset * 8:(offset + n) * 8].view(torch.int64)


@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engine", "staged"])
@pytest.mark.parametrize("which", ["src", "dst"])
def test_indices_stored_in_the_destination_are_refused(backend: str, which: str) -> None:
    """Index tensors carved out of the destination's memory would be overwritten by the
    copy reading them (later pairs then land in the wrong place): OverlapError, nothing
    moves, both directions."""
    pool = pd.DeviceKVPool(model_layout("layer_first"), DEV)
    fill_pool(pool, 5)
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        fill_random(host.buffer, 6)
        # D2H: indices inside the host pool; H2D: inside a device pool buffer (the destinations)
        for run, memory, offset in ((host.backup, host.buffer, 40), (host.load, pool.buffers[-1], 8)):
            inside = _int64_view(memory, 3, offset=offset)
            inside.copy_(torch.tensor([0, 1, 2]))
            before_host, before_dev = host.buffer.clone(), pool_bytes(pool).clone()
            s, d = (inside, torch.tensor([4, 5, 6])) if which == "src" else (torch.tensor([4, 5, 6]), inside)
            with pytest.raises(errors.OverlapError, match="destination table"):
                run(pool, s, d, backend=backend)  # type: ignore[arg-type]
            assert same(host.buffer, before_host) and same(pool_bytes(pool), before_dev)


def test_indices_stored_in_the_source_are_fine() -> None:
    """The copy never writes its source: indices kept there move the reference bytes."""
    pool = pd.DeviceKVPool(model_layout("layer_first"), DEV)
    fill_pool(pool, 7)
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        fill_random(host.buffer, 8)
        src_idx = _int64_view(host.buffer, 3, offset=16)
        src_idx.copy_(torch.tensor([2, 0, 1]))
        d = torch.tensor([7, 3, 5])
        source = host.buffer.clone()
        expected = reference_transfer(source, host.layout, pool_bytes(pool), pool.layout, src_idx.clone(), d)
        host.load(pool, src_idx, d, backend="kernel")
        assert same(pool_bytes(pool), expected)
