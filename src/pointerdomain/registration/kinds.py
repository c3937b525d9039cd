"""Typed kinds of host memory: every host range the library holds has one.

=====================  ==========================================================  ================
kind                   what it is                                                   device address
=====================  ==========================================================  ================
``registered``         an mmap / tensor this library registered (``single`` or      the runtime's alias
                       ``chunked`` rung); unregistered on close
``pinned``             the runtime's own pinned allocation of exactly the bytes     the runtime's alias
                       asked for (``cudaHostAlloc``; ``pinned_copy`` rung), never
                       a rounding allocator (torch's ``pin_memory()`` rounds up to
                       a power of two: 20.4 GiB asked, 32 GiB pinned)
``vmm_host``           VMM host memory (``cuMemCreate`` with a host NUMA location,   the VA itself
                       EGM): found through the driver, never registered again; its
                       owner is the VMM handle
``device_accessible``  pageable memory a coherent device reads in place            the VA itself
                       (``not_needed`` rung: GH200, GB200, GB10)
``foreign``            registered by another owner (UCX, NIXL, torch)               the runtime's alias
``pageable``           not device-readable (``unpinned`` rung: copy engine only)    none
=====================  ==========================================================  ================

:func:`detect` is what registration asks before it registers anything; :func:`kind_of`
maps a registration's rung to its kind; :func:`chunk_alias` gives a chunk's device
address for every kind (``explain`` and ``pointerdomain doctor`` use it).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from pointerdomain._platform.host_memory import PageableAccess, VmmAllocation, pageable_access, vmm_allocation
from pointerdomain.errors import DomainError, MemoryKindError
from pointerdomain.registration.ladder import Rung

if TYPE_CHECKING:
    from pointerdomain._platform.base import Backend
    from pointerdomain.devices import Device

__all__ = ["MemoryKind", "chunk_alias", "describe_vmm", "detect_vmm", "device_reads_va", "kind_of", "pageable_access_of"]


class MemoryKind(str, enum.Enum):
    """The kind of a host range (see the module docstring)."""

    REGISTERED = "registered"
    PINNED = "pinned"
    VMM_HOST = "vmm_host"
    DEVICE_ACCESSIBLE = "device_accessible"
    FOREIGN = "foreign"
    PAGEABLE = "pageable"


_BY_RUNG = {
    Rung.SINGLE: MemoryKind.REGISTERED,
    Rung.CHUNKED: MemoryKind.REGISTERED,
    Rung.NOT_NEEDED: MemoryKind.DEVICE_ACCESSIBLE,
    Rung.PINNED_COPY: MemoryKind.PINNED,
    Rung.UNPINNED: MemoryKind.PAGEABLE,
    Rung.FOREIGN: MemoryKind.FOREIGN,
    Rung.VMM_HOST: MemoryKind.VMM_HOST,
}


def kind_of(rung: Rung) -> MemoryKind:
    """The kind of memory a registration made on ``rung`` holds."""
    return _BY_RUNG[rung]


def device_reads_va(kind: MemoryKind) -> bool:
    """True where kernels read the host VA itself (no runtime alias exists to ask for)."""
    return kind in (MemoryKind.VMM_HOST, MemoryKind.DEVICE_ACCESSIBLE)


def describe_vmm(found: VmmAllocation) -> str:
    """The owner of VMM memory, for records and messages."""
    where = f"{found.location} node {found.node}" if found.node is not None else found.location
    mapped = f"mapped [{found.base:#x}, +{found.nbytes})" if found.nbytes else "mapped range unknown"
    return f"VMM handle {found.handle:#x} ({where}, {mapped})"


def detect_vmm(backend: Backend, device: Device, va: int, nbytes: int) -> VmmAllocation | None:
    """The VMM host allocation that maps all of ``[va, va + nbytes)``, or None when the
    range is ordinary memory.

    Raises:
        MemoryKindError: the range starts in VMM host memory and runs past its mapping,
            or starts in ordinary memory and runs into VMM memory (one registration
            cannot be both kinds); nothing was registered.
        DomainError: the range is VMM *device* memory (a device allocation, not host memory).
    """
    first = vmm_allocation(backend, va, device)
    last = vmm_allocation(backend, va + nbytes - 1, device)
    if first is None and last is None:
        return None
    if first is not None and not first.is_host:
        raise DomainError(
            f"[{va:#x}, +{nbytes}) is VMM device memory ({describe_vmm(first)}), found a device allocation, expected "
            "host memory. Fix: register host memory; device memory needs no registration")
    if first is None or last is None or last.handle != first.handle:
        inside = first or last
        assert inside is not None
        raise MemoryKindError(
            f"[{va:#x}, +{nbytes}) is partly VMM host memory ({describe_vmm(inside)}) and partly not: found a range "
            f"that crosses the mapping's end {inside.base + inside.nbytes:#x}, expected one kind of memory. Fix: "
            "register the VMM mapping and the other memory separately")
    return first


def pageable_access_of(backend: Backend, device: Device) -> PageableAccess:
    """Whether ``device`` reads pageable memory in place (:func:`pointerdomain._platform.host_memory.pageable_access`)."""
    return pageable_access(backend, device)


def chunk_alias(kind: MemoryKind, host_va: int, registered_address: int, nbytes: int,
                device: Device) -> tuple[int, int] | None:
    """(device address on ``device`` of a chunk of ``kind`` at ``host_va`` (registered at
    ``registered_address``; they differ in strict alias mode), its length), or None where
    there is none (``pageable``) or the backend cannot say. Never raises (diagnosis)."""
    from pointerdomain._platform import backend_for

    if kind is MemoryKind.PAGEABLE:
        return None
    if device_reads_va(kind):
        return host_va, nbytes
    try:
        status, alias = backend_for(device).alias(registered_address, device)
    except Exception:  # noqa: BLE001 - diagnosis must not raise (a build without the alias op)
        return None
    return (alias, nbytes) if status == 0 else None
