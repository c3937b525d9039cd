"""CUDA: a destination slot given twice in CUDA indices (never read on the host) is found
by the launch's validation pass on the device before any byte is written; the copy writes
nothing and check_errors / synchronize raise OverlapError (pointerdomain.transfer.launch_errors).
Graph capture and replay included. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import fill_pool, fill_random, model_layout, pool_bytes, reference_transfer, same

pytestmark = pytest.mark.gpu

POISON = 0x5A


def _dev() -> pd.Device:
    return pd.Device("cuda", 0)


def _poisoned_host(layout: pd.KVLayout) -> pd.HostKVPool:
    host = pd.HostKVPool(layout, _dev())
    host.buffer.view(torch.uint8).fill_(POISON)
    return host


def test_gpu_duplicate_destination_writes_nothing() -> None:
    dev = _dev()
    pd.synchronize(dev)
    pool = pd.DeviceKVPool(model_layout(), dev)
    fill_pool(pool, 71)
    with _poisoned_host(model_layout("page_first")) as host:
        s = torch.tensor([0, 1, 2, 3], device="cuda")
        d = torch.tensor([8, 9, 8, 10], device="cuda")
        host.backup(pool, s, d, backend="kernel")  # no host check: the device's pass finds slot 8 twice
        with pytest.raises(errors.OverlapError, match="destination slot twice"):
            pd.synchronize(dev)
        assert bool(torch.all(host.buffer.view(torch.uint8) == POISON))  # not one byte
        pd.check_errors(dev)
        d = torch.tensor([8, 9, 11, 10], device="cuda")
        host.backup(pool, s, d, backend="kernel")
        pd.synchronize(dev)
        poisoned = host.buffer.clone()
        poisoned.view(torch.uint8).fill_(POISON)
        want = reference_transfer(pool_bytes(pool), pool.layout, poisoned, host.layout, s.cpu(), d.cpu())
        assert same(host.buffer.reshape(-1).view(torch.uint8), want)
        # H2D into a device pool, and a duplicate across the whole index range
        before = pool_bytes(pool)
        n = 2000
        src = torch.arange(n, device="cuda") % host.layout.num_slots
        dst = torch.randperm(pool.layout.num_slots, device="cuda")[: n // 2].repeat(2)
        host.load(pool, src[: dst.numel()], dst, backend="kernel", max_ctas=pd.WHOLE_GPU)
        with pytest.raises(errors.OverlapError):
            pd.synchronize(dev)
        assert same(pool_bytes(pool), before)


def test_gpu_device_to_device_and_split_items() -> None:
    """The launch without leases (device pools only) and a page_head destination (parts)."""
    dev = _dev()
    pd.synchronize(dev)
    a, b = pd.DeviceKVPool(model_layout(), dev), pd.DeviceKVPool(model_layout(), dev)
    fill_pool(a, 72)
    fill_pool(b, 73)
    before = pool_bytes(b)
    pd.transfer_kv_all_layer(a.table, b.table, torch.tensor([1, 2], device="cuda"), torch.tensor([5, 5], device="cuda"),
                             src_layout=a.layout, dst_layout=b.layout)
    with pytest.raises(errors.OverlapError):
        pd.synchronize(dev)
    assert same(pool_bytes(b), before)
    with _poisoned_host(model_layout("page_head")) as host:
        host.backup(a, torch.tensor([0, 1, 2], device="cuda"), torch.tensor([4, 6, 4], device="cuda"))
        with pytest.raises(errors.OverlapError):
            pd.synchronize(dev)
        assert bool(torch.all(host.buffer.view(torch.uint8) == POISON))


def test_gpu_duplicate_in_a_graph_replay() -> None:
    """Captured: the validation pass is in the graph (no host sync); a replay with a
    duplicate written into the static index tensor copies nothing, the next one copies."""
    dev = _dev()
    pd.synchronize(dev)
    pool = pd.DeviceKVPool(model_layout(), dev)
    fill_pool(pool, 74)
    with _poisoned_host(model_layout("page_first")) as host:
        static_s = torch.tensor([0, 1, 2], device="cuda")
        static_d = torch.tensor([3, 4, 5], device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            host.backup(pool, static_s, static_d, backend="kernel")  # warm-up: plan, this stream's scratch
        torch.cuda.synchronize()
        pd.check_errors(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            host.backup(pool, static_s, static_d, backend="kernel")
        snap = host.buffer.clone()
        static_d.copy_(torch.tensor([7, 9, 7], device="cuda"))
        graph.replay()
        with pytest.raises(errors.OverlapError):
            pd.check_errors(dev)
        assert same(host.buffer, snap)
        static_d.copy_(torch.tensor([7, 9, 8], device="cuda"))
        graph.replay()
        pd.check_errors(dev)
        want = reference_transfer(pool_bytes(pool), pool.layout, snap, host.layout, static_s.cpu(), static_d.cpu())
        assert same(host.buffer.reshape(-1).view(torch.uint8), want)
        # eager launches on another stream while the graph replays: no false duplicate
        other = torch.cuda.Stream()
        fill_random(host.buffer, 75)
        for _ in range(20):
            graph.replay()
            with torch.cuda.stream(other):
                host.backup(pool, torch.tensor([10, 11], device="cuda"), torch.tensor([20, 21], device="cuda"),
                            backend="kernel")
        torch.cuda.synchronize()
        pd.check_errors(dev)
        del graph


def test_gpu_streams_do_not_share_scratch() -> None:
    """Launches on several streams at once, each with distinct destinations (the same slots
    on each stream, different pools): no launch sees another's marks."""
    dev = _dev()
    pd.synchronize(dev)
    pool = pd.DeviceKVPool(model_layout(), dev)
    fill_pool(pool, 76)
    hosts = [_poisoned_host(model_layout("page_first")) for _ in range(3)]
    streams = [torch.cuda.Stream() for _ in hosts]
    s = torch.arange(16, device="cuda")
    d = torch.arange(16, device="cuda").flip(0).contiguous()
    torch.cuda.synchronize()
    for _ in range(30):
        for host, stream in zip(hosts, streams):
            with torch.cuda.stream(stream):
                host.backup(pool, s, d, backend="kernel")
    torch.cuda.synchronize()
    pd.check_errors(dev)
    for host in hosts:
        poisoned = host.buffer.clone()
        poisoned.view(torch.uint8).fill_(POISON)
        want = reference_transfer(pool_bytes(pool), pool.layout, poisoned, host.layout, s.cpu(), d.cpu())
        assert same(host.buffer.reshape(-1).view(torch.uint8), want)
        host.close()


