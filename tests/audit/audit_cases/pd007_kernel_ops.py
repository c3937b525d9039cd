# Cases for PD007 (configured kernel ops called without a PointerTable);
# kernel_ops = ["sgl_kernel.transfer_kv_all_layer"].
import pointerdomain as pd
import sgl_kernel
from sgl_kernel import transfer_kv_all_layer


def f(src_ptrs, dst_ptrs, bufs, dev, pool):
    transfer_kv_all_layer(src_ptrs, dst_ptrs)  # expect[PD007]
    sgl_kernel.transfer_kv_all_layer(src_ptrs, dst_ptrs)  # expect[PD007]
    table = pd.make_kernel_ptr_table(bufs, dev)
    transfer_kv_all_layer(table.as_uint64_tensor(), dst_ptrs)  # negative
    transfer_kv_all_layer(pool.kernel_table, dst_ptrs)  # negative
    sgl_kernel.other_op(src_ptrs)  # negative: not configured
