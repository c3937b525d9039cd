"""Registered (pinned) host memory and device memory.

:func:`alloc_registered` and :func:`register_host_tensor` return a
:class:`RegisteredHostMemory` owner: a context manager that unregisters exactly
once (on ``close()``, on exit, or when collected). On CUDA the range is
registered with ``cudaHostRegister(portable | mapped)`` in chunks cut on a
caller-given granularity (one very large cudaHostRegister can fail: drivers have
refused single calls near 512 GiB);
a failing chunk rolls back the chunks already registered. On the emulated
backend each chunk gets a second virtual mapping of the same pages, so device
aliases differ from host VAs and separately registered chunks are not contiguous
in alias space, as on MI355X.

Before any call, the range's kind is asked of the platform
(:mod:`pointerdomain.registration.kinds`): VMM host memory is used as it is, never
registered again; on a device that reads pageable memory in place a ``NotSupported``
refusal takes the ``not_needed`` rung. The calls themselves may be paced and the pages
faulted in first (:mod:`pointerdomain.registration.pacing`).
"""

from __future__ import annotations

import functools
import mmap
import os
import resource
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from pointerdomain.arguments import describe
from pointerdomain._platform import Backend, backend_for, memory_device
from pointerdomain._platform.base import PinnedAllocator
from pointerdomain._platform.numa import node_of
from pointerdomain._platform.status import registration_error
from pointerdomain.devices import Device, validate_device
from pointerdomain.domains import HostVA
from pointerdomain.process_local import ProcessLocal
from pointerdomain.registration.ladder import RegistrationPolicy, Rung, note_rung, resolve_policy, warn_degraded
from pointerdomain.registration.kinds import MemoryKind, describe_vmm, detect_vmm, kind_of, pageable_access_of
from pointerdomain.registration.pacing import RegistrationStats, Stopwatch, note_registration, register_in_calls
from pointerdomain.registration.prefault import NONE as NO_PREFAULT
from pointerdomain.registration.prefault import PrefaultReport, huge_page_share, prefault
from pointerdomain.errors import (
    AlreadyRegisteredError,
    BusyError,
    ClosedError,
    DomainError,
    InvalidArgumentError,
    InvalidRegistrationError,
    NonContiguousError,
    NotRegisteredError,
    RegistrationSpanError,
    with_address,
)
from pointerdomain.registration import budget, segments, teardown
from pointerdomain.registration.leases import DEFAULT_CLOSE_TIMEOUT_S, LeaseSet

if TYPE_CHECKING:
    from pointerdomain._platform.strict_alloc import ChunkTwins

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "Chunk",
    "RegisteredHostMemory",
    "check_granularity",
    "find_closed_registration",
    "find_registration",
    "open_registrations",
    "pinned_bytes",
    "register_host_tensor",
]

#: Default largest single registration call, bytes (well under the ~512 GiB driver limit).
DEFAULT_MAX_CHUNK_BYTES = 64 << 30


@dataclass(frozen=True, slots=True)
class Chunk:
    """One registration call: ``nbytes`` bytes from ``host_va``."""

    host_va: HostVA
    nbytes: int
    #: Where the registration call was made, when not at ``host_va`` (strict alias mode:
    #: the chunk's registered mapping of the same pages, apart from the other chunks').
    register_va: int | None = None
    #: This library made the registration call and undoes it (False: pinned_copy memory,
    #: a foreign registration, unpinned memory).
    owned: bool = True

    def contains(self, va: HostVA, nbytes: int) -> bool:
        return self.host_va.value <= va.value and va.value + nbytes <= self.host_va.value + self.nbytes

    @property
    def registered_address(self) -> int:
        """The address the backend knows this chunk by (``host_va`` unless strict)."""
        return self.host_va.value if self.register_va is None else self.register_va


