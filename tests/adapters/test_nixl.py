"""NIXL on HostVA metadata (pointerdomain.adapters.nixl).

* descriptors: DRAM only from HostVA metadata, VRAM only from CUDA memory of the named
  device, FILE from a file descriptor; dev_id per type; every other input refused with a
  typed error (no NIXL needed);
* the wrapper with a recording fake agent: what reaches NIXL, local descriptors checked
  against the agent's registrations, registrations ended by the owner's close / collection;
* with the real NIXL (skipped, with the reason, when ``nixl`` cannot be imported):
  two processes over the UCX back-end on loopback -- A fills a host KV pool through the
  kernels, B pulls selected pages into its own host pool and loads them into its device
  pool through the kernels, bytes compared with A's; and the POSIX back-end writing a
  pool's pages to a file and reading them back (the storage-tier path).

Everything runs on the emulated device, where device aliases differ from host VAs.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import nixl as pdnixl
from pointerdomain.adapters.nixl import HostNixlAgent, dram_desc, file_desc, file_region, vram_desc
from tests.adapters.nixl_peer import MARK, layouts
from tests.childenv import pythonpath
from tests.reference import page_items, page_slots

# UCX's InfiniBand module, loaded whenever libibverbs is installed (CI installs it for
# Mooncake), segfaults at process exit on a machine with no RDMA device (seen here: node A
# returned -11 after a clean close). These tests move bytes over TCP on loopback, so
# leave the module out, in this process and in node A (which inherits the environment).
os.environ.setdefault("UCX_MODULES", "^ib")

PEER = Path(__file__).with_name("nixl_peer.py")
DEV = "emulated:0"


def _nixl_or_skip() -> None:
    try:
        pdnixl._nixl_api()
    except pdnixl.NixlUnavailableError as exc:
        pytest.skip(f"NIXL cannot be imported here: {exc}")


class FakeAgent:
    """Records the calls that reach NIXL."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            if name == "register_memory":
                return ("handle", len(self.calls))
            if name == "transfer":
                return "DONE"
            return None

        return call

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def pool() -> Any:
    _, host_layout = layouts()
    with pd.HostKVPool(host_layout, DEV) as p:
        yield p


def test_dram_descriptors_only_from_host_va_metadata(pool: pd.HostKVPool) -> None:
    info = pool.get_contiguous_buf_infos()[0]
    d = dram_desc(info)
    assert (d.mem_type, d.addr, d.nbytes, d.dev_id) == ("DRAM", info.address.value, info.nbytes, 0)
    assert d.addr == pool.buffer.data_ptr()                        # the host VA, not the alias
    assert dram_desc(info.address, 64).xfer_tuple() == (info.address.value, 64, 0)
    alias = pool.kernel_table[0]
    assert alias.value != info.address.value
    for bad in (alias, alias.value, pool.kernel_table, pool.host_table, pool.buffer, "0x1000", None):
        with pytest.raises(errors.DomainError):
            dram_desc(bad, 64)  # type: ignore[arg-type]
    with pytest.raises(errors.DomainError, match="device alias"):
        dram_desc(alias)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError):
        dram_desc(info.address)                                    # a bare HostVA needs its length
    with pytest.raises(errors.InvalidArgumentError):
        dram_desc(info, 64)
    with pytest.raises(errors.InvalidArgumentError):
        dram_desc(info.address, 0)
    with pytest.raises(TypeError):
        pdnixl.NixlDesc(object(), "DRAM", alias.value, 64, 0)        # no hand-made descriptors


def test_vram_and_file_descriptors() -> None:
    emu = pd.device_empty((64,), torch.uint8, DEV)
    with pytest.raises(errors.InvalidDeviceError, match="not a CUDA device"):
        vram_desc(emu, DEV)
    if torch.cuda.is_available():
        t = torch.empty(64, dtype=torch.uint8, device="cuda:0")
        d = vram_desc(t, "cuda:0")
        assert (d.mem_type, d.addr, d.nbytes, d.dev_id) == ("VRAM", t.data_ptr(), 64, 0)
        with pytest.raises(errors.DomainError, match="host memory"):
            vram_desc(torch.empty(64, dtype=torch.uint8).pin_memory(), "cuda:0")
    else:
        with pytest.raises(errors.DomainError, match="host memory, not VRAM"):
            vram_desc(torch.empty(64, dtype=torch.uint8), "cuda:0")
    f = file_desc(7, 4096, 512)
    assert (f.mem_type, f.addr, f.nbytes, f.dev_id) == ("FILE", 4096, 512, 7)   # addr = offset, dev_id = fd
    r = file_region(7, 1 << 20, "/tmp/x")
    assert r.reg_tuple() == (0, 1 << 20, 7, "/tmp/x") and r.contains(f)
    for bad_fd in (-1, 1.5, None):
        with pytest.raises(errors.InvalidArgumentError):
            file_desc(bad_fd, 0, 8)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError):
        file_desc(3, -1, 8)


