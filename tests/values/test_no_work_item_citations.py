"""No file of the repository cites a numbered work item or how the work was organised.

"issue 15 item 3", "#14", "the second session" or "the device tool" mean nothing to a
reader of the repository: a comment, docstring, doc or message states the decision itself
or points at a docs section. References to other projects' public trackers are facts with
their source and stay: ``vLLM #55428``, ``PR #35233``, ``sgl-project/sglang#40278``,
``vllm#42212``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve()

#: Citations of our own work items and of how the work was organised.
FORBIDDEN = [
    re.compile(r"\bissues?[ -]#?\d+", re.I),
    re.compile(r"\bitems? \d+(?:,| and |-\d| ?\))", re.I),
    re.compile(r"\b(?:first|second|third|fourth|fifth|previous|this|that|same|next|last|earlier|later) session\b", re.I),
    re.compile(r"\b(?:device tool|work item|house issue|the coordinator|lent (?:machine|H200|through))\b", re.I),
    re.compile(r"\b(?:a|fresh|another|new) helper (?:installed|found|tried|ran)\b", re.I),
]
#: A number after ``#`` is a work item unless it follows another project, a PR, or owner/repo.
_HASH = re.compile(r"(?<![\w&/])#(\d+)\b")
_UPSTREAM_BEFORE = re.compile(
    r"(?:\bPR|\bpull|\bvLLM|\bvllm|\bsglang|\bsgl-kernel|\bLMCache|\bNIXL|\bMooncake|\bQUDA|\bpytorch|\btorch"
    r"|\btriton|\bROCm|\bnanobind|\bCUDA|[\w.-]+/[\w.-]+)\s?$",
    re.I,
)
SKIP_SUFFIXES = {".png", ".jpg", ".so", ".whl", ".gz"}


def tracked_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if (ROOT / n).is_file() and (ROOT / n).suffix not in SKIP_SUFFIXES]


def citations(text: str) -> list[str]:
    """Every work-item citation in ``text``, as the matched words."""
    flat = re.sub(r"\s*\n\s*(?:#|//|\*)?\s*", " ", text)  # join lines, comment leaders dropped
    found = [m.group(0) for rx in FORBIDDEN for m in rx.finditer(flat)]
    for m in _HASH.finditer(flat):
        if not _UPSTREAM_BEFORE.search(flat[max(0, m.start() - 40) : m.start()]):
            found.append(flat[max(0, m.start() - 20) : m.end()].strip())
    return found


def test_no_file_cites_a_work_item() -> None:
    problems = []
    for path in tracked_files():
        if path.resolve() == SELF:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for hit in citations(text):
            problems.append(f"{path.relative_to(ROOT)}: {hit!r}")
    assert not problems, "state the decision or link a docs section instead of:\n" + "\n".join(problems)


def test_the_check_finds_each_form_and_keeps_upstream_references() -> None:
    for text in ["see issue 15 item 3", "(issue-10 item 3)", "fixed in #14 ", "the second session's run",
                 "lent through the device tool", "# Issue 13: build", "a fresh helper installed it",
                 "overlap,\n# item 6) is not generated"]:
        assert citations(text), text
    for text in ["vLLM #55428", "QUDA PR #1639", "sgl-project/sglang#40278", "vllm#42212", "sglang PR #35233",
                 "ROCm/legacy-rocm-build#1623", "a 4 KiB item 32 bytes", "a pytest session fixture",
                 "the peer's session id", "#include <cstdint>"]:
        assert not citations(text), text
