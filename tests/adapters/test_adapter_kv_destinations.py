"""The sglang adapter with a device pool whose K and V lists name the same buffers: a load
into it would write K and V of one slot to the same bytes, in no defined order, so it is
refused (OverlapError, rule 0 of pointerdomain.transfer.overlap) before anything is written;
as a source the same pool is fine (reads only)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pointerdomain import errors
from pointerdomain.adapters import sglang
from tests.adapters.test_adapter_sglang_split import (
    DEV,
    POISON,
    HostPool,
    MHADevicePool,
    bits,
    hosts,
    new_host,
    random_,
)

__all__ = ["hosts"]  # the fixture, used by name


def test_load_into_k_and_v_lists_over_one_buffer_is_refused(hosts: list[HostPool]) -> None:
    host = new_host(hosts, "page_first", False)
    random_(host.kv_buffer, 5)
    cache = sglang.HostKVCacheAdapter.from_sglang(host, DEV)
    pool = MHADevicePool(seed=None)
    pool.v_buffer = list(pool.k_buffer)  # V written through K's buffers
    slots = torch.arange(0, 4)
    loads: list[Callable[[], None]] = [
        lambda: cache.load_to_device_all_layer(pool, slots, slots),
        lambda: cache.load_to_device_per_layer(pool, slots, slots, 1),
        lambda: cache.load_to_device_all_layer(
            sglang.DeviceKVBuffers.mha(pool.k_buffer, pool.v_buffer, DEV, page_size=4), slots, slots),
    ]
    for load in loads:
        with pytest.raises(errors.OverlapError, match=r"\(K, layer \d\) and entry \d+ \(V, layer \d\)"):
            load()
    assert all(bool((bits(t) == POISON).all()) for t in pool.k_buffer)


def test_backup_from_k_and_v_lists_over_one_buffer_reads_both(hosts: list[HostPool]) -> None:
    host = new_host(hosts, "layer_first", False)
    cache = sglang.HostKVCacheAdapter.from_sglang(host, DEV)
    pool = MHADevicePool(seed=9)
    pool.v_buffer = list(pool.k_buffer)
    slots = torch.arange(4, 8)
    cache.backup_from_device_all_layer(pool, slots, slots)
    for layer in range(len(pool.k_buffer)):
        want = bits(pool.k_buffer[layer][slots])
        assert torch.equal(bits(host.kv_buffer[0, layer, slots]), want)
        assert torch.equal(bits(host.kv_buffer[1, layer, slots]), want)
