"""What kind of host memory an address is, as the platform sees it.

Two questions the registration layer asks before it registers anything:

* is the range **VMM host memory** (``cuMemCreate`` with a host location, e.g.
  ``CU_MEM_LOCATION_TYPE_HOST_NUMA``, or EGM)? Such memory is mapped and made
  device-accessible by its VMM handle; ``cuMemHostRegister`` over it is refused or,
  worse, pins a second time. :func:`vmm_allocation` asks the backend
  (:class:`HostKindQuery`: the CUDA driver's ``cuMemRetainAllocationHandle`` /
  ``cuMemGetAllocationPropertiesFromHandle`` / ``cuMemGetAddressRange``; the emulated
  backend's ``vmm-host`` profile);
* can the device read **pageable memory in place** through the host page tables
  (``PageableMemoryAccess`` and ``PageableMemoryAccessUsesHostPageTables`` both 1: the
  coherent parts GH200, GB200, GB10)? There a registration is not needed for kernels,
  and a driver that refuses it (``NotSupported``) gives an answer, not a failure
  (:func:`pageable_access`). HMM alone (``PageableMemoryAccess`` 1, host page tables 0)
  is not counted: pages are faulted over the bus, so registration still pays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pointerdomain._platform.base import Backend
    from pointerdomain.devices import Device

__all__ = ["NOT_SUPPORTED", "HostKindQuery", "PageableAccess", "VmmAllocation", "pageable_access", "vmm_allocation"]

#: cudaErrorNotSupported / CUDA_ERROR_NOT_SUPPORTED (same code in both APIs).
NOT_SUPPORTED = 801

VmmLocation = Literal["host", "host_numa", "host_numa_current", "device", "unknown"]


class VmmAllocation(NamedTuple):
    """One VMM allocation mapped at an address.

    Attributes:
        base: start of the mapped range holding the address (bytes, a VA).
        nbytes: length of that range.
        location: where its physical memory is (``"host_numa"`` for HOST_NUMA / EGM).
        node: the NUMA node (host locations) or device ordinal (``"device"``), or None.
        handle: the VMM handle (``CUmemGenericAllocationHandle``) that owns the memory.
    """

    base: int
    nbytes: int
    location: VmmLocation
    node: int | None
    handle: int

    @property
    def is_host(self) -> bool:
        return self.location in ("host", "host_numa", "host_numa_current")


@runtime_checkable
class HostKindQuery(Protocol):
    """A backend that can tell VMM memory from ordinary host memory. Optional: a backend
    without it never reports VMM memory (its allocations register as usual)."""

    def vmm_allocation(self, addr: int, device: Device) -> VmmAllocation | None:
        """The VMM allocation mapped at ``addr``, or None (not VMM memory, or unknown)."""
        ...


def vmm_allocation(backend: Backend, addr: int, device: Device) -> VmmAllocation | None:
    """:meth:`HostKindQuery.vmm_allocation` of ``backend``, None where it cannot ask."""
    if isinstance(backend, HostKindQuery):
        return backend.vmm_allocation(addr, device)
    return None


@dataclass(frozen=True, slots=True)
class PageableAccess:
    """Whether ``device`` reads pageable host memory in place.

    Attributes:
        coherent: True where both attributes are 1 (no registration needed for kernels).
        pageable_memory_access: ``PageableMemoryAccess`` (None: unreadable).
        uses_host_page_tables: ``PageableMemoryAccessUsesHostPageTables`` (None: unreadable).
        reason: one line for messages and ``pointerdomain doctor``.
    """

    coherent: bool
    pageable_memory_access: int | None
    uses_host_page_tables: int | None
    reason: str


def pageable_access(backend: Backend, device: Device) -> PageableAccess:
    """Read the two attributes of ``device`` through ``backend`` (never raises)."""
    try:
        access = backend.device_attribute("PageableMemoryAccess", device)
        tables = backend.device_attribute("PageableMemoryAccessUsesHostPageTables", device)
    except Exception as exc:  # noqa: BLE001 - a capability query must not fail a registration
        return PageableAccess(False, None, None, f"attributes unreadable ({type(exc).__name__}: {exc})")
    seen = f"PageableMemoryAccess={access}, PageableMemoryAccessUsesHostPageTables={tables}"
    if access == 1 and tables == 1:
        return PageableAccess(True, access, tables, f"{seen}: the device reads pageable memory in place")
    if access == 1:
        return PageableAccess(False, access, tables, f"{seen}: HMM only (pages fault over the bus); registration pays")
    return PageableAccess(False, access, tables, f"{seen}: the device cannot read unregistered memory")
