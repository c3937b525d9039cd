"""An engine registration outlives the memory it was made for: a transfer through it into
newer memory at the same addresses is refused.

Mooncake's ``register_memory`` and NIXL's ``register`` pin the pages they are given (an
RDMA memory region). When that memory is closed and freed while the engine still holds
the range, and new memory is registered at the same addresses (the allocator hands a
freed range out again), the engine would move bytes to the old pages. The adapters keep
which registration of this process held the range and refuse a transfer once another
one, over other memory, holds it (ClosedError); the same memory registered again passes.

The address reuse is made deterministic with ``mmap(MAP_FIXED)`` at the freed range.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters.mooncake import HostTransferEngine
from pointerdomain.adapters.nixl import HostNixlAgent, dram_desc
from tests.adapters.test_mooncake import FakeEngine
from tests.adapters.test_nixl import FakeAgent

DEV = "emulated:0"
N = 16 * mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FIXED = 0x10


def _map(at: int = 0) -> torch.Tensor:
    """``N`` bytes of fresh anonymous memory (at ``at`` exactly when given) as a uint8 tensor."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (_MAP_FIXED if at else 0)
    addr = _libc.mmap(at or None, N, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value) and (not at or addr == at)
    return torch.frombuffer((ctypes.c_uint8 * N).from_address(addr), dtype=torch.uint8)


@pytest.fixture
def replaced() -> Iterator[Any]:
    """``(start, swap)``: memory registered at ``start``; ``swap()`` closes it, drops every
    reference to it, frees it and registers new memory at the same addresses, returning
    the new registration."""
    old = [_map()]
    start = old[0].data_ptr()
    first = [pd.register_host_tensor(old[0], DEV)]
    later: list[pd.RegisteredHostMemory] = []

    def swap() -> pd.RegisteredHostMemory:
        first.pop().close()
        old.clear()  # nothing holds the old memory's tensor now: it can go
        gc.collect()
        assert _libc.munmap(start, N) == 0
        new = _map(start)
        later.append(pd.register_host_tensor(new, DEV))
        return later[-1]

    yield start, swap
    for mem in later:
        mem.close()
    _libc.munmap(start, N)


def test_mooncake_refuses_a_range_whose_memory_was_replaced(replaced: Any) -> None:
    start, swap = replaced
    fake = FakeEngine()
    eng = HostTransferEngine(fake, "127.0.0.1")
    eng.register_memory(pd.HostVA(start), N)
    block = pd.BufferInfo(address=pd.HostVA(start + mmap.PAGESIZE), nbytes=256, item_bytes=256)
    eng.transfer_sync_read("peer:1", block, pd.HostVA(0x10000))  # the memory the engine registered
    new = swap()
    assert new.host_va.value == start
    calls = len(fake.calls)
    with pytest.raises(errors.ClosedError, match="registration pins the pages it was given"):
        eng.transfer_sync_read("peer:1", block, pd.HostVA(0x10000))
    with pytest.raises(errors.ClosedError, match=r"local\[0\]"):
        eng.batch_transfer_sync_write("peer:1", [block], [pd.BufferInfo(address=pd.HostVA(0x10000), nbytes=256,
                                                                         item_bytes=256)])
    assert len(fake.calls) == calls  # nothing reached the engine
    # the way out: let the engine go of the old range, register the new memory
    eng.unregister_memory(pd.HostVA(start))
    eng.register_memory(pd.HostVA(start), N)
    eng.transfer_sync_read("peer:1", block, pd.HostVA(0x10000))
    assert fake.calls[-1][0] == "transfer_sync_read"
    eng.close()


def test_mooncake_passes_the_same_memory_registered_again() -> None:
    t = _map()
    try:
        mem = pd.register_host_tensor(t, DEV)
        eng = HostTransferEngine(FakeEngine(), "127.0.0.1")
        eng.register_memory(mem.host_va, N)
        mem.close()
        again = pd.register_host_tensor(t, DEV)  # the same pages: what the engine registered
        eng.transfer_sync_read("peer:1", pd.BufferInfo(address=again.host_va, nbytes=N, item_bytes=N),
                               pd.HostVA(0x10000))
        eng.close()
        again.close()
    finally:
        start = t.data_ptr()
        del t
        gc.collect()
        _libc.munmap(start, N)


def test_nixl_refuses_a_range_whose_memory_was_replaced(replaced: Any) -> None:
    start, swap = replaced
    fake = FakeAgent()
    agent = HostNixlAgent("fake", agent=fake)
    agent.register([dram_desc(pd.HostVA(start), N)])
    local = dram_desc(pd.HostVA(start + mmap.PAGESIZE), 256)
    remote = dram_desc(pd.HostVA(0x10000), 256)
    agent.transfer("READ", [local], [remote], "peer")
    swap()
    calls = len(fake.calls)
    with pytest.raises(errors.ClosedError, match="registration pins the pages it was given"):
        agent.transfer("READ", [local], [remote], "peer")
    assert len(fake.calls) == calls


def test_a_range_partly_replaced_or_held_by_two_registrations_is_refused_where_memory_went() -> None:
    """The engine registered one range held by two registrations; both close and their
    memory goes; new, smaller memory is registered at the start. Every byte of the old
    range is refused: inside the new memory, across its end, and past it."""
    whole = _map()
    start = whole.data_ptr()
    halves = [pd.register_host_tensor(whole[: N // 2], DEV), pd.register_host_tensor(whole[N // 2:], DEV)]
    fake = FakeEngine()
    eng = HostTransferEngine(fake, "127.0.0.1")
    eng.register_memory(pd.HostVA(start), N)
    agent = HostNixlAgent("fake", agent=FakeAgent())
    agent.register([dram_desc(pd.HostVA(start), N)])
    remote = pd.HostVA(0x10000)
    for at in (0, N // 2 - 128, N - 256):  # each half, and across the two
        eng.transfer_sync_read("peer:1", pd.HostVA(start + at), remote, 256)
        agent.transfer("READ", [dram_desc(pd.HostVA(start + at), 256)], [dram_desc(remote, 256)], "peer")
    while halves:  # no name left bound to a registration (it holds the storage)
        halves.pop().close()
    del whole
    gc.collect()
    assert _libc.munmap(start, N) == 0
    new = _map(start)[: N // 2]  # a smaller buffer at the same start
    later = pd.register_host_tensor(new, DEV)
    calls = len(fake.calls)
    try:
        for at in (0, N // 2 - 128, N // 2 + 64):  # inside the new memory, across its end, past it
            with pytest.raises(errors.ClosedError, match="registration pins the pages it was given"):
                eng.transfer_sync_read("peer:1", pd.HostVA(start + at), remote, 128)
            with pytest.raises(errors.ClosedError):
                agent.transfer("READ", [dram_desc(pd.HostVA(start + at), 128)], [dram_desc(remote, 128)], "peer")
        assert len(fake.calls) == calls
    finally:
        later.close()
        _libc.munmap(start, N)
