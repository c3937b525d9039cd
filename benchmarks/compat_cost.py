"""Host cost of the engines' call shapes (:mod:`pointerdomain.compat`) over the direct API,
measured in one run.

    python3 -m benchmarks.compat_cost [--calls N] [--json OUT] [--emulated]

Each row: one compat entry point called as its engine calls it (upstream defaults, the
engine's own buffers and raw ``data_ptr()`` tables, built once as a pool builds them),
against the direct call that does the same transfer with tables and layouts built once
(:func:`pointerdomain.transfer_kv_all_layer` / ``_per_layer``). Both are checked first,
byte for byte against each other on poisoned destinations. Median host microseconds per
call; ``over`` is what the translation and the raw-address checks cost once the tables
are cached (the goal: <= 1 us). Shapes: 32 layers, 16 tokens, bf16; MHA 8 x 128 (2 KiB
items), LMCache's vLLM flash-attention format with 16-token blocks. ``--emulated`` runs
the same rows on the CPU's emulated device (a smoke test: CPU figures, not the goal's).
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
from pointerdomain.compat import lmcache as lmc
from pointerdomain.compat import sgl_kernel as sgl
from pointerdomain.compat import vllm as vll

LAYERS, TOKENS, HEADS, DIM = 32, 16, 8, 128
DTYPE = torch.bfloat16


def _sync(dev: pd.Device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _median_us(fn: Callable[[], None], calls: int, dev: pd.Device) -> float:
    for _ in range(min(200, calls)):
        fn()
    _sync(dev)
    times: list[int] = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        if i % 128 == 127:
            _sync(dev)
    _sync(dev)
    return statistics.median(times) / 1e3


def _same(label: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if not torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()):
        raise RuntimeError(f"{label}: the compat call and the direct call moved different bytes")


def _sgl_cases(dev: pd.Device) -> dict[str, tuple[Callable[[], None], Callable[[], None], Callable[[], None]]]:
    """sglang HiCache: the all-layer backup lf_pf (raw uint64 tables of per-layer device
    buffers, kept in device memory as sglang keeps them) and the per-layer load pf_lf, at
    kvcacheio's defaults (block_quota 2), against the same transfer through the typed API."""
    slots = 64 * 16
    k = [pd.device_empty((slots, HEADS, DIM), DTYPE, dev) for _ in range(LAYERS)]
    v = [pd.device_empty((slots, HEADS, DIM), DTYPE, dev) for _ in range(LAYERS)]
    for b in k + v:
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8))
    host_layout = pd.KVLayout(kind="page_first", num_layers=LAYERS, num_pages=2 * slots, page_size=1,
                              num_heads=HEADS, head_dim=DIM, dtype="bfloat16")
    host = pd.HostKVPool(host_layout, dev)
    dev_layout = host_layout.replace(kind="layer_first", num_pages=slots)
    item = HEADS * DIM * 2

    def table(ts: list[torch.Tensor]) -> torch.Tensor:
        values = torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
        return pd.device_empty((len(ts),), torch.uint64, dev).copy_(values)

    k_ptrs, v_ptrs = table(k), table(v)
    on = k[0].device
    s_idx = torch.randperm(slots)[:TOKENS].to(on)
    d_idx = torch.randperm(2 * slots)[:TOKENS].to(on)
    src = pd.make_kernel_ptr_table(k + v, dev, layout=dev_layout)
    layer = LAYERS // 2

    def backup() -> None:
        sgl.transfer_kv_all_layer_lf_pf(k_ptrs, host.buffer[0], v_ptrs, host.buffer[1], s_idx, d_idx, item,
                                        LAYERS * item, LAYERS)

    def backup_direct() -> None:
        pd.transfer_kv_all_layer(src, host.kernel_table, s_idx, d_idx, src_layout=dev_layout, dst_layout=host_layout,
                                 max_ctas=2, backend="kernel")

    def load() -> None:
        sgl.transfer_kv_per_layer_pf_lf(host.buffer[0], k[layer], host.buffer[1], v[layer], d_idx, s_idx, layer, item,
                                        LAYERS * item)

    def load_direct() -> None:
        pd.transfer_kv_per_layer(host.kernel_table, src, d_idx, s_idx, layer_id=layer, src_layout=host_layout,
                                 dst_layout=dev_layout, max_ctas=2, backend="kernel")

    def check_backup() -> None:
        host.buffer.view(torch.uint8).fill_(0xA5)
        backup()
        _sync(dev)
        got = host.buffer.clone()
        host.buffer.view(torch.uint8).fill_(0xA5)
        backup_direct()
        _sync(dev)
        _same("sgl_kernel.transfer_kv_all_layer_lf_pf", got, host.buffer)

    def check_load() -> None:
        for b in (k[layer], v[layer]):
            b.view(torch.uint8).fill_(0xA5)
        load()
        _sync(dev)
        got = torch.stack([k[layer].clone(), v[layer].clone()])
        for b in (k[layer], v[layer]):
            b.view(torch.uint8).fill_(0xA5)
        load_direct()
        _sync(dev)
        _same("sgl_kernel.transfer_kv_per_layer_pf_lf", got, torch.stack([k[layer], v[layer]]))

    return {
        "sgl_kernel.transfer_kv_all_layer_lf_pf": (backup, backup_direct, check_backup),
        "sgl_kernel.transfer_kv_per_layer_pf_lf": (load, load_direct, check_load),
    }


