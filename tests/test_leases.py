"""Launch leases: close() of registered memory or a host pool never unmaps under a copy.

A launch leases every registration its tables point into while the copy can run; close()
waits (bounded, then BusyError naming the launch), and launches that start while it
closes get ClosedError. The crash case (close in one thread, big CPU copies in another)
runs in a child process: before leases it died with SIGSEGV.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain._platform import backend_for
from pointerdomain._platform.faulty import FaultyBackend
from pointerdomain._platform.testing import install_backend
from pointerdomain.devices import Device
from tests.reference import DEV, filled_pools, model_layout, pool_bytes, reference_transfer, same

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(pd.__file__).resolve().parents[1]  # the pointerdomain under test, also in the child


class BlockingBackend(FaultyBackend):
    """The emulated backend whose launches wait for ``go`` (a copy that takes as long as the test wants)."""

    def __init__(self) -> None:
        super().__init__(backend_for(DEV), {})
        self.started = threading.Event()
        self.go = threading.Event()

    def launch(self, plan, src_idx, dst_idx, n, layer_begin, layer_count, device: Device, stream, max_ctas):  # type: ignore[no-untyped-def]
        self.started.set()
        assert self.go.wait(10)
        super().launch(plan, src_idx, dst_idx, n, layer_begin, layer_count, device, stream, max_ctas)


@pytest.fixture
def blocking() -> Iterator[BlockingBackend]:
    backend = BlockingBackend()
    with install_backend(backend, "emulated"):
        yield backend


def _start_backup(pool: pd.DeviceKVPool, host: pd.HostKVPool, slots: torch.Tensor) -> tuple[threading.Thread, list[BaseException]]:
    failures: list[BaseException] = []

    def run() -> None:
        try:
            host.backup(pool, slots, slots)
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    thread = threading.Thread(target=run, name="offload-thread")
    thread.start()
    return thread, failures


def test_close_during_a_launch_is_busy_and_unregisters_nothing(blocking: BlockingBackend) -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=1) as (pool, host):
        slots = torch.tensor([0, 5, 9])
        expected = reference_transfer(pool_bytes(pool), pool.layout, host.buffer, host.layout, slots, slots)
        thread, failures = _start_backup(pool, host, slots)
        assert blocking.started.wait(10)
        with pytest.raises(errors.BusyError, match="offload-thread") as info:
            host.close(timeout=0.2)
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, errors.PointerDomainError)
        assert "transfer of 3 slot pair(s) on emulated:0" in str(info.value)
        assert not host.memory.closed and blocking.calls["unregister"] == 0
        blocking.go.set()
        thread.join(10)
        assert not failures
        assert same(host.buffer.reshape(-1).view(torch.uint8), expected)  # the copy ran to the end, correctly
        host.backup(pool, slots, slots)  # still open and usable after the refused close
    assert host.memory.closed


def test_close_waits_for_the_launch_then_later_launches_are_refused(blocking: BlockingBackend) -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=2) as (pool, host):
        slots = torch.tensor([1, 2, 30])
        expected = reference_transfer(pool_bytes(pool), pool.layout, host.buffer, host.layout, slots, slots)
        thread, failures = _start_backup(pool, host, slots)
        assert blocking.started.wait(10)
        closer = threading.Thread(target=host.close, kwargs={"timeout": 10.0})
        closer.start()
        closer.join(0.2)
        assert closer.is_alive() and not host.memory.closed  # waiting for the copy
        # a launch that starts while close() waits is refused, copies nothing
        before = host.buffer.clone()
        with pytest.raises(errors.ClosedError, match="clos"):
            host.backup(pool, torch.tensor([3]), torch.tensor([3]))
        assert same(host.buffer, before)
        blocking.go.set()
        thread.join(10)
        closer.join(10)
        assert not failures and not closer.is_alive()
        assert host.memory.closed and blocking.calls["unregister"] == 1
        assert same(host.buffer.reshape(-1).view(torch.uint8), expected)
        with pytest.raises(errors.ClosedError):
            host.backup(pool, slots, slots)


def test_registered_memory_close_waits_too(blocking: BlockingBackend) -> None:
    layout = model_layout("page_first")
    mem = pd.alloc_registered(layout.nbytes, DEV)
    table = pd.make_kernel_ptr_table([mem.tensor], DEV)
    pool = pd.DeviceKVPool(model_layout(), DEV)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            pd.transfer_kv_all_layer(pool.table, table, torch.tensor([4]), torch.tensor([4]),
                                     src_layout=pool.layout, dst_layout=layout)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=run, name="raw-launch")
    thread.start()
    assert blocking.started.wait(10)
    with pytest.raises(errors.BusyError, match="raw-launch"):
        mem.close(timeout=0.1)
    assert not mem.closed
    blocking.go.set()
    thread.join(10)
    assert not failures
    mem.close()
    assert mem.closed


_CRASH_REPRO = textwrap.dedent("""
    import sys, threading, time, torch
    import pointerdomain as pd
    from pointerdomain import errors
    dev = pd.Device("emulated", 0)
    lay = pd.KVLayout(kind="layer_first", attention="mha", num_layers=4, num_pages=256, page_size=16,
                      num_heads=4, head_dim=128, dtype="bfloat16")
    pool = pd.DeviceKVPool(lay, dev)
    host = pd.HostKVPool(lay.model_copy(update={"kind": "page_first"}), dev)
    slots = torch.randperm(lay.num_slots)
    state = {"launches": 0, "refused": 0, "other": None}
    started = threading.Event()
    def offload():
        while True:
            try:
                started.set()
                host.backup(pool, slots, slots, backend="kernel")
                state["launches"] += 1
            except errors.ClosedError:
                state["refused"] += 1
                return
            except BaseException as exc:
                state["other"] = repr(exc)
                return
    t = threading.Thread(target=offload)
    t.start()
    started.wait()
    time.sleep(0.05)
    host.close()
    t.join()
    print("launches", state["launches"], "refused", state["refused"], "other", state["other"])
    sys.exit(0 if state["refused"] == 1 and state["other"] is None else 3)
