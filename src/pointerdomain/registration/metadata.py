"""Metadata for storage back-ends and transfer engines: host VAs only.

Transfer engines (Mooncake ``register_memory(addr, len)``, NIXL) and storage
back-ends read host memory with the CPU or a NIC, so they take host VAs; a
device alias handed to them reads the wrong memory where aliases differ. The
models here are frozen pydantic models whose address fields are typed
:class:`HostVA` (validated as a strict int in [0, 2**64), serialised as that int),
and the functions accept only ``PointerTable[HostVA]``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

import pydantic
import torch
from pydantic import ConfigDict, Field, model_validator
from typing_extensions import Unpack

from pointerdomain.arguments import check_instance, describe
from pointerdomain.domains import ADDRESS_LIMIT, HostVA
from pointerdomain.errors import (
    ClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    MetadataValidationError,
)
from pointerdomain.layouts import KVLayout
from pointerdomain.registration.memory import (
    find_closed_registration,
    find_registration,
    last_serial,
    open_registrations,
)
from pointerdomain.registration.tables import PointerTable, require_domain
from pointerdomain.validated import ValidatedModel

__all__ = ["BufferInfo", "BufferInfoChanges", "EngineHold", "HeldMemory", "buffer_infos", "check_engine_hold", "check_metadata_live",
           "engine_hold", "metadata_table", "page_buffer_meta"]


def _metadata_error(exc: pydantic.ValidationError) -> MetadataValidationError:
    return MetadataValidationError.from_exception_data(exc.title, exc.errors())  # type: ignore[arg-type]


class BufferInfoChanges(TypedDict, total=False):
    """The fields :meth:`BufferInfo.replace` may change, with their types (a misspelt
    field or a wrong type is a static error under mypy and pyright)."""

    address: HostVA
    nbytes: int
    item_bytes: int


class BufferInfo(ValidatedModel, frozen=True):
    """A contiguous host buffer: ``nbytes`` bytes from host VA ``address``, made of
    items of ``item_bytes`` bytes. ``model_dump_json()`` gives plain ints.

    Every way to make or derive one validates (:mod:`pointerdomain.validated`): the
    class call, ``model_validate`` / ``model_validate_json``, :meth:`replace` and
    ``model_copy``; ``model_construct`` is refused.

    Raises (on construction and derivation):
        MetadataValidationError: (a ``pydantic.ValidationError``, ``ValueError`` and
            :class:`~pointerdomain.errors.PointerDomainError`) an address that is not a
            HostVA, the null address ``HostVA(0)`` (memory no engine may read: what a
            released tensor's ``data_ptr()`` gives), a size that is not a positive int,
            ``nbytes`` not a whole number of items, a range past ``2**64``, or an unknown field.
    """

    model_config = ConfigDict(strict=True, extra="forbid")  # frozen: class keyword, seen by type checkers

    address: HostVA
    nbytes: int = Field(gt=0)
    item_bytes: int = Field(gt=0)

    if not TYPE_CHECKING:  # runtime wrappers (inside the error tree); type checkers keep pydantic's signatures

        def __init__(self, **data: Any) -> None:
            try:
                super().__init__(**data)
            except MetadataValidationError:
                raise
            except pydantic.ValidationError as exc:
                raise _metadata_error(exc) from None

        # pydantic then does not treat this as a custom __init__ (which it would call, in
        # strict Python mode, from model_validate_json: JSON ints would not become HostVAs)
        __init__.__pydantic_base_init__ = True

        @classmethod
        def model_validate(cls, obj: Any, **kwargs: Any) -> BufferInfo:
            try:
                return super().model_validate(obj, **kwargs)
            except MetadataValidationError:
                raise
            except pydantic.ValidationError as exc:
                raise _metadata_error(exc) from None

        @classmethod
        def model_validate_json(cls, json_data: Any, **kwargs: Any) -> BufferInfo:
            try:
                return super().model_validate_json(json_data, **kwargs)
            except MetadataValidationError:
                raise
            except pydantic.ValidationError as exc:
                raise _metadata_error(exc) from None

        def __setattr__(self, name: str, value: Any) -> None:
            try:
                super().__setattr__(name, value)  # frozen: pydantic refuses it
            except MetadataValidationError:
                raise
            except pydantic.ValidationError as exc:
                raise _metadata_error(exc) from None

        def __delattr__(self, name: str) -> None:
            try:
                super().__delattr__(name)
            except MetadataValidationError:
                raise
            except pydantic.ValidationError as exc:
                raise _metadata_error(exc) from None

        @classmethod
        def model_validate_strings(cls, obj: Any, **kwargs: Any) -> BufferInfo:
            try:
                return super().model_validate_strings(obj, **kwargs)
            except MetadataValidationError:
                raise
            except pydantic.ValidationError as exc:
                raise _metadata_error(exc) from None

    @model_validator(mode="after")
    def _whole_items(self) -> BufferInfo:
        if self.address.value == 0:
            raise ValueError(
                "address: found HostVA(0x0), the null address, expected the address of allocated host memory: "
                "an engine reading it faults (a tensor whose storage was released reports data_ptr() 0). "
                "Fix: take the metadata from live memory"
            )
        if self.nbytes % self.item_bytes:
            raise ValueError(f"nbytes {self.nbytes} is not a whole number of {self.item_bytes}-byte items")
        if self.address.value + self.nbytes > ADDRESS_LIMIT:  # the engine would wrap to low memory
            raise ValueError(
                f"[{self.address!r}, +{self.nbytes}) runs past 2**64: found an end of "
                f"{self.address.value + self.nbytes:#x}, expected at most 2**64. Fix: the address or size is wrong"
            )
        return self

    def replace(self, **changes: Unpack[BufferInfoChanges]) -> BufferInfo:
        """A copy with ``changes`` applied, validated like a new BufferInfo; field names
        and types are checked by mypy and pyright (:class:`BufferInfoChanges`).

        Raises:
            MetadataValidationError: the result is invalid (e.g. ``address`` a DeviceAlias,
                ``nbytes=-1``, a range past ``2**64``).
        """
        return self._derive(changes)


def _check_host(table: object) -> PointerTable[HostVA]:
    return require_domain("table", table, HostVA, "metadata",
                          "device aliases must never reach transfer engines or CPU code; build it with host_ptr_table")


# The memory metadata was handed out for. A BufferInfo is a plain value with no link to
# its memory, so the adapters that hand an address to an engine ask here whether the
# memory behind it still stands. Weak references only (torch keeps one Python object per
# storage, so a weakref to it dies with the storage): a watch outlives its memory on
# purpose, until new metadata is handed out over the same addresses.
class _Watch:
    __slots__ = ("lo", "hi", "storage", "storage_ptr", "storage_nbytes", "tensor", "tensor_ptr", "serial")

    def __init__(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.lo = t.data_ptr()
        self.hi = self.lo + t.numel() * t.element_size()
        self.storage = weakref.ref(storage)
        self.storage_ptr = storage.data_ptr()
        self.storage_nbytes = storage.nbytes()
        self.tensor = weakref.ref(t)
        self.tensor_ptr = self.lo
        self.serial = last_serial()  # registrations made after this one are newer memory

    def live(self) -> bool:
        storage = self.storage()
        if storage is None or storage.data_ptr() != self.storage_ptr or storage.nbytes() != self.storage_nbytes:
            return False  # freed, or released / reallocated in place (resize_, share_memory_)
        t = self.tensor()
        return t is None or t.data_ptr() == self.tensor_ptr  # swapped (set_)

    def same(self, other: _Watch) -> bool:
        return (self.lo, self.hi, self.storage(), self.tensor()) == (other.lo, other.hi, other.storage(), other.tensor())


#: Most watches kept; past it the oldest released ones go first.
_MAX_WATCHES = 4096
_watch_lock = threading.Lock()
_watches: list[_Watch] = []


def _watch(table: PointerTable[HostVA]) -> None:
    for t in table.kept_tensors():
        w = _Watch(t)
        with _watch_lock:
            if any(old.same(w) for old in _watches):
                continue
            # released memory under new metadata: the addresses are live again
            _watches[:] = [old for old in _watches if old.live() or not (old.lo < w.hi and w.lo < old.hi)]
            _watches.append(w)
            if len(_watches) > _MAX_WATCHES:
                dead = [old for old in _watches if not old.live()]
                drop = dead[0] if dead else _watches[0]
                _watches.remove(drop)


def metadata_table(table: object) -> PointerTable[HostVA]:
    """``table`` checked for handing out metadata: a host table whose memory is live
    (what every metadata function calls first; adapters building their own metadata
    from a host table too). Records its memory, so that :func:`check_metadata_live`
    later knows whether metadata taken now still describes live memory.

    Raises:
        DomainError: not a ``PointerTable[HostVA]``.
        ClosedError: its registration was closed, or the storage under an entry was
            released, reallocated or swapped (``resize_``, ``share_memory_``, ``set_``).
    """
    host = _check_host(table)
    host.check_live()
    _watch(host)
    return host


def _covered(lo: int, hi: int, spans: list[tuple[int, int]]) -> bool:
    """Whether the ``(start, end)`` spans cover every byte of ``[lo, hi)``."""
    at = lo
    for a, b in sorted(spans):
        if a > at:
            break
        at = max(at, b)
    return at >= hi


def check_metadata_live(address: HostVA, nbytes: int, name: str = "region") -> None:
    """Refuse ``[address, address + nbytes)`` when it is metadata of memory that has gone:
    inside a closed registration, or inside memory that metadata was handed out for
    (:func:`metadata_table`) and that was released, reallocated or swapped since, with
    no metadata handed out afresh over it. Addresses this process never described (a
    peer's, a hand-built HostVA) pass: other checks own them. Adapters call this before
    handing an address to a transfer engine.

    Raises:
        ClosedError: the memory was closed or released (the message names ``name``).
        InvalidArgumentError: ``nbytes`` is not a positive int.
    """
    if type(nbytes) is not int or nbytes <= 0:
        raise InvalidArgumentError(f"{name}: nbytes found {describe(nbytes)}, expected a positive int (bytes)")
    lo, hi = address.value, address.value + nbytes
    closed = find_closed_registration(address, nbytes)
    if closed is not None:
        raise ClosedError(
            f"{name}: [{describe(address)}, +{nbytes}) lies in registered memory at {closed.host_va!r} that was closed: "
            "found metadata of closed memory, expected metadata of live memory. Fix: take metadata from an open "
            "pool, and deregister it from the engine before closing the pool"
        )
    with _watch_lock:
        near = [w for w in _watches if w.lo < hi and lo < w.hi]
    if near:  # memory registered over a watch's bytes since its metadata was taken: the addresses were reused
        newer = [(o.host_va.value, o.host_va.value + o.nbytes, o.serial) for o in open_registrations()
                 if o.host_va.value < hi and lo < o.host_va.value + o.nbytes]
        near = [w for w in near if not _covered(max(lo, w.lo), min(hi, w.hi),
                                                 [(a, b) for a, b, serial in newer if serial > w.serial])]
    if near and not any(w.live() for w in near):
        raise ClosedError(
            f"{name}: [{describe(address)}, +{nbytes}) is metadata of memory that was released, reallocated or swapped "
            "(resize_, share_memory_, set_) after it was handed out: an engine given it would read or write freed "
            "memory. Fix: take the metadata again from live memory"
        )


class HeldMemory(NamedTuple):
    """Bytes ``[lo, hi)`` of a range an engine registered, held then by a registration of
    this process, and that registration's storage (weakly: the adapter's record must not
    keep memory alive)."""

    lo: int
    hi: int
    storage: weakref.ref[torch.UntypedStorage]


#: What an adapter keeps of a range it registered with a transfer engine (:func:`engine_hold`).
EngineHold = tuple[HeldMemory, ...]


def engine_hold(address: HostVA, nbytes: int) -> EngineHold | None:
    """Taken when an adapter registers ``[address, address + nbytes)`` with a transfer
    engine: for each registration of this process holding part of the range, those bytes
    and the storage behind them; None where none does (a foreign buffer: the other checks
    own it). :func:`check_engine_hold` compares it at each transfer."""
    lo, hi = address.value, address.value + nbytes
    held = []
    for owner in open_registrations():
        a, b = max(lo, owner.host_va.value), min(hi, owner.host_va.value + owner.nbytes)
        if a < b:
            held.append(HeldMemory(a, b, weakref.ref(owner.tensor.untyped_storage())))
    return tuple(held) or None


def check_engine_hold(hold: EngineHold | None, address: HostVA, nbytes: int, name: str = "local") -> None:
    """Refuse a transfer through an engine registration whose memory is gone: every byte of
    ``[address, address + nbytes)`` that a registration of this process held when the
    engine registered its range must still be held by the storage that held it then. A
    storage that was released (its registration closed and the memory freed, whatever is
    mapped or registered at those addresses now) fails: the engine's own registration (an
    RDMA memory region, NIXL's) still pins the old pages, so bytes it moves would land in
    freed memory, not in what is there now. The same storage registered again passes; the
    same pages under a new tensor (a new storage over memory someone else kept mapped)
    cannot be told from new memory and are refused: register the range with the engine
    again.

    Raises:
        ClosedError: bytes of the range are no longer the memory the engine registered."""
    if hold is None:
        return
    lo, hi = address.value, address.value + nbytes
    for held in hold:
        a, b = max(lo, held.lo), min(hi, held.hi)
        if a >= b:
            continue
        storage = held.storage()
        if storage is not None:
            base = storage.data_ptr()
            if base <= a and b <= base + storage.nbytes():
                continue  # the storage the engine's pages belong to still holds these bytes
        raise ClosedError(
            f"{name}: [{describe(address)}, +{nbytes}) lies in a range registered with the engine over memory whose "
            f"registration closed and whose storage was released since (bytes [{a:#x}, {b:#x})): the engine's "
            "registration pins the pages it was given, which may be freed now, so the bytes it moves would not reach "
            "what is at these addresses. Fix: unregister the old range from the engine before closing its memory "
            "(register_pool does it on close), then register the memory that is there now (the same pages under a "
            "new tensor too: they cannot be told from new memory)"
        )


def buffer_infos(table: PointerTable[HostVA], item_bytes: int) -> list[BufferInfo]:
    """One :class:`BufferInfo` per table entry (e.g. a host pool's contiguous buffers).

    Raises:
        DomainError: ``table`` is not a host table.
        ClosedError: the table's memory was closed or released (see :func:`metadata_table`).
        pydantic.ValidationError: ``item_bytes`` not positive.
    """
    host = metadata_table(table)
    return [BufferInfo(address=a, nbytes=n, item_bytes=item_bytes) for a, n in zip(host, host.sizes)]


def page_buffer_meta(table: PointerTable[HostVA], layout: KVLayout, pages: list[int]) -> list[BufferInfo]:
    """The contiguous host blocks holding each page of a one-buffer host pool, in
    page order (what a transfer engine reads or writes to move those pages):
    :meth:`KVLayout.page_blocks` of each page (K's block then V's for ``page_first``,
    ``page_first_direct`` and ``page_head``, as sglang's ``get_page_buffer_meta``; one
    block per page for ``page_unified``; one per kv and layer for ``layer_first``).

    Args:
        table: a one-entry host table over the pool buffer of ``layout``.
        layout: the pool's layout.
        pages: page numbers in ``[0, layout.num_pages)``.

    Raises:
        DomainError: ``table`` is not a host table.
        LayoutError: the table is not one buffer of ``layout.nbytes`` bytes.
        InvalidTypeError: ``pages`` is not a list (or other iterable) of page numbers.
        IndexValidationError: a page that is not an int in ``[0, num_pages)`` (an ``IndexError``).
        ClosedError: the table's memory was closed or released (see :func:`metadata_table`).
    """
    check_instance("layout", layout, KVLayout, "pass the pool's KVLayout (pool.layout)")
    given: object = pages  # checked at run time too: callers may be untyped
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise InvalidTypeError(
            f"pages: found {describe(given)} ({type(given).__name__}), expected a list of page numbers (ints). "
            "Fix: pass e.g. [0, 3]"
        )
    pages = list(pages)
    host = metadata_table(table)
    if len(host) != 1 or host.sizes[0] != layout.nbytes:
        raise LayoutError(
            f"page_buffer_meta needs the one-buffer host pool of this layout ({layout.nbytes} bytes), got sizes "
            f"{host.sizes}: pass the pool's own layout"
        )
    base = host[0]
    return [
        BufferInfo(address=base + offset, nbytes=nbytes, item_bytes=layout.item_bytes)
        for page in pages
        for offset, nbytes in layout.page_blocks(page)
    ]
