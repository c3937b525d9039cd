"""The audit on big trees: progress on stderr without a terminal, per-file times in
JSON, a size cap and a per-file timeout that report the file as skipped and go on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pointerdomain.audit import AuditConfig, audit_paths
from pointerdomain.audit.engine import timed_audit_file

SITE = "import torch\n\ndef f(t):\n    return t.data_ptr() + 8\n"


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # stdout and stderr are pipes here, never a terminal: the non-TTY path
    return subprocess.run([sys.executable, "-m", "pointerdomain.audit", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)


def test_progress_lines_without_a_terminal(tmp_path: Path) -> None:
    for i in range(1100):
        (tmp_path / f"m{i:04d}.py").write_text("x = 1\n")
    (tmp_path / "site.py").write_text(SITE)
    for fmt in ("text", "json", "sarif"):
        r = _cli(tmp_path, "--format", fmt, "-j", "2", ".")
        assert r.returncode == 1, r.stderr
        lines = [x for x in r.stderr.splitlines() if x.startswith("pointerdomain audit: ") and "/1101 files" in x]
        assert [x.split()[2] for x in lines] == ["500/1101", "1000/1101", "1101/1101"], r.stderr
    quiet = _cli(tmp_path, "--progress", "none", ".")
    assert "/1101 files" not in quiet.stderr


def test_size_cap_skips_and_reports(tmp_path: Path) -> None:
    big = tmp_path / "generated_kernels.cu"
    big.write_text("uintptr_t table_addr;\n" * 40_000)  # ~880 KiB
    (tmp_path / "site.py").write_text(SITE)
    r = _cli(tmp_path, "--format", "json", "--max-file-kb", "512", "--select", "PD,PD103", ".")
    report = json.loads(r.stdout)
    files = {f["path"]: f for f in report["files"]}
    assert files["generated_kernels.cu"]["skipped"].startswith("859 KiB, above max_file_kb = 512")
    assert files["site.py"]["skipped"] is None and files["site.py"]["findings"] == 1
    assert all(isinstance(f["seconds"], float) and f["seconds"] >= 0 for f in report["files"])
    assert report["summary"]["skipped"] == 1 and [f["code"] for f in report["findings"]] == ["PD002"]
    assert "1 file(s) skipped" in r.stderr
    text = _cli(tmp_path, "--max-file-kb", "512", ".")
    assert "generated_kernels.cu: skipped: 859 KiB, above max_file_kb = 512" in text.stdout
    # under the default cap (1024 KiB) it is audited
    full = _cli(tmp_path, "--format", "json", "--select", "PD,PD103", ".")
    assert json.loads(full.stdout)["summary"]["skipped"] == 0
    assert sum(f["code"] == "PD103" for f in json.loads(full.stdout)["findings"]) == 40_000


def test_file_timeout_reports_and_goes_on(tmp_path: Path) -> None:
    slow = tmp_path / "slow.py"
    body = "".join(f"    a{i} = t.data_ptr() + {i}\n" for i in range(3000))
    slow.write_text("def f(t):\n" + body)
    fast = tmp_path / "fast.py"
    fast.write_text(SITE)
    config = AuditConfig(root=tmp_path, file_timeout=1.0)
    r = timed_audit_file(slow, config)
    assert r.skipped == "not finished within file_timeout = 1 s" and r.findings == ()
    assert 1.0 <= r.seconds < 10
    run = audit_paths([tmp_path], config, jobs=1, progress="none")
    assert [x.path for x in run.skipped] == ["slow.py"]
    assert [(f.path, f.code) for f in run.findings] == [("fast.py", "PD002")]
    # with room, the same file is audited whole
    assert len(timed_audit_file(slow, AuditConfig(root=tmp_path)).findings) == 3000


def test_config_keys_are_checked(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.pointerdomain.audit]\nmax_file_kb = 0\n")
    (tmp_path / "site.py").write_text(SITE)
    r = _cli(tmp_path, ".")
    assert r.returncode == 2 and "max_file_kb" in r.stderr
    r = _cli(tmp_path, "--config", str(tmp_path / "pyproject.toml"), "--file-timeout", "-1", ".")
    assert r.returncode == 2
