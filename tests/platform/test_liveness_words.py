"""The per-launch liveness check in one native pass (``pointerdomain._platform.liveness``):
the words it reads are found on this torch, it sees every change the per-storage check
sees, and a launch over a table of many allocations is refused before anything is written."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain._platform import liveness
from tests.reference import DEV, as_bytes, filled_pools, pool_bytes, reference_transfer

LAYOUT = pd.KVLayout(kind="layer_first", num_layers=4, num_pages=4, page_size=4, num_heads=2, head_dim=16)


def test_the_word_layout_is_found_on_this_torch() -> None:
    assert liveness.word_layout_found()


@pytest.fixture(params=["native", "python"])
def how(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Tables built with the native watch, or where no layout was found (the per-storage reads)."""
    if request.param == "python":
        monkeypatch.setattr(liveness, "_searched", True)
        monkeypatch.setattr(liveness, "_layout", None)
        # (the index and version words build on that layout: none either, restored after)
        monkeypatch.setattr(liveness, "_index_searched", True)
        monkeypatch.setattr(liveness, "_index_reader", None)
        monkeypatch.setattr(liveness, "_version_searched", True)
        monkeypatch.setattr(liveness, "_version_found", False)
    yield request.param


def _separate() -> list[torch.Tensor]:
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    return [pd.device_empty(tuple(b.shape), b.dtype, DEV) for b in pool.buffers]


def _release(b: list[torch.Tensor]) -> None:
    b[5].untyped_storage().resize_(0)


