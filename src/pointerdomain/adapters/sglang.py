"""sglang-style (HiCache) host KV pool with typed results.

sglang's host pool (``memory_pool_host.py``) passes raw ``int`` addresses around:
``make_kernel_ptr_table(tensors, target_device, *, host_memory_registered)``
returns a ``uint64`` tensor for its transfer kernels, and
``get_contiguous_buf_infos()`` / ``get_page_buffer_meta(indices)`` return lists
of ints for transfer engines and storage back-ends. Nothing stops a kernel
pointer from reaching an engine, or ``tensor.data_ptr()`` of host memory from
reaching a kernel (the fallback when the alias op is missing).

This module keeps those call shapes and types the results:

* :func:`make_kernel_ptr_table` returns a ``PointerTable[DeviceAlias]``; an
  untyped kernel still gets its ``uint64`` tensor through the documented
  accessor :meth:`PointerTable.as_uint64_tensor`;
* :meth:`HostKVCacheAdapter.get_contiguous_buf_infos` and
  :meth:`HostKVCacheAdapter.get_page_buffer_meta` return named tuples that
  unpack like sglang's tuples but hold :class:`HostVA` addresses.

Buffer shapes (sglang names, ``size`` = token slots = ``num_pages * page_size``):

* host ``layer_first``: ``[2, layer_num, size, head_num, head_dim]``
  (MLA: ``[1, layer_num, size, 1, kv_lora_rank + qk_rope_head_dim]``);
* host ``page_first``: ``[2, size, layer_num, head_num, head_dim]``;
* host ``page_first_direct``: ``[2, page_num, layer_num, page_size, head_num, head_dim]``;
* device (``MHATokenToKVPool``): per layer ``k_buffer[i]`` / ``v_buffer[i]`` of
  ``[size + page_size, head_num, head_dim]``; MLA one ``kv_buffer[i]`` of
  ``[size + page_size, 1, kv_cache_dim]``.

The host shapes sglang allocates (``init_kv_buffer`` of ``MHATokenToKVPoolHost``,
``python/sglang/srt/mem_cache/pool_host/mha.py`` at 0047d999bb3a3ad311df5a4b6356bfb5586e0d66,
and ``MLATokenToKVPoolHost``, ``pool_host/mla.py`` at 01c0ede38cc9645488fd2847dbea8a2f6a9241d8)
are the one-buffer shapes above, MLA without the leading kv dimension:
``[layer_num, size, 1, kv_cache_dim]`` (``layer_first``), ``[size, layer_num, 1,
kv_cache_dim]`` (``page_first``), ``[page_num, layer_num, page_size, 1, kv_cache_dim]``
(``page_first_direct``); MHA also ``page_head``, ``[2, page_num, head_num, page_size,
layer_num, head_dim]`` (:func:`sglang_host_shape`). The MHA host pool's ``k_buffer`` /
``v_buffer`` are ``kv_buffer[0]`` / ``kv_buffer[1]``.

sglang's kernels take the device side as separate per-layer tables
(``transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, ...)``
over ``k_data_ptrs`` / ``v_data_ptrs``, MLA one ``data_ptrs``). Here the per-layer K and V
buffers make one ``layer_first`` table split per kv and layer (K of every layer, then V:
:meth:`pointerdomain.KVLayout.table_splits`), which a single
:func:`pointerdomain.transfer_kv_all_layer` / :func:`pointerdomain.transfer_kv_per_layer`
moves against any host layout; :attr:`DeviceKVBuffers.k_table` / :attr:`DeviceKVBuffers.v_table`
are the per-kv tables sglang's own kernels take (for :func:`pointerdomain.compat.wrap.kernel_op`).
The host adapter's transfer methods take a :class:`DeviceKVBuffers`, any
:class:`pointerdomain.DevicePool`, or sglang's device pool object itself (its
``k_buffer`` / ``v_buffer`` lists, MLA ``kv_buffer``, and ``page_size``).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol, cast

import torch

from pointerdomain import (
    DEFAULT_MAX_CTAS,
    BufferInfo,
    Device,
    DeviceAlias,
    DevicePool,
    HostKVPool,
    HostVA,
    KVLayout,
    MaxCtas,
    PointerTable,
    find_registration,
    host_ptr_table,
    index_tensor,
    memory_device,
    transfer_kv_all_layer,
    transfer_kv_per_layer,
    validate_device,
)
from pointerdomain import make_kernel_ptr_table as _core_kernel_table
from pointerdomain.arguments import check_bool, check_instance, describe
from pointerdomain.registration.metadata import metadata_table
from pointerdomain.process_local import ProcessLocal
from pointerdomain.errors import (
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    NonContiguousError,
)

__all__ = [
    "ContiguousBufInfos",
    "DeviceKVBuffers",
    "HostKVCacheAdapter",
    "MHADevicePool",
    "MLADevicePool",
    "PageBufferMeta",
    "SglangHostPool",
    "make_kernel_ptr_table",
    "sglang_host_shape",
]


def make_kernel_ptr_table(
    tensors: Sequence[torch.Tensor],
    target_device: Device | str | torch.device,
    *,
    host_memory_registered: bool,
) -> PointerTable[DeviceAlias]:
    """sglang's ``make_kernel_ptr_table``, typed: a table of device aliases.

    ``host_memory_registered`` states what the tensors are and is checked:
    True -- every tensor is registered host memory (its alias is resolved);
    False -- every tensor is device memory of ``target_device`` (its
    ``data_ptr()``). Host memory passed with False is the bug this catches: a
    host VA would reach a kernel.

    Pass ``table.as_uint64_tensor()`` (``uint64``, shape ``[len(tensors)]``, on
    ``target_device``) to a kernel that takes an untyped pointer tensor.

    Args:
        tensors: contiguous, non-empty buffers in table order (any dtype/shape).
        target_device: the device whose kernels read the table (``"cuda:0"``,
            ``"emulated:0"``, a ``torch.device``).
        host_memory_registered: see above.

    Raises:
        DomainError: a tensor does not match ``host_memory_registered``, or host
            memory is not registered.
        PointerDomainError: as :func:`pointerdomain.make_kernel_ptr_table`
            (NonContiguousError, DeviceMismatchError, RegistrationSpanError, ClosedError,
            InvalidDeviceError).
        InvalidTypeError: ``host_memory_registered`` is not a bool.
    """
    check_bool("host_memory_registered", host_memory_registered)
    dev = validate_device(target_device)
    for i, t in enumerate(tensors):
        if not isinstance(cast(object, t), torch.Tensor):
            continue  # the core builder names the type
        where = memory_device(t)
        is_host = where is None and t.is_cpu
        if host_memory_registered and not is_host:
            raise DomainError(
                f"tensors[{i}]: memory of {where or t.device}, but host_memory_registered=True says the "
                "tensors are registered host memory"
            )
        if not host_memory_registered and is_host:
            raise DomainError(
                f"tensors[{i}]: host memory at {HostVA.unsafe_from_int(t.data_ptr())!r} with "
                "host_memory_registered=False: its "
                f"data_ptr() is a host VA, not an address a kernel on {dev} may use. Register it "
                "(pointerdomain.register_host_tensor) and pass host_memory_registered=True"
            )
    return _core_kernel_table(tensors, dev)


class ContiguousBufInfos(NamedTuple):
    """``(data_ptrs, data_lens, item_lens)``, as sglang's ``get_contiguous_buf_infos``.

    Region ``r`` is ``data_lens[r]`` bytes from host VA ``data_ptrs[r]``, made of
    pages of ``item_lens[r]`` bytes (page ``p`` starts at
    ``data_ptrs[r] + p * item_lens[r]``). For a transfer engine's
    ``register_memory``; never for a kernel.
    """

    data_ptrs: list[HostVA]
    data_lens: list[int]
    item_lens: list[int]

    def buffer_infos(self) -> list[BufferInfo]:
        """The regions as :class:`BufferInfo` (``item_bytes`` = bytes per page)."""
        return [
            BufferInfo(address=a, nbytes=n, item_bytes=i)
            for a, n, i in zip(self.data_ptrs, self.data_lens, self.item_lens)
        ]


class PageBufferMeta(NamedTuple):
    """``(ptr_list, element_size_list)``, as sglang's ``get_page_buffer_meta``.

    Block ``j`` is ``element_size_list[j]`` bytes from host VA ``ptr_list[j]``.
    Per page, in sglang's order: ``layer_first`` gives ``K(layer 0), V(layer 0),
    K(layer 1), ...`` (MLA: one block per layer); ``page_first`` and
    ``page_first_direct`` give ``K, V`` (MLA: one block).
    """

    ptr_list: list[HostVA]
    element_size_list: list[int]

    def buffer_infos(self, item_bytes: int | None = None) -> list[BufferInfo]:
        """The blocks as :class:`BufferInfo`; ``item_bytes`` defaults to each block's size."""
        return [
            BufferInfo(address=a, nbytes=n, item_bytes=n if item_bytes is None else item_bytes)
            for a, n in zip(self.ptr_list, self.element_size_list)
        ]


