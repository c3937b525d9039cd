import torch


def kept_by_own_line_comment(bufs, device):
    # pointerdomain: ignore[PD001] consumed by an int64 kernel
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)
    return table


def kept_by_trailing_comment(bufs, device):
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # pointerdomain: ignore[PD001] legacy


def reported(bufs, device) -> object:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)
