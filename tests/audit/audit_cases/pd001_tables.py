# Cases for PD001 (raw pointer tables). Lines marked `expect[...]` must give exactly those codes.
import numpy as np
import torch
import torch as T


def tables(bufs: list[torch.Tensor], device: torch.device) -> None:
    a = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # expect[PD001]
    h = T.as_tensor([bufs[0].data_ptr(), bufs[1].data_ptr()], dtype=T.int64)  # expect[PD001]
    ptrs = [b.data_ptr() for b in bufs]  # expect[PD002]
    t = torch.tensor(ptrs, dtype=torch.uint64).cuda()  # expect[PD001]
    n = np.array([b.data_ptr() for b in bufs], dtype=np.uint64)  # expect[PD001]
    # negatives: tables of sizes, not addresses
    ok = torch.tensor([b.numel() for b in bufs], dtype=torch.int64)
    sizes = torch.tensor([b.numel() * b.element_size() for b in bufs])


class tensor:  # a local class named `tensor` is not torch.tensor
    def __init__(self, data: object) -> None:
        self.data = data


def local_builder(bufs: list[torch.Tensor]) -> tensor:
    return tensor([b.data_ptr() for b in bufs])  # expect[PD002]