class MHADevicePool(Protocol):
    """sglang's ``MHATokenToKVPool`` as read here: per-layer K and V device tensors
    ``[size + page_size, head_num, head_dim]`` and tokens per page."""

    @property
    def k_buffer(self) -> Sequence[torch.Tensor]: ...

    @property
    def v_buffer(self) -> Sequence[torch.Tensor]: ...

    @property
    def page_size(self) -> int: ...


class MLADevicePool(Protocol):
    """sglang's ``MLATokenToKVPool`` as read here: per-layer latent device tensors
    ``[size + page_size, 1, kv_cache_dim]`` and tokens per page."""

    @property
    def kv_buffer(self) -> Sequence[torch.Tensor]: ...

    @property
    def page_size(self) -> int: ...


class SglangHostPool(Protocol):
    """sglang's ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` as read by
    :meth:`HostKVCacheAdapter.from_sglang`: the buffer, its layout name, tokens per page,
    layers and token slots (``page_num * page_size``); besides, MHA pools have
    ``head_num`` and ``head_dim``, MLA pools ``kv_cache_dim``."""

    @property
    def kv_buffer(self) -> torch.Tensor: ...

    @property
    def layout(self) -> str: ...

    @property
    def page_size(self) -> int: ...

    @property
    def layer_num(self) -> int: ...

    @property
    def size(self) -> int: ...


