# A consumer annotated to take a tensor: the table rewrite passes the structural checks and
# mypy (--check-untyped-defs) then reports the new error, so the fix is refused.
import torch


def launch(table: torch.Tensor, n: int) -> None:
    del table, n


def build(bufs, device):
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)  # expect[PD001]
    launch(ptrs, len(bufs))
