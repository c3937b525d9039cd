"""Memory a captured graph uses stays as it was while the graph exists
(pointerdomain.transfer.graphs): closing it is refused with BusyError naming the graph,
a reset graph refuses to replay, a replay over released storage (a table's or an index
tensor's, freed or swapped) is refused, and the
generation numbers of tables and pools change when memory under them closes.

CPU: the emulated device's stand-in graph (pointerdomain.testing.EmulatedGraph); the
CUDA case is marked gpu."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import EmulatedGraph
from pointerdomain.transfer import graphs
from tests.reference import (
    DEV,
    as_bytes,
    fill_pool,
    fill_random,
    model_layout,
    pool_bytes,
    reference_transfer,
    same,
)

LAYOUT = model_layout("layer_first", pages=4)
HOST = LAYOUT.replace(kind="page_first")


def _pools(seed: int) -> tuple[pd.DeviceKVPool, pd.HostKVPool]:
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, seed)
    host = pd.HostKVPool(HOST, DEV)
    fill_random(host.buffer, seed + 100)
    return pool, host


def test_a_captured_load_runs_at_replay_with_the_current_indices() -> None:
    pool, host = _pools(1)
    src = torch.tensor([0, 1, 2])
    dst = torch.tensor([3, 4, 5])
    before = pool_bytes(pool)
    graph = EmulatedGraph("decode step")
    with graph.capture(DEV):
        host.load(pool, src, dst)
    assert same(pool_bytes(pool), before)  # captured, not run
    src.copy_(torch.tensor([7, 9, 11]))  # a replay reads the indices as they are then
    dst.copy_(torch.tensor([1, 2, 6]))
    expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, src, dst)
    graph.replay()
    assert same(pool_bytes(pool), expected)
    graph.reset()
    host.close()


def test_closing_a_pool_a_graph_captured_is_refused_until_the_graph_is_reset() -> None:
    pool, host = _pools(2)
    slots = torch.tensor([0, 5])
    graph = EmulatedGraph("prefill step")
    with graph.capture(DEV):
        host.backup(pool, slots, slots)
    generation = host.generation
    recorded = graphs.generations(host, host.kernel_table)
    with pytest.raises(RuntimeError) as info:
        host.close()
    assert type(info.value) is errors.BusyError
    text = str(info.value)
    assert "prefill step on emulated:0" in text and "test_graph_freeze.py" in text and "nothing was unregistered" in text
    assert not host.memory.closed and host.generation == generation
    assert graphs.held_graphs(host) == [graph.held.name] and graphs.still_valid(recorded, host, host.kernel_table)
    # still open and usable: an eager launch and a replay both copy
    fill_pool(pool, 20)
    expected = reference_transfer(pool_bytes(pool), pool.layout, host.buffer, host.layout, slots, slots)
    graph.replay()
    assert same(as_bytes(host.buffer).reshape(-1), expected)
    graph.reset()
    host.close()
    assert host.memory.closed and host.generation > generation
    assert not graphs.still_valid(recorded, host, host.kernel_table)
    with pytest.raises(RuntimeError) as replay:
        graph.replay()
    assert type(replay.value) is errors.GraphInvalidatedError and "was reset" in str(replay.value)


def test_closing_a_registered_tensor_a_graph_captured_is_refused() -> None:
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 3)
    backing = torch.zeros(HOST.nbytes, dtype=torch.uint8)
    reg = pd.register_host_tensor(backing, DEV)
    table = pd.make_kernel_ptr_table([backing], DEV, layout=HOST)
    slots = torch.tensor([1, 2, 3])
    graph = EmulatedGraph()
    with graph.capture(DEV):
        pd.transfer_kv_all_layer(pool.table, table, slots, slots, src_layout=LAYOUT, dst_layout=HOST)
    assert int(backing.count_nonzero()) == 0
    with pytest.raises(errors.BusyError, match=graph.name):
        reg.close()
    graph.replay()
    expected = reference_transfer(pool_bytes(pool), LAYOUT, torch.zeros(HOST.nbytes, dtype=torch.uint8), HOST,
                                  slots, slots)
    assert same(backing, expected)
    graph.reset()
    reg.close()
    assert reg.closed


def test_a_replay_over_released_storage_is_refused_and_writes_nothing() -> None:
    pool, host = _pools(4)
    slots = torch.tensor([2, 3])
    graph = EmulatedGraph()
    with graph.capture(DEV):
        host.load(pool, slots, slots)
    # the table's buffer moved to other storage under the graph (its old storage is what the graph holds)
    pool.buffers[0].set_(torch.empty_like(pool.buffers[0]))
    host_before = host.buffer.clone()
    with pytest.raises(errors.GraphInvalidatedError, match="storage was released"):
        graph.replay()
    assert same(host.buffer, host_before)
    graph.reset()
    host.close()


@pytest.mark.parametrize("which", ["src", "dst"])
@pytest.mark.parametrize("how", ["resize_", "set_"])
def test_a_replay_over_index_storage_freed_or_swapped_is_refused_and_writes_nothing(which: str, how: str) -> None:
    """The graph reads the index tensors by their captured addresses: an index storage
    released (resize_) or swapped (set_) under it refuses the replay, nothing written; the
    captured storage stays allocated while the graph exists."""
    pool, host = _pools(9)
    src, dst = torch.tensor([0, 1]), torch.tensor([4, 5])
    graph = EmulatedGraph()
    with graph.capture(DEV):
        host.backup(pool, src, dst)
    host.buffer.view(torch.uint8).fill_(0xEE)  # poisoned: any byte a replay writes shows
    before = host.buffer.clone()
    index = src if which == "src" else dst
    captured_ptr = index.untyped_storage().data_ptr()
    if how == "resize_":
        index.untyped_storage().resize_(0)
    else:
        index.set_(torch.tensor([8, 9]))
    with pytest.raises(errors.GraphInvalidatedError, match=f"{which}_indices") as info:
        graph.replay()
    assert isinstance(info.value, RuntimeError) and "nothing was copied" in str(info.value)
    assert same(host.buffer, before)
    if how == "set_":  # the old storage is what a CUDA replay reads: still allocated, its values intact
        held = [k for k in graph.held.keep if isinstance(k, graphs.CapturedIndex) and k.ptr == captured_ptr]
        assert held and held[0].storage.data_ptr() == captured_ptr and held[0].storage.nbytes() == 16
        assert torch.equal(torch.empty(0, dtype=torch.int64).set_(held[0].storage), torch.tensor([0, 1]) if
                           which == "src" else torch.tensor([4, 5]))
    graph.reset()
    assert not [k for k in graph.held.keep if isinstance(k, graphs.CapturedIndex)]
    host.close()


def test_an_index_changed_in_place_still_replays() -> None:
    """copy_ into a captured index tensor keeps its storage: the replay reads the new values."""
    pool, host = _pools(10)
    src, dst = torch.tensor([0, 1]), torch.tensor([4, 5])
    graph = EmulatedGraph()
    with graph.capture(DEV):
        host.backup(pool, src, dst)
    host.buffer.view(torch.uint8).fill_(0xEE)
    src.copy_(torch.tensor([6, 2]))
    dst.copy_(torch.tensor([9, 3]))
    expected = reference_transfer(pool_bytes(pool), LAYOUT, as_bytes(host.buffer).reshape(-1).clone(), HOST, src, dst)
    graph.replay()
    assert same(as_bytes(host.buffer).reshape(-1), expected)
    graph.reset()
    host.close()


def test_an_eager_launch_holds_nothing() -> None:
    pool, host = _pools(5)
    host.backup(pool, torch.tensor([0]), torch.tensor([0]))
    assert graphs.held_graphs(host) == []
    host.close()


def test_capture_refuses_a_second_capture_and_a_cuda_device() -> None:
    graph = EmulatedGraph()
    with graph.capture(DEV), pytest.raises(errors.InvalidArgumentError, match="being captured"):
        with EmulatedGraph().capture(DEV):
            pass
    with pytest.raises(errors.InvalidArgumentError, match="captured already"):
        with graph.capture(DEV):
            pass
    with pytest.raises(errors.InvalidArgumentError, match="expected a str"):
        EmulatedGraph(3)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_cuda_graph_holds_its_pool_until_it_is_destroyed() -> None:
    """CUDA: a pool whose launch a torch.cuda.graph captured cannot close while the graph
    exists (BusyError naming the capture); a replay copies; once the graph is deleted the
    pool closes."""
    import gc

    dev = pd.Device("cuda", 0)
    pool = pd.DeviceKVPool(LAYOUT, dev)
    fill_pool(pool, 6)
    host = pd.HostKVPool(HOST, dev)
    host.buffer.zero_()
    src = torch.tensor([1, 2], device="cuda")
    dst = torch.tensor([3, 4], device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        host.backup(pool, src, dst, backend="kernel")
    with pytest.raises(errors.BusyError, match="CUDA graph of capture"):
        host.close(timeout=1.0)
    assert not host.memory.closed
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_transfer(pool_bytes(pool), LAYOUT, torch.zeros(HOST.nbytes, dtype=torch.uint8), HOST,
                                  src.cpu(), dst.cpu())
    assert same(as_bytes(host.buffer).reshape(-1), expected)
    del graph
    gc.collect()
    torch.cuda.synchronize()
    host.close(timeout=5.0)
    assert host.memory.closed


@pytest.mark.gpu
def test_cuda_graph_keeps_a_swapped_index_storage_allocated() -> None:
    """CUDA: an index tensor moved to other storage (set_) under a graph cannot be refused
    (torch replays the graph); the captured storage stays allocated, so the replay reads
    the captured values rather than memory the caching allocator handed out again."""
    import gc

    dev = pd.Device("cuda", 0)
    pool = pd.DeviceKVPool(LAYOUT, dev)
    fill_pool(pool, 7)
    host = pd.HostKVPool(HOST, dev)
    host.buffer.view(torch.uint8).fill_(0xEE)
    poisoned = as_bytes(host.buffer).reshape(-1).clone()
    src = torch.tensor([1, 2], device="cuda")
    dst = torch.tensor([3, 4], device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        host.backup(pool, src, dst, backend="kernel")
    dst.set_(torch.tensor([5, 6], device="cuda"))
    gc.collect()
    reuse = [torch.full((2,), 7, dtype=torch.int64, device="cuda") for _ in range(64)]  # would take a freed block
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_transfer(pool_bytes(pool), LAYOUT, poisoned, HOST, torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert same(as_bytes(host.buffer).reshape(-1), expected)
    del graph, reuse
    gc.collect()
    torch.cuda.synchronize()
    host.close(timeout=5.0)


def test_a_layer_pointer_table_a_graph_captured_is_not_replaced() -> None:
    """Re-tabling: the LMCache-style cache refuses to rebuild or drop a table a live graph
    launched with (the graph would replay the old caches); after the graph is reset it
    rebuilds."""
    from pointerdomain.adapters import lmcache

    layers, blocks, bs, heads, dim, count = 2, 4, 4, 1, 8, 4
    shape = (2, blocks, bs, heads, dim)
    caches = [pd.device_empty(shape, torch.bfloat16, DEV) for _ in range(layers)]
    for i, c in enumerate(caches):
        fill_random(c, 30 + i)
    mem = pd.alloc_registered(2 * layers * count * heads * dim * 2, DEV)
    chunk = mem.tensor.view(torch.bfloat16).view(2, layers, count, heads * dim)
    connector = lmcache.PagedKVConnector()
    slots = torch.tensor([3, 9, 12, 0])
    graph = EmulatedGraph("lmcache store")
    with graph.capture(DEV):
        connector.from_gpu(chunk, 0, count, kvcaches=caches, slot_mapping=slots)
    cache = connector.pointer_cache
    (table,) = [entry[1] for entry in cache._entries.values()]  # noqa: SLF001
    assert graphs.graphs_holding(table) == [graph.held.name] and cache.builds == 1
    moved = [pd.device_empty(shape, torch.bfloat16, DEV) for _ in range(layers)]  # the engine reallocated
    with pytest.raises(errors.BusyError, match="lmcache store"):
        connector.from_gpu(chunk, 0, count, kvcaches=moved, slot_mapping=slots)
    with pytest.raises(errors.BusyError, match="lmcache store"):
        cache.invalidate()
    assert len(cache) == 1 and cache.builds == 1  # unchanged
    graph.replay()  # the captured temporaries (the chunk's indices) were kept for it
    for layer in range(layers):
        for kv in range(2):
            want = caches[layer][kv].reshape(-1, heads, dim)[slots]
            assert same(chunk[kv, layer].view(count, heads, dim), want)
    graph.reset()
    connector.from_gpu(chunk, 0, count, kvcaches=moved, slot_mapping=slots)
    assert cache.builds == 2
    mem.close()


def test_capture_is_per_thread_as_stream_capture_is() -> None:
    """Another thread's launch during a capture runs at once and is not part of the graph."""
    import threading

    pool, host = _pools(7)
    slots = torch.tensor([1])
    graph = EmulatedGraph()
    expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, slots, slots)
    with graph.capture(DEV):
        worker = threading.Thread(target=host.load, args=(pool, slots, slots))
        worker.start()
        worker.join()
    assert same(pool_bytes(pool), expected) and graph.launches == []
    assert graphs.held_graphs(host) == []
    host.close()


