"""The staged copy-engine path's selection and refusals (``backend="staged"``), on the
emulated device: there it moves the bytes through the CPU kernel, and a CUDA-like test
backend (runtime "cuda", staged path "available", capture switchable) stands in for the
GPU so that ``backend="auto"``'s choice can be observed by call counts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors, staged
from pointerdomain.testing import (
    Backend,
    FaultyBackend,
    KernelPlan,
    LaunchArgs,
    StagingArgs,
    TorchCudartBackend,
    backend_for,
    install_backend,
)
from tests.reference import DEV, as_bytes, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer

#: Staging for the selection tests: 64 KiB of ring tables + 2 slots of 4 KiB, so a ring
#: chunk of the model layout (3 layers x 2 kv x 64 B = 384 B per slot) is 10 slots and
#: auto needs STAGED_MIN_CHUNKS x 10 = 160 slots.
SMALL_STAGING = (64 << 10) + 2 * 4096
CHUNK = 4096 // (3 * 2 * 64)


class CudaLike(FaultyBackend):
    """The emulated backend dressed as CUDA with the staged path built (the bytes still
    move through the CPU kernel); ``capturing`` makes it report a graph capture."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner, {})
        self.runtime = "cuda"
        self.capturing = False

    def staged_available(self) -> bool:
        return True

    def is_capturing(self, device: pd.Device) -> bool:
        return self.capturing


@pytest.fixture(autouse=True)
def _default_staging() -> Iterator[None]:
    yield
    staged.set_staging(DEV)


@pytest.fixture
def cuda_like() -> Iterator[CudaLike]:
    with install_backend(CudaLike(backend_for(DEV)), "emulated") as backend:
        yield backend


def _pools(host_kind: str = "page_first", pages: int = 64, page_size: int = 4, head_dim: int = 16,
           chunk_blocks: int | None = None) -> tuple[pd.DeviceKVPool, pd.HostKVPool]:
    dev_layout = pd.KVLayout(kind="layer_first", num_layers=3, num_pages=pages, page_size=page_size, num_heads=2,
                             head_dim=head_dim)
    host_layout = dev_layout.model_copy(update={"kind": host_kind})
    pool = pd.DeviceKVPool(dev_layout, DEV)
    fill_pool(pool, 1)
    max_chunk = host_layout.page_block_bytes() * chunk_blocks if chunk_blocks else 1 << 40
    host = pd.HostKVPool(host_layout, DEV, max_chunk_bytes=max_chunk)
    fill_random(host.buffer, 2)
    return pool, host


def _slots(num: int, n: int, seed: int) -> torch.Tensor:
    return torch.randperm(num, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("host_kind,page_size", [("page_first", 4), ("page_first_direct", 1)])
@pytest.mark.parametrize("chunk_blocks", [None, 3])
def test_explicit_staged_moves_the_reference_bytes_both_ways(host_kind: str, page_size: int,
                                                             chunk_blocks: int | None) -> None:
    pool, host = _pools(host_kind, pages=32 if page_size == 4 else 128, page_size=page_size,
                        chunk_blocks=chunk_blocks)
    with host:
        d, h = _slots(pool.layout.num_slots, 90, 3), _slots(host.layout.num_slots, 90, 4)
        expected = reference_transfer(pool_bytes(pool), pool.layout, host.buffer, host.layout, d, h)
        host.backup(pool, d, h, backend="staged", max_ctas=2)
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected)
        fill_pool(pool, 7)  # poison the device pool, then load back
        expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, h, d)
        host.load(pool, h, d, backend="staged", max_ctas=2)
        assert torch.equal(pool_bytes(pool), expected)


def _unchanged(pool: pd.DeviceKVPool, host: pd.HostKVPool) -> tuple[torch.Tensor, torch.Tensor]:
    return pool_bytes(pool).clone(), as_bytes(host.buffer).clone()


def test_per_layer_staged_is_refused_and_nothing_moves() -> None:
    pool, host = _pools()
    with host:
        before = _unchanged(pool, host)
        idx = torch.arange(8)
        with pytest.raises(errors.InvalidArgumentError, match="all layers"):
            host.load_layer(pool, idx, idx, 1, backend="staged")
        assert all(torch.equal(a, b) for a, b in zip(before, _unchanged(pool, host)))


@pytest.mark.parametrize("host_kind,page_size", [("layer_first", 4), ("page_first_direct", 4)])
def test_host_layout_without_contiguous_slots_is_a_layout_error(host_kind: str, page_size: int) -> None:
    pool, host = _pools(host_kind, pages=8, page_size=page_size)
    with host:
        before = _unchanged(pool, host)
        idx = torch.arange(8)
        with pytest.raises(errors.LayoutError, match="contiguously"):
            host.load(pool, idx, idx, backend="staged")
        assert all(torch.equal(a, b) for a, b in zip(before, _unchanged(pool, host)))


