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
from pointerdomain.devices import Device
from pointerdomain.testing import FaultyBackend, KernelPlan, LaunchArgs, backend_for, install_backend
from tests.reference import DEV, fill_pool, filled_pools, model_layout, pool_bytes, reference_transfer, same
from tests import childenv

ROOT = Path(__file__).resolve().parents[2]


class BlockingBackend(FaultyBackend):
    """The emulated backend whose launches wait for ``go`` (a copy that takes as long as the test wants)."""

    def __init__(self) -> None:
        super().__init__(backend_for(DEV), {})
        self.started = threading.Event()
        self.go = threading.Event()

    def launch(self, plan: KernelPlan, args: LaunchArgs) -> None:
        self.started.set()
        assert self.go.wait(10)
        super().launch(plan, args)


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


@pytest.mark.slow
@pytest.mark.parametrize("run", range(3))
def test_close_while_another_thread_copies_does_not_crash(run: int) -> None:
    """The issue's repro (SIGSEGV 5/5 before leases): a child process closes the host pool
    while another thread launches big CPU copies into it."""
    env = {"PYTHONPATH": childenv.pythonpath(), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"}
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


@pytest.mark.parametrize("bad", ["1", None, float("nan"), -1, -0.5, True])
def test_close_with_a_bad_timeout_is_a_typed_error_and_closes_nothing(bad: object) -> None:
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        with pytest.raises((errors.InvalidTypeError, errors.InvalidArgumentError), match="timeout") as info:
            host.close(timeout=bad)  # type: ignore[arg-type]
        assert isinstance(info.value, TypeError if bad is None or isinstance(bad, (str, bool)) else ValueError)
        assert not host.memory.closed
        pool = pd.DeviceKVPool(model_layout(), DEV)
        fill_pool(pool, 4)
        idx = torch.tensor([2, 9])
        host.backup(pool, idx, idx)  # still open for launches: the failed close left no closing state
        assert same(host.buffer[0][idx][:, 0], pool.buffer(0, 0)[idx])
    assert host.memory.closed


_PRELOAD = textwrap.dedent("""
    import pointerdomain as pd
    from pointerdomain.testing import FaultyBackend, backend_for, install_backend
    from tests.reference import DEV, model_layout

    class Counting(FaultyBackend):
        def __init__(self):
            super().__init__(backend_for(DEV), {})
            self.loads, self.capturing = [], False
        def is_capturing(self, device):
            return self.capturing
        def load_kernels(self, device):
            self.loads.append(device)
            super().load_kernels(device)

    b = Counting()
    with install_backend(b, "emulated"):
        b.capturing = True  # a device's first table built during a capture: nothing loaded then
        pd.DeviceKVPool(model_layout(), pd.Device("emulated", 1))
        assert b.loads == [], b.loads
        b.capturing = False
        pd.DeviceKVPool(model_layout(), DEV)
        pd.DeviceKVPool(model_layout(), DEV)
        assert b.loads == [DEV], b.loads  # once per device, when its first kernel table is built
    print("OK")
""")


def test_kernels_are_loaded_with_the_first_kernel_table_of_a_device() -> None:
    """Backend.load_kernels runs once per device, when its error word is made (outside a
    capture), so no first launch loads a kernel (CUDA lazy loading may then wait for all
    queued work). In a child process: this one's devices have their words already."""
    env = {"PYTHONPATH": childenv.pythonpath(), "PATH": "/usr/bin:/bin", "POINTERDOMAIN_EMULATED_DEVICES": "2"}
    proc = subprocess.run([sys.executable, "-c", _PRELOAD], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", (proc.returncode, proc.stdout, proc.stderr[-2000:])


_FIRST_LAUNCH = textwrap.dedent("""
    import time, torch
    import pointerdomain as pd
    from tests.reference import model_layout
    dev = pd.Device("cuda", 0)
    layout = model_layout(pages=64)
    pool = pd.DeviceKVPool(layout, dev)
    host = pd.HostKVPool(model_layout("page_first", pages=64), dev)
    slots = torch.arange(layout.num_slots, device="cuda")
    torch.cuda._sleep(1000)  # torch's sleep kernel loaded before the timed part
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of queued GPU time
        t0 = time.perf_counter()
        pd.transfer_kv_all_layer(pool.table, host.kernel_table, slots, slots, src_layout=pool.layout,
                                 dst_layout=host.layout, backend="kernel", max_ctas=2)
        took = time.perf_counter() - t0
    queued = not stream.query()
    torch.cuda.synchronize()
    assert queued and took < 0.3, (queued, took)
    host.close()
    print("OK")
""")


@pytest.mark.gpu
def test_gpu_first_launch_does_not_wait_for_queued_work() -> None:
    """CUDA, in a fresh process under lazy module loading: the process's first transfer
    launch, queued behind ~1 s of GPU work, returns at once (its kernels were loaded when
    the first kernel table was built, not at the launch)."""
    env = {"PYTHONPATH": childenv.pythonpath(), "PATH": "/usr/bin:/bin", "CUDA_MODULE_LOADING": "LAZY"}
    proc = subprocess.run([sys.executable, "-c", _FIRST_LAUNCH], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", (proc.returncode, proc.stdout, proc.stderr[-2000:])


# -- the lease events (Backend.launch_recorded / record_event / event_done) -------------------


class EventBackend(FaultyBackend):
    """The emulated backend as if its launches were asynchronous: every launch "records"
    event ``100 + ordinal`` (one per device, as the CUDA backend has one per device and
    stream), which stays pending until ``done`` is set."""

    def __init__(self) -> None:
        super().__init__(backend_for(DEV), {})
        self.done = threading.Event()
        self.recorded: list[tuple[Device, int]] = []
        self.queries = 0

    def record_event(self, device: Device, stream: int) -> int:
        self.recorded.append((device, stream))
        return 100 + device.ordinal

    def event_done(self, event: int) -> bool:
        assert event in (100, 101)
        self.queries += 1
        return self.done.is_set()


@pytest.fixture
def evented() -> Iterator[EventBackend]:
    backend = EventBackend()
    with install_backend(backend, "emulated"):
        yield backend


@pytest.mark.parametrize("checked_mode", [True, False])
def test_emulated_launch_leases_and_releases_with_no_event(checked_mode: bool) -> None:
    """The emulated launch is synchronous: the lease ends with the call and keeps no event
    (launch_recorded returns 0), in checked mode and on the unchecked fast path alike."""
    pd.checked.set_enabled(checked_mode)
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=4) as (pool, host):
        slots = torch.tensor([0, 5, 9])
        expected = reference_transfer(pool_bytes(pool), pool.layout, host.buffer, host.layout, slots, slots)
        for backend in ("auto", "kernel", "copy_engine"):
            host.backup(pool, slots, slots, backend=backend)  # type: ignore[arg-type]
            leases = host.memory.leases
            assert not leases._active and not leases._events  # noqa: SLF001 -- the test reads the lease state
            assert same(host.buffer.reshape(-1).view(torch.uint8), expected)
    assert host.memory.closed


@pytest.mark.parametrize("backend", ["kernel", "copy_engine"])
def test_close_waits_for_the_event_a_launch_recorded(evented: EventBackend, backend: str) -> None:
    """The event a launch hands to the lease set is what close() waits on: pending, close
    is a BusyError naming the launch and unregisters nothing; done, close goes through."""
    pd.checked.set_enabled(False)
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=5) as (pool, host):
        slots = torch.tensor([1, 2])
        host.backup(pool, slots, slots, backend=backend)  # type: ignore[arg-type]
        assert evented.recorded == [(DEV, 0)] and evented.calls["launch" if backend == "kernel" else "copy_runs"] == 1
        leases = host.memory.leases
        assert not leases._active and list(leases._events) == [100]  # noqa: SLF001
        try:
            with pytest.raises(errors.BusyError, match=r"GPU work queued by transfer of 2 slot pair\(s\) on emulated:0"):
                host.close(timeout=0.05)
            assert not host.memory.closed and evented.calls["unregister"] == 0 and evented.queries > 0
            host.backup(pool, slots, slots, backend=backend)  # type: ignore[arg-type]  # still usable
        finally:
            evented.done.set()
        host.close(timeout=5)
        assert host.memory.closed and not leases._events  # noqa: SLF001


def test_lease_events_of_two_devices_are_kept_apart(evented: EventBackend) -> None:
    """Launches on two devices' stream 0 leave two events (keyed by event, not by stream)."""
    pd.checked.set_enabled(False)
    e1 = pd.Device("emulated", 1)
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=6) as (pool, host):
        pool1 = pd.DeviceKVPool(model_layout(), e1)
        slots = torch.tensor([3])
        try:
            host.backup(pool, slots, slots)
            pd.transfer_kv_all_layer(pool1.table, host.kernel_table_for(e1), slots, slots, src_layout=pool1.layout,
                                     dst_layout=host.layout)
            assert evented.recorded == [(DEV, 0), (e1, 0)]
            assert sorted(host.memory.leases._events) == [100, 101]  # noqa: SLF001
        finally:
            evented.done.set()


