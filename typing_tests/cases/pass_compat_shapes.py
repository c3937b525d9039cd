"""The engines' call shapes in pointerdomain.compat type-check as the engines call them
(tensors, raw uint64 tables, ints), and run: an sglang backup with raw tables, an LMCache
multi-layer transfer and a vLLM block swap on the emulated device."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

import pointerdomain as pd
from pointerdomain.compat import lmcache, sgl_kernel, vllm

dev = pd.Device("emulated", 0)
layers, slots, item = 2, 8, 64
k = [pd.device_empty((slots, item), torch.uint8, dev) for _ in range(layers)]
v = [pd.device_empty((slots, item), torch.uint8, dev) for _ in range(layers)]


def on_device(ts: list[torch.Tensor]) -> torch.Tensor:
    values = torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    return pd.device_empty((len(ts),), torch.uint64, dev).copy_(values)


mem = pd.alloc_registered(2 * slots * layers * item, dev)
host = mem.tensor.view(2, slots, layers * item)
idx = torch.tensor([1, 3])
assert_type(sgl_kernel.transfer_kv_all_layer_lf_pf(on_device(k), host[0], on_device(v), host[1], idx, idx, item,
                                                   layers * item, layers), None)

caches = [pd.device_empty((2, 2, 4, 1, 32), torch.uint8, dev) for _ in range(layers)]
ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
obj = pd.device_empty((2, layers, 3, 32), torch.uint8, dev)
assert_type(lmcache.multi_layer_kv_transfer(obj, ptrs, torch.tensor([0, 5, 6]), dev, 8, 1, 1, 4), None)

blocks = pd.device_empty((4, 128), torch.uint8, dev)
other = pd.device_empty((4, 128), torch.uint8, dev)
assert_type(vllm.swap_blocks(blocks, other, 128, torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)), None)
mem.close()