class _Registry:
    """Active registrations by host VA range; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._active: dict[int, weakref.ref[RegisteredHostMemory]] = {}
        # Closed owners still alive (their tensor keeps the memory), so that building a
        # table over closed memory says ClosedError rather than "unregistered memory".
        self._closed: dict[int, weakref.ref[RegisteredHostMemory]] = {}
        self.pinned_bytes = 0

    def add(self, owner: RegisteredHostMemory) -> None:
        self._active[owner.host_va.value] = weakref.ref(owner)
        # a registration over these addresses proves any closed one there lost its memory
        lo, hi = owner.host_va.value, owner.host_va.value + owner.nbytes
        for key, ref in list(self._closed.items()):
            old = ref()
            if old is None or (old.host_va.value < hi and lo < old.host_va.value + old.nbytes):
                del self._closed[key]

    def remove(self, va: int) -> None:
        ref = self._active.pop(va, None)
        for key, old in list(self._closed.items()):
            if old() is None:
                del self._closed[key]
        if ref is not None and ref() is not None:  # closed, not collected
            self._closed[va] = ref

    def closed_overlapping(self, va: int, nbytes: int) -> RegisteredHostMemory | None:
        for ref in list(self._closed.values()):
            owner = ref()
            if (
                owner is not None and owner.host_va.value < va + nbytes and va < owner.host_va.value + owner.nbytes
                and _still_holds(owner)
            ):
                return owner
        return None

    def overlapping(self, va: int, nbytes: int) -> RegisteredHostMemory | None:
        for ref in list(self._active.values()):
            owner = ref()
            if owner is not None and owner.host_va.value < va + nbytes and va < owner.host_va.value + owner.nbytes:
                return owner
        return None


def _still_holds(owner: RegisteredHostMemory) -> bool:
    """Whether a closed owner's tensor still keeps the memory it registered: after
    ``set_`` / ``resize_`` / ``share_memory_`` the old storage may be freed and its
    addresses handed to someone else, who must not be told they are closed memory."""
    tensor = owner.tensor
    if tensor.data_ptr() != owner.host_va.value:
        return False
    storage = tensor.untyped_storage()
    return storage.data_ptr() + storage.nbytes() >= owner.host_va.value + owner.nbytes


_registry = _Registry()
_serial_lock = threading.Lock()
_serial = 0


def _next_serial() -> int:
    global _serial
    with _serial_lock:
        _serial += 1
        return _serial


# The process a registration was made in: a fork child's device runtime holds none of the
# parent's registrations (CUDA does not survive fork; ROCm marks pinned memory
# MADV_DONTFORK), so device work there over memory registered before the fork is refused
# (RegisteredHostMemory.check_this_process). Kept here, not asked of the kernel per launch.
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def last_serial() -> int:
    """The :attr:`RegisteredHostMemory.serial` of the newest registration made so far (0: none)."""
    return _serial


def find_registration(va: HostVA, nbytes: int = 1) -> RegisteredHostMemory | None:
    """The open registration containing ``[va, va + nbytes)``, or None.

    Raises:
        ClosedError: the registration's tensor released or moved its storage while
            registered (:meth:`RegisteredHostMemory.check_backing`).
        DomainError: ``va`` is not a HostVA (registrations are found by host address).
        InvalidArgumentError: ``nbytes`` is not a non-negative int.
    """
    if type(va) is not HostVA:
        raise DomainError(
            f"va: found a {type(va).__name__} ({describe(va, 40)}), expected a HostVA: registrations are found by host "
            "address. Fix: pass pointerdomain.HostVA.unsafe_from_int(tensor.data_ptr()) for host memory"
        )
    if type(nbytes) is not int or nbytes < 0:
        raise InvalidArgumentError(f"nbytes: found {describe(nbytes)}, expected an int >= 0. Fix: pass the range's size in bytes")
    with _registry._lock:
        owner = _registry.overlapping(va.value, max(nbytes, 1))
    if owner is not None and owner.contains(va, nbytes):
        owner.check_backing()  # a registration whose tensor released its memory finds nothing
        return owner
    return None


def open_registrations() -> list[RegisteredHostMemory]:
    """Every open registration (a snapshot; for diagnosis, e.g. checked mode)."""
    with _registry._lock:
        owners = [ref() for ref in _registry._active.values()]
    return [owner for owner in owners if owner is not None and not owner.closed]


def pinned_bytes() -> int:
    """Bytes of the open registrations made through pointerdomain in this process (ranges
    quarantined with their registration still in place are counted by
    :func:`pointerdomain.registration.teardown.quarantined_pinned`)."""
    return _registry.pinned_bytes


def _usage(device: Device) -> tuple[int, int]:
    return _registry.pinned_bytes, sum(o.nbytes for o in open_registrations() if o.device == device and not o.foreign)


budget.registry_usage = _usage  # the budget counts what is registered here


def find_closed_registration(va: HostVA, nbytes: int = 1) -> RegisteredHostMemory | None:
    """A closed registration (its owner still alive) overlapping ``[va, va + nbytes)``,
    or None. For error reporting: use :func:`find_registration` for open ones."""
    with _registry._lock:
        return _registry.closed_overlapping(va.value, max(nbytes, 1))


def _memlock_hint(nbytes: int) -> str:
    """The hint for a pinning failure, or "" unless registering ``nbytes`` more would
    exceed RLIMIT_MEMLOCK (then the limit is the cause, not e.g. pages shared with
    another registration)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _registry.pinned_bytes + nbytes <= soft:
        return ""
    return (
        f" RLIMIT_MEMLOCK is {soft} bytes and {_registry.pinned_bytes + nbytes} would be pinned: raise it "
        "(`ulimit -l unlimited`, docker --ulimit memlock=-1) or register less."
    )