""")


@pytest.mark.parametrize("run", range(3))
def test_close_while_another_thread_copies_does_not_crash(run: int) -> None:
    """The issue's repro (SIGSEGV 5/5 before leases): a child process closes the host pool
    while another thread launches big CPU copies into it."""
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", _CRASH_REPRO], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "refused 1" in proc.stdout


@pytest.mark.gpu
def test_gpu_close_waits_for_queued_gpu_work() -> None:
    """CUDA: close() of a host pool that queued GPU work still reads waits on the launch's
    stream event; with a short timeout it is a BusyError and nothing is unregistered."""
    dev = pd.Device("cuda", 0)
    layout = model_layout(pages=64)
    pool = pd.DeviceKVPool(layout, dev)
    for b in pool.buffers:
        b.copy_(torch.randn(b.shape, dtype=b.dtype))
    host = pd.HostKVPool(model_layout("page_first", pages=64), dev)
    slots = torch.arange(layout.num_slots, device="cuda")
    torch.cuda.synchronize()  # the fills are done before the side stream reads the pool
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # the copy queued behind ~1 s of GPU time
        host.backup(pool, slots, slots)
    assert not stream.query()
    with pytest.raises(errors.BusyError, match="GPU work"):
        host.close(timeout=0.01)
    assert not host.memory.closed
    host.close(timeout=60)
    assert stream.query() and host.memory.closed  # close returned only after the stream passed the copy
    expected = torch.stack([b.cpu() for b in pool.buffers])
    got = host.buffer.view(layout.num_kv, layout.num_slots, layout.num_layers, -1)
    for kv in range(layout.num_kv):
        for layer in range(layout.num_layers):
            assert same(got[kv, :, layer], expected[kv * layout.num_layers + layer].reshape(layout.num_slots, -1))
