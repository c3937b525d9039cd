#!/usr/bin/env python3
"""Run three engines' own kernel test files against pointerdomain's drop-in modules.

Usage: scripts/upstream-tests <sglang|lmcache|vllm|all> <upstream-root> [--strict-alias]
       [--pin-host] [--keep] [--show-diff] [pytest args...]

  --strict-alias  run pytest with POINTERDOMAIN_STRICT_ALIAS=1 (without it the variable is
                  removed from pytest's environment: the flag decides)
  --pin-host      vllm: the kv_cache_factory stand-in pins its CPU caches (upstream's are
                  pageable; pointerdomain.compat.vllm.swap_blocks copies both, through
                  different routes: this runs the registered/pinned one)
  --keep          keep the temporary folder (its path is printed)
  --show-diff     print the unified diff of every rewritten file
  anything else   passed to pytest (after the engine's defaults: vllm's -k swap)

<upstream-root> holds the upstream files at their upstream paths, one folder per engine
(``<root>/sglang/sgl-kernel/tests/test_kvcacheio.py``; for one engine ``<root>/<path>``
works too). Nothing is fetched here and nothing upstream is written into the repository:
each run copies the files into a fresh temporary folder and runs pytest there.

What changes, and only that (each change is printed with its file and line):

* import lines: the statements that import the engine's kernel module are pointed at
  ``pointerdomain.compat.<engine module>``; imports of upstream packages that are not
  installed on the test machine are pointed at stand-ins under ``_shims/`` in the
  temporary folder. Each substitution is an explicit (old text -> new text) entry of the
  engine's table below, applied only on the first line of an import statement; an entry
  that matches nothing is an error (the upstream file changed: look again).
* module-level skips are reported; the ones listed for the engine (a skip that says the
  engine's own kernel segfaults) are disabled by commenting out the statement, so the run
  shows whether ours does.

Every other line is byte-for-byte the upstream one: the runner checks that the rewritten
file differs from the original only on the lines it printed (same line count, so
tracebacks carry upstream line numbers).

Stand-ins (our code, kept small, never copied from upstream): see the ``*_STANDINS``
sources below and the generated ``conftest.py`` of each engine.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, NamedTuple, Sequence

DISABLED_PREFIX: Final = "# [upstream-tests: disabled] "


@dataclass(frozen=True)
class Sub:
    """Replace ``old`` by ``new`` on the first line of any import statement containing it."""

    old: str
    new: str
    why: str
    required: bool = True  # an entry that matches nothing is an error


@dataclass(frozen=True)
class SkipRule:
    """A module-level skip whose source contains ``contains`` is disabled (commented out)."""

    contains: str
    why: str


@dataclass(frozen=True)
class Engine:
    name: str
    test: str  # upstream path of the test file
    helpers: tuple[str, ...]  # upstream helper modules copied next to it
    subs: dict[str, tuple[Sub, ...]]  # upstream path -> its substitutions
    skip_rules: tuple[SkipRule, ...]
    shims: dict[str, str]  # module file name under _shims/ -> source
    conftest: str
    default_args: tuple[str, ...]
    #: top-level packages that are not installed there: an import of one left after the
    #: substitutions is an error at module level, a warning inside a function
    foreign: tuple[str, ...] = ()
    #: a module alias the file calls attributes of -> the names its stand-in provides
    provided: dict[str, tuple[str, ...]] = field(default_factory=dict)
    standin_summary: str = ""
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------
# Stand-ins. Small, written here from the call shapes the tests use; each says what it is.

SHIMS_INIT: Final = '"""Stand-ins for upstream modules that are not installed here (scripts/upstream_tests.py)."""\n'

SUPPORT: Final = '''"""Helpers shared by the stand-ins."""
from typing import Any, Callable, NoReturn

import pytest


def not_provided(module: str, name: str) -> Callable[..., NoReturn]:
    """A function standing for ``module.name``, which that module lacks: calling it skips."""

    def _missing(*args: Any, **kwargs: Any) -> NoReturn:
        pytest.skip(f"{name}: not provided by {module}")

    _missing.__name__ = name
    return _missing


def unavailable(name: str) -> Callable[..., NoReturn]:
    """A stand-in for an upstream function the runner does not provide (not a transfer op)."""

    def _unavailable(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{name}: upstream helper not provided by scripts/upstream-tests")

    _unavailable.__name__ = name
    return _unavailable
'''

SGLANG_STANDINS: Final = '''"""Stand-in for ``sglang.srt.utils`` (the two helpers test_kvcacheio.py imports)."""
import torch


def is_hip() -> bool:
    return torch.version.hip is not None


def get_cuda_version() -> tuple[int, int]:
    """(major, minor) of the CUDA torch was built with; (0, 0) without CUDA."""
    if not torch.version.cuda:
        return (0, 0)
    major, minor = torch.version.cuda.split(".")[:2]
    return (int(major), int(minor))
'''

LMCACHE_STANDINS: Final = '''"""Stand-ins for the lmcache modules test_mem_kernels.py and tests/v1/utils.py import.

