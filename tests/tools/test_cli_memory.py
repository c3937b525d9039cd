"""The demo's memory pre-check counts every buffer: the measured peak RSS of a demo run
is within 10 % of the estimate it prints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Run the demo as the only child of a fresh interpreter, so RUSAGE_CHILDREN's ru_maxrss
# (the largest finished child) is the demo's and not another test's subprocess.
_MEASURE = """
import json, resource, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pointerdomain", "demo", "--json", *sys.argv[1:]],
                     capture_output=True, text=True)
print(json.dumps({"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr,
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


@pytest.mark.slow
def test_demo_peak_rss_within_10_percent_of_the_estimate() -> None:
    # ~530 MiB of pools and copies over a ~250 MiB interpreter: the buffers dominate the peak.
    args = ["--device", "emulated:0", "--layers", "8", "--device-pages", "64", "--host-pages", "128", "--pages", "32"]
    raw = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, timeout=600, check=True)
    measured = json.loads(raw.stdout)
    assert measured["rc"] == 0, measured["stderr"]
    result = json.loads(measured["stdout"])
    est = result["estimate"]
    peak = measured["maxrss_kib"] * 1024
    buffers = est["host_peak_bytes"] - est["baseline_bytes"]
    assert buffers > est["baseline_bytes"], est  # the run is big enough for the check to mean something
    assert abs(peak - est["host_peak_bytes"]) <= 0.10 * est["host_peak_bytes"], (peak, est)
    assert est["host_pool_bytes"] == 128 * 64 * 8 * 2 * 8 * 128 * 2  # pages x tokens x layers x K,V x heads x dim x bf16
