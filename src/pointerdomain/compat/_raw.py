"""Raw addresses from an engine's call, resolved and checked before any launch.

The engines' own transfer calls take buffer tensors and raw ``uint64`` / ``int64``
address tables built from ``data_ptr()``. A kernel must never read a host VA (it faults
with error 700 where the alias differs: MI355X, WSL2, strict alias mode), and must never
read past the memory an entry points into. Here every raw entry is looked up before
anything runs:

* inside a registration of this library (:func:`pointerdomain.find_registration`): the
  registration must be open and on the launch's device type; the entry becomes the
  device alias of the same byte, and its reach is bounded by its registration chunk
  (separately registered chunks are not contiguous in the alias space);
* inside host memory the runtime pinned for someone else (torch's ``pin_memory()``,
  ``cudaHostAlloc``, another library's ``cudaHostRegister``): asked of the runtime
  (:func:`pointerdomain._platform.pointer_info`), translated to its alias, bounded by the
  runtime's allocation range;
* device memory: must be memory of the launch's device, bounded by its allocation (for
  torch's caching allocator that is the segment, which may hold other tensors: a raw
  address cannot say more);
* anything else (an unregistered host VA, an alias handed in where a host VA belongs,
  a freed or made-up address) is a typed error naming the table, the entry and the
  address, before anything is written.

Resolutions are cached (a pool's tables are built once and reused on every call):
buffer tensor lists by the tensors' identity and addresses, raw tables by the table
tensor's identity, its version counter (bumped by every in-place write through torch),
its device and the reach asked. A cached table whose registration was closed is
rebuilt (and so refused). Device memory freed under a cached table is seen where the
backend counts its releases (:func:`pointerdomain._platform.memory_generation`: the
emulated device; CUDA's caching allocator frees without the driver seeing it): every
cached look-up compares that count with the one its entries were checked at, and when it
moved the entries whose device regions no longer hold are dropped
(:func:`memory_current`). Not seen: a raw table rewritten behind torch's back (a kernel
writing its memory), pinned host memory freed and reused at the same address, or on CUDA
a block freed and reused inside a live segment; the typed API
(:func:`pointerdomain.make_kernel_ptr_table`) keeps its tensors alive and has none of
these gaps.

Prepared calls: an engine repeats one call shape with the same buffers and tables, only the
indices new. The call shapes keep each call's checked translation (tables, layouts, slot
counts), keyed by :func:`view_key` for buffer arguments and :func:`table_key` for raw
tables plus the scalar arguments (ints typed as ints: ``True`` is not the ``1`` of a
cached call), and a repeat goes straight to the direct launch
(:func:`pointerdomain.transfer_kv_all_layer` / ``_per_layer``), which checks the indices
(dtype, shape, device, lengths, range, overlap with the destination) and the tables'
liveness (open registrations, storages in place) as it does for every caller. Whatever
that launch refuses before writing (an ``IndexValidationError``) runs the call's full
path, which names the argument in its own words or accepts what the call shape accepts
beyond the direct API (``int32`` indices, LMCache's negative slots). A key sees what the
raw-table cache sees, and no more.

Before that key is built, a repeat is looked up by its arguments' identity (:class:`Seen`:
the call shape, the ``id`` of each tensor argument, the scalars), the entry holding those
tensors so that no other object can take their ``id``; it holds when every tensor is at
the same ``data_ptr()`` with the same version counter, or, for a buffer only (whose
contents change on every step), written since but of the same shape and strides
(:func:`seen_again`). A constant amount of work per call, no hashing of shapes. Not seen by
it: ``.data = t.view(...)``, which changes a buffer's shape without moving its data pointer
or its version (the repeat moves the bytes it was prepared for, inside the same storage).
Tensors an engine makes anew per call (``k_buffer[layer_id]``) are not kept by identity
(they would only churn the cache): those calls keep the memory key.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from pointerdomain.arguments import describe
from pointerdomain import _platform
from pointerdomain._platform.liveness import tensors_words
from pointerdomain._platform import memory_generation, pointer_info
from pointerdomain.registration.allocation import memory_device
from pointerdomain.devices import Device
from pointerdomain.layouts import KVLayout
from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain.errors import (
    ClosedError,
    DeviceMismatchError,
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    NotRegisteredError,
    OverlapError,
    PointerDomainError,
    RegistrationSpanError,
    with_address,
)
from pointerdomain.registration.memory import RegisteredHostMemory, find_closed_registration, find_registration
from pointerdomain.registration.resolve import alias_of
from pointerdomain.registration.tables import PointerTable, make_kernel_ptr_table, resolved_kernel_table

__all__ = [
    "addresses_table",
    "held",
    "met_again",
    "remember_seen",
    "seen_again",
    "is_split",
    "split_chunked",
    "unsplit",
    "Seen",
    "plain_tensor",
    "remember",
    "carry_chunked",
    "clear_cache",
    "disjoint_buffers",
    "entry_gap",
    "memory_current",
    "memory_device_of",
    "owned_cache",
    "resolve_addresses",
    "resolved_table",
    "table_key",
    "tensor_table",
    "view_key",
]

_MASK = (1 << 64) - 1
_SIGN = 1 << 63
#: Distinct buffer lists / raw tables remembered (least recently used dropped first).
#: A cached buffer table keeps its tensors alive, so the bound also bounds what it holds.
CACHE_SIZE = 64

_lock = threading.Lock()


def _i64(x: int) -> int:
    """The int64 bit pattern of an unsigned 64-bit value (``2**64`` reads as 0)."""
    x &= _MASK
    return x - (1 << 64) if x & _SIGN else x


def _named(name: str, exc: PointerDomainError) -> PointerDomainError:
    """``exc`` with ``name`` in front of its message (same type, same address)."""
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith(name):
        exc.args = (f"{name}: {exc.args[0]}", *exc.args[1:])
    return exc


def plain_tensor(name: str, t: object) -> torch.Tensor:
    """``t`` if it is a dense (strided) tensor with memory behind it: sparse, meta and other
    layouts have no ``data_ptr()`` a copy could use.

    Raises:
        InvalidTypeError: not a torch.Tensor, a sparse or other non-strided layout, or a meta tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name}: found a {type(t).__name__}, expected a torch.Tensor")
    if t.layout is not torch.strided or t.is_meta:
        kind = "a meta tensor" if t.is_meta else f"a {t.layout} tensor"
        raise InvalidTypeError(f"{name}: found {kind}, expected a dense tensor in memory (torch.strided). "
                               "Fix: pass the buffer itself (.to_dense() makes a copy)")
    return t


