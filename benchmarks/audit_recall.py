"""The automatic part of the audit's recall count on a real tree (docs/audit.md, section
"Runs on the real trees").

    pointerdomain-audit --format json -o out.json --no-baseline TREE
    python benchmarks/audit_recall.py TREE out.json [--misses]

Every ``x.data_ptr()``, ``ctypes.addressof(...)`` and ``a.ctypes.data`` in the non-test
``.py`` files of TREE (no ``test``/``tests``/``testing`` directory in the path, not
``test_*.py``/``*_test.py``/``conftest.py``; modules importing ``cutlass`` left out: their
``data_ptr()`` are CuTe DSL pointers) is listed with :mod:`ast`. Uses that are no address
by construction are set aside: inside a comparison, an operand of ``%``/``&``/``//``,
inside ``assert``, an argument of logging/``print``/``hash``/``id``/``str``/``repr``/
``format`` or a part of an f-string, a dict key, a value bound to a ``*key*`` name. The
rest are address sites. A site is *found* when a finding covers its statement, or when it
binds a name (or ``self.x``) that the text of a finding in the same function (the file,
for ``self.x``) reads. Prints sites, found, not found and the automatic recall; with
``--misses`` each site not found.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections import defaultdict
from pathlib import Path

_NOT_AN_ADDRESS_CALLS = frozenset({"print", "hash", "id", "str", "repr", "format", "debug", "info", "warning",
                                   "error", "exception", "critical", "log"})
_KEY = re.compile(r"(?i)key")


def _is_test(rel: Path) -> bool:
    if any(p in ("test", "tests", "testing") for p in rel.parts[:-1]):
        return True
    return rel.name.startswith("test_") or rel.name.endswith("_test.py") or rel.name == "conftest.py"


def _is_site(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "data_ptr" and not node.args:
            return True
        return (isinstance(f, ast.Attribute) and f.attr == "addressof") or (isinstance(f, ast.Name)
                                                                            and f.id == "addressof")
    return isinstance(node, ast.Attribute) and node.attr == "data" and isinstance(node.value, ast.Attribute) \
        and node.value.attr == "ctypes"


def _set_aside(path: list[ast.AST]) -> bool:
    """Whether the site at the end of ``path`` (its ancestors first) is no address use."""
    child = path[-1]
    for parent in reversed(path[:-1]):
        if isinstance(parent, (ast.Compare, ast.Assert, ast.JoinedStr)):
            return True
        if isinstance(parent, ast.BinOp) and isinstance(parent.op, (ast.Mod, ast.BitAnd, ast.FloorDiv)):
            return True
        if isinstance(parent, ast.Call):
            f = parent.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _NOT_AN_ADDRESS_CALLS and child is not f:
                return True
        if isinstance(parent, ast.Dict) and any(k is child for k in parent.keys):
            return True
        if isinstance(parent, ast.Assign) and any(isinstance(t, ast.Name) and _KEY.search(t.id)
                                                  for t in parent.targets):
            return True
        if isinstance(parent, ast.stmt):
            return False
        child = parent
    return False


_Func = ast.FunctionDef | ast.AsyncFunctionDef


def _sites(tree: ast.Module) -> list[tuple[ast.stmt, ast.AST, _Func | None]]:
    """(statement, site, enclosing function) for each address site of a module."""
    out: list[tuple[ast.stmt, ast.AST, _Func | None]] = []

    def walk(node: ast.AST, path: list[ast.AST], stmt: ast.stmt | None, func: _Func | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node
        if isinstance(node, ast.stmt):
            stmt = node
        if _is_site(node) and stmt is not None and not _set_aside([*path, node]):
            out.append((stmt, node, func))
        for child in ast.iter_child_nodes(node):
            walk(child, [*path, node], stmt, func)

    walk(tree, [], None, None)
    return out


def _bound_name(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
        if isinstance(target, ast.Name):
            return target.id
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            return f"{target.value.id}.{target.attr}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path)
    ap.add_argument("report", type=Path, help="the audit's --format json report of TREE (paths relative to TREE)")
    ap.add_argument("--misses", action="store_true", help="print each site not found")
    args = ap.parse_args()
    findings: dict[str, list[dict[str, object]]] = defaultdict(list)
    for f in json.loads(args.report.read_text())["findings"]:
        findings[str(f["path"])].append(f)
    total = found = 0
    misses = []
    for path in sorted(args.tree.rglob("*.py")):
        rel = path.relative_to(args.tree)
        if _is_test(rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            module = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
            continue
        if re.search(r"^\s*(?:import|from)\s+cutlass\b", text, re.M):
            continue
        here = findings.get(rel.as_posix(), [])
        lines = text.splitlines()
        for stmt, site, func in _sites(module):
            total += 1
            end = stmt.end_lineno or stmt.lineno
            hit = any(int(str(f["line"])) <= end and int(str(f["end_line"])) >= stmt.lineno for f in here)
            name = _bound_name(stmt)
            if not hit and name is not None:
                lo, hi = (func.lineno, func.end_lineno or func.lineno) if func is not None and "." not in name \
                    else (1, len(lines))
                word = re.compile(rf"(?<![\w.]){re.escape(name)}\b")
                hit = any(lo <= int(str(f["line"])) <= hi and int(str(f["line"])) != stmt.lineno
                          and word.search("\n".join(lines[int(str(f["line"])) - 1:int(str(f["end_line"]))]))
                          for f in here)
            found += hit
            if not hit:
                misses.append(f"{rel}:{getattr(site, 'lineno', stmt.lineno)}: {lines[stmt.lineno - 1].strip()[:100]}")
    print(f"sites {total}  found {found}  not found {total - found}  automatic recall "
          f"{100 * found / total if total else 100:.1f} %")
    if args.misses:
        print("\n".join(misses))


if __name__ == "__main__":
    main()
