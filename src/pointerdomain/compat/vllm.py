"""vLLM's block swap ops, same call shapes, every argument checked before anything is written.

Upstream (vllm-project/vllm; read at the commits named):

* ``vllm/_custom_ops.py`` (0002bde560dd9adcabb28b0da32f47d4c020e799)::

      swap_blocks(src: Tensor, dst: Tensor, block_size_in_bytes: int, block_mapping: Tensor) -> None
      swap_blocks_batch(src_ptrs: Tensor, dst_ptrs: Tensor, sizes: Tensor,
                        is_src_access_order_any: bool = False) -> None

* schemas, ``csrc/libtorch_stable/torch_bindings.cpp`` (0135b6c0e1e17d8da42d9812f967a16eaa71afbf)::

      swap_blocks(Tensor src, Tensor! dst, int block_size_in_bytes, Tensor block_mapping) -> ()
      swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes,
                        bool is_src_access_order_any=False) -> ()

* semantics, ``csrc/libtorch_stable/cache_kernels.cu`` (00eb0c874eb54594184ace2b4711db1df48ba85c):
  ``swap_blocks`` issues one ``cudaMemcpyAsync`` of ``block_size_in_bytes`` bytes per row
  ``(s, d)`` of ``block_mapping`` (a CPU ``int64 [n, 2]`` tensor, strides honoured), from
  ``src.data_ptr() + s * block_size_in_bytes`` to ``dst.data_ptr() + d * block_size_in_bytes``
  on the current stream; src and dst on one GPU, or one on the GPU and one on the CPU, never
  both on the CPU. No block id is range-checked there. ``swap_blocks_batch`` takes three CPU
  ``int64 [n]`` tensors (raw addresses, byte counts) and hands them to one
  ``cuMemcpyBatchAsync`` (``srcAccessOrder`` ANY when ``is_src_access_order_any``, else
  STREAM), or a loop of ``cudaMemcpyAsync(cudaMemcpyDefault)`` on older drivers, on the
  current stream. Nothing about the addresses is checked there.
* callers: ``tests/kernels/attention/test_cache.py`` (00228592456192abf9bea6f7ac937fa367f007a3)
  calls ``swap_blocks(src_cache, dst_cache, src_cache.element_size() * src_cache.stride(0),
  block_mapping)`` with ``block_mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)``;
  ``vllm/v1/kv_offload/cpu/gpu_worker.py`` (003ffff6b4d753da7b4a53d5fbbec843eb5b4da3) builds
  ``tensor.data_ptr() + block_id * tensor.stride(0)`` per KV tensor and block on both sides
  (GPU tensors and pinned ``int8 [num_blocks, page_bytes]`` CPU tensors) and calls
  ``swap_blocks_batch(torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(sizes))``
  on a side stream.

Here both run through :func:`pointerdomain.transfer_kv_all_layer` with
``backend="copy_engine"`` (the runtime's batch copy, as upstream), over tables whose slot is
one block (``swap_blocks``) or one descriptor (``swap_blocks_batch``), so every copy is exactly
the bytes upstream copies, fed device aliases only. The one exception is ``swap_blocks`` with
plain pageable host memory on the host side (upstream's own test copies to and from plain
``torch.empty(..., device="cpu")`` caches; ``cudaMemcpyAsync`` stages pageable memory
itself): those blocks are copied by torch (see :func:`swap_blocks`), nothing is pinned or
registered. Before anything is copied:

* host memory for ``swap_blocks_batch`` must be registered
  (:func:`pointerdomain.register_host_tensor`, :class:`pointerdomain.HostKVPool`,
  :func:`pointerdomain.alloc_registered`) or pinned by the runtime (``pin_memory()``): a
  batch DMA descriptor must hold a device alias, and pageable memory has none;
* device memory must be the launch device's;
* every block id, address and byte count is checked against the memory it lies in;
* overlap: a copy never writes bytes another copy of the same call reads or writes (see
  each function).

``is_src_access_order_any`` is checked and accepted; the copies always keep stream order,
the choice upstream documents as always safe. Ordering otherwise as upstream: the copies
are queued on the current stream of the launch device; keep the memory alive until it runs.
"""

from __future__ import annotations

import array
import functools
import importlib.util
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Literal, NamedTuple

import torch


import pointerdomain as pd
from pointerdomain.arguments import describe
from pointerdomain.compat import _raw
from pointerdomain.compat._raw import held, view_key
from pointerdomain._platform import backend_for
from pointerdomain.devices import current_device
from pointerdomain.domains import HostVA
from pointerdomain.errors import (
    ClosedError,
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    NotRegisteredError,
    OverlapError,
    PointerDomainError,
)
from pointerdomain.registration.memory import find_closed_registration, find_registration
from pointerdomain.registration.resolve import alias_of

