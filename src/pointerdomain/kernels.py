"""The typed launch API for KV page transfers.

Launch functions accept only ``PointerTable[DeviceAlias]`` (mypy) and check, at
runtime and before anything is launched: the tables' domain and device, that
their registrations are still open, that each table fits its layout (so every
address the kernel forms lies inside a table entry's buffer), and the index
tensors (``int64``, 1-D, contiguous, on the launch device, equal length, every
slot in range). A kernel therefore never reads or writes outside the tables it
was given; the kernels also skip out-of-range slots themselves, which covers a
CUDA graph replayed with new indices (host-side range checks cannot run during
capture).

Ordering (CUDA): the launch is enqueued on ``stream`` (default: the current
stream of the tables' device) and is asynchronous. The caller orders it after
the work that produced the source (same stream, or an event) and keeps the
tables and index tensors alive until the stream reaches it.
"""

from __future__ import annotations

from typing import Any

import torch

from pointerdomain import checked
from pointerdomain._extension import extension
from pointerdomain.domains import Device, DeviceAlias
from pointerdomain.errors import (
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    LayoutError,
    RuntimeCallError,
)
from pointerdomain.guard import validate_device
from pointerdomain.layouts import Geometry, KVLayout
from pointerdomain.tables import PointerTable

__all__ = ["transfer_kv_all_layer", "transfer_kv_per_layer"]


def _check_table(name: str, table: Any) -> Device:
    if not isinstance(table, PointerTable):
        raise DomainError(f"{name}: expected a PointerTable[DeviceAlias], got {type(table).__name__}")
    if table.domain is not DeviceAlias:
        raise DomainError(
            f"{name}: a PointerTable[{table.domain.__name__}] reached a kernel launch; kernels need "
            "PointerTable[DeviceAlias] (host VAs are not device addresses where "
            "CanUseHostPointerForRegisteredMem is 0). Build it with make_kernel_ptr_table(tensors, device)"
        )
    assert table.device is not None
    table.check_live()
    return table.device


def _check_indices(name: str, idx: Any, device: Device) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor):
        raise IndexValidationError(f"{name}: expected an int64 tensor, got {type(idx).__name__}")
    if idx.dtype != torch.int64:
        raise IndexValidationError(f"{name}: dtype {idx.dtype}, expected torch.int64")
    if idx.dim() != 1:
        raise IndexValidationError(f"{name}: shape {tuple(idx.shape)}, expected 1-D")
    if not idx.is_contiguous():
        raise IndexValidationError(f"{name}: not contiguous (stride {idx.stride()})")
    want = device.torch_device
    if idx.device != want and not (want.type == "cuda" and idx.device.type == "cuda" and idx.device.index == device.ordinal):
        raise IndexValidationError(f"{name}: on {idx.device}, but the launch runs on {device} (indices must be on {want})")
    return idx


def _check_range(src_idx: torch.Tensor, dst_idx: torch.Tensor, src_slots: int, dst_slots: int, device: Device) -> None:
    if src_idx.numel() == 0:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # no host sync during capture; the kernel skips out-of-range slots
    lo_s, hi_s, lo_d, hi_d = torch.stack([src_idx.min(), src_idx.max(), dst_idx.min(), dst_idx.max()]).tolist()
    for name, lo, hi, slots in (("src_indices", lo_s, hi_s, src_slots), ("dst_indices", lo_d, hi_d, dst_slots)):
        if lo < 0 or hi >= slots:
            bad = lo if lo < 0 else hi
            raise IndexValidationError(f"{name}: slot {bad} outside [0, {slots}); nothing was copied")


