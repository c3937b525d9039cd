"""The documentation's worked examples run as written: every ```python block marked
``<!-- doc-test -->`` in a page, in order, in one namespace per page (emulated device)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["docs/adoption.md"]
_BLOCK = re.compile(r"<!-- doc-test -->\s*\n```python\n(.*?)\n```", re.S)


def blocks(page: str) -> list[str]:
    return _BLOCK.findall((ROOT / page).read_text())


@pytest.mark.parametrize("page", PAGES)
def test_worked_examples_run(page: str) -> None:
    found = blocks(page)
    assert found, f"{page}: no <!-- doc-test --> blocks"
    namespace: dict[str, object] = {"__name__": f"doc:{page}"}
    for i, code in enumerate(found):
        exec(compile(code, f"{page} (block {i + 1})", "exec"), namespace)  # noqa: S102 -- our own docs
