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
"""

from __future__ import annotations

import mmap
import resource
import threading
import weakref
from dataclasses import dataclass
from types import TracebackType

import torch

from pointerdomain._platform import Backend, backend_for, memory_device
from pointerdomain._platform.status import registration_error
from pointerdomain.devices import Device, validate_device
from pointerdomain.domains import HostVA
from pointerdomain.errors import (
    AlreadyRegisteredError,
    ClosedError,
    DomainError,
    InvalidArgumentError,
    InvalidRegistrationError,
    NonContiguousError,
    NotRegisteredError,
    RegistrationSpanError,
    with_address,
)

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

    def contains(self, va: HostVA, nbytes: int) -> bool:
        return self.host_va.value <= va.value and va.value + nbytes <= self.host_va.value + self.nbytes


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
        self._closed.pop(owner.host_va.value, None)

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
            if owner is not None and owner.host_va.value < va + nbytes and va < owner.host_va.value + owner.nbytes:
                return owner
        return None

    def overlapping(self, va: int, nbytes: int) -> RegisteredHostMemory | None:
        for ref in list(self._active.values()):
            owner = ref()
            if owner is not None and owner.host_va.value < va + nbytes and va < owner.host_va.value + owner.nbytes:
                return owner
        return None


_registry = _Registry()


def find_registration(va: HostVA, nbytes: int = 1) -> RegisteredHostMemory | None:
    """The open registration containing ``[va, va + nbytes)``, or None."""
    with _registry._lock:
        owner = _registry.overlapping(va.value, max(nbytes, 1))
    if owner is not None and owner.contains(va, nbytes):
        return owner
    return None


def open_registrations() -> list[RegisteredHostMemory]:
    """Every open registration (a snapshot; for diagnosis, e.g. checked mode)."""
    with _registry._lock:
        owners = [ref() for ref in _registry._active.values()]
    return [owner for owner in owners if owner is not None and not owner.closed]


def pinned_bytes() -> int:
    """Bytes registered through pointerdomain and not yet unregistered, in this process."""
    return _registry.pinned_bytes


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


def _release(backend: Backend, device: Device, chunks: tuple[Chunk, ...], nbytes: int, keep: object) -> None:
    for chunk in chunks:
        backend.unregister(chunk.host_va.value, device)
    with _registry._lock:
        if chunks:
            _registry.remove(chunks[0].host_va.value)
        _registry.pinned_bytes -= nbytes


class RegisteredHostMemory:
    """Owner of one registered host range.

    Attributes:
        tensor: ``uint8`` CPU tensor of ``nbytes`` elements viewing the range (host VA).
        host_va: start of the range (the address CPU code and metadata use).
        nbytes: length in bytes.
        device: the device the registration was made for.
        chunks: the registration calls, in address order.

    Use as a context manager or call :meth:`close`; closing twice is a no-op.
    Tables built on this memory keep it alive and refuse to launch once it is closed.
    """

    def __init__(self, tensor: torch.Tensor, device: Device, granularity: int, max_chunk_bytes: int) -> None:
        self.tensor = tensor
        self.device = device
        self.host_va = HostVA(tensor.data_ptr())
        self.nbytes = tensor.numel() * tensor.element_size()
        self._lock = threading.Lock()
        self._closed = False
        backend = backend_for(device)
        chunk_bytes = max(granularity, (max_chunk_bytes // granularity) * granularity)
        chunks = tuple(
            Chunk(self.host_va + start, min(chunk_bytes, self.nbytes - start))
            for start in range(0, self.nbytes, chunk_bytes)
        )
        with _registry._lock:
            other = _registry.overlapping(self.host_va.value, self.nbytes)
            if other is not None:
                raise AlreadyRegisteredError(
                    f"[{self.host_va!r}, +{self.nbytes}) overlaps a registration at {other.host_va!r} "
                    f"(+{other.nbytes} bytes); close that one first or reuse it"
                )
            done: list[Chunk] = []
            for chunk in chunks:
                code = backend.register(chunk.host_va.value, chunk.nbytes, device)
                if code != 0:
                    for d in reversed(done):
                        backend.unregister(d.host_va.value, device)
                    raise self._registration_error(backend, code, chunk, len(done), len(chunks))
                done.append(chunk)
            self.chunks = chunks
            _registry.add(self)
            _registry.pinned_bytes += self.nbytes
        self._finalizer = weakref.finalize(self, _release, backend, device, chunks, self.nbytes, tensor)

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
                f"[{va!r}, +{nbytes}) is not inside registration {self.host_va!r} (+{self.nbytes})"), va.value)
        for chunk in self.chunks:
            if chunk.contains(va, max(nbytes, 1)):
                return chunk
        raise with_address(RegistrationSpanError(
            f"[{va!r}, +{nbytes}) spans two registration chunks; their device aliases are not contiguous. "
            "Register with a granularity that is a multiple of the buffer's page block "
            "(KVLayout.page_block_bytes(), as HostKVPool does), or split the table per page block"
        ), va.value)

    def close(self) -> None:
        """Unregister (once). The tensor stays valid as ordinary host memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()

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
        raise InvalidRegistrationError(f"granularity must be a positive int (bytes), got {granularity!r}")
    if type(max_chunk_bytes) is not int or max_chunk_bytes <= 0:
        raise InvalidRegistrationError(f"max_chunk_bytes must be a positive int (bytes), got {max_chunk_bytes!r}")


def register_host_tensor(
    tensor: torch.Tensor,
    device: Device | str | torch.device,
    *,
    granularity: int = mmap.PAGESIZE,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> RegisteredHostMemory:
    """Register an existing contiguous CPU tensor's memory for ``device``.

    The owner's ``tensor`` is a flat ``uint8`` view of ``tensor``. On the emulated
    backend the tensor's pages are moved behind a memfd in place (bytes kept);
    a tensor sharing a 4 KiB page with separately registered memory is refused.

    Raises:
        DomainError: ``tensor`` is not in CPU memory (a CUDA tensor, or emulated device memory).
        NonContiguousError: ``tensor`` is strided.
        InvalidRegistrationError: ``tensor`` is empty (a ``ValueError`` too).
        AlreadyRegisteredError: the range overlaps a registration.
        RegistrationError: the runtime refused; nothing stays registered.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"register_host_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
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
    dev = validate_device(device)
    flat = tensor.reshape(-1).view(torch.uint8)
    return RegisteredHostMemory(flat, dev, granularity, max_chunk_bytes)
