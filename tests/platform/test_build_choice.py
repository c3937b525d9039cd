"""The build's GPU back-end choice (CMakeLists.txt, POINTERDOMAIN_GPU=auto): GPU ops only
where a GPU is visible and its compiler is found, the reason said in the configure log.
Configure runs only (no compile); a stub nvidia-smi stands in for a visible NVIDIA GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CMAKE = shutil.which("cmake")
pytestmark = [
    pytest.mark.skipif(CMAKE is None, reason="cmake not found"),
    pytest.mark.skipif(not (ROOT / "CMakeLists.txt").exists(), reason="no source checkout"),
]


def _configure(tmp_path: Path, bin_dir: Path, **env: str) -> str:
    pytest.importorskip("nanobind")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("POINTERDOMAIN_", "CUDA", "CMAKE_"))}
    # no nvcc: only the stub folder and the system folders cmake and the C++ compiler live in
    path = os.pathsep.join([str(bin_dir), str(Path(CMAKE or "cmake").parent), "/usr/bin", "/bin"])
    full = {**base, "PATH": path, "CUDACXX": str(tmp_path / "no-nvcc"), **env}
    out = subprocess.run([CMAKE or "cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"),
                          f"-DPython_EXECUTABLE={sys.executable}"], env=full, capture_output=True, text=True,
                         timeout=300)
    return out.stdout + out.stderr


def _stub_smi(bin_dir: Path) -> None:
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n")
    smi.chmod(0o755)


def _gpu_visible() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/dev/kfd").exists() or shutil.which("nvidia-smi") is not None


def test_auto_without_a_visible_gpu_builds_cpu_kernels(tmp_path: Path) -> None:
    if _gpu_visible():
        pytest.skip("a GPU (or nvidia-smi) is visible on this machine")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = _configure(tmp_path, bin_dir)
    assert "pointerdomain: POINTERDOMAIN_GPU=auto chose none: no visible GPU" in log, log
    assert json.loads((tmp_path / "build" / "_build_facts.json").read_text())["gpu"] == "none"


def test_auto_with_a_gpu_but_no_compiler_says_so(tmp_path: Path) -> None:
    if Path("/dev/kfd").exists():
        pytest.skip("an AMD GPU is visible: auto looks for hipcc too")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub_smi(bin_dir)
    log = _configure(tmp_path, bin_dir)
    assert ("pointerdomain: POINTERDOMAIN_GPU=auto chose none: an NVIDIA GPU is visible (nvidia-smi -L lists a GPU) "
            "but no CUDA compiler was found") in log, log


def test_explicit_cuda_without_a_compiler_stops(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = _configure(tmp_path, bin_dir, POINTERDOMAIN_GPU="cuda")
    assert "POINTERDOMAIN_GPU=cuda but no CUDA compiler was found" in log, log
    assert not (tmp_path / "build" / "_build_facts.json").exists()
