"""A cache keyed by address values (``swap_blocks_batch``'s repeated batches) serves a
table only while what it was resolved against holds: the same numbers may name memory
allocated since, whose aliases differ."""

from __future__ import annotations

import gc

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import _raw
from pointerdomain.compat.vllm import swap_blocks_batch

DEV = pd.Device("emulated", 0)


def test_a_resolution_holds_while_its_memory_does() -> None:
    dev = pd.device_empty((4096,), dtype=torch.uint8, device=DEV)
    mem = pd.alloc_registered(4096, DEV)
    dev_table = _raw.addresses_table("src_ptrs", torch.tensor([dev.data_ptr()]), 4096, DEV)
    host_table = _raw.addresses_table("dst_ptrs", torch.tensor([mem.host_va.value]), 4096, DEV)
    assert _raw.resolution_holds(dev_table) and _raw.resolution_holds(host_table)
    mem.close()
    assert not _raw.resolution_holds(host_table)  # its registration closed
    del dev
    gc.collect()
    assert not _raw.resolution_holds(dev_table)  # its device memory freed


def test_a_repeated_batch_over_new_memory_at_the_same_numbers_copies_into_the_new_memory() -> None:
    src = pd.device_empty((2, 256), dtype=torch.uint8, device=DEV)
    src.copy_(torch.randint(0, 256, (2, 256), dtype=torch.uint8))
    with pd.alloc_registered(512, DEV) as first:
        dst = first.tensor[:512].view(2, 256)
        dst.fill_(0)
        ptrs = (torch.tensor([src[0].data_ptr(), src[1].data_ptr()]), torch.tensor([dst[1].data_ptr(), dst[0].data_ptr()]),
                torch.tensor([256, 256]))
        swap_blocks_batch(*ptrs)
        assert torch.equal(dst[1], src[0]) and torch.equal(dst[0], src[1])
    # the same host addresses registered again: a new registration, new aliases
    with pd.register_host_tensor(first.tensor, DEV) as second:
        assert second.host_va == first.host_va
        dst.fill_(0xA5)
        swap_blocks_batch(*ptrs)  # same numbers as the cached batch: resolved again, not refused as closed
        assert torch.equal(dst[1], src[0]) and torch.equal(dst[0], src[1])


def test_a_cached_batch_is_not_reused_once_its_device_memory_is_another_devices() -> None:
    """A checked batch of device memory of emulated:0; that memory is freed and the same
    address handed out by emulated:1: the repeat is refused as the first call would be
    (DeviceMismatchError), nothing copied."""
    import gc

    from pointerdomain.compat import vllm as vl

    d0, d1, block = pd.Device("emulated", 0), pd.Device("emulated", 1), 4096

    def ints(*v: int) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64)

    src = pd.device_empty((block,), torch.uint8, d0)
    src.fill_(3)
    dst = pd.device_empty((block,), torch.uint8, d0)
    at = src.data_ptr()
    vl.swap_blocks_batch(ints(at), ints(dst.data_ptr()), ints(block))  # checked and cached
    del src
    gc.collect()
    other = pd.device_empty((block,), torch.uint8, d1)
    if other.data_ptr() != at:
        pytest.skip("the emulated allocator did not hand the freed address to the other device")
    other.fill_(7)
    dst.fill_(0xA5)
    with pytest.raises(errors.DeviceMismatchError):
        vl.swap_blocks_batch(ints(at), ints(dst.data_ptr()), ints(block))
    assert bool((dst == 0xA5).all())
