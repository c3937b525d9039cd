"""Command line of ``pointerdomain audit`` (also ``python -m pointerdomain.audit`` and the
``pointerdomain-audit`` script, which import no torch).

Exit status: 0 no new findings; 1 new findings (or, with ``--fix``, findings left
after fixing); 2 a usage or configuration error (bad option, missing path, invalid
``[tool.pointerdomain.audit]``, unreadable baseline or config, an ``-o`` or
``--write-baseline`` file that cannot be written), told in one line on stderr; 3 no new finding, but files were
not audited (size cap, timeout, PD901) and ``--allow-skipped`` / ``allow_skipped`` is off.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import multiprocessing
import os
import stat
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import cast

import libcst as cst

from pointerdomain.audit.autofix import FixStyle, check_fix, fix_source, warm_mypy
from pointerdomain.audit.baseline import read_baseline, split_baselined, write_baseline
from pointerdomain.audit.config import AuditConfig, ConfigError, find_config, load_config
from pointerdomain.audit.engine import NOT_REGULAR, Progress, audit_paths, discover, timed_audit_file
from pointerdomain.audit.output import FORMATS, Format, Summary, render
from pointerdomain.audit.rules import RULES

__all__ = ["add_arguments", "main", "run"]

_VERSION = "0.1.0"
EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, EXIT_SKIPPED = 0, 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the audit's options to ``parser`` (the ``audit`` subcommand or a standalone parser)."""
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                        help="files or directories (default: [tool.pointerdomain.audit] paths, else .)")
    parser.add_argument("--format", choices=FORMATS, default="text", help="report format (default text)")
    parser.add_argument("--output", "-o", type=Path, help="write the report here instead of stdout")
    parser.add_argument("--config", type=Path,
                        help="TOML file with [tool.pointerdomain.audit] (default: nearest pyproject.toml that has it)")
    parser.add_argument("--baseline", type=Path, help="findings recorded in this file do not fail (default: config)")
    parser.add_argument("--no-baseline", action="store_true", help="ignore the configured baseline")
    parser.add_argument("--write-baseline", type=Path, metavar="FILE",
                        help="record every current finding in FILE and exit 0")
    parser.add_argument("--select", help="comma-separated code prefixes to run (overrides the config)")
    parser.add_argument("--ignore", help="comma-separated code prefixes to skip (added to the config)")
    parser.add_argument("--fix", action="store_true", help="rewrite fixable PD001 sites in place (each file checked: it re-parses and mypy "
                        "--check-untyped-defs reports no new error), then report")
    parser.add_argument("--diff", action="store_true", help="with --fix: print the checked rewrite as a diff, write nothing (a dry run)")
    parser.add_argument("--fix-style", choices=["table", "tensor"], default="table",
                        help="table: a typed PointerTable (default); tensor: ...as_uint64_tensor(), written only where "
                        "it is a proven drop-in (the fix proves it nowhere yet: each site is listed with the reason)")
    parser.add_argument("--jobs", "-j", type=int, default=0, help="worker processes (default: config, else CPUs)")
    parser.add_argument("--progress", choices=["auto", "bar", "lines", "none"], default="auto",
                        help="progress on stderr (auto: a bar on a terminal, else a line per 500 files)")
    parser.add_argument("--max-file-kb", type=int, help="skip (and report) files larger than this (default: "
                        "config max_file_kb, else 1024)")
    parser.add_argument("--file-timeout", type=float, help="seconds per file before it is skipped and reported "
                        "(default: config file_timeout, else 60)")
    parser.add_argument("--allow-skipped", action="store_true", default=None,
                        help="files not audited (size cap, timeout, parse error) do not fail the run (default: "
                        "config allow_skipped, else they do: exit status 3 when there is no new finding)")
    parser.add_argument("--list-rules", action="store_true", help="print the rule catalogue and exit")


def _codes(text: str | None) -> tuple[str, ...]:
    return tuple(c.strip() for c in text.split(",") if c.strip()) if text else ()


