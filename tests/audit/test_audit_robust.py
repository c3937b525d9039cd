"""Files the analysis cannot handle are reported (PD901 for the audit, "not fixed" for
``--fix``) and the run goes on to the next file."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pointerdomain.audit.cli import main
from pointerdomain.audit.config import AuditConfig
from pointerdomain.audit.engine import audit_paths


@pytest.fixture(autouse=True)
def default_recursion_limit() -> Iterator[None]:
    """CPython's default limit: mypy (run in-process by other tests and by --fix's check)
    raises it, and with a higher limit a 400-term sum is walked to its end."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(old)


def _long_sum(terms: int) -> str:
    return "import torch\n\ndef f(t):\n    return " + " + ".join(["t.data_ptr()"] * terms) + "\n"


def _long_concat(terms: int) -> str:
    return "from ext import op\n\ndef g(t):\n    s = " + " + ".join(['"x"'] * terms) + "\n    op(t.data_ptr(), s)\n"


_OTHER = "import torch\n\ndef h(bufs):\n    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)\n"


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_too_deep_expression_is_a_pd901_and_the_run_goes_on(tmp_path: Path, jobs: int) -> None:
    (tmp_path / "deep_sum.py").write_text(_long_sum(400))
    (tmp_path / "deep_concat.py").write_text(_long_concat(400))
    # enough files for the worker pool to start with jobs=2
    for i in range(50):
        (tmp_path / f"ok{i:02d}.py").write_text(_OTHER)
    result = audit_paths([tmp_path], AuditConfig(root=tmp_path), jobs=jobs, progress="none")
    assert result.files == 52
    by_file = {f.path: f for f in result.findings if f.code == "PD901"}
    assert sorted(by_file) == ["deep_concat.py", "deep_sum.py"]
    assert "RecursionError" in by_file["deep_sum.py"].message
    # every other file was audited: one PD001 each, on line 4
    pd001 = [f for f in result.findings if f.code == "PD001"]
    assert len(pd001) == 50 and {f.line for f in pd001} == {4}


def test_cli_reports_a_too_deep_expression(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "deep_sum.py").write_text(_long_sum(400))
    (tmp_path / "ok.py").write_text(_OTHER)
    monkeypatch.chdir(tmp_path)
    rc = main(["--progress", "none", "--format", "text", "."])
    out = capsys.readouterr().out
    assert rc == 1
    assert "deep_sum.py:1:1: PD901" in out and "ok.py:4:" in out


FIX_CASES = Path(__file__).with_name("audit_cases") / "fix"
_TABLE = ("import torch\n\ndef build(bufs, device) -> object:\n"
          "    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)\n")
_FIXED = "    return make_kernel_ptr_table("


