"""Cost of checked mode on the emulated (CPU) backend: per launch, and per 1k table entries.

    python benchmarks/checked_mode_cost.py [--quick] [--json OUT]

Each row times the same launch with checked mode off and on (median of batches of
process CPU time, so that other load on a shared machine counts less) and reports the
difference. ``measure()`` returns the rows for other benchmarks to print.
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
from pointerdomain import checked

DEV = "emulated:0"


def _median_us(fn: Callable[[], None], batches: int, per_batch: int) -> float:
    fn()
    times = []
    for _ in range(batches):
        t0 = time.process_time()
        for _ in range(per_batch):
            fn()
        times.append((time.process_time() - t0) / per_batch)
    return statistics.median(times) * 1e6


def _cost(fn: Callable[[], None], batches: int, per_batch: int) -> tuple[float, float]:
    with checked.checked_mode(False):
        off = _median_us(fn, batches, per_batch)
    with checked.checked_mode(True):
        on = _median_us(fn, batches, per_batch)
    return off, on


def _fill(t: torch.Tensor) -> None:
    flat = t.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))


def _row(name: str, entries: int, chunks: int, n: int, off: float, on: float) -> dict[str, Any]:
    return {"case": name, "table_entries": entries, "registration_chunks": chunks, "slots": n,
            "off_us": round(off, 1), "on_us": round(on, 1), "checked_cost_us": round(on - off, 1)}


def measure(quick: bool = False) -> list[dict[str, Any]]:
    batches, per_batch = (3, 20) if quick else (7, 50)
    rows: list[dict[str, Any]] = []
    model: dict[str, Any] = dict(attention="mha", num_layers=32, page_size=16, num_heads=8, head_dim=128,
                                 dtype="bfloat16")

    # 1. a typical launch: device pool (per-layer K/V buffers) <-> one-buffer host pool
    dev_layout = pd.KVLayout(kind="layer_first", num_pages=8, **model)
    host_layout = pd.KVLayout(kind="page_first", num_pages=16, **model)
    dev_pool = pd.DeviceKVPool(dev_layout, DEV)
    for n_pages in (1, 8):
        slots = torch.arange(n_pages * 16)
        with pd.HostKVPool(host_layout, DEV) as host:
            off, on = _cost(lambda: host.backup(dev_pool, slots, slots), batches, per_batch)
            entries = len(dev_pool.table) + len(host.kernel_table)
            rows.append(_row("typical: layer_first device pool -> page_first host pool, all layers", entries,
                             len(host.memory.chunks), len(slots), off, on))
            off, on = _cost(lambda: host.load_layer(dev_pool, slots, slots, 3), batches, per_batch)
            rows.append(_row("typical: host -> device, one layer", entries, len(host.memory.chunks), len(slots), off, on))

    # 2. per table entry: a host table with one entry per page block (a) in one registration,
    #    (b) with every block its own registration chunk (HostKVPool with a small max_chunk_bytes)
    small: dict[str, Any] = dict(attention="mla", num_layers=1, page_size=1, num_heads=1, head_dim=64, dtype="uint8")
    sizes = (256, 1024) if quick else (256, 1024, 4096)
    for entries in sizes:
        dev_small = pd.DeviceKVPool(pd.KVLayout(kind="layer_first", num_pages=64, **small), DEV)
        host_small = pd.KVLayout(kind="page_first", num_pages=entries, **small)
        slots = torch.arange(16)
        with pd.alloc_registered(host_small.nbytes, DEV) as mem:
            _fill(mem.tensor)
            block = host_small.page_block_bytes()
            table = pd.make_kernel_ptr_table([mem.tensor[i : i + block] for i in range(0, host_small.nbytes, block)],
                                             DEV)

            def launch(table: pd.PointerTable[pd.DeviceAlias] = table) -> None:
                pd.transfer_kv_all_layer(table, dev_small.table, slots, slots, src_layout=host_small,
                                         dst_layout=dev_small.layout)

            off, on = _cost(launch, batches, per_batch)
            rows.append(_row("per entry: one registration, one entry per page", entries + 1, 1, 16, off, on))
        with pd.HostKVPool(host_small, DEV, max_chunk_bytes=host_small.page_block_bytes()) as pool:
            off, on = _cost(lambda: pool.load(dev_small, slots, slots), batches, per_batch)
            rows.append(_row("per entry: one registration chunk per page (chunked HostKVPool)", entries + 1,
                             len(pool.memory.chunks), 16, off, on))

    # 3. per slot: many indices (touched pages are read from the CPU index tensors)
    big = pd.KVLayout(kind="page_first", num_pages=1024, **small)
    dev_big = pd.DeviceKVPool(pd.KVLayout(kind="layer_first", num_pages=1024, **small), DEV)
    with pd.HostKVPool(big, DEV) as host:
        for n in (256, 16384) if not quick else (256,):
            slots = torch.randperm(big.num_slots)[:n]
            off, on = _cost(lambda: host.backup(dev_big, slots, slots), batches, max(per_batch // 5, 4))
            rows.append(_row("per slot: many indices, 2 one-entry tables", 2, 1, n, off, on))
    return rows


def per_1k_entries(rows: list[dict[str, Any]], case_prefix: str) -> float:
    """Slope of checked-mode cost in µs per 1000 table entries for one 'per entry' series."""
    series = sorted((r["table_entries"], r["checked_cost_us"]) for r in rows if r["case"].startswith(case_prefix))
    (e0, c0), (e1, c1) = series[0], series[-1]
    return (c1 - c0) / (e1 - e0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = measure(args.quick)
    print(f"checked mode cost on {DEV} (torch threads: {torch.get_num_threads()})")
    print(f"{'case':<72} {'entries':>7} {'chunks':>6} {'slots':>6} {'off':>8} {'on':>8} {'cost':>8}  (CPU µs per launch)")
    for r in rows:
        print(f"{r['case']:<72} {r['table_entries']:>7} {r['registration_chunks']:>6} {r['slots']:>6} "
              f"{r['off_us']:>8} {r['on_us']:>8} {r['checked_cost_us']:>8}")
    slopes = {
        "one registration": per_1k_entries(rows, "per entry: one registration,"),
        "one chunk per entry": per_1k_entries(rows, "per entry: one registration chunk"),
    }
    for name, slope in slopes.items():
        print(f"per 1k table entries ({name}): {slope:.0f} µs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "per_1k_entries_us": slopes}, f, indent=2)


if __name__ == "__main__":
    main()
