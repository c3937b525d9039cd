"""The layer pipeline on a GPU (run on the H200 by scripts/gpu-check; skipped without
CUDA): layers queued on a load stream, the model's stream waiting per layer, and the
whole pipeline captured into a graph."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from tests.helpers.checks import assert_graph_loads
from tests.helpers.models import Model
from tests.reference import as_bytes, fill_pool, fill_random, items, pool_items

pytestmark = pytest.mark.gpu

MODEL = Model(layers=8, page_size=16, mha=(8, 128), mla_dim=576)


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
