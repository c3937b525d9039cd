"""Reference views of KV buffers for tests: the item of (kv, layer, slot) as a
plain torch index into the one-buffer tensor, so expected bytes come from torch."""

from __future__ import annotations

import torch

import pointerdomain as pd
from pointerdomain import DeviceKVPool, KVLayout
from pointerdomain._platform import Backend, backend_for

#: The emulated platform backend (raw registration, alias and allocation calls, as
#: another library sharing the process would make them).
EMU: Backend = backend_for(pd.Device("emulated", 0))


def items(buffer: torch.Tensor, layout: KVLayout, kv: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Items ``[len(slots), heads, head_dim]`` of a one-buffer tensor of ``layout.buffer_shape``."""
    slots = slots.to(buffer.device)
    if layout.kind == "layer_first":
        return buffer[kv, layer][slots]
    if layout.kind == "page_first":
        return buffer[kv][slots][:, layer]
    return buffer[kv][slots // layout.page_size, layer, slots % layout.page_size]


def pool_items(pool: DeviceKVPool, kv: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
    return pool.buffer(kv, layer)[slots.to(pool.buffer(kv, layer).device)]


def fill_random(t: torch.Tensor, seed: int) -> None:
    """Random bytes (never zeros, so a copy that did nothing shows)."""
    g = torch.Generator().manual_seed(seed)
    flat = t.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def table_storage(table: pd.PointerTable[pd.DeviceAlias]) -> torch.Tensor:
    """Fault injection: the table's own uint64 array (private). ``as_uint64_tensor()``
    returns a copy, so only a stray write from native code (a buggy kernel, memory
    corruption) can change what a launch reads; this stands in for that write."""
    return table._tensor
