# Cases for addresses read from other sources than data_ptr(): numpy's array interface and ctypes
# view, torch's caching allocator, and addresses passed through lambdas and *args helpers.
import ctypes

import numpy as np
import torch
from some_ext import lib, ops


def descriptor_tuple(t, n, m):
    ops.foo((t.data_ptr(), n, m))  # expect[PD008]
    ops.foo((t.data_ptr(), t.shape[0], t.shape[1]))  # expect[PD008]
    ops.foo((t.data_ptr(), t.size(0)))  # expect[PD008]
    ops.key_of((t.data_ptr(), t.shape, t._version))  # negative: a whole shape and a version: an identity


def numpy_views(a: np.ndarray, n):
    ops.copy(a.ctypes.data_as(ctypes.c_void_p), n)  # expect[PD008]
    p = a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    ops.copy(p, n)  # expect[PD008]
    ops.copy(a.__array_interface__["data"][0], n)  # expect[PD008]
    iface = a.__array_interface__
    addr, _readonly = iface["data"]
    lib.fill(addr, n)  # expect[PD008]
    end = addr + n  # expect[PD002]
    shape = a.__array_interface__["shape"]  # negative: not the data pointer
    ops.copy(shape, n)  # negative
    ro = a.__array_interface__["data"][1]  # negative: the read-only flag
    ops.copy(ro, n)  # negative
    return end  # expect[PD008]


def cuda_views(x, n):
    lib.fill(x.__cuda_array_interface__["data"][0], n)  # expect[PD008]


def allocator(n, stream):
    ptr = torch.cuda.caching_allocator_alloc(n, stream=stream)
    ops.launch(ptr, n)  # expect[PD008]
    half = ptr + n // 2  # expect[PD002]
    torch.cuda.caching_allocator_delete(ptr)  # negative: torch's own API
    return half  # expect[PD008]


def registration(a: np.ndarray, n):
    lib.cudaMemcpy(a.ctypes.data_as(ctypes.c_void_p), None, n, 1)  # expect[PD006]


launch = lambda p, n: ops.copy(p, n)  # noqa: E731
formatted = lambda p: f"{p:#x}"  # noqa: E731


def forward(kind, *args):
    return ops.dispatch(kind, *args)


def describe(*args):
    return " ".join(hex(a) for a in args)


class Copier:
    def __init__(self):
        self._free = lambda p: lib.free(p)

    def run(self, t, n, bufs):
        launch(t.data_ptr(), n)  # expect[PD008]
        forward("copy", t.data_ptr(), n)  # expect[PD008]
        self._free(t.data_ptr())  # expect[PD008]
        ptrs = [b.data_ptr() for b in bufs]  # expect[PD002]
        list(map(lambda p: lib.release(p), ptrs))  # expect[PD008]
        formatted(t.data_ptr())  # negative: the lambda only formats it
        describe(t.data_ptr(), n)  # negative: the helper only formats them
        forward("noop", n)  # negative: no address
