# Tables whose value leaves for consumers the fix cannot see: each site stays (table style).
from typing import Any

import torch


def returned_untyped(bufs, device):
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=device)


def checksum(bufs, device):
    return int(returned_untyped(bufs, device).sum())


def returned_any(bufs: list[torch.Tensor]) -> Any:
    tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)
    return tbl


class Pool:
    def __init__(self, bufs, device):
        self.ptrs = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=device)


def total(pool):
    return pool.ptrs.sum()


class ByName:
    def __init__(self, bufs, device):
        self.named = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=device)

    def total(self):
        return getattr(self, "named").sum()


class SetByName:
    def __init__(self, bufs, name):
        self.table = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)
        setattr(self, name, None)


def onto_another_object(pool, bufs):
    pool.ptrs = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)


def into_a_dict(cache, bufs):
    cache["ptrs"] = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)


def into_a_list(tables, bufs):
    tables.append(torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64))


MODULE_TABLE = torch.tensor([t.data_ptr() for t in [torch.zeros(1)]], dtype=torch.uint64)


class ClassLevel:
    TABLE = torch.tensor([t.data_ptr() for t in [torch.zeros(1)]], dtype=torch.uint64)


def returned_typed(bufs: list[torch.Tensor]) -> object:
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)


class Private:
    def __init__(self, bufs: list[torch.Tensor]) -> None:
        self.own = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)

    def size(self) -> object:
        return self.own.device


def typed_but_summed(bufs: list[torch.Tensor]) -> object:
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)


def summed(bufs):
    return typed_but_summed(bufs).sum()
