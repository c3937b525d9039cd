"""Honest completion (pointerdomain.transfer.outcomes, pointerdomain.adapters.outcomes):
a request that fails part-way is never reported done. Driver faults are injected
mid-batch and mid-staged-chunk on the emulated device (FaultyBackend); the outcome names
the spans not copied, the bytes of the copied chunks match plain torch and the others are
untouched; a stream latches the failure until reset; engine failures become outcomes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import outcomes as engine_outcomes
from pointerdomain.adapters.mooncake import HostTransferEngine
from pointerdomain.testing import FaultyBackend, backend_for, install_backend
from pointerdomain.transfer.outcomes import TransferOutcome, TransferStream, run_spans, transfer_outcome
from tests.reference import DEV, as_bytes, fill_pool, model_layout, pool_bytes, reference_transfer, same

LAYOUT = model_layout("layer_first", pages=4)
HOST = LAYOUT.replace(kind="page_first")
SRC = torch.tensor([0, 1, 2, 3, 4, 5])
DST = torch.tensor([9, 8, 7, 6, 5, 4])


def _host_bytes(host: pd.HostKVPool) -> torch.Tensor:
    return as_bytes(host.buffer).reshape(-1).clone()


def _backup(host: pd.HostKVPool, pool: pd.DeviceKVPool, **kw: Any) -> TransferOutcome:
    return transfer_outcome(pool.table, host.kernel_table, SRC, DST, src_layout=LAYOUT, dst_layout=HOST, **kw)


@pytest.mark.parametrize(("call", "backend"),
                         [("launch", "kernel"), ("staged", "staged"), ("copy_runs", "copy_engine")])
def test_a_fault_mid_batch_is_a_partial_outcome_with_the_failed_spans(call: str, backend: str) -> None:
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 1)
    with pd.HostKVPool(HOST, DEV) as host:
        host.buffer.view(torch.uint8).fill_(0xEE)  # poisoned: a chunk not copied keeps it
        poisoned = _host_bytes(host)
        with install_backend(FaultyBackend(backend_for(DEV), fail={call: {2: 700}}), "emulated"):
            outcome = _backup(host, pool, chunk_slots=2, backend=backend)  # type: ignore[arg-type]
        assert outcome.status == "partial" and not outcome.done
        assert outcome.failed_spans == ((2, 4), (4, 6)) and outcome.total == 6
        assert isinstance(outcome.error, errors.RuntimeCallError) and "700" in (outcome.reason or "")
        expected = reference_transfer(pool_bytes(pool), LAYOUT, poisoned, HOST, SRC[:2], DST[:2])
        assert same(_host_bytes(host), expected)  # the first chunk copied, the rest still poisoned


def test_a_fault_on_the_first_chunk_fails_the_request_and_a_clean_run_is_done() -> None:
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 2)
    with pd.HostKVPool(HOST, DEV) as host:
        before = _host_bytes(host)
        with install_backend(FaultyBackend(backend_for(DEV), fail={"launch": {1: 700}}), "emulated"):
            failed = _backup(host, pool, chunk_slots=4)
        assert failed.status == "failed" and failed.failed_spans == ((0, 4), (4, 6))
        assert same(_host_bytes(host), before)
        with pytest.raises(errors.RuntimeCallError) as info:
            failed.raise_for_status()
        assert any("not copied" in note for note in info.value.__notes__)
        done = _backup(host, pool, chunk_slots=4)
        assert done == TransferOutcome("done", 6) and done.done and done.reason is None
        assert same(_host_bytes(host), reference_transfer(pool_bytes(pool), LAYOUT, before, HOST, SRC, DST))


_T = torch.tensor


@pytest.mark.parametrize(("case", "src", "dst", "chunk", "error", "match"), [
    ("bad slot in a later chunk", _T([0, 1, 2, 3, 4, 5]), _T([0, 1, 2, 3, 4, 99]), 2, errors.IndexValidationError,
     "outside"),
    ("lengths differ", _T([0, 1, 2, 3]), _T([4, 5]), 2, errors.IndexValidationError, "4 slots but dst_indices has 2"),
    ("a slot written in two chunks", _T([0, 1]), _T([4, 4]), 1, errors.OverlapError, "written twice"),
    ("0-d indices", _T(0), _T(4), None, errors.IndexValidationError, "expected 1-D"),
    ("int32 indices", _T([0, 1], dtype=torch.int32), _T([2, 3], dtype=torch.int32), 1, errors.IndexValidationError,
     "int32"),
    ("2-d indices", _T([[0, 1]]), _T([[2, 3]]), 1, errors.IndexValidationError, "expected 1-D"),
])
def test_bad_input_anywhere_in_the_request_fails_it_whole_before_any_chunk(
    case: str, src: torch.Tensor, dst: torch.Tensor, chunk: int | None, error: type[Exception], match: str,
) -> None:
    """The whole request gets every check of one direct launch before its first chunk: the
    same typed error, the whole request failed, nothing written."""
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 4)
    with pd.HostKVPool(HOST, DEV) as host:
        host.buffer.view(torch.uint8).fill_(0xEE)  # poisoned: any byte written shows
        before = _host_bytes(host)
        with pytest.raises(error, match=match):
            pd.transfer_kv_all_layer(pool.table, host.kernel_table, src, dst, src_layout=LAYOUT, dst_layout=HOST)
        outcome = transfer_outcome(pool.table, host.kernel_table, src, dst, src_layout=LAYOUT, dst_layout=HOST,
                                   chunk_slots=chunk)
        assert outcome.status == "failed", case
        assert outcome.failed_spans == ((0, src.numel()),)
        assert type(outcome.error) is error and match in str(outcome.error)
        assert same(_host_bytes(host), before)  # nothing written, not even the chunks before the bad one
        with pytest.raises(errors.InvalidArgumentError, match="chunk_slots"):
            _backup(host, pool, chunk_slots=0)


def test_a_slot_read_in_one_chunk_and_written_in_another_is_an_overlap_error() -> None:
    """A swap inside one pool split one slot pair per chunk: each chunk alone is fine, the
    whole request reads a slot it writes (the direct launch refuses it)."""
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 5)
    before = pool_bytes(pool).clone()
    src, dst = torch.tensor([0, 1]), torch.tensor([1, 0])
    with pytest.raises(errors.OverlapError, match="both read"):
        pd.transfer_kv_all_layer(pool.table, pool.table, src, dst, src_layout=LAYOUT, dst_layout=LAYOUT)
    outcome = transfer_outcome(pool.table, pool.table, src, dst, src_layout=LAYOUT, dst_layout=LAYOUT, chunk_slots=1)
    assert outcome.status == "failed" and outcome.failed_spans == ((0, 2),)
    assert type(outcome.error) is errors.OverlapError
    assert same(pool_bytes(pool), before)
    moved = transfer_outcome(pool.table, pool.table, torch.tensor([0, 1]), torch.tensor([2, 3]), src_layout=LAYOUT,
                             dst_layout=LAYOUT, chunk_slots=1)
    assert moved.done
    expected = reference_transfer(before, LAYOUT, before.clone(), LAYOUT, torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert same(pool_bytes(pool), expected)


@pytest.mark.parametrize(("total", "spans"), [
    (4, [(3, 1)]), (4, [(0, 5)]), (4, [(-1, 2)]), (4, [(0, 2), (1, 3)]), (-1, []), (4, [(0, 2.0)]), (True, []),
    (10, [(0, 2)]), (10, []), (10, [(0, 4), (6, 10)]), (10, [(2, 10)]),  # blocks no span runs: never "done"
])
def test_bad_spans_are_refused_before_any_work_runs(total: Any, spans: Any) -> None:
    ran: list[tuple[int, int]] = []
    stream = TransferStream(DEV)
    with pytest.raises(errors.InvalidArgumentError):
        stream.run(total, spans, lambda a, b: ran.append((a, b)))
    with pytest.raises(ValueError):  # the builtin the typed error also is
        run_spans(total, spans, lambda a, b: ran.append((a, b)))
    assert ran == [] and stream.latched is None
    assert stream.run(4, [(0, 0), (0, 3), (3, 4)], lambda a, b: ran.append((a, b))).done
    assert ran == [(0, 0), (0, 3), (3, 4)]


def test_a_stream_latches_the_first_failure_until_reset() -> None:
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 3)
    stream = TransferStream(DEV)
    with pd.HostKVPool(HOST, DEV) as host:
        kw: dict[str, Any] = {"src_layout": LAYOUT, "dst_layout": HOST, "chunk_slots": 3}
        with install_backend(FaultyBackend(backend_for(DEV), fail={"launch": {2: 700}}), "emulated"):
            first = stream.submit(pool.table, host.kernel_table, SRC, DST, **kw)
        assert first.status == "partial" and stream.latched is first
        before = _host_bytes(host)
        with pytest.raises(RuntimeError) as info:
            stream.submit(pool.table, host.kernel_table, SRC, DST, **kw)
        assert type(info.value) is errors.LatchedError and "(3, 6)" in str(info.value)
        assert same(_host_bytes(host), before)  # nothing launched while latched
        assert stream.reset() is first and stream.latched is None
        assert stream.submit(pool.table, host.kernel_table, SRC, DST, **kw).done
        assert same(_host_bytes(host), reference_transfer(pool_bytes(pool), LAYOUT, before, HOST, SRC, DST))


class _Engine:
    """A Mooncake-like engine whose ``fail_at``-th transfer call returns -1."""

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at = fail_at
        self.transfers = 0
        self.moved: list[int] = []

    def _transfer(self, *args: Any) -> int:
        self.transfers += 1
        if self.transfers == self.fail_at:
            return -1
        self.moved.append(args[1])
        return 0

    def __getattr__(self, name: str) -> Any:
        if "transfer" in name:
            return self._transfer
        return lambda *args: 4242 if name == "get_rpc_port" else 0


@pytest.mark.parametrize("fail_at", [None, 1, 3])
def test_an_engine_failure_is_an_outcome_block_by_block(fail_at: int | None) -> None:
    with pd.HostKVPool(HOST, DEV) as host:
        fake = _Engine(fail_at)
        engine = HostTransferEngine(fake, "127.0.0.1")
        engine.batch_register_memory(host.get_contiguous_buf_infos())
        blocks = host.get_page_buffer_meta([0, 1, 2, 3])
        outcome = engine_outcomes.mooncake_blocks(engine, "read", "peer:1", blocks, blocks)
        n = len(blocks)
        if fail_at is None:
            assert outcome.done and len(fake.moved) == n
            return
        assert outcome.failed_spans == tuple((i, i + 1) for i in range(fail_at - 1, n))
        assert outcome.status == ("failed" if fail_at == 1 else "partial")
        assert isinstance(outcome.error, errors.RuntimeCallError) and "-1" in (outcome.reason or "")
        assert fake.moved == [b.address.value for b in blocks[: fail_at - 1]]  # nothing sent after the failure


def test_an_engine_batch_failure_fails_every_block_and_latches() -> None:
    with pd.HostKVPool(HOST, DEV) as host:
        engine = HostTransferEngine(_Engine(1), "127.0.0.1")
        engine.batch_register_memory(host.get_contiguous_buf_infos())
        blocks = host.get_page_buffer_meta([1, 2])
        stream = TransferStream(DEV)
        outcome = engine_outcomes.mooncake_batch(engine, "write", "peer:1", blocks, blocks, stream=stream)
        assert outcome.status == "failed" and outcome.failed_spans == ((0, len(blocks)),)
        with pytest.raises(errors.LatchedError):
            engine_outcomes.mooncake_batch(engine, "write", "peer:1", blocks, blocks, stream=stream)
        with pytest.raises(errors.InvalidArgumentError, match="'read' or 'write'"):
            engine_outcomes.mooncake_batch(engine, "copy", "peer:1", blocks, blocks)  # type: ignore[arg-type]


class _NixlAgent:
    """A NIXL-like agent: ``register_memory`` raises when ``refuse_register``; a transfer
    ends in ``state``."""

    def __init__(self, state: str = "DONE", refuse_register: bool = False) -> None:
        self.state = state
        self.refuse_register = refuse_register
        self.transfers = 0

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            if name == "register_memory":
                if self.refuse_register:
                    raise RuntimeError("nixlBackendError: registration refused")
                return ("handle", 1)
            if name == "transfer":
                self.transfers += 1
                return self.state
            return None

        return call


@pytest.mark.parametrize("state", ["DONE", "ERR"])
def test_a_nixl_error_state_is_a_failed_outcome(state: str) -> None:
    from pointerdomain.adapters.nixl import HostNixlAgent, dram_desc

    with pd.HostKVPool(HOST, DEV) as host:
        fake = _NixlAgent(state)
        agent = HostNixlAgent("fake", agent=fake)
        agent.register_pool(host)
        blocks = [dram_desc(b) for b in host.get_page_buffer_meta([0, 1])]
        outcome = engine_outcomes.nixl_transfer(agent, "READ", blocks, blocks, "peer")
        assert fake.transfers == 1
        if state == "DONE":
            assert outcome.done
            return
        assert outcome.status == "failed" and outcome.failed_spans == ((0, len(blocks)),)
        assert isinstance(outcome.error, errors.RuntimeCallError) and "ERR" in (outcome.reason or "")
        agent.close()


def test_a_dropped_registration_failure_is_a_failed_outcome_not_done() -> None:
    """The engine refused the pool's registration and the caller went on: the transfer
    over that pool is a failed outcome (nothing reached the engine), never done."""
    from pointerdomain.adapters.nixl import HostNixlAgent, dram_desc

    with pd.HostKVPool(HOST, DEV) as host:
        fake = _NixlAgent(refuse_register=True)
        agent = HostNixlAgent("fake", agent=fake)
        with pytest.raises(errors.RuntimeCallError):
            agent.register_pool(host)
        blocks = [dram_desc(b) for b in host.get_page_buffer_meta([2])]
        stream = TransferStream(DEV)
        outcome = engine_outcomes.nixl_transfer(agent, "READ", blocks, blocks, "peer", stream=stream)
        assert outcome.status == "failed" and isinstance(outcome.error, errors.NotRegisteredError)
        assert fake.transfers == 0 and stream.latched is outcome


def test_a_failure_the_drain_finds_is_a_failed_outcome_and_latches() -> None:
    """An error word the drain reads (a destination slot given twice in a graph replay, the
    device's deferred OverlapError) fails the request as an outcome, latches a stream, and
    reset() raises it as documented, staying latched until a clean drain."""
    from pointerdomain.testing import EmulatedGraph

    pool = pd.DeviceKVPool(LAYOUT, DEV)
    with pd.HostKVPool(HOST, DEV) as host:
        graph = EmulatedGraph()
        with graph.capture(DEV):  # slot 5 twice: found on the device at replay
            pd.transfer_kv_all_layer(pool.table, host.kernel_table, torch.tensor([0, 1]), torch.tensor([5, 5]),
                                     src_layout=LAYOUT, dst_layout=HOST)
        empty = torch.tensor([], dtype=torch.int64)
        graph.replay()
        out = transfer_outcome(pool.table, host.kernel_table, empty, empty, src_layout=LAYOUT, dst_layout=HOST)
        assert out.status == "failed" and isinstance(out.error, errors.OverlapError)
        graph.replay()
        stream = TransferStream(DEV)
        assert not stream.submit(pool.table, host.kernel_table, empty, empty, src_layout=LAYOUT,
                                 dst_layout=HOST).done
        assert stream.latched is not None
        graph.replay()
        with pytest.raises(errors.OverlapError):
            stream.reset()
        assert stream.latched is not None
        assert stream.reset() is not None and stream.latched is None  # a clean drain clears it
        graph.reset()


def test_an_outcome_is_refused_while_the_stream_captures_a_graph() -> None:
    """Nothing runs during capture, so no outcome can say what was copied: a failed outcome
    with InvalidArgumentError, nothing captured or written."""
    from pointerdomain.testing import EmulatedGraph

    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 5)
    with pd.HostKVPool(HOST, DEV) as host:
        before = _host_bytes(host)
        graph = EmulatedGraph()
        with graph.capture(DEV):
            out = _backup(host, pool)
        assert out.status == "failed" and isinstance(out.error, errors.InvalidArgumentError)
        assert "capturing" in out.reason
        graph.replay()
        pd.check_errors(DEV)
        assert torch.equal(_host_bytes(host), before)
        graph.reset()


def test_a_stream_takes_tables_of_its_own_device_only() -> None:
    other = pd.DeviceKVPool(LAYOUT, "emulated:1")
    with pd.HostKVPool(HOST, DEV) as host:
        stream = TransferStream("emulated:1")
        with pytest.raises(errors.DeviceMismatchError, match="one TransferStream per device"):
            stream.submit(other.table, host.kernel_table, SRC, DST, src_layout=LAYOUT, dst_layout=HOST)
        assert stream.latched is None
