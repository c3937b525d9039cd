"""Multi-device rules on the emulated backend, in the normal CPU suite.

The emulated backend has ``POINTERDOMAIN_EMULATED_DEVICES`` devices (default 2, so
``emulated:0`` and ``emulated:1`` exist here); each device has its own alias mapping
of one registration, and it refuses work for a device that is not the calling
thread's current one (as a kernel runs on the current GPU). These tests check:

* one registration -> a different alias per device, each mapped for that device only;
* per-device kernel tables from one host pool (``HostKVPool.kernel_table_for``);
* a launch on device d refuses tables and index tensors of another device before
  anything is copied;
* the launch switches to the tables' device and restores the caller's, also on error;
* concurrent transfers on both devices from one host pool, bytes verified.

Expected bytes come from ``tests/reference.py`` (plain torch indexing).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain._platform import Backend, LaunchArgs, backend_for
from pointerdomain._platform.emulated import EmulatedBackend
from pointerdomain._platform.faulty import FaultyBackend
from pointerdomain._platform.testing import install_backend
from pointerdomain.devices import current_device, emulated_device_count
from tests.reference import as_bytes, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer
from tests import childenv

if TYPE_CHECKING:
    from pointerdomain._C import KernelPlan

E0 = pd.Device("emulated", 0)
E1 = pd.Device("emulated", 1)
ROOT = Path(__file__).resolve().parents[2]
#: Where the imported package lives (the source tree, or site-packages under scripts/gpu-check).


def emulated() -> EmulatedBackend:
    backend = backend_for(E0)
    assert isinstance(backend, EmulatedBackend)
    return backend


def read(address: int, nbytes: int) -> bytes:
    """``nbytes`` at a raw address of this process (a host VA or an emulated alias)."""
    return ctypes.string_at(address, nbytes)


class RecordingBackend(FaultyBackend):
    """The emulated backend, recording the calling thread's current emulated device at
    each launch and copy (the device the work ran on), optionally failing a call."""

    def __init__(self, inner: Backend, fail: dict[str, dict[int, int]] | None = None) -> None:
        super().__init__(inner, fail or {})
        self.seen: list[tuple[pd.Device, pd.Device]] = []  # (device argument, current device)

    def launch(self, plan: KernelPlan, args: LaunchArgs) -> None:
        self.seen.append((args.device, current_device("emulated")))
        super().launch(plan, args)

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: pd.Device, stream: int) -> None:
        self.seen.append((device, current_device("emulated")))
        super().copy_runs(dsts, srcs, sizes, count, device, stream)


@pytest.fixture(autouse=True)
def _two_devices() -> None:
    assert emulated_device_count() >= 2, "the CPU suite runs with at least 2 emulated devices (the default)"
    assert current_device("emulated") == E0


# -- POINTERDOMAIN_EMULATED_DEVICES ----------------------------------------------------------


@pytest.mark.parametrize("text", ["0", "-1", "two", " 2", "2.0", "\u0662"])  # "" is unset: the default (test_env)
def test_emulated_device_count_is_parsed_strictly(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("POINTERDOMAIN_EMULATED_DEVICES", text)
    with pytest.raises(errors.InvalidDeviceError, match="POINTERDOMAIN_EMULATED_DEVICES"):
        emulated_device_count()
    with pytest.raises(errors.InvalidDeviceError, match="POINTERDOMAIN_EMULATED_DEVICES"):
        pd.validate_device("emulated:0")


def test_emulated_device_count_sets_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POINTERDOMAIN_EMULATED_DEVICES", "3")
    assert emulated_device_count() == 3
    assert pd.validate_device("emulated:2") == pd.Device("emulated", 2)
    with pytest.raises(errors.InvalidDeviceError, match="3 emulated device"):
        pd.validate_device("emulated:3")
    monkeypatch.delenv("POINTERDOMAIN_EMULATED_DEVICES")
    assert emulated_device_count() == 2
    with pytest.raises(errors.InvalidDeviceError):
        pd.validate_device("emulated:2")


def test_bad_emulated_device_count_imports_then_raises_at_first_use() -> None:
    code = (
        "import pointerdomain as pd\n"
        "try:\n"
        "    pd.alloc_registered(4096, 'emulated:0')\n"
        "except pd.errors.InvalidDeviceError as exc:\n"
        "    print('typed:', exc)\n"
    )
    env = {**os.environ, "POINTERDOMAIN_EMULATED_DEVICES": "zero", "PYTHONPATH": childenv.pythonpath()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("typed: POINTERDOMAIN_EMULATED_DEVICES='zero'"), out.stdout


def test_four_emulated_devices_each_with_its_own_alias() -> None:
    code = (
        "import pointerdomain as pd\n"
        "m = pd.alloc_registered(8192, 'emulated:0')\n"
        "m.tensor.copy_(__import__('torch').arange(8192) % 251)\n"
        "import ctypes\n"
        "aliases = [pd.resolve_alias(m.host_va + 100, f'emulated:{d}').value for d in range(4)]\n"
        "assert len(set(aliases)) == 4 and m.host_va.value + 100 not in aliases, aliases\n"
        "assert all(ctypes.string_at(a, 50) == bytes(m.tensor[100:150].tolist()) for a in aliases)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "POINTERDOMAIN_EMULATED_DEVICES": "4", "PYTHONPATH": childenv.pythonpath()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


# -- one registration, one alias per device --------------------------------------------------


def test_one_registration_has_a_distinct_alias_per_device() -> None:
    with pd.alloc_registered(3 * 4096, E0) as mem:
        fill_random(mem.tensor, 1)
        va = mem.host_va + 4096 + 24  # an interior pointer
        a0, a1 = pd.resolve_alias(va, E0), pd.resolve_alias(va, E1)
        assert a0.device == E0 and a1.device == E1
        assert len({a0.value, a1.value, va.value}) == 3
        # each alias keeps the offset inside its registration, and reads the same pages
        assert pd.resolve_alias(mem.host_va, E1).value + 4096 + 24 == a1.value
        want = bytes(mem.tensor[4096 + 24 : 4096 + 24 + 512].tolist())
        assert read(a0.value, 512) == want and read(a1.value, 512) == want
        mem.tensor[4096 + 24] ^= 0xFF  # a write through the host VA is seen through both aliases
        assert read(a0.value, 1) == read(a1.value, 1) == bytes([int(mem.tensor[4096 + 24])])
        # each alias is mapped for its own device only; the host VA for none
        backend = emulated()
        assert backend.alias_device(a0.value, 512) == 0
        assert backend.alias_device(a1.value, 512) == 1
        assert backend.alias_device(va.value, 512) == -1
        assert pd.resolve_alias(va, E1) == a1  # asked again: the same mapping
    assert backend.alias_device(a1.value, 1) == -1  # unregistering drops every device's mapping


def test_make_kernel_ptr_table_per_device_from_one_registration() -> None:
    with pd.alloc_registered(2 * 4096, E0) as mem:
        parts = [mem.tensor[:4096], mem.tensor[4096:]]
        t0, t1 = pd.make_kernel_ptr_table(parts, E0), pd.make_kernel_ptr_table(parts, "emulated:1")
        assert (t0.device, t1.device) == (E0, E1)
        assert all(a.device == E1 for a in t1)
        assert [a.value for a in t0] != [a.value for a in t1]
        assert [emulated().alias_device(a.value, 4096) for a in t1] == [1, 1]
        # the table's own array lives in device memory of its device
        assert pd.memory_device_at(t1.kernel_table_address(), 8 * len(t1)) == E1


def test_host_pool_kernel_table_for_each_device() -> None:
    with pd.HostKVPool(model_layout("page_first"), E0) as host:
        t1 = host.kernel_table_for("emulated:1")
        assert t1.device == E1 and host.kernel_table.device == E0
        assert host.kernel_table_for(E1) is t1 and host.kernel_table_for(E0) is host.kernel_table
        assert t1.sizes == host.kernel_table.sizes
        assert all(emulated().alias_device(a.value, n) == 1 for a, n in zip(t1, t1.sizes))
        with pytest.raises(errors.InvalidDeviceError):
            host.kernel_table_for("emulated:7")
    with pytest.raises(errors.ClosedError):
        host.kernel_table_for(E1)  # cached, but closed: the launch refuses it
    with pytest.raises(errors.ClosedError):
        pd.transfer_kv_all_layer(t1, t1, torch.tensor([0]), torch.tensor([1]), src_layout=host.layout,
                                 dst_layout=host.layout)


def test_chunked_host_pool_tables_per_device() -> None:
    layout = model_layout("page_first", pages=8)
    with pd.HostKVPool(layout, E0, max_chunk_bytes=layout.page_block_bytes() * 3) as host:
        assert len(host.memory.chunks) > 1
        t1 = host.kernel_table_for(E1)
        assert len(t1) == len(host.kernel_table) > 1
        assert all(emulated().alias_device(a.value, n) == 1 for a, n in zip(t1, t1.sizes))


# -- a launch on device d takes only device d's tables and indices ---------------------------


def pools() -> tuple[pd.DeviceKVPool, pd.DeviceKVPool, pd.HostKVPool]:
    dev_layout = model_layout("layer_first", pages=6)
    p0, p1 = pd.DeviceKVPool(dev_layout, E0), pd.DeviceKVPool(dev_layout, E1)
    fill_pool(p0, 0)
    fill_pool(p1, 100)
    host = pd.HostKVPool(model_layout("page_first", pages=10), E0)
    fill_random(host.buffer, 7)
    return p0, p1, host


def test_launch_refuses_a_table_of_another_device_before_copying() -> None:
    p0, p1, host = pools()
    with host:
        before_host, before_p1 = as_bytes(host.buffer).clone(), pool_bytes(p1)
        idx = torch.tensor([0, 1, 2])
        cases = [
            (p1.table, p1.layout, host.kernel_table, host.layout),  # D2H from device 1 into device 0's table
            (host.kernel_table, host.layout, p1.table, p1.layout),  # H2D the same way round
            (p0.table, p0.layout, host.kernel_table_for(E1), host.layout),  # device 1's host table on device 0
        ]
        for src, src_layout, dst, dst_layout in cases:
            with pytest.raises(errors.DeviceMismatchError, match="emulated:[01].*emulated:[01]"):
                pd.transfer_kv_all_layer(src, dst, idx, idx, src_layout=src_layout, dst_layout=dst_layout)
        assert torch.equal(as_bytes(host.buffer), before_host) and torch.equal(pool_bytes(p1), before_p1)


def test_a_table_for_device0_cannot_be_made_of_device1_memory() -> None:
    p1 = pd.DeviceKVPool(model_layout(), E1)
    with pytest.raises(errors.DeviceMismatchError, match="device memory of emulated:1"):
        pd.make_kernel_ptr_table(p1.buffers, E0)


def test_launch_refuses_indices_in_another_devices_memory() -> None:
    p0, p1, host = pools()
    with host:
        before = as_bytes(host.buffer).clone()
        good = torch.tensor([0, 5, 9])
        on_e0 = pd.device_empty((3,), torch.int64, E0)
        on_e0.copy_(good)
        on_e1 = pd.device_empty((3,), torch.int64, E1)
        on_e1.copy_(good)
        for s, d in ((on_e0, good), (good, on_e0)):
            with pytest.raises(errors.IndexValidationError, match="device memory of emulated:0.*runs on emulated:1"):
                host.backup(p1, s, d)
        assert torch.equal(as_bytes(host.buffer), before)
        # the launch device's own memory and plain CPU tensors are indices of emulated:1
        expected = reference_transfer(pool_bytes(p1), p1.layout, before, host.layout, good, good + 1)
        host.backup(p1, on_e1, good + 1)
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected)


# -- the device guard at every launch --------------------------------------------------------


def test_launch_on_device1_while_device0_is_current() -> None:
    p0, p1, host = pools()
    with host, install_backend(RecordingBackend(backend_for(E0)), "emulated") as rec:
        with pd.DeviceGuard("emulated:0"):
            s1, h1 = torch.tensor([3, 0, 17, 9]), torch.tensor([1, 2, 30, 31])
            s0, h0 = torch.tensor([4, 5]), torch.tensor([10, 11])
            expected = reference_transfer(pool_bytes(p1), p1.layout, as_bytes(host.buffer), host.layout, s1, h1)
            expected = reference_transfer(pool_bytes(p0), p0.layout, expected, host.layout, s0, h0)
            host.backup(p1, s1, h1, backend="kernel")
            assert current_device("emulated") == E0
            host.backup(p0, s0, h0, backend="kernel")
            assert torch.equal(as_bytes(host.buffer).reshape(-1), expected)
            # H2D into both devices, then the copy-engine path on device 1
            fill_pool(p0, 500)
            fill_pool(p1, 600)
            want1 = reference_transfer(host.buffer, host.layout, pool_bytes(p1), p1.layout, h1, s1)
            want0 = reference_transfer(host.buffer, host.layout, pool_bytes(p0), p0.layout, h0, s0)
            host.load(p1, h1, s1, backend="copy_engine")
            host.load(p0, h0, s0)
            assert current_device("emulated") == E0
            assert torch.equal(pool_bytes(p1), want1) and torch.equal(pool_bytes(p0), want0)
        # every piece of work ran with its tables' device current
        assert [d for d, _ in rec.seen] == [E1, E0, E1, E0]
        assert all(device == now for device, now in rec.seen), rec.seen


def test_device_restored_when_the_launch_fails() -> None:
    p0, p1, host = pools()
    with host, install_backend(RecordingBackend(backend_for(E0), fail={"launch": {1: 700}}), "emulated") as rec:
        before = as_bytes(host.buffer).clone()
        with pd.DeviceGuard(E0):
            with pytest.raises(errors.RuntimeCallError, match="700"):
                host.backup(p1, torch.tensor([1]), torch.tensor([2]), backend="kernel")
            assert current_device("emulated") == E0
            assert rec.seen == [(E1, E1)]
            with pytest.raises(errors.IndexValidationError):  # refused before the guard: nothing switched
                host.backup(p1, torch.tensor([1]), torch.tensor([10_000]))
            assert current_device("emulated") == E0
        assert torch.equal(as_bytes(host.buffer), before)


def test_caller_on_device1_gets_device1_back() -> None:
    p0, _p1, host = pools()
    with host, pd.DeviceGuard(E1):
        host.backup(p0, torch.tensor([0]), torch.tensor([0]))
        assert current_device("emulated") == E1
    assert current_device("emulated") == E0


def test_emulated_backend_refuses_work_for_a_device_that_is_not_current() -> None:
    src = pd.device_empty((64,), torch.uint8, E1)
    dst = pd.device_empty((64,), torch.uint8, E1)
    fill_random(src, 3)
    dst.zero_()
    runs = torch.tensor([[dst.data_ptr()], [src.data_ptr()], [64]], dtype=torch.int64)
    args = (runs[0].data_ptr(), runs[1].data_ptr(), runs[2].data_ptr(), 1)
    with pytest.raises(errors.RuntimeCallError, match="emulated:1 while emulated:0 is"):
        emulated().copy_runs(*args, E1, 0)
    assert not dst.any()
    with pd.DeviceGuard(E1):
        emulated().copy_runs(*args, E1, 0)
    assert torch.equal(dst, src)


# -- concurrent transfers on both devices from one host pool ---------------------------------


def test_concurrent_transfers_on_two_devices_from_one_host_pool() -> None:
    p0, p1, host = pools()
    rounds = 20
    with host:
        host_before = as_bytes(host.buffer).clone()
        # device 0 backs up into host slots 0..11, device 1 into 20..31: disjoint
        jobs = {E0: (p0, torch.arange(0, 12), torch.arange(12) * 2), E1: (p1, torch.arange(20, 32), torch.arange(12) + 5)}
        expected = host_before
        for dev, (pool, host_slots, dev_slots) in jobs.items():
            expected = reference_transfer(pool_bytes(pool), pool.layout, expected, host.layout, dev_slots, host_slots)
        failures: list[BaseException] = []
        barrier = threading.Barrier(2)

        def work(dev: pd.Device) -> None:
            pool, host_slots, dev_slots = jobs[dev]
            try:
                barrier.wait()
                for _ in range(rounds):
                    host.backup(pool, dev_slots, host_slots)
                    assert current_device("emulated") == E0  # each thread's own current device
                    host.load(pool, host_slots, dev_slots)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(d,)) for d in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        assert torch.equal(as_bytes(host.buffer).reshape(-1), expected)
        # loads put back exactly what was backed up (device bytes unchanged overall)
        for dev, (pool, host_slots, dev_slots) in jobs.items():
            want = reference_transfer(host.buffer, host.layout, pool_bytes(pool), pool.layout, host_slots, dev_slots)
            assert torch.equal(pool_bytes(pool), want)
