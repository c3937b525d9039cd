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


def test_a_second_close_waits_for_the_first_and_the_runtime_goes_last() -> None:
    """Two threads close one pool: the second waits for the first's hooks (an engine's
    deregistration) and unregister; the runtime registration is never undone while a hook
    runs, and a hook that fails quarantines memory that is still registered."""
    import threading
    import time

    from pointerdomain.testing import backend_for

    emulated = backend_for(pd.validate_device(DEV))
    base = emulated.pinned_bytes()
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    registered_in_hook: list[bool] = []
    in_hook = threading.Event()

    def engine_deregistration() -> None:
        in_hook.set()
        time.sleep(0.3)
        registered_in_hook.append(emulated.pinned_bytes() > base)
        raise RuntimeError("the engine kept the memory")

    pool.add_close_hook(engine_deregistration)
    first: list[BaseException] = []

    def closer() -> None:
        try:
            pool.close()
        except BaseException as exc:  # checked below
            first.append(exc)

    thread = threading.Thread(target=closer)
    thread.start()
    assert in_hook.wait(10)
    pool.close()  # the second closer
    assert not thread.is_alive()  # it returned only once the first close was done
    thread.join()
    assert registered_in_hook == [True]
    assert len(first) == 1 and isinstance(first[0], errors.QuarantinedError)
    held = teardown.find_quarantine(pool.memory.host_va.value, pool.memory.nbytes)
    assert held is not None and held.pinned == pool.memory.nbytes
    assert emulated.pinned_bytes() - base == pool.memory.nbytes  # still registered, as the quarantine says


@pytest.mark.parametrize("how", ["close", "with"])
def test_closing_the_pools_memory_runs_the_pools_hooks_first(how: str) -> None:
    """``pool.memory.close()`` (or ``with pool.memory:``) closes the pool: its hooks run
    before the runtime's unregister, once."""
    from pointerdomain.testing import backend_for

    emulated = backend_for(pd.validate_device(DEV))
    base = emulated.pinned_bytes()
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    seen: list[bool] = []
    pool.add_close_hook(lambda: seen.append(emulated.pinned_bytes() > base))
    if how == "close":
        pool.memory.close()
    else:
        with pool.memory:
            pass
    assert seen == [True] and pool.memory.closed and emulated.pinned_bytes() == base
    pool.close()
    assert seen == [True]


def test_explain_names_a_quarantined_pool_by_its_host_va_and_its_alias() -> None:
    """A quarantined pool stays registered and mapped: explain() says so by either
    address (the host VA, or the alias a GPU fault report carries), with the alias."""
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    alias = int(pool.kernel_table.as_uint64_tensor()[0])

    def failing() -> None:
        raise RuntimeError("the engine kept the memory")

    pool.add_close_hook(failing)
    with pytest.raises(errors.QuarantinedError):
        pool.close()
    by_va = pd.explain(pool.memory.host_va + 100)
    assert (by_va.domain, by_va.state, by_va.other_domain_address) == ("host_va", "quarantined", alias + 100)
    assert any(n.startswith("QUARANTINED") for n in by_va.notes)
    assert not any("has no alias" in n for n in by_va.notes)
    by_alias = pd.explain(alias + 100)
    assert (by_alias.domain, by_alias.state) == ("device_alias", "quarantined")
    assert by_alias.other_domain_address == pool.memory.host_va.value + 100
    assert any(n.startswith("QUARANTINED") for n in by_alias.notes)


def test_a_hook_that_closes_the_pool_leaves_the_unregister_to_the_close_running_it() -> None:
    """A hook calling pool.close() or pool.memory.close() returns at once: the hooks after
    it still run while the memory is registered, and the runtime goes last."""
    from pointerdomain.testing import backend_for

    emulated = backend_for(pd.validate_device(DEV))
    base = emulated.pinned_bytes()
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    seen: list[tuple[str, bool]] = []
    pool.add_close_hook(lambda: seen.append(("engine", emulated.pinned_bytes() > base)))  # runs last
    pool.add_close_hook(lambda: (pool.memory.close(), seen.append(("closer", emulated.pinned_bytes() > base))))
    pool.add_close_hook(lambda: (pool.close(), seen.append(("closer2", emulated.pinned_bytes() > base))))
    pool.close()
    assert seen == [("closer2", True), ("closer", True), ("engine", True)]
    assert pool.memory.closed and emulated.pinned_bytes() == base


def test_an_interrupted_hook_quarantines_the_memory() -> None:
    """A hook interrupted (KeyboardInterrupt): the hooks after it never ran, so an engine may
    still reach the memory: quarantined, not unregistered, and the interrupt propagates."""
    from pointerdomain.testing import backend_for

    emulated = backend_for(pd.validate_device(DEV))
    base = emulated.pinned_bytes()
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    ran: list[str] = []
    pool.add_close_hook(lambda: ran.append("engine A"))  # added first: runs last, never here

    def interrupted() -> None:
        raise KeyboardInterrupt

    pool.add_close_hook(interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert ran == [] and pool.memory.closed
    held = teardown.find_quarantine(pool.memory.host_va.value, pool.memory.nbytes)
    assert held is not None and "interrupted" in held.reason
    assert emulated.pinned_bytes() - base == pool.memory.nbytes  # still registered


def test_a_mooncake_pool_collected_without_close_lets_the_engine_go_first() -> None:
    """register_pool, then the pool object goes (its memory kept by the caller) and the
    memory is closed: the engine's unregister ran when the pool went, before the runtime's."""
    import gc

    from pointerdomain.adapters.mooncake import HostTransferEngine

    calls: list[str] = []

    class Engine:
        def register_memory(self, addr: int, length: int) -> int:
            calls.append("engine.register")
            return 0

        def unregister_memory(self, addr: int) -> int:
            calls.append("engine.unregister")
            return 0

    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    HostTransferEngine(Engine(), "127.0.0.1").register_pool(pool)  # type: ignore[arg-type]
    memory = pool.memory
    del pool
    gc.collect()
    assert calls == ["engine.register", "engine.unregister"]
    memory.close()
    assert memory.closed and calls == ["engine.register", "engine.unregister"]
