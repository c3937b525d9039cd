"""The alias policy on HIP, and the HIP-built extension on a machine without an AMD GPU.

Rule under test (docs/design.md, "Fallback policy per platform"): on HIP a missing
device-pointer op is a hard ``AliasOpMissingError`` when a device's policy is resolved,
never a silent fallback; the CUDA rule "alias = host VA where
CanUseHostPointerForRegisteredMem is 1" never applies to HIP, whatever the attribute says.

The platform is simulated on CPU through the documented test hook: torch reports one GPU
and ``_platform.testing.install_backend`` makes a stand-in the backend of ``cuda`` devices,
carrying what a real build would (the runtime, the device-pointer op present or missing,
the attribute). Each HIP case has a CUDA twin that takes the fallback, so a simulation that
never reached the rule would fail the twin.

The last group runs only when ``POINTERDOMAIN_HIP_CHECK=1`` (set by scripts/hip-check, which
builds the HIP variant and puts it first on PYTHONPATH): the imported extension must then be
the HIP build, import without an AMD GPU, and report "no device" through the runtime and
through ``pointerdomain doctor``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain._platform import Backend
from pointerdomain._platform.cuda import TorchCudartBackend
from pointerdomain._platform.faulty import FaultyBackend
from pointerdomain._platform.testing import install_backend
from pointerdomain.registration.resolve import decide_policy
from tests.reference import EMU

GPU = pd.Device("cuda", 0)
VA = pd.HostVA(0x7F00_0000_0000)
ALIAS_OFFSET = 0x1_0000_0000  # the stand-in op's alias = VA + this (distinct, as on MI355X)


class CpuOnlyBuild(TorchCudartBackend):
    """The real stand-in for builds without the GPU ops (its runtime comes from torch),
    with the attribute given instead of read through libcudart."""

    def __init__(self, can_use_host_pointer: int | None) -> None:
        super().__init__()
        self._attribute = can_use_host_pointer

    def can_use_host_pointer(self, device: pd.Device) -> int | None:
        return self._attribute


class SimulatedGpu(FaultyBackend):
    """The backend a GPU build for ``runtime`` ("cuda" / "hip") would give, for the alias
    policy; memory and launches stay the emulated backend's."""

    def __init__(self, runtime: str, *, alias_op: bool = False, can_use_host_pointer: int | None = 1,
                 alias_status: int = 0) -> None:
        super().__init__(EMU, fail={})
        self.runtime = self.name = runtime
        self.has_alias_op = alias_op
        self.host_readable = False
        self._attribute = can_use_host_pointer
        self._alias_status = alias_status

    def alias(self, va: int, device: pd.Device) -> tuple[int, int]:
        assert self.has_alias_op, "the policy asked a missing op"
        return (self._alias_status, 0 if self._alias_status else va + ALIAS_OFFSET)

    def pointer_is_host(self, ptr: int) -> bool:
        return True

    def can_use_host_pointer(self, device: pd.Device) -> int | None:
        return self._attribute

    def describe(self, code: int) -> str:
        return f"simulated error {code}"


@pytest.fixture
def simulate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``simulate(runtime, torch_hip=..., **build)``: one visible GPU whose backend is a
    :class:`SimulatedGpu` (``gpu_built=False``: a :class:`CpuOnlyBuild`),
    ``torch.version.hip`` set (a ROCm torch) or None (a CUDA torch)."""
    with contextlib.ExitStack() as stack:
        def apply(runtime: str | None, torch_hip: str | None = None, **build: Any) -> None:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
            monkeypatch.setattr(torch.version, "hip", torch_hip, raising=False)
            gpu_built = build.pop("gpu_built", True)
            backend: Backend = SimulatedGpu(runtime, **build) if gpu_built else CpuOnlyBuild(**build)
            stack.enter_context(install_backend(backend, "cuda"))
            pd.reset_resolver_cache()

        pd.reset_resolver_cache()
        yield apply
        pd.reset_resolver_cache()  # no simulated policy outlives the test


def expect_no_fallback(call: Callable[[], object]) -> errors.AliasOpMissingError:
    """``call`` must raise AliasOpMissingError, with no FallbackWarning and no counted fallback."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(errors.AliasOpMissingError) as info:
            call()
    assert [w for w in seen if w.category.__name__ == "FallbackWarning"] == []
    assert pd.fallback_count() == 0
    return info.value


