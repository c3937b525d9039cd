"""The Python pass: rules PD001-PD007 on one source file, with libcst.

Names are resolved with libcst's scope analysis (:class:`~libcst.metadata.ScopeProvider`
and its ``get_qualified_names_for``), so ``import torch as t; t.tensor(...)`` is
``torch.tensor`` and ``self.register_buffer(...)`` in an ``nn.Module`` is not a
registration call. Values are followed through local assignments (the scope's
``Assignment`` records) and through ``self.x = ...`` attributes of the same file; no
cross-file inference.

Speed: a file none of whose text contains a trigger word (:func:`trigger_words`)
cannot match any rule and is skipped before parsing. Of a file that can, only the
imports, the module-level statements, and the functions (top level or methods) whose
text contains a trigger are analysed; the others are blanked line for line, so every
line and column stays the original's. Scope analysis costs ~10 ms per KiB of source,
and most of a large file is code no rule looks at.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable, Sequence

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import (Assignment, CodeRange, MetadataWrapper, PositionProvider, QualifiedNameSource, Scope,
                             ScopeProvider)

from pointerdomain.audit.rules import RULES, Finding, source_lines

__all__ = ["PythonRules", "audit_python_source", "device_targets", "helper_sinks", "sink_at", "slice_source",
           "trigger_words"]

_BASE_TRIGGERS = (
    "data_ptr", "HostRegister", "HostUnregister", "hostRegister", "register_memory", "register_buffer",
    "deregister_memory", "transfer_sync", "transfer_submit", "transfer_async", "transfer_read_on", "transfer_write_on",
    "xfer_desc", "reg_desc", "xfer_dlist", "pointer_type", "c_void_p", "addressof", "ctypes.data",
    "array_interface__", "caching_allocator_alloc",
    # constructors of transfer-engine objects, so `self.engine = TransferEngine()` is analysed
    "TransferEngine", "nixl_agent", "MooncakeDistributedStore",
)

# PD001: callables that turn a sequence into a tensor/array.
_TABLE_BUILDERS = frozenset({
    "torch.tensor", "torch.as_tensor", "torch.asarray", "torch.Tensor", "torch.LongTensor",
    "torch.cuda.LongTensor", "numpy.array", "numpy.asarray", "numpy.fromiter",
})
# PD003: registration entry points, by the last component of the qualified name.
_REGISTER_FUNCS = frozenset({
    "cudaHostRegister", "cudaHostUnregister", "cuMemHostRegister", "cuMemHostRegister_v2", "cuMemHostUnregister",
    "hipHostRegister", "hipHostUnregister",
})
_CUPY_REGISTER = frozenset({"cupy.cuda.runtime.hostRegister", "cupy.cuda.runtime.hostUnregister"})
_ENGINE_REGISTER_METHODS = frozenset({
    "register_memory", "batch_register_memory", "unregister_memory", "batch_unregister_memory",
    "deregister_memory", "register_buffer", "unregister_buffer", "batch_register_buffer",
})
# PD004: transfer / descriptor methods of Mooncake's TransferEngine and NIXL's agent.
_MOONCAKE_TRANSFERS = frozenset({
    "transfer_sync_read", "transfer_sync_write", "transfer_sync", "batch_transfer_sync_read",
    "batch_transfer_sync_write", "transfer_submit_write", "transfer_async_read", "transfer_async_write",
    "batch_transfer_async_read", "batch_transfer_async_write", "transfer_read_on_cuda", "transfer_write_on_cuda",
})
_NIXL_DESC_METHODS = frozenset({"get_xfer_descs", "get_reg_descs", "prep_xfer_dlist"})
_ENGINE_METHODS = _ENGINE_REGISTER_METHODS | _MOONCAKE_TRANSFERS | _NIXL_DESC_METHODS
# Where a receiver's constructor comes from, for "is this a transfer engine".
_ENGINE_ROOTS = ("mooncake", "nixl", "_nixl", "rixl")
_TRITON_JIT = frozenset({"triton.jit", "triton.language.jit", "triton.runtime.jit", "triton.runtime.jit.jit"})
_POINTERDOMAIN_TABLE_CALLS = frozenset({
    "pointerdomain.make_kernel_ptr_table", "pointerdomain.host_ptr_table",
    "pointerdomain.registration.tables.make_kernel_ptr_table", "pointerdomain.registration.tables.host_ptr_table",
})
_TABLE_ATTRS = frozenset({"kernel_table", "host_table", "table"})
_HANDLE_WORDS = re.compile(r"(?i)stream|handle|event|module|func|ctx|context|comm|graph|reqh|backend|mvh|_side\b|"
                           r"agent|\bfd\b|library|lib\b")
_GPU_ENTRY = re.compile(r"^(cuda[A-Z]|cu[A-Z]|hip[A-Z]|nccl[A-Z]|hccl[A-Z]|Hccl[A-Z]|acl[a-z]*[A-Z]|rccl[A-Z])")
# PD008: callables that take an int for what it is (formatting, containers, logging, checks), and
# the one-argument ctypes/handle wrappers whose result is checked at the call that receives it.
_NOT_NATIVE = frozenset({
    "int", "hex", "str", "repr", "format", "print", "hash", "id", "len", "min", "max", "abs", "divmod", "sorted",
    "set", "list", "tuple", "dict", "frozenset", "isinstance", "append", "extend", "insert", "add", "get", "pop",
    "setdefault", "index", "count", "remove", "discard", "update", "join", "debug", "info", "warning", "warn",
    "error", "exception", "critical", "write", "range", "enumerate", "zip", "map", "filter", "any", "all",
    "round", "bool", "float", "super", "append_left", "appendleft", "add_note", "fail", "skipTest", "__init__",
    "tensor", "as_tensor", "asarray", "array", "fromiter", "Tensor", "LongTensor", "full", "empty", "zeros",
    "data_ptr", "item", "to_bytes", "from_bytes", "pack", "pack_into", "dumps", "setattr", "getattr", "type",
    "itemgetter", "sum", "next", "iter", "reversed", "hasattr", "callable", "bin", "oct", "chr", "ord",
    "move_to_end", "popitem",
})
# logging methods: an address in a log record (message arguments, `extra={...}`) is formatted, never used
_LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"})
# a logger by its name: `logger`, `self._log`, `LOG`, `logging.getLogger(n)` (not `self.catalog`)
_LOGGER = re.compile(r"(?i)logger|logging|(?:^|[._])_*log(?:$|[._(\[])")
_NOT_NATIVE_RECEIVERS = frozenset({"logger", "logging", "log", "LOG", "LOGGER", "_logger", "math", "os", "sys"})
_WRAPPERS = frozenset({"c_void_p", "c_uint64", "c_int64", "c_size_t", "c_ulonglong", "c_longlong", "buffer_type",
                       "c_char_p", "cast", "POINTER", "pointer"})
# Python-level APIs that take an int as an int (PD008 looks for native code that dereferences it).
_PY_ROOTS = frozenset({"torch", "numpy", "builtins", "math", "os", "sys", "struct", "pickle", "json", "logging",
                       "itertools", "functools", "operator", "collections", "typing", "warnings", "time",
                       "pytest", "unittest", "dataclasses", "weakref", "threading", "multiprocessing",
                       "bisect", "heapq"})
_CPU_DEVICES = frozenset({"cpu", "'cpu'", '"cpu"'})
_MAX_DEPTH = 16
# `x - arena_base`: what an offset is measured from
_BASE_NAME = re.compile(r"(?i)(?:^|_)(?:base|start|begin|origin)(?:_(?:addr|address|ptr))?$")
# `key = tuple(t.data_ptr() for t in ws)`: a cache key, looked up, never dereferenced
_KEY_NAME = re.compile(r"(?i)(?:^|_)key$|^key_|_key_")
# `def tensor_binding_signature(...): return tuple(t.data_ptr() for t in ts)`: a function that makes a key
_KEY_FUNCTION = re.compile(r"(?i)(?:^|_)(?:key|signature|fingerprint)(?:$|_)")
# typed device-pointer wrappers (cuda-python, hip-python): the callee is told the domain
_TYPED_DEVICE_POINTERS = frozenset({"CUdeviceptr", "CUdeviceptr_v2", "hipDeviceptr_t"})
_ARRAY_INTERFACES = frozenset({"__array_interface__", "__cuda_array_interface__"})


def _is_triton_jit(qualname: str) -> bool:
    """``triton.jit``, also re-exported (vLLM: ``from vllm.triton_utils import triton``)."""
    return qualname in _TRITON_JIT or qualname.endswith(".triton.jit") or (
        qualname.endswith(".jit") and "triton" in qualname.split(".")[:-1])


def trigger_words(kernel_ops: Iterable[str] = ()) -> tuple[str, ...]:
    """Words of which at least one occurs in the text of any site a PD0xx rule reports
    (the receiver-constructor words let ``self.engine = TransferEngine()`` be analysed).
    ``kernel_ops`` adds the last component of each configured PD007 op."""
    return _BASE_TRIGGERS + tuple(sorted({op.rsplit(".", 1)[-1] for op in kernel_ops}))


@dataclasses.dataclass(frozen=True)
class PythonRules:
    """What the pass needs from the configuration: the enabled PD0xx codes and the
    qualified names of the PD007 kernel ops."""

    enabled: frozenset[str]
    kernel_ops: frozenset[str] = frozenset()

    @property
    def triggers(self) -> tuple[str, ...]:
        return trigger_words(self.kernel_ops)


# ---------------------------------------------------------------------------------------
# slicing


def _has_trigger(text: str, triggers: Sequence[str]) -> bool:
    return any(t in text for t in triggers)


def _stmt_start(node: ast.stmt) -> int:
    decorators: list[ast.expr] = getattr(node, "decorator_list", None) or []
    return min([node.lineno] + [int(d.lineno) for d in decorators])


_ATTR_BINDING = re.compile(r"\bself\.(\w+)\s*(?::[^=\n]+)?=(?!=)[^\n]*")


def _names(node: ast.AST) -> tuple[set[str], set[str]]:
    """(names and ``obj.attr`` targets a statement binds, names it reads)."""
    stores: set[str] = set()
    loads: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.alias):  # a function-level import binds the name it imports
            stores.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.Name):
            (stores if isinstance(n.ctx, ast.Store) else loads).add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            if isinstance(n.ctx, ast.Store):
                stores.add(f"{n.value.id}.{n.attr}")
            else:
                loads.add(f"{n.value.id}.{n.attr}")
    return stores, loads


_DSL_DECORATORS = frozenset({"kernel", "jit"})


def _dsl_names(tree: ast.Module) -> set[str]:
    """The names the module binds by importing from the CuTe DSL (``import cutlass.cute as cute``:
    ``cute``; ``import cutlass``: ``cutlass``; ``from cutlass.cute import kernel``: ``kernel``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "cutlass")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "cutlass":
            out.update(a.asname or a.name for a in node.names)
    return out


def _device_dsl_kernel(node: ast.stmt, dsl: set[str]) -> bool:
    """A CuTe DSL function (``@cute.kernel``, ``@cute.experimental.kernel``, ``@cute.jit``), its
    decorator's root name imported from ``cutlass`` (``dsl``, from :func:`_dsl_names`): its
    ``x.data_ptr()`` is a typed pointer of the DSL (shared memory, a DSL tensor), not an
    integer, and arithmetic on it stays typed. A ``cute`` of the file's own is no DSL."""
    for d in getattr(node, "decorator_list", []):
        target = d.func if isinstance(d, ast.Call) else d
        parts = ast.unparse(target).split(".")
        if parts[0] in dsl and (parts[-1] in _DSL_DECORATORS or (len(parts) == 1 and parts[0] in _DSL_DECORATORS)):
            return True
    return False


