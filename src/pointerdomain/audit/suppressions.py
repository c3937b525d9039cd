"""Inline suppressions: ``# pointerdomain: ignore[PD001] reason`` (``//`` in C++).

A suppression must name its codes and give a reason. It applies to findings on its own
line, or, written alone on a line, to the next line that is not a comment. Where that line
is the first or the last line of a statement written over several lines, it covers every
line of the statement (a call whose arguments are spread over lines is reported at its
first line, an argument at its own); a comment on a middle line covers that line only.
One with no reason (or no code) suppresses nothing and is itself a finding (PD900), so a
gate cannot be silenced without saying why.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from collections.abc import Iterable, Sequence

from pointerdomain.audit.rules import RULES, Finding

__all__ = ["MARKER", "Suppression", "apply_suppressions", "parse_comment", "python_comments", "python_statement_spans"]

#: Text every suppression contains; files without it skip the comment scan.
MARKER = "pointerdomain:"

_RE = re.compile(r"^(?:#|//|/\*)\s*pointerdomain:\s*ignore\b(?:\[(?P<codes>[^\]]*)\])?(?P<reason>.*)$")
_CODE = re.compile(r"^PD\d{3}$")


@dataclasses.dataclass(frozen=True)
class Suppression:
    """A parsed suppression comment at ``line``/``col`` (1-based) covering ``target_line``."""

    line: int
    col: int
    target_line: int
    codes: frozenset[str]
    reason: str
    problem: str  # empty when the suppression is valid


def parse_comment(text: str, line: int, col: int, standalone: bool) -> Suppression | None:
    """Parse one comment's text (with its ``#`` or ``//``); None if it is not a suppression.
    ``standalone``: the comment is alone on its line (it then covers the next code line,
    resolved by :func:`apply_suppressions`; ``target_line`` is set to ``-line``)."""
    m = _RE.match(text.strip().removesuffix("*/").rstrip())
    if m is None:
        return None
    raw_codes = m.group("codes")
    codes = frozenset(c.strip() for c in (raw_codes or "").split(",") if c.strip())
    reason = m.group("reason").strip(" \t-:—–")
    problem = ""
    if raw_codes is None or not codes:
        problem = "suppression names no rule code: write `pointerdomain: ignore[PD001] <reason>`"
    elif bad := sorted(c for c in codes if not _CODE.match(c) or c not in RULES):
        problem = f"suppression names unknown rule code(s) {', '.join(bad)}"
    elif not reason:
        problem = f"suppression of {', '.join(sorted(codes))} gives no reason: say why the site is safe"
    return Suppression(line, col, -line if standalone else line, codes, reason, problem)


def python_comments(source: str) -> list[Suppression]:
    """Suppressions in Python source, found with :mod:`tokenize` (so ``#`` inside a string
    is not a comment). Sources with a tokenize error fall back to no suppressions."""
    if MARKER not in source:
        return []
    found: list[Suppression] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT and MARKER in tok.string:
                standalone = not tok.line[: tok.start[1]].strip()
                s = parse_comment(tok.string, tok.start[0], tok.start[1] + 1, standalone)
                if s is not None:
                    found.append(s)
    except (tokenize.TokenError, SyntaxError):
        return found
    return found


def python_statement_spans(source: str) -> list[tuple[int, int]]:
    """(first line, last line) of each Python statement written over several lines: a
    simple statement whole, a compound statement's header (``with engine.register(...):``
    up to its body), a decorator list with its ``def``/``class`` line. Empty when the source
    does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return []
    spans: list[tuple[int, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.match_case, ast.ExceptHandler)):
            # a clause of a compound statement: its header (`case ...:`, `except ...:`) alone
            start = node.pattern.lineno if isinstance(node, ast.match_case) else node.lineno
            last = max(start, node.body[0].lineno - 1)
            if last > start:
                spans.append((start, last))
            continue
        if not isinstance(node, ast.stmt):
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        # a compound statement's header ends where its first nested statement or clause
        # starts (`match` has `cases`, not `body`); a simple statement is whole
        inner: list[ast.stmt] = getattr(node, "body", None) or []
        cases: list[ast.match_case] = getattr(node, "cases", None) or []
        if cases:
            last = max(node.lineno, cases[0].pattern.lineno - 1)
        elif inner:
            last = max(node.lineno, inner[0].lineno - 1)  # the header: the body may share its line
        else:
            last = node.end_lineno or node.lineno
        if last > first:
            spans.append((first, last))
    return spans


def _resolve_targets(sups: Iterable[Suppression], lines: Sequence[str], comment_prefix: str) -> list[Suppression]:
    out = []
    for s in sups:
        if s.target_line < 0:
            target = s.line + 1
            while target <= len(lines) and (not lines[target - 1].strip()
                                            or lines[target - 1].lstrip().startswith(comment_prefix)):
                target += 1
            s = dataclasses.replace(s, target_line=target)
        out.append(s)
    return out


def apply_suppressions(
    path: str, findings: Sequence[Finding], sups: Sequence[Suppression], lines: Sequence[str], comment_prefix: str,
    spans: Sequence[tuple[int, int]] = (),
) -> tuple[list[Finding], int]:
    """Drop findings covered by a valid suppression and add a PD900 finding for each invalid
    one. ``spans`` are the (first, last) lines of the statements written over several lines
    (:func:`python_statement_spans`, :func:`pointerdomain.audit.cpp_pass.cpp_statement_spans`):
    a suppression aimed at the first or the last line of one covers all of its lines.
    Returns (findings kept, number suppressed)."""
    resolved = _resolve_targets(sups, lines, comment_prefix)
    ends: dict[int, list[tuple[int, int]]] = {}
    for first, last in spans:
        ends.setdefault(first, []).append((first, last))
        ends.setdefault(last, []).append((first, last))
    valid: dict[int, set[str]] = {}
    out: list[Finding] = []
    for s in resolved:
        if s.problem:
            text = lines[s.line - 1].strip() if 0 < s.line <= len(lines) else ""
            out.append(Finding(path, s.line, s.col, "PD900", s.problem, RULES["PD900"].fix, text))
        else:
            covered = {s.target_line}
            for first, last in ends.get(s.target_line, ()):
                covered.update(range(first, last + 1))
            for line in covered:
                valid.setdefault(line, set()).update(s.codes)
    suppressed = 0
    for f in findings:
        if f.code in valid.get(f.line, ()):
            suppressed += 1
        else:
            out.append(f)
    return out, suppressed
