# A pool whose buffer is one 2-D tensor: the table holds one address per row.
import torch


class RowPool:
    def __init__(self, layers: int, row_bytes: int, device: str) -> None:
        self.device = device
        self.kv_buffer = torch.zeros((layers, row_bytes), dtype=torch.uint8)
        self.host_ptrs = torch.tensor([x.data_ptr() for x in self.kv_buffer], dtype=torch.uint64)  # expect[PD001]
        self.dev_ptrs = torch.tensor(  # expect[PD001]
            [x.data_ptr() for x in self.kv_buffer], dtype=torch.uint64, device=self.device
        )
