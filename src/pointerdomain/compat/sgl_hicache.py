"""sglang's JIT HiCache transfer ops, same call shapes, checked before anything is written.

Upstream (sgl-project/sglang; read at the versions named):

* Python entry points, ``python/sglang/kernels/ops/kvcache/hicache.py``: the union of the
  newest stored versions (0cc653e50ac230481659af376ab4722abea33444 adds the page_unified
  write-back, a sibling version adds the page_unified load-back; 8ab8f3a8cb82be70938760a6f3ce0e83aa336dc9
  has neither)::

      DEFAULT_BLOCK_QUOTA = 32 if HIP else 2
      can_use_hicache_jit_kernel(*, element_size, unroll=None, block_quota=None) -> bool
      can_use_write_back_jit_kernel(*, element_size, unroll=None, block_quota=None) -> bool
      can_use_page_unified_load_back_jit_kernel(*, group_bytes, block_quota=None) -> bool
      transfer_hicache_one_layer(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src,
                                 indices_src, *, element_dim=None, unroll=None, block_quota=None)
      transfer_hicache_all_layer(k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src, indices_src, *,
                                 kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes, element_size=None,
                                 unroll=None, block_quota=None)
      transfer_hicache_one_layer_mla(cache_dst, indices_dst, cache_src, indices_src, *, element_dim=None, ...)
      transfer_hicache_all_layer_mla(ptr_dst, indices_dst, ptr_src, indices_src, *, cache_src_stride_bytes,
                                     cache_dst_stride_bytes, element_size=None, ...)
      transfer_hicache_all_layer_staged_lf_pf(k_ptr_src, v_ptr_src, src_indices, dst_indices, staging_k,
                                              staging_v, dst_k, dst_v, *, page_size, element_size=None, ...)
      transfer_hicache_all_layer_mla_staged_lf_pf(ptr_src, src_indices, dst_indices, staging, dst, *,
                                                  page_size, element_size=None, ...)
      transfer_hicache_all_layer_staged_lf_page_unified(k_ptr_src, v_ptr_src, src_pages, dst_pages, staging, dst)
      transfer_hicache_all_layer_mla_staged_lf_page_unified(ptr_src, src_pages, dst_pages, staging, dst)
      transfer_hicache_one_layer_page_unified_lf(k_cache_dst, v_cache_dst, src, src_indices, dst_indices,
                                                 layer_id, *, block_quota=None)
      transfer_hicache_one_layer_mla_page_unified_lf(cache_dst, src, src_indices, dst_indices, layer_id, *,
                                                     block_quota=None)

* semantics, ``python/sglang/jit_kernel/csrc/kvcacheio/hicache.cuh``, ``staged_write_back.cuh``
  and ``relayout.cuh`` (newest stored versions): ``one_layer`` views each cache as
  ``(-1, element_dim)`` rows whose stride may exceed the row (a page_first host layer is
  ``k_buffer.transpose(0, 1)[layer]``) and copies row ``indices_src[i]`` to row
  ``indices_dst[i]`` (``int32`` or ``int64`` indices on the GPU, one dtype); ``all_layer``
  addresses ``ptr[layer] + index * stride_bytes`` over ``uint64 [num_layers]`` GPU tables,
  ``element_size`` bytes each. The staged lf -> pf write-back copies, for page chunk ``p``,
  device tokens ``src_indices[p * P] + [0, P)`` of every layer to host rows
  ``dst_indices[p * P] + [0, P)`` (``dst_indices`` a CPU ``int64`` tensor) through the
  caller's staging buffer. The page_unified host block is ``(page, head_group, layer, 2,
  page_size, head_in_group, dim)`` (K = 0, V = 1; MLA ``(page, layer, page_size, dim)``); the
  write-back takes page IDs (device source, CPU destination, destinations unique) and the
  device row of token ``s`` holds the groups side by side (``(s * groups + g) * group_bytes``);
  the load-back takes host and device token indices and one layer.
* callers, ``python/sglang/srt/mem_cache/pool_host/mha.py`` (0047d999bb3a3ad311df5a4b6356bfb5586e0d66)
  and ``pool_host/mla.py`` (01c0ede38cc9645488fd2847dbea8a2f6a9241d8).

Here each call runs through :func:`pointerdomain.transfer_kv_all_layer` /
:func:`pointerdomain.transfer_kv_per_layer` over ``uint8`` layouts (see
:mod:`pointerdomain.compat.sgl_kernel`, whose checks and table handling these share):
``backend="kernel"`` for the one/all-layer and load-back ops (``max_ctas=block_quota``),
``backend="auto"`` for the write-backs (the library's own staged path or copy engine where
they win). A strided side (row stride ``S`` bytes > row ``E``) is read as one run of bytes
from its first row to its last (``(rows - 1) * S + E``) cut in sub-items of ``g = gcd(E,
S_src, S_dst)`` bytes: row ``r`` is sub-items ``r * S / g + [0, E / g)``, so the call first
computes ``n * E / g`` slot indices (torch ops on the indices' device; none when both sides
are packed rows). The page_unified blocks are lowered the same way (group rows); each
load-back runs two launches (K, then V) and the write-back reads the host block as a
page_first_direct block of ``2 * num_layers`` layers whose pages are ``(page, group)``
pairs.

Checked and accepted, not used: ``unroll`` (an int dividing 32), the staging buffers (device
memory of the launch device, of the right shape and dtype; left untouched: the library
stages through its own buffer when it stages). Differences from upstream, typed errors
before anything is written: indices must be 1-D, contiguous and in range (``int32`` ones are
widened to ``int64`` first, a new tensor per call); host memory must be registered or pinned;
a raw table's rows are bounded by its entries' allocations; element sizes need not be
multiples of 128 bytes (upstream's JIT build requires it, so ``can_use_hicache_jit_kernel``
answers as upstream does); the 16-byte rules of the staged and page_unified ops are kept.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Final

import torch

from pointerdomain.arguments import describe
from pointerdomain.compat import _raw
from pointerdomain.compat._raw import held, table_key, view_key
from pointerdomain.compat.sgl_kernel import (
    IS_HIP,
    Prepared,
    Side,
    apart,
    block_quota_of,
    buffers_table,
    check_range,
    distinct,
    exact,
    guard,
    index_arg,
    index_pair,
    joined,
    launch,
    launch_derived,
    launch_device,
    launch_prepared,
    layout,
    nbytes_of,
    page_parts,
    prepared,
    ptr_arg,
    remember_again,
    remember_call,
    remember_seen,
    replay,
    room,
    row_parts,
    runs,
    tensor_arg,
)
from pointerdomain.devices import Device
from pointerdomain.domains import DeviceAlias
from pointerdomain.errors import (
    DomainError,
    IndexValidationError,
    InvalidArgumentError,
    LayoutError,
    NonContiguousError,
    RegistrationSpanError,
)
from pointerdomain.transfer.overlap import allow_interleaved
from pointerdomain.registration.tables import PointerTable
from pointerdomain._platform import backend_for

__all__ = [
    "DEFAULT_BLOCK_QUOTA",
    "can_use_hicache_jit_kernel",
    "can_use_page_unified_load_back_jit_kernel",
    "can_use_write_back_jit_kernel",
    "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_all_layer_mla_staged_lf_page_unified",
    "transfer_hicache_all_layer_mla_staged_lf_pf",
    "transfer_hicache_all_layer_staged_lf_page_unified",
    "transfer_hicache_all_layer_staged_lf_pf",
    "transfer_hicache_one_layer",
    "transfer_hicache_one_layer_mla",
    "transfer_hicache_one_layer_mla_page_unified_lf",
    "transfer_hicache_one_layer_page_unified_lf",
]

#: Upstream's default CTA budget (ROCm needs a wider grid for mapped-host transfers).
DEFAULT_BLOCK_QUOTA: Final = 32 if IS_HIP else 2

_logger = logging.getLogger(__name__)


# -- scalar arguments -----------------------------------------------------------------------

def _quota(value: object) -> int:
    """``block_quota``: None (or 0, as upstream's ``block_quota or DEFAULT``) is the default."""
    if value is None or (type(value) is int and value == 0):
        return DEFAULT_BLOCK_QUOTA
    return block_quota_of(value)


def _unroll(value: object) -> None:
    """``unroll``: None / 0 (the default) or an int in [1, 32] dividing 32 (upstream's
    static asserts); accepted, not used."""
    if value is None or (type(value) is int and value == 0):
        return
    if type(value) is not int or not 1 <= value <= 32 or 32 % value:
        raise InvalidArgumentError(f"unroll: found {describe(value)}, expected None or an int in [1, 32] dividing 32")


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value <= 0:
        raise InvalidArgumentError(f"{name}: found {describe(value)} ({type(value).__name__}), expected an int > 0 (bytes)")
    return value


def _optional_size(name: str, value: object) -> int | None:
    """An optional size: None / 0 (upstream's ``x or default``) -> None, else an int > 0."""
    if value is None or (type(value) is int and value == 0):
        return None
    return _positive(name, value)


def _check_can_use(name: str, value: object, unroll: object, block_quota: object) -> int:
    size = _positive(name, value)
    _unroll(unroll)
    _quota(block_quota)
    return size


def can_use_hicache_jit_kernel(
    *,
    element_size: int,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> bool:
    """Upstream's answer for the one/all-layer ops: ``element_size % 128 == 0`` (its JIT
    build needs 128-byte rounds; this module's copies do not). Logs a warning when False.

    Raises:
        InvalidArgumentError: ``element_size`` not an int > 0, a bad ``unroll`` or ``block_quota``.
    """
    size = _check_can_use("element_size", element_size, unroll, block_quota)
    if size % 128:
        _logger.warning("Unsupported element_size = %d for JIT HiCache kernel", size)
        return False
    return True


def can_use_write_back_jit_kernel(
    *,
    element_size: int,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> bool:
    """Upstream's answer for the staged write-back: ``element_size % 16 == 0``."""
    size = _check_can_use("element_size", element_size, unroll, block_quota)
    if size % 16:
        _logger.warning("Unsupported element_size = %d for staged JIT HiCache kernel", size)
        return False
    return True


def can_use_page_unified_load_back_jit_kernel(
    *,
    group_bytes: int,
    block_quota: int | None = None,
) -> bool:
    """Upstream's answer for the page_unified load-back: ``group_bytes`` a positive multiple of 16."""
    if type(group_bytes) is not int:
        raise InvalidArgumentError(f"group_bytes: found {describe(group_bytes)}, expected an int (bytes)")
    _quota(block_quota)
    if group_bytes <= 0 or group_bytes % 16:
        _logger.warning("Unsupported group_bytes = %d for page-unified JIT load-back", group_bytes)
        return False
    return True


# -- strided row sides ------------------------------------------------------------------------

class _Rows:
    """One side of a one-layer copy: K (and V) caches as ``rows`` rows of ``element``
    bytes, ``stride`` bytes apart, and the contiguous buffers a table covers."""

    __slots__ = ("buffers", "rows", "stride", "element", "dtype")

    def __init__(self, buffers: tuple[torch.Tensor, ...], rows: int, stride: int, element: int,
                 dtype: torch.dtype) -> None:
        self.buffers, self.rows, self.stride, self.element, self.dtype = buffers, rows, stride, element, dtype


def _row_view(name: str, t: torch.Tensor, element_dim: int) -> torch.Tensor:
    try:
        v = t.view(-1, element_dim)
    except (RuntimeError, TypeError, OverflowError) as exc:  # not a whole number of rows, or no int64 size
        raise LayoutError(
            f"{name}: {tuple(t.shape)} (strides {t.stride()}) cannot be viewed as rows of {element_dim} elements "
            f"({exc}). Fix: pass the cache tensor whose last dimensions hold one token's elements contiguously"
        ) from None
    if v.shape[0] == 0:
        raise LayoutError(f"{name}: no rows of {element_dim} elements in {tuple(t.shape)}")
    if v.stride(1) != 1:  # a strided last dimension: the row's elements are not one run
        raise LayoutError(
            f"{name}: {tuple(t.shape)} with strides {t.stride()}: a token's {element_dim} elements are "
            f"{v.stride(1)} elements apart, expected adjacent. Fix: pass a cache whose last dimension is contiguous")
    if v.stride(0) < element_dim:
        raise LayoutError(f"{name}: rows {v.stride(0)} elements apart overlap rows of {element_dim} elements")
    return v


def _rows_side(names: Sequence[str], ts: Sequence[torch.Tensor], element_dim: int) -> _Rows:
    views = [_row_view(n, t, element_dim) for n, t in zip(names, ts)]
    first = views[0]
    for n, t, v in zip(names, ts, views):
        if t.dtype != ts[0].dtype:
            raise LayoutError(f"{n}: dtype {t.dtype}, but {names[0]} is {ts[0].dtype}")
        if v.shape[0] != first.shape[0] or v.stride(0) != first.stride(0):
            raise LayoutError(
                f"{n}: {v.shape[0]} rows {v.stride(0)} elements apart, but {names[0]} has {first.shape[0]} rows "
                f"{first.stride(0)} apart: K and V of a side must match")
    es = first.element_size()
    rows, stride, element = int(first.shape[0]), int(first.stride(0)) * es, element_dim * es
    buffers: list[torch.Tensor] = []
    for t, v in zip(ts, views):
        if stride == element and t.is_contiguous():
            buffers.append(t)  # the caller's tensor itself: its table is found by identity next time
        else:
            u = v.view(torch.uint8)
            buffers.append(u.as_strided(((rows - 1) * stride + element,), (1,), u.storage_offset()))
    return _Rows(tuple(buffers), rows, stride, element, ts[0].dtype)


def _one_layer(k_dst: object, v_dst: object | None, indices_dst: object, k_src: object, v_src: object | None,
               indices_src: object, element_dim: object, unroll: object, block_quota: object,
               names: tuple[str, str, str, str]) -> None:
    # a repeat of a call over packed rows goes straight to the direct launch (see the
    # prepared calls of pointerdomain.compat.sgl_kernel): first by the arguments' identity,
    # then by their memory
    plain = ((element_dim is None or type(element_dim) is int) and (unroll is None or type(unroll) is int)
             and (block_quota is None or type(block_quota) is int))
    fast = ("one", id(k_dst), id(v_dst), id(k_src), id(v_src), element_dim, unroll, block_quota)
    # sources first: the host layer views sglang makes per call differ at once (met_again)
    ts = (k_src, k_dst) if v_dst is None else (k_src, v_src, k_dst, v_dst)
    if plain and replay(fast, ts, indices_src, indices_dst):
        return
    key: tuple[object, ...] | None
    try:
        key = ("one", view_key(k_dst), None if v_dst is None else view_key(v_dst),  # type: ignore[arg-type]
               view_key(k_src), None if v_src is None else view_key(v_src),  # type: ignore[arg-type]
               element_dim, unroll, block_quota)
        hit = prepared.get(key)
    except Exception:  # not plain tensors: the full path
        key = hit = None
    if hit is not None and plain and launch_prepared(hit, indices_src, indices_dst):
        remember_again(fast, ts, (False,) * len(ts), hit)
        return
    ctas = _quota(block_quota)
    _unroll(unroll)
    d_names = (names[0],) if v_dst is None else (names[0], names[1])
    s_names = (names[2],) if v_src is None else (names[2], names[3])
    d_ts = tuple(tensor_arg(n, t) for n, t in zip(d_names, (k_dst, v_dst)))
    s_ts = tuple(tensor_arg(n, t) for n, t in zip(s_names, (k_src, v_src)))
    dim = _optional_size("element_dim", element_dim)
    if dim is None:
        if d_ts[0].dim() == 0:
            raise LayoutError(f"{d_names[0]}: a 0-dim tensor has no rows")
        dim = int(d_ts[0].shape[-1])
    s_idx, d_idx = _indices_pair(indices_src, indices_dst)
    device = launch_device("transfer_hicache_one_layer", list(zip(s_names + d_names, s_ts + d_ts)), (s_idx, d_idx))
    src = _rows_side(s_names, s_ts, dim)
    dst = _rows_side(d_names, d_ts, dim)
    if src.dtype != dst.dtype:
        raise LayoutError(f"source caches are {src.dtype} but destination caches are {dst.dtype}")
    check_range("indices_src", s_idx, src.rows)
    check_range("indices_dst", d_idx, dst.rows)
    distinct("indices_dst", d_idx, "row")
    g = math.gcd(src.element, src.stride, dst.stride)
    kv = len(s_ts)
    sides = []
    for rows, name in ((src, ", ".join(s_names)), (dst, ", ".join(d_names))):
        nbytes = (rows.rows - 1) * rows.stride + rows.element
        sides.append(Side(buffers_table(name, rows.buffers, device), rows.rows,
                          layout("layer_first", kv, 1, nbytes // g, 1, g)))
    parts = src.element // g
    # rows of other buffers (layers of a page_first pool) may lie between these rows
    interleave = (dst.stride, dst.element) if dst.stride > dst.element else None
    allow_interleaved(sides[1].table, interleave)
    apart(sides[0], s_names, sides[1], d_names, rows=interleave)
    launch_derived(sides[0], sides[1], lambda: (row_parts(s_idx, src.rows, parts, src.stride // g),
                                                row_parts(d_idx, dst.rows, parts, dst.stride // g)),
                   given=(s_idx, d_idx), layer=None, ctas=ctas)
    if parts == 1 and src.stride == dst.stride == g:  # packed rows: the indices are the slots
        entry = Prepared(held(k_src, v_src, k_dst, v_dst), sides[0], sides[1], None, ctas, [()])  # type: ignore[arg-type]
        remember_call(key, entry)
        if key is not None:
            remember_seen(fast, ts, (False,) * len(ts), entry)


def _indices_pair(indices_src: object, indices_dst: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's index pair: ``int32`` or ``int64`` (one dtype for both), 1-D, equal length."""
    for name, t in (("indices_src", indices_src), ("indices_dst", indices_dst)):
        if not isinstance(t, torch.Tensor):
            raise IndexValidationError(f"{name}: found a {type(t).__name__}, expected an int64 torch.Tensor")
    assert isinstance(indices_src, torch.Tensor) and isinstance(indices_dst, torch.Tensor)
    if indices_src.dtype != indices_dst.dtype:
        raise IndexValidationError(
            f"indices_src is {indices_src.dtype} but indices_dst is {indices_dst.dtype}: one dtype for both")
    return index_pair(indices_src, indices_dst, int32_ok=True, names=("indices_src", "indices_dst"))


def transfer_hicache_one_layer(
    k_cache_dst: torch.Tensor,
    v_cache_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    k_cache_src: torch.Tensor,
    v_cache_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    element_dim: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """Copy one layer's rows ``k_cache_dst[indices_dst[i]] = k_cache_src[indices_src[i]]``
    (same for V), each cache viewed as ``(-1, element_dim)`` rows (row stride may exceed the
    row: a page_first host layer view).

    Args:
        k_cache_dst, v_cache_dst, k_cache_src, v_cache_src: one dtype; K and V of a side of
            one row count and stride; registered / pinned host memory or device memory of
            one device.
        indices_dst, indices_src: ``int32`` / ``int64`` (one dtype) 1-D row indices of equal
            length, on the device (CPU tensors for an emulated device).
        element_dim: elements a row (default ``k_cache_dst.size(-1)``, as upstream).
        unroll: checked, not used.
        block_quota: at most this many CTAs (default :data:`DEFAULT_BLOCK_QUOTA`).

    Raises:
        PointerDomainError: a bad argument, before anything is written (InvalidTypeError,
            InvalidArgumentError, LayoutError, IndexValidationError, DomainError,
            DeviceMismatchError, RegistrationSpanError, ClosedError, OverlapError); and the
            launch errors of :func:`pointerdomain.transfer_kv_all_layer`.
    """
    _one_layer(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src, indices_src, element_dim, unroll,
               block_quota, ("k_cache_dst", "v_cache_dst", "k_cache_src", "v_cache_src"))


def transfer_hicache_one_layer_mla(
    cache_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    cache_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    element_dim: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """:func:`transfer_hicache_one_layer` for MLA's one cache a side."""
    _one_layer(cache_dst, None, indices_dst, cache_src, None, indices_src, element_dim, unroll, block_quota,
               ("cache_dst", "", "cache_src", ""))


# -- raw per-layer tables ---------------------------------------------------------------------

def _raw_rows(names: Sequence[str], ptrs: Sequence[torch.Tensor], device: Device, stride: int, element: int,
              g: int, cap: int | None = None) -> tuple[PointerTable[DeviceAlias], int, int]:
    """A raw side of rows ``element`` bytes, ``stride`` apart from each entry: its table
    (entries reaching exactly their last whole row), its row count (at most ``cap``) and
    sub-item count."""
    have = min(room(n, t, device) for n, t in zip(names, ptrs))
    if have < element:
        raise RegistrationSpanError(
            f"{' / '.join(names)}: an entry has {have} bytes to the end of its allocation, less than one row of "
            f"{element} bytes. Fix: check element_size and the tables' addresses")
    rows = (have - element) // stride + 1
    if cap is not None:
        rows = min(rows, cap)
    reach = (rows - 1) * stride + element
    table = joined([exact(n, t, device, reach) for n, t in zip(names, ptrs)])
    # rows of other entries (layers of a page_first pool) may lie between these rows
    allow_interleaved(table, (stride, element) if stride > element else None)
    return table, rows, reach // g


def _all_layer(k_dst: object, v_dst: object | None, indices_dst: object, k_src: object, v_src: object | None,
               indices_src: object, src_stride: object, dst_stride: object, element_size: object, unroll: object,
               block_quota: object, names: tuple[str, str, str, str], stride_names: tuple[str, str]) -> None:
    plain = (type(src_stride) is type(dst_stride) is int and (element_size is None or type(element_size) is int)
             and (unroll is None or type(unroll) is int) and (block_quota is None or type(block_quota) is int))
    fast = ("all", id(k_dst), id(v_dst), id(k_src), id(v_src), src_stride, dst_stride, element_size, unroll,
            block_quota)
    ts = (k_dst, k_src) if v_dst is None else (k_dst, v_dst, k_src, v_src)
    if plain and replay(fast, ts, indices_src, indices_dst):
        return
    key: tuple[object, ...] | None
    try:
        key = ("all", table_key(k_dst), None if v_dst is None else table_key(v_dst),  # type: ignore[arg-type]
               table_key(k_src), None if v_src is None else table_key(v_src),  # type: ignore[arg-type]
               src_stride, dst_stride, element_size, unroll, block_quota)
        hit = prepared.get(key)
    except Exception:  # not plain tensors, an inference-mode table: the full path
        key = hit = None
    if hit is not None and plain and launch_prepared(hit, indices_src, indices_dst):
        remember_again(fast, ts, (True,) * len(ts), hit)
        return
    ctas = _quota(block_quota)
    _unroll(unroll)
    s_stride = _positive(stride_names[0], src_stride)
    d_stride = _positive(stride_names[1], dst_stride)
    element = _optional_size("element_size", element_size)
    if element is None:  # upstream: "assume both contiguous"
        if s_stride != d_stride:
            raise InvalidArgumentError(
                f"element_size is None, which needs {stride_names[0]} == {stride_names[1]} (rows packed on both "
                f"sides), found {s_stride} and {d_stride}. Fix: pass element_size")
        element = d_stride
    if element > s_stride or element > d_stride:
        raise LayoutError(
            f"element_size {element} bytes is more than a row stride ({s_stride} / {d_stride} bytes): rows would "
            "overlap")
    d_names = (names[0],) if v_dst is None else (names[0], names[1])
    s_names = (names[2],) if v_src is None else (names[2], names[3])
    d_ptrs = tuple(ptr_arg(n, t) for n, t in zip(d_names, (k_dst, v_dst)))
    s_ptrs = tuple(ptr_arg(n, t) for n, t in zip(s_names, (k_src, v_src)))
    layers = s_ptrs[0].numel()
    for n, t in zip(s_names + d_names, s_ptrs + d_ptrs):
        if t.numel() != layers:
            raise LayoutError(f"{n}: {t.numel()} entries, but {s_names[0]} has {layers}: one entry per layer each")
    s_idx, d_idx = _indices_pair(indices_src, indices_dst)
    device = launch_device("transfer_hicache_all_layer", list(zip(s_names + d_names, s_ptrs + d_ptrs)),
                           (s_idx, d_idx))
    g = math.gcd(element, s_stride, d_stride)
    kv = len(s_ptrs)
    s_table, s_rows, s_sub = _raw_rows(s_names, s_ptrs, device, s_stride, element, g)
    # each destination entry's rows end before the next entry's rows begin (its allocation may
    # run on past it: layers carved from one larger registration)
    cap = _raw.row_cap([_raw.resolved_table(n, t, device, across_chunks=True) for n, t in zip(d_names, d_ptrs)],
                       d_stride, element)
    d_table, d_rows, d_sub = _raw_rows(d_names, d_ptrs, device, d_stride, element, g, cap or None)
    check_range("indices_src", s_idx, s_rows)
    try:
        check_range("indices_dst", d_idx, d_rows)
    except IndexValidationError:
        if not cap or d_rows < cap:
            raise
        # a row past the cap: the entries' rows meet there; apart() names the overlap
        d_table, d_rows, d_sub = _raw_rows(d_names, d_ptrs, device, d_stride, element, g)
        check_range("indices_dst", d_idx, d_rows)
    distinct("indices_dst", d_idx, "row")
    src = Side(s_table, s_rows, layout("layer_first", kv, layers, s_sub, 1, g))
    dst = Side(d_table, d_rows, layout("layer_first", kv, layers, d_sub, 1, g))
    parts = element // g
    apart(src, [n + "[{}]" for n in s_names], dst, [n + "[{}]" for n in d_names],  # errors name the layer entries
          rows=(d_stride, element) if d_stride > element else None)
    launch_derived(src, dst, lambda: (row_parts(s_idx, s_rows, parts, s_stride // g),
                                      row_parts(d_idx, d_rows, parts, d_stride // g)),
                   given=(s_idx, d_idx), layer=None, ctas=ctas)
    if parts == 1 and s_stride == d_stride == g:  # packed rows: the indices are the slots
        entry = Prepared(held(k_dst, v_dst, k_src, v_src), src, dst, None, ctas, [()])  # type: ignore[arg-type]
        remember_call(key, entry)
        if key is not None:
            remember_seen(fast, ts, (True,) * len(ts), entry)


def transfer_hicache_all_layer(
    k_ptr_dst: torch.Tensor,
    v_ptr_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    k_ptr_src: torch.Tensor,
    v_ptr_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    kv_cache_src_stride_bytes: int,
    kv_cache_dst_stride_bytes: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """Copy rows of every layer between per-layer caches named by raw tables: row
    ``indices_src[i]`` of layer ``l`` at ``k_ptr_src[l] + indices_src[i] * src_stride`` to
    ``k_ptr_dst[l] + indices_dst[i] * dst_stride``, ``element_size`` bytes (same for V).

    Args:
        k_ptr_dst, v_ptr_dst, k_ptr_src, v_ptr_src: ``uint64 [num_layers]`` tables of
            ``data_ptr()`` values (device memory, or registered / pinned host memory), the
            tables in device memory. A side's row count is the least number of whole rows
            any entry's allocation (registration chunk) holds from its address.
        kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes: bytes between rows (> 0).
        element_size: bytes a row; None: both strides must be equal and are the row.

    Other arguments and errors as :func:`transfer_hicache_one_layer`; also
    NotRegisteredError for an entry that is no known memory.
    """
    _all_layer(k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src, indices_src, kv_cache_src_stride_bytes,
               kv_cache_dst_stride_bytes, element_size, unroll, block_quota,
               ("k_ptr_dst", "v_ptr_dst", "k_ptr_src", "v_ptr_src"),
               ("kv_cache_src_stride_bytes", "kv_cache_dst_stride_bytes"))


def transfer_hicache_all_layer_mla(
    ptr_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    ptr_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    cache_src_stride_bytes: int,
    cache_dst_stride_bytes: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """:func:`transfer_hicache_all_layer` for MLA's one table a side."""
    _all_layer(ptr_dst, None, indices_dst, ptr_src, None, indices_src, cache_src_stride_bytes,
               cache_dst_stride_bytes, element_size, unroll, block_quota, ("ptr_dst", "", "ptr_src", ""),
               ("cache_src_stride_bytes", "cache_dst_stride_bytes"))


# -- staged write-back to page_first -------------------------------------------------------------

def _on(idx: torch.Tensor, device: Device) -> torch.Tensor:
    """``idx`` where a kernel of ``device`` reads indices (the CUDA device; the CPU when emulated)."""
    if not device.runtime.host_memory and idx.device != device.torch_device:
        return idx.to(device.torch_device)
    return idx


def _staging(names: Sequence[str], ts: Sequence[torch.Tensor], device: Device, tail: tuple[int, ...],
             dtype: torch.dtype, min_rows: int) -> None:
    """The caller's staging buffers: device memory of ``device``, ``[rows, *tail]`` with
    ``rows >= min_rows``, ``dtype``. Checked only (left untouched)."""
    for n, t in zip(names, ts):
        where = _raw.memory_device_of(n, t)
        if where != device:
            raise DomainError(
                f"{n}: {'host memory' if where is None else f'memory of {where}'}, expected device memory of {device} "
                "(upstream's staging buffer is a CUDA tensor)")
        if tuple(t.shape[1:]) != tail or t.dim() != len(tail) + 1 or t.shape[0] < min_rows or t.dtype != dtype:
            raise LayoutError(
                f"{n}: {tuple(t.shape)} {t.dtype}, expected [rows >= {min_rows}, {', '.join(map(str, tail))}] {dtype}")


def _staged_lf_pf(k_src: object, v_src: object | None, src_indices: object, dst_indices: object,
                  staging: tuple[object, ...], dst: tuple[object, ...], page_size: object, element_size: object,
                  unroll: object, block_quota: object, names: tuple[str, ...]) -> None:
    # names: src ptr table(s), staging buffer(s), destination buffer(s)
    kv = len(dst)
    _quota(block_quota)
    _unroll(unroll)
    ps = _positive("page_size", page_size)
    p_names, st_names, d_names = names[:kv], names[kv:2 * kv], names[2 * kv:]
    st_ts = tuple(tensor_arg(n, t) for n, t in zip(st_names, staging))
    d_ts = tuple(tensor_arg(n, t) for n, t in zip(d_names, dst))
    if st_ts[0].dim() < 3 or st_ts[0].numel() == 0:
        raise LayoutError(
            f"{st_names[0]}: shape {tuple(st_ts[0].shape)}, expected a non-empty [tokens, num_layers, ...] buffer")
    layers = int(st_ts[0].shape[1])
    es = st_ts[0].element_size()
    element = math.prod(st_ts[0].shape[2:]) * es
    given = _optional_size("element_size", element_size)
    if given is not None and given != element:
        raise LayoutError(
            f"element_size {given} bytes, but a row of {st_names[0]} holds {element} bytes (upstream: \"element size "
            "mismatch\")")
    if element % 16:
        raise InvalidArgumentError(
            f"element_size {element} bytes is not a multiple of 16 (upstream: \"element size must be 16-byte "
            "aligned\"; can_use_write_back_jit_kernel answers False)")
    p_ts = tuple(ptr_arg(n, t, layers) for n, t in zip(p_names, (k_src, v_src)))
    s_idx = index_arg("src_indices", src_indices, int32_ok=True)
    d_idx = index_arg("dst_indices", dst_indices)
    if d_idx.is_cuda:
        raise IndexValidationError(
            "dst_indices: a CUDA tensor, expected a CPU int64 tensor (upstream reads it on the host)")
    if s_idx.numel() != d_idx.numel() or s_idx.numel() % ps:
        raise IndexValidationError(
            f"src_indices has {s_idx.numel()} slots and dst_indices {d_idx.numel()}: expected equal lengths, a "
            f"multiple of page_size {ps} (whole pages)")
    device = launch_device("transfer_hicache_all_layer_staged_lf_pf",
                           list(zip(p_names + st_names, p_ts + st_ts)), (s_idx,))
    _staging(st_names, st_ts, device, tuple(int(x) for x in st_ts[0].shape[1:]), d_ts[0].dtype, ps)
    for n, t in zip(st_names[1:], st_ts[1:]):
        if t.shape != st_ts[0].shape:
            raise LayoutError(f"{n}: {tuple(t.shape)}, but {st_names[0]} is {tuple(st_ts[0].shape)}")
    dim = layers * element
    d_rows = -1
    for n, t in zip(d_names, d_ts):
        if _raw.memory_device_of(n, t) is not None:
            raise DomainError(f"{n}: device memory, expected the host pool (registered or pinned host memory)")
        if t.dtype != st_ts[0].dtype:
            raise LayoutError(f"{n}: dtype {t.dtype}, but the staging buffer is {st_ts[0].dtype}")
        if not t.is_contiguous():
            raise NonContiguousError(f"{n}: strides {t.stride()}, not contiguous")
        nbytes = nbytes_of(t)
        if nbytes == 0 or nbytes % dim or (t.dim() >= 2 and nbytes_of(t[0]) != dim):
            raise LayoutError(f"{n}: {tuple(t.shape)} {t.dtype} is not [tokens, {layers}, {element} bytes]")
        if d_rows not in (-1, nbytes // dim):
            raise LayoutError(f"{n}: {nbytes // dim} tokens, but {d_names[0]} has {d_rows}")
        d_rows = nbytes // dim
    s_table, s_rows = _raw_side_items(p_names, p_ts, device, element)
    s_starts, d_starts = s_idx[::ps], d_idx[::ps]
    check_range("src_indices", s_starts, s_rows, ps)
    check_range("dst_indices", d_starts, d_rows, ps)
    src = Side(s_table, s_rows, layout("layer_first", kv, layers, s_rows, 1, element))
    dst_side = Side(buffers_table(", ".join(d_names), d_ts, device), d_rows,
                    layout("page_first", kv, layers, d_rows, 1, element))
    apart(src, p_names, dst_side, d_names)
    launch_derived(src, dst_side, lambda: (runs(s_starts, s_rows, ps), _on(runs(d_starts, d_rows, ps), device)),
                   given=(s_idx, d_idx), layer=None, ctas=_quota(block_quota), backend="auto")


def _raw_side_items(names: Sequence[str], ptrs: Sequence[torch.Tensor], device: Device,
                    item: int) -> tuple[PointerTable[DeviceAlias], int]:
    have = min(room(n, t, device) for n, t in zip(names, ptrs))
    count = have // item
    if count == 0:
        raise RegistrationSpanError(
            f"{' / '.join(names)}: an entry has {have} bytes to the end of its allocation, less than one row of "
            f"{item} bytes")
    return joined([exact(n, t, device, count * item) for n, t in zip(names, ptrs)]), count


def transfer_hicache_all_layer_staged_lf_pf(
    k_ptr_src: torch.Tensor,
    v_ptr_src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    staging_k: torch.Tensor,
    staging_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    *,
    page_size: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """Write every layer of whole device pages back to a page_first host pool: for chunk
    ``p``, ``dst_k[d0 + t, l] = layer_l[s0 + t]`` (``s0 = src_indices[p * P]``, ``d0 =
    dst_indices[p * P]``, ``t < P``; same for V).

    Args:
        k_ptr_src, v_ptr_src: ``uint64 [num_layers]`` tables of the device layers'
            ``data_ptr()`` (packed rows of ``element_size`` bytes), in device memory.
        src_indices: device token slots (``int32`` / ``int64``), ``dst_indices``: host token
            slots (CPU ``int64``); equal lengths, a multiple of ``page_size``.
        staging_k, staging_v: device buffers ``[tokens >= page_size, num_layers, ...]`` of
            ``dst``'s dtype: checked, left untouched.
        dst_k, dst_v: the host pool ``[tokens, num_layers, ...]``, registered or pinned.
        page_size: tokens per page.
        element_size: bytes a row (default the staging buffer's), a multiple of 16.

    Raises:
        DomainError: staging in host memory or a destination in device memory.
        PointerDomainError: as :func:`transfer_hicache_all_layer`.
    """
    _staged_lf_pf(k_ptr_src, v_ptr_src, src_indices, dst_indices, (staging_k, staging_v), (dst_k, dst_v),
                  page_size, element_size, unroll, block_quota,
                  ("k_ptr_src", "v_ptr_src", "staging_k", "staging_v", "dst_k", "dst_v"))


def transfer_hicache_all_layer_mla_staged_lf_pf(
    ptr_src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    staging: torch.Tensor,
    dst: torch.Tensor,
    *,
    page_size: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """:func:`transfer_hicache_all_layer_staged_lf_pf` for MLA."""
    _staged_lf_pf(ptr_src, None, src_indices, dst_indices, (staging,), (dst,), page_size, element_size, unroll,
                  block_quota, ("ptr_src", "staging", "dst"))


# -- page_unified ----------------------------------------------------------------------------

def _group_pages(pages: torch.Tensor, count: int, page_size: int, groups: int, host: bool) -> torch.Tensor:
    """Every (group, token) slot of page IDs ``pages``, pair order ``(page, group, token)``:
    host ``(page * groups + g) * P + t`` (page_first_direct pages of groups), device ``(page *
    P + t) * groups + g`` (rows of groups side by side). A page outside ``[0, count)`` gives -1s."""
    p = guard(pages, count)
    g = torch.arange(groups, dtype=torch.int64, device=p.device).view(1, -1, 1)
    t = torch.arange(page_size, dtype=torch.int64, device=p.device).view(1, 1, -1)
    q = p.view(-1, 1, 1)
    out = (q * groups + g) * page_size + t if host else (q * page_size + t) * groups + g
    return torch.where(q >= 0, out, -1).reshape(-1)


def _page_ids(s_pages: object, d_pages: object) -> tuple[torch.Tensor, torch.Tensor]:
    s = index_arg("src_pages", s_pages, int32_ok=True)
    d = index_arg("dst_pages", d_pages)
    if d.is_cuda:
        raise IndexValidationError("dst_pages: a CUDA tensor, expected CPU int64 page IDs (upstream reads them on "
                                   "the host)")
    if s.numel() != d.numel():
        raise IndexValidationError(f"src_pages has {s.numel()} pages but dst_pages has {d.numel()}")
    if d.numel() and torch.unique(d).numel() != d.numel():
        raise IndexValidationError("dst_pages: a page ID appears twice (upstream: destination IDs must be unique)")
    return s, d


def _write_back_page_unified(k_src: object, v_src: object | None, src_pages: object, dst_pages: object,
                             staging: object, dst: object, names: tuple[str, ...]) -> None:
    mla = v_src is None
    st = tensor_arg("staging", staging)
    host = tensor_arg("dst", dst)
    ndim = 4 if mla else 7
    if host.dim() != ndim or st.dim() != ndim:
        want = "(page, layer, page_size, dim)" if mla else "(page, head_group, layer, 2, page_size, head_in_group, dim)"
        raise LayoutError(f"dst {tuple(host.shape)} / staging {tuple(st.shape)}: expected {ndim}-D {want}")
    if (not mla and host.shape[3] != 2) or any(d <= 0 for d in host.shape[1:]):
        raise LayoutError(f"dst {tuple(host.shape)}: page dimensions must be positive"
                          + ("" if mla else " and the K/V dimension 2"))
    if st.shape[1:] != host.shape[1:] or st.dtype != host.dtype:
        raise LayoutError(f"staging {tuple(st.shape)} {st.dtype} and dst {tuple(host.shape)} {host.dtype}: matching "
                          "page shapes and dtype expected")
    if not st.is_contiguous() or not host.is_contiguous():
        raise NonContiguousError("staging and dst must be contiguous")
    if st.shape[0] == 0:
        raise LayoutError("staging: must hold at least one page")
    es = host.element_size()
    if mla:
        groups, layers, ps, group = 1, int(host.shape[1]), int(host.shape[2]), int(host.shape[3]) * es
    else:
        groups, layers, ps = int(host.shape[1]), int(host.shape[2]), int(host.shape[4])
        group = int(host.shape[5] * host.shape[6]) * es
    if group % 16:
        raise InvalidArgumentError(f"a group's token row is {group} bytes, not a multiple of 16 (upstream: \"Each "
                                   "copied token row must be 16-byte aligned\")")
    s_pages, d_pages = _page_ids(src_pages, dst_pages)
    p_names = names
    p_ts = tuple(ptr_arg(n, t, layers) for n, t in zip(p_names, (k_src, v_src)))
    device = launch_device("transfer_hicache_all_layer_staged_lf_page_unified",
                           list(zip(p_names, p_ts)) + [("staging", st)], (s_pages,))
    _staging(("staging",), (st,), device, tuple(int(x) for x in host.shape[1:]), host.dtype, 1)
    if _raw.memory_device_of("dst", host) is not None:
        raise DomainError("dst: device memory, expected the pinned host pool")
    have = min(room(n, t, device) for n, t in zip(p_names, p_ts))
    rows = have // group // ps * ps  # group rows of an entry, whole pages of them
    if rows == 0:
        raise RegistrationSpanError(f"{' / '.join(p_names)}: an entry has {have} bytes to the end of its "
                                    f"allocation, less than a page of {ps} group rows of {group} bytes")
    s_count = rows // groups // ps  # device pages every group row of which an entry holds
    d_count = int(host.shape[0])
    check_range("src_pages", s_pages, s_count)
    check_range("dst_pages", d_pages, d_count)
    table = joined([exact(n, t, device, rows * group) for n, t in zip(p_names, p_ts)], interleave=True)
    depth = layers * (1 if mla else 2)  # K and V of a layer are consecutive "layers" of the lowered layouts
    src = Side(table, s_count, layout("layer_first", 1, depth, rows, ps, group))
    dst_side = Side(buffers_table("dst", (host,), device), d_count,
                    layout("page_first_direct", 1, depth, d_count * groups * ps, ps, group))
    apart(src, p_names, dst_side, ("dst",))
    if backend_for(device).is_capturing(device):
        # dst_pages are read on the host (as upstream): a replay would not follow them
        raise InvalidArgumentError(
            "transfer_hicache_all_layer_staged_lf_page_unified: called while the device's stream captures a graph; "
            "dst_pages are read on the host (as upstream), so a replay would write the pages of this call, not "
            "those of the replay's; nothing was copied. Fix: call it outside graph capture")
    launch(src, dst_side, _group_pages(s_pages, s_count, ps, groups, host=False),
           _on(_group_pages(d_pages, d_count, ps, groups, host=True), device), layer=None,
           ctas=DEFAULT_BLOCK_QUOTA, backend="auto")


def transfer_hicache_all_layer_staged_lf_page_unified(
    k_ptr_src: torch.Tensor,
    v_ptr_src: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    staging: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Write whole device pages of every layer to a page_unified host pool: group ``g`` of
    token ``t`` of page ``src_pages[i]``, layer ``l``, K (V) lands at ``dst[dst_pages[i], g,
    l, 0 (1), t]``.

    Lowered: the host pool is read as a page_first_direct pool of ``2 * num_layers`` layers
    (K, V of layer 0, then of layer 1, ...) whose page ``page * head_groups + g`` is group
    ``g`` of a page, of ``group_bytes`` items; the device tables as layer_first entries K0,
    V0, K1, ... of group rows, each cut to whole pages of rows. ``n * head_groups *
    page_size`` slot pairs are computed first.

    Args:
        k_ptr_src, v_ptr_src: ``uint64 [num_layers]`` tables of the device layers
            ``(token, head_groups * head_in_group, dim)``, in device memory.
        src_pages: device page IDs (``int32`` / ``int64``); dst_pages: host page IDs (CPU
            ``int64``, unique); equal lengths.
        staging: device buffer ``(pages >= 1, *dst.shape[1:])``: checked, left untouched.
        dst: the host pool ``(page, head_group, layer, 2, page_size, head_in_group, dim)``,
            contiguous, registered or pinned; a group's token row a multiple of 16 bytes.

    Raises:
        InvalidArgumentError: called while the device's stream captures a graph
            (``dst_pages`` are read on the host, as upstream: a replay would not follow them).
        And as :func:`transfer_hicache_all_layer_staged_lf_pf`.
    """
    _write_back_page_unified(k_ptr_src, v_ptr_src, src_pages, dst_pages, staging, dst, ("k_ptr_src", "v_ptr_src"))


def transfer_hicache_all_layer_mla_staged_lf_page_unified(
    ptr_src: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    staging: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """:func:`transfer_hicache_all_layer_staged_lf_page_unified` for MLA: ``dst`` is
    ``(page, layer, page_size, dim)``, token ``t`` of page ``src_pages[i]`` of layer ``l``
    lands at ``dst[dst_pages[i], l, t]``."""
    _write_back_page_unified(ptr_src, None, src_pages, dst_pages, staging, dst, ("ptr_src",))


def _load_back_page_unified(k_dst: object, v_dst: object | None, src: object, src_indices: object,
                            dst_indices: object, layer_id: object, block_quota: object) -> None:
    mla = v_dst is None
    ctas = _quota(block_quota)
    host = tensor_arg("src", src)
    ndim = 4 if mla else 7
    if host.dim() != ndim:
        want = "(page, layer, page_size, dim)" if mla else "(page, head_group, layer, 2, page_size, head_in_group, dim)"
        raise LayoutError(f"src {tuple(host.shape)}: expected {ndim}-D {want}")
    if (not mla and host.shape[3] != 2) or any(d <= 0 for d in host.shape[1:]):
        raise LayoutError(f"src {tuple(host.shape)}: page dimensions must be positive"
                          + ("" if mla else " and the K/V dimension 2"))
    if not host.is_contiguous():
        raise NonContiguousError("src: the host pool must be contiguous")
    es = host.element_size()
    if mla:
        groups, layers, ps, group = 1, int(host.shape[1]), int(host.shape[2]), int(host.shape[3]) * es
    else:
        groups, layers, ps = int(host.shape[1]), int(host.shape[2]), int(host.shape[4])
        group = int(host.shape[5] * host.shape[6]) * es
    if group % 16:
        raise InvalidArgumentError(f"a group's token row is {group} bytes, not a multiple of 16 (upstream: \"Each "
                                   "copied token row must be 16-byte aligned\")")
    if type(layer_id) is not int or not 0 <= layer_id < layers:
        raise IndexValidationError(f"layer_id {describe(layer_id)} outside [0, {layers}) (upstream: \"layer id out of range\")")
    names = ("cache_dst",) if mla else ("k_cache_dst", "v_cache_dst")
    d_ts = tuple(tensor_arg(n, t) for n, t in zip(names, (k_dst, v_dst)))
    s_idx, d_idx = index_pair(src_indices, dst_indices, int32_ok=True)
    device = launch_device("transfer_hicache_one_layer_page_unified_lf", list(zip(names, d_ts)), (s_idx, d_idx))
    for n, t in zip(names, d_ts):
        if _raw.memory_device_of(n, t) != device:
            raise DomainError(f"{n}: host memory, expected the device pool (upstream: a GPU tensor)")
        if t.dtype != host.dtype:
            raise LayoutError(f"{n}: dtype {t.dtype}, but src is {host.dtype}")
        if t.dim() < 1 or not t.is_contiguous() or nbytes_of(t) == 0 or nbytes_of(t) % (groups * group) or (
                t.dim() >= 2 and nbytes_of(t[0]) != groups * group):
            raise LayoutError(f"{n}: {tuple(t.shape)} {t.dtype} (strides {t.stride()}) is not contiguous rows of "
                              f"{groups * group} bytes (upstream: \"device row byte size mismatch\")")
        if t.shape != d_ts[0].shape:
            raise LayoutError(f"{n}: {tuple(t.shape)}, but {names[0]} is {tuple(d_ts[0].shape)}")
    if _raw.memory_device_of("src", host) is not None:
        raise DomainError("src: device memory, expected the host pool (registered or pinned host memory)")
    tokens = nbytes_of(d_ts[0]) // (groups * group)
    host_tokens = int(host.shape[0]) * ps
    check_range("src_indices", s_idx, host_tokens)
    check_range("dst_indices", d_idx, tokens)
    distinct("dst_indices", d_idx)  # the launch sees each slot as one per head group
    depth = layers * (1 if mla else 2)
    src_side = Side(buffers_table("src", (host,), device), host_tokens,
                    layout("layer_first", 1, 1, host_tokens * groups * depth, 1, group))
    _raw.disjoint_buffers(names, d_ts)  # one launch each: V's would overwrite K's bytes
    work = []
    for kv, (n, t) in enumerate(zip(names, d_ts)):
        side = Side(buffers_table(n, (t,), device), tokens, layout("layer_first", 1, 1, tokens * groups, 1, group))
        apart(src_side, ("src",), side, (n,))
        work.append((side, layer_id if mla else 2 * layer_id + kv))
    for side, inner in work:
        launch_derived(src_side, side, lambda inner=inner: (  # type: ignore[misc]
            page_parts(s_idx, host_tokens, ps, groups, outer=depth, inner=inner), row_parts(d_idx, tokens, groups)),
            given=(s_idx, d_idx), layer=None, ctas=ctas)


def transfer_hicache_one_layer_page_unified_lf(
    k_cache_dst: torch.Tensor,
    v_cache_dst: torch.Tensor,
    src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    *,
    block_quota: int | None = None,
) -> None:
    """Load layer ``layer_id`` from a page_unified host pool into the device layer: group
    ``g`` of ``k_cache_dst[d[i]]`` = ``src[s // P, g, layer_id, 0, s % P]`` (V: ``..., 1,
    ...``) for ``s = src_indices[i]``, ``P = page_size``.

    Lowered: the host pool is read as one flat array of group rows (row ``(((s // P *
    head_groups + g) * num_layers + layer_id) * 2 + kv) * P + s % P``), the device layer as
    rows of groups; ``n * head_groups`` slots per side are computed first, and K and V run
    as two launches.

    Args:
        k_cache_dst, v_cache_dst: the device layer ``(token, head, dim)``, contiguous, a token
            row ``head_groups * group_bytes`` bytes, of ``src``'s dtype.
        src: the host pool ``(page, head_group, layer, 2, page_size, head_in_group, dim)``,
            contiguous, registered or pinned; a group's token row a multiple of 16 bytes.
        src_indices, dst_indices: host and device token slots (``int32`` / ``int64``), equal
            lengths, on the device (CPU for an emulated device).
        layer_id: the host layer.
        block_quota: at most this many CTAs (default :data:`DEFAULT_BLOCK_QUOTA`).

    Raises:
        DomainError: a destination in host memory or a source in device memory.
        PointerDomainError: as :func:`transfer_hicache_one_layer`.
    """
    _load_back_page_unified(k_cache_dst, v_cache_dst, src, src_indices, dst_indices, layer_id, block_quota)


def transfer_hicache_one_layer_mla_page_unified_lf(
    cache_dst: torch.Tensor,
    src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    *,
    block_quota: int | None = None,
) -> None:
    """:func:`transfer_hicache_one_layer_page_unified_lf` for MLA: ``src`` is ``(page,
    layer, page_size, dim)``, ``cache_dst[d[i]] = src[s // P, layer_id, s % P]`` (one launch)."""
    _load_back_page_unified(cache_dst, None, src, src_indices, dst_indices, layer_id, block_quota)