# Layouts that split an item into parts (several heads, head groups): the launch reads the
# parts' indices, computed from the caller's. A CUDA graph captures that computation with
# the launch; the stand-in must compute them again at each replay from the indices as they
# are then, or a replay writes where the indices pointed at capture. The reference is the
# same copy run eagerly (its bytes are checked item by item in test_layouts_head.py).
_SPLIT = [("page_head", 1), ("page_unified", 2)]


def _split_host(kind: str, groups: int) -> pd.HostKVPool:
    host = pd.HostKVPool(LAYOUT.replace(kind=kind, head_groups=groups), DEV)
    host.buffer.view(torch.uint8).fill_(0xEE)
    return host


def _eager(pool: pd.DeviceKVPool, kind: str, groups: int, src: list[int], dst: list[int]) -> torch.Tensor:
    ref = _split_host(kind, groups)
    if src:
        ref.backup(pool, torch.tensor(src), torch.tensor(dst), backend="kernel")
    out = as_bytes(ref.buffer).reshape(-1).clone()
    ref.close()
    return out


@pytest.mark.strict_alias
@pytest.mark.parametrize(("kind", "groups"), _SPLIT)
def test_a_split_item_replay_follows_indices_changed_in_place(kind: str, groups: int) -> None:
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 40)
    host = _split_host(kind, groups)
    src, dst = torch.tensor([0, 1]), torch.tensor([3, 4])
    graph = EmulatedGraph()
    with graph.capture(DEV):
        host.backup(pool, src, dst, backend="kernel")
    assert bool((as_bytes(host.buffer) == 0xEE).all())  # captured, not run
    src.copy_(torch.tensor([5, 2]))
    dst.copy_(torch.tensor([9, 6]))
    graph.replay()
    assert same(as_bytes(host.buffer).reshape(-1), _eager(pool, kind, groups, [5, 2], [9, 6]))
    graph.reset()
    host.close()


@pytest.mark.strict_alias
@pytest.mark.parametrize(("kind", "groups"), _SPLIT)
@pytest.mark.parametrize("bad", ["out_of_range", "duplicate"])
def test_a_split_item_replay_of_bad_indices_set_in_place_writes_nothing_and_reports(
        kind: str, groups: int, bad: str) -> None:
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    fill_pool(pool, 41)
    host = _split_host(kind, groups)
    src, dst = torch.tensor([0, 1]), torch.tensor([3, 4])
    graph = EmulatedGraph()
    with graph.capture(DEV):
        host.backup(pool, src, dst, backend="kernel")
    dst.copy_(torch.tensor([3, 10 ** 6]) if bad == "out_of_range" else torch.tensor([7, 7]))
    graph.replay()
    with pytest.raises(errors.IndexValidationError if bad == "out_of_range" else errors.OverlapError):
        pd.check_errors(DEV)
    if bad == "duplicate":  # the duplicate pass runs before any copy: nothing written
        assert bool((as_bytes(host.buffer) == 0xEE).all())
    else:  # the pair in range is copied, the other skipped: nothing else changes
        assert same(as_bytes(host.buffer).reshape(-1), _eager(pool, kind, groups, [0], [3]))
    graph.reset()
    host.close()
