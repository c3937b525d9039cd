import torch
from typing import List as list  # noqa: F401


def param_named_list(list, device) -> object:
    return torch.tensor([b.data_ptr() for b in list], dtype=torch.uint64, device=device)


def local_named_list(bufs, device) -> object:
    list = bufs
    return torch.tensor([b.data_ptr() for b in list], dtype=torch.uint64)
