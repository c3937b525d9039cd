"""The command line (pointerdomain.tools.cli): demo and doctor."""

from __future__ import annotations

import json
import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pointerdomain", *args], capture_output=True, text=True, timeout=300)


def test_cli_demo_small_and_doctor() -> None:
    out = _cli("demo", "--layers", "4", "--device-pages", "8", "--host-pages", "12", "--pages", "5", "--device", "emulated:0")
    assert out.returncode == 0, out.stderr
    assert "distinct" in out.stdout and "verified byte-for-byte" in out.stdout
    doc = _cli("doctor", "--json", "--device", "emulated:0")
    assert doc.returncode == 0, doc.stderr
    report = json.loads(doc.stdout)
    assert report["devices"][0]["self_test"]["ok"] is True
    assert report["devices"][0]["self_test"]["alias_equals_va"] is False


def test_cli_demo_refuses_bad_shapes_with_a_message() -> None:
    for args, needle in ((("--layers", "100000"), "GiB more host memory"), (("--layers", "0"), "--layers"),
                         (("--pages", "0"), "argument --pages"), (("--attention", "mla", "--heads", "8"), "--heads must be 1")):
        out = _cli("demo", "--device", "emulated:0", *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr
