"""Resolution of a host VA to its device alias, and the fallback policy.

The alias comes from the extension's device-pointer op
(``cudaHostGetDevicePointer``; ``hipHostGetDevicePointer`` in a HIP build; the
emulated mapping on CPU). If the extension was built without the op (a CPU-only
wheel on a GPU machine, the failure that crashed servers at start-up), the host
VA may stand in for the alias only where the device reports
``cudaDevAttrCanUseHostPointerForRegisteredMem`` = 1 (CUDA Runtime API: "the
device can access host registered memory at the same virtual address as the
CPU"); that fallback warns once and is counted. On HIP, or where the attribute
is 0 or cannot be read, resolution raises :class:`AliasOpMissingError`.

Memory whose kind is ``vmm_host`` or ``device_accessible``
(:mod:`pointerdomain.registration.kinds`) has no runtime alias to ask for: the device
reads it at its host VA, which is its device address on every policy.

Policies are cached per process and device; :func:`reset_resolver_cache` clears them.
"""

from __future__ import annotations

import enum
import threading
import warnings
from typing import TYPE_CHECKING

from pointerdomain.arguments import describe
from pointerdomain._platform import backend_for, host_pointer_fallback
from pointerdomain._platform.cuda_hint import BUILD_HINT
from pointerdomain._platform.status import check
from pointerdomain.devices import Device, validate_device
from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain.errors import AliasOpMissingError, DomainError, NotRegisteredError, UnpinnedMemoryError
from pointerdomain.errors import with_address
from pointerdomain.registration.kinds import device_reads_va
from pointerdomain.registration.memory import find_closed_registration, find_registration

if TYPE_CHECKING:
    import torch

__all__ = [
    "AliasPolicy",
    "alias_of",
    "alias_policy",
    "cached_policy",
    "can_use_host_pointer",
    "decide_policy",
    "fallback_count",
    "policy_of",
    "reset_resolver_cache",
    "resolve_alias",
]

class AliasPolicy(enum.Enum):
    """How device aliases are obtained for a device."""

    RUNTIME_OP = "runtime_op"  #: cudaHostGetDevicePointer / hipHostGetDevicePointer
    EMULATED = "emulated"  #: the emulated second mapping (CPU backend)
    HOST_POINTER_FALLBACK = "host_pointer_fallback"  #: alias = host VA (attribute is 1, op missing)


class FallbackWarning(RuntimeWarning):
    """The device-pointer op is missing and host VAs are used as aliases."""


_lock = threading.Lock()
_policies: dict[Device, AliasPolicy] = {}
_fallbacks = 0


def reset_resolver_cache() -> None:
    """Forget cached policies and the fallback counter (thread-safe)."""
    global _fallbacks
    with _lock:
        _policies.clear()
        _fallbacks = 0


def fallback_count() -> int:
    """Number of aliases resolved through the host-pointer fallback in this process."""
    return _fallbacks


def decide_policy(runtime: str, has_op: bool, can_use_host_pointer: int | None) -> AliasPolicy:
    """The policy for a GPU device given what was found.

    Args:
        runtime: "cuda" or "hip".
        has_op: the extension provides the device-pointer op.
        can_use_host_pointer: the device attribute, or None if it could not be read.

    Raises:
        AliasOpMissingError: no op, and the host VA is not usable by kernels (or unknown, or HIP).
    """
    if has_op:
        return AliasPolicy.RUNTIME_OP
    if not host_pointer_fallback(runtime):
        raise AliasOpMissingError(f"this pointerdomain build has no hipHostGetDevicePointer op; {BUILD_HINT}")
    if can_use_host_pointer == 1:
        return AliasPolicy.HOST_POINTER_FALLBACK
    seen = "could not be read" if can_use_host_pointer is None else f"is {can_use_host_pointer}"
    raise AliasOpMissingError(
        "this pointerdomain build has no cudaHostGetDevicePointer op and "
        f"cudaDevAttrCanUseHostPointerForRegisteredMem {seen}, so host VAs are not valid in kernels; {BUILD_HINT}"
    )


def can_use_host_pointer(device: Device) -> int | None:
    """``cudaDevAttrCanUseHostPointerForRegisteredMem`` of ``device``, or None if it cannot be read."""
    return backend_for(device).can_use_host_pointer(device)


def policy_of(device: Device) -> AliasPolicy:
    """The alias policy of ``device``, not cached (see :func:`alias_policy`).

    Raises:
        ExtensionUnavailableError: the extension does not import.
        AliasOpMissingError: see :func:`decide_policy`.
    """
    backend = backend_for(device)
    if backend.alias_is_mapping:
        return AliasPolicy.EMULATED
    has_op = backend.has_alias_op
    return decide_policy(backend.runtime, has_op, None if has_op else backend.can_use_host_pointer(device))


