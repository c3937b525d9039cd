"""The public launch's cached fast path keeps every protection: after warm launches (the
plan found by its src, no capture query while none is open, the index tests asked once)
each broken precondition is still refused with its typed error before anything is
written, over a pool table (one allocation) and over 64 separate allocations; a graph
capture is still seen and held, on this thread only, whether it ends or raises."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import EmulatedGraph, FaultyBackend, backend_for, install_backend
from pointerdomain.transfer import graphs, plan as plan_module
from tests.reference import DEV, as_bytes, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer, same

LAYOUT = model_layout("layer_first", pages=4).replace(num_layers=32)  # 64 entries: kv x layer
HOST = LAYOUT.replace(kind="page_first")
TABLES = ["one allocation", "64 separate allocations"]
#: the emulated backend's count of open stand-in captures
EMULATED_CAPTURES: Any = getattr(backend_for(DEV), "graph_captures")


class _Separate:
    """A device pool over one allocation per kv and layer (what HostKVPool.load takes)."""

    def __init__(self, seed: int) -> None:
        shape = (LAYOUT.num_pages * LAYOUT.page_size, LAYOUT.item_bytes)
        self.buffers = [pd.device_empty(shape, torch.uint8, DEV) for _ in range(LAYOUT.num_kv * LAYOUT.num_layers)]
        for i, b in enumerate(self.buffers):
            fill_random(b, seed + i)
        self.layout = LAYOUT
        self.table = pd.make_kernel_ptr_table(self.buffers, DEV, layout=LAYOUT)


def _device_pool(kind: str, seed: int) -> Any:
    if kind == "one allocation":
        pool = pd.DeviceKVPool(LAYOUT, DEV)
        fill_pool(pool, seed)
        return pool
    return _Separate(seed)


def _device_bytes(pool: Any) -> torch.Tensor:
    return torch.cat([as_bytes(b).reshape(-1) for b in pool.buffers])


def _calls(host: pd.HostKVPool, pool: Any) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    def public(s: torch.Tensor, d: torch.Tensor) -> None:
        pd.transfer_kv_all_layer(host.kernel_table, pool.table, s, d, src_layout=host.layout, dst_layout=pool.layout)

    return {"transfer_kv_all_layer": public, "load": lambda s, d: host.load(pool, s, d),
            "backup": lambda s, d: host.backup(pool, d, s)}


def _warm(calls: dict[str, Callable[[torch.Tensor, torch.Tensor], None]]) -> None:
    s, d = torch.tensor([1, 2]), torch.tensor([3, 4])
    for _ in range(3):
        for call in calls.values():
            call(s, d)


def _snapshot(host: pd.HostKVPool, pool: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return as_bytes(host.buffer).reshape(-1).clone(), _device_bytes(pool).clone()


def _unchanged(host: pd.HostKVPool, pool: Any, before: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return same(as_bytes(host.buffer).reshape(-1), before[0]) and same(_device_bytes(pool), before[1])


@pytest.mark.parametrize("table", TABLES)
def test_warm_calls_copy_what_torch_copies(table: str) -> None:
    pool = _device_pool(table, 1)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 2)
    calls = _calls(host, pool)
    _warm(calls)
    for name in ("transfer_kv_all_layer", "load"):
        s, d = torch.tensor([5, 0, 9]), torch.tensor([1, 14, 2])
        want = reference_transfer(host.buffer, host.layout, _device_bytes(pool), LAYOUT, s, d)
        calls[name](s, d)
        assert same(_device_bytes(pool), want), name
    s, d = torch.tensor([7, 3]), torch.tensor([11, 6])
    fill_random(host.buffer, 3)
    want = reference_transfer(_device_bytes(pool), LAYOUT, host.buffer, host.layout, d, s)
    calls["backup"](s, d)
    assert same(as_bytes(host.buffer).reshape(-1), want)
    host.close()


@pytest.mark.parametrize("call", ["transfer_kv_all_layer", "load", "backup"])
@pytest.mark.parametrize("table", TABLES)
def test_released_index_storage_refused_after_warm_calls(table: str, call: str) -> None:
    pool = _device_pool(table, 3)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 4)
    calls = _calls(host, pool)
    _warm(calls)
    for released in ("src", "dst"):
        s, d = torch.tensor([1, 2]), torch.tensor([3, 4])
        (s if released == "src" else d).untyped_storage().resize_(0)
        before = _snapshot(host, pool)
        with pytest.raises(errors.IndexValidationError, match="storage holds 0 bytes"):
            calls[call](s, d)
        assert _unchanged(host, pool, before)
    host.close()


@pytest.mark.parametrize("call", ["transfer_kv_all_layer", "load", "backup"])
def test_a_table_buffer_pointed_elsewhere_refused_after_warm_calls(call: str) -> None:
    pool = _Separate(5)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 6)
    calls = _calls(host, pool)
    _warm(calls)
    other = pd.device_empty(tuple(pool.buffers[37].shape), torch.uint8, DEV)
    cast(Any, pool.buffers[37]).set_(other)  # entry 37 of 64: the table's address no longer that tensor's memory
    before = _snapshot(host, pool)
    with pytest.raises(errors.ClosedError, match="entry 37.s tensor now views other memory"):
        calls[call](torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert _unchanged(host, pool, before)
    host.close()


@pytest.mark.parametrize("table", TABLES)
def test_a_closed_host_pool_refused_after_warm_calls(table: str) -> None:
    pool = _device_pool(table, 7)
    host = pd.HostKVPool(HOST, DEV)
    calls = _calls(host, pool)
    _warm(calls)
    before = _device_bytes(pool).clone()
    host.close()
    for name, run in calls.items():
        with pytest.raises(errors.ClosedError):
            run(torch.tensor([1, 2]), torch.tensor([3, 4]))
        assert same(_device_bytes(pool), before), name


@pytest.mark.parametrize("table", TABLES)
def test_slot_checks_refused_after_warm_calls(table: str) -> None:
    pool = _device_pool(table, 8)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 9)
    calls = _calls(host, pool)
    _warm(calls)
    slots = LAYOUT.num_slots
    cases: list[tuple[torch.Tensor, torch.Tensor, type[Exception], str]] = [
        (torch.tensor([1, slots]), torch.tensor([3, 4]), errors.IndexValidationError, "outside"),
        (torch.tensor([1, 2]), torch.tensor([-1, 4]), errors.IndexValidationError, "outside"),
        (torch.tensor([1, 2]), torch.tensor([4, 4]), errors.OverlapError, "written twice"),
        (torch.tensor([1, 2, 3]), torch.tensor([3, 4]), errors.IndexValidationError, "slots but"),
        (torch.tensor([1.0, 2.0]), torch.tensor([3, 4]), errors.IndexValidationError, "dtype"),
        (torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), errors.IndexValidationError, "1-D"),
        (torch.tensor([1, 0, 2])[::2], torch.tensor([3, 4]), errors.IndexValidationError, "contiguous"),
    ]
    for s, d, kind, text in cases:
        for name in ("transfer_kv_all_layer", "load"):
            before = _snapshot(host, pool)
            with pytest.raises(kind, match=text):
                _calls(host, pool)[name](s, d)
            assert _unchanged(host, pool, before), (name, text)
    host.close()


def test_indices_in_the_destination_refused_after_warm_calls() -> None:
    pool = _Separate(10)
    host = pd.HostKVPool(HOST, DEV)
    calls = _calls(host, pool)
    _warm(calls)
    inside = pool.buffers[50].view(-1)[:16].view(torch.int64)  # 2 slots' indices in entry 50 of the dst
    inside.copy_(torch.tensor([3, 4]))
    before = _snapshot(host, pool)
    with pytest.raises(errors.OverlapError, match="destination table"):
        calls["load"](torch.tensor([1, 2]), inside)
    assert _unchanged(host, pool, before)
    host.close()


def test_a_capture_is_still_seen_and_held_after_warm_calls() -> None:
    pool = _device_pool("one allocation", 11)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 12)
    calls = _calls(host, pool)
    _warm(calls)
    assert EMULATED_CAPTURES.open == 0
    s, d = torch.tensor([0, 6]), torch.tensor([2, 9])
    before = pool_bytes(pool).clone()
    graph = EmulatedGraph("warm step")
    with graph.capture(DEV):
        assert EMULATED_CAPTURES.open == 1
        host.load(pool, s, d)
    assert EMULATED_CAPTURES.open == 0
    assert same(pool_bytes(pool), before)  # recorded, not run
    assert graphs.held_graphs(host) == [graph.held.name]
    with pytest.raises(errors.BusyError, match="warm step"):
        host.close()
    expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), LAYOUT, s, d)
    graph.replay()
    assert same(pool_bytes(pool), expected)
    graph.reset()
    host.close()


def test_the_capture_count_drops_when_the_capture_body_raises() -> None:
    graph = EmulatedGraph("raising step")
    with pytest.raises(ZeroDivisionError):
        with graph.capture(DEV):
            assert EMULATED_CAPTURES.open == 1
            _ = 1 // 0
    assert EMULATED_CAPTURES.open == 0


def test_a_capture_on_another_thread_neither_captures_nor_holds_this_threads_launch() -> None:
    pool = _device_pool("one allocation", 13)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 14)
    _warm(_calls(host, pool))
    inside, leave = threading.Event(), threading.Event()
    graph = EmulatedGraph("other thread")

    def capture() -> None:
        with graph.capture(DEV):
            inside.set()
            leave.wait(30)

    worker = threading.Thread(target=capture)
    worker.start()
    try:
        assert inside.wait(30) and EMULATED_CAPTURES.open == 1
        s, d = torch.tensor([1, 8]), torch.tensor([5, 12])
        expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), LAYOUT, s, d)
        host.load(pool, s, d)  # this thread is not capturing: copied now, no hold
        assert same(pool_bytes(pool), expected)
        assert graphs.held_graphs(host) == [] and graph.launches == []
    finally:
        leave.set()
        worker.join(30)
    assert EMULATED_CAPTURES.open == 0
    graph.reset()
    host.close()


def test_a_wrapping_backend_forwards_the_capture_count() -> None:
    inner = backend_for(DEV)
    with install_backend(FaultyBackend(inner, {}), "emulated") as wrapper:
        assert getattr(wrapper, "graph_captures", None) is EMULATED_CAPTURES
        pool = _device_pool("one allocation", 15)
        host = pd.HostKVPool(HOST, DEV)
        _warm(_calls(host, pool))
        graph = EmulatedGraph("wrapped")
        with graph.capture(DEV):
            host.load(pool, torch.tensor([1]), torch.tensor([2]))
        assert graphs.held_graphs(host) == [graph.held.name]
        with pytest.raises(errors.BusyError, match="wrapped"):
            host.close()
        graph.reset()
        host.close()


def test_the_plan_src_last_launched_with_is_dropped_with_src_and_never_used_for_another_dst() -> None:
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 16)
    first, second = _device_pool("one allocation", 17), _device_pool("one allocation", 18)
    s, d = torch.tensor([2, 3]), torch.tensor([7, 1])
    host.load(first, s, d)
    key = id(host.kernel_table)
    assert plan_module.LAST_BY_SRC[key].dst_ref() is first.table
    expected = reference_transfer(host.buffer, host.layout, pool_bytes(second), LAYOUT, s, d)
    untouched = pool_bytes(first).clone()
    host.load(second, s, d)  # same src, another dst: the other dst's own plan
    assert same(pool_bytes(second), expected) and same(pool_bytes(first), untouched)
    assert plan_module.LAST_BY_SRC[key].dst_ref() is second.table
    table = pd.make_kernel_ptr_table(first.buffers, DEV, layout=LAYOUT)
    pd.transfer_kv_all_layer(table, cast(Any, second).table, s, d, src_layout=LAYOUT, dst_layout=LAYOUT)
    dropped = id(table)
    assert dropped in plan_module.LAST_BY_SRC
    del table
    gc.collect()
    assert dropped not in plan_module.LAST_BY_SRC
    host.close()


def test_bind_call_is_what_the_launch_and_explain_transfer_run() -> None:
    from pointerdomain.transfer import kernels

    pool = _device_pool("one allocation", 19)
    host = pd.HostKVPool(HOST, DEV)
    s, d = torch.tensor([1, 2]), torch.tensor([3, 4])
    call: tuple[Any, ...] = (host.kernel_table, host.layout, pool.table, LAYOUT, s, d, 0, LAYOUT.num_layers, None, 4,
                             "auto", True)
    plan, options, args, host_indices, path = kernels.bind_call(*call)
    assert (plan, options, args, host_indices) == kernels.check_call(*call)
    assert kernels.bind_call(*call, False)[4] is None  # type: ignore[call-arg]  # (not asked to choose)
    assert (args.src_idx, args.dst_idx, args.n, args.layer_begin, args.layer_count) == (
        s.data_ptr(), d.data_ptr(), 2, 0, LAYOUT.num_layers)
    choice = pd.explain_transfer(host.kernel_table, pool.table, s, d, src_layout=host.layout, dst_layout=LAYOUT)
    assert path is not None and choice.path == path.value and choice.host_indices == host_indices
    s.untyped_storage().resize_(0)  # what the launch refuses, bind_call and explain_transfer refuse alike
    for run in (lambda: kernels.bind_call(*call),
                lambda: pd.explain_transfer(host.kernel_table, pool.table, s, d, src_layout=host.layout,
                                            dst_layout=LAYOUT),
                lambda: host.load(pool, s, d)):
        with pytest.raises(errors.IndexValidationError, match="storage holds 0 bytes"):
            run()
    host.close()


def test_layer_range() -> None:
    from pointerdomain.transfer.kernels import layer_range

    assert layer_range(LAYOUT, None) == (0, LAYOUT.num_layers)
    assert layer_range("not a layout", None) == (0, 0)  # reported by bind_call after the tables' checks
    assert layer_range(LAYOUT, 5) == (5, 1) and layer_range(LAYOUT, 5, False) == (5, 1)
    for bad, kind, text in [
        (None, errors.IndexValidationError, "layer_id must be an int, got None"),
        (True, errors.IndexValidationError, "layer_id must be an int"),
        (LAYOUT.num_layers, errors.IndexValidationError, f"outside \\[0, {LAYOUT.num_layers}\\)"),
        (-1, errors.IndexValidationError, "outside"),
    ]:
        with pytest.raises(kind, match=text):
            layer_range(LAYOUT, bad, False)
    with pytest.raises(errors.InvalidArgumentError, match="src_layout must be a KVLayout"):
        layer_range("not a layout", 0)


def test_indices_between_the_destinations_storages_are_not_in_them() -> None:
    # Allocations one after another, every other one in the table: index tensors in a gap
    # lie inside the span of the table's storages but in none of them.
    shape = (LAYOUT.num_pages * LAYOUT.page_size, LAYOUT.item_bytes)
    allocations = [pd.device_empty(shape, torch.uint8, DEV) for _ in range(2 * LAYOUT.num_kv * LAYOUT.num_layers)]
    table_buffers, gaps = allocations[::2], allocations[1::2]
    starts = sorted(b.data_ptr() for b in table_buffers)
    gap = next((g for g in gaps if starts[0] < g.data_ptr() < starts[-1]), None)
    if gap is None:
        pytest.skip("precondition: the allocator placed no gap allocation between the table's")
    for i, b in enumerate(table_buffers):
        fill_random(b, 40 + i)
    table = pd.make_kernel_ptr_table(table_buffers, DEV, layout=LAYOUT)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 20)
    indices = gap.view(-1)[:16].view(torch.int64)
    indices.copy_(torch.tensor([3, 4]))
    before = torch.cat([as_bytes(b).reshape(-1) for b in table_buffers])
    expected = reference_transfer(host.buffer, host.layout, before, LAYOUT, torch.tensor([1, 2]), torch.tensor([3, 4]))
    pd.transfer_kv_all_layer(host.kernel_table, table, torch.tensor([1, 2]), indices, src_layout=host.layout,
                             dst_layout=LAYOUT)
    assert same(torch.cat([as_bytes(b).reshape(-1) for b in table_buffers]), expected)
    inside = table_buffers[len(table_buffers) // 2].view(-1)[:16].view(torch.int64)
    inside.copy_(torch.tensor([3, 4]))
    with pytest.raises(errors.OverlapError, match="destination table"):
        pd.transfer_kv_all_layer(host.kernel_table, table, torch.tensor([1, 2]), inside, src_layout=host.layout,
                                 dst_layout=LAYOUT)
    host.close()


def test_memory_device_of_cpu_tensors() -> None:
    # the launch's worded index checks ask it for CPU indices: host memory is None, emulated
    # device memory its device, whichever device was asked about before
    one = pd.Device("emulated", 1)
    on_one, on_zero = pd.device_empty((4,), torch.int64, one), pd.device_empty((4,), torch.int64, DEV)
    host = torch.zeros(4, dtype=torch.int64)
    for _ in range(2):
        assert pd.memory_device(host) is None and pd.memory_device(host, whole_storage=True) is None
        assert pd.memory_device(on_one) == one and pd.memory_device(on_one[2:], whole_storage=True) == one
        assert pd.memory_device(on_zero) == DEV and pd.memory_device(on_zero[1:]) == DEV
    assert pd.memory_device_at(host.data_ptr(), 32) is None and pd.memory_device_at(on_one.data_ptr(), 32) == one


def _to_int32(t: torch.Tensor) -> None:
    t.data = t.to(torch.int32)


def _to_float64(t: torch.Tensor) -> None:  # the same element size: only the dtype tells
    t.data = t.view(torch.float64)


def _strided(t: torch.Tensor) -> None:
    t.set_(torch.arange(8).untyped_storage(), 0, (2,), (2,))


def _two_dims(t: torch.Tensor) -> None:
    t.set_(t.untyped_storage(), 0, (1, 2), (2, 1))


def _past_storage(t: torch.Tensor) -> None:
    t.set_(torch.arange(8).untyped_storage(), 6, (2,), (1,))
    t.untyped_storage().resize_(56)  # 7 of the 8 elements: the view's last one is gone


INDEX_CHANGES: dict[str, tuple[Callable[[torch.Tensor], None], type[errors.PointerDomainError], str]] = {
    "int32 (.data =)": (_to_int32, errors.IndexValidationError, "dtype torch.int32"),
    "float64 (.data =)": (_to_float64, errors.IndexValidationError, "dtype torch.float64"),
    "stride 2 (set_)": (_strided, errors.IndexValidationError, "not contiguous"),
    "2-D (set_)": (_two_dims, errors.IndexValidationError, "expected 1-D"),
    "storage ends inside the view": (_past_storage, errors.IndexValidationError, "fewer than the tensor views"),
}


@pytest.mark.parametrize("change", INDEX_CHANGES)
@pytest.mark.parametrize("call", ["transfer_kv_all_layer", "load", "backup"])
def test_index_tensors_changed_in_place_refused_after_warm_calls(call: str, change: str) -> None:
    """The same tensor objects, warm, then changed under the launch: the native index test
    (or torch's queries where it does not apply) refuses them with the error a fresh call gets."""
    mutate, error, message = INDEX_CHANGES[change]
    pool = _device_pool("one allocation", 7)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 8)
    calls = _calls(host, pool)
    for side in ("src", "dst"):
        s, d = torch.tensor([1, 2]), torch.tensor([3, 4])
        for _ in range(3):
            calls[call](s, d)
        mutate(s if side == "src" else d)
        before = _snapshot(host, pool)
        with pytest.raises(error, match=message):
            calls[call](s, d)
        assert _unchanged(host, pool, before)
    host.close()


