"""Pools, cases, and the measurement of one cell: poison, run, check byte for byte, time.

A *case* is a device pool (``layer_first``, one table entry per K/V layer buffer, as
engines hold them) and a host pool (registered memory, one table entry, layout
``--host-layout``) of one model shape, and the token slots moved between them: every
page of the pools, in random order on both sides. A *cell* is one method on one case in
one direction. Every cell except the bulk copy is checked before it is timed: the
destination is poisoned with random bytes, the method runs once on a small case and the
whole destination is compared with a torch reference (moved items equal the source,
everything else still poison, source unchanged); then it runs on the full-size case and
every moved item is compared (CUDA: on the GPU; CPU: a sample of ``SAMPLE_CHECK_BYTES``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch

from benchmarks.transfer import methods, report
from benchmarks.transfer.common import (CHECK_POOL_BYTES, DIRECTIONS, GiB, ITEM_SIZES, MiB, NOISE_SLACK,
                                        SAMPLE_CHECK_BYTES, Case, Side, Skip, fmt_bytes, fmt_size, load_average,
                                        model_shape, optional, pd)

__all__ = ["Bench", "Case", "Side", "main", "parse_args"]

Fn = Callable[[], None]


# ----------------------------------------------------------------------------- progress


class Progress:
    def __init__(self, total: int, mode: str) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        if mode == "auto":
            mode = "tqdm" if sys.stderr.isatty() and optional("tqdm") is not None else "plain"
        self.mode = mode
        if mode == "tqdm":
            import tqdm

            self.bar = tqdm.tqdm(total=total, unit="cell", file=sys.stderr, dynamic_ncols=True)

    def step(self, text: str, advance: int = 1) -> None:
        self.done += advance
        if self.mode == "tqdm":
            self.bar.set_description_str(text[:60], refresh=False)
            self.bar.update(advance)
        elif self.mode == "plain":
            print(f"[{self.done:>3}/{self.total} {time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.mode == "tqdm":
            self.bar.close()


# ----------------------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.perf_counter()
        self.cuda = args.device == "cuda"
        self.device = pd.Device("cuda", torch.cuda.current_device()) if self.cuda else pd.Device("emulated", 0)
        self.tdev = self.device.torch_device
        self.notes: list[str] = []
        self.results: list[dict[str, Any]] = []
        self.gen = torch.Generator().manual_seed(args.seed)
        torch.manual_seed(args.seed)
        self.stream: Any = torch.cuda.Stream(self.tdev) if self.cuda else None
        if self.cuda:
            self.ev0 = torch.cuda.Event(enable_timing=True)
            self.ev1 = torch.cuda.Event(enable_timing=True)
        self.sms: Optional[int] = torch.cuda.get_device_properties(self.tdev).multi_processor_count if self.cuda else None
        self.methods = methods.build(self)

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

    def poison(self, side: Side) -> None:
        """Random bytes over the whole pool (never zeros: a copy that did nothing shows)."""
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

    def hugepage_registered(self, nbytes: int) -> Any:
        """Host pool on 2 MiB-aligned anonymous memory advised MADV_HUGEPAGE, registered
        with the public register_host_tensor (compares how the host pages are backed)."""
        import mmap

        huge = 2 * MiB
        size = -(-nbytes // huge) * huge
        self._mm = mmap.mmap(-1, size + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        skip = -whole.data_ptr() % huge
        if hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            self._mm.madvise(mmap.MADV_HUGEPAGE, skip, size)
        else:
            self.notes.append("mmap.madvise(MADV_HUGEPAGE) not available: --host-alloc hugepage is plain mmap")
        tensor = whole[skip:skip + size]
        tensor.fill_(1)  # fault the pages in (as huge pages where the kernel grants them)
        return pd.register_host_tensor(tensor, self.device)

    def page_bytes(self, item: int, attention: str) -> int:
        return (1 if attention == "mla" else 2) * self.args.layers * self.args.page_size * item

    def setup(self, configs: list[tuple[int, str]]) -> None:
        a = self.args
        self.pages: dict[tuple[int, str], int] = {}
        max_bytes = 0
        for item, attention in configs:
            page_bytes = self.page_bytes(item, attention)
            pages = max(8, math.ceil(a.gib * GiB / page_bytes))
            self.pages[(item, attention)] = pages
            max_bytes = max(max_bytes, pages * page_bytes)
        self.max_bytes = max_bytes
        if a.host_alloc == "hugepage":
            self.host_mem = self.hugepage_registered(max_bytes)
        else:
            self.host_mem = pd.alloc_registered(max_bytes, self.device)
        self.host_flat = self.host_mem.tensor[:max_bytes]
        self.dev_flat = pd.device_empty((max_bytes,), torch.uint8, self.device)
        self.dev_flat.random_(0, 256)
        if self.cuda:
            self.scratch = torch.empty(min(max_bytes, 256 * MiB), dtype=torch.uint8, device=self.tdev)
            self.check_a = torch.empty(max_bytes, dtype=torch.uint8, device=self.tdev)  # device copies for checks
            self.check_b = torch.empty(max_bytes, dtype=torch.uint8, device=self.tdev)
            self.poison(Side("host", None, None, self.host_flat, True))
        else:
            self.host_flat.random_(0, 256)
            self.noise = torch.empty(max_bytes + NOISE_SLACK, dtype=torch.uint8).random_(0, 256)
        self.sync()

    def build_case(self, item: int, attention: str, num_pages: int, moved_pages: int) -> Case:
        ps = self.args.page_size
        common = dict(num_layers=self.args.layers, num_pages=num_pages, page_size=ps, **model_shape(item, attention))
        dl = pd.KVLayout(kind="layer_first", **common)
        hl = pd.KVLayout(kind=self.args.host_layout, **common)
        nbytes = dl.nbytes
        entries = dl.num_kv * dl.num_layers  # per-layer K/V buffers, as DeviceKVPool has them
        per = nbytes // entries
        dflat = self.dev_flat[:nbytes]
        dtable = pd.make_kernel_ptr_table([dflat[i * per:(i + 1) * per] for i in range(entries)], self.device)
        hflat = self.host_flat[:nbytes]
        htable = pd.make_kernel_ptr_table([hflat], self.device)
        dev = Side("device", dl, dtable, dflat, False)
        host = Side("host", hl, htable, hflat, True)
        tok = torch.arange(ps, dtype=torch.int64)
        dp = torch.randperm(num_pages, generator=self.gen)[:moved_pages]
        hp = torch.randperm(num_pages, generator=self.gen)[:moved_pages]
        return Case(item, attention, dev, host, (dp[:, None] * ps + tok).reshape(-1),
                    (hp[:, None] * ps + tok).reshape(-1))

    # ---- checks

    def full_check(self, case: Case, direction: str, m: Any) -> Optional[str]:
        """Poison dst, run once on the small case, compare every byte of dst (and src) with
        the torch reference."""
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
            return (f"small-case check: {bad.numel()} of {after.numel()} destination bytes differ from the torch "
                    f"reference (first at byte {int(bad[0, 0])}){what}")
        if not torch.equal(src.flat.to("cpu"), src_before):
            return "small-case check: the source pool changed"
        return None

    def moved_check(self, case: Case, direction: str, s: torch.Tensor, d: torch.Tensor) -> Optional[str]:
        """Every moved item of the full-size run (CUDA: compared on the GPU in chunks; CPU: a sample)."""
        src, dst = case.ends(direction)
        if self.cuda:
            # host pools are copied to the GPU first (one bulk copy), then compared there
            flats = []
            for side, scratch in ((src, self.check_a), (dst, self.check_b)):
                if side.is_host:
                    scratch[:side.flat.numel()].copy_(side.flat, non_blocking=True)
                    flats.append(scratch[:side.flat.numel()])
                else:
                    flats.append(side.flat)
            step = max(1, (128 * MiB) // case.bytes_per_slot)
            for b in range(0, s.numel(), step):
                got = dst.gather(d[b:b + step], flats[1])
                want = src.gather(s[b:b + step], flats[0])
                if not torch.equal(got, want):
                    bad = int((got != want).sum())
                    return f"full-size check: {bad} bytes of slots [{b}, {b + step}) differ from the source"
            self.sync()
            return None
        k = max(8, SAMPLE_CHECK_BYTES // case.bytes_per_slot)
        pick = torch.randperm(s.numel(), generator=self.gen)[:k]
        if not torch.equal(dst.gather(d[pick]), src.gather(s[pick])):
            return "full-size check: sampled destination items differ from the source"
        return None

    # ---- one cell

    def run_method(self, case: Case, check: Case, direction: str, m: Any) -> dict[str, Any]:
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
        rec: dict[str, Any] = dict(method=m.key, column=m.col, mode=m.mode, ctas=m.ctas, status="ok",
                                   bytes_per_call=n_sub * case.bytes_per_slot, items_per_call=n_sub * per_slot_items,
                                   capped=n_sub < n)
        if m.skip:
            rec.update(status="SKIP", note=m.skip)
            return rec
        try:
            if m.check:
                err = self.full_check(check, direction, m)
                if err:
                    rec.update(status="FAIL", note=err)
                    return rec
            fn = m.prep(case, direction, s, d)
            if m.check:
                self.poison(case.ends(direction)[1])
            warm = self.time(fn, 1)
            if m.check:
                err = self.moved_check(case, direction, s, d)
                if err:
                    rec.update(status="FAIL", note=err)
                    return rec
                rec["check"] = ("small case: every byte vs torch reference; full size: every moved item" if self.cuda
                                else "small case: every byte vs torch reference; full size: sampled items")
            reps = max(1, min(a.max_reps, math.ceil(a.min_trial_s / max(warm, 1e-9))))
            trials = [self.time(fn, reps) for _ in range(a.trials)]
            med = statistics.median(trials)
            per_call = med / reps
            rec.update(reps=reps, warmup_s=warm, trial_s=trials, s_per_call=per_call,
                       gbps=rec["bytes_per_call"] / per_call / 1e9)
            sm = m.sm_count(self)
            if sm is not None:
                rec["sm_ms_per_gib"] = sm * per_call * 1e3 / (rec["bytes_per_call"] / GiB)
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

    def sweep(self, configs: list[tuple[int, str]], progress: Progress) -> None:
        for item, attention in configs:
            pages = self.pages[(item, attention)]
            case = self.build_case(item, attention, pages, pages)
            check_pages = min(pages, max(2, math.ceil(CHECK_POOL_BYTES[self.cuda] / self.page_bytes(item, attention))))
            check = self.build_case(item, attention, check_pages, max(1, check_pages // 2))
            for direction in DIRECTIONS:
                point = dict(direction=direction, item_bytes=item, attention=attention,
                             num_heads=case.dev.layout.num_heads, head_dim=case.dev.layout.head_dim,
                             num_layers=self.args.layers, page_size=self.args.page_size, num_pages=pages,
                             host_layout=self.args.host_layout,
                             point_bytes=case.dev_slots.numel() * case.bytes_per_slot)
                bulk = None
                for m in self.methods:
                    rec = {**point, **self.run_method(case, check, direction, m)}
                    if m.key == "a" and rec["status"] == "ok":
                        bulk = rec["gbps"]
                    if rec.get("gbps") is not None and bulk:
                        rec["ratio"] = rec["gbps"] / bulk
                    self.results.append(rec)
                    shown = (f"{rec['gbps']:.2f} GB/s ({rec.get('ratio', 0):.3f}x)" if rec["status"] == "ok"
                             else f"{rec['status']} {rec.get('note', '')}")
                    progress.step(f"{direction} {fmt_size(item)} {attention} {m.col}: {shown}")
                report.save_json(self, partial=True)
            del case, check

    # ---- launch cost through the public API

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

    def overhead(self, progress: Progress) -> dict[str, Any]:
        """Host microseconds per public call for a 1-slot, all-layer H2D transfer (MHA 1 KiB),
        with and without the host-side index check, and CUDA-graph replay of the call."""
        a = self.args
        out: dict[str, Any] = dict(transfer=f"1 slot, all layers, H2D, MHA 1 KiB items, {a.layers} layers",
                                   rows=[], graph=[])
        case = self.build_case(1024, "mha", 16, 16)
        src, dst = case.ends("H2D")
        si = case.host_slots[3:4].to(self.tdev)
        di = case.dev_slots[5:6].to(self.tdev)

        def public(**kw: Any) -> Fn:
            return lambda: pd.transfer_kv_all_layer(src.table, dst.table, si, di, src_layout=src.layout,
                                                    dst_layout=dst.layout, **kw)

        def verify(fn: Fn, what: str) -> None:
            self.poison(dst)
            fn()
            self.sync()
            err = self.moved_check(case, "H2D", si.cpu(), di.cpu())
            if err:
                raise RuntimeError(f"{what}: wrong bytes ({err})")

        # Baseline: the platform layer's launch of the same plan, no checks at all (what the
        # public call costs over it is the typed layer's overhead; target <= 5 us).
        from pointerdomain._platform import LaunchArgs
        from pointerdomain.transfer.plan import plan_for

        plan = plan_for(src.table, src.layout, dst.table, dst.layout)
        stream = int(self.stream.cuda_stream) if self.cuda else 0

        args = LaunchArgs(si.data_ptr(), di.data_ptr(), si.numel(), 0, src.layout.num_layers, plan.device, stream, 2)

        def direct() -> None:
            plan.platform.launch(plan.unchecked or plan.kernel, args)

        calls: list[tuple[str, Callable[[], Fn]]] = [("platform launch (no checks), max_ctas=2", lambda: direct)]
        for backend in ("kernel", "auto"):
            for validate in (True, "host", False):
                calls.append((f"backend='{backend}', validate_indices={validate!r}",
                              lambda b=backend, v=validate: public(backend=b, validate_indices=v, max_ctas=2)))
        for label, make in calls:
            row: dict[str, Any] = dict(call=label)
            try:
                fn = make()
                verify(fn, label)
                us, n = self.host_us(fn, a.launches, a.overhead_budget_s)
                row.update(host_us=us, launches=n)
                if self.cuda:
                    reps = min(200, a.launches)
                    row["stream_us"] = self.time(fn, reps) / reps * 1e6
            except Exception as exc:
                row.update(status="ERROR", note=f"{type(exc).__name__}: {exc}")
                traceback.print_exc(limit=4, file=sys.stderr)
            out["rows"].append(row)
            progress.step(f"launch cost: {label}: " + (f"{row['host_us']:.2f} us" if "host_us" in row
                                                        else row.get("note", "")))
        if self.cuda:
            row = dict(call="CUDA graph replay of backend='kernel', validate_indices=False")
            try:
                fn = public(backend="kernel", validate_indices=False)
                fn()
                self.sync()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self.stream):
                    fn()
                self.sync()
                verify(graph.replay, row["call"])
                us, n = self.host_us(graph.replay, a.launches, a.overhead_budget_s)
                reps = min(1000, a.launches)
                row.update(host_us=us, launches=n, stream_us=self.time(graph.replay, reps) / reps * 1e6)
                del graph
            except Exception as exc:
                row.update(status="ERROR", note=f"{type(exc).__name__}: {exc}")
                traceback.print_exc(limit=4, file=sys.stderr)
            out["graph"].append(row)
            progress.step("launch cost: CUDA graph replay")
        return out


# ----------------------------------------------------------------------------- entry point


def default_out() -> str:
    """Results go outside the checkout by default."""
    return os.path.join(tempfile.gettempdir(), "pointerdomain-bench")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.transfer",
        description="KV page transfer benchmark (pointerdomain): GB/s per item size, direction, method and CTA budget.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Method keys for --methods: a (bulk, always run), b (memcpy per item), c (library copy engine), "
               "d (torch indexing), e1 e2 e4 e8 eall (our kernel, all layers, at that CTA budget / whole GPU), "
               "p1 p2 p4 p8 pall (the same, one launch per layer), f (auto), s / sh (staged path at 2 CTAs, CUDA / "
               "CPU index tensors), g (warp-per-item kernel), "
               "h (imitation of a common 2-CTA design); on CPU: e (our CPU kernel), p (per layer).")
    ap.add_argument("--out", default=default_out(), help="output directory for transfer.json / transfer.png "
                    "(default: %(default)s, outside the checkout)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cuda, or cpu (the emulated device); auto: cuda when available")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 4 MiB per point, page_size 4, 4 layers, 2 trials, 1 CPU thread; no target "
                         "verdicts (CI; not a timing run)")
    ap.add_argument("--gib", type=float, default=None,
                    help="GiB moved per point by one call (default: 1 on CUDA, 0.125 on CPU, 4 MiB with --quick)")
    ap.add_argument("--sizes", default=",".join(map(str, ITEM_SIZES)), help="item sizes in bytes, comma separated")
    ap.add_argument("--no-mla", action="store_true", help="skip the MLA (1152 B) rows")
    ap.add_argument("--host-layout", choices=("page_first", "page_first_direct", "layer_first"),
                    default="page_first", help="layout of the registered host pool (default %(default)s)")
    ap.add_argument("--host-alloc", choices=("alloc_registered", "hugepage"), default="alloc_registered",
                    help="host pool memory: pointerdomain.alloc_registered (default) or 2 MiB-aligned anonymous "
                         "memory advised MADV_HUGEPAGE, registered with register_host_tensor")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 32 on CUDA, 8 on CPU, 4 with --quick)")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per page (default 16; 4 with --quick)")
    ap.add_argument("--trials", type=int, default=None, help="timed trials per cell, median reported (default 3)")
    ap.add_argument("--min-trial-s", type=float, default=None,
                    help="repeat calls within a trial until it lasts this long (default 0.2 s on CUDA, 0.02 s on CPU, 0.01 with --quick)")
    ap.add_argument("--max-reps", type=int, default=50, help="at most this many calls per trial")
    ap.add_argument("--methods", default="all", help="comma-separated method keys (see below), default all")
    ap.add_argument("--memcpy-items", type=int, default=16384, help="cap on items per call for (b)")
    ap.add_argument("--engine-items", type=int, default=262144, help="cap on items per call for (c)")
    ap.add_argument("--index-gib", type=float, default=0.25, help="cap on GiB per call for (d) torch indexing")
    ap.add_argument("--launches", type=int, default=2000, help="calls per launch-cost measurement")
    ap.add_argument("--overhead-budget-s", type=float, default=None,
                    help="stop a launch-cost measurement after this many seconds (default 2; 0.5 with --quick)")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--staging", default=None, metavar="MIB:RING",
                    help="staging buffer of the staged path (pointerdomain.transfer.staged.set_staging), e.g. 64:4; "
                         "default the library's (16 MiB in 2 ring slots)")
    ap.add_argument("--progress", choices=("auto", "tqdm", "plain", "none"), default="auto",
                    help="auto: tqdm on a terminal, plain lines otherwise")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) first (the CPU kernel and torch copies use that many threads; "
                         "default: 1 with --quick, else torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    q = args.quick
    if args.threads is None and q:
        args.threads = 1  # quick mode: a fixed thread count, so runs compare
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if args.gib is None:
        args.gib = 4 / 1024 if q else (1.0 if cuda else 0.125)
    args.layers = args.layers or (4 if q else (32 if cuda else 8))
    args.page_size = args.page_size or (4 if q else 16)
    args.trials = args.trials or (2 if q else 3)
    # CUDA: 0.2 s trials (10-20 back-to-back calls at 0.5-1 GiB), so a path that spends host
    # time before its first GPU work (the staged path: ~1 ms per call) is timed in steady
    # state, as the kernel rows are; its one-call cost is in the launch-cost table.
    args.min_trial_s = args.min_trial_s if args.min_trial_s is not None else (0.01 if q else (0.2 if cuda else 0.02))
    args.overhead_budget_s = args.overhead_budget_s if args.overhead_budget_s is not None else (0.5 if q else 2.0)
    if q:
        args.launches = min(args.launches, 500)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    for s in args.sizes:
        if s % 16:
            ap.error(f"item size {s}: must be a multiple of 16 bytes")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    load = load_average()
    if load is not None and not bench.cuda and load > (os.cpu_count() or 1):
        bench.notes.append(f"load average {load:.1f} on {os.cpu_count()} CPUs when the run started: CPU timings "
                           "are not reliable")
    configs = [(s, "mha") for s in args.sizes]
    if not args.no_mla and 1152 in args.sizes:
        configs.append((1152, "mla"))
    configs.sort(key=lambda c: (c[0], c[1] == "mla"))
    for m in bench.methods:
        if m.skip:
            bench.notes.append(f"{m.col} skipped: {m.skip}")
    steps = len(configs) * len(DIRECTIONS) * len(bench.methods)
    steps += 0 if args.skip_overhead else (7 + (1 if bench.cuda else 0))
    print(f"pointerdomain {getattr(pd, '__version__', '?')} transfer benchmark on {report.device_name(bench)}; "
          f"torch {torch.__version__}; {fmt_bytes(args.gib * GiB)} per point, {args.layers} layers, "
          f"page_size {args.page_size}, host {args.host_layout}, {args.trials} trials, "
          f"{torch.get_num_threads()} CPU threads", flush=True)
    progress = Progress(steps, args.progress)
    ov: dict[str, Any] = {}
    ctx = torch.cuda.stream(bench.stream) if bench.cuda else _NullContext()
    try:
        with ctx:
            bench.setup(configs)
            bench.sweep(configs, progress)
            if not args.skip_overhead:
                ov = bench.overhead(progress)
            bench.sync()
    finally:
        progress.close()
    report.report(bench, configs)
    if ov:
        report.report_overhead(bench, ov)
    targets = [] if args.quick else report.targets(bench)
    if targets:
        report.report_targets(targets)
    elif args.quick:
        print("\nquick mode: a smoke test, no target verdicts")
    png = report.plot(bench, configs)
    path = report.save_json(bench, extra=dict(overhead=ov, targets=targets, plot=png,
                                              peers=report.PEERS_H200_2026_12_01))
    for note in bench.notes:
        print(f"note: {note}")
    print(f"wrote {path}" + (f" and {png}" if png else "") + f" in {time.perf_counter() - bench.t_start:.1f} s")
    bench.host_mem.close()
    bad = [r for r in bench.results if r["status"] in ("FAIL", "ERROR")]
    bad += [r for r in ov.get("rows", []) + ov.get("graph", []) if r.get("status") == "ERROR"]
    if bad:
        print(f"{len(bad)} measurement(s) FAILED or raised an ERROR (see above): exit status 1")
    return 1 if bad else 0


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
