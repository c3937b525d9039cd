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


def test_empty_is_unset_for_the_emulated_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from pointerdomain import errors
    from pointerdomain.devices import emulated_device_count

    monkeypatch.setenv(env.EMULATED_DEVICES, "")
    assert emulated_device_count() == 2
    monkeypatch.setenv(env.EMULATED_DEVICES, "3")
    assert emulated_device_count() == 3
    monkeypatch.setenv(env.EMULATED_DEVICES, " 2")
    with pytest.raises(errors.InvalidDeviceError):
        emulated_device_count()


@pytest.mark.parametrize(("value", "on", "warns"), [("1", True, False), ("0", False, False), ("", False, False),
                                                    ("true", False, True), ("1 ", False, True)])
def test_the_strict_alias_switch_warns_on_what_it_does_not_take(value: str, on: bool, warns: bool) -> None:
    """Read at import: a child process with the variable set."""
    import os
    import subprocess
    import sys

    code = ("import warnings\nwarnings.simplefilter('always')\nwith warnings.catch_warnings(record=True) as w:\n"
            "    import pointerdomain as pd\n    on = pd.strict_alias_enabled()\n"
            "print(on, any('POINTERDOMAIN_STRICT_ALIAS' in str(x.message) for x in w))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, env.STRICT_ALIAS: value})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(on), str(warns)], out.stdout


def test_a_cgroup_root_that_is_no_directory_warns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pointerdomain._platform.capacity import cgroup_limit

    monkeypatch.setenv(env.CGROUP_ROOT, str(tmp_path / "no-such-dir"))
    with pytest.warns(env.EnvironmentValueWarning, match="POINTERDOMAIN_CGROUP_ROOT"):
        assert cgroup_limit() is None
