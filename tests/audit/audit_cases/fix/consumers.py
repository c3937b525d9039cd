# Tables whose consumers need a tensor (torch.cat, arithmetic, a native op) are left alone.
import torch
from kernels import transfer_kv


class SplitPool:
    def __init__(self, k_buffer, v_buffer, device) -> None:
        self.k_ptrs = torch.tensor([x.data_ptr() for x in k_buffer], dtype=torch.uint64, device=device)  # expect[PD001]
        self.v_ptrs = torch.tensor([x.data_ptr() for x in v_buffer], dtype=torch.uint64, device=device)  # expect[PD001]
        self.kv_ptrs = torch.cat([self.k_ptrs, self.v_ptrs])
        offsets = torch.tensor([x.data_ptr() for x in k_buffer], dtype=torch.int64, device=device)  # expect[PD001]
        self.shifted = offsets + 64
        self.table = torch.tensor([x.data_ptr() for x in v_buffer], dtype=torch.uint64, device=device)  # expect[PD001]

    def load(self, indices):
        transfer_kv(self.table, indices)
