"""A third-party op that takes raw ``uint64`` pointer tables, behind a typed signature.

An engine's transfer ops (sglang's ``torch.ops.sgl_kernel.transfer_kv_all_layer``, a
cache's own CUDA op) take their per-layer buffer addresses as bare ``uint64`` tensors:
nothing says whether an entry is a host VA or a device alias, so a host VA reaches the
kernel and faults (error 700) where the two differ. :func:`kernel_op` puts a stub in
front of such an op; the stub's signature is the one callers and type checkers see,
with ``PointerTable[DeviceAlias]`` where the op takes a pointer table::

    @kernel_op(torch.ops.sgl_kernel.transfer_kv_all_layer.default)
    def transfer_kv_all_layer(
        src_k_layers: PointerTable[DeviceAlias], dst_k_layers: PointerTable[DeviceAlias],
        src_v_layers: PointerTable[DeviceAlias], dst_v_layers: PointerTable[DeviceAlias],
        src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int, num_layers: int,
        block_quota: int = 2, num_warps_per_block: int = 32,
    ) -> None: ...

Statically (mypy, pyright: the signature is kept with a ``ParamSpec``) a raw tensor or a
``PointerTable[HostVA]`` in a table parameter is an error. At run time, before the op is
called, every table argument is checked: a ``PointerTable[DeviceAlias]``
(:class:`DomainError` naming the parameter otherwise), all on one device
(:class:`DeviceMismatchError`), its registrations open and its buffers' storages live
(:meth:`PointerTable.check_live`, :class:`ClosedError`). The op then gets each table as a
``uint64`` tensor of the aliases, shape ``[len(table)]``, on the table's device.

The signature is read once, at decoration; a call binds its arguments with a few list and
dict operations and runs the checks. Measured on this project's 2-core CPU machine
(emulated device, sglang's ten-argument call with four two-layer tables, a no-op op):
about 6.5 us per call, of which about 2.5 us are the four
:meth:`PointerTable.check_live` calls (two reads per distinct storage a table points
into, so a table of 64 separately allocated layers costs more); four
:meth:`PointerTable.as_uint64_tensor` copies alone cost about 4.5 us there, and on CUDA
each is a device allocation and a copy launch.

Which tensor the op gets (``table_tensor``):

* ``"cached"`` (default): a private copy of the table's array, made once per table (the
  first call that passes it) and reused by later calls, so a call makes no allocation and
  no host-to-device copy. The copy is not the table's own array: whatever the op does to
  it, the table's launches (:func:`pointerdomain.transfer_kv_all_layer` and friends) read
  what they always read. An in-place write through torch bumps the copy's version counter
  (so does torch's dispatcher after an op whose schema marks the argument mutable,
  ``Tensor(a!)``: seen with ``torch.library.custom_op(mutates_args=...)``); the next call
  then gets a fresh copy. A write torch does not see (a kernel storing into the array it
  was handed, under a schema that says it does not) is not detected: use this mode for ops
  that only read their pointer tables, as sglang's transfer kernels do (their schemas,
  ``sgl-kernel/csrc/common_extension.cc`` in sgl-project/sglang at
  0063ef14c8f91e28619003de80a9d0efcae63109, declare ``src_k_layers``, ``dst_k_layers``, ...
  as plain ``Tensor`` arguments, not ``Tensor(a!)``: not written).
* ``"copy"``: :meth:`PointerTable.as_uint64_tensor` on every call (a new device
  allocation and a device copy per table per call), for an op that may write its tables.

The cached copy is made with a blocking host-to-device copy, so it is complete before any
stream reads it; it cannot be made inside CUDA graph capture (call the op once before
capturing). It lives as long as its table. As with every launch here, keep the tables
(and so their buffers) alive until the op's queued work is done.

Other arguments go to the op unchanged; the op checks them. Parameters that can be passed
positionally reach the op positionally, in the stub's order (so the stub lists them in the
op's order), keyword-only ones by their stub name; defaults of the stub are filled in
(``torch.ops`` overloads have none of their own for the extra ints).
"""

from __future__ import annotations

import functools
import inspect
import threading
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import Generic, Literal, NamedTuple, ParamSpec, TypeVar, cast

import torch

from pointerdomain.arguments import describe
from pointerdomain._platform import backend_for
from pointerdomain.registration.allocation import device_empty
from pointerdomain.devices import Device
from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain.errors import DeviceMismatchError, InvalidArgumentError, InvalidTypeError
from pointerdomain.registration.tables import PointerTable, require_domain

__all__ = ["KernelOp", "TableTensor", "cached_table_tensor", "kernel_op"]

P = ParamSpec("P")
R = TypeVar("R")

#: How a table reaches the op (see the module docstring).
TableTensor = Literal["cached", "copy"]

