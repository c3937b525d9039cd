# The CuTe DSL exemption follows the file's imports: a `cute` that is not cutlass's is no DSL.
import mydsl as cute
from mydsl import kernel
from some_ext import make_ptr, ops


@cute.kernel
def looks_like_dsl(t):
    ops.launch(t.data_ptr())  # expect[PD008]


@kernel
def plain_kernel_name(t, off):
    return t.data_ptr() + off  # expect[PD002]


def typed(t, dtype):
    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem)  # expect[PD008]
