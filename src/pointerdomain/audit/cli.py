"""Command line of ``pointerdomain audit`` (also ``python -m pointerdomain.audit`` and the
``pointerdomain-audit`` script, which import no torch).

Exit status: 0 no new findings; 1 new findings (or, with ``--fix``, findings left
after fixing); 2 a usage or configuration error (bad option, missing path, invalid
``[tool.pointerdomain.audit]``, unreadable baseline).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import libcst as cst

from pointerdomain.audit.autofix import FixStyle, check_fix, fix_source
from pointerdomain.audit.baseline import read_baseline, split_baselined, write_baseline
from pointerdomain.audit.config import AuditConfig, ConfigError, find_config, load_config
from pointerdomain.audit.engine import Progress, audit_paths, discover, timed_audit_file
from pointerdomain.audit.output import FORMATS, Format, Summary, render
from pointerdomain.audit.rules import RULES

__all__ = ["add_arguments", "main", "run"]

_VERSION = "0.1.0"
EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


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
                        help="table: a typed PointerTable (default); tensor: ...as_uint64_tensor(), a drop-in tensor")
    parser.add_argument("--jobs", "-j", type=int, default=0, help="worker processes (default: config, else CPUs)")
    parser.add_argument("--progress", choices=["auto", "bar", "lines", "none"], default="auto",
                        help="progress on stderr (auto: a bar on a terminal, else a line per 500 files)")
    parser.add_argument("--max-file-kb", type=int, help="skip (and report) files larger than this (default: "
                        "config max_file_kb, else 1024)")
    parser.add_argument("--file-timeout", type=float, help="seconds per file before it is skipped and reported "
                        "(default: config file_timeout, else 60)")
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


def _fix(paths: Sequence[Path], config: AuditConfig, style: FixStyle, diff: bool, known: Counter[str] | None) -> int:
    total = 0
    for path in discover(paths, config):
        if path.suffix != ".py":
            continue
        rel = config.relative(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            print(f"{rel}: not fixed: cannot read the file: {exc}", file=sys.stderr)
            continue
        if "data_ptr" not in text:
            continue
        # only what the audit reports is rewritten: a suppressed, ignored or baselined site stays
        sites = _reported_sites(path, config, known)
        if isinstance(sites, str):
            print(f"{rel}: not fixed: skipped ({sites})", file=sys.stderr)
            continue
        if not sites:
            continue
        try:
            result = fix_source(text, style, sites)
        except cst.ParserSyntaxError:
            continue
        except RecursionError:
            print(f"{rel}: not fixed: an expression is nested too deeply for libcst (RecursionError)",
                  file=sys.stderr)
            continue
        for line, reason in result.refused:
            print(f"{rel}:{line}: not fixed: {reason}", file=sys.stderr)
        if not result.fixes:
            continue
        check = check_fix(text, result.code, path.name)
        if not check.ok:
            print(f"{rel}: {result.fixes} fix(es) refused: {check.reason}", file=sys.stderr)
            for message in check.new_errors:
                print(f"    {message}", file=sys.stderr)
            continue
        total += result.fixes
        if diff:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(keepends=True),
                                                       result.code.splitlines(keepends=True), f"a/{rel}", f"b/{rel}"))
        else:
            path.write_text(result.code, encoding="utf-8")
    print(f"pointerdomain audit --fix: {total} site(s) {'would be ' if diff else ''}rewritten", file=sys.stderr)
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
        write_baseline(args.write_baseline, result.findings)
        print(f"pointerdomain audit: wrote {len(result.findings)} finding(s) to {args.write_baseline}", file=sys.stderr)
        return EXIT_CLEAN
    summary = Summary(result.files, len(result.new), len(result.baselined), result.suppressed, result.stale,
                      result.seconds, len(result.skipped))
    report = render(cast(Format, args.format), result.new, summary, _VERSION, result.per_file)
    if args.output is not None:
        args.output.write_text(report, encoding="utf-8")
        print(summary.line(), file=sys.stderr)
    else:
        sys.stdout.write(report)
        if args.format != "text":
            print(summary.line(), file=sys.stderr)
    return EXIT_FINDINGS if result.new else EXIT_CLEAN


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``pointerdomain-audit``, ``python -m pointerdomain.audit``)."""
    parser = argparse.ArgumentParser(prog="pointerdomain audit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