def memory_device_of(name: str, t: object) -> Device | None:
    """The device whose memory holds tensor ``t`` (a CUDA or emulated device), or None
    for host memory.

    Raises:
        InvalidTypeError: ``t`` is not a dense torch.Tensor (see :func:`plain_tensor`).
    """
    return memory_device(plain_tensor(name, t))


# -- buffer tensors -------------------------------------------------------------------

class _TensorEntry(NamedTuple):
    refs: tuple[weakref.ref[torch.Tensor], ...]
    table: PointerTable[DeviceAlias]


_by_identity: OrderedDict[tuple[object, ...], _TensorEntry] = OrderedDict()
_by_memory: OrderedDict[tuple[object, ...], PointerTable[DeviceAlias]] = OrderedDict()


#: the compat modules' own caches (prepared calls, derived tables), cleared with the rest
_owned: list[OrderedDict[Any, Any]] = []


def owned_cache() -> OrderedDict[Any, Any]:
    """A new bounded cache (see :func:`remember`) that :func:`clear_cache` empties too."""
    cache: OrderedDict[Any, Any] = OrderedDict()
    _owned.append(cache)
    return cache


def remember(cache: OrderedDict[Any, Any], key: object, value: object, limit: int = CACHE_SIZE) -> None:
    """Put ``key`` last in the bounded cache (the caller holds its lock); the oldest
    entries beyond ``limit`` are dropped. The one eviction rule of the compat caches."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


def _open(table: PointerTable[DeviceAlias]) -> bool:
    owners = table.registrations()
    return not owners or not any(owner.closed for owner in owners)


def resolution_holds(table: PointerTable[DeviceAlias]) -> bool:
    """True while what ``table`` was resolved against is unchanged: its registrations open
    and each device-memory range still one allocation of its device (not of another). A cache keyed by
    address values re-resolves otherwise: the same numbers may name new memory, and the
    aliases of a new registration differ from the old one's."""
    if not _open(table):
        return False
    for lo, hi, kind in table.resolved_regions():
        if kind == "device":
            info = pointer_info(table.device, lo)
            if (info is None or info.kind != "device" or not info.start <= lo < hi <= info.start + info.size
                    or info.ordinal != table.device.ordinal):
                return False  # freed, or the same numbers now another device's memory
    return True


#: :func:`pointerdomain._platform.memory_generation` when the cached resolutions were last
#: found to hold (-1: never checked)
_checked_generation = -1


def memory_current() -> bool:
    """Called by every cached compat look-up before it trusts a cached resolution: when
    device memory was released since the last check (the backend's release count moved),
    every cache entry holding a table resolved from raw addresses is dropped, so the call
    resolves its tables anew and refuses a freed entry (or an address now an allocation too
    small for it) with a typed error before anything is written. One native call when nothing was released. False when entries were
    dropped (an entry the caller already holds is then not to be used)."""
    if _platform.generation_count() == _checked_generation:
        return True
    return _recheck()


def _tables_in(value: object, out: list[PointerTable[DeviceAlias]], depth: int = 0) -> None:
    """The tables inside a cache entry (tuples, named tuples, lists, :class:`Seen`)."""
    if isinstance(value, PointerTable):
        out.append(value)
    elif isinstance(value, Seen):
        _tables_in(value.value, out, depth + 1)
    elif isinstance(value, (tuple, list)) and depth < 6:
        for item in value:
            if not isinstance(item, torch.Tensor):
                _tables_in(item, out, depth + 1)


def _recheck() -> bool:
    global _checked_generation
    with _lock:
        generation = memory_generation()  # before the look-ups: a free during them moves it again
        # Every entry holding a table resolved from raw addresses is dropped, not looked up
        # again: a look-up per entry made each call after a free cost the whole cache (a
        # process that frees between calls paid it on every call); a dropped entry costs one
        # resolution on its next use, which checks everything afresh.
        dropped = False
        for cache in (_raw_cache, *_owned):
            for key, value in list(cache.items()):
                found: list[PointerTable[DeviceAlias]] = []
                _tables_in(value, found)
                if any(table.resolved_regions() for table in found):
                    del cache[key]
                    dropped = True
        _checked_generation = generation
    return not dropped


def _same(refs: tuple[weakref.ref[torch.Tensor], ...], items: tuple[torch.Tensor, ...]) -> bool:
    for r, t in zip(refs, items):
        if r() is not t:
            return False
    return True


def tensor_table(name: str, tensors: Sequence[torch.Tensor], device: Device, *,
                 across_chunks: bool = False) -> PointerTable[DeviceAlias]:
    """:func:`pointerdomain.make_kernel_ptr_table` over ``tensors`` for ``device``, cached:
    the same tensor objects (or, failing that, tensors over the same bytes of the same
    storages) give the same table, so a call shape that passes a pool's buffers on every
    call pays for the checks once.

    Args:
        name: the parameter(s) the tensors came from, for error messages.
        tensors: contiguous, non-empty buffers (registered host memory or device memory of
            ``device``), in table order.
        device: the launch device.
        across_chunks: also take a buffer that spans several chunks of one registration (a
            pool registered in chunks of ``max_chunk_bytes``); the caller must launch the
            table only through :func:`split_chunked` (the compat ``Side``), which gives each
            block its own chunk's alias. False: such a buffer is refused.

    Raises:
        InvalidTypeError: an item is not a tensor; and every error of
            :func:`pointerdomain.make_kernel_ptr_table`, its message starting with ``name``.
    """
    table = _tensor_table(name, tuple(tensors), device)
    if _chunked and not across_chunks and table in _chunked:
        try:  # the plain table's own refusal, in its words
            make_kernel_ptr_table(list(tensors), device)
        except PointerDomainError as exc:
            raise _named(name, exc) from None
    return table


