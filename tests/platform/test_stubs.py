"""The checked-in stub of the extension matches the built module (nanobind stubgen)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pointerdomain._platform import gpu_ops_built

STUB = Path(__file__).resolve().parents[2] / "src" / "pointerdomain" / "_C.pyi"


def test_stub_matches_built_extension(tmp_path: Path) -> None:
    pytest.importorskip("nanobind.stubgen")
    if not gpu_ops_built():
        pytest.skip("the checked-in stub is for a build with the CUDA ops (nvcc present); this build is CPU-only")
    out = tmp_path / "_C.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "pointerdomain._C", "-o", str(out)],
                   check=True, cwd=tmp_path)
    generated, checked_in = out.read_text(), STUB.read_text()
    assert generated == checked_in, (
        "src/pointerdomain/_C.pyi is stale: regenerate with "
        "`python -m nanobind.stubgen -q -m pointerdomain._C -o src/pointerdomain/_C.pyi`"
    )
    assert '"""\npointerdomain kernels and runtime calls (private; use the pointerdomain package)' in checked_in
