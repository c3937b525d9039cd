"""The engines' call shapes keep their parameter types statically: a typed table where
the engine passes a tensor, a string where an int goes, or a missing argument is an error."""

from __future__ import annotations

import torch

from pointerdomain import DeviceAlias, PointerTable
from pointerdomain.compat import lmcache, sgl_kernel, vllm


def calls(t: torch.Tensor, table: PointerTable[DeviceAlias], idx: torch.Tensor) -> None:
    sgl_kernel.transfer_kv_all_layer_lf_pf(table, t, table, t, idx, idx, 64, 128, 2)  # type: ignore[arg-type]
    sgl_kernel.transfer_kv_per_layer_pf_lf(t, t, t, t, idx, idx, 0, "64", 128)  # type: ignore[arg-type]
    sgl_kernel.transfer_kv_all_layer(t, t, t, t, idx, idx, 64)  # type: ignore[call-arg]
    lmcache.multi_layer_kv_transfer([t], t, idx, "cuda:0", 8, 1, 1)  # type: ignore[arg-type]
    vllm.swap_blocks(t, t, "128", idx)  # type: ignore[arg-type]
