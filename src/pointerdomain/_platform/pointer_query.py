"""What the runtime knows about a bare address: host or device memory, which device,
and the allocation's range (for raw ``data_ptr()`` tables, :mod:`pointerdomain.compat`).

CUDA asks the driver, ``cuPointerGetAttributes`` (``libcuda.so.1`` through ctypes, as
:mod:`.cuda_driver` does): ``CU_POINTER_ATTRIBUTE_MEMORY_TYPE`` (1 host, 2 device),
``DEVICE_ORDINAL``, ``RANGE_START_ADDR`` and ``RANGE_SIZE``. Measured on an H200 (CUDA 13
driver): a ``pin_memory()`` tensor reads as host memory with the range of its pinned
block, a torch CUDA tensor as device memory with the range of its caching-allocator
segment, a ``cuMemHostRegister`` range as host memory with the registered range, and
plain malloc memory as unknown (the call fails). The emulated backend knows its own
device allocations (``device_lookup``); the range's end is found by bisection.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Literal, NamedTuple

__all__ = ["PointerInfo", "cuda_pointer_info", "span_by_lookup"]


class PointerInfo(NamedTuple):
    """One allocation as the runtime knows it."""

    kind: Literal["host", "device"]
    #: the device ordinal of device memory (-1 for host memory)
    ordinal: int
    #: the allocation's first byte and its size in bytes (``start <= addr < start + size``)
    start: int
    size: int


_MEMORY_TYPE, _DEVICE_ORDINAL, _RANGE_START, _RANGE_SIZE = 2, 9, 11, 12  # CUpointer_attribute (cuda.h)
_HOST, _DEVICE, _UNIFIED = 1, 2, 4  # CUmemorytype

_lock = threading.Lock()
_lib: Any = None
_lib_failed = False


def _driver() -> Any:
    global _lib, _lib_failed
    with _lock:
        if _lib is None and not _lib_failed:
            try:
                lib: Any = ctypes.CDLL("libcuda.so.1")
                lib.cuPointerGetAttributes.restype = ctypes.c_int
                lib.cuPointerGetAttributes.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
                _lib = lib
            except (OSError, AttributeError):
                _lib_failed = True
        return _lib


def cuda_pointer_info(addr: int) -> PointerInfo | None:
    """The driver's view of ``addr``, or None when it knows no allocation there (or
    libcuda cannot be loaded). Managed memory reads as None: it has no one domain."""
    lib = _driver()
    if lib is None:
        return None
    mtype, ordinal = ctypes.c_uint(0), ctypes.c_int(-1)
    start, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    attrs = (ctypes.c_int * 4)(_MEMORY_TYPE, _DEVICE_ORDINAL, _RANGE_START, _RANGE_SIZE)
    data = (ctypes.c_void_p * 4)(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in (mtype, ordinal, start, size)))
    if lib.cuPointerGetAttributes(4, attrs, data, ctypes.c_uint64(addr)) != 0:
        return None
    if size.value == 0 or not start.value <= addr < start.value + size.value:
        return None
    if mtype.value == _HOST:
        return PointerInfo("host", -1, start.value, size.value)
    if mtype.value == _DEVICE:
        return PointerInfo("device", ordinal.value, start.value, size.value)
    return None  # unified / array / unknown: not a domain this library can vouch for


def _grow(holds: Any, limit: int) -> int:
    """The largest ``n`` in ``[1, limit]`` with ``holds(n)`` (``holds(1)`` is True and
    ``holds`` is monotone): doubling, then bisection, about 2 log2(n) calls."""
    good = 1
    while good < limit and holds(min(good * 2, limit)):
        good = min(good * 2, limit)
    if good == limit:
        return good
    bad = min(good * 2, limit)
    while bad - good > 1:
        mid = (good + bad) // 2
        if holds(mid):
            good = mid
        else:
            bad = mid
    return good


def span_by_lookup(addr: int, holds: Any) -> tuple[int, int]:
    """``(start, size)`` of the allocation holding ``addr``, given ``holds(addr, nbytes) ->
    bool`` (True while ``[addr, addr + nbytes)`` lies inside one allocation; True for
    ``(addr, 1)``)."""
    end = addr + _grow(lambda n: holds(addr, n), (1 << 64) - addr)
    start = addr + 1 - _grow(lambda n: holds(addr + 1 - n, n), addr + 1)
    return start, end - start
