# Cases for PD006 (ctypes.c_void_p to a CUDA/HIP entry point).
import ctypes
from ctypes import c_void_p


def f(lib, t, n, count):
    lib.cudaMemcpy(ctypes.c_void_p(t.data_ptr()), None, n, 0)  # expect[PD006]
    p = c_void_p(t.data_ptr())
    lib.hipHostRegister(p, n, 0)  # expect[PD003,PD006]
    lib.cuMemcpyHtoD(p, None, n)  # expect[PD006]
    lib.my_copy(ctypes.c_void_p(t.data_ptr()))  # expect[PD008] a native library call, not a CUDA/HIP one
    lib.cudaGetDeviceCount(ctypes.byref(count))  # negative: no c_void_p


def handles(hip, lib, raw_stream):
    module = ctypes.c_void_p()
    hip.hipModuleLoadData(ctypes.byref(module), b"")
    hip.hipModuleUnload(module)  # negative: a module handle, not an address
    lib.cuFileStreamRegister(ctypes.c_void_p(raw_stream), 7)  # negative: a stream handle


def collectives(hccl, nccl, comm, stream, t, out, n):
    buffer_type = ctypes.c_void_p
    hccl.hcclAllReduce(buffer_type(t.data_ptr()), buffer_type(out.data_ptr()), n, 0, 0, comm, stream)  # expect[PD006]
    send = buffer_type(t.data_ptr())
    nccl.ncclSend(send, n, 0, 1, comm, stream)  # expect[PD006]
    hccl.HcclBroadcast(ctypes.c_void_p(t.data_ptr()), n, 0, 0, comm, stream)  # expect[PD006]
    hccl.aclrtMemcpy(ctypes.c_void_p(out.data_ptr()), n, ctypes.c_void_p(t.data_ptr()), n, 1)  # expect[PD006]
    hccl.hcclCommDestroy(ctypes.c_void_p(comm))  # negative: a communicator handle


def launch(hip, fn, args, extra, stream, t):
    params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    hip.hipModuleLaunchKernel(fn, 1, 1, 1, 64, 1, 1, 0, stream, params, None)  # negative: host kernarg buffer
    hip.hipModuleLaunchKernel(fn, 1, 1, 1, 64, 1, 1, 0, stream, None, ctypes.cast(extra, ctypes.c_void_p))  # negative
    hip.hipMemsetAsync(ctypes.cast(t.data_ptr(), ctypes.c_void_p), 0, 4, stream)  # expect[PD006]


def typed_device_pointers(cuda, stream, flag_base, n):
    cuda.cuStreamWriteValue32(stream, cuda.CUdeviceptr(flag_base.data_ptr()), 1, 0)  # negative: a typed device pointer
    cuda.cuMemsetD8(ctypes.c_void_p(flag_base.data_ptr()), 0, n)  # expect[PD006]