def _lmcache_case(dev: pd.Device, idx_dev: pd.Device | str) -> tuple[Callable[[], None], Callable[[], None],
                                                                    Callable[[], None]]:
    """LMCache multi_layer_kv_transfer, D2H, format 1 (vLLM flash attention), 16-token blocks."""
    blocks, bs = 64, 16
    caches = [pd.device_empty((2, blocks, bs, HEADS, DIM), DTYPE, dev) for _ in range(LAYERS)]
    for c in caches:
        c.view(torch.uint8).copy_(torch.randint(0, 256, (c.numel() * 2,), dtype=torch.uint8).view(c.view(torch.uint8).shape))
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)  # as LMCache's connector builds it
    mem = pd.alloc_registered(2 * LAYERS * TOKENS * HEADS * DIM * 2, dev)
    obj = mem.tensor.view(DTYPE).view(2, LAYERS, TOKENS, HEADS * DIM)
    slots = torch.randperm(blocks * bs)[:TOKENS].to(torch.int64)
    slots = slots if idx_dev == "cpu" else slots.to(caches[0].device)
    # direct: the same bytes as one all-layer transfer over tables built once
    dev_layout = pd.KVLayout(kind="layer_first", num_layers=LAYERS, num_pages=blocks, page_size=bs, num_heads=HEADS,
                             head_dim=DIM, dtype="bfloat16")
    obj_layout = dev_layout.replace(num_pages=TOKENS // bs)  # layouts agree on page_size: TOKENS is a multiple
    src = pd.make_kernel_ptr_table([c[kv] for kv in range(2) for c in caches], dev, layout=dev_layout)
    dst = pd.make_kernel_ptr_table([obj], dev, layout=obj_layout)
    ar = torch.arange(TOKENS, dtype=torch.int64, device=slots.device)

    def compat() -> None:
        lmc.multi_layer_kv_transfer(obj, ptrs, slots, caches[0].device, blocks * bs, 1, 1, bs)

    def direct() -> None:
        pd.transfer_kv_all_layer(src, dst, slots, ar, src_layout=dev_layout, dst_layout=obj_layout,
                                 max_ctas=pd.WHOLE_GPU, backend="kernel")

    def check() -> None:
        obj.view(torch.uint8).fill_(0xA5)
        compat()
        _sync(dev)
        got = obj.clone()
        obj.view(torch.uint8).fill_(0xA5)
        direct()
        _sync(dev)
        _same("lmcache.multi_layer_kv_transfer", got, obj)

    return compat, direct, check


def _vllm_case(dev: pd.Device) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """vLLM swap_blocks_batch as its CPU offloading worker calls it: per block and KV tensor
    one (src, dst, size) descriptor, GPU blocks -> pinned/registered CPU blocks (16 blocks x 64 tensors)."""
    blocks, block_bytes, tensors, moved = 64, 16 * HEADS * DIM * 2, 2 * LAYERS, 16
    gpu = [pd.device_empty((blocks, block_bytes), torch.uint8, dev) for _ in range(tensors)]
    for g in gpu:
        g.copy_(torch.randint(0, 256, g.shape, dtype=torch.uint8))
    mem = pd.alloc_registered(tensors * blocks * block_bytes, dev, granularity=block_bytes)
    cpu = mem.tensor.view(tensors, blocks, block_bytes)
    s_ids, d_ids = torch.randperm(blocks)[:moved], torch.randperm(blocks)[:moved]
    src_ptrs = torch.tensor([g.data_ptr() + int(b) * block_bytes for g in gpu for b in s_ids], dtype=torch.int64)
    dst_ptrs = torch.tensor([cpu[t].data_ptr() + int(b) * block_bytes for t in range(tensors) for b in d_ids],
                            dtype=torch.int64)
    sizes = torch.full((tensors * moved,), block_bytes, dtype=torch.int64)
    layout = pd.KVLayout(kind="layer_first", num_layers=1, num_pages=blocks, page_size=1, num_heads=1,
                         head_dim=block_bytes, dtype="uint8", attention="mla")
    src_tables = [pd.make_kernel_ptr_table([g], dev, layout=layout) for g in gpu]
    dst_tables = [pd.make_kernel_ptr_table([cpu[t]], dev, layout=layout) for t in range(tensors)]
    s_idx, d_idx = s_ids.to(torch.int64), d_ids.to(torch.int64)

    def compat() -> None:
        vll.swap_blocks_batch(src_ptrs, dst_ptrs, sizes)

    def direct() -> None:  # the typed API: one copy-engine transfer per KV tensor
        for s, d in zip(src_tables, dst_tables):
            pd.transfer_kv_all_layer(s, d, s_idx, d_idx, src_layout=layout, dst_layout=layout, backend="copy_engine")

    def check() -> None:
        cpu.fill_(0xA5)
        compat()
        _sync(dev)
        got = cpu.clone()
        cpu.fill_(0xA5)
        direct()
        _sync(dev)
        _same("vllm.swap_blocks_batch", got, cpu)

    return compat, direct, check


def measure(calls: int, dev: pd.Device) -> list[dict[str, Any]]:
    """The rows (see the module docstring)."""
    torch.manual_seed(0)
    cases: dict[str, tuple[Callable[[], None], Callable[[], None], Callable[[], None]]] = {
        **_sgl_cases(dev),
        "lmcache.multi_layer_kv_transfer (CPU slot_mapping)": _lmcache_case(dev, "cpu"),
        "lmcache.multi_layer_kv_transfer (device slot_mapping)": _lmcache_case(dev, "device"),
        "vllm.swap_blocks_batch (1024 descriptors)": _vllm_case(dev),
    }
    rows = []
    for label, (compat, direct, check) in cases.items():
        check()
        c, d = _median_us(compat, calls, dev), _median_us(direct, calls, dev)
        rows.append(dict(entry=label, compat_us=c, direct_us=d, over_us=c - d))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compat_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per row (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--emulated", action="store_true", help="run on the emulated device (smoke test)")
    args = ap.parse_args(argv)
    if args.emulated:
        dev = pd.Device("emulated", 0)
    elif torch.cuda.is_available():
        dev = pd.Device("cuda", 0)
    else:
        print("compat_cost: no CUDA device (pass --emulated for the CPU smoke run)")
        return 0
    rows = measure(args.calls, dev)
    print(f"{'entry point (' + str(dev) + ')':58s} {'compat us':>10s} {'direct us':>10s} {'over':>8s}")
    for r in rows:
        print(f"{r['entry']:58s} {r['compat_us']:10.2f} {r['direct_us']:10.2f} {r['over_us']:+8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
