"""The environment for a test's child Python process: it must import the same
pointerdomain as the test (the installed package on the GPU machine, the source tree
here) and keep whatever PYTHONPATH the run was given (wheels carried to a GPU machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pointerdomain

ROOT = Path(__file__).resolve().parents[1]  # the checkout: `tests` importable in the child


def pythonpath() -> str:
    """The child's PYTHONPATH, in the order the test's own path has them: the checkout, the
    run's PYTHONPATH, then the folder pointerdomain was imported from. A module both on the
    run's PYTHONPATH and beside the installed package (a newer typing_extensions carried to
    a machine whose site-packages has an older one) is then the same module in the child."""
    package_parent = str(Path(pointerdomain.__file__).resolve().parents[1])
    parts = (str(ROOT), os.environ.get("PYTHONPATH", ""), package_parent)
    return os.pathsep.join(p for p in parts if p)