def test_index_tensors_of_a_subclass_and_views_copy_what_torch_copies() -> None:
    """What the native index test does not take (a tensor subclass) goes to torch's queries;
    views at an offset and empty index tensors go through it: every one copies the reference."""
    pool = _device_pool("one allocation", 9)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 10)
    base = torch.tensor([0, 5, 0, 9, 3, 0])
    pairs = [(torch.nn.Parameter(torch.tensor([5, 9]), requires_grad=False), torch.tensor([2, 6])),
             (base[3:5], torch.arange(20)[11:13]), (torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))]
    for s, d in pairs:
        want = reference_transfer(host.buffer, host.layout, _device_bytes(pool), LAYOUT, s.detach(), d)
        pd.transfer_kv_all_layer(host.kernel_table, pool.table, s, d, src_layout=host.layout, dst_layout=pool.layout)
        assert same(_device_bytes(pool), want)
    host.close()


@pytest.mark.parametrize("call", ["transfer_kv_all_layer", "load", "backup"])
def test_indices_in_another_emulated_devices_memory_refused_after_warm_calls(call: str) -> None:
    pool = _device_pool("one allocation", 11)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, 12)
    calls = _calls(host, pool)
    _warm(calls)
    here = pd.device_empty((2,), torch.int64, DEV).copy_(torch.tensor([3, 4]))  # this device's memory: taken
    calls[call](torch.tensor([1, 2]), here)
    other = pd.device_empty((2,), torch.int64, "emulated:1").copy_(torch.tensor([1, 2]))
    for pair in ((other, torch.tensor([3, 4])), (torch.tensor([3, 4]), other)):
        before = _snapshot(host, pool)
        with pytest.raises(errors.IndexValidationError, match="device memory of emulated:1"):
            calls[call](*pair)
        assert _unchanged(host, pool, before)
    host.close()
