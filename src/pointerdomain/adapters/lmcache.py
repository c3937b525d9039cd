"""LMCache-style multi-layer transfer with per-device cached layer-pointer tables.

LMCache's paged-memory GPU connector keeps, per CUDA device index, a ``uint64``
tensor of the KV caches' ``data_ptr()`` values (``kv_cache_pointers_on_gpu``)
and launches one kernel (``multi_layer_kv_transfer``) that moves a chunk of
tokens between a memory object (``KV_2LTD``: ``[2, num_layers, num_tokens,
hidden]``) and every layer's paged cache through ``slot_mapping``. The cached
pointers go stale when the caches are reallocated (sleep/wake, a resized pool)
or when registered memory is re-registered at a new alias.

Here:

* :class:`LayerPointerCache` caches one ``PointerTable[DeviceAlias]`` per
  device, keyed by the tensors' ``(data_ptr, nbytes, storage identity)``; a
  different key, or a closed registration, rebuilds the table. The cached table
  keeps its tensors alive, so a storage identity cannot be reused by another
  allocation while the entry exists (no false hit).
* :class:`PagedKVConnector` has LMCache's ``from_gpu`` / ``to_gpu`` call
  shapes and moves the chunk with :func:`pointerdomain.transfer_kv_all_layer`.

KV cache formats (vLLM flash-attention, per layer, device memory):
MHA ``[2, num_blocks, block_size, num_heads, head_size]``; MLA
``[num_blocks, block_size, head_size]``. Memory object (contiguous, registered
host memory or device memory): MHA ``[2, num_layers, num_tokens, num_heads,
head_size]`` (any shape with those bytes, e.g. ``[2, L, T, H * D]``); MLA
``[1, num_layers, num_tokens, head_size]``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from pointerdomain import (
    DEFAULT_MAX_CTAS,
    Device,
    DeviceAlias,
    KVLayout,
    MaxCtas,
    PointerTable,
    external_stream,
    make_kernel_ptr_table,
    memory_device,
    transfer_kv_all_layer,
    validate_device,
)
from pointerdomain.errors import ClosedError, DomainError, IndexValidationError, LayoutError, NonContiguousError
from pointerdomain.arguments import check_instance, describe
from pointerdomain.transfer import graphs
from pointerdomain.process_local import ProcessLocal

__all__ = ["LayerPointerCache", "PagedKVConnector", "TensorKey"]

#: Identity of the memory behind a tensor list: per tensor ``(data_ptr, nbytes, storage id)``.
TensorKey = tuple[tuple[int, int, int], ...]


def _storage_id(t: torch.Tensor) -> int:
    cdata: int = t.untyped_storage()._cdata
    return cdata


class LayerPointerCache(ProcessLocal):
    """Per-device cached kernel tables over a list of layer buffers.

    ``get(tensors, device)`` returns the cached ``PointerTable[DeviceAlias]`` for
    ``device`` when the tensors are the same memory as last time, and rebuilds it
    (replacing the old entry, which releases the old tensors) when any tensor's
    ``data_ptr``, byte size or storage changed, or when a registration the table
    points into was closed. Thread-safe.

    Attributes:
        builds: tables built so far (misses).
        hits: lookups answered from the cache.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Device, tuple[TensorKey, PointerTable[DeviceAlias]]] = {}
        self.builds = 0
        self.hits = 0

    @staticmethod
    def key_of(tensors: Sequence[torch.Tensor]) -> TensorKey:
        """The cache key of ``tensors``: ``(data_ptr, nbytes, storage id)`` each."""
        return tuple((t.data_ptr(), t.nbytes, _storage_id(t)) for t in tensors)

    def get(self, tensors: Sequence[torch.Tensor], device: Device | str | torch.device) -> PointerTable[DeviceAlias]:
        """The kernel table of ``tensors`` for ``device``, cached.

        Raises:
            BusyError: the table must be rebuilt but a live captured graph launched with
                the cached one (it would replay the old table); the entry stays.
            Everything :func:`pointerdomain.make_kernel_ptr_table` raises (on a rebuild).
        """
        dev = validate_device(device)
        key = self.key_of(tensors)
        with self._lock:
            entry = self._entries.get(dev)
            if entry is not None and entry[0] == key:
                try:
                    entry[1].check_live()
                except ClosedError:
                    pass
                else:
                    self.hits += 1
                    return entry[1]
            if entry is not None:
                graphs.refuse_while_held(entry[1], f"rebuild the layer-pointer table of {dev}")
            self._entries.pop(dev, None)
            table = make_kernel_ptr_table(tensors, dev)
            self._entries[dev] = (key, table)
            self.builds += 1
            return table

    def invalidate(self, device: Device | str | torch.device | None = None) -> None:
        """Drop the entry of ``device``, or every entry when None.

        Raises:
            BusyError: a live captured graph launched with a table to drop; nothing dropped.
        """
        with self._lock:
            devices = list(self._entries) if device is None else [validate_device(device)]
            for dev in devices:
                entry = self._entries.get(dev)
                if entry is not None:
                    graphs.refuse_while_held(entry[1], f"drop the layer-pointer table of {dev}")
            for dev in devices:
                self._entries.pop(dev, None)

    def __len__(self) -> int:
        return len(self._entries)


