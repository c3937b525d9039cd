"""Faulting pages in before they are registered: parallel, NUMA-bound, huge-page aware.

``cuMemHostRegister`` faults in every page it pins that is not yet populated, on one
thread, while holding a driver lock that other processes' driver calls wait on. Faulting
the pages in beforehand, on several threads, leaves the driver only the pinning.

:func:`prefault` splits the range into page-aligned pieces (2 MiB-aligned under
``huge_pages="thp"``) and has ``threads`` threads fault them in writable with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+; contents kept), or where the kernel lacks
it (EINVAL) by writing each page's first byte back to itself; pages the kernel refuses to
populate writable (a read-only mapping) are never written, only left to the registration. With a NUMA node the threads run on
that node's CPUs (the pages follow the memory policy, e.g. an ``mbind`` made before,
:func:`pointerdomain._platform.numa.bind_to_node`). ``huge_pages="thp"`` advises
``MADV_HUGEPAGE`` first. :func:`huge_page_share` reads how much of a range ended up on
huge pages (``/proc/self/smaps``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["PrefaultReport", "huge_page_share", "hugetlb_alloc", "hugetlb_pool", "node_cpus", "populate_supported",
           "prefault"]

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_HUGE = 2 << 20


@dataclass(frozen=True, slots=True)
class PrefaultReport:
    """What :func:`prefault` did.

    Attributes:
        seconds: wall time of the whole prefault.
        threads: threads used (0: nothing was done).
        method: ``"populate_write"``, ``"touch"`` (older kernels) or ``"none"``.
        huge_pages: the policy applied (``"off"``, ``"thp"`` or ``"hugetlbfs"``).
        note: why something was skipped ("" if nothing was).
    """

    seconds: float
    threads: int
    method: Literal["populate_write", "touch", "none"]
    huge_pages: Literal["off", "thp", "hugetlbfs"]
    note: str = ""


NONE = PrefaultReport(0.0, 0, "none", "off")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def node_cpus(node: int) -> set[int]:
    """The CPUs of NUMA node ``node`` (``/sys/devices/system/node/nodeN/cpulist``), empty if unknown."""
    try:
        with open(f"/sys/devices/system/node/node{node}/cpulist") as f:
            text = f.read().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


_SUPPORTED: list[bool] = []


def populate_supported() -> bool:
    """Whether this kernel knows ``MADV_POPULATE_WRITE`` (asked once, on a page of our own)."""
    if not _SUPPORTED:
        libc = _libc()
        page = mmap.mmap(-1, mmap.PAGESIZE)
        holder = ctypes.c_char.from_buffer(page)
        ok = libc is not None and libc.madvise(ctypes.addressof(holder), mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0
        del holder
        page.close()
        _SUPPORTED.append(ok)
    return _SUPPORTED[0]


def _pieces(lo: int, hi: int, threads: int, align: int) -> list[tuple[int, int]]:
    step = max(align, -(-(hi - lo) // threads) // align * align or align)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def prefault(tensor: torch.Tensor, threads: int, huge_pages: Literal["off", "thp", "hugetlbfs"] = "off",
             node: int | None = None) -> PrefaultReport:
    """Fault the pages of ``tensor`` (a contiguous CPU tensor) in, writable, keeping its bytes.

    Args:
        tensor: the memory about to be registered.
        threads: worker threads (> 0; 0 returns at once with ``method="none"``).
        huge_pages: ``"thp"`` advises transparent huge pages first.
        node: run the workers on this NUMA node's CPUs (None: anywhere).

    Never raises for what the kernel refuses (the registration call faults the pages in
    itself then): the report's ``note`` says what was skipped.
    """
    if threads <= 0:
        return NONE
    start = time.perf_counter()
    va, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    lo, hi = va & ~(page - 1), -(-(va + nbytes) // page) * page
    libc = _libc()
    notes: list[str] = []
    if huge_pages == "thp":
        if libc is None or libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            code = ctypes.get_errno() if libc is not None else 0
            notes.append(f"MADV_HUGEPAGE refused ({os.strerror(code) if code else 'no libc'})")
    cpus = node_cpus(node) if node is not None else set()
    pieces = _pieces(lo, hi, threads, page if huge_pages == "off" else _HUGE)
    flat = tensor.reshape(-1).view(torch.uint8)

    def populate(piece: tuple[int, int]) -> int:
        """0, or the errno of MADV_POPULATE_WRITE (EINVAL: the kernel lacks it)."""
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)  # this worker thread only
            except OSError:
                pass
        if libc is None:
            return errno.EINVAL
        return 0 if libc.madvise(piece[0], piece[1] - piece[0], _MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()

    def touch(piece: tuple[int, int]) -> None:
        first, end = max(piece[0], va) - va, min(piece[1], va + nbytes) - va
        if first >= end:
            return
        aligned = first + (-(va + first)) % page  # the first page boundary at or after `first`
        idx = torch.arange(aligned, end, page)
        if aligned != first:
            idx = torch.cat([torch.tensor([first]), idx])
        flat[idx] = flat[idx]  # a write fault per page, same bytes

    method: Literal["populate_write", "touch"] = "populate_write"
    with ThreadPoolExecutor(max_workers=min(threads, len(pieces))) as pool:
        codes = list(pool.map(populate, pieces))
        # EINVAL is both "no such advice" (an older kernel) and "not writable": only the first is touched
        missing = [p for p, code in zip(pieces, codes) if code == errno.EINVAL] if not populate_supported() else []
        codes = [errno.EACCES if code == errno.EINVAL and not missing else code for code in codes]
        if missing:  # an older kernel: write each page's first byte back to itself
            method = "touch"
            notes.append("MADV_POPULATE_WRITE unavailable: pages touched one by one")
            list(pool.map(touch, missing))
        refused = {code for code in codes if code not in (0, errno.EINVAL)}
        if refused:  # e.g. a read-only mapping: never written to; the registration call decides
            notes.append("MADV_POPULATE_WRITE refused (" + ", ".join(os.strerror(c) for c in sorted(refused))
                         + "): those pages were left to the registration call")
    return PrefaultReport(time.perf_counter() - start, min(threads, len(pieces)), method, huge_pages, "; ".join(notes))


def huge_page_share(va: int, nbytes: int) -> float | None:
    """Share (0..1) of the resident memory of the mappings overlapping ``[va, va + nbytes)``
    that is on huge pages (THP or shared-memory PMD mappings, ``/proc/self/smaps``); None
    where it cannot be read or nothing is resident."""
    rss = huge = 0
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo_text, _, hi_text = head.partition("-")
                    try:
                        lo, hi = int(lo_text, 16), int(hi_text, 16)
                    except ValueError:
                        continue
                    inside = lo < va + nbytes and va < hi
                    continue
                if not inside:
                    continue
                fields = line.split()
                if fields[0] == "Rss:":
                    rss += int(fields[1])
                elif fields[0] in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                    huge += int(fields[1])
                elif fields[0] in ("Private_Hugetlb:", "Shared_Hugetlb:"):  # not counted in Rss
                    huge += int(fields[1])
                    rss += int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return min(1.0, huge / rss) if rss else None


_MAP_HUGETLB = 0x40000  # asm-generic/mman-common.h (x86_64, aarch64)


def hugetlb_pool() -> tuple[int, int, int]:
    """(free pages, total pages, page size in bytes) of the huge-page pool (``/proc/meminfo``;
    zeros where it cannot be read)."""
    found = {"HugePages_Free:": 0, "HugePages_Total:": 0, "Hugepagesize:": 0}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in found:
                    found[fields[0]] = int(fields[1]) * (1024 if fields[0] == "Hugepagesize:" else 1)
    except (OSError, ValueError, IndexError):
        pass
    return found["HugePages_Free:"], found["HugePages_Total:"], found["Hugepagesize:"]


def hugetlb_alloc(nbytes: int) -> torch.Tensor:
    """``nbytes`` of private anonymous memory from the huge-page pool (``MAP_HUGETLB``), a
    uint8 tensor (the mapping is rounded up to whole 2 MiB pages and goes with the tensor).

    Raises:
        OSError: the pool cannot back it (ENOMEM: too few pages reserved).
    """
    size = -(-nbytes // _HUGE) * _HUGE
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]  # the tensor keeps the mapping alive
