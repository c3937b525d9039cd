"""Metadata and launches over memory whose storage was released or swapped after the
table was built: refused with ClosedError, nothing handed to an engine or written."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters.mooncake import HostTransferEngine
from pointerdomain.adapters.nixl import HostNixlAgent, dram_desc
from pointerdomain.adapters.sglang import HostKVCacheAdapter
from tests import childenv
from tests.reference import DEV, fill_random, model_layout


class Recorder:
    """An engine / agent stand-in that records every call reaching it."""

    def __init__(self, nixl: bool = False) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.nixl = nixl

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            if name == "transfer":
                return "DONE"
            return ("handle", len(self.calls)) if self.nixl and name == "register_memory" else 0

        return call


def test_buffer_infos_of_released_storage_are_refused() -> None:
    t = torch.zeros(1024, dtype=torch.uint8)
    table = pd.host_ptr_table([t])
    assert pd.buffer_infos(table, 64)[0].nbytes == 1024
    t.untyped_storage().resize_(0)
    with pytest.raises(errors.ClosedError, match="released or reallocated"):
        pd.buffer_infos(table, 64)


def test_page_meta_of_swapped_tensor_is_refused() -> None:
    layout = model_layout("page_first")
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    table = pd.host_ptr_table([buf])
    assert len(pd.page_buffer_meta(table, layout, [1])) == 2
    buf.set_(torch.zeros(layout.nbytes, dtype=torch.uint8))
    with pytest.raises(errors.ClosedError, match="set_"):
        pd.page_buffer_meta(table, layout, [1])


@pytest.mark.parametrize("swap", ["share_memory_", "set_"])
def test_pool_metadata_after_storage_swap_is_refused(swap: str) -> None:
    with pd.HostKVPool(model_layout("page_first"), DEV) as pool:
        assert pool.get_contiguous_buf_infos()[0].address.value == pool.buffer.data_ptr()
        adapter = HostKVCacheAdapter.from_pool(pool)
        if swap == "share_memory_":
            pool.buffer.share_memory_()
        else:
            pool.buffer.set_(torch.zeros_like(pool.buffer))
        with pytest.raises(errors.ClosedError):
            pool.get_contiguous_buf_infos()
        with pytest.raises(errors.ClosedError):
            pool.get_page_buffer_meta([0])
        with pytest.raises(errors.ClosedError):
            adapter.get_contiguous_buf_infos()
        with pytest.raises(errors.ClosedError):
            adapter.get_page_buffer_meta(torch.arange(4))


def test_engines_refuse_metadata_taken_before_release() -> None:
    """A BufferInfo taken while the memory stood, handed on after it was released."""
    t = torch.zeros(4096, dtype=torch.uint8)
    info = pd.buffer_infos(pd.host_ptr_table([t]), 64)[0]
    t.untyped_storage().resize_(0)
    engine = Recorder()
    with pytest.raises(errors.ClosedError, match="region"):
        HostTransferEngine(engine, "127.0.0.1").register_memory(info)
    agent = Recorder(nixl=True)
    with pytest.raises(errors.ClosedError, match=r"descs\[0\]"):
        HostNixlAgent("a", agent=agent).register([dram_desc(info)])
    assert engine.calls == [] and agent.calls == []


def test_engines_refuse_closed_pool_metadata() -> None:
    pool = pd.HostKVPool(model_layout("page_first"), DEV)
    info = pool.get_contiguous_buf_infos()[0]
    pool.close()
    with pytest.raises(errors.ClosedError):
        pool.get_contiguous_buf_infos()
    engine, agent = Recorder(nixl=True), Recorder()
    with pytest.raises(errors.ClosedError):
        HostTransferEngine(engine, "127.0.0.1").register_memory(info)
    with pytest.raises(errors.ClosedError):
        HostNixlAgent("a", agent=agent).register_pool(pool)
    with pytest.raises(errors.ClosedError):
        HostNixlAgent("a", agent=agent).register([dram_desc(info)])
    assert engine.calls == [] and agent.calls == []


def test_fresh_metadata_over_reused_addresses_is_taken() -> None:
    """Metadata handed out afresh for live memory passes, whatever stood there before."""
    t = torch.zeros(4096, dtype=torch.uint8)
    table = pd.host_ptr_table([t])
    pd.buffer_infos(table, 64)
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(4096)  # may land at the old address
    info = pd.buffer_infos(pd.host_ptr_table([t]), 64)[0]
    engine = Recorder()
    HostTransferEngine(engine, "127.0.0.1").register_memory(info)
    assert engine.calls == [("register_memory", (t.data_ptr(), 4096))]


def test_mooncake_transfer_from_released_local_block_is_refused() -> None:
    t = torch.zeros(4096, dtype=torch.uint8)
    info = pd.buffer_infos(pd.host_ptr_table([t]), 64)[0]
    engine = Recorder()
    wrapper = HostTransferEngine(engine, "127.0.0.1")
    wrapper.register_memory(info)
    t.set_(torch.zeros(4096, dtype=torch.uint8))  # the old storage goes with its last user
    with pytest.raises(errors.ClosedError, match="local"):
        wrapper.transfer_sync_write("peer:1", info, pd.HostVA.unsafe_from_int(1 << 20))
    with pytest.raises(errors.ClosedError, match=r"local\[0\]"):
        wrapper.batch_transfer_sync_read("peer:1", [info], [info])
    assert [c[0] for c in engine.calls] == ["register_memory"]


@pytest.mark.parametrize("swap", ["device set_", "host set_", "host share_memory_"])
def test_launch_after_storage_swap_writes_nothing(swap: str) -> None:
    device = pd.DeviceKVPool(model_layout("layer_first"), DEV)
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        fill_random(host.buffer, 1)
        idx = torch.arange(4, dtype=torch.int64)
        host.load(device, idx, idx)  # the launch's plan is cached, then a storage moves
        if swap == "device set_":
            device.buffers[0].set_(torch.zeros_like(device.buffers[0]))
        elif swap == "host set_":
            host.buffer.set_(torch.zeros_like(host.buffer))
        else:
            host.buffer.share_memory_()
        before = [b.view(torch.uint8).clone() for b in device.buffers]
        with pytest.raises(errors.ClosedError):
            host.load(device, idx, idx)
        assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, device.buffers))
        with pytest.raises(errors.ClosedError):
            host.backup(device, idx, idx)


def test_memory_registered_after_stale_metadata_is_taken() -> None:
    """Addresses whose old metadata went stale, registered again since: live memory."""
    buf = torch.zeros(8192, dtype=torch.uint8)
    same = buf[:]  # keeps the old storage, as a new owner of those addresses would
    old = pd.buffer_infos(pd.host_ptr_table([buf]), 64)[0]
    buf.set_(torch.zeros(8192, dtype=torch.uint8))
    engine = Recorder()
    with pytest.raises(errors.ClosedError):
        HostTransferEngine(engine, "127.0.0.1").register_memory(old)
    with pd.register_host_tensor(same, DEV) as mem:
        HostTransferEngine(engine, "127.0.0.1").register_memory(pd.BufferInfo(address=mem.host_va, nbytes=8192,
                                                                              item_bytes=64))
    assert engine.calls == [("register_memory", (old.address.value, 8192))]


def test_stale_metadata_under_two_newer_registrations_is_superseded_where_they_cover_it() -> None:
    """Old metadata over addresses now held by two registrations made since (one range of
    an engine across both): live memory there; a part they do not cover stays refused."""
    backing = torch.zeros(5 * 4096, dtype=torch.uint8)
    start = (-backing.data_ptr()) % 4096  # page-aligned: each half registers on its own pages
    buf = backing[start:start + 3 * 4096]
    same = buf[:]  # keeps the old storage, as a new owner of those addresses would
    old = pd.buffer_infos(pd.host_ptr_table([buf]), 64)[0]
    buf.set_(torch.zeros(8192, dtype=torch.uint8))
    engine = Recorder()
    first, second = pd.register_host_tensor(same[:4096], DEV), pd.register_host_tensor(same[4096:8192], DEV)
    try:
        wrapper = HostTransferEngine(engine, "127.0.0.1")
        wrapper.register_memory(old.address, 8192)  # across both registrations
        with pytest.raises(errors.ClosedError, match="released"):
            wrapper.register_memory(old.address + 8192, 4096)  # under no registration since: still stale
    finally:
        first.close()
        second.close()
    assert engine.calls == [("register_memory", (old.address.value, 8192))]


def test_closed_registration_whose_tensor_let_go_is_not_reported_closed() -> None:
    """A closed owner kept alive, its storage released (``resize_(0)``): its old
    addresses may be anyone's now, so metadata over them is not refused as closed memory."""
    buf = torch.zeros(8192, dtype=torch.uint8)
    mem = pd.register_host_tensor(buf, DEV)
    va = mem.host_va
    mem.close()
    from pointerdomain.registration.memory import find_closed_registration
    from pointerdomain.registration.metadata import check_metadata_live

    assert find_closed_registration(va, 8192) is mem
    with pytest.raises(errors.ClosedError):
        check_metadata_live(va, 8192)
    buf.untyped_storage().resize_(0)
    assert find_closed_registration(va, 8192) is None
    try:  # metadata taken over these addresses earlier in the process may still say "released"
        check_metadata_live(va, 8192)
    except errors.ClosedError as exc:
        assert "was closed" not in str(exc)


