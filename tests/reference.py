"""The tests' one reference model and one fill helper.

Everything expected in a test comes from plain torch indexing on the documented
one-buffer shapes (``KVLayout.buffer_shape``, ``docs/design.md``), never from the
library's own geometry:

* :func:`canonical` views any layout's one-buffer bytes as
  ``[kv, layer, page, tok, item_bytes]``;
* :func:`items` is the item of ``(kv, layer, slots)`` of a one-buffer tensor, and
  :func:`pool_items` the same for a :class:`pointerdomain.DeviceKVPool`;
* :func:`reference_transfer` is the destination a transfer of every layout and
  direction must leave (copied items and untouched bytes alike).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

import pointerdomain as pd
from pointerdomain import DeviceKVPool, KVLayout
from pointerdomain.testing import Backend, backend_for
from tests.helpers.models import SMALL

__all__ = [
    "DEV",
    "EMU",
    "as_bytes",
    "canonical",
    "fill_pool",
    "fill_random",
    "filled_pools",
    "items",
    "model_layout",
    "pool_bytes",
    "pool_items",
    "reference_transfer",
    "same",
    "table_storage",
]

#: The device the CPU tests run on.
DEV = pd.Device("emulated", 0)


def model_layout(kind: str = "layer_first", pages: int = 8, attention: str = "mha") -> KVLayout:
    """A small model: 3 layers, pages of 4 tokens, bf16 (MHA 2 x 16, MLA 1 x 40)."""
    return SMALL.layout(kind, pages, attention)


#: The emulated platform backend (raw registration, alias and allocation calls, as
#: another library sharing the process would make them).
EMU: Backend = backend_for(pd.Device("emulated", 0))


def fill_random(t: torch.Tensor, seed: int) -> None:
    """Random bytes from ``seed`` (a copy that did nothing shows); ``t`` on any device."""
    g = torch.Generator().manual_seed(seed)
    flat = t.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


def fill_pool(pool: DeviceKVPool, seed: int) -> None:
    """:func:`fill_random` on every buffer of a device pool (seeds ``seed``, ``seed + 1``, ...)."""
    for i, buffer in enumerate(pool.buffers):
        fill_random(buffer, seed + i)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of (a contiguous copy of) ``t``, on the CPU."""
    return t.contiguous().view(torch.uint8).cpu()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (random bytes make NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def canonical(flat: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``[kv, layers, pages, page_size, item_bytes]`` uint8 view of a one-buffer pool's
    bytes, from the documented one-buffer shapes."""
    kv, n_l, n_p, ps = layout.num_kv, layout.num_layers, layout.num_pages, layout.page_size
    ib = layout.num_heads * layout.head_dim * torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    flat = flat.view(torch.uint8).reshape(-1)
    if layout.kind == "layer_first":  # [kv, L, P*ps, h, d]
        return flat.view(kv, n_l, n_p, ps, ib)
    if layout.kind == "page_first":  # [kv, P*ps, L, h, d]
        return flat.view(kv, n_p, ps, n_l, ib).permute(0, 3, 1, 2, 4)
    return flat.view(kv, n_p, n_l, ps, ib).permute(0, 2, 1, 3, 4)  # [kv, P, L, ps, h, d]


def items(buffer: torch.Tensor, layout: KVLayout, kv: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Items ``[len(slots), heads, head_dim]`` of a one-buffer tensor of ``layout.buffer_shape``."""
    slots = slots.to(buffer.device)
    if layout.kind == "layer_first":
        return buffer[kv, layer][slots]
    if layout.kind == "page_first":
        return buffer[kv][slots][:, layer]
    return buffer[kv][slots // layout.page_size, layer, slots % layout.page_size]


def pool_items(pool: DeviceKVPool, kv: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Items ``[len(slots), heads, head_dim]`` of a device pool's per-layer buffer."""
    return pool.buffer(kv, layer)[slots.to(pool.buffer(kv, layer).device)]


@contextlib.contextmanager
def filled_pools(
    dev_layout: KVLayout, host_layout: KVLayout, device: pd.Device | str, *, chunk_blocks: int | None, seed: int
) -> Iterator[tuple[DeviceKVPool, pd.HostKVPool]]:
    """A device pool and a host pool (registered in chunks of ``chunk_blocks`` page blocks,
    or in one piece for None), both filled from ``seed``; the host pool closed on exit."""
    pool = DeviceKVPool(dev_layout, device)
    fill_pool(pool, seed)
    max_chunk = host_layout.page_block_bytes() * chunk_blocks if chunk_blocks else 1 << 40
    with pd.HostKVPool(host_layout, device, max_chunk_bytes=max_chunk) as host:
        assert (len(host.memory.chunks) > 1) == (chunk_blocks is not None)
        fill_random(host.buffer, seed + 10_000)
        yield pool, host


def pool_bytes(pool: DeviceKVPool) -> torch.Tensor:
    """A device pool's per-layer buffers as its one-buffer (``layer_first``) bytes, on the CPU."""
    return torch.cat([as_bytes(b).reshape(-1) for b in pool.buffers])


def reference_transfer(
    src: torch.Tensor, src_layout: KVLayout, dst: torch.Tensor, dst_layout: KVLayout,
    src_slots: torch.Tensor, dst_slots: torch.Tensor, layers: Iterable[int] | None = None,
) -> torch.Tensor:
    """The bytes ``dst`` (a one-buffer pool of ``dst_layout``) must hold after copying
    slots ``src_slots[i] -> dst_slots[i]`` of every kv and of ``layers`` (default all)
    from ``src`` (one-buffer, ``src_layout``); a flat uint8 CPU tensor. Any layouts, any
    direction: the memory kind does not enter the model."""
    expected = as_bytes(dst).reshape(-1).clone()
    want, have = canonical(expected, dst_layout), canonical(as_bytes(src), src_layout)
    s, d = src_slots.cpu(), dst_slots.cpu()
    ps = src_layout.page_size
    for layer in range(src_layout.num_layers) if layers is None else layers:
        want[:, layer, d // ps, d % ps] = have[:, layer, s // ps, s % ps]
    return expected


def table_storage(table: pd.PointerTable[pd.DeviceAlias]) -> torch.Tensor:
    """Fault injection: the table's own uint64 array (private). ``as_uint64_tensor()``
    returns a copy, so only a stray write from native code (a buggy kernel, memory
    corruption) can change what a launch reads; this stands in for that write."""
    return table._tensor


def page_slots(pages: list[int], page_size: int) -> torch.Tensor:
    """Token slots of whole pages, int64, in page order."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])


def page_items(pool: DeviceKVPool, pages: list[int]) -> dict[str, torch.Tensor]:
    """Raw bytes of every (kv, layer) item of ``pages``, in page order (the transfer-engine
    peers in child processes save these for the test to compare)."""
    idx = page_slots(pages, pool.layout.page_size)
    return {
        f"{kv}/{layer}": pool.buffer(kv, layer)[idx].contiguous().view(torch.uint8).clone()
        for kv in range(pool.layout.num_kv)
        for layer in range(pool.layout.num_layers)
    }
