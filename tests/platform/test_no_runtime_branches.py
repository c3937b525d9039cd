"""Outside ``_platform`` the package asks a device what it can do (``Device.runtime``, the
backend's flags) instead of branching on its runtime's name: no comparison of a ``.type``
or ``.runtime`` attribute (but the Device value's own, ``self.type``), and none against a
runtime's name (read with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "pointerdomain"
#: the runtimes' and torch's device-type names
RUNTIME_NAMES = {"cuda", "hip", "rocm", "emulated", "cpu", "torch-cudart"}
#: where a runtime's name is the subject: the platform layer, and the source checker,
#: which reads C++ and Python text rather than devices
EXEMPT = ("_platform", "audit")


def _names_a_runtime(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in RUNTIME_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_runtime(e) for e in node.elts)
    # a device's type or a backend's runtime; ``self.type`` is the Device value defining itself
    return (isinstance(node, ast.Attribute) and node.attr in ("type", "runtime")
            and not (isinstance(node.value, ast.Name) and node.value.id == "self"))


def _is_runtime_branch(node: ast.AST) -> bool:
    """An equality or membership test that names a runtime (identity of runtime objects is not)."""
    return (isinstance(node, ast.Compare) and any(isinstance(op, _BRANCH_OPS) for op in node.ops)
            and any(_names_a_runtime(e) for e in (node.left, *node.comparators)))


_BRANCH_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def runtime_branches() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] in EXEMPT:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _is_runtime_branch(node):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_reader_finds_a_runtime_branch() -> None:
    tree = ast.parse('if device.type == "cuda": pass\nif kind in ("cpu", "x"): pass\nif a.runtime != b: pass')
    assert sum(_is_runtime_branch(n) for n in ast.walk(tree)) == 3


def test_no_runtime_branch_outside_the_platform_layer() -> None:
    found = runtime_branches()
    assert found == [], f"{len(found)} branches on a runtime's name outside _platform/:\n" + "\n".join(found)
