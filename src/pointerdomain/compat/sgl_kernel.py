"""sglang's ``sgl_kernel.kvcacheio`` transfers, same call shapes, checked before anything is written.

Upstream (sgl-project/sglang; read at the versions named):

* Python signatures, ``sgl-kernel/python/sgl_kernel/kvcacheio.py``: the newest stored version
  (the one with the head-group-major ``pfdhg`` pair and ``transfer_embedding_ranges_direct``;
  older versions at b0945ba35fce32521d20ad241abb93ec472038b3 and
  0ba3cdd474639a50317df43db246ca3351fbeecf have the same functions less those)::

      transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size,
                            block_quota=2, num_warps_per_block=32 | 16 on HIP)
      transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id,
                                  item_size, src_layout_dim, block_quota=2, num_warps_per_block)
      transfer_kv_per_layer_ph_lf(..., layer_id, item_size, src_layout_dim, page_size, head_num,
                                  block_quota=2, num_warps_per_block)
      transfer_kv_per_layer_pfdhg_lf(..., layer_id, item_size, src_layout_dim, page_size, head_num,
                                     block_quota=None, num_warps_per_block)
      transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices,
                            dst_indices, item_size, num_layers, block_quota=2, num_warps_per_block)
      transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices,
                                  item_size, dst_layout_dim, num_layers, block_quota=2, num_warps_per_block)
      transfer_kv_all_layer_lf_ph(..., item_size, dst_layout_dim, num_layers, page_size, head_num, ...)
      transfer_kv_all_layer_lf_pfdhg(..., item_size, dst_layout_dim, num_layers, page_size, head_num,
                                     block_quota=None, ...)
      transfer_kv_direct(src_layers: List[Tensor], dst_layers: List[Tensor], src_indices, dst_indices,
                         page_size)
      transfer_embedding_ranges_direct(src, dst, src_starts: List[int], dst_starts, lengths)
      transfer_kv_per_layer_direct_pf_lf(src_ptrs: List[Tensor], dst_ptrs: List[Tensor], src_indices,
                                         dst_indices, layer_id, page_size)
      transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size)
      transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, block_quota=None, ...)
      transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size,
                                      src_layout_dim, block_quota=None, ...)
      transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers,
                                block_quota=2, ...)
      transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size,
                                      dst_layout_dim, num_layers, block_quota=2, ...)

  ``block_quota=None`` resolves as upstream: ``SGLANG_HICACHE_BLOCK_QUOTA`` (an int) or 2 for the
  ``pfdhg`` pair; for the two per-layer MLA ops the same variable or 16 on HIP, 2 on CUDA.
* semantics, ``sgl-kernel/csrc/kvcacheio/transfer.cu`` (1243cf3da37cb08cb73faa12db09653eb997d142):
  one warp per index pair; ``item_size``, ``src_layout_dim`` / ``dst_layout_dim`` in **bytes**;
  the indices are **token slots** (``int64``, CUDA); ``item_size % 8 == 0`` is required.
  Per token ``t``, layer ``l`` (one K or V buffer; MLA has one buffer):

  =================  =============================================================
  side               address of item ``(t, l)``
  =================  =============================================================
  lf tensor          ``buffer + t * item_size`` (the buffer of layer ``l``)
  lf table           ``table[l] + t * item_size``; ``table`` a ``uint64 [num_layers]``
                     CUDA tensor of ``data_ptr()`` values, one per layer
  pf (page_first)    ``buffer + t * layout_dim + l * item_size``, host
                     ``[tokens, num_layers, item]``, ``layout_dim = num_layers * item_size``
  ph (page_head)     ``[pages, head_num, page_size, num_layers, item / head_num]``: head
                     ``h`` of token ``t`` at ``buffer + (t // page_size) * page_size *
                     layout_dim + h * page_size * layout_dim / head_num + (t % page_size) *
                     layout_dim / head_num + l * item_size / head_num``
  pfdhg              ``[pages, head_num, num_layers, page_size, item / head_num]``
                     (``head_num`` = head *groups*, from the test's oracle
                     ``host[t // P, :, l, t % P]``); the device row holds the groups
                     side by side
  =================  =============================================================

  The ``direct`` ops copy with ``Tensor.copy_`` on the current stream after reading the
  indices on the host: ``transfer_kv_direct`` copies every pair ``dst_layers[j][d[i]] =
  src_layers[j][s[i]]`` (runs of consecutive slots at once); the ``page_first_direct`` pair
  (host ``[pages, num_layers, page_size, ...]``) reads only every ``page_size``-th index:
  chunk ``p`` moves ``page_size`` tokens between host page ``idx[p * page_size] //
  page_size`` and device rows ``idx[p * page_size] + [0, page_size)``; the lists are
  ``[K, V]`` (or ``[latent]`` for MLA) on the page side and K layers then V layers on the
  device side.
* callers, ``python/sglang/srt/mem_cache/pool_host/mha.py`` (0047d999bb3a3ad311df5a4b6356bfb5586e0d66)
  and ``pool_host/mla.py`` (01c0ede38cc9645488fd2847dbea8a2f6a9241d8): host buffers
  ``layer_first [2, L, size, H, D]``, ``page_first [2, size, L, H, D]``, ``page_first_direct
  [2, pages, L, P, H, D]``, ``page_head [2, pages, H, P, L, D]`` (MLA: no leading 2, ``H = 1``);
  ``item_size = H * D * itemsize``, ``layout_dim = item_size * L``; device K/V per layer
  (``k_buffer[layer]``) and their ``uint64`` tables (``k_data_ptrs``).
* the upstream test, ``sgl-kernel/tests/test_kvcacheio.py`` (newest stored version): random
  pools, page-aligned index runs, results compared with torch indexing; the head-group test
  passes flat views (``host.view(-1)``) and even the same buffers for K and V (refused
  here: K and V would write the same bytes, in no defined order).

Here each call becomes one or a few :func:`pointerdomain.transfer_kv_per_layer` /
:func:`pointerdomain.transfer_kv_all_layer` launches over ``uint8`` layouts whose item is
``item_size`` bytes (``num_heads=1``, ``head_dim=item_size``): ``backend="kernel"`` for the
kernel ops (graph-safe as upstream), ``max_ctas=block_quota``, the tables' device's current
stream; ``backend="copy_engine"`` for the ``direct`` ops. Buffer tensors become tables through
:func:`pointerdomain.compat._raw.tensor_table` (contiguous, registered / runtime-pinned host
memory or device memory of the launch device); ``uint64`` tables through
:func:`~pointerdomain.compat._raw.resolved_table`, every entry resolved and bounded by its
allocation (registration chunk for registered memory), which also fixes the slot count of a
table side: the smallest number of whole items (tokens) every entry of the side holds.
``num_warps_per_block`` is checked (``1 <= n <= 1024 / warp size``) and accepted; the
library's kernel picks its own block size.

Lowered layouts (exact bytes as upstream, at a cost): ``page_head`` and ``pfdhg`` items are
not one run, so those calls copy per-head (per-group) items and first compute ``n * head_num``
slot indices with torch ops on the indices' device (no host sync; the indices are new
tensors each call); a ``page_head`` host buffer is a ``page_first`` buffer whose tokens are
``(page, head, token-in-page)`` triples, a ``pfdhg`` one a ``page_first_direct`` buffer whose
pages are ``(page, group)`` pairs, and the per-layer ``pfdhg`` load reads the host buffer as
one flat array of group rows. The ``direct`` pf ops compute the ``n`` token slots of each
page chunk the same way and run one launch per device layer.

Differences from upstream, all typed errors (:mod:`pointerdomain.errors`) before anything is
written: indices must be ``int64``, 1-D and contiguous (a strided tensor is read as packed
upstream); a slot outside its buffer is refused (checked on the host for CPU indices, else
skipped by the kernel and reported by :func:`pointerdomain.check_errors`), where the newest
upstream kernel skips negative slots silently; ``item_size`` must divide the buffers (and,
for a tensor of two or more dimensions, be its dim-0 row where a row is one token: pass a
flat ``view(-1)`` otherwise); a per-head (per-group) run must be a multiple of 8 bytes
(upstream moves whole 8-byte words and would drop the rest); host memory must be registered
or pinned (except for the ``direct`` ops: a side in plain pageable host memory, which
upstream's ``copy_`` lets the runtime stage, is copied by torch after the same checks,
``index_select`` / ``index_copy_`` of exactly the mapped rows, and refused with
``InvalidArgumentError`` while a graph is being captured, as the copy-engine route is: a
graph would record none of it); at least one side of every
call must be device memory of one device; destination buffers that overlap each other or a
source buffer (as the call addresses them) are refused, naming the arguments (:func:`apart`);
``copy_all_layer_kv_cache_cpu`` (a CPU-only op) is not provided.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final, Literal, NamedTuple

import torch

import pointerdomain as pd
from pointerdomain.arguments import describe, storage_short
from pointerdomain.compat import _raw
from pointerdomain.compat._raw import held, table_key, view_key
from pointerdomain.devices import Device, as_device
from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain import env
from pointerdomain.errors import (
    ClosedError,
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    NonContiguousError,
    NotRegisteredError,
    OverlapError,
    RegistrationSpanError,
    with_address,
)
from pointerdomain.transfer.kernels import TransferBackend
from pointerdomain.registration.memory import find_closed_registration, find_registration
from pointerdomain.registration.resolve import alias_of
from pointerdomain.registration.tables import PointerTable, resolved_kernel_table
from pointerdomain._platform import backend_for
from pointerdomain.transfer.graphs import recompute_before_last
from pointerdomain.transfer.overlap import allow_interleaved, first_shared, interleaved_entries, rows_clash

__all__ = [
    "transfer_embedding_ranges_direct",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_pfdhg",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_pfdhg_lf",
    "transfer_kv_per_layer_ph_lf",
]

#: ROCm builds of torch set ``torch.version.hip`` (upstream's ``is_hip()``).
IS_HIP: Final = torch.version.hip is not None
#: Threads per warp (wavefront on ROCm), as upstream's ``WARP_SIZE``.
WARP_SIZE: Final = 64 if IS_HIP else 32
#: Upstream's ``num_warps_per_block`` default.
DEFAULT_WARPS_PER_BLOCK: Final = 16 if IS_HIP else 32
#: A block holds at most 1024 threads.
MAX_WARPS_PER_BLOCK: Final = 1024 // WARP_SIZE
_MAX_CTAS: Final = 2**31 - 1

Kind = Literal["layer_first", "page_first", "page_first_direct"]


# -- scalar arguments -----------------------------------------------------------------------

def _int(name: str, value: object, *, low: int = 1) -> int:
    """``value`` as an int >= ``low`` (a bool is refused: ``True`` is no size)."""
    if type(value) is not int or value < low:
        raise InvalidArgumentError(
            f"{name}: found {describe(value)} ({type(value).__name__}), expected an int >= {low}")
    return value


def _item_size(value: object) -> int:
    item = _int("item_size", value)
    if item % 8:
        raise InvalidArgumentError(
            f"item_size: {item} bytes is not a multiple of 8 (upstream's kernels copy 8-byte words: "
            "TORCH_CHECK(item_size % 8 == 0)). Fix: pass one token's K (or V) of one layer in bytes")
    return item


def block_quota_of(value: object) -> int:
    """``block_quota`` checked: the CTA budget, an int in ``[1, 2**31 - 1]``."""
    if type(value) is not int or not 1 <= value <= _MAX_CTAS:
        raise InvalidArgumentError(
            f"block_quota: found {describe(value)}, expected an int in [1, {_MAX_CTAS}] (thread blocks for the copy)")
    return value


def _warps(value: object) -> None:
    if type(value) is not int or not 1 <= value <= MAX_WARPS_PER_BLOCK:
        raise InvalidArgumentError(
            f"num_warps_per_block: found {describe(value)}, expected an int in [1, {MAX_WARPS_PER_BLOCK}] "
            f"({WARP_SIZE}-thread warps, at most 1024 threads a block)")


def _env_quota(default: int) -> int:
    """Upstream's ``SGLANG_HICACHE_BLOCK_QUOTA`` override: an int, else ``default``."""
    text = env.text(env.SGLANG_BLOCK_QUOTA)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        return default


def _default_pfdhg_block_quota() -> int:
    return _env_quota(2)


def _default_mla_block_quota() -> int:
    return _env_quota(16 if IS_HIP else 2)


