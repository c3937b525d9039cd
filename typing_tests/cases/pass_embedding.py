"""Kernel-table arguments and NIXL descriptors type-check with the right domains, and run
(CPU, emulated device; no NIXL or Triton needed)."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

import pointerdomain as pd
from pointerdomain.adapters.nixl import NixlDesc, dram_desc, file_desc
from pointerdomain.transfer.kernel_args import check_kernel_table, kernel_table_tensor
from pointerdomain.transfer.triton import kernel_table_arg

DEV = "emulated:0"
layout = pd.KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=2, num_heads=1, head_dim=16)
with pd.HostKVPool(layout, DEV) as pool:
    assert_type(check_kernel_table(pool.kernel_table, DEV), pd.Device)
    assert_type(kernel_table_tensor(pool.kernel_table, DEV), torch.Tensor)
    assert_type(kernel_table_arg(pool.kernel_table, DEV), torch.Tensor)
    info = pool.get_contiguous_buf_infos()[0]
    d = dram_desc(info)
    assert_type(d, NixlDesc)
    assert_type(dram_desc(info.address, 64).xfer_tuple(), tuple[int, int, int])
    assert_type(file_desc(3, 0, 64).reg_tuple(), tuple[int, int, int, str])
    assert d.addr == info.address.value and d.dev_id == 0
assert_type(pd.get_include(), str)
