"""Tuning sweep for the CUDA transfer kernel (H200): GB/s per (threads, items in
flight per warp, word bytes) at SM budgets 2, 4, 8 and the whole GPU, for 1 KiB,
1152 B (MLA) and 2 KiB items, all-layer page_first host <-> layer_first device, random page order.
Calls the extension directly so every configuration runs on the same tables.
Usage: python benchmarks/sweep_kernel.py [--gib 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import pointerdomain as pd
from pointerdomain._extension import extension


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    ext = extension()
    dev = pd.Device("cuda", 0)
    stream = torch.cuda.current_stream().cuda_stream
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for item in (1024, 1152, 2048):
        shape = dict(num_layers=8, page_size=64, num_heads=1, head_dim=item // 2, dtype="bfloat16", attention="mha")
        page_bytes = 2 * 8 * 64 * item
        pages = max(16, int(args.gib * 2**30 // page_bytes))
        dl = pd.KVLayout(kind="layer_first", num_pages=pages, **shape)
        hl = pd.KVLayout(kind="page_first", num_pages=pages, **shape)
        pool = pd.DeviceKVPool(dl, dev)
        host = pd.HostKVPool(hl, dev)
        perm_d = torch.randperm(pages)
        perm_h = torch.randperm(pages)
        tok = torch.arange(64)
        d = (perm_d[:, None] * 64 + tok).reshape(-1).cuda()
        h = (perm_h[:, None] * 64 + tok).reshape(-1).cuda()
        moved = d.numel() * 2 * 8 * item
        geo_d = dl.geometry(len(pool.table), pool.table.sizes, "d")
        geo_h = hl.geometry(len(host.kernel_table), host.kernel_table.sizes, "h")
        bulk_h = torch.empty(moved, dtype=torch.uint8).pin_memory()
        bulk_d = torch.empty(moved, dtype=torch.uint8, device="cuda")
        for direction in ("H2D", "D2H"):
            if direction == "H2D":
                src, sg, dst, dg, si, di = host.kernel_table, geo_h, pool.table, geo_d, h, d
            else:
                src, sg, dst, dg, si, di = pool.table, geo_d, host.kernel_table, geo_h, d, h

            def timed(fn: object, reps: int = 3) -> float:
                fn()  # type: ignore[operator]
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(reps):
                    fn()  # type: ignore[operator]
                b.record()
                b.synchronize()
                return moved * reps / (a.elapsed_time(b) / 1e3) / 1e9

            bulk = timed(lambda: bulk_d.copy_(bulk_h, non_blocking=True) if direction == "H2D"
                         else bulk_h.copy_(bulk_d, non_blocking=True))
            rows.append(dict(item=item, direction=direction, budget="bulk", gbps=bulk))
            print(f"item {item} {direction} bulk {bulk:.1f} GB/s", flush=True)
            for budget in (2, 4, 8, None):
                best = None
                for threads in (512, 1024):
                    for ilp in (1, 2, 4):
                        for vec in (16, 8):
                            def run() -> None:
                                st = ext.gpu_transfer(src.kernel_table_address(), sg, dst.kernel_table_address(), dg,
                                                      si.data_ptr(), di.data_ptr(), si.numel(), 64, 2, 0, 8, item,
                                                      0, stream, budget or 0, vec)
                                assert st == 0, st
                            g = timed(run)
                            rows.append(dict(item=item, direction=direction, budget=budget or f"{sms} SMs",
                                             threads=threads, ilp=ilp, vec=vec, gbps=g, ratio=g / bulk))
                            if best is None or g > best[0]:
                                best = (g, threads, ilp, vec)
                assert best is not None
                print(f"item {item} {direction} budget {budget}: best {best[0]:.1f} GB/s ({best[0] / bulk:.2f}x bulk) "
                      f"threads {best[1]} ilp {best[2]} vec {best[3]}", flush=True)
        host.close()
        del pool, host, bulk_h, bulk_d
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