``PinMemoryAllocator``: like upstream's, one pinned host buffer of ``size`` bytes made at
construction (torch's pinned allocator, i.e. runtime-pinned memory); ``allocate(shape,
dtype)`` returns an object whose ``.tensor`` is a contiguous view carved from it (offsets
aligned to 512 bytes); ``close()`` drops the buffer. No free list: the tests allocate,
compare and close. The other names are placeholders for helpers the transfer tests never
call.
"""
import math
from typing import Any, Sequence

import torch

_ALIGN = 512


class _MemoryObj:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class PinMemoryAllocator:
    def __init__(self, size: int, use_paging: bool = False, **kwargs: Any) -> None:
        self._buffer: torch.Tensor | None = torch.empty(int(size), dtype=torch.uint8, pin_memory=True)
        self._offset = 0

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, *args: Any, **kwargs: Any) -> _MemoryObj:
        if self._buffer is None:
            raise RuntimeError("PinMemoryAllocator stand-in: allocate after close")
        nbytes = math.prod(int(s) for s in shape) * torch.empty((), dtype=dtype).element_size()
        start = -(-self._offset // _ALIGN) * _ALIGN
        if start + nbytes > self._buffer.numel():
            raise MemoryError(f"PinMemoryAllocator stand-in: {nbytes} bytes do not fit")
        self._offset = start + nbytes
        view = self._buffer[start:start + nbytes].view(dtype).view(tuple(int(s) for s in shape))
        return _MemoryObj(view)

    def close(self) -> None:
        self._buffer = None


class _Placeholder:
    """An upstream class the transfer tests never construct."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__}: placeholder in scripts/upstream-tests")


class LMCacheEngineMetadata(_Placeholder):
    pass


class CacheEngineKey(_Placeholder):
    pass


class VLLMPagedMemGPUConnectorV2(_Placeholder):
    pass
'''

VLLM_STANDINS: Final = '''"""Stand-ins for the vllm / vLLM-test modules test_cache.py imports.

``opcheck`` runs the op once with the arguments (upstream runs torch.library.opcheck, which
also runs it); ``current_platform`` answers the few questions the file asks from torch;
``create_kv_caches_with_random`` makes vLLM's paged K/V cache shapes (key
``[NB, NH, HS // x, BS, x]`` with ``x = 16 // element_size``, value ``[NB, NH, HS, BS]``;
fp8 caches are uint8) filled with random values; ``_C_cache_ops::swap_blocks`` is
registered as a torch op that calls ``pointerdomain.compat.vllm.swap_blocks``, so
``torch.ops._C_cache_ops.swap_blocks`` resolves to ours.
"""
import os
import random
from typing import Any, Callable

import torch

from _shims._support import unavailable

DEFAULT_OPCHECK_TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


def opcheck(op: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
            test_utils: Any = DEFAULT_OPCHECK_TEST_UTILS, raise_exception: bool = True,
            cond: bool = True) -> dict[str, str]:
    if cond:
        op(*args, **(kwargs or {}))
    return {}


