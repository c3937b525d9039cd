"""Ordered teardown and quarantine.

Registered memory is let go in one order, always: the transfer engines' registrations
(NIXL, Mooncake: close hooks of the pool, :mod:`pointerdomain.adapters`), then the
runtime's (``cudaHostUnregister``), then the mapping (the tensor that holds it), then
the owner (the shared segment's fd, the pool object). A step that fails stops the ones
after it: memory that an engine may still read or write by DMA, or that the driver
still holds pinned, must not be unmapped, freed or handed to the allocator again.

Such a range is *quarantined*: its owner is closed (launches and tables refuse it),
the memory stays mapped for the life of the process (the objects that hold it are kept
here), nothing is registered over it again (:class:`~pointerdomain.errors.QuarantinedError`),
and ``pointerdomain doctor`` and :func:`pointerdomain.explain` report it. The records
are :func:`quarantined`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from pointerdomain.domains import HostVA
from pointerdomain.errors import QuarantinedError

__all__ = [
    "STAGES",
    "Quarantine",
    "Stage",
    "check_not_quarantined",
    "find_quarantine",
    "quarantine",
    "quarantined",
    "quarantined_pinned",
]

Stage = Literal["engine", "runtime", "unmap", "owner"]

#: The teardown steps, in the order they run.
STAGES: tuple[Stage, ...] = ("engine", "runtime", "unmap", "owner")


@dataclass(frozen=True)
class Quarantine:
    """One quarantined range.

    Attributes:
        host_va: start of the range.
        nbytes: length in bytes.
        device: the device it was registered for.
        owner: the owner's description (``RegisteredHostMemory(...)``).
        stage: the teardown step that failed (``"engine"``: an engine's deregistration;
            ``"runtime"``: the runtime's unregister); the steps after it never ran.
        reason: what failed (the error).
        since: ``time.time()`` when it was quarantined.
        pinned: bytes of it still pinned (counted by the memory budget; no longer in
            :func:`pointerdomain.registration.memory.pinned_bytes`, which counts open
            registrations).
    """

    host_va: HostVA
    nbytes: int
    device: str
    owner: str
    stage: Stage
    reason: str
    since: float
    pinned: int = 0
    #: what keeps the memory mapped (the tensor, the registered mapping): never released
    keep: object = field(default=None, repr=False, compare=False)
    #: the registration object, where one was quarantined (``explain`` finds its aliases)
    memory: object = field(default=None, repr=False, compare=False)

    def overlaps(self, va: int, nbytes: int) -> bool:
        return self.host_va.value < va + max(nbytes, 1) and va < self.host_va.value + self.nbytes

    def as_dict(self) -> dict[str, object]:
        """JSON-ready (``doctor --json``)."""
        return {"host_va": hex(self.host_va.value), "nbytes": self.nbytes, "device": self.device,
                "owner": self.owner, "stage": self.stage, "reason": self.reason, "since": self.since,
                "pinned": self.pinned}


_lock = threading.Lock()
_records: list[Quarantine] = []


def quarantine(host_va: HostVA, nbytes: int, device: str, owner: str, stage: Stage, reason: str,
               keep: object, pinned: int = 0, memory: object = None) -> Quarantine:
    """Record ``[host_va, host_va + nbytes)`` as quarantined (``pinned`` bytes of it still
    pinned) and keep ``keep`` (what maps it) and ``memory`` (its registration object, if
    any) alive for the rest of the process."""
    record = Quarantine(host_va, nbytes, device, owner, stage, reason, time.time(), pinned, keep, memory)
    with _lock:
        _records.append(record)
    return record


def quarantined() -> list[Quarantine]:
    """Every quarantined range of this process, oldest first."""
    with _lock:
        return list(_records)


def quarantined_pinned() -> int:
    """Bytes of quarantined ranges still pinned (the memory budget counts them)."""
    with _lock:
        return sum(q.pinned for q in _records)


def find_quarantine(va: int, nbytes: int = 1) -> Quarantine | None:
    """The quarantined range overlapping ``[va, va + nbytes)``, or None."""
    with _lock:
        return next((q for q in _records if q.overlaps(va, nbytes)), None)


def check_not_quarantined(va: int, nbytes: int, what: str) -> None:
    """Raises:
    QuarantinedError: ``[va, va + nbytes)`` overlaps a quarantined range (``what`` names the request)."""
    found = find_quarantine(va, nbytes)
    if found is not None:
        raise QuarantinedError(
            f"{what}: [{HostVA.unsafe_from_int(va)!r}, +{nbytes}) overlaps quarantined memory at {found.host_va!r} "
            f"(+{found.nbytes} bytes, {found.owner}): its {found.stage} teardown step failed ({found.reason}), so it "
            "is never freed nor registered again in this process. Fix: use other memory; the range is reported by "
            "`pointerdomain doctor` and pointerdomain.explain()",
            found.owner, found.stage,
        )