_TABLE_TYPE = PointerTable[DeviceAlias]
_WHY = ("the op reads its entries as device addresses. Fix: build the table with "
        "pointerdomain.make_kernel_ptr_table(tensors, device) (device memory, or host memory registered "
        "for the device), never pass a bare uint64 tensor of data_ptr() values or a host table")


class _Param(NamedTuple):
    name: str
    #: index among the positional parameters, or -1 for a keyword-only one
    position: int
    default: object  # inspect.Parameter.empty when required
    table: bool
    #: may be passed by keyword (not positional-only)
    keyword: bool


class _Cached(NamedTuple):
    ref: weakref.ref[PointerTable[DeviceAlias]]
    tensor: torch.Tensor
    version: int


#: id(table) -> its private uint64 copy; the weak reference's callback drops the entry
#: with the table and rules out a reused id.
_copies: dict[int, _Cached] = {}
_lock = threading.Lock()


def _drop(key: int, ref: weakref.ref[PointerTable[DeviceAlias]]) -> None:
    with _lock:
        entry = _copies.get(key)
        if entry is not None and entry.ref is ref:
            del _copies[key]


def _make_copy(op: str, name: str, table: PointerTable[DeviceAlias], device: Device) -> torch.Tensor:
    if backend_for(device).is_capturing(device):
        raise InvalidArgumentError(
            f"{op}: {name}: the table's uint64 copy is made on the first call that passes the table, and that "
            "call is inside CUDA graph capture, where the blocking copy cannot run. Fix: call the op once "
            "with this table before capturing (or decorate with table_tensor='copy')")
    # a normal (not inference) tensor: its version counter shows in-place writes
    with torch.inference_mode(False):
        out = device_empty((len(table),), torch.uint64, device)
        out.copy_(torch.tensor(table.raw_values(), dtype=torch.uint64))  # blocking: done before any stream reads it
    return out


def cached_table_tensor(op: str, name: str, table: PointerTable[DeviceAlias]) -> torch.Tensor:
    """The private ``uint64`` copy of ``table`` that ``"cached"`` mode hands to ops
    (made on first use; remade after an in-place write through torch). Shape
    ``[len(table)]``, on ``table.device``. ``op`` / ``name``: the op and parameter, for
    the message.

    Raises:
        InvalidArgumentError: it must be made and the device's current stream is
            capturing a CUDA graph.
    """
    key = id(table)
    entry = _copies.get(key)  # a dict read is atomic under the GIL; writes take the lock
    if entry is not None and entry.ref() is table and entry.tensor._version == entry.version:
        return entry.tensor
    device = table.device
    tensor = _make_copy(op, name, table, device)
    ref = weakref.ref(table, functools.partial(_drop, key))
    with _lock:
        _copies[key] = _Cached(ref, tensor, tensor._version)
    return tensor


