"""Kernel tables as arguments of ``@triton.jit`` kernels, checked before the launch.

Triton translates the tensors it is passed (their ``data_ptr()``), never the integers
inside a tensor of addresses: a kernel that loads pointers from a table reads exactly
what the table holds, so the table must hold device aliases of the launch's device. A
raw ``uint64`` tensor carries no domain (vLLM PR #49836 faulted on ROCm with one), so
here a table enters a launch only as a ``PointerTable[DeviceAlias]``:

* :func:`kernel_table_arg` -- the checked table as an ``int64`` tensor of its aliases
  (same bits as the table's ``uint64`` array), for ``kernel[grid](...)``;
* :func:`launch` -- ``kernel[grid](*args, **kwargs)`` where every ``PointerTable``
  argument is checked and replaced by its tensor, a raw ``uint64`` tensor or a bare
  ``HostVA`` / ``DeviceAlias`` is refused, CUDA tensors of another device are refused,
  and the launch runs with ``device`` current.

In the kernel, an entry becomes a pointer with a cast (Triton: int -> pointer)::

    @triton.jit
    def gather(table, ...):
        base = tl.load(table + i).to(tl.pointer_type(tl.uint8))   # byte pointer to entry i
        tl.store(dst + offs, tl.load(base + offs))

Importing this module does not import Triton; :func:`launch` does. The checks are
plain Python (:mod:`pointerdomain.transfer.kernel_args`) and run without Triton or a GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.transfer.kernel_args import kernel_table_tensor

__all__ = ["TritonUnavailableError", "kernel_table_arg", "launch", "launch_args"]


class TritonUnavailableError(errors.PointerDomainError, ImportError):
    """Triton is not installed or does not import."""


def kernel_table_arg(table: pd.PointerTable[pd.DeviceAlias], device: pd.Device | str | torch.device) -> torch.Tensor:
    """The checked table as a Triton pointer-table argument.

    Returns:
        ``int64`` tensor ``[len(table)]`` of the device aliases (a fresh copy, on the
        table's device); the kernel casts an entry with ``.to(tl.pointer_type(...))``.

    Raises:
        DomainError: a ``PointerTable[HostVA]``, a raw tensor, an int or anything else.
        DeviceMismatchError: a table of another device.
        ClosedError: a registration the table points into was closed.
    """
    return kernel_table_tensor(table, device, dtype="int64")


def _arg(name: str, value: object, device: pd.Device) -> object:
    if isinstance(value, pd.PointerTable):
        return kernel_table_arg(value, device)
    if isinstance(value, (pd.HostVA, pd.DeviceAlias)):
        raise errors.DomainError(
            f"{name}: a bare {type(value).__name__} reached a Triton launch; pass a PointerTable[DeviceAlias] "
            "(make_kernel_ptr_table) and load its entries in the kernel"
        )
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.uint64:
            raise errors.DomainError(
                f"{name}: a raw uint64 tensor (an untyped pointer table?) reached a Triton launch; pass the "
                "PointerTable[DeviceAlias] itself, launch() checks it and passes its aliases"
            )
        if value.is_cuda and value.device.index != device.ordinal:
            raise errors.DeviceMismatchError(f"{name}: a tensor on {value.device}, but the launch is on {device}")
    return value


def launch_args(
    device: pd.Device | str | torch.device, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[list[object], dict[str, object]]:
    """The checked arguments :func:`launch` passes to the kernel (tables replaced by their
    ``int64`` alias tensors). Raises as :func:`launch`, without launching."""
    dev = pd.validate_device(device)
    return ([_arg(f"args[{i}]", a, dev) for i, a in enumerate(args)],
            {k: _arg(k, v, dev) for k, v in kwargs.items()})


def launch(kernel: Any, grid: Any, *args: object, device: pd.Device | str | torch.device, **kwargs: object) -> Any:
    """``kernel[grid](*args, **kwargs)`` on CUDA ``device`` with every table checked first.

    Args:
        kernel: a ``@triton.jit`` function (or anything indexable by ``grid``).
        grid: Triton's launch grid (a tuple, or a callable of the meta-parameters).
        args, kwargs: the kernel's arguments; a ``PointerTable[DeviceAlias]`` becomes its
            ``int64`` alias tensor; constexprs and launch options pass through.
        device: the CUDA device to launch on (made current for the launch; Triton uses
            the current stream of the current device).

    Returns:
        What ``kernel[grid](...)`` returns.

    Raises:
        InvalidDeviceError: ``device`` is not a CUDA device.
        DomainError: a host-VA table, a raw ``uint64`` tensor, a bare address.
        DeviceMismatchError: a table or CUDA tensor of another device.
        ClosedError: a table whose registration was closed.
        TritonUnavailableError: Triton does not import.

    The tables' copies are freed after the call on the current stream (stream-ordered
    reuse by torch's allocator is safe); the tables' *buffers* must stay alive until the
    kernel has run: keep the tables referenced, as for the library's own launches.
    """
    dev = pd.as_device(device)
    if dev.runtime.host_memory:
        raise errors.InvalidDeviceError(f"Triton launches need a CUDA device, got {dev}")
    conv_args, conv_kwargs = launch_args(dev, args, kwargs)
    try:
        importlib.import_module("triton")
    except Exception as exc:
        raise TritonUnavailableError(f"Triton does not import ({type(exc).__name__}: {exc})") from exc
    with torch.cuda.device(dev.ordinal):
        return kernel[grid](*conv_args, **conv_kwargs)