def slice_source(source: str, triggers: Sequence[str]) -> str:
    """``source`` with the code no rule can report on blanked out, line for line, so every
    kept line and column is the original's.

    Kept: imports (and module-level ``if``/``try`` blocks holding one), module- and
    class-level statements containing a trigger word, and in each function containing
    one, the statements that contain a trigger plus, to a fixed point, those that read a
    name a kept statement binds or bind a name a kept statement reads (the local data
    flow the rules follow). A ``pass`` keeps each emptied body valid. Returns ``source``
    unchanged if :mod:`ast` cannot parse it (libcst then reports the error)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source
    # `self.base = t.data_ptr()` in one method, `self.base + off` in another: the attribute
    # names bound to a trigger expression are triggers too, for this file.
    attrs = {m.group(1) for m in _ATTR_BINDING.finditer(source) if _has_trigger(m.group(0), triggers)}
    triggers = tuple(triggers) + tuple(f".{a}" for a in sorted(attrs))
    lines = source_lines(source, keepends=True)
    drop: list[ast.stmt] = []
    dsl = _dsl_names(tree)

    def segment(node: ast.stmt) -> str:
        return "".join(lines[_stmt_start(node) - 1: node.end_lineno])

    def has_import(node: ast.stmt) -> bool:
        return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node))

    def visit_function(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        body = fn.body
        if body[0].lineno == fn.lineno:
            return  # a one-line def: keep as is
        # A nested def or class is its own scope: sliced on its own when it holds a trigger,
        # dropped otherwise, and outside this body's data flow (a factory function holding
        # a whole module of classes was analysed whole: 2,700 lines kept for one data_ptr()).
        nested = [isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for st in body]
        info = [(st, not inner and _has_trigger(segment(st), triggers), *(_names(st) if not inner else (set(), set())))
                for st, inner in zip(body, nested)]
        # A function's own imports stay (kept, not seeds of the data flow): the names they bind
        # resolve for the kept statements and nested defs (`from cutlass.cute.typing import
        # AddressSpace` above a nested `make_ptr(..., AddressSpace.gmem)`).
        kept = [seed or isinstance(st, (ast.Import, ast.ImportFrom)) for st, seed, _, _ in info]
        for i, st in enumerate(body):
            if nested[i] and _has_trigger(segment(st), triggers) and not _device_dsl_kernel(st, dsl):
                kept[i] = True
                if isinstance(st, ast.ClassDef):
                    visit_body(st.body, False)
                elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit_function(st)
        tainted: set[str] = set()
        needed: set[str] = set()
        for (_, seed, stores, loads) in info:
            if seed:
                tainted |= stores
                needed |= loads
        changed = True
        while changed:
            changed = False
            for i, (_, _, stores, loads) in enumerate(info):
                if not kept[i] and not nested[i] and (loads & tainted or stores & needed):
                    kept[i] = changed = True
                    tainted |= stores
                    needed |= loads
        if not any(kept):
            kept[0] = True  # the trigger was in the signature: keep a statement so the body stays valid
        drop.extend(st for st, keep in zip(body, kept) if not keep)

    def visit_body(body: Sequence[ast.stmt], module_level: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _device_dsl_kernel(node, dsl):
                    drop.append(node)
                elif _has_trigger(segment(node), triggers):
                    visit_function(node)
                else:
                    drop.append(node)
            elif isinstance(node, ast.ClassDef):
                visit_body(node.body, False)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            elif module_level and isinstance(node, (ast.If, ast.Try)) and has_import(node):
                continue
            elif not _has_trigger(segment(node), triggers):
                drop.append(node)

    visit_body(tree.body, True)
    if not drop:
        return source
    # A line shared with a kept simple statement (`a = 1; b = 2`) stays whole.
    dropped = {id(n) for n in drop}
    shared: set[int] = set()
    todo: list[ast.stmt] = [n for n in tree.body if id(n) not in dropped]
    while todo:  # kept statements only, never descending into expressions
        node = todo.pop()
        bodies = [getattr(node, f, None) or [] for f in ("body", "orelse", "finalbody")]
        bodies += [h.body for h in getattr(node, "handlers", [])] + [c.body for c in getattr(node, "cases", [])]
        if any(bodies):
            todo.extend(n for b in bodies for n in b if isinstance(n, ast.stmt) and id(n) not in dropped)
        else:
            shared.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    for node in drop:
        first = _stmt_start(node)
        if first in shared:
            continue
        for i in range(first - 1, node.end_lineno or node.lineno):
            if i + 1 not in shared:
                lines[i] = "\n" if lines[i].endswith("\n") else ""
        lines[first - 1] = " " * node.col_offset + "pass\n"
    return "".join(lines)


# ---------------------------------------------------------------------------------------
# helpers of the file that hand a parameter to native code


def _ast_call_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


# Python-level modules beside _PY_ROOTS whose functions take an int as an int (`bisect_left(starts, ptr)`
# is a range look-up)
_PY_HELPER_ROOTS = _PY_ROOTS | {"bisect", "heapq", "copy", "re", "asyncio", "queue", "contextlib", "array"}


def _python_modules(tree: ast.Module) -> set[str]:
    """Names the module binds by importing a Python-level package (``import numpy as np``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update((a.asname or a.name).split(".")[0] for a in node.names
                       if a.name.split(".")[0] in _PY_HELPER_ROOTS)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _PY_HELPER_ROOTS:
            out.update(a.asname or a.name for a in node.names)
    return out


def _native_sink(call: ast.Call, defined: set[str], imported: set[str], python: set[str]) -> str | None:
    """The name of ``call`` when it is native code that takes an int address as one (an engine
    method, a GPU/collective runtime entry, ``from_address``, a method of a loaded library or
    extension object), else None. Python code (this file's functions, logging, containers, the
    Python-level packages) is no sink."""
    name = _ast_call_name(call)
    if name is None:
        return None
    if name in _ENGINE_METHODS or name in _REGISTER_FUNCS or _GPU_ENTRY.match(name) or name == "from_address":
        return name
    if name in _NOT_NATIVE or name in defined or name.startswith(("assert", "log", "_log")) or name in _WRAPPERS:
        return None
    func = call.func
    if isinstance(func, ast.Attribute):
        root: ast.expr = func.value
        while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        receiver = func.value.attr if isinstance(func.value, ast.Attribute) else \
            func.value.id if isinstance(func.value, ast.Name) else ""
        if isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"):
            return None  # a method of this object: Python
        if receiver in _NOT_NATIVE_RECEIVERS or (isinstance(root, ast.Name) and root.id in python and not (
                isinstance(func.value, ast.Attribute) and "ops" in ast.unparse(func.value).split("."))):
            return None
        return name
    return name if name in imported else None


# calls that make a call later, and the position of the callable (its arguments follow it)
_DEFERRED = {"to_thread": 0, "run_in_executor": 1, "submit": 0, "finalize": 1, "partial": 0, "call_soon": 0,
             "call_soon_threadsafe": 0}


def _carried(expr: ast.expr, origins: dict[str, set[str]]) -> set[str]:
    """The parameters whose address value ``expr`` still is: through names, containers (for
    unpacking), ``int()`` and the ctypes wrappers, ``+`` and page rounding (``&``, ``|``). An
    offset (``a - base``), a product, a quotient, a comparison or another call's result is
    no longer the address."""
    if isinstance(expr, ast.Name):
        return set(origins.get(expr.id, ()))
    if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
        return {o for e in expr.elts for o in _carried(e, origins)}
    if isinstance(expr, (ast.Subscript, ast.Starred)):
        return _carried(expr.value, origins)
    if isinstance(expr, ast.Attribute) and expr.attr == "value":
        return _carried(expr.value, origins)  # `c_void_p(addr).value`
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.BitAnd, ast.BitOr)):
        return _carried(expr.left, origins) | _carried(expr.right, origins)
    if isinstance(expr, ast.IfExp):
        return _carried(expr.body, origins) | _carried(expr.orelse, origins)
    if isinstance(expr, ast.Call) and (_ast_call_name(expr) in _WRAPPERS or _ast_call_name(expr) == "int"):
        return {o for a in expr.args for o in _carried(a, origins)}
    return set()


def sink_at(sinks: dict[int | str, str], position: int) -> str | None:
    """The native callee that positional argument ``position`` of a helper reaches (a key
    ``"*n"`` of :func:`helper_sinks` stands for every position from ``n`` on: ``*args``)."""
    if position in sinks:
        return sinks[position]
    for key, target in sinks.items():
        if isinstance(key, str) and key.startswith("*") and position >= int(key[1:]):
            return target
    return None


def _helper_functions(tree: ast.Module) -> list[tuple[str, ast.arguments, ast.AST]]:
    """(name, parameters, body) of each function and method of the module, and of each lambda
    bound to a name or an attribute (``launch = lambda p, n: ops.copy(p, n)``)."""
    out: list[tuple[str, ast.arguments, ast.AST]] = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((n.name, n.args, n))
        elif isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Lambda):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
                if name is not None:
                    out.append((name, n.value.args, n.value.body))
    return out


