"""A destination slot given twice where the indices are not read on the host before the
launch (graph replays; CUDA with validate_indices=True): the launch's validation pass,
ahead of the copy on the device, finds it, the copy writes nothing, and check_errors
raises OverlapError (pointerdomain.transfer.launch_errors).

CPU: the emulated device's stand-in graph replays launches as a CUDA graph does (no host
check), through the same rule (src/kernels/transfer_cpu.cpp); the CUDA tests are in
test_duplicates_gpu.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import EmulatedGraph
from pointerdomain.transfer import launch_errors
from tests.reference import DEV, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer, same

LAYOUT = model_layout("layer_first", pages=4)


@pytest.fixture
def pools() -> Iterator[tuple[pd.DeviceKVPool, pd.HostKVPool]]:
    pd.check_errors(DEV)
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 61)
    with pd.HostKVPool(LAYOUT.replace(kind="page_first", num_pages=8), DEV) as host:
        fill_random(host.buffer, 62)
        yield pool, host
    pd.check_errors(DEV)


@pytest.mark.parametrize("direction", ["backup", "load"])
def test_replay_with_a_duplicate_destination_copies_nothing(
    pools: tuple[pd.DeviceKVPool, pd.HostKVPool], direction: str
) -> None:
    pool, host = pools
    src = torch.tensor([0, 1, 2, 3])
    dst = torch.tensor([4, 5, 6, 7])
    graph = EmulatedGraph("copy step")
    with graph.capture(DEV):
        getattr(host, direction)(pool, src, dst)
    dst.copy_(torch.tensor([9, 5, 11, 9]))  # slot 9 twice: written by two pairs
    before_pool, before_host = pool_bytes(pool), host.buffer.clone()
    graph.replay()
    assert same(pool_bytes(pool), before_pool) and same(host.buffer, before_host)  # not one byte
    with pytest.raises(errors.OverlapError, match="destination slot twice") as info:
        pd.check_errors(DEV)
    assert isinstance(info.value, ValueError)
    pd.check_errors(DEV)  # cleared
    dst.copy_(torch.tensor([9, 5, 11, 10]))  # distinct again: the same graph copies
    graph.replay()
    pd.check_errors(DEV)
    if direction == "backup":
        want = reference_transfer(before_pool, pool.layout, before_host, host.layout, src, dst)
        assert same(host.buffer.reshape(-1).view(torch.uint8), want)
    else:
        want = reference_transfer(before_host, host.layout, before_pool, pool.layout, src, dst)
        assert same(pool_bytes(pool), want)
    graph.reset()


def test_duplicate_and_out_of_range_in_one_replay(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    """The duplicate is found first: nothing copied, OverlapError (the other pairs included)."""
    pool, host = pools
    src = torch.tensor([0, 1, 2])
    dst = torch.tensor([1, 2, 3])
    graph = EmulatedGraph("mixed")
    with graph.capture(DEV):
        host.backup(pool, src, dst)
    dst.copy_(torch.tensor([3, 1 << 40, 3]))
    before = host.buffer.clone()
    graph.replay()
    assert same(host.buffer, before)
    with pytest.raises(errors.OverlapError):
        pd.check_errors(DEV)
    graph.reset()


def test_out_of_range_alone_still_reports_index_errors(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    src = torch.tensor([0, 1])
    dst = torch.tensor([1, 2])
    graph = EmulatedGraph("range")
    with graph.capture(DEV):
        host.backup(pool, src, dst)
    dst.copy_(torch.tensor([-1, 2]))
    before = host.buffer.clone()
    graph.replay()
    with pytest.raises(errors.IndexValidationError):
        pd.check_errors(DEV)
    want = reference_transfer(pool_bytes(pool), pool.layout, before, host.layout, torch.tensor([1]), torch.tensor([2]))
    assert same(host.buffer.reshape(-1).view(torch.uint8), want)
    graph.reset()


def test_layouts_that_split_items_check_the_parts(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    """page_head: the launch runs over per-head parts; a repeated slot repeats every part.
    (The stand-in graph keeps the parts computed at capture, so the duplicate is captured.)"""
    pool, _host = pools
    with pd.HostKVPool(LAYOUT.replace(kind="page_head", num_pages=8), DEV) as host:
        fill_random(host.buffer, 63)
        src = torch.tensor([0, 1])
        dst = torch.tensor([5, 5])
        graph = EmulatedGraph("heads")
        before = host.buffer.clone()
        with graph.capture(DEV):  # no host check while capturing
            host.backup(pool, src, dst)
        try:
            graph.replay()
            assert same(host.buffer, before)
            with pytest.raises(errors.OverlapError):
                pd.check_errors(DEV)
        finally:
            graph.reset()


def test_error_word_bits() -> None:
    """The two report bits of the word as the kernels set them (transfer.h)."""
    assert (launch_errors.OUT_OF_RANGE, launch_errors.DUPLICATE) == (1, 2)
