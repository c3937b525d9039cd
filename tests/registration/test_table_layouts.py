"""Tables know their layout: a pool table launches only with the layout it was built for
(kind, shape, page count, dtype, exactly), and a table of bare tensors only with a layout
whose entry size equals each tensor's size (not merely fits in it)."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import DEV, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer, same


@pytest.fixture
def pools() -> tuple[pd.DeviceKVPool, pd.HostKVPool]:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 11)
    host = pd.HostKVPool(model_layout("page_first"), DEV)
    fill_random(host.buffer, 12)
    return pool, host


def test_pool_tables_carry_their_layout(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    assert pool.table.layout == pool.layout and host.kernel_table.layout == host.layout
    assert pd.make_kernel_ptr_table(pool.buffers, DEV).layout is None


@pytest.mark.parametrize("change", [{"kind": "page_first_direct"}, {"num_pages": 4}])
def test_launch_with_another_layout_than_the_pool_table_is_refused(
    pools: tuple[pd.DeviceKVPool, pd.HostKVPool], change: dict[str, object]
) -> None:
    """Same byte size, another kind (V would land in K's region) / fewer pages than the buffer."""
    pool, host = pools
    wrong = host.layout.model_copy(update=change)
    before = host.buffer.clone()
    idx = torch.tensor([0, 1])
    with pytest.raises(errors.LayoutError, match="built for") as info:
        pd.transfer_kv_all_layer(pool.table, host.kernel_table, idx, idx, src_layout=pool.layout, dst_layout=wrong)
    assert next(iter(change)) in str(info.value)
    assert same(host.buffer, before)


def test_bare_tensor_tables_need_exact_entry_sizes() -> None:
    layout = model_layout("page_first")
    pool = pd.DeviceKVPool(model_layout(), DEV)
    mem = pd.alloc_registered(2 * layout.nbytes, DEV)
    table = pd.make_kernel_ptr_table([mem.tensor], DEV)  # twice the bytes the layout describes
    idx = torch.tensor([3])
    with pytest.raises(errors.LayoutError, match="describes exactly"):
        pd.transfer_kv_all_layer(pool.table, table, idx, idx, src_layout=pool.layout, dst_layout=layout)
    with pytest.raises(errors.LayoutError, match="describes exactly"):
        pd.make_kernel_ptr_table([mem.tensor], DEV, layout=layout)
    exact = pd.make_kernel_ptr_table([mem.tensor[: layout.nbytes]], DEV, layout=layout)
    fill_pool(pool, 13)
    before = mem.tensor[: layout.nbytes].clone()
    pd.transfer_kv_all_layer(pool.table, exact, idx, idx, src_layout=pool.layout, dst_layout=layout)
    want = reference_transfer(pool_bytes(pool), pool.layout, before, layout, idx, idx)
    assert same(mem.tensor[: layout.nbytes], want)
    mem.close()


def test_matching_layout_equal_but_not_identical_object(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    copy = pd.KVLayout(**host.layout.model_dump())
    idx = torch.tensor([2, 9])
    before = host.buffer.clone()
    pd.transfer_kv_all_layer(pool.table, host.kernel_table, idx, idx, src_layout=pool.layout, dst_layout=copy)
    assert same(host.buffer.reshape(-1).view(torch.uint8),
                reference_transfer(pool_bytes(pool), pool.layout, before, host.layout, idx, idx))
