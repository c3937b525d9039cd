"""The stateful fuzzer (tests/transfer/fuzz_machine.py) in a child process: a segfault or an
abort there is a failure here, with the child's output, not a dead pytest.

The hypothesis profile comes from ``FUZZ_PROFILE`` (``ci``: 2,000 sequences, the
default; ``dev``: 200; ``long``: 20,000). docs/reliability.md reports the numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import childenv

pytestmark = pytest.mark.slow  # the long fuzzer run: .ci/run's fuzz stage

ROOT = Path(__file__).resolve().parents[2]
MINIMUM = {"ci": 2000, "dev": 200, "long": 20000}


def test_stateful_fuzzer_in_a_child_process(tmp_path: Path) -> None:
    profile = os.environ.get("FUZZ_PROFILE", "ci")
    summary = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=childenv.pythonpath())
    proc = subprocess.run(
        [sys.executable, "-m", "tests.transfer.fuzz_machine", "--profile", profile, "--summary", str(summary)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode >= 0, f"the fuzzer's process died of signal {-proc.returncode}:\n{tail}"
    assert proc.returncode == 0, f"the fuzzer found a failure:\n{tail}"
    result = json.loads(summary.read_text())
    assert result["failure"] == ""
    assert result["sequences"] >= MINIMUM.get(profile, 1), result
    assert result["launches_ok"] > 0 and result["launches_refused"] > 0, result
    assert result["compat_calls"] > 0, result  # the engines' call shapes are reached too