@pytest.mark.gpu
def test_gpu_native_lease_events() -> None:
    """_C.gpu_event_create / gpu_event_record / gpu_event_query / gpu_transfer_recorded /
    gpu_stream_capturing, and the CUDA backend's methods over them: pending while the stream
    is late, done after it; not recorded while the stream is being captured."""
    from pointerdomain import _C

    dev = pd.Device("cuda", 0)
    backend = backend_for(dev)
    stream = torch.cuda.Stream()
    raw = int(stream.cuda_stream)
    status, event = _C.gpu_event_create(0)
    assert status == 0 and event != 0
    assert _C.gpu_event_query(event) == 0  # never recorded: done
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
    assert _C.gpu_event_record(event, 0, raw) == 0
    assert _C.gpu_event_query(event) == _C.gpu_not_ready
    assert _C.gpu_stream_capturing(0, raw) == (0, 0)
    recorded = backend.record_event(dev, raw)
    assert recorded != 0 and backend.record_event(dev, raw) == recorded  # one event per (device, stream)
    assert not backend.event_done(recorded)
    stream.synchronize()
    assert _C.gpu_event_query(event) == 0 and backend.event_done(recorded)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        assert _C.gpu_stream_capturing(0, raw) == (0, 1) and backend.is_capturing(dev)
        assert _C.gpu_event_record(event, 0, raw) == _C.gpu_not_recorded
        assert backend.record_event(dev, raw) == 0
    assert not backend.is_capturing(dev)
    del graph


