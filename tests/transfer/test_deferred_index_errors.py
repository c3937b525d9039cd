"""Out-of-range slots without a host sync: the kernel skips the pair and sets the device's
error word (bound in every launch plan); ``check_errors`` / ``synchronize`` raise
IndexValidationError later. On the emulated device (host-readable, synchronous) the
launch raises at once. The copy-engine path builds its descriptors from the one host
copy of the indices it validated.

On CPU the CUDA behaviour is exercised with a backend class whose memory is declared not
host-readable (so the library takes the deferred path, as on CUDA)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pointerdomain as pd
from pointerdomain import checked, errors
from pointerdomain.testing import FaultyBackend, backend_for, install_backend
from pointerdomain.transfer.plan import plan_for
from tests.reference import DEV, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer, same
from tests import childenv

ROOT = Path(__file__).resolve().parents[2]


class DeviceLikeBackend(FaultyBackend):
    """The emulated backend, declared not host-readable: the launch path must not read
    index memory on the host (the CUDA rule)."""

    def __init__(self) -> None:
        super().__init__(backend_for(DEV), {})
        self.host_readable = False
        self.synchronized = 0

    def synchronize(self, device: pd.Device) -> None:
        self.synchronized += 1


@pytest.fixture
def device_like() -> Iterator[DeviceLikeBackend]:
    pd.check_errors(DEV)  # start clean
    backend = DeviceLikeBackend()
    with checked.checked_mode(False), install_backend(backend, "emulated"):
        yield backend


@pytest.fixture
def pools() -> Iterator[tuple[pd.DeviceKVPool, pd.HostKVPool]]:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 31)
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        fill_random(host.buffer, 32)
        yield pool, host


def test_plans_bind_the_device_error_word(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    plan = plan_for(pool.table, pool.layout, host.kernel_table, host.layout)
    assert plan.kernel.oob != 0 and plan.unchecked is not None and plan.unchecked.oob == 0


def test_deferred_error_surfaces_at_check_errors(
    device_like: DeviceLikeBackend, pools: tuple[pd.DeviceKVPool, pd.HostKVPool]
) -> None:
    pool, host = pools
    before = host.buffer.clone()
    s, d = torch.tensor([0, 1, 2]), torch.tensor([4, 10_000, 6])  # the middle pair is out of range
    host.backup(pool, s, d)  # no error, no host read of the indices at launch
    with pytest.raises(errors.IndexValidationError, match="outside its table") as info:
        pd.check_errors(DEV)
    assert isinstance(info.value, IndexError)
    assert device_like.synchronized >= 1
    pd.check_errors(DEV)  # cleared: a second check is clean
    ok_s, ok_d = torch.tensor([0, 2]), torch.tensor([4, 6])
    want = reference_transfer(pool_bytes(pool), pool.layout, before, host.layout, ok_s, ok_d)
    assert same(host.buffer.reshape(-1).view(torch.uint8), want)  # good pairs copied, the bad one skipped


def test_synchronize_reports_too(device_like: DeviceLikeBackend, pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    host.load(pool, torch.tensor([-1]), torch.tensor([0]))
    with pytest.raises(errors.IndexValidationError):
        pd.synchronize(DEV)
    pd.synchronize(DEV)


def test_host_validation_stays_available(device_like: DeviceLikeBackend, pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    before = host.buffer.clone()
    with pytest.raises(errors.IndexValidationError, match="slot 10000 outside"):
        host.backup(pool, torch.tensor([0]), torch.tensor([10_000]), validate_indices="host")
    assert same(host.buffer, before)
    pd.check_errors(DEV)  # nothing launched, nothing recorded


def test_validate_false_reports_nothing(device_like: DeviceLikeBackend, pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    host.backup(pool, torch.tensor([0]), torch.tensor([10_000]), validate_indices=False)
    pd.check_errors(DEV)


def test_emulated_device_raises_at_the_launch(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    before = host.buffer.clone()
    with checked.checked_mode(False), pytest.raises(errors.IndexValidationError):
        host.backup(pool, torch.tensor([0]), torch.tensor([32]))
    assert same(host.buffer, before)
    pd.check_errors(DEV)


def test_bad_validate_indices_value(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    pool, host = pools
    with pytest.raises(errors.InvalidArgumentError, match="'host'"):
        host.backup(pool, torch.tensor([0]), torch.tensor([1]), validate_indices="device")  # type: ignore[arg-type]


_TOCTOU = textwrap.dedent("""
    import torch
    import pointerdomain as pd
    from pointerdomain.testing import FaultyBackend, backend_for, install_backend
    from tests.reference import fill_pool, fill_random, model_layout, pool_bytes, reference_transfer, same
    dev = pd.Device("emulated", 0)

    class Mutating(FaultyBackend):
        # another thread changing an index after validation: here, between the check and the copy
        def current_stream(self, device):
            dst_idx[0] = host.layout.num_slots * 64
            return super().current_stream(device)

    pool = pd.DeviceKVPool(model_layout(), dev)
    fill_pool(pool, 41)
    host = pd.HostKVPool(model_layout("page_first"), dev)
    fill_random(host.buffer, 42)
    before = host.buffer.clone()
    src_idx, dst_idx = torch.tensor([3]), torch.tensor([5])
    with install_backend(Mutating(backend_for(dev), {}), "emulated"):
        pd.transfer_kv_all_layer(pool.table, host.kernel_table, src_idx, dst_idx, src_layout=pool.layout,
                                 dst_layout=host.layout, backend="copy_engine")
    want = reference_transfer(pool_bytes(pool), pool.layout, before, host.layout, torch.tensor([3]), torch.tensor([5]))
    print("OK" if same(host.buffer.reshape(-1).view(torch.uint8), want) else "WRONG")
