"""What an address is: :func:`explain` (and ``pointerdomain whatis ADDRESS``).

Every ROCm crash report starts with a bare fault address; this maps it back to the
buffer. An address is looked up, in order, as

1. the host VA of a registration pointerdomain holds (open, or closed with its owner alive);
2. the device alias of an open registration (each chunk's alias range, on its device and
   on every other device an alias of it was asked for);
3. emulated device memory (by address), or CUDA device memory in torch's caching
   allocator (only when CUDA is already initialised: explaining never starts a context);

Each answer names the host memory's kind (``memory_kind``: registered, pinned,
vmm_host, device_accessible, foreign, pageable; :mod:`pointerdomain.registration.kinds`),
also for host memory no registration holds where the platform can tell it, and the answer
carries the driver's view (the platform pointer query) and the process
memory-map line (``/proc/<pid>/maps``), plus the NUMA placement of the mapping
(``/proc/<pid>/numa_maps``) when the kernel exposes it.

The registry is per process: only the process that registered the memory can name its
owner. Another process (``pointerdomain whatis --pid PID``) sees the memory map only.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pointerdomain.arguments import describe
from pointerdomain.devices import Device
from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain.registration.teardown import find_quarantine, quarantined
from pointerdomain.explained import Domain, Explanation
from pointerdomain.registration.kinds import chunk_alias, device_reads_va
from pointerdomain.registration.memory import (
    RegisteredHostMemory,
    find_closed_registration,
    find_registration,
    open_registrations,
)

__all__ = ["Domain", "Explanation", "explain", "host_memory_kind", "maps_line", "numa_nodes_of_mapping",
           "registration_rung"]

_NOT_RECORDED = "not available in this build"


def registration_rung(owner: RegisteredHostMemory) -> str:
    """How ``owner`` was registered (the registration ladder's rung).

    Hook for the registration ladder: where the owner records its rung, that record is
    returned; otherwise the rung is read off the chunks (one call or page-aligned chunks,
    the two rungs this build has).
    """
    recorded = getattr(owner, "rung", None)  # set by the ladder where the build has one
    if recorded is not None:
        return str(getattr(recorded, "value", recorded))  # ladder.Rung is a str enum: its value
    chunks = getattr(owner, "chunks", ())
    return "one call" if len(chunks) <= 1 else f"page-aligned chunks ({len(chunks)} calls)"


def registration_numa_node(owner: RegisteredHostMemory, pid: int) -> int | None:
    """The NUMA node of ``owner``'s pages: the owner's record where the build keeps one,
    else the single node ``/proc/<pid>/numa_maps`` shows for its mapping (None if mixed
    or unknown)."""
    recorded = getattr(owner, "numa_node", None)  # set by NUMA-aware allocation where the build has it
    if isinstance(recorded, int):
        return recorded
    nodes = numa_nodes_of_mapping(owner.host_va.value, pid)
    return next(iter(nodes)) if len(nodes) == 1 else None


def maps_line(address: int, pid: int | None = None) -> str | None:
    """The ``/proc/<pid>/maps`` line (stripped) of the mapping holding ``address``, or
    None (no mapping, or the file cannot be read: another user's process, not Linux)."""
    try:
        with open(f"/proc/{pid or 'self'}/maps") as f:
            for line in f:
                lo, _, hi = line.split(" ", 1)[0].partition("-")
                if int(lo, 16) <= address < int(hi, 16):
                    return " ".join(line.split())
    except (OSError, ValueError):
        return None
    return None


_NODE = re.compile(r"\bN(\d+)=(\d+)")


def numa_nodes_of_mapping(address: int, pid: int | None = None) -> dict[int, int]:
    """{NUMA node: resident pages} of the mapping holding ``address``, from
    ``/proc/<pid>/numa_maps`` (empty where it is missing or the mapping has no pages yet)."""
    line = maps_line(address, pid)
    if line is None:
        return {}
    start = line.split("-", 1)[0].lstrip("0") or "0"
    try:
        with open(f"/proc/{pid or 'self'}/numa_maps") as f:
            for entry in f:
                if entry.split(" ", 1)[0].lstrip("0") == start:
                    return {int(n): int(pages) for n, pages in _NODE.findall(entry)}
    except OSError:
        return {}
    return {}


def _alias_range(owner: RegisteredHostMemory, k: int, device: Device | None = None) -> tuple[int, int] | None:
    """(device address of chunk k on ``device`` (default: the owner's), its length) or None
    where there is none (:func:`pointerdomain.registration.kinds.chunk_alias`). Never raises."""
    chunk = owner.chunks[k]
    if not owner.kernel_readable:
        return None  # unpinned rung: no alias exists (the copy engine stages the host VA)
    return chunk_alias(owner.kind, chunk.host_va.value, chunk.registered_address, chunk.nbytes,
                       owner.device if device is None else device)


def host_memory_kind(address: int, device: Device | None = None) -> tuple[str | None, str | None, str]:
    """(kind, owner, note) of a host address no registration of this process holds, as the
    platform can tell it: VMM host memory (owner: its handle), another owner's pin
    (``foreign``), pageable memory a coherent device reads in place (``device_accessible``);
    (None, None, "") where it cannot tell. Never raises."""
    from pointerdomain._platform import backend_for, default_device, pointer_info
    from pointerdomain.registration.kinds import MemoryKind, describe_vmm, pageable_access_of
    from pointerdomain._platform.host_memory import vmm_allocation

    try:
        dev = device if device is not None else default_device()
        backend = backend_for(dev)
        found = vmm_allocation(backend, address, dev)
        if found is not None:
            kind = MemoryKind.VMM_HOST.value if found.is_host else None
            return kind, describe_vmm(found), f"VMM memory ({found.location}): its handle maps it; never registered"
        if backend.pointer_is_host(address):
            info = pointer_info(dev, address)
            block = (f"; the runtime's pinned block is [{info.start:#x}, +{info.size}) bytes (a rounding allocator "
                     "such as pin_memory() pins more than was asked)") if info is not None and info.kind == "host" else ""
            return MemoryKind.FOREIGN.value, None, f"registered (pinned) by another owner, not by pointerdomain{block}"
        access = pageable_access_of(backend, dev)
        if access.coherent and maps_line(address) is not None:
            return MemoryKind.DEVICE_ACCESSIBLE.value, None, f"pageable memory {dev} reads in place ({access.reason})"
    except Exception as exc:  # noqa: BLE001 - diagnosis must not raise
        return None, None, f"no host memory kind: {type(exc).__name__}: {exc}"
    return None, None, ""


def _pointer_attributes(address: int, device: Device | None) -> tuple[dict[str, dict[str, object]], list[str]]:
    """The platform pointer query for ``address`` on the backends that can answer."""
    import torch

    from pointerdomain._platform import backend_for, gpu_ops_built

    out: dict[str, dict[str, object]] = {}
    notes: list[str] = []
    devices = [device] if device is not None else [Device("emulated", 0)]
    if device is None and torch.cuda.is_available():
        devices.append(Device("cuda", 0))
    for dev in devices:
        try:
            backend = backend_for(dev)
            emulated = dev.runtime.host_memory
            status, alias = backend.alias(address, dev) if emulated or gpu_ops_built() else (None, 0)
            # the emulated pointer query is a constant False (no runtime pins memory behind
            # pointerdomain's back): the emulated driver's own record answers instead, i.e.
            # whether this address lies in a registered range (never a strict-mode host VA)
            registered = status == 0 if emulated else backend.pointer_is_host(address)
            facts: dict[str, object] = {"registered_host": registered}
            if emulated:
                facts["emulated_device"] = backend.device_lookup(address, 1)
            if status is not None:
                facts["alias_status"] = status
                if status == 0:
                    facts["alias"] = f"{alias:#x}"
            out[backend.name] = facts
        except Exception as exc:  # noqa: BLE001 - diagnosis must not raise
            notes.append(f"no pointer query on {dev}: {type(exc).__name__}: {exc}")
    return out, notes


def _cuda_allocation(address: int) -> tuple[int, int, int] | None:
    """(device, segment start, size) of torch's CUDA caching-allocator segment holding
    ``address``; None when CUDA is not initialised (never initialised from here)."""
    import torch

    cuda: Any = torch.cuda  # is_initialized / memory_snapshot are untyped in torch's stubs
    if not (cuda.is_available() and cuda.is_initialized()):
        return None
    for segment in cuda.memory_snapshot():
        start, size = int(segment["address"]), int(segment["total_size"])
        if start <= address < start + size:
            return int(segment["device"]), start, size
    return None


def explain(address: int | HostVA | DeviceAlias, *, pid: int | None = None) -> Explanation:
    """Explain ``address`` in this process (see the module docstring for the lookup order).

    Args:
        address: an int in [0, 2**64), or a HostVA / DeviceAlias (its ``.value``).
        pid: read another process's memory map instead of this one's (the registry
            lookup is skipped: pointerdomain's registrations live in their process).

    Returns:
        An :class:`Explanation` (``print(explain(a))`` gives the text form). Never raises
        for an address nothing knows: that is ``domain="unknown"``.

    Raises:
        InvalidArgumentError: ``address`` is not an int in [0, 2**64), or ``pid`` is not an
            int > 0 (a process that does not exist is a note, with no memory map line).
    """
    from pointerdomain.errors import InvalidArgumentError

    value = address.value if isinstance(address, (HostVA, DeviceAlias)) else address
    if type(value) is not int or not 0 <= value < 2**64:
        raise InvalidArgumentError(f"explain takes an address (an int in [0, 2**64)), got {describe(address)}")
    if pid is not None and (type(pid) is not int or pid <= 0):
        raise InvalidArgumentError(f"pid must be a process id (an int > 0) or None, got {describe(pid)}")
    own = pid is None or pid == os.getpid()
    here = os.getpid() if own or pid is None else pid
    found: dict[str, object] = {"domain": "unknown"}
    notes: list[str] = []
    if own:
        found = _find(value, notes)
        seg = getattr(found.get("owner_obj"), "segment", None)
        if seg is not None:
            notes.append(f"shared segment {seg.key} ({seg.path}), bytes [{seg.offset}, +{seg.nbytes}) of it: "
                         "other processes may register their own mappings of it (counted once by the budget)")
        held = find_quarantine(value)
        owner_found = found.get("owner_obj")
        if held is None and isinstance(owner_found, RegisteredHostMemory) and _quarantined_memory(owner_found):
            held = find_quarantine(owner_found.host_va.value, owner_found.nbytes)  # found by its alias
        if held is not None:
            notes.append(f"QUARANTINED: [{held.host_va!r}, +{held.nbytes}) of {held.owner}: its {held.stage} teardown "
                         f"step failed ({held.reason}); it stays mapped and is never registered again")
            if found.get("domain") == "unknown":
                found = {"domain": "host_va", "kind": "quarantined registration", "owner": held.owner,
                         "base": held.host_va.value, "nbytes": held.nbytes, "offset": value - held.host_va.value,
                         "device": held.device}
    else:
        notes.append(f"process {here}: its registrations are in its own registry; only its memory map is read "
                     "(call pointerdomain.explain() inside that process for the owner)")
    device = found.get("device_obj")
    attrs, more = _pointer_attributes(value, device if isinstance(device, Device) else None) if own else ({}, [])
    notes.extend(more)
    owner = found.get("owner_obj")
    numa: int | None = None
    if isinstance(owner, RegisteredHostMemory):
        numa = registration_numa_node(owner, here)
    else:
        nodes = numa_nodes_of_mapping(value, here)
        numa = next(iter(nodes)) if len(nodes) == 1 else None
    if not os.path.exists(f"/proc/{here}/maps"):
        notes.append(f"/proc/{here}/maps does not exist (no such process, or not Linux)")
    if own and found.get("domain") == "unknown":
        kind, kind_owner, note = host_memory_kind(value)
        if kind is not None or kind_owner is not None:
            found |= {"memory_kind": kind, "memory_owner": kind_owner}
        if note:
            notes.append(note)
    fields = {k: v for k, v in found.items() if not k.endswith("_obj")}
    return Explanation(address=value, pointer_attributes=attrs, maps_line=maps_line(value, here), pid=here,
                       numa_node=numa, notes=tuple(notes), **fields)  # type: ignore[arg-type]


def _quarantined_memory(owner: RegisteredHostMemory) -> bool:
    """Whether ``owner`` was quarantined: closed for launches, still registered and mapped."""
    held = find_quarantine(owner.host_va.value, owner.nbytes)
    return held is not None and held.memory is owner


def _describe(owner: RegisteredHostMemory, state: Literal["open", "closed", "quarantined"]) -> dict[str, object]:
    vmm_owner = owner.owner if owner.kind.value == "vmm_host" else None
    return {"kind": "registration", "owner": repr(owner), "device": str(owner.device), "state": state,
            "rung": registration_rung(owner), "memory_kind": owner.kind.value, "memory_owner": vmm_owner,
            "owner_obj": owner, "device_obj": owner.device}


def _find(value: int, notes: list[str]) -> dict[str, object]:
    """The registry / allocation lookup for :func:`explain` (this process only)."""
    va = HostVA.unsafe_from_int(value)
    for owner, state in ((find_registration(va), "open"), (find_closed_registration(va), "closed")):
        if owner is None:
            continue
        if state == "closed" and _quarantined_memory(owner):
            state = "quarantined"  # still registered: its aliases still reach it
        out = _describe(owner, state)  # type: ignore[arg-type]
        out |= {"domain": "host_va", "base": owner.host_va.value, "nbytes": owner.nbytes,
                "offset": value - owner.host_va.value}
        for k, chunk in enumerate(owner.chunks):
            if chunk.contains(va, 1):
                out["chunk"] = (k + 1, len(owner.chunks))
                alias = _alias_range(owner, k) if state != "closed" else None
                if alias is not None:
                    out["other_domain_address"] = alias[0] + (value - chunk.host_va.value)
                    # a portable registration serving other devices too (kernel_table_for, resolve_alias)
                    others = [(d, _alias_range(owner, k, d)) for d in owner.alias_devices[1:]]
                    listed = [f"{d}: {r[0] + (value - chunk.host_va.value):#x}" for d, r in others if r is not None]
                    if listed:
                        notes.append(f"the device alias above is on {owner.device}; on other devices: "
                                     + ", ".join(listed))
                    if device_reads_va(owner.kind):
                        notes.append(f"{owner.kind.value} memory: the device reads it at its host VA, nothing "
                                     "was registered for it (the same number is both)")
                    elif alias[0] == chunk.host_va.value:
                        notes.append(f"on {owner.device} the device alias equals the host VA "
                                     "(CanUseHostPointerForRegisteredMem = 1): the same number is both")
                    elif chunk.register_va is not None:
                        notes.append("strict alias mode: the host VA is a never-registered mapping; kernels read "
                                     "the alias of the second, registered mapping of the same pages")
        if state == "closed":
            notes.append("the registration was closed: the memory is ordinary host memory now and has no alias")
        return out
    quarantined_owners = [q.memory for q in quarantined() if isinstance(q.memory, RegisteredHostMemory)]
    for owner in (*open_registrations(), *quarantined_owners):
        state = "quarantined" if owner.closed else "open"
        for dev in owner.alias_devices:  # its own device first, then the others aliases were asked for
            for k, chunk in enumerate(owner.chunks):
                alias = _alias_range(owner, k, dev)
                if alias is not None and alias[0] <= value < alias[0] + alias[1]:
                    out = _describe(owner, state)  # type: ignore[arg-type]
                    out |= {"domain": "device_alias", "base": alias[0], "nbytes": alias[1],
                            "offset": value - alias[0], "chunk": (k + 1, len(owner.chunks)),
                            "other_domain_address": chunk.host_va.value + (value - alias[0]),
                            "device": str(dev), "device_obj": dev}
                    if dev != owner.device:
                        notes.append(f"the alias is on {dev}; the registration was made for {owner.device} "
                                     "(portable: one registration serves every device of its type)")
                    return out
        for k, chunk in enumerate(owner.chunks):
            # strict alias mode: the second, registered mapping of the chunk's pages (the one the
            # driver knows; a fault report may carry it)
            if chunk.register_va is not None and chunk.register_va <= value < chunk.register_va + chunk.nbytes:
                off = value - chunk.register_va
                alias = _alias_range(owner, k)
                out = _describe(owner, state)  # type: ignore[arg-type]
                out |= {"domain": "host_va", "kind": "registration (strict mode's registered mapping)",
                        "base": chunk.register_va, "nbytes": chunk.nbytes, "offset": off,
                        "chunk": (k + 1, len(owner.chunks)),
                        "other_domain_address": alias[0] + off if alias is not None else None}
                notes.append("strict alias mode: this is the registered twin mapping of the registration's pages, "
                             f"never handed out; CPU code uses the host VA {chunk.host_va.value + off:#x}, kernels "
                             "the device alias")
                return out
    try:
        from pointerdomain.registration.allocation import memory_device_at

        where = memory_device_at(value, 1)
    except Exception as exc:  # noqa: BLE001 - no extension: say so, keep going
        notes.append(f"no emulated device lookup: {type(exc).__name__}: {exc}")
        where = None
    if where is not None:
        return {"domain": "device_memory", "kind": "device allocation", "device": str(where), "device_obj": where}
    segment = _cuda_allocation(value)
    if segment is not None:
        ordinal, start, size = segment
        return {"domain": "device_memory", "kind": "device allocation (torch caching allocator segment)",
                "device": f"cuda:{ordinal}", "base": start, "nbytes": size, "offset": value - start,
                "device_obj": Device("cuda", ordinal)}
    return {"domain": "unknown"}
