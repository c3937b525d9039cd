"""Registration through the CUDA driver API, loaded at run time.

``cuMemHostRegister`` / ``cuMemHostUnregister`` / ``cuMemHostGetDevicePointer`` come
from ``libcuda.so.1`` through ctypes (the module never links libcuda). A failed
driver call leaves no pending runtime error behind, unlike ``cudaHostRegister``,
whose failure the next unrelated runtime call reports (field notes; a vLLM fork moved
to the driver API for that reason). The driver's codes for the failures that matter
equal the runtime's (2 out of memory, 712 already registered, 713 not registered,
801 not supported), so :mod:`.status` maps them unchanged.

HIP keeps the runtime API (:class:`~pointerdomain._platform.cuda.CudaBackend`; its
``gpu_host_register`` consumes the pending error). Set
``POINTERDOMAIN_REGISTRATION_API=runtime`` to use the runtime API on CUDA too.

Also the device attributes ``pointerdomain doctor`` reports (:func:`device_attributes`), and
the VMM query that tells memory mapped by a ``cuMemCreate`` handle (host NUMA / EGM
memory) from ordinary host memory (:meth:`DriverApi.vmm_allocation`).
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any

from pointerdomain import env
from pointerdomain._platform.cuda import CudaBackend, install_vmm_query
from pointerdomain._platform.host_memory import VmmAllocation, VmmLocation

if TYPE_CHECKING:
    from pointerdomain.devices import Device

__all__ = ["ATTRIBUTES", "CudaDriverBackend", "DriverApi", "MemAllocationProp", "device_attributes", "driver_api"]

#: CUdevice_attribute values (cuda.h, CUDA 13.0) that decide strict mode and registration.
ATTRIBUTES = {
    "PageableMemoryAccess": 88,
    "CanUseHostPointerForRegisteredMem": 91,
    "HostRegisterSupported": 99,
    "PageableMemoryAccessUsesHostPageTables": 100,
    "HostRegisterReadOnlySupported": 113,
}
_PORTABLE, _DEVICEMAP = 0x01, 0x02  # CU_MEMHOSTREGISTER_*
#: CUmemLocationType values (cuda.h, CUDA 12.2+).
_LOCATIONS: dict[int, VmmLocation] = {1: "device", 2: "host", 3: "host_numa", 4: "host_numa_current"}


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class MemAllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` (cuda.h): what ``cuMemGetAllocationPropertiesFromHandle`` fills."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags),
                ("_room", ctypes.c_ubyte * 64)]  # room for fields a later cuda.h may add: the driver writes them


class DriverApi:
    """The few driver entry points, from ``libcuda.so.1``.

    Raises:
        OSError: libcuda cannot be loaded, lacks a symbol, or ``cuInit`` fails.
    """

    def __init__(self, path: str = "libcuda.so.1") -> None:
        lib: Any = ctypes.CDLL(path)
        self._lib = lib
        for name in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
                     "cuMemHostRegister_v2", "cuMemHostUnregister", "cuMemHostGetDevicePointer_v2",
                     "cuDeviceGetAttribute", "cuGetErrorString"):
            getattr(lib, name).restype = ctypes.c_int
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        # the VMM query (CUDA 10.2+ drivers); absent symbols leave it unavailable, not the API
        self.has_vmm_query = all(hasattr(lib, n) for n in (
            "cuMemRetainAllocationHandle", "cuMemGetAllocationPropertiesFromHandle", "cuMemRelease",
            "cuMemGetAddressRange_v2"))
        if self.has_vmm_query:
            for name in ("cuMemRetainAllocationHandle", "cuMemGetAllocationPropertiesFromHandle", "cuMemRelease",
                         "cuMemGetAddressRange_v2"):
                getattr(lib, name).restype = ctypes.c_int
            lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p]
            lib.cuMemGetAllocationPropertiesFromHandle.argtypes = [ctypes.POINTER(MemAllocationProp), ctypes.c_uint64]
            lib.cuMemRelease.argtypes = [ctypes.c_uint64]
            lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                    ctypes.c_uint64]
        status = int(lib.cuInit(0))
        if status != 0:
            raise OSError(f"cuInit failed with CUresult {status}")
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def _context(self, ordinal: int) -> tuple[int, ctypes.c_void_p]:
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is not None:
                return 0, ctx
            dev = ctypes.c_int(0)
            status = int(self._lib.cuDeviceGet(ctypes.byref(dev), ordinal))
            ctx = ctypes.c_void_p(None)
            if status == 0:  # the runtime's primary context: the one torch and the kernels use
                status = int(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value))
            if status == 0:
                self._contexts[ordinal] = ctx
            return status, ctx

    def _in_context(self, ordinal: int, call: Any) -> int:
        status, ctx = self._context(ordinal)
        if status != 0:
            return status
        status = int(self._lib.cuCtxPushCurrent_v2(ctx))
        if status != 0:
            return status
        try:
            return int(call())
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p(None)))

    def register(self, va: int, nbytes: int, ordinal: int) -> int:
        """cuMemHostRegister(portable | devicemap): CUresult."""
        return self._in_context(ordinal, lambda: self._lib.cuMemHostRegister_v2(va, nbytes, _PORTABLE | _DEVICEMAP))

    def unregister(self, va: int, ordinal: int) -> int:
        """cuMemHostUnregister: CUresult."""
        return self._in_context(ordinal, lambda: self._lib.cuMemHostUnregister(va))

    def device_pointer(self, va: int, ordinal: int) -> tuple[int, int]:
        """cuMemHostGetDevicePointer: (CUresult, alias)."""
        out = ctypes.c_uint64(0)
        status = self._in_context(ordinal, lambda: self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), va, 0))
        return status, int(out.value)

    def vmm_allocation(self, va: int, ordinal: int) -> VmmAllocation | None:
        """The VMM allocation mapped at ``va`` (``cuMemRetainAllocationHandle`` succeeds only
        for memory a ``cuMemMap`` mapped), or None: ordinary memory, or no VMM query."""
        if not self.has_vmm_query:
            return None
        handle = ctypes.c_uint64(0)
        prop = MemAllocationProp()
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)

        def query() -> int:
            status = int(self._lib.cuMemRetainAllocationHandle(ctypes.byref(handle), va))
            if status != 0:
                return status
            try:
                status = int(self._lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), handle.value))
                if status == 0 and int(self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), va)):
                    base.value, size.value = va, 0  # the range is unknown: the handle still names the owner
                return status
            finally:
                self._lib.cuMemRelease(handle.value)  # the retain's reference, not the owner's

        if self._in_context(ordinal, query) != 0:
            return None
        location = _LOCATIONS.get(int(prop.location.type), "unknown")
        return VmmAllocation(int(base.value), int(size.value), location, int(prop.location.id), int(handle.value))

    def attribute(self, name: str, ordinal: int) -> int | None:
        """A device attribute of :data:`ATTRIBUTES`, or None if the driver refuses."""
        dev, value = ctypes.c_int(0), ctypes.c_int(0)
        if int(self._lib.cuDeviceGet(ctypes.byref(dev), ordinal)) != 0:
            return None
        if int(self._lib.cuDeviceGetAttribute(ctypes.byref(value), ATTRIBUTES[name], dev.value)) != 0:
            return None
        return int(value.value)

    def error_string(self, code: int) -> str:
        text = ctypes.c_char_p(None)
        if int(self._lib.cuGetErrorString(code, ctypes.byref(text))) != 0 or text.value is None:
            return "unknown CUresult"
        return text.value.decode()


_api: DriverApi | None = None
_api_error: str = ""
_api_lock = threading.Lock()


def driver_api() -> DriverApi | None:
    """The process's :class:`DriverApi`, or None where libcuda cannot be used (no
    NVIDIA driver; see :data:`load_error`)."""
    global _api, _api_error
    with _api_lock:
        if _api is None and not _api_error:
            try:
                _api = DriverApi()
            except (OSError, AttributeError) as exc:
                _api_error = str(exc) or type(exc).__name__
        return _api


def load_error() -> str:
    """Why :func:`driver_api` returned None ("" if it did not)."""
    return _api_error


def device_attributes(ordinal: int) -> dict[str, int | None]:
    """Every attribute of :data:`ATTRIBUTES` of CUDA device ``ordinal`` (None: unreadable
    or no driver). For ``pointerdomain doctor`` and :func:`pointerdomain.strict_mode_capability`."""
    api = driver_api()
    return {name: (api.attribute(name, ordinal) if api is not None else None) for name in ATTRIBUTES}


def vmm_allocation(va: int, ordinal: int) -> VmmAllocation | None:
    """:meth:`DriverApi.vmm_allocation` of the process's driver API (None without libcuda)."""
    api = driver_api()
    return api.vmm_allocation(va, ordinal) if api is not None else None


install_vmm_query(vmm_allocation)


class CudaDriverBackend(CudaBackend):
    """:class:`CudaBackend` with registration through the driver API (see the module
    docstring); aliases, kernels and copies stay the runtime's."""

    def __init__(self, api: DriverApi) -> None:
        super().__init__()
        self.api = api
        self.name = "cuda-driver"

    def register(self, va: int, nbytes: int, device: Device) -> int:
        return self.api.register(va, nbytes, device.ordinal)

    def unregister(self, va: int, device: Device) -> int:
        return self.api.unregister(va, device.ordinal)


def cuda_backend() -> CudaBackend:
    """The backend for ``cuda`` devices of a build with the GPU ops: the driver-API one
    on CUDA when libcuda loads and ``POINTERDOMAIN_REGISTRATION_API`` is not ``runtime``,
    else the runtime one (always on HIP)."""
    base = CudaBackend()
    if base.runtime != "cuda" or env.text(env.REGISTRATION_API) == "runtime":
        return base
    api = driver_api()
    return CudaDriverBackend(api) if api is not None else base
