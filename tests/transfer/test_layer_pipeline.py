"""The layer pipeline (``HostKVPool.load_layers`` / ``pd.load_layers``): every layer queued
at once, exact bytes against the torch reference, per-layer completion, and the call's
errors raised before the first layer is queued."""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.helpers.checks import assert_round_trip
from pointerdomain.testing import DelegatingBackend, EmulatedGraph, backend_for, install_backend
from tests.reference import (
    DEV,
    as_bytes,
    fill_pool,
    fill_random,
    filled_pools,
    items,
    model_layout,
    pool_bytes,
    reference_transfer,
    same,
)

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engine"])
def test_load_layers_moves_the_reference_bytes(kind: str, attention: str, backend: str) -> None:
    dev_layout = model_layout("layer_first", pages=6, attention=attention)
    host_layout = model_layout(kind, pages=10, attention=attention)
    with filled_pools(dev_layout, host_layout, DEV, chunk_blocks=None, seed=3) as (pool, host):
        dev_slots = torch.tensor([0, 5, 23, 7, 12, 13])
        host_slots = torch.tensor([39, 2, 8, 17, 30, 31])
        loads: list[pd.LayerLoad] = []

        def load() -> None:
            loads.append(host.load_layers(pool, host_slots, dev_slots, backend=backend))  # type: ignore[arg-type]

        assert_round_trip(pool, host, dev_slots, host_slots, poison_seed=77, load=load)
        (done,) = loads
        assert done.num_layers == dev_layout.num_layers
        assert all(done.ready(layer) for layer in range(done.num_layers))  # synchronous device: all done
        for layer in range(done.num_layers):
            done.wait(layer)
            done.wait(layer, stream=0)
        done.synchronize()


def test_load_layers_touches_only_the_given_slots_of_every_layer() -> None:
    """A poisoned destination: the bytes outside the moved slots stay the poison."""
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 9)
    before = pool_bytes(pool).clone()
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        torch.manual_seed(0)
        as_bytes(host.buffer).copy_(torch.randint(0, 256, as_bytes(host.buffer).shape, dtype=torch.uint8))
        empty = torch.empty(0, dtype=torch.int64)
        host.load_layers(pool, empty, empty)
        assert torch.equal(pool_bytes(pool), before)  # nothing to move: nothing written


def test_layer_load_refuses_a_layer_it_did_not_queue() -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=1) as (pool, host):
        idx = torch.arange(4)
        done = host.load_layers(pool, idx, idx)
        for bad in (-1, done.num_layers, 2**70):
            with pytest.raises(errors.IndexValidationError, match="layer"):
                done.wait(bad)
            with pytest.raises(errors.IndexValidationError, match="layer"):
                done.ready(bad)
        for wrong in (1.0, "0", True, None):
            with pytest.raises(errors.IndexValidationError, match="expected an int"):
                done.wait(wrong)  # type: ignore[arg-type]
        for stream in (-1, 2**64, "0", 1.5):
            with pytest.raises(errors.InvalidArgumentError, match="stream"):
                done.wait(0, stream=stream)  # type: ignore[arg-type]
        assert "LayerLoad(3 layers" in repr(done)


def test_load_layers_errors_come_before_any_layer_is_queued() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 4)
    before = pool_bytes(pool).clone()
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        ok = torch.arange(4)
        cases: list[tuple[dict[str, object], type[Exception], str]] = [
            ({"host_indices": torch.tensor([0, 1, 2, 999])}, errors.IndexValidationError, "outside"),
            ({"device_indices": ok[:3]}, errors.IndexValidationError, "has 3"),
            ({"stream": -5}, errors.InvalidArgumentError, "stream"),
            ({"backend": "fast"}, errors.InvalidArgumentError, "backend"),
            ({"max_ctas": -3}, errors.InvalidArgumentError, "max_ctas"),
            ({"backend": "staged"}, errors.InvalidArgumentError, "one copy per layer"),
        ]
        for change, error, match in cases:
            kwargs: dict[str, object] = {"host_indices": ok, "device_indices": ok}
            kwargs.update(change)
            host_idx, dev_idx = kwargs.pop("host_indices"), kwargs.pop("device_indices")
            with pytest.raises(error, match=match):
                host.load_layers(pool, host_idx, dev_idx, **kwargs)  # type: ignore[arg-type]
            assert torch.equal(pool_bytes(pool), before)
        with pytest.raises(errors.InvalidTypeError):
            host.load_layers(host, ok, ok)  # type: ignore[arg-type]
    with pytest.raises(errors.ClosedError):
        host.load_layers(pool, ok, ok)
    assert torch.equal(pool_bytes(pool), before)


