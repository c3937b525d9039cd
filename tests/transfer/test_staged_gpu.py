"""GPU tests of the staged copy-engine path (``backend="staged"``, src/kernels/staged_gpu.cu;
run on the H200 by scripts/gpu-check; skipped without CUDA). Every check is a byte compare
of the whole destination (moved items and untouched bytes) against tests/reference.py, on a
destination filled with random bytes first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors, staged
from pointerdomain.testing import FaultyBackend, LaunchArgs, StagingArgs, backend_for, install_backend
from pointerdomain.transfer.plan import plan_for
from tests.helpers.models import Model
from tests.reference import as_bytes, fill_pool, fill_random, filled_pools, pool_bytes, reference_transfer

pytestmark = pytest.mark.gpu

#: 64 KiB of ring tables and 2 ring slots of 64 KiB: 8 (MHA 1 KiB) or 14 (MLA 1152 B) slots a
#: chunk of 4 layers, so 300 slots are 22-38 chunks and the ring wraps many times.
SMALL_STAGING = (64 << 10) + 2 * (64 << 10)
#: (host layout, page_size): the layouts whose slot holds its layers in one block.
HOSTS = [("page_first", 16), ("page_first_direct", 1)]


def _dev() -> pd.Device:
    return pd.Device("cuda", 0)


MODEL = Model(layers=4, page_size=16, mha=(8, 64), mla_dim=576)  # 1 KiB MHA, 1152 B MLA items (bf16)


@pytest.fixture(autouse=True)
def _default_staging() -> Iterator[None]:
    yield
    torch.cuda.synchronize()
    staged.set_staging(_dev())


def _slots(num_slots: int, page_size: int, n: int, seed: int, order: str) -> torch.Tensor:
    """n random slots: whole pages in random order ("pages": runs of consecutive slots) or
    tokens in random order ("tokens")."""
    g = torch.Generator().manual_seed(seed)
    if order == "tokens":
        return torch.randperm(num_slots, generator=g)[:n]
    pages = torch.randperm(num_slots // page_size, generator=g)
    return (pages.view(-1, 1) * page_size + torch.arange(page_size)).reshape(-1)[:n]


@pytest.mark.parametrize("host_kind,page_size", HOSTS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("order", ["pages", "tokens"])
@pytest.mark.parametrize("staging", ["small", "default"])
def test_staged_d2h_and_h2d_match_the_reference(host_kind: str, page_size: int, attention: str, chunked: bool,
                                                order: str, staging: str) -> None:
    dev = _dev()
    if staging == "small":
        staged.set_staging(dev, nbytes=SMALL_STAGING, ring=2)
    dev_layout = MODEL.layout("layer_first", 512 // page_size, attention, page_size=page_size)
    host_layout = MODEL.layout(host_kind, 768 // page_size, attention, page_size=page_size)
    with filled_pools(dev_layout, host_layout, dev, chunk_blocks=8 if chunked else None, seed=0) as (pool, host):
        d = _slots(dev_layout.num_slots, page_size, 300, 1, order)
        h = _slots(host_layout.num_slots, page_size, 300, 2, order)
        # D2H into the random (poisoned) host pool
        expected = reference_transfer(pool_bytes(pool), dev_layout, host.buffer, host_layout, d, h)
        host.backup(pool, d.cuda(), h.cuda(), backend="staged", max_ctas=2)
        torch.cuda.synchronize()
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected), "D2H: not the reference"
        # H2D into a poisoned device pool
        fill_pool(pool, 77)
        expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, h, d)
        host.load(pool, h.cuda(), d.cuda(), backend="staged", max_ctas=2)
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes(pool), expected), "H2D: not the reference"


@pytest.mark.parametrize("where", [("cpu", "cpu"), ("cpu", "cuda"), ("cuda", "cpu")])
def test_staged_takes_cpu_indices_without_a_sync_and_moves_the_reference(where: tuple[str, str]) -> None:
    """Either index set may be a CPU tensor (host side, device side): same bytes as with
    CUDA indices; the device pool's CPU indices are uploaded on the launch stream."""
    dev = _dev()
    staged.set_staging(dev, nbytes=SMALL_STAGING, ring=2)
    host_at, dev_at = where
    dev_layout, host_layout = MODEL.layout("layer_first", 32), MODEL.layout("page_first", 48)
    with filled_pools(dev_layout, host_layout, dev, chunk_blocks=8, seed=6) as (pool, host):
        d = _slots(dev_layout.num_slots, 16, 300, 11, "tokens")
        h = _slots(host_layout.num_slots, 16, 300, 12, "pages")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        expected = reference_transfer(pool_bytes(pool), dev_layout, host.buffer, host_layout, d, h)
        host.backup(pool, d.to(dev_at), h.to(host_at), backend="staged", max_ctas=2, stream=side.cuda_stream)
        side.synchronize()
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected), "D2H: not the reference"
        fill_pool(pool, 78)
        expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, h, d)
        host.load(pool, h.to(host_at), d.to(dev_at), backend="staged", max_ctas=2, stream=side.cuda_stream)
        side.synchronize()
        assert torch.equal(pool_bytes(pool), expected), "H2D: not the reference"
        with pytest.raises(errors.IndexValidationError, match="on cpu"):  # the kernel needs device indices
            host.load(pool, h, d, backend="kernel")
        bad = d.clone()
        bad[299] = dev_layout.num_slots
        before = _snapshot(pool, host)
        with pytest.raises(errors.IndexValidationError, match="nothing was copied"):
            host.load(pool, h.to(host_at), bad.to(dev_at), backend="staged", max_ctas=2)
        after = _snapshot(pool, host)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_copy_engine_takes_cpu_indices() -> None:
    dev = _dev()
    dev_layout, host_layout = MODEL.layout("layer_first", 32), MODEL.layout("page_first", 48)
    with filled_pools(dev_layout, host_layout, dev, chunk_blocks=None, seed=7) as (pool, host):
        d = _slots(dev_layout.num_slots, 16, 256, 13, "pages")
        h = _slots(host_layout.num_slots, 16, 256, 14, "pages")
        fill_pool(pool, 79)
        expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, h, d)
        host.load(pool, h, d, backend="copy_engine")
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes(pool), expected)


