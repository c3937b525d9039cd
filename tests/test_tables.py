"""Pointer tables (pointerdomain.registration.tables): what a kernel table and a host table accept."""

from __future__ import annotations

import gc

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.registration.allocation import memory_device
from tests.reference import DEV, as_bytes, fill_random, items, pool_items, model_layout


def test_kernel_table_of_registered_and_device_memory() -> None:
    dev_buf = pd.device_empty((4, 8), torch.float32, DEV)
    assert memory_device(dev_buf) == DEV
    with pd.alloc_registered(4096, DEV) as mem:
        table = pd.make_kernel_ptr_table([mem.tensor, dev_buf], DEV)
        assert table.domain is pd.DeviceAlias and table.device == DEV and len(table) == 2
        assert table[0] == pd.resolve_alias(mem.host_va, DEV)
        assert table[1] == pd.DeviceAlias(dev_buf.data_ptr(), DEV)
        assert table.sizes == (4096, 128)
        backing = table.as_uint64_tensor()
        assert backing.dtype == torch.uint64 and backing.tolist() == [table[0].value, table[1].value]
        assert pd.memory_device_at(table.kernel_table_address(), 16) == DEV  # the table's own array is device memory
        backing.zero_()  # a copy: the table is unchanged
        assert table.as_uint64_tensor().tolist() == [table[0].value, table[1].value]


def test_kernel_table_rejects_unregistered_host_memory_and_other_devices() -> None:
    with pytest.raises(errors.DomainError, match="unregistered host memory"):
        pd.make_kernel_ptr_table([torch.zeros(16)], DEV)
    other = pd.device_empty((16,), torch.float32, "emulated:1")
    with pytest.raises(errors.DeviceMismatchError):
        pd.make_kernel_ptr_table([other], DEV)


def test_host_table_rejects_device_memory() -> None:
    with pytest.raises(errors.DomainError, match="device addresses must"):
        pd.host_ptr_table([pd.device_empty((16,), torch.float32, DEV)])
    with pytest.raises(errors.DomainError):
        pd.host_ptr_table([torch.zeros(4, device="meta")])
    t = torch.zeros(16)
    table = pd.host_ptr_table([t])
    assert table.domain is pd.HostVA and table.device is None and table[0] == pd.HostVA(t.data_ptr())


def test_strided_buffer_is_rejected() -> None:
    # a [2, 7286, 64, 8, 128] strided buffer corrupted a real cache; same shape of bug, smaller
    base = torch.zeros(2, 64, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(errors.NonContiguousError, match="strides"):
        pd.host_ptr_table([base.transpose(0, 1)])


def test_table_keeps_memory_alive() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    host_layout = model_layout("page_first")
    mem = pd.alloc_registered(host_layout.nbytes, DEV)
    fill_random(mem.tensor, 3)
    expected = mem.tensor.clone()
    table = pd.make_kernel_ptr_table([mem.tensor], DEV)
    del mem
    gc.collect()
    slots = torch.arange(host_layout.num_slots)
    pd.transfer_kv_all_layer(table, pool.table, slots, slots, src_layout=host_layout, dst_layout=pool.layout)
    ref = expected.view(torch.bfloat16).view(host_layout.buffer_shape)
    for kv in range(2):
        for layer in range(3):
            assert torch.equal(as_bytes(pool_items(pool, kv, layer, slots)), as_bytes(items(ref, host_layout, kv, layer, slots)))
