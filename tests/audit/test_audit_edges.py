"""Inputs at the edges of what the audit reads: FIFOs and unlistable directories, BOMs,
characters `str.splitlines` takes for line breaks, suppressions on `match`, SARIF URIs of
odd paths, and addresses that are only printed, compared or hashed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pointerdomain.audit import AuditConfig, audit_file
from pointerdomain.audit.engine import NOT_REGULAR, audit_paths
from pointerdomain.audit.output import Summary, render
from pointerdomain.audit.rules import Finding, source_lines
from pointerdomain.audit.suppressions import python_statement_spans
from tests import childenv

_SITE = "import torch\nx = [t.data_ptr() + 1 for t in ts]\n"


def _audit(tmp_path: Path, name: str, data: bytes) -> tuple[list[Finding], int]:
    path = tmp_path / name
    path.write_bytes(data)
    return audit_file(path, AuditConfig(root=tmp_path))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_skipped_unread_by_the_audit_and_by_the_fix(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    os.mkfifo(tree / "pipe.py")
    (tree / "clean.py").write_text("x = 1\n")
    t0 = time.perf_counter()
    run = audit_paths([tree], AuditConfig(root=tmp_path, file_timeout=30.0), jobs=1, progress="none")
    assert time.perf_counter() - t0 < 20  # not read, so no wait for the file timeout
    assert [(r.path, r.skipped) for r in run.skipped] == [("tree/pipe.py", NOT_REGULAR)]
    # --fix: the parent never blocks on it; skipped, and the gate fails (exit 3)
    env = dict(os.environ, PYTHONPATH=childenv.pythonpath())
    out = subprocess.run([sys.executable, "-m", "pointerdomain.audit", "--progress", "none", "--no-baseline",
                          "--file-timeout", "30", "--fix", "tree"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert f"tree/pipe.py: not fixed: skipped ({NOT_REGULAR})" in out.stderr, out.stderr
    assert "0 site(s) rewritten; 1 file(s) skipped" in out.stderr
    assert out.returncode == 3


def test_a_directory_that_cannot_be_listed_fails_the_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = tmp_path / "tree"
    (tree / "private").mkdir(parents=True)
    (tree / "private" / "bad.py").write_text(_SITE)
    (tree / "ok.py").write_text("x = 1\n")
    real = os.scandir

    def scandir(path: str | os.PathLike[str] = ".") -> object:
        if Path(path).name == "private":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    run = audit_paths([tree], AuditConfig(root=tmp_path), jobs=1, progress="none")
    assert run.files == 1 and not run.new
    assert [(r.path, r.skipped) for r in run.skipped] == [
        ("tree/private", "cannot list the directory: Permission denied")]
    from pointerdomain.audit.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(["--progress", "none", "--no-baseline", "tree"]) == 3


def test_a_bom_is_no_character_of_the_source(tmp_path: Path) -> None:
    found, _ = _audit(tmp_path, "clean.py", b"\xef\xbb\xbfx = 1\nprint(x)\n")
    assert found == []  # not PD901 "invalid non-printable character U+FEFF"
    found, _ = _audit(tmp_path, "site.py", b"\xef\xbb\xbf" + _SITE.encode())
    assert [(f.line, f.col, f.code) for f in found] == [(2, 5, "PD002")]
    run = audit_paths([tmp_path / "clean.py"], AuditConfig(root=tmp_path), jobs=1, progress="none")
    assert run.skipped == ()


@pytest.mark.parametrize("brk", ["\x0c", "\x0b", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"])
def test_characters_splitlines_breaks_at_do_not_shift_lines(tmp_path: Path, brk: str) -> None:
    text = f"import torch\n# section 2 {brk}\n\ndef f(ts, out):\n" \
        "    # pointerdomain: ignore[PD002] addresses only logged\n" \
        "    ptrs = [t.data_ptr() + 8 for t in ts]\n    out(ptrs)\n"
    assert len(source_lines(text)) == 7
    found, suppressed = _audit(tmp_path, "sup.py", text.encode())
    assert found == [] and suppressed == 1
    unsuppressed = text.replace("    # pointerdomain: ignore[PD002] addresses only logged\n", "")
    found, _ = _audit(tmp_path, "bare.py", unsuppressed.encode())
    assert [(f.line, f.snippet) for f in found] == [(5, "ptrs = [t.data_ptr() + 8 for t in ts]")]


def test_source_lines_ends_lines_where_python_does() -> None:
    assert source_lines("a\r\nb\rc\x0cd\n\ne") == ["a", "b", "c\x0cd", "", "e"]
    assert source_lines("a\r\nb\n", keepends=True) == ["a\r\n", "b\n"]
    assert source_lines("") == [] and source_lines("x") == ["x"]


_MATCH = '''import torch


def f(kind, ts, out):
    match kind:  # pointerdomain: ignore[PD002] the kind names a host-only layout
        case "a":
            out.append([t.data_ptr() + 1 for t in ts])
        case "b":
            out.extend([t.data_ptr() + 2 for t in ts])


def g(kind, ts, out):
    match kind:
        case "a":
            out.append([t.data_ptr() + 1 for t in ts])
        case "b":
            out.extend([t.data_ptr() + 2 for t in ts])  # pointerdomain: ignore[PD002] this case only


def h(ts, out):
    try:  # pointerdomain: ignore[PD002] the header only
        out.append([t.data_ptr() + 3 for t in ts])
    except (ValueError,
            TypeError):
        out.append([t.data_ptr() + 4 for t in ts])
'''


def test_a_suppression_on_a_compound_header_covers_the_header_only(tmp_path: Path) -> None:
    found, suppressed = _audit(tmp_path, "m.py", _MATCH.encode())
    assert sorted(f.line for f in found) == [7, 9, 15, 22, 25]
    assert suppressed == 1
    spans = python_statement_spans(_MATCH)
    assert (5, 9) not in spans and (13, 17) not in spans and (23, 24) in spans


def test_sarif_uris_are_encoded_relative_references_or_absolute_file_uris(tmp_path: Path) -> None:
    outside = (tmp_path / "elsewhere" / "abs file.py").as_posix()
    findings = [Finding(p, 2, 5, "PD002", "m", "f", "s") for p in ("sp ace/f ile.py", "h#sh/a%20b.py", "c:x.py",
                                                                   outside, "../up.py")]
    log = json.loads(render("sarif", findings, Summary(3, 3, 0, 0, 0, 0.1), "0"))
    locations = [r["locations"][0]["physicalLocation"]["artifactLocation"]
                 for r in log["runs"][0]["results"]]
    by_uri = {loc["uri"]: loc.get("uriBaseId") for loc in locations}
    assert by_uri["sp%20ace/f%20ile.py"] == "%SRCROOT%"
    assert by_uri["h%23sh/a%2520b.py"] == "%SRCROOT%"
    assert by_uri["c%3Ax.py"] == "%SRCROOT%"  # not read as a URI scheme
    assert by_uri[Path(outside).as_uri()] is None and Path(outside).as_uri().startswith("file:///")
    assert by_uri[(Path.cwd().parent / "up.py").resolve().as_uri()] is None


_PRINTED = '''import logging

import torch


def dbg(t: torch.Tensor, off: int) -> None:
    print(f"buffer at {t.data_ptr() + off:#x}")
    print("at %#x" % (t.data_ptr() + off))
    print("at {:#x}".format(t.data_ptr() + off))
    print(t.data_ptr() + off)
    logging.info("at %x", t.data_ptr() + off)


def used(t: torch.Tensor, off: int) -> int:
    return t.data_ptr() + off
'''

_CPP = r'''#include <torch/extension.h>
#include <cstdio>
#include <functional>
#include <iostream>

bool same_buffer(const torch::Tensor& a, const torch::Tensor& b) {
  return reinterpret_cast<uintptr_t>(a.data_ptr()) == reinterpret_cast<uintptr_t>(b.data_ptr());
}

bool other_buffer(const torch::Tensor& a, void* p) {
  return p != reinterpret_cast<void*>(0) && (uint64_t)a.data_ptr() != 0;
}

size_t hash_tensor(const torch::Tensor& t) {
  return std::hash<uintptr_t>{}(reinterpret_cast<uintptr_t>(t.data_ptr()));
}

void log_it(const torch::Tensor& t) {
  printf("ptr %lx\n", (unsigned long)reinterpret_cast<uintptr_t>(t.data_ptr()));
  std::cout << "ptr " << reinterpret_cast<uintptr_t>(t.data_ptr()) << std::endl;
}

// old code, commented out with a line continuation: \
auto a = reinterpret_cast<uint64_t>(t.data_ptr());

uint64_t used(const torch::Tensor& t) {
  return reinterpret_cast<uint64_t>(t.data_ptr()) + 64;
}
'''


def test_an_address_only_printed_compared_or_hashed_is_no_finding(tmp_path: Path) -> None:
    found, _ = _audit(tmp_path, "p.py", _PRINTED.encode())
    assert [(f.line, f.code) for f in found] == [(15, "PD002")]  # the returned sum alone
    found, _ = _audit(tmp_path, "k.cpp", _CPP.encode())
    assert [(f.line, f.code) for f in found] == [(27, "PD102")]  # the address used in arithmetic alone