def test_module_function_takes_tables_and_layouts() -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=2) as (pool, host):
        idx = torch.tensor([3, 1, 4, 1 + 8, 5])
        fill_pool(pool, 5)
        done = pd.load_layers(host.kernel_table, pool.table, idx, idx, src_layout=host.layout,
                              dst_layout=pool.layout)
        assert done.num_layers == 3
        with pytest.raises(errors.DomainError):
            pd.load_layers(host.host_table, pool.table, idx, idx, src_layout=host.layout,  # type: ignore[arg-type]
                           dst_layout=pool.layout)
        with pytest.raises(errors.InvalidArgumentError, match="KVLayout"):
            pd.load_layers(host.kernel_table, pool.table, idx, idx, src_layout="x",  # type: ignore[arg-type]
                           dst_layout=pool.layout)


# The completion words ----------------------------------------------------------------
# Each layer's flag word reaches the load's generation once the layer's bytes are written
# (the native call walks the layers in order); waits and ready() read the words. The
# emulated backend reads and writes them on the host, so these tests set a word by hand to
# stand for a flag not (yet) published.

def _flag(done: pd.LayerLoad, layer: int) -> ctypes.c_uint32:
    words = done._words  # the load's completion words (host-readable on the emulated device)
    assert words is not None and words.host
    return ctypes.c_uint32.from_address(words.host + 4 * layer)


def test_each_layer_publishes_the_load_generation_and_waits_read_it() -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=4) as (pool, host):
        idx = torch.tensor([2, 9, 4])
        first = host.load_layers(pool, idx, idx)
        second = host.load_layers(pool, idx, idx)  # the same stream's words, the next generation
        assert first.generation >= 1 and second.generation == first.generation + 1
        assert [_flag(second, layer).value for layer in range(3)] == [second.generation] * 3
        assert all(first.ready(layer) and second.ready(layer) for layer in range(3))  # a later flag covers earlier loads
        _flag(second, 1).value = first.generation  # layer 1 of the second load not published (yet)
        assert first.ready(1) and not second.ready(1) and second.ready(0) and second.ready(2)
        with pytest.raises(errors.RuntimeCallError, match="flag 1 holds .* wait forever"):
            second.wait(1)  # a GPU stream would wait; the synchronous device cannot: it raises
        second.wait(0)
        second.wait(2, stream=0)
        first.wait(1)
        _flag(second, 1).value = second.generation
        second.wait(1)
        second.synchronize()


def test_generations_compare_cyclically_and_stay_per_stream() -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=5) as (pool, host):
        idx = torch.tensor([1, 3])
        done = host.load_layers(pool, idx, idx)
        flag = _flag(done, 0)
        for value, ready in [(done.generation + 5, True), (done.generation - 1, False),
                             ((done.generation + 2**31) & 0xFFFFFFFF, False), (0, False)]:
            flag.value = value & 0xFFFFFFFF
            assert done.ready(0) is ready, value


def test_empty_load_queues_nothing_and_is_done() -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=6) as (pool, host):
        empty = torch.empty(0, dtype=torch.int64)
        done = host.load_layers(pool, empty, empty)
        assert done.generation == 0 and done._words is None
        assert all(done.ready(layer) for layer in range(done.num_layers))
        done.wait(2)
        done.synchronize()


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_captured_pipeline_replays_layer_by_layer(attention: str) -> None:
    """A load captured into the stand-in graph with a consumer per layer (a copy of the
    layer into a second host pool, captured after ``wait(layer)``): the capture records
    one launch per layer (no flags: a graph gets its order as edges), and every replay
    moves this replay's bytes (indices and host data rewritten in place) before each
    layer's consumer reads them."""
    dev_layout = model_layout("layer_first", pages=6, attention=attention)
    host_layout = model_layout("page_first", pages=10, attention=attention)
    with filled_pools(dev_layout, host_layout, DEV, chunk_blocks=None, seed=7) as (pool, host), \
            pd.HostKVPool(host_layout, DEV) as sink:
        src = torch.tensor([1, 2, 3, 4])
        dst = torch.tensor([5, 6, 7, 8])
        before = pool_bytes(pool).clone()
        graph = EmulatedGraph("layer pipeline")
        with graph.capture(DEV):
            done = host.load_layers(pool, src, dst)
            for layer in range(done.num_layers):
                done.wait(layer)
                pd.transfer_kv_per_layer(pool.table, sink.kernel_table, dst, src, layer_id=layer,
                                         src_layout=pool.layout, dst_layout=sink.layout)
        assert torch.equal(pool_bytes(pool), before)  # captured, not run
        assert done.generation == 0 and done._words is None
        loads = [args for _plan, args, _marks in graph.launches if args[:3] == (src.data_ptr(), dst.data_ptr(), 4)]
        assert [(begin, count) for *_, begin, count in loads] == [(layer, 1) for layer in range(done.num_layers)]
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            src.copy_(torch.randperm(host_layout.num_slots, generator=g)[:4])
            dst.copy_(torch.randperm(dev_layout.num_slots, generator=g)[:4])
            fill_random(host.buffer, 100 + seed)
            fill_pool(pool, 200 + seed)
            as_bytes(sink.buffer).fill_(0xA5)
            expected = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, src, dst)
            graph.replay()
            assert torch.equal(pool_bytes(pool), expected)  # every layer, nothing else
            for kv in range(dev_layout.num_kv):
                for layer in range(done.num_layers):
                    assert same(items(sink.buffer, host_layout, kv, layer, src),
                                items(host.buffer, host_layout, kv, layer, src)), (seed, kv, layer)
        assert all(done.ready(layer) for layer in range(done.num_layers))
        with pytest.raises(errors.InvalidArgumentError, match="captured into a graph"):
            done.synchronize()
        graph.reset()


