# Code that also runs on npu / xpu: the pointerdomain builders raise there; never rewritten.
import torch


def npu_table(bufs, device):
    if device.type == "npu":
        torch.npu.synchronize()
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # expect[PD001]


def cuda_table(bufs, device):
    # a comment that names "npu" runs nowhere
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # expect[PD001]
