"""Host cost of the public default launch against the platform layer's bare launch, by how
the device table's buffers are allocated (the target: <= 2.5 us over the bare launch, the
same for one allocation and for 64).

    python3 -m benchmarks.launch_cost [--calls N] [--repeats R] [--device cuda:0|emulated:0] [--steps]
                                      [--json OUT] [--max-ratio X]

One slot, all layers, a host pool (``page_first``, registered) and a device table
(``layer_first``, one entry per kv and layer), MHA 1 KiB items. Two device tables of the
same layout, the two rows: the pool's own (``DeviceKVPool``: one allocation, 64 views) and
64 separate allocations (``pointerdomain.device_empty``, what an engine that allocates a
tensor per layer hands in). Per row: the bare launch (``backend.launch(plan.kernel, args)``
with the call bound beforehand, no checks), and the public default calls over it
(``transfer_kv_all_layer`` H2D, ``HostKVPool.load`` and ``.backup``: ``backend="auto"``,
``validate_indices=True``, the default CTA budget), each byte-checked once against a plain
torch reference on a poisoned destination before it is timed. The path ``"auto"`` took is
in the row's label (:func:`pointerdomain.explain_transfer`).

Timing, made for a noisy shared machine: every call is timed in batches of ``--calls``
calls (the batch mean), the batches of all calls and both rows interleaved ``--repeats``
times (each call next to what it is compared with: the row's bare launch, the other row's
same call; the order reversed every other repeat), and each figure is the median over the
repeats: of the times, of the per-repeat differences to the bare launch (``over``), of the
per-repeat ratios. ``ratio_64_to_1`` is the median of the per-repeat ratios of the public
call over 64 allocations to the one over one allocation (1.0: the cost does not grow with
the storages). ``--max-ratio X`` exits 1
when it is above ``X`` (the CI stage). ``--steps`` also times the public call's three
steps one by one (``check_call``: ``bind_call`` without choosing the path; ``choose_path``;
``run`` of :mod:`pointerdomain.transfer.kernels`).

On ``emulated:0`` (the default without a GPU) the same calls run on the CPU stand-in: the
host cost of the Python launch path, with a kernel that copies on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import pointerdomain as pd
from pointerdomain._platform import LaunchArgs, default_device
from pointerdomain.transfer.plan import plan_for

LAYOUT = pd.KVLayout(kind="layer_first", num_layers=32, num_pages=64, page_size=16, num_heads=8, head_dim=64,
                     dtype="bfloat16")
ROWS = ("one allocation (DeviceKVPool, 64 views)", "64 separate allocations")
CALLS = ("bare launch", "transfer_kv_all_layer", "HostKVPool.load", "HostKVPool.backup")


class _Buffers:
    """A device pool over separately allocated buffers (what ``HostKVPool.load`` takes:
    ``.layout`` and ``.table``)."""

    def __init__(self, buffers: list[torch.Tensor], dev: pd.Device) -> None:
        self.buffers = buffers
        self.layout = LAYOUT
        self.table = pd.make_kernel_ptr_table(buffers, dev, layout=LAYOUT)


def _batch_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Mean host microseconds of ``calls`` back-to-back calls (the launch queue drained first)."""
    sync()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def _verify(label: str, host: pd.HostKVPool, buffers: list[torch.Tensor], run: Callable[[], None],
            dev: pd.Device, load: bool) -> None:
    """One call of ``run`` (host slot 3 <-> device slot 5, all layers) against plain torch,
    on a poisoned destination: the sources random, the destination 0xA5 everywhere."""
    torch.manual_seed(0)
    raw = host.buffer.view(torch.uint8)  # [kv, slot, layer, item bytes] (page_first)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    for b in buffers:
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8).to(b.device))
    for side in ([b.view(torch.uint8) for b in buffers] if load else [raw]):
        side.fill_(0xA5)
    host_before = raw.clone()
    dev_before = [b.view(torch.uint8).clone() for b in buffers]
    run()
    pd.synchronize(dev)
    want_host = host_before.clone()
    for i, got in enumerate(buffers):  # entry kv * num_layers + layer; row 5 is device slot 5
        kv, layer = divmod(i, LAYOUT.num_layers)
        want = dev_before[i].clone()
        if load:
            want[5] = host_before[kv, 3, layer].reshape(want[5].shape).to(want.device)
        else:
            want_host[kv, 3, layer] = dev_before[i][5].cpu().reshape(want_host[kv, 3, layer].shape)
        if not torch.equal(got.view(torch.uint8), want):
            raise RuntimeError(f"{label}: device entry {i} holds other bytes than the torch reference")
    if not torch.equal(raw, want_host):
        raise RuntimeError(f"{label}: the host pool holds other bytes than the torch reference")


