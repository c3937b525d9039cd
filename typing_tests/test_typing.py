"""Typing tests: run mypy (and pyright, when installed) once over typing_tests/cases
and report one result per case file; run each pass file on CPU.

* ``pass_*.py``: must type-check with no error at all; its ``assert_type`` calls
  pin the inferred types. It is also executed (CPU only, emulated devices), so
  the annotations and the runtime cannot drift apart.
* ``fail_*.py``: every line that must be rejected carries exactly one
  ``# type: ignore[<code>]``. mypy runs with ``warn_unused_ignores``, so the file
  fails if an expected error disappears (an unused ignore), changes code (the
  error is then reported), or if any unexpected error appears. Not executed.
* ``_*.py``: helpers imported by the pass files; must type-check clean.

mypy runs once per pytest session (``mypy.api.run`` over all case files) with
typing_tests/mypy.ini and a persistent cache (typing_tests/.mypy_cache, or
``$MYPY_CACHE_DIR``): a cold run spends ~30 s in torch's annotations, a warm run
about a second. It runs in a child interpreter, started in the background with
pyright and the pass files, so the three overlap; a cold run in the pytest
process itself would also leave millions of mypy objects behind for the garbage
collector and for interpreter exit (measured: ~20 s at exit). That the checked-in extension stub (src/pointerdomain/_C.pyi)
matches the built module is tests/platform/test_stubs.py's job. See docs/typing.md.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

HERE = Path(__file__).resolve().parent
CASES = HERE / "cases"
MYPY_INI = HERE / "mypy.ini"
PYRIGHT_CONFIG = HERE / "pyrightconfig.json"
CACHE_DIR = Path(os.environ.get("MYPY_CACHE_DIR", HERE / ".mypy_cache"))

PASS_FILES = sorted(CASES.glob("pass_*.py"))
FAIL_FILES = sorted(CASES.glob("fail_*.py"))
HELPER_FILES = sorted(CASES.glob("_*.py"))
ALL_FILES = PASS_FILES + FAIL_FILES + HELPER_FILES

_IGNORE = re.compile(r"#\s*type:\s*ignore(?:\[(?P<codes>[^\]]*)\])?")
_MYPY_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+): (?P<severity>error|note|warning): (?P<message>.*)$")

#: pyright rule(s) corresponding to each mypy error code used in the fail files.
#: An expected line must get at least one of its code's rules from pyright, and
#: nothing but those and the follow-on rules below.
PYRIGHT_RULES: dict[str, frozenset[str]] = {
    "arg-type": frozenset({"reportArgumentType"}),
    "assignment": frozenset({"reportAssignmentType", "reportAttributeAccessIssue"}),  # the latter: to an attribute
    "attr-defined": frozenset({"reportAttributeAccessIssue"}),
    "call-arg": frozenset({"reportCallIssue"}),
    "call-overload": frozenset({"reportArgumentType", "reportCallIssue"}),
    "comparison-overlap": frozenset({"reportUnnecessaryComparison", "reportUnnecessaryContains"}),
    "index": frozenset({"reportArgumentType", "reportIndexIssue"}),
    "list-item": frozenset({"reportArgumentType", "reportAssignmentType"}),
    "misc": frozenset({"reportAttributeAccessIssue"}),  # used here only for writes to frozen attributes
    "operator": frozenset({"reportOperatorIssue"}),
    "return-value": frozenset({"reportReturnType"}),
    "type-var": frozenset({"reportInvalidTypeArguments", "reportArgumentType"}),  # the latter: a call's TypeVar
}
#: What pyright adds as a consequence of the expected error on the same line (a
#: rejected expression's value is Unknown; a bare expression statement is unused).
#: Accepted only next to an expected rule, never alone.
PYRIGHT_FOLLOW_ON = frozenset(
    {"reportUnusedExpression", "reportUnknownMemberType", "reportUnknownVariableType", "reportUnknownArgumentType"}
)


# --------------------------------------------------------------------------- case files


@dataclass
class Case:
    path: Path
    expected: dict[int, list[str]] = field(default_factory=dict)  # line -> codes of its "# type: ignore[...]"
    assert_types: int = 0

    @property
    def kind(self) -> str:
        name = self.path.name
        return "pass" if name.startswith("pass_") else "fail" if name.startswith("fail_") else "helper"


def load_case(path: Path) -> Case:
    source = path.read_text()
    case = Case(path)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and (m := _IGNORE.search(tok.string)):
            codes = m.group("codes")
            case.expected[tok.start[0]] = [c.strip() for c in codes.split(",")] if codes else []
    case.assert_types = sum(
        1
        for node in ast.walk(ast.parse(source, str(path)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "assert_type"
    )
    return case


def structure_problems(case: Case) -> list[str]:
    """The suite's own rules, checked before the type checkers' results."""
    name = case.path.name
    if case.kind == "fail":
        problems = [
            f"{name}:{line}: an expected-error line takes exactly one code, got '# type: ignore[{', '.join(codes)}]'"
            for line, codes in sorted(case.expected.items())
            if len(codes) != 1
        ]
        if not case.expected:
            problems.append(f"{name}: a fail file without any '# type: ignore[<code>]' line")
        return problems
    problems = [f"{name}:{line}: '# type: ignore' in a {case.kind} file" for line in sorted(case.expected)]
    if case.kind == "pass" and case.assert_types == 0:
        problems.append(f"{name}: a pass file without any assert_type(...)")
    return problems


CASE_DATA = {path: load_case(path) for path in ALL_FILES}


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_case_count() -> None:
    """The suite keeps at least 60 cases: expected-error lines plus assert_type checks."""
    expected = sum(len(CASE_DATA[p].expected) for p in FAIL_FILES)
    asserted = sum(CASE_DATA[p].assert_types for p in PASS_FILES)
    print(f"{expected} expected errors in {len(FAIL_FILES)} fail files + "
          f"{asserted} assert_type checks in {len(PASS_FILES)} pass files = {expected + asserted} cases")
    assert expected + asserted >= 60


# --------------------------------------------------------------------------- background jobs

#: Runs mypy.api.run with the arguments given and prints one JSON object:
#: {"stdout", "stderr", "status"}. os._exit skips freeing mypy's object graph.
_MYPY_RUNNER = r"""
import json, os, sys
from mypy import api
stdout, stderr, status = api.run(sys.argv[1:])
sys.stdout.write(json.dumps({"stdout": stdout, "stderr": stderr, "status": status}) + "\n")
sys.stdout.flush()
os._exit(0)
"""

#: Runs the pass files given as arguments, each in a child forked after torch and
#: pointerdomain are imported once (a fresh interpreter per file would import
#: torch seven times: ~3 s each on a small CI machine). Prints one JSON object:
#: {path: [exit code, output]}.
_PASS_RUNNER = r"""
import json, os, runpy, signal, sys, traceback
import torch, pydantic, pointerdomain  # imported once, before the forks
results = {}
for path in sys.argv[1:]:
    sys.stdout.flush(); sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r); os.dup2(w, 1); os.dup2(w, 2)
        signal.alarm(300)  # a pass file that hangs dies with SIGALRM instead of stalling the session
        code = 0
        try:
            sys.path.insert(0, os.path.dirname(path))
            sys.argv = [path]
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc(); code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    os.close(w)
    with os.fdopen(r, errors="replace") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    results[path] = [os.waitstatus_to_exitcode(status), out]
