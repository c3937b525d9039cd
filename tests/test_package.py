"""The package's lazy namespace (PEP 562): every public name is importable, comes
from the module its static import names, and `import pointerdomain` alone loads no torch
(the audit command starts without it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pointerdomain as pd

INIT = Path(pd.__file__)


def _static_imports() -> dict[str, str]:
    """name -> module, from the `if TYPE_CHECKING:` block type checkers read."""
    tree = ast.parse(INIT.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    out: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            # `from pointerdomain.transfer import checked`: the name is a module of that package
            folder = INIT.parent.joinpath(*node.module.split(".")[1:])
            out[alias.name] = f"{node.module}.{alias.name}" if (folder / f"{alias.name}.py").exists() else node.module
    return out


def test_lazy_map_matches_the_static_imports_and_all() -> None:
    lazy: dict[str, str] = getattr(pd, "_LAZY")
    assert lazy == _static_imports()
    assert set(lazy) | {"__version__", "get_include"} == set(pd.__all__)


def test_every_public_name_resolves_to_its_module() -> None:
    lazy: dict[str, str] = getattr(pd, "_LAZY")
    for name in pd.__all__:
        value = getattr(pd, name)
        if name in lazy and not lazy[name].endswith("." + name):
            assert getattr(sys.modules[lazy[name]], name) is value, name


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        getattr(pd, "no_such_name")
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_loads_no_torch() -> None:
    code = "import sys, pointerdomain, pointerdomain.audit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