def _release(
    backend: Backend, device: Device, chunks: tuple[Chunk, ...], nbytes: int, keep: object, leases: LeaseSet | None = None
) -> None:
    if leases is not None and not leases.closing:  # collected or at exit, not close(): still never under a copy
        try:
            leases.drain(f"registered memory at {chunks[0].host_va!r}" if chunks else "registered memory",
                         DEFAULT_CLOSE_TIMEOUT_S)
        except BusyError:
            return  # left registered (a leak) rather than unmapped under a running copy
    failed: list[str] = []
    still = 0
    for chunk in chunks:
        if chunk.owned:  # never a foreign registration (someone else's pin)
            code = backend.unregister(chunk.registered_address, device)
            if code not in (0, backend.status.not_registered):  # undone behind the owner already: nothing pinned
                failed.append(f"unregistering the chunk at {chunk.host_va!r} (+{chunk.nbytes}): "
                              f"{backend.describe(code)} (error {code})")
                still += chunk.nbytes if nbytes else 0
    with _registry._lock:
        if chunks:
            _registry.remove(chunks[0].host_va.value)
        _registry.pinned_bytes -= nbytes  # what stays pinned is the quarantine's now
    if failed:  # still pinned: never unmapped nor freed (keep), never registered again
        total = sum(c.nbytes for c in chunks)
        teardown.quarantine(chunks[0].host_va, total, str(device),
                            f"RegisteredHostMemory({chunks[0].host_va!r}, nbytes={total}, device={device})",
                            "runtime", "; ".join(failed), (keep, chunks), still)
        return
    if chunks:
        segments.forget(chunks[0].host_va.value)


def _release_pinned(backend: PinnedAllocator, device: Device, chunks: tuple[Chunk, ...], nbytes: int, keep: object) -> None:
    backend.pinned_release(chunks[0].host_va.value, device)  # the memory itself goes with its tensor
    with _registry._lock:
        _registry.remove(chunks[0].host_va.value)


class _Pin:
    """What handles on one registration share (:meth:`RegisteredHostMemory.acquire`):
    the registration is undone (``release``, once) when the last handle closes."""

    def __init__(self, release: Callable[[], None]) -> None:
        self.refs = 1
        self._release: Callable[[], None] | None = release
        self.handles: list[weakref.ref[RegisteredHostMemory]] = []

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def _drop(pin: _Pin, va: int) -> None:
    with _registry._lock:
        pin.refs -= 1
        if pin.refs > 0:  # point the registry at a handle that is still open
            live = [h for h in (r() for r in pin.handles) if h is not None and not h.closed]
            if live:
                _registry._active[va] = weakref.ref(live[0])
            return
    pin.release()