def test_copy_engine_layers_publish_in_order_too() -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=9) as (pool, host):
        idx = torch.tensor([6, 1])
        fill_pool(pool, 30)
        expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, idx, idx)
        done = host.load_layers(pool, idx, idx, backend="copy_engine")
        assert torch.equal(pool_bytes(pool), expected)
        assert [_flag(done, layer).value for layer in range(done.num_layers)] == [done.generation] * done.num_layers


def test_load_layers_queue_time_is_one_native_call() -> None:
    """Host time of queueing a 61-layer request of one token (the copy itself negligible):
    one native call for every layer, so far below 61 per-layer launches from Python. The
    bound is loose (a loaded 2-core machine); benchmarks/layer_pipeline.py has the figures."""
    layout = pd.KVLayout(kind="layer_first", num_layers=61, num_pages=4, page_size=16, num_heads=1, head_dim=576,
                         dtype="bfloat16", attention="mla")
    pool = pd.DeviceKVPool(layout, DEV)
    with pd.HostKVPool(layout.replace(kind="page_first", num_pages=8), DEV) as host:
        idx = torch.tensor([3])
        host.load_layers(pool, idx, idx)  # warm: the plan, the stream's words
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            host.load_layers(pool, idx, idx)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for layer in range(61):
                host.load_layer(pool, idx, idx, layer)
            times.append(-(time.perf_counter() - t0))
        queue = statistics.median(t for t in times if t > 0)
        per_layer_calls = statistics.median(-t for t in times if t < 0)
        assert queue < per_layer_calls / 4, (queue, per_layer_calls)


class _NoLayerPipeline(DelegatingBackend):
    """The emulated backend without the layer pipeline's native half (as a build without
    the GPU kernels on CUDA)."""

    launch_layers = None  # type: ignore[assignment]


def test_a_backend_without_the_pipeline_refuses_before_anything_is_written() -> None:
    with install_backend(_NoLayerPipeline(backend_for(DEV), "no-layers"), "emulated"):
        pool = pd.DeviceKVPool(model_layout(), DEV)
        fill_pool(pool, 3)
        before = pool_bytes(pool).clone()
        with pd.HostKVPool(model_layout("page_first"), DEV) as host:
            idx = torch.tensor([1, 2])
            with pytest.raises(errors.ExtensionUnavailableError, match="no layer pipeline"):
                host.load_layers(pool, idx, idx)
            assert torch.equal(pool_bytes(pool), before)
            host.load(pool, idx, idx)  # the plain load still runs on it
            assert not torch.equal(pool_bytes(pool), before)


# -- the completion words of streams that are gone ------------------------------------------------

class _Pipeline(DelegatingBackend):
    """The emulated backend, counting the completion words it allocates; with ``queued``
    set, a layer-pipeline launch is left "queued": nothing runs, no flag is set, and its
    event stays not done (a GPU kernel still waiting behind other work)."""

    def __init__(self) -> None:
        super().__init__(backend_for(pd.Device("emulated", 0)), "counting")
        self.allocated = 0
        self.queued = False

    def layer_words(self, device: pd.Device, capacity: int) -> Any:
        self.allocated += 1
        return super().layer_words(device, capacity)

    def launch_layers(self, plan: Any, args: Any, words: Any, gen: int) -> int:
        if self.queued:
            return 7  # an event that is not done
        return super().launch_layers(plan, args, words, gen)

    def event_done(self, event: int) -> bool:
        return event != 7 or not self.queued