def _config(args: argparse.Namespace) -> AuditConfig:
    source = args.config if args.config is not None else find_config(Path.cwd())
    if args.config is not None and not args.config.is_file():
        raise ConfigError(f"--config {args.config}: no such file")
    config = load_config(source)
    update: dict[str, object] = {}
    if args.select is not None:
        update["select"] = _codes(args.select)
    if args.ignore is not None:
        update["ignore"] = config.ignore + _codes(args.ignore)
    if getattr(args, "max_file_kb", None) is not None:
        update["max_file_kb"] = args.max_file_kb
    if getattr(args, "file_timeout", None) is not None:
        update["file_timeout"] = float(args.file_timeout)
    if getattr(args, "allow_skipped", None):
        update["allow_skipped"] = True
    if update:
        try:
            config = AuditConfig.model_validate(config.model_dump() | update | {"root": config.root,
                                                                                  "source": config.source})
        except ValueError as exc:
            raise ConfigError(f"--select/--ignore/--max-file-kb/--file-timeout: {exc}") from None
    return config


def _reported_sites(path: Path, config: AuditConfig, known: Counter[str] | None) -> set[tuple[int, int]] | str:
    """(line, column) of the PD001 findings of ``path`` that the audit reports as new, after
    ``select``/``ignore``, ``per_file_ignores``, inline suppressions and the baseline; or why
    the file was skipped (``max_file_kb``, ``file_timeout``)."""
    r = timed_audit_file(path, config)
    if r.skipped is not None:
        return r.skipped
    findings = list(r.findings)
    new = split_baselined(findings, known)[0] if known is not None else findings
    return {(f.line, f.col) for f in new if f.code == "PD001"}


_BOM = b"\xef\xbb\xbf"


@dataclasses.dataclass(frozen=True)
class _FileFix:
    """One file's fix, computed in the fix process: the bytes to write (None: nothing to
    write), the sites rewritten, the lines for stderr, and the unified diff (``--diff``)."""

    rel: str
    data: bytes | None = None
    fixes: int = 0
    messages: tuple[str, ...] = ()
    diff: str = ""
    skipped: bool = False


def _fix_file(path: Path, config: AuditConfig, style: FixStyle, known: Counter[str] | None,
              before_check: Callable[[], None] = lambda: None) -> _FileFix:
    """The checked rewrite of one file, nothing written. The text is decoded without newline
    translation and a UTF-8 BOM is kept aside, so the bytes written differ from the file's
    only at the rewritten sites (and the added import)."""
    rel = config.relative(path)
    try:
        raw = path.read_bytes()
        bom = raw.startswith(_BOM)
        text = raw[len(_BOM) if bom else 0:].decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return _FileFix(rel, messages=(f"{rel}: not fixed: cannot read the file: {exc}",))
    if "data_ptr" not in text:
        return _FileFix(rel)
    # only what the audit reports is rewritten: a suppressed, ignored or baselined site stays
    sites = _reported_sites(path, config, known)
    if isinstance(sites, str):
        return _FileFix(rel, messages=(f"{rel}: not fixed: skipped ({sites})",), skipped=True)
    if not sites:
        return _FileFix(rel)
    try:
        result = fix_source(text, style, sites)
    except cst.ParserSyntaxError:
        return _FileFix(rel)
    except RecursionError:
        return _FileFix(rel, messages=(f"{rel}: not fixed: an expression is nested too deeply for libcst "
                                       "(RecursionError)",))
    messages = [f"{rel}:{line}: not fixed: {reason}" for line, reason in result.refused]
    if not result.fixes:
        return _FileFix(rel, messages=tuple(messages))
    before_check()
    check = check_fix(text, result.code, path.name)
    if not check.ok:
        messages.append(f"{rel}: {result.fixes} fix(es) refused: {check.reason}")
        messages.extend(f"    {m}" for m in check.new_errors)
        return _FileFix(rel, messages=tuple(messages))
    diff = "".join(difflib.unified_diff(text.splitlines(keepends=True), result.code.splitlines(keepends=True),
                                        f"a/{rel}", f"b/{rel}"))
    return _FileFix(rel, (_BOM if bom else b"") + result.code.encode("utf-8"), result.fixes, tuple(messages), diff)


