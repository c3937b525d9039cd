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


class Runner:
    def launch(self, ws, dtype):
        # imports local to the method, make_ptr in a nested def: the nested def is sliced on its own
        # and must still see the enclosing function's imports
        import cutlass.cute as cute
        from cutlass.cute.typing import AddressSpace as _AddressSpace

        def to_ptr(tensor, align=16):
            return cute.runtime.make_ptr(cutlass.Uint8, tensor.data_ptr(), _AddressSpace.gmem, assumed_align=align)  # negative

        return to_ptr(ws)

    def launch_own_space(self, ws, dtype):
        from mydsl.typing import AddressSpace as _AddressSpace  # not the DSL's space
        from mydsl.runtime import make_ptr

        def to_ptr(tensor):
            return make_ptr(dtype, tensor.data_ptr(), _AddressSpace.gmem)  # expect[PD008]

        return to_ptr(ws)
