"""The baseline file: findings accepted as they are, so only new ones fail CI.

Each finding is recorded by a fingerprint of its rule, its path, its source line's text
(whitespace-normalised) and its rank among the same rule's findings on identical text in
that file. Moving code up or down keeps the fingerprint; editing the flagged line (or
adding a new identical site) makes a new finding. Format (JSON)::

    {"tool": "pointerdomain-audit", "version": 1,
     "findings": [{"fingerprint": "...", "path": "...", "code": "PD001", "line": 12, "snippet": "..."}]}

``line`` and ``snippet`` are for readers; only ``fingerprint`` is matched.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from pointerdomain.audit.config import ConfigError
from pointerdomain.audit.rules import Finding

__all__ = ["fingerprints", "read_baseline", "split_baselined", "write_baseline"]

_TOOL = "pointerdomain-audit"


def fingerprints(findings: Sequence[Finding]) -> list[str]:
    """One fingerprint per finding, in the order given (see the module docstring)."""
    rank: Counter[tuple[str, str, str]] = Counter()
    out = []
    for f in sorted(findings, key=lambda f: (f.path, f.line, f.col, f.code)):
        text = " ".join(f.snippet.split())
        key = (f.path, f.code, text)
        digest = hashlib.sha256(f"{f.code}\0{f.path}\0{text}\0{rank[key]}".encode()).hexdigest()[:20]
        rank[key] += 1
        out.append((f, digest))
    order = {id(f): d for f, d in out}
    return [order[id(f)] for f in findings]


def write_baseline(path: Path, findings: Sequence[Finding]) -> None:
    """Write every finding (PD900/PD901 included) to ``path``.

    Raises:
        ConfigError: ``path`` cannot be written (a missing folder, a directory, no permission).
    """
    entries = [{"fingerprint": fp, "path": f.path, "code": f.code, "line": f.line, "snippet": f.snippet}
               for f, fp in sorted(zip(findings, fingerprints(findings)), key=lambda x: (x[0].path, x[0].line))]
    try:
        path.write_text(json.dumps({"tool": _TOOL, "version": 1, "findings": entries}, indent=1) + "\n",
                        encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"baseline {path}: cannot write: {exc.strerror or exc}") from None


def read_baseline(path: Path) -> Counter[str]:
    """The fingerprints recorded in ``path`` (a multiset).

    Raises:
        ConfigError: the file is missing, not UTF-8 JSON, or not a baseline.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"baseline {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"baseline {path}: not UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"baseline {path}: not JSON: {exc}") from None
    except RecursionError:  # json's decoder recurses once per nested array or object
        raise ConfigError(f"baseline {path}: not a pointerdomain-audit baseline (nested too deeply)") from None
    if not isinstance(data, dict) or data.get("tool") != _TOOL or data.get("version") != 1 \
            or not isinstance(data.get("findings"), list):
        raise ConfigError(f"baseline {path}: not a pointerdomain-audit baseline (version 1)")
    try:
        return Counter(str(e["fingerprint"]) for e in data["findings"])
    except (KeyError, TypeError):
        raise ConfigError(f"baseline {path}: an entry has no fingerprint") from None


def split_baselined(findings: Sequence[Finding], baseline: Counter[str]) -> tuple[list[Finding], list[Finding], int]:
    """(new findings, baselined findings, number of baseline entries no longer found)."""
    remaining = Counter(baseline)
    new, old = [], []
    for f, fp in zip(findings, fingerprints(findings)):
        if remaining[fp] > 0:
            remaining[fp] -= 1
            old.append(f)
        else:
            new.append(f)
    return new, old, sum(remaining.values())
