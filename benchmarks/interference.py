"""What a KV transfer costs the model: a bf16 GEMM runs on its own stream while each
transfer method runs on another, measured in one run.

    python -m benchmarks.interference [--gemm 8192] [--seconds 0.5] [--json OUT] [--emulated]

Rows, one per transfer method (H2D loads of 1 KiB items, 32 layers, random slots):
``kernel@1``, ``kernel@2``, ``kernel@4``, ``kernel@gpu`` (the whole GPU), ``staged@2`` (CPU
index tensors), ``copy_engine``. For each: the GEMM's TFLOP/s alone (measured right before the
row, after an untimed warm-up) and during the transfer,
the transfer's GB/s (10^9 bytes/s) alone and during the GEMM, and the bulk copy's GB/s (one
``copy_`` of the same bytes from pinned memory) in the same run. A decode-like part then
times many small GEMMs (1, 8 and 64 rows x ``--gemm`` x ``--gemm``) one by one, alone and
during each transfer, and reports their p50 / p99 latency in microseconds.

Every method is first checked byte for byte: the device pool poisoned, the load run, every
moved item compared with the host pool's item by plain torch indexing of its page_first
buffer, every other byte still the poison (:meth:`benchmarks.contention.KVCase.check`).

Goal (recorded on the H200 in docs/performance.md): a method with >= 0.95 x bulk while the
GEMM loses <= 3 %. ``--emulated`` runs the same code on the CPU's emulated device with tiny
sizes and no concurrency (a smoke test of the checks and the report, no figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import pointerdomain as pd
from benchmarks.contention import LAYERS, KVCase, concurrently, time_loop

def transfer_methods(case: KVCase) -> dict[str, Callable[[int | None], None]]:
    """Each method as a call taking the stream to run on (None: the current one)."""
    h, d = case.host_slots, case.dev_slots
    h_cpu, d_cpu = h.cpu(), d.cpu()
    host, pool = case.host, case.pool
    return {
        "kernel@1": lambda s: host.load(pool, h, d, max_ctas=1, backend="kernel", stream=s),
        "kernel@2": lambda s: host.load(pool, h, d, max_ctas=2, backend="kernel", stream=s),
        "kernel@4": lambda s: host.load(pool, h, d, max_ctas=4, backend="kernel", stream=s),
        "kernel@gpu": lambda s: host.load(pool, h, d, max_ctas=pd.WHOLE_GPU, backend="kernel", stream=s),
        "staged@2": lambda s: host.load(pool, h_cpu, d_cpu, max_ctas=2, backend="staged", stream=s),
        "copy_engine": lambda s: host.load(pool, h, d, backend="copy_engine", stream=s),
    }


def _latencies(device: pd.Device, stream: Any, fn: Callable[[], None], count: int) -> list[float]:
    """Per-call device latency (us) of ``count`` calls of ``fn`` on ``stream``, one by one."""
    out = []
    for _ in range(count):
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gemm", type=int, default=None, help="GEMM size N (N x N x N; default 8192, 64 emulated)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per transfer (default 8192, 32 emulated)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per timed loop (default 0.5)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--emulated", action="store_true", help="the CPU's emulated device (smoke test)")
    opts = parser.parse_args(argv)
    emulated = opts.emulated or not torch.cuda.is_available()
    device = pd.Device("emulated", 0) if emulated else pd.Device("cuda", 0)
    n = opts.gemm or (64 if emulated else 8192)
    tokens = opts.tokens or (32 if emulated else 8192)
    seconds = opts.seconds if opts.seconds is not None else (0.02 if emulated else 0.5)
    tdev = device.torch_device
    dtype = torch.float32 if emulated else torch.bfloat16  # CPU bf16 matmul is slow and not the point
    a, b = torch.randn(n, n, device=tdev, dtype=dtype), torch.randn(n, n, device=tdev, dtype=dtype)
    c = torch.empty(n, n, device=tdev, dtype=dtype)
    small = {rows: torch.randn(rows, n, device=tdev, dtype=dtype) for rows in (1, 8, 64)}
    gemm_stream = torch.cuda.Stream(device.ordinal) if not emulated else None
    copy_stream = torch.cuda.Stream(device.ordinal) if not emulated else None
    copy_int = None if copy_stream is None else copy_stream.cuda_stream

    def gemm() -> None:
        torch.matmul(a, b, out=c)

    def decode() -> None:
        for rows, x in small.items():
            torch.matmul(x, b)

    case = KVCase.build(device, tokens)
    try:
        methods: dict[str, Callable[[int | None], None]] = {}
        skipped: dict[str, str] = {}
        for name, fn in transfer_methods(case).items():
            try:
                case.check(lambda fn=fn: fn(None), name)  # type: ignore[misc]
            except pd.errors.PointerDomainError as exc:  # a path this device does not have (staged: CUDA only)
                skipped[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
                continue
            methods[name] = fn
        flops = 2.0 * n * n * n
        # Warm-up, untimed: a cold card runs its first GEMMs at idle clocks, which made an
        # "alone" figure taken first lower than every "during" figure.
        time_loop(device, gemm_stream, gemm, seconds)
        _latencies(device, gemm_stream, decode, 10 if not emulated else 1)
        bulk_src = torch.empty(case.bytes_per_call, dtype=torch.uint8)
        if not emulated:
            bulk_src = bulk_src.pin_memory()
        bulk_dst = torch.empty(case.bytes_per_call, dtype=torch.uint8, device=tdev)
        b_s, b_n = time_loop(device, copy_stream, lambda: bulk_dst.copy_(bulk_src, non_blocking=True), seconds)
        bulk = case.bytes_per_call * b_n / b_s / 1e9
        rows: list[dict[str, Any]] = []
        for name, fn in methods.items():
            # the GEMM alone right before each method's shared run: clock drift over the run
            # then moves both sides of the row's ratio together
            g_s, g_n = time_loop(device, gemm_stream, gemm, seconds)
            gemm_alone = flops * g_n / g_s / 1e12
            lat_alone = _latencies(device, gemm_stream, decode, 50 if not emulated else 5)
            t_s, t_n = time_loop(device, copy_stream, lambda fn=fn: fn(copy_int), seconds)  # type: ignore[misc]
            alone = case.bytes_per_call * t_n / t_s / 1e9
            (gs, gn), (ts, tn) = concurrently(
                device, lambda: time_loop(device, gemm_stream, gemm, seconds),
                lambda fn=fn: time_loop(device, copy_stream, lambda: fn(copy_int), seconds))  # type: ignore[misc]
            lat_during: list[float] = []

            def decode_job() -> tuple[float, int]:
                lat_during.extend(_latencies(device, gemm_stream, decode, 50 if not emulated else 5))
                return 1.0, len(lat_during)

            concurrently(device, decode_job,
                          lambda fn=fn: time_loop(device, copy_stream, lambda: fn(copy_int), seconds))  # type: ignore[misc]
            rows.append({
                "method": name, "transfer_gbps_alone": alone, "transfer_gbps_during": case.bytes_per_call * tn / ts / 1e9,
                "bulk_gbps": bulk, "ratio_during": case.bytes_per_call * tn / ts / 1e9 / bulk,
                "gemm_tflops_alone": gemm_alone, "gemm_tflops_during": flops * gn / gs / 1e12,
                "gemm_loss": 1.0 - (flops * gn / gs / 1e12) / gemm_alone,
                "decode_p50_us_alone": _pct(lat_alone, 0.5), "decode_p99_us_alone": _pct(lat_alone, 0.99),
                "decode_p50_us_during": _pct(lat_during, 0.5), "decode_p99_us_during": _pct(lat_during, 0.99),
            })
    finally:
        case.close()
    print(f"interference on {device}: GEMM {n}^3 {'fp32 (emulated smoke)' if emulated else 'bf16'}, "
          f"{tokens} tokens x {LAYERS} layers x 1 KiB items per transfer, bulk {bulk:.1f} GB/s")
    print(f"{'method':>12} {'GB/s alone':>10} {'during':>8} {'x bulk':>7} {'TFLOP/s':>8} {'during':>8} {'loss':>6}"
          f" {'p99 us':>8} {'during':>8}")
    for name, why in skipped.items():
        print(f"{name:>12} not run here: {why}")
    for r in rows:
        print(f"{r['method']:>12} {r['transfer_gbps_alone']:10.2f} {r['transfer_gbps_during']:8.2f}"
              f" {r['ratio_during']:7.3f} {r['gemm_tflops_alone']:8.1f} {r['gemm_tflops_during']:8.1f}"
              f" {r['gemm_loss']:6.1%} {r['decode_p99_us_alone']:8.1f} {r['decode_p99_us_during']:8.1f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": str(device), "gemm": n, "tokens": tokens, "rows": rows, "skipped": skipped,
                       "median_loss": statistics.median(float(r["gemm_loss"]) for r in rows) if rows else None}, f, indent=1)


if __name__ == "__main__":
    main()
