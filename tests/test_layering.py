"""The package's layering, read from the source with ``ast`` (nothing is imported).

Every import counts: module level, inside functions, under ``if TYPE_CHECKING:``, absolute
and relative, ``from pkg import module`` as an edge to that module. A package's
``__init__.py`` is a module of its own (``pointerdomain.transfer``); importing
``a.b.c`` is an edge to ``a.b.c`` only (the parents' ``__init__`` files run too, but they
re-export nothing, see :func:`test_rooms_reexport_nothing`).

Floors, bottom up: the value modules at the package root (addresses, devices, errors,
environment, layouts, validated models, process-local marker); ``_platform`` (the
runtime, which sees only value modules); the rooms ``registration``, ``transfer``,
``tools``; the engine-facing ``adapters`` and ``compat``. The package root
(``pointerdomain/__init__.py``, ``__main__.py``) is the public face over all of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "pointerdomain"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE
#: the root modules that are the package's face, not value types
FACE = {PACKAGE, f"{PACKAGE}.__main__"}
#: folders whose modules a value module must not import
UPPER_FLOORS = ("registration", "transfer", "tools", "adapters", "compat")
MAX_ROOT_MODULES = 12


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    modules = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}
    modules[f"{PACKAGE}._C"] = SRC / "_C.pyi"  # the native extension, read through its stub
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to: itself, or its longest prefix that is a
    module (``pointerdomain.transfer.plan.TransferPlan`` -> ``pointerdomain.transfer.plan``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> list[tuple[str, int]]:
    """``(imported package module, line)`` for every import statement in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target) if target.split(".")[0] == PACKAGE else None
            if resolved is not None and resolved != module:
                found.append((resolved, node.lineno))
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _where(module: str, target: str) -> str:
    lines = sorted({line for t, line in GRAPH[module] if t == target})
    return f"{MODULES[module].relative_to(SRC.parent)}:{','.join(map(str, lines))}"


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle
    through its members, found by a walk inside the component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    edges = {m: sorted({t for t, _ in GRAPH[m]}) for m in GRAPH}

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            visit(m)

    cycles = []
    for component in components:
        members = set(component)
        path = [component[0]]
        seen = {component[0]}
        while True:  # follow edges inside the component until a module repeats
            nxt = next(w for w in edges[path[-1]] if w in members)
            if nxt in seen:
                cycles.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def _floor(module: str) -> str:
    """``value``, ``face``, or the first folder under the package (``transfer``, ...)."""
    if module in FACE:
        return "face"
    if module == f"{PACKAGE}._C":
        return "_platform"  # reached from _platform alone
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or module in {f"{PACKAGE}.{f}" for f in (*UPPER_FLOORS, "_platform", "audit")} else "value"


def test_the_reader_sees_imports() -> None:
    # the graph is read right: known edges of each kind are present
    assert any(t == f"{PACKAGE}.errors" for t, _ in GRAPH[f"{PACKAGE}.domains"])
    assert any(t == f"{PACKAGE}.transfer.plan" for t, _ in GRAPH[f"{PACKAGE}.transfer.kernels"])
    assert any(t == f"{PACKAGE}.transfer.checked" for t, _ in GRAPH[f"{PACKAGE}.transfer.kernels"])  # from pkg import mod
    assert any(t == f"{PACKAGE}.transfer.kernels" for t, _ in GRAPH[PACKAGE])  # under TYPE_CHECKING


def test_no_import_cycle() -> None:
    cycles = _cycles()
    described = [
        " -> ".join(c) + "\n    " + "\n    ".join(_where(a, b) for a, b in zip(c, c[1:])) for c in cycles
    ]
    assert not cycles, "import cycles (every import counts, function-local and TYPE_CHECKING ones too):\n" + "\n".join(
        described
    )


def test_platform_imports_only_value_modules() -> None:
    bad = [
        f"{m} -> {t} ({_where(m, t)})"
        for m in GRAPH
        if _floor(m) == "_platform"
        for t in sorted({t for t, _ in GRAPH[m]})
        if _floor(t) not in {"value", "_platform"}
    ]
    assert not bad, "_platform imports beyond the value modules:\n" + "\n".join(bad)


def test_value_modules_import_no_upper_floor() -> None:
    bad = [
        f"{m} -> {t} ({_where(m, t)})"
        for m in GRAPH
        if _floor(m) == "value"
        for t in sorted({t for t, _ in GRAPH[m]})
        if _floor(t) in UPPER_FLOORS
    ]
    assert not bad, "value modules importing registration/transfer/tools/adapters/compat:\n" + "\n".join(bad)


def test_root_module_count() -> None:
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root (at most {MAX_ROOT_MODULES}): {root}"


@pytest.mark.parametrize("room", ["registration", "transfer", "tools"])
def test_rooms_reexport_nothing(room: str) -> None:
    # a room's __init__ imports nothing, so importing one module of a room never pulls in
    # the rest of it (and the edges above are all the imports that run)
    assert GRAPH[f"{PACKAGE}.{room}"] == []
