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
the bytes upstream copies, fed device aliases only. Before anything is copied:

* host memory must be registered (:func:`pointerdomain.register_host_tensor`,
  :class:`pointerdomain.HostKVPool`, :func:`pointerdomain.alloc_registered`) or pinned by the
  runtime (``pin_memory()``); plain pageable host memory, which upstream's copies stage
  through the driver, is a typed error (a batch DMA descriptor may not hold a host VA);
* device memory must be the launch device's;
* every block id, address and byte count is checked against the memory it lies in;
* overlap: a copy never writes bytes another copy of the same call reads or writes (see
  each function).

``is_src_access_order_any`` is checked and accepted; the copies always keep stream order,
the choice upstream documents as always safe. Ordering otherwise as upstream: the copies
are queued on the current stream of the launch device; keep the memory alive until it runs.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Final, Literal, NamedTuple

import torch

import pointerdomain as pd
from pointerdomain.compat import _raw
from pointerdomain.devices import current_device
from pointerdomain.errors import (
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    OverlapError,
)

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
    if t.is_contiguous() and t.numel() * t.element_size() == span:
        return t
    storage = t.untyped_storage()
    offset = t.storage_offset() * t.element_size()
    if offset + span > storage.nbytes():
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


def _launch_device(src: torch.Tensor, dst: torch.Tensor) -> pd.Device:
    """The device of ``src`` / ``dst`` (whichever is device memory, the same device if both)."""
    s = _raw.memory_device_of("src", src)
    d = _raw.memory_device_of("dst", dst)
    for name, t, where in (("src", src, s), ("dst", dst, d)):
        if where is None and t.device.type != "cpu":
            raise DomainError(f"{name}: a tensor on {t.device}, expected host memory or device memory. Fix: pass a "
                              "tensor of the KV cache's device or its registered host copy")
    if s is None and d is None:
        raise DomainError(
            "src and dst are both host memory: swap_blocks copies between device memory and host memory or "
            "inside one device (upstream: 'Invalid device combination'). Fix: put one side on the device")
    if s is not None and d is not None and s != d:
        raise DeviceMismatchError(
            f"src is memory of {s} and dst of {d}, expected one device (upstream: 'src and dst must be on the same "
            "GPU'). Fix: copy between devices in two steps through registered host memory")
    device = s if s is not None else d
    assert device is not None
    return device


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
    if mapping.device.type != "cpu" or _raw.memory_device_of("block_mapping", mapping) is not None:
        raise IndexValidationError(
            f"block_mapping: in memory of {_raw.memory_device_of('block_mapping', mapping) or mapping.device}, "
            "expected a CPU tensor in host memory (upstream: 'block_mapping must be on CPU'). Fix: build it on "
            "the CPU (.cpu())")
    with torch.inference_mode(False):
        return mapping[:, 0].clone(), mapping[:, 1].clone()  # read once: the checked copy is the one used


def _check_block_ids(side: str, column: int, ids: torch.Tensor, count: int) -> None:
    bad = ((ids < 0) | (ids >= count)).nonzero()
    if bad.numel():
        row = int(bad[0])
        raise IndexValidationError(
            f"block_mapping[{row}][{column}]: {side} block {int(ids[row])} outside [0, {count}) of {side} "
            f"({count} blocks), expected a block id of {side}; nothing was copied. Fix: check the block ids "
            f"against {side}.shape[0]")


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
        src: the source blocks: device memory, or host memory registered for the device
            (or pinned by the runtime) when ``dst`` is device memory.
        dst: the destination blocks, likewise; the same device as ``src`` when both are
            device memory.
        block_size_in_bytes: bytes per block (an int > 0; see above).
        block_mapping: ``int64 [num_pairs, 2]`` CPU tensor of ``(src block, dst block)``
            rows (any strides; read once).

    Copies ``num_pairs * block_size_in_bytes`` bytes with the copy engine, queued on the
    device's current stream. ``src`` and ``dst`` may be the same memory when no block is
    both read and written; a destination block may appear once only.

    Raises:
        InvalidTypeError: ``src``, ``dst`` or ``block_mapping`` not a tensor, or
            ``block_size_in_bytes`` not an int.
        InvalidArgumentError: ``block_size_in_bytes`` <= 0.
        DomainError: both tensors host memory; unregistered (pageable) host memory.
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
    device = _launch_device(src, dst)
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
    src_table = _raw.tensor_table("src", [s_view], device)
    dst_table = _raw.tensor_table("dst", [d_view], device)
    if s_ids.numel() == 0:
        return
    pd.transfer_kv_all_layer(
        src_table, dst_table, s_ids, d_ids,
        src_layout=_block_layout("layer_first", s_count, block_size_in_bytes),
        dst_layout=_block_layout("layer_first", d_count, block_size_in_bytes),
        backend="copy_engine",
    )


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
    if arr.device.type != "cpu" or where is not None:
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
        owner = pd.find_registration(pd.HostVA(addr), 1)
        if owner is not None and kind is None:
            kind = owner.device.type
    return current_device(kind or ("cuda" if torch.cuda.is_available() else "emulated"))


