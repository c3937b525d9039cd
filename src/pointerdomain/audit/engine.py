"""The runner: find the files, audit them in worker processes, apply suppressions,
per-file ignores and the baseline.

Files are audited in a :mod:`multiprocessing` pool (``fork`` from the CLI; see
``_results`` for when the forkserver is used instead); trees of fewer than
``_SERIAL_BELOW`` candidate files run in-process, where a pool costs more than it
saves. Progress goes to stderr: a rich bar when stderr is a terminal, else a line every
``_LINE_EVERY`` files. A file above ``max_file_kb`` is not read, one that runs past
``file_timeout`` seconds is abandoned, one that cannot be read, parsed or analysed gives a
PD901 finding; all three are reported as skipped (not audited), and the run goes on.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from pointerdomain.audit.baseline import read_baseline, split_baselined
from pointerdomain.audit.config import AuditConfig, ConfigError
from pointerdomain.audit.cpp_pass import CPP_SUFFIXES, audit_cpp_source, cpp_statement_spans, cpp_suppressions
from pointerdomain.audit.python_pass import PythonRules, audit_python_source
from pointerdomain.audit.rules import RULES, Finding, source_lines
from pointerdomain.audit.suppressions import apply_suppressions, python_comments, python_statement_spans

__all__ = ["NOT_REGULAR", "AuditRun", "FileResult", "Progress", "audit_file", "audit_paths", "discover"]

Progress = Literal["auto", "bar", "lines", "none"]
#: Why a FIFO, socket or device named like a source file is not read (a read may never end).
NOT_REGULAR = "not a regular file (a FIFO, socket or device): not read"
_SERIAL_BELOW = 48
_LINE_EVERY = 500


@dataclasses.dataclass(frozen=True)
class FileResult:
    """One file's outcome: its findings (suppressions applied), the number suppressed, the
    seconds spent on it, and why it was skipped (None when it was audited). A file that
    could not be read, parsed or analysed is skipped even when its PD901 finding is
    ignored, suppressed or baselined: no rule ran on it."""

    path: str
    findings: tuple[Finding, ...]
    suppressed: int
    seconds: float
    skipped: str | None = None


@dataclasses.dataclass(frozen=True)
class AuditRun:
    """What one run found. ``new`` fail the gate; ``baselined`` are recorded in the
    baseline; ``suppressed`` counts findings silenced by a valid inline suppression;
    ``stale`` counts baseline entries that matched nothing."""

    files: int
    new: tuple[Finding, ...]
    baselined: tuple[Finding, ...]
    suppressed: int
    stale: int
    seconds: float
    per_file: tuple[FileResult, ...] = ()

    @property
    def skipped(self) -> tuple[FileResult, ...]:
        """Files not audited: above the size cap, past the per-file timeout, or unreadable,
        unparsable or not analysable (PD901)."""
        return tuple(r for r in self.per_file if r.skipped is not None)

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(sorted(self.new + self.baselined))


def discover(paths: Sequence[Path], config: AuditConfig) -> list[Path]:
    """The Python (and, with ``config.cpp``, C++/CUDA) files under ``paths``, sorted,
    excludes applied. A file named explicitly is audited even if its suffix is unusual.

    Raises:
        ConfigError: a path does not exist.
    """
    return _discover(paths, config)[0]


def _discover(paths: Sequence[Path], config: AuditConfig) -> tuple[list[Path], list[tuple[Path, str]]]:
    """:func:`discover`, and the directories it could not list, each with why: the files
    in them were not audited."""
    unlisted: list[tuple[Path, str]] = []

    def on_error(exc: OSError) -> None:
        where = Path(exc.filename) if exc.filename is not None else Path(".")
        unlisted.append((where, f"cannot list the directory: {exc.strerror or exc}"))

    suffixes = (".py", ".pyi") + (CPP_SUFFIXES if config.cpp else ())
    out: set[Path] = set()
    for p in paths:
        if not p.exists():
            raise ConfigError(f"{p}: no such file or directory")
        if p.is_file():
            out.add(p)
            continue
        for dirpath, dirnames, filenames in os.walk(p, onerror=on_error):
            d = Path(dirpath)
            dirnames[:] = sorted(n for n in dirnames if not config.is_excluded(d / n))
            out.update(d / n for n in filenames if n.endswith(suffixes) and not config.is_excluded(d / n))
    # A file reached twice (a symlink to a file of the run) is audited once, by its own path
    # rather than a link's; a link that resolves nowhere (a loop) stays and reads as PD901.
    by_target: dict[str, Path] = {}
    for path in sorted(out, key=lambda q: (q.is_symlink(), str(q))):
        by_target.setdefault(os.path.realpath(path), path)
    return sorted(by_target.values()), sorted(unlisted)


def audit_file(path: Path, config: AuditConfig, rules: PythonRules | None = None) -> tuple[list[Finding], int]:
    """Audit one file with the enabled rules, suppressions and per-file ignores applied.
    Returns (findings, number suppressed). A file that cannot be read, decoded, parsed or
    analysed gives a PD901 finding."""
    findings, suppressed, _ = _audit(path, config, rules)
    return findings, suppressed


def _not_audited(rel: str, message: str) -> tuple[list[Finding], int, str]:
    return [Finding(rel, 1, 1, "PD901", message, RULES["PD901"].fix)], 0, message


def _audit(path: Path, config: AuditConfig, rules: PythonRules | None) -> tuple[list[Finding], int, str | None]:
    """:func:`audit_file`, and why no rule ran on the file (None when it was audited)."""
    rel = config.relative(path)
    enabled = config.enabled()
    ignored = config.ignored_for(path)
    if ignored:
        enabled = frozenset(c for c in enabled if c == "PD900" or not any(c.startswith(p) for p in ignored))
    if rules is None or rules.enabled != enabled:
        rules = PythonRules(enabled, frozenset(config.kernel_ops))
    try:
        # utf-8-sig: a BOM is no character of the source (Python reads it so too)
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        return _not_audited(rel, f"cannot read the file: {exc}")
    lines = source_lines(text)
    unaudited: str | None = None
    if path.suffix in (".py", ".pyi") or not path.suffix.endswith(CPP_SUFFIXES):
        try:
            findings = audit_python_source(rel, text, rules)
        except RecursionError:
            # libcst walks its tree recursively: a very long expression (hundreds of chained
            # `+` terms) exhausts the stack. Report this file, keep the run going.
            return _not_audited(rel, "libcst cannot analyse this file: an expression is nested too deeply for "
                                "its recursive tree walk (RecursionError)")
        except _FileTimeout:
            raise
        except Exception as exc:  # a defect of the analysis on one file must not end the run
            return _not_audited(rel, f"the audit failed on this file: {type(exc).__name__}: {exc}")
        # PD901 from the pass is a parse error: no rule ran, whether or not PD901 is enabled
        unaudited = next((f"{f.message} (line {f.line})" for f in findings if f.code == "PD901"), None)
        sups = python_comments(text)
        prefix = "#"
    else:
        findings = audit_cpp_source(rel, text, enabled)
        sups = cpp_suppressions(text)
        prefix = "//"
    findings = [f for f in findings if f.code in enabled]
    spans = (python_statement_spans(text) if prefix == "#" else cpp_statement_spans(text)) if sups else ()
    kept, suppressed = apply_suppressions(rel, findings, sups, lines, prefix, spans)
    return sorted(kept), suppressed, unaudited


class _FileTimeout(Exception):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise _FileTimeout


def timed_audit_file(path: Path, config: AuditConfig, rules: PythonRules | None = None) -> FileResult:
    """:func:`audit_file` with the size cap and the per-file timeout of ``config`` applied,
    and the time taken. The timeout needs SIGALRM and the main thread (the CLI and the pool
    workers); elsewhere a file runs to its end."""
    rel = config.relative(path)
    t0 = time.perf_counter()
    try:
        st = path.stat()
        size = st.st_size
    except OSError:
        st = None
        size = 0  # audit_file reports the unreadable file
    if st is not None and not stat.S_ISREG(st.st_mode):
        return FileResult(rel, (), 0, 0.0, NOT_REGULAR)
    if size > config.max_file_kb * 1024:
        return FileResult(rel, (), 0, 0.0, f"{size / 1024:.0f} KiB, above max_file_kb = {config.max_file_kb}")
    armed = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    previous = None
    if armed:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, config.file_timeout)
    try:
        found, suppressed, unaudited = _audit(path, config, rules)
    except _FileTimeout:
        return FileResult(rel, (), 0, time.perf_counter() - t0,
                          f"not finished within file_timeout = {config.file_timeout:g} s")
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return FileResult(rel, tuple(found), suppressed, time.perf_counter() - t0,
                      unaudited)


# -- the pool -------------------------------------------------------------------------------

_worker_config: AuditConfig | None = None


def _init_worker(config: AuditConfig) -> None:
    global _worker_config
    _worker_config = config


def _work(path: Path) -> FileResult:
    assert _worker_config is not None
    return timed_audit_file(path, _worker_config)


def _results(files: Sequence[Path], config: AuditConfig, jobs: int) -> Iterator[FileResult]:
    if jobs <= 1 or len(files) < _SERIAL_BELOW:
        rules = PythonRules(config.enabled(), frozenset(config.kernel_ops))
        for f in files:
            yield timed_audit_file(f, config, rules)
        return
    # `fork` starts workers in milliseconds and is what the CLI uses (it imports no torch and
    # runs no threads). In a process with torch loaded or threads running (pytest, a
    # notebook) a forked worker was seen to abort inside libcst's native parser: there the
    # forkserver, preloaded with this module, starts workers from a clean process.
    methods = multiprocessing.get_all_start_methods()
    ctx: multiprocessing.context.BaseContext
    if "fork" in methods and "torch" not in sys.modules and threading.active_count() == 1:
        ctx = multiprocessing.get_context("fork")
    else:
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            ctx.set_forkserver_preload([__name__])
    # Big files first, so the last worker to finish is not the one holding the largest file.
    order = sorted(files, key=lambda f: -_size(f))
    with ctx.Pool(jobs, initializer=_init_worker, initargs=(config,)) as pool:
        yield from pool.imap_unordered(_work, order, chunksize=4)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _lines(items: Iterable[FileResult], total: int, every: int) -> Iterator[FileResult]:
    t0 = time.perf_counter()
    done = 0
    for r in items:
        done += 1
        if done % every == 0 or done == total:
            print(f"pointerdomain audit: {done}/{total} files, {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
        yield r


def _progress(items: Iterable[FileResult], total: int, mode: Progress) -> Iterable[FileResult]:
    if mode == "none":
        return items
    if mode == "lines" or (mode == "auto" and not sys.stderr.isatty()):
        return _lines(items, total, _LINE_EVERY)
    from rich.console import Console  # only when drawn: rich's import is not free
    from rich.progress import track

    return track(items, total=total, description="pointerdomain audit", console=Console(stderr=True),
                 transient=True)


def audit_paths(paths: Sequence[Path], config: AuditConfig, *, jobs: int | None = None,
                progress: Progress = "auto", baseline: Path | None = None) -> AuditRun:
    """Audit ``paths`` and split the findings against ``baseline`` (a file written by
    :func:`pointerdomain.audit.baseline.write_baseline`; None: no baseline).

    Raises:
        ConfigError: a path does not exist, or the baseline is unreadable.
    """
    t0 = time.perf_counter()
    known = read_baseline(baseline) if baseline is not None else None
    files, unlisted = _discover(paths, config)
    n_jobs = jobs if jobs else (config.jobs or os.cpu_count() or 1)
    findings: list[Finding] = []
    suppressed = 0
    # a directory that cannot be listed: its files were not audited, which fails the gate
    per_file: list[FileResult] = [FileResult(config.relative(d), (), 0, 0.0, why) for d, why in unlisted]
    for r in _progress(_results(files, config, n_jobs), len(files), progress):
        findings.extend(r.findings)
        suppressed += r.suppressed
        per_file.append(r)
    findings.sort()
    per_file.sort(key=lambda r: r.path)
    new, old, stale = split_baselined(findings, known) if known is not None else (findings, [], 0)
    return AuditRun(len(files), tuple(new), tuple(old), suppressed, stale, time.perf_counter() - t0,
                    tuple(per_file))
