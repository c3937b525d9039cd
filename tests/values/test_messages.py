"""Messages a user reads: pools say what they are, sizes and counts read right, the
CLI offers only what it accepts and prints each default once."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.tools.cli import UsageError, build_parser, parse_device
from tests.childenv import pythonpath
from tests.reference import DEV, model_layout


def test_pools_have_a_repr() -> None:
    device = pd.DeviceKVPool(model_layout("layer_first"), DEV)
    assert repr(device).startswith("DeviceKVPool(layer_first, mha, 3 layer(s)") and "emulated:0" in repr(device)
    host = pd.HostKVPool(model_layout("page_first"), DEV)
    assert f"at {host.memory.host_va!r}" in repr(host) and "8 page(s)" in repr(host)
    host.close()
    assert repr(host).endswith("closed)")


def test_a_numpy_page_is_named_a_type_problem_not_a_range_problem() -> None:
    layout = model_layout("page_first")
    with pytest.raises(errors.IndexValidationError) as info:
        layout.page_blocks(np.int64(1))  # type: ignore[arg-type]
    assert "outside" not in str(info.value) and "int64" in str(info.value) and "int(page)" in str(info.value)
    with pytest.raises(errors.IndexValidationError, match="outside"):
        layout.page_blocks(8)


def test_cli_device_error_offers_only_devices_it_takes() -> None:
    with pytest.raises(UsageError) as info:
        parse_device("bogus")
    assert "cpu" not in str(info.value).replace("CPU stand-in", "") and "emulated:N" in str(info.value)
    with pytest.raises(UsageError):
        parse_device("cpu")


def test_help_shows_each_default_once_and_no_developer_notes() -> None:
    parser = build_parser()
    top = parser.format_help()
    assert "Subcommands are rows" not in top and "Exit codes" in top
    demo = parser._subparsers._group_actions[0].choices["demo"].format_help()  # type: ignore[union-attr]
    flat = " ".join(demo.split())
    assert "(default: None)" not in flat
    assert flat.count("default: 8 for MHA") == 1 and "(default: 32)" in flat


def test_small_demo_run_reads_right() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pointerdomain", "demo", "--device", "emulated:0", "--layers", "1", "--heads", "1",
         "--head-dim", "8", "--page-size", "1", "--device-pages", "2", "--host-pages", "2", "--pages", "1"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # a size that rounds to "0 MiB" (not "272.0 MiB", which a machine's memory line may read)
    assert "1 layer," in out.stdout and "1 layers" not in out.stdout and not re.search(r"(?<![\d.])0 MiB", out.stdout)
    assert "device pool 64 B" in out.stdout and "(1 page)" in out.stdout


def test_explanation_of_another_process_does_not_claim_no_registration() -> None:
    other = pd.explain(4096, pid=1) if os.path.exists("/proc/1/maps") else None
    if other is None:
        pytest.skip("no /proc/1")
    assert "in no registration" not in other.text().splitlines()[0]