def test_registration_over_a_closed_ones_addresses_is_live() -> None:
    """Memory registered again after close, from another start inside the old range (the
    old owner still alive): live, its metadata handed to an engine."""
    from pointerdomain.registration.memory import find_closed_registration
    from pointerdomain.registration.metadata import check_metadata_live

    base = torch.zeros(16384, dtype=torch.uint8)
    old = pd.register_host_tensor(base[:8192], DEV)
    old.close()
    with pd.register_host_tensor(base[128:8320], DEV) as mem:
        assert find_closed_registration(mem.host_va, 8192) is None
        check_metadata_live(mem.host_va, 8192)
        engine = Recorder()
        HostTransferEngine(engine, "127.0.0.1").register_memory(pd.BufferInfo(address=mem.host_va, nbytes=8192,
                                                                              item_bytes=64))
        assert engine.calls == [("register_memory", (mem.host_va.value, 8192))]
    assert old.closed


def test_tables_over_released_storage_are_refused() -> None:
    """A tensor whose storage was released reports ``data_ptr()`` 0 (or freed memory):
    no table, so no metadata naming that address reaches an engine."""
    t = torch.zeros(1 << 16, dtype=torch.uint8)
    t.untyped_storage().resize_(0)
    live = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(errors.ClosedError, match=r"tensors\[1\].*storage released"):
        pd.host_ptr_table([live, t])
    with pytest.raises(errors.ClosedError, match=r"tensors\[0\].*storage released"):
        pd.make_kernel_ptr_table([t], DEV)
    shrunk = torch.zeros(1024, dtype=torch.uint8)
    view = shrunk[512:]
    shrunk.untyped_storage().resize_(600)  # the view needs 1024 bytes of it
    with pytest.raises(errors.ClosedError, match=r"tensors\[0\]"):
        pd.host_ptr_table([view])


