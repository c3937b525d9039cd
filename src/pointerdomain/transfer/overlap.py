"""The overlap rule: a launch never reads and writes the same bytes.

Slot pairs are copied in no defined order and in parallel on the GPU, so a launch
whose source and destination share memory (a shift or a swap inside one pool)
would depend on that order: on the CPU it loses data silently, on the GPU it races.
The rule, checked before anything is launched:

0. A launch never writes one byte through two destination entries: two entries over
   one buffer (K and V, or two layers, given the same memory) would have the launch
   write those bytes twice, and on a GPU the order of the writes is a race. Checked when
   the plan is built (:func:`entry_clashes`: entries of one layer, ``OverlapError``) and,
   for entries of two different layers, per launch by its layer range
   (:func:`check_layers`: free for tables without such entries). Sources may share
   memory (reads only). This holds whatever built the table (:func:`make_kernel_ptr_table`,
   a pool, an adapter, compat). A table whose rows interleave by design carries its row
   stride and row bytes (:func:`allow_interleaved`): its intersecting entries clash where
   a row of one meets a row of another (:func:`rows_clash`, also compat's argument check).
1. Tables whose buffers do not intersect in memory: nothing to check (the common
   device <-> host case; found once per plan, no per-launch cost).
2. Tables over the same memory with the same geometry (one table, or two tables of
   the same buffers and layout): the source slot set and the destination slot set
   must be disjoint, else :class:`~pointerdomain.errors.OverlapError` naming a slot.
   For CPU (emulated) indices this is a host check on every launch. For CUDA indices
   it reads the indices on the host, a device synchronisation: it only runs for
   launches of this kind (never on the default device <-> host path), and such a
   launch cannot be captured in a CUDA graph (``OverlapError`` during capture).
3. Tables whose memory intersects with different geometries (two views of one
   buffer): refused for every launch (``OverlapError`` when the plan is built), since
   which bytes a slot touches on each side no longer compares slot by slot.

To move slots inside one pool, copy through a second buffer (two launches).

A launch lowered to per-part items (``page_head``, ``page_unified`` with head groups:
:func:`pointerdomain.layouts.lower_pair`) compares the lowered geometries for rules 1-3
and checks rule 2 on the caller's slots: both sides then have the same layout, whose
parts of slot ``s`` are the same on both, so the two slot sets meet exactly where their
parts do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pointerdomain.arguments import describe
from pointerdomain.errors import InvalidArgumentError, OverlapError

if TYPE_CHECKING:
    from pointerdomain.domains import DeviceAlias
    from pointerdomain.layouts import Geometry
    from pointerdomain.registration.tables import PointerTable

__all__ = [
    "LayerClash",
    "allow_interleaved",
    "check_distinct_destinations",
    "check_layers",
    "check_slots",
    "entry_clashes",
    "entry_spans",
    "first_shared",
    "interleaved_entries",
    "on_interleave_change",
    "rows_clash",
    "shared_memory",
]


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    a.sort()
    b.sort()
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] <= b[j][0]:
            i += 1
        elif b[j][1] <= a[i][0]:
            j += 1
        else:
            return True
    return False


def _entry_name(index: int, geo: Geometry) -> str:
    """Entry ``index`` of a table addressed by ``geo`` as (kv, layer, page) where the
    table splits those dimensions (``entry = kv*e_kv + layer*e_layer + page*e_page``)."""
    parts: list[str] = []
    rest = index
    for stride, label in sorted(((geo.e_kv, "kv"), (geo.e_layer, "layer"), (geo.e_page, "page")), reverse=True):
        if stride > 0:
            value, rest = divmod(rest, stride)
            parts.append(("K" if value == 0 else "V") if label == "kv" and geo.e_kv > 0 else f"{label} {value}")
    return f"entry {index}" + (f" ({', '.join(parts)})" if parts else "")


def _entry_layer(index: int, geo: Geometry) -> int | None:
    """The layer of entry ``index``, or None where the table does not split layers (each
    entry then holds items of every layer)."""
    if geo.e_layer == 0:
        return None
    rest = index
    for stride, label in sorted(((geo.e_kv, 0), (geo.e_layer, 1), (geo.e_page, 2)), reverse=True):
        if stride > 0:
            value, rest = divmod(rest, stride)
            if label == 1:
                return value
    return None  # unreachable: e_layer > 0 is among the strides


#: Tables whose entries intersect by design (:func:`allow_interleaved`): table -> (row stride, row bytes).
_interleaved: weakref.WeakKeyDictionary[PointerTable[DeviceAlias], tuple[int, int]] = weakref.WeakKeyDictionary()
#: Called with a table whose mark changed: verdicts cached from the old mark are dropped.
_on_change: list[Callable[[PointerTable[DeviceAlias]], None]] = []


def on_interleave_change(callback: Callable[[PointerTable[DeviceAlias]], None]) -> None:
    """Call ``callback(table)`` whenever :func:`allow_interleaved` changes ``table``'s mark
    (the transfer plans cache rule 0's verdict per table: :mod:`pointerdomain.transfer.plan`)."""
    _on_change.append(callback)


def allow_interleaved(table: PointerTable[DeviceAlias], rows: tuple[int, int] | None) -> None:
    """Let ``table``'s entries intersect as a destination where their rows cannot meet:
    with ``rows = (stride, row)``, each entry holds rows of ``row`` bytes every ``stride``
    bytes from its address (K at offset 0 and V at offset ``row`` of a ``2 * row`` stride,
    or layers of a page_first pool); two intersecting entries still clash where a row of
    one meets a row of the other (:func:`rows_clash`). ``None`` clears the mark (a cached
    table met again by a call whose rows are packed). A changed mark holds from the next
    launch on: plans built under the old one are dropped (:func:`on_interleave_change`).

    Raises:
        InvalidArgumentError: ``stride`` or ``row`` < 1.
    """
    if rows is not None:
        stride, row = rows
        if stride < 1 or row < 1:
            raise InvalidArgumentError(f"allow_interleaved: stride {stride} and row {row} bytes, expected both >= 1")
        rows = (stride, row)
    if _interleaved.get(table) == rows:
        return  # the common case: a cached table met again with its own mark
    if rows is None:
        _interleaved.pop(table, None)
    else:
        _interleaved[table] = rows
    for callback in _on_change:
        callback(table)


def interleaved_entries(table: PointerTable[DeviceAlias]) -> tuple[int, int] | None:
    """``(row stride, row bytes)`` given to :func:`allow_interleaved` for ``table``, or None."""
    return _interleaved.get(table)


def rows_clash(a: int, a_end: int, b: int, b_end: int, rows: tuple[int, int] | None) -> bool:
    """Whether entries over bytes ``[a, a_end)`` and ``[b, b_end)`` may write one byte twice.
    Without ``rows``: whenever they intersect. With ``rows = (S, B)`` (each entry's rows ``B``
    bytes every ``S`` bytes from its start): intersecting entries clash iff
    ``(b - a) mod S`` is < ``B`` or > ``S - B``, a row of one meeting a row of the other
    (exact where both hold rows through the intersection; otherwise it refuses)."""
    if a_end <= b or b_end <= a:
        return False
    if rows is None:
        return True
    stride, row = rows
    offset = (b - a) % stride
    return offset < row or offset > stride - row


def first_shared(a: int, b: int, rows: tuple[int, int] | None) -> int:
    """The first byte entries starting at ``a`` <= ``b`` that :func:`rows_clash` both write
    (for a message): ``b``, or where ``b``'s first row reaches ``a``'s next row."""
    if rows is None:
        return b
    offset = (b - a) % rows[0]
    return b if offset < rows[1] else b + rows[0] - offset


#: Two layers whose destination entries share memory, and the error a launch over both raises.
LayerClash = tuple[int, int, str]


def entry_clashes(dst: PointerTable[DeviceAlias], dst_geo: Geometry) -> tuple[LayerClash, ...]:
    """Rule 0 for destination table ``dst`` (addressed by ``dst_geo``), when its plan is
    built. Each entry holds exactly its layout's bytes
    (:meth:`~pointerdomain.layouts.KVLayout.geometry`), every one of which some item
    writes, so two entries that intersect are bytes written twice by any launch that
    addresses both. Entries of one layer (K and V, two pages), or of a table that does not
    split layers, are addressed by every launch: refused here. Entries of two different
    layers are addressed together only by a launch over both layers: returned, for
    :func:`check_layers` (a per-layer launch over a table whose layers name one buffer
    is sound, and compat builds such tables). A table passed to :func:`allow_interleaved`
    may have entries that intersect where their rows do not meet (:func:`rows_clash`).

    Raises:
        OverlapError: two entries of one layer intersect, naming both (K / V, layer, page).
    """
    values, sizes = dst.raw_values(), dst.sizes
    if len(values) < 2:
        return ()
    rows = _interleaved.get(dst)
    spans = sorted((v, v + n, i) for i, (v, n) in enumerate(zip(values, sizes)))
    nearest: dict[int, tuple[int, int, int, int]] = {}  # layer a -> (the nearest layer b > a, entries, address)
    active: list[tuple[int, int]] = []  # (end, entry) of spans that may reach the next start
    for start, end, i in spans:
        active = [(e, j) for e, j in active if e > start]
        for _e, j in active:
            if not rows_clash(values[j], _e, start, end, rows):
                continue  # interleaved by design: rows of the two entries never meet
            address = first_shared(values[j], start, rows)
            first, second = sorted((i, j))
            la, lb = _entry_layer(first, dst_geo), _entry_layer(second, dst_geo)
            if la is None or lb is None or la == lb:
                raise OverlapError(_clash_message(dst, dst_geo, first, second, address))
            la, lb = min(la, lb), max(la, lb)
            if la not in nearest or lb < nearest[la][0]:
                nearest[la] = (lb, first, second, address)
        active.append((end, i))
    # per layer a only its nearest clashing layer b: a launch over [a, b] holds every farther one too
    return tuple((la, lb, _clash_message(dst, dst_geo, first, second, start))
                 for la, (lb, first, second, start) in sorted(nearest.items()))


def entry_spans(table: PointerTable[DeviceAlias]) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` byte ranges, in the domain of tensors' ``data_ptr()``, of what
    ``table``'s entries address: each entry holds exactly its layout's bytes (as in
    :func:`entry_clashes`) from where it starts
    (:meth:`~pointerdomain.registration.tables.PointerTable.entry_addresses`). For a table
    built from raw addresses, which keeps no storages to say where its memory lies."""
    return tuple((a, a + n) for a, n in zip(table.entry_addresses(), table.sizes))


def _clash_message(dst: PointerTable[DeviceAlias], geo: Geometry, first: int, second: int, address: int) -> str:
    return (
        f"dst table {describe(dst)}: {_entry_name(first, geo)} and {_entry_name(second, geo)} share memory (bytes "
        f"from {address:#x}): the launch would write those bytes twice, in no defined order (a race on a GPU), so "
        "which item lands is chance; nothing was copied. Fix: give K and V and every layer their own buffers"
    )


def check_layers(clashes: tuple[LayerClash, ...], layer_begin: int, layer_count: int) -> None:
    """Rule 0 for one launch over layers ``[layer_begin, layer_begin + layer_count)``:
    none of the plan's :func:`entry_clashes` has both layers in that range.

    Raises:
        OverlapError: the launch addresses two destination entries that share memory.
    """
    end = layer_begin + layer_count
    for la, lb, message in clashes:
        if layer_begin <= la and lb < end:
            raise OverlapError(message)


def shared_memory(
    src: PointerTable[DeviceAlias], src_geo: Geometry, dst: PointerTable[DeviceAlias], dst_geo: Geometry
) -> bool:
    """True when ``src`` and ``dst`` are the same memory with the same geometry (rule 2).

    Raises:
        OverlapError: their memory intersects with different geometries (rule 3).
    """
    a = [(v, v + n) for v, n in zip(src.raw_values(), src.sizes)]
    b = [(v, v + n) for v, n in zip(dst.raw_values(), dst.sizes)]
    if not _intersect(a, b):
        return False
    if src.raw_values() == dst.raw_values() and src.sizes == dst.sizes and src_geo == dst_geo:
        return True
    raise OverlapError(
        f"src table {describe(src)} and dst table {describe(dst)} intersect in memory but address it differently (another "
        "layout or entry split): a launch would read bytes it also writes, in no defined order. Fix: copy "
        "through a separate buffer, or use one table with one layout for moves inside a pool"
    )


def check_slots(src_idx: torch.Tensor, dst_idx: torch.Tensor, capturing: bool) -> None:
    """Rule 2 for one launch: no slot is both a source and a destination.

    Raises:
        OverlapError: a slot is in both sets, or the check cannot run (graph capture).
    """
    if src_idx.numel() == 0:
        return
    if capturing:
        raise OverlapError(
            "src and dst are the same memory: the slot sets must be checked for overlap on the host, which "
            "cannot happen during CUDA graph capture. Fix: capture copies between different pools only"
        )
    hit = torch.isin(src_idx, dst_idx)
    if bool(hit.any()):
        slot = int(src_idx[hit][0])
        raise OverlapError(
            f"slot {slot} is both read (src_indices) and written (dst_indices) in one launch over the same "
            "memory: slot pairs run in no defined order, so the result would depend on it. Fix: split the "
            "launch so no slot is read and written in one call, or copy through a second buffer"
        )


def check_distinct_destinations(dst_idx: torch.Tensor, dst_list: list[int] | None = None) -> None:
    """No destination slot is written twice in one launch: slot pairs run in parallel
    on the GPU, so two writes to one slot race and either may land. Runs where the
    indices are read on the host anyway (:func:`pointerdomain.transfer.plan` range checks);
    elsewhere a validation pass on the device ahead of the copy refuses the launch
    (:mod:`pointerdomain.transfer.launch_errors`).
    ``dst_list``: the indices already read into a list (small CPU sets).

    Raises:
        OverlapError: a slot appears twice in ``dst_indices``, naming it.
    """
    n = len(dst_list) if dst_list is not None else dst_idx.numel()
    if n < 2:
        return
    if dst_list is not None:
        if len(set(dst_list)) == n:
            return
        seen: set[int] = set()
        slot = -1
        for slot in dst_list:
            if slot in seen:
                break
            seen.add(slot)
    else:
        ordered = torch.sort(dst_idx).values
        twice = ordered[1:] == ordered[:-1]
        if not bool(twice.any()):
            return
        slot = int(ordered[1:][twice][0])
    raise OverlapError(
        f"dst_indices: slot {slot} is written twice in one launch: slot pairs run in no defined order (in parallel "
        "on a GPU), so which write lands is a race. Fix: give each destination slot once per call"
    )