def helper_sinks(source: str) -> dict[str, dict[int | str, str]]:
    """For each function or method defined in ``source`` (and each lambda bound to a name): the
    parameters (by position, without ``self``/``cls``, and by name; ``"*n"`` for a ``*args``
    that starts at position ``n``) whose value reaches a native call inside it (directly, through
    local assignments and tuple unpacking, or through another such helper of the file), each
    with the native callee's name. One file, no inference across modules."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return {}
    functions = _helper_functions(tree)
    defined = {name for name, _, _ in functions}
    python = _python_modules(tree)
    imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} - python
    out: dict[str, dict[int | str, str]] = {}
    plan: list[tuple[str, list[str], dict[str, set[str]], list[ast.Call]]] = []
    for helper, sig, fn in functions:
        params = [a.arg for a in (*sig.posonlyargs, *sig.args)]
        if params and params[0] in ("self", "cls"):
            params = params[1:]
        origins: dict[str, set[str]] = {p: {p} for p in (*params, *(a.arg for a in sig.kwonlyargs))}
        if sig.vararg is not None:  # `def run(*args): ops.foo(*args)`: every position from len(params) on
            origins[sig.vararg.arg] = {f"*{len(params)}"}
        for _ in range(3):  # local assignments, to a small fixed point
            for node in ast.walk(fn):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    used = _carried(node.value, origins)
                    if used:
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        for t in targets:
                            for n in ast.walk(t):
                                if isinstance(n, ast.Name):
                                    origins.setdefault(n.id, set()).update(used)
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        plan.append((helper, params, origins, calls))

    changed = True
    while changed:  # helpers calling helpers
        changed = False
        for helper, params, origins, calls in plan:
            found = out.setdefault(helper, {})
            for call in calls:
                sink = _native_sink(call, defined, imported, python)
                callee = out.get(_ast_call_name(call) or "") if sink is None else None
                args = call.args
                later = _DEFERRED.get(_ast_call_name(call) or "")
                if later is not None and len(call.args) > later:
                    # `asyncio.to_thread(self.engine.transfer_sync, sid, src, ...)`: the call made later
                    f = call.args[later]
                    fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                    sink = fname if fname in _ENGINE_METHODS or _GPU_ENTRY.match(fname) else None
                    callee = out.get(fname) if sink is None else None
                    args = call.args[later + 1:]
                for i, a in enumerate(args):
                    target = sink
                    if callee is not None:
                        target = sink_at(callee, i)
                    if target is None:
                        continue
                    for p in _carried(a, origins):
                        if p not in found:
                            found[p] = target
                            if p in params:
                                found[params.index(p)] = target
                            changed = True
                for kw in call.keywords:
                    target = sink if callee is None else callee.get(kw.arg or "")
                    if target is None:
                        continue
                    for p in _carried(kw.value, origins):
                        if p not in found:
                            found[p] = target
                            if p in params:
                                found[params.index(p)] = target
                            changed = True
    return {k: v for k, v in out.items() if v}


# ---------------------------------------------------------------------------------------
# the analysis


class _Collector(cst.CSTVisitor):
    """First pass: the value bound by each ``name = value`` / ``self.x = value``."""

    def __init__(self) -> None:
        # (receiver, element) for `x.append(v)`, `x.insert(i, v)`, `x.add(v)`, `x[k] = v`;
        # (receiver, collection) for `x.extend(v)`: a container filled after it was bound empty
        self.stores: list[tuple[cst.BaseExpression, cst.BaseExpression]] = []
        self.extends: list[tuple[cst.BaseExpression, cst.BaseExpression]] = []
        self.values: dict[int, cst.BaseExpression] = {}  # id(target Name node) -> value
        self.annotations: dict[int, cst.BaseExpression] = {}  # id(target Name node) -> annotation
        self.attrs: dict[str, list[cst.BaseExpression]] = {}  # "self.x" -> values
        self.attr_annotations: dict[str, cst.BaseExpression] = {}
        # for identity snapshots (`before = [t.data_ptr() for t in xs]` only ever compared):
        self.compared: set[int] = set()  # ids of Name/Attribute nodes inside a comparison or assert
        self.bound_by: dict[int, cst.BaseExpression] = {}  # id(value) -> its one Name/Attribute target
        self.attr_nodes: dict[str, list[cst.Attribute]] = {}  # ".x" -> every `obj.x` node
        self.store_targets: set[int] = set()  # ids of assignment targets

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression | None,
              annotation: cst.BaseExpression | None = None) -> None:
        if isinstance(target, cst.Name):
            if value is not None:
                self.values[id(target)] = value
            if annotation is not None:
                self.annotations[id(target)] = annotation
        elif isinstance(target, cst.Attribute):
            name = get_full_name_for_node(target)
            if name is not None:
                if value is not None:
                    self.attrs.setdefault(name, []).append(value)
                if annotation is not None:
                    self.attr_annotations[name] = annotation
        elif isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)):
            if len(target.elements) == len(value.elements):
                for t, v in zip(target.elements, value.elements):
                    self._bind(t.value, v.value)
        elif isinstance(target, (cst.Tuple, cst.List)) and value is not None:
            # `addrs, lens = zip(*pairs)`: each name is a column of `pairs`; `a, n = pair`: an element
            column = value
            if isinstance(value, cst.Call) and _call_name(value) == "zip" and len(value.args) == 1 \
                    and value.args[0].star == "*":
                column = cst.List([cst.Element(_element_of(value.args[0].value))])
                for t in target.elements:
                    self._bind(t.value, column)
                return
            for t in target.elements:
                self._bind(t.value, _element_of(column))

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._bind(t.target, node.value)
            self.store_targets.add(id(t.target))
            if isinstance(t.target, cst.Subscript):
                self.stores.append((t.target.value, node.value))
        if len(node.targets) == 1 and isinstance(node.targets[0].target, (cst.Name, cst.Attribute)):
            self.bound_by[id(node.value)] = node.targets[0].target
            value = node.value
            if isinstance(value, cst.Call) and _call_name(value) in ("tuple", "list", "sorted") \
                    and len(value.args) == 1:
                self.bound_by[id(value.args[0].value)] = node.targets[0].target  # `key = tuple(<genexp>)`

    def _mark_compared(self, node: cst.CSTNode) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, (cst.Name, cst.Attribute)):
                self.compared.add(id(n))
            stack.extend(n.children)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        self._mark_compared(node)

    def visit_Assert(self, node: cst.Assert) -> None:
        self._mark_compared(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.attr_nodes.setdefault(node.attr.value, []).append(node)

    def visit_For(self, node: cst.For) -> None:
        # `for t in X`: t is an element of X; `for a, n in X`: each name an element of an element;
        # `for a, n in zip(A, N)`: a an element of A, n of N; `for i, t in enumerate(X)`: t of X
        it, target = node.iter, node.target
        if isinstance(target, (cst.Tuple, cst.List)) and isinstance(it, cst.Call) and not any(a.star for a in it.args):
            name = _call_name(it)
            if name == "zip" and len(it.args) == len(target.elements):
                for t, a in zip(target.elements, it.args):
                    self._bind(t.value, _element_of(a.value))
                return
            if name == "enumerate" and it.args and len(target.elements) == 2:
                self._bind(target.elements[1].value, _element_of(it.args[0].value))
                return
        self._bind(target, _element_of(it))

    def visit_Call(self, node: cst.Call) -> None:
        if _call_name(node) == "map" and len(node.args) >= 2 and isinstance(node.args[0].value, cst.Lambda):
            # `map(lambda p: lib.free(p), ptrs)`: each parameter is an element of its iterable
            fn = node.args[0].value
            for param, seq in zip(fn.params.params, node.args[1:]):
                self.values[id(param)] = _element_of(seq.value)
        if isinstance(node.func, cst.Attribute) and node.args:
            method = node.func.attr.value
            if method in ("append", "add", "insert", "appendleft"):
                self.stores.append((node.func.value, node.args[-1].value))
            elif method == "extend":
                self.extends.append((node.func.value, node.args[-1].value))

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._bind(node.target, node.value, node.annotation.annotation)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._bind(node.target, node.value)


def _element_of(expr: cst.BaseExpression) -> cst.BaseExpression:
    """A stand-in expression for one element of ``expr`` (``expr[0]``): the rules read an
    element of an address collection as an address."""
    return cst.Subscript(expr, [cst.SubscriptElement(cst.Index(cst.Integer("0")))])


# what makes a tuple holding an address a tensor's identity (a cache key) rather than a descriptor
_IDENTITY_KEY = re.compile(r"\._version\b|\.shape\b|\.dtype\b|\bid\(|\.is_inference\(")


def _identity_tuple(node: cst.BaseExpression, dims: bool = True) -> bool:
    """A tuple with an element that is a tensor's identity (``t.shape``, ``t.shape[1]``,
    ``t._version``, ``id(t)``): a cache key. A shape inside arithmetic (``n // t.shape[0]``,
    a row size in a descriptor) is no identity. ``dims=False`` (a tuple handed to native
    code as an argument): one dimension (``t.shape[0]``, ``t.size(1)``) next to the address
    is a descriptor's extent, not an identity."""
    return isinstance(node, cst.Tuple) and any(
        not isinstance(e.value, cst.BinaryOperation) and _IDENTITY_KEY.search(_code_of(e.value))
        and (dims or not _dimension(e.value)) for e in node.elements)


def _dimension(expr: cst.BaseExpression) -> bool:
    """``t.shape[i]`` / ``t.size(i)``: one extent of a tensor, an int."""
    if isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Attribute):
        return expr.value.attr.value == "shape"
    return isinstance(expr, cst.Call) and _call_name(expr) in ("size", "stride") and len(expr.args) == 1


def _index(node: cst.Subscript) -> int | None:
    """The integer literal ``node`` is indexed with, else None."""
    if len(node.slice) == 1:
        index = node.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.Integer):
            return int(index.value.value, 0)
    return None


def _numpy_data_as(call: cst.Call) -> bool:
    """numpy's ``a.ctypes.data_as(T)``: a ctypes pointer to the array's (host) buffer."""
    func = call.func
    return isinstance(func, cst.Attribute) and func.attr.value == "data_as" and isinstance(func.value, cst.Attribute) \
        and func.value.attr.value == "ctypes"


def _getattr_as_attribute(call: cst.Call) -> cst.Attribute | None:
    """``obj.name`` for ``getattr(obj, "name")`` with a literal name, else None."""
    if not (isinstance(call.func, cst.Name) and call.func.value == "getattr" and len(call.args) == 2):
        return None
    name = call.args[1].value
    if isinstance(name, cst.SimpleString) and isinstance(name.evaluated_value, str) \
            and name.evaluated_value.isidentifier():
        return cst.Attribute(call.args[0].value, cst.Name(name.evaluated_value))
    return None


def _is_host_struct_address(expr: cst.BaseExpression) -> bool:
    """``ctypes.addressof(x)`` / ``ctypes.byref(x)``: the address of a ctypes object in host memory."""
    return isinstance(expr, cst.Call) and _call_name(expr) in ("addressof", "byref")


def _code_of(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node).strip()


def _call_name(node: cst.Call) -> str | None:
    """The last component of the called name (``a.b.c(...)`` -> ``c``; ``lib._funcs["ncclSend"](...)``
    -> ``ncclSend``)."""
    func = node.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Subscript) and len(func.slice) == 1:
        index = func.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
            value = index.value.evaluated_value
            return value if isinstance(value, str) and value.isidentifier() else None
    return None


_CPU_DEVICE_CALLS = frozenset({"torch.device('cpu')", 'torch.device("cpu")', "device('cpu')", 'device("cpu")'})


def device_targets(expr: cst.BaseExpression) -> frozenset[str]:
    """Where a ``device=`` expression can place a tensor: ``{"host"}`` (``"cpu"``,
    ``torch.device("cpu")``, ``None``: torch's default device), ``{"device"}`` (anything
    else), or both for a conditional whose branches differ (``device if device else "cpu"``,
    ``device or "cpu"``, ``"cuda" if torch.cuda.is_available() else "cpu"``)."""
    if isinstance(expr, cst.IfExp):
        return device_targets(expr.body) | device_targets(expr.orelse)
    if isinstance(expr, cst.BooleanOperation):
        return device_targets(expr.left) | device_targets(expr.right)
    code = _code_of(expr)
    if code in _CPU_DEVICES or code in _CPU_DEVICE_CALLS or code == "None":
        return frozenset({"host"})
    return frozenset({"device"})


def _arg(node: cst.Call, index: int, keyword: str) -> cst.BaseExpression | None:
    for a in node.args:
        if a.keyword is not None and a.keyword.value == keyword:
            return a.value
    positional = [a for a in node.args if a.keyword is None and not a.star]
    return positional[index].value if index < len(positional) else None


_COLLECTIONS = (cst.List, cst.Set, cst.Tuple, cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.Dict, cst.DictComp)


