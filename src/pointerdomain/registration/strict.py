"""Strict alias mode: make a host VA handed to a kernel fault on
every GPU, not only where the device alias differs from the host VA.

On NVIDIA cards with ``CanUseHostPointerForRegisteredMem`` = 1 the alias of registered
memory equals its host VA, so a kernel given a host VA works and the MI355X / WSL2
crash stays hidden. In strict mode, host memory the library allocates
(:func:`~pointerdomain.alloc_registered`, :class:`~pointerdomain.HostKVPool`) is one
memfd mapped twice: the :class:`~pointerdomain.HostVA` (CPU code, metadata, host tables,
transfer engines) is the mapping that is never registered; the
:class:`~pointerdomain.DeviceAlias` (kernels, copy-engine descriptors) is the alias of
the second, registered mapping. Bytes written through one are read through the other.
In a forked child each mapping is a private copy of its bytes (a child's writes never reach
the parent; the two no longer share bytes there). Measured on an H200 (field notes): a kernel reading the never-registered mapping fails
with error 700; where ``PageableMemoryAccess`` = 1 (HMM / ATS) it would not fault
(:func:`strict_mode_capability`).

:func:`~pointerdomain.register_host_tensor` in strict mode registers the caller's memory
as usual (it cannot be mapped a second time in place without moving the caller's
pages) and records ``strict=False`` on the registration: the strict guarantee covers
memory the library allocates. Memory from the ``pinned_copy`` rung is also not strict.

Switches: ``POINTERDOMAIN_STRICT_ALIAS=1`` in the environment (read at import),
:func:`strict_alias` (a call or a context manager), ``pytest --strict-alias``
(tests/conftest.py). Off by default: two mappings cost a second set of page-table
entries and cudaHostRegister pins through the second one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from pointerdomain.arguments import describe
from pointerdomain.devices import Device, validate_device
from pointerdomain import env
from pointerdomain.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["ENV_VAR", "StrictCapability", "strict_alias", "strict_alias_enabled", "strict_mode_capability"]

#: The environment variable that turns strict mode on at import (``1``).
ENV_VAR = env.STRICT_ALIAS

_lock = threading.Lock()
_enabled = env.flag(ENV_VAR)  # "1"; "", "0" or unset off; anything else warns (EnvironmentValueWarning), off


def strict_alias_enabled() -> bool:
    """True while strict alias mode is on (new allocations are double-mapped)."""
    return _enabled


class strict_alias:  # noqa: N801 - used like a function: strict_alias(True) / with strict_alias(True)
    """Turn strict alias mode on or off for the process, from now on.

    ``strict_alias(True)`` switches it; used as a context manager it switches back to
    the previous state on exit. Registrations keep the mode they were made with.

    Raises:
        InvalidArgumentError: ``enabled`` is not a bool.
    """

    def __init__(self, enabled: bool = True) -> None:
        global _enabled
        if type(enabled) is not bool:
            raise InvalidArgumentError(f"enabled: strict_alias takes a bool (True or False), got {describe(enabled)}")
        with _lock:
            self.previous = _enabled
            _enabled = enabled

    def __enter__(self) -> strict_alias:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _enabled
        with _lock:
            _enabled = self.previous


@dataclass(frozen=True, slots=True)
class StrictCapability:
    """Whether strict mode makes a host VA in a kernel fault on a device.

    Attributes:
        device: the device asked about.
        can_fault: True: a kernel given a never-registered host VA faults (error 700);
            False: it does not (HMM / ATS read pageable memory, or the emulated CPU
            kernel); None: unknown (the attribute could not be read).
        pageable_memory_access: ``PageableMemoryAccess`` (None: unreadable / not CUDA).
        uses_host_page_tables: ``PageableMemoryAccessUsesHostPageTables`` (ATS).
        reason: one line saying why.
    """

    device: Device
    can_fault: bool | None
    pageable_memory_access: int | None
    uses_host_page_tables: int | None
    reason: str


def strict_mode_capability(device: Device | str | torch.device) -> StrictCapability:
    """Can strict mode fault on ``device``? (for ``pointerdomain doctor``).

    Rule (CUDA Runtime API, cudaDevAttrPageableMemoryAccess: "the device supports coherently
    accessing pageable memory without calling cudaHostRegister on it"): ``PageableMemoryAccess``
    = 0 means a kernel touching the unregistered mapping faults; 1 (HMM, or ATS where
    ``PageableMemoryAccessUsesHostPageTables`` = 1) means it reads it and nothing faults.

    Raises:
        InvalidDeviceError: the device does not exist.
    """
    dev = validate_device(device)
    if dev.runtime.host_memory:
        return StrictCapability(dev, False, None, None,
                                "emulated: the alias is always a distinct mapping, but the CPU kernel can read any "
                                "mapped address; checked mode (not a fault) catches host VAs there")
    from pointerdomain._platform import backend_for

    backend = backend_for(dev)
    if not backend.driver_attributes:
        return StrictCapability(dev, None, None, None,
                                f"{backend.runtime}: PageableMemoryAccess is read through the CUDA driver only")
    from pointerdomain._platform.cuda_driver import device_attributes, load_error

    attrs = device_attributes(dev.ordinal)
    pma, ats = attrs["PageableMemoryAccess"], attrs["PageableMemoryAccessUsesHostPageTables"]
    if pma is None:
        return StrictCapability(dev, None, None, ats, f"PageableMemoryAccess unreadable ({load_error() or 'driver refused'})")
    if pma == 0:
        return StrictCapability(dev, True, pma, ats,
                                "PageableMemoryAccess = 0: a kernel given a never-registered host VA faults (error 700)")
    kind = "ATS" if ats == 1 else "HMM"
    return StrictCapability(dev, False, pma, ats,
                            f"PageableMemoryAccess = 1 ({kind}): the GPU reads pageable memory, nothing would fault")
