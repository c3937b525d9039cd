# A function annotated to return a tensor: the table rewrite passes the structural checks
# (returning the value is fine) and mypy (--check-untyped-defs) then reports the new error,
# so the fix is refused.
import torch


def build(bufs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # expect[PD001]
    return ptrs