def _first(mask: torch.Tensor) -> int | None:
    hit = mask.nonzero()
    return int(hit[0]) if hit.numel() else None


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
    the first is queued.

    Raises:
        InvalidTypeError: an argument not a tensor, a dtype other than int64 / uint64, or
            ``is_src_access_order_any`` not a bool.
        IndexValidationError: a tensor not 1-D, or lengths that differ.
        DeviceMismatchError: a tensor not in host memory; a run in memory of another device.
        InvalidArgumentError: a size <= 0 (or >= 2**63).
        NotRegisteredError: an address in no known memory (unregistered host memory, a
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
            f"is_src_access_order_any: found {is_src_access_order_any!r} ({type(is_src_access_order_any).__name__}), "
            "expected a bool. Fix: pass True or False")
    n = src.numel()
    if dst.numel() != n or nbytes.numel() != n:
        raise IndexValidationError(
            f"src_ptrs has {n} entries, dst_ptrs {dst.numel()} and sizes {nbytes.numel()}, expected one length "
            "(one source, destination and size per copy). Fix: build the three arrays together")
    if n == 0:
        return
    with torch.inference_mode(False):  # plain tensors: the resolution caches read version counters
        s_raw = src.detach().to("cpu", copy=True).view(torch.int64)  # read once: the checked copy is the one used
        d_raw = dst.detach().to("cpu", copy=True).view(torch.int64)
        size = nbytes.detach().to("cpu", copy=True).view(torch.int64)
    bad = _first(size <= 0)
    if bad is not None:
        value = int(size[bad]) & _MASK if nbytes.dtype == torch.uint64 else int(size[bad])
        raise InvalidArgumentError(
            f"sizes[{bad}]: {value} bytes, expected an int in (0, 2**63) (bytes). Fix: leave out empty copies")
    device = _batch_device(s_raw, d_raw)
    values, inverse = torch.unique(size, return_inverse=True)
    launches: list[_Launch] = []
    if len(values) == 1:
        # one size (vLLM: one KV tensor group): the tables resolve and check every entry, named by its index
        src_table = _raw.resolved_table("src_ptrs", s_raw, device, reach=int(values[0]))
        dst_table = _raw.resolved_table("dst_ptrs", d_raw, device, reach=int(values[0]))
        _check_overlap(torch.tensor(src_table.raw_values(), dtype=torch.uint64).view(torch.int64),
                       torch.tensor(dst_table.raw_values(), dtype=torch.uint64).view(torch.int64), size)
        launches.append((src_table, dst_table, _block_layout("page_first", n, int(values[0])),
                         torch.arange(n, dtype=torch.int64)))
    else:
        # every entry resolved and checked, named by its own index, before any table is built;
        # then one launch per distinct size (a layout's slots are all one size)
        s_alias = _raw.resolve_addresses("src_ptrs", s_raw, size, device)
        d_alias = _raw.resolve_addresses("dst_ptrs", d_raw, size, device)
        _check_overlap(s_alias, d_alias, size)
        for g, value in enumerate(values.tolist()):
            with torch.inference_mode(False):
                members = (inverse == g).nonzero().view(-1)
                s_part, d_part = s_raw[members], d_raw[members]
            count = s_part.numel()
            launches.append((_raw.resolved_table("src_ptrs", s_part, device, reach=value),
                             _raw.resolved_table("dst_ptrs", d_part, device, reach=value),
                             _block_layout("page_first", count, value), torch.arange(count, dtype=torch.int64)))
    for src_table, dst_table, layout, slots in launches:
        pd.transfer_kv_all_layer(src_table, dst_table, slots, slots, src_layout=layout, dst_layout=layout,
                                 backend="copy_engine")