def _tensor_table(name: str, items: tuple[torch.Tensor, ...], device: Device) -> PointerTable[DeviceAlias]:
    for i, t in enumerate(items):
        plain_tensor(f"{name}[{i}]", t)
    # The tensor's base, not the tensor: a call shape that passes pool.buffer[0] makes a new
    # view every call. Same base object (alive: weak reference), same bytes, same contiguity
    # = the same buffer; a base moved to another storage (set_) no longer holds that view's
    # bytes, but the view (and the cached table) still point at the old storage it keeps.
    bases = tuple(t if t._base is None else t._base for t in items)
    fast = (device, *[(id(b), t.data_ptr(), t.nbytes, t.is_contiguous()) for b, t in zip(bases, items)])
    entry = _by_identity.get(fast)  # a dict read is atomic under the GIL; writes take the lock
    if entry is not None and _same(entry.refs, bases) and _open(entry.table):
        return entry.table
    storages = [t.untyped_storage() for t in items]
    slow: tuple[object, ...] = (device, *(
        (t.data_ptr(), t.nbytes, t.is_contiguous(), st.data_ptr(), st.nbytes()) for t, st in zip(items, storages)))
    with _lock:
        table = _by_memory.get(slow)
        if table is not None and not (_open(table) and table.storages_intact()):
            del _by_memory[slow]
            table = None
    if table is None:
        try:
            table = make_kernel_ptr_table(list(items), device)
        except RegistrationSpanError as exc:
            table = _across_chunks(items, device)
            if table is None:
                raise _named(name, exc) from None
        except PointerDomainError as exc:
            raise _named(name, exc) from None
    with _lock:
        remember(_by_memory, slow, table)
        remember(_by_identity, fast, _TensorEntry(tuple(weakref.ref(b) for b in bases), table))
    return table


# -- buffers registered in several chunks ----------------------------------------------------

class _Multi(NamedTuple):
    """A table entry over several chunks of one registration: its device alias is that of
    its first chunk only (each chunk has its own alias base where the aliases differ from
    the host VAs), so the table is not launched as it is (:func:`split_chunked`)."""

    entry: int
    host: int  # the host VA of the entry's first byte
    owner: RegisteredHostMemory


#: tables holding entries over several chunks, and those entries
_chunked: weakref.WeakKeyDictionary[PointerTable[DeviceAlias], tuple[_Multi, ...]] = weakref.WeakKeyDictionary()
#: the per-block form of such a table, for each layout it was launched with
_splits: weakref.WeakKeyDictionary[PointerTable[DeviceAlias], dict[KVLayout, PointerTable[DeviceAlias]]] = (
    weakref.WeakKeyDictionary())


def _across_chunks(items: Sequence[torch.Tensor], device: Device) -> PointerTable[DeviceAlias] | None:
    """The table of ``items`` when the only thing :func:`make_kernel_ptr_table` refused is
    that a buffer spans several chunks of one registration (a pool registered in chunks of
    ``max_chunk_bytes``, 64 GiB by default): each item contiguous host memory inside one open
    registration for ``device``'s type, or memory the plain table takes. None otherwise (the
    caller raises the original error)."""
    values: list[int] = []
    addresses: list[int] = []
    owners: list[RegisteredHostMemory] = []
    marks: list[_Multi] = []
    for i, t in enumerate(items):
        nbytes = t.numel() * t.element_size()
        owner = None
        if t.is_cpu and memory_device(t) is None and t.is_contiguous() and nbytes > 0:
            owner = find_registration(HostVA.unsafe_from_int(t.data_ptr()), nbytes)
        if owner is not None and len(owner.chunks) > 1 and not owner.closed and owner.device.same_type(device):
            va = HostVA.unsafe_from_int(t.data_ptr())
            values.append(alias_of(owner.chunk_of(va, 1).host_va, device).value + (
                va.value - owner.chunk_of(va, 1).host_va.value))
            marks.append(_Multi(i, va.value, owner))
        else:
            try:
                one = make_kernel_ptr_table([t], device)
            except PointerDomainError:
                return None
            values.append(one.raw_values()[0])
            owner = next(iter(one.registrations()), None)
            if owner is None:
                return None  # device or runtime-pinned memory beside a chunked buffer: not handled here
        if all(o is not owner for o in owners):
            owners.append(owner)
        addresses.append(t.data_ptr())
    if not marks:
        return None
    table = resolved_kernel_table(values, [t.numel() * t.element_size() for t in items], device, owners, (),
                                  addresses)
    _chunked[table] = tuple(marks)
    return table


#: each per-block table (:func:`split_chunked`) and the table it was made from
_unsplit: weakref.WeakKeyDictionary[PointerTable[DeviceAlias], PointerTable[DeviceAlias]] = weakref.WeakKeyDictionary()


def is_split(table: PointerTable[DeviceAlias]) -> bool:
    """True for a per-block table made by :func:`split_chunked`."""
    return bool(_unsplit) and table in _unsplit


def unsplit(table: PointerTable[DeviceAlias]) -> PointerTable[DeviceAlias]:
    """The table a per-block table was made from (entries as the caller gave them, for
    checks that compare the caller's buffers), or ``table`` itself."""
    return _unsplit.get(table, table) if _unsplit else table


