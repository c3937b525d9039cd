# The tensor form keeps the original dtype: int64 without a dtype, int64/long named, uint64.
import torch
from torch import tensor


def no_dtype(bufs):
    return torch.tensor([t.data_ptr() for t in bufs])


def shifted(bufs):
    return no_dtype(bufs) + 8


def named_long(bufs):
    return torch.as_tensor([t.data_ptr() for t in bufs], dtype=torch.long)


def unsigned(bufs):
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)


def chosen_by_the_caller(bufs, dtype):
    return torch.tensor([t.data_ptr() for t in bufs], dtype=dtype)


def bare_builder(bufs):
    return tensor([t.data_ptr() for t in bufs])