def _steps(src: Any, sl: pd.KVLayout, dst: Any, si: torch.Tensor, di: torch.Tensor, calls: int,
           repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median host microseconds of each step of the public default call."""
    from pointerdomain.transfer import kernels

    call = (src, sl, dst, LAYOUT, si, di, 0, LAYOUT.num_layers, None, kernels.DEFAULT_MAX_CTAS, "auto", True)
    plan, options, args, host, _path = kernels.bind_call(*call, False)
    path = kernels.choose_path(plan, src, dst, options, args, host)
    fns: dict[str, Callable[[], object]] = {
        "check_call": lambda: kernels.bind_call(*call, False),  # the checks and binding, no path
        "choose_path": lambda: kernels.choose_path(plan, src, dst, options, args, host),
        "run": lambda: kernels.run(plan, src, dst, si, di, args, path, options.check),
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(_batch_us(fn, calls, sync))
    return {k: statistics.median(v) for k, v in times.items()}


def measure(calls: int, repeats: int, dev: pd.Device, steps: bool = False) -> dict[str, Any]:
    """The rows and the ratio (see the module docstring)."""
    sync: Callable[[], None] = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    pool = pd.DeviceKVPool(LAYOUT, dev)
    host = pd.HostKVPool(LAYOUT.replace(kind="page_first"), dev)
    separate = _Buffers([pd.device_empty(tuple(b.shape), b.dtype, dev) for b in pool.buffers], dev)
    devices: dict[str, Any] = {ROWS[0]: pool, ROWS[1]: separate}
    si = torch.tensor([3], device=dev.torch_device)
    di = torch.tensor([5], device=dev.torch_device)
    src, sl = host.kernel_table, host.layout
    stream = int(torch.cuda.current_stream().cuda_stream) if dev.type == "cuda" else 0
    fns: dict[tuple[str, str], Callable[[], object]] = {}
    paths: dict[str, str] = {}
    for row, device_pool in devices.items():
        dst = device_pool.table
        plan = plan_for(src, sl, dst, LAYOUT)
        args = LaunchArgs(si.data_ptr(), di.data_ptr(), 1, 0, LAYOUT.num_layers, dev, stream, pd.DEFAULT_MAX_CTAS)

        def bare(plan: Any = plan, args: LaunchArgs = args) -> None:
            plan.platform.launch(plan.kernel, args)

        def public(dst: pd.PointerTable[pd.DeviceAlias] = dst) -> None:
            pd.transfer_kv_all_layer(src, dst, si, di, src_layout=sl, dst_layout=LAYOUT)

        def load(device_pool: Any = device_pool) -> None:
            host.load(device_pool, si, di)

        def backup(device_pool: Any = device_pool) -> None:
            host.backup(device_pool, di, si)

        buffers = device_pool.buffers
        _verify(f"{row}: bare launch", host, buffers, bare, dev, load=True)
        _verify(f"{row}: transfer_kv_all_layer", host, buffers, public, dev, load=True)
        _verify(f"{row}: HostKVPool.load", host, buffers, load, dev, load=True)
        _verify(f"{row}: HostKVPool.backup", host, buffers, backup, dev, load=False)
        paths[row] = pd.explain_transfer(src, dst, si, di, src_layout=sl, dst_layout=LAYOUT).path
        for name, fn in zip(CALLS, (bare, public, load, backup)):
            fns[(row, name)] = fn
    for fn in fns.values():  # warm-up
        for _ in range(200):
            fn()
    # Each call next to the one it is compared with (a row's bare launch, the other row's
    # public call), the order reversed every other repeat: load from other processes shifts
    # both sides of a comparison alike.
    order = [(row, name) for name in CALLS for row in ROWS]
    times: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
    for r in range(repeats):
        for key in order if r % 2 == 0 else reversed(order):
            times[key].append(_batch_us(fns[key], calls, sync))
    sync()
    rows = []
    for row in ROWS:
        bare = times[(row, "bare launch")]
        bare_us = statistics.median(bare)
        call_us = {name: statistics.median(times[(row, name)]) for name in CALLS[1:]}
        over = {name: statistics.median(a - b for a, b in zip(times[(row, name)], bare)) for name in CALLS[1:]}
        public = times[(row, "transfer_kv_all_layer")]
        entry: dict[str, Any] = dict(
            table=row, path=paths[row], bare_us=bare_us, public_us=call_us["transfer_kv_all_layer"],
            over_bare_us=over["transfer_kv_all_layer"],
            ratio_to_bare=statistics.median(a / b for a, b in zip(public, bare)),
            calls_us=call_us, calls_over_bare_us=over,
        )
        if steps:
            entry["steps_us"] = _steps(src, sl, devices[row].table, si, di, calls, repeats, sync)
        rows.append(entry)
    ratios = [a / b for a, b in zip(times[(ROWS[1], "transfer_kv_all_layer")], times[(ROWS[0], "transfer_kv_all_layer")])]
    host.close()
    return dict(device=str(dev), calls_per_batch=calls, repeats=repeats, rows=rows,
                ratio_64_to_1=statistics.median(ratios))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.launch_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=50, help="calls per timed batch (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=61, help="interleaved batches per call (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write the result to this JSON file")
    ap.add_argument("--device", default=None,
                    help="cuda:N or emulated:N (default cuda:0 where a GPU with the GPU ops is, else emulated:0)")
    ap.add_argument("--steps", action="store_true", help="also time the public call's steps one by one")
    ap.add_argument("--max-ratio", type=float, default=None,
                    help="exit 1 when ratio_64_to_1 (public call over 64 allocations / over one) is above this")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        ap.error("--calls and --repeats must be at least 1")
    dev = pd.validate_device(args.device) if args.device else default_device()
    result = measure(args.calls, args.repeats, dev, args.steps)
    print(f"{dev}: median us per call over {args.repeats} interleaved batches of {args.calls}")
    print(f"{'device table (auto path)':52s} {'bare':>7s} {'public':>7s} {'over':>7s} {'x bare':>7s}")
    for r in result["rows"]:
        label = f"{r['table']} ({r['path']})"
        print(f"{label:52s} {r['bare_us']:7.2f} {r['public_us']:7.2f} {r['over_bare_us']:+7.2f} "
              f"{r['ratio_to_bare']:7.2f}")
        for name, us in r["calls_us"].items():
            if name != "transfer_kv_all_layer":
                print(f"    {name:48s} {'':7s} {us:7.2f} {r['calls_over_bare_us'][name]:+7.2f}")
        for step, us in r.get("steps_us", {}).items():
            print(f"    step {step:43s} {'':7s} {us:7.2f}")
    print(f"ratio_64_to_1 (public call, 64 allocations / one): {result['ratio_64_to_1']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.max_ratio is not None and result["ratio_64_to_1"] > args.max_ratio:
        print(f"FAILED: ratio_64_to_1 {result['ratio_64_to_1']:.3f} > {args.max_ratio}: the launch cost grows with "
              "the number of storages under a table", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
