# The module already has its own make_kernel_ptr_table (another signature): the fix must
# not import pointerdomain's under the same name.
import torch

from pool_helpers import make_kernel_ptr_table


class HostPool:
    def __init__(self, bufs, device) -> None:
        self.bufs = bufs
        self.device = device
        self.registered = make_kernel_ptr_table(bufs, device, host_memory_registered=True)
        self.plain = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # expect[PD001]