def _fix_cli(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    # a generous per-file limit: mypy's check is slow on a loaded machine (the limit itself is
    # tested in test_audit_fix.py)
    pytest.importorskip("mypy")  # --fix checks each rewrite with mypy and refuses all without it
    rc = main(["--progress", "none", "--fix", "--file-timeout", "600", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_fix_reports_an_undecodable_file_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # a.py is fixed first, then b.py cannot be decoded, then c.py is fixed
    (tmp_path / "a.py").write_text(_TABLE)
    latin1 = ("# caf\xe9\n" + _TABLE).encode("latin-1")
    (tmp_path / "b.py").write_bytes(latin1)
    (tmp_path / "c.py").write_text(_TABLE)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _fix_cli(tmp_path, capsys, "--diff", ".")
    assert "b.py: not fixed: cannot read the file:" in err and "can't decode" in err
    assert "2 site(s) would be rewritten" in err and "+++ b/a.py" in out and "+++ b/c.py" in out
    rc, out, err = _fix_cli(tmp_path, capsys, ".")
    assert rc == 1 and "b.py:1:1: PD901" in out  # the audit after the fix reports it
    assert _FIXED in (tmp_path / "a.py").read_text() and _FIXED in (tmp_path / "c.py").read_text()
    assert (tmp_path / "b.py").read_bytes() == latin1


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_fix_reports_a_too_deep_expression_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.py").write_text(_long_sum(400))
    (tmp_path / "b.py").write_text(_TABLE)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _fix_cli(tmp_path, capsys, ".")
    assert rc == 1 and "a.py:1:1: PD901" in out
    assert _FIXED in (tmp_path / "b.py").read_text() and "1 site(s) rewritten" in err


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_fix_rewrites_only_reported_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    case = (FIX_CASES / "filtered.py").read_text()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "filtered.py").write_text(case)
    monkeypatch.chdir(tmp_path)
    # inline suppressions: the two suppressed sites stay as they are
    rc, out, err = _fix_cli(tmp_path, capsys, "--diff", "pkg")
    assert "1 site(s) would be rewritten" in err
    changed = [line for line in out.splitlines() if line.startswith("-    ") or line.startswith("+    ")]
    assert len(changed) == 2 and changed[1].startswith("+" + _FIXED), out
    assert changed[0] == "-    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)"
    assert "pointerdomain: ignore[PD001] legacy" in case  # and the trailing one is the other return line
    # --ignore, --select: nothing is reported, nothing is rewritten
    for args in (("--ignore", "PD001"), ("--select", "PD002")):
        rc, out, err = _fix_cli(tmp_path, capsys, *args, "pkg")
        assert rc == 0 and "0 site(s) rewritten" in err
    # per_file_ignores of the config
    (tmp_path / "pyproject.toml").write_text('[tool.pointerdomain.audit]\nper_file_ignores = { "pkg/*" = ["PD001"] }\n')
    rc, out, err = _fix_cli(tmp_path, capsys, "pkg")
    assert rc == 0 and "0 site(s) rewritten" in err
    # the baseline: a recorded site is not rewritten, an explicit --no-baseline rewrites it
    (tmp_path / "pyproject.toml").write_text('[tool.pointerdomain.audit]\nbaseline = "audit-baseline.json"\n')
    assert main(["--progress", "none", "--write-baseline", "audit-baseline.json", "pkg"]) == 0
    capsys.readouterr()
    rc, out, err = _fix_cli(tmp_path, capsys, "pkg")
    assert rc == 0 and "0 site(s) rewritten" in err
    assert (pkg / "filtered.py").read_text() == case
    rc, out, err = _fix_cli(tmp_path, capsys, "--no-baseline", "pkg")
    assert "1 site(s) rewritten" in err
    fixed = (pkg / "filtered.py").read_text()
    assert fixed.count("torch.tensor([b.data_ptr()") == 2 and fixed.count(_FIXED) == 1


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_fix_leaves_a_file_above_max_file_kb(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    big = _TABLE + "# padding\n" * 300  # about 3 KiB
    (tmp_path / "big.py").write_text(big)
    (tmp_path / "small.py").write_text(_TABLE)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _fix_cli(tmp_path, capsys, "--max-file-kb", "2", ".")
    assert "big.py: not fixed: skipped (3 KiB, above max_file_kb = 2)" in err
    assert (tmp_path / "big.py").read_text() == big and _FIXED in (tmp_path / "small.py").read_text()


def test_a_symlink_loop_is_a_pd901_and_a_linked_file_is_audited_once(tmp_path: Path) -> None:
    (tmp_path / "loop.py").symlink_to("loop.py")
    (tmp_path / "real.py").write_text(_OTHER)
    (tmp_path / "alias.py").symlink_to("real.py")
    result = audit_paths([tmp_path], AuditConfig(root=tmp_path))
    seen = sorted((f.path, f.code) for f in result.findings)
    assert seen == [("loop.py", "PD901"), ("real.py", "PD001")]


# -- files not audited are visible: text, JSON, SARIF and the exit status ---------------


_BAD = "def f(x):\n    return x.data_ptr(\n"  # a trigger word, and no parse


def _gate(root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
          *args: str) -> tuple[int, str, str]:
    monkeypatch.chdir(root)
    rc = main(["--progress", "none", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("how", ["ignore", "per_file_ignores", "baseline"])
def test_an_unparsed_file_fails_the_gate_even_when_pd901_is_silenced(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    (tmp_path / "bad.py").write_text(_BAD)
    (tmp_path / "clean.py").write_text("def g(x):\n    return x + 1\n")
    config = {"ignore": 'ignore = ["PD901"]\n', "per_file_ignores": 'per_file_ignores = { "bad.py" = ["PD9"] }\n',
              "baseline": 'baseline = "base.json"\n'}[how]
    (tmp_path / "pyproject.toml").write_text("[tool.pointerdomain.audit]\n" + config)
    if how == "baseline":
        assert _gate(tmp_path, capsys, monkeypatch, "--write-baseline", "base.json", ".")[0] == 0
    rc, out, _ = _gate(tmp_path, capsys, monkeypatch, ".")
    assert rc == 3, out  # no new finding, but one file was not audited
    assert "bad.py: skipped: libcst cannot parse this file" in out and "1 file(s) skipped" in out
    assert "PD901" not in out.split("bad.py: skipped")[0]  # the finding itself stays silenced
    # accepted explicitly: the option, or the configuration key
    assert _gate(tmp_path, capsys, monkeypatch, "--allow-skipped", ".")[0] == 0
    (tmp_path / "pyproject.toml").write_text("[tool.pointerdomain.audit]\n" + config + "allow_skipped = true\n")
    assert _gate(tmp_path, capsys, monkeypatch, ".")[0] == 0
    # excluding the file is the other way to accept it
    (tmp_path / "pyproject.toml").write_text("[tool.pointerdomain.audit]\n" + config + 'exclude = ["bad.py"]\n')
    assert _gate(tmp_path, capsys, monkeypatch, ".")[0] == 0


def test_skipped_files_in_json_and_sarif(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.py").write_text(_BAD)
    (tmp_path / "big.py").write_text("import torch\n" + "x = 1\n" * 400)  # ~2.4 KiB: above a 1 KiB cap
    (tmp_path / "ok.py").write_text("def g(x):\n    return x + 1\n")
    args = ("--max-file-kb", "1", "--ignore", "PD901", ".")
    rc, out, err = _gate(tmp_path, capsys, monkeypatch, "--format", "json", *args)
    report = json.loads(out)
    assert rc == 3 and report["findings"] == [] and report["summary"]["skipped"] == 2
    assert [s["path"] for s in report["skipped"]] == ["bad.py", "big.py"]
    reasons = {s["path"]: s["reason"] for s in report["skipped"]}
    assert reasons["big.py"].endswith("above max_file_kb = 1") and "cannot parse" in reasons["bad.py"]
    assert {f["path"]: f["skipped"] for f in report["files"]} == {**reasons, "ok.py": None}
    assert "(not audited: this fails the run" in err

    rc, out, _ = _gate(tmp_path, capsys, monkeypatch, "--format", "sarif", *args)
    (run,) = json.loads(out)["runs"]
    assert rc == 3 and run["results"] == []
    (invocation,) = run["invocations"]
    assert invocation["executionSuccessful"] is False
    notes = invocation["toolExecutionNotifications"]
    assert [n["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for n in notes] == ["bad.py", "big.py"]
    assert all(n["level"] == "error" and "was not audited" in n["message"]["text"] for n in notes)

    rc, out, _ = _gate(tmp_path, capsys, monkeypatch, "--format", "sarif", "--allow-skipped", *args)
    (invocation,) = json.loads(out)["runs"][0]["invocations"]
    assert rc == 0 and invocation["executionSuccessful"] is True
    assert [n["level"] for n in invocation["toolExecutionNotifications"]] == ["warning", "warning"]
    # a clean tree: no notification, a successful run
    (tmp_path / "bad.py").unlink()
    (tmp_path / "big.py").unlink()
    rc, out, _ = _gate(tmp_path, capsys, monkeypatch, "--format", "sarif", ".")
    (invocation,) = json.loads(out)["runs"][0]["invocations"]
    assert rc == 0 and invocation == {"executionSuccessful": True, "toolExecutionNotifications": []}


def test_new_findings_take_precedence_over_skipped_files(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.py").write_text(_BAD)
    (tmp_path / "ok.py").write_text(_OTHER)
    rc, out, _ = _gate(tmp_path, capsys, monkeypatch, ".")
    assert rc == 1 and "bad.py:2:1: PD901" in out and "ok.py:4:" in out and "bad.py: skipped:" in out


def test_a_timed_out_file_fails_the_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    body = "".join(f"    a{i} = t.data_ptr() + {i}  # pointerdomain: ignore[PD002] test body\n" for i in range(3000))
    (tmp_path / "slow.py").write_text("def f(t):\n" + body)
    rc, out, _ = _gate(tmp_path, capsys, monkeypatch, "--file-timeout", "0.5", "-j", "1", ".")
    assert rc == 3 and "slow.py: skipped: not finished within file_timeout = 0.5 s" in out
    rc, out, _ = _gate(tmp_path, capsys, monkeypatch, ".")  # with room it is audited, everything suppressed
    assert rc == 0 and "3000 suppressed" in out


def test_an_analysis_failure_is_a_skipped_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import pointerdomain.audit.engine as engine

    def broken(path: str, text: str, rules: object) -> list[object]:
        raise ValueError("an odd node")

    (tmp_path / "a.py").write_text(_OTHER)
    monkeypatch.setattr(engine, "audit_python_source", broken)
    result = audit_paths([tmp_path], AuditConfig(root=tmp_path), jobs=1, progress="none")
    assert [(r.path, r.skipped) for r in result.skipped] == [
        ("a.py", "the audit failed on this file: ValueError: an odd node")]
    assert [f.code for f in result.findings] == ["PD901"]


@pytest.mark.parametrize("args", [("--file-timeout", "inf"), ("--file-timeout", "nan"), ("--file-timeout", "0"),
                                  ("--file-timeout", "1e12"), ("--max-file-kb", "0"), ("--jobs", "-1")])
def test_limits_outside_what_runs_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    rc = main(["--progress", "none", *args, "."])
    out, err = capsys.readouterr()
    assert rc == 2, (args, out, err)
    assert "Traceback" not in out + err
