# Code that also runs on npu / xpu: the pointerdomain builders raise there; never rewritten.
import torch


def npu_table(bufs, device):
    if device.type == "npu":
        torch.npu.synchronize()
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # expect[PD001]


def cuda_table(bufs, device) -> object:
    # a comment that names "npu" runs nowhere
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # expect[PD001]


class XpuPool:
    def __init__(self, k_buffer):
        self.device = "xpu"
        self.k_buffer = k_buffer

    def table(self):
        return torch.tensor([b.data_ptr() for b in self.k_buffer], dtype=torch.uint64, device=self.device)  # expect[PD001]
