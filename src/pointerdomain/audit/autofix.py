"""``pointerdomain audit --fix``: rewrite PD001 raw pointer tables to pointerdomain tables,
and only where the rewrite cannot break the code around it.

Rewritten forms (``torch`` resolved by qualified name, any import alias)::

    torch.tensor([t.data_ptr() for t in X], dtype=torch.uint64, device=D)
        -> make_kernel_ptr_table(X, D)          # D is a device (not "cpu")
    torch.tensor([t.data_ptr() for t in X], dtype=torch.uint64)          # or device="cpu"
        -> host_ptr_table(X)
    torch.tensor([a.data_ptr(), b.data_ptr()], ...)  ->  ...([a, b], ...)

``torch.as_tensor`` is treated the same; ``dtype`` may be any integer dtype or absent. A
device chosen at run time gives one builder per case under the same condition
(``device=device if device else "cpu"`` -> ``make_kernel_ptr_table(X, device) if device else
host_ptr_table(X)``; ``device or "cpu"`` the same when ``device`` is a name or attribute).
A device name is followed to its binding when it is a name assigned once or ``self.attr``
assigned once in ``__init__`` (``dev = "cpu"`` gives ``host_ptr_table``). A device table is
written only for a device known not to be the CPU: a CUDA/HIP device written out, a name
bound to one, a parameter (the caller's device); a parameter with a CPU default, a name
bound to the CPU and to something else, a loop variable, another object's attribute
(``args.device``) or a call refuses the site.
``X`` is passed as is only when it is known to be a list/tuple of tensors (a list display
or comprehension, ``list(...)``, or a name annotated ``list[...]``/``Sequence[...]``/
``tuple[...]``); otherwise it becomes ``[*X]``, parenthesized where ``*`` needs it (not
``list(X)``: a local ``list`` may shadow the builtin): the same items the comprehension
iterated, so a 2-D tensor gives its rows (``unbind(0)``) and a dict its keys.

A site is left alone (the finding stays, the reason is in :attr:`FixResult.refused`) when:

* the comprehension has a filter or arithmetic, or the call has other keyword arguments
  (``pin_memory=``) or a ``.to(device)`` / ``.cuda()`` chain;
* the rewritten call alone would not parse (the file's other sites are still fixed);
* the enclosing function or class mentions a device other than CUDA/HIP (``npu``, ``xpu``, ``musa``,
  ``mlu``, ``hpu``, ``mps``) or the module imports such a back-end (``torch_npu``, ...): the
  pointerdomain builders raise there;
* (``style="table"``) a consumer of the value would break with a ``PointerTable``:
  arithmetic, indexing, a method other than ``as_uint64_tensor()``, an element of a list or
  tuple (``torch.cat([t1, t2])``), a copy to another name or attribute (``t2 = tbl``: its
  reads are not followed), or an argument of any call other than pointerdomain's own
  API (and ``id``/``repr``/``print``; not ``isinstance``/``type``, which answer otherwise
  for a table): a native op such as
  ``sgl_kernel.transfer_kv_all_layer``, a Triton launch ``kern[grid](table)`` or an untyped
  helper may read it as a tensor;
* (``style="table"``) the value escapes to consumers the fix cannot see: returned by a
  function that declares no return type (or ``Any``), or whose calls in the module use it
  as a tensor; bound to a module or class name; stored on another object (``pool.ptrs =``)
  or in a container; a ``self.attr`` whose name the module also reads on another object
  (``pool.ptrs``) or by name (``getattr(obj, "ptrs")``, or ``getattr``/``setattr``/
  ``vars``/``__dict__`` with a computed name on ``self``, ``operator.attrgetter``); a local
  declared ``nonlocal``/``global``, or in a function calling ``locals()``/``vars()``/
  ``globals()``/``eval``/``exec``. A declared return type is the
  callers' contract, which the mypy check holds the rewrite to;
* (``style="tensor"``) always, for now: the builders refuse strided views, empty tensors,
  device memory in a host table and unregistered host memory in a device table, which
  ``torch.tensor`` of ``data_ptr()`` values took, and the fix cannot prove the tensors
  hold none of them. A dtype other than ``int64``/``uint64`` is named as the reason first.

The builders are imported by name (``from pointerdomain import ...``) unless a name of the
module already binds one of them to something else (sglang has its own
``make_kernel_ptr_table``): then ``import pointerdomain as pd`` (or ``import pointerdomain``
when ``pd`` is taken too) and qualified calls. A module with ``from m import *`` may bind
any name unseen (``pd`` too, as a re-exported pandas): there ``import pointerdomain`` and
``pointerdomain.make_kernel_ptr_table(...)``.

:func:`check_fix` re-parses the result and runs mypy (``--check-untyped-defs``) on the
file before and after; the CLI writes a file only when that check passes.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import re
import sys
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Literal

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import (ClassScope, GlobalScope, MetadataWrapper, ParentNodeProvider, PositionProvider,
                             QualifiedNameProvider, ScopeProvider)

from pointerdomain.audit.python_pass import device_targets

__all__ = ["FixCheck", "FixResult", "FixStyle", "check_fix", "fix_source", "warm_mypy"]

FixStyle = Literal["table", "tensor"]
_BUILDERS = frozenset({"torch.tensor", "torch.as_tensor"})
_ALLOWED_KWARGS = frozenset({"dtype", "device"})
_NAMES = ("make_kernel_ptr_table", "host_ptr_table")
_OTHER_DEVICE = re.compile(r"\b(?:npu|xpu|musa|mlu|hpu|mps)\b|is_npu|is_xpu|is_musa|torch_npu|torch_musa")
_OTHER_BACKEND_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:torch_npu|torch_musa|torch_mlu|habana_frameworks|"
                                   r"intel_extension_for_pytorch)\b", re.M)
_SEQUENCE_ANNOTATION = re.compile(r"^(?:typing\.)?(?:list|List|tuple|Tuple|Sequence|abc\.Sequence|"
                                  r"collections\.abc\.Sequence)\b")
# consumers of a table value that keep working with a PointerTable
_TABLE_METHODS = frozenset({"as_uint64_tensor"})
_TABLE_ATTRS = frozenset({"device", "domain", "layout"})
# calls that accept a PointerTable argument besides pointerdomain's own API
# a device that may be the CPU, decided outside what the fix sees
_UNKNOWN = "unknown"
# (not isinstance/type/issubclass: their answer changes with the value's type)
_ANY_OBJECT_BUILTINS = frozenset({"builtins.id", "builtins.repr", "builtins.print"})
# calls that read a function's local names by name
_NAMESPACE_READS = frozenset({"builtins.locals", "builtins.vars", "builtins.globals", "builtins.eval", "builtins.exec"})
# a tensor moved or copied after it is built: `torch.tensor(...).to(device)`, `.cuda()`
_DEVICE_CHAIN_METHODS = frozenset({"to", "cuda", "cpu", "pin_memory", "type", "contiguous", "clone", "share_memory_"})
# a CUDA/HIP device written out: "cuda", "cuda:0", f"cuda:{i}", torch.device("cuda", i)
_CUDA_STRING = re.compile(r"^[rRuU]?(['\"])(?:cuda|hip)(?::\d+)?\1$")
_CUDA_FSTRING = re.compile(r"^[fF](['\"])(?:cuda|hip):\{[^{}]*\}\1$")


# expressions that stand after `*` without parentheses
_ATOMS = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.List, cst.Tuple, cst.Set, cst.Dict, cst.ListComp,
          cst.SetComp, cst.DictComp, cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)


@dataclasses.dataclass(frozen=True)
class FixResult:
    """The rewritten source, how many call sites were rewritten, and the sites left alone
    as ``(line, reason)``."""

    code: str
    fixes: int
    refused: tuple[tuple[int, str], ...] = ()


def _data_ptr_receiver(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """``x`` for ``x.data_ptr()`` (no arguments), else None."""
    if (isinstance(expr, cst.Call) and not expr.args and isinstance(expr.func, cst.Attribute)
            and expr.func.attr.value == "data_ptr"):
        return expr.func.value
    return None


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node).strip()


class _Rewriter(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (ScopeProvider, ParentNodeProvider, QualifiedNameProvider)

    def __init__(self, context: CodemodContext, style: FixStyle, module_code: str, qualified: str | None,
                 sites: Collection[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.sites = sites
        self.context = context
        self.style = style
        self.fixes = 0
        self.refused: list[tuple[int, str]] = []
        self.qualified = qualified  # "pd" / "pointerdomain" when the plain names are taken
        self.other_backend = _OTHER_BACKEND_IMPORT.search(module_code) is not None
        self._functions: list[cst.FunctionDef] = []
        self._classes: list[cst.ClassDef] = []
        self._lines: dict[int, int] = {}
        self._starts: dict[int, tuple[int, int]] = {}
        self._attribute_nodes: dict[str, list[cst.CSTNode]] = {}
        self._other_attribute_nodes: dict[str, list[cst.Attribute]] = {}
        self._calls_by_name: dict[str, list[cst.Call]] = {}
        self._by_name_calls: list[cst.Call] = []
        self._dict_reads: list[cst.Attribute] = []

    # -- context ------------------------------------------------------------------------

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._functions.append(node)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.append(node)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._classes.pop()
        return updated_node

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        self._functions.pop()
        return updated_node

    def _qualnames(self, node: cst.CSTNode) -> set[str]:
        try:
            return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}
        except Exception:  # libcst raises on a few odd nodes; then the name is unknown
            return set()

    def _is_builder(self, node: cst.Call) -> bool:
        return bool(self._qualnames(node.func) & _BUILDERS)

    def _bound_values(self, name: cst.Name) -> tuple[list[cst.BaseExpression], list[cst.BaseExpression]]:
        """(values, annotations) bound to ``name`` where it is used."""
        scope = self.get_metadata(ScopeProvider, name, None)
        values: list[cst.BaseExpression] = []
        annotations: list[cst.BaseExpression] = []
        if scope is None:
            return values, annotations
        for a in scope[name.value]:
            node = getattr(a, "node", None)
            if isinstance(node, cst.Param) and node.annotation is not None:
                annotations.append(node.annotation.annotation)
            parent = self.get_metadata(ParentNodeProvider, node, None) if node is not None else None
            if isinstance(parent, cst.AnnAssign):
                annotations.append(parent.annotation.annotation)
                if parent.value is not None:
                    values.append(parent.value)
            elif isinstance(parent, cst.AssignTarget):
                assign = self.get_metadata(ParentNodeProvider, parent, None)
                if isinstance(assign, cst.Assign):
                    values.append(assign.value)
        return values, annotations

    def _known_sequence(self, it: cst.BaseExpression) -> bool:
        if isinstance(it, (cst.List, cst.ListComp, cst.Tuple)):
            return True
        if isinstance(it, cst.Call) and self._qualnames(it.func) & {"builtins.list", "builtins.tuple"}:
            return True
        if isinstance(it, cst.Name):
            values, annotations = self._bound_values(it)
            if any(_SEQUENCE_ANNOTATION.match(_code(a)) for a in annotations):
                return True
            return bool(values) and all(self._known_sequence(v) for v in values)
        return False

    def _tensors_expr(self, data: cst.BaseExpression) -> cst.BaseExpression | None:
        """The tensors ``X`` of a rewritable table argument, or None."""
        if isinstance(data, cst.ListComp):
            comp = data.for_in
            if comp.ifs or comp.inner_for_in is not None or comp.asynchronous is not None:
                return None
            recv = _data_ptr_receiver(data.elt)
            if not (isinstance(comp.target, cst.Name) and isinstance(recv, cst.Name)
                    and recv.value == comp.target.value):
                return None
            it = comp.iter
            if self._known_sequence(it):
                return it.with_changes(lpar=[], rpar=[]) if isinstance(it, (cst.Name, cst.Attribute)) else it
            # a dict view, a generator, an attribute of unknown type, a 2-D tensor: the items
            # the comprehension iterated (a tensor's rows), as a list
            # as `[*X]`, which no local name `list` can shadow; `*` binds tighter than
            # `if`/`or`/`not`/comparisons/lambda/`:=`, and a generator needs its own parentheses
            if isinstance(it, _ATOMS):
                return cst.List([cst.StarredElement(it.with_changes(lpar=[], rpar=[]))])
            return cst.List([cst.StarredElement(it.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()]))])
        if isinstance(data, cst.List) and data.elements:
            receivers = [_data_ptr_receiver(e.value) for e in data.elements]
            if any(r is None or isinstance(e, cst.StarredElement) for r, e in zip(receivers, data.elements)):
                return None
            return cst.List([cst.Element(r) for r in receivers if r is not None])
        return None

    # -- consumers ----------------------------------------------------------------------

    def _uses(self, call: cst.Call) -> list[cst.CSTNode] | str:
        """The expressions that read the value of ``call``: the call itself when used inline,
        the reads of the local name or ``self.attr`` it is bound to. A string: why its
        readers cannot all be seen (a module or class name, another object's attribute, an
        attribute read by name, a subscript or tuple target)."""
        parent = self.get_metadata(ParentNodeProvider, call, None)
        if isinstance(parent, (cst.Assign, cst.AnnAssign)):
            targets = [t.target for t in parent.targets] if isinstance(parent, cst.Assign) else [parent.target]
            uses: list[cst.CSTNode] = []
            for target in targets:
                if isinstance(target, cst.Name):
                    scope = self.get_metadata(ScopeProvider, target, None)
                    if scope is None:
                        return "its value is bound to a target the fix cannot follow"
                    assignments = list(scope.assignments[target.value])
                    if any(isinstance(a.scope, GlobalScope) for a in assignments):
                        return f"its value is bound to the module name {target.value}, which other modules may " \
                            "import and use as a tensor"
                    if any(isinstance(a.scope, ClassScope) for a in assignments):
                        return f"its value is the class attribute {target.value}, read through instances and " \
                            "subclasses the fix does not follow"
                    hidden = self._hidden_name_reads(target)
                    if hidden is not None:
                        return hidden
                    for a in assignments:
                        uses.extend(access.node for access in a.references)
                elif isinstance(target, cst.Attribute):
                    if not (isinstance(target.value, cst.Name) and target.value.value in ("self", "cls")):
                        return f"its value is stored on another object ({_code(target)}), whose reads the fix " \
                            "does not follow"
                    hidden = self._hidden_attribute_reads(target)
                    if hidden is not None:
                        return hidden
                    uses.extend(self._attribute_reads(_code(target)))
                else:
                    return "its value is bound to a target the fix cannot follow"
            return uses
        return [call]

    def _hidden_name_reads(self, target: cst.Name) -> str | None:
        """Why the local name ``target`` may be read where its scope's references do not
        show it: declared ``nonlocal``/``global`` (read by the enclosing function or the
        module), or read by name (``locals()``, ``vars()``, ``globals()``, ``eval``/``exec``
        in its function); else None."""
        function = self._enclosing(target, cst.FunctionDef)
        if not isinstance(function, cst.FunctionDef):
            return None
        declared = _declared_names(function)
        if target.value in declared:
            return f"{target.value} is declared {declared[target.value]}: its value is read in another scope, whose " \
                "uses the fix does not follow"
        for name in ("locals", "vars", "globals", "eval", "exec"):
            for call in self._calls_by_name.get(name, []):
                if not isinstance(call.func, cst.Name) or (name == "vars" and call.args):
                    continue
                if not self._qualnames(call.func) & _NAMESPACE_READS:
                    continue
                inner = self._enclosing(call, cst.FunctionDef)
                while inner is not None and inner is not function:
                    inner = self._enclosing(inner, cst.FunctionDef)
                if inner is function:
                    return f"{name}() in {function.name.value}() reads its names by name, and the fix does not " \
                        "follow them"
        return None

    def _hidden_attribute_reads(self, target: cst.Attribute) -> str | None:
        """Why ``self.<attr>`` may be read where the fix does not follow it in this module:
        on another object (``pool.ptrs``), by name (``getattr(obj, "ptrs")`` anywhere;
        ``getattr``/``setattr``/``delattr`` with a computed name, ``vars()`` or ``__dict__``
        on ``self`` in its class or a subclass in this module); else None."""
        attr = target.attr.value
        owner = self._enclosing(target, cst.ClassDef)
        other = self._other_attribute_nodes.get(attr)
        if other:
            return f"its attribute .{attr} is also read on another object ({_code(other[0])}), as a tensor for all " \
                "the fix knows"
        for call in self._by_name_calls:
            names = self._qualnames(call.func)
            if not names & {"builtins.getattr", "builtins.setattr", "builtins.delattr", "builtins.vars"} \
                    or not call.args:
                continue
            on_self = isinstance(call.args[0].value, cst.Name) and call.args[0].value.value in ("self", "cls") \
                and self._same_or_subclass(self._enclosing(call, cst.ClassDef), owner)
            which = _code(call.func)
            if len(call.args) < 2:  # vars(self)
                if on_self:
                    return f"{which}(self) reads the object's attributes by name, and the fix does not follow them"
                continue
            name = call.args[1].value
            if isinstance(name, cst.SimpleString):
                if name.evaluated_value == attr:
                    return f"its attribute .{attr} is used by name ({_code(call)}), as a tensor for all the fix knows"
            elif on_self:
                return f"{which}() on self with a computed name may reach .{attr}, whose reads the fix does not " \
                    "follow"
        for call in self._calls_by_name.get("attrgetter", []):
            for arg in call.args:
                name = arg.value
                if not isinstance(name, cst.SimpleString) or not isinstance(name.evaluated_value, str):
                    return f"{_code(call)} reads attributes by a computed name, which may be .{attr}"
                if attr in name.evaluated_value.split("."):
                    return f"its attribute .{attr} is used by name ({_code(call)}), as a tensor for all the fix knows"
        if any(self._same_or_subclass(self._enclosing(n, cst.ClassDef), owner) for n in self._dict_reads):
            return "self.__dict__ reads the object's attributes by name, and the fix does not follow them"
        return None

    @staticmethod
    def _same_or_subclass(cls: cst.CSTNode | None, owner: cst.CSTNode | None) -> bool:
        """Whether ``self`` in ``cls`` may be an instance of ``owner``: the same class, or one
        naming it among its bases (by name: one level, as written in this module)."""
        if cls is None or owner is None or cls is owner:
            return cls is owner
        assert isinstance(cls, cst.ClassDef) and isinstance(owner, cst.ClassDef)
        return any(_code(b.value).split(".")[-1] == owner.name.value for b in cls.bases)

    def _attribute_reads(self, dotted: str) -> list[cst.CSTNode]:
        return [n for n in self._attribute_nodes.get(dotted, []) if not self._is_store(n)]

    def _is_store(self, node: cst.CSTNode) -> bool:
        parent = self.get_metadata(ParentNodeProvider, node, None)
        return isinstance(parent, (cst.AssignTarget, cst.AnnAssign)) and getattr(parent, "target", None) is node

    def _breaking_use(self, use: cst.CSTNode, depth: int = 0) -> str | None:
        """Why this read of the table value would break once it is a PointerTable, or None."""
        parent = self.get_metadata(ParentNodeProvider, use, None)
        if isinstance(parent, cst.Expr) or parent is None:
            return None
        if isinstance(parent, cst.Return):
            return self._breaking_return(parent, depth)
        if isinstance(parent, cst.Attribute) and parent.value is use:
            attr = parent.attr.value
            if attr in _TABLE_METHODS or attr in _TABLE_ATTRS:
                return None
            return f"its value is used as a tensor (.{attr})"
        if isinstance(parent, (cst.BinaryOperation, cst.AugAssign, cst.UnaryOperation)):
            return "arithmetic on its value"
        if isinstance(parent, cst.Subscript):
            return "its value is indexed"
        if isinstance(parent, cst.Element):
            return "its value is put in a list or tuple (torch.cat of tables)"
        if isinstance(parent, cst.Arg):
            call = self.get_metadata(ParentNodeProvider, parent, None)
            if isinstance(call, cst.Call) and self._takes_a_table(call):
                return None
            callee = _code(call.func) if isinstance(call, cst.Call) else "a call"
            # a native op (sgl_kernel, torch.ops), a Triton launch, an untyped helper: each may
            # read it as a tensor, and mypy sees none of them
            return f"its value is passed to {callee}(), which may need a tensor"
        if isinstance(parent, cst.Comparison):
            return None
        if isinstance(parent, (cst.Assign, cst.AnnAssign)):
            # a copy (`t2 = tbl`, `self.other = self.tbl`): its reads are not followed, and
            # mypy sees no error where an untyped native op receives it
            return "its value is copied to another name, whose uses the fix does not follow"
        return f"its value is used in a {type(parent).__name__}"

    def _breaking_return(self, ret: cst.Return, depth: int) -> str | None:
        """A returned table reaches the function's callers: allowed when the function declares
        its return type (mypy then checks the rewrite against it; ``Any`` declares nothing)
        and the calls of it in this module work with a table too."""
        function = self._enclosing(ret, cst.FunctionDef)
        if not isinstance(function, cst.FunctionDef):
            return "its value is returned where the fix cannot see the callers"
        name = function.name.value
        if function.returns is None:
            return f"its value is returned by {name}(), whose callers the fix does not see (the function declares " \
                "no return type)"
        annotation = function.returns.annotation
        if self._qualnames(annotation) & {"typing.Any", "typing_extensions.Any"} or _code(annotation) == "Any":
            return f"its value is returned by {name}(), declared Any: its callers the fix does not see may use it " \
                "as a tensor"
        if depth >= 4:
            return f"its value is returned through more than {depth} calls, which the fix does not follow"
        for call in self._calls_by_name.get(name, []):
            why = self._breaking_use(call, depth + 1)
            if why is not None:
                return f"its value is returned by {name}(), and at {_code(call)}: {why}"
        return None

    def _takes_a_table(self, call: cst.Call) -> bool:
        """Whether ``call`` is known to accept a PointerTable argument: pointerdomain's own API
        and a few builtins that take any object."""
        names = self._qualnames(call.func)
        return bool(names) and all(n.split(".", 1)[0] == "pointerdomain" or n in _ANY_OBJECT_BUILTINS
                                   for n in names)

    # -- the rewrite --------------------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> None:
        index: dict[str, list[cst.CSTNode]] = collections.defaultdict(list)

        class _Attrs(cst.CSTVisitor):
            def visit_Attribute(self, n: cst.Attribute) -> None:
                if isinstance(n.value, cst.Name) and n.value.value in ("self", "cls"):
                    index[_code(n)].append(n)

        node.visit(_Attrs())
        self._attribute_nodes = dict(index)
        others: dict[str, list[cst.Attribute]] = collections.defaultdict(list)
        calls: dict[str, list[cst.Call]] = collections.defaultdict(list)
        by_name: list[cst.Call] = []
        dict_reads: list[cst.Attribute] = []

        class _Reads(cst.CSTVisitor):
            def visit_Attribute(self, n: cst.Attribute) -> None:
                if n.attr.value == "__dict__":
                    if isinstance(n.value, cst.Name) and n.value.value in ("self", "cls"):
                        dict_reads.append(n)
                elif not (isinstance(n.value, cst.Name) and n.value.value in ("self", "cls")):
                    others[n.attr.value].append(n)

            def visit_Call(self, n: cst.Call) -> None:
                if isinstance(n.func, cst.Name):
                    calls[n.func.value].append(n)
                    if n.func.value in ("getattr", "setattr", "delattr", "vars"):
                        by_name.append(n)
                elif isinstance(n.func, cst.Attribute):
                    calls[n.func.attr.value].append(n)

        node.visit(_Reads())
        self._other_attribute_nodes = dict(others)
        self._calls_by_name = dict(calls)
        self._by_name_calls = by_name
        self._dict_reads = dict_reads

    def _refuse(self, node: cst.CSTNode, reason: str) -> None:
        self.refused.append((self._line(node), reason))

    def _line(self, node: cst.CSTNode) -> int:
        return self._lines.get(id(node), 0)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not isinstance(original_node.func, (cst.Attribute, cst.Name)) or not original_node.args:
            return updated_node
        first = original_node.args[0]
        if first.keyword is not None or first.star:
            return updated_node
        kwargs = {a.keyword.value: a.value for a in original_node.args[1:] if a.keyword is not None}
        if len(kwargs) != len(original_node.args) - 1 or not set(kwargs) <= _ALLOWED_KWARGS:
            return updated_node
        tensors = self._tensors_expr(first.value)
        if tensors is None or not self._is_builder(original_node):
            return updated_node
        if self.sites is not None and self._starts.get(id(original_node)) not in self.sites:
            return updated_node  # not a reported finding: suppressed, ignored or baselined
        # comments do not run: "keyed by device type ("npu"/"musa")" in a comment is no npu path
        function_text = re.sub(r"#[^\n]*", "", _code(self._functions[-1])) if self._functions else ""
        # the class too: `self.device = "xpu"` in __init__ reaches a table built in another method
        class_text = re.sub(r"#[^\n]*", "", _code(self._classes[-1])) if self._classes else ""
        if self.other_backend or _OTHER_DEVICE.search(function_text) or _OTHER_DEVICE.search(class_text):
            self._refuse(original_node, "the code runs on a non-CUDA/HIP device (npu/xpu/musa/...) here, where the "
                         "pointerdomain builders raise")
            return updated_node
        chain = self.get_metadata(ParentNodeProvider, original_node, None)
        if isinstance(chain, cst.Attribute) and chain.value is original_node \
                and chain.attr.value in _DEVICE_CHAIN_METHODS \
                and isinstance(self.get_metadata(ParentNodeProvider, chain, None), cst.Call):
            self._refuse(original_node, f"the table is moved or copied after it is built (.{chain.attr.value}()): a "
                         "chain the fix leaves as it is")
            return updated_node
        view: cst.BaseExpression | None = None
        if self.style == "tensor":
            # the value stays a tensor of the same dtype, device and values (a copy): every
            # consumer keeps working, wherever it is
            dtype = self._tensor_dtype(original_node, kwargs.get("dtype"))
            if isinstance(dtype, str):
                self._refuse(original_node, dtype)
                return updated_node
            view = dtype
            self._refuse(original_node, "the tensor form is not a drop-in here: the pointerdomain builders refuse "
                         "strided views, empty tensors, device memory in a host table and unregistered host memory in "
                         "a device table (whose entries become device aliases), where the original built a tensor of "
                         f"whatever data_ptr() gave; the fix cannot prove that {_code(tensors)} holds none of them")
            return updated_node
        else:
            uses = self._uses(original_node)
            if isinstance(uses, str):
                self._refuse(original_node, uses)
                return updated_node
            for use in uses:
                why = self._breaking_use(use)
                if why is not None:
                    self._refuse(original_node, why)
                    return updated_node
        device = kwargs.get("device")
        if device is not None and len(self._targets(device)) > 1 and not self._splittable(device):
            self._refuse(original_node, f"the device ({_code(device)}) is chosen at run time in a form the fix "
                         "cannot split into a device and a host table")
            return updated_node
        if device is not None and _UNKNOWN in self._targets(device):
            self._refuse(original_node, f"the device ({_code(device)}) is not known to be a CUDA/HIP device: it may "
                         "be the CPU (a loop variable, another object's attribute, a call, a parameter with a CPU "
                         "default, or a name or attribute bound to the CPU and to something else), where a device "
                         "table raises")
            return updated_node
        fixed = self._table_call(tensors, device)
        if view is not None:
            fixed = _with_view(fixed, view)
        try:  # each rewrite alone, so one that does not parse leaves the file's other fixes
            ast.parse(f"(\n{_code(fixed)}\n)", mode="eval")
        except (SyntaxError, ValueError) as exc:
            why = exc.msg if isinstance(exc, SyntaxError) else str(exc)
            self._refuse(original_node, f"the rewrite would not parse ({_code(fixed)}: {why})")
            return updated_node
        self.fixes += 1
        return fixed

    def _tensor_dtype(self, call: cst.Call, dtype: cst.BaseExpression | None) -> cst.BaseExpression | None | str:
        """For ``style="tensor"``: the dtype to view the ``uint64`` copy as (None: it is
        ``uint64`` already), or why the original dtype cannot be kept. Without a dtype
        ``torch.tensor`` of Python ints is ``int64``."""
        if dtype is None:
            if isinstance(call.func, cst.Attribute):
                return cst.Attribute(call.func.value, cst.Name("int64"))
            return f"the original dtype is int64 (none given), and {_code(call.func)}() names no torch module to " \
                "write it with"
        names = self._qualnames(dtype)
        if "torch.uint64" in names:
            return None
        if names & {"torch.int64", "torch.long"}:
            return dtype
        return f"the original dtype ({_code(dtype)}) is not known to be int64 or uint64, and the tensor form " \
            "must keep it"

    def _targets(self, device: cst.BaseExpression, truthy: bool = False, depth: int = 0) -> frozenset[str]:
        """Where ``device`` places the table, with simple bindings followed: a name assigned
        in its scope, ``self.attr`` assigned in its class, a parameter's default.
        ``{"host"}``: the CPU; ``{"device"}``: a CUDA/HIP device written out (``"cuda"``,
        ``"cuda:0"``, ``f"cuda:{i}"``, ``torch.device("cuda", i)``, an index), or a parameter
        the caller fills in; ``_UNKNOWN`` among them: nothing proves it is not the CPU (a
        parameter with a CPU default, a name bound to the CPU and to something else, a loop
        variable, an attribute of another object such as ``args.device``, a call).
        ``truthy``: the value is read only where it tested true (``D if D else ...``,
        ``D or ...``), so a ``None`` binding does not reach it."""
        if depth > 8:
            return frozenset({_UNKNOWN})
        if isinstance(device, cst.IfExp):
            body_truthy = _code(device.test) == _code(device.body)
            return self._targets(device.body, body_truthy, depth + 1) | self._targets(device.orelse, False, depth + 1)
        if isinstance(device, cst.BooleanOperation):
            left_truthy = isinstance(device.operator, cst.Or)
            return self._targets(device.left, left_truthy, depth + 1) | self._targets(device.right, False, depth + 1)
        if isinstance(device, cst.Name) and device.value not in ("None", "True", "False"):
            bound = self._name_bindings(device)
        elif isinstance(device, cst.Attribute) and isinstance(device.value, cst.Name) \
                and device.value.value in ("self", "cls"):
            bound = self._attribute_bindings(device)
        else:
            return self._written_targets(device)
        values, single, caller, unfollowed = bound
        if unfollowed or (not values and not caller):
            return frozenset({_UNKNOWN})  # bound where this pass does not look (a loop, an import, elsewhere)
        found: set[str] = set()
        for value, from_default in values:
            if truthy and _code(value) == "None":
                continue  # read only when true
            targets = self._targets(value, False, depth + 1)
            if from_default and "host" in targets:
                return frozenset({_UNKNOWN})  # the CPU unless the caller says otherwise
            if from_default and _UNKNOWN in targets:
                targets = frozenset({"device"})  # a default the caller overrides: the caller's device
            found |= targets
        if caller or not found:
            found.add("device")  # a parameter: the caller's device, as before
        if "host" in found and (not single or len(found) > 1):
            return frozenset({_UNKNOWN})
        return frozenset(found)

    def _written_targets(self, device: cst.BaseExpression) -> frozenset[str]:
        """``{"host"}`` for the CPU written out, ``{"device"}`` for a CUDA/HIP device written
        out, else ``_UNKNOWN``."""
        if device_targets(device) == {"host"}:
            return frozenset({"host"})
        if isinstance(device, cst.Integer):
            return frozenset({"device"})  # an index: torch's CUDA device of that index
        if isinstance(device, cst.SimpleString) and _CUDA_STRING.match(_code(device)):
            return frozenset({"device"})
        if isinstance(device, cst.FormattedString) and _CUDA_FSTRING.match(_code(device)):
            return frozenset({"device"})
        if isinstance(device, cst.Call) and device.args and not device.args[0].keyword \
                and self._qualnames(device.func) & {"torch.device"} \
                and isinstance(device.args[0].value, (cst.SimpleString, cst.FormattedString)) \
                and self._written_targets(device.args[0].value) == {"device"}:
            return frozenset({"device"})
        if isinstance(device, cst.Call) and not device.args \
                and self._qualnames(device.func) & {"torch.cuda.current_device"}:
            return frozenset({"device"})
        return frozenset({_UNKNOWN})

    def _name_bindings(self, name: cst.Name) -> tuple[list[tuple[cst.BaseExpression, bool]], bool, bool, bool]:
        """The values bound to ``name`` where it is read, each with whether it is a
        parameter's default; whether it is bound once by a plain assignment; whether it is a
        parameter (the caller may pass any device); whether something binds it that this
        pass does not follow (a loop variable, an import, a ``with`` target, an unpacking)."""
        scope = self.get_metadata(ScopeProvider, name, None)
        if scope is None:
            return [], False, False, True
        values: list[tuple[cst.BaseExpression, bool]] = []
        plain = 0
        others = 0
        caller = False
        for a in scope[name.value]:
            node = getattr(a, "node", None)
            if isinstance(node, cst.Param):
                caller = True
                if node.default is not None:
                    values.append((node.default, True))
                continue
            parent = self.get_metadata(ParentNodeProvider, node, None) if node is not None else None
            if isinstance(parent, cst.AnnAssign) and parent.value is not None:
                values.append((parent.value, False))
                plain += 1
            elif isinstance(parent, cst.AssignTarget):
                assign = self.get_metadata(ParentNodeProvider, parent, None)
                if isinstance(assign, cst.Assign):
                    values.append((assign.value, False))
                    plain += 1
                else:
                    others += 1
            elif isinstance(parent, cst.AnnAssign):
                continue  # `dev: str` declares, binds nothing
            else:
                others += 1
        return values, plain == 1 and others == 0 and len(values) == 1 and not caller, caller, others > 0

    def _attribute_bindings(
            self, attr: cst.Attribute) -> tuple[list[tuple[cst.BaseExpression, bool]], bool, bool, bool]:
        """As :meth:`_name_bindings` for ``self.attr`` in the enclosing class: the values it
        is assigned, whether that is one plain assignment in ``__init__``, never a caller's,
        and whether a store is one this pass does not follow (``+=``, an unpacking). No
        store in the class: set elsewhere, which this pass does not follow."""
        owner = self._classes[-1] if self._classes else None
        values: list[tuple[cst.BaseExpression, bool]] = []
        in_init = 0
        stores = 0
        unfollowed = False
        for node in self._attribute_nodes.get(_code(attr), []):
            if owner is None or self._enclosing(node, cst.ClassDef) is not owner:
                continue
            parent = self.get_metadata(ParentNodeProvider, node, None)
            if isinstance(parent, cst.AssignTarget) and parent.target is node:
                assign = self.get_metadata(ParentNodeProvider, parent, None)
                value = assign.value if isinstance(assign, cst.Assign) else None
            elif isinstance(parent, cst.AnnAssign) and parent.target is node:
                value = parent.value
            elif isinstance(parent, (cst.AugAssign, cst.Element, cst.StarredElement)):
                unfollowed = True  # `self.d += ...`, `self.a, self.d = ...`: a value this pass does not follow
                continue
            else:
                continue  # a read
            if value is None:
                continue
            stores += 1
            values.append((value, False))
            function = self._enclosing(node, cst.FunctionDef)
            if isinstance(function, cst.FunctionDef) and function.name.value == "__init__":
                in_init += 1
        return values, stores == 1 and in_init == 1 and not unfollowed, False, unfollowed or not values

    def _enclosing(self, node: cst.CSTNode, kind: type[cst.CSTNode]) -> cst.CSTNode | None:
        current = self.get_metadata(ParentNodeProvider, node, None)
        while current is not None and not isinstance(current, kind):
            current = self.get_metadata(ParentNodeProvider, current, None)
        return current

    def _splittable(self, device: cst.BaseExpression) -> bool:
        """A device expression whose host and device cases can become two builder calls:
        ``A if C else B`` (each branch once, as before), ``D or B`` with ``D`` a name or
        attribute (``D`` read twice: as the test and as the device)."""
        if isinstance(device, cst.IfExp):
            return all(len(self._targets(b, b is device.body and _code(device.test) == _code(b))) == 1
                       or self._splittable(b) for b in (device.body, device.orelse))
        if isinstance(device, cst.BooleanOperation) and isinstance(device.operator, cst.Or):
            return isinstance(device.left, (cst.Name, cst.Attribute)) and (
                len(self._targets(device.right)) == 1 or self._splittable(device.right))
        return False

    def _table_call(self, tensors: cst.BaseExpression, device: cst.BaseExpression | None,
                    truthy: bool = False) -> cst.BaseExpression:
        """The builder call for ``device`` (None: torch's default, the CPU): ``host_ptr_table``
        for the CPU, ``make_kernel_ptr_table`` otherwise, and for a device chosen at run time
        one of each under the same condition (``device if device else "cpu"`` becomes
        ``make_kernel_ptr_table(X, device) if device else host_ptr_table(X)``)."""
        if device is not None and len(self._targets(device, truthy)) > 1:
            if isinstance(device, cst.IfExp):
                body_truthy = _code(device.test) == _code(device.body)
                return cst.IfExp(test=device.test, body=self._table_call(tensors, device.body, body_truthy),
                                 orelse=self._table_call(tensors, device.orelse),
                                 whitespace_before_if=device.whitespace_before_if,
                                 whitespace_after_if=device.whitespace_after_if,
                                 whitespace_before_else=device.whitespace_before_else,
                                 whitespace_after_else=device.whitespace_after_else)
            if isinstance(device, cst.BooleanOperation):
                left = device.left.with_changes(lpar=[], rpar=[])
                return cst.IfExp(test=left, body=self._table_call(tensors, device.left, True),
                                 orelse=self._table_call(tensors, device.right))
        if device is None or self._targets(device, truthy) == {"host"}:
            name, args = "host_ptr_table", [cst.Arg(tensors)]
        else:
            name = "make_kernel_ptr_table"
            args = [cst.Arg(tensors, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                    cst.Arg(device.with_changes(lpar=[], rpar=[])
                            if isinstance(device, (cst.IfExp, cst.Name, cst.Attribute)) else device)]
        func: cst.BaseExpression
        if self.qualified is None:
            AddImportsVisitor.add_needed_import(self.context, "pointerdomain", name)
            func = cst.Name(name)
        else:
            if self.qualified == "pd":
                AddImportsVisitor.add_needed_import(self.context, "pointerdomain", asname="pd")
            else:
                AddImportsVisitor.add_needed_import(self.context, "pointerdomain")
            func = cst.Attribute(cst.Name(self.qualified), cst.Name(name))
        call: cst.BaseExpression = cst.Call(func, args)
        if self.style == "tensor":
            call = cst.Call(cst.Attribute(call, cst.Name("as_uint64_tensor")), [])
        return call


def _declared_names(function: cst.FunctionDef) -> dict[str, str]:
    """The names ``function`` itself declares ``nonlocal`` or ``global`` (not its nested
    functions and classes), each with the keyword."""
    found: dict[str, str] = {}

    class _Declared(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is function

        def visit_ClassDef(self, node: cst.ClassDef) -> bool:
            return False

        def visit_Lambda(self, node: cst.Lambda) -> bool:
            return False

        def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
            found.update((n.name.value, "nonlocal") for n in node.names)

        def visit_Global(self, node: cst.Global) -> None:
            found.update((n.name.value, "global") for n in node.names)

    function.visit(_Declared())
    return found


def _with_view(call: cst.BaseExpression, dtype: cst.BaseExpression) -> cst.BaseExpression:
    """``call.view(dtype)``, and each branch of a run-time choice of builder alike."""
    if isinstance(call, cst.IfExp):
        return call.with_changes(body=_with_view(call.body, dtype), orelse=_with_view(call.orelse, dtype))
    return cst.Call(cst.Attribute(call, cst.Name("view")), [cst.Arg(dtype.with_changes(lpar=[], rpar=[]))])


def _taken_names(module: cst.Module) -> set[str]:
    """Names of the module scope (and any function scope) bound to something other than
    pointerdomain's own export."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    scopes = set(wrapper.resolve(ScopeProvider).values())
    taken: set[str] = set()
    for scope in scopes:
        if scope is None:
            continue
        for name in (*_NAMES, "pd", "pointerdomain"):
            for a in scope.assignments[name] if name in scope.assignments else ():
                node = getattr(a, "node", None)
                if isinstance(node, cst.ImportFrom) and _code(node.module or cst.Name("")) == "pointerdomain" \
                        and name in _NAMES:
                    continue  # already pointerdomain's
                if isinstance(node, cst.Import) and name == "pointerdomain":
                    continue
                if isinstance(node, cst.Import) and name == "pd" and "pointerdomain as pd" in _code(node):
                    continue
                taken.add(name)
    return taken


def _has_star_import(module: cst.Module) -> bool:
    found = False

    class _Star(cst.CSTVisitor):
        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            nonlocal found
            found = found or isinstance(node.names, cst.ImportStar)

    module.visit(_Star())
    return found


def fix_source(source: str, style: FixStyle = "table", sites: Collection[tuple[int, int]] | None = None) -> FixResult:
    """Rewrite every fixable PD001 site in ``source``; see the module docstring for what is
    left alone. ``sites``: the (line, column) starts, both 1-based, of the calls that may be
    rewritten (the PD001 findings the audit reports); None: every site. Raises
    libcst.ParserSyntaxError when ``source`` does not parse, RecursionError when an
    expression is nested too deeply for libcst's recursive tree walk."""
    module = cst.parse_module(source)
    taken = _taken_names(module)
    qualified: str | None = None
    if _has_star_import(module):
        qualified = "pointerdomain"
    elif taken & set(_NAMES):
        qualified = "pd" if "pd" not in taken else "pointerdomain"
    context = CodemodContext()
    wrapper = MetadataWrapper(module)
    rewriter = _Rewriter(context, style, source, qualified, sites)
    positions = wrapper.resolve(PositionProvider)
    rewriter._lines = {id(n): p.start.line for n, p in positions.items() if isinstance(n, cst.Call)}
    rewriter._starts = {id(n): (p.start.line, p.start.column + 1) for n, p in positions.items()
                        if isinstance(n, cst.Call)}
    fixed = wrapper.visit(rewriter)
    if rewriter.fixes:
        fixed = AddImportsVisitor(context).transform_module(fixed)
    return FixResult(fixed.code, rewriter.fixes, tuple(rewriter.refused))


@dataclasses.dataclass(frozen=True)
class FixCheck:
    """The verdict of :func:`check_fix`: ``ok`` when the fixed file parses and mypy reports
    no error that the original did not have; ``new_errors`` lists those it did."""

    ok: bool
    new_errors: tuple[str, ...] = ()
    reason: str = ""


_MYPY_LINE = re.compile(r"^[^:]+:\d+(?::\d+)?: (?P<rest>(?:error|note): .*)$")


def _mypy_messages(code: str, name: str, cache: Path | None) -> list[str] | None:
    try:
        from mypy import api
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_text(code, encoding="utf-8")
        args = ["--check-untyped-defs", "--ignore-missing-imports", "--follow-imports=silent", "--no-error-summary",
                "--show-error-codes", "--no-pretty", "--python-executable", sys.executable, str(path)]
        if cache is not None:
            args[:0] = ["--cache-dir", str(cache)]
        limit = sys.getrecursionlimit()
        try:
            out, err, _ = api.run(args)
        finally:
            sys.setrecursionlimit(limit)  # mypy raises it for the whole process
    msgs = []
    for line in out.splitlines():
        m = _MYPY_LINE.match(line)
        if m and m.group("rest").startswith("error"):
            msgs.append(m.group("rest"))
    return msgs


def warm_mypy(cache: Path | None = None) -> None:
    """Run mypy once on ``import torch`` with :func:`check_fix`'s options, so its cache holds
    torch's stubs before the first file is checked (nothing when mypy is not installed)."""
    _mypy_messages("import torch\n", "pointerdomain_warm_up.py", cache)


def check_fix(before: str, after: str, name: str = "module.py", cache: Path | None = None) -> FixCheck:
    """Check a rewrite: ``after`` must parse (libcst and :func:`compile`) and mypy
    (``--check-untyped-defs``, imports it cannot find treated as Any) must report no error
    on it that it did not report on ``before`` (compared without line numbers, since the
    fix adds an import). Refused when mypy is not installed."""
    try:
        cst.parse_module(after)
        compile(after, name, "exec")
    except (cst.ParserSyntaxError, SyntaxError) as exc:
        return FixCheck(False, (), f"the fixed code does not parse: {exc}")
    old = _mypy_messages(before, name, cache)
    new = _mypy_messages(after, name, cache)
    if old is None or new is None:
        return FixCheck(False, (), "mypy is not installed (pip install mypy): the fix is checked with it")
    remaining = collections.Counter(old)
    added = []
    for m in new:
        if remaining[m]:
            remaining[m] -= 1
        else:
            added.append(m)
    return FixCheck(not added, tuple(added), "mypy reports new errors" if added else "")