class KernelOp(Generic[P, R]):
    """An op behind a typed stub (made by :func:`kernel_op`); call it with the stub's
    signature.

    Attributes (read-only):
        op: the wrapped op.
        tables: the stub's parameters that take a ``PointerTable[DeviceAlias]``.
        table_tensor: ``"cached"`` or ``"copy"`` (module docstring).
        __signature__ / __wrapped__: the stub's (``inspect.signature`` shows it).

    Raises (each call, before the op runs):
        InvalidTypeError: the arguments do not fit the stub's signature (missing, unknown
            or repeated), as Python's own ``TypeError`` would say.
        DomainError: a table parameter got anything but a ``PointerTable[DeviceAlias]``
            (a raw tensor, a ``PointerTable[HostVA]``, a list); the message names it.
        DeviceMismatchError: two table parameters on different devices.
        ClosedError: a table points into a closed registration, or the storage of a
            buffer it points into was released or reallocated.
        InvalidArgumentError: ``"cached"`` mode, first use of a table inside CUDA graph
            capture.
    """

    __signature__: inspect.Signature
    __wrapped__: Callable[P, R]
    __name__: str
    __qualname__: str

    def __init__(self, op: Callable[..., object], stub: Callable[P, R], params: tuple[_Param, ...],
                 signature: inspect.Signature, var_positional: bool, var_keyword: bool,
                 table_tensor: TableTensor) -> None:
        self._op = op
        self._table_tensor: TableTensor = table_tensor
        self._tables: tuple[str, ...] = tuple(p.name for p in params if p.table)
        self._signature = signature
        self._positional = tuple(p for p in params if p.position >= 0)
        self._keyword_only = tuple(p for p in params if p.position < 0)
        self._names = frozenset(p.name for p in params)
        self._var_positional = var_positional
        self._var_keyword = var_keyword
        self._table_positions = tuple(p.position for p in self._positional if p.table)
        self._table_keywords = tuple(p.name for p in self._keyword_only if p.table)
        self._cached = table_tensor == "cached"
        self._name: str = getattr(stub, "__qualname__", repr(stub))
        functools.update_wrapper(self, stub)
        self.__signature__ = signature

    def _bad_call(self, args: tuple[object, ...], kwargs: dict[str, object]) -> InvalidTypeError:
        """The stub signature's own complaint about a call the fast path refused."""
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            return InvalidTypeError(f"{self._name}: {exc}")
        return InvalidTypeError(f"{self._name}: the arguments do not fit {self._signature}")

    def _tensor(self, name: str, value: object, device: Device | None, first: str) -> tuple[torch.Tensor, Device, str]:
        """The op's tensor for table argument ``value`` of parameter ``name``, checked;
        ``device`` / ``first``: the device of the first table so far and its parameter."""
        if isinstance(value, PointerTable) and value.domain is DeviceAlias:
            table = cast(PointerTable[DeviceAlias], value)
        else:
            table = require_domain(f"{self._name}: {name}", value, DeviceAlias, "a kernel op", _WHY)
        dev = table.device
        if device is None:
            device, first = dev, name
        elif dev != device:
            raise DeviceMismatchError(
                f"{self._name}: {name} is a table for {dev}, but {first} is for {device}: one op launch reads "
                "every table on one device. Fix: build all its tables for the same device")
        table.check_live()
        if self._cached:
            return cached_table_tensor(self._name, name, table), device, first
        return table.as_uint64_tensor(), device, first

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        positional = self._positional
        n = len(args)
        if n > len(positional) and not self._var_positional:
            raise self._bad_call(args, kwargs)
        out: list[object] = list(args)
        used = 0
        for p in positional[n:]:
            if p.keyword and p.name in kwargs:
                out.append(kwargs[p.name])
                used += 1
            elif p.default is not inspect.Parameter.empty:
                out.append(p.default)
            else:
                raise self._bad_call(args, kwargs)
        keywords: dict[str, object] = {}
        for p in self._keyword_only:
            if p.name in kwargs:
                keywords[p.name] = kwargs[p.name]
                used += 1
            elif p.default is not inspect.Parameter.empty:
                keywords[p.name] = p.default
            else:
                raise self._bad_call(args, kwargs)
        if used != len(kwargs):
            # keywords no parameter took: for **kwargs, unless they name a parameter
            # (given positionally already, or positional-only)
            taken = {p.name for p in positional[n:] if p.keyword} | {p.name for p in self._keyword_only}
            extra = {k: v for k, v in kwargs.items() if k not in taken}
            if not self._var_keyword or not self._names.isdisjoint(extra):
                raise self._bad_call(args, kwargs)
            keywords.update(extra)
        device: Device | None = None
        first = ""
        for i in self._table_positions:
            out[i], device, first = self._tensor(positional[i].name, out[i], device, first)
        for name in self._table_keywords:
            keywords[name], device, first = self._tensor(name, keywords[name], device, first)
        return cast(R, self._op(*out, **keywords))

    @property
    def op(self) -> Callable[..., object]:
        """The wrapped op."""
        return self._op

    @property
    def tables(self) -> tuple[str, ...]:
        """The stub's parameters that take a ``PointerTable[DeviceAlias]``, in order."""
        return self._tables

    @property
    def table_tensor(self) -> TableTensor:
        """``"cached"`` or ``"copy"`` (module docstring)."""
        return self._table_tensor

    def __repr__(self) -> str:
        return f"<kernel_op {self._name}{self._signature} -> {self._op!r}>"


def _hints(stub: Callable[..., object]) -> dict[str, object]:
    try:
        return typing.get_type_hints(stub)
    except Exception as exc:  # NameError, TypeError, ...: an annotation that does not evaluate
        raise InvalidArgumentError(
            f"kernel_op: the annotations of {getattr(stub, '__qualname__', stub)!r} do not evaluate ({exc}); "
            "every table parameter must be annotated PointerTable[DeviceAlias] with names the stub's module "
            "defines") from None


