"""``pointerdomain doctor``: the platform matrix for bug reports.

Readable tables by default, ``--json`` for a bug report. Per device: the device
attributes that decide address domains (CanUseHostPointerForRegisteredMem,
PageableMemoryAccess, PageableMemoryAccessUsesHostPageTables, HostRegisterSupported,
HostRegisterReadOnlySupported), the PCI bus id and NUMA node, the alias policy,
strict-mode capability, the host-memory kinds it meets (pageable memory read in place,
VMM host memory detected, the kind a fresh allocation gets), a self-test per
registration-ladder rung and a registered-memory round trip through the transfer kernel.
For the process: the registration counters (seconds per GiB, the longest single
registration call, prefault time, huge-page share; ``"registration"`` in ``--json``). For
the host: WSL2, Confidential Computing, ``ulimit -l``; transfer engines importable;
versions. Inside a rank of an initialised ``torch.distributed`` group (:func:`collect`
called there): the group and the registration outcome its ranks agreed on
(``"distributed"`` in ``--json``, :mod:`pointerdomain.distributed`).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import mmap
import os
import platform
import resource
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pointerdomain._platform import (
    backend_for,
    extension_ops,
    extension_path,
    gpu_ops_built,
    runtime_devices,
    visible_devices,
)
from pointerdomain._platform.base import DEVICE_ATTRIBUTES, DeviceAttributeName
from pointerdomain.buildinfo import build_rows
from pointerdomain.devices import Device
from pointerdomain.errors import PointerDomainError

__all__ = [
    "NOT_AVAILABLE",
    "Row",
    "budget_row",
    "add_arguments",
    "collect",
    "confidential_computing",
    "device_attributes",
    "engine_rows",
    "gpu_numa_node",
    "group_row",
    "host_rows",
    "ladder_rows",
    "memory_kind_rows",
    "pci_bus_id",
    "registration_rows",
    "render_text",
    "run",
    "self_test",
    "strict_mode_row",
    "transparent_huge_pages",
    "version_rows",
]

#: What a row says where this build lacks the feature.
NOT_AVAILABLE = "not available in this build"

#: The attributes of the matrix (the PCI ids are shown as one bus id).
MATRIX: tuple[DeviceAttributeName, ...] = tuple(a for a in DEVICE_ATTRIBUTES if not a.startswith("Pci"))


@dataclass(frozen=True)
class Row:
    """One line of the report: ``name``, its ``value`` (JSON-ready) and how it was found."""

    name: str
    value: object
    detail: str = ""


# host --------------------------------------------------------------------------------
def wsl2() -> Row:
    """WSL2: ``/proc/version`` names Microsoft's kernel (device aliases differ there)."""
    try:
        with open("/proc/version") as f:
            text = f.read()
    except OSError:
        return Row("WSL2", "unknown", "/proc/version unreadable")
    return Row("WSL2", "microsoft" in text.lower(), "/proc/version")


