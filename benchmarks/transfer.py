#!/usr/bin/env python3
"""KV page transfer benchmark: a device KV pool (layer_first, one buffer per K/V layer)
<-> a registered host pool (page_first, all layers of a token together), all layers,
random page order, against the usual ways of moving the same bytes.

Usage::

    python benchmarks/transfer.py --out DIR            # CUDA: >= 1 GiB per point (H200: ~2-3 min)
    python benchmarks/transfer.py --quick --out DIR    # smoke test (CI, CPU): a few MiB per point
    python benchmarks/transfer.py --help               # sizes, caps, method subsets

Per point (item size x direction; MHA at every size, MLA at 1152 B) it measures, in
the same run and on the same buffers (see ``--help`` for the column list):

(a) bulk copy of the same number of bytes (CUDA: one cudaMemcpyAsync through torch
    ``.copy_(non_blocking=True)`` between the registered pool and a CUDA tensor; CPU:
    a contiguous torch copy) - the limit every ratio is taken against;
(b) one cudaMemcpyAsync per item, (c) cudaMemcpyBatchAsync on the same per-item list
    (both through ``pointerdomain._C.gpu_copy_runs``, fed device aliases from the
    tables; on CPU (b) is one memcpy per item through ``_C.cpu_copy_runs``);
(d) torch indexing copy (``dst[:, idx] = src[:, :, idx]`` style, pinned pool);
(e) our kernel (``transfer_kv_all_layer(backend="kernel")``) at SM budgets
    max_ctas = 2, 4 and the whole GPU; (f) ``backend="auto"`` at the default budget;
(g) a simple warp-per-item 16-byte kernel on the whole GPU and (h) the common 2-CTA
    design (8-byte words, 2 CTAs x 1024 threads, each warp a contiguous share of the
    slots) - both compiled here with cupy.RawKernel.

Every method except (a) is checked before it is timed: the destination is poisoned
with random bytes, the method runs once on a small pool and the whole destination is
compared with a CPU torch reference (moved items equal the source, everything else
still poison, source unchanged), then once more on the full-size pool, compared on a
random sample of items. A mismatch marks the cell FAIL and it is not timed.

Then: the typed layer's cost per launch (public API vs the extension called directly,
host time per call, and CUDA-graph replay), and checked mode's cost per launch and per
1k table entries. Output: tables on stdout (rich if installed), progress on stderr
(tqdm or rich on a terminal, plain lines otherwise), DIR/transfer.json (every number,
the config, device, versions, date) and DIR/transfer.png (matplotlib, if installed).
GB/s is 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

try:
    import pointerdomain as pd
except ImportError:  # a source checkout that was not installed: use src/ (needs the built extension there)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))
    import pointerdomain as pd
from pointerdomain import kernels as pd_kernels
from pointerdomain._extension import extension

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ITEM_SIZES = (512, 1024, 1152, 2048, 4096, 16384, 65536)
DIRECTIONS = ("D2H", "H2D")
DIRECTION_TEXT = {
    "D2H": "D2H: device pool -> host pool (backup)",
    "H2D": "H2D: host pool -> device pool (load)",
}
# Items compared after the full-size run, and the size of the small pool compared byte for
# byte, on CUDA / on CPU (where torch indexing and compares are slow).
SAMPLE_CHECK_BYTES = {True: 16 * MiB, False: 1 * MiB}
CHECK_POOL_BYTES = {True: 8 * MiB, False: 2 * MiB}
OVERHEAD_PAGES = 16  # pool of the tiny-transfer overhead measurement (MHA, 1 KiB items)
NOISE_SLACK = 1 * MiB  # CPU poison: a window of a noise buffer at one of this many offsets

Fn = Callable[[], None]


class Skip(Exception):
    """A method that cannot run here (reason in the message)."""


def fmt_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _optional(name: str) -> Any:
    try:
        module = __import__(name)
        for part in name.split(".")[1:]:
            module = getattr(module, part)
        return module
    except Exception:
        return None


# ----------------------------------------------------------------------------- layouts and pools


def model_shape(item: int, attention: str) -> dict[str, Any]:
    """Heads / head_dim (bf16) giving ``item`` bytes per token-layer: GQA-like 128-wide
    heads where the size allows (2 KiB = 8 x 128), else one head; MLA one latent vector."""
    if attention == "mla":
        return dict(attention="mla", num_heads=1, head_dim=item // 2, dtype="bfloat16")
    if item % 256 == 0:
        return dict(attention="mha", num_heads=item // 256, head_dim=128, dtype="bfloat16")
    return dict(attention="mha", num_heads=1, head_dim=item // 2, dtype="bfloat16")


@dataclass
class Side:
    """One pool of a case: its layout, kernel table, geometry and bytes."""

    name: str
    layout: Any
    table: Any
    geo: tuple[int, ...]
    flat: torch.Tensor  # uint8, exactly layout.nbytes
    is_host: bool

    def view4(self, flat: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Bytes as [kv, slots, layers, item] (host page_first) or [kv, layers, slots, item] (device)."""
        f = self.flat if flat is None else flat
        lo = self.layout
        if self.is_host:
            return f.view(lo.num_kv, lo.num_slots, lo.num_layers, lo.item_bytes)
        return f.view(lo.num_kv, lo.num_layers, lo.num_slots, lo.item_bytes)

    def gather(self, slots: torch.Tensor, flat: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Items of ``slots`` as [kv, layers, n, item] (torch indexing: the reference)."""
        v = self.view4(flat)
        idx = slots.to(v.device)
        return v[:, idx].transpose(1, 2) if self.is_host else v[:, :, idx]

    def scatter(self, slots: torch.Tensor, items: torch.Tensor, flat: torch.Tensor) -> None:
        v = self.view4(flat)
        idx = slots.to(v.device)
        if self.is_host:
            v[:, idx] = items.transpose(1, 2)
        else:
            v[:, :, idx] = items


@dataclass
class Case:
    """A device pool and a host pool of the same model shape and the slots moved between
    them: whole pages in random order, expanded to token slots (CPU int64)."""

    item: int
    attention: str
    dev: Side
    host: Side
    dev_slots: torch.Tensor
    host_slots: torch.Tensor

    @property
    def bytes_per_slot(self) -> int:
        lo = self.dev.layout
        return lo.num_kv * lo.num_layers * lo.item_bytes

    def ends(self, direction: str) -> tuple[Side, Side]:
        return (self.dev, self.host) if direction == "D2H" else (self.host, self.dev)

    def slots(self, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.dev_slots, self.host_slots) if direction == "D2H" else (self.host_slots, self.dev_slots)


# ----------------------------------------------------------------------------- baselines (g), (h)

BASELINE_CUDA = r"""
typedef unsigned long long u64;
typedef long long i64;
struct alignas(16) Word16 { u64 lo, hi; };  // own 16-byte word: no dependence on NVRTC's implicit headers

// Same addressing as pointerdomain's kernels: entry = kv*e_kv + layer*e_layer + page*e_page,
// addr = table[entry] + kv*s_kv + layer*s_layer + page*s_page + tok*s_tok.
__device__ __forceinline__ u64 item_addr(u64 table, i64 e_kv, i64 e_layer, i64 e_page, i64 s_kv,
                                         i64 s_layer, i64 s_page, i64 s_tok, i64 kv, i64 layer,
                                         i64 slot, i64 page_size) {
    const i64 page = slot / page_size, tok = slot - page * page_size;
    const u64 base = reinterpret_cast<const u64 *>(table)[kv * e_kv + layer * e_layer + page * e_page];
    return base + (u64)(kv * s_kv + layer * s_layer + page * s_page + tok * s_tok);
}
#define SIDE(p) u64 p##_table, i64 p##_ekv, i64 p##_el, i64 p##_ep, i64 p##_skv, i64 p##_sl, i64 p##_sp, i64 p##_st
#define ADDR(p, kv, layer, slot) \
    item_addr(p##_table, p##_ekv, p##_el, p##_ep, p##_skv, p##_sl, p##_sp, p##_st, kv, layer, slot, page_size)

// (g) one warp per item (slot, kv, layer), 16-byte words, one launch covering every item.
extern "C" __global__ void warp_per_item_16(SIDE(src), SIDE(dst), u64 src_idx, u64 dst_idx, i64 n,
                                            i64 page_size, i64 num_kv, i64 num_layers, i64 item_bytes) {
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const i64 per_slot = num_kv * num_layers;
    if (warp >= n * per_slot) return;
    const i64 i = warp / per_slot, r = warp - i * per_slot;
    const i64 kv = r / num_layers, layer = r - kv * num_layers;
    const i64 s = reinterpret_cast<const i64 *>(src_idx)[i];
    const i64 d = reinterpret_cast<const i64 *>(dst_idx)[i];
    const Word16 *sp = reinterpret_cast<const Word16 *>(ADDR(src, kv, layer, s));
    Word16 *dp = reinterpret_cast<Word16 *>(ADDR(dst, kv, layer, d));
    const i64 words = item_bytes >> 4;
    for (i64 j = lane; j < words; j += 32) dp[j] = sp[j];
}

// (h) the common design: 8-byte words (non-coherent loads, cache-global stores), each warp a
// contiguous share of the slots, all layers and K/V of a slot in turn; launched as 2 CTAs of
// 1024 threads.
extern "C" __global__ void common_2cta_8(SIDE(src), SIDE(dst), u64 src_idx, u64 dst_idx, i64 n,
                                         i64 page_size, i64 num_kv, i64 num_layers, i64 item_bytes,
                                         i64 items_per_warp) {
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = (int)(tid & 31);
    const i64 warp = tid >> 5;
    const i64 words = item_bytes >> 3;
    for (i64 k = 0; k < items_per_warp; ++k) {
        const i64 i = warp * items_per_warp + k;
        if (i >= n) break;
        const i64 s = reinterpret_cast<const i64 *>(src_idx)[i];
        const i64 d = reinterpret_cast<const i64 *>(dst_idx)[i];
        for (i64 layer = 0; layer < num_layers; ++layer) {
            for (i64 kv = 0; kv < num_kv; ++kv) {
                const u64 *sp = reinterpret_cast<const u64 *>(ADDR(src, kv, layer, s));
                u64 *dp = reinterpret_cast<u64 *>(ADDR(dst, kv, layer, d));
                for (i64 j = lane; j < words; j += 32) {
                    u64 v;
                    asm volatile("ld.global.nc.b64 %0, [%1];" : "=l"(v) : "l"(sp + j) : "memory");
                    asm volatile("st.global.cg.b64 [%0], %1;" ::"l"(dp + j), "l"(v) : "memory");
                }
            }
        }
    }
}
"""


class CupyBaselines:
    """(g) and (h), compiled with cupy.RawKernel (NVRTC) for the current GPU."""

    def __init__(self, ordinal: int) -> None:
        import cupy  # lazy: optional dependency
        import numpy

        self.cp, self.np, self.ordinal = cupy, numpy, ordinal
        with cupy.cuda.Device(ordinal):
            self.g = cupy.RawKernel(BASELINE_CUDA, "warp_per_item_16")
            self.h = cupy.RawKernel(BASELINE_CUDA, "common_2cta_8")
            for kernel in (self.g, self.h):
                compile_now = getattr(kernel, "compile", None)  # else it compiles at the first launch
                if compile_now is not None:
                    compile_now()
        self.version = str(cupy.__version__)

    def side_args(self, side: Side) -> list[Any]:
        np = self.np
        return [np.uint64(side.table.kernel_table_address())] + [np.int64(v) for v in side.geo[:7]]

    def prepare(self, which: str, src: Side, dst: Side, si: torch.Tensor, di: torch.Tensor, stream: int) -> Fn:
        np, cp = self.np, self.cp
        lo = src.layout
        word = 16 if which == "g" else 8
        for side in (src, dst):
            if lo.item_bytes % word or side.table.alignment % word or any(s % word for s in side.geo[3:7]):
                raise Skip(f"{word}-byte words need {word}-byte aligned items, tables and strides")
        n = si.numel()
        common = (self.side_args(src) + self.side_args(dst)
                  + [np.uint64(si.data_ptr()), np.uint64(di.data_ptr()), np.int64(n), np.int64(lo.page_size),
                     np.int64(lo.num_kv), np.int64(lo.num_layers), np.int64(lo.item_bytes)])
        if which == "g":
            items = n * lo.num_kv * lo.num_layers
            grid, block, kern, args = (items + 7) // 8, 256, self.g, tuple(common)
        else:
            warps = 2 * 32
            per_warp = (n + warps - 1) // warps
            grid = (n + per_warp * 32 - 1) // (per_warp * 32)
            block, kern, args = 1024, self.h, tuple(common + [np.int64(per_warp)])
        ext_stream = cp.cuda.ExternalStream(stream)
        device = cp.cuda.Device(self.ordinal)
        keep = (si, di, src.table, dst.table)

        def run() -> None:
            _ = keep  # the kernel reads these tensors' memory: keep them alive with the closure
            with device, ext_stream:
                kern((grid,), (block,), args)

        return run


# ----------------------------------------------------------------------------- progress and output


class Progress:
    def __init__(self, total: int, mode: str) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        tty = sys.stderr.isatty()
        if mode == "auto":
            mode = "plain"
            if tty and _optional("tqdm") is not None:
                mode = "tqdm"
            elif tty and _optional("rich.progress") is not None:
                mode = "rich"
        self.mode = mode
        if mode == "tqdm":
            import tqdm

            self.bar = tqdm.tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)
        elif mode == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self.prog = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(stderr=True))
            self.task = self.prog.add_task("benchmark", total=total)
            self.prog.start()

    def step(self, text: str, advance: int = 1) -> None:
        self.done += advance
        if self.mode == "tqdm":
            self.bar.set_description_str(text[:60], refresh=False)
            self.bar.update(advance)
        elif self.mode == "rich":
            self.prog.update(self.task, advance=advance, description=text[:60])
        elif self.mode == "plain":
            print(f"[{self.done:>3}/{self.total} {time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.mode == "tqdm":
            self.bar.close()
        elif self.mode == "rich":
            self.prog.stop()


def print_table(title: str, header: list[str], rows: list[list[str]], footer: str = "") -> None:
    rich_table = _optional("rich.table")
    if rich_table is not None:
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 220, highlight=False)
        table = rich_table.Table(title=title, show_lines=False, caption=footer or None, caption_justify="left")
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    cells = [[c.replace("\n", " ") for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    if footer:
        print(footer)


# ----------------------------------------------------------------------------- the benchmark


@dataclass
class Method:
    key: str
    col: str
    desc: str
    prep: Callable[[Case, str, torch.Tensor, torch.Tensor], Fn]
    cap_items: Optional[int] = None    # at most this many items (slot x kv x layer) per call
    cap_bytes: Optional[int] = None    # at most this many bytes per call
    check: bool = True
    skip: Optional[str] = None         # reason it does not run here


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.perf_counter()
        self.cuda = args.device == "cuda"
        self.device = pd.Device("cuda", torch.cuda.current_device()) if self.cuda else pd.Device("emulated", 0)
        self.tdev = self.device.torch_device
        self.ext = extension()
        self.notes: list[str] = []
        self.results: list[dict[str, Any]] = []
        self.gen = torch.Generator().manual_seed(args.seed)
        torch.manual_seed(args.seed)
        self.stream: Any = torch.cuda.Stream(self.tdev) if self.cuda else None
        if self.cuda:
            self.ev0 = torch.cuda.Event(enable_timing=True)
            self.ev1 = torch.cuda.Event(enable_timing=True)
        params = inspect.signature(pd.transfer_kv_all_layer).parameters
        self.api_params = set(params)
        mc = params.get("max_ctas")
        self.default_max_ctas: Any = getattr(pd_kernels, "DEFAULT_MAX_CTAS",
                                             mc.default if mc is not None and mc.default is not inspect.Parameter.empty
                                             else None)
        self.sms = torch.cuda.get_device_properties(self.tdev).multi_processor_count if self.cuda else None
        self.baselines: Any = None
        self.baseline_skip: Optional[str] = None
        if self.cuda:
            try:
                self.baselines = CupyBaselines(self.device.ordinal)
            except ImportError as exc:
                self.baseline_skip = f"cupy not importable ({exc}): (g) and (h) skipped"
            except Exception as exc:  # compile or driver problem
                self.baseline_skip = f"cupy kernels unavailable ({type(exc).__name__}: {exc}): (g) and (h) skipped"
        else:
            self.baseline_skip = "(g) and (h) are CUDA kernels: not run on CPU"

    # ---- small helpers

    def sync(self) -> None:
        if self.cuda:
            self.stream.synchronize()

    def time(self, fn: Fn, reps: int) -> float:
        """Seconds for ``reps`` back-to-back calls: CUDA events on the benchmark stream, else wall clock."""
        if self.cuda:
            self.sync()
            self.ev0.record(self.stream)
            for _ in range(reps):
                fn()
            self.ev1.record(self.stream)
            self.ev1.synchronize()
            return float(self.ev0.elapsed_time(self.ev1)) / 1e3
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return time.perf_counter() - t0

    def launch_kw(self, backend: Optional[str], max_ctas: Any = "default", validate: Optional[bool] = None) -> dict[str, Any]:
        """Keyword arguments for transfer_kv_all_layer, limited to what this build accepts."""
        kw: dict[str, Any] = {}
        if backend is not None:
            if "backend" not in self.api_params:
                raise Skip("transfer_kv_all_layer has no backend= argument in this build")
            kw["backend"] = backend
        if max_ctas != "default":
            if "max_ctas" not in self.api_params:
                raise Skip("transfer_kv_all_layer has no max_ctas= argument in this build")
            kw["max_ctas"] = max_ctas
        if validate is not None:
            if "validate_indices" not in self.api_params:
                raise Skip("transfer_kv_all_layer has no validate_indices= argument in this build")
            kw["validate_indices"] = validate
        return kw

    def poison(self, side: Side) -> None:
        """Random bytes over the whole pool (never zeros: a copy that did nothing shows).
        CUDA: fresh bytes from the GPU generator (through a scratch buffer for host memory).
        CPU: a window of a noise buffer generated once, at a random offset (random_ on CPU
        is ~100 MB/s; the sources were filled separately, so the poison never matches them)."""
        flat = side.flat
        n = flat.numel()
        if self.cuda and side.is_host:
            for off in range(0, n, self.scratch.numel()):
                m = min(self.scratch.numel(), n - off)
                self.scratch[:m].random_(0, 256)
                flat[off:off + m].copy_(self.scratch[:m], non_blocking=True)
        elif self.cuda:
            flat.random_(0, 256)
        else:
            off = int(torch.randint(0, NOISE_SLACK, (1,), generator=self.gen))
            flat.copy_(self.noise[off:off + n])
        self.sync()

    # ---- pools and cases

    def setup(self, configs: list[tuple[int, str]]) -> None:
        a = self.args
        self.pages: dict[tuple[int, str], int] = {}
        max_bytes = 0
        for item, attention in configs:
            page_bytes = self.page_bytes(item, attention)
            pages = max(8, math.ceil(a.gib * GiB / page_bytes))
            self.pages[(item, attention)] = pages
            max_bytes = max(max_bytes, pages * page_bytes)
        max_bytes = max(max_bytes, OVERHEAD_PAGES * self.page_bytes(1024, "mha"))
        self.max_bytes = max_bytes
        self.host_mem = pd.alloc_registered(max_bytes, self.device)
        self.host_flat = self.host_mem.tensor[:max_bytes]
        self.dev_flat = pd.device_empty((max_bytes,), torch.uint8, self.device)
        if self.cuda:
            self.scratch = torch.empty(min(max_bytes, 256 * MiB), dtype=torch.uint8, device=self.tdev)
            self.dev_flat.random_(0, 256)
            self.poison(Side("host", None, None, (), self.host_flat, True))
        else:
            self.dev_flat.random_(0, 256)
            self.host_flat.random_(0, 256)
            self.noise = torch.empty(max_bytes + NOISE_SLACK, dtype=torch.uint8).random_(0, 256)
        self.sync()

    def page_bytes(self, item: int, attention: str) -> int:
        return (1 if attention == "mla" else 2) * self.args.layers * self.args.page_size * item

    def build_case(self, item: int, attention: str, num_pages: int, moved_pages: int) -> Case:
        ps = self.args.page_size
        common = dict(num_layers=self.args.layers, num_pages=num_pages, page_size=ps, **model_shape(item, attention))
        dl = pd.KVLayout(kind="layer_first", **common)
        hl = pd.KVLayout(kind="page_first", **common)
        assert dl.item_bytes == item, (dl.item_bytes, item)
        nbytes = dl.nbytes
        entries = dl.num_kv * dl.num_layers  # per-layer K/V buffers, as DeviceKVPool has them
        per = nbytes // entries
        dflat = self.dev_flat[:nbytes]
        dtable = pd.make_kernel_ptr_table([dflat[i * per:(i + 1) * per] for i in range(entries)], self.device)
        hflat = self.host_flat[:nbytes]
        htable = pd.make_kernel_ptr_table([hflat], self.device)
        dev = Side("device", dl, dtable, dl.geometry(len(dtable), dtable.sizes, "device"), dflat, False)
        host = Side("host", hl, htable, hl.geometry(len(htable), htable.sizes, "host"), hflat, True)
        tok = torch.arange(ps, dtype=torch.int64)
        dp = torch.randperm(num_pages, generator=self.gen)[:moved_pages]
        hp = torch.randperm(num_pages, generator=self.gen)[:moved_pages]
        return Case(item, attention, dev, host, (dp[:, None] * ps + tok).reshape(-1), (hp[:, None] * ps + tok).reshape(-1))

    # ---- methods

    def methods(self) -> list[Method]:
        cuda = self.cuda
        ms: list[Method] = []
        ms.append(Method("a", "(a) bulk",
                         "bulk cudaMemcpyAsync of the same bytes: torch .copy_(non_blocking=True) between the registered "
                         "host pool and a CUDA tensor (the limit)" if cuda else
                         "contiguous torch copy (.copy_) of the same bytes (the limit)",
                         self.prep_bulk, check=False))
        if cuda:
            copy_runs = getattr(self.ext, "gpu_copy_runs", None)
            no_runs = None if copy_runs is not None else "pointerdomain._C.gpu_copy_runs is not in this build"
            no_batch = no_runs or (None if getattr(self.ext, "gpu_has_batch_copy", True) else
                                   "this build has no cudaMemcpyBatchAsync (CUDA < 12.8)")
            ms.append(Method("b", "(b) memcpy/item",
                             "one cudaMemcpyAsync per item (slot x kv x layer), device aliases from the tables "
                             "(_C.gpu_copy_runs, use_batch=False)",
                             lambda c, d, s, t: self.prep_runs(c, d, s, t, batch=False),
                             cap_items=self.args.memcpy_items, skip=no_runs))
            ms.append(Method("c", "(c) batch/item",
                             "cudaMemcpyBatchAsync on the same per-item list (_C.gpu_copy_runs, use_batch=True)",
                             lambda c, d, s, t: self.prep_runs(c, d, s, t, batch=True),
                             cap_items=self.args.batch_items, skip=no_batch))
        else:
            ms.append(Method("b", "(b) memcpy/item",
                             "one memcpy per item, same per-item address list as CUDA's (b) (_C.cpu_copy_runs)",
                             lambda c, d, s, t: self.prep_runs(c, d, s, t, batch=False),
                             cap_items=self.args.memcpy_items,
                             skip=None if hasattr(self.ext, "cpu_copy_runs") else "_C.cpu_copy_runs not in this build"))
        ms.append(Method("d", "(d) torch idx",
                         "torch indexing copy, all layers per statement: D2H host[:, d] = dev[:, :, s] "
                         "(gather on GPU, .to('cpu', non_blocking=True) into pinned memory, scatter on CPU); "
                         "H2D dev[:, :, d] = host[:, s].to(cuda, non_blocking=True)" if cuda else
                         "torch indexing copy on CPU tensors, all layers per statement: dst[:, d] = src[:, :, s]",
                         self.prep_index, cap_bytes=int(self.args.index_gib * GiB)))
        if cuda:
            budgets: list[tuple[str, Any]] = [("e2", 2), ("e4", 4), ("eall", None)]
            if self.default_max_ctas not in (2, 4, None):
                budgets.insert(0, ("e", self.default_max_ctas))
            for key, mc in budgets:
                col = f"(e) k@{mc}" if mc is not None else "(e) k@GPU"
                desc = (f"our kernel, transfer_kv_all_layer(backend='kernel', max_ctas={mc})"
                        + (" (whole GPU)" if mc is None else "")
                        + (" (the API default)" if mc == self.default_max_ctas else ""))
                ms.append(Method(key, col, desc, lambda c, d, s, t, mc=mc: self.prep_ours(c, d, s, t, "kernel", mc)))
        else:
            ms.append(Method("e", "(e) kernel", "our kernel, transfer_kv_all_layer(backend='kernel') (CPU threads: "
                             f"torch.get_num_threads() = {torch.get_num_threads()})",
                             lambda c, d, s, t: self.prep_ours(c, d, s, t, "kernel", "default")))
        ms.append(Method("f", "(f) auto", f"our auto path, transfer_kv_all_layer(backend='auto') at the default "
                         f"max_ctas ({self.default_max_ctas})",
                         lambda c, d, s, t: self.prep_ours(c, d, s, t, "auto", "default"),
                         skip=None if "backend" in self.api_params else "no backend= argument in this build"))
        if cuda:
            ms.append(Method("g", "(g) warp16 GPU", "simple kernel: one warp per item, 16-byte words, every item in "
                             "one launch (whole GPU); cupy.RawKernel", lambda c, d, s, t: self.prep_baseline(c, d, s, t, "g"),
                             skip=self.baseline_skip))
            ms.append(Method("h", "(h) 2CTA 8B", "common design: 8-byte words (ld.global.nc / st.global.cg), each warp "
                             "a contiguous share of the slots, 2 CTAs x 1024 threads; cupy.RawKernel",
                             lambda c, d, s, t: self.prep_baseline(c, d, s, t, "h"), skip=self.baseline_skip))
        wanted = self.args.methods
        if wanted != "all":
            keys = {k.strip() for k in wanted.split(",")}
            ms = [m for m in ms if m.key in keys or (m.key == "a")]  # (a) always: the ratios need it
        return ms

    def prep_bulk(self, case: Case, direction: str, s: torch.Tensor, d: torch.Tensor) -> Fn:
        nbytes = s.numel() * case.bytes_per_slot
        src, dst = case.ends(direction)
        a, b = src.flat[:nbytes], dst.flat[:nbytes]

        def run() -> None:
            b.copy_(a, non_blocking=True)

        return run

    def prep_runs(self, case: Case, direction: str, s: torch.Tensor, d: torch.Tensor, batch: bool) -> Fn:
        """Per-item (dst, src, size) lists, slot-major, from the tables' device aliases and the
        layouts' geometry: addr = table[entry] + offsets (the kernels' formula)."""
        src, dst = case.ends(direction)
        lo = src.layout
        kv = torch.arange(lo.num_kv, dtype=torch.int64).view(1, -1, 1)
        layer = torch.arange(lo.num_layers, dtype=torch.int64).view(1, 1, -1)

        def addresses(side: Side, slots: torch.Tensor) -> torch.Tensor:
            values = [alias.value for alias in side.table]  # DeviceAlias values: never a tensor's data_ptr()
            if max(values) >= 1 << 63:
                raise Skip("addresses >= 2**63 do not fit int64 tensors")
            g = side.geo
            base = torch.tensor(values, dtype=torch.int64)
            page, tok = (slots // lo.page_size).view(-1, 1, 1), (slots % lo.page_size).view(-1, 1, 1)
            entry = kv * g[0] + layer * g[1] + page * g[2]
            return (base[entry] + kv * g[3] + layer * g[4] + page * g[5] + tok * g[6]).reshape(-1).contiguous()

        srcs, dsts = addresses(src, s), addresses(dst, d)
        sizes = torch.full_like(srcs, lo.item_bytes)
        count = srcs.numel()
        ext = self.ext
        if not self.cuda:
            def run_cpu() -> None:
                ext.cpu_copy_runs(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), count)

            return run_cpu
        ordinal, stream = self.device.ordinal, int(self.stream.cuda_stream)

        def run() -> None:
            status = ext.gpu_copy_runs(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), count, ordinal, stream, batch)
            if status != 0:
                raise RuntimeError(f"gpu_copy_runs(use_batch={batch}) returned {status}: {ext.gpu_error_string(status)}")

        return run

    def prep_index(self, case: Case, direction: str, s: torch.Tensor, d: torch.Tensor) -> Fn:
        src, dst = case.ends(direction)
        sv, dv = src.view4(), dst.view4()
        si, di = s.to(sv.device), d.to(dv.device)
        if not self.cuda:
            if direction == "D2H":
                def run_cpu() -> None:
                    dv[:, di] = sv[:, :, si].transpose(1, 2)
            else:
                def run_cpu() -> None:
                    dv[:, :, di] = sv[:, si].transpose(1, 2)
            return run_cpu
        stream, tdev = self.stream, self.tdev
        if direction == "D2H":
            def run() -> None:
                items = sv[:, :, si].transpose(1, 2).contiguous()      # [kv, n, layers, item] on the GPU
                staged = items.to("cpu", non_blocking=True)             # torch stages into pinned memory
                stream.synchronize()                                    # the bytes must land before the CPU reads them
                dv[:, di] = staged
        else:
            def run() -> None:
                items = sv[:, si]                                       # CPU gather from the pinned pool
                dv[:, :, di] = items.to(tdev, non_blocking=True).transpose(1, 2)
        return run

    def prep_ours(self, case: Case, direction: str, s: torch.Tensor, d: torch.Tensor, backend: str, max_ctas: Any) -> Fn:
        src, dst = case.ends(direction)
        kw = self.launch_kw(backend, max_ctas)
        si, di = s.to(self.tdev), d.to(self.tdev)
        st, dt, sl, dl = src.table, dst.table, src.layout, dst.layout
        transfer = pd.transfer_kv_all_layer
        return lambda: transfer(st, dt, si, di, src_layout=sl, dst_layout=dl, **kw)

    def prep_baseline(self, case: Case, direction: str, s: torch.Tensor, d: torch.Tensor, which: str) -> Fn:
        src, dst = case.ends(direction)
        return self.baselines.prepare(which, src, dst, s.to(self.tdev), d.to(self.tdev), int(self.stream.cuda_stream))

    # ---- checks

    def full_check(self, case: Case, direction: str, m: Method) -> Optional[str]:
        """Poison dst, run once on the small pool, compare every byte of dst (and src) with a
        CPU torch reference."""
        src, dst = case.ends(direction)
        s, d = case.slots(direction)
        fn = m.prep(case, direction, s, d)
        self.poison(dst)
        src_before = src.flat.to("cpu").clone()
        poisoned = dst.flat.to("cpu").clone()
        fn()
        self.sync()
        after = dst.flat.to("cpu")
        expected = poisoned.clone()
        dst.scatter(d, src.gather(s, src_before), expected)
        if not torch.equal(after, expected):
            bad = (after != expected).nonzero()
            what = "; nothing was written" if torch.equal(after, poisoned) else ""
            return (f"small-pool check: {bad.numel()} of {after.numel()} destination bytes differ from the CPU "
                    f"reference (first at byte {int(bad[0, 0])}){what}")
        if not torch.equal(src.flat.to("cpu"), src_before):
            return "small-pool check: the source pool changed"
        return None

    def sample_check(self, case: Case, direction: str, s: torch.Tensor, d: torch.Tensor) -> Optional[str]:
        src, dst = case.ends(direction)
        k = max(8, SAMPLE_CHECK_BYTES[self.cuda] // case.bytes_per_slot)
        pick = torch.randperm(s.numel(), generator=self.gen)[:k]
        got = dst.gather(d[pick]).to("cpu")
        want = src.gather(s[pick]).to("cpu")
        if not torch.equal(got, want):
            bad = int((got != want).sum())
            return f"full-size check: {bad} bytes of {got.numel()} sampled destination bytes differ from the source"
        return None

    # ---- one cell

    def run_method(self, case: Case, check: Case, direction: str, m: Method) -> dict[str, Any]:
        a = self.args
        s_all, d_all = case.slots(direction)
        n = s_all.numel()
        n_sub = n
        per_slot_items = case.dev.layout.num_kv * case.dev.layout.num_layers
        if m.cap_items is not None:
            n_sub = min(n_sub, max(1, m.cap_items // per_slot_items))
        if m.cap_bytes is not None:
            n_sub = min(n_sub, max(1, m.cap_bytes // case.bytes_per_slot))
        if n_sub < n and n_sub >= a.page_size:
            n_sub -= n_sub % a.page_size  # whole pages
        s, d = s_all[:n_sub], d_all[:n_sub]
        rec: dict[str, Any] = dict(method=m.key, column=m.col, status="ok", bytes_per_call=n_sub * case.bytes_per_slot,
                                   items_per_call=n_sub * per_slot_items, capped=n_sub < n)
        if m.skip:
            rec.update(status="SKIP", note=m.skip)
            return rec
        try:
            if m.check:
                err = self.full_check(check, direction, m)
                if err:
                    rec.update(status="FAIL", note=err)
                    return rec
                rec["check"] = "small pool: all bytes vs CPU reference; full size: sampled items"
            fn = m.prep(case, direction, s, d)
            if m.check:
                self.poison(case.ends(direction)[1])
            warm = self.time(fn, 1)
            if m.check:
                err = self.sample_check(case, direction, s, d)
                if err:
                    rec.update(status="FAIL", note=err)
                    return rec
            reps = max(1, min(a.max_reps, math.ceil(a.min_trial_s / max(warm, 1e-9))))
            trials = [self.time(fn, reps) for _ in range(a.trials)]
            med = statistics.median(trials)
            rec.update(reps=reps, warmup_s=warm, trial_s=trials, gbps=rec["bytes_per_call"] * reps / med / 1e9)
        except Skip as exc:
            rec.update(status="SKIP", note=str(exc))
        except Exception as exc:
            rec.update(status="ERROR", note=f"{type(exc).__name__}: {exc}")
            traceback.print_exc(limit=4, file=sys.stderr)
            try:
                self.sync()
            except Exception:
                pass
        return rec

    # ---- main sweep

    def sweep(self, configs: list[tuple[int, str]], methods: list[Method], progress: Progress) -> None:
        for item, attention in configs:
            pages = self.pages[(item, attention)]
            case = self.build_case(item, attention, pages, pages)
            check_pages = min(pages, max(2, math.ceil(CHECK_POOL_BYTES[self.cuda] / self.page_bytes(item, attention))))
            check = self.build_case(item, attention, check_pages, max(1, check_pages // 2))
            for direction in DIRECTIONS:
                point = dict(direction=direction, item_bytes=item, attention=attention,
                             num_heads=case.dev.layout.num_heads, head_dim=case.dev.layout.head_dim,
                             num_layers=self.args.layers, page_size=self.args.page_size, num_pages=pages,
                             point_bytes=case.dev_slots.numel() * case.bytes_per_slot)
                bulk = None
                for m in methods:
                    rec = {**point, **self.run_method(case, check, direction, m)}
                    if m.key == "a" and rec["status"] == "ok":
                        bulk = rec["gbps"]
                    if rec.get("gbps") is not None and bulk:
                        rec["ratio"] = rec["gbps"] / bulk
                    self.results.append(rec)
                    shown = (f"{rec['gbps']:.2f} GB/s ({rec.get('ratio', 0):.2f}x)" if rec["status"] == "ok"
                             else f"{rec['status']} {rec.get('note', '')}")
                    progress.step(f"{direction} {fmt_size(item)} {attention} {m.col}: {shown}")
                self.save_json(partial=True)
            del case, check

    # ---- typed-layer overhead

    def host_us(self, fn: Fn, n: int, budget_s: float) -> tuple[float, int]:
        """Median host microseconds per call over up to ``n`` calls (stops after ``budget_s``)."""
        fn()
        fn()
        self.sync()
        times: list[int] = []
        deadline = time.perf_counter() + budget_s
        for i in range(n):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
            if self.cuda and i % 128 == 127:
                self.sync()  # keep the launch queue short (outside the timed calls)
            if len(times) >= 20 and time.perf_counter() > deadline:
                break
        self.sync()
        return statistics.median(times) / 1e3, len(times)

    def direct_call(self, src: Side, dst: Side, si: torch.Tensor, di: torch.Tensor, stream: Optional[int] = None) -> Fn:
        """The extension call transfer_kv_all_layer(backend='kernel') makes, with everything
        precomputed (mirrors pointerdomain.kernels._launch)."""
        ext, lo = self.ext, src.layout
        common = (src.table.kernel_table_address(), tuple(src.geo), dst.table.kernel_table_address(),
                  tuple(dst.geo), si.data_ptr(), di.data_ptr(), si.numel(), lo.page_size, lo.num_kv, 0,
                  lo.num_layers, lo.item_bytes)
        if not self.cuda:
            nthreads = torch.get_num_threads()
            return lambda: ext.cpu_transfer(*common, nthreads)
        mc = self.default_max_ctas
        vec_max = lo.vector_bytes(src.table.alignment, dst.table.alignment, *src.geo[3:7], *dst.geo[3:7])
        config = getattr(pd_kernels, "kernel_config", None)
        if config is not None:
            tail: tuple[int, ...] = (config(vec_max)[2],)
        else:
            tail = (vec_max,)
        st = int(self.stream.cuda_stream) if stream is None else stream
        ordinal, gpu_transfer, err = self.device.ordinal, ext.gpu_transfer, ext.gpu_error_string

        def call() -> None:
            status = gpu_transfer(*common, ordinal, st, mc or 0, *tail)
            if status != 0:
                raise RuntimeError(f"gpu_transfer returned {status}: {err(status)}")

        return call

    def overhead(self, progress: Progress) -> dict[str, Any]:
        """Microseconds per launch for a 1-slot, all-layer transfer (MHA, 1 KiB items)."""
        a = self.args
        out: dict[str, Any] = dict(transfer="1 slot, all layers, H2D (host page_first -> device layer_first), "
                                   f"MHA 1 KiB items, {a.layers} layers", rows=[], graph=[], notes=[])
        case = self.build_case(1024, "mha", OVERHEAD_PAGES, OVERHEAD_PAGES)
        src, dst = case.ends("H2D")
        si = case.host_slots[3:4].to(self.tdev)
        di = case.dev_slots[5:6].to(self.tdev)
        transfer = pd.transfer_kv_all_layer

        def public(**kw: Any) -> Fn:
            return lambda: transfer(src.table, dst.table, si, di, src_layout=src.layout, dst_layout=dst.layout, **kw)

        def verify(fn: Fn, what: str) -> None:
            self.poison(dst)
            fn()
            self.sync()
            err = self.sample_check(case, "H2D", si.cpu(), di.cpu())
            if err:
                raise RuntimeError(f"{what}: wrong bytes ({err})")

        rows: list[tuple[str, Optional[Callable[[], Fn]]]] = [
            ("direct extension call (_C.gpu_transfer)" if self.cuda else "direct extension call (_C.cpu_transfer)",
             lambda: self.direct_call(src, dst, si, di)),
        ]
        for backend in ("kernel", "auto"):
            for validate in (True, False):
                label = f"public API, backend='{backend}'" + ("" if validate else ", validate_indices=False")
                rows.append((label, lambda b=backend, v=validate: public(**self.launch_kw(b, "default", v))))
        direct_us = None
        for label, make in rows:
            row: dict[str, Any] = dict(call=label)
            try:
                assert make is not None
                fn = make()
                verify(fn, label)
                us, n = self.host_us(fn, a.launches, a.overhead_budget_s)
                row.update(host_us=us, launches=n)
                if direct_us is None and label.startswith("direct"):
                    direct_us = us
                elif direct_us is not None:
                    row["overhead_us"] = us - direct_us
                if self.cuda:
                    reps = min(200, a.launches)
                    row["stream_us"] = self.time(fn, reps) / reps * 1e6
            except Skip as exc:
                row.update(status="SKIP", note=str(exc))
            except Exception as exc:
                row.update(status="ERROR", note=f"{type(exc).__name__}: {exc}")
                traceback.print_exc(limit=4, file=sys.stderr)
            out["rows"].append(row)
            progress.step(f"overhead: {label}: " + (f"{row['host_us']:.2f} us" if "host_us" in row else row.get("note", "")))
        if self.cuda:
            out["graph"] = self.graph_replay(public, src, dst, si, di, verify)
            progress.step("overhead: CUDA graph replay")
        return out

    def graph_replay(self, public: Callable[..., Fn], src: Side, dst: Side, si: torch.Tensor, di: torch.Tensor,
                     verify: Callable[[Fn, str], None]) -> list[dict[str, Any]]:
        a = self.args
        rows: list[dict[str, Any]] = []
        makers: list[tuple[str, Callable[[], Fn]]] = [
            ("graph replay of the direct extension call", lambda: self.direct_call(src, dst, si, di)),
            ("graph replay of the public API call (backend='kernel')", lambda: public(**self.launch_kw("kernel"))),
        ]
        direct_us = None
        for label, make in makers:
            row: dict[str, Any] = dict(call=label)
            try:
                fn = make()
                fn()
                self.sync()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self.stream):
                    fn()  # captured on self.stream; the public call picks it up as the current stream
                self.sync()
                replay = graph.replay
                verify(replay, label)
                us, n = self.host_us(replay, a.launches, a.overhead_budget_s)
                reps = min(1000, a.launches)
                gpu_us = self.time(replay, reps) / reps * 1e6
                row.update(host_us=us, launches=n, replay_stream_us=gpu_us)
                if direct_us is None:
                    direct_us = gpu_us
                else:
                    row["overhead_us"] = gpu_us - direct_us
                row["_graph"] = graph  # dropped before JSON; keeps the graph alive until the end
            except Skip as exc:
                row.update(status="SKIP", note=str(exc))
            except Exception as exc:
                row.update(status="ERROR", note=f"{type(exc).__name__}: {exc}")
                traceback.print_exc(limit=4, file=sys.stderr)
            rows.append(row)
        for row in rows:
            row.pop("_graph", None)
        return rows

    # ---- checked mode

    def checked_cost(self, progress: Progress) -> dict[str, Any]:
        out: dict[str, Any] = dict(rows=[])
        checked = _optional("pointerdomain.checked")
        if checked is None or not hasattr(checked, "set_enabled") or not hasattr(checked, "enabled"):
            out["note"] = "pointerdomain.checked.set_enabled not in this build: skipped"
            progress.step("checked mode: skipped")
            return out
        a = self.args
        shape = dict(num_layers=2, page_size=1, num_heads=1, head_dim=256, dtype="bfloat16")
        dl = pd.KVLayout(kind="layer_first", num_pages=16, **shape)
        out["transfer"] = ("1 slot D2H, backend='kernel', into a chunked HostKVPool (page_first, 2 layers, page_size 1, "
                           "512 B items; registered in 2 chunks, so one kernel-table entry per page and K/V)")
        pool = pd.DeviceKVPool(dl, self.device)
        previous = bool(checked.enabled())
        try:
            kw = self.launch_kw("kernel")
        except Skip:
            kw = {}
        for pages in a.checked_pages:
            hl = pd.KVLayout(kind="page_first", num_pages=pages, **shape)
            row: dict[str, Any] = dict(host_pages=pages)
            try:
                with pd.HostKVPool(hl, self.device, max_chunk_bytes=max(hl.page_block_bytes(), hl.nbytes // 2)) as host:
                    entries = len(host.kernel_table) + len(pool.table)
                    si = torch.tensor([1], dtype=torch.int64, device=self.tdev)
                    di = torch.tensor([pages - 1], dtype=torch.int64, device=self.tdev)
                    table = host.kernel_table

                    def fn() -> None:
                        pd.transfer_kv_all_layer(pool.table, table, si, di, src_layout=dl, dst_layout=hl, **kw)

                    checked.set_enabled(False)
                    off, n_off = self.host_us(fn, a.launches, a.overhead_budget_s)
                    checked.set_enabled(True)
                    on, n_on = self.host_us(fn, a.launches, a.overhead_budget_s)
                    row.update(table_entries=entries, off_us=off, on_us=on, cost_us=on - off, launches_off=n_off,
                               launches_on=n_on)
            except Exception as exc:
                row.update(status="ERROR", note=f"{type(exc).__name__}: {exc}")
                traceback.print_exc(limit=4, file=sys.stderr)
            finally:
                checked.set_enabled(previous)
            out["rows"].append(row)
            progress.step(f"checked mode: {pages} pages: " + (f"+{row['cost_us']:.1f} us" if "cost_us" in row else row.get("note", "")))
        ok = [r for r in out["rows"] if "cost_us" in r]
        if len(ok) >= 2 and ok[-1]["table_entries"] != ok[0]["table_entries"]:
            out["per_1k_entries_us"] = ((ok[-1]["cost_us"] - ok[0]["cost_us"])
                                        / ((ok[-1]["table_entries"] - ok[0]["table_entries"]) / 1000))
        return out

    # ---- reporting

    def cell(self, rec: Optional[dict[str, Any]]) -> str:
        if rec is None:
            return ""
        if rec["status"] != "ok":
            return {"SKIP": "-", "FAIL": "FAIL", "ERROR": "ERROR"}.get(rec["status"], rec["status"])
        g = rec["gbps"]
        text = f"{g:.2f}" if g < 10 else f"{g:.1f}"
        if rec.get("capped"):
            text += "*"
        ratio = rec.get("ratio")
        return f"{text}\n{ratio:.2f}x" if ratio is not None else text

    def report(self, configs: list[tuple[int, str]], methods: list[Method]) -> None:
        shown = [m for m in methods if not m.skip]
        for direction in DIRECTIONS:
            rows = []
            for item, attention in configs:
                row = [f"{fmt_size(item)} {attention.upper()}"]
                for m in shown:
                    rec = next((r for r in self.results if r["direction"] == direction and r["item_bytes"] == item
                                and r["attention"] == attention and r["method"] == m.key), None)
                    row.append(self.cell(rec))
                rows.append(row)
            footer = ("GB/s (1e9 B/s) over ratio to (a). * measured on a capped part of the pool (bytes per call "
                      "in the JSON); FAIL: wrong bytes, not timed; - : skipped (see notes)")
            print_table(f"{DIRECTION_TEXT[direction]} - {self.device_name()}", ["item"] + [m.col for m in shown],
                        rows, footer)
        print("\nColumns:")
        for m in methods:
            print(f"  {m.col:<16} {m.desc}" + (f"  [skipped: {m.skip}]" if m.skip else ""))
            if m.cap_items is not None or m.cap_bytes is not None:
                cap = (f"{m.cap_items} items" if m.cap_items is not None else fmt_bytes(m.cap_bytes or 0))
                print(f"  {'':<16} capped at {cap} per call (time budget); the rest of the row moves the whole pool")
        fails = [r for r in self.results if r["status"] in ("FAIL", "ERROR")]
        for r in fails:
            print(f"  {r['status']}: {r['direction']} {fmt_size(r['item_bytes'])} {r['attention']} {r['column']}: "
                  f"{r.get('note', '')}")

    def report_overhead(self, ov: dict[str, Any]) -> None:
        rows = []
        for r in ov.get("rows", []) + ov.get("graph", []):
            if "host_us" not in r:
                row = [r["call"], r.get("status", ""), "", r.get("note", "")[:70]]
            else:
                stream = r.get("replay_stream_us", r.get("stream_us"))
                row = [r["call"], f"{r['host_us']:.2f}", f"{r['overhead_us']:+.2f}" if "overhead_us" in r else "",
                       str(r["launches"])]
                if self.cuda:
                    row.insert(3, f"{stream:.2f}" if stream is not None else "")
            if self.cuda and len(row) == 4 and "host_us" not in r:
                row.insert(3, "")
            rows.append(row)
        header = ["call", "host us/call (median)", "vs direct (us)", "launches"]
        footer = "host us: wall time of one Python call (median); vs direct: minus the direct extension call"
        if self.cuda:
            header.insert(3, "stream us/launch")
            footer += ("; stream us: CUDA-event time per launch over back-to-back launches (graph rows: per replay; "
                       "their 'vs direct' compares replay stream times)")
        print(f"\nTyped-layer overhead: {ov.get('transfer', '')}")
        print_table("Typed-layer overhead per launch", header, rows, footer)

    def report_checked(self, ck: dict[str, Any]) -> None:
        if not ck.get("rows"):
            print(f"\nChecked mode: {ck.get('note', 'not measured')}")
            return
        rows = []
        for r in ck["rows"]:
            if "cost_us" in r:
                rows.append([str(r["host_pages"]), str(r["table_entries"]), f"{r['off_us']:.1f}", f"{r['on_us']:.1f}",
                             f"{r['cost_us']:+.1f}"])
            else:
                rows.append([str(r["host_pages"]), "", "", "", r.get("note", "")[:60]])
        per = ck.get("per_1k_entries_us")
        print(f"\nChecked mode: {ck.get('transfer', '')}")
        print_table("Checked mode cost per launch",
                    ["host pages", "table entries", "off us", "on us", "cost us"], rows,
                    f"cost per 1k table entries: {per:.1f} us" if per is not None else "")

    def targets(self) -> list[dict[str, Any]]:
        """The issue's targets against this run's numbers (CUDA) or the CPU target."""
        out: list[dict[str, Any]] = []

        def ratio(direction: str, item: int, attention: str, key: str) -> Optional[float]:
            rec = next((r for r in self.results if r["direction"] == direction and r["item_bytes"] == item
                        and r["attention"] == attention and r["method"] == key and r["status"] == "ok"), None)
            return rec.get("ratio") if rec else None

        items = sorted({(r["item_bytes"], r["attention"]) for r in self.results})
        if self.cuda:
            goals = [("whole GPU", "eall", 0.90, [c for c in items if c[0] >= 1024]),
                     ("4 CTAs", "e4", 0.85, [c for c in items if c in ((1024, "mha"), (2048, "mha"))]),
                     ("2 CTAs", "e2", 0.60, [c for c in items if c in ((1024, "mha"), (2048, "mha"))])]
        else:
            goals = [("CPU kernel", "e", 0.50, [c for c in items if c == (1024, "mha")])]
        for name, key, goal, cases in goals:
            for item, attention in cases:
                for direction in DIRECTIONS:
                    r = ratio(direction, item, attention, key)
                    out.append(dict(target=f"{name} >= {goal:.2f}x (a)", direction=direction, item_bytes=item,
                                    attention=attention, ratio=r, met=None if r is None else r >= goal))
        return out

    def report_targets(self, targets: list[dict[str, Any]], ov: dict[str, Any]) -> None:
        rows = [[t["target"], f"{fmt_size(t['item_bytes'])} {t['attention'].upper()}", t["direction"],
                 "" if t["ratio"] is None else f"{t['ratio']:.2f}x",
                 "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")] for t in targets]
        for r in ov.get("rows", []):
            if "overhead_us" in r and r["call"].startswith("public"):
                rows.append([f"typed overhead <= 5 us: {r['call']}", "", "", f"{r['overhead_us']:+.2f} us",
                             "met" if r["overhead_us"] <= 5 else "MISSED"])
        for r in ov.get("graph", []):
            if "overhead_us" in r:
                rows.append([f"zero at graph replay: {r['call']}", "", "", f"{r['overhead_us']:+.2f} us",
                             "met" if abs(r["overhead_us"]) <= 0.5 else "MISSED"])
        print_table("Targets (issue 3, item 5)", ["target", "item", "dir", "measured", "verdict"], rows,
                    "graph replay 'zero' means within 0.5 us of the direct graph's replay")

    def device_name(self) -> str:
        if self.cuda:
            return f"{torch.cuda.get_device_name(self.tdev)} ({self.sms} SMs)"
        return f"CPU, emulated device ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

    def save_json(self, partial: bool = False, extra: Optional[dict[str, Any]] = None) -> str:
        a = self.args
        os.makedirs(a.out, exist_ok=True)
        doc: dict[str, Any] = dict(
            benchmark="pointerdomain KV page transfer", partial=partial,
            date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            command=[sys.executable] + sys.argv,
            device=dict(kind="cuda" if self.cuda else "cpu (emulated device)", name=self.device_name(), sms=self.sms,
                        cupy=getattr(self.baselines, "version", None),
                        batch_copy=bool(getattr(self.ext, "gpu_has_batch_copy", False)) if self.cuda else None),
            versions=dict(pointerdomain=getattr(pd, "__version__", "?"), torch=torch.__version__,
                          torch_cuda=torch.version.cuda, python=platform.python_version(), platform=platform.platform()),
            config=dict(gib_per_point=a.gib, item_sizes=a.sizes, mla=not a.no_mla, num_layers=a.layers,
                        page_size=a.page_size, trials=a.trials, min_trial_s=a.min_trial_s, quick=a.quick,
                        memcpy_items_cap=a.memcpy_items, batch_items_cap=a.batch_items, index_gib_cap=a.index_gib,
                        device_layout="layer_first (one table entry per K/V layer)",
                        host_layout="page_first (one table entry), registered host memory",
                        order="random permutation of whole pages on both sides, expanded to token slots",
                        default_max_ctas=self.default_max_ctas, seed=a.seed, cpu_threads=torch.get_num_threads(),
                        cpu_count=os.cpu_count(), load_average=_load()),
            methods={m.key: dict(column=m.col, description=m.desc, skipped=m.skip, cap_items=m.cap_items,
                                 cap_bytes=m.cap_bytes) for m in getattr(self, "method_list", [])},
            results=self.results, notes=self.notes, elapsed_s=time.perf_counter() - self.t_start,
        )
        if extra:
            doc.update(extra)
        path = os.path.join(a.out, "transfer.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(path + ".tmp", path)
        return path

    def plot(self, configs: list[tuple[int, str]], methods: list[Method]) -> Optional[str]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as exc:
            self.notes.append(f"matplotlib not importable ({exc}): no plot")
            return None
        sizes = sorted({c[0] for c in configs})
        fig, axes = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
        for ax, direction in zip(axes, DIRECTIONS):
            for m in methods:
                recs = [r for r in self.results if r["direction"] == direction and r["method"] == m.key
                        and r["status"] == "ok"]
                mha = sorted((r["item_bytes"], r["gbps"]) for r in recs if r["attention"] == "mha")
                if not recs:
                    continue
                color = None
                if mha:
                    xs, ys = zip(*mha)
                    (line,) = ax.plot(xs, ys, marker="o", markersize=4, label=m.col,
                                      linestyle="--" if m.key == "a" else "-", linewidth=2.2 if m.key == "a" else 1.4)
                    color = line.get_color()
                for r in recs:
                    if r["attention"] == "mla":
                        ax.plot([r["item_bytes"]], [r["gbps"]], marker="x", markersize=9, color=color,
                                linestyle="none", label=None if mha else m.col)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes)
            ax.set_xticklabels([("\n" if s == 1152 else "") + fmt_size(s) for s in sizes])  # 1152 B sits next to 1 KiB
            ax.set_xlabel("item bytes (one token-layer of K or V); x marks: MLA 1152 B")
            ax.set_title(DIRECTION_TEXT[direction])
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("GB/s (1e9 B/s)")
        axes[1].legend(fontsize=8, loc="lower right")
        fig.suptitle(f"pointerdomain KV transfer, all layers, page_first host <-> layer_first device, random pages - "
                     f"{self.device_name()}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(self.args.out, "transfer.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


# ----------------------------------------------------------------------------- entry point


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="KV page transfer benchmark (pointerdomain): GB/s per item size, direction and method.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Method keys for --methods: a (bulk, always run), b (memcpy per item), c (cudaMemcpyBatchAsync), "
               "d (torch indexing), e2 / e4 / eall (our kernel at max_ctas 2 / 4 / whole GPU; on CPU: e), "
               "f (auto), g (warp-per-item 16 B), h (common 2-CTA 8 B).")
    ap.add_argument("--out", default="bench-out", help="output directory for transfer.json / transfer.png")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cuda, or cpu (the emulated device); auto: cuda when available")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 4 MiB per point, page_size 4, 4 layers, 2 trials (CI; not a timing run)")
    ap.add_argument("--gib", type=float, default=None,
                    help="GiB moved per point by one launch (default: 1 on CUDA, 0.125 on CPU, 4 MiB with --quick)")
    ap.add_argument("--sizes", default=",".join(map(str, ITEM_SIZES)), help="item sizes in bytes, comma separated")
    ap.add_argument("--no-mla", action="store_true", help="skip the MLA (1152 B) rows")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 8; 4 with --quick)")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per page (default 16; 4 with --quick)")
    ap.add_argument("--trials", type=int, default=None, help="timed trials per cell, median reported (default 3)")
    ap.add_argument("--min-trial-s", type=float, default=None,
                    help="repeat launches within a trial until it lasts this long (default 0.02 s; 0.01 with --quick)")
    ap.add_argument("--max-reps", type=int, default=50, help="at most this many launches per trial")
    ap.add_argument("--methods", default="all", help="comma-separated method keys (see below), default all")
    ap.add_argument("--memcpy-items", type=int, default=65536,
                    help="cap on items per call for (b) (per-item memcpy is ~0.3 GB/s at 1 KiB)")
    ap.add_argument("--batch-items", type=int, default=262144, help="cap on items per call for (c)")
    ap.add_argument("--index-gib", type=float, default=0.25, help="cap on GiB per call for (d) torch indexing")
    ap.add_argument("--launches", type=int, default=2000, help="launches per overhead / checked-mode measurement")
    ap.add_argument("--overhead-budget-s", type=float, default=None,
                    help="stop an overhead measurement after this many seconds (default 2; 0.5 with --quick)")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-checked", action="store_true")
    ap.add_argument("--progress", choices=("auto", "tqdm", "rich", "plain", "none"), default="auto",
                    help="auto: tqdm (else rich) on a terminal, plain lines otherwise")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) first (the CPU kernel and torch copies use that many threads)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    q = args.quick
    if args.gib is None:
        args.gib = 4 / 1024 if q else (1.0 if args.device == "cuda" else 0.125)
    args.layers = args.layers or (4 if q else 8)
    args.page_size = args.page_size or (4 if q else 16)
    args.trials = args.trials or (2 if q else 3)
    args.min_trial_s = args.min_trial_s if args.min_trial_s is not None else (0.01 if q else 0.02)
    args.overhead_budget_s = args.overhead_budget_s if args.overhead_budget_s is not None else (0.5 if q else 2.0)
    if q:
        args.launches = min(args.launches, 500)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    for s in args.sizes:
        if s % 16:
            ap.error(f"item size {s}: must be a multiple of 16 bytes")
    args.checked_pages = (256, 2048) if q else (1024, 8192)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    load = _load()
    if load is not None and not bench.cuda and load > (os.cpu_count() or 1):
        bench.notes.append(f"load average {load:.1f} on {os.cpu_count()} CPUs when the run started: other work "
                           "competes for the cores, CPU timings are not reliable (multi-threaded torch copies "
                           "suffer most; --threads 1 is steadier)")
    configs = [(s, "mha") for s in args.sizes]
    if not args.no_mla and 1152 in args.sizes:
        configs.append((1152, "mla"))
    configs.sort(key=lambda c: (c[0], c[1] == "mla"))
    methods = bench.methods()
    bench.method_list = methods  # type: ignore[attr-defined]
    for m in methods:
        if m.skip:
            bench.notes.append(f"{m.col} skipped: {m.skip}")
    if bench.baseline_skip:
        bench.notes.append(bench.baseline_skip)
    steps = len(configs) * len(DIRECTIONS) * len(methods)
    steps += 0 if args.skip_overhead else (5 + (1 if bench.cuda else 0))
    steps += 0 if args.skip_checked else len(args.checked_pages)
    print(f"pointerdomain {getattr(pd, '__version__', '?')} transfer benchmark on {bench.device_name()}; "
          f"torch {torch.__version__}; {fmt_bytes(args.gib * GiB)} per point, {args.layers} layers, "
          f"page_size {args.page_size}, {args.trials} trials; default max_ctas {bench.default_max_ctas}",
          flush=True)
    progress = Progress(steps, args.progress)
    ov: dict[str, Any] = {}
    ck: dict[str, Any] = {}
    ctx = torch.cuda.stream(bench.stream) if bench.cuda else _nullcontext()
    try:
        with ctx:
            bench.setup(configs)
            bench.sweep(configs, methods, progress)
            if not args.skip_overhead:
                ov = bench.overhead(progress)
            if not args.skip_checked:
                ck = bench.checked_cost(progress)
            bench.sync()
    finally:
        progress.close()
    targets = bench.targets()
    bench.report(configs, methods)
    if ov:
        bench.report_overhead(ov)
    if ck:
        bench.report_checked(ck)
    bench.report_targets(targets, ov)
    cpu_summary = None
    if not bench.cuda:
        cpu_summary = cpu_report(bench)
    png = bench.plot(configs, methods)
    path = bench.save_json(extra=dict(overhead=ov, checked_mode=ck, targets=targets, cpu_summary=cpu_summary,
                                      plot=png))
    for note in bench.notes:
        print(f"note: {note}")
    print(f"wrote {path}" + (f" and {png}" if png else "") + f" in {time.perf_counter() - bench.t_start:.1f} s")
    bench.host_mem.close()
    bad = [r for r in bench.results if r["status"] in ("FAIL", "ERROR")]
    bad += [r for r in ov.get("rows", []) + ov.get("graph", []) + ck.get("rows", []) if r.get("status") == "ERROR"]
    if bad:
        print(f"{len(bad)} measurement(s) FAILED or raised an ERROR (see above): exit status 1")
    return 1 if bad else 0


def _load() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_report(bench: Bench) -> dict[str, Any]:
    """CPU path: our kernel and torch indexing against a contiguous copy of the same bytes."""
    out: dict[str, Any] = {}
    for direction in DIRECTIONS:
        def get(key: str) -> Optional[float]:
            rec = next((r for r in bench.results if r["direction"] == direction and r["item_bytes"] == 1024
                        and r["attention"] == "mha" and r["method"] == key and r["status"] == "ok"), None)
            return rec["gbps"] if rec else None

        contiguous, kernel, index = get("a"), get("e"), get("d")
        out[direction] = dict(contiguous_gbps=contiguous, kernel_gbps=kernel, torch_index_gbps=index,
                              kernel_ratio=kernel / contiguous if kernel and contiguous else None,
                              index_ratio=index / contiguous if index and contiguous else None)
        if contiguous:
            print(f"CPU path, 1 KiB items, {direction}: contiguous copy {contiguous:.2f} GB/s; our kernel "
                  + (f"{kernel:.2f} GB/s ({kernel / contiguous:.2f}x, target >= 0.5x)" if kernel else "n/a")
                  + "; torch indexing " + (f"{index:.2f} GB/s ({index / contiguous:.2f}x)" if index else "n/a"))
    return out


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
