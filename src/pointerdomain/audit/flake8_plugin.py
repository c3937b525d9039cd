"""flake8 entry point: the Python and C++ rules as flake8 errors ``PDxxx``.

Registered in pyproject.toml under ``[project.entry-points."flake8.extension"]`` as
``PD = "pointerdomain.audit.flake8_plugin:Plugin"``; ``flake8 --select PD`` runs it. The
configuration is the ``[tool.pointerdomain.audit]`` table of the nearest pyproject.toml
above each file; suppressions work as in ``pointerdomain audit`` (flake8's ``# noqa: PD001``
too). The baseline is not applied: flake8 reports every finding.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pointerdomain.audit.config import AuditConfig, ConfigError, find_config, load_config
from pointerdomain.audit.python_pass import PythonRules, audit_python_source
from pointerdomain.audit.rules import source_lines
from pointerdomain.audit.suppressions import apply_suppressions, python_comments, python_statement_spans

__all__ = ["Plugin"]


@functools.lru_cache(maxsize=64)
def _config_for(directory: Path) -> AuditConfig:
    try:
        return load_config(find_config(directory))
    except ConfigError:
        return AuditConfig(root=directory)


class Plugin:
    """flake8 plugin (AST-style: flake8 passes ``tree``, ``lines`` and ``filename``)."""

    name = "pointerdomain-audit"
    version = "0.1.0"

    def __init__(self, tree: ast.AST, lines: Sequence[str], filename: str) -> None:
        self.lines = lines
        self.filename = filename

    def run(self) -> Iterator[tuple[int, int, str, type[Any]]]:
        """Yield ``(line, col0, "PDxxx message (fix: ...)", type)`` per finding (col 0-based)."""
        path = Path(self.filename)
        config = _config_for(path.resolve().parent if self.filename not in ("-", "stdin") else Path.cwd())
        enabled = config.enabled()
        ignored = config.ignored_for(path)
        enabled = frozenset(c for c in enabled if c == "PD900" or not any(c.startswith(p) for p in ignored))
        source = "".join(self.lines)
        findings = audit_python_source(self.filename, source, PythonRules(enabled, frozenset(config.kernel_ops)))
        sups = python_comments(source)
        spans = python_statement_spans(source) if sups else []
        kept, _ = apply_suppressions(self.filename, findings, sups, source_lines(source), "#", spans)
        for f in kept:
            yield f.line, f.col - 1, f"{f.code} {f.message} (fix: {f.fix})", type(self)
