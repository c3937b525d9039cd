"""Issue 13: the alias policy on HIP, and the HIP-built extension on a machine without an AMD GPU.

Rule under test (docs/design.md, "Fallback policy per platform"): on HIP a missing
device-pointer op is a hard ``AliasOpMissingError`` when a device's policy is resolved,
never a silent fallback; the CUDA rule "alias = host VA where
CanUseHostPointerForRegisteredMem is 1" never applies to HIP, whatever the attribute says.

The platform is simulated on CPU: torch reports one GPU, and the imported ``pointerdomain._C``
is replaced by a stand-in module that carries what a real build would (``gpu_built``,
``gpu_runtime``, the ops present or missing). Each HIP case has a CUDA twin that takes the
fallback, so a simulation that never reached the rule would fail the twin.

The last group runs only when ``POINTERDOMAIN_HIP_CHECK=1`` (set by scripts/hip-check, which
builds the HIP variant and puts it first on PYTHONPATH): the imported extension must then be
the HIP build, import without an AMD GPU, and report "no device" through the runtime and
through ``pointerdomain doctor``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors

# The modules the simulation patches, found through public names so that moving them
# (e.g. into a pointerdomain._platform package) needs no change here.
RESOLVER = importlib.import_module(pd.alias_policy.__module__)  # where alias_policy decides
LOADER = importlib.import_module(RESOLVER.extension.__module__)  # where pointerdomain._C is cached

GPU = pd.Device("cuda", 0)
VA = pd.HostVA(0x7F00_0000_0000)
ALIAS_OFFSET = 0x1_0000_0000  # the stand-in op's alias = VA + this (distinct, as on MI355X)


def fake_extension(runtime: str | None, *, gpu_built: bool = True, alias_op: bool = False,
                   can_use_host_pointer: int = 1, alias_status: int = 0) -> ModuleType:
    """A stand-in for ``pointerdomain._C``: a GPU build for ``runtime`` ("cuda" / "hip"),
    or, with ``gpu_built=False`` and ``runtime=None``, a CPU-only build. With
    ``alias_op=False`` the device-pointer op is missing; the attribute reads
    ``can_use_host_pointer``."""
    real = LOADER.extension()
    ext = ModuleType("pointerdomain._C")
    for name in dir(real):  # keep the CPU / emulated ops
        if name.startswith(("cpu_", "emu_")):
            setattr(ext, name, getattr(real, name))
    ext.gpu_built = gpu_built  # type: ignore[attr-defined]
    if runtime is not None:
        ext.gpu_runtime = runtime  # type: ignore[attr-defined]
    if gpu_built:
        ext.gpu_can_use_host_pointer_for_registered_mem = lambda ordinal: (0, can_use_host_pointer)  # type: ignore[attr-defined]
        ext.gpu_pointer_is_host = lambda ptr: (0, 1)  # type: ignore[attr-defined]
        ext.gpu_error_string = lambda code: f"simulated error {code}"  # type: ignore[attr-defined]
        if alias_op:
            ext.gpu_host_get_device_pointer = (  # type: ignore[attr-defined]
                lambda va, ordinal: (alias_status, 0 if alias_status else va + ALIAS_OFFSET)
            )
    return ext


@pytest.fixture
def simulate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``simulate(ext, torch_hip=...)``: one visible GPU, ``ext`` imported as ``pointerdomain._C``,
    ``torch.version.hip`` set (a ROCm torch) or None (a CUDA torch)."""
    def apply(ext: ModuleType, torch_hip: str | None = None, cudart_attribute: int | None = None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.version, "hip", torch_hip, raising=False)
        monkeypatch.setattr(LOADER, "_module", ext)
        if cudart_attribute is not None:  # a CPU-only build reads the attribute through libcudart
            monkeypatch.setattr(RESOLVER, "can_use_host_pointer", lambda device: cudart_attribute)
        pd.reset_resolver_cache()

    LOADER.extension()  # the real module, for the CPU ops the stand-ins keep
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
    err = expect_no_fallback(lambda: RESOLVER.decide_policy("hip", False, attribute))
    assert "hipHostGetDevicePointer" in str(err) and "POINTERDOMAIN_GPU=hip" in str(err)
    assert isinstance(err, RuntimeError)  # the matching builtin, for callers that catch it


@pytest.mark.parametrize("attribute", [1, 0, None])
def test_hip_with_op_uses_the_op(attribute: int | None) -> None:
    assert RESOLVER.decide_policy("hip", True, attribute) is pd.AliasPolicy.RUNTIME_OP