""")


def test_copy_engine_uses_the_indices_it_validated() -> None:
    """An index changed after validation (TOCTOU) does not reach the copy-engine
    descriptors: the copy uses the validated host copy (before: a write far past the pool)."""
    env = {"PYTHONPATH": childenv.pythonpath(), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", _TOCTOU], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", (proc.returncode, proc.stdout, proc.stderr[-2000:])


@pytest.mark.gpu
def test_gpu_deferred_index_error_no_sync_and_graph_replay() -> None:
    """CUDA: a bad slot is skipped and reported at synchronize(); inside a captured graph
    the launch is free (no host sync) and a replay with a bad index written into the
    static index tensor reports at check_errors(); nothing written outside the tables."""
    dev = pd.Device("cuda", 0)
    pd.synchronize(dev)
    pool = pd.DeviceKVPool(model_layout(), dev)
    fill_pool(pool, 51)
    with pd.HostKVPool(model_layout("page_first"), dev) as host:
        fill_random(host.buffer, 52)
        before = host.buffer.clone()
        s = torch.tensor([0, 1, 2], device="cuda")
        d = torch.tensor([4, 1 << 40, 6], device="cuda")
        host.backup(pool, s, d)  # default validate_indices=True: no raise, no sync
        with pytest.raises(errors.IndexValidationError):
            pd.synchronize(dev)
        ok = reference_transfer(pool_bytes(pool), pool.layout, before, host.layout, torch.tensor([0, 2]),
                                torch.tensor([4, 6]))
        assert same(host.buffer.reshape(-1).view(torch.uint8), ok)
        pd.check_errors(dev)
        # graph capture and replay
        static_s = torch.tensor([7, 8], device="cuda")
        static_d = torch.tensor([9, 10], device="cuda")
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            host.backup(pool, static_s, static_d, backend="kernel")  # warm-up (plan built)
        torch.cuda.synchronize()
        pd.check_errors(dev)
        with torch.cuda.graph(graph, stream=stream):
            host.backup(pool, static_s, static_d, backend="kernel")
        snap = host.buffer.clone()
        static_d.copy_(torch.tensor([11, -5], device="cuda"))
        graph.replay()
        with pytest.raises(errors.IndexValidationError):
            pd.check_errors(dev)
        want = reference_transfer(pool_bytes(pool), pool.layout, snap, host.layout, torch.tensor([7]),
                                  torch.tensor([11]))
        assert same(host.buffer.reshape(-1).view(torch.uint8), want)
        pd.check_errors(dev)
        del graph  # a graph that captured the pool's launches holds it open (pointerdomain.transfer.graphs)