#: The host layouts sglang allocates, by attention (``init_kv_buffer``; see the module docstring).
_SGLANG_KINDS: dict[str, tuple[str, ...]] = {
    "mha": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "mla": ("layer_first", "page_first", "page_first_direct"),
}


def sglang_host_shape(layout: KVLayout) -> tuple[int, ...]:
    """The shape sglang's host pool allocates for ``layout`` (dtype ``layout.torch_dtype``):
    MHA ``layout.buffer_shape``; MLA the same without the leading kv dimension of 1
    (``[layer_num, size, 1, kv_cache_dim]`` for ``layer_first``). The bytes are the same
    either way.

    Raises:
        InvalidTypeError: ``layout`` is not a KVLayout.
        LayoutError: a kind sglang has no host pool of for this attention (MLA
            ``page_head``, ``page_unified``).
    """
    if not isinstance(cast(object, layout), KVLayout):
        raise InvalidTypeError(
            f"layout: found a {type(layout).__name__}, expected a KVLayout. Fix: pass pointerdomain.KVLayout(...)")
    if layout.kind not in _SGLANG_KINDS[layout.attention]:
        raise LayoutError(
            f"sglang has no {layout.attention.upper()} host pool of layout {layout.kind!r}; its kinds are "
            f"{_SGLANG_KINDS[layout.attention]}. Fix: use one of those kinds")
    shape = layout.buffer_shape
    return shape[1:] if layout.attention == "mla" else shape


def _sglang_buffers(name: str, pool: object) -> tuple[object, object | None]:
    """``(k_buffer, v_buffer)`` of an sglang MHA device pool, ``(kv_buffer, None)`` of an MLA one.

    Raises:
        InvalidTypeError: neither attribute set is there, or one is a single tensor (a
            host pool, or one tensor for all layers).
    """
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    kv = getattr(pool, "kv_buffer", None)
    found = "None" if pool is None else f"a {type(pool).__name__}"
    for attr, value in (("k_buffer", k), ("v_buffer", v), ("kv_buffer", kv)):
        if isinstance(value, torch.Tensor):
            raise InvalidTypeError(
                f"{name}: found {found} whose {attr} is one tensor, expected a device pool whose k_buffer / "
                "v_buffer (MLA: kv_buffer) are lists of per-layer tensors, as sglang's MHATokenToKVPool / "
                "MLATokenToKVPool. A host pool is the other side of the copy: pass the device pool it backs up")
    if k is not None and v is not None:
        return k, v
    if kv is not None:
        return kv, None
    raise InvalidTypeError(
        f"{name}: found {found}, expected a device pool: a DeviceKVBuffers or DevicePool (.layout and .table), or "
        "sglang's MHATokenToKVPool (.k_buffer, .v_buffer, .page_size) / MLATokenToKVPool (.kv_buffer, .page_size)")


class _DeviceView(NamedTuple):
    """An sglang device pool object seen before: the lists' items then, and their buffers."""

    ref: weakref.ref[object]
    k: tuple[object, ...]
    v: tuple[object, ...] | None
    buffers: DeviceKVBuffers


def _same_items(before: tuple[object, ...] | None, now: object) -> bool:
    if before is None or now is None:
        return before is None and now is None
    if not isinstance(now, (list, tuple)):
        return False
    items = cast("list[object] | tuple[object, ...]", now)
    return len(items) == len(before) and all(a is b for a, b in zip(items, before))


def _check_backend(io_backend: str) -> None:
    if io_backend != "kernel":
        raise InvalidArgumentError(
            f"io_backend: found {describe(io_backend)}, expected 'kernel'; {describe(io_backend)} is not supported by this adapter: only 'kernel' (the typed transfer "
            "kernels). A 'direct' backend uses runtime copies (cudaMemcpyAsync), which take host VAs. "
            "Fix: pass io_backend='kernel'"
        )