def test_null_host_address_is_refused() -> None:
    null = pd.HostVA.unsafe_from_int(0)
    with pytest.raises(errors.MetadataValidationError, match="null address"):
        pd.BufferInfo(address=null, nbytes=65536, item_bytes=64)
    with pytest.raises(errors.MetadataValidationError, match="null address"):
        pd.BufferInfo.model_validate_json('{"address": 0, "nbytes": 64, "item_bytes": 64}')
    good = pd.BufferInfo(address=pd.HostVA.unsafe_from_int(4096), nbytes=64, item_bytes=64)
    with pytest.raises(errors.MetadataValidationError, match="null address"):
        good.replace(address=null)
    with pytest.raises(errors.InvalidArgumentError, match="null address"):
        dram_desc(null, 64)
    engine = Recorder()
    wrapper = HostTransferEngine(engine, "127.0.0.1")
    with pytest.raises(errors.InvalidArgumentError, match="null address"):
        wrapper.register_memory(null, 64)
    with pytest.raises(errors.InvalidArgumentError, match="null address"):
        wrapper.transfer_sync_read("peer:1", null, pd.HostVA.unsafe_from_int(1 << 20), 64)
    assert engine.calls == []


@pytest.mark.parametrize("swap", ["share_memory_", "set_"])
def test_pool_host_va_after_storage_swap_is_refused(swap: str) -> None:
    with pd.HostKVPool(model_layout("page_first"), DEV) as pool:
        assert pool.host_va(1, 2, 1).value == pool.buffer.data_ptr() + pool.layout.byte_offset(1, 2, 1)
        if swap == "share_memory_":
            pool.buffer.share_memory_()
        else:
            pool.buffer.set_(torch.zeros_like(pool.buffer))
        with pytest.raises(errors.ClosedError):
            pool.host_va(1, 2, 1)


