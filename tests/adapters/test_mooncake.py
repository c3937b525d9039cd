"""The Mooncake Transfer Engine on HostVA metadata: a typed wrapper that refuses device
aliases (unit tests with a recording fake), and a two-process pull of KV pages over
TCP on 127.0.0.1 with the real engine (skipped, with the reason, when the engine
cannot be imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters.mooncake import HostTransferEngine, as_host_va
from tests.childenv import pythonpath

PEER = Path(__file__).with_name("mooncake_peer.py")
DEV = "emulated:0"


class FakeEngine:
    """Records what reaches the engine; returns ``rc`` from every call."""

    def __init__(self, rc: int = 0) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.rc = rc

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append((name, args))
            return 4242 if name == "get_rpc_port" else self.rc

        return call


@pytest.fixture
def pool() -> Any:
    layout = pd.KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=2, num_heads=1, head_dim=32)
    with pd.HostKVPool(layout, DEV) as p:
        yield p


def test_wrapper_accepts_only_host_addresses(pool: pd.HostKVPool) -> None:
    fake = FakeEngine()
    eng = HostTransferEngine(fake, "127.0.0.1")
    alias = pool.kernel_table[0]
    assert isinstance(alias, pd.DeviceAlias) and alias.value != pool.host_table[0].value
    for bad in (alias, alias.value, pool.kernel_table, pool.host_table, pool.buffer):
        with pytest.raises(errors.DomainError):
            eng.register_memory(bad, 4096)  # type: ignore[arg-type]
    with pytest.raises(errors.DomainError, match="device alias"):
        eng.batch_register_memory([alias])  # type: ignore[list-item]
    device_mem = pd.device_empty((4096,), torch.uint8, DEV)
    with pytest.raises(errors.DomainError, match="device memory"):
        eng.register_memory(pd.HostVA(device_mem.data_ptr()), 4096)
    assert fake.calls == []  # nothing reached the engine

    infos = pool.get_contiguous_buf_infos()
    eng.batch_register_memory(infos)
    assert fake.calls == [("register_memory", (infos[0].address.value, infos[0].nbytes))]
    blocks = pool.get_page_buffer_meta([1, 3])
    with pytest.raises(errors.DomainError):
        eng.batch_transfer_sync_read("peer:1", [alias] * len(blocks), blocks)  # type: ignore[list-item]
    with pytest.raises(errors.DomainError):
        eng.transfer_sync_read("peer:1", blocks[0], alias, blocks[0].nbytes)  # type: ignore[arg-type]
    assert eng.batch_transfer_sync_read("peer:1", blocks, blocks) == sum(b.nbytes for b in blocks)
    name, (peer, local, remote, lengths) = fake.calls[-1]
    assert name == "batch_transfer_sync_read" and peer == "peer:1"
    assert local == [b.address.value for b in blocks] and lengths == [b.nbytes for b in blocks]
    eng.transfer_sync_write("peer:1", blocks[0].address, pd.HostVA(0x1000), 16)
    assert fake.calls[-1] == ("transfer_sync_write", ("peer:1", blocks[0].address.value, 0x1000, 16))
    assert eng.session_id == "127.0.0.1:4242"
    eng.close()
    assert fake.calls[-1] == ("unregister_memory", (infos[0].address.value,))


def test_device_memory_over_released_metadata_is_named_device_memory() -> None:
    # host memory whose metadata was handed out, released; emulated device memory taken
    # until one allocation reuses those addresses: it is device memory, not stale metadata
    layout = pd.KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=2, num_heads=1, head_dim=32)
    released: list[tuple[int, int]] = []
    for _ in range(4):
        with pd.HostKVPool(layout, DEV) as p:
            released += [(i.address.value, i.address.value + i.nbytes) for i in p.get_contiguous_buf_infos()]
    fake = FakeEngine()
    eng = HostTransferEngine(fake, "127.0.0.1")
    held = []
    for _ in range(64):
        held.append(pd.device_empty((4096,), torch.uint8, DEV))
        a = held[-1].data_ptr()
        if any(lo < a + 4096 and a < hi for lo, hi in released):
            break
    else:
        pytest.fail("no emulated device allocation reused released pool memory")
    with pytest.raises(errors.DomainError, match="device memory"):
        eng.register_memory(pd.HostVA(a), 4096)
    assert fake.calls == []


def test_wrapper_checks_registration_sizes_and_return_codes(pool: pd.HostKVPool) -> None:
    eng = HostTransferEngine(FakeEngine(), "127.0.0.1")
    block = pool.get_page_buffer_meta([0])[0]
    with pytest.raises(errors.NotRegisteredError):
        eng.transfer_sync_read("peer:1", block, block)
    eng.batch_register_memory(pool.get_contiguous_buf_infos())
    other = pd.BufferInfo(address=block.address, nbytes=block.nbytes // 2, item_bytes=1)
    with pytest.raises(ValueError, match="bytes"):
        eng.batch_transfer_sync_read("peer:1", [block], [other])
    for call in (eng.transfer_sync_read, eng.transfer_sync_write):  # one block: the remote's own size counts
        with pytest.raises(errors.InvalidArgumentError, match="16-byte block for a 32-byte"):
            call("peer:1", pd.BufferInfo(address=block.address, nbytes=32, item_bytes=16),
                 pd.BufferInfo(address=block.address, nbytes=16, item_bytes=16))
        with pytest.raises(errors.InvalidArgumentError, match="16-byte block for a 32-byte"):
            call("peer:1", block.address, pd.BufferInfo(address=block.address, nbytes=16, item_bytes=16), 32)
    assert [name for name, _ in eng.engine.calls] == ["register_memory"]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="nbytes"):
        eng.register_memory(block.address)
    with pytest.raises(errors.NotRegisteredError):
        eng.unregister_memory(block.address + 64)
    failing = HostTransferEngine(FakeEngine(rc=-1), "127.0.0.1")
    with pytest.raises(errors.RuntimeCallError, match="register_memory"):
        failing.register_memory(block)
    assert as_host_va(block) == block.address and as_host_va(block.address) is block.address


def engine_unavailable() -> str | None:
    """Why the real engine cannot be used here, or None (checked in a child process,
    so a broken native library cannot take the test run down)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import mooncake.engine as e; e.TransferEngine()"],
            capture_output=True, text=True, timeout=60,
        )
    except subprocess.TimeoutExpired:
        return "importing mooncake.engine timed out"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return "mooncake transfer engine not importable: " + (lines[-1] if lines else f"exit {proc.returncode}")
    return None


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


