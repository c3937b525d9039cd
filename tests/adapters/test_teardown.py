"""Ordered teardown (pointerdomain.registration.teardown): engines' deregistration, then the
runtime's unregister; a failed step quarantines the memory (recorder engines, fault injection)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import mooncake, nixl
from pointerdomain.registration import memory, teardown
from pointerdomain.testing import DelegatingBackend, FaultyBackend, backend_for, install_backend
from pointerdomain.tools import doctor
from tests.reference import DEV, model_layout

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias

PAGE = 4096


class Recording(DelegatingBackend):
    """The emulated backend, logging each unregister into a shared log."""

    def __init__(self, inner: Any, log: list[str]) -> None:
        super().__init__(inner, "recording")
        self.log = log
        self.vas: list[int] = []

    def unregister(self, va: int, device: pd.Device) -> int:
        self.log.append("runtime.unregister")
        self.vas.append(va)
        return self.inner.unregister(va, device)


class Agent:
    """A NIXL stand-in logging into the shared log; ``fail`` makes deregistration raise."""

    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.log.append(f"nixl.{name}")
            if name == "deregister_memory" and self.fail:
                raise RuntimeError("NIXL: memory still in use by a transfer")
            return ("handle", 1) if name == "register_memory" else None

        return call


class Engine:
    """A Mooncake stand-in; ``unregister_rc`` is what unregister_memory returns."""

    def __init__(self, log: list[str], unregister_rc: int = 0) -> None:
        self.log, self.unregister_rc = log, unregister_rc

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.log.append(f"mooncake.{name}")
            return self.unregister_rc if name == "unregister_memory" else 0

        return call


def _emulated() -> Any:
    return backend_for(pd.as_device(DEV))


def _assert_quarantined(pool: pd.HostKVPool, stage: str, pattern: bytes) -> None:
    va, n = pool.memory.host_va, pool.memory.nbytes
    found = teardown.find_quarantine(va.value, n)
    assert found is not None and found.stage == stage and found.nbytes == n
    assert pool.memory.closed and pd.find_registration(va) is None
    assert bytes(pool.memory.tensor[:len(pattern)].tolist()) == pattern  # still mapped, bytes intact
    with pytest.raises(errors.QuarantinedError) as info:  # never registered again
        pd.register_host_tensor(pool.memory.tensor, DEV)
    assert info.value.stage == stage and info.value.owner == found.owner
    report = doctor.collect([])
    assert any(q["host_va"] == hex(va.value) and q["stage"] == stage for q in report["quarantined"])
    assert any("QUARANTINED" in note for note in pd.explain(va.value + 8).notes)


def test_nixl_then_runtime_in_that_order() -> None:
    log: list[str] = []
    with install_backend(Recording(_emulated(), log), "emulated"):
        pool = pd.HostKVPool(model_layout("page_first"), DEV)
        agent = nixl.HostNixlAgent("a", agent=Agent(log))
        agent.register_pool(pool)
        pool.close()
    assert log == ["nixl.register_memory", "nixl.deregister_memory", "runtime.unregister"]
    assert teardown.find_quarantine(pool.memory.host_va.value, pool.memory.nbytes) is None


def test_failed_nixl_deregistration_quarantines_before_the_runtime() -> None:
    log: list[str] = []
    with install_backend(Recording(_emulated(), log), "emulated") as rec:
        pool = pd.HostKVPool(model_layout("page_first"), DEV)
        va = pool.memory.host_va.value
        pattern = bytes(range(7, 71))
        pool.memory.tensor[:64].copy_(torch.tensor(list(pattern), dtype=torch.uint8))
        agent = nixl.HostNixlAgent("a", agent=Agent(log, fail=True))  # kept: a collected agent has let go
        agent.register_pool(pool)
        pinned = memory.pinned_bytes()
        with pytest.raises(errors.QuarantinedError) as info:
            pool.close()
        assert info.value.stage == "engine" and "memory still in use" in str(info.value)
        assert isinstance(info.value.__cause__, errors.QuarantinedError)  # the adapter's, from NIXL's error
        assert isinstance(info.value.__cause__.__cause__, errors.RuntimeCallError)
        assert len([q for q in teardown.quarantined() if q.host_va == pool.memory.host_va]) == 1  # once
        assert "runtime.unregister" not in log  # the runtime's unregister never ran
        n = pool.memory.nbytes
        held = teardown.find_quarantine(pool.memory.host_va.value, n)
        assert held is not None and held.pinned == n  # still pinned: the quarantine's, counted by the budget
        assert memory.pinned_bytes() == pinned - n and teardown.quarantined_pinned() >= n
        _assert_quarantined(pool, "engine", pattern)
        idx = torch.arange(4, dtype=torch.int64)
        with pytest.raises(errors.ClosedError):
            pool.load(pd.DeviceKVPool(model_layout("layer_first"), DEV), idx, idx)
        del pool
        gc.collect()
        assert va not in rec.vas  # nor when the pool is collected


def test_mooncake_pool_order_and_failed_unregister() -> None:
    log: list[str] = []
    with install_backend(Recording(_emulated(), log), "emulated"):
        pool = pd.HostKVPool(model_layout("page_first"), DEV)
        mooncake.HostTransferEngine(Engine(log), "127.0.0.1").register_pool(pool)  # type: ignore[arg-type]
        pool.close()
        assert log == ["mooncake.register_memory", "mooncake.unregister_memory", "runtime.unregister"]
        log.clear()
        bad = pd.HostKVPool(model_layout("page_first"), DEV)
        engine = mooncake.HostTransferEngine(Engine(log, unregister_rc=-1), "127.0.0.1")  # type: ignore[arg-type]
        engine.register_pool(bad)
        with pytest.raises(errors.QuarantinedError):
            bad.close()
        assert "runtime.unregister" not in log
        _assert_quarantined(bad, "engine", bytes(bad.memory.tensor[:8].tolist()))


def test_mooncake_close_quarantines_what_the_engine_keeps() -> None:
    log: list[str] = []
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    engine = mooncake.HostTransferEngine(Engine(log, unregister_rc=5), "127.0.0.1")  # type: ignore[arg-type]
    engine.register_pool(pool)
    with pytest.raises(errors.QuarantinedError) as info:
        engine.close()
    assert "returned 5" in str(info.value) and info.value.owner.startswith("RegisteredHostMemory(")
    _assert_quarantined(pool, "engine", bytes(pool.memory.tensor[:8].tolist()))
    pool.close()  # closed already: nothing more happens


def test_failed_runtime_unregister_quarantines() -> None:
    with install_backend(FaultyBackend(_emulated(), fail={"unregister": {1: 999}}), "emulated") as fb:
        mem = pd.alloc_registered(4 * PAGE, DEV)
        mem.tensor.fill_(0x5A)
        before = memory.pinned_bytes()
        mem.close()  # the runtime refused: nothing raised to the closer, the range is quarantined
        found = teardown.find_quarantine(mem.host_va.value, mem.nbytes)
        assert found is not None and found.stage == "runtime" and "error 999" in found.reason
        assert memory.pinned_bytes() == before - 4 * PAGE and found.pinned == 4 * PAGE  # still pinned
        assert fb.calls["unregister"] == 1
        with pytest.raises(errors.QuarantinedError):
            pd.register_host_tensor(mem.tensor[:PAGE], DEV)
        assert bool((mem.tensor == 0x5A).all())


def test_nixl_agent_close_quarantines_what_nixl_keeps() -> None:
    log: list[str] = []
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    agent = nixl.HostNixlAgent("a", agent=Agent(log, fail=True))
    agent.register_pool(pool)
    with pytest.raises(errors.QuarantinedError) as info:
        agent.close()  # the agent goes first, the pool is still open
    assert info.value.stage == "engine" and "memory still in use" in str(info.value)
    _assert_quarantined(pool, "engine", bytes(pool.memory.tensor[:8].tolist()))
    pool.close()  # closed already: the hook does not run twice, nothing raises
