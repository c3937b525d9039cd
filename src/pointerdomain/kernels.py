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

import weakref
from typing import Any, Literal, NamedTuple, cast

import torch

from pointerdomain import checked
from pointerdomain._extension import extension
from pointerdomain.domains import Device, DeviceAlias
from pointerdomain.errors import (
    ClosedError,
    InvalidArgumentError,
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    LayoutError,
    RuntimeCallError,
)
from pointerdomain.layouts import Geometry, KVLayout
from pointerdomain.tables import PointerTable

__all__ = ["DEFAULT_MAX_CTAS", "Backend", "kernel_config", "transfer_kv_all_layer", "transfer_kv_per_layer"]


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
    if (idx.get_device() != device.ordinal) if device.type == "cuda" else idx.is_cuda or idx.is_meta:
        raise IndexValidationError(
            f"{name}: on {idx.device}, but the launch runs on {device} (indices must be on {device.torch_device})"
        )
    return idx


def _check_range(src_idx: torch.Tensor, dst_idx: torch.Tensor, src_slots: int, dst_slots: int, device: Device) -> None:
    if src_idx.numel() == 0:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # no host sync during capture; the kernel skips out-of-range slots
    if not src_idx.is_cuda and src_idx.numel() <= 512:  # small CPU index sets: list min/max beats tensor ops
        s_list, d_list = src_idx.tolist(), dst_idx.tolist()
        lo_s, hi_s, lo_d, hi_d = min(s_list), max(s_list), min(d_list), max(d_list)
    else:  # one host sync for both tensors
        (lo_s, hi_s), (lo_d, hi_d) = torch.stack([*torch.aminmax(src_idx), *torch.aminmax(dst_idx)]).view(2, 2).tolist()
    for name, lo, hi, slots in (("src_indices", lo_s, hi_s, src_slots), ("dst_indices", lo_d, hi_d, dst_slots)):
        if lo < 0 or hi >= slots:
            bad = lo if lo < 0 else hi
            raise IndexValidationError(f"{name}: slot {bad} outside [0, {slots}); nothing was copied")


#: Default SM budget: serving engines give copy kernels a few CTAs so the copy
#: overlaps model compute (field notes). None = the whole GPU.
DEFAULT_MAX_CTAS = 4

#: Runs at least this long go to the copy engine under ``backend="auto"``. Measured on
#: the H200 (docs/performance.md): cudaMemcpyBatchAsync of 64 KiB runs gave 0.72-0.79 x
#: bulk while the kernel gave 0.91-0.94 x with only 2-4 CTAs, so the engine only pays
#: for runs far longer than a KV item, where it approaches a bulk copy and frees the SMs.
CE_MIN_RUN_BYTES_SMALL_BUDGET = 512 << 10
CE_MIN_RUN_BYTES_WHOLE_GPU = 1 << 20

Backend = Literal["auto", "kernel", "copy_engine"]

class _Plan(NamedTuple):
    """What a launch needs that depends only on the (immutable) tables and layouts."""

    dst: weakref.ref[PointerTable[DeviceAlias]]
    src_layout: KVLayout
    dst_layout: KVLayout
    device: Device
    src_geo: Geometry
    dst_geo: Geometry
    run_bytes: int
    vec_max: int
    #: (src table ptr, src geometry, dst table ptr, dst geometry, page_size, num_kv, item_bytes)
    kernel_args: tuple[int, Geometry, int, Geometry, int, int, int]
    config: tuple[int, int, int]  # threads, items in flight, word bytes


_plans: weakref.WeakKeyDictionary[PointerTable[DeviceAlias], dict[tuple[int, int, int], _Plan]] = (
    weakref.WeakKeyDictionary()
)