def test_device_to_device_is_refused() -> None:
    a, b = pd.DeviceKVPool(model_layout(), DEV), pd.DeviceKVPool(model_layout(), DEV)
    idx = torch.arange(4)
    with pytest.raises(errors.InvalidArgumentError, match="host pool and a device pool"):
        pd.transfer_kv_all_layer(a.table, b.table, idx, idx, src_layout=a.layout, dst_layout=b.layout,
                                 backend="staged")


@pytest.mark.parametrize("side", ["host", "device"])
@pytest.mark.parametrize("bad", [-1, 10_000])
@pytest.mark.parametrize("validate", [True, False])
def test_bad_index_is_refused_before_anything_moves(side: str, bad: int, validate: bool) -> None:
    pool, host = _pools(pages=16)
    with host:
        before = _unchanged(pool, host)
        h, d = torch.arange(40), torch.arange(40)
        (h if side == "host" else d)[17] = bad
        with pytest.raises(errors.IndexValidationError, match="nothing was copied"):
            host.load(pool, h, d, backend="staged", validate_indices=validate)
        with pytest.raises(errors.IndexValidationError, match="nothing was copied"):
            host.backup(pool, d, h, backend="staged", validate_indices=validate)
        assert all(torch.equal(a, b) for a, b in zip(before, _unchanged(pool, host)))


def test_staging_too_small_for_one_slot_is_refused() -> None:
    pool, host = _pools(head_dim=1024)  # 3 layers x 2 kv x 4 KiB = 24 KiB per slot > a 4 KiB ring slot
    with host:
        staged.set_staging(DEV, nbytes=SMALL_STAGING, ring=2)
        idx = torch.arange(4)
        with pytest.raises(errors.InvalidArgumentError, match="holds no slot"):
            host.load(pool, idx, idx, backend="staged")
        staged.set_staging(DEV, nbytes=(64 << 10) + 2 * (24 << 10), ring=2)
        host.load(pool, idx, idx, backend="staged")  # now it fits


def test_set_staging_checks_its_arguments() -> None:
    for kwargs in ({"ring": 1}, {"ring": 9}, {"nbytes": 64 << 10}, {"nbytes": 1.5e7}):
        with pytest.raises(errors.InvalidArgumentError):
            staged.set_staging(DEV, **kwargs)
    staged.set_staging(DEV, nbytes=32 << 20, ring=4)
    assert staged.staging_config(DEV) == staged.StagingConfig(32 << 20, 4)
    staged.set_staging(DEV)
    assert staged.staging_config(DEV) == staged.StagingConfig(staged.DEFAULT_STAGING_BYTES, staged.DEFAULT_STAGING_RING)


def test_chunk_slots_follows_the_native_rule() -> None:
    # staged_gpu.cu: ((bytes - 64 KiB) / ring) rounded down to 4 KiB, / (num_kv * block), at most 7680
    assert staged.chunk_slots(staged.StagingConfig(16 << 20, 2), 2, 32 << 10) == ((8 << 20) - (32 << 10)) // (64 << 10)
    assert staged.chunk_slots(staged.StagingConfig(16 << 20, 2), 1, 64) == 7680
    assert staged.chunk_slots(staged.StagingConfig(SMALL_STAGING, 2), 2, 192) == CHUNK
    assert staged.chunk_slots(staged.StagingConfig(SMALL_STAGING, 2), 2, 4096) == 0


def test_explicit_staged_during_capture_is_refused(cuda_like: CudaLike) -> None:
    pool, host = _pools()
    with host:
        idx = torch.arange(8)
        cuda_like.capturing = True
        with pytest.raises(errors.InvalidArgumentError, match="captured"):
            host.load(pool, idx, idx, backend="staged")
        assert cuda_like.calls["staged"] == 0 and cuda_like.calls["launch"] == 0


def _on_device(idx: torch.Tensor) -> torch.Tensor:
    """``idx`` in emulated device memory: indices on the device, as a CUDA caller's are."""
    out = pd.device_empty(tuple(idx.shape), torch.int64, DEV)
    out.copy_(idx)
    return out


def _auto_load(cuda_like: CudaLike, pool: pd.DeviceKVPool, host: pd.HostKVPool, n: int, **kwargs: object) -> str:
    """Run an auto load of n slots (indices in device memory); which path ran; the bytes
    checked against the reference."""
    h, d = _on_device(_slots(host.layout.num_slots, n, 5)), _on_device(_slots(pool.layout.num_slots, n, 6))
    expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, h, d)
    before = dict(cuda_like.calls)
    host.load(pool, h, d, **kwargs)  # type: ignore[arg-type]
    assert torch.equal(pool_bytes(pool), expected)
    ran = [name for name in ("staged", "launch", "copy_runs") if cuda_like.calls[name] != before[name]]
    assert len(ran) == 1, ran
    return ran[0]


