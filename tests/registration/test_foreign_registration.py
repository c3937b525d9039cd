"""Ownership: ranges another owner registered are used and never unregistered; the
library's own exact ranges are reference-counted (RegisteredHostMemory.acquire)."""

from __future__ import annotations

import ctypes

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.registration import memory
from pointerdomain.testing import DriverFaults, backend_for, install_backend
from tests.reference import DEV, EMU, fill_random

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias

PAGE = 4096


def test_range_pinned_by_another_library_is_used_not_owned() -> None:
    buf = EMU.host_alloc(8 * PAGE)
    fb = DriverFaults(backend_for(DEV))
    with install_backend(fb, "emulated"):
        assert fb.register_foreign(buf.data_ptr(), buf.numel(), DEV) == 0  # "UCX" pinned it first
        with pd.register_host_tensor(buf, DEV) as mem:
            assert mem.rung is pd.Rung.FOREIGN and mem.foreign and mem.owner == "foreign"
            assert fb.register_calls == []  # detected through pointer attributes: no registration call
            assert memory.pinned_bytes() == 0  # not counted as ours
            fill_random(buf, 5)
            alias = pd.resolve_alias(mem.host_va + 64, DEV)
            assert ctypes.string_at(alias.value, 16) == bytes(buf[64:80].tolist())
        assert fb.foreign_unregisters == 0  # closing never unregistered someone else's pin
        status, _ = EMU.alias(buf.data_ptr(), DEV)
        assert status == 0  # still registered for its owner
        assert fb.unregister_foreign(buf.data_ptr()) == 0


def test_712_without_pointer_attributes_of_the_whole_range_is_refused() -> None:
    """Another owner holds part of the range only: 712 on a chunk, the range is not usable
    as a whole, the chunks registered before it are rolled back."""
    buf = EMU.host_alloc(8 * PAGE)
    fb = DriverFaults(backend_for(DEV))
    with install_backend(fb, "emulated"):
        assert fb.register_foreign(buf.data_ptr() + 6 * PAGE, 2 * PAGE, DEV) == 0
        with pytest.raises(errors.AlreadyRegisteredError, match="error 712"):
            pd.register_host_tensor(buf, DEV, max_chunk_bytes=2 * PAGE)
        assert [st for _, _, st in fb.register_calls] == [0, 0, 0, 712]
        assert fb.pinned_bytes() == 0 and fb.foreign_unregisters == 0
        fb.unregister_foreign(buf.data_ptr() + 6 * PAGE)


def test_own_exact_range_is_reference_counted() -> None:
    t = torch.zeros(4 * PAGE, dtype=torch.uint8)
    first = pd.register_host_tensor(t, DEV)
    second = pd.register_host_tensor(t, DEV, shared=True)
    assert second is not first and first.refcount == 2 and second.rung is first.rung
    alias = pd.resolve_alias(first.host_va, DEV)
    first.close()
    assert first.closed and not second.closed
    assert memory.find_registration(second.host_va) is second  # still open through the other handle
    t[:4] = 9
    assert ctypes.string_at(pd.resolve_alias(second.host_va, DEV).value, 4) == b"\t" * 4
    assert pd.resolve_alias(second.host_va, DEV) == alias
    with pytest.raises(errors.ClosedError):
        first.check_open()
    second.close()
    assert memory.find_registration(pd.HostVA(t.data_ptr())) is None
    status, _ = EMU.alias(t.data_ptr(), DEV)
    assert status != 0  # unregistered once the last handle closed


def test_shared_needs_the_exact_range_and_a_bool() -> None:
    t = torch.zeros(4 * PAGE, dtype=torch.uint8)
    with pd.register_host_tensor(t, DEV) as mem:
        with pytest.raises(errors.AlreadyRegisteredError):
            pd.register_host_tensor(t[PAGE:], DEV, shared=True)  # overlapping, not exact
        with pytest.raises(errors.AlreadyRegisteredError):
            pd.register_host_tensor(t, DEV)  # not shared: refused as before
        with pytest.raises(errors.InvalidArgumentError):
            pd.register_host_tensor(t, DEV, shared=1)  # type: ignore[arg-type]
        assert mem.refcount == 1


def test_acquired_handle_collected_while_another_is_open() -> None:
    import gc

    t = torch.zeros(2 * PAGE, dtype=torch.uint8)
    with pd.register_host_tensor(t, DEV) as mem:
        extra = mem.acquire()
        del extra
        gc.collect()
        assert mem.refcount == 1
        assert EMU.alias(t.data_ptr(), DEV)[0] == 0  # still registered
    assert EMU.alias(t.data_ptr(), DEV)[0] != 0