print(json.dumps(results))
"""


def _cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",  # CPU only, even on a GPU machine: the pass files use the emulated devices
        POINTERDOMAIN_EMULATED_DEVICES="2",
        POINTERDOMAIN_CHECKED="0",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("POINTERDOMAIN_EMULATE_MEMLOCK", None)
    return env


def _pyright_command() -> list[str] | None:
    exe = shutil.which("pyright")
    if exe is not None:
        return [exe]
    if importlib.util.find_spec("pyright") is not None:
        return [sys.executable, "-m", "pyright"]
    return None


@dataclass
class Job:
    """A subprocess started in the background; its output goes to a temp file
    (a pipe would stall it once its buffer filled)."""

    proc: subprocess.Popen[bytes]
    out: IO[bytes]

    @classmethod
    def start(cls, args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> Job:
        out = tempfile.TemporaryFile()
        return cls(subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT), out)

    def wait(self, timeout: float) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = -9
        self.out.seek(0)
        text = self.out.read().decode(errors="replace")
        self.out.close()
        return code, text


@dataclass
class Jobs:
    mypy: Job | None = None
    pass_files: Job | None = None
    pyright: Job | None = None


@pytest.fixture(scope="session")
def jobs(request: pytest.FixtureRequest) -> Iterator[Jobs]:
    """Start, once and together, the subprocesses the selected tests need."""
    wanted = {getattr(item, "originalname", item.name) for item in request.session.items}
    jobs = Jobs()
    if wanted & {"test_mypy", "test_mypy_ran"}:
        args = [
            "--config-file", str(MYPY_INI),
            "--cache-dir", str(CACHE_DIR),
            "--show-absolute-path",
            "--show-error-codes",
            "--hide-error-context",
            "--no-pretty",
            "--no-color-output",
            "--no-error-summary",
            *map(str, ALL_FILES),
        ]
        jobs.mypy = Job.start([sys.executable, "-c", _MYPY_RUNNER, *args], cwd=HERE.parent)
    if "test_pass_file_runs" in wanted:
        jobs.pass_files = Job.start(
            [sys.executable, "-c", _PASS_RUNNER, *map(str, PASS_FILES)], cwd=CASES, env=_cpu_env()
        )
    command = _pyright_command()
    if command is not None and wanted & {"test_pyright_strict", "test_pyright_reported_only_case_files"}:
        jobs.pyright = Job.start(
            [*command, "--outputjson", "-p", str(PYRIGHT_CONFIG), "--pythonpath", sys.executable], cwd=HERE
        )
    yield jobs
    for job in (jobs.mypy, jobs.pass_files, jobs.pyright):
        if job is not None and job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


# --------------------------------------------------------------------------- mypy


@dataclass
class MypyRun:
    status: int
    stdout: str
    stderr: str
    by_file: dict[Path, list[str]]  # every reported line (errors and their notes), per file
    errors: dict[Path, int]


@pytest.fixture(scope="session")
def mypy_run(jobs: Jobs) -> MypyRun:
    assert jobs.mypy is not None
    code, out = jobs.mypy.wait(timeout=600)
    try:
        report = json.loads(out.splitlines()[-1])
        stdout, stderr, status = str(report["stdout"]), str(report["stderr"]), int(report["status"])
    except (IndexError, KeyError, ValueError):
        pytest.fail(f"mypy did not run (exit {code}):\n{out}", pytrace=False)
    by_file: dict[Path, list[str]] = {}
    errors: dict[Path, int] = {}
    for line in stdout.splitlines():
        m = _MYPY_LINE.match(line)
        path = Path(m.group("path")).resolve() if m else Path("<mypy>")
        by_file.setdefault(path, []).append(line)
        if m is None or m.group("severity") == "error":
            errors[path] = errors.get(path, 0) + 1
    return MypyRun(status, stdout, stderr, by_file, errors)


def test_mypy_ran(mypy_run: MypyRun) -> None:
    """mypy itself worked (status 2 is a crash or a usage error) and reported
    nothing outside the case files."""
    assert mypy_run.status in (0, 1), f"mypy failed to run (status {mypy_run.status}):\n{mypy_run.stderr}{mypy_run.stdout}"
    outside = [line for path, lines in mypy_run.by_file.items() if path not in CASE_DATA for line in lines]
    assert not outside, "mypy reported outside the case files:\n" + "\n".join(outside)


@pytest.mark.parametrize("path", ALL_FILES, ids=_ids(ALL_FILES))
def test_mypy(path: Path, mypy_run: MypyRun) -> None:
    case = CASE_DATA[path]
    problems = structure_problems(case)
    assert not problems, "\n".join(problems)
    if mypy_run.status not in (0, 1):
        pytest.fail(f"mypy failed to run (status {mypy_run.status}):\n{mypy_run.stderr}", pytrace=False)
    if mypy_run.errors.get(path, 0):
        what = (
            "an expected error vanished (unused ignore) or changed, or an unexpected one appeared"
            if case.kind == "fail"
            else "this file must type-check clean"
        )
        pytest.fail(f"mypy: {what}:\n" + "\n".join(mypy_run.by_file[path]), pytrace=False)


# --------------------------------------------------------------------------- pass files at runtime


@pytest.fixture(scope="session")
def pass_runs(jobs: Jobs) -> dict[str, tuple[int, str]]:
    assert jobs.pass_files is not None
    code, out = jobs.pass_files.wait(timeout=600)
    try:
        report: dict[str, tuple[int, str]] = json.loads(out.splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        pytest.fail(f"the pass-file runner failed (exit {code}):\n{out}", pytrace=False)
    return report


@pytest.mark.parametrize("path", PASS_FILES, ids=_ids(PASS_FILES))
def test_pass_file_runs(path: Path, pass_runs: dict[str, tuple[int, str]]) -> None:
    """The pass file runs clean on CPU (emulated devices), in its own process."""
    code, out = pass_runs[str(path)]
    if code != 0:
        pytest.fail(f"{path.name} exited with {code} on CPU:\n{out}", pytrace=False)


# --------------------------------------------------------------------------- pyright


@dataclass
class PyrightRun:
    version: str
    by_file: dict[Path, dict[int, list[tuple[str, str]]]]  # file -> line -> [(rule, message)]


@pytest.fixture(scope="session")
def pyright_run(jobs: Jobs) -> PyrightRun:
    if jobs.pyright is None:
        pytest.skip("pyright is not installed (pip install pyright); the mypy results do not depend on it")
    code, out = jobs.pyright.wait(timeout=600)
    try:
        report = json.loads(out[out.index("{"):])
    except (ValueError, json.JSONDecodeError):
        pytest.fail(f"pyright gave no JSON report (exit {code}):\n{out}", pytrace=False)
    if code not in (0, 1):
        pytest.fail(f"pyright failed to run (exit {code}):\n{out}", pytrace=False)
    by_file: dict[Path, dict[int, list[tuple[str, str]]]] = {}
    for diag in report.get("generalDiagnostics", []):
        if diag.get("severity") == "information":
            continue
        path = Path(diag["file"]).resolve()
        line = diag["range"]["start"]["line"] + 1
        by_file.setdefault(path, {}).setdefault(line, []).append((diag.get("rule", ""), diag["message"]))
    return PyrightRun(report.get("version", "?"), by_file)


def _pyright_problems(case: Case, found: dict[int, list[tuple[str, str]]]) -> Iterator[str]:
    name = case.path.name
    for line in sorted(set(found) | set(case.expected)):
        diags = found.get(line, [])
        rules = {rule for rule, _ in diags}
        shown = "; ".join(f"{msg.splitlines()[0]} ({rule})" for rule, msg in diags)
        if line not in case.expected:
            yield f"{name}:{line}: unexpected: {shown}"
            continue
        (code,) = case.expected[line]
        allowed = PYRIGHT_RULES.get(code)
        if allowed is None:
            yield f"{name}:{line}: no pyright rule is mapped to mypy code [{code}]: add it to PYRIGHT_RULES"
        elif not rules & allowed:
            yield f"{name}:{line}: expected pyright {'/'.join(sorted(allowed))} (mypy [{code}]), got: {shown or 'nothing'}"
        elif rules - allowed - PYRIGHT_FOLLOW_ON:
            yield f"{name}:{line}: besides the expected [{code}] error, also: {shown}"


@pytest.mark.parametrize("path", ALL_FILES, ids=_ids(ALL_FILES))
def test_pyright_strict(path: Path, pyright_run: PyrightRun) -> None:
    """The same case files under pyright, strict (pyrightconfig.json): each expected
    line gets the pyright rule matching its mypy code, and nothing else errs."""
    problems = list(_pyright_problems(CASE_DATA[path], pyright_run.by_file.get(path, {})))
    if problems:
        pytest.fail(f"pyright {pyright_run.version}, strict:\n" + "\n".join(problems), pytrace=False)


def test_pyright_reported_only_case_files(pyright_run: PyrightRun) -> None:
    outside = sorted(str(p) for p in pyright_run.by_file if p not in CASE_DATA)
    assert not outside, f"pyright reported diagnostics outside the case files: {outside}"
