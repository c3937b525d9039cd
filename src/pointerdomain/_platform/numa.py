"""NUMA facts: the node of a host page, the node of a GPU, and placing pages on a node.

Sources: get_mempolicy(2) with ``MPOL_F_NODE | MPOL_F_ADDR`` (node of the page at an
address), falling back to ``/proc/self/numa_maps`` (containers often forbid the
NUMA syscalls without CAP_SYS_NICE); mbind(2) with ``MPOL_MF_MOVE`` to move already
populated pages; a GPU's node from ``/sys/bus/pci/devices/<bdf>/numa_node``
(``-1`` there means the platform does not say). The syscalls are called through
ctypes (``syscall(2)``): no libnuma is needed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pointerdomain.devices import Device

__all__ = ["bind_to_node", "device_node", "node_count", "node_of"]

# syscall numbers (asm/unistd.h): get_mempolicy, mbind
_SYSCALLS = {"x86_64": (239, 237), "aarch64": (236, 235), "ppc64le": (260, 259)}
_MPOL_F_NODE, _MPOL_F_ADDR = 1, 2
_MPOL_BIND, _MPOL_MF_MOVE = 2, 1 << 1
_NODES = "/sys/devices/system/node"


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def node_count() -> int:
    """Number of NUMA nodes the kernel reports (1 where sysfs does not say)."""
    try:
        return max(1, sum(1 for name in os.listdir(_NODES) if re.fullmatch(r"node\d+", name)))
    except OSError:
        return 1


def node_of(va: int) -> int | None:
    """The NUMA node of the (populated) page at ``va``, or None if it cannot be found."""
    numbers = _SYSCALLS.get(platform.machine())
    libc = _libc()
    if numbers is not None and libc is not None:
        node = ctypes.c_int(-1)
        page = va & ~(mmap.PAGESIZE - 1)
        rc = libc.syscall(ctypes.c_long(numbers[0]), ctypes.byref(node), ctypes.c_void_p(None), ctypes.c_ulong(0),
                          ctypes.c_void_p(page), ctypes.c_ulong(_MPOL_F_NODE | _MPOL_F_ADDR))
        if rc == 0 and node.value >= 0:
            return int(node.value)
    return _node_from_numa_maps(va)


def _node_from_numa_maps(va: int) -> int | None:
    start = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
                if lo <= va < hi:
                    start = lo
                    break
        if start is None:
            return None
        with open("/proc/self/numa_maps") as f:
            for line in f:
                fields = line.split()
                if fields and int(fields[0], 16) == start:
                    counts = {int(m[1]): int(m[2]) for m in (re.fullmatch(r"N(\d+)=(\d+)", x) for x in fields) if m}
                    if counts:
                        return max(counts, key=lambda n: counts[n])
                    return 0 if node_count() == 1 else None
    except (OSError, ValueError):
        pass
    return 0 if start is not None and node_count() == 1 else None


def device_node(device: Device) -> int | None:
    """The NUMA node a device is attached to: from sysfs for a CUDA GPU (None where it
    says -1 or cannot be read); node 0 for an emulated device on a one-node machine
    (its "device memory" is host memory), else None."""
    if device.type == "emulated":
        return 0 if node_count() == 1 else None
    try:
        import torch

        props = torch.cuda.get_device_properties(device.ordinal)
        domain, bus, slot = (int(getattr(props, name)) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        bdf = f"{domain:04x}:{bus:02x}:{slot:02x}.0"
        with open(f"/sys/bus/pci/devices/{bdf}/numa_node") as f:
            node = int(f.read().strip())
    except (OSError, ValueError, AttributeError, RuntimeError, AssertionError):
        return None
    return node if node >= 0 else None


def bind_to_node(va: int, nbytes: int, node: int) -> str:
    """Move the pages of ``[va, va + nbytes)`` to ``node`` (mbind, MPOL_BIND, MPOL_MF_MOVE).

    Returns:
        "" on success, else why not (for the registration's record and a warning).
    """
    numbers = _SYSCALLS.get(platform.machine())
    libc = _libc()
    if numbers is None or libc is None:
        return f"no mbind syscall number known for {platform.machine()}"
    if not 0 <= node < 8 * ctypes.sizeof(ctypes.c_ulong):
        return f"node {node} is beyond the one-word node mask"
    mask = ctypes.c_ulong(1 << node)
    page = va & ~(mmap.PAGESIZE - 1)
    length = va + nbytes - page
    rc = libc.syscall(ctypes.c_long(numbers[1]), ctypes.c_void_p(page), ctypes.c_ulong(length), ctypes.c_int(_MPOL_BIND),
                      ctypes.byref(mask), ctypes.c_ulong(8 * ctypes.sizeof(mask) + 1), ctypes.c_uint(_MPOL_MF_MOVE))
    if rc != 0:
        return f"mbind failed: {os.strerror(ctypes.get_errno())}"
    return ""
