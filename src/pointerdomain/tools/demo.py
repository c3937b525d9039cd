"""``pointerdomain demo``: a KV-cache round trip through registered host memory.

Random KV pages are backed up from a device pool to a registered host pool (D2H,
through device aliases), the device pool is clobbered, the pages are loaded back
(H2D) and verified byte for byte, with every untouched slot checked too.

Before allocating, :func:`estimate` counts every buffer the run holds at its peak
(the pools, the saved pages, the alias pages the copies touch, the bounded scratch of
the fill and verify steps, and the process as it is now) and refuses a run that would
not fit. The estimate is printed (``--json``: ``estimate.host_peak_bytes``) and
tests/tools/test_cli_memory.py holds the measured peak RSS within 10 % of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, get_args

import pydantic
import torch

from pointerdomain.arguments import describe
from pointerdomain._platform import backend_for
from pointerdomain.tools.cli import EXIT_FAILURE, EXIT_OK, UsageError, parse_device
from pointerdomain.devices import Device
from pointerdomain.layouts import DType, KVLayout, LayoutKind
from pointerdomain.transfer.pools import DeviceKVPool, HostKVPool
from pointerdomain.registration.resolve import alias_policy

__all__ = ["Estimate", "add_arguments", "estimate", "run"]

#: Bytes compared at once by the verify step (bounds its scratch).
SCRATCH_BYTES = 16 << 20

# KVLayout field -> the flag that sets it (validation errors name the flag).
_FLAGS = {"num_layers": "--layers", "page_size": "--page-size", "num_heads": "--heads", "head_dim": "--head-dim",
          "dtype": "--dtype", "attention": "--attention", "kind": "--host-layout"}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {describe(text)}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _seed(text: str) -> int:
    """A seed torch's generators take (``manual_seed``): an int in [-2**63, 2**64)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**64), got {describe(text)}") from None
    if not -(1 << 63) <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"must be an integer in [-2**63, 2**64) (a torch generator's seed), got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's flags (every one with a help line; defaults shown by ``--help``)."""
    p.add_argument("--device", default=None, help="cuda:N or emulated:N; default: the current GPU when one is present "
                   "with the GPU ops, else emulated:0 (the CPU stand-in). 'cpu' is refused: say emulated:0")
    p.add_argument("--attention", choices=["mha", "mla"], default="mha", help="MHA (K and V per head) or MLA (one latent)")
    p.add_argument("--layers", type=_positive, default=32, help="transformer layers in both pools")
    p.add_argument("--heads", type=_positive, default=None, help="KV heads per token (default: 8 for MHA; MLA has 1)")
    p.add_argument("--head-dim", type=_positive, default=128, help="elements per head; 128 for MHA, 576 is typical for MLA")
    p.add_argument("--dtype", choices=list(get_args(DType)), default="bfloat16", help="element type of the KV cache")
    p.add_argument("--page-size", type=_positive, default=64, help="tokens per page")
    p.add_argument("--device-pages", type=_positive, default=32, help="pages in the device pool")
    p.add_argument("--host-pages", type=_positive, default=64, help="pages in the registered host pool")
    p.add_argument("--pages", type=_positive, default=16, help="pages moved each way (at most the smaller pool)")
    p.add_argument("--host-layout", choices=list(get_args(LayoutKind)), default="page_first",
                   help="layout of the host pool (the device pool is layer_first)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random bytes and page choice, in [-2**63, 2**64)")
    p.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="progress bars on stderr (auto: when stderr is a terminal)")
    p.add_argument("--json", action="store_true", help="print the result and the memory estimate as one JSON object")


@dataclass(frozen=True)
class Estimate:
    """Peak memory of a demo run, bytes. ``host_peak_bytes`` is the process's peak RSS
    (``baseline_bytes`` is its RSS when the estimate was made); ``device_bytes`` is GPU
    memory (0 on the emulated device, whose memory is host memory and counted in the host peak)."""

    baseline_bytes: int
    device_pool_bytes: int
    host_pool_bytes: int
    saved_bytes: int
    alias_touched_bytes: int
    scratch_bytes: int
    host_peak_bytes: int
    device_bytes: int


def _proc_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in bytes (None where it is missing)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_bytes() -> int:
    return _proc_bytes("/proc/self/status", "VmRSS") or 0


