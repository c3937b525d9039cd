"""Separately registered chunks have unrelated aliases, as on MI355X (adjacent host ranges,
aliases far apart and in the other order): the emulated backend maps each chunk's alias at
a random gap inside inaccessible guard pages, so base-plus-offset is valid only inside one
registration and a walk from one chunk's alias into the next faults. Every path of the
library computes the alias per chunk: a chunked pool moves exact bytes across chunk
boundaries through the kernel, the staged path and the copy engine, in normal and strict
alias mode."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain.testing import FaultyBackend, backend_for, install_backend
from tests.reference import DEV, as_bytes, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer

PATHS = ["kernel", "staged", "copy_engine"]


def _mapping_perms(addr: int) -> str | None:
    """The permissions of the mapping of this process holding ``addr`` (``/proc/self/maps``), or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return perms
    return None


@pytest.fixture(params=[False, True], ids=["normal", "strict"])
def strict(request: pytest.FixtureRequest) -> Iterator[bool]:
    with pd.strict_alias(request.param):
        yield request.param


def _aliases(mem: pd.RegisteredHostMemory) -> list[tuple[int, int, int]]:
    """(host VA, alias, bytes) of each chunk, the alias asked of the backend directly."""
    backend = backend_for(DEV)
    out = []
    for chunk in mem.chunks:
        status, alias = backend.alias(chunk.registered_address, DEV)
        assert status == 0
        out.append((chunk.host_va.value, alias, chunk.nbytes))
    return out


def test_adjacent_chunks_get_aliases_apart_with_guard_pages_between(strict: bool) -> None:
    page = 4096
    with pd.alloc_registered(16 * page, DEV, max_chunk_bytes=2 * page) as mem:
        assert mem.strict is strict
        chunks = _aliases(mem)
        assert len(chunks) == 8
        for (va, alias, n), (next_va, next_alias, _) in zip(chunks, chunks[1:]):
            assert next_va == va + n  # the host ranges meet
            assert next_alias != alias + n  # their aliases do not: base + offset stops at the chunk's end
            assert _mapping_perms(alias + n) in (None, "---p")  # the byte past a chunk's alias faults
            assert _mapping_perms(alias - 1) in (None, "---p")  # and the byte before it
            assert _mapping_perms(alias) == "rw-s"
        # the aliases run the other way from the host VAs (as measured on MI355X), most of the time:
        # the address below the last alias may be taken, then the kernel places the mapping
        downward = sum(b[1] < a[1] for a, b in zip(chunks, chunks[1:]))
        assert downward >= len(chunks) // 2
        # and each alias reaches the bytes of its own chunk
        fill_random(mem.tensor, 3)
        for va, alias, n in chunks:
            off = va - mem.host_va.value
            assert torch.equal(_read(alias, n), mem.tensor[off : off + n])


def test_aliases_keep_descending_in_a_fragmented_address_space() -> None:
    # Holes of every size left above and below the last reservation (a serving process's
    # allocator churn): the kernel's own choice would fill a hole higher up, so each alias
    # is placed in the highest free range below the previous one instead.
    import mmap
    import random

    rng = random.Random(7)
    page = 4096
    held = [mmap.mmap(-1, rng.randint(4, 600) * page) for _ in range(600)]
    for m in held[1::2]:
        m.close()
    try:
        for _ in range(10):
            with pd.alloc_registered(16 * page, DEV, max_chunk_bytes=2 * page) as mem:
                aliases = [alias for _, alias, _ in _aliases(mem)]
                downward = sum(b < a for a, b in zip(aliases, aliases[1:]))
                assert downward >= len(aliases) - 2  # a thread of the process may take a free range first
    finally:
        for m in held[::2]:
            m.close()


def _read(addr: int, n: int) -> torch.Tensor:
    """``n`` bytes at ``addr`` of this process (a copy)."""
    import ctypes

    return torch.frombuffer(bytearray(ctypes.string_at(addr, n)), dtype=torch.uint8)


def test_the_alias_of_a_chunk_interior_stays_in_that_chunk() -> None:
    page = 4096
    with pd.alloc_registered(8 * page, DEV, max_chunk_bytes=2 * page) as mem:
        for k, chunk in enumerate(mem.chunks):
            first = pd.resolve_alias(chunk.host_va, DEV).value
            last = pd.resolve_alias(chunk.host_va + (chunk.nbytes - 1), DEV).value
            assert last == first + chunk.nbytes - 1, k  # inside one registration: base plus offset
        boundary = [pd.resolve_alias(c.host_va, DEV).value for c in mem.chunks]
        assert len(set(b - a for a, b in zip(boundary, boundary[1:]))) > 1 or len(boundary) < 3  # random gaps


# the staged path takes host layouts whose slot holds its layers contiguously
CASES = [(path, kind) for path in PATHS for kind in ("page_first", "page_first_direct", "layer_first")
         if not (path == "staged" and kind != "page_first")]


