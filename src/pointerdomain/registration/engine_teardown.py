"""What an engine adapter does when the engine will not let go of host memory: the
registered memory holding the range is quarantined (:mod:`pointerdomain.registration.teardown`):
closed, never unregistered, unmapped nor registered again, since the engine may still
reach it by DMA."""

from __future__ import annotations

from pointerdomain.arguments import describe
from pointerdomain.domains import HostVA
from pointerdomain.errors import QuarantinedError
from pointerdomain.registration.memory import find_registration
from pointerdomain.registration.teardown import find_quarantine

__all__ = ["quarantine_engine_range"]


def quarantine_engine_range(va: HostVA, nbytes: int, reason: str) -> QuarantinedError:
    """Quarantine the registration holding ``[va, va + nbytes)`` (if it is still open)
    because an engine's deregistration failed (``reason``); returns the error to raise,
    naming the owner."""
    owner = find_registration(va, nbytes) or find_registration(va, 1)
    if owner is not None:
        record = owner.quarantine("engine", reason)
        who = record.owner
    else:
        held = find_quarantine(va.value, nbytes)
        who = held.owner if held is not None else f"host memory at {describe(va)} (+{nbytes} bytes, not registered here)"
    return QuarantinedError(
        f"an engine's deregistration of [{describe(va)}, +{nbytes}) failed ({reason}): {who} is quarantined: closed, but "
        "kept registered and mapped for the life of the process and never registered again (the engine may still "
        "reach it). Fix: find why the engine kept the memory (`pointerdomain doctor` lists quarantined ranges)",
        who, "engine",
    )
