"""Helpers shared by the adapters (private)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain.devices import Device
from pointerdomain.errors import DomainError, IndexValidationError, LayoutError
from pointerdomain.layouts import DType, KVLayout
from pointerdomain.devices import validate_device
from pointerdomain.allocation import memory_device
from pointerdomain.tables import PointerTable, make_kernel_ptr_table

__all__ = ["DevicePool", "check_kernel_table", "dtype_name", "index_list", "kernel_table_checked", "launch_options", "same_device", "tensor_nbytes"]

_DTYPE_NAMES: dict[torch.dtype, DType] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
}


class DevicePool(Protocol):
    """What a host pool needs from a device pool: its layout and its kernel table.

    :class:`pointerdomain.DeviceKVPool` and
    :class:`pointerdomain.adapters.sglang.DeviceKVBuffers` satisfy it.
    """

    @property
    def layout(self) -> KVLayout: ...

    @property
    def table(self) -> PointerTable[DeviceAlias]: ...


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def kernel_table_checked(
    tensors: Sequence[torch.Tensor],
    target_device: Device | str | torch.device,
    *,
    host_memory_registered: bool,
) -> PointerTable[DeviceAlias]:
    """``make_kernel_ptr_table`` after checking every tensor against ``host_memory_registered``
    (True: registered host memory; False: device memory). See
    :func:`pointerdomain.adapters.sglang.make_kernel_ptr_table`.

    Raises:
        DomainError: a tensor of the other kind; and the core builder's errors.
    """
    dev = validate_device(target_device)
    for i, t in enumerate(tensors):
        if not _is_tensor(t):
            continue  # the core builder names the type
        where = memory_device(t)
        is_host = where is None and t.device.type == "cpu"
        if host_memory_registered and not is_host:
            raise DomainError(
                f"tensors[{i}]: memory of {where or t.device}, but host_memory_registered=True says the "
                "tensors are registered host memory"
            )
        if not host_memory_registered and is_host:
            raise DomainError(
                f"tensors[{i}]: host memory at {HostVA(t.data_ptr())!r} with host_memory_registered=False: its "
                f"data_ptr() is a host VA, not an address a kernel on {dev} may use. Register it "
                "(pointerdomain.register_host_tensor) and pass host_memory_registered=True"
            )
    return make_kernel_ptr_table(tensors, dev)


def launch_options(stream: int | None, max_ctas: int | None) -> dict[str, Any]:
    """Keyword arguments for a transfer launch, leaving out the ones not given (so the
    launch functions' own defaults apply)."""
    options: dict[str, Any] = {}
    if stream is not None:
        options["stream"] = stream
    if max_ctas is not None:
        options["max_ctas"] = max_ctas
    return options


def dtype_name(dtype: torch.dtype) -> DType:
    """The :class:`KVLayout` name of a torch dtype.

    Raises:
        LayoutError: a dtype the kernels do not move.
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise LayoutError(f"dtype {dtype} is not a KV dtype; expected one of {sorted(_DTYPE_NAMES.values())}") from None


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (``numel * element_size``)."""
    return int(t.numel() * t.element_size())


def check_kernel_table(name: str, table: object) -> PointerTable[DeviceAlias]:
    """``table`` if it is a live ``PointerTable[DeviceAlias]``.

    Raises:
        DomainError: any other object, or a ``PointerTable[HostVA]``.
        ClosedError: its registered memory was closed.
    """
    if not isinstance(table, PointerTable) or table.domain is not DeviceAlias:
        what = f"PointerTable[{table.domain.__name__}]" if isinstance(table, PointerTable) else type(table).__name__
        raise DomainError(
            f"{name}: expected a PointerTable[DeviceAlias] (from make_kernel_ptr_table), got {what}; "
            "copy descriptors and kernels take device aliases, never host VAs"
        )
    table.check_live()
    return table


def index_list(name: str, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``ids`` as a contiguous 1-D ``int64`` CPU tensor.

    Raises:
        IndexValidationError: not 1-D, or not integers.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise IndexValidationError(f"{name}: dtype {ids.dtype}, expected an integer dtype")
        out = ids.detach().to("cpu", torch.int64).contiguous()
    else:
        values = list(ids)
        if any(type(v) is not int for v in values):
            raise IndexValidationError(f"{name}: expected ints, got {[type(v).__name__ for v in values][:4]}")
        out = torch.tensor(values, dtype=torch.int64)
    if out.dim() != 1:
        raise IndexValidationError(f"{name}: shape {tuple(out.shape)}, expected 1-D")
    return out


def same_device(name: str, a: Device | None, b: Device | None) -> Device:
    """The common device of two kernel tables.

    Raises:
        DomainError: a host table (no device).
        DeviceMismatchError: different devices.
    """
    from pointerdomain.errors import DeviceMismatchError

    if a is None or b is None:
        raise DomainError(f"{name}: a host table has no device")
    if a != b:
        raise DeviceMismatchError(f"{name}: tables for {a} and {b}; a batch copy runs on one device")
    return a
