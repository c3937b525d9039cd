"""Storage liveness: a table whose entry storage was released or reallocated under it
(``untyped_storage().resize_()``) is refused at every launch, checked mode or not."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import checked, errors
from tests.reference import DEV, fill_random, model_layout, same


@pytest.mark.parametrize("checked_on", [False, True])
@pytest.mark.parametrize("how", ["released", "reallocated", "same size, moved", "smaller"])
def test_registered_tensor_storage_released_under_a_table(checked_on: bool, how: str) -> None:
    layout = model_layout("page_first")
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    pool = pd.DeviceKVPool(model_layout(), DEV)
    for b in pool.buffers:
        fill_random(b, 3)
    with pd.register_host_tensor(buf, DEV):
        table = pd.make_kernel_ptr_table([buf], DEV)
        idx = torch.tensor([1, 2])
        pd.transfer_kv_all_layer(pool.table, table, idx, idx, src_layout=pool.layout, dst_layout=layout)
        storage = buf.untyped_storage()
        old = storage.data_ptr()
        if how == "released":
            storage.resize_(0)
        elif how == "reallocated":
            storage.resize_(2 * layout.nbytes)
        elif how == "same size, moved":  # freed, then the old size again elsewhere (the old block taken)
            # the allocator may hand the old block back whatever holds memory meanwhile: retry,
            # each time keeping one more block taken, until the storage lands elsewhere
            blockers = []
            for _ in range(16):
                storage.resize_(0)
                blockers.append(torch.zeros(layout.nbytes, dtype=torch.uint8))
                storage.resize_(layout.nbytes)
                if storage.data_ptr() != old:
                    break
            assert storage.data_ptr() != old and storage.nbytes() == layout.nbytes, "precondition: moved"
            del blockers
        else:  # freed, then a smaller block (maybe at the old address)
            storage.resize_(0)
            storage.resize_(layout.nbytes // 2)
        with checked.checked_mode(checked_on):
            with pytest.raises(errors.ClosedError, match="storage of an entry changed") as info:
                pd.transfer_kv_all_layer(pool.table, table, idx, idx, src_layout=pool.layout, dst_layout=layout)
        assert isinstance(info.value, ValueError)
        assert "rebuild the table" in str(info.value)


def test_storage_check_passes_for_live_tables() -> None:
    layout = model_layout("page_first")
    pool = pd.DeviceKVPool(model_layout(), DEV)
    for b in pool.buffers:
        fill_random(b, 5)
    with pd.HostKVPool(layout, DEV) as host:
        idx = torch.tensor([0, 7, 31])
        host.backup(pool, idx, idx)
        for kv in range(2):
            for layer in range(3):
                got = host.buffer[kv][idx][:, layer]
                assert same(got, pool.buffer(kv, layer)[idx])


@pytest.mark.gpu
def test_gpu_released_device_memory_under_a_live_table() -> None:
    """CUDA: a device pool buffer released (storage resized to 0, back to torch's caching
    allocator) under its live table: the next launch is a ClosedError and the host pool is
    unchanged."""
    dev = pd.Device("cuda", 0)
    pool = pd.DeviceKVPool(model_layout(), dev)
    with pd.HostKVPool(model_layout("page_first"), dev) as host:
        fill_random(host.buffer, 9)
        before = host.buffer.clone()
        pool.buffers[3].untyped_storage().resize_(0)
        idx = torch.tensor([0, 1], device="cuda")
        with pytest.raises(errors.ClosedError, match="storage of an entry changed"):
            host.backup(pool, idx, idx)
        with pytest.raises(errors.ClosedError):
            host.load(pool, idx, idx)
        torch.cuda.synchronize()
        assert same(host.buffer, before)
