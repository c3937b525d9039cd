"""kernel_op keeps the stub's signature for type checkers (and the op's result type);
the wrapped op runs here on the emulated device with tables of device memory and of
registered host memory, and refuses a raw tensor at run time too."""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from _support import DEVICE, raises
from typing_extensions import assert_type

from pointerdomain import DeviceAlias, PointerTable, alloc_registered, device_empty, make_kernel_ptr_table
from pointerdomain.compat.wrap import KernelOp, kernel_op
from pointerdomain.errors import DomainError, IndexValidationError


def ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t]


def raw_op(src: torch.Tensor, dst: torch.Tensor, indices: torch.Tensor, item_size: int) -> int:
    """A cache's own op: copies slots ``indices`` of every buffer through the raw entries."""
    for s, d in zip(ints(src), ints(dst)):
        for i in ints(indices):
            ctypes.memmove(d + i * item_size, s + i * item_size, item_size)
    return len(indices)


@kernel_op(raw_op, tables=("src", "dst"))
def copy_items(src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], indices: torch.Tensor,
               item_size: int = 16) -> int:
    raise NotImplementedError  # never run: the op runs (a body of ... is mypy's empty-body error here)


assert isinstance(copy_items, KernelOp)
assert_type(copy_items.tables, tuple[str, ...])
assert copy_items.tables == ("src", "dst")

device = [device_empty((4, 16), torch.uint8, DEVICE) for _ in range(2)]
for n, t in enumerate(device):
    t.fill_(n + 1)
with alloc_registered(2 * 4 * 16, DEVICE) as mem:
    host = mem.tensor.view(2, 4, 16)
    host.fill_(0)
    src, dst = make_kernel_ptr_table(device, DEVICE), make_kernel_ptr_table(list(host.unbind(0)), DEVICE)
    assert_type(copy_items(src, dst, torch.tensor([1, 3])), int)
    assert_type(copy_items(src=src, dst=dst, indices=torch.tensor([0]), item_size=16), int)
    assert bool((host[0, 1] == 1).all()) and bool((host[1, 3] == 2).all()) and bool((host[0, 2] == 0).all())
    raw: Any = dst.as_uint64_tensor()  # what a caller without types could pass
    with raises(DomainError, match="dst"):
        copy_items(src, raw, torch.tensor([0]))


# Declared destinations and slot addressing: checked on every call before the op runs.
@kernel_op(raw_op, tables=("src", "dst"), writes=("dst",), slots={"src": ("indices", "item_size"),
                                                                   "dst": ("indices", "item_size")})
def copy_declared(src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], indices: torch.Tensor,
                  item_size: int = 16) -> int:
    raise NotImplementedError  # never run: the op runs


with alloc_registered(2 * 4 * 16, DEVICE) as mem:
    host = mem.tensor.view(2, 4, 16)
    host.fill_(0)
    src, dst = make_kernel_ptr_table(device, DEVICE), make_kernel_ptr_table(list(host.unbind(0)), DEVICE)
    assert_type(copy_declared(src, dst, torch.tensor([2])), int)
    assert bool((host[0, 2] == 1).all()) and bool((host[0, 0] == 0).all())
    with raises(IndexValidationError, match="indices"):
        copy_declared(src, dst, torch.tensor([4]))  # past the entries' 4 slots of 16 bytes
    assert bool((host[:, 0] == 0).all())