def _parse(device: Device | str | torch.device | None) -> Device | None:
    return None if device is None else validate_device(device)


class PagedKVConnector(ProcessLocal):
    """LMCache's paged-memory connector call shapes over typed, cached tables.

    Args:
        pointer_cache: the per-device layer-table cache (a new one by default).

    Attributes:
        pointer_cache: the :class:`LayerPointerCache` in use.
    """

    def __init__(self, *, pointer_cache: LayerPointerCache | None = None) -> None:
        if pointer_cache is not None:
            check_instance("pointer_cache", pointer_cache, LayerPointerCache, "pass a LayerPointerCache, or None for a new one")
        self.pointer_cache = pointer_cache if pointer_cache is not None else LayerPointerCache()

    def from_gpu(
        self,
        memory_obj: torch.Tensor,
        start: int,
        end: int,
        *,
        kvcaches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        device: Device | str | torch.device | None = None,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    ) -> None:
        """D2H (or D2D): tokens ``start:end`` of the paged caches -> ``memory_obj``, every layer.

        Token ``i`` of the chunk is slot ``slot_mapping[start + i]`` of each layer's cache.

        Args:
            memory_obj: the chunk buffer (see module docs), ``end - start`` tokens.
            start, end: token range of ``slot_mapping``.
            kvcaches: per-layer paged caches (device memory, one device).
            slot_mapping: ``int64`` 1-D slots on the launch device (CPU when emulated).
            device: the launch device; default the device holding ``kvcaches``.
            stream, max_ctas: passed to the launch (``stream``: a ``cudaStream_t`` as an
                int; the temporaries this call makes are kept until that stream reaches
                the launch; ``memory_obj``, ``kvcaches`` and ``slot_mapping`` are the caller's
                to keep alive).

        Raises:
            LayoutError: caches of mixed or unknown shape/dtype, or a memory object
                of the wrong size.
            NonContiguousError: a strided memory object.
            DomainError: caches in host memory, or an unregistered host memory object.
            IndexValidationError: a bad token range, or a slot out of range.
            Everything :func:`pointerdomain.transfer_kv_all_layer` raises.
        """
        self._move(memory_obj, start, end, kvcaches, slot_mapping, _parse(device), to_gpu=False, stream=stream, max_ctas=max_ctas)

    def to_gpu(
        self,
        memory_obj: torch.Tensor,
        start: int,
        end: int,
        *,
        kvcaches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        device: Device | str | torch.device | None = None,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    ) -> None:
        """H2D (or D2D): ``memory_obj`` -> tokens ``start:end`` of the paged caches, every layer.

        Arguments and errors as :meth:`from_gpu`.
        """
        self._move(memory_obj, start, end, kvcaches, slot_mapping, _parse(device), to_gpu=True, stream=stream, max_ctas=max_ctas)

    def _move(
        self,
        memory_obj: torch.Tensor,
        start: int,
        end: int,
        kvcaches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        device: Device | None,
        *,
        to_gpu: bool,
        stream: int | None,
        max_ctas: MaxCtas,
    ) -> None:
        caches = list(kvcaches)
        if not caches:
            raise LayoutError("kvcaches is empty")
        first = caches[0]
        for i, t in enumerate(caches):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise LayoutError(f"kvcaches[{i}]: {tuple(t.shape)} {t.dtype} differs from layer 0 {tuple(first.shape)} {first.dtype}")
        if first.dim() == 5 and first.shape[0] == 2:
            attention, heads, dim = "mha", int(first.shape[3]), int(first.shape[4])
            entries = [t[0] for t in caches] + [t[1] for t in caches]
        elif first.dim() == 3:
            attention, heads, dim = "mla", 1, int(first.shape[2])
            entries = caches
        else:
            raise LayoutError(
                f"kvcaches[0] has shape {tuple(first.shape)}; expected [2, num_blocks, block_size, num_heads, head_size] "
                "(MHA) or [num_blocks, block_size, head_size] (MLA)"
            )
        if device is None:
            where = memory_device(first)
            if where is None:
                raise DomainError("kvcaches are host memory; a paged KV cache is device memory")
            dev = where
        else:
            dev = device
        if type(start) is not int or type(end) is not int or not 0 <= start <= end <= slot_mapping.numel():
            raise IndexValidationError(f"token range [{describe(start)}, {describe(end)}) outside slot_mapping of {slot_mapping.numel()} slots")
        count = end - start
        if count == 0:
            return
        slots = int(first[0].shape[0] * first[0].shape[1]) if attention == "mha" else int(first.shape[0] * first.shape[1])
        common: dict[str, Any] = dict(
            attention=attention, num_layers=len(caches), page_size=1, num_heads=heads, head_dim=dim,
            dtype=KVLayout.dtype_name(first.dtype),
        )
        paged_layout = KVLayout(kind="layer_first", num_pages=slots, **common)
        chunk_layout = KVLayout(kind="layer_first", num_pages=count, **common)
        if memory_obj.nbytes != chunk_layout.nbytes:
            raise LayoutError(
                f"memory_obj holds {memory_obj.nbytes} bytes; {count} tokens x {len(caches)} layers need "
                f"{chunk_layout.nbytes}"
            )
        if not memory_obj.is_contiguous():
            raise NonContiguousError(f"memory_obj of shape {tuple(memory_obj.shape)} is strided")
        paged_table = self.pointer_cache.get(entries, dev)
        chunk_table = make_kernel_ptr_table([memory_obj], dev)
        chunk_idx = torch.arange(count, dtype=torch.int64, device=dev.torch_device)
        slot_idx = slot_mapping[start:end]
        side = external_stream(dev, stream)
        if side is not None:
            # The table and index tensors are freed when this returns; keep the caching
            # allocator from reusing them before the launch on `stream` has read them.
            chunk_table.record_stream(side)
            chunk_idx.record_stream(side)
        if to_gpu:
            transfer_kv_all_layer(
                chunk_table, paged_table, chunk_idx, slot_idx, src_layout=chunk_layout, dst_layout=paged_layout,
                stream=stream, max_ctas=max_ctas,
            )
        else:
            transfer_kv_all_layer(
                paged_table, chunk_table, slot_idx, chunk_idx, src_layout=paged_layout, dst_layout=chunk_layout,
                stream=stream, max_ctas=max_ctas,
            )
