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

What the op writes is opaque to the wrapper: by default it checks the tables and nothing
else. Declared at decoration, it also refuses before the op runs what the engine call
shapes of :mod:`pointerdomain.compat.sgl_kernel` refuse: ``writes`` (the destination
table parameters: their entries may not share memory with each other or with any other
table's entry) and ``slots`` (how the op addresses entries, slot ``s`` being ``item_size``
bytes at ``entry + s * item_size``: every slot inside every entry it addresses, no
destination slot given twice; the indices are read on the host)::

    @kernel_op(torch.ops.sgl_kernel.transfer_kv_all_layer.default,
               writes=("dst_k_layers", "dst_v_layers"),
               slots={"src_k_layers": ("src_indices", "item_size"), "src_v_layers": ("src_indices", "item_size"),
                      "dst_k_layers": ("dst_indices", "item_size"), "dst_v_layers": ("dst_indices", "item_size")})
    def transfer_kv_all_layer(...) -> None: ...

Other arguments go to the op unchanged; the op checks them. Parameters that can be passed
positionally reach the op positionally, in the stub's order (so the stub lists them in the
op's order), keyword-only ones by their stub name; defaults of the stub are filled in
(``torch.ops`` overloads have none of their own for the extra ints).
"""

from __future__ import annotations

import bisect
import functools
import inspect
import threading
import typing
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, Literal, NamedTuple, ParamSpec, TypeVar, cast

import torch

from pointerdomain.arguments import describe
from pointerdomain._platform import backend_for
from pointerdomain.registration.allocation import device_empty
from pointerdomain.devices import Device
from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain.errors import (
    DeviceMismatchError,
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    OverlapError,
    with_address,
)
from pointerdomain.registration.tables import PointerTable, require_domain
from pointerdomain.transfer.overlap import first_shared, interleaved_entries, rows_clash

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


#: kernel_op's ``slots``: table parameter -> (index parameter, item-size parameter).
SlotSpec = Mapping[str, tuple[str, str]]

#: (the op, its tables' ids and interleave marks in parameter order) -> weak references to
#: tables whose entries passed :func:`_entries_apart`: a call that meets them again pays a look-up.
_apart_seen: OrderedDict[tuple[object, ...], tuple[weakref.ref[PointerTable[DeviceAlias]], ...]] = OrderedDict()
_APART_MAX = 256
#: index tensors up to this many slots are checked as Python lists
_LIST_MAX = 512


def _entries_apart(op: str, tables: Sequence[tuple[str, PointerTable[DeviceAlias]]], writes: frozenset[str]) -> None:
    """Refuse tables whose destination entries (parameters in ``writes``) share memory with
    each other or with any other table's entry, as the sibling compat calls do (entries
    of one table marked interleaved by
    :func:`~pointerdomain.transfer.overlap.allow_interleaved` clash where their rows meet:
    :func:`~pointerdomain.transfer.overlap.rows_clash`). Each entry is exactly the bytes its
    table holds for it. Cached per tables and marks (a mark changed later is a new key).

    Raises:
        OverlapError: naming the two entries (``param[i]``).
    """
    marks = tuple(interleaved_entries(t) for _, t in tables)
    key = (op, writes, tuple(id(t) for _, t in tables), marks)
    hit = _apart_seen.get(key)
    if hit is not None and all(r() is t for r, (_, t) in zip(hit, tables)):
        return
    dst: list[tuple[int, int, str, int]] = []
    src: list[tuple[int, int, str, int]] = []
    for k, (name, table) in enumerate(tables):
        side = dst if name in writes else src
        side.extend((v, v + n, f"{name}[{i}]", k) for i, (v, n) in enumerate(zip(table.raw_values(), table.sizes)))
    dst.sort()
    src.sort()
    active: list[tuple[int, int, str, int]] = []  # destination spans that may reach the next start
    for b, b_end, y, ky in dst:
        active = [e for e in active if e[1] > b]
        for a, a_end, x, kx in active:
            rows = marks[kx] if kx == ky else None  # the interleave mark holds within its own table
            if rows_clash(a, a_end, b, b_end, rows):
                at = first_shared(a, b, rows)
                raise with_address(OverlapError(
                    f"{op}: {x} and {y} share memory (from {at:#x}): the op would write those bytes twice, in no "
                    "defined order (a race on a GPU); nothing was written. Fix: give K and V and every layer their "
                    "own buffers"), at)
        active.append((b, b_end, y, ky))
    starts = [a for a, _, _, _ in src]
    reach: list[tuple[int, int]] = []  # per source prefix: (the furthest end, its span)
    for j, (_, a_end, _, _) in enumerate(src):
        reach.append((a_end, j) if not reach or a_end > reach[-1][0] else reach[-1])
    for b, b_end, y, _ in dst:
        k = bisect.bisect_left(starts, b_end)  # sources starting before this entry ends
        if k and reach[k - 1][0] > b:
            a, _, x, _ = src[reach[k - 1][1]]
            at = max(a, b)
            raise with_address(OverlapError(
                f"{op}: {y} overlaps {x} (from {at:#x}): the op would write bytes it also reads, in no defined "
                "order; nothing was written. Fix: copy between separate buffers"), at)
    with _lock:
        _apart_seen[key] = tuple(weakref.ref(t) for _, t in tables)
        if len(_apart_seen) > _APART_MAX:
            _apart_seen.popitem(last=False)


def _index_values(op: str, name: str, value: object, device: Device) -> torch.Tensor:
    """Index argument ``value`` of parameter ``name`` checked (``int64`` / ``int32``, 1-D,
    contiguous: the op reads it as a packed array) and read on the host (a device sync for
    CUDA indices; refused during CUDA graph capture, where the host cannot read them)."""
    if not isinstance(value, torch.Tensor):
        raise IndexValidationError(f"{op}: {name}: found {describe(value)}, expected an int64 torch.Tensor of slots")
    if value.layout is not torch.strided or value.is_meta:
        raise IndexValidationError(f"{op}: {name}: found a {'meta' if value.is_meta else str(value.layout)} tensor, "
                                   "expected a dense int64 tensor in memory")
    if value.dtype not in (torch.int64, torch.int32):
        raise IndexValidationError(f"{op}: {name}: dtype {value.dtype}, expected torch.int64 (or torch.int32)")
    if value.dim() != 1:
        raise IndexValidationError(f"{op}: {name}: shape {tuple(value.shape)}, expected 1-D")
    if not value.is_contiguous():
        raise IndexValidationError(
            f"{op}: {name}: strides {value.stride()}, not contiguous (the op would read it as packed). Fix: .contiguous()")
    held = value.untyped_storage().nbytes()
    needed = (value.storage_offset() + value.numel()) * value.element_size()
    if value.numel() and held < needed:  # released or shrunk storage: neither torch nor the op may read it
        raise IndexValidationError(
            f"{op}: {name}: its storage holds {held} bytes, the view needs {needed} (the storage was released or "
            "resized): the op would read indices from memory the tensor no longer owns; nothing was written")
    if value.is_cuda:
        if backend_for(device).is_capturing(device):
            raise InvalidArgumentError(
                f"{op}: {name}: the slots the op writes are checked on the host, which cannot read device indices "
                "during CUDA graph capture. Fix: call the op outside capture (or decorate it without slots)")
        return value.to("cpu", torch.int64)
    return value.to(torch.int64)


def _check_slots(op: str, tables: dict[str, PointerTable[DeviceAlias]], args: dict[str, object],
                 slots: Mapping[str, tuple[str, str]], writes: frozenset[str], device: Device) -> None:
    """Every slot an index parameter gives lies inside every entry of each table it
    addresses (slot ``s`` of an entry: ``item`` bytes at ``entry + s * item``), and no slot
    of an index parameter that addresses a destination table is given twice.

    Raises:
        InvalidArgumentError: an item size that is not an int >= 1.
        IndexValidationError: a bad index tensor (its storage released included), index
            tensors of different lengths, or a slot outside an entry.
        OverlapError: a destination slot given twice.
    """
    bounds: dict[str, tuple[int, str, int]] = {}  # index parameter -> (slots, the table that bounds them, item)
    for table_name, (index_name, item_name) in slots.items():
        item = args[item_name]
        if type(item) is not int or item < 1:
            raise InvalidArgumentError(
                f"{op}: {item_name}: found {describe(item)} ({type(item).__name__}), expected an int >= 1 (the bytes "
                f"of a slot of {table_name})")
        count = min(tables[table_name].sizes) // item
        if index_name not in bounds or count < bounds[index_name][0]:
            bounds[index_name] = (count, table_name, item)
    read = {name: _index_values(op, name, args[name], device) for name in bounds}
    lengths = {name: idx.numel() for name, idx in read.items()}
    first = next(iter(lengths), "")
    other = next((k for k, n in lengths.items() if n != lengths[first]), None)
    if other is not None:  # the op walks slot i of each index tensor together
        a, b, na, nb = first, other, lengths[first], lengths[other]
        raise IndexValidationError(
            f"{op}: {a} has {na} slots and {b} {nb}: the op reads the index tensors as pairs (slot i of each), "
            "so a shorter one would be read past its end; nothing was written. Fix: pass index tensors of equal "
            "length")
    for index_name, (count, table_name, item) in bounds.items():
        idx = read[index_name]
        n = idx.numel()
        if not n:
            continue
        listed = idx.tolist() if n <= _LIST_MAX else None  # small sets: list operations beat tensor ops
        lo, hi = (min(listed), max(listed)) if listed is not None else (int(v) for v in torch.aminmax(idx))
        if lo < 0 or hi >= count:
            sizes = tables[table_name].sizes
            entry_name = f"{table_name}[{sizes.index(min(sizes))}]"
            raise IndexValidationError(
                f"{op}: {index_name}: slot {lo if lo < 0 else hi} outside [0, {count}) (the {item}-byte slots "
                f"{entry_name} holds): the op would address memory outside the table's entries; nothing was written")
        written = [t for t, (i, _) in slots.items() if i == index_name and t in writes]
        if not written or n < 2 or (listed is not None and len(set(listed)) == n):
            continue
        ordered = torch.sort(idx).values
        twice = ordered[1:] == ordered[:-1]
        if bool(twice.any()):
            raise OverlapError(
                f"{op}: {index_name}: slot {int(ordered[1:][twice][0])} is given twice: the op would write it twice "
                f"through {', '.join(written)}, in no defined order (in parallel on a GPU), so which write lands is "
                "a race; nothing was written. Fix: give each destination slot once per call")


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
                 table_tensor: TableTensor, writes: tuple[str, ...] = (),
                 slots: dict[str, tuple[str, str]] | None = None) -> None:
        self._op = op
        self._writes = writes
        self._write_set = frozenset(writes)
        self._slots: dict[str, tuple[str, str]] = dict(slots or {})
        #: the call's writes are checked (``writes`` or ``slots`` given)
        self._declared = bool(writes or self._slots)
        self._where = {p.name: p.position for p in params}
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

    def _table(self, name: str, value: object, device: Device | None,
               first: str) -> tuple[PointerTable[DeviceAlias], Device, str]:
        """Table argument ``value`` of parameter ``name``, checked; ``device`` / ``first``:
        the device of the first table so far and its parameter."""
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
        table.check_kernel_readable()  # the op's kernel reads the entries: no host VAs of unpinned memory
        return table, device, first

    def _checked_tensor(self, name: str, value: object, device: Device | None,
                        first: str) -> tuple[torch.Tensor, Device, str]:
        """:meth:`_table`, then the table's ``uint64`` tensor (cached or copied, as the op asks)."""
        table, device, first = self._table(name, value, device, first)
        if self._cached:
            return cached_table_tensor(self._name, name, table), device, first
        return table.as_uint64_tensor(), device, first

    def _tensor(self, name: str, table: PointerTable[DeviceAlias]) -> torch.Tensor:
        """The op's tensor for checked table ``table`` of parameter ``name``."""
        if self._cached:
            return cached_table_tensor(self._name, name, table)
        return table.as_uint64_tensor()

    def _check_writes(self, tables: list[tuple[str, PointerTable[DeviceAlias]]], out: list[object],
                      keywords: dict[str, object], device: Device) -> None:
        """The declared writes of a call whose tables passed their checks (``writes``,
        ``slots``: see :func:`kernel_op`)."""
        if self._writes:
            _entries_apart(self._name, tables, self._write_set)
        if self._slots:
            where = self._where
            needed = {n for pair in self._slots.values() for n in pair}
            args = {n: (out[where[n]] if where[n] >= 0 else keywords[n]) for n in needed}
            _check_slots(self._name, dict(tables), args, self._slots, self._write_set, device)

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
        if self._declared:  # every table checked first, then what the call writes, then the tensors
            tables: list[tuple[str, PointerTable[DeviceAlias]]] = []
            for i in self._table_positions:
                table, device, first = self._table(positional[i].name, out[i], device, first)
                tables.append((positional[i].name, table))
            for name in self._table_keywords:
                table, device, first = self._table(name, keywords[name], device, first)
                tables.append((name, table))
            assert device is not None  # at least one table parameter
            self._check_writes(tables, out, keywords, device)
            for (name, table), i in zip(tables, (*self._table_positions, *(-1 for _ in self._table_keywords))):
                if i >= 0:
                    out[i] = self._tensor(name, table)
                else:
                    keywords[name] = self._tensor(name, table)
            return cast(R, self._op(*out, **keywords))
        for i in self._table_positions:
            out[i], device, first = self._checked_tensor(positional[i].name, out[i], device, first)
        for name in self._table_keywords:
            keywords[name], device, first = self._checked_tensor(name, keywords[name], device, first)
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

    @property
    def writes(self) -> tuple[str, ...]:
        """The table parameters the op writes through (``writes`` of :func:`kernel_op`)."""
        return self._writes

    @property
    def slots(self) -> dict[str, tuple[str, str]]:
        """Table parameter -> (index parameter, item-size parameter) (``slots`` of
        :func:`kernel_op`; a copy)."""
        return dict(self._slots)

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


