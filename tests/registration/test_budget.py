"""The memory budget (pointerdomain.registration.budget): each limit refuses a request
whole, before any runtime call, with a typed error naming it; what fits still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pointerdomain as pd
from pointerdomain import env, errors, ladder
from pointerdomain.registration import budget, memory
from pointerdomain.registration.budget import cgroup_limit
from pointerdomain.testing import NOT_SUPPORTED, DriverFaults, backend_for, install_backend
from tests.childenv import pythonpath
from tests.reference import DEV

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias

MIB = 1 << 20


def faults(**kw: object) -> DriverFaults:
    return DriverFaults(backend_for(pd.as_device(DEV)), **kw)  # type: ignore[arg-type]


def _cgroup_lines() -> list[tuple[str, str]]:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    return [(ctl, rel) for _, ctl, rel in (line.split(":", 2) for line in lines)]


@pytest.fixture
def fake_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cgroup file system the budget reads instead of /sys/fs/cgroup."""
    monkeypatch.setenv(env.CGROUP_ROOT, str(tmp_path))
    yield tmp_path


def _set_v2(root: Path, level: str, limit: str, current: int) -> None:
    where = root / level.strip("/")
    where.mkdir(parents=True, exist_ok=True)
    (where / "memory.max").write_text(limit + "\n")
    (where / "memory.current").write_text(f"{current}\n")


def test_cgroup_v2_limit_refuses_before_any_page(fake_cgroup: Path) -> None:
    if not any(ctl == "" for ctl, _ in _cgroup_lines()):
        pytest.skip("no cgroup v2 line in /proc/self/cgroup")
    rel = next(rel for ctl, rel in _cgroup_lines() if ctl == "")
    _set_v2(fake_cgroup, "/", str(64 * MIB), 60 * MIB)  # the root binds: 4 MiB left
    if rel.strip("/"):
        _set_v2(fake_cgroup, rel, "max", 60 * MIB)  # the process's own level sets none
    found = cgroup_limit()
    assert found is not None and found.version == 2 and found.room == 4 * MIB and found.limit == 64 * MIB
    base = budget.budget_for(DEV).pinned_bytes  # other tests' registrations (quarantined ones stay)
    with install_backend(faults(), "emulated") as fb:
        with pytest.raises(errors.BudgetExceededError) as info:
            pd.alloc_registered(8 * MIB, DEV)
        assert info.value.limit == "cgroup" and info.value.room == 4 * MIB and info.value.nbytes == 8 * MIB
        assert isinstance(info.value, MemoryError) and isinstance(info.value, errors.RegistrationError)
        text = str(info.value)
        assert "'cgroup' limit" in text and "nothing was allocated or registered" in text and str(64 * MIB) in text
        assert "MemAvailable inside a container is the host's" in text
        assert fb.register_calls == [] and budget.budget_for(DEV).pinned_bytes == base
        with pd.alloc_registered(2 * MIB, DEV) as small:  # what fits is allocated and registered
            assert small.nbytes == 2 * MIB and len(fb.register_calls) == 1
    # "max" everywhere: no limit
    _set_v2(fake_cgroup, "/", "max", 60 * MIB)
    assert cgroup_limit() is None or cgroup_limit().version == 1  # type: ignore[union-attr]


def test_cgroup_v1_ancestor_limit(fake_cgroup: Path) -> None:
    lines = [(ctl, rel) for ctl, rel in _cgroup_lines() if "memory" in ctl.split(",")]
    if not lines:
        pytest.skip("no cgroup v1 memory controller line in /proc/self/cgroup")
    rel = lines[0][1]
    parent = (fake_cgroup / "memory" / rel.strip("/")).parent
    parent.mkdir(parents=True, exist_ok=True)
    (parent / "memory.limit_in_bytes").write_text(f"{32 * MIB}\n")
    (parent / "memory.usage_in_bytes").write_text(f"{31 * MIB}\n")
    found = cgroup_limit()
    assert found is not None and found.version == 1 and found.room == MIB and found.path == str(parent)
    with pytest.raises(errors.BudgetExceededError) as info:
        pd.device_empty((2 * MIB,), torch.uint8, DEV)  # emulated device memory is host memory
    assert info.value.limit == "cgroup" and str(info.value).startswith("shape:")


def test_wsl2_wddm_pool() -> None:
    base = budget.budget_for(DEV).pinned_bytes  # other tests' registrations (quarantined ones stay)
    with budget.simulated_host(wsl2=True, mem_total=8 * MIB + 2 * base, pins=True), \
            install_backend(faults(), "emulated") as fb:
        limits = {lim.name: lim for lim in budget.budget_for(DEV).limits}
        assert limits["wddm"].room == 4 * MIB and limits["wddm"].enforced
        with pd.alloc_registered(3 * MIB, DEV) as first:
            assert budget.budget_for(DEV).room("register") == MIB
            calls = len(fb.register_calls)
            with pytest.raises(errors.BudgetExceededError) as info:
                pd.register_host_tensor(torch.empty(2 * MIB, dtype=torch.uint8), DEV)
            assert info.value.limit == "wddm" and info.value.room == MIB and ".wslconfig" in info.value.fix
            assert len(fb.register_calls) == calls and budget.budget_for(DEV).pinned_bytes == base + first.nbytes
            # the ladder may degrade past it when asked to
            with pd.register_host_tensor(torch.empty(2 * MIB, dtype=torch.uint8), DEV,
                                         policy=pd.RegistrationPolicy(on_failure="degrade")) as other:
                assert other.nbytes == 2 * MIB
    assert not any(lim.name == "wddm" for lim in budget.budget_for(DEV).limits)  # not WSL2 here


