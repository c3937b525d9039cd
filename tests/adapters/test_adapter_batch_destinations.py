"""Batches of the Mooncake, NIXL and vLLM adapters whose destinations meet: the blocks of a
batch move in no defined order (Mooncake runs them in parallel, cudaMemcpyBatchAsync
concurrently), so two blocks landing on one byte would leave either. Refused with
OverlapError before the engine / copy function is called, the poisoned destination
byte-for-byte untouched; the same batches with distinct destinations move the right bytes.
The engine and the batch copy are CPU stand-ins copying through the raw addresses with
ctypes.memmove (like a NIC or a DMA engine, they translate nothing)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import vllm
from pointerdomain.adapters.mooncake import HostTransferEngine
from pointerdomain.adapters.nixl import HostNixlAgent, dram_desc
from tests.reference import fill_random, same

DEV = "emulated:0"
POISON = 0xA5


class MemmoveEngine:
    """A transfer engine in one process: the "peer" memory is this process's, so a read
    copies remote -> local and a write local -> remote. Records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def register_memory(self, addr: int, n: int, /) -> int:
        self.calls.append("register_memory")
        return 0

    def unregister_memory(self, addr: int, /) -> int:
        self.calls.append("unregister_memory")
        return 0

    def transfer_sync_read(self, peer: str, local: int, remote: int, n: int, /) -> int:
        self.calls.append("transfer_sync_read")
        ctypes.memmove(local, remote, n)
        return 0

    def transfer_sync_write(self, peer: str, local: int, remote: int, n: int, /) -> int:
        self.calls.append("transfer_sync_write")
        ctypes.memmove(remote, local, n)
        return 0

    def batch_transfer_sync_read(self, peer: str, local: list[int], remote: list[int], n: list[int], /) -> int:
        self.calls.append("batch_transfer_sync_read")
        for a, b, k in zip(local, remote, n):
            ctypes.memmove(a, b, k)
        return 0

    def batch_transfer_sync_write(self, peer: str, local: list[int], remote: list[int], n: list[int], /) -> int:
        self.calls.append("batch_transfer_sync_write")
        for a, b, k in zip(local, remote, n):
            ctypes.memmove(b, a, k)
        return 0


LAYOUT = pd.KVLayout(kind="page_first", num_layers=2, num_pages=8, page_size=4, num_heads=2, head_dim=8,
                     dtype="float32")


@pytest.fixture
def two_pools() -> Iterator[tuple[pd.HostKVPool, pd.HostKVPool]]:
    with pd.HostKVPool(LAYOUT, DEV) as a, pd.HostKVPool(LAYOUT, DEV) as b:
        fill_random(a.buffer, 1)
        b.buffer.view(torch.uint8).fill_(POISON)
        yield a, b