# --- the decision itself -------------------------------------------------------------

@pytest.mark.parametrize("attribute", [1, 0, None])
def test_hip_without_op_raises_whatever_the_attribute(attribute: int | None) -> None:
    err = expect_no_fallback(lambda: decide_policy("hip", False, attribute))
    assert "hipHostGetDevicePointer" in str(err) and "POINTERDOMAIN_GPU=hip" in str(err)
    assert isinstance(err, RuntimeError)  # the matching builtin, for callers that catch it


@pytest.mark.parametrize("attribute", [1, 0, None])
def test_hip_with_op_uses_the_op(attribute: int | None) -> None:
    assert decide_policy("hip", True, attribute) is pd.AliasPolicy.RUNTIME_OP


def test_cuda_twin_takes_the_fallback_only_with_attribute_1() -> None:
    assert decide_policy("cuda", False, 1) is pd.AliasPolicy.HOST_POINTER_FALLBACK
    for attribute in (0, None):
        expect_no_fallback(lambda: decide_policy("cuda", False, attribute))


# --- through alias_policy / resolve_alias on a simulated platform ---------------------

def test_hip_build_missing_op_is_an_error_at_resolution(simulate: Callable[..., None]) -> None:
    # A HIP build whose device-pointer op is missing, on a device whose attribute reads 1.
    simulate("hip", alias_op=False, can_use_host_pointer=1, torch_hip="6.2.41133")
    expect_no_fallback(lambda: pd.alias_policy(GPU))
    expect_no_fallback(lambda: pd.resolve_alias(VA, GPU))
    expect_no_fallback(lambda: pd.alias_policy("cuda:0"))  # not cached as a success either


def test_cuda_twin_of_missing_op_falls_back(simulate: Callable[..., None]) -> None:
    simulate("cuda", alias_op=False, can_use_host_pointer=1)
    assert pd.alias_policy(GPU) is pd.AliasPolicy.HOST_POINTER_FALLBACK
    with pytest.warns(RuntimeWarning, match="using host VAs as aliases"):
        alias = pd.resolve_alias(VA, GPU)
    assert alias == pd.DeviceAlias(VA.value, GPU) and pd.fallback_count() == 1


def test_cpu_only_build_on_rocm_torch_is_an_error(simulate: Callable[..., None]) -> None:
    # The start-up crash class: a CPU-only wheel (no gpu_runtime attribute) under a ROCm
    # torch. The runtime then comes from torch.version.hip; the attribute reads 1.
    simulate(None, gpu_built=False, torch_hip="6.2.41133", can_use_host_pointer=1)
    err = expect_no_fallback(lambda: pd.resolve_alias(VA, GPU))
    assert "hipHostGetDevicePointer" in str(err)


def test_cpu_only_build_on_cuda_torch_falls_back(simulate: Callable[..., None]) -> None:
    simulate(None, gpu_built=False, torch_hip=None, can_use_host_pointer=1)
    assert pd.alias_policy(GPU) is pd.AliasPolicy.HOST_POINTER_FALLBACK


def test_hip_build_resolves_through_its_op(simulate: Callable[..., None]) -> None:
    simulate("hip", alias_op=True, can_use_host_pointer=0, torch_hip="6.2.41133")
    assert pd.alias_policy(GPU) is pd.AliasPolicy.RUNTIME_OP
    alias = pd.resolve_alias(VA, GPU)
    assert alias == pd.DeviceAlias(VA.value + ALIAS_OFFSET, GPU) and alias.value != VA.value
    assert pd.fallback_count() == 0