def _launch(
    src: PointerTable[DeviceAlias],
    src_layout: KVLayout,
    dst: PointerTable[DeviceAlias],
    dst_layout: KVLayout,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_count: int,
    stream: int | None,
    max_ctas: int | None,
) -> None:
    device = _check_table("src", src)
    dst_device = _check_table("dst", dst)
    if dst_device != device:
        raise DeviceMismatchError(f"src table is for {device} but dst table is for {dst_device}")
    validate_device(device)
    for field in ("attention", "num_layers", "page_size", "num_heads", "head_dim", "dtype"):
        if getattr(src_layout, field) != getattr(dst_layout, field):
            raise LayoutError(
                f"src and dst layouts differ in {field}: {getattr(src_layout, field)!r} vs {getattr(dst_layout, field)!r}"
            )
    src_geo: Geometry = src_layout.geometry(len(src), src.sizes, "src")
    dst_geo: Geometry = dst_layout.geometry(len(dst), dst.sizes, "dst")
    s_idx = _check_indices("src_indices", src_indices, device)
    d_idx = _check_indices("dst_indices", dst_indices, device)
    if s_idx.numel() != d_idx.numel():
        raise IndexValidationError(f"src_indices has {s_idx.numel()} slots but dst_indices has {d_idx.numel()}")
    _check_range(s_idx, d_idx, src_layout.num_slots, dst_layout.num_slots, device)
    if max_ctas is not None and (type(max_ctas) is not int or max_ctas <= 0):
        raise ValueError(f"max_ctas must be a positive int or None, got {max_ctas!r}")
    n = s_idx.numel()
    if n == 0:
        return
    if checked.enabled():
        checked.verify_launch(src, src_layout, dst, dst_layout, s_idx, d_idx, layer_begin, layer_count)
    layout = src_layout
    common = (
        src.as_uint64_tensor().data_ptr(), src_geo, dst.as_uint64_tensor().data_ptr(), dst_geo,
        s_idx.data_ptr(), d_idx.data_ptr(), n, layout.page_size, layout.num_kv, layer_begin, layer_count,
        layout.item_bytes,
    )
    ext = extension()
    if device.type == "emulated":
        ext.cpu_transfer(*common, torch.get_num_threads())
        return
    vec = layout.vector_bytes(src.alignment, dst.alignment, *src_geo[3:7], *dst_geo[3:7])
    if stream is None:
        stream = int(torch.cuda.current_stream(device.torch_device).cuda_stream)
    status = ext.gpu_transfer(*common, device.ordinal, stream, max_ctas or 0, vec)
    if status != 0:
        raise RuntimeCallError("transfer kernel launch", int(status), str(ext.gpu_error_string(status)))


def transfer_kv_all_layer(
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    src_layout: KVLayout,
    dst_layout: KVLayout,
    stream: int | None = None,
    max_ctas: int | None = None,
) -> None:
    """Copy token slots ``src_indices[i] -> dst_indices[i]`` for every layer and K/V.

    Use for a device pool -> host pool backup (D2H) or a load back (H2D); the
    direction follows from which table is which.

    Args:
        src, dst: kernel tables (see :func:`make_kernel_ptr_table`) over buffers of
            ``src_layout`` / ``dst_layout``; same device.
        src_indices, dst_indices: ``int64`` 1-D token slots of equal length ``n``,
            on the launch device (CPU for an emulated device).
        src_layout, dst_layout: must agree on everything but ``kind`` and ``num_pages``.
        stream: a ``cudaStream_t`` as an int; default the device's current stream.
        max_ctas: at most this many CTAs (thread blocks); None: up to 4 per SM.

    Moves ``n * num_kv * num_layers * item_bytes`` bytes.

    Raises:
        DomainError: a table is not a PointerTable[DeviceAlias].
        DeviceMismatchError: the tables are for different devices.
        ClosedError: a table's registered memory was closed.
        LayoutError: layouts disagree, or a table does not fit its layout.
        IndexValidationError: bad dtype, shape, device, lengths, or a slot out of range.
        RuntimeCallError: the launch failed.
    """
    _launch(src, src_layout, dst, dst_layout, src_indices, dst_indices, 0, src_layout.num_layers, stream, max_ctas)


def transfer_kv_per_layer(
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    layer_id: int,
    src_layout: KVLayout,
    dst_layout: KVLayout,
    stream: int | None = None,
    max_ctas: int | None = None,
) -> None:
    """As :func:`transfer_kv_all_layer`, for one layer (layer-by-layer loading that
    overlaps the forward pass). Moves ``n * num_kv * item_bytes`` bytes.

    Raises:
        IndexValidationError: ``layer_id`` outside ``[0, num_layers)``; and all of
            :func:`transfer_kv_all_layer`'s errors.
    """
    if type(layer_id) is not int or not 0 <= layer_id < src_layout.num_layers:
        raise IndexValidationError(f"layer_id {layer_id!r} outside [0, {src_layout.num_layers})")
    _launch(src, src_layout, dst, dst_layout, src_indices, dst_indices, layer_id, 1, stream, max_ctas)
