"""Host cost of one public launch against the platform layer's bare launch, by how the
destination table's buffers are allocated (the target: <= 5 us over the direct call).

    python3 -m benchmarks.launch_cost [--calls N] [--device cuda:0|emulated:0] [--steps] [--json OUT]

``--steps`` also times the public launch's three steps one by one on the same call
(``check_call``, ``choose_path``, ``run`` of :mod:`pointerdomain.transfer.kernels`).

On ``emulated:0`` (the default without a GPU) the same calls run on the CPU stand-in:
the host cost of the Python launch path, with a kernel that copies on the CPU.

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
from pointerdomain._platform import default_device
from pointerdomain.transfer.plan import plan_for

LAYOUT = pd.KVLayout(kind="layer_first", num_layers=32, num_pages=64, page_size=16, num_heads=8, head_dim=64,
                     dtype="bfloat16")


def _median_us(fn: Callable[[], None], calls: int, dev: pd.Device) -> float:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(200):
        fn()
    sync()
    times: list[int] = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        if i % 128 == 127:
            sync()
    sync()
    return statistics.median(times) / 1e3


def _steps(src: Any, sl: pd.KVLayout, dst: Any, si: torch.Tensor, di: torch.Tensor, calls: int,
           dev: pd.Device) -> dict[str, float]:
    """Median host microseconds of each step of the public call (``max_ctas=2``, ``auto``)."""
    from pointerdomain.transfer import kernels

    call = (src, sl, dst, LAYOUT, si, di, 0, LAYOUT.num_layers, None, 2, "auto", True)
    plan, options, args = kernels.check_call(*call)
    path = kernels.choose_path(plan, src, dst, options, args)
    return {
        "check_call": _median_us(lambda: kernels.check_call(*call) and None, calls, dev),
        "choose_path": _median_us(lambda: kernels.choose_path(plan, src, dst, options, args) and None, calls, dev),
        "run": _median_us(lambda: kernels.run(plan, src, dst, si, di, args, path, options.check), calls, dev),
    }


def measure(calls: int, dev: pd.Device, steps: bool = False) -> list[dict[str, Any]]:
    """Rows of (table, public us, direct us, over): see the module docstring."""
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
    si = torch.tensor([3], device=dev.torch_device)
    di = torch.tensor([5], device=dev.torch_device)
    src, sl = host.kernel_table, host.layout
    stream = int(torch.cuda.current_stream().cuda_stream) if dev.type == "cuda" else 0
    rows = []
    for label, (dst, buffers) in tables.items():
        def public(dst: pd.PointerTable[pd.DeviceAlias] = dst) -> None:
            pd.transfer_kv_all_layer(src, dst, si, di, src_layout=sl, dst_layout=LAYOUT, max_ctas=2)

        for b in buffers:
            b.view(torch.uint8).fill_(0xA5)
        public()
        pd.synchronize(dev)
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

        pub, dir_ = _median_us(public, calls, dev), _median_us(direct, calls, dev)
        row: dict[str, Any] = dict(table=label, public_us=pub, direct_us=dir_, over_us=pub - dir_)
        if steps:
            row["steps_us"] = _steps(src, sl, dst, si, di, calls, dev)
        rows.append(row)
    host.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.launch_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=4000, help="timed calls per row (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--device", default=None,
                    help="cuda:N or emulated:N (default cuda:0 where a GPU with the GPU ops is, else emulated:0)")
    ap.add_argument("--steps", action="store_true", help="also time the launch's steps one by one")
    args = ap.parse_args(argv)
    dev = pd.validate_device(args.device) if args.device else default_device()
    rows = measure(args.calls, dev, args.steps)
    print(f"{dev}: {'destination table':34s} {'public us':>10s} {'direct us':>10s} {'over':>7s}")
    for r in rows:
        print(f"{r['table']:42s} {r['public_us']:10.2f} {r['direct_us']:10.2f} {r['over_us']:+7.2f}")
        for step, us in r.get("steps_us", {}).items():
            print(f"    {step:38s} {us:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
