"""Checked kernel-table arguments for a cache's own kernels that take tensors (torch
custom ops, Triton kernels through :mod:`pointerdomain.transfer.triton`).

Such kernels receive a table as a ``uint64`` (or ``int64``) tensor of addresses, which
carries no domain: the check has to happen at the boundary, in Python, before the op
or the launch. :func:`kernel_table_tensor` is that boundary::

    def my_gather(table: pd.PointerTable[pd.DeviceAlias], out: torch.Tensor) -> None:
        ptrs = kernel_table_tensor(table, out.device)       # DomainError / DeviceMismatchError / ClosedError
        torch.ops.mycache.gather(ptrs, out)                 # the op reads device aliases only

The C++ counterpart (a nanobind parameter of type ``pointerdomain::KernelTable``) is in
``pointerdomain/nanobind.h`` (:func:`pointerdomain.get_include`); docs/embedding.md
shows the three ways side by side. Plain Python, no optional imports.
"""

from __future__ import annotations

from typing import Literal

import torch

import pointerdomain as pd
from pointerdomain.arguments import describe
from pointerdomain import errors

__all__ = ["TableDtype", "check_kernel_table", "kernel_table_tensor"]

#: ``"uint64"`` (the table's own dtype) or ``"int64"`` (the same bits, for ops and
#: Triton kernels that take signed pointer integers).
TableDtype = Literal["uint64", "int64"]


def check_kernel_table(table: pd.PointerTable[pd.DeviceAlias], device: pd.Device | str | torch.device) -> pd.Device:
    """Check that ``table`` is a kernel table of ``device`` whose registrations are open.

    Returns:
        ``device`` as a :class:`~pointerdomain.Device`.

    Raises:
        DomainError: a ``PointerTable[HostVA]`` (host VAs are for CPU code and transfer
            engines), a raw tensor of addresses, an int, or anything that is not a
            ``PointerTable``.
        DeviceMismatchError: a table of another device.
        ClosedError: a registration the table points into was closed.
        UnpinnedMemoryError: a registration the table points into is on the ``unpinned``
            rung (its entries are host VAs no kernel can read).
        InvalidDeviceError: ``device`` is not a device, or does not exist.
    """
    dev = pd.validate_device(device)  # a device that does not exist is named as such, not as a mismatch
    value: object = table  # checked at run time too: callers may be untyped
    if not isinstance(value, pd.PointerTable):
        if isinstance(value, torch.Tensor):
            raise errors.DomainError(
                "a raw tensor has no address domain: pass the PointerTable[DeviceAlias] itself "
                "(make_kernel_ptr_table); its checked tensor comes from kernel_table_tensor()"
            )
        raise errors.DomainError(
            f"a kernel table argument is a PointerTable[DeviceAlias] (make_kernel_ptr_table), got {type(value).__name__}"
        )
    if value.domain is not pd.DeviceAlias:
        raise errors.DomainError(
            f"{describe(value)} reached a kernel argument: kernels read device aliases only (PointerTable[DeviceAlias] from "
            "make_kernel_ptr_table); host VAs are for CPU code and transfer engines"
        )
    if value.device != dev:
        raise errors.DeviceMismatchError(f"a kernel table of {value.device} was given for a launch on {dev}")
    value.check_live()
    value.check_kernel_readable()
    return dev


def kernel_table_tensor(
    table: pd.PointerTable[pd.DeviceAlias], device: pd.Device | str | torch.device, *, dtype: TableDtype = "uint64"
) -> torch.Tensor:
    """The checked table as a tensor of its device aliases, for an op or kernel that takes
    a pointer tensor.

    Args:
        table: the kernel table.
        device: the device the op or kernel runs on.
        dtype: ``"uint64"`` or ``"int64"`` (a view of the same bits).

    Returns:
        A fresh copy, shape ``[len(table)]``, on the table's device (a CUDA tensor, or a
        CPU tensor for an emulated device): writing to it cannot change what the table's
        own launches read. The entries point into buffers the *table* keeps alive: keep the
        table referenced until the op's work on the stream has completed.

    Raises:
        As :func:`check_kernel_table`; InvalidArgumentError for another ``dtype``.
    """
    check_kernel_table(table, device)
    if dtype not in ("uint64", "int64"):
        raise errors.InvalidArgumentError(f"dtype must be 'uint64' or 'int64', got {describe(dtype)}")
    out = table.as_uint64_tensor()
    return out.view(torch.int64) if dtype == "int64" else out