def _names_arg(name: str, value: object) -> tuple[str, ...]:
    """``writes``: None, or a sequence of strings without repeats."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidTypeError(
            f"kernel_op: {name}: found {describe(value)}, expected a sequence of table parameter names, e.g. "
            f"{name}=('dst_k_layers', 'dst_v_layers')")
    names = tuple(cast(Sequence[object], value))
    for n in names:
        if not isinstance(n, str):
            raise InvalidTypeError(f"kernel_op: {name}: found {describe(n)} ({type(n).__name__}), expected parameter names")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"kernel_op: {name} {names!r} names a parameter twice")
    return cast(tuple[str, ...], names)


def _slots_arg(value: object) -> dict[str, tuple[str, str]]:
    """``slots``: None, or a mapping of names to (index, item size) name pairs."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidTypeError(
            f"kernel_op: slots: found {describe(value)}, expected a mapping of table parameter names to (indices, "
            "item_size) parameter names, e.g. slots={'dst_k_layers': ('dst_indices', 'item_size')}")
    out: dict[str, tuple[str, str]] = {}
    for k, v in cast(Mapping[object, object], value).items():
        if (not isinstance(k, str) or not isinstance(v, tuple) or len(v) != 2
                or not all(isinstance(n, str) for n in v)):
            raise InvalidTypeError(
                f"kernel_op: slots: found {describe(k)}: {describe(v)}, expected a table parameter name mapped to "
                "a pair of parameter names (indices, item_size)")
        out[k] = cast(tuple[str, str], v)
    return out


