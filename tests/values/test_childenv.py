"""tests/childenv.py: a child process imports what the test's own process imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pointerdomain
from tests import childenv


def test_the_runs_pythonpath_wins_over_the_installed_packages_folder(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # a module both beside an installed pointerdomain and on the run's PYTHONPATH: this
    # process, whose PYTHONPATH comes before site-packages, imports the PYTHONPATH one
    installed, carried = tmp_path / "site-packages", tmp_path / "carried"
    for folder in (installed, carried):
        folder.mkdir()
        (folder / "pd_childenv_probe.py").write_text(f"WHERE = {folder.name!r}\n")
    (installed / "pointerdomain").mkdir()
    monkeypatch.setattr(pointerdomain, "__file__", str(installed / "pointerdomain" / "__init__.py"))
    monkeypatch.setenv("PYTHONPATH", str(carried))
    out = subprocess.run([sys.executable, "-c", "import pd_childenv_probe as m; print(m.WHERE)"],
                         env={**os.environ, "PYTHONPATH": childenv.pythonpath()}, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "carried"
    parts = childenv.pythonpath().split(os.pathsep)
    assert parts[0] == str(childenv.ROOT) and str(installed) in parts  # `tests` and the package importable