_WARMING, _WARM = "warming", "warm"


def _fix_loop(conn: Connection, config: AuditConfig, style: FixStyle, known: Counter[str] | None) -> None:
    """The fix process: one file per request, until the parent sends None. Before its first
    mypy check it warms mypy's cache (torch's stubs: 30 s or more cold) and tells the parent,
    whose clock for the file stops meanwhile."""
    warmed = False

    def warm() -> None:
        nonlocal warmed
        if not warmed:
            conn.send(_WARMING)
            warm_mypy()
            conn.send(_WARM)
            warmed = True

    while True:
        path = conn.recv()
        if path is None:
            return
        try:
            result = _fix_file(path, config, style, known, warm)
        except Exception as exc:  # a defect in the fix must not end the run
            rel = config.relative(path)
            result = _FileFix(rel, messages=(f"{rel}: not fixed: {type(exc).__name__}: {exc}",))
        conn.send(result)


class _FixProcess:
    """Runs :func:`_fix_file` in a child process so a file can be stopped at any point (a
    stall inside libcst's native parser or mypy's compiled code does not see SIGALRM): past
    ``config.file_timeout`` the child is killed, the file reported as skipped, and a fresh
    child takes the next file. The parent alone writes, after the child's answer."""

    def __init__(self, config: AuditConfig, style: FixStyle, known: Counter[str] | None) -> None:
        self.args = (config, style, known)
        # `fork` from the CLI (no torch, no threads: see engine._results); else `spawn`, which
        # also gives the child the environment of now (MYPY_CACHE_DIR)
        safe_fork = "fork" in multiprocessing.get_all_start_methods() and "torch" not in sys.modules \
            and threading.active_count() == 1
        self.ctx = multiprocessing.get_context("fork" if safe_fork else "spawn")
        self.proc: BaseProcess | None = None
        self.conn: Connection | None = None

    def _start(self) -> Connection:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_fix_loop, args=(child, *self.args), daemon=True)  # type: ignore[attr-defined]
        self.proc.start()
        child.close()
        self.conn = parent
        return parent

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def fix(self, path: Path, timeout: float) -> _FileFix:
        rel = self.args[0].relative(path)
        conn = self.conn if self.conn is not None else self._start()
        conn.send(path)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    reason = f"the fix did not finish within file_timeout = {timeout:g} s"
                    break
                answer: _FileFix | str = conn.recv()
                if answer != _WARMING:
                    assert isinstance(answer, _FileFix)
                    return answer
                # mypy's one-time start is not the file's: bounded apart, at 10 x file_timeout
                started = time.monotonic()
                if not conn.poll(10 * timeout):
                    reason = f"mypy did not start within 10 x file_timeout = {10 * timeout:g} s"
                    break
                conn.recv()
                deadline += time.monotonic() - started
        except (EOFError, OSError):
            reason = "the fix process ended without an answer"
        self._stop()
        return _FileFix(rel, messages=(f"{rel}: not fixed: skipped ({reason}; nothing written)",), skipped=True)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
            except OSError:
                pass
        if self.proc is not None:
            self.proc.join(5)
        self._stop()


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename: an interrupted run leaves the old file or the
    new one, never a part; the file's permission bits are kept. A symlink is followed: its
    target is rewritten and the link stays a link."""
    path = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_regular(path: Path) -> bytes | None:
    """The bytes of ``path``, or None when it is not a regular file (a FIFO, socket or
    device: opened without blocking and never read)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read()


