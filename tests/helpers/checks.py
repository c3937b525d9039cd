"""The round trip every transfer path must pass, checked against the reference model."""

from __future__ import annotations

from collections.abc import Callable

import torch

import pointerdomain as pd
from tests.reference import as_bytes, fill_pool, items, pool_bytes, pool_items, reference_transfer

__all__ = ["assert_graph_loads", "assert_round_trip"]


def assert_round_trip(
    pool: pd.DeviceKVPool, host: pd.HostKVPool, dev_slots: torch.Tensor, host_slots: torch.Tensor, *,
    poison_seed: int, backup: Callable[[], object] | None = None, load: Callable[[], object] | None = None,
    sync: Callable[[], object] = lambda: None,
) -> None:
    """D2H ``dev_slots -> host_slots`` then H2D back into the pool poisoned from
    ``poison_seed``, each destination compared byte for byte with
    :func:`tests.reference.reference_transfer` (moved items and every other byte); the
    device pool must be unchanged by the backup. ``backup`` / ``load`` run the copies
    (default: ``host.backup`` / ``host.load`` with the given slots), ``sync`` waits for them."""
    pool_before = pool_bytes(pool)
    expected = reference_transfer(pool_before, pool.layout, as_bytes(host.buffer).clone(), host.layout,
                                  dev_slots, host_slots)
    (backup or (lambda: host.backup(pool, dev_slots, host_slots)))()
    sync()
    assert torch.equal(as_bytes(host.buffer).reshape(-1), expected), "D2H: not the reference (moved items or the rest)"
    assert torch.equal(pool_bytes(pool), pool_before), "D2H changed its source"
    fill_pool(pool, poison_seed)
    expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, host_slots, dev_slots)
    (load or (lambda: host.load(pool, host_slots, dev_slots)))()
    sync()
    assert torch.equal(pool_bytes(pool), expected), "H2D: not the reference (moved items or the rest)"


def assert_graph_loads(graph: torch.cuda.CUDAGraph, pool: pd.DeviceKVPool, host: pd.HostKVPool,
                       src: torch.Tensor, dst: torch.Tensor, *, replays: int) -> None:
    """``graph`` captured an H2D load of host slots ``src`` into pool slots ``dst`` (int64
    CUDA tensors of one length). Replay ``replays`` times, each with new random slots
    written into ``src`` / ``dst`` in place and the pool poisoned first: every moved item of
    every kv and layer must equal the host's item (plain torch indexing)."""
    for seed in range(replays):
        g = torch.Generator().manual_seed(seed)
        hs = torch.randperm(host.layout.num_slots, generator=g)[:src.numel()]
        ds = torch.randperm(pool.layout.num_slots, generator=g)[:dst.numel()]
        src.copy_(hs)
        dst.copy_(ds)
        fill_pool(pool, 40 * seed)
        graph.replay()
        torch.cuda.synchronize()
        for kv in range(pool.layout.num_kv):
            for layer in range(pool.layout.num_layers):
                assert torch.equal(as_bytes(pool_items(pool, kv, layer, ds)),
                                   as_bytes(items(host.buffer, host.layout, kv, layer, hs))), (seed, kv, layer)