def halves(block: pd.BufferInfo) -> pd.BufferInfo:
    """The block half a block further on: it shares its first half with ``block``'s second."""
    return pd.BufferInfo(address=block.address + block.nbytes // 2, nbytes=block.nbytes, item_bytes=block.item_bytes)


@pytest.mark.parametrize("batched", [True, False])
def test_mooncake_batch_read_into_one_local_block_twice_is_refused(
    two_pools: tuple[pd.HostKVPool, pd.HostKVPool], batched: bool
) -> None:
    src, dst = two_pools
    engine: Any = MemmoveEngine() if batched else _OneByOne()
    eng = HostTransferEngine(engine, "127.0.0.1")
    eng.batch_register_memory(dst.get_contiguous_buf_infos())
    before = dst.buffer.clone()
    page = dst.get_page_buffer_meta([1])  # its K block and its V block
    remote = src.get_page_buffer_meta([2, 3])
    engine.calls.clear()
    for local in (page + page, page + [halves(b) for b in page]):
        with pytest.raises(errors.OverlapError, match=r"local\[0\] and local\[2\]"):
            eng.batch_transfer_sync_read("peer:1", local, remote)
    assert engine.calls == []
    assert same(dst.buffer, before)  # nothing written

    # distinct destinations: every block lands where it was sent
    assert eng.batch_transfer_sync_read("peer:1", dst.get_page_buffer_meta([5, 1]), remote) == 4 * page[0].nbytes
    for d, s in ((5, 2), (1, 3)):
        assert same(dst.buffer[:, d * 4:(d + 1) * 4], src.buffer[:, s * 4:(s + 1) * 4])
    untouched = [p for p in range(8) if p not in (1, 5)]
    assert bool((dst.buffer[:, [q for p in untouched for q in range(p * 4, p * 4 + 4)]].view(torch.uint8) == POISON).all())
    eng.close()


def test_mooncake_batch_write_to_one_remote_block_twice_is_refused(
    two_pools: tuple[pd.HostKVPool, pd.HostKVPool],
) -> None:
    src, dst = two_pools  # src is local here; dst stands for the peer's memory
    engine = MemmoveEngine()
    eng = HostTransferEngine(engine, "127.0.0.1")
    eng.batch_register_memory(src.get_contiguous_buf_infos())
    engine.calls.clear()
    before = dst.buffer.clone()
    remote = dst.get_page_buffer_meta([4])
    with pytest.raises(errors.OverlapError, match=r"remote\[0\] and remote\[2\]"):
        eng.batch_transfer_sync_write("peer:1", src.get_page_buffer_meta([0, 6]), remote + remote)
    assert engine.calls == [] and same(dst.buffer, before)
    # reading one remote block into two local blocks is fine: sources may repeat
    local_two = pd.HostKVPool(LAYOUT, DEV)
    with local_two:
        eng.batch_register_memory(local_two.get_contiguous_buf_infos())
        eng.batch_transfer_sync_read("peer:1", local_two.get_page_buffer_meta([0, 1]), remote + remote)
        assert same(local_two.buffer[:, 0:4], dst.buffer[:, 16:20]) and same(local_two.buffer[:, 4:8], dst.buffer[:, 16:20])
    eng.close()


class _OneByOne:
    """An engine without batch calls: the wrapper moves a batch block by block."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._inner = MemmoveEngine()

    def register_memory(self, addr: int, n: int, /) -> int:
        return self._inner.register_memory(addr, n)

    def unregister_memory(self, addr: int, /) -> int:
        return self._inner.unregister_memory(addr)

    def transfer_sync_read(self, peer: str, local: int, remote: int, n: int, /) -> int:
        self.calls.append("transfer_sync_read")
        return self._inner.transfer_sync_read(peer, local, remote, n)

    def transfer_sync_write(self, peer: str, local: int, remote: int, n: int, /) -> int:
        self.calls.append("transfer_sync_write")
        return self._inner.transfer_sync_write(peer, local, remote, n)


# --------------------------------------------------------------------------- vLLM


def cpu_batch_copy() -> tuple[vllm.BatchCopyFn, list[int]]:
    ran: list[int] = []

    def copy(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
        ran.append(int(sizes.numel()))
        for a, b, k in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(b, a, k)

    return copy, ran


@pytest.fixture
def offload() -> Iterator[tuple[vllm.CpuGpuBlockOffload, list[torch.Tensor], list[torch.Tensor]]]:
    layers, gpu_blocks, cpu_blocks, block = 2, 10, 6, 256
    gpu = [pd.device_empty((gpu_blocks, block), torch.uint8, DEV) for _ in range(layers)]
    for i, g in enumerate(gpu):
        fill_random(g, 10 + i)
    with pd.alloc_registered(layers * cpu_blocks * block, DEV) as mem:
        cpu = [mem.tensor[i * cpu_blocks * block:(i + 1) * cpu_blocks * block].view(cpu_blocks, block)
               for i in range(layers)]
        mem.tensor.fill_(POISON)
        yield vllm.CpuGpuBlockOffload(gpu, cpu, DEV), gpu, cpu


def test_vllm_store_and_load_into_one_block_twice_are_refused(
    offload: tuple[vllm.CpuGpuBlockOffload, list[torch.Tensor], list[torch.Tensor]],
) -> None:
    off, gpu, cpu = offload
    copy, ran = cpu_batch_copy()
    gpu_before = [g.clone() for g in gpu]
    with pytest.raises(errors.OverlapError, match=r"cpu_block_ids\[0\] of entry (\d) and cpu_block_ids\[2\] of entry \1 "):
        vllm.run_batch_copy(off.store(gpu_block_ids=[1, 2, 3], cpu_block_ids=[0, 4, 0]), copy)
    with pytest.raises(errors.OverlapError, match=r"gpu_block_ids\[0\] of entry (\d) and gpu_block_ids\[1\] of entry \1 "):
        vllm.run_batch_copy(off.load([0, 1], [3, 3]), copy)
    with pytest.raises(errors.OverlapError):
        vllm.block_copy_batch(off.gpu_table, off.cpu_table, [1, 2], [5, 5], block_bytes=off.block_bytes)
    assert ran == []
    assert all(bool((c.view(torch.uint8) == POISON).all()) for c in cpu)
    assert all(same(g, b) for g, b in zip(gpu, gpu_before))

    # distinct destinations: copied, and nothing else written
    vllm.run_batch_copy(off.store([7, 2], [0, 4]), copy)
    assert ran == [4]
    for g, c in zip(gpu, cpu):
        assert same(c[torch.tensor([0, 4])], g[torch.tensor([7, 2])])
        assert bool((c[torch.tensor([1, 2, 3, 5])] == POISON).all())


def test_vllm_batch_within_one_table_refuses_a_block_read_and_written(
    offload: tuple[vllm.CpuGpuBlockOffload, list[torch.Tensor], list[torch.Tensor]],
) -> None:
    off, gpu, _ = offload
    copy, ran = cpu_batch_copy()
    before = [g.clone() for g in gpu]
    t = off.gpu_table
    # block 3 is written by pair 0 and read by pair 1: the copies' order would decide its bytes
    with pytest.raises(errors.OverlapError, match=r"dst_block_ids\[0\] of entry 0 shares bytes with src_block_ids\[1\]"):
        vllm.block_copy_batch(t, t, [1, 3], [3, 5], block_bytes=off.block_bytes)
    with pytest.raises(errors.OverlapError):
        vllm.block_copy_batch(t, t, [4], [4], block_bytes=off.block_bytes)
    assert ran == [] and all(same(g, b) for g, b in zip(gpu, before))
    # disjoint blocks in one table are a valid batch
    vllm.run_batch_copy(vllm.block_copy_batch(t, t, [1, 2], [8, 9], block_bytes=off.block_bytes), copy)
    for g, b in zip(gpu, before):
        assert same(g[8], b[1]) and same(g[9], b[2]) and same(g[:8], b[:8])


def test_vllm_destination_table_naming_one_tensor_twice_is_refused(
    offload: tuple[vllm.CpuGpuBlockOffload, list[torch.Tensor], list[torch.Tensor]],
) -> None:
    # distinct block ids, but entries 0 and 1 of the destination are one tensor: block 2 of
    # each is the same memory
    off, gpu, cpu = offload
    twice = pd.make_kernel_ptr_table([cpu[0], cpu[0]], DEV)
    copy, ran = cpu_batch_copy()
    with pytest.raises(errors.OverlapError, match=r"dst_block_ids\[1\] of entry \d and dst_block_ids\[1\] of entry \d"):
        vllm.block_copy_batch(off.gpu_table, twice, [4, 5], [3, 2], block_bytes=off.block_bytes)
    assert ran == [] and all(bool((c.view(torch.uint8) == POISON).all()) for c in cpu)


# --------------------------------------------------------------------------- NIXL


class MemmoveNixlAgent:
    """A NIXL agent in one process (the peer's memory is this process's): a READ copies
    each remote descriptor to its local one, a WRITE the other way. Records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str, backends: list[str], /) -> Any:
        self.calls.append("register_memory")
        return len(self.calls)

    def deregister_memory(self, handle: Any, /) -> None:
        self.calls.append("deregister_memory")

    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str, /) -> Any:
        self.calls.append("get_xfer_descs")
        return list(descs)

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str, notif: bytes, backends: list[str], /) -> Any:
        self.calls.append("initialize_xfer")
        return op, local, remote

    def transfer(self, handle: Any, /) -> str:
        self.calls.append("transfer")
        op, local, remote = handle
        for (a, n, _), (b, _, _) in zip(local, remote):
            if op == "READ":
                ctypes.memmove(a, b, n)
            else:
                ctypes.memmove(b, a, n)
        return "DONE"

    def check_xfer_state(self, handle: Any, /) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: Any, /) -> None:
        self.calls.append("release_xfer_handle")

    def remove_remote_agent(self, agent: str, /) -> None:
        pass