__all__ = ["swap_blocks", "swap_blocks_batch"]

_MASK: Final = (1 << 64) - 1
#: int64 with only the sign bit: ``x ^ _FLIP`` orders int64 bit patterns as unsigned addresses
_FLIP: Final = -(1 << 63)


# -- swap_blocks -----------------------------------------------------------------------

def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(
            f"{name}: found a {type(t).__name__}, expected a torch.Tensor. Fix: pass the tensor itself")
    return t


def _check_blocks(name: str, t: object) -> torch.Tensor:
    blocks = _check_tensor(name, t)
    if blocks.dim() < 1 or blocks.numel() == 0:
        raise LayoutError(
            f"{name}: shape {tuple(blocks.shape)}, expected a block-major [num_blocks, ...] tensor with blocks. "
            f"Fix: pass the whole KV cache tensor, dimension 0 the block")
    return blocks


@functools.lru_cache(maxsize=512)
def _block_layout(kind: Literal["layer_first", "page_first"], count: int, nbytes: int) -> pd.KVLayout:
    """A layout whose slot (and page) is one ``nbytes`` block, ``count`` of them: one item of
    ``nbytes`` uint8 per slot, one layer, one kv. Cached so a repeated call shape finds its
    transfer plan again (plans are keyed by the layout objects)."""
    return pd.KVLayout(kind=kind, attention="mla", num_layers=1, num_pages=count, page_size=1, num_heads=1,
                       head_dim=nbytes, dtype="uint8")


class _Flat(NamedTuple):
    ref: weakref.ref[torch.Tensor]
    data_ptr: int
    storage_ptr: int
    nbytes: int
    view: torch.Tensor


#: id(tensor) -> its flat uint8 view over its blocks (strided tensors only), so the same
#: tensor gives the same view object and so the same cached table on every call
_flats: dict[int, _Flat] = {}
_FLATS_MAX: Final = 64
_flat_lock = threading.Lock()


def _blocks_view(name: str, t: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """The ``t.shape[0] * block_bytes`` bytes from ``t.data_ptr()`` (block ``b`` is the
    ``block_bytes`` bytes at ``b * block_bytes``), checked to lie in ``t``'s storage: ``t``
    itself when it is exactly those bytes, else a flat ``uint8`` view of them."""
    stride_bytes = t.stride(0) * t.element_size()
    if stride_bytes != block_bytes:
        raise LayoutError(
            f"{name}: block_size_in_bytes is {block_bytes} but {name}'s blocks (dimension 0) are {stride_bytes} "
            f"bytes apart (element_size() {t.element_size()} * stride(0) {t.stride(0)}): block b would not be "
            f"{name}[b]. Fix: pass {name}.element_size() * {name}.stride(0), the same for src and dst")
    count = int(t.shape[0])
    span = count * block_bytes
    storage = t.untyped_storage()
    offset = t.storage_offset() * t.element_size()
    if t.is_contiguous() and t.numel() * t.element_size() == span and offset + span <= storage.nbytes():
        return t
    if offset + span > storage.nbytes():  # a view past its storage, or a storage released (resize_(0))
        raise LayoutError(
            f"{name}: its {count} blocks of {block_bytes} bytes end {offset + span - storage.nbytes()} bytes past "
            f"the end of its storage ({storage.nbytes()} bytes, {name} starting at byte {offset}): the last block "
            "would be copied from or into memory that is not the tensor's. Fix: pass a tensor whose blocks lie "
            "in its storage (e.g. the whole [num_blocks, ...] buffer rather than a view offset into it)")
    key = id(t)
    hit = _flats.get(key)
    if (hit is not None and hit.ref() is t and hit.data_ptr == t.data_ptr() and hit.nbytes == span
            and hit.storage_ptr == storage.data_ptr()):
        return hit.view
    with torch.inference_mode(False):  # a plain tensor, so it may be cached and reused outside
        view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, offset, (span,), (1,))
    with _flat_lock:
        for dead in [k for k, entry in _flats.items() if entry.ref() is None]:
            del _flats[dead]  # the view holds the storage: let it go with its tensor
        _flats[key] = _Flat(weakref.ref(t), t.data_ptr(), storage.data_ptr(), span, view)
        while len(_flats) > _FLATS_MAX:
            del _flats[next(iter(_flats))]
    return view


class _Sides(NamedTuple):
    device: pd.Device
    #: the side in device memory, or None: both are device memory of ``device``
    device_side: Literal["src", "dst"] | None