def _plan(src: PointerTable[DeviceAlias], src_layout: KVLayout, dst: PointerTable[DeviceAlias], dst_layout: KVLayout) -> _Plan:
    """Domain, device and layout checks, once per (src, dst, layouts); cached while the tables live."""
    key = (id(dst), id(src_layout), id(dst_layout))
    per_src = _plans.get(src) if isinstance(cast(object, src), PointerTable) else None
    plan = per_src.get(key) if per_src is not None else None
    if plan is not None and plan.dst() is dst and plan.src_layout is src_layout and plan.dst_layout is dst_layout:
        return plan
    device = _check_table("src", src)
    dst_device = _check_table("dst", dst)
    if dst_device != device:
        raise DeviceMismatchError(f"src table is for {device} but dst table is for {dst_device}")
    for name, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"{name} must be a KVLayout, got {type(layout).__name__}")
    for field in ("attention", "num_layers", "page_size", "num_heads", "head_dim", "dtype"):
        if getattr(src_layout, field) != getattr(dst_layout, field):
            raise LayoutError(
                f"src and dst layouts differ in {field}: "
                f"{getattr(src_layout, field)!r} vs {getattr(dst_layout, field)!r}"
            )
    src_geo = src_layout.geometry(len(src), src.sizes, "src")
    dst_geo = dst_layout.geometry(len(dst), dst.sizes, "dst")
    vec_max = src_layout.vector_bytes(src.alignment, dst.alignment, *src_geo[3:7], *dst_geo[3:7])
    plan = _Plan(
        weakref.ref(dst), src_layout, dst_layout, device, src_geo, dst_geo,
        _run_bytes(src_layout, src_geo, dst_geo), vec_max,
        (src.kernel_table_address(), src_geo, dst.kernel_table_address(), dst_geo,
         src_layout.page_size, src_layout.num_kv, src_layout.item_bytes),
        kernel_config(vec_max),
    )
    _plans.setdefault(src, {})[key] = plan
    return plan


def _current_stream(device: Device) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~10x cheaper
    if raw is not None:
        return int(raw(device.ordinal))
    return int(torch.cuda.current_stream(device.torch_device).cuda_stream)


def kernel_config(vec_max: int) -> tuple[int, int, int]:
    """(threads per CTA, items in flight per warp, copy word bytes) for a launch whose
    addresses and strides allow ``vec_max``-byte words.

    From the H200 sweep (benchmarks/sweep_kernel.py, docs/performance.md): 1024
    threads per CTA with 4 items in flight per warp and 16-byte words was within
    3% of the best configuration at every budget (2, 4, 8 CTAs, whole GPU), both
    directions, 1 KiB to 2 KiB items; smaller CTAs lose up to 3x at 2 CTAs. One
    configuration serves both directions and every budget (the whole GPU is one
    such CTA per SM, see transfer_gpu.cu).
    """
    return 1024, 4, vec_max


def _run_bytes(src_layout: KVLayout, src_geo: Geometry, dst_geo: Geometry) -> int:
    """Longest contiguous run a page can give on both sides (token stride == item)."""
    item = src_layout.item_bytes
    return src_layout.page_size * item if src_geo[6] == item and dst_geo[6] == item else item


