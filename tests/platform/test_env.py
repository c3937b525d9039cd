"""Environment variables: read through ``pointerdomain.env`` only, and documented from there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pointerdomain import env

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "pointerdomain"


def _environment_reads(path: Path) -> list[int]:
    """Lines of ``path`` that touch ``os.environ`` / ``os.getenv`` / ``os.putenv``."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted({node.lineno for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "environb")})


def test_the_reader_finds_a_read(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import os\nx = os.environ.get('A')\ny = os.getenv('B')\n")
    assert _environment_reads(sample) == [2, 3]


def test_only_env_reads_the_environment() -> None:
    found = [f"{p.relative_to(SRC)}:{line}" for p in sorted(SRC.rglob("*.py")) if p != SRC / "env.py"
             for line in _environment_reads(p)]
    assert found == [], "environment read outside pointerdomain/env.py (add the variable to env.VARIABLES):\n" + "\n".join(found)


def test_the_design_docs_table_is_envs() -> None:
    docs = (ROOT / "docs" / "design.md").read_text()
    assert env.markdown_table() in docs, "docs/design.md's table differs from pointerdomain.env.markdown_table()"
    for v in env.VARIABLES:
        assert docs.count(f"| `{v.name}` |") == 1


def test_an_unlisted_variable_cannot_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.STRICT_ALIAS, "1")
    assert env.text(env.STRICT_ALIAS) == "1"
    monkeypatch.delenv(env.STRICT_ALIAS)
    assert env.text(env.STRICT_ALIAS) is None
    with pytest.raises(KeyError, match="VARIABLES"):
        env.text("POINTERDOMAIN_NOT_A_VARIABLE")
