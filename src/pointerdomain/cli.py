"""Command line: ``pointerdomain doctor``, ``pointerdomain demo`` and ``pointerdomain audit``."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any, get_args

import pydantic
import torch

from pointerdomain._platform import (
    backend_for,
    default_device,
    extension_ops,
    extension_path,
    gpu_ops_built,
    runtime_devices,
    visible_devices,
)
from pointerdomain.devices import Device, validate_device
from pointerdomain.errors import LayoutError, PointerDomainError
from pointerdomain.layouts import DType, KVLayout, LayoutKind
from pointerdomain.pools import DeviceKVPool, HostKVPool
from pointerdomain.resolve import alias_policy, can_use_host_pointer

__all__ = ["main"]


def _sync(device: Device) -> None:
    backend_for(device).synchronize(device)


def _random_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill ``t`` with random bytes (never zeros: a copy that does nothing must show)."""
    flat = t.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def self_test(device: Device) -> dict[str, Any]:
    """Register 1 MiB, write it through the host VA, copy it into device memory with
    the transfer kernel through the device alias, and compare the bytes."""
    layout = KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=16, num_heads=1, head_dim=64,
                      attention="mla", dtype="uint8")
    dev_layout = layout.replace(kind="layer_first")
    pool = DeviceKVPool(dev_layout, device)
    gen = torch.Generator().manual_seed(7)
    with HostKVPool(layout, device) as host:
        _random_bytes(host.buffer, gen)
        slots = torch.arange(layout.num_slots, dtype=torch.int64, device=device.torch_device)
        host.load(pool, slots, slots)
        _sync(device)
        ok = all(
            torch.equal(pool.buffer(0, layer).cpu().view(-1, 64), host.buffer[0, :, layer].reshape(-1, 64))
            for layer in range(layout.num_layers)
        )
        va, alias = host.memory.host_va, host.kernel_table[0]
    return {"ok": ok, "host_va": hex(va.value), "device_alias": hex(alias.value), "alias_equals_va": va.value == alias.value}