@pytest.mark.parametrize("pages", [None, 3, "01", object()])
def test_page_meta_of_non_list_pages_is_a_type_error(pages: Any) -> None:
    with pd.HostKVPool(model_layout("page_first"), DEV) as pool:
        with pytest.raises(errors.InvalidTypeError, match="pages"):
            pool.get_page_buffer_meta(pages)
        with pytest.raises(errors.InvalidTypeError, match="pages"):
            pd.page_buffer_meta(pool.host_table, pool.layout, pages)
        with pytest.raises(errors.IndexValidationError, match="indices"):
            HostKVCacheAdapter.from_pool(pool).get_page_buffer_meta(pages)
        assert pool.get_page_buffer_meta((0, 1)) == pool.get_page_buffer_meta([0, 1])


_RELEASED_INDICES = r"""
import sys, torch, pointerdomain as pd
from pointerdomain import errors
from tests.reference import DEV, fill_random, model_layout
device = pd.DeviceKVPool(model_layout("layer_first"), DEV)
with pd.HostKVPool(model_layout("page_first"), DEV) as host:
    fill_random(host.buffer, 1)
    before = host.buffer.view(torch.uint8).clone()
    device_before = [b.view(torch.uint8).clone() for b in device.buffers]
    idx = torch.arange(4)
    idx.untyped_storage().resize_(0)
    for call in (lambda: host.backup(device, idx, torch.arange(4)), lambda: host.backup(device, torch.arange(4), idx),
                 lambda: host.load(device, idx, torch.arange(4)), lambda: pd.index_tensor("ids", idx)):
        try:
            call()
            print("no error")
        except errors.IndexValidationError as exc:
            print("IndexValidationError", "storage released" in str(exc))
    print("unchanged", torch.equal(before, host.buffer.view(torch.uint8))
          and all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(device_before, device.buffers)))
"""


def test_released_index_tensors_are_refused() -> None:
    """Index tensors whose storage was released: IndexValidationError before any read
    of them (a child process: reading them may crash)."""
    import os
    import subprocess
    import sys

    from tests.childenv import pythonpath

    child = subprocess.run([sys.executable, "-c", _RELEASED_INDICES], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=pythonpath()))
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
    assert child.stdout.splitlines() == ["IndexValidationError True"] * 4 + ["unchanged True"]


