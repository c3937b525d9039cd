"""Both directions at once: an engine backs pages up (D2H) while it prefetches others
(H2D). Measured against the bulk duplex ceiling in the same run.

    python -m benchmarks.duplex [--tokens N] [--seconds S] [--json OUT] [--emulated]

The ceiling: two opposite ``copy_`` calls of the same bytes between pinned host memory and
the device, each on its own stream, enqueued from two host threads at once; its aggregate
GB/s (10^9 bytes/s, both directions summed). Each row runs a backup of one set of slots and
a load of another set at once, each on its own stream from its own thread, with the CTA
budget given per direction: kernel 1+1, 2+2 (<= 4 CTAs in all), the whole GPU each, staged
2+2 with CPU index tensors, and the copy engine. Every method is first checked byte for
byte in both directions (poisoned destinations, plain torch indexing as the reference; see
:mod:`benchmarks.contention`).

Goal (recorded on the H200 in docs/performance.md): >= 0.95 x the duplex ceiling in
aggregate at <= 4 CTAs in all. ``--emulated``: the CPU's emulated device, one direction
after the other (a smoke test of the checks and the report, no figures).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

import pointerdomain as pd
from benchmarks.contention import KVCase, concurrently, time_loop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per call and direction (default 8192)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per timed loop (default 0.5)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--emulated", action="store_true", help="the CPU's emulated device (smoke test)")
    opts = parser.parse_args(argv)
    emulated = opts.emulated or not torch.cuda.is_available()
    device = pd.Device("emulated", 0) if emulated else pd.Device("cuda", 0)
    tokens = opts.tokens or (32 if emulated else 8192)
    seconds = opts.seconds if opts.seconds is not None else (0.02 if emulated else 0.5)
    # two independent cases: the load's pools and the backup's pools (different memory)
    load_case, back_case = KVCase.build(device, tokens, seed=1), KVCase.build(device, tokens, seed=2)
    s_load = torch.cuda.Stream(device.ordinal) if not emulated else None
    s_back = torch.cuda.Stream(device.ordinal) if not emulated else None
    i_load = None if s_load is None else s_load.cuda_stream
    i_back = None if s_back is None else s_back.cuda_stream
    moved = load_case.bytes_per_call
    try:
        lh, ld, bh, bd = load_case.host_slots, load_case.dev_slots, back_case.host_slots, back_case.dev_slots
        kw: dict[str, dict[str, Any]] = {
            "kernel 1+1": dict(max_ctas=1, backend="kernel"),
            "kernel 2+2": dict(max_ctas=2, backend="kernel"),
            "kernel gpu+gpu": dict(max_ctas=pd.WHOLE_GPU, backend="kernel"),
            "staged 2+2": dict(max_ctas=2, backend="staged"),
            "copy_engine": dict(backend="copy_engine"),
        }
        cpu_idx = {"staged 2+2"}
        rows: list[dict[str, Any]] = []
        skipped: dict[str, str] = {}
        for name, args in kw.items():
            on_cpu = name in cpu_idx
            li, lo = (lh.cpu(), ld.cpu()) if on_cpu else (lh, ld)
            bi, bo = (bd.cpu(), bh.cpu()) if on_cpu else (bd, bh)

            def load(s: int | None, args: dict[str, Any] = args, li: Any = li, lo: Any = lo) -> None:
                load_case.host.load(load_case.pool, li, lo, stream=s, **args)

            def backup(s: int | None, args: dict[str, Any] = args, bi: Any = bi, bo: Any = bo) -> None:
                back_case.host.backup(back_case.pool, bi, bo, stream=s, **args)

            try:
                load_case.check(lambda: load(None), name)
                back_case.check_backup(lambda: backup(None), name)
            except pd.errors.PointerDomainError as exc:
                skipped[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
                continue
            (ls, ln), (bs, bn) = concurrently(
                device, lambda: time_loop(device, s_load, lambda: load(i_load), seconds),
                lambda: time_loop(device, s_back, lambda: backup(i_back), seconds))
            rows.append({"method": name, "h2d_gbps": moved * ln / ls / 1e9, "d2h_gbps": moved * bn / bs / 1e9})
        tdev = device.torch_device
        host_a, host_b = torch.empty(moved, dtype=torch.uint8), torch.empty(moved, dtype=torch.uint8)
        if not emulated:
            host_a, host_b = host_a.pin_memory(), host_b.pin_memory()
        dev_a, dev_b = torch.empty(moved, dtype=torch.uint8, device=tdev), torch.empty(moved, dtype=torch.uint8,
                                                                                      device=tdev)
        (hs, hn), (ds, dn) = concurrently(
            device, lambda: time_loop(device, s_load, lambda: dev_a.copy_(host_a, non_blocking=True), seconds),
            lambda: time_loop(device, s_back, lambda: host_b.copy_(dev_b, non_blocking=True), seconds))
        ceiling = moved * hn / hs / 1e9 + moved * dn / ds / 1e9
    finally:
        load_case.close()
        back_case.close()
    for r in rows:
        r["aggregate_gbps"] = r["h2d_gbps"] + r["d2h_gbps"]
        r["ratio"] = r["aggregate_gbps"] / ceiling
    print(f"duplex on {device}: {tokens} tokens x 32 layers x 1 KiB items per call and direction; "
          f"bulk duplex ceiling {ceiling:.1f} GB/s{' (emulated: one direction after the other)' if emulated else ''}")
    print(f"{'method':>15} {'H2D GB/s':>9} {'D2H GB/s':>9} {'sum':>8} {'x ceiling':>9}")
    for name, why in skipped.items():
        print(f"{name:>15} not run here: {why}")
    for r in rows:
        print(f"{r['method']:>15} {r['h2d_gbps']:9.2f} {r['d2h_gbps']:9.2f} {r['aggregate_gbps']:8.2f} {r['ratio']:9.3f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": str(device), "tokens": tokens, "ceiling_gbps": ceiling, "rows": rows,
                       "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