def test_confidential_computing_refuses_registration_not_pinned_allocation() -> None:
    with budget.simulated_host(confidential_computing=True, pins=True), \
            install_backend(faults(refuse_all=NOT_SUPPORTED), "emulated") as fb:
        with pytest.raises(errors.RegistrationRefusedError) as info:
            pd.register_host_tensor(torch.zeros(4 * 4096, dtype=torch.uint8), DEV)
        assert info.value.limit == "confidential_computing" and "801" in str(info.value)
        assert "pinned_copy" in info.value.fix and fb.register_calls == []
        with pytest.raises(errors.RegistrationRefusedError):
            pd.alloc_registered(4 * 4096, DEV)
        assert fb.register_calls == [] and fb.pinned_calls == 0
        with pytest.warns(ladder.RegistrationDegradedWarning), \
                pd.alloc_registered(4 * 4096, DEV, policy=pd.RegistrationPolicy(on_failure="degrade")) as mem:
            assert mem.rung is pd.Rung.PINNED_COPY  # what the fix says works
            mem.tensor.copy_(torch.arange(4 * 4096, dtype=torch.int64).to(torch.uint8))
            assert torch.equal(mem.tensor, torch.arange(4 * 4096, dtype=torch.int64).to(torch.uint8))


def test_device_cap() -> None:
    assert budget.set_device_cap("emulated:1", 2 * MIB) is None
    try:
        with pd.alloc_registered(MIB, "emulated:1"):
            with pytest.raises(errors.BudgetExceededError) as info:
                pd.alloc_registered(2 * MIB, "emulated:1")
            assert info.value.limit == "device_cap" and info.value.room == MIB
            with pd.alloc_registered(2 * MIB, "emulated:0"):  # another device: its own budget
                pass
        assert budget.device_cap("emulated:1") == 2 * MIB
    finally:
        assert budget.set_device_cap("emulated:1", None) == 2 * MIB
    with pytest.raises(errors.InvalidArgumentError):
        budget.set_device_cap("emulated:0", -1)
    with pytest.raises(errors.InvalidArgumentError):
        budget.simulated_host(wsl=True).__enter__()


_PRLIMIT_CHILD = textwrap.dedent(
    """
    import json, torch
    import pointerdomain as pd
    from pointerdomain import errors
    from pointerdomain.registration import memory
    from pointerdomain.registration.budget import budget_for
    from pointerdomain.testing import backend_for
    out = {"budget": budget_for("emulated:0").as_dict()}
    try:
        pd.register_host_tensor(torch.zeros(128 << 10, dtype=torch.uint8), "emulated:0")
        out["error"] = None
    except errors.PointerDomainError as exc:
        out["error"] = [type(exc).__name__, exc.limit, exc.room, str(exc)]
    out["pinned"] = memory.pinned_bytes() + backend_for(pd.Device("emulated", 0)).pinned_bytes()
    with pd.register_host_tensor(torch.zeros(32 << 10, dtype=torch.uint8), "emulated:0") as ok:
        out["fits"] = ok.nbytes
    print(json.dumps(out))
    """
)


def test_memlock_under_prlimit() -> None:
    environ = dict(os.environ, PYTHONPATH=pythonpath(), POINTERDOMAIN_EMULATE_MEMLOCK="1")
    cmd = ["prlimit", "--memlock=65536:65536", sys.executable, "-c", _PRLIMIT_CHILD]
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    limits = {lim["name"]: lim for lim in out["budget"]["limits"]}
    assert limits["memlock"]["room"] == 65536 and limits["memlock"]["enforced"] is True
    assert out["budget"]["room_register"] == 65536
    cls, limit, room, text = out["error"]
    assert (cls, limit, room) == ("MemlockBudgetError", "memlock", 65536)
    assert "RLIMIT_MEMLOCK is 65536 bytes and 131072 would be pinned" in text and "Kubernetes" in text
    assert out["pinned"] == 0 and out["fits"] == 32 << 10


@pytest.mark.slow
def test_doctor_json_reports_the_budget() -> None:
    environ = dict(os.environ, PYTHONPATH=pythonpath(), POINTERDOMAIN_EMULATE_MEMLOCK="1")
    cmd = ["prlimit", "--memlock=1048576:1048576", sys.executable, "-m", "pointerdomain", "doctor", "--json",
           "--device", "emulated:0"]
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    got = report["devices"][0]["budget"]
    limits = {lim["name"]: lim for lim in got["limits"]}
    assert limits["memlock"]["room"] == 1 << 20 and got["room_register"] == 1 << 20
    assert limits["memavailable"]["applies"] == "allocate"
