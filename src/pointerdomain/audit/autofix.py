"""``pointerdomain audit --fix``: rewrite PD001 raw pointer tables to pointerdomain tables.

Rewritten forms (``torch`` resolved by qualified name, any import alias)::

    torch.tensor([t.data_ptr() for t in X], dtype=torch.uint64, device=D)
        -> make_kernel_ptr_table(X, D)          # D is a device (not "cpu")
    torch.tensor([t.data_ptr() for t in X], dtype=torch.uint64)          # or device="cpu"
        -> host_ptr_table(X)
    torch.tensor([a.data_ptr(), b.data_ptr()], ...)  ->  ...([a, b], ...)

``torch.as_tensor`` is treated the same; ``dtype`` may be any integer dtype or absent.
``X`` is wrapped in ``list(...)`` when it is a call (``d.values()``, ``zip(...)``), since the
builders take a ``Sequence``. The import (``from pointerdomain import ...``) is added.

With ``style="tensor"`` the rewrite ends in ``.as_uint64_tensor()``, so the value keeps its
type (a ``uint64`` tensor on D) and code that consumes it needs no change: a drop-in fix
that still resolves aliases and checks registrations. With ``style="table"`` (default) the
value becomes a typed ``PointerTable``; mypy then points at every consumer to update.

Anything else (a filter in the comprehension, ``.to(device)`` after the call, extra
keyword arguments) is left for a person: the finding stays.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import MetadataWrapper, ScopeProvider

__all__ = ["FixResult", "FixStyle", "fix_source"]

FixStyle = Literal["table", "tensor"]
_BUILDERS = frozenset({"torch.tensor", "torch.as_tensor"})
_ALLOWED_KWARGS = frozenset({"dtype", "device"})
_CPU = frozenset({"'cpu'", '"cpu"', "torch.device('cpu')", 'torch.device("cpu")'})


@dataclasses.dataclass(frozen=True)
class FixResult:
    """The rewritten source and how many call sites were rewritten."""

    code: str
    fixes: int


def _data_ptr_receiver(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """``x`` for ``x.data_ptr()`` (no arguments), else None."""
    if (isinstance(expr, cst.Call) and not expr.args and isinstance(expr.func, cst.Attribute)
            and expr.func.attr.value == "data_ptr"):
        return expr.func.value
    return None


def _tensors_expr(data: cst.BaseExpression) -> cst.BaseExpression | None:
    """The tensors ``X`` of a rewritable table argument, or None."""
    if isinstance(data, cst.ListComp):
        comp = data.for_in
        if comp.ifs or comp.inner_for_in is not None or comp.asynchronous is not None:
            return None
        recv = _data_ptr_receiver(data.elt)
        if not (isinstance(comp.target, cst.Name) and isinstance(recv, cst.Name) and recv.value == comp.target.value):
            return None
        it = comp.iter
        if isinstance(it, cst.Call) and not (isinstance(it.func, cst.Name) and it.func.value in ("list", "tuple")):
            return cst.Call(cst.Name("list"), [cst.Arg(it)])
        return it.with_changes(lpar=[], rpar=[]) if isinstance(it, (cst.Name, cst.Attribute)) else it
    if isinstance(data, cst.List) and data.elements:
        receivers = [_data_ptr_receiver(e.value) for e in data.elements]
        if any(r is None or isinstance(e, cst.StarredElement) for r, e in zip(receivers, data.elements)):
            return None
        return cst.List([cst.Element(r) for r in receivers if r is not None])
    return None


class _Rewriter(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (ScopeProvider,)

    def __init__(self, context: CodemodContext, style: FixStyle) -> None:
        super().__init__()
        self.context = context
        self.style = style
        self.fixes = 0

    def _is_builder(self, node: cst.Call) -> bool:
        scope = self.get_metadata(ScopeProvider, node.func, None)
        if scope is None:
            return False
        return any(q.name in _BUILDERS for q in scope.get_qualified_names_for(node.func))

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not isinstance(original_node.func, (cst.Attribute, cst.Name)) or not original_node.args:
            return updated_node
        first = original_node.args[0]
        if first.keyword is not None or first.star:
            return updated_node
        kwargs = {a.keyword.value: a.value for a in original_node.args[1:] if a.keyword is not None}
        if len(kwargs) != len(original_node.args) - 1 or not set(kwargs) <= _ALLOWED_KWARGS:
            return updated_node
        tensors = _tensors_expr(first.value)
        if tensors is None or not self._is_builder(original_node):
            return updated_node
        device = kwargs.get("device")
        device_code = cst.Module([]).code_for_node(device).strip() if device is not None else ""
        if device is None or device_code in _CPU:
            name, args = "host_ptr_table", [cst.Arg(tensors)]
        else:
            name = "make_kernel_ptr_table"
            args = [cst.Arg(tensors, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), cst.Arg(device)]
        AddImportsVisitor.add_needed_import(self.context, "pointerdomain", name)
        self.fixes += 1
        call: cst.BaseExpression = cst.Call(cst.Name(name), args)
        if self.style == "tensor":
            call = cst.Call(cst.Attribute(call, cst.Name("as_uint64_tensor")), [])
        return call


def fix_source(source: str, style: FixStyle = "table") -> FixResult:
    """Rewrite every fixable PD001 site in ``source``. Raises libcst.ParserSyntaxError
    when ``source`` does not parse."""
    module = cst.parse_module(source)
    context = CodemodContext()
    wrapper = MetadataWrapper(module)
    rewriter = _Rewriter(context, style)
    fixed = wrapper.visit(rewriter)
    if rewriter.fixes:
        fixed = AddImportsVisitor(context).transform_module(fixed)
    return FixResult(fixed.code, rewriter.fixes)
