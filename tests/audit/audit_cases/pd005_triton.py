# Cases for PD005 (Triton kernel loading pointers from an integer table).
import triton
import triton.language as tl


@triton.jit
def swap(table_ptr, dst_ptr, n: tl.constexpr):
    src = tl.load(table_ptr + 1).to(tl.pointer_type(tl.int8))  # expect[PD005]
    v = tl.load(table_ptr)
    p = v.to(tl.pointer_type(tl.float16), bitcast=True)  # expect[PD005]
    q = dst_ptr.to(tl.pointer_type(tl.uint8))  # negative: a pointer argument re-typed
    x = tl.load(dst_ptr).to(tl.float32)  # negative: a value cast
    tl.store(q, x)


@triton.autotune(configs=[], key=["n"])
@triton.jit(do_not_specialize=["n"])
def gather(table_ptr, n):
    base = tl.load(table_ptr + n)
    ptr = tl.cast(base, tl.pointer_type(tl.bfloat16))  # expect[PD005]
    tl.store(ptr, 0)


def not_a_kernel(t):
    v = tl.load(t)
    return v.to(tl.pointer_type(tl.int8))  # negative: not @triton.jit


from vllm.triton_utils import tl as tl2, triton as triton2  # noqa: E402  re-exported triton


@triton2.jit
def reexported(src_addrs, job):
    src = tl2.load(src_addrs + job).to(tl2.pointer_type(tl2.int64))  # expect[PD005]
    tl2.store(src, 0)


@triton.jit
def indexed(k_cache_ptr, block_table_ptr, stride):
    idx = tl.load(block_table_ptr)
    block_ptr = k_cache_ptr + idx.to(tl.int64) * stride
    scale = block_ptr.to(tl.pointer_type(tl.int32))  # negative: a real pointer offset by a loaded index
    base = tl.load(block_table_ptr + 1)
    p = (base + 64).to(tl.pointer_type(tl.int8))  # expect[PD005]
    tl.store(scale, tl.load(p))
