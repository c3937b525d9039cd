"""Concurrency: registration, the registry, the resolver (and its cache
reset) and launches from many threads at once, with exact results and no error
escaping. Checked mode is on, so its registry snapshots race with registration too.

The GIL is switched far more often than by default (``sys.setswitchinterval``) so
threads interleave inside the Python layer; the kernels release the GIL.
"""

from __future__ import annotations

import random
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import checked, errors
from pointerdomain.registration import memory
from pointerdomain.testing import FaultyBackend, NOT_REGISTERED, install_backend
from pointerdomain.domains import HostVA
from tests.reference import EMU, fill_random

PAGE = 4096
MODEL = dict(attention="mha", num_layers=2, page_size=4, num_heads=2, head_dim=8, dtype="float16")


@pytest.fixture(autouse=True)
def _checked_and_switchy() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with checked.checked_mode(True):
            yield
    finally:
        sys.setswitchinterval(interval)


def run_threads(workers: list[Callable[[], None]], timeout: float = 120) -> None:
    """Start all workers at once; fail with every traceback if any raised."""
    barrier = threading.Barrier(len(workers))
    failures: list[str] = []

    def wrap(fn: Callable[[], None]) -> None:
        try:
            barrier.wait()
            fn()
        except BaseException:  # noqa: BLE001 - report everything that escaped a thread
            failures.append(traceback.format_exc())

    threads = [threading.Thread(target=wrap, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not failures, "\n".join(failures)


def registrar(seed: int, rounds: int) -> Callable[[], None]:
    """Register (chunked), check aliases and a kernel read through them, close."""

    def work() -> None:
        rng = random.Random(seed)
        dev = f"emulated:{seed % 2}"
        for _ in range(rounds):
            pages, chunk = rng.randint(1, 6), rng.randint(1, 3)
            with pd.alloc_registered(pages * PAGE, dev, max_chunk_bytes=chunk * PAGE) as mem:
                assert len(mem.chunks) == -(-pages // chunk)
                assert memory.find_registration(mem.host_va, mem.nbytes) is mem
                for c in mem.chunks:
                    base = pd.resolve_alias(c.host_va, dev)
                    k = rng.randrange(c.nbytes)
                    assert pd.resolve_alias(c.host_va + k, dev) == base + k
                fill_random(mem.tensor, rng.randrange(2**31))
                out = pd.device_empty((PAGE,), torch.uint8, dev)
                layout = pd.KVLayout(kind="layer_first", attention="mla", num_layers=1, num_pages=1,
                                     page_size=4, num_heads=1, head_dim=1024, dtype="uint8")
                slots = torch.arange(4)
                pd.transfer_kv_all_layer(pd.make_kernel_ptr_table([mem.tensor[:PAGE]], dev),
                                         pd.make_kernel_ptr_table([out], dev), slots, slots,
                                         src_layout=layout, dst_layout=layout)
                assert torch.equal(out, mem.tensor[:PAGE])
            assert memory.find_registration(mem.host_va, mem.nbytes) is None
            assert EMU.alias(mem.host_va.value, mem.device)[0] == NOT_REGISTERED

    return work


def resolver(mem: pd.RegisteredHostMemory, starts: list[pd.DeviceAlias], chunk_bytes: int, seed: int,
             rounds: int) -> Callable[[], None]:
    def work() -> None:
        rng = random.Random(seed)
        for _ in range(rounds):
            k = rng.randrange(mem.nbytes)
            alias = pd.resolve_alias(mem.host_va + k, mem.device)
            assert alias == starts[k // chunk_bytes] + k % chunk_bytes
            assert pd.alias_policy(mem.device) is pd.AliasPolicy.EMULATED

    return work


def resetter(rounds: int) -> Callable[[], None]:
    def work() -> None:
        for i in range(rounds):
            pd.reset_resolver_cache()
            assert pd.alias_policy(f"emulated:{i % 2}") is pd.AliasPolicy.EMULATED
            assert pd.fallback_count() == 0

    return work


def launcher(seed: int, rounds: int) -> Callable[[], None]:
    """Own pools (chunked host pool), random pages both ways, exact bytes, per-layer too."""

    def work() -> None:
        rng = random.Random(seed)
        dev = f"emulated:{seed % 2}"
        dev_layout = pd.KVLayout(kind="layer_first", num_pages=6, **MODEL)
        host_layout = pd.KVLayout(kind=rng.choice(["page_first", "page_first_direct", "layer_first"]),
                                  num_pages=8, **MODEL)
        device_pool = pd.DeviceKVPool(dev_layout, dev)
        with pd.HostKVPool(host_layout, dev, max_chunk_bytes=2 * host_layout.page_block_bytes()) as host:
            for _ in range(rounds):
                for buf in device_pool.buffers:
                    fill_random(buf, rng.randrange(2**31))
                n = rng.randint(1, dev_layout.num_slots)
                d_slots = torch.tensor(rng.sample(range(dev_layout.num_slots), n))
                h_slots = torch.tensor(rng.sample(range(host_layout.num_slots), n))
                expected = [b[d_slots].clone() for b in device_pool.buffers]
                host.backup(device_pool, d_slots, h_slots)
                for buf in device_pool.buffers:
                    buf.view(torch.uint8).fill_(0x5A)
                layer = rng.randrange(2)
                host.load_layer(device_pool, h_slots, d_slots, layer)
                for kv in range(2):
                    for lyr in range(2):
                        got = device_pool.buffer(kv, lyr)
                        if lyr == layer:
                            assert torch.equal(got[d_slots].view(torch.uint8), expected[kv * 2 + lyr].view(torch.uint8))
                        else:
                            assert bool((got.view(torch.uint8) == 0x5A).all())

    return work


def test_register_resolve_launch_and_reset_at_once() -> None:
    chunk_bytes = 2 * PAGE
    shared = pd.alloc_registered(8 * PAGE, "emulated:0", max_chunk_bytes=chunk_bytes)
    starts = [pd.resolve_alias(c.host_va, "emulated:0") for c in shared.chunks]
    workers: list[Callable[[], None]] = []
    workers += [registrar(seed, 25) for seed in range(3)]
    workers += [resolver(shared, starts, chunk_bytes, seed, 1500) for seed in range(2)]
    workers += [launcher(seed, 12) for seed in range(3)]
    workers += [resetter(1500)]
    with shared:
        run_threads(workers)
        assert pd.resolve_alias(shared.host_va + 5, "emulated:0") == starts[0] + 5


def test_one_winner_when_threads_register_the_same_range() -> None:
    """The registry check and the backend call are one atomic step: of threads
    registering one range at once exactly one wins, the others get
    AlreadyRegisteredError, and after the winner closes the next round starts clean."""
    buf = EMU.host_alloc(4 * PAGE)
    n_threads, rounds = 4, 30
    barrier = threading.Barrier(n_threads)
    results: list[list[str]] = [[] for _ in range(rounds)]
    lock = threading.Lock()

    def contender() -> None:
        for r in range(rounds):
            barrier.wait()
            try:
                mem = pd.register_host_tensor(buf, "emulated:0", max_chunk_bytes=PAGE)
                outcome = "won"
            except errors.AlreadyRegisteredError:
                mem, outcome = None, "refused"
            with lock:
                results[r].append(outcome)
            barrier.wait()
            if mem is not None:
                assert len(mem.chunks) == 4
                mem.close()
            barrier.wait()

    run_threads([contender] * n_threads)
    for r, outcome in enumerate(results):
        assert sorted(outcome) == ["refused"] * (n_threads - 1) + ["won"], (r, outcome)
    assert memory.find_registration(HostVA(buf.data_ptr()), buf.numel()) is None


def test_close_from_many_threads_unregisters_once() -> None:
    with install_backend(FaultyBackend(EMU, fail={}), "emulated") as counting:
        for _ in range(20):
            mem = pd.alloc_registered(3 * PAGE, "emulated:1", max_chunk_bytes=PAGE)
            before = counting.calls["unregister"]
            run_threads([mem.close] * 6)
            assert counting.calls["unregister"] - before == len(mem.chunks) == 3
            assert memory.find_registration(mem.host_va, mem.nbytes) is None
