# Address flows through map(), getattr() and ctypes.cast().
import ctypes
import operator

import torch
from mooncake.engine import TransferEngine
from native_ops import copy_rows


def through_map(bufs, device):
    ptrs = list(map(lambda t: t.data_ptr(), bufs))  # expect[PD002]
    table = torch.tensor(list(map(lambda t: t.data_ptr(), bufs)), dtype=torch.uint64, device=device)  # expect[PD001]
    by_method = list(map(torch.Tensor.data_ptr, bufs))  # expect[PD002]
    by_caller = tuple(map(operator.methodcaller("data_ptr"), bufs))  # expect[PD002]
    sizes = list(map(lambda t: t.numel(), bufs))  # negative: no address
    return ptrs, table, by_method, by_caller, sizes


def through_getattr(t, n):
    engine = TransferEngine()
    getattr(engine, "register_memory")(t.data_ptr(), n)  # expect[PD003]
    register = getattr(engine, "register_memory")
    register(t.data_ptr(), n)  # expect[PD003]
    getattr(engine, "batch_transfer_sync_write")("peer", [t.data_ptr()], [0], [n])  # expect[PD004]
    getattr(t, "numel")()  # negative: not an engine method


def through_cast(lib, t, n, stream, engine):
    copy_rows(ctypes.cast(t.data_ptr(), ctypes.c_void_p), n)  # expect[PD008]
    src = ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
    lib.cudaMemcpy(src, None, n, 0)  # expect[PD006]
    staging = ctypes.create_string_buffer(n)
    addr = ctypes.cast(staging, ctypes.c_void_p).value
    engine.register_memory(addr, n)  # expect[PD003]
    lib.cudaStreamSynchronize(ctypes.cast(stream, ctypes.c_void_p))  # negative: a stream handle
    handle = ctypes.cast(stream, ctypes.c_void_p).value
    lib.cuStreamQuery(handle)  # negative: a stream handle


def cast_returned(t):
    return ctypes.cast(t.data_ptr(), ctypes.c_void_p)  # expect[PD008]
