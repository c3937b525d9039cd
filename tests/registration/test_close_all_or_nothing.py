"""Closing a host pool is all or nothing: every hook runs once; when one raises (an engine
kept the memory) the pool closes and its memory is quarantined, not unregistered; hooks are
refused once the pool is closed."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.registration import teardown
from tests.reference import DEV, model_layout


def test_a_raising_hook_neither_half_closes_nor_drops_the_others() -> None:
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    device = pd.DeviceKVPool(model_layout("layer_first"), DEV)
    ran: list[str] = []

    def first() -> None:
        ran.append("first")

    def failing() -> None:
        ran.append("failing")
        raise RuntimeError("engine deregistration failed")

    def last() -> None:
        ran.append("last")

    for hook in (first, failing, last):
        pool.add_close_hook(hook)
    va = pool.memory.host_va
    with pytest.raises(errors.QuarantinedError, match="engine deregistration failed") as info:
        pool.close()
    assert ran == ["last", "failing", "first"]
    assert any("every hook ran" in note for note in info.value.__notes__)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value.__cause__, RuntimeError)
    assert pool.memory.closed and pd.find_registration(va) is None
    held = teardown.find_quarantine(va.value, pool.memory.nbytes)
    assert held is not None and held.stage == "engine" and info.value.owner == held.owner
    idx = torch.arange(4, dtype=torch.int64)
    with pytest.raises(errors.ClosedError):
        pool.load(device, idx, idx)
    pool.close()  # a second close: nothing left to do, no hook runs again
    assert ran == ["last", "failing", "first"]


def test_hooks_refused_after_close_or_when_not_callable() -> None:
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    with pytest.raises(errors.InvalidTypeError, match="hook"):
        pool.add_close_hook("close")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidTypeError, match="hook"):
        pool.add_close_hook(None)  # type: ignore[arg-type]
    pool.close()
    with pytest.raises(errors.ClosedError):
        pool.add_close_hook(lambda: None)


def test_closed_pool_hands_out_no_metadata() -> None:
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    pool.close()
    with pytest.raises(errors.ClosedError):
        pool.get_contiguous_buf_infos()
    with pytest.raises(errors.ClosedError):
        pool.get_page_buffer_meta([0])
    with pytest.raises(errors.ClosedError):
        pd.buffer_infos(pool.host_table, 64)
