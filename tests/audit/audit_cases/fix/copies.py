# A table copied to another name or attribute: the copy's reads are not followed, so the site stays.
import torch
from sgl_kernel import transfer_kv_all_layer


def aliased(bufs: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> None:
    tbl = torch.tensor([x.data_ptr() for x in bufs], dtype=torch.uint64, device="cuda")
    t2 = tbl
    transfer_kv_all_layer(t2, a, b)


def aliased_int64(bufs: list[torch.Tensor]) -> object:
    tbl = torch.tensor([x.data_ptr() for x in bufs], dtype=torch.int64)
    t2 = tbl
    return t2.sum()


class Pool:
    def __init__(self, bufs: list[torch.Tensor]) -> None:
        self.tbl = torch.tensor([x.data_ptr() for x in bufs], dtype=torch.uint64, device="cuda")
        self.other = self.tbl

    def run(self, a: torch.Tensor, b: torch.Tensor) -> None:
        transfer_kv_all_layer(self.other, a, b)


def returned(bufs: list[torch.Tensor]) -> object:
    tbl = torch.tensor([x.data_ptr() for x in bufs], dtype=torch.uint64)
    return tbl