def _chunk_bases(owner: RegisteredHostMemory, device: Device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chunk of ``owner``: its host start, end and device alias (int64, in order)."""
    chunks = sorted(owner.chunks, key=lambda c: c.host_va.value)
    return (torch.tensor([c.host_va.value for c in chunks], dtype=torch.int64),
            torch.tensor([c.host_va.value + c.nbytes for c in chunks], dtype=torch.int64),
            torch.tensor([_i64(alias_of(c.host_va, device).value) for c in chunks], dtype=torch.int64))


def carry_chunked(table: PointerTable[DeviceAlias], sources: Sequence[tuple[PointerTable[DeviceAlias], int]]) -> None:
    """Mark the entries of ``table`` (made from entry ``k`` of table ``t`` for each ``(t, k)``
    in ``sources``, in order) that span several chunks, as their sources were."""
    if not _chunked:
        return
    marks = []
    for i, (src, k) in enumerate(sources):
        for m in _chunked.get(src, ()):
            if m.entry == k:
                marks.append(_Multi(i, m.host, m.owner))
    if marks:
        _chunked[table] = tuple(marks)


def split_chunked(table: PointerTable[DeviceAlias], layout: KVLayout) -> PointerTable[DeviceAlias]:
    """``table`` itself, or, when an entry spans several chunks of a registration, the same
    memory as the finest-needed table ``layout`` allows (one entry per kv, layer or page
    block: :meth:`pointerdomain.KVLayout.table_splits`) in which every entry lies in one
    chunk and has that chunk's own device alias. Cached per table and layout.

    Raises:
        RegistrationSpanError: even a page block of ``layout`` crosses a chunk boundary (the
            registration was not cut on this layout's page blocks).
    """
    if not _chunked:
        return table
    marks = _chunked.get(table)
    if marks is None:
        return table
    done = _splits.get(table)
    if done is not None and layout in done:
        return done[layout]
    n = len(table)
    splits = layout.table_splits()
    if n not in splits:
        return table  # the launch refuses the table's length for this layout
    device = table.device
    marked = {m.entry: m for m in marks}
    bases = {id(m.owner): _chunk_bases(m.owner, device) for m in marks}
    if all(bool(((aliases - starts) == aliases[0] - starts[0]).all()) for starts, _, aliases in bases.values()):
        # every chunk at one offset from its host VAs (CUDA's UVA: the alias is the VA): the
        # first chunk's alias holds for the whole registration, the table as it is
        with _lock:
            _splits.setdefault(table, {})[layout] = table
        return table
    for m_len in (k for k in splits if k > n and k % n == 0):
        per = m_len // n
        if any(size % per for size in table.sizes):
            continue
        steps = torch.arange(per, dtype=torch.int64)
        values: list[torch.Tensor] = []
        for i, (value, size) in enumerate(zip(table.raw_values(), table.sizes)):
            block = size // per
            mark = marked.get(i)
            if mark is None:
                values.append(_i64(value) + steps * block)
                continue
            starts, ends, aliases = bases[id(mark.owner)]
            host = mark.host + steps * block  # host VAs fit int64 (user space)
            k = torch.searchsorted(starts, host, right=True) - 1
            if bool((host + block > ends[k]).any()):
                break  # a block crosses a chunk boundary: try finer blocks
            values.append(aliases[k] + (host - starts[k]))
        else:
            sizes = [size // per for size in table.sizes for _ in range(per)]
            addresses = [address + j * (size // per) for address, size in zip(table.entry_addresses(), table.sizes)
                         for j in range(per)]
            split = resolved_kernel_table([v & _MASK for v in torch.cat(values).tolist()], sizes, device,
                                          table.registrations(), table.resolved_regions(), addresses)
            with _lock:
                _splits.setdefault(table, {})[layout] = split
                _unsplit[split] = table
            return split
    first = marks[0]
    raise with_address(RegistrationSpanError(
        f"entry {first.entry}: the buffer at {first.host:#x} lies in a registration of {len(first.owner.chunks)} "
        f"chunks, and a page block of this call's layout ({layout.page_block_bytes()} bytes) crosses a chunk "
        "boundary: each chunk has its own device alias, so no table entry can address it. Fix: register the pool "
        "with a granularity that is a multiple of the page block (HostKVPool cuts on its own page blocks), or a "
        "larger max_chunk_bytes"), first.host)


# -- prepared-call keys -------------------------------------------------------------------

def view_key(t: torch.Tensor) -> tuple[object, ...]:
    """What makes a buffer argument the same buffer as on a call before, for the prepared-call
    caches: the bytes it covers and how it describes them (address, shape, strides, dtype),
    not the tensor object (a call shape may pass a new view of a pool's buffer each call).
    Sound because the cache entry keeps that memory alive (its tables hold their tensors,
    :func:`held` the arguments), so no other allocation can take the address while the
    entry lives, and the launch checks that the storages are still in place. Raises for a
    non-tensor or a tensor without memory (the caller then takes its full path)."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def table_key(t: torch.Tensor) -> tuple[int, int, int]:
    """What makes a raw address table the same table with the same contents: the object, its
    version counter (bumped by every in-place torch write, ``set_`` and ``resize_`` included;
    shared with its views) and its address. Raises for an inference tensor, which has no
    counter (the caller then takes its full path). Checks first that no cached resolution
    was freed since (:func:`memory_current`): a key names what the raw-table cache holds."""
    memory_current()
    return (id(t), t._version, t.data_ptr())


def held(*ts: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """What a prepared-call cache entry keeps alive: the argument tensors its key names (a
    raw table's ``id`` must not be reused; a buffer's memory must stay where the key says)."""
    return tuple(t for t in ts if t is not None)


# -- prepared calls found by their arguments' identity ----------------------------------------

class Seen:
    """A prepared call as last seen with these argument objects (:func:`seen_again`).

    It holds the argument tensors themselves (as a prepared call holds its own: while the
    entry lives no other object can have their ``id``, so a key of ids that matches names
    these very objects), and per tensor the ``data_ptr()`` and version counter last checked
    and the shape and strides; ``tables`` marks the raw address tables, whose
    contents (their version) count, among buffers, whose contents do not."""

    __slots__ = ("tensors", "ptrs", "versions", "shapes", "strides", "tables", "value", "_words", "_spare",
                 "unchanged")

    def __init__(self, tensors: Sequence[torch.Tensor], tables: Sequence[bool], value: object) -> None:
        self.tensors = tuple(tensors)
        #: True while no tensor moved or was written since it was checked (one native call:
        #: the words behind each tensor's data pointer and version, :func:`tensors_words`);
        #: None where they cannot be read (the caller asks torch)
        self.unchanged: Callable[[], bool] | None = None
        #: (write, compare) of the spare copy of those words, then of the one in use
        self._spare: tuple[tuple[Callable[[], bool], Callable[[], bool]], ...] = ()
        self._words: torch.Tensor | None = None
        native = tensors_words()
        if native is not None:  # the words first: a change before the reads below makes them differ
            n = len(self.tensors)
            self._words = torch.empty(10 * n, dtype=torch.uint64)  # two copies of 5 words a tensor
            first = int(self._words.data_ptr())
            sides = [(functools.partial(native, self.tensors, at, False), functools.partial(native, self.tensors, at, True))
                     for at in (first + 40 * n, first)]
            if sides[1][0]():
                self.unchanged = sides[1][1]
                self._spare = tuple(sides)
        self.ptrs = tuple(t.data_ptr() for t in tensors)
        self.versions = tuple(int(t._version) for t in tensors)
        self.shapes = tuple(t.shape for t in tensors)
        self.strides = tuple(t.stride() for t in tensors)
        self.tables = tuple(tables)
        self.value = value

    def snap(self) -> bool:
        """Write the tensors' words now into the spare copy, before the caller checks them
        with torch's queries (so a change during those checks makes the copy differ)."""
        return bool(self._spare) and self._spare[0][0]()

    def adopt(self, snapped: bool) -> None:
        """The tensors passed the checks: :attr:`unchanged` compares with the copy :meth:`snap`
        wrote (or is None where it wrote none)."""
        if not self._spare:
            return
        spare, used = self._spare
        self.unchanged = spare[1] if snapped else None
        self._spare = (used, spare)


def seen_again(entry: Seen, tensors: tuple[torch.Tensor, ...]) -> bool:
    """True when ``tensors`` (the objects ``entry`` was made from: its key holds their ids,
    and the entry keeps them alive) still are what the entry was checked for: each at the
    same ``data_ptr()`` (``set_()``, ``.data = other``: other memory) with its version
    counter unchanged (no in-place write, ``set_``, ``resize_`` or in-place view op since);
    or, for a buffer only, written since (an engine writes its KV cache every step) but of
    the same shape and strides (what an in-place op can change; its dtype cannot change
    without ``.data =``, which no counter sees). A constant amount of work per argument:
    two attribute reads while nothing moved, no hashing of shapes. False, too, when device
    memory a cached resolution names was freed since (:func:`memory_current`)."""
    if _platform.generation_count() != _checked_generation and not _recheck():  # memory_current, inlined
        return False
    unchanged = entry.unchanged  # entry.tensors are these objects (the key's ids, held by the entry)
    if unchanged is not None and unchanged():
        return True
    snapped = entry.snap()  # (before the reads below)
    n = len(tensors)
    if n == 2:
        a, b = tensors
        if (a.data_ptr(), b.data_ptr()) != entry.ptrs:
            return False
        versions: tuple[int, ...] = (a._version, b._version)
    elif n == 4:
        a, b, c, d = tensors
        if (a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr()) != entry.ptrs:
            return False
        versions = (a._version, b._version, c._version, d._version)
    else:
        if tuple(t.data_ptr() for t in tensors) != entry.ptrs:
            return False
        versions = tuple(t._version for t in tensors)
    if versions == entry.versions:
        return True
    for t, v, was, table, shape, strides in zip(tensors, versions, entry.versions, entry.tables, entry.shapes,
                                                 entry.strides):
        # a raw table written: its addresses are resolved again; a buffer: what it is must hold
        if v != was and (table or t.shape != shape or t.stride() != strides):
            return False
    entry.versions = versions  # the buffers are still the same buffers
    entry.adopt(snapped)
    return True


def met_again(tensors: Sequence[object], held: Sequence[object], last: list[tuple[object, ...]]) -> bool:
    """After a memory-keyed hit of a prepared call: True when ``tensors`` are the objects
    it holds (``held``) or the objects of its previous memory-keyed hit (``last[0]``): an
    engine's own tensors, met again, worth keeping by identity (:func:`remember_seen`).
    Otherwise they become ``last[0]``, kept alive there, so their ids stay taken: a view
    an engine makes anew on every call never matches, and never churns the identity cache."""
    prev, last[0] = last[0], tuple(tensors)
    first = tensors[0]
    if first is not held[0] and (not prev or first is not prev[0]):
        return False  # the common miss, cheaply: callers put the argument an engine makes anew first
    for known in (held, prev):
        if len(known) == len(tensors):
            for x, y in zip(tensors, known):
                if x is not y:
                    break
            else:
                return True
    return False


def remember_seen(cache: OrderedDict[Any, Any], key: object, tensors: Sequence[torch.Tensor | None],
                  tables: Sequence[bool], value: object) -> None:
    """Keep ``value`` (a prepared call) under ``key`` (the call shape, its arguments' ids
    and scalars) for :func:`seen_again`; ``tables`` marks the raw address tables among
    ``tensors`` (None entries are left out of both). An inference tensor (no version
    counter) is not kept."""
    kept = [(t, tab) for t, tab in zip(tensors, tables) if t is not None]
    try:
        entry = Seen([t for t, _ in kept], [tab for _, tab in kept], value)
    except RuntimeError:  # an inference tensor: no version counter
        return
    with _lock:
        remember(cache, key, entry, 2 * CACHE_SIZE)


# -- destination tables ---------------------------------------------------------------

def disjoint_buffers(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Refuse destination buffers (one per table entry, each written from its start) whose
    bytes overlap: two entries would write the same bytes, a race on a GPU (the direct API
    refuses a slot written twice; this is one slot through two entries).

    Raises:
        OverlapError: two of ``tensors`` share a byte.
    """
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, i) for i, t in enumerate(tensors))
    for (a, a_end, i), (b, _b_end, j) in zip(spans, spans[1:]):
        if b < a_end:
            raise with_address(OverlapError(
                f"{names[i]} [{a:#x}, {a_end:#x}) and {names[j]} (from {b:#x}) share memory: a copy would write those "
                "bytes twice (the order decides which wins). Fix: give every layer (and K and V) its own buffer"), b)


def entry_gap(name: str, tables: Sequence[PointerTable[DeviceAlias]], *, same_ok: bool = False) -> int | None:
    """The least distance in bytes between two entries of ``tables`` (one side's raw
    tables, K and V together), or None for a single entry: the most one entry's buffer can
    hold without running into another's. A raw address says where a buffer starts, not
    where it ends, so a side's slot count is held to this as well as to its allocation.
    ``same_ok``: entries at one address are one buffer named twice (a source side that
    only reads it: layers sharing a cache), measured to the next distinct entry.

    Raises:
        OverlapError: two entries at the same address (unless ``same_ok``).
    """
    # aliases of entries in different chunks are not comparable: such tables by host address
    across = bool(_chunked) and any(t in _chunked for t in tables)
    values = sorted((v, k, i) for k, t in enumerate(tables)
                    for i, v in enumerate(t.entry_addresses() if across else t.raw_values()))
    gap: int | None = None
    for (a, ka, ia), (b, kb, ib) in zip(values, values[1:]):
        if a == b and same_ok:
            continue
        if a == b:
            raise with_address(OverlapError(
                f"{name}: entry {ia} of table {ka} and entry {ib} of table {kb} are the same address {a:#x}: a copy "
                "would write those bytes twice (the order decides which wins). Fix: give every layer (and K and V) "
                "its own buffer"), a)
        gap = b - a if gap is None else min(gap, b - a)
    return gap


def row_cap(tables: Sequence[PointerTable[DeviceAlias]], stride: int, row: int) -> int | None:
    """The most rows (``row`` bytes every ``stride`` bytes from each entry's address) every
    entry of ``tables`` (one side's raw tables, K and V together) holds before one of its
    rows meets a row of a later entry, or None where no two entries' rows ever meet (one
    entry, or rows that interleave by design: :func:`~pointerdomain.transfer.overlap.rows_clash`).
    A raw address says where a buffer starts, not where it ends, so a destination side's
    rows are held to this as well as to its allocation. 0: two entries' first rows meet."""
    across = bool(_chunked) and any(t in _chunked for t in tables)
    values = sorted(v for t in tables for v in (t.entry_addresses() if across else t.raw_values()))
    if len(values) < 2:
        return None
    v = torch.tensor([x - values[0] for x in values], dtype=torch.int64)
    d = v[None, :] - v[:, None]  # d[i, j]: how far entry j starts after entry i
    off = d % stride
    meet = (d >= 0) & ((off < row) | (off > stride - row))
    meet.fill_diagonal_(False)
    if not bool(meet.any()):
        return None
    return max(0, (int(d[meet].min()) - row) // stride + 1)


# -- raw addresses ---------------------------------------------------------------------

class _Span(NamedTuple):
    """One allocation a raw address lies in: ``[start, end)`` in the caller's domain."""

    start: int
    end: int
    #: the kernel-usable address of ``start`` (the device alias; device memory: itself)
    alias_start: int
    owner: RegisteredHostMemory | None
    device_memory: bool = False


def _span(name: str, addr: int, device: Device) -> _Span:
    """The allocation holding ``addr`` for a launch on ``device``, checked."""
    va = HostVA.unsafe_from_int(addr)
    owner = find_registration(va, 1)
    try:
        if owner is not None:
            owner.check_open()
            if not owner.device.same_type(device):
                raise DeviceMismatchError(
                    f"{addr:#x} lies in memory registered for {owner.device}, but the launch is on {device}")
            chunk = owner.chunk_of(va, 1)
            return _Span(chunk.host_va.value, chunk.host_va.value + chunk.nbytes, alias_of(chunk.host_va, device).value,
                         owner)
        closed = find_closed_registration(va, 1)
        if closed is not None:
            raise ClosedError(
                f"{addr:#x} lies in memory registered at {closed.host_va!r} (+{closed.nbytes} bytes) and that "
                "registration was closed: found a closed registration, expected an open one. Fix: keep it open "
                "while the engine's tables point into it, or register it again and rebuild the table")
        info = pointer_info(device, addr)
        if info is None:
            raise with_address(NotRegisteredError(
                f"{addr:#x} is no memory this process knows: not inside a pointerdomain registration, not host "
                f"memory the runtime pinned, not device memory of {device}. A kernel must not read it (an "
                "unregistered host VA faults with error 700 where the device alias differs from it). Fix: register "
                "the host buffer (pointerdomain.register_host_tensor / HostKVPool) or pass device memory; if the "
                "value is already a device alias (PointerTable.as_uint64_tensor()), pass host VAs (data_ptr())"
            ), addr)
        end = info.start + info.size
        if info.kind == "device":
            if info.ordinal != device.ordinal:
                raise DeviceMismatchError(
                    f"{addr:#x} is device memory of {device.type}:{info.ordinal}, but the launch is on {device}")
            return _Span(info.start, end, info.start, None, True)
        return _Span(info.start, end, alias_of(HostVA.unsafe_from_int(info.start), device).value, None)
    except PointerDomainError as exc:
        raise _named(name, exc) from None


def _check_address_tensor(name: str, ptrs: object, device: Device) -> torch.Tensor:
    if not isinstance(ptrs, torch.Tensor):
        raise InvalidTypeError(
            f"{name}: found a {type(ptrs).__name__}, expected a 1-D uint64 or int64 torch.Tensor of addresses")
    plain_tensor(name, ptrs)
    if ptrs.dtype not in (torch.uint64, torch.int64):
        raise InvalidTypeError(f"{name}: dtype {ptrs.dtype}, expected torch.uint64 or torch.int64 addresses")
    if ptrs.dim() != 1 or ptrs.numel() == 0:
        raise IndexValidationError(f"{name}: shape {tuple(ptrs.shape)}, expected a non-empty 1-D tensor of addresses")
    where = memory_device(ptrs)
    if where is not None and where != device:
        raise DeviceMismatchError(f"{name}: the address table lives in memory of {where}, the launch is on {device}")
    return ptrs


def _reaches(name: str, reach: int | Sequence[int] | None, n: int) -> tuple[int | None, ...]:
    if reach is None:
        return (None,) * n
    values = (reach,) * n if isinstance(reach, int) else tuple(reach)
    if len(values) != n:
        raise InvalidArgumentError(f"{name}: {len(values)} reach values for {n} entries")
    for r in values:
        if type(r) is not int or not 0 < r < _SIGN:
            raise InvalidArgumentError(f"{name}: reach {describe(r)}, expected an int in (0, 2**63) (bytes)")
    return values


class _RawEntry(NamedTuple):
    ref: weakref.ref[torch.Tensor]
    version: int
    data_ptr: int
    table: PointerTable[DeviceAlias]
    #: the entries as resolved, for tensors without a version counter (inference mode)
    values: torch.Tensor | None


#: (id(table tensor), device, reach) -> its last resolution (the weak reference rules out a
#: reused id; a table asked with two reaches keeps both)
_raw_cache: OrderedDict[tuple[int, Device, object, bool], _RawEntry] = OrderedDict()


class _Resolved(NamedTuple):
    aliases: torch.Tensor  # int64 bit patterns, CPU
    sizes: torch.Tensor  # int64, CPU: the reach asked, or what each span holds from its entry on
    owners: tuple[RegisteredHostMemory, ...]
    regions: tuple[tuple[int, int, str], ...]  # alias ranges of the foreign / device spans


def _resolve(name: str, a: torch.Tensor, want: torch.Tensor | None, device: Device,
             marks: list[_Multi] | None = None) -> _Resolved:
    """Every entry of ``a`` (CPU int64 bit patterns) resolved for ``device``, vectorised:
    one lookup per distinct allocation, not per entry. ``want``: bytes each entry must
    reach (int64, > 0), or None (report what its allocation holds from it on). ``marks``
    given: an entry in a registration of several chunks may reach to the registration's
    end, past its chunk's; each such entry is appended to ``marks`` (its alias is its
    chunk's: the table must go through :func:`split_chunked`)."""
    n = a.numel()
    flipped = a ^ _i64(_SIGN)  # signed order of the flipped bits = unsigned order of the addresses
    out = torch.empty(n, dtype=torch.int64)
    have = torch.empty(n, dtype=torch.int64)
    done = torch.zeros(n, dtype=torch.bool)
    owners: list[RegisteredHostMemory] = []
    regions: list[tuple[int, int, str]] = []
    while True:
        left = (~done).nonzero()
        if left.numel() == 0:
            break
        i = int(left[0])
        addr = int(a[i]) & _MASK
        span = _span(f"{name}[{i}]", addr, device)
        inside = (flipped >= _i64(span.start ^ _SIGN)) & (flipped <= _i64((span.end - 1) ^ _SIGN)) & ~done
        room = _i64(span.end) - a  # bytes from each address to the span's end (exact where inside)
        if marks is not None and span.owner is not None and len(span.owner.chunks) > 1:
            owner_end = span.owner.host_va.value + span.owner.nbytes
            reach = _i64(owner_end) - a
            beyond = inside & ((room < want) if want is not None else (reach > room))
            for j in beyond.nonzero().flatten().tolist():
                at = int(a[j]) & _MASK
                if want is None or int(want[j]) <= owner_end - at:
                    marks.append(_Multi(j, at, span.owner))
            room = torch.where(beyond, reach, room)
        if want is not None:
            over = inside & (room < want)
            if bool(over.any()):
                j = int(over.nonzero()[0])
                at = int(a[j]) & _MASK
                raise with_address(RegistrationSpanError(
                    f"{name}[{j}]: {int(want[j])} bytes from {at:#x} run {int(want[j]) - (span.end - at)} bytes past "
                    f"the end of the {'registration chunk' if span.owner is not None else 'allocation'} it lies in "
                    f"[{span.start:#x}, {span.end:#x}). Fix: check the item size, layer count and slot count given"
                ), at)
        out[inside] = a[inside] + _i64(span.alias_start - span.start)  # mod 2**64: aliases may set the top bit
        have[inside] = room[inside]
        done |= inside
        if span.owner is not None:
            if all(o is not span.owner for o in owners):
                owners.append(span.owner)
        else:
            regions.append((span.alias_start, span.alias_start + (span.end - span.start),
                            "device" if span.device_memory else "pinned"))
    return _Resolved(out, have if want is None else want, tuple(owners), tuple(regions))


def _read_addresses(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a CPU int64 tensor of the same bits (a copy: later writes to ``t`` do not
    change what was checked), readable outside inference mode."""
    with torch.inference_mode(False):
        return t.detach().to("cpu", copy=True).view(torch.int64)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for an inference tensor (it has none)."""
    return None if t.is_inference() else int(t._version)


def resolved_table(
    name: str, ptrs: torch.Tensor, device: Device, *, reach: int | Sequence[int] | None = None,
    across_chunks: bool = False,
) -> PointerTable[DeviceAlias]:
    """A kernel table from an engine's raw address table, every entry resolved and checked.

    Args:
        name: the parameter the table came from, for error messages (``f"{name}[{i}]"``).
        ptrs: 1-D ``uint64`` or ``int64`` addresses (``data_ptr()`` values: host VAs of
            registered or runtime-pinned host memory, or device memory of ``device``), on
            the CPU or on ``device`` (read once, then cached: see the module docstring; a
            tensor made in inference mode has no version counter, so its contents are
            compared instead, which for a device table costs a copy to the host per call).
        device: the launch device.
        reach: bytes each entry must cover from its address (one int for all, or one per
            entry); None: each entry's size is what its allocation (or registration chunk)
            holds from its address on, for callers that derive a slot count from it.
        across_chunks: an entry in memory registered in several chunks may reach past its
            chunk, to the end of its registration (and with ``reach`` None its size says
            so); the caller must launch the table only through :func:`split_chunked`.

    Returns:
        A ``PointerTable[DeviceAlias]`` of ``len(ptrs)`` entries, sizes = the reach.

    Raises:
        InvalidTypeError: ``ptrs`` is not a uint64/int64 tensor.
        IndexValidationError: ``ptrs`` is not 1-D or is empty.
        InvalidArgumentError: a reach that is not an int > 0, or of the wrong length.
        DeviceMismatchError: ``ptrs`` or an entry's memory belongs to another device.
        NotRegisteredError: an entry is no memory this process knows.
        ClosedError: an entry lies in a closed registration.
        RegistrationSpanError: an entry's reach runs past its allocation or chunk.
    """
    reach_key = reach if reach is None or isinstance(reach, int) else tuple(reach)
    key = (id(ptrs), device, reach_key, across_chunks)
    memory_current()  # device memory under a cached table freed since: the entry is gone
    entry = _raw_cache.get(key)  # the hit path first: a pool's table, unchanged since the last call
    if entry is not None and entry.ref() is ptrs and entry.data_ptr == ptrs.data_ptr() and _open(entry.table):
        if entry.values is None:
            if entry.version == ptrs._version:
                return entry.table
        elif torch.equal(_read_addresses(ptrs), entry.values):
            return entry.table
    _check_address_tensor(name, ptrs, device)
    reaches = _reaches(name, reach, ptrs.numel())
    version = _version(ptrs)
    values = _read_addresses(ptrs)
    want = None if reaches[0] is None else torch.tensor(reaches, dtype=torch.int64)
    marks: list[_Multi] | None = [] if across_chunks else None
    got = _resolve(name, values, want, device, marks)
    table = resolved_kernel_table([v & _MASK for v in got.aliases.tolist()], got.sizes.tolist(), device, got.owners,
                                  got.regions, [v & _MASK for v in values.tolist()])
    if marks:
        _chunked[table] = tuple(marks)
    with _lock:
        remember(_raw_cache, key,
                  _RawEntry(weakref.ref(ptrs), -1 if version is None else version, ptrs.data_ptr(), table,
                            values if version is None else None))
    return table


def _sizes(name: str, nbytes: torch.Tensor | int, addrs: torch.Tensor) -> torch.Tensor:
    n = addrs.numel()
    if isinstance(nbytes, torch.Tensor):
        if nbytes.dtype not in (torch.int64, torch.uint64) or nbytes.shape != addrs.shape:
            raise InvalidArgumentError(
                f"{name}: sizes of dtype {nbytes.dtype} and shape {tuple(nbytes.shape)}, expected int64 of shape "
                f"{tuple(addrs.shape)}")
        sizes = _read_addresses(nbytes)
        if nbytes.dtype == torch.uint64 and bool((sizes < 0).any()):
            bad = int((sizes < 0).nonzero()[0])
            raise InvalidArgumentError(f"{name}[{bad}]: size {int(sizes[bad]) & _MASK} bytes, expected < 2**63")
    elif type(nbytes) is int:
        if not 0 < nbytes < _SIGN:
            raise InvalidArgumentError(f"{name}: size {nbytes} bytes, expected an int in (0, 2**63)")
        sizes = torch.full((n,), nbytes, dtype=torch.int64)
    else:
        raise InvalidArgumentError(f"{name}: sizes {describe(nbytes)}, expected an int or an int64 tensor")
    if bool((sizes <= 0).any()):
        bad = int((sizes <= 0).nonzero()[0])
        raise InvalidArgumentError(f"{name}[{bad}]: size {int(sizes[bad])} bytes, expected an int > 0")
    return sizes


def addresses_table(
    name: str, addrs: torch.Tensor, nbytes: torch.Tensor | int, device: Device
) -> PointerTable[DeviceAlias]:
    """A kernel table of per-descriptor raw addresses (a batch copy's ``src_ptrs``), each
    entry checked as :func:`resolve_addresses` does, its size ``nbytes``. Not cached: for
    arrays an engine builds per call (the table is as cheap to build as to look up).

    Raises:
        As :func:`resolve_addresses`.
    """
    _check_address_tensor(name, addrs, device)
    values = _read_addresses(addrs)
    got = _resolve(name, values, _sizes(name, nbytes, addrs), device)
    return resolved_kernel_table([v & _MASK for v in got.aliases.tolist()], got.sizes.tolist(), device, got.owners,
                                 got.regions, [v & _MASK for v in values.tolist()])


def resolve_addresses(name: str, addrs: torch.Tensor, nbytes: torch.Tensor | int, device: Device) -> torch.Tensor:
    """Per-descriptor raw addresses (a batch copy's ``src_ptrs`` / ``dst_ptrs``) made
    kernel- and DMA-usable: each entry resolved and checked as :func:`resolved_table`
    does, its ``nbytes`` checked against its allocation. Vectorised: one runtime query
    per distinct allocation, not per entry.

    Args:
        name: the parameter, for error messages.
        addrs: 1-D ``int64`` / ``uint64`` addresses (bit patterns), CPU or ``device``.
        nbytes: bytes from each address (an int for all, or an int64 tensor like ``addrs``), > 0.
        device: the copy's device.

    Returns:
        A CPU ``int64`` tensor of the same length: device aliases (bit patterns of the
        unsigned addresses) for host entries, the address itself for device memory.

    Raises:
        As :func:`resolved_table`; InvalidArgumentError for sizes <= 0 or of the wrong shape.
    """
    _check_address_tensor(name, addrs, device)
    return _resolve(name, _read_addresses(addrs), _sizes(name, nbytes, addrs), device).aliases


def clear_cache() -> None:
    """Forget every cached resolution and prepared call (and release the buffers they hold)."""
    with _lock:
        _clear_locked()


def _clear_locked() -> None:
    _by_identity.clear()
    _by_memory.clear()
    _raw_cache.clear()
    for cache in _owned:
        cache.clear()