def test_words_of_streams_no_load_holds_are_reused_not_leaked() -> None:
    """Loads on many streams one after another, each dropped before the next (a stream per
    request, destroyed after it): the words of streams no load holds go back for the next
    streams, so the allocations stop growing instead of one per stream ever used; every
    load still moves the reference bytes and publishes its layers."""
    with install_backend(_Pipeline(), "emulated") as backend, \
            filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=11) as (pool, host):
        idx = torch.tensor([2, 7, 5])
        allocated = []
        for k, stream in enumerate(range(1000, 1040)):
            allocated.append(backend.allocated)
            verify = k % 4 == 0  # the bytes every few loads (a pool refill and reference are the slow part)
            if verify:
                fill_pool(pool, stream)
                expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, idx, idx)
            done = host.load_layers(pool, idx, idx, stream=stream)
            if verify:
                assert torch.equal(pool_bytes(pool), expected)
            assert done.stream == stream and all(done.ready(layer) for layer in range(done.num_layers))
            del done
            gc.collect()
        assert allocated[-1] < 20 and allocated[-1] == allocated[15] == backend.allocated
        kept = [host.load_layers(pool, idx, idx, stream=s) for s in range(1, 31)]  # thirty streams at once
        assert all(load.ready(layer) for load in kept for layer in range(load.num_layers))
        assert backend.allocated >= 30
        del kept


def test_a_reused_stream_handle_never_sees_another_loads_progress() -> None:
    """A load whose kernel is still queued keeps its words to itself: a load on another
    stream, or a new load on the same stream handle once the first is dropped, never
    publishes into them (its layers stay not ready), and words go back for reuse only once
    no load holds them and their last launch is done; a load that takes them over starts
    past every generation they published, so no flag they hold reads as its layer done."""
    with install_backend(_Pipeline(), "emulated") as backend, \
            filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=12) as (pool, host):
        idx = torch.tensor([1, 4])
        layers = range(pool.layout.num_layers)
        warm = host.load_layers(pool, idx, idx, stream=5)
        assert all(warm.ready(layer) for layer in layers)
        del warm
        gc.collect()
        backend.queued = True
        pending = host.load_layers(pool, idx, idx, stream=5)  # the same handle: the dropped load's words
        assert not any(pending.ready(layer) for layer in layers)
        backend.queued = False
        other = host.load_layers(pool, idx, idx, stream=6)  # another stream while the first is queued
        assert all(other.ready(layer) for layer in layers)
        assert not any(pending.ready(layer) for layer in layers)
        backend.queued = True
        del pending, other
        gc.collect()
        backend.queued = False
        again = host.load_layers(pool, idx, idx, stream=5)  # the handle reused; the queued launch not done
        assert all(again.ready(layer) for layer in layers)
        backend.queued = True
        later = host.load_layers(pool, idx, idx, stream=5)  # queued behind it on the same words
        assert later.generation == again.generation + 1
        assert not any(later.ready(layer) for layer in layers)
        backend.queued = False
        del again, later
        gc.collect()
        for stream in range(100, 120):  # streams enough for the early ones' words to be spare
            host.load_layers(pool, idx, idx, stream=stream)
        gc.collect()
        host.load_layers(pool, idx, idx, stream=120)
        allocated = backend.allocated
        backend.queued = True
        reused = host.load_layers(pool, idx, idx, stream=9)  # takes over words whose loads are all gone
        assert backend.allocated == allocated
        assert not any(reused.ready(layer) for layer in layers)
        backend.queued = False


def test_a_failing_kernel_launch_of_the_pipeline_is_the_testing_backends_launch_fault() -> None:
    """FaultyBackend's ``launch`` fault reaches the layer pipeline's kernel launch too: the
    load raises the typed error with nothing written, and the next load moves the bytes."""
    from pointerdomain.testing import FaultyBackend

    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=21) as (pool, host):
        idx = torch.tensor([1, 6, 3])
        before = pool_bytes(pool).clone()
        faulty = FaultyBackend(backend_for(pd.validate_device(DEV)), fail={"launch": {1: 2}})
        with install_backend(faulty, "emulated"):
            with pytest.raises(errors.RuntimeCallError, match="transfer kernel launch"):
                host.load_layers(pool, idx, idx, backend="kernel")
            assert faulty.calls["launch"] == 1
            assert torch.equal(pool_bytes(pool), before)
            expected = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, idx, idx)
            done = host.load_layers(pool, idx, idx, backend="kernel")
            assert faulty.calls["launch"] == 2
            assert all(done.ready(layer) for layer in range(done.num_layers))
            assert torch.equal(pool_bytes(pool), expected)
