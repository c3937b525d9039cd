"""The layer pipeline (:meth:`pointerdomain.HostKVPool.load_layers`): host time to queue a
request's layers, host time per layer wait, and the summed load's bandwidth against one
bulk copy of the same bytes, measured in one run.

    python -m benchmarks.layer_pipeline [--emulated] [--calls N] [--tokens N] [--json OUT]

Rows: MHA items of 1 KiB (4 heads x 128 bf16) and MLA items of 1152 bytes (one 576-element
bf16 latent), at 1 and 2 CTAs and the whole GPU, 32 layers for bandwidth; plus the queue
time of a 61-layer request (a DeepSeek-V3-sized model), and of a one-token 61-layer request
(on the emulated device, whose copies run inside the call, the host cost of queueing alone). Every row is first checked byte
for byte: ``load_layers`` into a poisoned device pool against ``load`` into another
poisoned pool, and both against the host items (the torch reference). Figures are
medians over ``--calls`` calls:

- ``queue_us``: host microseconds for the ``load_layers`` call (every layer queued: one
  native call on the kernel path; on the emulated device the copies run inside it);
- ``per_layer_us``: ``queue_us`` / layers;
- ``wait_us``: host microseconds per ``LayerLoad.wait`` (the model stream waiting);
- ``gbps`` / ``bulk_gbps`` / ``ratio``: device-timed GB/s (10^9 bytes/s) of the whole
  pipeline against one ``copy_`` of the same number of bytes from pinned host memory
  (CUDA only; the emulated device has no device time).

Goals (recorded on the H200 in docs/performance.md): ratio >= 0.95 at <= 2 CTAs,
``per_layer_us`` <= 3 once queued, ``queue_us`` <= 100 for 61 layers.
``--emulated`` runs on the CPU's emulated device (a smoke test, CPU figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import pointerdomain as pd

PAGE_SIZE = 16


def _layouts(attention: str, layers: int, tokens: int) -> tuple[pd.KVLayout, pd.KVLayout]:
    heads, dim = (4, 128) if attention == "mha" else (1, 576)
    pages = max(2, 2 * tokens // PAGE_SIZE)
    common: dict[str, Any] = dict(attention=attention, num_layers=layers, page_size=PAGE_SIZE, num_heads=heads,
                                  head_dim=dim, dtype="bfloat16")
    return (pd.KVLayout(kind="layer_first", num_pages=pages, **common),
            pd.KVLayout(kind="page_first", num_pages=2 * pages, **common))


def _sync(dev: pd.Device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _pool_bytes(pool: pd.DeviceKVPool) -> torch.Tensor:
    return torch.cat([b.reshape(-1).view(torch.uint8).cpu() for b in pool.buffers])


def _row(dev: pd.Device, attention: str, layers: int, tokens: int, ctas: pd.MaxCtas, calls: int) -> dict[str, Any]:
    dev_layout, host_layout = _layouts(attention, layers, tokens)
    pool = pd.DeviceKVPool(dev_layout, dev)
    with pd.HostKVPool(host_layout, dev) as host:
        host.buffer.view(torch.uint8).copy_(torch.randint(0, 256, host.buffer.view(torch.uint8).shape,
                                                          dtype=torch.uint8))
        g = torch.Generator().manual_seed(0)
        h = torch.randperm(host_layout.num_slots, generator=g)[:tokens].to(dev.torch_device)
        d = torch.randperm(dev_layout.num_slots, generator=g)[:tokens].to(dev.torch_device)
        # correctness first: the pipeline moves what load moves, and those are the host's items
        for b in pool.buffers:
            b.view(torch.uint8).fill_(0xA5)
        host.load(pool, h, d, max_ctas=ctas)
        _sync(dev)
        want = _pool_bytes(pool)
        for b in pool.buffers:
            b.view(torch.uint8).fill_(0xA5)  # the same poison: unmoved bytes must stay it
        done = host.load_layers(pool, h, d, max_ctas=ctas)
        done.synchronize()
        _sync(dev)
        if not torch.equal(_pool_bytes(pool), want):
            raise SystemExit(f"{attention} {ctas} CTAs: load_layers moved other bytes than load")
        item = dev_layout.item_bytes
        host_bytes = host.buffer.reshape(-1).view(torch.uint8).cpu()
        for kv in range(dev_layout.num_kv):  # the host's items, by the layout's own byte offsets
            for layer in (0, layers - 1):
                got = pool.buffer(kv, layer).reshape(-1).view(torch.uint8).cpu().view(-1, item)[d.cpu()]
                for i, slot in enumerate(h.cpu().tolist()[:8]):
                    at = host_layout.byte_offset(slot // PAGE_SIZE, layer, kv, token=slot % PAGE_SIZE)
                    if not torch.equal(got[i], host_bytes[at:at + item]):
                        raise SystemExit(f"{attention}: kv {kv} layer {layer} slot {slot} is not the host's item")
        queue: list[float] = []
        waits: list[float] = []
        device_s: list[float] = []
        stream = torch.cuda.Stream(dev.ordinal) if dev.type == "cuda" else None
        for _ in range(calls):
            _sync(dev)
            start_ev = end_ev = None
            if stream is not None:
                start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_ev.record(stream)
            t0 = time.perf_counter()
            done = host.load_layers(pool, h, d, max_ctas=ctas,
                                    stream=None if stream is None else stream.cuda_stream)
            t1 = time.perf_counter()
            for layer in range(layers):
                done.wait(layer)
            t2 = time.perf_counter()
            if stream is not None and end_ev is not None and start_ev is not None:
                end_ev.record(stream)
                end_ev.synchronize()
                device_s.append(start_ev.elapsed_time(end_ev) / 1e3)
            queue.append((t1 - t0) * 1e6)
            waits.append((t2 - t1) * 1e6 / layers)
        _sync(dev)
        moved = tokens * dev_layout.num_kv * layers * item
        row: dict[str, Any] = {
            "attention": attention, "item_bytes": item, "layers": layers, "tokens": tokens, "max_ctas": 0 if ctas is pd.WHOLE_GPU else ctas,
            "queue_us": statistics.median(queue), "per_layer_us": statistics.median(queue) / layers,
            "wait_us": statistics.median(waits), "bytes": moved,
        }
        if device_s:
            bulk_src = torch.empty(moved, dtype=torch.uint8).pin_memory()
            bulk_dst = torch.empty(moved, dtype=torch.uint8, device=dev.torch_device)
            bulk: list[float] = []
            for _ in range(calls):
                ea, eb = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ea.record()
                bulk_dst.copy_(bulk_src, non_blocking=True)
                eb.record()
                eb.synchronize()
                bulk.append(ea.elapsed_time(eb) / 1e3)
            row["gbps"] = moved / statistics.median(device_s) / 1e9
            row["bulk_gbps"] = moved / statistics.median(bulk) / 1e9
            row["ratio"] = row["gbps"] / row["bulk_gbps"]
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emulated", action="store_true", help="run on the emulated device (CPU smoke test)")
    parser.add_argument("--calls", type=int, default=21, help="timed calls per row (median)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per request (default 4096, 64 emulated)")
    parser.add_argument("--json", default=None, help="write the rows here")
    opts = parser.parse_args()
    if opts.calls < 1:
        parser.error("--calls must be >= 1")
    dev = pd.Device("emulated", 0) if opts.emulated or not torch.cuda.is_available() else pd.Device("cuda", 0)
    tokens = opts.tokens or (64 if dev.type == "emulated" else 4096)
    rows = []
    for attention in ("mha", "mla"):
        for ctas in (1, 2, pd.WHOLE_GPU):
            rows.append(_row(dev, attention, 32, tokens, ctas, opts.calls))
    rows.append(_row(dev, "mla", 61, min(tokens, 256), 2, opts.calls))
    rows.append(_row(dev, "mla", 61, 1, 2, opts.calls))  # one token: the queueing cost alone (emulated: no copy to speak of)
    print(f"layer pipeline on {dev} (medians of {opts.calls} calls; host us, device GB/s)")
    print(f"{'shape':>6} {'item':>5} {'layers':>6} {'tokens':>6} {'ctas':>4} {'queue_us':>9} {'per_layer':>9} {'wait_us':>8}"
          f" {'GB/s':>7} {'bulk':>7} {'ratio':>6}")
    for r in rows:
        bw = (f" {r['gbps']:7.1f} {r['bulk_gbps']:7.1f} {r['ratio']:6.3f}" if "gbps" in r else "")
        print(f"{r['attention']:>6} {r['item_bytes']:5d} {r['layers']:6d} {r['tokens']:6d} {r['max_ctas'] or 'all':>4} {r['queue_us']:9.1f}"
              f" {r['per_layer_us']:9.2f} {r['wait_us']:8.2f}{bw}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
