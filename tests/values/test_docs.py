"""The README's and the docs' Python examples run as written (emulated device).

Every ```python block of README.md and docs/**/*.md runs, in order, in one namespace per
page. A block that is shown but not meant to run says why: either on the line before it,
``<!-- not run: REASON -->`` (not rendered), or as its first line, ``# not run REASON``. A statement commented ``# runtime: SomeError`` must raise that error from
``pointerdomain.errors`` (the examples show what the library refuses); the statements
after it run as usual.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import pointerdomain as pd

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))])
_BLOCK = re.compile(r"^(<!-- not run: [^>]+ -->\n)?```python\n(.*?)^```", re.S | re.M)
_RAISES = re.compile(r"#\s*runtime:\s*(\w+)")
NOT_RUN = "# not run"


def blocks(page: str) -> list[tuple[bool, str]]:
    """The page's ```python blocks, in order, each with whether it is marked not run."""
    return [(bool(mark) or code.lstrip().startswith(NOT_RUN), code)
            for mark, code in _BLOCK.findall((ROOT / page).read_text())]


def runnable(page: str) -> list[str]:
    return [code for not_run, code in blocks(page) if not not_run]


def run_block(code: str, name: str, namespace: dict[str, object]) -> None:
    """Run ``code`` statement by statement; one marked ``# runtime: X`` must raise X."""
    tree = ast.parse(code, filename=name)
    lines = code.splitlines()
    for stmt in tree.body:
        text = "\n".join(lines[stmt.lineno - 1 : stmt.end_lineno])
        marker = _RAISES.search(text)
        compiled = compile(ast.Module(body=[stmt], type_ignores=[]), f"{name} line {stmt.lineno}", "exec")
        if marker is None:
            exec(compiled, namespace)  # noqa: S102 -- our own docs
            continue
        expected = getattr(pd.errors, marker.group(1))
        with pytest.raises(expected):
            exec(compiled, namespace)  # noqa: S102 -- our own docs


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)])
def test_examples_run(page: str) -> None:
    namespace: dict[str, object] = {"__name__": f"doc:{page}"}
    for i, code in enumerate(runnable(page)):
        run_block(code, f"{page} (python block {i + 1})", namespace)


def test_every_page_with_examples_is_collected() -> None:
    """The pages known to carry worked examples still have runnable blocks, and a block
    that is not run says so (a typo in the marker would otherwise run it)."""
    for page in ["README.md", "docs/adoption.md", "docs/embedding.md"]:
        assert runnable(page), f"{page}: no runnable ```python block"
    for page in PAGES:
        for _, code in blocks(page):
            first = code.lstrip().splitlines()[0] if code.strip() else ""
            if first.lower().startswith("# not") and not first.startswith(NOT_RUN):
                pytest.fail(f"{page}: block marked {first!r}; the marker is {NOT_RUN!r}")


def test_a_wrong_expected_error_fails() -> None:
    """The ``# runtime:`` marker is checked, not trusted."""
    with pytest.raises(pytest.fail.Exception):
        run_block("x = 1  # runtime: DomainError\n", "case", {})
    namespace: dict[str, object] = {}
    run_block("import pointerdomain as pd\npd.HostVA(-1)  # runtime: InvalidArgumentError\ny = 2\n", "case", namespace)
    assert namespace["y"] == 2
