"""An op wrapped by kernel_op takes PointerTable[DeviceAlias] in its table parameters,
statically: a raw uint64 tensor of data_ptr() values, a host table, a list of buffers or
a bare alias there is an error, and so is a call the stub's signature does not allow."""

from __future__ import annotations

import torch

from pointerdomain import DeviceAlias, HostVA, PointerTable
from pointerdomain.compat.wrap import kernel_op


def raw_op(src: torch.Tensor, dst: torch.Tensor, indices: torch.Tensor, item_size: int) -> None: ...


@kernel_op(raw_op)
def copy_items(src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], indices: torch.Tensor,
               item_size: int = 16) -> None: ...


def calls(kernel: PointerTable[DeviceAlias], host: PointerTable[HostVA], raw: torch.Tensor,
          buffers: list[torch.Tensor], idx: torch.Tensor) -> None:
    copy_items(kernel, raw, idx)  # type: ignore[arg-type]
    copy_items(raw, kernel, idx)  # type: ignore[arg-type]
    copy_items(kernel, host, idx)  # type: ignore[arg-type]
    copy_items(src=host, dst=kernel, indices=idx)  # type: ignore[arg-type]
    copy_items(kernel, buffers, idx)  # type: ignore[arg-type]
    copy_items(kernel, kernel[0], idx)  # type: ignore[arg-type]
    copy_items(kernel, kernel, idx, item_size="16")  # type: ignore[arg-type]
    copy_items(kernel, kernel, idx, stream=0)  # type: ignore[call-arg]
    copy_items(kernel, kernel)  # type: ignore[call-arg]
    copy_items.tables = ("src",)  # type: ignore[misc]


kernel_op(raw_op, writes=3)  # type: ignore[arg-type]
kernel_op(raw_op, slots=["dst", "indices"])  # type: ignore[arg-type]