def estimate(device: Device, dev_layout: KVLayout, host_layout: KVLayout, pages: int) -> Estimate:
    """Every buffer the run holds at its peak (see the module docstring). The host pool
    is written in full (poisoned), and the pages moved are touched a second time through
    their alias mapping (a second mapping of the same pages counts again in RSS)."""
    moved = pages * dev_layout.nbytes // dev_layout.num_pages
    host_side = device.runtime.host_memory  # emulated device memory and the saved copy are host memory
    alias_touched = moved if host_side else 0
    scratch = 2 * SCRATCH_BYTES  # verify: a gathered block + its compare result (the fill is in place)
    baseline = _rss_bytes()
    host_peak = (baseline + host_layout.nbytes + alias_touched + scratch
                 + ((dev_layout.nbytes + moved) if host_side else 0))
    return Estimate(baseline, dev_layout.nbytes, host_layout.nbytes, moved, alias_touched, scratch, host_peak,
                    0 if host_side else dev_layout.nbytes + moved)


def _available_host_bytes() -> int | None:
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def _check_fits(device: Device, est: Estimate) -> None:
    gib = 2**30
    available = _available_host_bytes()
    need = est.host_peak_bytes - est.baseline_bytes
    if available is not None and need > available * 0.9:
        raise UsageError(f"the run needs {need / gib:.1f} GiB more host memory (peak {est.host_peak_bytes / gib:.1f} "
                         f"GiB) and {available / gib:.1f} GiB is available: lower --layers, --device-pages, "
                         "--host-pages or --pages")
    if est.device_bytes:
        free = backend_for(device).free_device_memory(device)
        if free is not None and est.device_bytes > free * 0.9:
            raise UsageError(f"the device pool and saved pages need {est.device_bytes / gib:.1f} GiB and {device} has "
                             f"{free / gib:.1f} GiB free: lower --layers, --device-pages or --pages")


def _layouts(args: argparse.Namespace) -> tuple[KVLayout, KVLayout]:
    if args.attention == "mla" and args.heads not in (None, 1):
        raise UsageError(f"--heads: MLA stores one latent vector per token: --heads must be 1 (got {args.heads})")
    heads = args.heads if args.heads is not None else (1 if args.attention == "mla" else 8)
    if not args.pages <= min(args.device_pages, args.host_pages):
        raise UsageError(f"--pages must be in [1, {min(args.device_pages, args.host_pages)}] (the smaller pool), "
                         f"got {args.pages}")
    fields = dict(kind="layer_first", attention=args.attention, num_layers=args.layers, num_pages=args.device_pages,
                  page_size=args.page_size, num_heads=heads, head_dim=args.head_dim, dtype=args.dtype)
    try:
        # pydantic's own validator first: it lists every bad field (KVLayout's errors name the first only)
        for data in (fields, fields | {"kind": args.host_layout, "num_pages": args.host_pages}):
            KVLayout.__pydantic_validator__.validate_python(data)
        dev = KVLayout(**fields)
        host = dev.replace(kind=args.host_layout, num_pages=args.host_pages)
    except pydantic.ValidationError as exc:
        raise UsageError("invalid pool shape: " + "; ".join(_flag_error(e, args) for e in exc.errors())) from None
    return dev, host


def _flag_error(err: Any, args: argparse.Namespace) -> str:
    loc = [str(part) for part in err.get("loc", ())]
    field = loc[0] if loc else ""
    msg = str(err.get("msg", "invalid"))
    if field == "num_pages":
        return f"--device-pages / --host-pages: {msg}"
    if field in _FLAGS:
        flag = _FLAGS[field]
        value = getattr(args, flag[2:].replace("-", "_"), None)
        return f"{flag} {value}: {msg}"
    return msg.removeprefix("Value error, ")


class _Steps:
    """Progress on stderr (rich) for the steps that can take seconds."""

    def __init__(self, mode: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        enabled = mode == "always" or (mode == "auto" and console.is_terminal)
        self.progress = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, disable=not enabled,
                                 transient=False, auto_refresh=enabled)

    @contextlib.contextmanager
    def step(self, name: str, total: int = 1) -> Iterator[Callable[[], None]]:
        task = self.progress.add_task(name, total=total)
        yield lambda: self.progress.advance(task)
        self.progress.update(task, completed=total)
        self.progress.refresh()


def _fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes in place (never a constant: a copy that does nothing must show); no scratch."""
    if t.device != gen.device:  # a CUDA tensor needs a CUDA generator: seed one from the CPU one
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        gen = torch.Generator(device=t.device).manual_seed(seed)
    t.view(torch.uint8).view(-1).random_(0, 256, generator=gen)


def _untouched_intact(buf: torch.Tensor, others: torch.Tensor) -> bool:
    """Every slot not moved still holds the clobber byte 0xA5 (checked in bounded blocks)."""
    rows = buf.view(torch.uint8).view(buf.shape[0], -1)
    per = max(1, SCRATCH_BYTES // max(1, rows.shape[1]))
    for lo in range(0, rows.shape[0], per):
        block = rows[lo : lo + per][others[lo : lo + per]]
        if block.numel() and not bool((block == 0xA5).all()):
            return False
    return True


def _size(nbytes: float) -> str:
    """A byte count for people: B, KiB, MiB or GiB, never "0 MiB" for a small pool."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "too fast to time"