def test_gpu_layer_pipeline_duplicate_destination_writes_nothing() -> None:
    """The layer pipeline's one native call runs the same validation pass ahead of its
    layers kernel: a slot given twice copies no layer, every layer's flag is still
    published (a wait never hangs), and the device's error word raises OverlapError."""
    dev = _dev()
    pd.synchronize(dev)
    pool = pd.DeviceKVPool(model_layout(), dev)
    fill_pool(pool, 74)
    with pd.HostKVPool(model_layout("page_first"), dev) as host:
        fill_random(host.buffer, 75)
        before = pool_bytes(pool)
        load = host.load_layers(pool, torch.tensor([0, 1, 2], device="cuda"), torch.tensor([6, 7, 6], device="cuda"),
                                backend="kernel")
        consumer = torch.cuda.Stream()
        for layer in range(pool.layout.num_layers):
            load.wait(layer, consumer.cuda_stream)
        consumer.synchronize()
        with pytest.raises(errors.OverlapError):
            pd.synchronize(dev)
        assert same(pool_bytes(pool), before)
        pd.check_errors(dev)
        # the same call without the duplicate moves every layer
        s, d = torch.tensor([0, 1, 2], device="cuda"), torch.tensor([6, 7, 8], device="cuda")
        load = host.load_layers(pool, s, d, backend="kernel")
        load.synchronize()
        pd.synchronize(dev)
        want = reference_transfer(host.buffer, host.layout, before.clone(), pool.layout, s.cpu(), d.cpu())
        assert same(pool_bytes(pool), want)
