"""The one exception tree of pointerdomain.

Every error is a :class:`PointerDomainError` and also the builtin a caller would
expect (as in attrs): a wrong address domain is a ``TypeError``, a bad value a
``ValueError``, an index out of range an ``IndexError``, a runtime failure a
``RuntimeError``. All are raised before any kernel launch or runtime call that
could corrupt memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import pydantic

if TYPE_CHECKING:
    from pointerdomain.explained import Explanation

__all__ = [
    "PointerDomainError",
    "DomainError",
    "DeviceMismatchError",
    "InvalidArgumentError",
    "InvalidDeviceError",
    "NonContiguousError",
    "LayoutError",
    "IndexValidationError",
    "RegistrationError",
    "AlreadyRegisteredError",
    "InvalidRegistrationError",
    "NotRegisteredError",
    "MemlockLimitError",
    "MemoryKindError",
    "RegistrationSpanError",
    "ClosedError",
    "ExtensionUnavailableError",
    "GpuRuntimeMismatchError",
    "AliasOpMissingError",
    "RuntimeCallError",
    "InvalidTypeError",
    "OutOfMemoryError",
    "NotPicklableError",
    "LayoutFieldError",
    "MetadataValidationError",
    "with_address",
    "BusyError",
    "GraphInvalidatedError",
    "LatchedError",
    "OverlapError",
    "UnpinnedMemoryError",
    "BudgetExceededError",
    "MemlockBudgetError",
    "RegistrationRefusedError",
    "QuarantinedError",
    "GroupRegistrationError",
]


class PointerDomainError(Exception):
    """Base class of every error raised by pointerdomain.

    Attributes:
        address: the address the error is about, where one was at hand when it was
            raised (checked mode's DomainError, NotRegisteredError, RegistrationSpanError),
            else None. :meth:`explain` says where it lies.
    """

    address: int | None = None

    def explain(self) -> Explanation | None:
        """:func:`pointerdomain.explain` of :attr:`address` (computed now, so it reflects
        the registrations at the time of the call), or None for an error without one."""
        if self.address is None:
            return None
        if _explainer is None:  # the package installs it on import; only a broken install lacks it
            raise ExtensionUnavailableError("no address lookup is installed: import pointerdomain")
        return _explainer(self.address)


#: ``explain(address)``, installed by the package (``pointerdomain/__init__.py``): the lookup
#: lives with the tools, above everything, and this module imports nothing above it.
_explainer: Callable[[int], Explanation] | None = None


def set_explainer(explainer: Callable[[int], Explanation]) -> None:
    """Install the lookup behind :meth:`PointerDomainError.explain` (the package does, on import)."""
    global _explainer
    _explainer = explainer


E = TypeVar("E", bound=PointerDomainError)


def with_address(exc: E, address: int) -> E:
    """``exc`` with :attr:`~PointerDomainError.address` set and a note saying how to
    explain it (``raise with_address(NotRegisteredError(...), va.value)``)."""
    exc.address = address
    exc.add_note(f"explain the address: exc.explain(), pointerdomain.explain({address:#x}), "
                 f"or `pointerdomain whatis {address:#x}` for its memory-map line")
    return exc


class DomainError(PointerDomainError, TypeError):
    """An address or pointer table of the wrong domain (host VA vs device alias),
    or memory of the wrong kind (a device address handed to CPU code)."""


class InvalidArgumentError(PointerDomainError, ValueError):
    """An argument outside its documented range or of the wrong kind (an address
    outside [0, 2**64), a stream that is not a non-negative int, an unknown backend,
    a non-positive CTA budget, a page number outside the pool)."""


class DeviceMismatchError(PointerDomainError, ValueError):
    """A table, tensor or address belongs to another device than the one asked for."""


class InvalidDeviceError(PointerDomainError, ValueError):
    """A device that does not exist (ordinal out of range, unknown device type)."""


class NonContiguousError(PointerDomainError, ValueError):
    """A strided tensor where one contiguous buffer is required."""


class LayoutError(PointerDomainError, ValueError):
    """A KV layout that is invalid or does not match the tables it describes."""


class IndexValidationError(PointerDomainError, IndexError):
    """Index tensors of the wrong dtype, device, shape or length, or out of range."""


class RegistrationError(PointerDomainError, RuntimeError):
    """Registering or unregistering host memory failed; nothing stays registered."""


class InvalidRegistrationError(RegistrationError, ValueError):
    """A registration request that is invalid before any runtime call: zero bytes, an
    empty tensor, a non-positive granularity or chunk size."""


class AlreadyRegisteredError(RegistrationError):
    """The range overlaps memory that is already registered
    (cudaErrorHostMemoryAlreadyRegistered, 712)."""


class NotRegisteredError(RegistrationError):
    """The address is not inside registered host memory
    (cudaErrorHostMemoryNotRegistered, 713)."""


class MemlockLimitError(RegistrationError):
    """Pinning failed and the range exceeds RLIMIT_MEMLOCK."""


class MemoryKindError(RegistrationError, ValueError):
    """The memory's kind refuses the request (e.g. a range that runs past the VMM
    allocation that maps it); the message names the kind, the limit and the owner."""


class RegistrationSpanError(PointerDomainError, ValueError):
    """A buffer spans two registrations: its aliases are not contiguous."""


class ClosedError(PointerDomainError, ValueError):
    """Use of registered memory (or a table built on it) after it was unregistered."""


class ExtensionUnavailableError(PointerDomainError, ImportError):
    """The compiled extension pointerdomain._C is missing or failed to import."""


class AliasOpMissingError(PointerDomainError, RuntimeError):
    """The extension lacks the device-pointer op and the host VA cannot stand in."""


class RuntimeCallError(PointerDomainError, RuntimeError):
    """A CUDA/HIP runtime call or kernel launch returned an error code."""

    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call} failed with error {code}: {message}")
        self.call = call
        self.code = code


class InvalidTypeError(PointerDomainError, TypeError):
    """An argument of the wrong Python type (a bare tensor where a list of tensors is
    required, a string where an int is)."""


class OutOfMemoryError(PointerDomainError, MemoryError):
    """An allocation of ``nbytes`` bytes failed (host or device memory); nothing was
    allocated. The message gives the size and what to do."""

    def __init__(self, message: str, nbytes: int) -> None:
        super().__init__(message)
        self.nbytes = nbytes


class NotPicklableError(PointerDomainError, TypeError):
    """``pickle`` / ``copy`` of an object holding process-local addresses or
    registrations (tables, pools, registered memory): they mean nothing in another
    process and must not be shared by two owners."""


class LayoutFieldError(LayoutError):
    """A :class:`~pointerdomain.KVLayout` field with an invalid value (the pydantic
    validation error, wrapped). Attributes: ``field``, ``value``, ``expected``."""

    def __init__(self, message: str, field: str, value: object, expected: str) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.expected = expected


class MetadataValidationError(pydantic.ValidationError, PointerDomainError):
    """Invalid metadata (:class:`~pointerdomain.BufferInfo`): pydantic's validation
    error (a ``ValueError``; field, input and expected type in its text) inside the tree,
    with the fix appended. Built with ``from_exception_data`` from pydantic's own error."""

    def __str__(self) -> str:
        return (
            f"{super().__str__()}\nFix: build BufferInfo from a HostVA (never an int or a DeviceAlias) with "
            "positive nbytes and item_bytes, nbytes a whole number of items; or take it from buffer_infos()"
        )