# A registered tensor whose storage is released or moved under its registration: glibc
# unmaps those pages (1 MiB is above its mmap threshold) and the next allocations of that
# size may take the range. close(), a fork and a new registration must then leave the new
# memory alone: no crash, no byte of it changed.
_RELEASED_UNDER_REGISTRATION = r"""
import os, sys, torch, pointerdomain as pd
how = sys.argv[1]
x = torch.zeros(1 << 20, dtype=torch.uint8)
reg = pd.register_host_tensor(x, "emulated:0")
if how == "grow":
    x.resize_(4 << 20)
elif how == "release":
    x.untyped_storage().resize_(0)
else:
    x.set_(torch.zeros(16, dtype=torch.uint8))
try:
    pd.make_kernel_ptr_table([x], "emulated:0")
    raise SystemExit("a table over released storage was built")
except pd.errors.PointerDomainError:
    pass
# new memory, likely in the released range; a pattern that any overwrite would change
news = [torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8) for _ in range(4)]
want = [n.clone() for n in news]
pid = os.fork()
if pid == 0:
    ok = all(torch.equal(n, w) for n, w in zip(news, want))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, ("fork child saw changed bytes", status)
reg.close()
assert all(torch.equal(n, w) for n, w in zip(news, want)), "close() changed new memory"
# the new memory registers and moves bytes through its own alias
again = pd.register_host_tensor(news[0], "emulated:0")
table = pd.make_kernel_ptr_table([news[0]], "emulated:0")
again.close()
print("ok", how)
"""


@pytest.mark.parametrize("strict", [False, True], ids=["normal", "strict"])
@pytest.mark.parametrize("how", ["grow", "release", "set_"])
def test_close_after_storage_released_under_registration(how: str, strict: bool) -> None:
    env = {"PYTHONPATH": childenv.pythonpath(), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "POINTERDOMAIN_STRICT_ALIAS": "1" if strict else "0"}
    proc = subprocess.run([sys.executable, "-c", _RELEASED_UNDER_REGISTRATION, how], env=env,
                          capture_output=True, text=True, timeout=120, cwd=childenv.ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert f"ok {how}" in proc.stdout


@pytest.mark.strict_alias
@pytest.mark.parametrize("how", ["release", "grow"])
def test_a_registration_whose_tensor_released_its_storage_resolves_nothing(how: str) -> None:
    """New memory mapped at a registered address after the registered tensor released or
    moved its storage is not that registration's: its alias reaches the old pages, so a table
    or an engine call shape over the new memory would copy where no one reads. Refused
    (ClosedError), nothing written; close() leaves the new memory alone."""
    import ctypes

    from pointerdomain.compat import vllm as ops

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    x = torch.zeros(1 << 20, dtype=torch.uint8)  # above glibc's mmap threshold: freed by munmap
    page = x.data_ptr() & ~4095
    reg = pd.register_host_tensor(x, DEV)
    if how == "release":
        x.untyped_storage().resize_(0)
    else:
        x.resize_(4 << 20)
    assert reg.backing_released()
    MAP_PRIVATE_ANON, MAP_FIXED_NOREPLACE = 0x22, 0x100000
    got = libc.mmap(page, 1 << 20, 3, MAP_PRIVATE_ANON | MAP_FIXED_NOREPLACE, -1, 0)
    if got != page:
        reg.close()
        pytest.skip("the released range was taken by another mapping")
    try:
        ctypes.memset(page, 0x33, 1 << 20)
        new = torch.frombuffer((ctypes.c_uint8 * (1 << 20)).from_address(page), dtype=torch.uint8)
        inside = new[reg.host_va.value - page + 4096:][:4096]  # inside the registered range
        with pytest.raises(errors.ClosedError, match="released or moved"):
            pd.make_kernel_ptr_table([inside], DEV)
        gpu = pd.device_empty((4, 1024), torch.uint8, DEV).fill_(0x55)
        with pytest.raises(errors.ClosedError, match="released or moved"):
            ops.swap_blocks(gpu, inside.view(4, 1024), 1024, torch.tensor([[0, 1]]))
        reg.close()
        assert bool((new == 0x33).all())
    finally:
        del new, inside
        libc.munmap(page, 1 << 20)


def test_a_registration_whose_tensor_swapped_its_storage_keeps_resolving() -> None:
    """set_ gives the caller's tensor other storage; the registration keeps the old one
    (its own view holds it), so the registered range is still that memory."""
    x = torch.zeros(1 << 16, dtype=torch.uint8)
    reg = pd.register_host_tensor(x, DEV)
    x.set_(torch.zeros(16, dtype=torch.uint8))
    assert not reg.backing_released()
    table = pd.make_kernel_ptr_table([reg.tensor[:4096]], DEV)
    assert len(table) == 1
    del table
    reg.close()
