"""The stateful fuzzers in child processes, both at once (one per core on the 2-core CI
machine): the KV machine (tests/transfer/fuzz_machine.py) and the engine-facing surface
machine (tests/transfer/fuzz_surface.py: the compat call shapes, the transfer-engine
adapters, graph capture on the emulated device and the layer pipeline). A segfault or an abort there is a failure here, with the child's output, not
a dead pytest.

The hypothesis profile comes from ``FUZZ_PROFILE`` (``ci``, the default: 2,000 KV and
3,200 surface examples, at least 5,000 sequences together; ``dev``: 200 and 300;
``long``: 20,000 each). The test prints one line with the counts and times (``.ci/run``'s
fuzz stage shows it); docs/reliability.md reports the numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import childenv

pytestmark = pytest.mark.slow  # the long fuzzer run: .ci/run's fuzz stage

ROOT = Path(__file__).resolve().parents[2]
MACHINES = ("fuzz_machine", "fuzz_surface")
MINIMUM = {"ci": {"fuzz_machine": 2000, "fuzz_surface": 3000, "total": 5000},
           "dev": {"fuzz_machine": 200, "fuzz_surface": 300, "total": 500},
           "long": {"fuzz_machine": 20000, "fuzz_surface": 20000, "total": 40000}}


def test_stateful_fuzzers_in_child_processes(tmp_path: Path) -> None:
    profile = os.environ.get("FUZZ_PROFILE", "ci")
    env = dict(os.environ, PYTHONPATH=childenv.pythonpath())
    start = time.monotonic()
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", f"tests.transfer.{name}", "--profile", profile, "--summary",
             str(tmp_path / f"{name}.json")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name in MACHINES
    }
    outputs = {name: proc.communicate(timeout=900)[0] for name, proc in procs.items()}
    wall = time.monotonic() - start
    results = {}
    for name, proc in procs.items():
        tail = outputs[name][-6000:]
        assert proc.returncode >= 0, f"{name}: the fuzzer's process died of signal {-proc.returncode}:\n{tail}"
        assert proc.returncode == 0, f"{name}: the fuzzer found a failure:\n{tail}"
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert results[name]["failure"] == ""
    kv, surface = results["fuzz_machine"], results["fuzz_surface"]
    total = kv["sequences"] + surface["sequences"]
    print(f"\nfuzz ({profile}): {total} sequences, 0 failures, {wall:.0f} s wall "
          f"(KV machine {kv['sequences']} sequences in {kv['seconds']} s; surface machine "
          f"{surface['sequences']} sequences in {surface['seconds']} s)")
    want = MINIMUM.get(profile, {})
    assert kv["sequences"] >= want.get("fuzz_machine", 1), kv
    assert surface["sequences"] >= want.get("fuzz_surface", 1), surface
    assert total >= want.get("total", 1)
    assert kv["launches_ok"] > 0 and kv["launches_refused"] > 0, kv
    assert kv["compat_calls"] > 0, kv  # the engines' call shapes are reached by the KV machine too
    for call in ("sgl_per_layer", "sgl_all_layer", "vllm_swap_blocks", "vllm_swap_blocks_batch",
                 "lmcache_multi_layer", "mooncake", "nixl", "graph_capture", "layer_pipeline"):
        # every entry point both accepted and refused
        assert surface[f"{call}_ok"] > 0 and surface[f"{call}_refused"] > 0, (call, surface)