def _regrow(b: list[torch.Tensor]) -> None:
    storage = b[6].untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    storage.resize_(nbytes // 2)


def _swap(b: list[torch.Tensor]) -> None:
    b[1].set_(torch.zeros_like(b[1]).untyped_storage())


def _share(b: list[torch.Tensor]) -> None:
    b[2].share_memory_()  # type: ignore[no-untyped-call]


CHANGES: dict[str, Callable[[list[torch.Tensor]], None]] = {
    "resize_(0)": _release, "resize_ smaller": _regrow, "set_": _swap, "share_memory_": _share,
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_under_a_table_of_many_allocations_is_seen(how: str, change: str) -> None:
    buffers = [torch.zeros(64, dtype=torch.uint8) for _ in range(16)]  # CPU tensors: a host table
    table = pd.host_ptr_table(buffers)
    assert (table.storage_watch() is not None) == (how == "native")
    assert table.storages_intact()
    CHANGES[change](buffers)
    assert not table.storages_intact()
    with pytest.raises(errors.ClosedError):
        table.check_live()


def test_a_view_pointed_elsewhere_in_its_own_storage_is_seen(how: str) -> None:
    base = torch.zeros(4096, dtype=torch.uint8)
    views = [base[:1024], base[1024:2048]]
    table = pd.host_ptr_table(views)
    assert table.storages_intact()
    views[1].set_(base.untyped_storage(), 3072, (1024,), (1,))  # same storage, another offset
    assert not table.storages_intact()


@pytest.mark.parametrize("change", ["set_", "share_memory_"])  # (emulated device memory cannot be resized)
def test_a_launch_over_many_allocations_after_a_change_writes_nothing(how: str, change: str) -> None:
    buffers = _separate()
    dst = pd.make_kernel_ptr_table(buffers, DEV, layout=LAYOUT)
    with pd.HostKVPool(LAYOUT.replace(kind="page_first"), DEV) as host:
        host.buffer.view(torch.uint8).fill_(0x5A)
        for b in buffers:
            b.view(torch.uint8).fill_(0xA5)
        idx = torch.tensor([1, 2])
        pd.transfer_kv_all_layer(host.kernel_table, dst, idx, idx, src_layout=host.layout, dst_layout=LAYOUT)
        assert all(bool((b.view(torch.uint8)[1:3] == 0x5A).all()) for b in buffers)  # the call works
        for b in buffers:
            b.view(torch.uint8).fill_(0xA5)
        CHANGES[change](buffers)
        changed = {"set_": 1, "share_memory_": 2}[change]
        kept = [b.view(torch.uint8).clone() for b in buffers]
        with pytest.raises(errors.ClosedError):
            pd.transfer_kv_all_layer(host.kernel_table, dst, idx, idx, src_layout=host.layout, dst_layout=LAYOUT)
        assert all(torch.equal(b.view(torch.uint8), before) for b, before in zip(buffers, kept))
        assert all(bool((b.view(torch.uint8) == 0xA5).all()) for i, b in enumerate(buffers) if i != changed)


def test_the_index_reader_is_found_and_gives_torchs_answers() -> None:
    reader = liveness.cpu_index_reader()
    if reader is None:  # seen in about half of fresh processes: the launch then asks torch (same answers)
        pytest.skip("the index reader's word offsets were not proven in this process")
    base = torch.arange(100)
    # what the reader accepts is torch's answer; it may decline a shape (the launch then asks
    # torch: seen once for a one-element view at the storage's end), but not the shapes its
    # proof at start-up accepted
    for t in (torch.tensor([3]), base[7:30], torch.zeros(0, dtype=torch.int64), base[99:], torch.arange(5000)):
        got = reader.pair(t, base)
        assert got is None or got == (t.numel(), 100, t.data_ptr(), base.data_ptr())
    for t in (torch.tensor([3, 1, 2]), torch.arange(40)[7:19], torch.empty(4096, dtype=torch.int64)):
        assert reader.pair(t, t) == (t.numel(), t.numel(), t.data_ptr(), t.data_ptr())
    released = torch.arange(4)
    released.untyped_storage().resize_(0)
    refused: list[object] = [base[::2], base.view(10, 10), base.to(torch.int32), base.to(torch.uint64),
                             base.view(torch.float64), released, torch.empty(3, dtype=torch.int64, device="meta"),
                             torch.nn.Parameter(base.clone(), requires_grad=False), base.tolist(), None, 7]
    for t in refused:
        assert reader.pair(t, base) is None and reader.pair(base, t) is None


def test_tensors_words_see_every_change_a_repeat_must_not_take() -> None:
    native = liveness.tensors_words()
    assert native is not None
    words = torch.empty(10, dtype=torch.uint64)
    address = int(words.data_ptr())

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(64, dtype=torch.bfloat16)[8:], torch.zeros(8, dtype=torch.int64)

    def retype(t: torch.Tensor) -> None:
        t.data = t.view(torch.float16)  # the same bytes, another dtype: no counter moves

    def moved(t: torch.Tensor) -> None:
        t.data = torch.zeros_like(t)  # other memory, the same dtype: no counter moves

    changes: list[Callable[[torch.Tensor], object]] = [
        lambda t: t.add_(1), lambda t: t.set_(torch.zeros_like(t).untyped_storage()), retype, moved,
        lambda t: t.untyped_storage().resize_(0), lambda t: t.resize_(4)]
    pair = fresh()
    assert native(pair, address, False) and native(pair, address, True)
    for change in changes:
        for side in (0, 1):
            pair = fresh()
            assert native(pair, address, False)
            change(pair[side])
            assert not native(pair, address, True)
    with torch.inference_mode():
        inference = torch.zeros(4)
    assert not native((inference,), address, False)  # no version counter: torch's queries instead
    assert not native((torch.nn.Parameter(torch.zeros(4)),), address, False)


def test_a_device_index_reader_takes_that_devices_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's meta device stands in for a GPU here: its tensors have the words a GPU's have,
    # and no memory; its index is always -1, so the index byte's proof (tested below) is
    # set aside for it
    monkeypatch.setattr(liveness, "_device_readers", {})
    monkeypatch.setattr(liveness, "_index_byte_proven", lambda *args: True)
    meta = torch.device("meta", 0)
    reader = liveness.device_index_reader(meta)
    if reader is None:  # built on the CPU reader's offsets, where those were proven (see above)
        pytest.skip("the index reader's word offsets were not proven in this process")
    assert reader is liveness.device_index_reader(meta)
    assert reader.meta != liveness.cpu_index_reader().meta  # type: ignore[union-attr]
    base = torch.empty(100, dtype=torch.int64, device=meta)
    for t in (torch.empty(1, dtype=torch.int64, device=meta), base[7:30], torch.empty(0, dtype=torch.int64, device=meta)):
        assert reader.native(t, base, reader.meta, -1) == (t.numel(), 100, t.data_ptr(), base.data_ptr(), True)
    refused: list[object] = [torch.arange(100), base[::2], base.view(10, 10), base.to(torch.int32), base.view(torch.float64),
                             torch.nn.Parameter(base.clone(), requires_grad=False), None, 7]
    for t in refused:
        assert reader.native(t, base, reader.meta, -1) is None and reader.native(base, t, reader.meta, -1) is None


def test_the_index_byte_proof_accepts_only_a_type_and_index_pair() -> None:
    cpu_reader = liveness.cpu_index_reader()
    if cpu_reader is None:
        pytest.skip("the index reader's word offsets were not proven in this process")
    at = cpu_reader.meta_at
    cpu = liveness._meta_word(torch.empty(1, dtype=torch.int64), at)  # noqa: SLF001
    meta = liveness._meta_word(torch.empty(1, dtype=torch.int64, device="meta"), at)  # noqa: SLF001
    c, m = cpu.to_bytes(8, "little"), meta.to_bytes(8, "little")
    t = next(i for i in range(8) if c[i] != m[i])
    x = next(i for i in range(8) if c[i] == 0xFF)

    def word(type_byte: int, index_byte: int, other: tuple[int, int] | None = None) -> int:
        b = bytearray(c)
        b[t], b[x] = type_byte, index_byte
        if other is not None:
            b[other[0]] = other[1]
        return int.from_bytes(bytes(b), "little")

    proven = liveness._index_byte_proven  # noqa: SLF001
    assert proven(cpu, meta, word(1, 0), 0) and proven(cpu, meta, word(1, 3), 3)
    assert not proven(cpu, meta, word(1, 0), 1)  # the index byte is not this device's ordinal
    assert not proven(cpu, meta, word(1, 1), 0)
    assert not proven(cpu, meta, word(c[t], 0), 0)  # the type byte the CPU's
    assert not proven(cpu, meta, word(m[t], 0), 0)  # or the meta device's
    spare = next(i for i in range(8) if i not in (t, x))
    assert not proven(cpu, meta, word(1, 0, (spare, c[spare] ^ 0x10)), 0)  # another byte differs
    assert not proven(cpu, cpu, word(1, 0), 0)  # no type byte found
    assert not proven(cpu, meta, word(1, 0xFF), 0xFF)


@contextlib.contextmanager
def _gpu_pools(layers: int, dev_pages: int, host_pages: int, seed: int, host_slots: list[int],
               dev_slots: list[int]) -> Iterator[tuple[pd.DeviceKVPool, pd.HostKVPool, torch.Tensor, torch.Tensor,
                                                       torch.Tensor]]:
    """Filled pools on cuda:0, the slots as CUDA tensors, and the device pool's bytes a load
    of those slots must leave (:func:`tests.reference.reference_transfer`)."""
    dev = pd.Device("cuda", 0)
    dev_layout = pd.KVLayout(kind="layer_first", num_layers=layers, num_pages=dev_pages, page_size=16, num_heads=8,
                             head_dim=128)
    host_layout = pd.KVLayout(kind="page_first", num_layers=layers, num_pages=host_pages, page_size=16, num_heads=8,
                              head_dim=128)
    with filled_pools(dev_layout, host_layout, dev, seed=seed) as (pool, host):
        h, d = torch.tensor(host_slots, device="cuda"), torch.tensor(dev_slots, device="cuda")
        want = reference_transfer(host.buffer.cpu(), host_layout, pool_bytes(pool), dev_layout, h.cpu(), d.cpu())
        yield pool, host, h, d, want


@pytest.mark.gpu
def test_gpu_device_indices_read_natively_refuse_what_torch_refuses() -> None:
    reader = liveness.device_index_reader(torch.device("cuda", 0))
    # where proven (not in every process, as the CPU reader above), the launch takes CUDA
    # indices in one native call: both ways, the same answers
    print("device index reader:", reader is not None)
    with _gpu_pools(4, 16, 32, 4, [5, 0, 31, 7], [3, 9, 1, 15]) as (
            pool, host, host_slots, dev_slots, want):
        host.load(pool, host_slots, dev_slots)  # through the native reader
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes(pool), want)
        saved = [as_bytes(b).clone() for b in pool.buffers]
        wide = torch.arange(8, device="cuda")
        bad: list[tuple[object, type[Exception]]] = [
            (wide[::2], errors.IndexValidationError),                       # strided
            (wide.view(2, 4), errors.IndexValidationError),                 # 2-D
            (wide[:4].to(torch.int32), errors.IndexValidationError),        # int32
        ]
        released = torch.arange(4, device="cuda")
        released.untyped_storage().resize_(0)
        bad.append((released, errors.PointerDomainError))
        for idx, err in bad:
            with pytest.raises(err):
                host.load(pool, host_slots, idx)  # type: ignore[arg-type]
            with pytest.raises(err):
                host.load(pool, idx, dev_slots)  # type: ignore[arg-type]
        torch.cuda.synchronize()
        assert all(torch.equal(as_bytes(b), s) for b, s in zip(pool.buffers, saved))  # nothing written


@pytest.mark.gpu
def test_gpu_a_first_plan_inside_a_capture_leaves_the_capture_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # the device reader is not searched inside a capture (its probes would allocate there):
    # the captured launch asks torch, replays move the right bytes, and a later plan outside
    # capture finds the reader
    monkeypatch.setattr(liveness, "_device_readers", {})
    with _gpu_pools(2, 8, 16, 6, [17, 2, 200, 64], [1, 100, 33, 0]) as (
            pool, host, host_slots, dev_slots, want):
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            host.load(pool, host_slots, dev_slots)
        assert liveness._device_readers == {}  # noqa: SLF001 -- not searched while capturing
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes(pool), want)
        del graph  # (a graph holds the pools it captured)
        other = pd.DeviceKVPool(pool.layout, pool.device)  # a new table pair: a new plan, outside capture
        host.load(other, host_slots, dev_slots)
        torch.cuda.synchronize()
        assert torch.device("cuda", 0) in liveness._device_readers  # noqa: SLF001
