"""GPU tests (run on the H200 by scripts/gpu-check; skipped without CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.helpers.checks import assert_graph_loads, assert_round_trip
from tests.helpers.models import Model
from tests.reference import as_bytes, fill_pool, fill_random, filled_pools, items, pool_items

pytestmark = pytest.mark.gpu


def _dev() -> pd.Device:
    return pd.Device("cuda", 0)


MODEL = Model(layers=4, page_size=16, mha=(8, 128), mla_dim=576)


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("chunked", [False, True])
def test_gpu_round_trip_matches_cpu_reference(kind: str, attention: str, chunked: bool) -> None:
    dev = _dev()
    dev_layout = MODEL.layout("layer_first", 24, attention)
    host_layout = MODEL.layout(kind, 40, attention)
    with filled_pools(dev_layout, host_layout, dev, chunk_blocks=7 if chunked else None, seed=0) as (pool, host):
        g = torch.Generator().manual_seed(1)
        dev_slots = torch.randperm(dev_layout.num_slots, generator=g)[:100]
        host_slots = torch.randperm(host_layout.num_slots, generator=g)[:100]
        saved = [as_bytes(b).clone() for b in pool.buffers]

        def load_per_layer() -> None:
            for layer in range(4):
                host.load_layer(pool, host_slots.cuda(), dev_slots.cuda(), layer)

        # D2H, then H2D per layer into a poisoned pool: moved items from the host, every other byte kept
        assert_round_trip(pool, host, dev_slots, host_slots, poison_seed=500, load=load_per_layer,
                          backup=lambda: host.backup(pool, dev_slots.cuda(), host_slots.cuda()),
                          sync=torch.cuda.synchronize)
        item = dev_layout.item_bytes
        fill_pool(pool, 900)
        host.load(pool, host_slots.cuda(), dev_slots.cuda(), max_ctas=2)
        torch.cuda.synchronize()
        for i, b in enumerate(pool.buffers):
            assert torch.equal(as_bytes(b).view(-1, item)[dev_slots], saved[i].view(-1, item)[dev_slots])


def test_gpu_graph_capture_and_replay() -> None:
    dev = _dev()
    dev_layout = MODEL.layout("layer_first", 16)
    host_layout = MODEL.layout("page_first", 32)
    pool = pd.DeviceKVPool(dev_layout, dev)
    with pd.HostKVPool(host_layout, dev) as host:
        fill_random(host.buffer, 3)
        src = torch.zeros(64, dtype=torch.int64, device="cuda")
        dst = torch.zeros(64, dtype=torch.int64, device="cuda")
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            host.load(pool, src, dst)
        assert_graph_loads(graph, pool, host, src, dst, replays=3)
        del graph  # a graph that captured the pool's launches holds it open (pointerdomain.transfer.graphs)


def test_gpu_host_table_rejected_and_no_sticky_error() -> None:
    dev = _dev()
    pool = pd.DeviceKVPool(MODEL.layout("layer_first", 4), dev)
    host_layout = MODEL.layout("page_first", 4)
    with pd.HostKVPool(host_layout, dev) as host:
        idx = torch.arange(4, device="cuda")
        with pytest.raises(errors.DomainError):
            pd.transfer_kv_all_layer(host.host_table, pool.table, idx, idx,  # type: ignore[arg-type]
                                     src_layout=host_layout, dst_layout=pool.layout)
        with pytest.raises(errors.IndexValidationError, match="on cpu"):  # the kernel reads indices on the GPU
            host.load(pool, idx.cpu(), idx, backend="kernel")
        with pytest.raises(errors.AlreadyRegisteredError):
            pd.register_host_tensor(host.memory.tensor[:4096], dev)
        # the failed registration left no pending CUDA error behind
        torch.cuda.synchronize()
        assert torch.ones(4, device="cuda").sum().item() == 4.0
    with pytest.raises(errors.DomainError):
        pd.host_ptr_table([torch.zeros(4, device="cuda")])


def test_gpu_direct_cuda_register_conflict_reports_712() -> None:
    dev = _dev()
    t = torch.empty(1 << 20, dtype=torch.uint8)
    with pd.register_host_tensor(t, dev):
        from pointerdomain.testing import backend_for

        backend = backend_for(dev)
        assert backend.register(t.data_ptr(), t.numel(), dev) == 712
        assert backend.can_use_host_pointer(dev) is not None  # the next runtime call succeeds: not sticky
    with pd.register_host_tensor(t, dev) as again:
        assert not again.closed


def test_gpu_stream_ordering_compute_then_offload() -> None:
    dev = _dev()
    dev_layout = MODEL.layout("layer_first", 64)
    host_layout = MODEL.layout("page_first", 64)
    pool = pd.DeviceKVPool(dev_layout, dev)
    compute, copy = torch.cuda.Stream(), torch.cuda.Stream()
    with pd.HostKVPool(host_layout, dev) as host:
        slots = torch.arange(dev_layout.num_slots, device="cuda")
        values = [torch.full(b.shape, float(i + 1), dtype=b.dtype, device="cuda") for i, b in enumerate(pool.buffers)]
        torch.cuda.synchronize()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(50_000_000)  # make the compute stream late
            for b, v in zip(pool.buffers, values):
                b.copy_(v * 2)
            done = torch.cuda.Event()
            done.record(compute)
        copy.wait_event(done)
        host.backup(pool, slots, slots, stream=copy.cuda_stream)
        copy.synchronize()
        for kv in range(2):
            for layer in range(4):
                got = items(host.buffer, host_layout, kv, layer, slots.cpu())
                assert bool((got == float(2 * (kv * 4 + layer + 1))).all())


def test_gpu_doctor_and_demo() -> None:
    doc = subprocess.run([sys.executable, "-m", "pointerdomain", "doctor", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert doc.returncode == 0, doc.stderr
    report = json.loads(doc.stdout)
    entry = report["devices"][0]
    assert entry["device"] == "cuda:0" and entry["self_test"]["ok"]
    attrs = entry["attributes"]
    assert attrs["CanUseHostPointerForRegisteredMem"] in (0, 1) and attrs["HostRegisterSupported"] == 1
    assert attrs["PageableMemoryAccess"] in (0, 1) and attrs["PageableMemoryAccessUsesHostPageTables"] in (0, 1)
    assert entry["pci_bus_id"] is not None and isinstance(entry["numa_node"]["value"], int)
    assert all(row["value"] == "works" for row in entry["ladder"] if row["name"] in ("rung: one call",
                                                                                    "rung: page-aligned chunks"))
    demo = subprocess.run([sys.executable, "-m", "pointerdomain", "demo"], capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "cuda:0" in demo.stdout and "verified byte-for-byte" in demo.stdout


@pytest.mark.parametrize("kind", ["layer_first", "page_first_direct", "page_first"])
@pytest.mark.parametrize("backend", ["copy_engine", "auto"])
@pytest.mark.parametrize("max_ctas", [1, 2, 4, pd.WHOLE_GPU])
def test_gpu_backends_and_budgets_match_reference(kind: str, backend: str, max_ctas: pd.MaxCtas) -> None:
    dev = _dev()
    dev_layout = MODEL.layout("layer_first", 24, "mla")
    host_layout = MODEL.layout(kind, 40, "mla")
    pool = pd.DeviceKVPool(dev_layout, dev)
    fill_pool(pool, 11)
    with pd.HostKVPool(host_layout, dev, max_chunk_bytes=host_layout.page_block_bytes() * 5) as host:
        fill_random(host.buffer, 12)
        g = torch.Generator().manual_seed(2)
        pages_d = torch.randperm(24, generator=g)[:10]
        pages_h = torch.randperm(40, generator=g)[:10]
        tok = torch.arange(16)
        d = (pages_d[:, None] * 16 + tok).reshape(-1)
        h = (pages_h[:, None] * 16 + tok).reshape(-1)
        host.backup(pool, d.cuda(), h.cuda(), backend=backend, max_ctas=max_ctas)
        torch.cuda.synchronize()
        for layer in range(4):
            assert torch.equal(as_bytes(items(host.buffer, host_layout, 0, layer, h)),
                               as_bytes(pool_items(pool, 0, layer, d)))
        fill_pool(pool, 99)
        host.load(pool, h.cuda(), d.cuda(), backend=backend, max_ctas=max_ctas)
        torch.cuda.synchronize()
        for layer in range(4):
            assert torch.equal(as_bytes(pool_items(pool, 0, layer, d)),
                               as_bytes(items(host.buffer, host_layout, 0, layer, h)))
