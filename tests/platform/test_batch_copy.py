"""The batched copy contract (``pointerdomain._platform.batch_copy``): planned before any
submission, followed by the CUDA backend, recorded by the emulated one. Each clause
answers a public failure of ``cudaMemcpyBatchAsync``: the legacy stream refused, attribute
indices read past their array, hangs with tens of thousands of descriptors, a capture that
drops the batch, HIP batch copies racing graph replays."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain._platform.batch_copy import (
    LEGACY_STREAMS,
    MAX_DESCRIPTORS,
    Submission,
    batch_allowed,
    plan_copy_runs,
)
from pointerdomain.testing import EmulatedBackend, backend_for, install_backend

DEV = pd.Device("emulated", 0)


def _check_contract(plan: tuple[Submission, ...], count: int, stream: int, *, capturing: bool = False) -> None:
    """Every clause of the contract, for ``plan`` of ``count`` descriptors on ``stream``."""
    assert sum(s.count for s in plan) == count
    first = 0
    for sub in plan:
        assert sub.first == first and sub.count >= 1 and sub.stream == stream
        first += sub.count
        if sub.batched:
            assert not capturing  # never a batch call into a capture
            assert sub.count <= MAX_DESCRIPTORS
            assert sub.attr_idxs == (0,) and sub.num_attrs == 1  # one entry in both arrays, not one per descriptor
            assert sub.submit_stream == ("ordered side stream" if stream in LEGACY_STREAMS else "given")
        else:
            assert sub.attr_idxs == () and sub.submit_stream == "given"


@pytest.mark.parametrize("stream", [0, 1])
def test_the_legacy_stream_goes_through_the_ordered_side_stream(stream: int) -> None:
    (sub,) = plan_copy_runs(10, stream, batched=True, capturing=False)
    assert sub.batched and sub.submit_stream == "ordered side stream" and sub.stream == stream


@pytest.mark.parametrize("stream", [2, 0x7F00_0000_1234])  # cudaStreamPerThread, a created stream
def test_other_streams_are_taken_as_given(stream: int) -> None:
    (sub,) = plan_copy_runs(10, stream, batched=True, capturing=False)
    assert sub.batched and sub.submit_stream == "given"


def test_a_large_count_is_split_into_capped_submissions_in_order() -> None:
    count = 3 * MAX_DESCRIPTORS + 5
    plan = plan_copy_runs(count, 7, batched=True, capturing=False)
    assert [(s.first, s.count) for s in plan] == [
        (0, MAX_DESCRIPTORS), (MAX_DESCRIPTORS, MAX_DESCRIPTORS), (2 * MAX_DESCRIPTORS, MAX_DESCRIPTORS),
        (3 * MAX_DESCRIPTORS, 5)]
    _check_contract(plan, count, 7)


def test_a_captured_stream_gets_per_run_copies() -> None:
    (sub,) = plan_copy_runs(50_000, 7, batched=True, capturing=True)
    assert not sub.batched and sub.count == 50_000 and sub.attr_idxs == ()


def test_hip_never_takes_the_batch_call() -> None:
    assert not batch_allowed("hip", True) and not batch_allowed("hip", False)
    assert batch_allowed("cuda", True) and not batch_allowed("cuda", False)
    (sub,) = plan_copy_runs(20_000, 7, batched=batch_allowed("hip", True), capturing=False)
    assert not sub.batched


@pytest.mark.parametrize(("count", "stream"), [(-1, 0), (1.0, 0), (True, 0), (1, -1), (1, 2**64), (1, "0")])
def test_bad_counts_and_streams_are_refused(count: object, stream: object) -> None:
    with pytest.raises(errors.InvalidArgumentError):
        plan_copy_runs(count, stream, batched=True, capturing=False)  # type: ignore[arg-type]


def test_nothing_to_copy_plans_nothing() -> None:
    assert plan_copy_runs(0, 0, batched=True, capturing=False) == ()


# The emulated backend follows the plan and records it -------------------------------------------------


def _runs(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` one-byte copies from a random source to a poisoned destination, in a
    shuffled order (src, dst, dst addresses, src addresses, sizes)."""
    gen = torch.Generator().manual_seed(count)
    src = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)
    dst = torch.full((count,), 0xA5, dtype=torch.uint8)
    dst[: count // 2] = 0x5A  # the poison is not one value: a skipped copy cannot match by luck
    order = torch.randperm(count, generator=gen)
    dsts = (dst.data_ptr() + order).to(torch.int64)
    srcs = (src.data_ptr() + order).to(torch.int64)
    return src, dst, dsts, srcs, torch.ones(count, dtype=torch.int64)


@pytest.fixture
def emulated() -> Iterator[EmulatedBackend]:
    backend = backend_for(DEV)
    assert isinstance(backend, EmulatedBackend)
    backend.copy_submissions.clear()
    yield backend
    backend.copy_submissions.clear()


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 100_000), stream=st.sampled_from([0, 1, 2, 12345]))
def test_copy_runs_follow_the_contract_for_any_descriptor_count(count: int, stream: int) -> None:
    backend = backend_for(DEV)
    assert isinstance(backend, EmulatedBackend)
    backend.copy_submissions.clear()
    src, dst, dsts, srcs, sizes = _runs(count)
    backend.copy_runs(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), count, DEV, stream)
    plan = tuple(backend.copy_submissions)
    backend.copy_submissions.clear()
    _check_contract(plan, count, stream)
    assert all(s.batched for s in plan) and len(plan) == -(-count // MAX_DESCRIPTORS)
    assert torch.equal(dst, src)  # every descriptor of every submission copied, exactly


class _Capturing(EmulatedBackend):
    """The emulated device with its stream being captured into a graph."""

    def is_capturing(self, device: pd.Device) -> bool:
        return True


def test_copy_runs_while_capturing_are_per_run_copies_and_exact() -> None:
    backend = _Capturing(1)
    count = MAX_DESCRIPTORS + 3
    src, dst, dsts, srcs, sizes = _runs(count)
    backend.copy_runs(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), count, DEV, 0)
    (sub,) = backend.copy_submissions
    assert not sub.batched and sub.count == count
    assert torch.equal(dst, src)


def test_a_copy_engine_transfer_is_submitted_by_the_contract(emulated: EmulatedBackend) -> None:
    layout = pd.KVLayout(kind="layer_first", num_layers=3, num_pages=8, page_size=4, num_heads=2, head_dim=8,
                         dtype="float32")
    src, dst = pd.DeviceKVPool(layout, DEV), pd.DeviceKVPool(layout, DEV)
    for i, b in enumerate(src.buffers):
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(i)))
    for b in dst.buffers:
        b.fill_(float("nan"))
    s_idx = torch.arange(0, 32, 2)  # every other slot: no two copies merge into one run
    d_idx = torch.arange(1, 32, 2)
    pd.transfer_kv_all_layer(src.table, dst.table, s_idx, d_idx, src_layout=layout, dst_layout=layout,
                             backend="copy_engine", stream=0)
    plan = tuple(emulated.copy_submissions)
    count = 16 * 2 * 3  # slots x kv x layers
    _check_contract(plan, count, 0)
    assert plan and all(s.batched and s.submit_stream == "ordered side stream" for s in plan)
    for a, b in zip(src.buffers, dst.buffers):
        assert torch.equal(b[d_idx].view(torch.int32), a[s_idx].view(torch.int32))
        assert torch.isnan(b[s_idx]).all()  # slots not written keep the poison