class HostKVCacheAdapter(ProcessLocal):
    """A cache's registered host KV buffer behind sglang's ``HostKVCache`` methods.

    Args:
        kv_buffer: the host pool, contiguous, ``layout.nbytes`` bytes (any shape
            and dtype; normally ``layout.buffer_shape`` of ``layout.torch_dtype``, or
            :func:`sglang_host_shape`), in host memory registered for ``device``
            (``pointerdomain.alloc_registered``, ``register_host_tensor``; on CUDA a torch
            ``pin_memory()`` tensor too). MHA or MLA, as ``layout.attention`` says.
        layout: the host layout (``layer_first``, ``page_first``, ``page_first_direct``).
        device: the device whose kernels move its pages.

    :meth:`from_sglang` builds it from sglang's own host pool object, :meth:`from_pool`
    from a :class:`pointerdomain.HostKVPool`. The transfer methods take the device side
    as :class:`DeviceKVBuffers` or as sglang's device pool object.

    Attributes:
        kv_buffer: the buffer (host VA side).
        kv_layout: its :class:`KVLayout`.
        layout: the layout kind as sglang names it (``"layer_first"``, ...).
        kernel_table: ``PointerTable[DeviceAlias]`` for launches: one entry, or one
            per page block when the registration was made in several chunks.
        host_table: ``PointerTable[HostVA]``, one entry, for metadata.

    Raises:
        InvalidTypeError: ``kv_buffer`` is not a tensor (a ``TypeError``).
        LayoutError: its size is not ``layout.nbytes``.
        NonContiguousError: it is strided.
        DomainError: it is device memory, or host memory not registered.
        RegistrationSpanError: a page block spans two registration chunks.
        InvalidDeviceError: the device does not exist.
    """

    def __init__(self, kv_buffer: torch.Tensor, layout: KVLayout, device: Device | str | torch.device) -> None:
        if not isinstance(cast(object, kv_buffer), torch.Tensor):
            raise InvalidTypeError(
                f"kv_buffer: found a {type(kv_buffer).__name__}, expected a torch.Tensor. Fix: pass the host pool tensor"
            )
        check_instance("layout", layout, KVLayout, "pass the host pool's KVLayout")
        if kv_buffer.nbytes != layout.nbytes:
            raise LayoutError(
                f"kv_buffer holds {kv_buffer.nbytes} bytes but the {layout.kind} layout needs {layout.nbytes}"
            )
        if not kv_buffer.is_contiguous():
            raise NonContiguousError(f"kv_buffer of shape {tuple(kv_buffer.shape)} is strided; pass the pool buffer")
        self.device: Device = validate_device(device)
        self.kv_layout = layout
        self.kv_buffer = kv_buffer
        self.host_table: PointerTable[HostVA] = host_ptr_table([kv_buffer])
        owner = find_registration(HostVA.unsafe_from_int(kv_buffer.data_ptr()), layout.nbytes)
        chunked = owner is not None and len(owner.chunks) > 1
        entries = layout.page_block_views(kv_buffer) if chunked else [kv_buffer]
        self.kernel_table: PointerTable[DeviceAlias] = make_kernel_ptr_table(
            entries, self.device, host_memory_registered=True
        )
        #: sglang device pool objects seen by the transfer methods, by id
        self._device_views: dict[int, _DeviceView] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_pool(cls, pool: HostKVPool) -> HostKVCacheAdapter:
        """The adapter over a :class:`pointerdomain.HostKVPool`'s buffer.

        Raises:
            InvalidTypeError: ``pool`` is not a HostKVPool.
        """
        check_instance("pool", pool, HostKVPool, "pass the pointerdomain.HostKVPool; for sglang's own pool use from_sglang")
        return cls(pool.buffer, pool.layout, pool.device)

    @classmethod
    def from_sglang(cls, host_pool: SglangHostPool, device: Device | str | torch.device) -> HostKVCacheAdapter:
        """The adapter over sglang's host pool object (``MHATokenToKVPoolHost`` or
        ``MLATokenToKVPoolHost``), its buffer in the shape sglang allocates.

        Read: ``kv_buffer`` (the tensor), ``layout`` (``"layer_first"``, ``"page_first"``,
        ``"page_first_direct"``; MHA also ``"page_head"``), ``page_size``, ``layer_num``,
        ``size`` (token slots), and ``head_num`` / ``head_dim`` (MHA) or ``kv_cache_dim``
        (MLA: the pool has that attribute). The dtype is ``kv_buffer``'s.

        Args:
            host_pool: the pool; its ``kv_buffer`` must be host memory registered for
                ``device`` (as for the constructor).
            device: the device whose kernels move its pages.

        Raises:
            InvalidTypeError: an attribute is missing, or ``kv_buffer`` is not a tensor.
            InvalidArgumentError: ``layout`` is not a layout name, or a size is not an int > 0.
            LayoutError: ``kv_buffer`` does not have the shape sglang allocates for those
                values (:func:`sglang_host_shape`), ``size`` is not whole pages, or a kind
                sglang has no pool of for this attention; and everything the constructor raises.
        """
        def read(attr: str) -> object:
            if not hasattr(host_pool, attr):
                raise InvalidTypeError(
                    f"host_pool: a {type(host_pool).__name__} without {attr}; expected sglang's "
                    "MHATokenToKVPoolHost or MLATokenToKVPoolHost. Fix: pass the host pool object, or build the "
                    "adapter from its buffer and a KVLayout (HostKVCacheAdapter(kv_buffer, layout, device))")
            return cast(object, getattr(host_pool, attr))

        def count(attr: str) -> int:
            value = read(attr)
            if type(value) is not int or value <= 0:
                raise InvalidArgumentError(
                    f"host_pool.{attr}: found {describe(value)}, expected an int > 0. Fix: pass the pool sglang built")
            return value

        buffer = read("kv_buffer")
        if not isinstance(buffer, torch.Tensor):
            raise InvalidTypeError(
                f"host_pool.kv_buffer: found a {type(buffer).__name__}, expected a torch.Tensor (one buffer for the "
                "pool). Fix: pass the pool after init_kv_buffer")
        kind = read("layout")
        if not isinstance(kind, str):
            raise InvalidArgumentError(
                f"host_pool.layout: found {describe(kind)}, expected a layout name, e.g. 'page_first'. Fix: pass the pool "
                "sglang built")
        mla = getattr(host_pool, "kv_cache_dim", None) is not None
        attention: Literal["mha", "mla"] = "mla" if mla else "mha"
        if kind not in _SGLANG_KINDS[attention]:
            raise InvalidArgumentError(
                f"host_pool.layout: found {describe(kind)}, expected one of {_SGLANG_KINDS[attention]} for an "
                f"{attention.upper()} pool. Fix: use a kind sglang allocates for it")
        page_size, layers, size = count("page_size"), count("layer_num"), count("size")
        heads, dim = (1, count("kv_cache_dim")) if mla else (count("head_num"), count("head_dim"))
        if size % page_size:
            raise LayoutError(
                f"host_pool.size: found {size} slots, expected a whole number of pages of {page_size} tokens "
                "(sglang sets size = page_num * page_size). Fix: pass the pool sglang built")
        layout = KVLayout.model_validate({
            "kind": kind, "attention": attention, "num_layers": layers, "num_pages": size // page_size,
            "page_size": page_size, "num_heads": heads, "head_dim": dim, "dtype": KVLayout.dtype_name(buffer.dtype),
        })
        want = sglang_host_shape(layout)
        if tuple(buffer.shape) != want:
            raise LayoutError(
                f"host_pool.kv_buffer: shape {tuple(buffer.shape)}, but sglang allocates {want} for an "
                f"{attention.upper()} {kind} pool of {layers} layers, {size} slots, {heads} x {dim}. Fix: pass "
                "the pool's own kv_buffer, or HostKVCacheAdapter(kv_buffer, layout, device) for another shape")
        return cls(buffer, layout, device)

    def _device_side(self, method: str, device_pool: object) -> tuple[KVLayout, PointerTable[DeviceAlias]]:
        """``(layout, table)`` of the device pool a transfer method was given: a
        :class:`pointerdomain.DevicePool` as it is, an sglang device pool object through a
        :class:`DeviceKVBuffers` over its lists (built once per pool object, rebuilt when a
        list holds other tensors).

        Raises:
            InvalidTypeError: anything else; and what :class:`DeviceKVBuffers` raises.
        """
        layout, table = getattr(device_pool, "layout", None), getattr(device_pool, "table", None)
        if isinstance(layout, KVLayout) and isinstance(table, PointerTable):
            return layout, cast("PointerTable[DeviceAlias]", table)
        k, v = _sglang_buffers(f"{method}: device_pool", device_pool)
        key = id(device_pool)
        view = self._device_views.get(key)  # a dict read is atomic under the GIL; writes take the lock
        if view is not None and view.ref() is device_pool and _same_items(view.k, k) and _same_items(view.v, v):
            return view.buffers.layout, view.buffers.table
        buffers = DeviceKVBuffers.from_sglang(cast(MHADevicePool, device_pool), self.device)
        try:
            ref = weakref.ref(device_pool, functools.partial(self._forget, key))
        except TypeError:  # not weak-referenceable: no cache, checked again next call
            return buffers.layout, buffers.table
        with self._lock:
            while len(self._device_views) >= 8:  # a host pool backs one device pool (and its draft pools)
                del self._device_views[next(iter(self._device_views))]
            self._device_views[key] = _DeviceView(
                ref, tuple(buffers.k_buffer), None if buffers.v_buffer is None else tuple(buffers.v_buffer), buffers)
        return buffers.layout, buffers.table

    def _forget(self, key: int, ref: weakref.ref[object]) -> None:
        with self._lock:
            view = self._device_views.get(key)
            if view is not None and view.ref is ref:
                del self._device_views[key]

    @property
    def layout(self) -> str:
        """The layout kind, as sglang's ``HostKVCache.layout``."""
        return self.kv_layout.kind

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.kv_layout.page_size

    @property
    def size(self) -> int:
        """Token slots (``page_num * page_size``)."""
        return self.kv_layout.num_slots

    @property
    def page_num(self) -> int:
        return self.kv_layout.num_pages

    @property
    def layer_num(self) -> int:
        return self.kv_layout.num_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_layout.torch_dtype

    def get_contiguous_buf_infos(self) -> ContiguousBufInfos:
        """The pool as contiguous host regions (for a transfer engine's ``register_memory``).

        ``layer_first``: one region per (K/V, layer) of ``size * item`` bytes;
        ``page_first*``: one region per K/V. ``item_lens`` = bytes of one page in
        the region (``kv_layout.page_block_bytes()``). Addresses are HostVA.

        Raises:
            ClosedError: the pool's memory was closed, released or swapped.
        """
        regions = self.kv_layout.page_regions()
        base, block = metadata_table(self.host_table)[0], self.kv_layout.page_block_bytes()
        return ContiguousBufInfos([base + off for off, _ in regions], [n for _, n in regions], [block] * len(regions))

    def _pages(self, indices: torch.Tensor | Sequence[int]) -> list[int]:
        idx = index_tensor("indices", indices)
        ps = self.page_size
        if idx.numel() % ps:
            raise IndexValidationError(f"indices: {idx.numel()} token slots, not a multiple of page_size {ps}")
        if idx.numel() == 0:
            return []
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.size:
            raise IndexValidationError(f"indices: slot {lo if lo < 0 else hi} outside [0, {self.size})")
        rows = idx.view(-1, ps)
        firsts = rows[:, 0]
        if bool((firsts % ps != 0).any()) or not torch.equal(rows, firsts[:, None] + torch.arange(ps)):
            raise IndexValidationError(
                f"indices: each group of {ps} slots must be one whole page (page-aligned, consecutive)"
            )
        return [int(f) // ps for f in firsts.tolist()]

    def get_page_buffer_meta(self, indices: torch.Tensor | Sequence[int]) -> PageBufferMeta:
        """Host-VA blocks holding the pages of ``indices`` (zero-copy storage I/O).

        Args:
            indices: token slots, ``int`` 1-D, a multiple of ``page_size`` long,
                whole pages in order (as sglang passes ``host_indices``).

        Returns:
            ``(ptr_list, element_size_list)`` in sglang's block order (see
            :class:`PageBufferMeta`); sizes in bytes.

        Raises:
            IndexValidationError: wrong shape or dtype, a partial or misaligned
                page, or a slot outside ``[0, size)``.
            ClosedError: the pool's memory was closed, released or swapped.
        """
        base = metadata_table(self.host_table)[0]
        blocks = [
            block
            for page in self._pages(indices)
            for block in self.kv_layout.page_blocks(page, order="layer_major", merge=False)
        ]
        return PageBufferMeta([base + off for off, _ in blocks], [n for _, n in blocks])

    def backup_from_device_all_layer(
        self,
        device_pool: DevicePool | MHADevicePool | MLADevicePool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
        *,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    ) -> None:
        """D2H: token slots ``device_indices`` of ``device_pool`` -> ``host_indices``, every layer.

        Args:
            device_pool: a :class:`DeviceKVBuffers` (or any :class:`pointerdomain.DevicePool`),
                or sglang's ``MHATokenToKVPool`` / ``MLATokenToKVPool`` object itself (its
                per-layer lists are read and checked as :class:`DeviceKVBuffers` does, once
                per pool object and again when a list's tensors change).
            host_indices, device_indices: token slots, ``int64`` 1-D, as long as each other,
                on the launch device (CPU when emulated).
            io_backend: ``"kernel"`` (sglang's argument; the only one taken).

        Raises:
            InvalidArgumentError: ``io_backend`` is not ``"kernel"`` (a ``ValueError``).
            InvalidTypeError: ``device_pool`` is none of the above; everything
                :class:`DeviceKVBuffers` raises for an sglang pool object's lists; and
                everything :func:`pointerdomain.transfer_kv_all_layer` raises.
        """
        _check_backend(io_backend)
        layout, table = self._device_side("backup_from_device_all_layer", device_pool)
        transfer_kv_all_layer(
            table, self.kernel_table, device_indices, host_indices,
            src_layout=layout, dst_layout=self.kv_layout,
            stream=stream, max_ctas=max_ctas,
        )

    def load_to_device_all_layer(
        self,
        device_pool: DevicePool | MHADevicePool | MLADevicePool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
        *,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    ) -> None:
        """H2D: ``host_indices`` -> ``device_indices`` of ``device_pool``, every layer.
        Arguments and errors as :meth:`backup_from_device_all_layer`."""
        _check_backend(io_backend)
        layout, table = self._device_side("load_to_device_all_layer", device_pool)
        transfer_kv_all_layer(
            self.kernel_table, table, host_indices, device_indices,
            src_layout=self.kv_layout, dst_layout=layout,
            stream=stream, max_ctas=max_ctas,
        )

    def load_to_device_per_layer(
        self,
        device_pool: DevicePool | MHADevicePool | MLADevicePool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str = "kernel",
        *,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    ) -> None:
        """H2D for one layer (layer-by-layer loading overlapping the forward pass): only
        layer ``layer_id`` of the device pool is written. Other arguments as
        :meth:`backup_from_device_all_layer`.

        Raises:
            IndexValidationError: ``layer_id`` outside ``[0, layer_num)``; and all of
                :meth:`backup_from_device_all_layer`'s errors, with
                :func:`pointerdomain.transfer_kv_per_layer`'s.
        """
        _check_backend(io_backend)
        layout, table = self._device_side("load_to_device_per_layer", device_pool)
        transfer_kv_per_layer(
            self.kernel_table, table, host_indices, device_indices, layer_id=layer_id,
            src_layout=self.kv_layout, dst_layout=layout,
            stream=stream, max_ctas=max_ctas,
        )


def _buffer_list(name: str, buffers: object) -> list[torch.Tensor]:
    """``buffers`` as a list of tensors, one per layer.

    Raises:
        InvalidTypeError: a bare tensor (one buffer for all layers is not sglang's device
            pool), not a list or tuple, or an item that is not a tensor.
        LayoutError: an empty list.
    """
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, (list, tuple)):
        raise InvalidTypeError(
            f"{name}: found a {type(buffers).__name__}, expected a list of per-layer device tensors "
            "(sglang's MHATokenToKVPool.k_buffer / v_buffer, MLATokenToKVPool.kv_buffer). Fix: pass the list; "
            "for one stacked tensor, list(t.unbind(0))")
    items = list(cast("list[object] | tuple[object, ...]", buffers))
    for i, b in enumerate(items):
        if not isinstance(b, torch.Tensor):
            raise InvalidTypeError(
                f"{name}[{i}]: found a {type(b).__name__}, expected a torch.Tensor. Fix: one device tensor per layer")
    if not items:
        raise LayoutError(f"{name}: found an empty list, expected one buffer per layer. Fix: pass the pool's buffers")
    return cast("list[torch.Tensor]", items)