def test_auto_picks_staged_where_it_wins_and_the_kernel_elsewhere(cuda_like: CudaLike) -> None:
    staged.set_staging(DEV, nbytes=SMALL_STAGING, ring=2)
    pool, host = _pools(pages=64)  # 256 slots
    with host:
        need = staged.STAGED_MIN_CHUNKS * CHUNK
        assert _auto_load(cuda_like, pool, host, need) == "staged"
        assert _auto_load(cuda_like, pool, host, need, max_ctas=pd.WHOLE_GPU) == "staged"
        assert _auto_load(cuda_like, pool, host, need - 1) == "launch"  # too few chunks to overlap
        assert _auto_load(cuda_like, pool, host, need, max_ctas=1) == "launch"  # 1 CTA: the kernel wins
        cuda_like.capturing = True
        assert _auto_load(cuda_like, pool, host, need) == "launch"  # capture: the kernel, graph-safe
        cuda_like.capturing = False
        h, d = _slots(host.layout.num_slots, need, 8), _slots(pool.layout.num_slots, need, 9)
        host.load_layer(pool, h, d, 1)  # per-layer: the kernel
        assert cuda_like.calls["staged"] == 2
        staged.set_staging(DEV)  # the default ring: the same transfer is now a fraction of one chunk
        assert _auto_load(cuda_like, pool, host, need) == "launch"


@pytest.mark.parametrize("direction", ["load", "backup"])
def test_auto_takes_cpu_indices_through_the_staged_path_at_any_size(cuda_like: CudaLike, direction: str) -> None:
    """Indices in host memory (CPU tensors where the device is a GPU) are read on the host
    anyway: ``"auto"`` takes them through the staged path wherever it applies, below the
    chunk count it needs for indices on the device; explain_transfer says so beforehand."""
    staged.set_staging(DEV, nbytes=SMALL_STAGING, ring=2)
    pool, host = _pools(pages=64)
    with host:
        n = 7  # far below STAGED_MIN_CHUNKS * CHUNK
        h, d = _slots(host.layout.num_slots, n, 11), _slots(pool.layout.num_slots, n, 12)
        if direction == "load":
            for b in pool.buffers:
                b.view(torch.uint8).fill_(0xA5)  # the poisoned destination
            src, src_layout, dst, dst_layout, s_idx, d_idx = (host.kernel_table, host.layout, pool.table,
                                                              pool.layout, h, d)
            expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, h, d)
        else:
            host.buffer.view(torch.uint8).fill_(0xA5)
            src, src_layout, dst, dst_layout, s_idx, d_idx = (pool.table, pool.layout, host.kernel_table,
                                                              host.layout, d, h)
            expected = reference_transfer(pool_bytes(pool), pool.layout, host.buffer, host.layout, d, h)
        choice = pd.explain_transfer(src, dst, s_idx, d_idx, src_layout=src_layout, dst_layout=dst_layout)
        assert (choice.path, choice.host_indices) == ("staged", True), choice
        before = dict(cuda_like.calls)
        if direction == "load":
            host.load(pool, h, d)
            got = pool_bytes(pool)
        else:
            host.backup(pool, d, h)
            got = as_bytes(host.buffer)
        assert cuda_like.calls["staged"] == before["staged"] + 1 and cuda_like.calls["launch"] == before["launch"]
        assert torch.equal(got.reshape(-1), as_bytes(expected).reshape(-1))
        # the same slots on the device: too few chunks to overlap, the kernel
        on_device = pd.explain_transfer(src, dst, _on_device(s_idx), _on_device(d_idx), src_layout=src_layout,
                                        dst_layout=dst_layout)
        assert (on_device.path, on_device.host_indices) == ("kernel", False), on_device
        # per layer the staged path does not apply: the kernel reads host memory here
        per_layer = pd.explain_transfer(src, dst, s_idx, d_idx, src_layout=src_layout, dst_layout=dst_layout,
                                        layer_id=1)
        assert per_layer.path == "kernel", per_layer