class RegisteredHostMemory(ProcessLocal):
    """Owner of one registered host range.

    Attributes:
        tensor: ``uint8`` CPU tensor of ``nbytes`` elements viewing the range (host VA).
        host_va: start of the range (the address CPU code and metadata use).
        nbytes: length in bytes.
        device: the device the registration was made for.
        chunks: the registration calls, in address order.
        rung: how it was registered (:class:`pointerdomain.registration.ladder.Rung`: single, chunked,
            not_needed, pinned_copy, unpinned; or the outcomes foreign, vmm_host).
        kind: the kind of memory (:class:`pointerdomain.registration.kinds.MemoryKind`).
        ladder_record: why each rung above ``rung`` failed, and recognised answers such as a
            coherent device's NotSupported (empty when there was nothing to say).
        owner: ``"pointerdomain"``, ``"foreign"`` (another owner registered the range;
            pointerdomain never unregisters it) or, for VMM host memory, the VMM handle
            that owns it (``"VMM handle 0x..."``). ``foreign`` is the same as a bool.
        stats: how the registration ran (:class:`pointerdomain.registration.pacing.RegistrationStats`:
            calls, seconds per GiB, the longest call, prefault, huge-page share).
        kernel_readable: False on the ``unpinned`` rung (only the copy engine may read it).
        strict: the host VA is a never-registered second mapping (strict alias mode).
        numa_node: NUMA node of the first page (None if unknown).

        alias_devices: the devices aliases were asked for (``device`` first).
        leases: the launches using it now (:class:`pointerdomain.registration.leases.LeaseSet`).

    Use as a context manager or call :meth:`close`; closing twice is a no-op.
    Tables built on this memory keep it alive and refuse to launch once it is closed;
    :meth:`close` waits for launches that use it (see :mod:`pointerdomain.registration.leases`).
    """

    def __init__(
        self, tensor: torch.Tensor, device: Device, granularity: int, max_chunk_bytes: int, *,
        policy: RegistrationPolicy | None = None, registered: torch.Tensor | None = None,
        library_owned: bool = False, segment: segments.Segment | None = None,
        prefaulted: PrefaultReport | None = None,
    ) -> None:
        self.device = device
        #: Order of creation in this process (metadata taken before a registration of the
        #: same addresses describes memory that was there before it).
        self.serial = _next_serial()
        #: The process this registration was made in (a fork child inherits the object, not
        #: the registration: :meth:`check_this_process`).
        self.pid = _pid
        # devices an alias was asked for (alias_of), own first: a portable registration
        # serves every device of its type; explain() looks aliases up on these
        self._alias_devices: dict[Device, None] = {device: None}
        self._lock = threading.Lock()
        self._closed = False
        #: the owner's close (set_owner_close), called by close() first
        self._owner_close: weakref.WeakMethod[Callable[..., None]] | None = None
        self.leases = LeaseSet()
        backend = backend_for(device)
        policy = resolve_policy(policy)
        nbytes = tensor.numel() * tensor.element_size()
        with _registry._lock:
            teardown.check_not_quarantined(tensor.data_ptr(), nbytes, "register")
            other = _registry.overlapping(tensor.data_ptr(), nbytes)
            if other is not None:
                raise AlreadyRegisteredError(
                    f"[{HostVA.unsafe_from_int(tensor.data_ptr())!r}, +{nbytes}) overlaps a registration at "
                    f"{other.host_va!r} (+{other.nbytes} bytes, {other.kind.value} memory, owner {other.owner}); "
                    "close that one first or reuse it"
                )
            self.tensor: torch.Tensor = tensor
            # knows its span: ``host_va + n`` past the registration raises RegistrationSpanError
            self.host_va: HostVA = HostVA.unsafe_from_int(tensor.data_ptr()).bounded(
                tensor.data_ptr(), tensor.data_ptr() + nbytes)
            self.nbytes: int = nbytes
            record: list[str] = []
            self._vmm_owner = ""
            self._prefaulted = prefaulted
            self._watch = Stopwatch()
            self._prefault = NO_PREFAULT
            twins = None
            if registered is not None:
                from pointerdomain._platform.strict_alloc import ChunkTwins  # imports _C: strict mode only

                twins = ChunkTwins(backend, registered)
            rung, chunks, self._registered = self._climb(
                backend, registered, twins, granularity, max_chunk_bytes, policy, library_owned, record)
            self.chunks = chunks
            self.rung: Rung = rung
            self.kind: MemoryKind = kind_of(rung)
            self.ladder_record: tuple[str, ...] = tuple(record)
            self.foreign = rung is Rung.FOREIGN
            self.owner: str = "foreign" if self.foreign else self._vmm_owner or "pointerdomain"
            # read only when huge pages were asked for: /proc/self/smaps costs ~50 ms in a large process
            thp = policy.huge_pages != "off" and bool(self._watch.durations)
            share = huge_page_share(self.host_va.value, self.nbytes) if thp else None
            self.stats: RegistrationStats = self._watch.stats(policy.max_call_seconds, self._prefault, share)
            self.kernel_readable = rung is not Rung.UNPINNED
            self.strict = self._registered is not None
            counted = self.nbytes if rung in (Rung.SINGLE, Rung.CHUNKED) else 0
            _registry.add(self)
            _registry.pinned_bytes += counted
        #: the shared segment the range lies in (noted in the host-wide ledger), or None
        self.segment = segment if counted else None
        if self.segment is not None:
            segments.note(self.host_va.value, self.segment, counted)
        note_rung(rung)
        note_registration(self.stats, self.nbytes, self.kind.value)
        self.numa_node: int | None = node_of(self.host_va.value)
        keep = (self.tensor, self._registered, twins)  # unregister before the mappings can go
        if rung is Rung.PINNED_COPY and isinstance(backend, PinnedAllocator):
            release = functools.partial(_release_pinned, backend, device, chunks, counted, keep)
        else:
            release = functools.partial(_release, backend, device, chunks, counted, keep, self.leases)
        self._pin = _Pin(release)
        self._pin.handles.append(weakref.ref(self))
        self._finalizer = weakref.finalize(self, _drop, self._pin, self.host_va.value)

    def _climb(
        self, backend: Backend, registered: torch.Tensor | None, twins: ChunkTwins | None, granularity: int,
        max_chunk_bytes: int, policy: RegistrationPolicy, library_owned: bool, record: list[str],
    ) -> tuple[Rung, tuple[Chunk, ...], torch.Tensor | None]:
        """Register down the ladder (pointerdomain.registration.ladder); called with the registry lock held."""
        base = self.host_va.value if registered is None else registered.data_ptr()
        reg_va = None if registered is None else base
        vmm = detect_vmm(backend, self.device, base, self.nbytes)  # raises MemoryKindError for a mixed range
        if vmm is not None:  # mapped for the device by its VMM handle: registering it again is refused
            self._vmm_owner = describe_vmm(vmm)
            record.append(f"VMM host memory owned by {self._vmm_owner}: the device reads it at its VA; never "
                          "registered nor unregistered")
            return Rung.VMM_HOST, (Chunk(self.host_va, self.nbytes, reg_va, owned=False),), registered
        if backend.pointer_is_host(base) and backend.pointer_is_host(base + self.nbytes - 1):
            record.append("already registered by another owner (pointer attributes): used, never unregistered")
            return Rung.FOREIGN, (Chunk(self.host_va, self.nbytes, reg_va, owned=False),), registered
        cut = max(granularity, (max_chunk_bytes // granularity) * granularity)
        plans: list[tuple[Rung, int]] = [(Rung.SINGLE, cut)]
        small = max(granularity, (min(policy.chunk_bytes, cut) // granularity) * granularity)
        if policy.on_failure == "degrade" and small < cut and small < self.nbytes:
            plans.append((Rung.CHUNKED, small))
        error: Exception | None = None
        access = pageable_access_of(backend, self.device)
        self._prefault = self._prefaulted or prefault(self.tensor if registered is None else registered,
                                                      policy.prefault_threads, policy.huge_pages)
        for rung, size in plans:
            code, chunks, k = self._register_all(backend, size, reg_va, twins, granularity,
                                                 policy.max_call_seconds)
            if code == 0:
                if rung is Rung.CHUNKED:
                    self._degraded(record, rung, "chunked")
                return rung, chunks, registered
            if code == backend.status.already_registered and backend.pointer_is_host(base) and backend.pointer_is_host(
                    base + self.nbytes - 1):
                record.append(f"already registered by another owner (error {code}): used, never unregistered")
                return Rung.FOREIGN, (Chunk(self.host_va, self.nbytes, reg_va, owned=False),), registered
            error = self._registration_error(backend, code, chunks[k], k, len(chunks))
            if code == backend.status.not_supported and not access.coherent:  # say why reading in place is no answer here
                error = type(error)(f"{error}; the memory is not device-accessible without registration "
                                    f"({access.reason})")
            record.append(f"{rung.value} ({len(chunks)} call(s) of up to {size} bytes): {error}")
            if code == backend.status.not_supported and access.coherent:  # an answer, not a failure: nothing to warn about
                record.append(f"not_needed: {access.reason}")
                return Rung.NOT_NEEDED, (Chunk(self.host_va, self.nbytes, reg_va, owned=False),), registered
            if policy.on_failure == "fail" or code == backend.status.already_registered:
                raise error
        assert error is not None
        if access.coherent:  # the device reads the memory in place: better than any copy
            self._degraded(record, Rung.NOT_NEEDED, "not_needed")
            return Rung.NOT_NEEDED, (Chunk(self.host_va, self.nbytes, reg_va, owned=False),), registered
        if library_owned and policy.allow_pinned_copy and isinstance(backend, PinnedAllocator):
            status, pinned = backend.pinned_alloc(self.nbytes, self.device)
            if status == 0 and pinned is not None:
                pinned.copy_(self.tensor)
                self.tensor = pinned[: self.nbytes]
                self.host_va = HostVA.unsafe_from_int(pinned.data_ptr())
                self._degraded(record, Rung.PINNED_COPY, "pinned_copy")
                return Rung.PINNED_COPY, (Chunk(self.host_va, self.nbytes, owned=False),), None
            record.append(f"pinned_copy: the runtime's pinned allocation failed: {backend.describe(status)} "
                          f"(error {status})")
        if policy.allow_unpinned:
            self._degraded(record, Rung.UNPINNED, "unpinned")
            return Rung.UNPINNED, (Chunk(self.host_va, self.nbytes, owned=False),), None
        raise type(error)(f"{error}; registration ladder exhausted: " + " | ".join(record))

    def _register_all(
        self, backend: Backend, size: int, reg_va: int | None, twins: ChunkTwins | None, granularity: int,
        max_call_seconds: float | None,
    ) -> tuple[int, tuple[Chunk, ...], int]:
        """(0, chunks, n) when every call succeeded, else (status, chunks made so far and the
        failing one last, index of the failing one) after unregistering the ones before it.
        Calls of ``size`` bytes, or sized to ``max_call_seconds`` (pointerdomain.registration.pacing);
        in strict mode each chunk at its own twin mapping (``twins``)."""
        prepare = getattr(backend, "prepare", None)  # emulated only: one memfd for all chunks (mid-page starts)
        if prepare is not None and (size < self.nbytes or max_call_seconds is not None):
            code = prepare(self.host_va.value if reg_va is None else reg_va, self.nbytes)
            if code != 0:
                return code, (Chunk(self.host_va, min(size, self.nbytes), reg_va),), 0
        chunks: list[Chunk] = []

        def call(start: int, length: int) -> int:
            where = None if reg_va is None else reg_va + start
            if twins is not None:  # strict: each chunk at its own mapping, apart from the others
                where = twins.address(start, length, length >= self.nbytes)
            chunks.append(Chunk(self.host_va + start, length, where))
            return backend.register(chunks[-1].registered_address, length, self.device)

        try:
            code, made, planned = register_in_calls(self.nbytes, granularity, size, max_call_seconds, call,
                                                    self._watch)
        except MemoryError:  # a strict twin could not be mapped: every chunk made so far is registered
            for d in reversed(chunks):
                backend.unregister(d.registered_address, self.device)
            raise
        if code == 0:
            return 0, tuple(chunks), made
        for d in reversed(chunks[:-1]):
            backend.unregister(d.registered_address, self.device)
        # padded with the planned count, so messages say "chunk k/n"
        return code, (*chunks, *[chunks[-1]] * (planned - made)), made - 1

    def _degraded(self, record: list[str], rung: Rung, cause: str) -> None:
        why = record[-1] if record else ""
        warn_degraded(f"{self.device.type}:{cause}",
                      f"pointerdomain: registration for {self.device} took the {rung.value!r} rung of the "
                      f"registration ladder ({why}); counted in pointerdomain.ladder.rung_counts(), warned once")

    def registered_address_of(self, va: HostVA) -> int:
        """The address the backend knows ``va`` by: ``va`` itself, or in strict alias mode the
        same offset in its chunk's registered mapping (ask the alias of this, never of ``va``)."""
        if self._registered is None:
            return va.value
        chunk = self.chunk_of(va, 1)  # each chunk has its own registered mapping
        return chunk.registered_address + (va.value - chunk.host_va.value)

    def note_alias_device(self, device: Device) -> None:
        """Record that an alias of this registration was asked for on ``device`` (the
        resolver calls this; handles from :meth:`acquire` share the record)."""
        if device in self._alias_devices or not device.same_type(self.device):
            return
        with _registry._lock:
            self._alias_devices.setdefault(device)

    @property
    def alias_devices(self) -> tuple[Device, ...]:
        """The devices aliases of this registration were asked for, :attr:`device` first
        (what :func:`pointerdomain.explain` looks an alias up on)."""
        with _registry._lock:
            return tuple(self._alias_devices)

    def acquire(self) -> RegisteredHostMemory:
        """Another handle on this registration (reference-counted): the range is unregistered
        when the last handle closes.

        Raises:
            ClosedError: this handle is closed.
        """
        with _registry._lock:
            self.check_open()
            other = object.__new__(RegisteredHostMemory)
            other.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_lock", "_closed", "_finalizer")})
            other._lock = threading.Lock()
            other._closed = False
            self._pin.refs += 1
            self._pin.handles.append(weakref.ref(other))
            other._finalizer = weakref.finalize(other, _drop, self._pin, self.host_va.value)
        return other

    @property
    def refcount(self) -> int:
        """Open handles on this registration (:meth:`acquire`)."""
        return self._pin.refs

    def _registration_error(self, backend: Backend, code: int, chunk: Chunk, done: int, total: int) -> Exception:
        where = f"registering chunk {done + 1}/{total} ({chunk.nbytes} bytes at {chunk.host_va!r}) for {self.device}"
        rolled = f"; the {done} chunk(s) before it were unregistered" if done else ""
        return registration_error(backend, code, where, rolled, _memlock_hint(self.nbytes))

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        """Raises:
        ClosedError: the memory was unregistered."""
        if self._closed:
            raise ClosedError(
                f"registered memory at {self.host_va!r} (+{self.nbytes} bytes) was closed (unregistered): found a "
                "closed registration, expected an open one. Fix: keep it open while tables use it, or register "
                "the memory again and rebuild the tables over it"
            )

    @property
    def inherited(self) -> bool:
        """True in a fork child for a registration made before the fork (in the parent)."""
        return self.pid != _pid

    def check_this_process(self) -> None:
        """Device work (an alias, a launch) is refused over a registration inherited
        through ``fork()``: the child's runtime holds none of the parent's registrations
        (CUDA does not survive fork; ROCm's pinned memory is not mapped in a child), and
        the child's copy of the bytes is its own (docs/design.md). Its host memory stays
        readable by the CPU, and ``close()`` works.

        Raises:
            ClosedError: this registration was made in another process (this one's fork parent)."""
        if self.pid != _pid:
            raise ClosedError(
                f"registered memory at {self.host_va!r} (+{self.nbytes} bytes) was registered in process {self.pid}, "
                f"before this process ({_pid}) forked from it: a fork child's device runtime holds none of the "
                "parent's registrations (CUDA does not survive fork), and the child's copy of the bytes no longer "
                "reaches the parent's aliases. Fix: register memory in this process (alloc_registered / "
                "register_host_tensor) and build tables over it"
            )

    def backing_released(self) -> bool:
        """True when the storage of the tensor this registration was made over no longer
        holds the registered range: released (``untyped_storage().resize_(0)``) or moved
        (``resize_`` past its size) while registered. Another allocation may then sit at
        that address, and an alias of this registration would not reach its bytes."""
        storage = self.tensor.untyped_storage()
        base = int(storage.data_ptr())
        start = self.host_va.value
        return not (base <= start and start + self.nbytes <= base + int(storage.nbytes()))

    def check_backing(self) -> None:
        """Raises:
        ClosedError: :meth:`backing_released`."""
        if self.backing_released():
            raise ClosedError(
                f"registered memory at {self.host_va!r} (+{self.nbytes} bytes): the storage of the tensor it was "
                "registered over was released or moved (untyped_storage().resize_(0), resize_) while registered, so "
                "its address may now name other memory its alias does not reach. Fix: close this registration "
                "(and keep a registered tensor's storage for as long as it is registered)"
            )

    def contains(self, va: HostVA, nbytes: int) -> bool:
        return self.host_va.value <= va.value and va.value + nbytes <= self.host_va.value + self.nbytes

    def chunk_of(self, va: HostVA, nbytes: int) -> Chunk:
        """The chunk holding ``[va, va + nbytes)``.

        Raises:
            NotRegisteredError: the range is outside this registration.
            RegistrationSpanError: it straddles two chunks (their aliases are not contiguous).
        """
        if not self.contains(va, nbytes):
            raise with_address(NotRegisteredError(
                f"[{describe(va)}, +{nbytes}) is not inside registration {self.host_va!r} (+{self.nbytes})"), va.value)
        for chunk in self.chunks:
            if chunk.contains(va, max(nbytes, 1)):
                return chunk
        raise with_address(RegistrationSpanError(
            f"[{describe(va)}, +{nbytes}) spans two registration chunks; their device aliases are not contiguous. "
            "Register with a granularity that is a multiple of the buffer's page block "
            "(KVLayout.page_block_bytes(), as HostKVPool does), or split the table per page block"
        ), va.value)

    def close(self, *, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Unregister (once). The tensor stays valid as ordinary host memory.

        First waits, up to ``timeout`` seconds, for every launch that uses this memory:
        CPU copies still running and, on CUDA, GPU work already queued that reads or
        writes it (an event per launch stream). Launches started meanwhile get
        ``ClosedError``.

        Raises:
            BusyError: a launch still used the memory after ``timeout``; it stays
                registered and open.
            InvalidTypeError: ``timeout`` is not an int or float; InvalidArgumentError:
                negative or NaN (both before anything is closed).
        """
        owner_close = self._owner_close() if self._owner_close is not None else None
        if owner_close is not None and not self._closed:
            owner_close(timeout=timeout)  # its hooks first (an engine's deregistration), then _close_now
            return
        self._close_now(timeout)

    def _close_now(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """:meth:`close` itself, for the object that owns this memory (:meth:`set_owner_close`)."""
        with self._lock:
            if self._closed:
                return
            self.leases.drain(f"registered memory at {self.host_va!r} (+{self.nbytes} bytes)", timeout)
            self._closed = True
        self._finalizer()

    def set_owner_close(self, close: Callable[..., None]) -> None:
        """Make :meth:`close` of this memory call ``close(timeout=...)`` instead, a bound
        method of the object that owns it (a host pool, whose close hooks, e.g. an engine's
        deregistration, must run before the runtime's unregister); that method ends with
        :meth:`_close_now`. Held weakly: once the owner is gone, close() is this memory's own."""
        self._owner_close = weakref.WeakMethod(close)

    def quarantine(self, stage: teardown.Stage, reason: str) -> teardown.Quarantine:
        """Close this registration without undoing it, for good: a teardown step before
        the runtime's unregister failed (an engine's deregistration), so the memory may still
        be reached by DMA and must stay registered and mapped. Every handle closes
        (launches refuse it), nothing unregisters or frees it, and the range is refused to
        later registrations (:mod:`pointerdomain.registration.teardown`).

        Raises:
            InvalidArgumentError: ``stage`` is not a teardown stage.
        """
        if stage not in teardown.STAGES:
            raise InvalidArgumentError(f"stage: found {describe(stage)}, expected one of {teardown.STAGES}")
        held = teardown.find_quarantine(self.host_va.value, self.nbytes)
        if held is not None and held.host_va == self.host_va:
            return held  # quarantined already (an adapter did, then the pool's close)
        with _registry._lock:
            for ref in self._pin.handles:
                handle = ref()
                if handle is not None:
                    handle._closed = True
                    handle._finalizer.detach()  # never unregistered
            self._pin.refs = 0
            self._pin._release = None
            _registry.remove(self.host_va.value)
            pinned = self.nbytes if self.rung in (Rung.SINGLE, Rung.CHUNKED) else 0
            _registry.pinned_bytes -= pinned  # the quarantine's now
        return teardown.quarantine(self.host_va, self.nbytes, str(self.device), repr(self), stage, reason,
                                   (self.tensor, self._registered, self._pin), pinned, memory=self)

    def __enter__(self) -> RegisteredHostMemory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.chunks)} chunk(s)"
        return f"RegisteredHostMemory({self.host_va!r}, nbytes={self.nbytes}, device={self.device}, {state})"


def check_granularity(granularity: int, max_chunk_bytes: int) -> None:
    if type(granularity) is not int or granularity <= 0:
        raise InvalidRegistrationError(f"granularity must be a positive int (bytes), got {describe(granularity)}")
    if type(max_chunk_bytes) is not int or max_chunk_bytes <= 0:
        raise InvalidRegistrationError(f"max_chunk_bytes must be a positive int (bytes), got {describe(max_chunk_bytes)}")
    if max_chunk_bytes < granularity:
        # a chunk is whole granules: a smaller cap could only be exceeded or split a granule
        raise InvalidRegistrationError(
            f"max_chunk_bytes: found {max_chunk_bytes}, below granularity {granularity}, expected at least one "
            "granule (chunks are cut on the granularity, so no chunk can be smaller). Fix: pass max_chunk_bytes "
            f">= {granularity}, or a smaller granularity"
        )


def register_host_tensor(
    tensor: torch.Tensor,
    device: Device | str | torch.device,
    *,
    granularity: int = mmap.PAGESIZE,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    policy: RegistrationPolicy | None = None,
    shared: bool = False,
) -> RegisteredHostMemory:
    """Register an existing contiguous CPU tensor's memory for ``device``.

    The owner's ``tensor`` is a flat ``uint8`` view of ``tensor``. On the emulated
    backend the tensor's pages are moved behind a memfd in place (bytes kept);
    a tensor sharing a 4 KiB page with separately registered memory is refused.

    A range another owner registered already (the runtime's pointer attributes, or
    error 712) is used without taking ownership: ``rung == "foreign"``, never
    unregistered by pointerdomain. With ``shared=True`` a range this library registered
    already, exactly (same start, length and device), gets another handle
    (:meth:`RegisteredHostMemory.acquire`; unregistered when the last closes); without it
    any overlap is :class:`AlreadyRegisteredError`. The ladder's ``pinned_copy`` rung is
    never used here (the caller's memory cannot be replaced). In strict alias mode the
    caller's memory cannot be mapped twice in place: it is registered as usual and the
    registration records ``strict=False`` (pointerdomain.registration.strict).

    Raises:
        DomainError: ``tensor`` is not in CPU memory (a CUDA tensor, or emulated device memory).
        NonContiguousError: ``tensor`` is strided.
        InvalidRegistrationError: ``tensor`` is empty, or ``granularity`` / ``max_chunk_bytes``
            not positive or ``max_chunk_bytes`` below ``granularity`` (a ``ValueError`` too).
        AlreadyRegisteredError: the range overlaps a registration.
        BudgetExceededError: registering would pass a limit of the memory budget
            (:mod:`pointerdomain.registration.budget`; ``MemlockBudgetError`` for
            RLIMIT_MEMLOCK); RegistrationRefusedError: the platform refuses registration
            (Confidential Computing). Both before any runtime call.
        RegistrationError: the runtime refused; nothing stays registered.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"register_host_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:
        raise DomainError(f"only CPU memory can be registered as host memory; got a tensor on {tensor.device}")
    where = memory_device(tensor)
    if where is not None:
        raise DomainError(
            f"the tensor is device memory of {where} (found a device address, expected host memory): only host "
            "memory can be registered. Fix: register a host buffer (or use alloc_registered) and copy into it"
        )
    if not tensor.is_contiguous():
        raise NonContiguousError(
            f"cannot register a strided tensor (shape {tuple(tensor.shape)}, stride {tensor.stride()}): "
            "its bytes are not one range; register its contiguous base buffer"
        )
    if tensor.numel() == 0:
        raise InvalidRegistrationError("cannot register an empty tensor: a 0-byte registration is invalid")
    check_granularity(granularity, max_chunk_bytes)
    resolve_policy(policy)
    if type(shared) is not bool:  # before the range is looked up: shared=1 is not True
        raise InvalidArgumentError(f"shared: found {describe(shared)}, expected a bool (True or False)")
    dev = validate_device(device)
    flat = tensor.reshape(-1).view(torch.uint8)
    if shared is True:
        with _registry._lock:
            other = _registry.overlapping(flat.data_ptr(), flat.numel())
            if (other is not None and not other.foreign and other.host_va.value == flat.data_ptr()
                    and other.nbytes == flat.numel() and other.device == dev):
                return other.acquire()
    segment = segments.segment_of(flat.data_ptr(), flat.numel())  # before the emulation may remap it
    budget.check_registration(flat.numel(), dev, policy=policy, segment=segment)
    return RegisteredHostMemory(flat, dev, granularity, max_chunk_bytes, policy=policy, segment=segment)
