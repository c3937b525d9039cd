"""The command line as users expect it: help with defaults, --version, exit codes 0/1/2,
errors naming flags, the device said, progress on stderr."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pointerdomain.tools import cli, demo


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pointerdomain", *args], capture_output=True, text=True, timeout=300)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_flag_has_help_and_defaults_show() -> None:
    subs = _subparsers()
    assert set(subs) == {c.name for c in cli.COMMANDS}
    for name, sub in subs.items():
        assert issubclass(sub.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
        for action in sub._actions:
            assert action.help, (name, action.dest)
    text = subs["demo"].format_help()
    assert "(default: 32)" in text and "(default: page_first)" in text


@pytest.mark.slow
def test_version_and_demo_help() -> None:
    import pointerdomain

    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.startswith(f"pointerdomain {pointerdomain.__version__}")
    helped = _cli("demo", "--help")
    assert helped.returncode == 0 and "(default: 64)" in helped.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("args", "needle"), [
    (("--device", "cpu"), "--device emulated:0"),
    (("--device", "emulated:99"), "--device emulated:99"),
    (("--device", "tpu:0"), "--device tpu:0"),
    (("--layers", "0"), "--layers"),
    (("--layers", "x"), "--layers"),
    (("--pages", "100"), "--pages must be"),
    (("--attention", "mla", "--heads", "8"), "--heads must be 1"),
    (("--layers", "100000"), "GiB"),
    (("--no-such-flag",), "unrecognized arguments"),
    (("--seed", str(2**64)), "--seed"),
    (("--seed", str(-2**63 - 1)), "--seed"),
])
def test_demo_usage_errors_exit_2_and_name_the_flag(args: tuple[str, ...], needle: str) -> None:
    out = _cli("demo", *args)
    assert out.returncode == 2, (args, out.stdout, out.stderr)
    assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_shape_errors_name_flags_not_model_fields() -> None:
    ns = cli.build_parser().parse_args(["demo"])
    ns.layers, ns.page_size = 0, -3  # past argparse: the pydantic check is the last line of defence
    with pytest.raises(cli.UsageError) as info:
        demo._layouts(ns)
    text = str(info.value)
    assert "--layers 0" in text and "--page-size -3" in text
    assert "num_layers" not in text and "page_size" not in text


@pytest.mark.slow
def test_demo_says_its_device_and_shows_progress() -> None:
    out = _cli("demo", "--layers", "2", "--device-pages", "4", "--host-pages", "6", "--pages", "3", "--progress", "always")
    assert out.returncode == 0, out.stderr
    # the default device: the GPU where one with the GPU ops is present, else the emulated one
    from pointerdomain.testing import default_device

    gpu = default_device().type == "cuda"
    assert ("demo on cuda:0 (default: a GPU" if gpu else "demo on emulated:0 (default: no GPU") in out.stdout
    for step in ("allocate device pool", "fill", "copy D2H", "copy H2D", "verify"):
        assert step in out.stderr, step
    quiet = _cli("demo", "--layers", "2", "--device-pages", "4", "--host-pages", "6", "--pages", "3", "--json",
                 "--device", "emulated:0")
    assert quiet.returncode == 0 and quiet.stderr == ""
    result = json.loads(quiet.stdout)
    assert result["ok"] is True and result["device"] == "emulated:0" and result["device_choice"] == "--device"


@pytest.mark.slow
def test_module_entry_point_uses_the_same_conventions() -> None:
    out = subprocess.run([sys.executable, "-m", "pointerdomain.tools.cli", "demo", "--device", "cpu"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "--device emulated:0" in out.stderr and "Traceback" not in out.stderr