class BusyError(PointerDomainError, RuntimeError):
    """Memory could not be closed because a launch still uses it (a CPU copy running, or
    GPU work queued that reads it) after the bounded wait; nothing was unregistered.
    The message names the launch."""


class GraphInvalidatedError(PointerDomainError, RuntimeError):
    """A captured graph cannot be replayed: it was reset, or memory it captured was
    released; nothing was replayed. The message names the graph and what changed."""


class LatchedError(PointerDomainError, RuntimeError):
    """A transfer stream latched an earlier failed or partial outcome and was not reset:
    nothing was launched. The message names the outcome and the spans not copied."""


class OverlapError(PointerDomainError, ValueError):
    """Source and destination of one launch intersect in the same memory (a slot that is
    both read and written, or two tables over shared memory with different geometries):
    the result would depend on the copy order, so nothing is launched."""


class UnpinnedMemoryError(PointerDomainError, ValueError):
    """A kernel was asked to read host memory that the registration ladder left
    unpinned (rung ``unpinned``): only the copy engine may read it."""


class GpuRuntimeMismatchError(ExtensionUnavailableError):
    """The extension's GPU ops were built for another GPU runtime or major version than the
    torch in this process (a CUDA 13 wheel under a torch built for CUDA 12); it is not
    imported. Attributes: ``built`` (``CUDA 13.0.88``) and ``torch`` (``CUDA 12.8``)."""

    def __init__(self, message: str, built: str, torch: str) -> None:
        super().__init__(message)
        self.built = built
        self.torch = torch


class BudgetExceededError(OutOfMemoryError, RegistrationError):
    """A request of ``nbytes`` exceeds a limit of the memory budget
    (:mod:`pointerdomain.registration.budget`), found before anything was allocated or
    registered. Attributes: ``limit`` (its name: ``"cgroup"``, ``"memlock"``,
    ``"wddm"``, ``"device_cap"``, ...), ``room`` (bytes left under it), ``fix``."""

    def __init__(self, message: str, nbytes: int, limit: str, room: int, fix: str) -> None:
        super().__init__(message, nbytes)
        self.limit = limit
        self.room = room
        self.fix = fix


class MemlockBudgetError(BudgetExceededError, MemlockLimitError):
    """The budget's ``RLIMIT_MEMLOCK`` limit: registering ``nbytes`` more would pass it."""


class RegistrationRefusedError(RegistrationError):
    """The platform refuses host registration at every size (GPU Confidential Computing:
    ``cudaHostRegister`` returns 801), found before any call. Attributes: ``limit``
    (``"confidential_computing"``), ``fix``."""

    def __init__(self, message: str, limit: str, fix: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.fix = fix


class QuarantinedError(RegistrationError):
    """The range lies in quarantined memory: a teardown step (an engine's deregistration
    or the runtime's unregister) failed there, so the memory is never freed nor
    registered again in this process (:func:`pointerdomain.registration.teardown.quarantined`).
    Attributes: ``owner`` (the quarantined owner's description), ``stage``."""

    def __init__(self, message: str, owner: str, stage: str) -> None:
        super().__init__(message)
        self.owner = owner
        self.stage = stage


class GroupRegistrationError(RegistrationError):
    """The ranks of a process group did not reach one registration outcome
    (:func:`pointerdomain.distributed.register_group`): a rank failed to register, or
    registered on another rung of the ladder than the others and the group refuses the
    difference. Raised on every rank, with the same text; nothing stays registered.
    Attributes: ``ranks`` (the ranks at fault, ascending) and ``causes`` (rank -> cause)."""

    def __init__(self, message: str, ranks: tuple[int, ...], causes: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.causes = causes