def alias_policy(device: Device | str | torch.device) -> AliasPolicy:
    """The cached alias policy for ``device``.

    Raises:
        InvalidDeviceError: the device does not exist.
        ExtensionUnavailableError: the extension does not import.
        AliasOpMissingError: see :func:`decide_policy`.
    """
    return cached_policy(validate_device(device))


def cached_policy(dev: Device) -> AliasPolicy:
    """:func:`alias_policy` for a validated device (internal callers)."""
    with _lock:
        policy = _policies.get(dev)
    if policy is not None:
        return policy
    policy = policy_of(dev)
    with _lock:
        _policies[dev] = policy
    return policy


def resolve_alias(va: HostVA, device: Device | str | torch.device) -> DeviceAlias:
    """The device alias of a registered host address, for ``device``.

    Interior pointers keep their offset from the start of their registration.

    Raises:
        DomainError: ``va`` is not a HostVA (e.g. already an alias).
        NotRegisteredError: ``va`` is not inside registered host memory.
        ClosedError: its registration was closed.
        UnpinnedMemoryError: ``va`` lies in memory on the registration ladder's ``unpinned``
            rung: nothing was registered, so it has no device alias (only the library's
            copy engine path reads it, through its host VA).
        AliasOpMissingError: no way to get a valid alias on this device.
        RuntimeCallError: the runtime call failed.
    """
    if not isinstance(va, HostVA):
        raise DomainError(f"resolve_alias takes a HostVA, got {type(va).__name__}")
    alias = alias_of(va, validate_device(device))
    owner = find_registration(va)
    if owner is None:
        return alias
    if not owner.kernel_readable:
        raise with_address(UnpinnedMemoryError(
            f"{describe(va)} lies in host memory that is not pinned (registration ladder rung 'unpinned'): it has no "
            "device alias, and a kernel given its host VA would fault. Fix: register the memory pinned, or move it "
            "with backend='copy_engine'"), va.value)
    chunk = owner.chunk_of(va, 1)
    lo = alias.value - (va.value - chunk.host_va.value)  # the chunk's alias range: one registration call
    return alias.bounded(lo, lo + chunk.nbytes)


def alias_of(va: HostVA, dev: Device) -> DeviceAlias:
    """:func:`resolve_alias` for a validated device (internal callers)."""
    policy = cached_policy(dev)
    owner = find_registration(va)
    if owner is not None:
        owner.check_open()
        owner.check_this_process()  # a fork child's runtime holds none of the parent's registrations
    elif (closed := find_closed_registration(va)) is not None:
        closed.check_open()  # raises ClosedError
    elif policy is AliasPolicy.EMULATED or not backend_for(dev).pointer_is_host(va.value):
        raise with_address(NotRegisteredError(
            f"{describe(va)} is not inside registered host memory; register it first "
            "(pointerdomain.alloc_registered / register_host_tensor)"
        ), va.value)
    backend = backend_for(dev)
    if owner is not None and not owner.kernel_readable:
        return DeviceAlias.unsafe_from_int(va.value, dev)  # unpinned rung: the copy engine stages the host VA itself
    if owner is not None and device_reads_va(owner.kind):
        owner.note_alias_device(dev)
        return DeviceAlias.unsafe_from_int(va.value, dev)  # VMM host / device-accessible memory: the VA itself
    # strict alias mode: the alias of the registered mapping, never of the host VA itself
    where = va.value if owner is None else owner.registered_address_of(va)
    if owner is not None:
        owner.note_alias_device(dev)  # so explain() knows which devices' aliases to look up
    if policy is AliasPolicy.EMULATED:
        status, alias = backend.alias(where, dev)
        if status != 0:
            raise with_address(NotRegisteredError(f"{describe(va)} has no emulated alias (status {status})"), va.value)
        return DeviceAlias.unsafe_from_int(alias, dev)
    if policy is AliasPolicy.HOST_POINTER_FALLBACK:
        global _fallbacks
        with _lock:
            _fallbacks += 1
            first = _fallbacks == 1
        if first:
            warnings.warn(
                f"pointerdomain: device-pointer op missing; using host VAs as aliases on {dev} "
                f"(CanUseHostPointerForRegisteredMem = 1). {BUILD_HINT}",
                FallbackWarning,
                stacklevel=2,
            )
        return DeviceAlias.unsafe_from_int(where, dev)
    status, alias = backend.alias(where, dev)
    check(backend, "cudaHostGetDevicePointer", status)
    return DeviceAlias.unsafe_from_int(alias, dev)
