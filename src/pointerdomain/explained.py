"""What :func:`pointerdomain.explain` returns: :class:`Explanation`, where one address lies.

A plain record, so that errors can name it (:meth:`pointerdomain.errors.PointerDomainError.explain`)
without importing the lookup, which lives with the tools (:mod:`pointerdomain.tools.explanation`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = ["Domain", "Explanation"]

Domain = Literal["host_va", "device_alias", "device_memory", "unknown"]


@dataclass(frozen=True)
class Explanation:
    """Where one address lies. Fields that do not apply are None.

    Attributes:
        address: the address asked about (an int in [0, 2**64)).
        domain: ``"host_va"`` (a CPU address of registered memory), ``"device_alias"``
            (what kernels read for it), ``"device_memory"`` or ``"unknown"``.
        kind: ``"registration"`` or ``"device allocation"``.
        owner: the owner object's repr (``RegisteredHostMemory(...)``).
        base: start of the registration (host VA) or of the alias range the address is in.
        nbytes: length of that registration / allocation in bytes.
        offset: ``address - base`` in bytes.
        device: the device the memory belongs to or is registered for; for a device
            alias, the device the alias is for (a portable registration has one per device).
        other_domain_address: the same byte in the other domain (the alias of a host VA,
            the host VA of an alias); equal to ``address`` where the device's alias is the VA.
        state: ``"open"``, ``"closed"`` (unregistered, owner still alive) or
            ``"quarantined"`` (closed for launches, but still registered and mapped: a
            teardown step failed, ``registration.teardown``).
        chunk: ``(k, n)``: the address is in registration call k (1-based) of n.
        rung: how the registration was made (registration ladder rung).
        memory_kind: the kind of host memory (:class:`pointerdomain.registration.kinds.MemoryKind`
            value: ``registered``, ``pinned``, ``vmm_host``, ``device_accessible``, ``foreign``,
            ``pageable``), for a registration or for host memory the platform can tell
            (VMM memory, another owner's pin, pageable memory a coherent device reads).
        memory_owner: who owns the memory where that is not the registration (a VMM handle).
        numa_node: the NUMA node of the mapping's pages when all are on one node.
        pointer_attributes: the platform's answers for the address (backend name ->
            facts such as ``registered_host``: the driver knows this very address as
            registered (pinned) host memory, False for a strict-mode host VA, whose
            registered twin is another mapping; ``alias_status``).
        maps_line: the ``/proc/<pid>/maps`` line of the mapping holding the address.
        pid: the process whose memory map was read.
        notes: short remarks (why a lookup was not possible, alias == VA, ...).
    """

    address: int
    domain: Domain
    kind: str | None = None
    owner: str | None = None
    base: int | None = None
    nbytes: int | None = None
    offset: int | None = None
    device: str | None = None
    other_domain_address: int | None = None
    state: Literal["open", "closed", "quarantined"] | None = None
    chunk: tuple[int, int] | None = None
    rung: str | None = None
    memory_kind: str | None = None
    memory_owner: str | None = None
    numa_node: int | None = None
    pointer_attributes: dict[str, dict[str, object]] = field(default_factory=dict)
    maps_line: str | None = None
    pid: int = 0
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict (addresses as hex strings too, under ``*_hex``)."""
        out = asdict(self)
        for key in ("address", "base", "other_domain_address"):
            value = out[key]
            out[f"{key}_hex"] = None if value is None else f"{value:#x}"
        return out

    def text(self) -> str:
        """Several lines for a human (what ``pointerdomain whatis`` prints)."""
        what = {
            "host_va": "a HostVA (CPU address) of registered host memory",
            "device_alias": "a DeviceAlias (the address kernels read) of registered host memory",
            "device_memory": "device memory",
            "unknown": (f"in no registration or device allocation pointerdomain knows in process {self.pid}"
                        if self.pid in (0, os.getpid()) else
                        f"process {self.pid}'s registrations are not visible from this process: its memory map only"),
        }[self.domain]
        lines = [f"{self.address:#x}: {what}"]
        if self.owner is not None:
            lines.append(f"  owner: {self.owner}")
        if self.base is not None:
            size = f" of {self.nbytes} bytes" if self.nbytes is not None else ""
            lines.append(f"  offset: {self.offset} bytes from {self.base:#x}{size}")
        if self.chunk is not None:
            lines.append(f"  chunk: {self.chunk[0]} of {self.chunk[1]} registration call(s)")
        for label, value in (("device", self.device), ("state", self.state), ("rung", self.rung),
                             ("kind", self.memory_kind), ("memory owner", self.memory_owner)):
            if value is not None:
                lines.append(f"  {label}: {value}")
        if self.other_domain_address is not None:
            other = "device alias" if self.domain == "host_va" else "host VA"
            lines.append(f"  {other}: {self.other_domain_address:#x}")
        if self.numa_node is not None:
            lines.append(f"  NUMA node: {self.numa_node}")
        for backend, facts in self.pointer_attributes.items():
            lines.append(f"  driver ({backend}): " + ", ".join(f"{k}={v}" for k, v in facts.items()))
        lines.append(f"  /proc/{self.pid}/maps: {self.maps_line or 'no mapping holds this address'}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()
