"""How much more host memory this process can have backed, read before touching pages.

Allocating and pre-faulting (or pinning) more than the machine can back does not fail
cleanly: the kernel's OOM killer ends the process. So host allocations ask first: the
smallest of the memory available (``MemAvailable``), the commit limit when overcommit
is off (``vm.overcommit_memory = 2``), the address-space limit (``RLIMIT_AS``) and the
cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), each less
what is in use. Unreadable sources are skipped (another OS, a restricted /proc).
"""

from __future__ import annotations

import resource
from pathlib import Path

__all__ = ["host_capacity"]


def _meminfo() -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    except OSError:
        pass
    return values


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit, or None (no limit known)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit, used = _read_int(base / "memory.max"), _read_int(base / "memory.current")
        elif "memory" in controllers.split(","):  # v1
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit, used = _read_int(base / "memory.limit_in_bytes"), _read_int(base / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < 1 << 62:  # v1 reports "no limit" as a huge number
            return max(0, limit - (used or 0))
    return None


def _vm_size() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_capacity() -> tuple[int, str] | None:
    """``(bytes, what limits them)``: the most host memory this process can still have
    backed now, and the limit that says so; None when nothing could be read."""
    found: list[tuple[int, str]] = []
    info = _meminfo()
    if "MemAvailable" in info:
        found.append((info["MemAvailable"], "the memory available (MemAvailable in /proc/meminfo)"))
    if _read_int(Path("/proc/sys/vm/overcommit_memory")) == 2 and "CommitLimit" in info:
        room = max(0, info["CommitLimit"] - info.get("Committed_AS", 0))
        found.append((room, "the commit limit (vm.overcommit_memory = 2: CommitLimit - Committed_AS)"))
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append((max(0, soft - _vm_size()), f"the address-space limit RLIMIT_AS ({soft} bytes, ulimit -v)"))
    cgroup = _cgroup_room()
    if cgroup is not None:
        found.append((cgroup, "the cgroup's memory limit (container memory limit)"))
    return min(found) if found else None
