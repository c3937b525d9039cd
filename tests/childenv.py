"""The environment for a test's child Python process: it must import the same
pointerdomain as the test (the installed package on the GPU machine, the source tree
here) and keep whatever PYTHONPATH the run was given (wheels carried to a GPU machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pointerdomain

ROOT = Path(__file__).resolve().parents[1]  # the checkout: `tests` importable in the child


def pythonpath() -> str:
    package_parent = str(Path(pointerdomain.__file__).resolve().parents[1])
    parts = (package_parent, str(ROOT), os.environ.get("PYTHONPATH", ""))
    return os.pathsep.join(p for p in parts if p)