def run(args: argparse.Namespace) -> int:
    """``pointerdomain demo``: 0 when the round trip verifies, 1 otherwise."""
    device, why = parse_device(args.device)
    dev_layout, host_layout = _layouts(args)
    est = estimate(device, dev_layout, host_layout, args.pages)
    _check_fits(device, est)
    say: Callable[[str], None] = (lambda _text: None) if args.json else print
    say(f"pointerdomain demo on {device} ({why}): {args.attention}, {_count(args.layers, 'layer')}, item "
        f"{dev_layout.item_bytes} B, page {_count(args.page_size, 'token')}; device pool {_size(dev_layout.nbytes)}, "
        f"host pool {_size(host_layout.nbytes)} ({args.host_layout}); estimated peak host memory "
        f"{_size(est.host_peak_bytes)}")
    sys.stdout.flush()
    steps = _Steps(args.progress)
    gen = torch.Generator().manual_seed(args.seed)
    sync = backend_for(device).synchronize
    with steps.progress:
        with steps.step("allocate device pool"):
            pool = DeviceKVPool(dev_layout, device)
        with steps.step("allocate + register host pool"):
            host = HostKVPool(host_layout, device)
        with host:
            with steps.step("fill (random bytes)", len(pool.buffers) + 1) as tick:
                for buf in pool.buffers:
                    _fill_random(buf, gen)
                    tick()
                _fill_random(host.buffer, gen)  # poison: a page not written back shows
                tick()
            va, alias = host.memory.host_va, host.kernel_table[0]
            say(f"host pool: HostVA {va.value:#x}, DeviceAlias {alias.value:#x} "
                f"({'equal' if va.value == alias.value else 'distinct'}; policy {alias_policy(device).value})")
            dev_pages = torch.randperm(args.device_pages, generator=gen)[: args.pages]
            host_pages = torch.randperm(args.host_pages, generator=gen)[: args.pages]
            tok = torch.arange(args.page_size)
            dev_slots = (dev_pages[:, None] * args.page_size + tok).reshape(-1).to(device.torch_device)
            host_slots = (host_pages[:, None] * args.page_size + tok).reshape(-1).to(device.torch_device)
            expected = [buf[dev_slots] for buf in pool.buffers]  # indexing copies
            moved = args.pages * args.page_size * dev_layout.num_kv * args.layers * dev_layout.item_bytes
            host.backup(pool, dev_slots[:1], host_slots[:1])  # warm-up: module load, first-launch costs
            host.load(pool, host_slots[:1], dev_slots[:1])
            sync(device)
            with steps.step("copy D2H (backup)"):
                t0 = time.perf_counter()
                host.backup(pool, dev_slots, host_slots)
                sync(device)
                t_d2h = time.perf_counter() - t0
            with steps.step("clobber device pool", len(pool.buffers)) as tick:
                for buf in pool.buffers:
                    buf.view(torch.uint8).fill_(0xA5)
                    tick()
                sync(device)
            with steps.step("copy H2D (load)"):
                t0 = time.perf_counter()
                host.load(pool, host_slots, dev_slots)
                sync(device)
                t_h2d = time.perf_counter() - t0
            with steps.step("verify", len(pool.buffers)) as tick:
                others = torch.ones(dev_layout.num_slots, dtype=torch.bool, device=device.torch_device)
                others[dev_slots] = False
                bad, untouched = [], True
                for i, (buf, want) in enumerate(zip(pool.buffers, expected)):
                    if not torch.equal(buf[dev_slots].view(torch.uint8), want.view(torch.uint8)):
                        bad.append(i)
                    untouched = untouched and _untouched_intact(buf, others)
                    tick()
    ok = not bad and untouched
    result = {"device": str(device), "device_choice": why, "moved_bytes": moved, "d2h_s": t_d2h, "h2d_s": t_h2d,
              "d2h_gbps": moved / t_d2h / 1e9, "h2d_gbps": moved / t_h2d / 1e9, "buffers_differing": bad,
              "untouched_intact": untouched, "ok": ok, "estimate": asdict(est)}
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK if ok else EXIT_FAILURE
    print(f"moved {_size(moved)} each way ({_count(args.pages, 'page')}): "
          f"D2H {t_d2h * 1e3:.1f} ms = {_rate(moved, t_d2h)}, "
          f"H2D {t_h2d * 1e3:.1f} ms = {_rate(moved, t_h2d)}")
    if not ok:
        print(f"FAILED: {len(bad)} buffer(s) differ; untouched slots intact: {untouched}")
        return EXIT_FAILURE
    print("round trip verified byte-for-byte; untouched slots intact")
    return EXIT_OK