def _snapshot(pool: pd.DeviceKVPool, host: pd.HostKVPool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.cuda.synchronize()
    return pool_bytes(pool).clone(), as_bytes(host.buffer).reshape(-1).clone()


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("side", ["host", "device"])
def test_staged_bad_index_is_refused_with_nothing_written(direction: str, side: str) -> None:
    dev = _dev()
    staged.set_staging(dev, nbytes=SMALL_STAGING, ring=2)
    dev_layout, host_layout = MODEL.layout("layer_first", 16), MODEL.layout("page_first", 16)
    with filled_pools(dev_layout, host_layout, dev, chunk_blocks=None, seed=4) as (pool, host):
        before = _snapshot(pool, host)
        h, d = torch.arange(200), torch.arange(200).flip(0)
        (h if side == "host" else d)[150] = 256  # one past the end, in the last chunks
        with pytest.raises(errors.IndexValidationError, match="nothing was copied"):
            if direction == "d2h":
                host.backup(pool, d.cuda(), h.cuda(), backend="staged", validate_indices=False)
            else:
                host.load(pool, h.cuda(), d.cuda(), backend="staged", validate_indices=False)
        after = _snapshot(pool, host)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_native_staged_check_refuses_a_bad_host_index_with_nothing_written() -> None:
    """The C++ side's own range check of the host indices (the Python layer's is bypassed)."""
    dev = _dev()
    staged.set_staging(dev, nbytes=SMALL_STAGING, ring=2)
    dev_layout, host_layout = MODEL.layout("layer_first", 16), MODEL.layout("page_first", 16)
    with filled_pools(dev_layout, host_layout, dev, chunk_blocks=None, seed=5) as (pool, host):
        before = _snapshot(pool, host)
        plan = plan_for(host.kernel_table, host_layout, pool.table, dev_layout)
        h_host = torch.arange(100)
        h_host[60] = -1
        h_dev, d = h_host.cuda(), torch.arange(100, device="cuda")
        table = torch.tensor(host.kernel_table.raw_values(), dtype=torch.uint64)
        buf = torch.empty(SMALL_STAGING, dtype=torch.uint8, device="cuda")
        backend = backend_for(dev)
        with pytest.raises(errors.IndexValidationError):
            backend.staged(plan.kernel,
                           LaunchArgs(h_dev.data_ptr(), d.data_ptr(), 100, 0, 4, dev,
                                      torch.cuda.current_stream().cuda_stream, 2),
                           StagingArgs(True, table.data_ptr(), h_host.data_ptr(), buf.data_ptr(), SMALL_STAGING, 2))
        after = _snapshot(pool, host)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_staged_transfers_on_two_streams_share_the_ring_safely() -> None:
    dev = _dev()
    staged.set_staging(dev, nbytes=SMALL_STAGING, ring=2)
    dev_layout, host_layout = MODEL.layout("layer_first", 64), MODEL.layout("page_first", 64)
    with filled_pools(dev_layout, host_layout, dev, chunk_blocks=None, seed=6) as (pool, host):
        torch.cuda.synchronize()
        perm = _slots(1024, 16, 1024, 7, "tokens")
        h = _slots(1024, 16, 1024, 8, "pages")
        expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, h, perm)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        a, b = (h[:512].cuda(), perm[:512].cuda()), (h[512:].cuda(), perm[512:].cuda())
        torch.cuda.synchronize()
        host.load(pool, *a, backend="staged", max_ctas=2, stream=s1.cuda_stream)
        host.load(pool, *b, backend="staged", max_ctas=2, stream=s2.cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes(pool), expected)