def kernel_op(
    op: Callable[..., object],
    *,
    tables: Sequence[str] | None = None,
    table_tensor: TableTensor = "cached",
) -> Callable[[Callable[P, R]], KernelOp[P, R]]:
    """Decorator: the op ``op`` behind the decorated stub's signature, its table
    parameters checked and turned into ``uint64`` tensors (module docstring).

    Args:
        op: the op (``torch.ops.<ns>.<name>.default``, any callable). It gets the call's
            arguments, the stub's defaults filled in, positional-capable parameters
            positionally in the stub's order, keyword-only ones by name; each table as a
            ``uint64`` tensor ``[len(table)]`` of device aliases on the table's device.
        tables: the stub's parameters that take pointer tables; each must be annotated
            exactly ``PointerTable[DeviceAlias]``, have no default and not be ``*args`` /
            ``**kwargs``. Default: every parameter so annotated. When given it must name
            every parameter so annotated (a table parameter left out would reach the op
            as a PointerTable object).
        table_tensor: ``"cached"`` (a per-table private copy, made once) or ``"copy"``
            (a fresh copy per call); see the module docstring.

    Returns:
        A decorator taking the stub and returning a :class:`KernelOp` with the stub's
        signature. The stub's body never runs: ``...`` for ``-> None``; for another
        return type write ``raise NotImplementedError`` (mypy reports an empty body).

    Raises (at decoration):
        InvalidTypeError: ``op`` or the stub is not callable, ``tables`` is a string or
            holds a non-string.
        InvalidArgumentError: ``tables`` names a parameter the stub does not have, names
            one twice, is empty, or names ``*args`` / ``**kwargs``; a table parameter's
            annotation is not ``PointerTable[DeviceAlias]`` (``PointerTable[HostVA]``, a
            bare tensor, a union, ...) or it has a default; a parameter annotated
            ``PointerTable[...]`` is left out of ``tables``; the annotations do not
            evaluate; ``table_tensor`` is neither mode; the stub has no table parameter.
    """
    if not callable(op):
        raise InvalidTypeError(f"kernel_op: op: found a {type(op).__name__}, expected a callable (the op to wrap)")
    if table_tensor not in ("cached", "copy"):
        raise InvalidArgumentError(f"kernel_op: table_tensor: found {describe(table_tensor)}, expected 'cached' or 'copy'")
    names: tuple[str, ...] | None = None
    if tables is not None:
        if isinstance(tables, str) or not isinstance(cast(object, tables), Sequence):
            raise InvalidTypeError(
                f"kernel_op: tables: found {describe(tables)}, expected a sequence of parameter names, e.g. "
                "tables=('src_k_layers', 'dst_k_layers')")
        names = tuple(tables)
        for t in names:
            if not isinstance(cast(object, t), str):
                raise InvalidTypeError(f"kernel_op: tables: found {describe(t)} ({type(t).__name__}), expected parameter names")
        if not names:
            raise InvalidArgumentError("kernel_op: tables is empty; name the parameters that take pointer tables")
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"kernel_op: tables {names!r} names a parameter twice")

    def decorate(stub: Callable[P, R]) -> KernelOp[P, R]:
        if not callable(stub):
            raise InvalidTypeError(f"kernel_op: found a {type(stub).__name__} to decorate, expected a function")
        where = f"kernel_op({getattr(stub, '__qualname__', stub)!r})"
        signature = inspect.signature(stub)
        hints = _hints(stub)
        given = signature.parameters
        annotated = [n for n in given if typing.get_origin(hints.get(n)) is PointerTable or hints.get(n) is PointerTable]
        chosen = tuple(annotated) if names is None else names
        for n in chosen:
            if n not in given:
                raise InvalidArgumentError(
                    f"{where}: tables names {n!r}, which is not a parameter of the stub {signature}")
            kind = given[n].kind
            if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise InvalidArgumentError(f"{where}: {n!r} is *args / **kwargs; a table parameter takes one table")
            hint = hints.get(n)
            if hint != _TABLE_TYPE:
                shown = "no annotation" if hint is None else f"annotation {getattr(hint, '__name__', None) or hint!r}"
                also = (" (a host table is what a kernel must never read)" if hint == PointerTable[HostVA] else "")
                raise InvalidArgumentError(
                    f"{where}: table parameter {n!r} has {shown}{also}; it must be annotated exactly "
                    "PointerTable[DeviceAlias], so that type checkers refuse a raw tensor or a host table there")
            if given[n].default is not inspect.Parameter.empty:
                raise InvalidArgumentError(f"{where}: table parameter {n!r} has a default; a table must be passed")
        missing = [n for n in annotated if n not in chosen]
        if missing:
            raise InvalidArgumentError(
                f"{where}: {missing} annotated PointerTable but not in tables={chosen!r}: the op would get the "
                "PointerTable object itself. Fix: list every table parameter (or leave tables out)")
        if not chosen:
            raise InvalidArgumentError(
                f"{where}: the stub {signature} has no parameter annotated PointerTable[DeviceAlias]; "
                "there is nothing to check (call the op directly)")
        params: list[_Param] = []
        position = 0
        var_positional = var_keyword = False
        for n, p in given.items():
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                var_positional = True
            elif p.kind is inspect.Parameter.VAR_KEYWORD:
                var_keyword = True
            elif p.kind is inspect.Parameter.KEYWORD_ONLY:
                params.append(_Param(n, -1, p.default, n in chosen, True))
            else:
                params.append(_Param(n, position, p.default, n in chosen,
                                      p.kind is not inspect.Parameter.POSITIONAL_ONLY))
                position += 1
        return KernelOp(op, stub, tuple(params), signature, var_positional, var_keyword, table_tensor)

    return decorate
