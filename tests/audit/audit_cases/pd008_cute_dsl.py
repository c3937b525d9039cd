# Host-side code of a CuTe DSL module: the DSL's own calls take DSL pointers; make_ptr takes the int.
import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.runtime import make_ptr


def build_scheduler(storage, layout, stages):
    sched = pipeline.PipelineAsync.create(num_stages=stages, barrier_storage=storage.mbar.data_ptr())  # negative
    buf = cute.make_tensor(storage.buf.data_ptr(), layout)  # negative: a shared-memory DSL pointer
    smem = cutlass.Array(storage.base.data_ptr() + 128, dtype=cutlass.Int32, shape=(4,), addrspace=3)  # negative
    return sched, buf, smem


def wrap(counter, dtype):
    return make_ptr(dtype, counter.data_ptr())  # expect[PD008]


def wrap_typed(counter, dtype):
    return make_ptr(dtype, counter.data_ptr(), cute.AddressSpace.gmem)  # negative: the DSL's space is named


def wrap_typed_keyword(counter, dtype):
    return make_ptr(dtype, counter.data_ptr(), mem_space=cute.AddressSpace.gmem, assumed_align=16)  # negative


@cute.kernel
def copy_kernel(src, dst):
    cute.copy(src.data_ptr() + 16, dst)  # negative: a DSL kernel (decorator resolved to cutlass.cute.kernel)
