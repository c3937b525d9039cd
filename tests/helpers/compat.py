"""Byte helpers of the engine call-shape tests (tests/compat): destinations poisoned with
:data:`POISON` before a call, bytes compared after it, and sglang's ``uint64`` pointer
tables of ``data_ptr()`` values in device memory."""

from __future__ import annotations

import torch

import pointerdomain as pd

#: The byte a destination is filled with before a call: what must not be written stays it.
POISON = 0xA5


def u8(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (a ``uint8`` view)."""
    return t.view(torch.uint8)


def rand(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled with random bytes (returned)."""
    b = u8(t)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
    return t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bytes."""
    return torch.equal(u8(a).reshape(-1), u8(b).reshape(-1))


def untouched(*ts: torch.Tensor) -> bool:
    """Every byte of every tensor is still :data:`POISON`."""
    return all(bool((u8(t) == POISON).all()) for t in ts)


def dev(*shape: int, dtype: torch.dtype, device: pd.Device) -> torch.Tensor:
    """Device memory of ``device``, uninitialised."""
    return pd.device_empty(shape, dtype=dtype, device=device)


def table(ts: list[torch.Tensor], device: pd.Device) -> torch.Tensor:
    """sglang's ``k_data_ptrs``: a ``uint64`` table of the tensors' ``data_ptr()`` values,
    itself in device memory of ``device``."""
    t = pd.device_empty((len(ts),), dtype=torch.uint64, device=device)
    return t.copy_(torch.tensor([x.data_ptr() for x in ts], dtype=torch.uint64))