def test_hip_op_failure_is_a_runtime_error(simulate: Callable[..., None]) -> None:
    simulate("hip", alias_op=True, alias_status=1, torch_hip="6.2.41133")
    with pytest.raises(errors.RuntimeCallError) as info:
        pd.resolve_alias(VA, GPU)
    assert info.value.code == 1 and pd.fallback_count() == 0


# --- the HIP-built extension itself (scripts/hip-check) -------------------------------

hip_build = pytest.mark.skipif(os.environ.get("POINTERDOMAIN_HIP_CHECK") != "1",
                               reason="needs the HIP build on PYTHONPATH (scripts/hip-check sets POINTERDOMAIN_HIP_CHECK=1)")


def _real_extension() -> Any:
    """The built module itself (these cases test the artifact, below the platform layer)."""
    ext = importlib.import_module("pointerdomain._C")
    assert ext.__name__ == "pointerdomain._C"
    return ext


@hip_build
def test_imported_extension_is_the_hip_build() -> None:
    ext = _real_extension()
    assert ext.gpu_built is True and ext.gpu_runtime == "hip"
    assert ext.gpu_has_batch_copy is False  # cudaMemcpyBatchAsync is CUDA-only
    binary = Path(ext.__file__).read_bytes()
    assert b"hipHostGetDevicePointer" in binary and b"hipDeviceGetAttribute" in binary
    for cuda_marker in (b"libcuda.so", b"libcudart", b"cudaGetDeviceCount"):  # all in a CUDA build
        assert cuda_marker not in binary, cuda_marker
    maps = Path("/proc/self/maps").read_text()
    assert "libamdhip64" in maps and "libcudart" not in maps


@hip_build
def test_hip_runtime_reports_no_device_and_calls_fail_cleanly() -> None:
    ext = _real_extension()
    status, count = ext.gpu_device_count()
    assert count == 0 and status != 0  # hipErrorNoDevice (100) on ROCm 5.2
    assert ext.gpu_error_string(status).startswith("hipError")  # the HIP runtime's own name for it
    version_status, version = ext.gpu_runtime_version()
    assert version_status == 0 and version > 0
    with pd.alloc_registered(4096, "emulated:0") as mem:  # real pages for the runtime to refuse
        va = mem.host_va.value
        status, alias = ext.gpu_host_get_device_pointer(va, 0)
        assert status != 0 and alias == 0
        assert ext.gpu_host_register(va, 4096, 0) != 0
    status, value = ext.gpu_can_use_host_pointer_for_registered_mem(0)
    assert status != 0 and value == 0
    # The emulated backend still works in the same process.
    assert pd.alias_policy("emulated:0") is pd.AliasPolicy.EMULATED


@hip_build
def test_doctor_reports_no_device() -> None:
    out = subprocess.run([sys.executable, "-m", "pointerdomain.tools.cli", "doctor", "--json"], capture_output=True,
                         text=True, timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    versions = {row["name"]: row["value"] for row in report["versions"]}
    assert versions["GPU ops built"] is True and versions["GPU runtime"] == "hip"
    ext = _real_extension()
    status, _ = ext.gpu_device_count()
    assert versions["gpu_device_count"] == 0
    assert versions["gpu_devices"] == f"no device ({ext.gpu_error_string(status)}, code {status})"
    assert versions["extension"] == ext.__file__
    # The generic attribute query is in the HIP build too; with no device it answers a status, not a crash.
    for name in ("PageableMemoryAccess", "HostRegisterSupported", "PciBusId"):
        attr_status, value = ext.gpu_device_attribute(ext.DeviceAttribute[name], 0)
        assert attr_status != 0 and value == 0, name
    assert [d["device"] for d in report["devices"]] == ["emulated:0"]
    assert report["devices"][0]["self_test"]["ok"] is True