@pytest.mark.requires_module("mooncake")
def test_two_process_pull_over_tcp(tmp_path: Path) -> None:
    reason = engine_unavailable()
    if reason is not None:
        pytest.skip(reason)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="1", PYTHONPATH=pythonpath())
    ready, expected, result = tmp_path / "ready.json", tmp_path / "expected.pt", tmp_path / "result.pt"
    serve_log, pull_log = tmp_path / "serve.log", tmp_path / "pull.log"
    # A: device pages 1, 4, 6 backed up into host pages 5, 2, 7; B pulls those host pages into
    # its host pages 0, 1, 2 and loads them into device pages 3, 0, 9.
    started = time.perf_counter()
    with open(serve_log, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, str(PEER), "serve", "--ready", str(ready), "--device-pages", "1,4,6",
             "--host-pages", "5,2,7", "--expected", str(expected)],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if server.poll() is not None:
                pytest.fail(f"serving peer exited with {server.returncode}:\n{tail(serve_log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"serving peer not ready after 120 s:\n{tail(serve_log)}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["alias_rejected"], "the wrapper let a DeviceAlias reach register_memory"
        assert info["alias_differs"], "the emulated device should give aliases != host VAs"
        try:
            proc = subprocess.run(
                [sys.executable, str(PEER), "pull", "--ready", str(ready), "--device-pages", "3,0,9",
                 "--host-pages", "0,1,2", "--result", str(result)],
                capture_output=True, timeout=180, env=env,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"pulling peer timed out:\n{exc.stdout!r}\n{exc.stderr!r}")
        pull_log.write_bytes(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"pulling peer failed:\n{tail(pull_log)}\n--- server:\n{tail(serve_log)}"
        stats = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        assert server.stdin is not None
        server.stdin.write(b"done\n")
        server.stdin.close()
        assert server.wait(timeout=60) == 0, tail(serve_log)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)

    want: dict[str, torch.Tensor] = torch.load(expected)
    got: dict[str, torch.Tensor] = torch.load(result)
    assert sorted(want) == sorted(got) and len(want) == 2 * 3
    for key in want:
        assert torch.equal(got[key], want[key]), f"(kv/layer) {key}: pulled pages differ"
        assert bool(want[key].any())
    page_bytes = 2 * 3 * 4 * 2 * 64 * 2  # kv x layers x tokens x heads x head_dim x bf16, per page
    assert stats["bytes"] == 3 * page_bytes and stats["blocks"] == 3 * 2
    print(f"mooncake two-process pull: {stats['bytes']} bytes in {stats['blocks']} blocks, "
          f"read {stats['read_seconds'] * 1e3:.1f} ms, total {time.perf_counter() - started:.1f} s")


def test_overlapping_registration_is_refused_and_records_stay_whole(pool: pd.HostKVPool) -> None:
    # the engine itself refuses overlapping registrations (ERR_ADDRESS_OVERLAPPED): refused
    # here first, and never by replacing the record of the range registered at that start
    fake = FakeEngine()
    eng = HostTransferEngine(fake, "127.0.0.1")
    whole = pool.get_contiguous_buf_infos()[0]
    eng.register_memory(whole)
    first = pool.get_page_buffer_meta([0])[0]  # starts where the pool starts
    inner = pool.get_page_buffer_meta([2])[0]
    for sub in (first, inner, pd.BufferInfo(address=whole.address + 64, nbytes=whole.nbytes, item_bytes=1)):
        with pytest.raises(errors.AlreadyRegisteredError, match="overlaps"):
            eng.register_memory(sub)
    assert [name for name, _ in fake.calls] == ["register_memory"]
    eng.transfer_sync_write("peer:1", inner, pd.HostVA(0x10000))  # the rest of the pool is still registered
    # a block's metadata at the registration's start is not the registration: nothing unregistered
    with pytest.raises(errors.NotRegisteredError, match=f"registration starting there is {whole.nbytes} bytes"):
        eng.unregister_memory(first)
    assert [name for name, _ in fake.calls] == ["register_memory", "transfer_sync_write"]
    eng.unregister_memory(whole)
    assert fake.calls[-1] == ("unregister_memory", (whole.address.value,))
    with pytest.raises(errors.NotRegisteredError):
        eng.unregister_memory(whole.address)  # once only
    eng.register_memory(first)  # free again: a sub-range registers, and only it counts
    with pytest.raises(errors.NotRegisteredError):
        eng.transfer_sync_write("peer:1", inner, pd.HostVA(0x10000))
    eng.close()
    assert fake.calls[-1] == ("unregister_memory", (first.address.value,))


def test_peer_is_checked_before_the_engine(pool: pd.HostKVPool) -> None:
    fake = FakeEngine()
    eng = HostTransferEngine(fake, "127.0.0.1")
    eng.batch_register_memory(pool.get_contiguous_buf_infos())
    fake.calls.clear()
    blocks = pool.get_page_buffer_meta([1])
    for bad, error in ((5, errors.InvalidTypeError), (b"peer:1", errors.InvalidTypeError), (None, errors.InvalidTypeError),
                       ("", errors.InvalidArgumentError), (" peer:1", errors.InvalidArgumentError)):
        bad_peer: Any = bad  # what an untyped caller passes
        with pytest.raises(error, match="peer"):
            eng.transfer_sync_read(bad_peer, blocks[0], blocks[1])
        with pytest.raises(error, match="peer"):
            eng.transfer_sync_write(bad_peer, blocks[0], blocks[1])
        with pytest.raises(error, match="peer"):
            eng.batch_transfer_sync_read(bad_peer, blocks, blocks)
        with pytest.raises(error, match="peer"):
            eng.batch_transfer_sync_write(bad_peer, blocks, blocks)
    assert fake.calls == []