def _fix(paths: Sequence[Path], config: AuditConfig, style: FixStyle, diff: bool, known: Counter[str] | None) -> int:
    total = skipped = 0
    worker = _FixProcess(config, style, known)
    try:
        for path in discover(paths, config):
            if path.suffix != ".py":
                continue
            try:
                data = _read_regular(path)
            except OSError as exc:
                print(f"{config.relative(path)}: not fixed: cannot read the file: {exc}", file=sys.stderr)
                continue
            if data is None:  # a FIFO would block the read for ever: skipped, as the audit skips it
                print(f"{config.relative(path)}: not fixed: skipped ({NOT_REGULAR})", file=sys.stderr)
                skipped += 1
                continue
            if b"data_ptr" not in data:
                continue  # no PD001 site: not worth a round trip to the fix process
            result = worker.fix(path, config.file_timeout)
            for line in result.messages:
                print(line, file=sys.stderr)
            skipped += result.skipped
            if result.data is None:
                continue
            if diff:
                sys.stdout.write(result.diff)
            else:
                try:
                    _write_atomically(path, result.data)
                except OSError as exc:  # the file stays as it was, and so does its finding
                    print(f"{result.rel}: not fixed: cannot write the file: {exc.strerror or exc}", file=sys.stderr)
                    continue
            total += result.fixes
    finally:
        worker.close()
    print(f"pointerdomain audit --fix: {total} site(s) {'would be ' if diff else ''}rewritten"
          + (f"; {skipped} file(s) skipped" if skipped else ""), file=sys.stderr)
    return total


def run(args: argparse.Namespace) -> int:
    """Run the audit for parsed ``args``; returns the exit status."""
    if args.list_rules:
        for r in RULES.values():
            print(f"{r.code}  {r.name}: {r.summary}\n       fix: {r.fix}")
        return EXIT_CLEAN
    if args.jobs < 0:
        print("error: --jobs must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    if args.diff and not args.fix:
        print("error: --diff needs --fix", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = _config(args)
        paths = list(args.paths) or [config.root / p for p in config.paths] or [Path(".")]
        baseline: Path | None = None
        if args.baseline is not None:
            baseline = args.baseline
        elif config.baseline and not args.no_baseline and args.write_baseline is None:
            baseline = config.root / config.baseline
            if not baseline.exists():
                baseline = None  # a configured baseline not written yet: everything is new
        if args.fix:
            known = read_baseline(baseline) if baseline is not None else None
            _fix(paths, config, cast(FixStyle, args.fix_style), args.diff, known)
        result = audit_paths(paths, config, jobs=args.jobs or None, progress=cast(Progress, args.progress),
                             baseline=baseline)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.write_baseline is not None:
        try:
            write_baseline(args.write_baseline, result.findings)
        except ConfigError as exc:
            print(f"error: --write-baseline: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"pointerdomain audit: wrote {len(result.findings)} finding(s) to {args.write_baseline}", file=sys.stderr)
        for skip in result.skipped:  # their findings, if any, are not in the baseline
            print(f"{skip.path}: skipped: {skip.skipped}", file=sys.stderr)
        return EXIT_CLEAN
    summary = Summary(result.files, len(result.new), len(result.baselined), result.suppressed, result.stale,
                      result.seconds, len(result.skipped), not config.allow_skipped)
    report = render(cast(Format, args.format), result.new, summary, _VERSION, result.per_file)
    if args.output is not None:
        try:
            args.output.write_text(report, encoding="utf-8")
        except OSError as exc:
            print(f"error: -o {args.output}: cannot write: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
        print(summary.line(), file=sys.stderr)
    else:
        sys.stdout.write(report)
        if args.format != "text":
            print(summary.line(), file=sys.stderr)
    if result.new:
        return EXIT_FINDINGS
    return EXIT_SKIPPED if result.skipped and not config.allow_skipped else EXIT_CLEAN


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``pointerdomain-audit``, ``python -m pointerdomain.audit``)."""
    parser = argparse.ArgumentParser(prog="pointerdomain audit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