class DeviceKVBuffers(ProcessLocal):
    """sglang's device pool buffers (``MHATokenToKVPool.k_buffer`` / ``v_buffer``, or
    ``MLATokenToKVPool.kv_buffer``) as a device pool the host adapter can launch with.

    Args:
        k_buffer: per layer ``[num_slots, head_num, head_dim]`` device tensors, contiguous
            (MLA: the ``kv_buffer`` list, ``head_num`` 1, ``head_dim`` = ``kv_cache_dim``).
        v_buffer: per layer V tensors of the same shape and dtype as every K tensor, as
            many, or None for MLA.
        device: the device holding them (their memory is checked to be its memory).
        page_size: tokens per page (an int > 0); ``num_slots`` must be a multiple (sglang
            allocates ``size + page_size`` slots).

    Attributes:
        k_buffer / v_buffer: the lists given (``v_buffer`` None for MLA).
        layout: ``layer_first`` :class:`KVLayout` with ``num_pages = num_slots // page_size``,
            ``num_layers = len(k_buffer)``.
        table: ``PointerTable[DeviceAlias]`` of ``k_buffer + v_buffer`` (``2 * layers`` entries,
            split per kv and layer; MLA ``layers`` entries), what the transfers launch with.
        k_table / v_table: per-kv tables (``layers`` entries each; ``v_table`` None for
            MLA), as sglang's ``k_data_ptrs`` / ``v_data_ptrs`` (MLA ``data_ptrs``), for
            ops that take K and V tables apart.

    Raises:
        InvalidTypeError: ``k_buffer`` / ``v_buffer`` is not a list or tuple (a bare
            tensor included), or holds a non-tensor.
        InvalidArgumentError: ``page_size`` is not an int > 0.
        LayoutError: an empty list, K and V lists of different lengths, a buffer of another
            shape or dtype than ``k_buffer[0]``, a non-3-D buffer, an unsupported dtype,
            ``num_slots`` not a multiple of ``page_size``, or MLA with ``head_num`` != 1.
        DomainError: a buffer is host memory.
        DeviceMismatchError: a buffer is memory of another device.
        NonContiguousError: a strided buffer.
        InvalidDeviceError: the device does not exist.
    """

    def __init__(
        self,
        k_buffer: Sequence[torch.Tensor],
        v_buffer: Sequence[torch.Tensor] | None,
        device: Device | str | torch.device,
        *,
        page_size: int,
    ) -> None:
        dev = validate_device(device)
        self.k_buffer = _buffer_list("k_buffer", k_buffer)
        self.v_buffer = None if v_buffer is None else _buffer_list("v_buffer", v_buffer)
        if self.v_buffer is not None and len(self.v_buffer) != len(self.k_buffer):
            raise LayoutError(
                f"v_buffer: found {len(self.v_buffer)} buffers for {len(self.k_buffer)} K buffers, expected one K "
                "and one V buffer per layer. Fix: pass both lists of the same pool")
        if type(page_size) is not int or page_size <= 0:
            raise InvalidArgumentError(
                f"page_size: found {describe(page_size)}, expected an int > 0 (tokens per page). Fix: pass the pool's page_size")
        named = [(f"k_buffer[{i}]", b) for i, b in enumerate(self.k_buffer)]
        named += [(f"v_buffer[{i}]", b) for i, b in enumerate(self.v_buffer or [])]
        first = self.k_buffer[0]
        for name, b in named:
            if b.dim() != 3 or b.shape != first.shape or b.dtype != first.dtype:
                raise LayoutError(
                    f"{name}: shape {tuple(b.shape)} {b.dtype}; every buffer must be [num_slots, head_num, head_dim] "
                    f"like k_buffer[0] {tuple(first.shape)} {first.dtype}. Fix: pass the buffers of one pool")
            if not b.is_contiguous():
                raise NonContiguousError(
                    f"{name}: strides {b.stride()} of shape {tuple(b.shape)}, not contiguous; a table entry covers "
                    "one packed buffer. Fix: pass the pool's own per-layer buffers")
            where = memory_device(b)
            if where is None:
                raise DomainError(
                    f"{name}: host memory at {HostVA.unsafe_from_int(b.data_ptr())!r}; a device pool's buffers are "
                    "device memory "
                    f"of {dev}. Fix: pass the device pool's buffers (host memory belongs in HostKVCacheAdapter)")
            if where != dev:
                raise DeviceMismatchError(
                    f"{name}: memory of {where}, but the pool is on {dev}. Fix: keep every layer on one device, "
                    "or pass the device the buffers are on")
        num_slots, heads, dim = (int(x) for x in first.shape)
        if num_slots % page_size:
            raise LayoutError(
                f"k_buffer[0]: found {num_slots} slots, expected a whole number of pages of {page_size} tokens "
                "(sglang allocates size + page_size). Fix: pass the pool's page_size")
        if self.v_buffer is None and heads != 1:
            raise LayoutError(
                f"k_buffer[0]: found head_num {heads} with v_buffer=None (MLA); expected 1: MLA buffers hold one "
                "latent vector per token. Fix: pass v_buffer for MHA")
        self.device: Device = dev
        self._layout = KVLayout(
            kind="layer_first",
            attention="mha" if self.v_buffer is not None else "mla",
            num_layers=len(self.k_buffer),
            num_pages=num_slots // page_size,
            page_size=page_size,
            num_heads=heads,
            head_dim=dim,
            dtype=KVLayout.dtype_name(first.dtype),
        )
        self._table = make_kernel_ptr_table(self.k_buffer + (self.v_buffer or []), dev, host_memory_registered=False)

    @classmethod
    def mha(cls, k_buffer: Sequence[torch.Tensor], v_buffer: Sequence[torch.Tensor],
            device: Device | str | torch.device, *, page_size: int) -> DeviceKVBuffers:
        """MHA: per-layer K and V lists (``MHATokenToKVPool.k_buffer`` / ``v_buffer``).

        Raises:
            InvalidTypeError: ``v_buffer`` is None; and everything the constructor raises.
        """
        if v_buffer is None:
            raise InvalidTypeError(
                "v_buffer: found None, expected the per-layer V buffers. Fix: pass v_buffer, or mla() for MLA")
        return cls(k_buffer, v_buffer, device, page_size=page_size)

    @classmethod
    def mla(cls, kv_buffer: Sequence[torch.Tensor], device: Device | str | torch.device, *,
            page_size: int) -> DeviceKVBuffers:
        """MLA: one per-layer list (``MLATokenToKVPool.kv_buffer``, ``[num_slots, 1, kv_cache_dim]``)."""
        return cls(kv_buffer, None, device, page_size=page_size)

    @classmethod
    def from_sglang(cls, device_pool: MHADevicePool | MLADevicePool, device: Device | str | torch.device
                    ) -> DeviceKVBuffers:
        """The buffers of sglang's device pool object: ``k_buffer`` and ``v_buffer`` (MHA) or
        ``kv_buffer`` (MLA), and ``page_size``; ``device`` the device they are on (sglang's
        own ``device`` attribute names no ordinal).

        Raises:
            InvalidTypeError: the object has neither ``k_buffer`` and ``v_buffer`` nor
                ``kv_buffer``, or no ``page_size``; and everything the constructor raises.
        """
        k, v = _sglang_buffers("device_pool", device_pool)
        page_size = getattr(device_pool, "page_size", None)
        if page_size is None:
            raise InvalidTypeError(
                f"device_pool: a {type(device_pool).__name__} without page_size; sglang's device pools have one. "
                "Fix: pass the pool, or DeviceKVBuffers(k_buffer, v_buffer, device, page_size=...)")
        # the lists and page_size are checked by the constructor
        return cls(cast("Sequence[torch.Tensor]", k), cast("Sequence[torch.Tensor] | None", v), device,
                   page_size=cast(int, page_size))

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def table(self) -> PointerTable[DeviceAlias]:
        return self._table

    @functools.cached_property
    def k_table(self) -> PointerTable[DeviceAlias]:
        """Per-layer K (MLA: latent) buffers, ``layers`` entries."""
        return make_kernel_ptr_table(self.k_buffer, self.device, host_memory_registered=False)

    @functools.cached_property
    def v_table(self) -> PointerTable[DeviceAlias] | None:
        """Per-layer V buffers, ``layers`` entries; None for MLA."""
        if self.v_buffer is None:
            return None
        return make_kernel_ptr_table(self.v_buffer, self.device, host_memory_registered=False)

    @property
    def layer_num(self) -> int:
        return self._layout.num_layers

    @property
    def page_size(self) -> int:
        return self._layout.page_size