def confidential_computing() -> Row:
    """GPU Confidential Computing (cudaHostRegister returns 801 at every size there):
    ``nvidia-smi conf-compute -f`` when present, else a CPU TEE guest device, else unknown."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "conf-compute", "-f"], capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return Row("Confidential Computing", out.stdout.strip().splitlines()[-1], "nvidia-smi conf-compute -f")
        except (OSError, subprocess.SubprocessError):
            pass
    for dev, tee in (("/dev/tdx_guest", "Intel TDX"), ("/dev/sev-guest", "AMD SEV-SNP")):
        if os.path.exists(dev):
            return Row("Confidential Computing", f"CPU TEE guest ({tee}); GPU CC mode unknown", dev)
    return Row("Confidential Computing", "unknown", "no nvidia-smi conf-compute, no TDX/SEV guest device")


def memlock() -> Row:
    """``ulimit -l``: RLIMIT_MEMLOCK soft/hard in bytes (None = unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    show = [None if v == resource.RLIM_INFINITY else v for v in (soft, hard)]
    return Row("ulimit -l (RLIMIT_MEMLOCK bytes, soft/hard)", show, "unlimited = null; pinning beyond it fails")


def transparent_huge_pages() -> Row:
    """The kernel's THP mode (``/sys/kernel/mm/transparent_hugepage/enabled``, the bracketed
    word): ``madvise`` means only ranges advised ``MADV_HUGEPAGE`` (``huge_pages="thp"``) get them."""
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return Row("transparent huge pages", "unknown", f"{path} unreadable")
    start, end = text.find("["), text.find("]")
    return Row("transparent huge pages", text[start + 1:end] if 0 <= start < end else text.strip(), path)


def host_rows() -> list[Row]:
    """The host's rows: WSL2, Confidential Computing, ``ulimit -l``, NUMA nodes, THP mode."""
    nodes = sorted(n for n in os.listdir("/sys/devices/system/node") if n.startswith("node")) if os.path.isdir(
        "/sys/devices/system/node") else []
    return [wsl2(), confidential_computing(), memlock(),
            Row("NUMA nodes", len(nodes) or "unknown", "/sys/devices/system/node"), transparent_huge_pages()]


# versions and engines ------------------------------------------------------------------
def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_rows() -> list[Row]:
    """Library and runtime versions, the extension and what it was built with."""
    import pointerdomain

    rows = [Row("pointerdomain", pointerdomain.__version__), Row("python", platform.python_version()),
            Row("platform", platform.platform()), Row("torch", torch.__version__),
            Row("torch CUDA", torch.version.cuda), Row("torch HIP", getattr(torch.version, "hip", None)),
            Row("torch sees CUDA", torch.cuda.is_available())]
    rows.extend(Row(*row) for row in build_rows())
    try:
        rows.append(Row("extension", extension_path()))
    except PointerDomainError as exc:
        return [*rows, Row("extension", f"MISSING: {exc}")]
    rows.append(Row("GPU ops built", gpu_ops_built()))
    if gpu_ops_built():
        rows.append(Row("GPU runtime", backend_for(Device("cuda", 0)).runtime))
        rows.extend(Row(k, v, "the extension's own runtime") for k, v in runtime_devices().items())
    rows.append(Row("extension ops", len(extension_ops()), ", ".join(extension_ops())))
    return rows


def engine_rows() -> list[Row]:
    """Transfer engines importable (Mooncake, NIXL), with their distribution versions."""
    rows = []
    for label, module, dists in (("mooncake", "mooncake", ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")),
                                 ("nixl", "nixl", ("nixl", "nixl-cu13", "nixl-cu12"))):
        if importlib.util.find_spec(module) is None:
            rows.append(Row(label, "not installed"))
            continue
        version = next((v for d in dists if (v := _dist_version(d)) is not None), "unknown version")
        try:
            importlib.import_module(module)
            rows.append(Row(label, f"importable ({version})"))
        except Exception as exc:  # noqa: BLE001 - a broken engine install is a finding, not a crash
            rows.append(Row(label, f"installed, import fails: {type(exc).__name__}: {exc}"))
    return rows


# devices ---------------------------------------------------------------------------------
def device_attributes(device: Device) -> dict[str, int | None]:
    """The matrix attributes of ``device`` (None: the runtime does not define it or the query failed)."""
    backend = backend_for(device)
    return {name: backend.device_attribute(name, device) for name in MATRIX}


def pci_bus_id(device: Device) -> str | None:
    """``dddd:bb:dd.0`` of ``device`` from the PCI domain / bus / device attributes, or None."""
    backend = backend_for(device)
    pci: tuple[DeviceAttributeName, ...] = ("PciDomainId", "PciBusId", "PciDeviceId")
    parts = [backend.device_attribute(name, device) for name in pci]
    if any(p is None for p in parts):
        return None
    domain, bus, dev = (int(p or 0) for p in parts)
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def gpu_numa_node(device: Device) -> Row:
    """The NUMA node of ``device`` (``/sys/bus/pci/devices/<bdf>/numa_node``; -1: the
    platform reports none, e.g. one node)."""
    if device.runtime.host_memory:
        return Row("NUMA node", "n/a (emulated device: CPU memory)")
    bdf = pci_bus_id(device)
    if bdf is None:
        return Row("NUMA node", "unknown", "no PCI bus id from the runtime")
    path = f"/sys/bus/pci/devices/{bdf}/numa_node"
    try:
        with open(path) as f:
            return Row("NUMA node", int(f.read().strip()), path)
    except (OSError, ValueError):
        return Row("NUMA node", "unknown", f"{path} unreadable")


def strict_mode_row(device: Device, attributes: dict[str, int | None]) -> Row:
    """Strict alias mode capability of ``device`` (:func:`pointerdomain.registration.strict.strict_mode_capability`:
    PageableMemoryAccess 0 -> a never-registered host VA faults, 1 -> HMM/ATS reads it)."""
    from pointerdomain.registration.strict import strict_mode_capability

    cap = strict_mode_capability(device)
    value = {True: "can fault", False: "cannot fault", None: "unknown"}[cap.can_fault]
    return Row("strict alias mode", value, cap.reason)


def _rung_test(device: Device, nbytes: int, max_chunk_bytes: int) -> tuple[bool, str]:
    from pointerdomain.registration.kinds import chunk_alias

    """Register ``nbytes`` (chunks of ``max_chunk_bytes``), check every chunk's alias
    (and, where device memory is host-readable, the bytes through it), unregister."""
    from pointerdomain.registration.allocation import alloc_registered

    with alloc_registered(nbytes, device, max_chunk_bytes=max_chunk_bytes) as mem:
        backend = backend_for(device)
        data = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        mem.tensor.copy_(data)
        for chunk in mem.chunks:
            # strict alias mode: the alias is of the registered second mapping, not the host VA;
            # VMM host / device-accessible memory: the VA itself
            found = chunk_alias(mem.kind, chunk.host_va.value, chunk.registered_address, chunk.nbytes, device)
            if found is None:
                return False, f"no device address for chunk at {chunk.host_va!r} ({mem.kind.value} memory)"
            alias = found[0]
            if backend.host_readable:
                start = chunk.host_va.value - mem.host_va.value
                seen = ctypes.string_at(alias, chunk.nbytes)
                if seen != bytes(data[start : start + chunk.nbytes].numpy().tobytes()):
                    return False, f"bytes through the alias of chunk at {chunk.host_va!r} differ"
        return True, f"{len(mem.chunks)} call(s), {nbytes} bytes, {mem.kind.value} memory ({mem.rung.value})"


def ladder_rows(device: Device) -> list[Row]:
    """A self-test per registration-ladder rung (:func:`pointerdomain.registration.ladder.probe_rungs`:
    single, chunked, pinned_copy, unpinned), plus this module's check of the bytes through
    every chunk's alias for the single and chunked rungs."""
    from pointerdomain.registration.ladder import probe_rungs

    def value(rung: str, result: str) -> str:
        if result.startswith("ok"):
            return "works"
        if result.startswith("not supported ("):
            return "not supported (recognised)"  # a coherent part: the not_needed rung serves
        return "FAILS" if rung in ("single", "chunked") else result

    rows = [Row(f"rung: {rung}", value(rung, result), "" if result == "ok" else result)
            for rung, result in probe_rungs(device).items()]
    page = mmap.PAGESIZE
    for rung, nbytes, chunk in (("single", 64 * page, 64 * page), ("chunked", 4 * page, page)):
        try:
            ok, detail = _rung_test(device, nbytes, chunk)
            rows.append(Row(f"alias check: {rung}", "works" if ok else "FAILS", detail))
        except PointerDomainError as exc:
            rows.append(Row(f"alias check: {rung}", "FAILS", f"{type(exc).__name__}: {exc}"))
    return rows


def memory_kind_rows(device: Device) -> list[Row]:
    """The host-memory kinds ``device`` meets (:mod:`pointerdomain.registration.kinds`): whether
    it reads pageable memory in place (the ``not_needed`` rung), whether VMM host memory
    can be told apart (through the driver), and the kind a fresh allocation gets here."""
    from pointerdomain._platform.host_memory import HostKindQuery, pageable_access
    from pointerdomain.registration.allocation import alloc_registered

    backend = backend_for(device)
    access = pageable_access(backend, device)
    rows = [Row("pageable memory", "device-accessible (no registration needed)" if access.coherent
                else "needs registration", access.reason)]
    if isinstance(backend, HostKindQuery):
        rows.append(Row("VMM host memory", "detected, never registered again",
                        f"the {backend.name} backend's VMM query (CUDA: cuMemRetainAllocationHandle)"))
    else:
        rows.append(Row("VMM host memory", "not detectable here", f"the {backend.name} backend has no VMM query"))
    try:
        with alloc_registered(4 * mmap.PAGESIZE, device) as mem:
            rows.append(Row("kind of a fresh allocation", mem.kind.value, f"rung {mem.rung.value}, owner {mem.owner}"))
    except PointerDomainError as exc:
        rows.append(Row("kind of a fresh allocation", "FAILS", f"{type(exc).__name__}: {exc}"))
    return rows


def registration_rows() -> dict[str, object]:
    """The process's registration counters (:func:`pointerdomain.registration.pacing.registration_counters`):
    seconds per GiB, the longest single call, prefault time, the last huge-page share."""
    from pointerdomain.registration.pacing import registration_counters

    return registration_counters()


def self_test(device: Device) -> dict[str, Any]:
    """Register a small pool (8 KiB), write it through the host VA, copy it into device
    memory with the transfer kernel through the device alias, and compare the bytes."""
    from pointerdomain.layouts import KVLayout
    from pointerdomain.transfer.pools import DeviceKVPool, HostKVPool

    layout = KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=16, num_heads=1, head_dim=64,
                      attention="mla", dtype="uint8")
    pool = DeviceKVPool(layout.replace(kind="layer_first"), device)
    gen = torch.Generator().manual_seed(7)
    with HostKVPool(layout, device) as host:
        flat = host.buffer.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
        slots = torch.arange(layout.num_slots, dtype=torch.int64, device=device.torch_device)
        host.load(pool, slots, slots)
        backend_for(device).synchronize(device)
        ok = all(
            torch.equal(pool.buffer(0, layer).cpu().view(-1, 64), host.buffer[0, :, layer].reshape(-1, 64))
            for layer in range(layout.num_layers)
        )
        va, alias = host.memory.host_va, host.kernel_table[0]
    return {"ok": ok, "host_va": hex(va.value), "device_alias": hex(alias.value), "alias_equals_va": va.value == alias.value}


def group_row() -> dict[str, Any] | None:
    """The process group (rank, world size, backend) and the registration outcome its
    ranks agreed on (:func:`pointerdomain.distributed.group_report`), or None outside
    an initialised torch.distributed group. Makes no collective call."""
    from pointerdomain.distributed import group_report

    return group_report()


def budget_row(device: Device) -> dict[str, object]:
    """The memory budget of ``device`` (:func:`pointerdomain.registration.budget.budget_for`):
    every limit, its room in bytes, whether it is enforced, and the fix."""
    from pointerdomain.registration.budget import budget_for

    return budget_for(device).as_dict()


def device_report(device: Device) -> dict[str, Any]:
    """Every row of one device (errors become an ``error`` entry, never an exception)."""
    from pointerdomain.registration.resolve import alias_policy

    entry: dict[str, Any] = {"device": str(device)}
    try:
        entry["name"] = backend_for(device).device_name(device)
        attrs = device_attributes(device)
        entry["attributes"] = attrs
        entry["pci_bus_id"] = pci_bus_id(device)
        entry["numa_node"] = asdict(gpu_numa_node(device))
        entry["alias_policy"] = alias_policy(device).value
        entry["strict_mode"] = asdict(strict_mode_row(device, attrs))
        entry["memory_kinds"] = [asdict(r) for r in memory_kind_rows(device)]
        entry["ladder"] = [asdict(r) for r in ladder_rows(device)]
        entry["self_test"] = self_test(device)
        entry["budget"] = budget_row(device)
    except PointerDomainError as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry


def collect(devices: list[Device] | None = None) -> dict[str, Any]:
    """The whole report as JSON-ready data (``devices``: default every visible device,
    or ``[emulated:0]`` without a GPU)."""
    from pointerdomain.registration.teardown import quarantined

    report: dict[str, Any] = {
        "versions": [asdict(r) for r in version_rows()],
        "host": [asdict(r) for r in host_rows()],
        "transfer_engines": [asdict(r) for r in engine_rows()],
        "quarantined": [q.as_dict() for q in quarantined()],
    }
    group = group_row()
    if group is not None:  # only inside a rank of an initialised torch.distributed group
        report["distributed"] = group
    try:
        extension_path()
    except PointerDomainError:
        report["devices"] = []
        report["ok"] = False
        return report
    report["devices"] = [device_report(d) for d in (devices or visible_devices())]
    report["registration"] = registration_rows()
    report["ok"] = all("error" not in d and d["self_test"]["ok"] for d in report["devices"])
    return report


def _show(value: object) -> str:
    if value is None:
        return "-"
    return str(value)


def render_text(report: dict[str, Any]) -> None:
    """Print ``report`` as tables (rich) to stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, shutil.get_terminal_size((120, 24)).columns))
    for title, key in (("Versions", "versions"), ("Host", "host"), ("Transfer engines", "transfer_engines")):
        table = Table(title=title, title_justify="left", show_header=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_column(style="dim")
        for row in report[key]:
            detail = row["detail"] if key != "versions" or row["name"] != "extension ops" else ""
            table.add_row(row["name"], _show(row["value"]), detail)
        console.print(table)
    for dev in report["devices"]:
        table = Table(title=f"{dev['device']}: {dev.get('name', '')}", title_justify="left", show_header=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_column(style="dim")
        if "error" in dev:
            table.add_row("error", dev["error"], "")
        else:
            for name, value in dev["attributes"].items():
                table.add_row(name, _show(value), "device attribute")
            table.add_row("PCI bus id", _show(dev["pci_bus_id"]), "")
            for key in ("numa_node", "strict_mode"):
                table.add_row(dev[key]["name"], _show(dev[key]["value"]), dev[key]["detail"])
            table.add_row("alias policy", dev["alias_policy"], "")
            for row in dev.get("memory_kinds", []):
                table.add_row(row["name"], _show(row["value"]), row["detail"])
            for row in dev["ladder"]:
                table.add_row(row["name"], _show(row["value"]), row["detail"])
            budget = dev["budget"]
            table.add_row("budget: room to allocate / register (bytes)",
                          f"{_show(budget['room_allocate'])} / {_show(budget['room_register'])}",
                          ", ".join(f"{lim['name']}={_show(lim['room'])}{'' if lim['enforced'] else ' (reported)'}"
                                    for lim in budget["limits"]))
            st = dev["self_test"]
            table.add_row("self-test (kernel round trip)", "ok" if st["ok"] else "FAILED",
                          f"HostVA {st['host_va']}, DeviceAlias {st['device_alias']}"
                          f" ({'equal' if st['alias_equals_va'] else 'distinct'})")
        console.print(table)
    group = report.get("distributed")
    if group is not None:
        table = Table(title="Process group", title_justify="left", show_header=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_column(style="dim")
        table.add_row("this rank", f"{group['rank']} of {group['world_size']}", f"backend {group['backend']}")
        outcome = group["registration"]
        if outcome is None:
            table.add_row("registration", "no register_group call yet", "")
        else:
            table.add_row("registration", outcome["rung"] if outcome["ok"] else "REFUSED", outcome["error"][:200])
            for record in outcome["records"]:
                table.add_row(f"rank {record['rank']}", record["rung"] or "failed",
                              record["error"][:200] or "; ".join(record["ladder_record"])[:200])
        console.print(table)
    for q in report.get("quarantined", []):
        console.print(f"[bold red]quarantined[/]: {q['host_va']} (+{q['nbytes']} bytes, {q['device']}): "
                      f"{q['stage']} teardown step failed: {q['reason']}")
    counters = report.get("registration")
    if isinstance(counters, dict):
        table = Table(title="Registration (this process)", title_justify="left", show_header=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for key in ("registrations", "calls", "bytes", "seconds_per_gib", "longest_call_s", "prefault_seconds",
                    "not_needed", "vmm_host"):
            table.add_row(key, _show(counters.get(key)))
        console.print(table)
    console.print("all self-tests passed" if report["ok"] else "[bold red]a self-test failed or the extension is missing")


# command line ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``doctor`` subcommand's flags."""
    parser.add_argument("--device", default=None,
                        help="one device (cuda:N or emulated:N); default: every visible GPU, or emulated:0 without one")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for bug reports)")


def run(args: argparse.Namespace) -> int:
    """``pointerdomain doctor``: 0 when every self-test passed, 1 otherwise."""
    from pointerdomain.tools.cli import parse_device

    devices = [parse_device(args.device)[0]] if args.device else None
    report = collect(devices)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        render_text(report)
    sys.stdout.flush()
    return 0 if report["ok"] else 1
