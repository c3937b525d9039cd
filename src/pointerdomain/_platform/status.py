"""Status codes from the backends turned into typed errors, in one place.

Each runtime names its own codes: a :class:`StatusTable` per runtime (CUDA's
``cudaError_t``, HIP's ``hipError_t``, the emulated backend's own), chosen by the
backend through its ``runtime`` (:attr:`Backend.status <pointerdomain._platform.base.RuntimeTraits.status>`).
The numbers the library acts on are equal in CUDA and HIP (712 / 713 host memory
already / not registered, 2 out of memory, 801 not supported, 900 capture unsupported),
but the names are not, and some numbers mean different things (201:
``cudaErrorDeviceUninitialized`` / ``hipErrorInvalidContext``) or exist in one runtime
only (HIP's 1052 / 1053 ``hipErrorRuntimeMemory`` / ``hipErrorRuntimeOther``): a HIP
failure reads as HIP's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from pointerdomain.errors import (
    AlreadyRegisteredError,
    IndexValidationError,
    InvalidArgumentError,
    MemlockLimitError,
    RegistrationError,
    RuntimeCallError,
)

__all__ = [
    "ALREADY_REGISTERED",
    "CUDA_STATUS",
    "EMULATED_STATUS",
    "HIP_STATUS",
    "MEMLOCK_EXCEEDED",
    "NOT_REGISTERED",
    "OUT_OF_MEMORY",
    "STAGED_BAD_INDEX",
    "STAGED_NOT_APPLICABLE",
    "StatusTable",
    "check",
    "check_staged",
    "registration_error",
    "status_table",
]


@dataclass(frozen=True, slots=True)
class StatusTable:
    """One runtime's status codes: the ones the library acts on, and the names of the
    codes it may meet (for messages).

    Attributes:
        runtime: ``"cuda"``, ``"hip"`` or ``"emulated"``.
        already_registered: host memory already registered (a foreign pin).
        not_registered: host memory not registered.
        out_of_memory: an allocation or pin failed for memory (may be RLIMIT_MEMLOCK).
        not_supported: the operation is not supported (e.g. registration refused).
        capture_unsupported: the call is not allowed while the stream is being captured.
        memlock_exceeded: the runtime's own "RLIMIT_MEMLOCK exceeded" code, or None
            where the runtime says only ``out_of_memory`` (then the limit is inferred).
        names: code -> the runtime's name for it.
    """

    runtime: str
    already_registered: int
    not_registered: int
    out_of_memory: int
    not_supported: int
    capture_unsupported: int
    memlock_exceeded: int | None
    names: Mapping[int, str]

    def name(self, code: int) -> str:
        """The runtime's name of ``code`` (``hipErrorHostMemoryAlreadyRegistered``), or
        ``"<runtime> status <code>"`` for a code this table does not name."""
        return self.names.get(code) or f"{self.runtime} status {code}"


#: cudaError_t (CUDA runtime, driver_types.h) for the codes the library can meet.
_CUDA_NAMES = {
    0: "cudaSuccess",
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    35: "cudaErrorInsufficientDriver",
    98: "cudaErrorInvalidDeviceFunction",
    100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice",
    201: "cudaErrorDeviceUninitialized",
    209: "cudaErrorNoKernelImageForDevice",
    400: "cudaErrorInvalidResourceHandle",
    600: "cudaErrorNotReady",
    700: "cudaErrorIllegalAddress",
    701: "cudaErrorLaunchOutOfResources",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
    719: "cudaErrorLaunchFailure",
    801: "cudaErrorNotSupported",
    900: "cudaErrorStreamCaptureUnsupported",
    901: "cudaErrorStreamCaptureInvalidated",
    906: "cudaErrorStreamCaptureImplicit",
    999: "cudaErrorUnknown",
}

#: hipError_t (HIP runtime, hip_runtime_api.h) for the same failures.
_HIP_NAMES = {
    0: "hipSuccess",
    1: "hipErrorInvalidValue",
    2: "hipErrorOutOfMemory",
    3: "hipErrorNotInitialized",
    35: "hipErrorInsufficientDriver",
    98: "hipErrorInvalidDeviceFunction",
    100: "hipErrorNoDevice",
    101: "hipErrorInvalidDevice",
    201: "hipErrorInvalidContext",
    209: "hipErrorNoBinaryForGpu",
    400: "hipErrorInvalidHandle",
    600: "hipErrorNotReady",
    700: "hipErrorIllegalAddress",
    701: "hipErrorLaunchOutOfResources",
    712: "hipErrorHostMemoryAlreadyRegistered",
    713: "hipErrorHostMemoryNotRegistered",
    719: "hipErrorLaunchFailure",
    801: "hipErrorNotSupported",
    900: "hipErrorStreamCaptureUnsupported",
    901: "hipErrorStreamCaptureInvalidated",
    906: "hipErrorStreamCaptureImplicit",
    999: "hipErrorUnknown",
    1052: "hipErrorRuntimeMemory",
    1053: "hipErrorRuntimeOther",
}

#: The emulated backend's own "RLIMIT_MEMLOCK exceeded" (it knows the cause exactly; a
#: real runtime says only out of memory, so there the limit is inferred from the sizes).
MEMLOCK_EXCEEDED = 1000

#: The emulated backend's codes (src/kernels/emulation.h; 712 / 713 as CUDA numbers them).
_EMULATED_NAMES = {
    0: "ok",
    1: "invalid value",
    2: "map failed",
    3: "shared page",
    101: "wrong device",
    712: "already registered",
    713: "not registered",
    801: "not supported",
    MEMLOCK_EXCEEDED: "memlock exceeded",
}

CUDA_STATUS = StatusTable("cuda", 712, 713, 2, 801, 900, None, MappingProxyType(_CUDA_NAMES))
HIP_STATUS = StatusTable("hip", 712, 713, 2, 801, 900, None, MappingProxyType(_HIP_NAMES))
EMULATED_STATUS = StatusTable("emulated", 712, 713, 2, 801, 900, MEMLOCK_EXCEEDED, MappingProxyType(_EMULATED_NAMES))

_TABLES = {table.runtime: table for table in (CUDA_STATUS, HIP_STATUS, EMULATED_STATUS)}


def status_table(runtime: str) -> StatusTable:
    """The status table of ``runtime`` (``"cuda"``, ``"hip"``, ``"emulated"``); a runtime
    without its own table reads codes as CUDA numbers them, under its own name."""
    table = _TABLES.get(runtime)
    if table is None:
        table = StatusTable(runtime, 712, 713, 2, 801, 900, None, MappingProxyType({}))
    return table


#: cudaErrorHostMemoryAlreadyRegistered (= hipErrorHostMemoryAlreadyRegistered); a backend's
#: own number is ``backend.status.already_registered``.
ALREADY_REGISTERED = CUDA_STATUS.already_registered
#: cudaErrorHostMemoryNotRegistered (= hipErrorHostMemoryNotRegistered).
NOT_REGISTERED = CUDA_STATUS.not_registered
#: cudaErrorMemoryAllocation (= hipErrorOutOfMemory); the emulated backend's "could not map".
OUT_OF_MEMORY = CUDA_STATUS.out_of_memory


class Backend(Protocol):
    """What this module asks of a :class:`~pointerdomain._platform.base.Backend`."""

    @property
    def status(self) -> StatusTable: ...

    def describe(self, code: int) -> str: ...


def _text(backend: Backend, code: int) -> str:
    """``"<runtime's name>: <runtime's text>"`` of ``code``."""
    return f"{backend.status.name(code)}: {backend.describe(code)}"


def check(backend: Backend, call: str, code: int) -> None:
    """Raise :class:`RuntimeCallError` for a non-zero status of ``call``, named as the
    backend's runtime names it."""
    if code != 0:
        raise RuntimeCallError(call, code, _text(backend, code))


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
    """The error for a failed registration call, with the status named as the backend's
    runtime names it.

    Args:
        where: which call failed (chunk, size, address, device).
        rolled: what was undone, "" if nothing.
        memlock_hint: non-empty when RLIMIT_MEMLOCK would be exceeded (then an
            out-of-memory status is a :class:`MemlockLimitError`).
    """
    table = backend.status
    named = f"{table.name(code)}, error {code}"
    if code == table.already_registered:
        return AlreadyRegisteredError(f"{where}: already registered ({named}){rolled}")
    if table.memlock_exceeded is not None and code == table.memlock_exceeded:
        hint = memlock_hint or " Raise RLIMIT_MEMLOCK (`ulimit -l unlimited`, docker --ulimit memlock=-1) or register less."
        return MemlockLimitError(f"{where}: {backend.describe(code)} ({named}){rolled}.{hint}")
    # Only a runtime that cannot say "memlock" itself may mean the limit by out-of-memory;
    # the emulated backend reports that one itself (above), so its out-of-memory is address
    # space or memory.
    if memlock_hint and table.memlock_exceeded is None and code in (table.out_of_memory, -table.out_of_memory):
        return MemlockLimitError(f"{where}: {backend.describe(code)} ({named}){rolled}.{memlock_hint}")
    return RegistrationError(f"{where}: {backend.describe(code)} ({named}){rolled}")
