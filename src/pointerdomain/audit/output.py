"""Report formats: text (one line per finding, for people and editors), JSON, and
SARIF 2.1.0 (for GitHub code scanning and other SARIF viewers).

SARIF follows the OASIS SARIF 2.1.0 standard
(https://docs.oasis-open.org/sarif/sarif/v2.1.0/sarif-v2.1.0.html): one run, the rule
catalogue in ``tool.driver.rules``, each result with ``ruleId``/``ruleIndex``, a
``physicalLocation`` (1-based ``startLine``/``startColumn``), the suggested fix in
``message`` and ``properties.fix``, and ``partialFingerprints`` from the baseline's
fingerprint so viewers track findings across commits. Files that were not audited (size
cap, timeout, PD901) are ``toolExecutionNotifications`` of the run's invocation, so a
viewer shows that the tree was not checked whole.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Literal

from pointerdomain.audit.baseline import fingerprints
from pointerdomain.audit.engine import FileResult
from pointerdomain.audit.rules import RULES, Finding

__all__ = ["FORMATS", "Format", "Summary", "render"]

Format = Literal["text", "json", "sarif"]
FORMATS: tuple[Format, ...] = ("text", "json", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


@dataclasses.dataclass(frozen=True)
class Summary:
    """Counts for a run: files read, new / baselined findings, suppressed findings,
    stale baseline entries, wall time in seconds, files skipped (size cap, timeout, PD901),
    and whether skipped files fail the run (``allow_skipped`` off)."""

    files: int
    new: int
    baselined: int
    suppressed: int
    stale: int
    seconds: float
    skipped: int = 0
    skipped_fail: bool = False

    def line(self) -> str:
        return (f"pointerdomain audit: {self.new} new finding(s), {self.baselined} baselined, "
                f"{self.suppressed} suppressed, in {self.files} file(s), {self.seconds:.1f} s"
                + (f"; {self.skipped} file(s) skipped" if self.skipped else "")
                + (" (not audited: this fails the run; exclude them, or pass --allow-skipped)"
                   if self.skipped and self.skipped_fail else "")
                + (f"; {self.stale} baseline entr{'y' if self.stale == 1 else 'ies'} no longer found"
                   if self.stale else ""))


def _text(findings: Sequence[Finding], summary: Summary, per_file: Sequence[FileResult]) -> str:
    lines = [f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}\n    fix: {f.fix}" for f in findings]
    lines += [f"{r.path}: skipped: {r.skipped}" for r in per_file if r.skipped is not None]
    return "\n".join([*lines, summary.line()]) + "\n"


def _json(findings: Sequence[Finding], summary: Summary, version: str, per_file: Sequence[FileResult]) -> str:
    items = [{"path": f.path, "line": f.line, "col": f.col, "end_line": f.end_line or f.line,
              "end_col": f.end_col or f.col, "code": f.code, "rule": f.rule.name, "level": f.rule.level,
              "message": f.message, "fix": f.fix, "snippet": f.snippet, "fingerprint": fp}
             for f, fp in zip(findings, fingerprints(findings))]
    files = [{"path": r.path, "seconds": round(r.seconds, 4), "findings": len(r.findings), "skipped": r.skipped}
             for r in per_file]
    skipped = [{"path": r.path, "reason": r.skipped} for r in per_file if r.skipped is not None]
    return json.dumps({"tool": "pointerdomain-audit", "version": version, "findings": items,
                       "skipped": skipped, "files": files, "summary": dataclasses.asdict(summary)}, indent=1) + "\n"


def _artifact(path: str) -> dict[str, str]:
    """A SARIF ``artifactLocation`` for a reported path: a percent-encoded relative URI
    reference against ``%SRCROOT%`` for a path under the root, else (an absolute path, or
    one that leaves the root) an absolute ``file://`` URI without ``uriBaseId`` (SARIF
    2.1.0 sections 3.4.3 and 3.10.2)."""
    local = Path(path)
    if local.is_absolute() or local.drive or ".." in local.parts:
        return {"uri": local.resolve().as_uri()}
    # `:` too (`c:x.py` is no scheme), `#`, `%`, `?`, spaces and non-ASCII
    return {"uri": urllib.parse.quote(local.as_posix(), safe="/"), "uriBaseId": "%SRCROOT%"}


def _sarif(findings: Sequence[Finding], version: str, summary: Summary, per_file: Sequence[FileResult]) -> str:
    codes = list(RULES)
    rules = [{"id": r.code, "name": r.name, "shortDescription": {"text": r.summary},
              "fullDescription": {"text": r.summary}, "help": {"text": f"Fix: {r.fix}"},
              "defaultConfiguration": {"level": r.level}} for r in RULES.values()]
    results: list[dict[str, Any]] = []
    for f, fp in zip(findings, fingerprints(findings)):
        region: dict[str, int] = {"startLine": f.line, "startColumn": f.col}
        if f.end_line:
            region |= {"endLine": f.end_line, "endColumn": max(f.end_col, 1)}
        results.append({
            "ruleId": f.code, "ruleIndex": codes.index(f.code), "level": f.rule.level,
            "message": {"text": f"{f.message}. Fix: {f.fix}"},
            "locations": [{"physicalLocation": {"artifactLocation": _artifact(f.path), "region": region}}],
            "partialFingerprints": {"pointerdomainAudit/v1": fp},
            "properties": {"fix": f.fix},
        })
    # a file no rule ran on: an error notification when it fails the run, else a warning
    notifications = [{
        "level": "error" if summary.skipped_fail else "warning",
        "message": {"text": f"{r.path} was not audited: {r.skipped}"},
        "locations": [{"physicalLocation": {"artifactLocation": _artifact(r.path)}}],
        "descriptor": {"id": "skipped-file"},
    } for r in per_file if r.skipped is not None]
    log = {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [{
        "tool": {"driver": {"name": "pointerdomain-audit", "version": version,
                            "rules": rules}},
        "invocations": [{"executionSuccessful": not (notifications and summary.skipped_fail),
                         "toolExecutionNotifications": notifications}],
        "columnKind": "unicodeCodePoints",
        "results": results,
    }]}
    return json.dumps(log, indent=1) + "\n"


def render(fmt: Format, findings: Sequence[Finding], summary: Summary, version: str,
           per_file: Sequence[FileResult] = ()) -> str:
    """The report of ``findings`` (the new ones) in format ``fmt``. ``per_file`` adds each
    file's time and skip reason (JSON ``files`` and ``skipped``; SARIF tool execution
    notifications; skipped files as lines of the text report)."""
    if fmt == "json":
        return _json(findings, summary, version, per_file)
    if fmt == "sarif":
        return _sarif(findings, version, summary, per_file)
    return _text(findings, summary, per_file)
