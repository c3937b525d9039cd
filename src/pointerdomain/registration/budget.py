"""The memory budget: every limit a host allocation or registration runs into, read and
decided before the first call, all or nothing.

Pinning or pre-faulting past a limit does not fail cleanly: inside a container
``MemAvailable`` is the host's memory while the cgroup's limit ends the process; on WSL2
the WDDM lock pool (about half of RAM) refuses pins part-way through a pool; under GPU
Confidential Computing every ``cudaHostRegister`` fails (801). So a request is checked
against each :class:`Limit` first and refused whole with a typed error naming the limit
and the fix (:class:`~pointerdomain.errors.BudgetExceededError`,
:class:`~pointerdomain.errors.MemlockBudgetError`,
:class:`~pointerdomain.errors.RegistrationRefusedError`); nothing is allocated or
registered then.

Limits (``Limit.name``):

* allocation (``alloc_registered``, emulated device memory): ``memavailable``, ``commit``
  (``vm.overcommit_memory = 2``), ``rlimit_as``, ``cgroup`` (v2 ``memory.max`` less
  ``memory.current`` at every level of the hierarchy, v1 ``memory.limit_in_bytes``; the
  cgroup file system is read under ``POINTERDOMAIN_CGROUP_ROOT``);
* registration: ``memlock`` (``RLIMIT_MEMLOCK`` less what this process pinned; enforced
  where the backend's registrations count against it: the emulated backend with
  ``POINTERDOMAIN_EMULATE_MEMLOCK=1``; reported elsewhere, as RDMA engines' own
  registrations count against it), ``wddm`` (WSL2: half of ``MemTotal`` less what is
  pinned, shared segments counted once), ``confidential_computing`` (registration refused
  at every size), ``device_cap`` (:func:`set_device_cap`).

With ``RegistrationPolicy(on_failure="degrade")`` the registration limits are not
refused here: the ladder climbs down past them and records why. ``pointerdomain doctor
--json`` reports :func:`budget_for` of each device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pointerdomain.arguments import describe
from pointerdomain import env
from pointerdomain._platform.capacity import CgroupLimit, capacity_limits, cgroup_limit, gpu_confidential_computing, meminfo
from pointerdomain.devices import Device, validate_device
from pointerdomain.errors import (
    BudgetExceededError,
    InvalidArgumentError,
    MemlockBudgetError,
    RegistrationRefusedError,
)
from pointerdomain.registration.ladder import RegistrationPolicy, resolve_policy
from pointerdomain.registration.segments import Segment, registered_elsewhere, shared_pinned
from pointerdomain.registration.teardown import quarantined_pinned

__all__ = [
    "Budget",
    "CgroupLimit",
    "HostFacts",
    "Limit",
    "budget_for",
    "check_allocation",
    "cgroup_limit",
    "check_registration",
    "device_cap",
    "host_facts",
    "registry_usage",
    "set_device_cap",
    "simulated_host",
]

Applies = Literal["allocate", "register"]

_MEMLOCK_FIX = ("raise it (`ulimit -l unlimited`, docker --ulimit memlock=-1; Kubernetes has no field for it: "
                "set it in the container's entrypoint or the runtime's default ulimits) or register less")


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit of the budget.

    Attributes:
        name: ``memavailable``, ``commit``, ``rlimit_as``, ``cgroup``, ``memlock``, ``wddm``,
            ``confidential_computing`` or ``device_cap``.
        applies: ``"allocate"`` (host memory backed) or ``"register"`` (host memory pinned).
        room: bytes left under it now (None: no bound in bytes).
        enforced: checked before allocating / registering for this device (False: reported only).
        source: where it was read and what it is.
        fix: what to do when a request passes it.
    """

    name: str
    applies: Applies
    room: int | None
    enforced: bool
    source: str
    fix: str


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the budget reads from the host (:func:`host_facts`; tests replace fields with
    :func:`simulated_host`).

    Attributes:
        capacity: the allocation limits, ``(name, bytes left, what)`` (``_platform.capacity``).
        memlock: ``RLIMIT_MEMLOCK`` soft limit in bytes (None: unlimited).
        mem_total: ``MemTotal`` in bytes (None: unreadable).
        wsl2: the kernel is WSL2's.
        confidential_computing: GPU CC mode (None: unknown).
        pins: None: ask the device whether registering pins memory; True / False: as given.
        memlock_counts: None: registrations count against RLIMIT_MEMLOCK where the backend's
            do; True / False: as given.
    """

    capacity: tuple[tuple[str, int, str], ...]
    memlock: int | None
    mem_total: int | None
    wsl2: bool
    confidential_computing: bool | None
    pins: bool | None = None
    memlock_counts: bool | None = None


@dataclass(frozen=True, slots=True)
class Budget:
    """The limits for one device now (:func:`budget_for`).

    Attributes:
        device: the device (``"cuda:0"``).
        limits: every limit read, enforced or not.
        pinned_bytes: bytes this process has pinned (open registrations and quarantined ranges).
        shared_bytes: bytes of shared segments registered on this host (each counted once).
    """

    device: str
    limits: tuple[Limit, ...]
    pinned_bytes: int
    shared_bytes: int

    def room(self, applies: Applies) -> int | None:
        """Bytes that can still be allocated (``"allocate"``) or registered
        (``"register"``) for this device: the least room of the enforced limits (None: no bound)."""
        rooms = [lim.room for lim in self.limits if lim.applies == applies and lim.enforced and lim.room is not None]
        return min(rooms) if rooms else None

    def binding(self, applies: Applies, nbytes: int) -> Limit | None:
        """The first enforced limit of ``applies`` that ``nbytes`` more would pass, or None."""
        for lim in self.limits:
            if lim.applies == applies and lim.enforced and lim.room is not None and nbytes > lim.room:
                return lim
        return None

    def as_dict(self) -> dict[str, object]:
        """JSON-ready (``doctor --json``)."""
        return {"device": self.device, "pinned_bytes": self.pinned_bytes, "shared_bytes": self.shared_bytes,
                "room_allocate": self.room("allocate"), "room_register": self.room("register"),
                "limits": [dataclasses.asdict(lim) for lim in self.limits]}


_lock = threading.Lock()
_override: dict[str, object] = {}
_caps: dict[Device, int] = {}


def _wsl2() -> bool:
    try:
        return "microsoft" in Path("/proc/version").read_text().lower()
    except OSError:
        return False


def host_facts(*, pins: bool = False) -> HostFacts:
    """The host as read now (with :func:`simulated_host`'s changes). ``pins``: whether the
    device asked about pins memory (GPU CC mode is only asked of NVML then)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    with _lock:
        override = dict(_override)
    cc = override.get("confidential_computing", gpu_confidential_computing() if pins else None)
    facts = HostFacts(
        capacity=tuple(capacity_limits()),
        memlock=None if soft == resource.RLIM_INFINITY else soft,
        mem_total=meminfo().get("MemTotal"),
        wsl2=_wsl2(),
        confidential_computing=cc if isinstance(cc, bool) else None,
    )
    return dataclasses.replace(facts, **override)  # type: ignore[arg-type]


@contextlib.contextmanager
def simulated_host(**changes: object) -> Iterator[None]:
    """Within the block the budget sees these :class:`HostFacts` fields changed (tests:
    ``simulated_host(wsl2=True, mem_total=8 << 30, pins=True)``); nothing else changes.

    Raises:
        InvalidArgumentError: a name that is not a HostFacts field.
    """
    fields = {f.name for f in dataclasses.fields(HostFacts)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise InvalidArgumentError(f"simulated_host: found {unknown}, expected HostFacts fields {sorted(fields)}")
    with _lock:
        saved = dict(_override)
        _override.update(changes)
    try:
        yield
    finally:
        with _lock:
            _override.clear()
            _override.update(saved)


def set_device_cap(device: Device | str, nbytes: int | None) -> int | None:
    """Cap the bytes this process may register for ``device`` (None: no cap); returns the
    previous cap. Registrations past it are refused (:class:`BudgetExceededError`,
    ``limit == "device_cap"``).

    Raises:
        InvalidArgumentError: ``nbytes`` is not None or an int >= 0.
        InvalidDeviceError: the device does not exist.
    """
    if nbytes is not None and (type(nbytes) is not int or nbytes < 0):
        raise InvalidArgumentError(f"nbytes: found {describe(nbytes)}, expected None or an int >= 0 (bytes)")
    dev = validate_device(device)
    with _lock:
        previous = _caps.pop(dev, None)
        if nbytes is not None:
            _caps[dev] = nbytes
    return previous


def device_cap(device: Device | str) -> int | None:
    """The cap :func:`set_device_cap` set for ``device`` (None: none)."""
    dev = validate_device(device)
    with _lock:
        return _caps.get(dev)


def _no_registrations(dev: Device) -> tuple[int, int]:
    return 0, 0


#: ``(bytes this process pinned, of them for the device)``: installed by
#: :mod:`pointerdomain.registration.memory`, which holds the registry (it imports this module).
registry_usage: Callable[[Device], tuple[int, int]] = _no_registrations


def _usage(dev: Device, wsl2: bool) -> tuple[int, int, int]:
    """(bytes this process pinned, of them for ``dev``, bytes of shared segments registered on
    the host by other registrations, each counted once; read only where a limit needs it)."""
    total, mine = registry_usage(dev)
    total += quarantined_pinned()  # still pinned, never to be unregistered
    if not wsl2:
        return total, mine, 0
    private, shared = shared_pinned()
    return total, mine, max(0, shared - private)


def budget_for(device: Device | str) -> Budget:
    """Every limit for allocating and registering host memory for ``device`` now.

    Raises:
        InvalidDeviceError: the device does not exist.
    """
    dev = validate_device(device)
    facts = host_facts(pins=not dev.runtime.host_memory)
    pins = facts.pins if facts.pins is not None else not dev.runtime.host_memory
    counts = facts.memlock_counts if facts.memlock_counts is not None else (
        dev.runtime.host_memory and env.flag(env.EMULATE_MEMLOCK))
    pinned, for_dev, others_shared = _usage(dev, facts.wsl2)
    limits = [Limit(name, "allocate", room, True, what,
                    "allocate less (fewer pages or layers per pool), free memory first, or raise the limit"
                    + (" (the container's memory limit; MemAvailable inside a container is the host's)"
                       if name == "cgroup" else ""))
              for name, room, what in facts.capacity]
    if facts.memlock is not None:
        limits.append(Limit(
            "memlock", "register", max(0, facts.memlock - pinned), counts,
            f"RLIMIT_MEMLOCK ({facts.memlock} bytes, ulimit -l) less {pinned} bytes pinned by this process"
            + ("" if counts else "; this backend's registrations do not count against it, RDMA engines' "
               "(NIXL, Mooncake: ibv_reg_mr) do"),
            _MEMLOCK_FIX))
    if facts.wsl2 and facts.mem_total is not None:
        pool = facts.mem_total // 2
        used = pinned + others_shared
        limits.append(Limit(
            "wddm", "register", max(0, pool - used), pins,
            f"the WSL2 WDDM lock pool (about half of RAM: {pool} bytes) less {used} bytes pinned "
            "(shared segments counted once)",
            "register less, or raise WSL2's memory (.wslconfig [wsl2] memory=...): the pool is about half of it"))
    if facts.confidential_computing:
        limits.append(Limit(
            "confidential_computing", "register", 0, pins,
            "GPU Confidential Computing is on (NVML): cudaHostRegister returns 801 at every size",
            "allocate with alloc_registered(..., policy=RegistrationPolicy(on_failure=\"degrade\")): the "
            "pinned_copy rung uses the runtime's pinned allocation, which CC allows"))
    with _lock:
        cap = _caps.get(dev)
    if cap is not None:
        limits.append(Limit("device_cap", "register", max(0, cap - for_dev), True,
                            f"the cap set for {dev} (set_device_cap: {cap} bytes) less {for_dev} registered for it",
                            "register less, close registrations for this device, or raise the cap (set_device_cap)"))
    return Budget(str(dev), tuple(limits), pinned, others_shared)


def _refuse(limit: Limit, nbytes: int, dev: Device, verb: str, memlock: int | None, pinned: int,
            name: str = "nbytes", what: str = "host") -> None:
    room = limit.room or 0
    head = (f"{name}: found a request for nbytes={nbytes} ({nbytes / (1 << 30):.2f} GiB) of {what} memory for {dev} "
            f"({verb}), expected at most {room} bytes: the budget's {limit.name!r} limit, {limit.source}")
    tail = f"; nothing was allocated or registered. Fix: {limit.fix}"
    if limit.name == "confidential_computing":
        raise RegistrationRefusedError(f"{name}: found a request to register {nbytes} bytes of {what} memory for "
                                       f"{dev}, expected a platform that registers host memory: {limit.source}{tail}",
                                       limit.name, limit.fix)
    if limit.name == "memlock":
        raise MemlockBudgetError(f"{head}. RLIMIT_MEMLOCK is {memlock} bytes and {pinned + nbytes} would be "
                                 f"pinned{tail}", nbytes, limit.name, room, limit.fix)
    raise BudgetExceededError(head + tail, nbytes, limit.name, room, limit.fix)


def check_allocation(nbytes: int, device: Device, *, name: str = "nbytes", what: str = "host") -> None:
    """Refuse ``nbytes`` of host memory for ``device`` past an allocation limit (``name``:
    the argument, ``what``: the memory, for the message).

    Raises:
        BudgetExceededError: a limit (``limit`` names it) has less room than ``nbytes``.
    """
    budget = budget_for(device)
    limit = budget.binding("allocate", nbytes)
    if limit is not None:
        _refuse(limit, nbytes, device, "allocating", None, budget.pinned_bytes, name, what)


def check_registration(
    nbytes: int, device: Device, *, policy: RegistrationPolicy | None = None, allocate: bool = False,
    segment: Segment | None = None,
) -> None:
    """Refuse a registration of ``nbytes`` for ``device`` (and with ``allocate`` its
    allocation) that would pass a limit, before any call. ``segment``: the shared segment
    the range lies in (:func:`pointerdomain.registration.segments.segment_of`): the bytes
    another registration of it pinned already are not charged to the host-wide limits. Registration limits are not refused under
    ``on_failure="degrade"`` (the ladder degrades past them).

    Raises:
        BudgetExceededError: an allocation limit, the WDDM pool or a device cap.
        MemlockBudgetError: RLIMIT_MEMLOCK (where the backend counts against it).
        RegistrationRefusedError: the platform refuses registration at every size (CC).
    """
    budget = budget_for(device)
    if allocate:
        limit = budget.binding("allocate", nbytes)
        if limit is not None:
            _refuse(limit, nbytes, device, "allocating", None, budget.pinned_bytes)
    if resolve_policy(policy).on_failure != "fail":
        return
    for lim in budget.limits:
        if lim.applies != "register" or not lim.enforced or lim.room is None:
            continue
        # RLIMIT_MEMLOCK and a device cap count this process's own pins, shared or not; the
        # WDDM pool counts physical pages, a segment another process pinned once
        need = nbytes
        if segment is not None and lim.name == "wddm":
            need = max(0, nbytes - registered_elsewhere(segment))
        if need > lim.room or lim.name == "confidential_computing":
            memlock = host_facts().memlock if lim.name == "memlock" else None
            _refuse(lim, need, device, "registering", memlock, budget.pinned_bytes)