@pytest.mark.gpu
@pytest.mark.parametrize("checked_mode", [True, False])
def test_gpu_launch_records_outside_capture_only(checked_mode: bool) -> None:
    """CUDA: an eager launch leaves the launch stream's event with the lease set (the
    unchecked launch runs without a Python device switch, checked mode under one); a launch
    captured into a graph records nothing, and its replays copy."""
    pd.checked.set_enabled(checked_mode)
    dev = pd.Device("cuda", 0)
    with filled_pools(model_layout(), model_layout("page_first"), dev, chunk_blocks=None, seed=7) as (pool, host):
        leases = host.memory.leases
        slots = torch.tensor([1, 4, 6], device="cuda")
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            host.backup(pool, slots, slots)
        assert not leases._active and len(leases._events) == 1  # noqa: SLF001
        (event,) = leases._events  # noqa: SLF001
        assert event == backend_for(dev).record_event(dev, int(stream.cuda_stream))
        stream.synchronize()
        leases._events.clear()  # noqa: SLF001
        src = torch.zeros(3, dtype=torch.int64, device="cuda")
        dst = torch.zeros(3, dtype=torch.int64, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            host.load(pool, src, dst, backend="kernel")
        assert not leases._events and torch.cuda.current_device() == 0  # noqa: SLF001
        host.buffer.zero_()
        fill_pool(pool, 70)
        src.copy_(torch.tensor([2, 3, 5]))
        dst.copy_(torch.tensor([7, 8, 9]))
        expected = reference_transfer(host.buffer.clone(), host.layout, pool_bytes(pool), pool.layout,
                                      src.cpu(), dst.cpu())
        graph.replay()
        torch.cuda.synchronize()
        assert same(pool_bytes(pool), expected)
        del graph


def test_fork_child_drops_the_leases_of_threads_it_does_not_have(blocking: BlockingBackend) -> None:
    # a launch runs in another thread at fork(): that thread does not exist in the child, so
    # its lease is dropped there (the child can close the pool); the parent keeps it
    import os

    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=7) as (pool, host):
        slots = torch.tensor([0, 5, 9])
        expected = reference_transfer(pool_bytes(pool), pool.layout, host.buffer, host.layout, slots, slots)
        thread, failures = _start_backup(pool, host, slots)
        assert blocking.started.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: no pytest past here
            code = 1
            try:
                host.close(timeout=2)
                code = 0 if host.memory.closed else 2
            except BaseException:  # reported by the exit code
                code = 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with pytest.raises(errors.BusyError, match="offload-thread"):  # the parent's lease still holds
            host.close(timeout=0.1)
        blocking.go.set()
        thread.join(10)
        assert not failures and same(host.buffer.reshape(-1).view(torch.uint8), expected)
    assert host.memory.closed
