# Addresses that leave through a helper of the file, a tuple handed on, a kernel launch, a
# descriptor whose row size reads a shape, a private record class, a nested argument tuple.
import asyncio
import ctypes
import dataclasses
from bisect import bisect_left

import torch
import triton
import weakref

_libc = ctypes.CDLL(None)


def _madvise(addr, length, advice):
    start = addr & ~4095
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)


def _describe(addr, length):
    return f"{addr:#x}+{length}"


def _unpin(ptr):
    torch.cuda.cudart().cudaHostUnregister(ptr)  # expect[PD003]


def _release(ptr):
    _unpin(ptr)


def _view_at(state, start_addr, n):
    byte_offset = start_addr - state.data_ptr()
    return state.view(-1).narrow(0, byte_offset // state.element_size(), n)


def _block_of(starts, ptr):
    return bisect_left(starts, ptr)


def advise(t):
    _madvise(t.data_ptr(), t.nbytes, 4)  # expect[PD008]
    _describe(t.data_ptr(), t.nbytes)  # negative: the helper only formats it
    _madvise(0, t.nbytes, 4)  # negative: no address
    _release(t.data_ptr())  # expect[PD008]
    _madvise(len(t.data_ptr().to_bytes(8, "little")), t.nbytes, 4)  # negative: a length, no address
    _view_at(t, t[1].data_ptr(), 4)  # negative: the helper turns it into an offset at once
    _block_of([0], t.data_ptr())  # negative: a range look-up in Python


class Offload:
    def __init__(self, ids_cpu, ops):
        self.ids_ptr = ids_cpu.data_ptr()
        self.ops = ops

    def step(self, n):
        args = (n, self.ids_ptr)  # expect[PD008]
        self._run(args)
        self._run((n, n))  # negative: no address in the tuple
        self._log(self.ids_ptr)  # negative: the helper is Python only

    def _run(self, args):
        n, ids_ptr = args
        self.ops.compact(ids_ptr, n)

    def _log(self, value):
        print(hex(value))


@triton.jit
def gather(src_addr, ids, out):
    pass


def launch(w, ids, out):
    gather[(ids.numel(),)](w.data_ptr(), ids, out)  # expect[PD008]
    gather[(ids.numel(),)](w, ids, out)  # negative: the tensor itself


def describe(components, replicated, span):
    meta = [[(b.data_ptr(), b.stride(0) * b.element_size(), b.nbytes // b.shape[0] * span) for b in c]  # expect[PD002]
            for c in components]
    seen = [(t.shape[1], t.data_ptr()) for t in replicated]  # negative: a tensor's identity
    rep = [None if t is None else (t.data_ptr(), t.stride(0)) for t in replicated]  # expect[PD002]
    counts = [None if t is None else (t.numel(), t.stride(0)) for t in replicated]  # negative: no address
    return meta, seen, rep, counts


@dataclasses.dataclass
class _Buffer:
    base: int
    rows: int


def make_buffer(region, rows):
    return _Buffer(base=int(region.data_ptr()), rows=rows)  # expect[PD008]


def make_empty_buffer(rows):
    return _Buffer(base=0, rows=rows)  # negative: no address


def launch_ex(cbd, config, kernel, layout, m):
    arg_values = (layout.data_ptr(), m)
    arg_types = (ctypes.c_void_p, ctypes.c_uint32)
    cbd.cuLaunchKernelEx(config, kernel, ((m, m), arg_types), 0)  # negative: no address
    return cbd.cuLaunchKernelEx(config, kernel, (arg_values, arg_types), 0)  # expect[PD008]


def host_view(t):
    host = t.cpu()
    addr = host.data_ptr()
    view = (ctypes.c_char * host.nbytes).from_address(addr)  # expect[PD008]
    copy = (ctypes.c_char * host.nbytes).from_buffer_copy(bytes(host.nbytes))  # negative: no address
    return view, copy


class Sender:
    def __init__(self, engine):
        self.engine = engine

    async def _send(self, sid, src, dst, n):
        return await asyncio.to_thread(self.engine.transfer_sync_write, sid, src, dst, n)

    async def _count(self, sid, src, n):
        return await asyncio.to_thread(print, sid, src, n)

    async def send(self, sid, t, dst):
        await self._send(sid, t.data_ptr(), dst, t.nbytes)  # expect[PD008]
        await self._count(sid, t.data_ptr(), t.nbytes)  # negative: printed, never handed to native code


def pin_for_life(storage):
    weakref.finalize(storage, _unpin, storage.data_ptr())  # expect[PD008]
    weakref.finalize(storage, _describe, storage.data_ptr(), 0)  # negative: the helper only formats it


def dsl_pointers(cute, t, dtype):
    from dsl_runtime import make_ptr  # the CuTe DSL runtime, re-exported

    # `cute` is a parameter here, not the DSL imported from cutlass: its AddressSpace names nothing
    typed = make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)  # expect[PD008]
    return typed, make_ptr(dtype, t.data_ptr())  # expect[PD008]