def _launch_device(src: torch.Tensor, dst: torch.Tensor) -> _Sides:
    """The device of ``src`` / ``dst`` (whichever is device memory, the same device if both)."""
    s = _raw.memory_device_of("src", src)
    d = _raw.memory_device_of("dst", dst)
    for name, t, where in (("src", src, s), ("dst", dst, d)):
        if where is None and not t.is_cpu:
            raise DomainError(f"{name}: a tensor on {t.device}, expected host memory or device memory. Fix: pass a "
                              "tensor of the KV cache's device or its registered host copy")
    if s is None and d is None:
        raise DomainError(
            "src and dst are both host memory: swap_blocks copies between device memory and host memory or "
            "inside one device (upstream: 'Invalid device combination'). Fix: put one side on the device")
    if s is not None and d is not None:
        if s != d:
            raise DeviceMismatchError(
                f"src is memory of {s} and dst of {d}, expected one device (upstream: 'src and dst must be on the "
                "same GPU'). Fix: copy between devices in two steps through registered host memory")
        return _Sides(s, None)
    if s is not None:
        return _Sides(s, "src")
    assert d is not None
    return _Sides(d, "dst")


def _check_mapping(block_mapping: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_mapping``'s two columns as contiguous int64 CPU tensors."""
    mapping = _check_tensor("block_mapping", block_mapping)
    if mapping.dtype != torch.int64:
        raise IndexValidationError(
            f"block_mapping: dtype {mapping.dtype}, expected torch.int64. Fix: build it with dtype=torch.int64")
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise IndexValidationError(
            f"block_mapping: shape {tuple(mapping.shape)}, expected [num_pairs, 2] (src block, dst block). Fix: "
            "torch.tensor(pairs, dtype=torch.int64).view(-1, 2)")
    if not mapping.is_cpu or _raw.memory_device_of("block_mapping", mapping) is not None:
        raise IndexValidationError(
            f"block_mapping: in memory of {_raw.memory_device_of('block_mapping', mapping) or mapping.device}, "
            "expected a CPU tensor in host memory (upstream: 'block_mapping must be on CPU'). Fix: build it on "
            "the CPU (.cpu())")
    return mapping[:, 0].clone(), mapping[:, 1].clone()  # read once: the checked copy is the one used


def _check_block_ids(side: str, column: int, ids: torch.Tensor, count: int) -> None:
    bad = ((ids < 0) | (ids >= count)).nonzero()
    if bad.numel():
        row = int(bad[0])
        raise IndexValidationError(
            f"block_mapping[{row}][{column}]: {side} block {int(ids[row])} outside [0, {count}) of {side} "
            f"({count} blocks), expected a block id of {side}; nothing was copied. Fix: check the block ids "
            f"against {side}.shape[0]")


def _pageable(view: torch.Tensor, device: pd.Device) -> bool:
    """True when the host memory of ``view`` (a CPU tensor) is plain pageable memory: no
    byte at either end in an open or closed registration, and the runtime knows no pinned
    allocation at its start. The same tests :func:`pointerdomain.make_kernel_ptr_table`
    makes before it refuses host memory as unregistered, so registered, closed,
    straddling and runtime-pinned memory keep the copy-engine path and its errors."""
    va = view.data_ptr()
    nbytes = view.numel() * view.element_size()
    start = HostVA.unsafe_from_int(va)
    if (find_registration(start, 1) is not None or find_registration(start + (nbytes - 1), 1) is not None
            or find_closed_registration(start, nbytes) is not None):
        return False
    try:
        alias_of(start, device)  # pinned by the runtime (pin_memory(), cudaHostAlloc)
    except NotRegisteredError:
        return True
    return False


#: Bytes staged per torch copy on the pageable path (bounds its temporary memory).
_STAGE_BYTES: Final = 64 << 20


def _rows(view: torch.Tensor, count: int, block_bytes: int) -> torch.Tensor:
    """``view`` (exactly ``count`` blocks, contiguous) as ``uint8 [count, block_bytes]``."""
    return view.reshape(-1).view(torch.uint8).view(count, block_bytes)


def _copy_pageable(s_rows: torch.Tensor, d_rows: torch.Tensor, s_ids: torch.Tensor, d_ids: torch.Tensor) -> None:
    """Rows ``s_ids`` of ``s_rows`` into rows ``d_ids`` of ``d_rows`` (one side pageable
    host memory, the other device memory): a gather on the source's device, one torch
    copy to the destination's device, an ``index_copy_`` there. Exactly the mapped rows
    are written; at most ``_STAGE_BYTES`` are staged at a time."""
    step = max(1, _STAGE_BYTES // int(s_rows.shape[1]))
    s_at, d_at = s_ids.to(s_rows.device), d_ids.to(d_rows.device)
    # inference mode: upstream's caches are made under torch.inference_mode(), and an
    # in-place write into an inference tensor is refused outside it
    with torch.inference_mode():
        for lo in range(0, s_ids.numel(), step):
            staged = s_rows.index_select(0, s_at[lo : lo + step]).to(d_rows.device)
            d_rows.index_copy_(0, d_at[lo : lo + step], staged)


# A cache swaps blocks of the same two tensors call after call; only the mapping changes.
# The checked translation (the two tables and layouts, the route) is kept per (src, dst,
# block size), keyed as sglang's prepared calls (:func:`pointerdomain.compat._raw.view_key`),
# for the copy-engine route only; a repeat checks the mapping (CPU int64 [n, 2], no
# destination block twice) and hands its columns to the direct launch, which checks the
# block ids. Anything it refuses takes the full path, which words the error.

class _Swap(NamedTuple):
    held: tuple[torch.Tensor, ...]
    src: pd.PointerTable[pd.DeviceAlias]
    dst: pd.PointerTable[pd.DeviceAlias]
    src_layout: pd.KVLayout
    dst_layout: pd.KVLayout
    #: where the device's memory is host memory (a CPU mapping may lie in it): its backend's
    #: allocation look-up (an ordinal, or -1 for host memory); None: device memory is never host memory
    device_lookup: Callable[[int, int], int] | None
    #: the arguments of the last memory-keyed hit (:func:`pointerdomain.compat._raw.met_again`)
    last: list[tuple[object, ...]]


_swaps: OrderedDict[tuple[object, ...], _Swap] = _raw.owned_cache()
_SWAPS_MAX: Final = 64
#: numpy (optional) reads a block_mapping with less host time than torch's ops
_NUMPY: Final[bool] = importlib.util.find_spec("numpy") is not None
#: the same prepared swaps by their tensors' identity (:class:`pointerdomain.compat._raw.Seen`):
#: the first look-up of a repeat, before the memory-keyed one above
_seen: OrderedDict[tuple[object, ...], _raw.Seen] = _raw.owned_cache()
#: up to this many pairs the duplicate check runs on a Python set (cheaper than torch ops)
_SET_CHECK_MAX: Final = 64


def _swap_prepared(p: _Swap, block_mapping: object) -> bool:
    """A prepared swap's direct launch; False when the mapping or the launch was refused
    before anything was copied (the caller then takes the full path)."""
    try:
        m = block_mapping
        if (type(m) is not torch.Tensor or m.dtype != torch.int64 or m.dim() != 2 or m.shape[1] != 2
                or not m.is_cpu
                or (p.device_lookup is not None and p.device_lookup(m.data_ptr(), max(m.numel() * 8, 1)) >= 0)):
            return False
        n = m.shape[0]
        if n == 0:
            return False
        # read once: the checked copy is the one used
        if _NUMPY:  # one numpy copy and two zero-copy tensors: less host time than torch's ops
            cols = m.numpy().T.copy()
            s_ids, d_ids = torch.from_numpy(cols[0]), torch.from_numpy(cols[1])
        else:
            s_ids, d_ids = m.t().contiguous().unbind(0)
        if n > 1:
            if n <= _SET_CHECK_MAX:
                if len(set((cols[1] if _NUMPY else d_ids).tolist())) != n:
                    return False
            else:
                ordered = torch.sort(d_ids).values
                if bool((ordered[1:] == ordered[:-1]).any()):
                    return False
    except Exception:  # the full path words it
        return False
    try:
        pd.transfer_kv_all_layer(p.src, p.dst, s_ids, d_ids, src_layout=p.src_layout, dst_layout=p.dst_layout,
                                 backend="copy_engine")
    except (IndexValidationError, ClosedError):  # refused before writing: the full path
        return False
    return True


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int, block_mapping: torch.Tensor) -> None:
    """Copy block ``block_mapping[i][0]`` of ``src`` to block ``block_mapping[i][1]`` of
    ``dst`` for every row ``i`` (vLLM's ``ops.swap_blocks``; see the module docstring).

    Block ``b`` of a tensor ``t`` is the ``block_size_in_bytes`` bytes at
    ``t.data_ptr() + b * block_size_in_bytes``. Here ``block_size_in_bytes`` must be the byte
    stride of dimension 0 of both tensors (``t.element_size() * t.stride(0)``, what vLLM's
    callers pass), so block ``b`` is ``t[b]`` with any padding up to the next row, and its
    ids run over ``[0, t.shape[0])``. All of a block's bytes are copied, padding included
    (as upstream: a view ``kv[:, 0]`` of a ``[num_blocks, 2, ...]`` buffer has a block of
    both K and V).

    Args:
        src: the source blocks: device memory, or host memory when ``dst`` is device
            memory (registered for the device, pinned by the runtime, or plain pageable).
        dst: the destination blocks, likewise; the same device as ``src`` when both are
            device memory.
        block_size_in_bytes: bytes per block (an int > 0; see above).
        block_mapping: ``int64 [num_pairs, 2]`` CPU tensor of ``(src block, dst block)``
            rows (any strides; read once).

    Copies ``num_pairs * block_size_in_bytes`` bytes. ``src`` and ``dst`` may be the same
    memory when no block is both read and written; a destination block may appear once
    only. Every check below runs before the first byte is copied, whichever route copies:

    * device memory, registered or runtime-pinned host memory: one copy-engine transfer,
      queued on the device's current stream (as upstream's ``cudaMemcpyAsync`` calls);
    * plain pageable host memory (no registration, not pinned: upstream's own test passes
      ``torch.empty(..., device="cpu")`` caches): nothing is pinned or registered; the
      mapped blocks are gathered on the source's device (``index_select``), copied to the
      other side with one torch copy, and written with ``index_copy_``, in steps of at
      most 64 MiB, on the device's current stream. As upstream's pageable
      ``cudaMemcpyAsync``, the host side is done with when the call returns (torch's
      blocking copy waits for the transfer); device-side writes may still be queued.
      Not capturable in a CUDA graph (the pageable copy synchronises): refused with
      :class:`~pointerdomain.errors.InvalidArgumentError` while the device's stream is
      capturing, as the copy-engine route is, before anything is copied.

    Raises:
        InvalidTypeError: ``src``, ``dst`` or ``block_mapping`` not a tensor, or
            ``block_size_in_bytes`` not an int.
        InvalidArgumentError: ``block_size_in_bytes`` <= 0; called while capturing a graph.
        DomainError: both tensors host memory, or a tensor on a device that is neither.
        DeviceMismatchError: device memory of two devices, or host memory registered for
            another device type.
        LayoutError: a tensor without blocks, a block size that is not the tensor's
            dimension-0 byte stride, or blocks running past the tensor's storage.
        IndexValidationError: ``block_mapping`` not ``int64``, not ``[n, 2]``, not host
            memory, or a block id outside its tensor's ``[0, shape[0])``.
        OverlapError: a destination block twice in ``block_mapping``, or src and dst
            sharing memory with a block both read and written (or addressed differently).
        ClosedError, RegistrationSpanError: as :func:`pointerdomain.make_kernel_ptr_table`.
    """
    fast = ("swap", id(src), id(dst), block_size_in_bytes)
    plain = type(block_size_in_bytes) is int
    if plain:
        try:
            again = _seen.get(fast)
            found = again is not None and _raw.seen_again(again, (src, dst))
        except Exception:  # not plain tensors: the full path
            found = False
        if found and _swap_prepared(again.value, block_mapping):  # type: ignore[union-attr, arg-type]
            return
    key: tuple[object, ...] | None
    try:
        key = ("swap", view_key(src), view_key(dst), block_size_in_bytes)
        hit = _swaps.get(key)
    except Exception:  # not plain tensors: the full path
        key = hit = None
    if hit is not None and plain and _swap_prepared(hit, block_mapping):
        if _raw.met_again((src, dst), hit.held, hit.last):  # the cache's own tensors (not views made per call)
            _raw.remember_seen(_seen, fast, (src, dst), (False, False), hit)
        return
    _check_blocks("src", src)
    _check_blocks("dst", dst)
    if type(block_size_in_bytes) is not int:
        raise InvalidTypeError(
            f"block_size_in_bytes: found a {type(block_size_in_bytes).__name__}, expected an int (bytes). Fix: "
            "pass src.element_size() * src.stride(0)")
    if block_size_in_bytes <= 0:
        raise InvalidArgumentError(
            f"block_size_in_bytes: {block_size_in_bytes}, expected an int > 0 (bytes). Fix: pass "
            "src.element_size() * src.stride(0)")
    s_ids, d_ids = _check_mapping(block_mapping)
    device, device_side = _launch_device(src, dst)
    s_view = _blocks_view("src", src, block_size_in_bytes)
    d_view = _blocks_view("dst", dst, block_size_in_bytes)
    s_count, d_count = int(src.shape[0]), int(dst.shape[0])
    _check_block_ids("src", 0, s_ids, s_count)
    _check_block_ids("dst", 1, d_ids, d_count)
    if d_ids.numel() > 1:
        # two copies into one block would leave whichever ran last
        sorted_ids, order = torch.sort(d_ids)
        dup = (sorted_ids[1:] == sorted_ids[:-1]).nonzero()
        if dup.numel():
            j = int(dup[0])
            a, b = sorted((int(order[j]), int(order[j + 1])))
            raise OverlapError(
                f"block_mapping[{a}] and block_mapping[{b}] both write dst block {int(sorted_ids[j])}: the result "
                "would depend on the copy order; nothing was copied. Fix: give each dst block once")
    host_view = None if device_side is None else (d_view if device_side == "src" else s_view)
    if host_view is not None and _pageable(host_view, device):
        if backend_for(device).is_capturing(device):
            # torch's pageable copy runs at once and a graph records none of it: a replay would not copy
            raise InvalidArgumentError(
                f"swap_blocks: {'dst' if device_side == 'src' else 'src'} is plain pageable host "
                f"memory, which cannot be captured in a CUDA graph (the copy would run once now and not on replay); "
                "nothing was copied. Fix: register or pin the host buffer (pointerdomain.register_host_tensor, "
                "pin_memory()), or call outside capture")
        # one side device memory, the other host memory: they cannot share bytes
        if s_ids.numel():
            _copy_pageable(_rows(s_view, s_count, block_size_in_bytes), _rows(d_view, d_count, block_size_in_bytes),
                           s_ids, d_ids)
        return
    src_table = _raw.tensor_table("src", [s_view], device, across_chunks=True)
    dst_table = _raw.tensor_table("dst", [d_view], device, across_chunks=True)
    s_layout = _block_layout("layer_first", s_count, block_size_in_bytes)
    d_layout = _block_layout("layer_first", d_count, block_size_in_bytes)
    # a buffer registered in several chunks: one entry per block, each with its chunk's alias
    src_table, dst_table = _raw.split_chunked(src_table, s_layout), _raw.split_chunked(dst_table, d_layout)
    if s_ids.numel():
        pd.transfer_kv_all_layer(src_table, dst_table, s_ids, d_ids, src_layout=s_layout, dst_layout=d_layout,
                                 backend="copy_engine")
    if key is not None:
        entry = _Swap(held(src, dst), src_table, dst_table, s_layout, d_layout,
                      backend_for(device).device_lookup if device.runtime.host_memory else None, [()])
        with _flat_lock:
            _raw.remember(_swaps, key, entry, _SWAPS_MAX)
        _raw.remember_seen(_seen, fast, (src, dst), (False, False), entry)


# -- swap_blocks_batch -----------------------------------------------------------------

def _check_array(name: str, t: object, what: str) -> torch.Tensor:
    arr = _check_tensor(name, t)
    if arr.dtype not in (torch.int64, torch.uint64):
        raise InvalidTypeError(
            f"{name}: dtype {arr.dtype}, expected torch.int64 (or torch.uint64) {what}. Fix: build it with "
            "dtype=torch.int64 (numpy int64 through torch.from_numpy)")
    if arr.dim() != 1:
        raise IndexValidationError(
            f"{name}: shape {tuple(arr.shape)}, expected a 1-D tensor of {what}, one per copy. Fix: .view(-1)")
    where = _raw.memory_device_of(name, arr)
    if not arr.is_cpu or where is not None:
        raise DeviceMismatchError(
            f"{name}: in memory of {where or arr.device}, expected a CPU tensor in host memory (upstream: "
            f"'{name} must be on CPU'). Fix: build it on the CPU (.cpu())")
    return arr


def _batch_device(src: torch.Tensor, dst: torch.Tensor) -> pd.Device:
    """The copy's device: the emulated device whose memory the first descriptor's source or
    destination lies in; else the calling thread's current device (upstream's copy runs on
    the current stream of the current device) of the type its registered host memory is
    for, or CUDA where there is CUDA, else the current emulated device."""
    kind: str | None = None
    for addr in (int(src[0]) & _MASK, int(dst[0]) & _MASK):
        where = pd.memory_device_at(addr, 1)
        if where is not None:
            return where
        owner = pd.find_registration(pd.HostVA.unsafe_from_int(addr), 1)
        if owner is not None and kind is None:
            kind = owner.device.type
    return current_device(kind or ("cuda" if torch.cuda.is_available() else "emulated"))


def _first(mask: torch.Tensor) -> int | None:
    hit = mask.nonzero()
    return int(hit[0]) if hit.numel() else None


def _alias_values(table: pd.PointerTable[pd.DeviceAlias]) -> torch.Tensor:
    """A table's entries as a CPU ``int64`` tensor of their bit patterns, from its
    host-side values (one buffer conversion, not a Python int per entry)."""
    return torch.frombuffer(array.array("Q", table.raw_values()), dtype=torch.int64)


def _check_overlap(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
    """Refuse a batch where a destination run meets another destination run or any source
    run (``int64`` alias bit patterns and byte counts; sources may overlap each other)."""
    last = sizes - 1  # inclusive ends: an allocation may end at 2**64
    d_lo = dst ^ _FLIP
    d_hi = d_lo + last
    order = torch.argsort(d_lo)
    lo, hi = d_lo[order], d_hi[order]
    reach, holder = torch.cummax(hi, dim=0)
    j = _first(lo[1:] <= reach[:-1])
    if j is not None:
        a, b = sorted((int(order[j + 1]), int(order[int(holder[j])])))
        raise OverlapError(
            f"dst_ptrs[{a}] and dst_ptrs[{b}]: the destination runs of these descriptors overlap ({int(sizes[a])} "
            f"bytes at {int(dst[a]) & _MASK:#x} and {int(sizes[b])} bytes at {int(dst[b]) & _MASK:#x}, as device "
            "aliases): the bytes would depend on the copy order; nothing was copied")
    s_lo = src ^ _FLIP
    s_order = torch.argsort(s_lo)
    s_sorted = s_lo[s_order]
    s_reach, s_holder = torch.cummax((s_lo + last)[s_order], dim=0)
    k = torch.searchsorted(s_sorted, d_hi, right=True)  # sources starting at or before each dst run's end
    prev = (k - 1).clamp(min=0)
    i = _first((k > 0) & (s_reach[prev] >= d_lo))
    if i is not None:
        other = int(s_order[int(s_holder[int(prev[i])])])
        raise OverlapError(
            f"dst_ptrs[{i}] and src_ptrs[{other}]: a destination run overlaps a source run ({int(sizes[i])} bytes "
            f"at {int(dst[i]) & _MASK:#x} and {int(sizes[other])} bytes at {int(src[other]) & _MASK:#x}, as device "
            "aliases): a copy would read bytes the batch writes, in no defined order; nothing was copied")


#: One launch of a batch: source table, destination table, their layout, the slots (0..n-1).
_Launch = tuple["pd.PointerTable[pd.DeviceAlias]", "pd.PointerTable[pd.DeviceAlias]", "pd.KVLayout", torch.Tensor]


class _Batch(NamedTuple):
    """A checked batch: the int64 copies of its arrays as checked, and its launches."""

    src: torch.Tensor
    dst: torch.Tensor
    sizes: torch.Tensor
    launches: tuple[_Launch, ...]


#: (length, first source, destination and size) -> the last checked batch that starts so;
#: a call whose three arrays equal it (compared element by element) reuses its launches
_batches: OrderedDict[tuple[int, int, int, int], _Batch] = _raw.owned_cache()
_BATCHES_MAX: Final = 16


def swap_blocks_batch(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    is_src_access_order_any: bool = False,
) -> None:
    """Copy ``sizes[i]`` bytes from address ``src_ptrs[i]`` to address ``dst_ptrs[i]`` for
    every ``i`` (vLLM's ``ops.swap_blocks_batch``; see the module docstring).

    Args:
        src_ptrs, dst_ptrs: 1-D ``int64`` CPU tensors of raw addresses (``data_ptr()`` values
            plus offsets; ``uint64`` accepted too): device memory of the copy's device, or
            host VAs inside memory registered for it or pinned by the runtime.
        sizes: 1-D ``int64`` (or ``uint64``) CPU tensor of byte counts, each > 0, as long
            as the address tensors.
        is_src_access_order_any: upstream's permission to prefetch sources out of stream
            order; checked (a bool) and not used: the copies keep stream order.

    The copy's device: the emulated device holding the first descriptor's source or
    destination; else the current device (as upstream: its current stream) of the type the
    first descriptor's registered host memory is for, else CUDA's where there is CUDA. Each run
    must lie inside one allocation (or one registration chunk) of that device or of
    registered / pinned host memory; host VAs become device aliases. No destination run
    may overlap another destination run or any source run (refused: the result would
    depend on the order of the copies); source runs may overlap each other. An empty batch
    does nothing. Copies ``sizes.sum()`` bytes with the copy engine, one copy per
    descriptor, queued on the device's current stream; all descriptors are checked before
    the first is queued. A call whose three arrays hold exactly the values of a batch
    checked before (compared element by element, so writes through numpy are seen) reuses
    that batch's checks and tables, as a cached raw table does
    (:mod:`pointerdomain.compat._raw` says what such a cache cannot see).

    Plain pageable host memory is refused here, unlike in :func:`swap_blocks`: every
    descriptor goes to the copy engine as a device alias (a batch DMA descriptor must hold
    one, and pageable memory has none), and there is no tensor to gather through, only a
    raw address per copy. Register the host buffers or pin them (vLLM's offload worker
    pins its CPU tensors).

    Raises:
        InvalidTypeError: an argument not a tensor, a dtype other than int64 / uint64, or
            ``is_src_access_order_any`` not a bool.
        IndexValidationError: a tensor not 1-D, or lengths that differ.
        DeviceMismatchError: a tensor not in host memory; a run in memory of another device.
        InvalidArgumentError: a size <= 0 (or >= 2**63).
        NotRegisteredError: an address in no known memory (pageable host memory, a
            device alias handed in for a host VA, a freed or made-up address).
        RegistrationSpanError: a run past the end of its allocation or registration chunk.
        ClosedError: an address in a closed registration.
        OverlapError: the overlaps above.
    """
    src = _check_array("src_ptrs", src_ptrs, "addresses")
    dst = _check_array("dst_ptrs", dst_ptrs, "addresses")
    nbytes = _check_array("sizes", sizes, "byte counts")
    if type(is_src_access_order_any) is not bool:
        raise InvalidTypeError(
            f"is_src_access_order_any: found {describe(is_src_access_order_any)} ({type(is_src_access_order_any).__name__}), "
            "expected a bool. Fix: pass True or False")
    n = src.numel()
    if dst.numel() != n or nbytes.numel() != n:
        raise IndexValidationError(
            f"src_ptrs has {n} entries, dst_ptrs {dst.numel()} and sizes {nbytes.numel()}, expected one length "
            "(one source, destination and size per copy). Fix: build the three arrays together")
    if n == 0:
        return
    s_bits, d_bits, z_bits = (t if t.dtype == torch.int64 else t.view(torch.int64) for t in (src, dst, nbytes))
    # The same descriptors as a batch checked before (an engine that repeats a transfer),
    # while what it was resolved against holds (its registrations open, its device memory
    # the same allocations: the same numbers may name memory allocated since, whose aliases
    # differ): its tables serve again, and its overlap check gave the same answer. The arrays are compared as they are (no copy: the
    # launches use the batch's own checked tables, whatever the arrays hold afterwards).
    key = (n, int(s_bits[0]), int(d_bits[0]), int(z_bits[0]))
    seen = _batches.get(key)
    if (seen is not None and torch.equal(seen.src, s_bits) and torch.equal(seen.dst, d_bits)
            and torch.equal(seen.sizes, z_bits)
            and all(_raw.resolution_holds(t) for launch in seen.launches for t in launch[:2])):
        for src_table, dst_table, layout, slots in seen.launches:
            pd.transfer_kv_all_layer(src_table, dst_table, slots, slots, src_layout=layout, dst_layout=layout,
                                     backend="copy_engine")
        return
    # read once: the checked copy is the one used
    s_raw = s_bits.detach().to("cpu", copy=True)
    d_raw = d_bits.detach().to("cpu", copy=True)
    size = z_bits.detach().to("cpu", copy=True)
    bad = _first(size <= 0)
    if bad is not None:
        value = int(size[bad]) & _MASK if nbytes.dtype == torch.uint64 else int(size[bad])
        raise InvalidArgumentError(
            f"sizes[{bad}]: {value} bytes, expected an int in (0, 2**63) (bytes). Fix: leave out empty copies")
    device = _batch_device(s_raw, d_raw)
    values, inverse = torch.unique(size, return_inverse=True)
    # one launch per distinct size (a layout's slots are all one size; vLLM: one size per
    # KV tensor group), each group's entries in call order
    if len(values) == 1:
        groups: list[tuple[int, torch.Tensor | None]] = [(int(values[0]), None)]
    else:
        members = torch.split(torch.argsort(inverse, stable=True), torch.bincount(inverse).tolist())
        groups = list(zip(values.tolist(), members))
    launches: list[_Launch] = []
    s_alias = torch.empty(n, dtype=torch.int64)
    d_alias = torch.empty(n, dtype=torch.int64)
    try:
        for value, at in groups:
            src_table = _raw.addresses_table("src_ptrs", s_raw if at is None else s_raw[at], value, device)
            dst_table = _raw.addresses_table("dst_ptrs", d_raw if at is None else d_raw[at], value, device)
            count = len(src_table)
            for table, out in ((src_table, s_alias), (dst_table, d_alias)):
                resolved = _alias_values(table)
                if at is None:
                    out.copy_(resolved)
                else:
                    out[at] = resolved
            launches.append((src_table, dst_table, _block_layout("page_first", count, value),
                             torch.arange(count, dtype=torch.int64)))
    except PointerDomainError:
        if len(groups) > 1:
            # a group's error names the entry by its place in its group: resolve the whole
            # call again, in call order, so the error names the entry's own index
            _raw.resolve_addresses("src_ptrs", s_raw, size, device)
            _raw.resolve_addresses("dst_ptrs", d_raw, size, device)
        raise
    _check_overlap(s_alias, d_alias, size)
    for src_table, dst_table, layout, slots in launches:
        pd.transfer_kv_all_layer(src_table, dst_table, slots, slots, src_layout=layout, dst_layout=layout,
                                 backend="copy_engine")
    with _flat_lock:
        _raw.remember(_batches, key, _Batch(s_raw, d_raw, size, tuple(launches)), _BATCHES_MAX)