def test_fake_agent_registration_follows_the_pool() -> None:
    fake = FakeAgent()
    agent = HostNixlAgent("fake", agent=fake)
    _, host_layout = layouts()
    p = pd.HostKVPool(host_layout, DEV)
    reg = agent.register_pool(p)
    name, (tuples, mem_type, backends) = fake.calls[0]
    assert name == "register_memory" and mem_type == "DRAM" and backends == []
    assert tuples == [(p.buffer.data_ptr(), host_layout.nbytes, 0, "")]
    blocks = p.get_page_buffer_meta([1, 5])
    agent.read("peer", blocks, blocks)
    local_tuples = fake.calls[1][1][0]
    assert local_tuples == [(b.address.value, b.nbytes, 0) for b in blocks]
    p.close()                                                     # the hook deregisters first
    assert reg.closed and agent.registrations() == []
    assert fake.names().count("deregister_memory") == 1
    assert fake.calls[-1] == ("deregister_memory", (("handle", 1),))
    n = len(fake.calls)
    with pytest.raises(errors.NotRegisteredError):                # the closed pool's blocks are refused
        agent.read("peer", blocks, blocks)
    assert len(fake.calls) == n                                   # before NIXL was called
    reg.close()
    assert fake.names().count("deregister_memory") == 1           # once


def test_fake_agent_registration_ends_when_the_owner_is_collected() -> None:
    fake = FakeAgent()
    agent = HostNixlAgent("fake", agent=fake)
    _, host_layout = layouts()
    p = pd.HostKVPool(host_layout, DEV)
    reg = agent.register_pool(p)
    del p
    gc.collect()
    assert reg.closed and fake.names().count("deregister_memory") == 1


def test_fake_agent_transfer_checks(pool: pd.HostKVPool) -> None:
    fake = FakeAgent()
    agent = HostNixlAgent("fake", agent=fake)
    agent.register_pool(pool)
    blocks = pool.get_page_buffer_meta([0, 1])
    n = len(fake.calls)
    with pytest.raises(errors.DomainError):
        agent.transfer("READ", [pool.kernel_table[0]], [dram_desc(blocks[0])], "peer")  # type: ignore[list-item]
    with pytest.raises(errors.LayoutError):
        agent.transfer("READ", [dram_desc(blocks[0])], [dram_desc(blocks[0].address, blocks[0].nbytes + 2)], "peer")
    with pytest.raises(errors.InvalidArgumentError):
        agent.transfer("READ", [dram_desc(blocks[0])], [], "peer")
    with pytest.raises(errors.InvalidArgumentError):
        agent.transfer("COPY", [dram_desc(blocks[0])], [dram_desc(blocks[0])], "peer")  # type: ignore[arg-type]
    outside = pd.alloc_registered(4096, DEV)
    with pytest.raises(errors.NotRegisteredError):
        agent.transfer("READ", [dram_desc(pd.host_ptr_table([outside.tensor])[0], 64)], [dram_desc(blocks[0].address, 64)], "peer")
    with pytest.raises(errors.DomainError):
        agent.register([pool.host_table[0]])  # type: ignore[list-item]
    assert len(fake.calls) == n
    outside.close()


def _load_and_compare(device_pool: pd.DeviceKVPool, expected: dict[str, torch.Tensor], dev_pages: list[int],
                      poison: dict[str, torch.Tensor]) -> None:
    got = page_items(device_pool, dev_pages)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    idx = page_slots(dev_pages, device_pool.layout.page_size)
    for key, before in poison.items():                            # nothing else was written
        kv, layer = map(int, key.split("/"))
        after = device_pool.buffer(kv, layer).view(torch.uint8).clone()
        after[idx] = before[idx]
        assert torch.equal(after, before), key


def _poisoned_device_pool() -> tuple[pd.DeviceKVPool, dict[str, torch.Tensor]]:
    dev_layout, _ = layouts()
    device_pool = pd.DeviceKVPool(dev_layout, DEV)
    for t in device_pool.buffers:
        t.view(torch.uint8).fill_(0xA5)
    poison = {f"{kv}/{layer}": device_pool.buffer(kv, layer).view(torch.uint8).clone()
              for kv in range(dev_layout.num_kv) for layer in range(dev_layout.num_layers)}
    return device_pool, poison