def _copy_runs(
    src: PointerTable[DeviceAlias], src_geo: Geometry, dst: PointerTable[DeviceAlias], dst_geo: Geometry,
    s_idx: torch.Tensor, d_idx: torch.Tensor, layout: KVLayout, layer_begin: int, layer_count: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-copy (dst, src, nbytes) arrays on the host: items merged into runs of
    consecutive slots that stay inside one page on both sides (a run never crosses a
    table entry, so never two registrations)."""
    item, ps = layout.item_bytes, layout.page_size
    s = s_idx.cpu()
    d = d_idx.cpu()
    kv = torch.arange(layout.num_kv).view(1, -1, 1)
    layer = torch.arange(layer_begin, layer_begin + layer_count).view(1, 1, -1)

    def addresses(table: PointerTable[DeviceAlias], g: Geometry, slots: torch.Tensor) -> torch.Tensor:
        values = torch.tensor(table.raw_values(), dtype=torch.int64)
        page, tok = (slots // ps).view(-1, 1, 1), (slots % ps).view(-1, 1, 1)
        entry = kv * g[0] + layer * g[1] + page * g[2]
        return values[entry] + kv * g[3] + layer * g[4] + page * g[5] + tok * g[6]

    sa = addresses(src, src_geo, s).permute(1, 2, 0).reshape(-1)  # (kv, layer, i) order: runs along i
    da = addresses(dst, dst_geo, d).permute(1, 2, 0).reshape(-1)
    same_page = torch.zeros(s.numel(), dtype=torch.bool)  # slot i continues slot i-1's page on both sides
    same_page[1:] = (s[1:] // ps == s[:-1] // ps) & (d[1:] // ps == d[:-1] // ps)
    same_page = same_page.repeat(layout.num_kv * layer_count)
    cont = torch.zeros_like(same_page)
    cont[1:] = (sa[1:] == sa[:-1] + item) & (da[1:] == da[:-1] + item) & same_page[1:]
    starts = torch.nonzero(~cont).view(-1)
    lengths = torch.diff(starts, append=torch.tensor([sa.numel()])) * item
    return da[starts], sa[starts], lengths


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
    backend: Backend,
    validate_indices: bool,
) -> None:
    plan = _plan(src, src_layout, dst, dst_layout)
    device = plan.device
    cuda = device.type == "cuda"
    for name, table in (("src", src), ("dst", dst)):
        try:
            table.check_live()
        except ClosedError as exc:
            raise ClosedError(f"{name}: {exc}; rebuild the table over open registered memory") from None
    s_idx = _check_indices("src_indices", src_indices, device)
    d_idx = _check_indices("dst_indices", dst_indices, device)
    n = s_idx.numel()
    if n != d_idx.numel():
        raise IndexValidationError(f"src_indices has {n} slots but dst_indices has {d_idx.numel()}")
    if max_ctas is not None and (type(max_ctas) is not int or max_ctas <= 0):
        raise InvalidArgumentError(f"max_ctas must be a positive int or None, got {max_ctas!r}")
    if backend != "kernel" and backend != "auto" and backend != "copy_engine":
        raise InvalidArgumentError(f"backend must be 'auto', 'kernel' or 'copy_engine', got {backend!r}")
    if stream is not None and (type(stream) is not int or stream < 0):
        raise InvalidArgumentError(f"stream must be a cudaStream_t as a non-negative int or None, got {stream!r}")
    if type(validate_indices) is not bool:
        raise InvalidArgumentError(f"validate_indices must be a bool, got {validate_indices!r}")
    if backend == "auto":
        threshold = CE_MIN_RUN_BYTES_WHOLE_GPU if max_ctas is None else CE_MIN_RUN_BYTES_SMALL_BUDGET
        long_runs = plan.run_bytes >= threshold
        backend = "copy_engine" if long_runs and not (cuda and torch.cuda.is_current_stream_capturing()) else "kernel"
    elif backend == "copy_engine" and cuda and torch.cuda.is_current_stream_capturing():
        raise InvalidArgumentError(
            "backend='copy_engine' reads the indices on the host and cannot be captured in a CUDA graph"
        )
    if validate_indices or backend == "copy_engine":  # the copy engine reads the indices on the host anyway
        _check_range(s_idx, d_idx, src_layout.num_slots, dst_layout.num_slots, device)
    if n == 0:
        return
    if checked.enabled():
        checked.verify_launch(src, src_layout, dst, dst_layout, s_idx, d_idx, layer_begin, layer_count)
    ext = extension()
    if stream is None and cuda:
        stream = _current_stream(device)
    if backend == "copy_engine":
        dsts, srcs, sizes = _copy_runs(
            src, plan.src_geo, dst, plan.dst_geo, s_idx, d_idx, src_layout, layer_begin, layer_count
        )
        if not cuda:
            ext.cpu_copy_runs(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), dsts.numel())
            return
        status = ext.gpu_copy_runs(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), dsts.numel(),
                                   device.ordinal, stream, bool(ext.gpu_has_batch_copy))
        if status != 0:
            raise RuntimeCallError("cudaMemcpyBatchAsync", int(status), str(ext.gpu_error_string(status)))
        return
    src_ptr, src_geo, dst_ptr, dst_geo, page_size, num_kv, item_bytes = plan.kernel_args
    if not cuda:
        ext.cpu_transfer(src_ptr, src_geo, dst_ptr, dst_geo, s_idx.data_ptr(), d_idx.data_ptr(), n, page_size,
                         num_kv, layer_begin, layer_count, item_bytes, torch.get_num_threads())
        return
    vec = plan.config[2]
    status = ext.gpu_transfer(src_ptr, src_geo, dst_ptr, dst_geo, s_idx.data_ptr(), d_idx.data_ptr(), n, page_size,
                              num_kv, layer_begin, layer_count, item_bytes, device.ordinal, stream, max_ctas or 0,
                              vec)
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
    max_ctas: int | None = DEFAULT_MAX_CTAS,
    backend: Backend = "auto",
    validate_indices: bool = True,
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
        max_ctas: SM budget: at most this many CTAs (thread blocks) for the kernel
            (default :data:`DEFAULT_MAX_CTAS` = 4, so the copy overlaps compute);
            None: the whole GPU. Ignored on the emulated device.
        backend: ``"kernel"`` (graph-safe: no host sync, allocation or index read),
            ``"copy_engine"`` (cudaMemcpyBatchAsync of runs of consecutive slots inside
            a page, fed device aliases; reads the indices on the host, so it syncs on
            CUDA indices and cannot be captured), or ``"auto"``: the copy engine when
            both layouts give runs of at least 512 KiB (1 MiB with the whole GPU) and
            not capturing, else the kernel (faster than the engine up to 64 KiB runs
            even at 2 CTAs, measured on the H200).
        validate_indices: check every slot is in range on the host before launching
            (a device sync for CUDA indices; skipped during graph capture). When False
            the kernel still skips out-of-range slots, so nothing outside the tables is
            touched, but no error is raised.

    Moves ``n * num_kv * num_layers * item_bytes`` bytes.

    Raises:
        DomainError: a table is not a PointerTable[DeviceAlias].
        DeviceMismatchError: the tables are for different devices.
        ClosedError: a table's registered memory was closed.
        LayoutError: layouts disagree, or a table does not fit its layout.
        IndexValidationError: bad dtype, shape, device, lengths, or a slot out of range.
        InvalidArgumentError: a layout that is not a KVLayout, a bad ``stream``,
            ``max_ctas``, ``backend`` or ``validate_indices``.
        RuntimeCallError: the launch failed.
    """
    # a non-KVLayout (possible from untyped callers) is reported by _launch
    num_layers = src_layout.num_layers if isinstance(cast(object, src_layout), KVLayout) else 0
    _launch(src, src_layout, dst, dst_layout, src_indices, dst_indices, 0, num_layers, stream, max_ctas,
            backend, validate_indices)


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
    max_ctas: int | None = DEFAULT_MAX_CTAS,
    backend: Backend = "auto",
    validate_indices: bool = True,
) -> None:
    """As :func:`transfer_kv_all_layer`, for one layer (layer-by-layer loading that
    overlaps the forward pass). Moves ``n * num_kv * item_bytes`` bytes.

    Raises:
        IndexValidationError: ``layer_id`` outside ``[0, num_layers)``; and all of
            :func:`transfer_kv_all_layer`'s errors.
    """
    if not isinstance(cast(object, src_layout), KVLayout):
        raise InvalidArgumentError(f"src_layout must be a KVLayout, got {type(src_layout).__name__}")
    if type(layer_id) is not int:
        raise IndexValidationError(f"layer_id must be an int, got {layer_id!r}")
    if not 0 <= layer_id < src_layout.num_layers:
        raise IndexValidationError(f"layer_id {layer_id!r} outside [0, {src_layout.num_layers})")
    _launch(src, src_layout, dst, dst_layout, src_indices, dst_indices, layer_id, 1, stream, max_ctas, backend,
            validate_indices)