def test_nixl_read_into_one_local_block_twice_is_refused(two_pools: tuple[pd.HostKVPool, pd.HostKVPool]) -> None:
    src, dst = two_pools
    fake = MemmoveNixlAgent()
    agent = HostNixlAgent("me", agent=fake)
    agent.register_pool(dst)
    before = dst.buffer.clone()
    page = dst.get_page_buffer_meta([1])  # its K block and its V block
    remote = src.get_page_buffer_meta([2, 3])
    fake.calls.clear()
    for local in (page + page, page + [halves(b) for b in page]):
        with pytest.raises(errors.OverlapError, match=r"local\[0\] and local\[2\]"):
            agent.read("peer", local, remote)
    assert fake.calls == []
    assert same(dst.buffer, before)  # nothing written

    # distinct destinations: every block lands where it was sent
    agent.read("peer", dst.get_page_buffer_meta([5, 1]), remote)
    for d, s in ((5, 2), (1, 3)):
        assert same(dst.buffer[:, d * 4:(d + 1) * 4], src.buffer[:, s * 4:(s + 1) * 4])
    untouched = [p for p in range(8) if p not in (1, 5)]
    assert bool((dst.buffer[:, [q for p in untouched for q in range(p * 4, p * 4 + 4)]].view(torch.uint8) == POISON).all())
    agent.close()