@pytest.mark.requires_module("nixl")
def test_two_processes_pull_pages_over_ucx(tmp_path: Path) -> None:
    _nixl_or_skip()
    a_dev_pages, a_host_pages = [2, 7, 4], [5, 0, 3]
    b_host_pages, b_dev_pages = [1, 6, 2], [9, 0, 3]
    expected_path = tmp_path / "expected.pt"
    env = dict(os.environ, PYTHONPATH=pythonpath())  # this pointerdomain, and the checkout for tests.*
    proc = subprocess.Popen(
        [sys.executable, str(PEER), "--name", f"A-{os.getpid()}", "--dev-pages", *map(str, a_dev_pages),
         "--host-pages", *map(str, a_host_pages), "--expected", str(expected_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        while line and not line.startswith(MARK):
            line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "node A printed nothing"
        msg = json.loads(line[len(MARK):])
        _, host_layout = layouts()
        device_pool, poison = _poisoned_device_pool()
        with pd.HostKVPool(host_layout, DEV) as host_pool, HostNixlAgent(f"B-{os.getpid()}", ["UCX"]) as agent:
            host_pool.buffer.view(torch.uint8).fill_(0x3C)
            reg = agent.register_pool(host_pool)
            peer = agent.add_remote(base64.b64decode(msg["metadata"]))
            assert peer == msg["name"]
            remote = [pd.BufferInfo.model_validate_json(b) for b in msg["blocks"]]
            assert all(isinstance(b.address, pd.HostVA) for b in remote)
            local = host_pool.get_page_buffer_meta(b_host_pages)
            agent.read(peer, local, remote)
            host_pool.load(device_pool, page_slots(b_host_pages, host_layout.page_size),
                           page_slots(b_dev_pages, host_layout.page_size))
        assert reg.closed
        proc.stdin.write("done\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert [json.loads(ln[len(MARK):]) for ln in out.splitlines() if ln.startswith(MARK)] == [{"closed": True}]
        expected = torch.load(expected_path)
        _load_and_compare(device_pool, expected, b_dev_pages, poison)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.requires_module("nixl")
def test_posix_backend_writes_pages_to_a_file_and_reads_them_back(tmp_path: Path) -> None:
    _nixl_or_skip()
    dev_layout, host_layout = layouts()
    src_dev = pd.DeviceKVPool(dev_layout, DEV)
    g = torch.Generator().manual_seed(99)
    for t in src_dev.buffers:
        flat = t.view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    pages_out, pages_back, dev_back = [3, 0, 6], [7, 1, 4], [8, 2, 5]
    path = tmp_path / "kv_pages.bin"
    with pd.HostKVPool(host_layout, DEV) as host_pool, HostNixlAgent(f"P-{os.getpid()}", ["POSIX"]) as agent:
        host_pool.backup(src_dev, page_slots([1, 5, 9], dev_layout.page_size), page_slots(pages_out, host_layout.page_size))
        agent.register_pool(host_pool)
        blocks = host_pool.get_page_buffer_meta(pages_out)
        total = sum(b.nbytes for b in blocks)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, total)
            freg = agent.register([file_region(fd, total, str(path))])
            offsets = [sum(b.nbytes for b in blocks[:i]) for i in range(len(blocks))]
            in_file = [file_desc(fd, off, b.nbytes) for off, b in zip(offsets, blocks)]
            agent.transfer("WRITE", [dram_desc(b) for b in blocks], in_file, agent.name)
            data = path.read_bytes()
            flat = host_pool.buffer.view(torch.uint8).view(-1)
            base = host_pool.buffer.data_ptr()
            for off, b in zip(offsets, blocks):            # the file holds the pages' bytes (host VA side)
                start = b.address.value - base
                assert data[off:off + b.nbytes] == bytes(flat[start:start + b.nbytes].tolist())
            back = host_pool.get_page_buffer_meta(pages_back)
            host_pool.buffer.view(torch.uint8).view(-1)[:] = 0   # wipe everything, then read the file back
            agent.transfer("READ", [dram_desc(b) for b in back], in_file, agent.name)
            freg.close()
        finally:
            os.close(fd)
        device_pool, poison = _poisoned_device_pool()
        host_pool.load(device_pool, page_slots(pages_back, host_layout.page_size), page_slots(dev_back, host_layout.page_size))
    _load_and_compare(device_pool, page_items(src_dev, [1, 5, 9]), dev_back, poison)


def test_fake_agent_refuses_local_dram_in_device_memory_or_closed_memory() -> None:
    # dram_desc builds a peer's descriptors too (addresses of another process), so the memory
    # behind a DRAM descriptor is checked where it is known to be local: register and the
    # local side of a transfer, before NIXL is called
    fake = FakeAgent()
    agent = HostNixlAgent("fake", agent=fake)
    device_mem = pd.device_empty((4096,), torch.uint8, DEV)
    in_device = dram_desc(pd.HostVA(device_mem.data_ptr()), 4096)
    with pytest.raises(errors.DomainError, match="device memory"):
        agent.register([in_device])
    _, host_layout = layouts()
    p = pd.HostKVPool(host_layout, DEV)
    infos = p.get_contiguous_buf_infos()
    blocks = p.get_page_buffer_meta([1])
    p.close()
    stale = [dram_desc(i) for i in infos]
    with pytest.raises(errors.ClosedError, match=r"descs\[0\]"):
        agent.register(stale)
    assert fake.calls == []
    # as a remote descriptor (a peer's address space) the same values pass to NIXL
    with pd.HostKVPool(host_layout, DEV) as live:
        agent.register_pool(live)
        mine = live.get_page_buffer_meta([1])
        agent.read("peer", mine, blocks)
        assert "transfer" in fake.names()
