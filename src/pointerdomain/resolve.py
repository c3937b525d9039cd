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

Policies are cached per process and device; :func:`reset_resolver_cache` clears them.
"""

from __future__ import annotations

import ctypes
import enum
import glob
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

from pointerdomain._extension import extension, gpu_ops_built
from pointerdomain.domains import Device, DeviceAlias, HostVA
from pointerdomain.errors import AliasOpMissingError, NotRegisteredError, RuntimeCallError
from pointerdomain.guard import validate_device
from pointerdomain.memory import find_closed_registration, find_registration

if TYPE_CHECKING:
    import torch

__all__ = ["AliasPolicy", "alias_policy", "fallback_count", "reset_resolver_cache", "resolve_alias"]

_BUILD_HINT = (
    "install a pointerdomain build with the GPU ops: `pip install --no-build-isolation .` on a machine "
    "with the CUDA toolkit (nvcc on PATH) or, for ROCm, with POINTERDOMAIN_GPU=hip (README, Building)"
)


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
    if runtime == "hip":
        raise AliasOpMissingError(f"this pointerdomain build has no hipHostGetDevicePointer op; {_BUILD_HINT}")
    if can_use_host_pointer == 1:
        return AliasPolicy.HOST_POINTER_FALLBACK
    seen = "could not be read" if can_use_host_pointer is None else f"is {can_use_host_pointer}"
    raise AliasOpMissingError(
        "this pointerdomain build has no cudaHostGetDevicePointer op and "
        f"cudaDevAttrCanUseHostPointerForRegisteredMem {seen}, so host VAs are not valid in kernels; {_BUILD_HINT}"
    )


def _torch_runtime() -> str:
    import torch

    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def _load_cudart() -> Any:
    import torch

    roots = [os.path.dirname(torch.__file__), os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return ctypes.CDLL("libcudart.so")


def can_use_host_pointer(device: Device) -> int | None:
    """``cudaDevAttrCanUseHostPointerForRegisteredMem`` (attribute 91) for a CUDA device,
    or None if it cannot be read."""
    if gpu_ops_built():
        status, value = extension().gpu_can_use_host_pointer_for_registered_mem(device.ordinal)
        return int(value) if status == 0 else None
    try:
        lib = _load_cudart()
        value = ctypes.c_int(0)
        if lib.cudaDeviceGetAttribute(ctypes.byref(value), 91, device.ordinal) != 0:
            return None
        return int(value.value)
    except (OSError, AttributeError):
        return None


def alias_policy(device: Device | str | torch.device) -> AliasPolicy:
    """The cached alias policy for ``device``.

    Raises:
        InvalidDeviceError: the device does not exist.
        ExtensionUnavailableError: the extension does not import.
        AliasOpMissingError: see :func:`decide_policy`.
    """
    dev = validate_device(device)
    with _lock:
        policy = _policies.get(dev)
    if policy is not None:
        return policy
    if dev.type == "emulated":
        extension()
        policy = AliasPolicy.EMULATED
    else:
        has_op = gpu_ops_built() and hasattr(extension(), "gpu_host_get_device_pointer")
        runtime = str(getattr(extension(), "gpu_runtime", _torch_runtime()))
        policy = decide_policy(runtime, has_op, None if has_op else can_use_host_pointer(dev))
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
        AliasOpMissingError: no way to get a valid alias on this device.
        RuntimeCallError: the runtime call failed.
    """
    from pointerdomain.errors import DomainError

    if not isinstance(va, HostVA):
        raise DomainError(f"resolve_alias takes a HostVA, got {type(va).__name__}")
    dev = validate_device(device)
    policy = alias_policy(dev)
    owner = find_registration(va)
    if owner is not None:
        owner.check_open()
    elif (closed := find_closed_registration(va)) is not None:
        closed.check_open()  # raises ClosedError
    elif policy is AliasPolicy.EMULATED or not _runtime_reports_host(va):
        raise NotRegisteredError(
            f"{va!r} is not inside registered host memory; register it first "
            "(pointerdomain.alloc_registered / register_host_tensor)"
        )
    if policy is AliasPolicy.EMULATED:
        status, alias = extension().emu_get_device_pointer(va.value)
        if status != 0:
            raise NotRegisteredError(f"{va!r} has no emulated alias (status {status})")
        return DeviceAlias(int(alias), dev)
    if policy is AliasPolicy.HOST_POINTER_FALLBACK:
        global _fallbacks
        with _lock:
            _fallbacks += 1
            first = _fallbacks == 1
        if first:
            warnings.warn(
                f"pointerdomain: device-pointer op missing; using host VAs as aliases on {dev} "
                f"(CanUseHostPointerForRegisteredMem = 1). {_BUILD_HINT}",
                FallbackWarning,
                stacklevel=2,
            )
        return DeviceAlias(va.value, dev)
    status, alias = extension().gpu_host_get_device_pointer(va.value, dev.ordinal)
    if status != 0:
        raise RuntimeCallError("cudaHostGetDevicePointer", int(status), str(extension().gpu_error_string(status)))
    return DeviceAlias(int(alias), dev)


def _runtime_reports_host(va: HostVA) -> bool:
    """True when the GPU runtime knows ``va`` as pinned host memory (e.g. torch ``pin_memory()``)."""
    if not gpu_ops_built():
        return False
    status, is_host = extension().gpu_pointer_is_host(va.value)
    return status == 0 and bool(is_host)
