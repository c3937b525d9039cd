"""The Triton kernel of tests/transfer/test_triton_gpu.py and tests/transfer/test_triton_interpret.py: it
loads pointers from kernel tables and moves KV items from a page_first host pool into a
layer_first device pool. Imported only where triton is installed."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["load_pages"]


@triton.jit
def load_pages(
    host_table,                 # int64 [1]: device alias of the host pool (page_first, one registration chunk)
    dev_table,                  # int64 [num_kv * num_layers]: device buffers, layer_first
    host_slots,                 # int64 [n]: token slots in the host pool
    dev_slots,                  # int64 [n]: token slots in the device pool
    NUM_LAYERS: tl.constexpr,
    HOST_SLOTS: tl.constexpr,   # token slots of the host pool
    ITEM_BYTES: tl.constexpr,   # num_heads * head_dim * element size
    BLOCK: tl.constexpr,        # bytes per step, a power of two
):
    tok = tl.program_id(0)
    kl = tl.program_id(1)       # kv * NUM_LAYERS + layer: the device table entry
    kv = kl // NUM_LAYERS
    layer = kl % NUM_LAYERS
    hs = tl.load(host_slots + tok)
    ds = tl.load(dev_slots + tok)
    host_base = tl.load(host_table).to(tl.pointer_type(tl.uint8))
    dev_base = tl.load(dev_table + kl).to(tl.pointer_type(tl.uint8))
    # page_first host buffer: [num_kv, HOST_SLOTS, NUM_LAYERS, heads, dim]; int64 offsets
    src = host_base + ((kv * HOST_SLOTS + hs) * NUM_LAYERS + layer) * ITEM_BYTES
    dst = dev_base + ds * ITEM_BYTES
    for start in tl.static_range(0, ITEM_BYTES, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ITEM_BYTES
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
