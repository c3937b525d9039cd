"""The layer pipeline on a GPU (run on the H200 by scripts/gpu-check; skipped without
CUDA): layers queued on a load stream, the model's stream waiting per layer, and the
whole pipeline captured into a graph."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
import torch

import pointerdomain as pd
from tests.helpers.checks import assert_graph_loads
from tests.helpers.models import Model
from tests.reference import as_bytes, fill_pool, fill_random, items, pool_items

pytestmark = pytest.mark.gpu

MODEL = Model(layers=8, page_size=16, mha=(8, 128), mla_dim=576)
DEADLINE_S = 30.0  # a flag never published would leave a stream waiting forever: fail instead


def _until(done: Callable[[], bool], what: str) -> None:
    """Poll ``done()`` (a stream's or a load's state) until true, or fail after DEADLINE_S."""
    end = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < end, f"{what} not done after {DEADLINE_S} s (a layer flag never published?)"
        time.sleep(1e-4)


@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engine"])
def test_gpu_layers_wait_per_layer_on_the_model_stream(backend: str) -> None:
    dev = pd.Device("cuda", 0)
    dev_layout = MODEL.layout("layer_first", 64)
    host_layout = MODEL.layout("page_first", 128)
    pool = pd.DeviceKVPool(dev_layout, dev)
    with pd.HostKVPool(host_layout, dev) as host:
        fill_random(host.buffer, 11)
        fill_pool(pool, 12)
        g = torch.Generator().manual_seed(0)
        h = torch.randperm(host_layout.num_slots, generator=g)[:256]
        d = torch.randperm(dev_layout.num_slots, generator=g)[:256]
        load_stream, model_stream = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        done = host.load_layers(pool, h.cuda(), d.cuda(), stream=load_stream.cuda_stream,
                                backend=backend)  # type: ignore[arg-type]
        seen: list[torch.Tensor] = []
        with torch.cuda.stream(model_stream):
            for layer in range(done.num_layers):
                done.wait(layer)  # the model stream (current here) waits for this layer only
                seen.append(torch.cat([pool_items(pool, kv, layer, d).clone() for kv in range(2)]))
        _until(model_stream.query, "the model stream's per-layer waits")
        model_stream.synchronize()
        assert all(done.ready(layer) for layer in range(done.num_layers))
        for layer, got in enumerate(seen):
            want = torch.cat([items(host.buffer, host_layout, kv, layer, h) for kv in range(2)])
            assert torch.equal(as_bytes(got), as_bytes(want)), f"layer {layer}"


def test_gpu_layer_pipeline_captured_and_replayed() -> None:
    dev = pd.Device("cuda", 0)
    dev_layout = MODEL.layout("layer_first", 16)
    host_layout = MODEL.layout("page_first", 32)
    pool = pd.DeviceKVPool(dev_layout, dev)
    with pd.HostKVPool(host_layout, dev) as host:
        fill_random(host.buffer, 3)
        src = torch.zeros(64, dtype=torch.int64, device="cuda")
        dst = torch.zeros(64, dtype=torch.int64, device="cuda")
        out = torch.zeros(MODEL.layers, dtype=torch.float32, device="cuda")
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            done = host.load_layers(pool, src, dst)
            for layer in range(done.num_layers):
                done.wait(layer)
                out[layer] = pool.buffer(0, layer).float().sum()
        assert_graph_loads(graph, pool, host, src, dst, replays=2)
        del graph  # a graph that captured the pool's launches holds it open (pointerdomain.transfer.graphs)


def _big_load(tokens: int = 4096) -> tuple[pd.DeviceKVPool, pd.HostKVPool, torch.Tensor, torch.Tensor]:
    """A device pool and an open host pool (random bytes), and ``tokens`` random slot pairs
    on the GPU: enough bytes that a load at 2 CTAs takes milliseconds."""
    dev = pd.Device("cuda", 0)
    dev_layout = MODEL.layout("layer_first", 2 * tokens // MODEL.page_size)
    host_layout = MODEL.layout("page_first", 4 * tokens // MODEL.page_size)
    pool = pd.DeviceKVPool(dev_layout, dev)
    host = pd.HostKVPool(host_layout, dev)
    fill_random(host.buffer, 21)
    fill_pool(pool, 22)
    g = torch.Generator().manual_seed(1)
    h = torch.randperm(host_layout.num_slots, generator=g)[:tokens].cuda()
    d = torch.randperm(dev_layout.num_slots, generator=g)[:tokens].cuda()
    return pool, host, h, d


def test_gpu_layers_become_ready_in_order() -> None:
    """Sampled while in flight, the ready layers are always a prefix (layer l + 1 is
    published only after every CTA passed layer l); all are ready after synchronize, and
    an earlier load on the stream stays ready after a later one (generations grow)."""
    pool, host, h, d = _big_load()
    with host:
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        first = host.load_layers(pool, h, d, stream=stream.cuda_stream, max_ctas=1)
        done = host.load_layers(pool, h, d, stream=stream.cuda_stream, max_ctas=1)
        assert done.generation == first.generation + 1
        seen: set[int] = set()
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            # last layer first: readiness only grows, so a later layer seen ready means every
            # earlier one read after it must be ready too
            ready = [done.ready(layer) for layer in reversed(range(done.num_layers))][::-1]
            count = sum(ready)
            assert ready == [True] * count + [False] * (done.num_layers - count), ready
            seen.add(count)
            if count == done.num_layers:
                break
        assert seen and max(seen) == done.num_layers, f"layers never all ready in {DEADLINE_S} s: {sorted(seen)}"
        done.synchronize()
        assert all(first.ready(layer) for layer in range(first.num_layers))
        assert len(seen) > 2, f"never saw the load in flight: {sorted(seen)}"
        torch.cuda.synchronize()
        for kv in range(2):
            for layer in range(MODEL.layers):
                assert torch.equal(as_bytes(pool_items(pool, kv, layer, d)),
                                   as_bytes(items(host.buffer, host.layout, kv, layer, h))), (kv, layer)


def test_gpu_captured_pipeline_orders_each_layers_consumer() -> None:
    """A graph with the load on one stream and, on a consumer stream forked BEFORE the
    load, per-layer waits each followed by a copy of the layer out of the pool. Every
    replay loads other bytes over a poisoned pool; a wait that let its copy run before the
    layer landed would read the poison."""
    pool, host, h, d = _big_load()
    with host:
        src = h.clone()
        dst = d.clone()
        n = src.numel()
        out = torch.zeros(MODEL.layers, 2, n, *pool.buffer(0, 0).shape[1:], dtype=pool.buffer(0, 0).dtype,
                          device="cuda")
        capture, load_stream, consumer = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=capture):
            consumer.wait_stream(capture)  # the consumer forks before the load is queued
            load_stream.wait_stream(capture)
            done = host.load_layers(pool, src, dst, stream=load_stream.cuda_stream, max_ctas=2)
            with torch.cuda.stream(consumer):
                for layer in range(done.num_layers):
                    done.wait(layer)
                    for kv in range(2):
                        out[layer, kv].copy_(pool.buffer(kv, layer)[dst])
            capture.wait_stream(consumer)
            capture.wait_stream(load_stream)
        assert done.generation == 0  # captured: one launch per layer, events, no flags
        for seed in range(4):
            g = torch.Generator().manual_seed(10 + seed)
            hs = torch.randperm(host.layout.num_slots, generator=g)[:n]
            ds = torch.randperm(pool.layout.num_slots, generator=g)[:n]
            src.copy_(hs)
            dst.copy_(ds)
            fill_random(host.buffer, 30 + seed)
            fill_pool(pool, 40 + seed)  # poison: a consumer that ran early reads these
            torch.cuda.synchronize()
            graph.replay()
            _until(torch.cuda.current_stream().query, "the replay")
            torch.cuda.synchronize()
            for layer in range(MODEL.layers):
                for kv in range(2):
                    want = items(host.buffer, host.layout, kv, layer, hs)
                    assert torch.equal(as_bytes(out[layer, kv]), as_bytes(want)), (seed, layer, kv)
                    assert torch.equal(as_bytes(pool_items(pool, kv, layer, ds)), as_bytes(want)), (seed, layer, kv)
        del graph  # holds the host pool open until destroyed


def test_gpu_queueing_61_layers_is_one_launch() -> None:
    """Host time of load_layers for a 61-layer request: one native call (a kernel launch
    and a few stream operations), so far below a launch per layer."""
    dev = pd.Device("cuda", 0)
    model = Model(layers=61, page_size=16, mha=(8, 128), mla_dim=576)
    dev_layout = model.layout("layer_first", 64, attention="mla")
    pool = pd.DeviceKVPool(dev_layout, dev)
    with pd.HostKVPool(model.layout("page_first", 128, attention="mla"), dev) as host:
        idx = torch.arange(256, device="cuda")
        stream = torch.cuda.Stream()
        host.load_layers(pool, idx, idx, stream=stream.cuda_stream, max_ctas=2).synchronize()  # warm
        times = []
        for _ in range(21):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            done = host.load_layers(pool, idx, idx, stream=stream.cuda_stream, max_ctas=2)
            times.append(time.perf_counter() - t0)
            _until(lambda: done.ready(done.num_layers - 1), "the load")
            done.synchronize()
        # one launch per layer would cost >= 61 bare launches (~5 us each) in every call: the
        # fastest call says which design ran; a median would read the machine's load
        assert min(times) < 300e-6, sorted(times)
