"""Pointer tables: immutable, domain-typed arrays of buffer addresses.

A :class:`PointerTable` is backed by one ``uint64`` tensor on the table's device
(kernel tables live in the memory the kernel reads: the CUDA device, or emulated
device memory) and holds references to the tensors it points into and to their
registrations, so no address outlives its memory.

Only two functions build tables:

* :func:`make_kernel_ptr_table` -> ``PointerTable[DeviceAlias]``, the only table
  a launch accepts;
* :func:`host_ptr_table` -> ``PointerTable[HostVA]``, for CPU code and metadata.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar, cast, overload

import torch
from typing_extensions import Never, TypeIs, final

from pointerdomain.arguments import describe, storage_short
from pointerdomain.domains import Address, DeviceAlias, HostVA
from pointerdomain.errors import with_address
from pointerdomain.errors import (
    ClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    DeviceMismatchError,
    DomainError,
    InvalidArgumentError,
    NonContiguousError,
    NotRegisteredError,
    RegistrationSpanError,
    UnpinnedMemoryError,
)
from pointerdomain._platform.liveness import StorageWatch, storage_watch
from pointerdomain.registration.allocation import device_empty, memory_device
from pointerdomain.devices import Device, validate_device
from pointerdomain.process_local import ProcessLocal
from pointerdomain.layouts import KVLayout
from pointerdomain.registration.memory import RegisteredHostMemory, find_closed_registration, find_registration
from pointerdomain.registration.resolve import alias_of

__all__ = ["PointerTable", "has_domain", "host_ptr_table", "is_host_table", "is_kernel_table", "make_kernel_ptr_table",
           "require_domain"]

#: The address domain of a table. Invariant on purpose: a PointerTable[HostVA]
#: is not a PointerTable[DeviceAlias], nor a table of the base Address.
D = TypeVar("D", bound=Address)

_nbytes = torch.UntypedStorage.nbytes
_data_ptr = torch.UntypedStorage.data_ptr
_tensor_ptr = torch.Tensor.data_ptr


@final
class _Token:
    """The private type of the constructor's token: only this module holds one, so a
    hand-built ``PointerTable(...)`` is a static error as well as a runtime one."""

    __slots__ = ()


_TOKEN = _Token()


class _TableDevice:
    """``PointerTable.device``, typed by the table's domain: a kernel table's device is a
    :class:`Device`, a host table's is None (a property cannot be overloaded on self)."""

    @overload
    def __get__(self, table: None, owner: object) -> _TableDevice: ...
    @overload
    def __get__(self, table: PointerTable[DeviceAlias], owner: object) -> Device: ...
    @overload
    def __get__(self, table: PointerTable[HostVA], owner: object) -> None: ...
    @overload
    def __get__(self, table: PointerTable[Any], owner: object) -> Device | None: ...
    def __get__(self, table: PointerTable[Any] | None, owner: object) -> Device | None | _TableDevice:
        if table is None:
            return self
        return table._device  # noqa: SLF001 -- the descriptor is part of the table's class

    def __set__(self, table: PointerTable[Any], value: Never) -> None:  # read-only, also statically
        raise AttributeError("PointerTable is immutable")