def kernel_op(
    op: Callable[..., object],
    *,
    tables: Sequence[str] | None = None,
    table_tensor: TableTensor = "cached",
    writes: Sequence[str] | None = None,
    slots: SlotSpec | None = None,
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
        writes: the table parameters the op writes through (its destinations). Each
            call then refuses, before the op runs, a destination entry sharing memory
            with another destination entry or with any entry of the other tables
            (``OverlapError``), each entry being the bytes its table holds for it; a
            table marked by :func:`pointerdomain.transfer.overlap.allow_interleaved`
            may have entries whose rows interleave. Checked once per combination of
            tables (a look-up when they are met again).
        slots: how the op addresses table parameters' entries, for ops that move
            fixed-size slots (sglang's ``transfer_kv_*`` ops): ``{table: (indices,
            item_size)}``, slot ``s`` of every entry of ``table`` being the
            ``item_size`` bytes at ``entry + s * item_size``, where ``indices`` names the
            index-tensor parameter and ``item_size`` the int parameter. Each call then
            refuses an item size that is not an int >= 1 (``InvalidArgumentError``), an
            index tensor that is not ``int64`` / ``int32``, 1-D and contiguous or whose
            storage no longer holds it (released or resized), index tensors of different
            lengths (the op reads them as pairs: slot ``i`` of each index tensor named in
            ``slots`` together, as sglang's ops walk ``src_indices`` and ``dst_indices``),
            or a slot outside ``[0, entry bytes // item_size)`` of any entry of a table it
            addresses (``IndexValidationError``), and a slot given twice in an index
            tensor that addresses a ``writes`` table (``OverlapError``). The indices are
            read on the host: a device sync for CUDA indices, refused during CUDA graph
            capture (``InvalidArgumentError``). Both declared cost about 15 us more a call
            than none (two 32-slot CPU index tensors, four tables, this project's 2-core CPU
            machine: docs/log/2026-12-05-declared-writes.md).

    Returns:
        A decorator taking the stub and returning a :class:`KernelOp` with the stub's
        signature. The stub's body never runs: ``...`` for ``-> None``; for another
        return type write ``raise NotImplementedError`` (mypy reports an empty body).

    Raises (at decoration):
        InvalidTypeError: ``op`` or the stub is not callable, ``tables`` or ``writes`` is a
            string or holds a non-string, ``slots`` is not a mapping of names to pairs of
            names.
        InvalidArgumentError: ``tables`` names a parameter the stub does not have, names
            one twice, is empty, or names ``*args`` / ``**kwargs``; ``writes`` or a key of
            ``slots`` names anything but a table parameter, or ``slots`` names an index or
            item-size parameter the stub does not have, a table parameter or ``*args`` /
            ``**kwargs``; a table parameter's
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

    write_names = _names_arg("writes", writes)
    slot_spec = _slots_arg(slots)

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
        for n in write_names:
            if n not in chosen:
                raise InvalidArgumentError(
                    f"{where}: writes names {n!r}, which is not a table parameter of the stub (tables: {chosen!r})")
        for t, pair in slot_spec.items():
            if t not in chosen:
                raise InvalidArgumentError(
                    f"{where}: slots names {t!r}, which is not a table parameter of the stub (tables: {chosen!r})")
            for n in pair:
                if n not in given or given[n].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                    raise InvalidArgumentError(
                        f"{where}: slots[{t!r}]: {n!r} is not a parameter of the stub {signature} (an index tensor "
                        "and an item size, each a named parameter)")
                if n in chosen:
                    raise InvalidArgumentError(
                        f"{where}: slots[{t!r}]: {n!r} is a table parameter; name the index tensor and the item "
                        "size parameters")
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
        return KernelOp(op, stub, tuple(params), signature, var_positional, var_keyword, table_tensor, write_names,
                        slot_spec)

    return decorate
