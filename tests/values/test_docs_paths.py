"""Every repository path the docs cite exists, and every docs page (and section) the
repository cites exists.

A path is cited when it starts with a top-level folder of the repository (``src/...``,
``tests/...``, ``docs/...``) or with a folder of the package (``registration/memory.py``,
``pointerdomain/registration/ladder.py``, ``_platform/cuda_driver.py``). pytest node ids
(``tests/test_x.py::test_y``) are checked for their file. A section is cited as
``<a docs page>, "Heading"``: some heading of that page must start with the quoted text.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))])
#: Where a cited path may be rooted: the repository, the package, its sources, its headers.
BASES = [ROOT, ROOT / "src" / "pointerdomain", ROOT / "src", ROOT / "src" / "pointerdomain" / "include"]
_TOP = r"(?:src|scripts|benchmarks|tests|typing_tests|docs|\.ci)"
_PKG = r"(?:pointerdomain|registration|transfer|tools|_platform|adapters|compat|audit|kernels|include)"
_PATH = re.compile(rf"(?<![\w/.$<>@:-])((?:{_TOP}|{_PKG})/[\w./*<>-]*[\w*>])")
#: Paths in other projects' repositories that the docs name with their project.
UPSTREAM = {
    "tests/v1/test_mem_kernels.py",  # LMCache
    "tests/v1/utils.py",  # LMCache
    "tests/kernels/attention/test_cache.py",  # vLLM
}
#: Made by running the tests, not kept in the repository.
GENERATED = {"typing_tests/.mypy_cache"}
#: Files a dated log names as they were when it was measured (replaced since; the log says by what).
HISTORICAL = {"benchmarks/transfer.py", "benchmarks/sweep_kernel.py", "tests/test_foundation.py"}
_SECTION = re.compile(r"(docs/[\w/.-]+\.md)\)?,? \(?\"([^\"]+)\"")
_DOC = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+\.md)")


def cited_paths(text: str) -> set[str]:
    found = set()
    for match in _PATH.finditer(text):
        path = match.group(1).rstrip(".")
        if "<" in path or "*" in path:
            continue
        found.add(path)
    return found


def exists(path: str) -> bool:
    return any((base / path).exists() for base in BASES)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in names:
        p = ROOT / name
        if p.suffix in {".png", ".so", ".whl"} or not p.is_file():
            continue
        out.append(p)
    return out


@pytest.mark.parametrize("page", PAGES)
def test_paths_a_page_cites_exist(page: str) -> None:
    text = (ROOT / page).read_text()
    allowed = UPSTREAM | GENERATED | (HISTORICAL if page.startswith("docs/log/") else set())
    missing = sorted(p for p in cited_paths(text) if p not in allowed and not exists(p))
    assert not missing, f"{page} cites paths that do not exist: {missing}"


def test_docs_pages_and_sections_cited_anywhere_exist() -> None:
    problems = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(ROOT)
        for doc in set(_DOC.findall(text)):
            if not (ROOT / doc).is_file():
                problems.append(f"{rel}: {doc} does not exist")
        for doc, title in _SECTION.findall(text.replace("\n", " ")):
            page = ROOT / doc
            if not page.is_file():
                continue
            headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]
            title = re.sub(r"\s+", " ", title)
            if not any(h.startswith(title) for h in headings):
                problems.append(f'{rel}: {doc} has no section "{title}"')
    assert not problems, "\n".join(problems)


def test_the_path_check_sees_a_missing_file() -> None:
    text = "see `src/pointerdomain/no_such_module.py` and tests/values/test_docs.py::test_examples_run"
    assert cited_paths(text) == {"src/pointerdomain/no_such_module.py", "tests/values/test_docs.py"}
    assert not exists("src/pointerdomain/no_such_module.py")
    assert exists("tests/values/test_docs.py") and exists("registration/memory.py")