def _move_across_chunks(device: pd.Device, strict: bool, path: str, host_kind: str) -> None:
    """A backup and a load through ``path`` of slots on both sides of every chunk boundary of
    a pool registered one page block per chunk, byte-compared with the reference on
    poisoned destinations."""
    dev_layout = model_layout("layer_first", pages=6)
    host_layout = model_layout(host_kind, pages=10)
    pool = pd.DeviceKVPool(dev_layout, device)
    fill_pool(pool, 11)
    block = host_layout.page_block_bytes()
    with pd.HostKVPool(host_layout, device, max_chunk_bytes=block) as host:  # one chunk per page block
        assert len(host.memory.chunks) > 2 and host.memory.strict is strict
        host.buffer.view(torch.uint8).fill_(0xA5)  # poison
        ps = host_layout.page_size
        # slots on both sides of the chunk boundaries, in an order that crosses them both ways
        host_slots = torch.tensor([ps - 1, ps, 2 * ps - 1, 2 * ps, 5 * ps + 1, 3 * ps - 1, 9 * ps + 3, 4 * ps,
                                   7 * ps + 2, 6 * ps - 1, 8 * ps, 1])
        dev_slots = torch.randperm(dev_layout.num_slots, generator=torch.Generator().manual_seed(5))[: len(host_slots)]
        on = pool.buffers[0].device
        want = reference_transfer(pool_bytes(pool), dev_layout, host.buffer, host_layout, dev_slots, host_slots)
        host.backup(pool, dev_slots.to(on), host_slots.to(on), backend=path)  # type: ignore[arg-type]
        if on.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(as_bytes(host.buffer).reshape(-1), want)
        # and back, into a poisoned device pool
        back = pd.DeviceKVPool(dev_layout, device)
        for b in back.buffers:
            b.view(torch.uint8).fill_(0x5A)
        want_back = reference_transfer(host.buffer, host_layout, pool_bytes(back), dev_layout, host_slots, dev_slots)
        host.load(back, host_slots.to(on), dev_slots.to(on), backend=path)  # type: ignore[arg-type]
        assert torch.equal(pool_bytes(back), want_back)


@pytest.mark.parametrize(("path", "host_kind"), CASES)
def test_a_chunked_pool_moves_exact_bytes_across_chunk_boundaries(strict: bool, path: str, host_kind: str) -> None:
    _move_across_chunks(DEV, strict, path, host_kind)


@pytest.mark.gpu
@pytest.mark.parametrize(("path", "host_kind"), CASES)
def test_gpu_a_chunked_pool_moves_exact_bytes_across_chunk_boundaries(strict: bool, path: str, host_kind: str) -> None:
    dev = pd.Device("cuda", 0)
    _move_across_chunks(dev, strict, path, host_kind)
    if strict:  # each chunk registered at its own twin: the aliases are not one range, on the H200 too
        with pd.alloc_registered(8 * 4096, dev, max_chunk_bytes=2 * 4096) as mem:
            aliases = [pd.resolve_alias(c.host_va, dev).value for c in mem.chunks]
            assert all(b != a + c.nbytes for a, b, c in zip(aliases, aliases[1:], mem.chunks))


_WALK = """
import ctypes, sys
import pointerdomain as pd
from pointerdomain.testing import FaultyBackend, backend_for, install_backend
dev = pd.Device("emulated", 0)
mem = pd.alloc_registered(4 * 4096, dev, max_chunk_bytes=2 * 4096)
first = mem.chunks[0]
status, alias = backend_for(dev).alias(first.registered_address, dev)
ctypes.string_at(alias, first.nbytes)  # inside the chunk: fine
print("inside ok", flush=True)
ctypes.string_at(alias + first.nbytes, 1)  # base + offset into the next chunk's host range
print("walked past", flush=True)
"""


@pytest.mark.slow  # a child process (it dies of the fault)
def test_walking_from_one_chunk_alias_into_the_next_faults() -> None:
    import signal
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WALK], capture_output=True, text=True, timeout=120)
    assert "inside ok" in out.stdout and "walked past" not in out.stdout, out.stdout + out.stderr
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr[-2000:])


class _AliasIsAddress(FaultyBackend):
    """A CUDA-like backend whose alias is the registered address itself
    (``CanUseHostPointerForRegisteredMem`` = 1): registration only records the calls."""

    def __init__(self) -> None:
        super().__init__(backend_for(DEV), fail={})
        self.runtime = "cuda"
        self.registered: dict[int, int] = {}

    def register(self, va: int, nbytes: int, device: pd.Device) -> int:
        self.registered[va] = nbytes
        return 0

    def unregister(self, va: int, device: pd.Device) -> int:
        return 0 if self.registered.pop(va, None) is not None else 713

    def alias(self, va: int, device: pd.Device) -> tuple[int, int]:
        return (0, va) if any(a <= va < a + n for a, n in self.registered.items()) else (713, 0)


def test_strict_chunks_are_registered_on_twins_apart_where_the_alias_is_the_address() -> None:
    page = 4096
    fake = _AliasIsAddress()
    with install_backend(fake, "emulated"), pd.strict_alias(True):
        mem = pd.alloc_registered(6 * page + 512, DEV, max_chunk_bytes=page + 512, granularity=page + 512)
        try:
            assert mem.strict and len(mem.chunks) == 6 and sorted(fake.registered.values())[-1] == page + 512
            aliases = [pd.resolve_alias(c.host_va, DEV).value for c in mem.chunks]
            for chunk, alias, nxt in zip(mem.chunks, aliases, aliases[1:]):
                assert nxt != alias + chunk.nbytes  # adjacent host ranges, aliases apart
                assert alias != chunk.host_va.value  # never the host VA (strict)
                assert _mapping_perms(alias + chunk.nbytes) in (None, "---p") or (alias + chunk.nbytes) % page
            fill_random(mem.tensor, 9)
            for chunk, alias in zip(mem.chunks, aliases):  # each twin holds its chunk's bytes (mid-page starts too)
                off = chunk.host_va.value - mem.host_va.value
                assert torch.equal(_read(alias, chunk.nbytes), mem.tensor[off : off + chunk.nbytes])
                last = pd.resolve_alias(chunk.host_va + (chunk.nbytes - 1), DEV).value
                assert last == alias + chunk.nbytes - 1  # base + offset inside the chunk
        finally:
            mem.close()
    assert fake.registered == {}  # every chunk unregistered at its own twin
