"""Shared segments: one physical pool mapped by several processes, accounted once.

Processes that map one shared segment (a memfd passed between them, a ``/dev/shm``
file) each register their own mapping (a registration belongs to one address space, and
each process keeps its own :class:`~pointerdomain.HostVA`), but the pages are the same:
a budget that adds the registrations charges a 1.6 TiB pool twice. So a registration
over a shared file mapping is identified by its segment, ``(st_dev, st_ino)`` of the
mapping's file (``/proc/self/maps``, or ``os.fstat`` of the fd) and the byte range in
that file, and noted in a host-wide ledger (one file per segment in
``/dev/shm/pointerdomain-segments-<uid>``, or ``POINTERDOMAIN_SEGMENT_DIR``; entries of
processes that are gone are dropped when read). :func:`shared_pinned` gives the bytes
of every registered segment counted once, which the budget's host-wide limits (the WSL2
WDDM pool) use; :func:`registered_elsewhere` the bytes of a range that another
registration of the segment already pinned.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pointerdomain.arguments import describe
from pointerdomain import env
from pointerdomain.errors import InvalidArgumentError

__all__ = [
    "Segment",
    "SegmentKey",
    "forget",
    "ledger_entries",
    "registered_elsewhere",
    "segment_bytes",
    "segment_of",
    "segment_of_fd",
    "note",
    "shared_pinned",
]


@dataclass(frozen=True, slots=True, order=True)
class SegmentKey:
    """A shared segment: the device and inode of its file (``os.stat``'s ``st_dev``, ``st_ino``)."""

    st_dev: int
    st_ino: int

    def __str__(self) -> str:
        return f"{self.st_dev:x}-{self.st_ino}"


@dataclass(frozen=True, slots=True)
class Segment:
    """Where a range of this process's memory lies in a shared segment.

    Attributes:
        key: the segment.
        offset: byte offset of the range's start in the segment's file.
        nbytes: length of the range.
        path: the mapping's path (``/memfd:name (deleted)``, ``/dev/shm/...``).
    """

    key: SegmentKey
    offset: int
    nbytes: int
    path: str


#: memfds this library makes for itself (the emulated backend's second mappings, strict
#: alias mode's double mapping): their fds never leave the process, so they are no segment.
_OWN_MEMFDS = ("/memfd:pointerdomain-emulated", "/memfd:pointerdomain-strict")


def _maps(pid: str = "self") -> Iterator[tuple[int, int, str, int, int, int, str]]:
    """``(start, end, perms, file offset, st_dev, st_ino, path)`` of each mapping."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        lo, _, hi = fields[0].partition("-")
        major, _, minor = fields[3].partition(":")
        yield (int(lo, 16), int(hi, 16), fields[1], int(fields[2], 16),
               os.makedev(int(major, 16), int(minor, 16)), int(fields[4]), fields[5] if len(fields) > 5 else "")


def segment_of(va: int, nbytes: int) -> Segment | None:
    """The shared segment holding ``[va, va + nbytes)`` of this process, or None (private
    or anonymous memory, or a range over two files or mappings that do not follow on in
    the file).

    Raises:
        InvalidArgumentError: ``va`` / ``nbytes`` not ints with ``nbytes > 0``.
    """
    if type(va) is not int or type(nbytes) is not int or va < 0 or nbytes <= 0:
        raise InvalidArgumentError(f"segment_of: found va={describe(va)}, nbytes={describe(nbytes)}, expected ints, nbytes > 0")
    found: Segment | None = None
    want, end = va, va + nbytes
    for lo, hi, perms, off, dev, ino, path in _maps():
        if hi <= want or lo > want:
            continue
        if ino == 0 or "s" not in perms or path.strip().startswith(_OWN_MEMFDS):
            return None  # anonymous, private (copy-on-write), or this library's own memfd (never handed out)
        here = off + (want - lo)
        if found is None:
            found = Segment(SegmentKey(dev, ino), here, nbytes, path.strip())
        elif found.key != SegmentKey(dev, ino) or found.offset + (want - va) != here:
            return None
        want = hi
        if want >= end:
            return found
    return None


def segment_of_fd(fd: int) -> SegmentKey:
    """The segment of open file ``fd`` (``os.fstat``).

    Raises:
        InvalidArgumentError: ``fd`` is not an int >= 0; OSError: not an open fd.
    """
    if type(fd) is not int or fd < 0:
        raise InvalidArgumentError(f"fd: found {describe(fd)}, expected a file descriptor (an int >= 0)")
    st = os.fstat(fd)
    return SegmentKey(st.st_dev, st.st_ino)


def _ledger_dir(create: bool = True) -> Path:
    chosen = env.text(env.SEGMENT_DIR)
    if chosen:
        path = Path(chosen)
    else:
        base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        path = base / f"pointerdomain-segments-{os.getuid()}"
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(key: SegmentKey) -> Iterator[tuple[list[tuple[int, int, int]], Path]]:
    """The ledger entries ``(pid, offset, nbytes)`` of ``key`` (live processes only), under
    the segment file's lock; the list as left by the block is written back."""
    path = _ledger_dir() / str(key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(os.dup(fd), "r") as f:
            rows = []
            for line in f.read().splitlines():
                parts = line.split()
                if len(parts) == 3 and all(p.isdigit() for p in parts):
                    pid, off, n = map(int, parts)
                    if _alive(pid):
                        rows.append((pid, off, n))
        before = list(rows)
        yield rows, path
        if rows != before or not rows:
            data = "".join(f"{p} {o} {n}\n" for p, o, n in rows).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            if not rows:
                with contextlib.suppress(OSError):
                    path.unlink()
    finally:
        os.close(fd)  # releases the lock


def _union(ranges: list[tuple[int, int]]) -> int:
    total, reach = 0, -1
    for lo, hi in sorted(ranges):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


_lock = threading.Lock()
#: this process's tracked registrations: host VA -> (segment, bytes it counts in pinned_bytes)
_mine: dict[int, tuple[Segment, int]] = {}


def note(va: int, seg: Segment, counted: int) -> None:
    """Note this process's registration at ``va`` of ``seg`` in the ledger (``counted``:
    the bytes it adds to this process's pinned bytes)."""
    with _locked(seg.key) as (rows, _path):
        rows.append((os.getpid(), seg.offset, seg.nbytes))
    with _lock:
        _mine[va] = (seg, counted)


def forget(va: int) -> None:
    """Drop the ledger entry of the registration at ``va`` (after its unregister)."""
    with _lock:
        entry = _mine.pop(va, None)
    if entry is None:
        return
    seg = entry[0]
    with _locked(seg.key) as (rows, _path):
        mine = (os.getpid(), seg.offset, seg.nbytes)
        if mine in rows:
            rows.remove(mine)


def ledger_entries(key: SegmentKey) -> list[tuple[int, int, int]]:
    """``(pid, offset, nbytes)`` of each live registration of segment ``key`` on this host."""
    with _locked(key) as (rows, _path):
        return list(rows)


def segment_bytes(key: SegmentKey) -> int:
    """Bytes of segment ``key`` registered by any process on this host, counted once."""
    return _union([(o, o + n) for _p, o, n in ledger_entries(key)])


def registered_elsewhere(seg: Segment) -> int:
    """Bytes of ``seg``'s range already registered by another registration (any process)."""
    lo, hi = seg.offset, seg.offset + seg.nbytes
    clipped = [(max(o, lo), min(o + n, hi)) for _p, o, n in ledger_entries(seg.key) if o < hi and lo < o + n]
    return _union(clipped)


def shared_pinned() -> tuple[int, int]:
    """``(bytes of this process's pinned bytes that lie in shared segments, bytes of every
    segment registered on this host counted once)``."""
    with _lock:
        mine = sum(counted for _seg, counted in _mine.values())
        keys = {seg.key for seg, _c in _mine.values()}
    try:
        names = [p.name for p in _ledger_dir(create=False).iterdir()]
    except OSError:
        names = []
    for name in names:
        dev, _, ino = name.partition("-")
        with contextlib.suppress(ValueError):
            keys.add(SegmentKey(int(dev, 16), int(ino)))
    return mine, sum(segment_bytes(k) for k in sorted(keys))
