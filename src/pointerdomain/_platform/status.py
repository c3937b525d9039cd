"""Status codes from the backends turned into typed errors, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pointerdomain.errors import (
    AlreadyRegisteredError,
    IndexValidationError,
    InvalidArgumentError,
    MemlockLimitError,
    RegistrationError,
    RuntimeCallError,
)

if TYPE_CHECKING:
    from pointerdomain._platform.base import Backend

__all__ = [
    "ALREADY_REGISTERED",
    "MEMLOCK_EXCEEDED",
    "NOT_REGISTERED",
    "OUT_OF_MEMORY",
    "STAGED_BAD_INDEX",
    "STAGED_NOT_APPLICABLE",
    "check",
    "check_staged",
    "registration_error",
]

#: cudaErrorHostMemoryAlreadyRegistered; the emulated backend uses the same code.
ALREADY_REGISTERED = 712
#: cudaErrorHostMemoryNotRegistered; the emulated backend uses the same code.
NOT_REGISTERED = 713
#: cudaErrorMemoryAllocation; the emulated backend's "could not map" (kMapFailed).
OUT_OF_MEMORY = 2
#: The emulated backend's own "RLIMIT_MEMLOCK exceeded" (it knows the cause exactly; a
#: real runtime says only OUT_OF_MEMORY, so there the limit is inferred from the sizes).
MEMLOCK_EXCEEDED = 1000


def check(backend: Backend, call: str, code: int) -> None:
    """Raise :class:`RuntimeCallError` for a non-zero status of ``call``."""
    if code != 0:
        raise RuntimeCallError(call, code, backend.describe(code))


#: gpu::kStagedNotApplicable / kStagedBadIndex (src/kernels/gpu.h): the staged path's own codes.
STAGED_NOT_APPLICABLE = -1
STAGED_BAD_INDEX = -2


def check_staged(backend: Backend, code: int) -> None:
    """Raise the typed error for a non-zero status of the staged copy-engine path
    (the Python layer checks both conditions first; these are its last line)."""
    if code == STAGED_BAD_INDEX:
        raise IndexValidationError("staged transfer: a host slot index is out of range; nothing was copied")
    if code == STAGED_NOT_APPLICABLE:
        raise InvalidArgumentError(
            "staged transfer: the host layout gives no contiguous per-slot blocks, or the staging buffer "
            "holds no chunk; nothing was copied"
        )
    check(backend, "staged copy-engine transfer", code)


def registration_error(backend: Backend, code: int, where: str, rolled: str, memlock_hint: str) -> RegistrationError:
    """The error for a failed registration call.

    Args:
        where: which call failed (chunk, size, address, device).
        rolled: what was undone, "" if nothing.
        memlock_hint: non-empty when RLIMIT_MEMLOCK would be exceeded (then an
            out-of-memory status is a :class:`MemlockLimitError`).
    """
    if code == ALREADY_REGISTERED:
        return AlreadyRegisteredError(f"{where}: already registered (error {code}){rolled}")
    if code == MEMLOCK_EXCEEDED:
        hint = memlock_hint or " Raise RLIMIT_MEMLOCK (`ulimit -l unlimited`, docker --ulimit memlock=-1) or register less."
        return MemlockLimitError(f"{where}: {backend.describe(code)} (error {code}){rolled}.{hint}")
    # Only a real runtime's out-of-memory can be the memlock limit; the emulated backend
    # reports that one itself (above), so its out-of-memory is address space or memory.
    if memlock_hint and code in (OUT_OF_MEMORY, -OUT_OF_MEMORY) and backend.runtime != "emulated":
        return MemlockLimitError(f"{where}: {backend.describe(code)} (error {code}){rolled}.{memlock_hint}")
    return RegistrationError(f"{where}: {backend.describe(code)} (error {code}){rolled}")