@final
class PointerTable(ProcessLocal, Sequence[D], Generic[D]):  # Generic too: runtime parameters as before
    """An immutable table of buffer start addresses of one domain and device.

    Build with :func:`make_kernel_ptr_table` or :func:`host_ptr_table`.

    Attributes:
        domain: ``HostVA`` or ``DeviceAlias``, checked again at every launch.
        device: the device whose kernels may use the addresses, or None for a
            host table.
        sizes: bytes of the buffer behind each entry.
        layout: the KV layout the table was built for (pool tables), or None for a
            table of bare tensors; a launch with another layout is a ``LayoutError``.
    """

    __slots__ = ("_domain", "_device", "_values", "_sizes", "_tensor", "_keepalive", "_owners", "_alignment",
                 "_layout", "_storages", "_storage_state", "_storage_ptrs", "_tensor_ptrs", "_resolved", "_watch", "_addresses",
                 "_unpinned", "__weakref__")

    def __init__(
        self,
        token: _Token,
        domain: type[D],
        device: Device | None,
        values: tuple[int, ...],
        sizes: tuple[int, ...],
        keepalive: tuple[torch.Tensor, ...],
        owners: tuple[RegisteredHostMemory, ...],
        layout: KVLayout | None = None,
    ) -> None:
        if token is not _TOKEN:
            raise InvalidTypeError("build tables with make_kernel_ptr_table() or host_ptr_table()")
        self._domain = domain
        self._device = device
        self._values = values
        self._sizes = sizes
        self._keepalive = keepalive
        self._owners = owners
        #: the first registration kernels cannot read (the ``unpinned`` rung, fixed at registration), or None
        self._unpinned = next((o for o in owners if not o.kernel_readable), None)
        self._alignment = math.gcd(*values)
        self._layout = layout
        #: (lo, hi, kind) alias-space ranges a raw table's entries were resolved into
        #: (:func:`resolved_kernel_table`); empty for tables built from tensors
        self._resolved: tuple[tuple[int, int, str], ...] = ()
        #: the entries as the caller gave them (``data_ptr()`` domain), for a raw table
        #: whose aliases differ from them (:func:`resolved_kernel_table`); else the values
        self._addresses = values
        # Storage identity and size of every entry (one per storage): a launch refuses the
        # table once one was released or reallocated under it (resize_), see check_live.
        storages: dict[int, torch.UntypedStorage] = {}
        for t in keepalive:
            storage = t.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
        self._storages = tuple(storages.values())
        # Address and size, both compared per launch: resize_ is the one way to release or
        # move a storage, and resize_(0) then resize_(n) between two launches can give back
        # the old size at a new address (the old one freed), or the old address with a
        # smaller size. (A storage freed and reallocated at its old address and size reads
        # as intact: its bytes are again where the table points.)
        self._storage_state = tuple(s.nbytes() for s in self._storages)
        self._storage_ptrs = tuple(storages)  # the addresses the storages were keyed by
        # Where each kept tensor points: ``t.set_(other)`` swaps a tensor's storage without
        # touching the old one (which the table keeps alive), so only the tensor shows it.
        self._tensor_ptrs = tuple(map(_tensor_ptr, keepalive))
        # The same facts as machine words read in one native call per launch, where this
        # torch's layout was found (_platform.liveness); else the per-storage reads below.
        # The watch holds every storage its tensors view (also one sharing another's address).
        distinct = {id(s): s for s in (t.untyped_storage() for t in keepalive)}
        self._watch = storage_watch(tuple(distinct.values()), keepalive)
        host = torch.tensor(list(values), dtype=torch.uint64)
        if device is None:
            self._tensor = host
        else:
            self._tensor = device_empty((len(values),), torch.uint64, device)
            self._tensor.copy_(host)

    @property
    def generation(self) -> int:
        """Changes (grows) when registered memory under the table closes; 0 for a table
        over device memory alone. An engine records it with a captured graph and compares
        before a replay (:mod:`pointerdomain.transfer.graphs`)."""
        return max((owner.leases.generation for owner in self._owners), default=0)

    @property
    def domain(self) -> type[D]:
        return self._domain

    #: The device whose kernels may read the table: a ``Device`` for a
    #: ``PointerTable[DeviceAlias]``, None for a ``PointerTable[HostVA]``.
    device = _TableDevice()

    @property
    def sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def layout(self) -> KVLayout | None:
        return self._layout

    @property
    def alignment(self) -> int:
        """Greatest common divisor of all addresses, in bytes (picks the copy word width)."""
        return self._alignment

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, index: int) -> D: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[D, ...]: ...
    def __getitem__(self, index: int | slice) -> D | tuple[D, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(len(self))[index])
        value = self._values[index]
        span = (value, value + self._sizes[index])  # arithmetic on an entry stays in its buffer
        if self._domain is DeviceAlias:
            assert self._device is not None
            return DeviceAlias.unsafe_from_int(value, self._device).bounded(*span)  # type: ignore[return-value]
        return HostVA.unsafe_from_int(value).bounded(*span)  # type: ignore[return-value]

    def __iter__(self) -> Iterator[D]:
        return (self[i] for i in range(len(self)))

    def as_uint64_tensor(self) -> torch.Tensor:
        """A copy of the table as a ``uint64`` tensor of shape ``[len(self)]`` on the
        table's device.

        This is the explicit escape hatch for untyped kernels (e.g. a cache's own
        CUDA op that takes a pointer tensor): what it returns carries no domain,
        so pass it only to code that expects this table's domain and device. It is a
        copy, so writing to it cannot change what this table's launches read.
        """
        return self._tensor.clone()

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Keep the table's array from being reused by torch's caching allocator until
        work queued on ``stream`` (which reads it) is done (``Tensor.record_stream``)."""
        self._tensor.record_stream(stream)

    def kernel_table_address(self) -> int:
        """Device address of the table's own ``uint64`` array (what the launch functions
        pass to the kernels). The array is private to the table and lives as long as it."""
        return int(self._tensor.data_ptr())

    def raw_values(self) -> tuple[int, ...]:
        """The addresses as plain ints, host-side (escape hatch like :meth:`as_uint64_tensor`;
        used to build copy-engine descriptors without reading the device copy)."""
        return self._values

    def entry_addresses(self) -> tuple[int, ...]:
        """Where each entry's buffer starts in the domain of tensors' ``data_ptr()`` (host
        VAs, device addresses): the addresses a table resolved from raw addresses was given
        (:func:`resolved_kernel_table`), else :meth:`raw_values` (for a table built from
        tensors, :meth:`storage_spans` says where its memory lies)."""
        return self._addresses

    def registrations(self) -> tuple[RegisteredHostMemory, ...]:
        """The registrations this table points into (kept open-checked at every launch)."""
        return self._owners

    def resolved_regions(self) -> tuple[tuple[int, int, str], ...]:
        """``(lo, hi, kind)`` device-alias ranges (``kind`` "device" or "pinned") that the
        entries of a table built from raw addresses were checked against when it was
        resolved (:mod:`pointerdomain.compat`); empty for tables built from tensors, whose
        memory is :meth:`kept_tensors`. Checked mode verifies launches against them."""
        return self._resolved

    def kept_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors this table keeps alive (the buffers it was built from)."""
        return self._keepalive

    def storage_spans(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` byte addresses (``data_ptr()`` domain: host VAs, device
        addresses) of each distinct storage the entries' buffers lie in, as recorded when
        the table was built (:meth:`storages_intact` says whether they still hold)."""
        return tuple((p, p + n) for p, n in zip(self._storage_ptrs, self._storage_state))

    def storages_intact(self) -> bool:
        """False when the storage of an entry was released or reallocated since the table
        was built: its size or its address changed (:meth:`check_live` raises for it; a
        launch plan calls this directly). One native call whatever the number of storages
        (:mod:`pointerdomain._platform.liveness`), or two reads per storage where that does
        not apply."""
        watch = self._watch
        if watch is not None:
            return watch.intact()
        state, storages = self._storage_state, self._storages
        if len(state) == 1:  # pool tables: one allocation
            only = storages[0]
            if not (_nbytes(only) == state[0] and _data_ptr(only) == self._storage_ptrs[0]):
                return False
        elif not (tuple(map(_nbytes, storages)) == state and tuple(map(_data_ptr, storages)) == self._storage_ptrs):
            return False
        return tuple(map(_tensor_ptr, self._keepalive)) == self._tensor_ptrs

    def storage_watch(self) -> StorageWatch | None:
        """The native liveness check of this table (:mod:`pointerdomain._platform.liveness`),
        or None where the per-storage reads of :meth:`storages_intact` stand in for it."""
        return self._watch

    def check_live(self) -> None:
        """Every launch calls this (one native pass over the words of the table's storages
        and tensors, :meth:`storages_intact`; docs/performance.md).

        Raises:
            ClosedError: a registration this table points into was closed, the storage
                of an entry was released or reallocated (``untyped_storage().resize_()``,
                ``share_memory_()``), or an entry's tensor now views other memory
                (``set_()``)."""
        for owner in self._owners:
            owner.check_open()
        if not self.storages_intact():
            self._storage_error()

    def check_this_process(self) -> None:
        """Every registration this table points into was made in this process, not inherited
        through ``fork()`` (:meth:`RegisteredHostMemory.check_this_process`).

        Raises:
            ClosedError: a registration made before this process forked from its parent."""
        for owner in self._owners:
            owner.check_this_process()

    def check_kernel_readable(self) -> None:
        """For a table handed to a kernel outside the library's launches (a custom op's
        pointer tensor, a Triton argument, a C++ extension's caster): every registration it
        points into can be read by a kernel of this process. A table over memory on the
        registration ladder's ``unpinned`` rung holds host VAs that only the copy engine may
        read (the library's own launches then take ``backend="copy_engine"``;
        docs/reliability.md); a registration made before this process forked from its
        parent is none of this process's runtime's (docs/design.md).

        Raises:
            UnpinnedMemoryError: a registration on the ``unpinned`` rung.
            ClosedError: a registration inherited through ``fork()``."""
        self.check_this_process()
        owner = self._unpinned
        if owner is not None:
            raise UnpinnedMemoryError(
                f"{self!r} points into host memory at {owner.host_va!r} (+{owner.nbytes} bytes) that is not pinned "
                f"(registration ladder rung 'unpinned': {'; '.join(owner.ladder_record) or 'allowed by the policy'}): "
                "its entries are host VAs, which a kernel cannot read. Fix: register the memory pinned, or move it "
                "with the library's copy engine (backend='copy_engine')")

    def _storage_error(self) -> None:
        for s, nbytes, ptr in zip(self._storages, self._storage_state, self._storage_ptrs):
            if s.nbytes() != nbytes or s.data_ptr() != ptr:
                raise ClosedError(
                    f"{self!r}: the storage of an entry changed under the table (found {s.nbytes()} bytes at "
                    f"{s.data_ptr():#x}, expected {nbytes} bytes at {ptr:#x}): it was released or reallocated "
                    "(e.g. untyped_storage().resize_()) and the table's addresses point at freed memory. "
                    "Fix: rebuild the table over live tensors"
                )
        for i, (t, ptr) in enumerate(zip(self._keepalive, self._tensor_ptrs)):
            if t.data_ptr() != ptr:
                raise ClosedError(
                    f"{self!r}: entry {i}'s tensor now views other memory (found {t.data_ptr():#x}, expected "
                    f"{ptr:#x}): its storage was swapped (set_(), share_memory_()) after the table was built, so "
                    "the table's address no longer reaches the tensor the caller reads. Fix: rebuild the table "
                    "over the tensor as it is now"
                )
        raise ClosedError(f"{self!r}: the memory under the table changed since it was built. Fix: rebuild the table")

    def __repr__(self) -> str:
        where = "host" if self._device is None else str(self._device)
        return f"PointerTable[{self._domain.__name__}]({len(self)} entries, {where})"


def is_kernel_table(table: object) -> TypeIs[PointerTable[DeviceAlias]]:
    """True if ``table`` is a ``PointerTable[DeviceAlias]`` (narrows a union of tables:
    pyright does not narrow on ``t.domain is DeviceAlias``, a property)."""
    return isinstance(table, PointerTable) and table.domain is DeviceAlias


def is_host_table(table: object) -> TypeIs[PointerTable[HostVA]]:
    """True if ``table`` is a ``PointerTable[HostVA]`` (see :func:`is_kernel_table`)."""
    return isinstance(table, PointerTable) and table.domain is HostVA


def has_domain(table: object, domain: type[D]) -> TypeIs[PointerTable[D]]:
    """True if ``table`` is a ``PointerTable`` of ``domain`` (``HostVA`` or ``DeviceAlias``):
    ``if has_domain(t, DeviceAlias):`` narrows ``t`` in both branches under mypy and
    pyright. Use it where ``t.domain is DeviceAlias`` would be written: that compares the
    value but narrows nothing under pyright (it does not narrow on a class held by an
    attribute)."""
    return isinstance(table, PointerTable) and table.domain is domain


def require_domain(name: str, table: object, domain: type[D], use: str, why: str) -> PointerTable[D]:
    """``table`` if it is a ``PointerTable[domain]``: the one table-domain check of the
    launch, metadata and adapter paths (checked mode repeats it on purpose).

    Args:
        name: the argument, for the message.
        domain: ``DeviceAlias`` or ``HostVA``.
        use: what the table reached (``"a kernel launch"``, ``"metadata"``).
        why: why the other domain is refused and how to build the right table.

    Raises:
        DomainError: another object, or a table of the other domain.
    """
    if isinstance(table, PointerTable) and table.domain is domain:
        return table
    want = f"PointerTable[{domain.__name__}]"
    if isinstance(table, PointerTable):
        got = f"PointerTable[{table.domain.__name__}]"
        raise DomainError(f"{name}: a {got} reached {use}; {use} needs a {want}, got {got}: {why}")
    raise DomainError(f"{name}: expected a {want}, got {type(table).__name__}; {use} needs a {want}: {why}")


def _tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def _check_tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(
            f"{name}: found a {type(t).__name__} ({describe(t, 60)}), expected a torch.Tensor. Fix: pass the buffers "
            "themselves (contiguous tensors), one per table entry"
        )
    if not t.is_contiguous():
        raise NonContiguousError(
            f"{name}: tensor of shape {tuple(t.shape)} has strides {t.stride()}, not contiguous: a pointer "
            "table entry must cover one contiguous buffer (a strided view would be read as if packed). "
            "Pass the contiguous base buffer, or .contiguous() a copy"
        )
    if t.numel() == 0:
        raise InvalidArgumentError(
            f"{name}: found an empty tensor (shape {tuple(t.shape)}), expected a buffer of at least one byte: a "
            "table entry must point at memory. Fix: drop the empty tensor from the list"
        )
    if storage_short(t):  # resize_(0) leaves data_ptr() 0 or freed: no address to hand out
        raise ClosedError(
            f"{name}: {describe(t)}: its storage holds {t.untyped_storage().nbytes()} bytes, fewer than the "
            f"{_tensor_bytes(t)} the tensor views: it was released (untyped_storage().resize_()). "
            "Fix: pass tensors whose storage is allocated"
        )
    return t


def _tensor_list(name: str, tensors: object) -> tuple[object, ...]:
    """``tensors`` as a tuple, refusing a bare tensor (iterating it would make one entry
    per row: a table of row addresses nobody asked for) and non-sequences."""
    if isinstance(tensors, torch.Tensor):
        raise InvalidTypeError(
            f"{name}: found a bare torch.Tensor of shape {tuple(tensors.shape)}, expected a list of tensors "
            "(iterating a tensor would make one table entry per row). Fix: pass [tensor] for a one-entry table"
        )
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise InvalidTypeError(
            f"{name}: found a {type(tensors).__name__}, expected a list or tuple of torch.Tensor. "
            "Fix: pass the buffers as a list, one per table entry"
        )
    return tuple(tensors)


def _kernel_address(name: str, t: torch.Tensor, device: Device) -> tuple[int, RegisteredHostMemory | None]:
    nbytes = _tensor_bytes(t)
    where = memory_device(t)
    if where == device:
        return t.data_ptr(), None
    if where is not None:
        raise DeviceMismatchError(f"{name}: device memory of {where}, but the table is for {device}")
    if not t.is_cpu:
        raise DomainError(f"{name}: tensor on {t.device} is neither host memory nor memory of {device}")
    va = HostVA.unsafe_from_int(t.data_ptr())
    owner = find_registration(va, nbytes)
    if owner is None:
        partial = find_registration(va, 1) or find_registration(va + (nbytes - 1), 1)
        if partial is not None:
            raise with_address(RegistrationSpanError(
                f"{name}: [{describe(va)}, +{nbytes}) runs past registration {partial.host_va!r} (+{partial.nbytes})"
            ), va.value)
        closed = find_closed_registration(va, nbytes)
        if closed is not None:
            raise ClosedError(
                f"{name}: the memory at {describe(va)} (+{nbytes} bytes) was registered at {closed.host_va!r} "
                f"(+{closed.nbytes} bytes) and that registration was closed: found a closed registration, "
                "expected an open one. Fix: register the memory again (register_host_tensor) and rebuild the table"
            )
        try:
            return alias_of(va, device).value, None  # pinned by the runtime (e.g. pin_memory())
        except NotRegisteredError:
            pass
        raise DomainError(
            f"{name}: unregistered host memory at {describe(va)} (a HostVA) cannot be read by a kernel on {device}; "
            "allocate it with pointerdomain.alloc_registered or register it with register_host_tensor"
        )
    owner.check_open()
    if not owner.device.same_type(device):
        raise DeviceMismatchError(f"{name}: memory registered for {owner.device}, but the table is for {device}")
    try:
        owner.chunk_of(va, nbytes)
    except RegistrationSpanError as exc:
        raise with_address(RegistrationSpanError(f"{name}: {exc}"), va.value) from None
    return alias_of(va, device).value, owner


def make_kernel_ptr_table(
    tensors: Sequence[torch.Tensor], device: Device | str | torch.device, *, layout: KVLayout | None = None
) -> PointerTable[DeviceAlias]:
    """A table of device aliases for kernels on ``device``.

    Each tensor must be contiguous and either registered host memory (its alias
    is resolved; see :func:`pointerdomain.resolve_alias`) or device memory of
    ``device`` (its ``data_ptr()``). The table's ``uint64`` tensor lives on ``device``.

    Args:
        tensors: the buffers, in table order (any dtype and shape).
        device: the device whose kernels will read the table.
        layout: the layout the tensors hold (pools pass theirs): launches must then use
            exactly this layout. Checked here: the table fits it.

    Raises:
        InvalidTypeError: ``tensors`` is a bare tensor or not a sequence, or an item is
            not a tensor (a ``TypeError`` too).
        InvalidArgumentError: an empty tensor.
        NonContiguousError: a strided tensor.
        DomainError: unregistered host memory.
        DeviceMismatchError: memory of another device, or registered for another device type.
        RegistrationSpanError: a tensor straddles two registrations or chunks.
        ClosedError: a tensor's registration was closed, or its storage holds fewer
            bytes than it views (released with ``untyped_storage().resize_(0)``).
        InvalidDeviceError: ``device`` does not exist.
        LayoutError: ``layout`` is given and the tensors do not fit it exactly.
        InvalidArgumentError: ``layout`` is not a KVLayout.
    """
    dev = validate_device(device)
    if layout is not None and not isinstance(cast(object, layout), KVLayout):
        raise InvalidArgumentError(f"layout must be a KVLayout or None, got {type(layout).__name__}")
    values: list[int] = []
    owners: list[RegisteredHostMemory] = []
    checked = tuple(_check_tensor(f"tensors[{i}]", t) for i, t in enumerate(_tensor_list("tensors", tensors)))
    for i, t in enumerate(checked):
        value, owner = _kernel_address(f"tensors[{i}]", t, dev)
        values.append(value)
        if owner is not None and all(o is not owner for o in owners):
            owners.append(owner)
    sizes = tuple(_tensor_bytes(t) for t in checked)
    if layout is not None:
        layout.geometry(len(values), sizes, "tensors")
    return PointerTable(_TOKEN, DeviceAlias, dev, tuple(values), sizes, checked, tuple(owners), layout)


def host_ptr_table(tensors: Sequence[torch.Tensor]) -> PointerTable[HostVA]:
    """A table of host VAs for CPU code, storage back-ends and transfer engines.

    Args:
        tensors: contiguous tensors in host memory (registered or not).

    Raises:
        DomainError: a CUDA tensor or emulated device memory (a device address
            handed to CPU code).
        NonContiguousError: a strided tensor.
        InvalidTypeError: ``tensors`` is a bare tensor or not a sequence, or an item is not a tensor.
        InvalidArgumentError: an empty tensor.
        ClosedError: a tensor's storage holds fewer bytes than it views (released with
            ``untyped_storage().resize_(0)``): the message names the entry.
    """
    checked = tuple(_check_tensor(f"tensors[{i}]", t) for i, t in enumerate(_tensor_list("tensors", tensors)))
    owners: list[RegisteredHostMemory] = []
    for i, t in enumerate(checked):
        where = memory_device(t)
        if where is not None or not t.is_cpu:
            raise DomainError(
                f"tensors[{i}]: memory of {where or t.device} is not host memory; device addresses must "
                "never reach CPU code (memcpy, transfer engines): copy the data to host memory first"
            )
        owner = find_registration(HostVA.unsafe_from_int(t.data_ptr()), _tensor_bytes(t))
        if owner is not None and all(o is not owner for o in owners):
            owners.append(owner)
    return PointerTable(
        _TOKEN,
        HostVA,
        None,
        tuple(t.data_ptr() for t in checked),
        tuple(_tensor_bytes(t) for t in checked),
        checked,
        tuple(owners),
    )


def resolved_kernel_table(
    values: Sequence[int],
    sizes: Sequence[int],
    device: Device,
    owners: Sequence[RegisteredHostMemory],
    regions: Sequence[tuple[int, int, str]] = (),
    addresses: Sequence[int] | None = None,
) -> PointerTable[DeviceAlias]:
    """A kernel table over device aliases already resolved and checked by the caller
    (:mod:`pointerdomain.compat`, for an engine's raw ``data_ptr()`` tables): no tensors
    to keep alive, ``owners`` the registrations the entries lie in (launches then
    refuse the table once one is closed), ``regions`` the other alias ranges (device
    memory, runtime-pinned memory) the entries were checked against, ``addresses`` the
    entries as given (``data_ptr()`` domain, one per value; None: the values themselves,
    as for device memory), which a launch compares its index tensors against.

    Raises:
        InvalidArgumentError: ``addresses`` of another length than ``values``.
    """
    table = PointerTable(_TOKEN, DeviceAlias, device, tuple(values), tuple(sizes), (), tuple(owners))
    table._resolved = tuple(regions)  # noqa: SLF001 -- set once, before the table is handed out
    if addresses is not None:
        if len(addresses) != len(values):
            raise InvalidArgumentError(f"addresses: {len(addresses)} entries for {len(values)} values")
        table._addresses = tuple(addresses)  # noqa: SLF001 -- as above
    return table
