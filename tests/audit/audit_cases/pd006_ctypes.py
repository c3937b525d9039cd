# Cases for PD006 (ctypes.c_void_p to a CUDA/HIP entry point).
import ctypes
from ctypes import c_void_p


def f(lib, t, n, count):
    lib.cudaMemcpy(ctypes.c_void_p(t.data_ptr()), None, n, 0)  # expect[PD006]
    p = c_void_p(t.data_ptr())
    lib.hipHostRegister(p, n, 0)  # expect[PD003,PD006]
    lib.cuMemcpyHtoD(p, None, n)  # expect[PD006]
    lib.my_copy(ctypes.c_void_p(t.data_ptr()))  # negative: not a CUDA/HIP entry point
    lib.cudaGetDeviceCount(ctypes.byref(count))  # negative: no c_void_p


def handles(hip, lib, raw_stream):
    module = ctypes.c_void_p()
    hip.hipModuleLoadData(ctypes.byref(module), b"")
    hip.hipModuleUnload(module)  # negative: a module handle, not an address
    lib.cuFileStreamRegister(ctypes.c_void_p(raw_stream), 7)  # negative: a stream handle