class _Platform:
    def is_rocm(self) -> bool:
        return torch.version.hip is not None

    def is_cuda(self) -> bool:
        return torch.version.cuda is not None and torch.cuda.is_available()

    def is_cpu(self) -> bool:
        return not torch.cuda.is_available()

    def has_device_capability(self, capability: int, device_id: int = 0) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        return major * 10 + minor >= int(capability)

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn


current_platform = _Platform()


def set_random_seed(seed: int | None) -> None:
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)


_CACHE_DTYPES = {"half": torch.half, "bfloat16": torch.bfloat16, "float": torch.float, "fp8": torch.uint8}


#: scripts/upstream-tests --pin-host: CPU caches pinned (upstream's are pageable)
PIN_HOST = os.environ.get("UPSTREAM_TESTS_PIN_HOST") == "1"


def create_kv_caches_with_random(num_blocks: int, block_size: int, num_layers: int, num_heads: int,
                                 head_size: int, cache_dtype: Any, model_dtype: Any = None,
                                 seed: int | None = None, device: str = "cuda"
                                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if cache_dtype == "fp8" and head_size % 16:
        raise ValueError(f"fp8 key cache needs head_size % 16 == 0, got {head_size}")
    set_random_seed(seed)
    if cache_dtype == "auto":
        dtype = model_dtype
    elif isinstance(cache_dtype, torch.dtype):
        dtype = cache_dtype
    else:
        dtype = _CACHE_DTYPES[cache_dtype]
    assert isinstance(dtype, torch.dtype), dtype
    scale = head_size ** -0.5
    x = 16 // torch.empty((), dtype=dtype).element_size()
    shapes = ((num_blocks, num_heads, head_size // x, block_size, x), (num_blocks, num_heads, head_size, block_size))
    caches: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for shape, out in zip(shapes, caches):
        for _ in range(num_layers):
            if dtype == torch.uint8:  # fp8 bytes of values in [-scale, scale]
                vals = torch.empty(shape, dtype=torch.float32, device=device).uniform_(-scale, scale)
                out.append(vals.to(torch.float8_e4m3fn).view(torch.uint8))
            else:
                out.append(torch.empty(shape, dtype=dtype, device=device).uniform_(-scale, scale))
    if PIN_HOST and torch.device(device).type == "cpu":
        caches = ([t.pin_memory() for t in caches[0]], [t.pin_memory() for t in caches[1]])
    return caches


scaled_dequantize = unavailable("vllm...quant_utils.scaled_dequantize")
nvfp4_kv_cache_split_views = unavailable("vllm.utils.torch_utils.nvfp4_kv_cache_split_views")


@torch.library.custom_op("_C_cache_ops::swap_blocks", mutates_args=("dst",))
def _swap_blocks_op(src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int,
                    block_mapping: torch.Tensor) -> None:
    from pointerdomain.compat.vllm import swap_blocks

    swap_blocks(src, dst, block_size_in_bytes, block_mapping)
'''

VLLM_CUSTOM_OPS: Final = '''"""``vllm._custom_ops`` for test_cache.py: the swap ops are pointerdomain.compat.vllm's.

``convert_fp8`` is a plain-torch stand-in (fp8 e4m3 bytes <-> float, times/divided by
``scale``), only so the MLA swap test can fill its fp8 caches; everything else the file
calls on ``ops`` (reshape_and_cache, ...) is not here and fails if such a test runs.
"""
import torch

from pointerdomain.compat.vllm import swap_blocks, swap_blocks_batch

__all__ = ["swap_blocks", "swap_blocks_batch", "convert_fp8"]


def convert_fp8(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, kv_dtype: str = "fp8") -> None:
    if kv_dtype not in ("fp8", "fp8_e4m3"):
        raise NotImplementedError(f"convert_fp8 stand-in: kv_dtype {kv_dtype!r}")
    if dst.dtype == torch.uint8 and src.dtype != torch.uint8:
        dst.copy_((src.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    elif src.dtype == torch.uint8 and dst.dtype != torch.uint8:
        dst.copy_((src.view(torch.float8_e4m3fn).float() * scale).to(dst.dtype))
    else:
        raise NotImplementedError(f"convert_fp8 stand-in: {src.dtype} -> {dst.dtype}")
'''

CONFTEST_COMMON: Final = '''"""Generated by scripts/upstream-tests: session header and the strict-alias check."""
import os

import pytest
import torch

import pointerdomain as pd


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [
        f"upstream-tests: pointerdomain from {os.path.dirname(pd.__file__)}",
        f"upstream-tests: strict alias mode {'ON' if pd.strict_alias_enabled() else 'off'}; "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"GPU {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}",
    ]


def pytest_sessionstart(session: pytest.Session) -> None:
    # the variable is read when pointerdomain is imported: make sure it took effect
    if os.environ.get("POINTERDOMAIN_STRICT_ALIAS") == "1" and not pd.strict_alias_enabled():
        raise pytest.UsageError("POINTERDOMAIN_STRICT_ALIAS=1 but pointerdomain.strict_alias_enabled() is False")
'''

CONFTEST_LMCACHE: Final = '''

@pytest.fixture(scope="module")
def has_npu() -> bool:
    """Stand-in for LMCache's tests/conftest.py fixture: no Ascend NPU here."""
    return False
'''

CONFTEST_VLLM: Final = '''

import _shims.vllm_standins as _vllm_standins  # registers torch.ops._C_cache_ops.swap_blocks


@pytest.fixture()
def kv_cache_factory():  # type: ignore[no-untyped-def]
    """Stand-in for vLLM's tests/conftest.py fixture of the same name."""
    return _vllm_standins.create_kv_caches_with_random
'''

PYTEST_INI: Final = """[pytest]
markers =
    cpu_model: vLLM's marker for CPU-backend tests
"""

ENGINES: Final[dict[str, Engine]] = {
    "sglang": Engine(
        name="sglang",
        test="sgl-kernel/tests/test_kvcacheio.py",
        helpers=(),
        subs={
            "sgl-kernel/tests/test_kvcacheio.py": (
                Sub("from sgl_kernel.kvcacheio import", "from pointerdomain.compat.sgl_kernel import",
                    "the kernel module under test"),
                Sub("from sglang.srt.utils import", "from _shims.sglang_standins import",
                    "is_hip / get_cuda_version stand-ins (sglang not installed)"),
            ),
        },
        skip_rules=(SkipRule("segfaults on CUDA 13",
                             "upstream skips the module because sgl-kernel's own kernel segfaults on CUDA 13; "
                             "ours must not, and this run shows whether it does"),),
        shims={"sglang_standins.py": SGLANG_STANDINS},
        conftest=CONFTEST_COMMON,
        default_args=(),
        foreign=("sgl_kernel", "sglang"),
        standin_summary="conftest.py: header only",
    ),
    "lmcache": Engine(
        name="lmcache",
        test="tests/v1/test_mem_kernels.py",
        helpers=("tests/v1/utils.py",),
        subs={
            "tests/v1/test_mem_kernels.py": (
                Sub("import lmcache.c_ops as lmc_ops", "import pointerdomain.compat.lmcache as lmc_ops",
                    "the kernel module under test"),
                Sub("from lmcache.v1.memory_management import", "from _shims.lmcache_standins import",
                    "PinMemoryAllocator stand-in (lmcache not installed)"),
            ),
            "tests/v1/utils.py": (
                Sub("from lmcache.config import", "from _shims.lmcache_standins import",
                    "placeholder (only used by helpers the transfer tests do not call)"),
                Sub("from lmcache.utils import", "from _shims.lmcache_standins import", "placeholder (same)"),
                Sub("from lmcache.v1.gpu_connector import", "from _shims.lmcache_standins import",
                    "placeholder (same)"),
            ),
        },
        skip_rules=(),
        shims={"lmcache_standins.py": LMCACHE_STANDINS},
        conftest=CONFTEST_COMMON + CONFTEST_LMCACHE,
        default_args=(),
        foreign=("lmcache", "torch_npu"),
        standin_summary="conftest.py: has_npu fixture (False)",
        notes=("`from utils import ...` is the upstream tests/v1/utils.py, copied next to the test unchanged "
               "but for its three lmcache import lines",),
    ),
    "vllm": Engine(
        name="vllm",
        test="tests/kernels/attention/test_cache.py",
        helpers=(),
        subs={
            "tests/kernels/attention/test_cache.py": (
                Sub("from vllm import _custom_ops as ops", "from _shims import vllm_custom_ops as ops",
                    "swap_blocks / swap_blocks_batch from pointerdomain.compat.vllm, plus a convert_fp8 "
                    "stand-in for the MLA swap test's fp8 fill"),
                Sub("from tests.kernels.utils import", "from _shims.vllm_standins import",
                    "opcheck stand-in: runs the op once"),
                Sub("from vllm.model_executor.layers.quantization.utils.quant_utils import",
                    "from _shims.vllm_standins import", "placeholder (used only by reshape tests)"),
                Sub("from vllm.platforms import", "from _shims.vllm_standins import",
                    "current_platform stand-in"),
                Sub("from vllm.utils.torch_utils import", "from _shims.vllm_standins import",
                    "set_random_seed stand-in; nvfp4 placeholder"),
            ),
        },
        skip_rules=(),
        shims={"vllm_standins.py": VLLM_STANDINS, "vllm_custom_ops.py": VLLM_CUSTOM_OPS},
        conftest=CONFTEST_COMMON + CONFTEST_VLLM,
        default_args=("-k", "swap"),
        foreign=("vllm", "tests"),
        provided={"ops": ("swap_blocks", "swap_blocks_batch", "convert_fp8")},
        standin_summary="conftest.py: kv_cache_factory fixture; torch.ops._C_cache_ops.swap_blocks registered "
                        "(calls pointerdomain.compat.vllm.swap_blocks)",
        notes=("the file's other tests exercise vLLM ops pointerdomain does not provide; -k swap selects "
               "test_swap_blocks and test_swap_blocks_mla (override with your own -k)",),
    ),
}


# ---------------------------------------------------------------------------------------
# Rewriting.

class Change(NamedTuple):
    path: str
    line: int  # 1-based
    old: str
    new: str
    why: str


class RewriteError(Exception):
    pass


def _import_first_lines(tree: ast.Module) -> dict[int, ast.Import | ast.ImportFrom]:
    return {node.lineno: node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))}


def _module_level_statements(body: Sequence[ast.stmt]) -> list[ast.stmt]:
    """Statements run at import: the module body and what its if/try blocks hold."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _module_level_statements(stmt.body) + _module_level_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                out += _module_level_statements(block)
    return out


def _is_module_skip(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        return isinstance(f, ast.Attribute) and f.attr in ("skip", "importorskip")
    return False


def _top_package(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [] if node.level or node.module is None else [node.module.split(".")[0]]
    return [a.name.split(".")[0] for a in node.names]


def rewrite(path: str, text: str, engine: Engine, *,
            shim_redirects: dict[int, str]) -> tuple[str, list[Change], list[str]]:
    """Apply the engine's table to one upstream file; returns (new text, changes, warnings)."""
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text, filename=path)
    imports = _import_first_lines(tree)
    changes: list[Change] = []
    warnings: list[str] = []
    for sub in engine.subs.get(path, ()):
        hits = 0
        for lineno, node in sorted(imports.items()):
            line = lines[lineno - 1]
            if sub.old not in line:
                continue
            new = shim_redirects.get(lineno, sub.new)
            lines[lineno - 1] = line.replace(sub.old, new, 1)
            changes.append(Change(path, lineno, line.rstrip("\n"), lines[lineno - 1].rstrip("\n"),
                                  sub.why if new == sub.new else sub.why + "; names it lacks stand as skips"))
            hits += 1
        if sub.required and not hits:
            raise RewriteError(f"{path}: no import line contains {sub.old!r}: the upstream file changed, "
                               "update the table in scripts/upstream_tests.py")
    for stmt in _module_level_statements(tree.body):
        if not _is_module_skip(stmt):
            continue
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        source = "".join(lines[first - 1:last])
        rule = next((r for r in engine.skip_rules if r.contains in source), None)
        if rule is None:
            warnings.append(f"{path}:{first}: module-level skip KEPT: {' '.join(source.split())}")
            continue
        for i in range(first, last + 1):
            old = lines[i - 1]
            lines[i - 1] = DISABLED_PREFIX + old if old.strip() else old
            changes.append(Change(path, i, old.rstrip("\n"), lines[i - 1].rstrip("\n"),
                                  f"module-level skip disabled: {rule.why}"))
    new_text = "".join(lines)
    # whatever upstream package is still imported: not installed there
    new_tree = ast.parse(new_text, filename=path)
    run_at_import = {id(s) for s in _module_level_statements(new_tree.body)}
    for lineno, node in sorted(_import_first_lines(new_tree).items()):
        pkgs = [p for p in _top_package(node) if p in engine.foreign]
        if not pkgs:
            continue
        at_module_level = id(node) in run_at_import
        msg = f"{path}:{lineno}: import of {', '.join(pkgs)} left as is: {lines[lineno - 1].strip()}"
        if at_module_level:
            raise RewriteError(msg + " (module level: the file cannot import; add a table entry)")
        warnings.append(msg + " (inside a function: fails only if that test runs)")
    _check_only_printed_lines_changed(path, text, new_text, changes)
    return new_text, changes, warnings


def _check_only_printed_lines_changed(path: str, old: str, new: str, changes: Sequence[Change]) -> None:
    a, b = old.splitlines(), new.splitlines()
    if len(a) != len(b):
        raise RewriteError(f"{path}: line count changed ({len(a)} -> {len(b)})")
    allowed = {c.line for c in changes}
    bad = [i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y and i + 1 not in allowed]
    if bad:
        raise RewriteError(f"{path}: lines changed that were not printed: {bad}")


def _imported_names(text: str, old: str) -> dict[int, list[str]]:
    """For each `from ... import` statement whose first line contains ``old``: the names it imports."""
    lines = text.splitlines()
    out: dict[int, list[str]] = {}
    for lineno, node in _import_first_lines(ast.parse(text)).items():
        if isinstance(node, ast.ImportFrom) and old in lines[lineno - 1]:
            out[lineno] = [a.name for a in node.names]
    return out


def _attributes_used(text: str, alias: str) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == alias}


_TARGET = re.compile(r"^from (pointerdomain\.compat\.\w+) import$|^import (pointerdomain\.compat\.\w+) as (\w+)$")


def plan_targets(path: str, text: str, engine: Engine, shims: dict[str, str]) -> tuple[dict[int, str], list[str]]:
    """Check the compat modules provide what the file imports from them.

    A missing name in a ``from compat.x import (...)`` statement would fail the whole file at
    import; such a statement is pointed at a generated ``_shims.partial_x`` that re-exports the
    names compat.x has and stands a skip ("not provided by ...") in for each it lacks. A
    missing attribute of a module imported whole is only reported (it fails where used).
    """
    redirects: dict[int, str] = {}
    report: list[str] = []
    for sub in engine.subs.get(path, ()):
        m = _TARGET.match(sub.new)
        if m is None:
            continue
        target = m.group(1) or m.group(2)
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # reported; the run then shows the collection error
            report.append(f"{target} does not import here ({type(exc).__name__}: {exc}); left as is")
            continue
        if m.group(1):
            per_line = _imported_names(text, sub.old)
            names = sorted({n for ns in per_line.values() for n in ns})
            missing = [n for n in names if not hasattr(module, n)]
            report.append(f"{target}: provides {len(names) - len(missing)} of the {len(names)} names the file "
                          f"imports" + (f"; MISSING: {', '.join(missing)} (their tests skip)" if missing else ""))
            if missing:
                shim = "partial_" + target.rsplit(".", 1)[1]
                present = [n for n in names if n not in missing]
                shims[shim + ".py"] = (
                    f'"""{target} with a skip standing in for each name it lacks (generated)."""\n'
                    + (f"from {target} import {', '.join(present)}\n" if present else "")
                    + "from _shims._support import not_provided\n\n"
                    + "".join(f"{n} = not_provided({target!r}, {n!r})\n" for n in missing))
                for lineno in per_line:
                    redirects[lineno] = f"from _shims.{shim} import"
        else:
            used = sorted(_attributes_used(text, m.group(3)))
            missing = [n for n in used if not hasattr(module, n)]
            report.append(f"{target} as {m.group(3)}: the file uses {', '.join(used)}"
                          + (f"; MISSING: {', '.join(missing)} (AttributeError where called)" if missing else
                             "; all present"))
    for alias, offered in engine.provided.items():
        attrs = sorted(_attributes_used(text, alias))
        if attrs:
            absent = [n for n in attrs if n not in offered]
            report.append(f"{alias} (stand-in module): the file uses {', '.join(attrs)}; provided: "
                          f"{', '.join(n for n in attrs if n in offered)}"
                          + (f"; not provided (fail if called): {', '.join(absent)}" if absent else ""))
    return redirects, report


# ---------------------------------------------------------------------------------------
# Running.

class Counts(NamedTuple):
    tests: int
    passed: int
    skipped: int
    failed: int
    errors: int


def _counts(junit: Path) -> Counts | None:
    if not junit.exists():
        return None
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    return Counts(tests, tests - skipped - failed - errors, skipped, failed, errors)


def _find(root: Path, engine: str, rel: str) -> Path:
    for candidate in (root / engine / rel, root / rel):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{engine}: {rel} not found under {root} (expected {root / engine / rel}; "
                            "see .upstream/SOURCES.txt for where each file comes from)")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run_engine(engine: Engine, root: Path, *, strict_alias: bool, pin_host: bool, keep: bool, show_diff: bool,
               pytest_args: Sequence[str]) -> tuple[int, Counts | None]:
    print(f"\n===== upstream-tests: {engine.name} =====", flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"upstream-{engine.name}-"))
    try:
        shims: dict[str, str] = {"__init__.py": SHIMS_INIT, "_support.py": SUPPORT, **engine.shims}
        all_changes: list[Change] = []
        all_warnings: list[str] = []
        target_report: list[str] = []
        for rel in (engine.test, *engine.helpers):
            src = _find(root, engine.name, rel)
            text = src.read_text(encoding="utf-8")
            print(f"upstream file: {src}  ({len(text)} chars, sha256 {_sha(src)})")
            redirects, report = plan_targets(rel, text, engine, shims)
            target_report += report
            new_text, changes, warnings = rewrite(rel, text, engine, shim_redirects=redirects)
            all_changes += changes
            all_warnings += warnings
            dst = work / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(new_text, encoding="utf-8")
            if show_diff:
                sys.stdout.writelines(difflib.unified_diff(text.splitlines(keepends=True),
                                                           new_text.splitlines(keepends=True),
                                                           f"upstream/{rel}", f"run/{rel}", n=0))
        print("substitutions (every line that differs from upstream):")
        for c in sorted(all_changes, key=lambda c: (c.path != engine.test, c.path, c.line)):
            print(f"  {c.path}:{c.line}  [{c.why}]\n      - {c.old}\n      + {c.new}")
        for line in target_report:
            print(f"compat check: {line}")
        for w in all_warnings:
            print(f"note: {w}")
        for n in engine.notes:
            print(f"note: {n}")
        (work / "_shims").mkdir()
        for name, source in shims.items():
            compile(source, f"_shims/{name}", "exec")  # a broken stand-in fails here, not mid-run
            (work / "_shims" / name).write_text(source, encoding="utf-8")
        modules = sorted(n for n in shims if n not in ("__init__.py", "_support.py"))
        print(f"stand-ins: _shims/{', _shims/'.join(modules)}; {engine.standin_summary}")
        compile(engine.conftest, "conftest.py", "exec")
        (work / "conftest.py").write_text(engine.conftest, encoding="utf-8")
        (work / "pytest.ini").write_text(PYTEST_INI, encoding="utf-8")

        env = dict(os.environ)
        env["PYTHONPATH"] = str(work) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop("POINTERDOMAIN_STRICT_ALIAS", None)
        if strict_alias:
            env["POINTERDOMAIN_STRICT_ALIAS"] = "1"
        env.pop("UPSTREAM_TESTS_PIN_HOST", None)
        if pin_host and engine.name == "vllm":
            env["UPSTREAM_TESTS_PIN_HOST"] = "1"
            print("--pin-host: the kv_cache_factory stand-in pins its CPU caches (upstream's are pageable)")
        junit = work / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(work),
               "-c", str(work / "pytest.ini"), "-rfEs", f"--junitxml={junit}", engine.test,
               *engine.default_args, *pytest_args]
        print(f"strict alias: {'ON (POINTERDOMAIN_STRICT_ALIAS=1)' if strict_alias else 'off'}")
        print(f"run ({work}): {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, cwd=work, env=env).returncode
        counts = _counts(junit)
        if rc < 0:
            print(f"{engine.name}: pytest DIED with signal {-rc} (a crash, e.g. SIGSEGV = 11)")
        if "--collect-only" in pytest_args or "--co" in pytest_args:
            print(f"{engine.name}: collection only (pytest exit {rc}; its count is above)")
        elif counts is None:
            print(f"{engine.name}: no results (pytest exit {rc})")
        else:
            print(f"{engine.name}: {counts.passed} passed, {counts.skipped} skipped, {counts.failed} failed, "
                  f"{counts.errors} errors (of {counts.tests}; pytest exit {rc})")
        return rc, counts
    finally:
        if keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if len(args) < 2 or args[0] in ("-h", "--help") or args[0] not in (*ENGINES, "all"):
        print(__doc__)
        return 2
    which, root = args[0], Path(args[1]).resolve()
    rest = args[2:]
    flags = {"--strict-alias": False, "--pin-host": False, "--keep": False, "--show-diff": False}
    pytest_args: list[str] = []
    for a in rest:
        if a in flags:
            flags[a] = True
        else:
            pytest_args.append(a)
    if not root.is_dir():
        print(f"upstream-tests: {root} is not a folder")
        return 2
    names = list(ENGINES) if which == "all" else [which]
    results: dict[str, tuple[int, Counts | None]] = {}
    for name in names:
        try:
            results[name] = run_engine(ENGINES[name], root, strict_alias=flags["--strict-alias"],
                                       pin_host=flags["--pin-host"], keep=flags["--keep"],
                                       show_diff=flags["--show-diff"], pytest_args=pytest_args)
        except (RewriteError, FileNotFoundError) as exc:
            print(f"{name}: NOT RUN: {exc}")
            results[name] = (3, None)
    print("\n===== upstream-tests summary" + (" (strict alias)" if flags["--strict-alias"] else "") + " =====")
    worst = 0
    collect_only = "--collect-only" in pytest_args or "--co" in pytest_args
    for name, (rc, counts) in results.items():
        text = ("collection only" if collect_only and rc == 0 else
                f"{counts.passed} passed, {counts.skipped} skipped, {counts.failed} failed, {counts.errors} errors"
                if counts else "no results")
        print(f"  {name:8s} {text}  (exit {rc})")
        # pytest 5: nothing collected (e.g. a -k that selects nothing in one engine of "all")
        if rc not in (0, 5) or (counts is not None and (counts.failed or counts.errors)):
            worst = 1
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
