"""Host cost of one public launch against the platform layer's bare launch, by how the
destination table's buffers are allocated (issue 15 item 3: <= 5 us over the direct call).

    python3 -m benchmarks.launch_cost [--calls N] [--json OUT]     (CUDA only)

One slot, all layers, host pool (``page_first``, registered) -> device pool
(``layer_first``, one table entry per kv and layer), MHA 1 KiB items, 2 CTAs, back to back.
Three device tables of the same layout: the pool's own (``DeviceKVPool``: one allocation,
64 views), and 64 separate allocations (``pointerdomain.device_empty``) (what an engine that allocates a
tensor per layer hands in). The per-launch liveness check reads the size of every distinct
storage a table points into, so the third row is where its cost shows. Every public call
is checked once before it is timed, byte for byte against a plain-torch reference on a
poisoned destination. Median host microseconds per call (the launch
queue is drained outside the timed calls every 128 calls).
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
from pointerdomain.transfer.plan import plan_for

LAYOUT = pd.KVLayout(kind="layer_first", num_layers=32, num_pages=64, page_size=16, num_heads=8, head_dim=64,
                     dtype="bfloat16")


def _median_us(fn: Callable[[], None], calls: int) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    times: list[int] = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        if i % 128 == 127:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def measure(calls: int) -> list[dict[str, Any]]:
    """Rows of (table, public us, direct us, over): see the module docstring."""
    dev = pd.Device("cuda", 0)
    pool = pd.DeviceKVPool(LAYOUT, dev)
    host = pd.HostKVPool(LAYOUT.replace(kind="page_first"), dev)
    torch.manual_seed(0)
    raw = host.buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    separate = [pd.device_empty(tuple(b.shape), b.dtype, dev) for b in pool.buffers]  # one allocation each
    tables = {
        "DeviceKVPool (one allocation, 64 views)": (pool.table, pool.buffers),
        "64 separate allocations": (pd.make_kernel_ptr_table(separate, dev, layout=LAYOUT), separate),
    }
    si = torch.tensor([3], device="cuda")
    di = torch.tensor([5], device="cuda")
    src, sl = host.kernel_table, host.layout
    stream = int(torch.cuda.current_stream().cuda_stream)
    rows = []
    for label, (dst, buffers) in tables.items():
        def public(dst: pd.PointerTable[pd.DeviceAlias] = dst) -> None:
            pd.transfer_kv_all_layer(src, dst, si, di, src_layout=sl, dst_layout=LAYOUT, max_ctas=2)

        for b in buffers:
            b.view(torch.uint8).fill_(0xA5)
        public()
        torch.cuda.synchronize()
        # plain-torch reference: entry kv * num_layers + layer, slot 5 = host slot 3 of (kv, layer); the rest poison
        for i, got in enumerate(buffers):
            kv, layer = divmod(i, LAYOUT.num_layers)
            want = torch.full_like(got.view(torch.uint8), 0xA5)
            want[5] = host.buffer[kv, 3, layer].contiguous().view(torch.uint8).reshape(want[5].shape).to(want.device)
            if not torch.equal(got.view(torch.uint8), want):
                raise RuntimeError(f"{label}: entry {i} holds other bytes than the torch reference")
        plan = plan_for(src, sl, dst, LAYOUT)

        def direct(plan: Any = plan) -> None:
            plan.platform.launch(plan.unchecked or plan.kernel, si.data_ptr(), di.data_ptr(), 1, 0,
                                 LAYOUT.num_layers, dev, stream, 2)

        pub, dir_ = _median_us(public, calls), _median_us(direct, calls)
        rows.append(dict(table=label, public_us=pub, direct_us=dir_, over_us=pub - dir_))
    host.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.launch_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=4000, help="timed calls per row (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_cost: no CUDA device (the figure is the CUDA launch path's)")
        return 0
    rows = measure(args.calls)
    print(f"{'destination table':42s} {'public us':>10s} {'direct us':>10s} {'over':>7s}")
    for r in rows:
        print(f"{r['table']:42s} {r['public_us']:10.2f} {r['direct_us']:10.2f} {r['over_us']:+7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
