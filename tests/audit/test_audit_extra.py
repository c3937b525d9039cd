"""`pip install "pointerdomain[audit]"` is enough for `pointerdomain-audit`: every third-party
module the audit imports belongs to a distribution the `audit` extra requires (directly or
through their own requirements), so it runs where torch is absent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from tests import childenv

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("audit_cases")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` pull in, transitively (markers of extras skipped)."""
    seen: set[str] = set()
    todo = [r for r in requirements if "python_version<'3.11'" not in r.replace(" ", "")]
    while todo:
        req = todo.pop()
        if "extra ==" in req:
            continue
        m = _NAME.match(req)
        if m is None or _canonical(m.group()) in seen:
            continue
        seen.add(_canonical(m.group()))
        try:
            todo.extend(metadata.requires(m.group()) or [])
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_the_audit_extra_covers_what_the_audit_imports(tmp_path: Path) -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["audit"]
    allowed = _closure(extra)
    probe = (
        "import json, sys\n"
        "from pointerdomain.audit.cli import main\n"
        f"main(['--progress', 'none', '--format', 'json', '-o', {str(tmp_path / 'r.json')!r}, {str(CASES)!r}])\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": childenv.pythonpath()}, check=True)
    imported = json.loads(out.stdout.splitlines()[-1])
    assert "torch" not in imported
    owners = metadata.packages_distributions()
    third_party = {m for m in imported
                   if m not in sys.stdlib_module_names and m != "pointerdomain" and not m.startswith("_")}
    missing = {m: owners.get(m) for m in third_party
               if not any(_canonical(d) in allowed for d in owners.get(m, []))}
    assert missing == {}, f"imported by the audit, not required by the audit extra: {missing}"