def test_auto_stages_outside_capture_and_uses_the_kernel_in_graph_capture_and_replay() -> None:
    dev = _dev()
    staged.set_staging(dev, nbytes=SMALL_STAGING, ring=2)
    dev_layout, host_layout = MODEL.layout("layer_first", 64), MODEL.layout("page_first", 64)
    n = 256
    assert n >= staged.STAGED_MIN_CHUNKS * staged.chunk_slots(staged.staging_config(dev), 2, 4 * 1024)
    with install_backend(FaultyBackend(backend_for(dev), {}), "cuda") as counting, \
            filled_pools(dev_layout, host_layout, dev, chunk_blocks=None, seed=8) as (pool, host):
        # outside capture, the default budget (4 CTAs): auto takes the staged path, both ways
        h, d = _slots(1024, 16, n, 9, "pages"), _slots(1024, 16, n, 10, "tokens")
        expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, h, d)
        host.load(pool, h.cuda(), d.cuda())
        torch.cuda.synchronize()
        assert counting.calls["staged"] == 1 and counting.calls["launch"] == 0
        assert torch.equal(pool_bytes(pool), expected)
        expected = reference_transfer(pool_bytes(pool), dev_layout, host.buffer, host_layout, d, h.flip(0))
        host.backup(pool, d.cuda(), h.flip(0).cuda())
        torch.cuda.synchronize()
        assert counting.calls["staged"] == 2 and counting.calls["launch"] == 0
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected)
        # inside capture: auto falls back to the kernel; an explicit staged request is refused
        src = torch.zeros(n, dtype=torch.int64, device="cuda")
        dst = torch.zeros(n, dtype=torch.int64, device="cuda")
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            host.load(pool, src, dst)
            with pytest.raises(errors.InvalidArgumentError, match="captured"):
                host.load(pool, src, dst, backend="staged")
        assert counting.calls["launch"] == 1 and counting.calls["staged"] == 2
        for seed in range(3):  # replay with new indices: the bytes of each
            h, d = _slots(1024, 16, n, 20 + seed, "tokens"), _slots(1024, 16, n, 30 + seed, "pages")
            src.copy_(h)
            dst.copy_(d)
            fill_pool(pool, 40 * seed + 1)
            torch.cuda.synchronize()
            expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, h, d)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(pool_bytes(pool), expected), f"replay {seed}"
        assert counting.calls["launch"] == 1 and counting.calls["staged"] == 2
        del graph  # a graph that captured the pool's launches holds it open (pointerdomain.transfer.graphs)


def test_staged_refuses_per_layer_and_page_first_direct_pages() -> None:
    dev = _dev()
    dev_layout, host_layout = MODEL.layout("layer_first", 16), MODEL.layout("page_first_direct", 16)
    with filled_pools(dev_layout, host_layout, dev, chunk_blocks=None, seed=11) as (pool, host):
        before = _snapshot(pool, host)
        idx = torch.arange(64, device="cuda")
        with pytest.raises(errors.LayoutError):
            host.load(pool, idx, idx, backend="staged")
        with pytest.raises(errors.InvalidArgumentError, match="all layers"):
            host.load_layer(pool, idx, idx, 2, backend="staged")
        after = _snapshot(pool, host)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
        fill_random(host.buffer, 12)  # and auto still moves it (the kernel)
        expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, idx, idx)
        host.load(pool, idx, idx)
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes(pool), expected)