def doctor(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        report["extension"] = extension_path()
    except PointerDomainError as exc:
        report["extension"] = f"MISSING: {exc}"
        print(json.dumps(report, indent=2))
        return 1
    report["gpu_ops_built"] = gpu_ops_built()
    report["gpu_runtime"] = backend_for(Device("cuda", 0)).runtime if gpu_ops_built() else None
    if gpu_ops_built():
        report.update(runtime_devices())
    report["ops"] = extension_ops()
    devices = [validate_device(args.device)] if args.device else []
    if not devices:
        devices = visible_devices()
    report["devices"] = []
    status = 0
    for dev in devices:
        entry: dict[str, Any] = {"device": str(dev)}
        try:
            entry["name"] = backend_for(dev).device_name(dev)
            entry["can_use_host_pointer_for_registered_mem"] = can_use_host_pointer(dev)
            entry["alias_policy"] = alias_policy(dev).value
            entry["self_test"] = self_test(dev)
            status |= 0 if entry["self_test"]["ok"] else 1
        except PointerDomainError as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            status = 1
        report["devices"].append(entry)
    print(json.dumps(report, indent=2))
    return status


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _memory_problem(device: Device, dev_layout: KVLayout, host_layout: KVLayout, pages: int) -> str | None:
    """Why the demo's pools would not fit, or None. Host: the host pool, the saved pages
    and (emulated) the device pool against MemAvailable; CUDA: the device pool and the
    saved pages against free device memory."""
    saved = pages * dev_layout.nbytes // dev_layout.num_pages
    free = backend_for(device).free_device_memory(device)  # None: device memory is host memory
    host_need = host_layout.nbytes + (dev_layout.nbytes + saved if free is None else 0)
    available = _available_host_bytes()
    if available is not None and host_need > available * 0.8:
        return (f"the pools need {host_need / 2**30:.1f} GiB of host memory and {available / 2**30:.1f} GiB is "
                "available: lower --layers, --device-pages, --host-pages or --pages")
    if free is not None:
        if dev_layout.nbytes + saved > free * 0.9:
            return (f"the device pool needs {(dev_layout.nbytes + saved) / 2**30:.1f} GiB and {device} has "
                    f"{free / 2**30:.1f} GiB free: lower --layers or --device-pages")
    return None


def demo(args: argparse.Namespace) -> int:
    device = validate_device(args.device) if args.device else default_device()
    if args.attention == "mla" and args.heads not in (None, 1):
        print(f"error: MLA stores one latent vector per token: --heads must be 1 (got {args.heads})", file=sys.stderr)
        return 2
    heads = args.heads if args.heads is not None else (1 if args.attention == "mla" else 8)
    try:
        dev_layout = KVLayout(kind="layer_first", attention=args.attention, num_layers=args.layers,
                              num_pages=args.device_pages, page_size=args.page_size,
                              num_heads=heads,
                              head_dim=args.head_dim, dtype=args.dtype)
        host_layout = dev_layout.replace(kind=args.host_layout, num_pages=args.host_pages)
    except (pydantic.ValidationError, LayoutError) as exc:
        print(f"error: invalid pool shape: {exc}", file=sys.stderr)
        return 2
    if not 0 < args.pages <= min(args.device_pages, args.host_pages):
        print(f"error: --pages must be in [1, {min(args.device_pages, args.host_pages)}] (the smaller pool), "
              f"got {args.pages}", file=sys.stderr)
        return 2
    problem = _memory_problem(device, dev_layout, host_layout, args.pages)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    print(f"pointerdomain demo on {device}: {args.attention}, {args.layers} layers, item {dev_layout.item_bytes} B, "
          f"page {args.page_size} tokens; device pool {dev_layout.nbytes / 2**20:.0f} MiB, "
          f"host pool {host_layout.nbytes / 2**20:.0f} MiB ({args.host_layout})")
    pool = DeviceKVPool(dev_layout, device)
    for buf in pool.buffers:
        _random_bytes(buf, gen)
    with HostKVPool(host_layout, device) as host:
        va, alias = host.memory.host_va, host.kernel_table[0]
        print(f"host pool: HostVA {va.value:#x}, DeviceAlias {alias.value:#x} "
              f"({'equal' if va.value == alias.value else 'distinct'}; policy {alias_policy(device).value})")
        dev_pages = torch.randperm(args.device_pages, generator=gen)[: args.pages]
        host_pages = torch.randperm(args.host_pages, generator=gen)[: args.pages]
        tok = torch.arange(args.page_size)
        dev_slots = (dev_pages[:, None] * args.page_size + tok).reshape(-1).to(device.torch_device)
        host_slots = (host_pages[:, None] * args.page_size + tok).reshape(-1).to(device.torch_device)
        expected = [buf[dev_slots].clone() for buf in pool.buffers]
        moved = args.pages * args.page_size * dev_layout.num_kv * args.layers * dev_layout.item_bytes

        host.backup(pool, dev_slots[:1], host_slots[:1])  # warm-up: module load, first-launch costs
        host.load(pool, host_slots[:1], dev_slots[:1])
        _sync(device)
        t0 = time.perf_counter()
        host.backup(pool, dev_slots, host_slots)
        _sync(device)
        t_d2h = time.perf_counter() - t0
        for buf in pool.buffers:  # clobber the device pool
            buf.view(torch.uint8).fill_(0xA5)
        _sync(device)
        t0 = time.perf_counter()
        host.load(pool, host_slots, dev_slots)
        _sync(device)
        t_h2d = time.perf_counter() - t0

        bad = [i for i, (buf, want) in enumerate(zip(pool.buffers, expected))
               if not torch.equal(buf[dev_slots].view(torch.uint8), want.view(torch.uint8))]
        others = torch.ones(dev_layout.num_slots, dtype=torch.bool, device=device.torch_device)
        others[dev_slots] = False
        untouched = all(bool((buf[others].view(torch.uint8) == 0xA5).all()) for buf in pool.buffers)
    print(f"moved {moved / 2**20:.1f} MiB each way ({args.pages} pages): "
          f"D2H {t_d2h * 1e3:.1f} ms = {moved / t_d2h / 1e9:.2f} GB/s, "
          f"H2D {t_h2d * 1e3:.1f} ms = {moved / t_h2d / 1e9:.2f} GB/s")
    if bad or not untouched:
        print(f"FAILED: {len(bad)} buffer(s) differ; untouched slots intact: {untouched}")
        return 1
    print("round trip verified byte-for-byte; untouched slots intact")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pointerdomain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_doc = sub.add_parser("doctor", help="platform, extension, alias policy per device, registered-memory self-test")
    p_doc.add_argument("--device", help="one device (cuda:N or emulated:N); default all")
    p_demo = sub.add_parser("demo", help="back up random KV pages to registered host memory, clobber, load, verify")
    p_demo.add_argument("--device", help="cuda:N or emulated:N (default: cuda if present, else emulated:0)")
    p_demo.add_argument("--attention", choices=["mha", "mla"], default="mha")
    p_demo.add_argument("--layers", type=int, default=32)
    p_demo.add_argument("--heads", type=int, default=None, help="KV heads (MHA, default 8; MLA has 1)")
    p_demo.add_argument("--head-dim", type=int, default=128, help="128 for MHA; 576 is typical for MLA")
    p_demo.add_argument("--dtype", choices=list(get_args(DType)), default="bfloat16")
    p_demo.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p_demo.add_argument("--device-pages", type=int, default=32)
    p_demo.add_argument("--host-pages", type=int, default=64)
    p_demo.add_argument("--pages", type=int, default=16, help="pages moved each way")
    p_demo.add_argument("--host-layout", choices=list(get_args(LayoutKind)), default="page_first")
    p_demo.add_argument("--seed", type=int, default=0)
    p_audit = sub.add_parser("audit", help="find raw integer addresses (PD rules); CI gate (docs/audit.md)")
    try:  # torch-free, but needs the `audit` extra (libcst)
        from pointerdomain.audit import cli as audit_cli
    except ImportError as exc:
        audit_missing: ImportError | None = exc
        p_audit.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        audit_missing = None
        audit_cli.add_arguments(p_audit)
    args = parser.parse_args(argv)
    if args.command == "audit":
        if audit_missing is not None:
            print(f"error: pointerdomain audit needs pip install 'pointerdomain[audit]' ({audit_missing})", file=sys.stderr)
            return 2
        return audit_cli.run(args)
    try:
        return doctor(args) if args.command == "doctor" else demo(args)
    except PointerDomainError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
