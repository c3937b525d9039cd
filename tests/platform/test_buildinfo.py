"""Build facts (pointerdomain.buildinfo): what --version and doctor print, and the check
that refuses GPU ops built for another runtime major than torch's before the extension is
imported (facts faked here, so it runs without a GPU)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

import pointerdomain
from pointerdomain import _platform, buildinfo
from pointerdomain.buildinfo import BuildFacts, check_torch_runtime
from pointerdomain.errors import ExtensionUnavailableError, GpuRuntimeMismatchError

CUDA13 = BuildFacts(version="1.2.3", commit="ab" * 20, gpu="cuda", runtime_version="13.0.88", runtime_link="shared",
                    archs=("80-real", "90-real", "100"))
CUDA12 = BuildFacts(version="1.2.3", gpu="cuda", runtime_version="12.9.86", runtime_link="shared", archs=("90",))
HIP6 = BuildFacts(version="1.2.3", gpu="hip", runtime_version="6.4.1", runtime_link="shared", archs=("gfx942",))
CPU = BuildFacts(version="1.2.3")


@pytest.mark.parametrize(("facts", "cuda", "hip"), [
    (CUDA13, "13.0", None), (CUDA13, "13.2", None), (CUDA12, "12.8", None), (HIP6, None, "6.4.43483"),
    (CUDA13, None, None), (HIP6, None, None),  # a CPU torch: the emulated device still works
    (CPU, "12.8", None), (CPU, None, "6.4"), (CPU, None, None),
])
def test_matching_runtimes_pass(facts: BuildFacts, cuda: str | None, hip: str | None) -> None:
    check_torch_runtime(facts, cuda, hip)


@pytest.mark.parametrize(("facts", "cuda", "hip", "torch_text"), [
    (CUDA13, "12.8", None, "CUDA 12.8"), (CUDA12, "13.0", None, "CUDA 13.0"),
    (CUDA13, None, "6.4.43483", "HIP 6.4.43483"), (HIP6, "13.0", None, "CUDA 13.0"), (HIP6, None, "7.0.1", "HIP 7.0.1"),
])
def test_other_runtime_major_is_a_typed_error(facts: BuildFacts, cuda: str | None, hip: str | None,
                                              torch_text: str) -> None:
    with pytest.raises(GpuRuntimeMismatchError) as info:
        check_torch_runtime(facts, cuda, hip)
    exc = info.value
    assert isinstance(exc, ExtensionUnavailableError) and isinstance(exc, ImportError)
    assert exc.torch == torch_text and exc.built == f"{'CUDA' if facts.gpu == 'cuda' else 'HIP'} {facts.runtime_version}"
    assert facts.gpu_summary() in str(exc) and torch_text in str(exc)


def test_first_use_under_another_cuda_major_raises_before_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA 13 build under a torch built for CUDA 12: the platform's extension import
    raises the typed error, not a loader error or a crash."""
    monkeypatch.setattr(buildinfo, "build_facts", lambda: CUDA13)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(GpuRuntimeMismatchError, match="torch was built for CUDA 12.8"):
        _platform.gpu_ops_built()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert _platform.gpu_ops_built() in (True, False)  # same major: the real extension answers


def test_facts_summary_and_commit_text() -> None:
    assert CUDA13.gpu_summary() == "CUDA 13.0.88 ops for 80-real;90-real;100 (shared runtime)"
    assert CUDA13.runtime_major == 13 and CPU.runtime_major is None and CPU.gpu_summary() == "CPU kernels only"
    assert CUDA13.commit_text() == "ab" * 6
    assert BuildFacts(version="1", commit="cd" * 20, dirty=True).commit_text() == "cd" * 6 + "+dirty"


def test_installed_facts_match_the_build() -> None:
    """The facts file the build wrote agrees with the distribution's metadata and the extension."""
    facts = buildinfo.build_facts()
    path = buildinfo.facts_path()
    assert path is not None
    generated = json.loads(path.read_text())
    assert facts.version == generated["version"] == importlib.metadata.version("pointerdomain") == pointerdomain.__version__
    assert facts.archs == tuple(a for a in generated["archs"].split(";") if a) and facts.dirty is generated["dirty"]
    assert facts.gpu in ("cuda", "hip", "none") and facts.gpu_why.startswith("POINTERDOMAIN_GPU=")
    assert facts.commit == "unknown" or (len(facts.commit) == 40 and int(facts.commit, 16) >= 0)
    assert _platform.gpu_ops_built() == (facts.gpu != "none")
    from pointerdomain import _C

    assert _C.gpu_built == (facts.gpu != "none")
    if _C.gpu_built:
        assert _C.gpu_runtime == facts.gpu


def test_version_flag_prints_the_facts() -> None:
    facts = buildinfo.build_facts()
    out = subprocess.run([sys.executable, "-m", "pointerdomain", "--version"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.splitlines() == [f"pointerdomain {facts.version} (commit {facts.commit_text()})",
                                f"ops: {facts.gpu_summary()}", f"build: {facts.gpu_why}"]