def test_explain_transfer_runs_every_check_and_launches_nothing() -> None:
    pool, host = _pools()
    with host:
        before = _unchanged(pool, host)
        idx = torch.arange(4)
        plain = pd.explain_transfer(host.kernel_table, pool.table, idx, idx, src_layout=host.layout,
                                    dst_layout=pool.layout)
        assert (plain.path, plain.host_indices) == ("kernel", True) and "kernel" in plain.reason
        asked = pd.explain_transfer(host.kernel_table, pool.table, idx, idx, src_layout=host.layout,
                                    dst_layout=pool.layout, backend="copy_engine")
        assert asked.path == "copy_engine" and "asked" in asked.reason
        with pytest.raises(errors.DomainError):
            pd.explain_transfer(host.host_table, pool.table, idx, idx, src_layout=host.layout,  # type: ignore[arg-type]
                                dst_layout=pool.layout)
        with pytest.raises(errors.IndexValidationError):
            pd.explain_transfer(host.kernel_table, pool.table, idx, idx[:3], src_layout=host.layout,
                                dst_layout=pool.layout)
        with pytest.raises(errors.IndexValidationError):
            pd.explain_transfer(host.kernel_table, pool.table, idx, idx, src_layout=host.layout,
                                dst_layout=pool.layout, layer_id=3)
        assert all(torch.equal(a, b) for a, b in zip(before, _unchanged(pool, host)))


def test_auto_keeps_the_kernel_for_other_host_layouts_and_large_items(cuda_like: CudaLike) -> None:
    staged.set_staging(DEV, nbytes=(64 << 10) + 2 * (32 << 10), ring=2)
    pool, host = _pools("page_first_direct", pages=64)  # 4-token pages: not one block per slot
    with host:
        assert _auto_load(cuda_like, pool, host, 200) == "launch"
    pool, host = _pools(pages=64, head_dim=1088)  # 4352 B items > STAGED_MAX_ITEM_BYTES
    with host:
        assert staged.chunk_slots(staged.staging_config(DEV), 2, 3 * 4352) >= 1
        assert _auto_load(cuda_like, pool, host, 200) == "launch"


def test_auto_never_stages_without_a_native_path() -> None:
    staged.set_staging(DEV, nbytes=SMALL_STAGING, ring=2)
    pool, host = _pools(pages=64)
    with host, install_backend(FaultyBackend(backend_for(DEV), {}), "emulated") as emulated:
        h, d = torch.arange(200), torch.arange(200)
        host.load(pool, h, d)
        assert emulated.calls["staged"] == 0 and emulated.calls["launch"] == 1


def test_native_bad_index_status_is_a_typed_error(cuda_like: CudaLike) -> None:
    pool, host = _pools()
    with host:
        before = _unchanged(pool, host)
        cuda_like.fail["staged"] = {1: -2, 2: -1}
        idx = torch.arange(8)
        with pytest.raises(errors.IndexValidationError, match="nothing was copied"):
            host.load(pool, idx, idx, backend="staged")
        with pytest.raises(errors.InvalidArgumentError, match="nothing was copied"):
            host.load(pool, idx, idx, backend="staged")
        assert all(torch.equal(a, b) for a, b in zip(before, _unchanged(pool, host)))


def test_a_build_without_the_gpu_ops_reports_not_built() -> None:
    stand_in = TorchCudartBackend()
    assert not stand_in.staged_available()
    pool = pd.DeviceKVPool(model_layout(), DEV)
    with pytest.raises(errors.ExtensionUnavailableError, match="not built"):
        stand_in.staged(_plan_kernel(pool), LaunchArgs(0, 0, 1, 0, 3, DEV, 0, 2),
                        StagingArgs(True, 0, 0, 0, 1 << 24, 2))


def _plan_kernel(pool: pd.DeviceKVPool) -> KernelPlan:
    from pointerdomain.transfer.plan import plan_for

    return plan_for(pool.table, pool.layout, pool.table, pool.layout).kernel


def test_staging_size_is_bounded_and_an_allocation_failure_is_typed() -> None:
    with pytest.raises(errors.InvalidArgumentError, match="at most"):
        staged.set_staging(DEV, nbytes=staged.MAX_STAGING_BYTES + 4096)
    with pytest.raises(errors.InvalidArgumentError):
        staged.set_staging(DEV, nbytes=2**64)

    class NoDeviceMemory(FaultyBackend):
        def device_alloc(self, nbytes: int, device: pd.Device) -> torch.Tensor:
            if nbytes >= (1 << 30):
                raise MemoryError("std::bad_alloc")
            return self.inner.device_alloc(nbytes, device)

    pool, host = _pools()
    with host, install_backend(NoDeviceMemory(backend_for(DEV), {}), "emulated"):
        staged.set_staging(DEV, nbytes=1 << 30, ring=2)
        before = _unchanged(pool, host)
        idx = torch.arange(8)
        with pytest.raises(errors.OutOfMemoryError):
            host.load(pool, idx, idx, backend="staged")
        assert all(torch.equal(a, b) for a, b in zip(before, _unchanged(pool, host)))
        staged.set_staging(DEV)