# -- tensors --------------------------------------------------------------------------------

def tensor_arg(name: str, t: object) -> torch.Tensor:
    """``t``: a dense tensor whose storage holds every byte it views.

    Raises:
        InvalidTypeError: not a dense tensor (:func:`pointerdomain.compat._raw.plain_tensor`).
        ClosedError: its storage was released or shrunk under it (reading or writing it
            would touch freed memory; torch's own copies would raise an untyped error).
    """
    _raw.plain_tensor(name, t)  # a tensor with memory behind it (not sparse, not meta)
    assert isinstance(t, torch.Tensor)
    if storage_short(t):
        raise ClosedError(
            f"{name}: {describe(t)}: its storage holds fewer bytes than the tensor views (released or shrunk). Fix: "
            "pass a tensor whose storage is allocated")
    return t


def nbytes_of(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def whole_units(name: str, t: torch.Tensor, unit: int, what: str, row: int | None = None) -> int:
    """How many ``unit``-byte blocks contiguous buffer ``t`` holds, exactly.

    ``row``: the bytes a dim-0 row must hold when ``t`` has two or more dimensions (its
    token or page), or None for no row check.

    Raises:
        NonContiguousError: ``t`` is strided (a table entry covers one contiguous buffer).
        LayoutError: ``t`` is empty or not a whole number of blocks, or a row of another size.
    """
    if not t.is_contiguous():
        raise NonContiguousError(
            f"{name}: strides {t.stride()} for shape {tuple(t.shape)}, not contiguous: the copy addresses one "
            "packed buffer. Fix: pass the contiguous pool buffer itself")
    n = nbytes_of(t)
    if n == 0 or n % unit:
        raise LayoutError(
            f"{name}: {n} bytes ({tuple(t.shape)} {t.dtype}) is not a whole number of {what} of {unit} bytes "
            "(> 0). Fix: check item_size / layout_dim / page_size against the buffer")
    if row is not None and t.dim() >= 2:
        got = nbytes_of(t[0]) if t.shape[0] else 0
        if got != row:
            raise LayoutError(
                f"{name}: a dim-0 row of {tuple(t.shape)} {t.dtype} holds {got} bytes, but the call describes "
                f"{row} bytes per row ({what}). Fix: check item_size (bytes, not elements) and layout_dim; pass a "
                "flat view (t.view(-1)) if a row deliberately holds several items")
    return n // unit


def same_bytes(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """K and V buffers of one side are the same size (one table, two equal entries)."""
    if nbytes_of(a) != nbytes_of(b):
        raise LayoutError(
            f"{name_a} holds {nbytes_of(a)} bytes but {name_b} holds {nbytes_of(b)}: K and V of one side must "
            "have the same size")


def index_arg(name: str, t: object, *, int32_ok: bool = False) -> torch.Tensor:
    """An index tensor: ``int64`` (``int32`` too where upstream takes it, widened to
    ``int64``), 1-D, contiguous.

    Raises:
        IndexValidationError: not a tensor, another dtype, not 1-D, strided.
    """
    if not isinstance(t, torch.Tensor):
        raise IndexValidationError(f"{name}: found a {type(t).__name__}, expected an int64 torch.Tensor")
    if t.layout is not torch.strided or t.is_meta:
        raise IndexValidationError(f"{name}: found a {'meta' if t.is_meta else str(t.layout)} tensor, expected a "
                                   "dense int64 tensor in memory")
    allowed = (torch.int64, torch.int32) if int32_ok else (torch.int64,)
    if t.dtype not in allowed:
        want = "torch.int64 or torch.int32" if int32_ok else "torch.int64"
        raise IndexValidationError(f"{name}: dtype {t.dtype}, expected {want}")
    if t.dim() != 1:
        raise IndexValidationError(f"{name}: shape {tuple(t.shape)}, expected 1-D")
    if not t.is_contiguous():
        raise IndexValidationError(
            f"{name}: strides {t.stride()}, not contiguous (the kernel would read it as packed). Fix: .contiguous()")
    if t.dtype == torch.int64:
        return t
    wide = t.to(torch.int64)
    setattr(wide, _WIDENED_FROM, t)  # a launch under graph capture widens it again at each replay
    return wide


#: on an int64 copy :func:`index_arg` made of an int32 index tensor: the caller's tensor
_WIDENED_FROM: Final = "_pointerdomain_widened_from"


def widen_again(device: Device, idx: Sequence[torch.Tensor]) -> None:
    """After a launch that read ``idx`` (or indices derived from them): each int64 copy
    :func:`index_arg` made of a caller's ``int32`` tensor is widened again from that tensor
    before the launch at each replay of a graph being captured (a CUDA graph captures the
    widening's torch op; the emulated stand-in runs this step first, before any derivation
    from the copy). A no-op for ``int64`` indices or outside capture."""
    pairs = [(w, getattr(w, _WIDENED_FROM)) for w in idx if hasattr(w, _WIDENED_FROM)]
    if pairs:
        recompute_before_last(device, tuple(w for w, _ in pairs),
                              lambda: tuple(o.to(torch.int64) for _, o in pairs))


def index_pair(src: object, dst: object, *, int32_ok: bool = False,
               names: tuple[str, str] = ("src_indices", "dst_indices")) -> tuple[torch.Tensor, torch.Tensor]:
    s = index_arg(names[0], src, int32_ok=int32_ok)
    d = index_arg(names[1], dst, int32_ok=int32_ok)
    if s.numel() != d.numel():
        raise IndexValidationError(f"{names[0]} has {s.numel()} slots but {names[1]} has {d.numel()}")
    return s, d


def launch_device(what: str, memory: Sequence[tuple[str, object]], indices: Sequence[torch.Tensor] = ()) -> Device:
    """The one device of a call: where its device memory (buffers, tables) lies, and the
    device of CUDA index tensors.

    Raises:
        InvalidTypeError: an item of ``memory`` is not a tensor.
        DomainError: nothing lies in device memory (host memory where the copy needs device memory).
        DeviceMismatchError: memory of two devices.
    """
    found: dict[Device, str] = {}
    for name, t in memory:
        where = _raw.memory_device_of(name, t)
        if where is not None:
            found.setdefault(where, name)
    for t in indices:
        if t.is_cuda:
            found.setdefault(as_device(t.device), "the indices")
    if not found:
        # A uint64/int64 table in host memory may well list device memory: its entries are
        # not what is wrong, where the table itself lies is (the kernel reads it on the device).
        tables = [n for n, t in memory if isinstance(t, torch.Tensor) and t.dim() == 1
                  and t.dtype in (torch.uint64, torch.int64)]
        if tables:
            raise DomainError(
                f"{what}: {', '.join(tables)}: pointer table(s) held in host memory, and nothing else of the call lies "
                "in device memory; the kernel reads each table on the device, so the table itself must be there, "
                "whatever memory its entries name. Fix: move the table to the device (e.g. "
                f"{tables[0]}.to('cuda'), once, outside the hot path)")
        raise DomainError(
            f"{what}: found host memory only ({', '.join(n for n, _ in memory)}), expected device memory on at least "
            "one side: the copy runs on the device that memory belongs to. Fix: pass the device pool's buffers "
            "(or its uint64 table in device memory)")
    if len(found) > 1:
        raise DeviceMismatchError(
            f"{what}: memory of several devices ({'; '.join(f'{n}: {d}' for d, n in found.items())}), expected one")
    return next(iter(found))


# -- layouts and index arithmetic ------------------------------------------------------------

@functools.lru_cache(maxsize=1024)
def layout(kind: Kind, num_kv: int, num_layers: int, slots: int, page_size: int, item: int) -> pd.KVLayout:
    """A ``uint8`` layout whose item is ``item`` bytes, ``slots`` token slots. Cached: the
    same call shape finds its transfer plan again (plans are keyed by the layout objects)."""
    if slots < page_size or slots % page_size:
        raise LayoutError(f"{slots} slots are not a whole number (> 0) of {page_size}-slot pages")
    return pd.KVLayout(kind=kind, attention="mha" if num_kv == 2 else "mla", num_layers=num_layers,
                       num_pages=slots // page_size, page_size=page_size, num_heads=1, head_dim=item, dtype="uint8")


def check_range(name: str, idx: torch.Tensor, slots: int, span: int = 1) -> None:
    """Host check of CPU indices (no sync): each slot (or run of ``span`` slots from it) in
    ``[0, slots)``. CUDA indices are left to the kernel, which skips and reports."""
    if idx.numel() == 0 or idx.is_cuda:
        return
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo < 0 or hi + span > slots:
        bad = lo if lo < 0 else hi
        what = f"slot {bad}" if span == 1 else f"run [{bad}, {bad + span})"
        raise IndexValidationError(f"{name}: {what} outside [0, {slots}); nothing was copied")


def distinct(name: str, idx: torch.Tensor, what: str = "slot") -> None:
    """Host check of CPU indices (no sync): no destination ``what`` given twice, named by the
    caller's argument and positions. A call shape that lowers its indices (a row as several
    slots) would otherwise be refused by the launch in terms of its internal slots. CUDA
    indices are left to the launch's own check.

    Raises:
        OverlapError: ``name[i]`` and ``name[j]`` hold the same value."""
    if idx.numel() < 2 or idx.is_cuda:
        return
    ordered, order = torch.sort(idx, stable=True)
    twice = (ordered[1:] == ordered[:-1]).nonzero()
    if twice.numel():
        k = int(twice[0])
        a, b = int(order[k]), int(order[k + 1])
        raise OverlapError(
            f"{name}[{a}] and {name}[{b}] both write {what} {int(ordered[k])}: the two writes would race (in no "
            "defined order on a GPU); nothing was copied. Fix: give each destination once per call")


def guard(idx: torch.Tensor, slots: int, span: int = 1) -> torch.Tensor:
    """``idx`` with every slot outside ``[0, slots - span]`` set to -1, before any arithmetic,
    so a wild slot's parts are all negative (skipped and reported), never another slot."""
    return torch.where((idx >= 0) & (idx + span <= slots), idx, -1)


def _arange(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=like.device)


def row_parts(idx: torch.Tensor, slots: int, parts: int, scale: int | None = None) -> torch.Tensor:
    """Slot ``s`` of a buffer of ``slots`` rows as ``parts`` consecutive sub-slots
    ``s * scale + j`` (``scale`` >= ``parts``, default ``parts``: a row holds ``scale``
    sub-items, the first ``parts`` of which are copied). Identity for ``parts == scale == 1``."""
    step = parts if scale is None else scale
    if parts == 1 and step == 1:
        return idx
    t = guard(idx, slots)
    return ((t * step).unsqueeze(1) + _arange(parts, t)).reshape(-1)


def page_parts(idx: torch.Tensor, slots: int, page_size: int, parts: int, outer: int = 1,
               inner: int = 0) -> torch.Tensor:
    """Token slot ``s`` (page ``s // page_size``, token ``s % page_size``) of a host buffer
    whose page holds ``parts`` runs, as the ``parts`` slots ``((page * parts + j) * outer +
    inner) * page_size + s % page_size``, ``j`` in ``[0, parts)``."""
    t = guard(idx, slots)
    page = torch.div(t, page_size, rounding_mode="floor")
    tok = t - page * page_size
    base = (page * (parts * outer) + inner) * page_size + tok
    return (base.unsqueeze(1) + _arange(parts, t) * (outer * page_size)).reshape(-1)


def runs(starts: torch.Tensor, slots: int, length: int, *, aligned_to: int = 0, scale: int = 1,
         offset: int = 0) -> torch.Tensor:
    """Every ``length``-slot run from ``starts``: ``base(s) * scale + offset + [0, length)``
    with ``base(s) = s`` (or ``s // aligned_to`` for a page index when ``aligned_to``);
    a start whose run leaves ``[0, slots)`` gives a run of -1."""
    if aligned_to:
        t = guard(starts, slots)
        base = torch.div(t, aligned_to, rounding_mode="floor") * scale + offset
        base = torch.where(t >= 0, base, -length)
    else:
        t = guard(starts, slots, length)
        base = torch.where(t >= 0, t * scale + offset, -length)
    return (base.unsqueeze(1) + _arange(length, t)).reshape(-1)


# -- tables ---------------------------------------------------------------------------------

class _SideFields(NamedTuple):
    table: PointerTable[DeviceAlias]
    slots: int
    layout: pd.KVLayout


class Side(_SideFields):
    """One side of a launch: its table, its slot count (as the caller counts slots) and
    the layout the kernels address it by. A table with a buffer registered in several
    chunks becomes its per-block form here (:func:`pointerdomain.compat._raw.split_chunked`),
    so every check and launch over the side sees each chunk's own alias."""

    __slots__ = ()

    def __new__(cls, table: PointerTable[DeviceAlias], slots: int, layout: pd.KVLayout) -> Side:
        split = _raw.split_chunked(table, layout)
        if split is not table:
            allow_interleaved(split, interleaved_entries(table))  # each block keeps its entry's rows
        return super().__new__(cls, split, slots, layout)


def buffers_table(name: str, tensors: Sequence[torch.Tensor], device: Device) -> PointerTable[DeviceAlias]:
    return _raw.tensor_table(name, tensors, device, across_chunks=True)  # launched through Side only


def ptr_arg(name: str, t: object, count: int | None = None) -> torch.Tensor:
    """An upstream pointer table: a 1-D ``uint64`` tensor (``count`` entries when given)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(
            f"{name}: found a {type(t).__name__}, expected a uint64 torch.Tensor of data_ptr() values")
    if t.dtype != torch.uint64:
        raise InvalidTypeError(
            f"{name}: dtype {t.dtype}, expected torch.uint64 (upstream reads data_ptr<uintptr_t>()). Fix: "
            "torch.tensor([x.data_ptr() for x in layers], dtype=torch.uint64, device=...)")
    if t.dim() != 1 or t.numel() == 0:
        raise IndexValidationError(f"{name}: shape {tuple(t.shape)}, expected a non-empty 1-D table")
    if count is not None and t.numel() != count:
        raise LayoutError(f"{name}: {t.numel()} entries, but num_layers is {count} (one entry per layer)")
    return t


_JoinEntry = tuple[tuple[weakref.ref[PointerTable[DeviceAlias]], ...], PointerTable[DeviceAlias]]
_joins: OrderedDict[tuple[object, ...], _JoinEntry] = _raw.owned_cache()
_lock = threading.Lock()
_CACHE: Final = 256


def room(name: str, ptrs: torch.Tensor, device: Device) -> int:
    """Bytes every entry of raw table ``ptrs`` has from its address to the end of its
    allocation (registration chunk), the least over the entries: what fixes a raw side's
    slot count. The resolution is cached by :func:`_raw.resolved_table` (per table tensor,
    version and reach), so a repeat costs a cache look-up."""
    return min(_raw.resolved_table(name, ptrs, device, across_chunks=True).sizes)


def exact(name: str, ptrs: torch.Tensor, device: Device, reach: int) -> PointerTable[DeviceAlias]:
    """Raw table ``ptrs`` resolved with every entry reaching exactly ``reach`` bytes."""
    return _raw.resolved_table(name, ptrs, device, reach=reach, across_chunks=True)  # launched through Side


def joined(tables: Sequence[PointerTable[DeviceAlias]], *, interleave: bool = False) -> PointerTable[DeviceAlias]:
    """One kernel table of the entries of ``tables`` (resolved raw tables of one device):
    concatenated (K layers, then V layers), or ``interleave``d (K0, V0, K1, V1, ...).
    Cached while the tables live."""
    if len(tables) == 1:
        return tables[0]
    key = (interleave, *(id(t) for t in tables))
    hit = _joins.get(key)
    if hit is not None and all(r() is t for r, t in zip(hit[0], tables)):
        return hit[1]
    if interleave:
        order = [(t, i) for i in range(len(tables[0])) for t in tables]
    else:
        order = [(t, i) for t in tables for i in range(len(t))]
    owners: dict[int, pd.RegisteredHostMemory] = {}
    for t in tables:
        for o in t.registrations():
            owners.setdefault(id(o), o)
    device = tables[0].device
    table = resolved_kernel_table([t.raw_values()[i] for t, i in order], [t.sizes[i] for t, i in order], device,
                                  tuple(owners.values()), tuple(r for t in tables for r in t.resolved_regions()),
                                  [t.entry_addresses()[i] for t, i in order])
    _raw.carry_chunked(table, order)
    with _lock:
        _raw.remember(_joins, key, (tuple(weakref.ref(t) for t in tables), table), _CACHE)
    return table


def raw_side(names: Sequence[str], tables: Sequence[torch.Tensor], device: Device, unit: int,
             *, interleave: bool = False, destination: bool = False) -> tuple[PointerTable[DeviceAlias], int]:
    """The kernel table of raw per-layer tables (K then V, or one for MLA) whose entries
    each hold whole ``unit``-byte blocks, and how many blocks each holds (the least any
    entry's allocation allows). A ``destination`` side also holds each entry to the distance
    to the next entry (:func:`pointerdomain.compat._raw.entry_gap`), so that no slot of one
    entry is a slot of another: two layers never write the same bytes.

    Raises:
        RegistrationSpanError: an entry's allocation holds less than one block.
        OverlapError: a destination side with two entries at one address, or two entries
            less than one block apart.
        And every error of :func:`pointerdomain.compat._raw.resolved_table`.
    """
    have = min(room(n, t, device) for n, t in zip(names, tables))
    count = have // unit
    if count == 0:
        raise RegistrationSpanError(
            f"{' / '.join(names)}: an entry has {have} bytes to the end of its allocation, less than one item of "
            f"{unit} bytes. Fix: check item_size and the table's addresses")
    if destination:
        gap = _raw.entry_gap(" / ".join(names), [_raw.resolved_table(n, t, device, across_chunks=True)
                                                 for n, t in zip(names, tables)])
        if gap is not None and gap < unit:
            raise OverlapError(
                f"{' / '.join(names)}: two entries are {gap} bytes apart, less than one item of {unit} bytes: their "
                "items overlap, and a copy would write the same bytes twice. Fix: give every layer its own buffer")
        if gap is not None:
            count = min(count, gap // unit)
    resolved = [exact(n, t, device, count * unit) for n, t in zip(names, tables)]
    return joined(resolved, interleave=interleave), count


# -- launching ------------------------------------------------------------------------------
def _addressed(side: Side, names: Sequence[str], layer: int | None, by_host: bool) -> list[tuple[int, int, str]]:
    """``(start, end, name)`` of each entry of ``side`` a launch addresses (all of them,
    or for a one-layer launch over a table with an entry per kv and layer, that layer's),
    in the alias domain of kernel tables (``by_host``: as the caller's addresses, for a call
    over memory registered in several chunks, whose aliases differ per chunk; the entries as
    the caller gave them, before :func:`pointerdomain.compat._raw.split_chunked`); the entries
    are the arguments' in order, an equal share each (K layers then V layers). A name with
    ``{}`` (a pointer table argument: ``"k_ptr_dst[{}]"``) names each entry, ``k`` counted
    within the argument."""
    table, lay = _raw.unsplit(side.table), side.layout
    n = len(table)
    per = max(1, n // len(names))
    split = layer is not None and lay.kind == "layer_first" and n == lay.num_kv * lay.num_layers
    out = []
    for i, (v, size) in enumerate(zip(table.entry_addresses() if by_host else table.raw_values(), table.sizes)):
        if split and i % lay.num_layers != layer:
            continue
        arg = min(i // per, len(names) - 1)
        out.append((v, v + size, names[arg].format(i - arg * per)))
    return out


def _intersecting(table: PointerTable[DeviceAlias]) -> bool:
    """True when two entries of ``table`` share bytes (as the caller's addresses)."""
    spans = sorted(zip(table.entry_addresses(), table.sizes))
    return any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:]))


def apart(src: Side, s_names: Sequence[str], dst: Side, d_names: Sequence[str], layer: int | None = None,
          rows: tuple[int, int] | None = None) -> None:
    """Refuse a call whose destination buffers overlap each other or a source buffer, as
    the launch addresses them (layout-aware: the entries the tables hold, exactly their
    items' bytes; with ``rows = (stride, row)``, bytes of destination entries whose rows
    interleave by design, where a row of one meets a row of another:
    :func:`~pointerdomain.transfer.overlap.rows_clash`). ``rows`` comes from the call, not
    from the table: a cached table may serve call shapes of other geometries. Runs once per
    call shape (prepared calls skip it).

    Raises:
        OverlapError: naming the two arguments (entries: names with ``{}``, :func:`_addressed`).
    """
    if rows is not None and _raw.is_split(dst.table) and _intersecting(_raw.unsplit(dst.table)):
        # per-block entries of interleaved rows coincide with other entries' rows: the launch's
        # overlap rule could not tell them apart, so the call is refused here, in its own words
        raise RegistrationSpanError(
            f"{', '.join(n.replace('[{}]', '') for n in d_names)}: destination rows of several entries interleave "
            f"({rows[1]} bytes every {rows[0]}) in host memory registered in several chunks; each chunk has its own "
            "device alias, and these rows cannot be addressed per chunk; nothing was copied. Fix: register the pool "
            "in one chunk (max_chunk_bytes above its size), or back it up with the pool's buffers "
            "(transfer_kv_all_layer_lf_pf)")
    by_host = _raw.is_split(dst.table) or _raw.is_split(src.table)
    _refuse_overlaps(sorted(_addressed(dst, d_names, layer, by_host)), sorted(_addressed(src, s_names, layer, by_host)),
                     rows)


def apart_tensors(d_names: Sequence[str], d_ts: Sequence[torch.Tensor], s_names: Sequence[str],
                  s_ts: Sequence[torch.Tensor]) -> None:
    """:func:`apart` for calls that copy whole buffers' rows (the ``direct`` ops): each
    buffer's bytes as the tensor holds them.

    Raises:
        OverlapError: naming the two arguments.
    """
    def spans(names: Sequence[str], ts: Sequence[torch.Tensor]) -> list[tuple[int, int, str]]:
        return sorted((t.data_ptr(), t.data_ptr() + nbytes_of(t), n) for n, t in zip(names, ts))

    _refuse_overlaps(spans(d_names, d_ts), spans(s_names, s_ts), None)


def _refuse_overlaps(d_spans: list[tuple[int, int, str]], s_spans: list[tuple[int, int, str]],
                     rows: tuple[int, int] | None) -> None:
    """``(start, end, name)`` spans, each list sorted: two destination spans that clash
    (:func:`~pointerdomain.transfer.overlap.rows_clash`: that intersect, or with ``rows``,
    whose rows meet), or a destination span meeting a source span, raise ``OverlapError``
    naming both."""
    active: list[tuple[int, int, str]] = []  # spans that may reach the next start
    for b, b_end, y in d_spans:
        active = [s for s in active if s[1] > b]
        for a, a_end, x in active:
            if rows_clash(a, a_end, b, b_end, rows):
                at = first_shared(a, b, rows)
                raise with_address(OverlapError(
                    f"{x} and {y} share memory (from {at:#x}): the copy would write those bytes twice, in no defined "
                    "order (a race on a GPU); nothing was copied. Fix: give K and V and every layer their own "
                    "buffers"), at)
        active.append((b, b_end, y))
    i = j = 0
    while i < len(d_spans) and j < len(s_spans):
        (a, a_end, x), (b, b_end, y) = d_spans[i], s_spans[j]
        if a_end <= b:
            i += 1
        elif b_end <= a:
            j += 1
        else:
            raise with_address(OverlapError(
                f"{x} overlaps {y} (from {max(a, b):#x}): the copy would write bytes it also reads, in no defined "
                "order; nothing was copied. Fix: copy between separate buffers"), max(a, b))


def launch(src: Side, dst: Side, s_idx: torch.Tensor, d_idx: torch.Tensor, *, layer: int | None, ctas: int,
           backend: TransferBackend = "kernel") -> None:
    """One launch: all layers of the layouts (``layer`` None) or one layer."""
    if layer is None:
        pd.transfer_kv_all_layer(src.table, dst.table, s_idx, d_idx, src_layout=src.layout, dst_layout=dst.layout,
                                 max_ctas=ctas, backend=backend)
    else:
        pd.transfer_kv_per_layer(src.table, dst.table, s_idx, d_idx, layer_id=layer, src_layout=src.layout,
                                 dst_layout=dst.layout, max_ctas=ctas, backend=backend)
    widen_again(src.table.device, (s_idx, d_idx))


def launch_derived(src: Side, dst: Side, derive: Callable[[], tuple[torch.Tensor, torch.Tensor]], *,
                   given: Sequence[torch.Tensor], layer: int | None, ctas: int,
                   backend: TransferBackend = "kernel") -> None:
    """:func:`launch` of indices ``derive`` computes from the caller's (a row as several
    slots, page runs), ``given`` the index tensors it reads. Under graph capture a replay
    must follow the caller's indices as they are then: a CUDA graph captures ``derive``'s
    torch ops with the launch, and the emulated stand-in is told to run ``derive`` again
    before the launch at each replay (after widening ``int32`` ones again: :func:`widen_again`)."""
    s_parts, d_parts = derive()
    launch(src, dst, s_parts, d_parts, layer=layer, ctas=ctas, backend=backend)
    recompute_before_last(src.table.device, (s_parts, d_parts), derive)
    widen_again(src.table.device, given)  # told last: runs first at a replay


def _layer_id(value: object, num_layers: int) -> int:
    if type(value) is not int:
        raise IndexValidationError(f"layer_id: found {describe(value)} ({type(value).__name__}), expected an int")
    if not 0 <= value < num_layers:
        raise IndexValidationError(f"layer_id {value} outside [0, {num_layers}) (the host buffer's layers)")
    return value


def _layers_in(name: str, layout_dim: object, item: int) -> int:
    dim = _int(name, layout_dim)
    if dim % item:
        raise LayoutError(
            f"{name}: {dim} bytes is not a whole number of items of item_size {item} bytes (it is one token's "
            "items of every layer: num_layers * item_size)")
    return dim // item


def _heads(name: str, value: object, item: int) -> int:
    heads = _int(name, value)
    if item % heads:
        raise InvalidArgumentError(f"{name}: item_size {item} bytes does not split into {heads} equal runs")
    if (item // heads) % 8:
        raise InvalidArgumentError(
            f"{name}: Per-head-group run of {item // heads} bytes (item_size / {name}) is not a multiple of 8 "
            "bytes (upstream copies whole 8-byte words and would drop the rest)")
    return heads


def _lf_tensors(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], item: int) -> int:
    """Slots of per-layer buffers (layer_first, one token per ``item`` bytes), K and V equal."""
    slots = whole_units(names[0], tensors[0], item, "items", row=item)
    for name, t in zip(names[1:], tensors[1:]):
        whole_units(name, t, item, "items", row=item)
        same_bytes(names[0], tensors[0], name, t)
    return slots


def _per_layer_dst(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], num_layers: int,
                   device: Device) -> PointerTable[DeviceAlias]:
    """A layer_first table of ``num_layers`` layers over one layer's buffers (each layer's
    entry the given buffer): a per-layer launch of layer ``l`` addresses only layer ``l``'s
    entries, so the device's other layers need not be named."""
    items = [t for t in tensors for _ in range(num_layers)]
    return buffers_table(", ".join(names), items, device)


def _kv(k: object, v: object | None, names: tuple[str, str]) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    if v is None:
        return (names[0],), (tensor_arg(names[0], k),)
    return names, (tensor_arg(names[0], k), tensor_arg(names[1], v))


# -- layer_first <-> layer_first ---------------------------------------------------------------

def _per_layer_lf(k_src: object, k_dst: object, v_src: object | None, v_dst: object | None, src_indices: object,
                  dst_indices: object, item_size: object, block_quota: object, num_warps_per_block: object,
                  names: tuple[str, str, str, str], fast: tuple[object, ...] | None) -> None:
    ts = (k_src, k_dst) if v_src is None else (k_src, k_dst, v_src, v_dst)
    key: tuple[object, ...] | None
    try:
        key = ("lf", view_key(k_src), view_key(k_dst),  # type: ignore[arg-type]
               None if v_src is None else view_key(v_src), None if v_dst is None else view_key(v_dst),  # type: ignore[arg-type]
               item_size, block_quota, num_warps_per_block)
        hit = prepared.get(key)
    except Exception:  # not plain tensors: the full path names what is wrong
        key = hit = None
    if (hit is not None and type(item_size) is type(block_quota) is type(num_warps_per_block) is int
            and launch_prepared(hit, src_indices, dst_indices)):
        remember_again(fast, ts, (False,) * len(ts), hit)
        return
    item = _item_size(item_size)
    ctas = block_quota_of(block_quota)
    _warps(num_warps_per_block)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    s_names, s_ts = _kv(k_src, v_src, (names[0], names[2]))
    d_names, d_ts = _kv(k_dst, v_dst, (names[1], names[3]))
    device = launch_device("transfer", list(zip(s_names + d_names, s_ts + d_ts)), (s_idx, d_idx))
    kv = len(s_ts)
    s_slots = _lf_tensors(s_names, s_ts, item)
    d_slots = _lf_tensors(d_names, d_ts, item)
    _raw.disjoint_buffers(d_names, d_ts)  # K and V written through one buffer: a race
    src = Side(buffers_table(", ".join(s_names), s_ts, device), s_slots, layout("layer_first", kv, 1, s_slots, 1, item))
    dst = Side(buffers_table(", ".join(d_names), d_ts, device), d_slots, layout("layer_first", kv, 1, d_slots, 1, item))
    check_range("src_indices", s_idx, s_slots)
    check_range("dst_indices", d_idx, d_slots)
    apart(src, s_names, dst, d_names)
    launch(src, dst, s_idx, d_idx, layer=None, ctas=ctas)
    entry = Prepared(held(k_src, k_dst, v_src, v_dst), src, dst, None, ctas, [()])  # type: ignore[arg-type]
    remember_call(key, entry)
    remember_seen(fast if key is not None else None, ts, (False,) * len(ts), entry)


def transfer_kv_per_layer(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """Copy items ``src[s[i]] -> dst[d[i]]`` of one layer's K and V buffers (layer_first
    both sides): ``dst_k[d[i]] = src_k[s[i]]``, same for V, ``item_size`` bytes each.

    Args:
        src_k, dst_k, src_v, dst_v: one layer's buffers (contiguous, ``[slots, ...]``,
            ``item_size`` bytes a dim-0 row, or flat); K and V of a side the same size;
            registered / pinned host memory or device memory of one device; ``dst_k``
            and ``dst_v`` sharing no memory (OverlapError: the writes would race).
        src_indices, dst_indices: ``int64`` 1-D token slots of equal length, on the
            device (CPU tensors for an emulated device).
        item_size: bytes of one token's K (or V), a multiple of 8.
        block_quota: at most this many CTAs (``max_ctas``).
        num_warps_per_block: checked (``1 <= n <= 1024 / warp size``), not used: the
            library's kernel picks its own block size.

    Raises:
        PointerDomainError: a bad argument, before anything is written (InvalidTypeError,
            InvalidArgumentError, NonContiguousError, LayoutError, IndexValidationError,
            DomainError, DeviceMismatchError, RegistrationSpanError, ClosedError,
            OverlapError); and the launch errors of :func:`pointerdomain.transfer_kv_all_layer`.
    """
    fast = ("lf", id(src_k), id(dst_k), id(src_v), id(dst_v), item_size, block_quota, num_warps_per_block)
    if (type(item_size) is type(block_quota) is type(num_warps_per_block) is int
            and replay(fast, (src_k, dst_k, src_v, dst_v), src_indices, dst_indices)):
        return
    _per_layer_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, block_quota,
                  num_warps_per_block, ("src_k", "dst_k", "src_v", "dst_v"), fast)


def transfer_kv_per_layer_mla(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int | None = None,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """:func:`transfer_kv_per_layer` for MLA's one latent buffer per layer.
    ``block_quota=None``: ``SGLANG_HICACHE_BLOCK_QUOTA`` or 16 on HIP, 2 on CUDA (upstream)."""
    quota = _default_mla_block_quota() if block_quota is None else block_quota
    fast = ("lf", id(src), id(dst), None, None, item_size, quota, num_warps_per_block)
    if type(item_size) is type(quota) is type(num_warps_per_block) is int and replay(fast, (src, dst), src_indices,
                                                                                     dst_indices):
        return
    _per_layer_lf(src, dst, None, None, src_indices, dst_indices, item_size, quota, num_warps_per_block,
                  ("src", "dst", "", ""), fast)


def _all_layer_lf(k_src: object, k_dst: object, v_src: object | None, v_dst: object | None, src_indices: object,
                  dst_indices: object, item_size: object, num_layers: object, block_quota: object,
                  num_warps_per_block: object, names: tuple[str, str, str, str],
                  fast: tuple[object, ...] | None) -> None:
    ts = (k_src, k_dst) if v_src is None else (k_src, k_dst, v_src, v_dst)
    key: tuple[object, ...] | None
    try:
        key = ("lf_all", table_key(k_src), table_key(k_dst),  # type: ignore[arg-type]
               None if v_src is None else table_key(v_src), None if v_dst is None else table_key(v_dst),  # type: ignore[arg-type]
               item_size, num_layers, block_quota, num_warps_per_block)
        hit = prepared.get(key)
    except Exception:  # not plain tensors, an inference-mode table: the full path
        key = hit = None
    if (hit is not None and type(item_size) is type(num_layers) is type(block_quota) is type(num_warps_per_block)
            is int and launch_prepared(hit, src_indices, dst_indices)):
        remember_again(fast, ts, (True,) * len(ts), hit)
        return
    item = _item_size(item_size)
    layers = _int("num_layers", num_layers)
    ctas = block_quota_of(block_quota)
    _warps(num_warps_per_block)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    s_names = (names[0],) if v_src is None else (names[0], names[2])
    d_names = (names[1],) if v_dst is None else (names[1], names[3])
    s_ptrs = tuple(ptr_arg(n, t, layers) for n, t in zip(s_names, (k_src, v_src)))
    d_ptrs = tuple(ptr_arg(n, t, layers) for n, t in zip(d_names, (k_dst, v_dst)))
    device = launch_device("transfer", list(zip(s_names + d_names, s_ptrs + d_ptrs)), (s_idx, d_idx))
    kv = len(s_ptrs)
    s_table, s_slots = raw_side(s_names, s_ptrs, device, item)
    d_table, d_slots = raw_side(d_names, d_ptrs, device, item, destination=True)
    src = Side(s_table, s_slots, layout("layer_first", kv, layers, s_slots, 1, item))
    dst = Side(d_table, d_slots, layout("layer_first", kv, layers, d_slots, 1, item))
    check_range("src_indices", s_idx, s_slots)
    check_range("dst_indices", d_idx, d_slots)
    apart(src, s_names, dst, d_names)
    launch(src, dst, s_idx, d_idx, layer=None, ctas=ctas)
    entry = Prepared(held(k_src, k_dst, v_src, v_dst), src, dst, None, ctas, [()])  # type: ignore[arg-type]
    remember_call(key, entry)
    remember_seen(fast if key is not None else None, ts, (True,) * len(ts), entry)


def transfer_kv_all_layer(
    src_k_layers: torch.Tensor,
    dst_k_layers: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """Copy items ``s[i] -> d[i]`` of every layer, K and V, between per-layer buffers named
    by raw tables: ``layer_l_dst[d[i]] = layer_l_src[s[i]]``.

    Args:
        src_k_layers, dst_k_layers, src_v_layers, dst_v_layers: ``uint64 [num_layers]``
            tensors of each layer buffer's ``data_ptr()`` (device memory of the launch
            device, or registered / pinned host memory), the tables themselves in device
            memory. Each entry is resolved and must hold whole items; a side's slot count
            is the least number of items any of its entries' allocations holds from it (a
            raw address says no more; for torch's caching allocator the allocation is its
            segment).
        item_size: bytes of one token's K (or V) of one layer, a multiple of 8.
        num_layers: entries of every table.

    Other arguments and errors as :func:`transfer_kv_per_layer`; also NotRegisteredError
    for an entry that is no known memory (or device memory freed since a cached call over
    it), OverlapError for a destination table naming one buffer twice or two entries less
    than one item apart, and IndexValidationError for a destination slot at or past the
    next destination entry (a raw address says where a buffer starts, not where it ends).
    """
    fast = ("lf_all", id(src_k_layers), id(dst_k_layers), id(src_v_layers), id(dst_v_layers), item_size, num_layers,
            block_quota, num_warps_per_block)
    if (type(item_size) is type(num_layers) is type(block_quota) is type(num_warps_per_block) is int
            and replay(fast, (src_k_layers, dst_k_layers, src_v_layers, dst_v_layers), src_indices, dst_indices)):
        return
    _all_layer_lf(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices, item_size,
                  num_layers, block_quota, num_warps_per_block,
                  ("src_k_layers", "dst_k_layers", "src_v_layers", "dst_v_layers"), fast)


def transfer_kv_all_layer_mla(
    src_layers: torch.Tensor,
    dst_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """:func:`transfer_kv_all_layer` for MLA (one raw table a side)."""
    fast = ("lf_all", id(src_layers), id(dst_layers), None, None, item_size, num_layers, block_quota,
            num_warps_per_block)
    if (type(item_size) is type(num_layers) is type(block_quota) is type(num_warps_per_block) is int
            and replay(fast, (src_layers, dst_layers), src_indices, dst_indices)):
        return
    _all_layer_lf(src_layers, dst_layers, None, None, src_indices, dst_indices, item_size, num_layers,
                  block_quota, num_warps_per_block, ("src_layers", "dst_layers", "", ""), fast)


# -- prepared calls -------------------------------------------------------------------------
# A HiCache engine issues the same call shape with the same buffers and tables on every
# layer of every forward pass; only the indices change. The checked translation of such a
# call (tables, layouts, slot counts) is kept per call shape and arguments, and a
# repeat goes straight to the direct launch, which checks the indices itself (dtype, shape,
# device, lengths, range, overlap with the destination) and the tables' liveness (open
# registrations, storages in place). Keys: :func:`pointerdomain.compat._raw.view_key` and
# :func:`~pointerdomain.compat._raw.table_key`; the entry holds what its key names
# (:func:`~pointerdomain.compat._raw.held`). An inference tensor (no version counter) or
# anything that is no plain tensor takes the full path.

class Prepared(NamedTuple):
    held: tuple[torch.Tensor, ...]
    src: "Side"
    dst: "Side"
    layer: int | None
    ctas: int
    #: the arguments of the last memory-keyed hit (:func:`pointerdomain.compat._raw.met_again`)
    last: list[tuple[object, ...]]


prepared: OrderedDict[tuple[object, ...], Prepared] = _raw.owned_cache()
_PREPARED_MAX = 256
#: the same prepared calls by their arguments' identity (:class:`pointerdomain.compat._raw.Seen`),
#: keyed by the call shape, the ``id`` of each tensor argument and the scalars: the first
#: look-up of a repeat (:func:`replay`), before the memory-keyed one above
seen: OrderedDict[tuple[object, ...], _raw.Seen] = _raw.owned_cache()


def replay(fast: tuple[object, ...], tensors: tuple[object, ...], s_idx: object, d_idx: object) -> bool:
    """Launch the prepared call kept under ``fast`` when ``tensors`` are still the arguments it
    was made from (:func:`pointerdomain.compat._raw.seen_again`); False when there is none or
    the direct launch refused it before writing (the caller then takes its keyed path). The
    caller has checked that the scalars in ``fast`` are ints (or None where the call takes None)."""
    try:
        entry = seen.get(fast)
        if entry is None or not _raw.seen_again(entry, tensors):  # type: ignore[arg-type]
            return False
    except Exception:  # an unhashable scalar, None where a tensor belongs: the full path names it
        return False
    return launch_prepared(entry.value, s_idx, d_idx)  # type: ignore[arg-type]


def remember_seen(fast: tuple[object, ...] | None, tensors: Sequence[object], tables: Sequence[bool],
                  entry: Prepared) -> None:
    """Keep a prepared call for :func:`replay` (``fast`` None: nothing kept)."""
    if fast is not None:
        _raw.remember_seen(seen, fast, tensors, tables, entry)  # type: ignore[arg-type]


def remember_call(key: tuple[object, ...] | None, entry: Prepared) -> None:
    if key is None:
        return
    with _lock:
        _raw.remember(prepared, key, entry, _PREPARED_MAX)


def remember_again(fast: tuple[object, ...] | None, tensors: Sequence[object], tables: Sequence[bool],
                   entry: Prepared) -> None:
    """After a memory-keyed hit: keep the call for :func:`replay` only when its arguments are
    objects met again (:func:`pointerdomain.compat._raw.met_again`: a pool's own tensors).
    Views an engine makes anew on every call would only churn the identity cache: those
    calls keep the memory-keyed look-up."""
    if _raw.met_again(tensors, entry.held, entry.last):
        remember_seen(fast, tensors, tables, entry)


def launch_prepared(p: Prepared, s_idx: object, d_idx: object) -> bool:
    """The direct launch of a prepared call; False when the direct call refused it before
    anything was written (indices it does not take, a registration closed since: the full
    path then words the error, widens indices it accepts, or resolves the memory again)."""
    _held, (src, _, src_layout), (dst, _, dst_layout), layer, ctas, _last = p  # one unpack, no attribute reads
    try:
        if layer is None:
            pd.transfer_kv_all_layer(src, dst, s_idx, d_idx,  # type: ignore[arg-type]
                                     src_layout=src_layout, dst_layout=dst_layout, max_ctas=ctas, backend="kernel")
        else:
            pd.transfer_kv_per_layer(src, dst, s_idx, d_idx,  # type: ignore[arg-type]
                                     layer_id=layer, src_layout=src_layout, dst_layout=dst_layout, max_ctas=ctas,
                                     backend="kernel")
    except (IndexValidationError, ClosedError, OverlapError):  # refused before writing: the full path words it
        return False
    return True


# -- page_first host <-> layer_first device ------------------------------------------------------

def _per_layer_pf_lf(k_src: object, k_dst: object, v_src: object | None, v_dst: object | None, src_indices: object,
                     dst_indices: object, layer_id: object, item_size: object, src_layout_dim: object,
                     block_quota: object, num_warps_per_block: object, names: tuple[str, str, str, str],
                     fast: tuple[object, ...] | None) -> None:
    ts = (k_src, k_dst) if v_src is None else (k_src, k_dst, v_src, v_dst)
    plain = type(layer_id) is type(item_size) is type(src_layout_dim) is type(block_quota) is type(
        num_warps_per_block) is int
    key: tuple[object, ...] | None
    try:
        key = ("pf_lf", view_key(k_src), view_key(k_dst),  # type: ignore[arg-type]
               None if v_src is None else view_key(v_src), None if v_dst is None else view_key(v_dst),  # type: ignore[arg-type]
               layer_id, item_size, src_layout_dim, block_quota, num_warps_per_block)
        hit = prepared.get(key)
    except Exception:  # not plain tensors: the full path names what is wrong
        key = hit = None
    if hit is not None and plain and launch_prepared(hit, src_indices, dst_indices):
        remember_again(fast, ts, (False,) * len(ts), hit)
        return
    item = _item_size(item_size)
    layers = _layers_in("src_layout_dim", src_layout_dim, item)
    layer = _layer_id(layer_id, layers)
    ctas = block_quota_of(block_quota)
    _warps(num_warps_per_block)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    s_names, s_ts = _kv(k_src, v_src, (names[0], names[2]))
    d_names, d_ts = _kv(k_dst, v_dst, (names[1], names[3]))
    device = launch_device("transfer", list(zip(s_names + d_names, s_ts + d_ts)), (s_idx, d_idx))
    kv = len(s_ts)
    dim = layers * item
    s_slots = whole_units(s_names[0], s_ts[0], dim, "tokens (src_layout_dim bytes)", row=dim)
    for name, t in zip(s_names[1:], s_ts[1:]):
        whole_units(name, t, dim, "tokens (src_layout_dim bytes)", row=dim)
        same_bytes(s_names[0], s_ts[0], name, t)
    d_slots = _lf_tensors(d_names, d_ts, item)
    src = Side(buffers_table(", ".join(s_names), s_ts, device), s_slots,
               layout("page_first", kv, layers, s_slots, 1, item))
    dst = Side(_per_layer_dst(d_names, d_ts, layers, device), d_slots,
               layout("layer_first", kv, layers, d_slots, 1, item))
    check_range("src_indices", s_idx, s_slots)
    check_range("dst_indices", d_idx, d_slots)
    apart(src, s_names, dst, d_names, layer)
    launch(src, dst, s_idx, d_idx, layer=layer, ctas=ctas)
    entry = Prepared(held(k_src, k_dst, v_src, v_dst), src, dst, layer, ctas, [()])  # type: ignore[arg-type]
    remember_call(key, entry)
    remember_seen(fast if key is not None else None, ts, (False,) * len(ts), entry)


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = 2,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """Load layer ``layer_id`` from a page_first host pool into one device layer:
    ``dst_k[d[i]] = src_k[s[i], layer_id]`` (same for V).

    Args:
        src_k, src_v: the whole host buffers ``[tokens, num_layers, ...]``, contiguous,
            ``src_layout_dim`` bytes a token (dim-0 row).
        dst_k, dst_v: the device layer's buffers, ``item_size`` bytes a token.
        layer_id: the host layer, in ``[0, src_layout_dim / item_size)``.
        src_layout_dim: bytes of one token of every layer, a multiple of ``item_size``.

    Other arguments and errors as :func:`transfer_kv_per_layer`.
    """
    fast = ("pf_lf", id(src_k), id(dst_k), id(src_v), id(dst_v), layer_id, item_size, src_layout_dim, block_quota,
            num_warps_per_block)
    if (type(layer_id) is type(item_size) is type(src_layout_dim) is type(block_quota) is type(num_warps_per_block)
            is int and replay(fast, (src_k, dst_k, src_v, dst_v), src_indices, dst_indices)):
        return
    _per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
                     block_quota, num_warps_per_block, ("src_k", "dst_k", "src_v", "dst_v"), fast)


def transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int | None = None,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """:func:`transfer_kv_per_layer_pf_lf` for MLA. ``block_quota=None`` as
    :func:`transfer_kv_per_layer_mla`."""
    quota = _default_mla_block_quota() if block_quota is None else block_quota
    fast = ("pf_lf", id(src), id(dst), None, None, layer_id, item_size, src_layout_dim, quota, num_warps_per_block)
    if (type(layer_id) is type(item_size) is type(src_layout_dim) is type(quota) is type(num_warps_per_block) is int
            and replay(fast, (src, dst), src_indices, dst_indices)):
        return
    _per_layer_pf_lf(src, dst, None, None, src_indices, dst_indices, layer_id, item_size, src_layout_dim, quota,
                     num_warps_per_block, ("src", "dst", "", ""), fast)


def _all_layer_lf_pf(k_src: object, k_dst: object, v_src: object | None, v_dst: object | None, src_indices: object,
                     dst_indices: object, item_size: object, dst_layout_dim: object, num_layers: object,
                     block_quota: object, num_warps_per_block: object, names: tuple[str, str, str, str],
                     fast: tuple[object, ...] | None) -> None:
    ts = (k_src, k_dst) if v_src is None else (k_src, k_dst, v_src, v_dst)
    tables = (True, False) if v_src is None else (True, False, True, False)
    plain = type(item_size) is type(dst_layout_dim) is type(num_layers) is type(block_quota) is type(
        num_warps_per_block) is int
    key: tuple[object, ...] | None
    try:
        key = ("lf_pf", table_key(k_src), view_key(k_dst),  # type: ignore[arg-type]
               None if v_src is None else table_key(v_src), None if v_dst is None else view_key(v_dst),  # type: ignore[arg-type]
               item_size, dst_layout_dim, num_layers, block_quota, num_warps_per_block)
        hit = prepared.get(key)
    except Exception:  # not plain tensors, an inference-mode table: the full path
        key = hit = None
    if hit is not None and plain and launch_prepared(hit, src_indices, dst_indices):
        remember_again(fast, ts, tables, hit)
        return
    item = _item_size(item_size)
    layers = _int("num_layers", num_layers)
    in_dim = _layers_in("dst_layout_dim", dst_layout_dim, item)
    if in_dim != layers:
        raise LayoutError(f"dst_layout_dim holds {in_dim} layers of item_size {item}, but num_layers is {layers}")
    ctas = block_quota_of(block_quota)
    _warps(num_warps_per_block)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    s_names = (names[0],) if v_src is None else (names[0], names[2])
    s_ptrs = tuple(ptr_arg(n, t, layers) for n, t in zip(s_names, (k_src, v_src)))
    d_names, d_ts = _kv(k_dst, v_dst, (names[1], names[3]))
    device = launch_device("transfer", list(zip(s_names + d_names, s_ptrs + d_ts)), (s_idx, d_idx))
    kv = len(s_ptrs)
    dim = layers * item
    d_slots = whole_units(d_names[0], d_ts[0], dim, "tokens (dst_layout_dim bytes)", row=dim)
    for name, t in zip(d_names[1:], d_ts[1:]):
        whole_units(name, t, dim, "tokens (dst_layout_dim bytes)", row=dim)
        same_bytes(d_names[0], d_ts[0], name, t)
    s_table, s_slots = raw_side(s_names, s_ptrs, device, item)
    src = Side(s_table, s_slots, layout("layer_first", kv, layers, s_slots, 1, item))
    dst = Side(buffers_table(", ".join(d_names), d_ts, device), d_slots,
               layout("page_first", kv, layers, d_slots, 1, item))
    check_range("src_indices", s_idx, s_slots)
    check_range("dst_indices", d_idx, d_slots)
    apart(src, s_names, dst, d_names)
    launch(src, dst, s_idx, d_idx, layer=None, ctas=ctas)
    entry = Prepared(held(k_src, k_dst, v_src, v_dst), src, dst, None, ctas, [()])  # type: ignore[arg-type]
    remember_call(key, entry)
    remember_seen(fast if key is not None else None, ts, tables, entry)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """Back up every layer from per-layer device buffers (raw ``uint64`` tables, as
    :func:`transfer_kv_all_layer`) into a page_first host pool:
    ``dst_k[d[i], l] = layer_l[s[i]]`` (same for V).

    Args:
        dst_k, dst_v: the host buffers ``[tokens, num_layers, ...]``, ``dst_layout_dim``
            bytes a token.
        dst_layout_dim: ``num_layers * item_size``.

    Other arguments and errors as :func:`transfer_kv_all_layer`.
    """
    fast = ("lf_pf", id(src_k_layers), id(dst_k), id(src_v_layers), id(dst_v), item_size, dst_layout_dim, num_layers,
            block_quota, num_warps_per_block)
    if (type(item_size) is type(dst_layout_dim) is type(num_layers) is type(block_quota) is type(num_warps_per_block)
            is int and replay(fast, (src_k_layers, dst_k, src_v_layers, dst_v), src_indices, dst_indices)):
        return
    _all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size, dst_layout_dim,
                     num_layers, block_quota, num_warps_per_block, ("src_k_layers", "dst_k", "src_v_layers", "dst_v"),
                     fast)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """:func:`transfer_kv_all_layer_lf_pf` for MLA."""
    fast = ("lf_pf", id(src_layers), id(dst), None, None, item_size, dst_layout_dim, num_layers, block_quota,
            num_warps_per_block)
    if (type(item_size) is type(dst_layout_dim) is type(num_layers) is type(block_quota) is type(num_warps_per_block)
            is int and replay(fast, (src_layers, dst), src_indices, dst_indices)):
        return
    _all_layer_lf_pf(src_layers, dst, None, None, src_indices, dst_indices, item_size, dst_layout_dim, num_layers,
                     block_quota, num_warps_per_block, ("src_layers", "dst", "", ""), fast)


# -- page_head and head-group-major host pools ------------------------------------------------

def _head_host(names: tuple[str, ...], ts: tuple[torch.Tensor, ...], dim: int, page_size: int) -> int:
    """Pages of host buffers of ``page_size * dim``-byte pages, K and V equal."""
    pages = whole_units(names[0], ts[0], page_size * dim, "pages (page_size * layout_dim bytes)",
                        row=page_size * dim)
    for name, t in zip(names[1:], ts[1:]):
        whole_units(name, t, page_size * dim, "pages (page_size * layout_dim bytes)", row=page_size * dim)
        same_bytes(names[0], ts[0], name, t)
    return pages


def transfer_kv_per_layer_ph_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """Load layer ``layer_id`` from a page_head host pool
    ``[pages, head_num, page_size, num_layers, head_bytes]`` into one device layer
    ``[tokens, head_num, head_bytes]``: head ``h`` of ``dst[d[i]]`` = ``src[s // P, h, s % P,
    layer_id]`` for ``s = s[i]``, ``P = page_size``.

    Lowered (see the module docstring): the host pool is read as a page_first pool of
    ``head_bytes`` items whose token ``(s // P) * head_num * P + h * P + s % P`` is head
    ``h`` of slot ``s``, the device layer as ``tokens * head_num`` items of ``head_bytes``;
    the call first computes ``n * head_num`` slot indices per side (torch ops, on the
    indices' device) and moves ``head_bytes`` runs.

    Args:
        src_layout_dim: ``num_layers * item_size`` (bytes of one token of every layer).
        page_size: tokens per host page (> 0); the host buffers hold whole pages.
        head_num: heads an item splits into; ``item_size / head_num`` a multiple of 8.

    Other arguments and errors as :func:`transfer_kv_per_layer_pf_lf`.
    """
    item = _item_size(item_size)
    layers = _layers_in("src_layout_dim", src_layout_dim, item)
    layer = _layer_id(layer_id, layers)
    ps = _int("page_size", page_size)
    heads = _heads("head_num", head_num, item)
    ctas = block_quota_of(block_quota)
    _warps(num_warps_per_block)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    s_names, s_ts = _kv(src_k, src_v, ("src_k", "src_v"))
    d_names, d_ts = _kv(dst_k, dst_v, ("dst_k", "dst_v"))
    device = launch_device("transfer_kv_per_layer_ph_lf", list(zip(s_names + d_names, s_ts + d_ts)), (s_idx, d_idx))
    pages = _head_host(s_names, s_ts, layers * item, ps)
    d_slots = _lf_tensors(d_names, d_ts, item)
    part = item // heads
    s_slots = pages * ps
    src = Side(buffers_table("src_k, src_v", s_ts, device), s_slots,
               layout("page_first", 2, layers, s_slots * heads, 1, part))
    dst = Side(_per_layer_dst(d_names, d_ts, layers, device), d_slots,
               layout("layer_first", 2, layers, d_slots * heads, 1, part))
    check_range("src_indices", s_idx, s_slots)
    check_range("dst_indices", d_idx, d_slots)
    apart(src, s_names, dst, d_names, layer)
    launch_derived(src, dst, lambda: (page_parts(s_idx, s_slots, ps, heads), row_parts(d_idx, d_slots, heads)),
                   given=(s_idx, d_idx), layer=layer, ctas=ctas)


def transfer_kv_all_layer_lf_ph(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """Back up every layer from per-layer device buffers (raw ``uint64`` tables) into a
    page_head host pool: ``dst[d // P, h, d % P, l] = layer_l[s][h]``; the inverse of
    :func:`transfer_kv_per_layer_ph_lf`, lowered the same way (``n * head_num`` slots).

    Other arguments and errors as :func:`transfer_kv_all_layer_lf_pf` and
    :func:`transfer_kv_per_layer_ph_lf`.
    """
    item = _item_size(item_size)
    layers = _int("num_layers", num_layers)
    if _layers_in("dst_layout_dim", dst_layout_dim, item) != layers:
        raise LayoutError(f"dst_layout_dim {dst_layout_dim} is not num_layers ({layers}) * item_size ({item})")
    ps = _int("page_size", page_size)
    heads = _heads("head_num", head_num, item)
    ctas = block_quota_of(block_quota)
    _warps(num_warps_per_block)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    s_names = ("src_k_layers", "src_v_layers")
    s_ptrs = tuple(ptr_arg(n, t, layers) for n, t in zip(s_names, (src_k_layers, src_v_layers)))
    d_names, d_ts = _kv(dst_k, dst_v, ("dst_k", "dst_v"))
    device = launch_device("transfer_kv_all_layer_lf_ph", list(zip(s_names + d_names, s_ptrs + d_ts)),
                           (s_idx, d_idx))
    pages = _head_host(d_names, d_ts, layers * item, ps)
    part = item // heads
    s_table, s_slots = raw_side(s_names, s_ptrs, device, item)
    d_slots = pages * ps
    src = Side(s_table, s_slots, layout("layer_first", 2, layers, s_slots * heads, 1, part))
    dst = Side(buffers_table("dst_k, dst_v", d_ts, device), d_slots,
               layout("page_first", 2, layers, d_slots * heads, 1, part))
    check_range("src_indices", s_idx, s_slots)
    check_range("dst_indices", d_idx, d_slots)
    apart(src, s_names, dst, d_names)
    launch_derived(src, dst, lambda: (row_parts(s_idx, s_slots, heads), page_parts(d_idx, d_slots, ps, heads)),
                   given=(s_idx, d_idx), layer=None, ctas=ctas)


def transfer_kv_per_layer_pfdhg_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
    block_quota: int | None = None,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """Load layer ``layer_id`` from a head-group-major host pool
    ``[pages, head_num, num_layers, page_size, group_bytes]`` (``head_num`` = head
    *groups*) into one device layer ``[tokens, head_num, group_bytes]``: group ``g`` of
    ``dst[d[i]]`` = ``src[s // P, g, layer_id, s % P]``.

    Lowered: the host buffer is read as one flat array of ``group_bytes`` rows (row
    ``((s // P * head_num + g) * num_layers + layer_id) * P + s % P``), the device layer as
    ``tokens * head_num`` rows; ``n * head_num`` slot indices per side are computed first
    (torch ops on the indices' device).

    Args:
        head_num: head groups; ``item_size / head_num`` a multiple of 8.
        block_quota: None: ``SGLANG_HICACHE_BLOCK_QUOTA`` or 2 (upstream).

    Other arguments and errors as :func:`transfer_kv_per_layer_ph_lf`.
    """
    quota = _default_pfdhg_block_quota() if block_quota is None else block_quota
    ctas = block_quota_of(quota)
    item = _item_size(item_size)
    ps = _int("page_size", page_size)
    groups = _heads("head_num", head_num, item)
    layers = _layers_in("src_layout_dim", src_layout_dim, item)
    layer = _layer_id(layer_id, layers)
    _warps(num_warps_per_block)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    s_names, s_ts = _kv(src_k, src_v, ("src_k", "src_v"))
    d_names, d_ts = _kv(dst_k, dst_v, ("dst_k", "dst_v"))
    device = launch_device("transfer_kv_per_layer_pfdhg_lf", list(zip(s_names + d_names, s_ts + d_ts)),
                           (s_idx, d_idx))
    pages = _head_host(s_names, s_ts, layers * item, ps)
    d_slots = _lf_tensors(d_names, d_ts, item)
    part = item // groups
    s_slots = pages * ps
    src = Side(buffers_table("src_k, src_v", s_ts, device), s_slots,
               layout("layer_first", 2, 1, s_slots * groups * layers, 1, part))
    dst = Side(buffers_table("dst_k, dst_v", d_ts, device), d_slots,
               layout("layer_first", 2, 1, d_slots * groups, 1, part))
    check_range("src_indices", s_idx, s_slots)
    check_range("dst_indices", d_idx, d_slots)
    apart(src, s_names, dst, d_names)
    launch_derived(src, dst, lambda: (page_parts(s_idx, s_slots, ps, groups, outer=layers, inner=layer),
                                      row_parts(d_idx, d_slots, groups)),
                   given=(s_idx, d_idx), layer=None, ctas=ctas)


def transfer_kv_all_layer_lf_pfdhg(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
    block_quota: int | None = None,
    num_warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
) -> None:
    """Back up every layer from per-layer device buffers (raw ``uint64`` tables) into a
    head-group-major host pool: ``dst[d // P, g, l, d % P] = layer_l[s][g]``; the inverse
    of :func:`transfer_kv_per_layer_pfdhg_lf`.

    Lowered: the host pool is read as a page_first_direct pool whose page ``page * head_num
    + g`` is group ``g`` of a page, of ``group_bytes`` items; each device entry as rows of
    ``group_bytes`` whose slot count is cut to whole ``page_size`` pages of group rows (the
    two layouts share the page size), so a device token in an entry's last partial page of
    group rows cannot be copied (a reported slot error, never a wrong byte).
    ``n * head_num`` slot indices per side are computed first.

    Other arguments and errors as :func:`transfer_kv_all_layer_lf_ph`.
    """
    quota = _default_pfdhg_block_quota() if block_quota is None else block_quota
    ctas = block_quota_of(quota)
    item = _item_size(item_size)
    layers = _int("num_layers", num_layers)
    if _layers_in("dst_layout_dim", dst_layout_dim, item) != layers:
        raise LayoutError(f"dst_layout_dim {dst_layout_dim} is not num_layers ({layers}) * item_size ({item})")
    ps = _int("page_size", page_size)
    groups = _heads("head_num", head_num, item)
    _warps(num_warps_per_block)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    s_names = ("src_k_layers", "src_v_layers")
    s_ptrs = tuple(ptr_arg(n, t, layers) for n, t in zip(s_names, (src_k_layers, src_v_layers)))
    d_names, d_ts = _kv(dst_k, dst_v, ("dst_k", "dst_v"))
    device = launch_device("transfer_kv_all_layer_lf_pfdhg", list(zip(s_names + d_names, s_ptrs + d_ts)),
                           (s_idx, d_idx))
    pages = _head_host(d_names, d_ts, layers * item, ps)
    part = item // groups
    have = min(room(n, t, device) for n, t in zip(s_names, s_ptrs))
    rows = (have // item) * groups // ps * ps  # group rows, whole pages of them
    if rows == 0:
        raise RegistrationSpanError(
            f"src_k_layers / src_v_layers: an entry has {have} bytes to the end of its allocation, less than a page "
            f"of {ps} rows of {part} bytes. Fix: check item_size, head_num and page_size")
    s_table = joined([exact(n, t, device, rows * part) for n, t in zip(s_names, s_ptrs)])
    s_slots = rows // groups  # tokens every group of which lies in a whole page of rows
    d_slots = pages * ps
    src = Side(s_table, s_slots, layout("layer_first", 2, layers, rows, ps, part))
    dst = Side(buffers_table("dst_k, dst_v", d_ts, device), d_slots,
               layout("page_first_direct", 2, layers, d_slots * groups, ps, part))
    check_range("src_indices", s_idx, s_slots)
    check_range("dst_indices", d_idx, d_slots)
    apart(src, s_names, dst, d_names)
    launch_derived(src, dst, lambda: (row_parts(s_idx, s_slots, groups), page_parts(d_idx, d_slots, ps, groups)),
                   given=(s_idx, d_idx), layer=None, ctas=ctas)


# -- direct (copy engine) ---------------------------------------------------------------------

def tensor_list(name: str, value: object) -> tuple[torch.Tensor, ...]:
    """A non-empty list or tuple of tensors (a bare tensor is refused: iterating it gives rows)."""
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise InvalidTypeError(f"{name}: found a {type(value).__name__}, expected a list of torch.Tensor")
    if not value:
        raise InvalidArgumentError(f"{name}: an empty list, expected at least one tensor")
    return tuple(tensor_arg(f"{name}[{i}]", t) for i, t in enumerate(value))


def pageable(t: torch.Tensor, device: Device) -> bool:
    """True when ``t`` is plain pageable host memory: a CPU tensor, no byte at either end in
    an open or closed registration, and no allocation the runtime pinned at its start (the
    tests :func:`pointerdomain.make_kernel_ptr_table` makes before it refuses host memory
    as unregistered: registered, closed, straddling and runtime-pinned memory keep the
    table path and its errors)."""
    if not t.is_cpu or _raw.memory_device_of("tensor", t) is not None:
        return False
    va, n = HostVA.unsafe_from_int(t.data_ptr()), max(nbytes_of(t), 1)
    if (find_registration(va, 1) is not None or find_registration(va.offset(n - 1), 1) is not None
            or find_closed_registration(va, n) is not None):
        return False
    try:
        alias_of(va, device)  # pinned by the runtime (pin_memory(), cudaHostAlloc)
    except NotRegisteredError:
        return True
    return False


def torch_route(named: Sequence[tuple[str, torch.Tensor]], device: Device) -> bool:
    """True when a direct op takes the torch route (some buffer is plain pageable host
    memory); every other buffer is then checked as the table path checks it (a closed
    registration, unregistered memory, another device's memory: typed errors), so the
    route never writes memory the table path would refuse.

    Raises:
        InvalidArgumentError: the torch route while the device's stream is capturing a graph
            (its copy would run once now and not on replay), as the copy-engine route is.
    """
    flags = [pageable(t, device) for _, t in named]
    if not any(flags):
        return False
    for (name, t), plain in zip(named, flags):
        if not plain:
            buffers_table(name, (t,), device)
    if backend_for(device).is_capturing(device):
        name = next(name for (name, _), plain in zip(named, flags) if plain)
        raise InvalidArgumentError(
            f"{name}: plain pageable host memory, which cannot be captured in a CUDA graph (the copy would run once "
            "now and not on replay); nothing was copied. Fix: register or pin the host buffer "
            "(pointerdomain.register_host_tensor, pin_memory()), or call outside capture")
    return True


def copy_rows(src: torch.Tensor, dst: torch.Tensor, rows: tuple[int, int], s: torch.Tensor,
              d: torch.Tensor) -> None:
    """Rows ``s`` of contiguous ``src`` into rows ``d`` of contiguous ``dst`` by torch
    (``rows``: each tensor's row count; the indices checked in range before): the route of
    upstream's ``Tensor.copy_`` when one side is pageable host memory, which the runtime
    stages itself and no kernel or DMA descriptor may address. Exactly the mapped rows are
    written, on the current stream."""
    s_rows = src.view(torch.uint8).reshape(rows[0], -1)
    d_rows = dst.view(torch.uint8).reshape(rows[1], -1)
    # inference mode: an in-place write into an inference tensor is refused outside it
    with torch.inference_mode():
        staged = s_rows.index_select(0, s.to(s_rows.device)).to(d_rows.device)
        d_rows.index_copy_(0, d.to(d_rows.device), staged)


def rows_of(name: str, ts: Sequence[torch.Tensor]) -> tuple[int, int]:
    """``(rows, row_bytes)`` shared by tensors ``ts`` (dim 0 the token), all contiguous,
    of one dtype and shape."""
    first = ts[0]
    for i, t in enumerate(ts):
        if t.dim() < 1 or t.shape[0] == 0 or t.numel() == 0:
            raise LayoutError(f"{name}[{i}]: shape {tuple(t.shape)}, expected [tokens, ...] with tokens")
        if t.shape != first.shape or t.dtype != first.dtype:
            raise LayoutError(
                f"{name}[{i}]: {tuple(t.shape)} {t.dtype}, but {name}[0] is {tuple(first.shape)} {first.dtype}: "
                "every tensor of the list must have one shape and dtype")
        if not t.is_contiguous():
            raise NonContiguousError(f"{name}[{i}]: strides {t.stride()}, not contiguous")
    return int(first.shape[0]), nbytes_of(first) // int(first.shape[0])


def _page_multiple(s_idx: torch.Tensor, page_size: int) -> None:
    if s_idx.numel() % page_size:
        raise IndexValidationError(
            f"src_indices: {s_idx.numel()} slots is not a multiple of page_size {page_size} (upstream: "
            "\"Source indices size must be divisible by page size\")")


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Copy every slot pair of every listed layer buffer: ``dst_layers[j][d[i]] =
    src_layers[j][s[i]]``, through the copy engine (``backend="copy_engine"``: the runtime's
    batch copy of runs of consecutive slots, as upstream's ``copy_`` of runs).

    Args:
        src_layers, dst_layers: equally long lists of per-layer buffers ``[tokens, ...]``
            (K layers then V layers, or any list), contiguous, one shape and dtype a list,
            one token row size for both; registered / pinned host memory or device memory
            of one device.
        src_indices, dst_indices: ``int64`` 1-D token slots of equal length, a multiple of
            ``page_size``; on the CPU or the device (read on the host, as upstream).
        page_size: > 0 (upstream's divisibility check; the runs merge within pages).

    Raises:
        LayoutError: lists of different lengths, shapes or dtypes.
        PointerDomainError: as :func:`transfer_kv_per_layer`.
    """
    src = tensor_list("src_layers", src_layers)
    dst = tensor_list("dst_layers", dst_layers)
    if len(src) != len(dst):
        raise LayoutError(f"src_layers has {len(src)} tensors but dst_layers has {len(dst)}")
    ps = _int("page_size", page_size)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    _page_multiple(s_idx, ps)
    s_rows, s_row = rows_of("src_layers", src)
    d_rows, d_row = rows_of("dst_layers", dst)
    if s_row != d_row or src[0].dtype != dst[0].dtype:
        raise LayoutError(
            f"src_layers rows are {s_row} bytes of {src[0].dtype}, dst_layers rows {d_row} bytes of {dst[0].dtype}: "
            "a token must be the same on both sides")
    device = launch_device("transfer_kv_direct",
                           [(f"src_layers[{i}]", t) for i, t in enumerate(src)]
                           + [(f"dst_layers[{i}]", t) for i, t in enumerate(dst)], (s_idx, d_idx))
    apart_tensors([f"dst_layers[{i}]" for i in range(len(dst))], dst, [f"src_layers[{i}]" for i in range(len(src))],
                  src)
    if torch_route([(f"src_layers[{i}]", t) for i, t in enumerate(src)]
                   + [(f"dst_layers[{i}]", t) for i, t in enumerate(dst)], device):
        s_host, d_host = s_idx.cpu(), d_idx.cpu()
        check_range("src_indices", s_host, s_rows)
        check_range("dst_indices", d_host, d_rows)
        distinct("dst_indices", d_host)  # index_copy_ would let the last write win
        for a, b in zip(src, dst):
            copy_rows(a, b, (s_rows, d_rows), s_host, d_host)
        return
    page = ps if s_rows % ps == 0 and d_rows % ps == 0 else 1
    n = len(src)
    src_side = Side(buffers_table("src_layers", src, device), s_rows, layout("layer_first", 1, n, s_rows, page, s_row))
    dst_side = Side(buffers_table("dst_layers", dst, device), d_rows, layout("layer_first", 1, n, d_rows, page, d_row))
    check_range("src_indices", s_idx, s_rows)
    check_range("dst_indices", d_idx, d_rows)
    launch(src_side, dst_side, s_idx, d_idx, layer=None, ctas=pd.DEFAULT_MAX_CTAS, backend="copy_engine")


class _PageDirect(NamedTuple):
    tensors: tuple[torch.Tensor, ...]
    pages: int
    layers: int
    item: int


def _page_direct(name: str, ts: tuple[torch.Tensor, ...], page_size: int) -> _PageDirect:
    """page_first_direct buffers ``[pages, num_layers, page_size, ...]`` (K, V or one)."""
    first = ts[0]
    for i, t in enumerate(ts):
        if t.dim() < 3 or t.numel() == 0:
            raise LayoutError(f"{name}[{i}]: shape {tuple(t.shape)}, expected [pages, num_layers, page_size, ...]")
        if t.shape != first.shape or t.dtype != first.dtype:
            raise LayoutError(f"{name}[{i}]: {tuple(t.shape)} {t.dtype}, but {name}[0] is {tuple(first.shape)}")
        if not t.is_contiguous():
            raise NonContiguousError(f"{name}[{i}]: strides {t.stride()}, not contiguous")
    if first.shape[2] != page_size:
        raise LayoutError(
            f"{name}: dimension 2 of {tuple(first.shape)} is {first.shape[2]}, but page_size is {page_size} "
            "(a page_first_direct buffer is [pages, num_layers, page_size, ...])")
    pages, layers = int(first.shape[0]), int(first.shape[1])
    return _PageDirect(ts, pages, layers, nbytes_of(first) // (pages * layers * page_size))


def _direct_pf(page_ts: tuple[torch.Tensor, ...], page_name: str, layer_ts: tuple[torch.Tensor, ...],
               layer_name: str, page_idx: torch.Tensor, layer_idx: torch.Tensor, start_layer: int | None,
               page_size: int, to_pages: bool, what: str) -> None:
    """Both page_first_direct ops: per device layer ``j`` (one launch each), page chunk ``p``
    moves ``page_size`` tokens between host page ``page_idx[p * P] // P`` (rows of layer
    ``start + j``) and device rows ``layer_idx[p * P] + [0, P)``."""
    kv = len(page_ts)
    if kv not in (1, 2):
        raise LayoutError(f"{page_name}: {kv} tensors, expected [K, V] or one MLA buffer")
    if len(layer_ts) % kv:
        raise LayoutError(f"{layer_name}: {len(layer_ts)} tensors is not a whole number of {kv}-buffer layers")
    host = _page_direct(page_name, page_ts, page_size)
    n_layers = len(layer_ts) // kv
    start = 0 if start_layer is None else _layer_id(start_layer, host.layers)
    if start + n_layers > host.layers:
        raise LayoutError(
            f"{layer_name}: {n_layers} layers from layer {start}, but {page_name} holds {host.layers} layers")
    rows, row = rows_of(layer_name, layer_ts)
    if row != host.item or layer_ts[0].dtype != page_ts[0].dtype:
        raise LayoutError(
            f"{layer_name}: rows of {row} bytes ({layer_ts[0].dtype}), but a token of {page_name} holds {host.item} "
            f"bytes ({page_ts[0].dtype})")
    device = launch_device(what, [(f"{page_name}[{i}]", t) for i, t in enumerate(page_ts)]
                           + [(f"{layer_name}[{i}]", t) for i, t in enumerate(layer_ts)], (page_idx, layer_idx))
    page_named = ([f"{page_name}[{i}]" for i in range(len(page_ts))], page_ts)
    layer_named = ([f"{layer_name}[{i}]" for i in range(len(layer_ts))], layer_ts)
    if to_pages:
        apart_tensors(*page_named, *layer_named)
    else:
        apart_tensors(*layer_named, *page_named)
    page_starts = page_idx[::page_size]
    layer_starts = layer_idx[::page_size]
    host_slots = host.pages * page_size
    slow = torch_route([(f"{page_name}[{i}]", t) for i, t in enumerate(page_ts)]
                       + [(f"{layer_name}[{i}]", t) for i, t in enumerate(layer_ts)], device)
    if slow:  # the indices are read on the host anyway (as upstream's .cpu())
        page_starts, layer_starts = page_starts.cpu(), layer_starts.cpu()
    check_range("src_indices" if not to_pages else "dst_indices", page_starts, host_slots)
    check_range("dst_indices" if not to_pages else "src_indices", layer_starts, rows, page_size)
    flat = host.pages * host.layers * page_size
    if slow:
        d_runs = runs(layer_starts, rows, page_size)
        # index_copy_ would let the last write win: the rows written, by their place in the indices
        distinct("dst_indices", d_runs if not to_pages else runs(page_starts, host_slots, page_size,
                                                                    aligned_to=page_size), "row")
        for j in range(n_layers):
            h_runs = runs(page_starts, host_slots, page_size, aligned_to=page_size, scale=host.layers * page_size,
                          offset=(start + j) * page_size)
            for k in range(kv):
                layer_t, page_t = layer_ts[j + k * n_layers], page_ts[k]
                if to_pages:
                    copy_rows(layer_t, page_t, (rows, flat), d_runs, h_runs)
                else:
                    copy_rows(page_t, layer_t, (flat, rows), h_runs, d_runs)
        return
    page_side = Side(buffers_table(page_name, page_ts, device), host_slots,
                     layout("layer_first", kv, 1, flat, page_size if rows % page_size == 0 else 1, host.item))
    page_lay = page_side.layout.page_size
    plans = []
    for j in range(n_layers):
        tensors = tuple(layer_ts[j + k * n_layers] for k in range(kv))
        side = Side(buffers_table(layer_name, tensors, device), rows, layout("layer_first", kv, 1, rows, page_lay, row))
        plans.append((j, side))
    d_runs = runs(layer_starts, rows, page_size)
    for j, side in plans:
        h_runs = runs(page_starts, host_slots, page_size, aligned_to=page_size, scale=host.layers * page_size,
                      offset=(start + j) * page_size)
        if to_pages:
            launch(side, page_side, d_runs, h_runs, layer=None, ctas=pd.DEFAULT_MAX_CTAS, backend="copy_engine")
        else:
            launch(page_side, side, h_runs, d_runs, layer=None, ctas=pd.DEFAULT_MAX_CTAS, backend="copy_engine")


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Load from a page_first_direct host pool into device layers, page by page, through
    the copy engine: for chunk ``p`` (every ``page_size``-th index), ``dst_ptrs[j][d0 + t] =
    src_ptrs[kv][s0 // P, layer_id + j, t]`` for ``t < P``, ``s0 = s[p * P]``, ``d0 = d[p * P]``
    (the other indices are not read, as upstream).

    Args:
        src_ptrs: ``[K, V]`` host buffers ``[pages, num_layers, page_size, ...]`` (or one for
            MLA), contiguous.
        dst_ptrs: per-layer device buffers, K layers then V layers (``n`` layers from
            ``layer_id``; upstream passes one), rows of one token.
        src_indices, dst_indices: ``int64`` 1-D, equal length, a multiple of ``page_size``.
        layer_id: the first host layer.
        page_size: tokens per page (dimension 2 of the host buffers).

    Lowered: the host buffer is read as one flat array of token rows (row ``(s0 // P *
    num_layers + layer) * P + t``); the ``n`` slots are computed per call (torch ops); one
    launch per device layer.

    Raises:
        As :func:`transfer_kv_direct`.
    """
    page_ts = tensor_list("src_ptrs", src_ptrs)
    layer_ts = tensor_list("dst_ptrs", dst_ptrs)
    ps = _int("page_size", page_size)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    _page_multiple(s_idx, ps)
    if type(layer_id) is not int:
        raise IndexValidationError(f"layer_id: found {describe(layer_id)}, expected an int")
    _direct_pf(page_ts, "src_ptrs", layer_ts, "dst_ptrs", s_idx, d_idx, layer_id, ps, False,
               "transfer_kv_per_layer_direct_pf_lf")


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Back up device layers into a page_first_direct host pool, page by page, through the
    copy engine: ``dst_ptrs[kv][d0 // P, j, t] = src_ptrs[j (+ n for V)][s0 + t]`` for every
    chunk ``p``, ``t < P``, ``s0 = s[p * P]``, ``d0 = d[p * P]``.

    Args:
        src_ptrs: per-layer device buffers, K layers then V layers (or the MLA layers).
        dst_ptrs: ``[K, V]`` host buffers ``[pages, num_layers, page_size, ...]`` (or one).

    Other arguments, lowering and errors as :func:`transfer_kv_per_layer_direct_pf_lf`.
    """
    layer_ts = tensor_list("src_ptrs", src_ptrs)
    page_ts = tensor_list("dst_ptrs", dst_ptrs)
    ps = _int("page_size", page_size)
    s_idx, d_idx = index_pair(src_indices, dst_indices)
    _page_multiple(s_idx, ps)
    _direct_pf(page_ts, "dst_ptrs", layer_ts, "src_ptrs", d_idx, s_idx, None, ps, True,
               "transfer_kv_all_layer_direct_lf_pf")


def _int_list(name: str, value: object) -> list[int]:
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise InvalidTypeError(f"{name}: found a {type(value).__name__}, expected a list of ints")
    for i, v in enumerate(value):
        if type(v) is not int:
            raise InvalidTypeError(f"{name}[{i}]: found {describe(v)} ({type(v).__name__}), expected an int")
    return list(value)


def _ranges_apart(s_t: torch.Tensor, d_t: torch.Tensor, starts_s: list[int], starts_d: list[int],
                  lens: list[int], row: int) -> None:
    """Refuse row ranges (each inside its tensor, checked before) whose destination rows
    meet another range's destination rows, or whose destination bytes are bytes any range
    reads (``src`` and ``dst`` over one buffer): either would leave bytes that depend on
    the copy order. Byte spans from the tensors' addresses, so views of one buffer at
    other rows compare exactly; ranges that meet nothing may share a buffer.

    Raises:
        OverlapError: naming the two ranges and the rows.
    """
    d_spans = sorted((b, b + n, r) for r, (b, n) in enumerate(zip(starts_d, lens)) if n)
    reach, holder = -1, -1  # the furthest destination end so far, and its range
    for b, end, r in d_spans:
        if b < reach:
            first, second = sorted((holder, r))
            raise OverlapError(
                f"range {first} and range {second} write dst rows [{b}, {min(end, reach)}): the copy would write those "
                "rows twice, in no defined order (a race on a GPU), so which range lands is chance; nothing was "
                "copied. Fix: give every destination row to one range")
        if end > reach:
            reach, holder = end, r
    d_base, s_base = d_t.data_ptr(), s_t.data_ptr()
    d_end, s_end = d_base + nbytes_of(d_t), s_base + nbytes_of(s_t)
    if d_end <= s_base or s_end <= d_base:
        return  # separate memory: no range reads what another writes
    s_spans = sorted((s_base + a * row, s_base + (a + n) * row, r) for r, (a, n) in enumerate(zip(starts_s, lens)) if n)
    for b, end, r in d_spans:
        lo, hi = d_base + b * row, d_base + end * row
        for a_lo, a_hi, q in s_spans:
            if a_lo >= hi:
                break
            if a_hi > lo:
                at = max(lo, a_lo)
                raise with_address(OverlapError(
                    f"range {r} writes dst rows [{b}, {end}) that range {q} reads (src rows [{starts_s[q]}, "
                    f"{starts_s[q] + lens[q]}); shared bytes from {at:#x}): the copy would read bytes it also writes, "
                    "in no defined order; nothing was copied. Fix: copy between separate buffers or ranges that do "
                    "not meet"), at)


def transfer_embedding_ranges_direct(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: list[int],
    dst_starts: list[int],
    lengths: list[int],
) -> None:
    """Copy row ranges ``dst[dst_starts[r] : + lengths[r]] = src[src_starts[r] : + lengths[r]]``
    between host and device tensors through the copy engine, on the current stream.

    Args:
        src, dst: ``[rows, ...]`` contiguous tensors of one dtype and row shape; one in
            device memory, the other registered / pinned host memory (or both device memory).
        src_starts, dst_starts, lengths: equally long lists of ints; starts >= 0, lengths
            >= 0, every range inside its tensor.

    Raises:
        InvalidTypeError: not tensors, not lists of ints.
        IndexValidationError: lists of different lengths, a negative value, a range past a tensor.
        OverlapError: two ranges writing one destination row, or a range's destination rows
            meeting rows a range reads (``src`` and ``dst`` over one buffer); ranges that
            meet nothing may move rows inside one buffer.
        LayoutError, NonContiguousError, DomainError, DeviceMismatchError: as
            :func:`transfer_kv_direct`.
    """
    s_t = tensor_arg("src", src)
    d_t = tensor_arg("dst", dst)
    starts_s = _int_list("src_starts", src_starts)
    starts_d = _int_list("dst_starts", dst_starts)
    lens = _int_list("lengths", lengths)
    if not len(starts_s) == len(starts_d) == len(lens):
        raise IndexValidationError(
            f"src_starts, dst_starts and lengths have {len(starts_s)}, {len(starts_d)} and {len(lens)} entries")
    s_rows, s_row = rows_of("src", (s_t,))
    d_rows, d_row = rows_of("dst", (d_t,))
    if s_t.shape[1:] != d_t.shape[1:] or s_t.dtype != d_t.dtype:
        raise LayoutError(f"src rows {tuple(s_t.shape[1:])} {s_t.dtype} and dst rows {tuple(d_t.shape[1:])} "
                          f"{d_t.dtype} differ")
    for r, (a, b, n) in enumerate(zip(starts_s, starts_d, lens)):
        if a < 0 or b < 0 or n < 0 or a + n > s_rows or b + n > d_rows:
            raise IndexValidationError(
                f"range {r}: src [{a}, {a + n}) of {s_rows} rows, dst [{b}, {b + n}) of {d_rows} rows: outside a "
                "tensor or negative")
    device = launch_device("transfer_embedding_ranges_direct", [("src", s_t), ("dst", d_t)])
    _ranges_apart(s_t, d_t, starts_s, starts_d, lens, s_row)  # both routes: torch's index_copy_ would not refuse
    s_idx = torch.cat([torch.arange(a, a + n, dtype=torch.int64) for a, n in zip(starts_s, lens)]
                      or [torch.empty(0, dtype=torch.int64)])
    d_idx = torch.cat([torch.arange(b, b + n, dtype=torch.int64) for b, n in zip(starts_d, lens)]
                      or [torch.empty(0, dtype=torch.int64)])
    if torch_route([("src", s_t), ("dst", d_t)], device):
        copy_rows(s_t, d_t, (s_rows, d_rows), s_idx, d_idx)
        return
    src_side = Side(buffers_table("src", (s_t,), device), s_rows, layout("layer_first", 1, 1, s_rows, 1, s_row))
    dst_side = Side(buffers_table("dst", (d_t,), device), d_rows, layout("layer_first", 1, 1, d_rows, 1, d_row))
    launch(src_side, dst_side, s_idx, d_idx, layer=None, ctas=pd.DEFAULT_MAX_CTAS, backend="copy_engine")