def test_cuda_twin_takes_the_fallback_only_with_attribute_1() -> None:
    assert RESOLVER.decide_policy("cuda", False, 1) is pd.AliasPolicy.HOST_POINTER_FALLBACK
    for attribute in (0, None):
        expect_no_fallback(lambda: RESOLVER.decide_policy("cuda", False, attribute))


# --- through alias_policy / resolve_alias on a simulated platform ---------------------

def test_hip_build_missing_op_is_an_error_at_resolution(simulate: Callable[..., None]) -> None:
    # A HIP build whose device-pointer op is missing, on a device whose attribute reads 1.
    simulate(fake_extension("hip", alias_op=False, can_use_host_pointer=1), torch_hip="6.2.41133")
    expect_no_fallback(lambda: pd.alias_policy(GPU))
    expect_no_fallback(lambda: pd.resolve_alias(VA, GPU))
    expect_no_fallback(lambda: pd.alias_policy("cuda:0"))  # not cached as a success either


def test_cuda_twin_of_missing_op_falls_back(simulate: Callable[..., None]) -> None:
    simulate(fake_extension("cuda", alias_op=False, can_use_host_pointer=1))
    assert pd.alias_policy(GPU) is pd.AliasPolicy.HOST_POINTER_FALLBACK
    with pytest.warns(RuntimeWarning, match="using host VAs as aliases"):
        alias = pd.resolve_alias(VA, GPU)
    assert alias == pd.DeviceAlias(VA.value, GPU) and pd.fallback_count() == 1


def test_cpu_only_build_on_rocm_torch_is_an_error(simulate: Callable[..., None]) -> None:
    # The start-up crash class: a CPU-only wheel (no gpu_runtime attribute) under a ROCm
    # torch. The runtime then comes from torch.version.hip; the attribute reads 1.
    simulate(fake_extension(None, gpu_built=False), torch_hip="6.2.41133", cudart_attribute=1)
    err = expect_no_fallback(lambda: pd.resolve_alias(VA, GPU))
    assert "hipHostGetDevicePointer" in str(err)


def test_cpu_only_build_on_cuda_torch_falls_back(simulate: Callable[..., None]) -> None:
    simulate(fake_extension(None, gpu_built=False), torch_hip=None, cudart_attribute=1)
    assert pd.alias_policy(GPU) is pd.AliasPolicy.HOST_POINTER_FALLBACK


def test_hip_build_resolves_through_its_op(simulate: Callable[..., None]) -> None:
    simulate(fake_extension("hip", alias_op=True, can_use_host_pointer=0), torch_hip="6.2.41133")
    assert pd.alias_policy(GPU) is pd.AliasPolicy.RUNTIME_OP
    alias = pd.resolve_alias(VA, GPU)
    assert alias == pd.DeviceAlias(VA.value + ALIAS_OFFSET, GPU) and alias.value != VA.value
    assert pd.fallback_count() == 0


def test_hip_op_failure_is_a_runtime_error(simulate: Callable[..., None]) -> None:
    simulate(fake_extension("hip", alias_op=True, alias_status=1), torch_hip="6.2.41133")
    with pytest.raises(errors.RuntimeCallError) as info:
        pd.resolve_alias(VA, GPU)
    assert info.value.code == 1 and pd.fallback_count() == 0


# --- the HIP-built extension itself (scripts/hip-check) -------------------------------

hip_build = pytest.mark.skipif(os.environ.get("POINTERDOMAIN_HIP_CHECK") != "1",
                               reason="needs the HIP build on PYTHONPATH (scripts/hip-check sets POINTERDOMAIN_HIP_CHECK=1)")


def _real_extension() -> Any:
    ext = LOADER.extension()
    assert isinstance(ext, ModuleType) and ext.__name__ == "pointerdomain._C"
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
    out = subprocess.run([sys.executable, "-m", "pointerdomain.cli", "doctor"], capture_output=True, text=True,
                         timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    assert report["gpu_ops_built"] is True and report["gpu_runtime"] == "hip"
    ext = _real_extension()
    status, _ = ext.gpu_device_count()
    assert report["gpu_device_count"] == 0
    assert report["gpu_devices"] == f"no device ({ext.gpu_error_string(status)}, code {status})"
    assert report["extension"] == ext.__file__
    assert [d["device"] for d in report["devices"]] == ["emulated:0"]
    assert report["devices"][0]["self_test"]["ok"] is True
