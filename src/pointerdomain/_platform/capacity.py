"""How much more host memory this process can have backed, read before touching pages.

Allocating and pre-faulting (or pinning) more than the machine can back does not fail
cleanly: the kernel's OOM killer ends the process. So host allocations ask first: the
smallest of the memory available (``MemAvailable``), the commit limit when overcommit
is off (``vm.overcommit_memory = 2``), the address-space limit (``RLIMIT_AS``) and the
cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, at every level
of the hierarchy), each less what is in use. Unreadable sources are skipped (another OS, a restricted /proc).
"""

from __future__ import annotations

import ctypes
import functools
import resource
from dataclasses import dataclass
import warnings
from pathlib import Path

from pointerdomain import env

__all__ = ["CgroupLimit", "capacity_limits", "cgroup_limit", "gpu_confidential_computing", "host_capacity", "meminfo"]


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where unreadable)."""
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


@dataclass(frozen=True)
class CgroupLimit:
    """The binding memory limit of this process's cgroup: the level of the hierarchy
    (the process's own cgroup or an ancestor) with the least room left.

    Attributes:
        version: 1 or 2.
        path: the directory the limit was read from.
        limit: ``memory.max`` (v1: ``memory.limit_in_bytes``), bytes.
        current: ``memory.current`` (v1: ``memory.usage_in_bytes``), bytes.
    """

    version: int
    path: str
    limit: int
    current: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.current)


def _levels(base: Path, rel: str) -> list[Path]:
    """``base / rel`` and each ancestor up to ``base`` (a child's limit is bounded by its parents')."""
    parts = [p for p in rel.strip("/").split("/") if p and p != ".."]
    return [base.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def cgroup_limit() -> CgroupLimit | None:
    """The binding cgroup memory limit of this process (v2 ``memory.max`` less
    ``memory.current``, else v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``),
    read under ``POINTERDOMAIN_CGROUP_ROOT`` (default ``/sys/fs/cgroup``); None when no
    level sets one. Inside a container ``MemAvailable`` is the host's: this is the limit
    that ends the process."""
    given = env.text(env.CGROUP_ROOT)
    root = Path(given or "/sys/fs/cgroup")
    if given and not root.is_dir():
        # a typo here would lift the cgroup's limit without a word
        warnings.warn(f"{env.CGROUP_ROOT}={given!r}: not a directory, so no cgroup memory limit is read. Fix: set "
                      f"it to the cgroup file system's directory or unset it (default /sys/fs/cgroup)",
                      env.EnvironmentValueWarning, stacklevel=2)
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = ["0::/"]
    found: list[CgroupLimit] = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2
            names, base, version = ("memory.max", "memory.current"), root, 2
        elif "memory" in controllers.split(","):  # v1
            names, base, version = ("memory.limit_in_bytes", "memory.usage_in_bytes"), root / "memory", 1
        else:
            continue
        for level in _levels(base, rel):
            limit, used = _read_int(level / names[0]), _read_int(level / names[1])
            if limit is not None and limit < 1 << 62:  # v2 says "max", v1 a huge number, for no limit
                found.append(CgroupLimit(version, str(level), limit, used or 0))
    return min(found, key=lambda c: c.room) if found else None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit, or None (no limit known)."""
    found = cgroup_limit()
    return None if found is None else found.room


def _vm_size() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def capacity_limits() -> list[tuple[str, int, str]]:
    """Each limit on the host memory this process can still have backed, as
    ``(name, bytes left, what it is)``: ``memavailable``, ``commit`` (only with
    ``vm.overcommit_memory = 2``), ``rlimit_as``, ``cgroup``; unreadable ones are left out."""
    found: list[tuple[str, int, str]] = []
    info = meminfo()
    if "MemAvailable" in info:
        found.append(("memavailable", info["MemAvailable"], "the memory available (MemAvailable in /proc/meminfo)"))
    if _read_int(Path("/proc/sys/vm/overcommit_memory")) == 2 and "CommitLimit" in info:
        room = max(0, info["CommitLimit"] - info.get("Committed_AS", 0))
        found.append(("commit", room, "the commit limit (vm.overcommit_memory = 2: CommitLimit - Committed_AS)"))
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append(("rlimit_as", max(0, soft - _vm_size()),
                      f"the address-space limit RLIMIT_AS ({soft} bytes, ulimit -v)"))
    cgroup = cgroup_limit()
    if cgroup is not None:
        found.append(("cgroup", cgroup.room, f"the cgroup's memory limit (container memory limit: {cgroup.path} "
                      f"memory {'max' if cgroup.version == 2 else 'limit_in_bytes'} {cgroup.limit} bytes, "
                      f"{cgroup.current} in use)"))
    return found


def host_capacity() -> tuple[int, str] | None:
    """``(bytes, what limits them)``: the most host memory this process can still have
    backed now, and the limit that says so; None when nothing could be read."""
    found = capacity_limits()
    return min((room, what) for _name, room, what in found) if found else None


class _CcState(ctypes.Structure):
    _fields_ = [("environment", ctypes.c_uint), ("ccFeature", ctypes.c_uint), ("devToolsMode", ctypes.c_uint)]


@functools.cache
def gpu_confidential_computing() -> bool | None:
    """Whether NVIDIA GPU Confidential Computing is on (NVML's
    ``nvmlSystemGetConfComputeState``: ``ccFeature`` enabled), where host registration
    is refused at every size; None where NVML is missing or does not say (read once)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
    except AttributeError:
        return None
    try:
        state = _CcState()
        query = getattr(nvml, "nvmlSystemGetConfComputeState", None)
        if query is None or query(ctypes.byref(state)) != 0:
            return None  # a driver before CC support: not on
        return bool(state.ccFeature == 1)
    finally:
        nvml.nvmlShutdown()
