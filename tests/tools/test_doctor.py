"""`pointerdomain doctor`: the matrix rows against what the platform says, and its failure paths."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from pointerdomain.tools import doctor
from pointerdomain.testing import DeviceAttributeName, FaultyBackend, backend_for, install_backend
from pointerdomain.devices import Device

EMU = Device("emulated", 0)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pointerdomain", *args], capture_output=True, text=True, timeout=300)


def test_doctor_json_matrix_on_the_emulated_device() -> None:
    out = _cli("doctor", "--json", "--device", "emulated:0")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True
    (dev,) = report["devices"]
    assert dev["attributes"] == {name: backend_for(EMU).device_attribute(name, EMU) for name in doctor.MATRIX}
    assert dev["attributes"]["CanUseHostPointerForRegisteredMem"] == 0
    assert dev["self_test"]["ok"] is True and dev["self_test"]["alias_equals_va"] is False
    ladder = {row["name"]: row["value"] for row in dev["ladder"]}
    assert ladder["rung: single"] == "works" and ladder["rung: chunked"] == "works"
    assert ladder["alias check: single"] == "works" and ladder["alias check: chunked"] == "works"
    assert {"rung: pinned_copy", "rung: unpinned"} <= set(ladder)
    host = {row["name"]: row["value"] for row in report["host"]}
    with open("/proc/version") as f:
        assert host["WSL2"] == ("microsoft" in f.read().lower())
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert host["ulimit -l (RLIMIT_MEMLOCK bytes, soft/hard)"] == [
        None if v == resource.RLIM_INFINITY else v for v in (soft, hard)]
    assert "Confidential Computing" in host
    engines = {row["name"] for row in report["transfer_engines"]}
    assert engines == {"mooncake", "nixl"}
    versions = {row["name"]: row["value"] for row in report["versions"]}
    import pointerdomain
    import torch

    assert versions["pointerdomain"] == pointerdomain.__version__ and versions["torch"] == torch.__version__


@pytest.mark.slow
def test_doctor_text_has_every_row_and_default_devices() -> None:
    out = _cli("doctor")
    assert out.returncode == 0, out.stderr
    for needle in (*doctor.MATRIX, "WSL2", "Confidential Computing", "ulimit -l", "NUMA node", "strict alias mode",
                   "rung: single", "alias check: chunked", "self-test", "mooncake", "nixl", "torch", "all self-tests passed"):
        assert needle in out.stdout, needle
    assert _cli("doctor", "--device", "cuda:7").returncode == 2
    assert _cli("doctor", "--device", "cpu").returncode == 2


def test_ladder_rung_failure_is_reported_not_raised() -> None:
    inner = backend_for(EMU)
    with install_backend(FaultyBackend(inner, fail={"register": {1: 2}}), "emulated"):
        rows = {r.name: r for r in doctor.ladder_rows(EMU)}
    assert rows["rung: single"].value == "FAILS" and rows["rung: single"].detail
    assert rows["rung: chunked"].value == "works" and rows["alias check: single"].value == "works"


class _PciBackend(FaultyBackend):
    """The emulated backend answering PCI attributes like a GPU at 0000:1b:00.0."""

    def device_attribute(self, name: DeviceAttributeName, device: Device) -> int | None:
        return {"PciDomainId": 0, "PciBusId": 0x1B, "PciDeviceId": 0, "PageableMemoryAccess": 1}.get(name)


def test_pci_bus_id_numa_path_and_strict_prediction() -> None:
    fake = _PciBackend(backend_for(EMU), fail={})
    cuda = Device("cuda", 0)
    with install_backend(fake, "cuda"):
        assert doctor.pci_bus_id(cuda) == "0000:1b:00.0"
        node = doctor.gpu_numa_node(cuda)
    assert "/sys/bus/pci/devices/0000:1b:00.0/numa_node" in node.detail
    assert doctor.strict_mode_row(EMU, doctor.device_attributes(EMU)).value == "cannot fault"
    assert doctor.gpu_numa_node(EMU).value.startswith("n/a")


def test_doctor_json_names_memory_kinds_and_registration_counters() -> None:
    out = _cli("doctor", "--json", "--device", "emulated:0")
    report = json.loads(out.stdout)
    (dev,) = report["devices"]
    kinds = {row["name"]: row["value"] for row in dev["memory_kinds"]}
    assert kinds["pageable memory"] == "needs registration"  # the distinct profile
    assert kinds["VMM host memory"] == "detected, never registered again"
    assert kinds["kind of a fresh allocation"] == "registered"
    host = {row["name"]: row["value"] for row in report["host"]}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        assert host["transparent huge pages"] == text[text.index("[") + 1:text.index("]")]
    except OSError:
        assert host["transparent huge pages"] == "unknown"
    counters = report["registration"]
    # the doctor's own registrations (rung tests, self-test) were counted and timed
    assert counters["registrations"] >= 4 and counters["calls"] >= counters["registrations"] - counters["vmm_host"]
    assert counters["bytes"] > 0 and 0 < counters["longest_call_s"] <= counters["call_seconds"]
    assert counters["seconds_per_gib"] == pytest.approx(counters["call_seconds"] / (counters["bytes"] / (1 << 30)))


@pytest.mark.parametrize("profile, pageable, fresh, single", [
    ("coherent", "device-accessible (no registration needed)", "device_accessible", "not supported (recognised)"),
    ("vmm-host", "needs registration", "vmm_host", "works"),
])
def test_doctor_under_each_emulated_profile(profile: str, pageable: str, fresh: str, single: str) -> None:
    import os

    env = {**os.environ, "POINTERDOMAIN_EMULATED_PROFILE": profile}
    out = subprocess.run([sys.executable, "-m", "pointerdomain", "doctor", "--json", "--device", "emulated:0"],
                         capture_output=True, text=True, timeout=300, env=env)
    report = json.loads(out.stdout)
    (dev,) = report["devices"]
    kinds = {row["name"]: row["value"] for row in dev["memory_kinds"]}
    assert kinds["pageable memory"] == pageable and kinds["kind of a fresh allocation"] == fresh
    ladder = {row["name"]: row["value"] for row in dev["ladder"]}
    assert ladder["rung: single"] == single
    assert dev["self_test"]["ok"] is True and dev["self_test"]["alias_equals_va"] is True  # read in place
    assert out.returncode == 0