class _Auditor(cst.CSTVisitor):
    """Second pass: the rules."""

    METADATA_DEPENDENCIES = (ScopeProvider,)

    def __init__(self, path: str, lines: Sequence[str], rules: PythonRules, collected: _Collector) -> None:
        super().__init__()
        self.path = path
        self.lines = lines
        self.rules = rules
        self.c = collected
        self.reported: list[tuple[cst.CSTNode, str, str, str]] = []  # (node, code, message, fix)
        self._covered: set[int] = set()  # nodes already reported as part of another finding
        self._device_chain: dict[int, cst.Call] = {}  # id(inner table call) -> `.to(dev)` / `.cuda()` call
        self._triton_depth = 0
        self._fill_index: dict[tuple[int, str], tuple[list[cst.BaseExpression], list[cst.BaseExpression]]] | None \
            = None
        self._assert_depth = 0
        self._function_names: list[str] = []  # the enclosing functions, innermost last
        self._memo: dict[tuple[int, int], bool] = {}
        self._helpers: dict[str, dict[int | str, str]] | None = None  # helper_sinks() of the file, on demand
        self._cute_dsl = re.search(r"^\s*(?:import|from)\s+cutlass\b", "\n".join(lines), re.M) is not None
        # the functions and methods of the file (from the unsliced text: a helper without a
        # trigger word is blanked before parsing)
        text = "\n".join(lines)
        self.defined = set(re.findall(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)", text, re.M))
        # `name = lambda ...` / `self.name = lambda ...`: helpers too (helper_sinks follows them)
        self.defined |= set(re.findall(r"^[ \t]*(?:(?:self|cls)\.)?(\w+)[ \t]*(?::[^=\n]+)?=[ \t]*lambda\b", text, re.M))
        # functions of the file used as a sort or look-up key (`sorted(ts, key=self._addr_key)`,
        # `bisect(..., key=f)`): what they return orders, never addresses memory
        self.key_functions = set(re.findall(r"\bkey[ \t]*=[ \t]*(?:(?:self|cls)\.)?(\w+)\b(?![ \t]*\()", text))

    # -- helpers ------------------------------------------------------------------------

    def _qualnames(self, node: cst.CSTNode) -> set[str]:
        scope = self.get_metadata(ScopeProvider, node, None)
        if scope is None:
            return set()
        try:
            return {q.name for q in scope.get_qualified_names_for(node)}
        except Exception:  # libcst raises on a few odd nodes; then the name is unknown
            return set()

    def _report(self, node: cst.CSTNode, code: str, message: str, fix: str | None = None) -> None:
        if code in self.rules.enabled:
            self.reported.append((node, code, message, fix if fix is not None else RULES[code].fix))

    def _bound_values(self, name: cst.Name) -> list[cst.BaseExpression]:
        """Values assigned to ``name`` in the scope where it is used (any of them)."""
        scope: Scope | None = self.get_metadata(ScopeProvider, name, None)
        if scope is None:
            return []
        out = []
        try:
            assignments = scope[name.value]
        except Exception:
            return []
        for a in assignments:
            if isinstance(a, Assignment):
                v = self.c.values.get(id(a.node))
                if v is not None:
                    out.append(v)
        return out

    def _bound_annotations(self, name: cst.Name) -> list[cst.BaseExpression]:
        scope: Scope | None = self.get_metadata(ScopeProvider, name, None)
        if scope is None:
            return []
        out: list[cst.BaseExpression] = []
        try:
            assignments = scope[name.value]
        except Exception:
            return []
        for a in assignments:
            if isinstance(a, Assignment):
                if isinstance(a.node, cst.Param) and a.node.annotation is not None:
                    out.append(a.node.annotation.annotation)
                ann = self.c.annotations.get(id(a.node))
                if ann is not None:
                    out.append(ann)
        return out

    def _values_of(self, expr: cst.BaseExpression) -> list[cst.BaseExpression]:
        if isinstance(expr, cst.Name):
            return self._bound_values(expr)
        if isinstance(expr, cst.Attribute):
            name = get_full_name_for_node(expr)
            return list(self.c.attrs.get(name, [])) if name else []
        return []

    def is_address(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        # Memoised per node: names bound in loops and containers filled in many places made the
        # plain recursion exponential (30 s on one 2,800-line file). A node met again while
        # it is being decided (x = x + off) counts as no address on that path.
        key = (id(expr), 0)
        memo = self._memo.get(key)
        if memo is None:
            self._memo[key] = False
            memo = self._memo[key] = self._is_address(expr, depth)
        return memo

    def is_address_collection(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        """A list/tuple/set/dict/comprehension of addresses (or of tuples holding one),
        ``list(...)``/``zip(...)``/``d.values()`` of one, an element of a collection of
        tuples, a name/attribute bound to one or filled with addresses after it was bound."""
        key = (id(expr), 1)
        memo = self._memo.get(key)
        if memo is None:
            self._memo[key] = False
            memo = self._memo[key] = self._is_address_collection(expr, depth)
        return memo

    def _is_address(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        """An int that is a raw address: ``x.data_ptr()``, ``ctypes.addressof(x)``,
        arithmetic on one, ``int(...)`` of one, an element of an address collection, or a
        name/attribute bound to one."""
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.Attribute) and expr.attr.value == "data" and isinstance(expr.value, cst.Attribute) \
                and expr.value.attr.value == "ctypes":
            return True  # numpy `a.ctypes.data`
        if isinstance(expr, cst.IfExp):
            return self.is_address(expr.body, depth + 1) or self.is_address(expr.orelse, depth + 1)
        if isinstance(expr, cst.Attribute) and expr.attr.value == "value" and isinstance(expr.value, cst.Call) \
                and self._is_ctypes_cast(expr.value) and self._casts_an_address(expr.value, depth + 1):
            return True  # `ctypes.cast(buf, c_void_p).value`: the address as an int
        if isinstance(expr, cst.Subscript) and _index(expr) == 0 and self._interface_data(expr.value, depth + 1):
            return True  # `a.__array_interface__["data"][0]`: the buffer's address ([1] is the read-only flag)
        if isinstance(expr, cst.Call):
            name = _call_name(expr)
            if name == "data_ptr":
                return True
            if name == "caching_allocator_alloc" and any(q.startswith("torch.") for q in self._qualnames(expr.func)):
                return True  # `torch.cuda.caching_allocator_alloc(n)`: a raw device address
            if name == "addressof" and "ctypes.addressof" in self._qualnames(expr.func):
                return True
            if name in ("int", "item") and expr.args and isinstance(expr.func, cst.Name):
                return self.is_address(expr.args[0].value, depth + 1)
            if name == "item" and isinstance(expr.func, cst.Attribute):
                return False
            return False
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, (cst.Modulo, cst.BitAnd, cst.FloorDivide, cst.Divide)):
                return False  # an offset in a page, an alignment, a count: no longer an address
            if isinstance(expr.operator, cst.Subtract) and self._offset_base(expr.right):
                return False  # `x - base`: the distance from an address is an offset
            if isinstance(expr.operator, cst.Add) and any(
                    self._address_offset(a, depth + 1) and self._offset_base(b)
                    for a, b in ((expr.left, expr.right), (expr.right, expr.left))):
                return True  # `buf.mc_base + (ptr - buf.base)`: the address moved into another mapping
            return self.is_address(expr.left, depth + 1) or self.is_address(expr.right, depth + 1)
        if isinstance(expr, cst.Subscript):
            return self.is_address_collection(expr.value, depth + 1)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            return any(self.is_address(v, depth + 1) for v in self._values_of(expr))
        return False

    def _interface_data(self, expr: cst.BaseExpression, depth: int) -> bool:
        """``x.__array_interface__["data"]`` (or ``__cuda_array_interface__``): the (address,
        read-only) pair, itself or through a name bound to the interface dict or to the pair."""
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
            index = expr.slice[0].slice
            if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString) \
                    and index.value.evaluated_value == "data":
                return self._interface_dict(expr.value, depth + 1)
            return False
        if isinstance(expr, cst.Name):
            return any(self._interface_data(v, depth + 1) for v in self._values_of(expr))
        return False

    def _interface_dict(self, expr: cst.BaseExpression, depth: int) -> bool:
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.Attribute):
            return expr.attr.value in _ARRAY_INTERFACES
        if isinstance(expr, cst.Name):
            return any(self._interface_dict(v, depth + 1) for v in self._values_of(expr))
        return False

    def _offset_base(self, expr: cst.BaseExpression) -> bool:
        """What ``x - expr`` measures from: an address, an address rounded to a page
        (``start = ptr & ~(PAGE - 1)``), or a name or attribute called a base or start
        (``self._arena.base`` of another module): the difference is an offset or a length."""
        if self.is_address(expr) or self._rounded_address(expr, 0):
            return True
        last = (get_full_name_for_node(expr) or "").rsplit(".", 1)[-1] if isinstance(
            expr, (cst.Name, cst.Attribute)) else ""
        return _BASE_NAME.search(last) is not None

    def _address_offset(self, expr: cst.BaseExpression, depth: int) -> bool:
        """``addr - base``: the offset of an address from a base, itself or by name."""
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract):
            return self.is_address(expr.left, depth + 1) and self._offset_base(expr.right)
        if isinstance(expr, cst.Name):
            return any(self._address_offset(v, depth + 1) for v in self._values_of(expr))
        return False

    def _rounded_address(self, expr: cst.BaseExpression, depth: int) -> bool:
        """An address through ``&``, ``%`` or ``//`` (an aligned start), itself or by name."""
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.BinaryOperation):
            return self.is_address(expr.left, depth + 1) or self._rounded_address(expr.left, depth + 1) or \
                self.is_address(expr.right, depth + 1)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            return any(self._rounded_address(v, depth + 1) for v in self._values_of(expr))
        return False

    def _is_ctypes_cast(self, call: cst.Call) -> bool:
        return _call_name(call) == "cast" and len(call.args) >= 2 and "ctypes.cast" in self._qualnames(call.func)

    def _casts_an_address(self, call: cst.Call, depth: int) -> bool:
        """``ctypes.cast(src, T)`` of an address (``t.data_ptr()``) or of a ctypes buffer
        (``create_string_buffer``, ``(c_char * n)()``): not of a handle (``stream``, ``ctx``)."""
        src = call.args[0].value
        if _HANDLE_WORDS.search(_code_of(src)):
            return False
        if self.is_address(src, depth + 1):
            return True
        values = [src, *self._values_of(src)] if isinstance(src, (cst.Name, cst.Attribute)) else [src]
        return any(isinstance(v, cst.Call) and (_call_name(v) == "create_string_buffer" or (
            isinstance(v.func, cst.BinaryOperation) and isinstance(v.func.operator, cst.Multiply)
            and "ctypes" in _code_of(v.func.left))) for v in values)

    def _element_exprs(self, expr: cst.BaseExpression) -> list[cst.BaseExpression]:
        if isinstance(expr, (cst.List, cst.Set, cst.Tuple)):
            return [e.value for e in expr.elements]
        if isinstance(expr, (cst.ListComp, cst.SetComp, cst.GeneratorExp)):
            return [expr.elt]
        if isinstance(expr, cst.Dict):
            return [e.value for e in expr.elements if isinstance(e, cst.DictElement)]
        if isinstance(expr, cst.DictComp):
            return [expr.value]
        return []

    def _maps_to_address(self, func: cst.BaseExpression, depth: int) -> bool:
        """A function ``map()`` applies that gives an address: ``lambda t: t.data_ptr()``,
        ``torch.Tensor.data_ptr``, ``operator.methodcaller("data_ptr")``."""
        if isinstance(func, cst.Lambda):
            return self.is_address(func.body, depth + 1)
        if isinstance(func, cst.Attribute):
            return func.attr.value == "data_ptr"
        if isinstance(func, cst.Call) and _call_name(func) == "methodcaller" and func.args:
            name = func.args[0].value
            return isinstance(name, cst.SimpleString) and name.evaluated_value == "data_ptr"
        return False

    def _holds_address(self, expr: cst.BaseExpression, depth: int) -> bool:
        """An element that is an address, or a tuple/list holding one ((addr, len, dev))."""
        if self.is_address(expr, depth):
            return True
        if isinstance(expr, (cst.Tuple, cst.List)):
            return any(self.is_address(e.value, depth + 1) for e in expr.elements)
        if isinstance(expr, cst.IfExp):  # `None if t is None else (t.data_ptr(), n)`
            return self._holds_address(expr.body, depth + 1) or self._holds_address(expr.orelse, depth + 1)
        return False

    def _is_address_collection(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, _COLLECTIONS):
            return any(self._holds_address(e, depth + 1) for e in self._element_exprs(expr))
        if isinstance(expr, cst.Call):
            name = _call_name(expr)
            if name in ("list", "tuple", "sorted", "reversed", "set", "zip", "enumerate") and expr.args:
                return any(self.is_address_collection(a.value, depth + 1) for a in expr.args)
            if name in ("values", "items") and isinstance(expr.func, cst.Attribute):
                return self.is_address_collection(expr.func.value, depth + 1)
            if name == "map" and len(expr.args) >= 2:
                return self._maps_to_address(expr.args[0].value, depth + 1)
            return False
        if isinstance(expr, cst.Subscript):
            # an element of a collection of (addr, len) tuples, or a slice of an address list
            return self.is_address_collection(expr.value, depth + 1)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            return self.is_address_collection(expr.left, depth + 1) or self.is_address_collection(expr.right, depth + 1)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            if any(self.is_address_collection(v, depth + 1) for v in self._values_of(expr)):
                return True
            filled, extended = self._filled(expr)
            return any(self._holds_address(v, depth + 1) for v in filled) or \
                any(self.is_address_collection(v, depth + 1) for v in extended)
        return False

    def _filled(self, expr: cst.Name | cst.Attribute) -> tuple[list[cst.BaseExpression], list[cst.BaseExpression]]:
        """What was put into the container ``expr`` after it was bound (``.append``, ``[k] =``,
        ``.extend``): elements and collections. A name counts in its own scope only."""
        if self._fill_index is None:
            index: dict[tuple[int, str], tuple[list[cst.BaseExpression], list[cst.BaseExpression]]] = {}
            for i, pairs in enumerate((self.c.stores, self.c.extends)):
                for recv, value in pairs:
                    key = self._fill_key(recv)
                    if key is not None:
                        index.setdefault(key, ([], []))[i].append(value)
            self._fill_index = index
        key = self._fill_key(expr)
        return self._fill_index.get(key, ([], [])) if key is not None else ([], [])

    def _fill_key(self, expr: cst.BaseExpression) -> tuple[int, str] | None:
        if isinstance(expr, cst.Name):
            scope = self.get_metadata(ScopeProvider, expr, None)
            return (id(scope), expr.value) if scope is not None else None
        if isinstance(expr, cst.Attribute):
            name = get_full_name_for_node(expr)
            return (0, name) if name else None
        return None

    def _is_int_descriptor_list(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        """NIXL's ``[(addr, len, dev_id, meta), ...]``: a list of tuples (or a name bound to one)."""
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, (cst.List, cst.ListComp, cst.GeneratorExp)):
            elts = self._element_exprs(expr)
            # `[(1, 2, 3)]` in an API test of malformed lists holds no address
            return bool(elts) and all(isinstance(e, cst.Tuple) and len(e.elements) >= 3 for e in elts) and not all(
                isinstance(e, cst.Tuple) and isinstance(e.elements[0].value, cst.Integer) for e in elts)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            return any(self._is_int_descriptor_list(v, depth + 1) for v in self._values_of(expr))
        return False

    def _origin_qualnames(self, expr: cst.BaseExpression, depth: int = 0) -> set[str]:
        """Qualified names of what built ``expr`` (its constructor call, or its annotation)."""
        if depth > _MAX_DEPTH:
            return set()
        if isinstance(expr, cst.Call):
            return self._qualnames(expr.func)
        out: set[str] = set()
        if isinstance(expr, cst.Name):
            for ann in self._bound_annotations(expr):
                out |= self._qualnames(ann)
        elif isinstance(expr, cst.Attribute):
            name = get_full_name_for_node(expr)
            attr_ann = self.c.attr_annotations.get(name) if name else None
            if attr_ann is not None:
                out |= self._qualnames(attr_ann)
        for v in self._values_of(expr):
            out |= self._origin_qualnames(v, depth + 1)
        return out

    def engine_kind(self, expr: cst.BaseExpression) -> str | None:
        """"mooncake" / "nixl" for an object built by (or annotated with) a name from those
        packages, else None."""
        roots = {q.split(".", 1)[0] for q in self._origin_qualnames(expr)}
        if "mooncake" in roots:
            return "mooncake"
        return "nixl" if roots & set(_ENGINE_ROOTS) else None

    def is_engine(self, expr: cst.BaseExpression) -> bool:
        return self.engine_kind(expr) is not None

    def _is_pointer_table(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.Call):
            if _call_name(expr) == "as_uint64_tensor":
                return True
            return bool(self._qualnames(expr.func) & _POINTERDOMAIN_TABLE_CALLS)
        if isinstance(expr, cst.Attribute) and expr.attr.value in _TABLE_ATTRS:
            return True
        if isinstance(expr, (cst.Name, cst.Attribute)):
            anns = self._bound_annotations(expr) if isinstance(expr, cst.Name) else []
            if any("PointerTable" in (get_full_name_for_node(a) or "") or
                   (isinstance(a, cst.Subscript) and "PointerTable" in (get_full_name_for_node(a.value) or ""))
                   for a in anns):
                return True
            return any(self._is_pointer_table(v, depth + 1) for v in self._values_of(expr))
        return False

    def _arg_values(self, node: cst.Call) -> list[cst.BaseExpression]:
        return [a.value for a in node.args]

    # -- rules --------------------------------------------------------------------------

    def _method_alias(self, node: cst.Call) -> cst.Attribute | None:
        """``engine.register_memory`` for ``reg(...)`` after ``reg = engine.register_memory``, for
        ``getattr(engine, "register_memory")(...)`` and for ``reg(...)`` after
        ``reg = getattr(engine, "register_memory")``."""
        candidates = [node.func]
        if isinstance(node.func, cst.Name):
            candidates = self._bound_values(node.func)
        for v in candidates:
            if isinstance(v, cst.Call):
                v = _getattr_as_attribute(v)  # type: ignore[assignment]
            if isinstance(v, cst.Attribute) and v.attr.value in _ENGINE_METHODS:
                return v
        return None

    def _logging_call(self, node: cst.Call, name: str | None) -> bool:
        """``logger.info("%x", ptr, extra={"ptr": t.data_ptr()})``, ``logging.getLogger(n).debug(...)``:
        a log record formats the address, never dereferences it."""
        if name not in _LOG_METHODS or not isinstance(node.func, cst.Attribute):
            return False
        if _LOGGER.search(_code_of(node.func.value)):
            return True
        return any(q.startswith("logging.") for q in self._qualnames(node.func))

    def _formatting_call(self, node: cst.Call) -> bool:
        """``print(...)``, ``"...".format(...)``: the arguments are formatted as text."""
        if isinstance(node.func, cst.Name) and node.func.value == "print":
            return not self._qualnames(node.func) or "builtins.print" in self._qualnames(node.func)
        return isinstance(node.func, cst.Attribute) and node.func.attr.value == "format" \
            and isinstance(node.func.value, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString))

    def visit_FormattedStringExpression(self, node: cst.FormattedStringExpression) -> None:
        # f"{t.data_ptr() + off:#x}": the value is formatted as text, never used as an address
        self._cover_subtree(node)

    def visit_Call(self, node: cst.Call) -> None:
        name = _call_name(node)
        if self._logging_call(node, name) or self._formatting_call(node):
            self._cover_subtree(node)  # no address use inside: PD002 and PD008 both skip it
            return
        if name is None and isinstance(node.func, cst.Subscript) and "PD008" in self.rules.enabled:
            self._check_kernel_launch(node, node.func)
        if name is None and not isinstance(node.func, cst.Call):
            return
        if name is not None and name.startswith("assert"):
            self._assert_depth += 1  # `self.assertEqual(a.data_ptr() + n, b.data_ptr())`: a test's check
        func: cst.BaseExpression = node.func
        alias = self._method_alias(node)
        if alias is not None:
            func, name = alias, alias.attr.value
        if name is None:
            return
        if name == "map" and id(node) not in self._covered and not self._assert_depth \
                and self.is_address_collection(node):
            self._report(node, "PD002", "data_ptr() addresses collected through map(): an untyped pointer table")
            self._cover_subtree(node)
        # `.to(device)` / `.cuda()` after a table build: remember the target for PD001's fix.
        if name in ("to", "cuda") and isinstance(node.func, cst.Attribute) and isinstance(node.func.value, cst.Call):
            self._device_chain[id(node.func.value)] = node
        if name in ("tensor", "as_tensor", "asarray", "Tensor", "LongTensor", "array", "fromiter"):
            self._check_table(node)
        if name in _REGISTER_FUNCS or name in ("hostRegister", "hostUnregister"):
            self._check_runtime_registration(node, name)
        elif name in _ENGINE_REGISTER_METHODS and isinstance(func, cst.Attribute):
            self._check_engine_registration(node, name, func.value)
        if (name in _MOONCAKE_TRANSFERS or name in _NIXL_DESC_METHODS) and isinstance(func, cst.Attribute):
            self._check_transfer(node, name, func.value)
        if _GPU_ENTRY.match(name):
            self._check_c_void_p(node, name)
        if self.rules.kernel_ops:
            self._check_kernel_op(node)
        if self._triton_depth and name in ("to", "cast"):
            self._check_triton_cast(node, name)
        if "PD008" in self.rules.enabled:
            self._check_address_argument(node, name)

    def leave_Call(self, original_node: cst.Call) -> None:
        name = _call_name(original_node)
        if name is not None and name.startswith("assert"):
            self._assert_depth -= 1

    def visit_Assert(self, node: cst.Assert) -> None:
        self._assert_depth += 1

    def leave_Assert(self, original_node: cst.Assert) -> None:
        self._assert_depth -= 1

    def visit_Return(self, node: cst.Return) -> None:
        # `return ctypes.c_void_p(t.data_ptr())`, `return ptr, tensor`: the address leaves the
        # function untyped
        value = node.value
        if value is None or id(value) in self._covered or isinstance(value, cst.BinaryOperation):
            return  # `return base + off` is PD002's
        if self._function_names and (self._function_names[-1] == "__hash__"
                                     or self._function_names[-1] in self.key_functions):
            return  # a hash or a sort key: the address orders or identifies, it is never dereferenced
        if self._wraps_address(value):
            what = "as a ctypes pointer"
        elif self.is_address(value) or (isinstance(value, cst.Tuple) and not _identity_tuple(value)
                                        and any(self.is_address(e.value) for e in value.elements)):
            what = "as an int"
        else:
            return
        self._report(value, "PD008", f"a raw address is returned {what}: the caller cannot tell its domain",
                     self._domain_fix(value))
        self._cover_subtree(value)

    def _wraps_address(self, expr: cst.BaseExpression) -> bool:
        if isinstance(expr, cst.Call) and _numpy_data_as(expr):
            return True  # `a.ctypes.data_as(c_void_p)`: a ctypes pointer to the array's buffer
        if isinstance(expr, cst.Call) and self._is_ctypes_cast(expr):
            return self.is_address(expr.args[0].value)  # `ctypes.cast(t.data_ptr(), c_void_p)`
        return isinstance(expr, cst.Call) and _call_name(expr) in _WRAPPERS and len(expr.args) == 1 \
            and self.is_address(expr.args[0].value)

    def _carries_address(self, expr: cst.BaseExpression) -> bool:
        """An argument that is an address, a ctypes/handle wrapper of one, or a tuple/list
        holding one (``(addr, nbytes)`` sent to a peer)."""
        if isinstance(expr, cst.Call) and _call_name(expr) in _TYPED_DEVICE_POINTERS:
            return False  # `cuda.CUdeviceptr(addr)`: the callee is told it is device memory
        if self.is_address(expr) or self._wraps_address(expr):
            return True
        if isinstance(expr, cst.Name) and any(isinstance(v, cst.Call) and self._wraps_address(v)
                                              for v in self._values_of(expr)):
            return True  # `src = ctypes.cast(t.data_ptr(), POINTER(c_uint8))` then `op(src)`
        if isinstance(expr, cst.Call) and len(expr.args) == 1 and _call_name(expr) not in _NOT_NATIVE:
            return self.is_address(expr.args[0].value)
        if isinstance(expr, (cst.Tuple, cst.List)):
            # `(arg_values, arg_types)` of cuda-python's launch: a tuple may carry a collection of addresses
            # (a list literal of descriptors stays PD002's)
            return not _identity_tuple(expr, dims=False) and any(self.is_address(e.value) or (
                isinstance(expr, cst.Tuple) and self.is_address_collection(e.value)) for e in expr.elements)
        if isinstance(expr, cst.Name):
            # `args = (n, self.req_ids_ptr, ...)` then `op(args)`: a list/tuple of addresses
            return any(not _identity_tuple(v, dims=False)
                       for v in self._values_of(expr)) and self.is_address_collection(expr)
        return False

    def _check_address_argument(self, node: cst.Call, name: str) -> None:
        positional = [a for a in node.args if a.keyword is None and not a.star]
        if name in ("append", "add") and len(positional) > 1 or name == "insert" and len(positional) > 2:
            name = f"{name} (a native method: a Python container takes one item)"  # `iobufs.append(ptr, n, True)`
        elif name in _NOT_NATIVE or name.startswith(("assert", "log", "_log")) or id(node) in self._covered \
                or _call_name(node) in _WRAPPERS | _TYPED_DEVICE_POINTERS or self._typed_dsl_pointer(node):
            return
        if isinstance(node.func, cst.Attribute):
            recv = get_full_name_for_node(node.func.value) or ""
            if recv.rsplit(".", 1)[-1] in _NOT_NATIVE_RECEIVERS:
                return  # logging
            if recv in ("self", "cls") and name in self.defined:
                self._check_helper_call(node, name)  # a Python helper of this file: does it hand the int on?
                return
        elif isinstance(node.func, cst.Name):
            # `_Buffer(base=t.data_ptr())`: a record class of the file, private too (not in a CuTe DSL
            # module, whose private state classes hold DSL pointers)
            cls_name = node.func.value if self._cute_dsl else node.func.value.lstrip("_")
            if not self._imported(node.func) and not cls_name[:1].isupper() \
                    and not self._bound_to_loaded_callable(node.func):
                if name in self.defined:
                    self._check_helper_call(node, name)
                return  # a local function or a parameter: Python code (a class, e.g. a ctypes struct of
                # kernel arguments, is reported: the address is stored in its field)
        args = [a.value for a in node.args if id(a.value) not in self._covered]
        hits = [a for a in args if self._carries_address(a)]
        if not hits:
            return
        if self._check_deferred_call(node, name):
            return
        # `(ctypes.c_char * n).from_address(p)`: libcst names a method of an expression `builtins.None`
        qns = set() if isinstance(node.func, cst.Attribute) and get_full_name_for_node(node.func.value) is None \
            else self._qualnames(node.func)
        if any(q.split(".", 1)[0] in _PY_ROOTS and not q.startswith("torch.ops.") for q in qns):
            return  # torch / numpy / stdlib Python APIs (torch.tensor is PD001's)
        if any(q.startswith("cutlass.") and not q.endswith(".make_ptr") for q in qns):
            self._cover_subtree(node)  # `cutlass.Array(smem_base.data_ptr() + off, ...)`: DSL arithmetic too
            return  # CuTe DSL functions (`cute.make_tensor`, `pipeline.PipelineAsync.create`) take DSL pointers
            # (shared-memory storage fields); make_ptr is where a host int becomes one
        self._report_argument(node, hits[0], f"passed as an int to {name}()", "the callee cannot tell a host VA "
                              "from a device address")

    def _check_kernel_launch(self, node: cst.Call, func: cst.Subscript) -> None:
        """``kernel[grid](t.data_ptr(), ...)``: a JIT kernel (Triton, Numba) launched with an int
        address, which the kernel turns into a pointer."""
        kernel = get_full_name_for_node(func.value)
        if kernel is None or id(node) in self._covered or self._assert_depth:
            return
        hits = [a.value for a in node.args if id(a.value) not in self._covered and self._carries_address(a.value)]
        if hits:
            self._report_argument(node, hits[0], f"passed as an int to the kernel launch {kernel}[...]()",
                                  "the kernel cannot tell a host VA from a device address")

    def _report_argument(self, call: cst.Call, hit: cst.BaseExpression, how: str, why: str) -> None:
        """PD008 for an address argument of ``call``; where the argument is a name bound to a tuple
        literal in this scope (``args = (n, self.x_ptr, ...)`` then ``op(args)``), at that tuple:
        that is where the ints are packed, and a tuple reaching several calls is one finding."""
        packed = [v for v in self._values_of(hit) if isinstance(v, cst.Tuple)] if isinstance(hit, cst.Name) else []
        if isinstance(hit, cst.Name) and len(packed) == 1 and len(self._values_of(hit)) == 1:
            self._cover_subtree(call)
            if id(packed[0]) in self._covered:
                return  # reported at the tuple already
            how = how.replace("as an int", "as ints").replace("hands it", "hands them")
            self._report(packed[0], "PD008", f"data_ptr() addresses packed into the tuple {hit.value} are {how}: "
                         f"{why}", self._domain_fix(packed[0]))
            self._cover_subtree(packed[0])
            return
        self._report(call, "PD008", f"data_ptr() address {how}: {why}", self._domain_fix(hit))
        self._cover_subtree(call)

    def _typed_dsl_pointer(self, node: cst.Call) -> bool:
        """``make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem)``: the CuTe DSL is told the address
        space, like ``CUdeviceptr``; the int becomes a typed pointer there. The space must resolve to
        the DSL's (``cutlass.cute.AddressSpace``) through the file's imports."""
        return _call_name(node) == "make_ptr" and any(
            ("AddressSpace" in _code_of(a.value) or (a.keyword is not None and a.keyword.value in (
                "mem_space", "address_space"))) and any(q.startswith("cutlass.") for q in self._qualnames(a.value))
            for a in node.args)

    def _check_deferred_call(self, node: cst.Call, name: str) -> bool:
        """``weakref.finalize(obj, _unpin, t.data_ptr())``, ``pool.submit(self._register, ptr, n)``:
        the address goes to a helper of this file that hands it to native code. True when reported."""
        later = _DEFERRED.get(name)
        positional = [a.value for a in node.args if a.keyword is None and not a.star]
        if later is None or len(positional) <= later:
            return False
        f = positional[later]
        helper = f.attr.value if isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and \
            f.value.value in ("self", "cls") else f.value if isinstance(f, cst.Name) else None
        if helper is None or helper not in self.defined:
            return False
        if self._helpers is None:
            self._helpers = helper_sinks("\n".join(self.lines))
        sinks = self._helpers.get(helper, {})
        for i, a in enumerate(positional[later + 1:]):
            if sink_at(sinks, i) and id(a) not in self._covered and self._carries_address(a):
                self._report_argument(node, a, f"passed as an int to {helper}() (called by {name}()), which hands it "
                                      f"to native {sink_at(sinks, i)}()", "neither can tell a host VA from a device "
                                      "address")
                return True
        return False

    def _check_helper_call(self, node: cst.Call, name: str) -> None:
        """``self._pre_register(buf.data_ptr(), n)`` where the helper of this file hands that
        parameter to native code (an engine, a runtime entry, a loaded library): the address
        leaves typed code at this call."""
        if self._helpers is None:
            self._helpers = helper_sinks("\n".join(self.lines))
        sinks = self._helpers.get(name)
        if not sinks or id(node) in self._covered:
            return
        positional = [a for a in node.args if a.keyword is None and not a.star]
        for i, a in enumerate(positional):
            if sink_at(sinks, i) and id(a.value) not in self._covered and self._carries_address(a.value):
                self._report_argument(node, a.value, f"passed as an int to {name}(), which hands it to native "
                                      f"{sink_at(sinks, i)}()", "neither can tell a host VA from a device address")
                return
        for a in node.args:
            if a.keyword is not None and a.keyword.value in sinks and id(a.value) not in self._covered \
                    and self._carries_address(a.value):
                self._report_argument(node, a.value, f"passed as an int to {name}(), which hands it to native "
                                      f"{sinks[a.keyword.value]}()", "neither can tell a host VA from a device "
                                      "address")
                return

    def _bound_to_loaded_callable(self, name: cst.Name) -> bool:
        """``func = module["flashinfer_moe_permute"]`` / ``fn = lib.get_function(...)``: a callable
        taken out of a loaded module or library, not a Python function of this file."""
        return any(isinstance(v, (cst.Subscript, cst.Call, cst.Attribute)) and not isinstance(v, cst.Lambda)
                   for v in self._bound_values(name))

    def _imported(self, name: cst.Name) -> bool:
        scope = self.get_metadata(ScopeProvider, name, None)
        if scope is None:
            return False
        try:
            return any(q.source == QualifiedNameSource.IMPORT for q in scope.get_qualified_names_for(name))
        except Exception:
            return False

    def _tensor_of(self, expr: cst.BaseExpression, depth: int = 0) -> cst.BaseExpression | None:
        """The tensor whose ``data_ptr()`` ``expr`` is (through names and wrappers), or None."""
        if depth > _MAX_DEPTH:
            return None
        if isinstance(expr, cst.Call):
            if _call_name(expr) == "data_ptr" and isinstance(expr.func, cst.Attribute):
                return expr.func.value
            for a in expr.args:
                t = self._tensor_of(a.value, depth + 1)
                if t is not None:
                    return t
            return None
        if isinstance(expr, cst.BinaryOperation):
            return self._tensor_of(expr.left, depth + 1) or self._tensor_of(expr.right, depth + 1)
        if isinstance(expr, (cst.Tuple, cst.List)):
            for e in expr.elements:
                t = self._tensor_of(e.value, depth + 1)
                if t is not None:
                    return t
            return None
        if isinstance(expr, (cst.Name, cst.Attribute)):
            for v in self._values_of(expr):
                t = self._tensor_of(v, depth + 1)
                if t is not None:
                    return t
        return None

    def memory_domain(self, expr: cst.BaseExpression) -> str | None:
        """"device" / "host" for the memory behind the address ``expr``, from how its tensor
        was made (``device="cuda"``, ``.cuda()``, ``pin_memory``, ``device="cpu"``), else None."""
        tensor = self._tensor_of(expr)
        if tensor is None:
            return self._source_domain(expr)
        texts = [cst.Module([]).code_for_node(v) for v in [tensor, *self._values_of(tensor)]] \
            if isinstance(tensor, (cst.Name, cst.Attribute)) else [cst.Module([]).code_for_node(tensor)]
        text = " ".join(texts)
        calls = [v for v in [tensor, *self._values_of(tensor)] if isinstance(v, cst.Call)] \
            if isinstance(tensor, (cst.Name, cst.Attribute)) else [tensor] if isinstance(tensor, cst.Call) else []
        devices = [_arg(c, 99, "device") for c in calls]
        if any(d is not None and len(device_targets(d)) > 1 for d in devices):
            return None  # `device=device if device else "cpu"`: either, decided at run time
        if re.search(r"pin_memory|[\"']cpu[\"']|\.cpu\(\)|numpy|mmap|ctypes", text):
            return "host"
        if re.search(r"cuda|[\"'](?:npu|xpu|hip|musa)|\.npu\(|device\s*=", text):
            return "device"
        return None

    def _source_domain(self, expr: cst.BaseExpression) -> str | None:
        """The domain of an address read from an allocator or an array interface, through names:
        ``caching_allocator_alloc`` / ``__cuda_array_interface__``: device; numpy's
        ``__array_interface__`` / ``.ctypes``: host."""
        values = [expr, *self._values_of(expr)] if isinstance(expr, (cst.Name, cst.Attribute)) else [expr]
        text = " ".join(_code_of(v) for v in values)
        if re.search(r"caching_allocator_alloc|__cuda_array_interface__", text):
            return "device"
        if re.search(r"__array_interface__|\.ctypes\.data", text):
            return "host"
        return None

    def _domain_fix(self, expr: cst.BaseExpression) -> str:
        domain = self.memory_domain(expr)
        if domain == "device":
            return ("device memory: its address is a device address, valid only for that device's kernels and "
                    "device-memory registrations; keep it typed (pass the tensor, or a make_kernel_ptr_table "
                    "table), never as a HostVA")
        if domain == "host":
            return ("host memory: pass a HostVA (pointerdomain.HostVA / host_ptr_table) to CPU code and engines, "
                    "and the device alias (make_kernel_ptr_table) to kernels")
        return ("say the domain in the type: a HostVA for host memory read by CPU code or engines, a device "
                "address (make_kernel_ptr_table / the tensor itself) for device memory and kernels")

    def _named_device_targets(self, device: cst.BaseExpression) -> frozenset[str]:
        """:func:`device_targets`, through the values bound to a device name or attribute
        (``dev = "cpu"``: the host); a parameter with a default, or an attribute bound to the
        CPU, may be either."""
        targets = device_targets(device)
        if not isinstance(device, (cst.Name, cst.Attribute)):
            return targets
        bound: set[str] = set()
        for value in self._values_of(device):
            bound |= device_targets(value)
        if isinstance(device, cst.Attribute) and "host" in bound:
            bound.add("device")  # a method this pass skipped may assign the attribute again
        if isinstance(device, cst.Name):
            scope: Scope | None = self.get_metadata(ScopeProvider, device, None)
            try:
                assignments = list(scope[device.value]) if scope is not None else []
            except Exception:  # libcst raises on a few odd names; then nothing is known
                assignments = []
            for a in assignments:
                param = getattr(a, "node", None)
                if isinstance(param, cst.Param) and param.default is not None:
                    bound |= device_targets(param.default) | {"device"}  # the caller's choice
        return frozenset(bound) or targets

    def _check_table(self, node: cst.Call) -> None:
        data = _arg(node, 0, "data")
        if data is None or not self.is_address_collection(data):
            return
        qns = self._qualnames(node.func)
        if not qns & _TABLE_BUILDERS:
            return
        builder = sorted(qns & _TABLE_BUILDERS)[0]
        device = _arg(node, 99, "device")
        chain = self._device_chain.get(id(node))
        targets = frozenset({"host"})
        if device is not None:
            targets = self._named_device_targets(device)
        elif chain is not None:
            targets = frozenset({"device"})
        kernel_fix = ("pointerdomain.make_kernel_ptr_table(tensors, device) -> PointerTable[DeviceAlias] (device "
                      "aliases, checked registration)")
        host_fix = "pointerdomain.host_ptr_table(tensors) -> PointerTable[HostVA]"
        if len(targets) > 1:
            target = "host or device"
            fix = f"{kernel_fix} where the device is a GPU, {host_fix} where it is the CPU"
        else:
            target = next(iter(targets))
            fix = kernel_fix if target == "device" else host_fix
        self._covered.add(id(data))
        if isinstance(data, cst.Call):  # `list(map(lambda t: t.data_ptr(), bufs))`: one finding, PD001's
            self._covered.update(id(a.value) for a in data.args)
        when = " (the device is chosen at run time)" if len(targets) > 1 else ""
        self._report(node, "PD001", f"{builder}() of data_ptr() addresses builds an untyped {target} pointer table"
                     f"{when}",
                     fix + "; `pointerdomain audit --fix` rewrites `[t.data_ptr() for t in X]` forms")

    def _check_runtime_registration(self, node: cst.Call, name: str) -> None:
        qns = self._qualnames(node.func)
        if name in ("hostRegister", "hostUnregister") and not qns & _CUPY_REGISTER:
            return
        what = "unregistration" if "nregister" in name else "registration"
        via = next((q for q in sorted(qns) if "<locals>" not in q), None) or get_full_name_for_node(node.func) or name
        self._covered.update(id(v) for v in self._arg_values(node))
        self._report(node, "PD003", f"raw host-memory {what} {via}(): its return code and the alias of the "
                     "range are not checked by the caller's types")  # host memory by definition: HostVA fix

    def _file_descriptors(self, node: cst.Call) -> bool:
        """NIXL ``"FILE"`` / ``"OBJ"`` descriptors hold (offset, len, fd/key), no address."""
        mem = _arg(node, 1, "mem_type")
        if isinstance(mem, cst.Name):
            mem = next(iter(self._bound_values(mem)), mem)
        return isinstance(mem, cst.SimpleString) and mem.evaluated_value in ("FILE", "OBJ")

    def _registration_fix(self, args: Sequence[cst.BaseExpression]) -> str:
        domain = next((d for d in (self.memory_domain(a) for a in args) if d is not None), None)
        if domain == "device":
            return ("this registers device memory: its metadata is a device address (the tensor's own "
                    "data_ptr() on its device), never a HostVA or a host alias; pass the tensor or a typed "
                    "table of that device")
        if domain == "host":
            return RULES["PD003"].fix
        return ("host memory: HostVA metadata (pointerdomain.register_host_tensor, adapters.mooncake."
                "HostTransferEngine.register_memory); device memory: its device address, never a HostVA")

    def _check_engine_registration(self, node: cst.Call, name: str, receiver: cst.BaseExpression) -> None:
        args = self._arg_values(node)
        if self._file_descriptors(node):
            return
        if name.startswith(("register", "batch_register")) and args and self._is_int_descriptor_list(args[0]) \
                and self.is_engine(receiver):
            self._covered.update(id(v) for v in args)
            self._report(node, "PD004", f"{name}() fed a list of (addr, len, dev, meta) int tuples",
                         RULES["PD004"].fix)
            return
        # Mooncake's raw engine/store take only int addresses; NIXL also takes tensors (safe).
        engine = self.engine_kind(receiver) == "mooncake"
        fed_ints = any(self.is_address(a) or self.is_address_collection(a) for a in args)
        if not engine and not fed_ints:
            return  # e.g. nn.Module.register_buffer, NIXL given tensors, a typed wrapper
        self._covered.update(id(v) for v in args)
        why = "with raw int addresses" if fed_ints else "on a raw Mooncake object (it takes int addresses)"
        self._report(node, "PD003", f"transfer-engine {name}() {why}: its metadata carries no domain",
                     self._registration_fix(args))

    def _check_transfer(self, node: cst.Call, name: str, receiver: cst.BaseExpression) -> None:
        if self._file_descriptors(node):
            return
        args = self._arg_values(node)
        fed = [a for a in args if self.is_address(a) or self.is_address_collection(a) or self._is_int_descriptor_list(a)]
        engine = self.engine_kind(receiver) == "mooncake"
        if not fed and not (engine and name in _MOONCAKE_TRANSFERS):
            return
        self._covered.update(id(v) for v in args)
        why = "with raw int addresses" if fed else "on a raw Mooncake engine (its API takes int addresses)"
        self._report(node, "PD004", f"{name}() called {why}")

    def _is_c_void_p(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.Call):
            if expr.args and _is_host_struct_address(expr.args[0].value):
                return False  # `(c_void_p * 1)(ctypes.addressof(args))`: the launch API's host kernel-argument buffer
            if _call_name(expr) in _TYPED_DEVICE_POINTERS:
                return False  # `cuda.CUdeviceptr(addr)`: typed as device memory for the callee
            if _numpy_data_as(expr):
                return True  # `a.ctypes.data_as(c_void_p)`
            if _call_name(expr) != "c_void_p" and len(expr.args) == 1 and self.is_address(expr.args[0].value):
                return True  # `buffer_type(t.data_ptr())` with `buffer_type = ctypes.c_void_p` in another module
            if _call_name(expr) == "c_void_p":
                # c_void_p() is an out-parameter for a handle; c_void_p(stream) wraps a handle
                if not expr.args or _HANDLE_WORDS.search(cst.Module([]).code_for_node(expr.args[0].value)):
                    return False
                return "ctypes.c_void_p" in self._qualnames(expr.func)
            if _call_name(expr) == "cast" and len(expr.args) >= 2:
                # `ctypes.cast(t.data_ptr(), c_void_p | POINTER(T) | c_char_p)`; a cast of a ctypes array or
                # struct is a host buffer
                target = expr.args[1].value
                pointer = "ctypes.c_void_p" in self._qualnames(target) or "ctypes.c_char_p" in self._qualnames(
                    target) or (isinstance(target, cst.Call) and "ctypes.POINTER" in self._qualnames(target.func))
                return pointer and self.is_address(expr.args[0].value)
            if _call_name(expr) == "byref" and expr.args:
                return False
            return False
        if isinstance(expr, cst.Name):
            return any(self._is_c_void_p(v, depth + 1) for v in self._values_of(expr))
        return False

    def _check_c_void_p(self, node: cst.Call, name: str) -> None:
        if any(self._is_c_void_p(a) for a in self._arg_values(node)):
            self._cover_subtree(node)
            self._report(node, "PD006", f"ctypes.c_void_p address passed to {name}(): the callee cannot tell a "
                         "host VA from a device alias")

    def _check_kernel_op(self, node: cst.Call) -> None:
        qns = self._qualnames(node.func)
        dotted = get_full_name_for_node(node.func)
        ops = self.rules.kernel_ops
        hit = sorted(q for q in qns if q in ops) or ([dotted] if dotted in ops else [])
        if not hit:
            return
        if any(self._is_pointer_table(a) for a in self._arg_values(node)):
            return
        self._report(node, "PD007", f"kernel op {hit[0]}() called without a PointerTable argument")

    # PD002 -----------------------------------------------------------------------------

    def visit_Comparison(self, node: cst.Comparison) -> None:
        # `lo <= other.data_ptr() + n <= hi`: a range check, no address is made
        self._cover_subtree(node)

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> bool:
        if isinstance(node.operator, cst.Modulo) and isinstance(
                node.left, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
            self._cover_subtree(node)  # `"%#x" % (t.data_ptr() + off)`: formatted as text
            return True
        if id(node) in self._covered or self._assert_depth or isinstance(
                node.operator, (cst.Modulo, cst.BitAnd, cst.FloorDivide, cst.Divide)):
            return True  # `addr % align` is an alignment/offset check; `assert b - a == stride` a test's check
        if isinstance(node.operator, cst.Subtract) and self._offset_base(node.right):
            self._cover_subtree(node)  # `k.data_ptr() - q.data_ptr()`, `(p + n) - start`: an offset or a length
            return True
        if self.is_address(node.left) or self.is_address(node.right) or self.is_address(node):
            self._report(node, "PD002", "arithmetic on a data_ptr() address yields an untyped int "
                         "(an alias offset must stay inside one registration)")
            self._cover_subtree(node)
        return True

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.operator, (cst.AddAssign, cst.SubtractAssign)) and self.is_address(node.target):
            self._report(node, "PD002", "in-place arithmetic on a data_ptr() address")

    def _cover_subtree(self, node: cst.CSTNode) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            self._covered.add(id(n))
            stack.extend(n.children)

    def _check_collection(self, node: cst.BaseExpression, kind: str) -> None:
        if id(node) in self._covered or self._assert_depth:
            return
        if _identity_tuple(node):
            self._cover_subtree(node)  # `(t.data_ptr(), t.shape, t._version)`: a cache key, never dereferenced
            return
        elts = self._element_exprs(node)
        if any(_identity_tuple(e) for e in elts):
            self._cover_subtree(node)
            return
        if any(self._holds_address(e, 0) for e in elts):
            if self._only_compared(node) or (self._function_names and _KEY_FUNCTION.search(self._function_names[-1])):
                self._cover_subtree(node)  # a snapshot of addresses only compared later: an identity check
                return
            self._report(node, "PD002", f"data_ptr() addresses collected into a {kind}: an untyped pointer table")
            self._cover_subtree(node)

    def _only_compared(self, value: cst.BaseExpression) -> bool:
        """``value`` is bound to a name or attribute whose every read is inside a comparison or
        an ``assert`` (directly, or after being copied into an attribute: ``entry.addrs = addrs``
        then ``assert new == entry.addrs``): the addresses are kept to check identity, never
        dereferenced. False when it is never read."""
        target = self.c.bound_by.get(id(value))
        if target is None:
            return False
        if isinstance(target, cst.Name) and _KEY_NAME.search(target.value):
            return True  # `key = tuple(w.data_ptr() for w in ws)`: looked up in a cache
        reads = self._reads(target)
        if not reads:
            return False
        for read in reads:
            if id(read) in self.c.compared:
                continue
            copy = self.c.bound_by.get(id(read))
            if not isinstance(copy, cst.Attribute):
                return False
            copies = self._reads(copy)
            if not copies or any(id(n) not in self.c.compared for n in copies):
                return False
        return True

    def _reads(self, target: cst.BaseExpression) -> list[cst.CSTNode]:
        """The nodes that read what ``target`` (a Name or ``obj.attr``) was bound to: the name's
        accesses in its scope; for an attribute, every ``x.attr`` of the file that is no
        assignment target (any receiver: the object travels)."""
        if isinstance(target, cst.Attribute):
            return [n for n in self.c.attr_nodes.get(target.attr.value, []) if id(n) not in self.c.store_targets]
        if not isinstance(target, cst.Name):
            return []
        scope = self.get_metadata(ScopeProvider, target, None)
        if scope is None:
            return []
        try:
            assignments = [a for a in scope.assignments[target.value] if isinstance(a, Assignment)]
        except Exception:
            return []
        return [access.node for a in assignments for access in a.references]

    def visit_List(self, node: cst.List) -> None:
        self._check_collection(node, "list")

    def visit_ListComp(self, node: cst.ListComp) -> None:
        self._check_collection(node, "list")

    def visit_GeneratorExp(self, node: cst.GeneratorExp) -> None:
        self._check_collection(node, "generator")

    def visit_Dict(self, node: cst.Dict) -> None:
        self._check_collection(node, "dict")

    def visit_DictComp(self, node: cst.DictComp) -> None:
        self._check_collection(node, "dict")

    def visit_Expr(self, node: cst.Expr) -> None:
        # `ptrs.append(t.data_ptr())` / `.extend(...)` / `.insert(i, ...)`
        call = node.value
        if isinstance(call, cst.Call) and _call_name(call) in ("append", "extend", "insert"):
            args = self._arg_values(call)
            if args and _identity_tuple(args[-1]):
                return  # `seen.append((x.shape[1], x.untyped_storage().data_ptr()))`: a tensor's identity
            if args and (self._holds_address(args[-1], 0) or self.is_address_collection(args[-1])):
                self._report(call, "PD002", f"data_ptr() address collected with .{_call_name(call)}()")
                self._cover_subtree(call)

    def visit_Assign(self, node: cst.Assign) -> None:
        # `args.x_ptr = x.data_ptr()`: a field of another object (a native argument struct)
        for t in node.targets:
            target = t.target
            if isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name) \
                    and target.value.value not in ("self", "cls") and id(node.value) not in self._covered \
                    and self.is_address(node.value):
                self._report(node, "PD008", f"a raw address is stored in {_code_of(target)}, a field of another "
                             "object: the receiver cannot tell its domain", self._domain_fix(node.value))
                self._cover_subtree(node.value)
                return
        # `table[k] = t.data_ptr()`
        if any(isinstance(t.target, cst.Subscript) for t in node.targets) and self._holds_address(node.value, 0) \
                and id(node.value) not in self._covered:
            self._report(node, "PD002", "data_ptr() address stored into a container by subscript")
            self._cover_subtree(node.value)

    # PD005 -----------------------------------------------------------------------------

    def _dsl_function(self, node: cst.FunctionDef) -> bool:
        """Decorated by the CuTe DSL (``@cute.kernel``, ``@cute.jit``), resolved through the file's
        imports: ``cutlass.cute.kernel``, never a ``cute`` of the file's own."""
        for d in node.decorators:
            target = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
            if any(q.startswith("cutlass.") and q.rsplit(".", 1)[-1] in _DSL_DECORATORS
                   for q in self._qualnames(target)):
                return True
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool | None:
        if self._dsl_function(node):
            return False  # CuTe DSL device code: data_ptr() there is a typed DSL pointer
        if node.name.value == "__c_pointers__":
            return False  # the CuTe DSL argument protocol: addresses of host ctypes descriptors
        self._function_names.append(node.name.value)
        for d in node.decorators:
            target = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
            if any(_is_triton_jit(q) for q in self._qualnames(target)):
                self._triton_depth += 1
                self._jit_nodes = getattr(self, "_jit_nodes", set()) | {id(node)}
                return None
        return None

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        if original_node.name.value != "__c_pointers__" and not self._dsl_function(original_node):
            self._function_names.pop()
        if id(original_node) in getattr(self, "_jit_nodes", set()):
            self._triton_depth -= 1

    def _is_pointer_type(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.Call) and _call_name(expr) == "pointer_type":
            return bool({q for q in self._qualnames(expr.func) if q.startswith("triton")}) or \
                isinstance(expr.func, cst.Attribute)
        if isinstance(expr, cst.Name):
            return any(self._is_pointer_type(v, depth + 1) for v in self._values_of(expr))
        return False

    def _is_loaded(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        if depth > _MAX_DEPTH:
            return False
        if isinstance(expr, cst.Call):
            name = _call_name(expr)
            if name == "load":
                return any(q.startswith("triton") for q in self._qualnames(expr.func)) or \
                    isinstance(expr.func, cst.Attribute)
            if name in ("to", "cast") and isinstance(expr.func, cst.Attribute):
                return self._is_loaded(expr.func.value, depth + 1)
            return False
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
            # `loaded + off`: the loaded value is the base; `ptr + loaded_idx * stride` is a real
            # pointer offset by a loaded index (vLLM indexer_k_store.py was a false positive)
            return self._is_loaded(expr.left, depth + 1)
        if isinstance(expr, cst.Name):
            return any(self._is_loaded(v, depth + 1) for v in self._values_of(expr))
        return False

    def _check_triton_cast(self, node: cst.Call, name: str) -> None:
        if name == "to" and isinstance(node.func, cst.Attribute):
            value: cst.BaseExpression | None = node.func.value
            dtype = _arg(node, 0, "dtype")
        else:
            if not any(q.startswith("triton") for q in self._qualnames(node.func)):
                return
            value, dtype = _arg(node, 0, "input"), _arg(node, 1, "dtype")
        if value is None or dtype is None or not self._is_pointer_type(dtype) or not self._is_loaded(value):
            return
        self._report(node, "PD005", "Triton kernel casts an integer loaded from a table to a pointer: the table "
                     "must hold device aliases, never host VAs")


def audit_python_source(path: str, source: str, rules: PythonRules) -> list[Finding]:
    """Run the enabled PD0xx rules on ``source`` (the text of ``path``). Suppressions are
    not applied here (see :mod:`pointerdomain.audit.suppressions`). A file that does not
    parse gives one PD901 finding."""
    triggers = rules.triggers
    lines = source_lines(source)
    if not _has_trigger(source, triggers):
        # no rule can match, but a file that does not parse is still not audited: Python's
        # own parser says so for a fraction of libcst's cost
        try:
            ast.parse(source)
        except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte (Python 3.11)
            line = getattr(exc, "lineno", None) or 1
            column = getattr(exc, "offset", None) or 1
            message = getattr(exc, "msg", None) or str(exc)
            return [Finding(path, line, column, "PD901", f"Python cannot parse this file: {message}",
                            RULES["PD901"].fix, lines[line - 1].strip() if 0 < line <= len(lines) else "")]
        return []
    sliced = slice_source(source, triggers)
    try:
        module = cst.parse_module(sliced)
    except cst.ParserSyntaxError as exc:
        if sliced is source:
            return [Finding(path, exc.raw_line, exc.raw_column + 1, "PD901", f"libcst cannot parse this file: "
                            f"{exc.message}", RULES["PD901"].fix,
                            lines[exc.raw_line - 1].strip() if 0 < exc.raw_line <= len(lines) else "")]
        try:
            module = cst.parse_module(source)  # the slicing broke an odd line: analyse it all
        except cst.ParserSyntaxError as whole:
            return [Finding(path, whole.raw_line, whole.raw_column + 1, "PD901", f"libcst cannot parse this file: "
                            f"{whole.message}", RULES["PD901"].fix,
                            lines[whole.raw_line - 1].strip() if 0 < whole.raw_line <= len(lines) else "")]
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    collector = _Collector()
    wrapper.module.visit(collector)
    auditor = _Auditor(path, lines, rules, collector)
    wrapper.visit(auditor)
    if not auditor.reported:
        return []
    # Positions cost a code-generation pass over the module: only for files with findings.
    positions = wrapper.resolve(PositionProvider)
    findings = []
    for node, code, message, fix in auditor.reported:
        pos: CodeRange = positions[node]
        line = pos.start.line
        snippet = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        findings.append(Finding(path, line, pos.start.column + 1, code, message, fix, snippet,
                                pos.end.line, pos.end.column + 1))
    return sorted(findings)