def test_nixl_write_to_one_remote_block_twice_is_refused(two_pools: tuple[pd.HostKVPool, pd.HostKVPool]) -> None:
    src, dst = two_pools  # src is local here; dst stands for the peer's memory
    fake = MemmoveNixlAgent()
    agent = HostNixlAgent("me", agent=fake)
    agent.register_pool(src)
    fake.calls.clear()
    before = dst.buffer.clone()
    remote = dst.get_page_buffer_meta([4])
    for rem in (remote + remote, remote + [halves(b) for b in remote]):
        with pytest.raises(errors.OverlapError, match=r"remote\[0\] and remote\[2\]"):
            agent.write("peer", src.get_page_buffer_meta([0, 6]), rem)
    assert fake.calls == [] and same(dst.buffer, before)
    # a local block written to two remote blocks is fine: sources may repeat
    agent.write("peer", src.get_page_buffer_meta([0, 0]), dst.get_page_buffer_meta([4, 7]))
    for d in (4, 7):
        assert same(dst.buffer[:, d * 4:(d + 1) * 4], src.buffer[:, 0:4])
    # reading one remote block into two local blocks is fine too
    with pd.HostKVPool(LAYOUT, DEV) as local_two:
        local_two.buffer.view(torch.uint8).fill_(POISON)
        agent.register_pool(local_two)
        agent.read("peer", local_two.get_page_buffer_meta([0, 1]), remote + remote)
        assert same(local_two.buffer[:, 0:4], dst.buffer[:, 16:20]) and same(local_two.buffer[:, 4:8], dst.buffer[:, 16:20])
        assert bool((local_two.buffer[:, 8:].view(torch.uint8) == POISON).all())
    agent.close()


def test_nixl_overlapping_registrations_are_refused(two_pools: tuple[pd.HostKVPool, pd.HostKVPool]) -> None:
    a, b = two_pools
    fake = MemmoveNixlAgent()
    agent = HostNixlAgent("me", agent=fake)
    reg = agent.register_pool(a)
    fake.calls.clear()
    with pytest.raises(errors.AlreadyRegisteredError, match="already registered"):
        agent.register_pool(a)
    inner = a.get_page_buffer_meta([3])[0]
    with pytest.raises(errors.AlreadyRegisteredError, match="already registered"):
        agent.register([dram_desc(inner)])  # a range inside a registered one
    block = b.get_page_buffer_meta([2])[0]
    with pytest.raises(errors.AlreadyRegisteredError, match=r"descs\[0\] and descs\[1\] overlap"):
        agent.register([dram_desc(block), dram_desc(halves(block))])  # overlapping within one call
    assert fake.calls == [] and agent.registrations() == [reg]
    # memory next to a registration, and the same pool once its registration ended, register
    reg_b = agent.register_pool(b)
    reg.close()
    again = agent.register_pool(a)
    assert fake.calls.count("register_memory") == 2 and agent.registrations() == [reg_b, again]
    agent.close()
