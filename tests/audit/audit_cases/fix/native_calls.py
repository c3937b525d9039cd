import torch
import triton
import triton.language as tl
from sgl_kernel import transfer_kv_all_layer

import pointerdomain


@triton.jit
def copy_rows(src_ptrs, n, BLOCK: tl.constexpr):
    pass


def to_native_op(srcs, idx):
    table = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.uint64, device="cuda")
    transfer_kv_all_layer(table, idx)


def to_triton(srcs):
    table = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.uint64, device="cuda")
    copy_rows[(len(srcs),)](table, 0, BLOCK=128)


def to_torch_ops(srcs, idx):
    table = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.int64, device="cuda")
    torch.ops.sgl_kernel.transfer(table, idx)


def to_own_api(srcs):
    table = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.uint64, device="cuda")
    print(table)
    return pointerdomain.has_domain(table, pointerdomain.DeviceAlias)
