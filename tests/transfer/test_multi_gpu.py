"""Two-GPU tests: per-device tables from one portable registration, the
launch device guard, and concurrent transfers on both GPUs from one host pool.

Marked ``gpu`` (skipped without CUDA) and skipped unless ``torch.cuda.device_count() >= 2``.
Run: ``python -m pytest -q -m gpu tests/transfer/test_multi_gpu.py`` on a two-GPU machine.
Expected bytes come from ``tests/reference.py`` (plain torch on the CPU).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import FaultyBackend, backend_for, install_backend
from tests.helpers.models import Model
from tests.reference import as_bytes, fill_pool, fill_random, pool_bytes, reference_transfer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

C0 = pd.Device("cuda", 0)
C1 = pd.Device("cuda", 1)


MODEL = Model(layers=4, page_size=16, mha=(8, 128))


@pytest.fixture(autouse=True)
def _device0_current() -> Iterator[None]:
    previous = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    torch.cuda.set_device(previous)


def pools(chunk_blocks: int | None = None) -> tuple[pd.DeviceKVPool, pd.DeviceKVPool, pd.HostKVPool]:
    dev_layout, host_layout = MODEL.layout("layer_first", 24), MODEL.layout("page_first", 50)
    p0, p1 = pd.DeviceKVPool(dev_layout, C0), pd.DeviceKVPool(dev_layout, C1)
    fill_pool(p0, 0)
    fill_pool(p1, 100)
    max_chunk = host_layout.page_block_bytes() * chunk_blocks if chunk_blocks else 1 << 40
    host = pd.HostKVPool(host_layout, C0, max_chunk_bytes=max_chunk)  # registered once, portable
    fill_random(host.buffer, 7)
    return p0, p1, host


def slots(n: int, total: int, seed: int) -> torch.Tensor:
    return torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n]


def test_one_portable_registration_gives_a_table_per_device() -> None:
    with pd.alloc_registered(1 << 20, C0) as mem:
        a0, a1 = pd.resolve_alias(mem.host_va + 4096, C0), pd.resolve_alias(mem.host_va + 4096, C1)
        assert (a0.device, a1.device) == (C0, C1)  # tagged per device; values may or may not be equal
        assert torch.cuda.current_device() == 0  # resolving for device 1 switched and came back
        t1 = pd.make_kernel_ptr_table([mem.tensor], C1)
        assert t1.device == C1 and t1[0] == pd.resolve_alias(mem.host_va, C1)
        assert t1.as_uint64_tensor().device == torch.device("cuda", 1)
    _p0, _p1, host = pools()
    with host:
        t1 = host.kernel_table_for("cuda:1")
        assert t1.device == C1 and host.kernel_table_for(C1) is t1 and host.kernel_table.device == C0


@pytest.mark.parametrize("chunked", [False, True])
def test_launch_on_device1_while_device0_is_current(chunked: bool) -> None:
    p0, p1, host = pools(chunk_blocks=7 if chunked else None)
    with host:
        before = as_bytes(host.buffer).clone()
        d1, h1 = slots(100, 384, 1), slots(100, 800, 2)[:100]
        d0 = slots(60, 384, 3)
        h0 = torch.tensor(sorted(set(range(800)) - set(h1.tolist())))[:60]  # disjoint from h1
        expected = reference_transfer(pool_bytes(p1), p1.layout, before, host.layout, d1, h1)
        expected = reference_transfer(pool_bytes(p0), p0.layout, expected, host.layout, d0, h0)
        host.backup(p1, d1.cuda(1), h1.cuda(1))
        assert torch.cuda.current_device() == 0
        host.backup(p0, d0.cuda(0), h0.cuda(0))
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected)
        # H2D into both (poisoned) devices, with device 0 current throughout
        fill_pool(p0, 500)
        fill_pool(p1, 600)
        want1 = reference_transfer(host.buffer, host.layout, pool_bytes(p1), p1.layout, h1, d1)
        want0 = reference_transfer(host.buffer, host.layout, pool_bytes(p0), p0.layout, h0, d0)
        host.load(p1, h1.cuda(1), d1.cuda(1), max_ctas=2)
        for layer in range(4):
            host.load_layer(p0, h0.cuda(0), d0.cuda(0), layer)
        host.load(p1, h1.cuda(1), d1.cuda(1), backend="copy_engine")
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        assert torch.equal(pool_bytes(p1), want1) and torch.equal(pool_bytes(p0), want0)


def test_cross_device_tables_and_indices_refused_before_launch() -> None:
    p0, p1, host = pools()
    with host:
        before, before1 = as_bytes(host.buffer).clone(), pool_bytes(p1)
        i1 = torch.arange(4, device="cuda:1")
        with pytest.raises(errors.DeviceMismatchError):  # device 1's pool with device 0's host table
            pd.transfer_kv_all_layer(p1.table, host.kernel_table, i1, i1, src_layout=p1.layout, dst_layout=host.layout)
        with pytest.raises(errors.DeviceMismatchError):
            pd.transfer_kv_all_layer(host.kernel_table_for(C1), p0.table, i1, i1, src_layout=host.layout,
                                     dst_layout=p0.layout)
        for bad in (torch.arange(4, device="cuda:0"), torch.arange(4)):
            with pytest.raises(errors.IndexValidationError, match="cuda:1"):
                host.backup(p1, bad, i1)
            with pytest.raises(errors.IndexValidationError, match="cuda:1"):
                host.load(p1, i1, bad)
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(1)
        assert torch.equal(as_bytes(host.buffer), before) and torch.equal(pool_bytes(p1), before1)


def test_device_restored_when_a_launch_on_device1_fails() -> None:
    p0, p1, host = pools()
    with host:
        before = as_bytes(host.buffer).clone()
        i1 = torch.arange(4, device="cuda:1")
        with pytest.raises(errors.IndexValidationError):  # the host range check runs under the guard
            host.backup(p1, i1, torch.tensor([0, 1, 2, 10_000], device="cuda:1"), validate_indices="host")
        assert torch.cuda.current_device() == 0
        with install_backend(FaultyBackend(backend_for(C0), fail={"launch": {1: 700}}), "cuda"):
            with pytest.raises(errors.RuntimeCallError, match="700"):
                host.backup(p1, i1, i1, backend="kernel")
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(1)
        assert torch.equal(as_bytes(host.buffer), before)


def test_concurrent_transfers_on_two_gpus_from_one_host_pool() -> None:
    p0, p1, host = pools()
    with host:
        before = as_bytes(host.buffer).clone()
        h_all = slots(800, 800, 9)
        jobs = {C0: (p0, slots(300, 384, 10), h_all[:300]), C1: (p1, slots(300, 384, 11), h_all[300:600])}
        expected = before
        for pool, d, h in jobs.values():
            expected = reference_transfer(pool_bytes(pool), pool.layout, expected, host.layout, d, h)
        streams = {dev: torch.cuda.Stream(device=dev.torch_device) for dev in jobs}
        # one thread enqueues on both devices' streams (asynchronous launches overlap)
        for dev, (pool, d, h) in jobs.items():
            host.backup(pool, d.to(dev.torch_device), h.to(dev.torch_device), stream=streams[dev].cuda_stream,
                        max_ctas=pd.WHOLE_GPU, validate_indices=False)
        for s in streams.values():
            s.synchronize()
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected)
        # two threads, one per device, each on its own stream, loads into poisoned pools
        fill_pool(p0, 700)
        fill_pool(p1, 800)
        wants = {dev: reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, h, d)
                 for dev, (pool, d, h) in jobs.items()}
        failures: list[BaseException] = []
        barrier = threading.Barrier(2)

        def work(dev: pd.Device) -> None:
            pool, d, h = jobs[dev]
            try:
                hi, di = h.to(dev.torch_device), d.to(dev.torch_device)
                barrier.wait()
                for _ in range(10):
                    host.load(pool, hi, di, stream=streams[dev].cuda_stream)
                    assert torch.cuda.current_device() == 0  # this thread's device: untouched
                streams[dev].synchronize()
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(dev,)) for dev in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not failures, failures
        for dev, (pool, _d, _h) in jobs.items():
            assert torch.equal(pool_bytes(pool), wants[dev]), f"{dev}: not the reference"
        assert torch.cuda.current_device() == 0
