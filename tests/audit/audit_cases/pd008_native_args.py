# Cases for PD008 (raw addresses handed to native code, collectives and peers as ints).
import ctypes
import logging

import torch
from deep_ep_like import ep_ops
from some_ext import launch_copy

logger = logging.getLogger(__name__)


class ElasticBuffer:
    def __init__(self, group) -> None:
        self.runtime = ep_ops.Buffer(group)

    def dispatch(self, x, topk_idx, recv_x, scales=None):
        handle = self.runtime.dispatch(  # expect[PD008]
            x.data_ptr(),
            topk_idx.data_ptr(),
            x.size(0),
            0 if scales is None else scales.data_ptr(),
            recv_x.data_ptr(),
        )
        return handle

    def combine(self, x, out):
        src = x.data_ptr()
        torch.ops.ep_kernels.combine(src, out.data_ptr(), x.numel())  # expect[PD008]
        launch_copy(src, out.data_ptr(), x.nbytes)  # expect[PD008]

    def stream_ptr(self, buf):
        return ctypes.c_void_p(buf.data_ptr())  # expect[PD008]

    def announce(self, sock, buf):
        sock.send_pyobj((buf.data_ptr(), buf.nbytes))  # expect[PD008]

    # negatives: logging, a helper of this file, formatting, identity, an alignment check
    def _helper(self, addr: int) -> int:
        return addr

    def quiet(self, buf, other, f):
        logger.debug("buffer at %x", buf.data_ptr())
        self._helper(buf.data_ptr())
        f(buf.data_ptr())
        name = f"{buf.data_ptr():#x}"
        same = int(buf.data_ptr()) == other.data_ptr()
        torch.testing.assert_close(buf, other)
        aligned = launch_copy(buf.data_ptr() % 16)
        return name, same, aligned


def fill_args(native_ep, x, out):
    args = native_ep.DispatchArgs()
    args.x_ptr = x.data_ptr()  # expect[PD008]
    args.out_ptr = out.data_ptr()  # expect[PD008]
    args.num_tokens = x.size(0)
    return args


def allocate(n):
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    ptr = t.data_ptr()
    return ptr, t  # expect[PD008]


def pinned_copy(dst, src_array, n):
    ctypes.memmove(dst.data_ptr(), src_array.ctypes.data, n)  # expect[PD008]


class KernelArgs(ctypes.Structure):
    _fields_ = [("x_ptr", ctypes.c_void_p), ("n", ctypes.c_int)]


def launch_dsl(t):
    from cutlass_like.runtime import make_ptr

    p = make_ptr(8, t.data_ptr())  # expect[PD008]
    args = KernelArgs(t.data_ptr(), 4)  # expect[PD008]
    return p, args


class Offload:
    def __init__(self, ids_cpu, slots_cpu):
        self.ids_ptr = ids_cpu.data_ptr()
        self.slots_ptr = slots_cpu.data_ptr()

    def step(self, host_ops, n):
        args = (n, self.ids_ptr, self.slots_ptr)  # expect[PD008]
        host_ops.onload(args)  # the finding is at the tuple that packs the ints
        host_ops.onload_again(args)  # the same tuple: one finding


def io_buffers(native, bufs, parts):
    vals = native.IOBuffers()
    for b in bufs:
        vals.append(b.data_ptr(), b.nbytes, True)  # expect[PD008]
    strided = [(t.data_ptr(), t.stride(0) * 2) for t in parts]  # expect[PD002] descriptors, not keys
    return vals, strided


def jit_module_call(module, lib, group, out, stream):
    func = module["moe_output_memset_bf16"]
    func(out.data_ptr(), out.size(0), stream)  # expect[PD008]
    lib._funcs["ncclEpTensorCreate"](group, 3, ctypes.c_void_p(out.data_ptr()))  # expect[PD006]
