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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

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
from pointerdomain.errors import (
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
    "PageBufferMeta",
    "make_kernel_ptr_table",
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
        NonContiguousError, DeviceMismatchError, RegistrationSpanError,
        ClosedError, InvalidDeviceError: as :func:`pointerdomain.make_kernel_ptr_table`.
    """
    dev = validate_device(target_device)
    for i, t in enumerate(tensors):
        if not isinstance(cast(object, t), torch.Tensor):
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


def _check_backend(io_backend: str) -> None:
    if io_backend != "kernel":
        raise InvalidArgumentError(
            f"io_backend: found {io_backend!r}, expected 'kernel'; {io_backend!r} is not supported by this adapter: only 'kernel' (the typed transfer "
            "kernels). A 'direct' backend uses runtime copies (cudaMemcpyAsync), which take host VAs. "
            "Fix: pass io_backend='kernel'"
        )


class HostKVCacheAdapter:
    """A cache's registered host KV buffer behind sglang's ``HostKVCache`` methods.

    Args:
        kv_buffer: the host pool, contiguous, ``layout.nbytes`` bytes (any shape
            and dtype; normally ``layout.buffer_shape`` of ``layout.torch_dtype``),
            in host memory registered for ``device`` (``pointerdomain.alloc_registered``,
            ``register_host_tensor``; on CUDA a torch ``pin_memory()`` tensor too).
        layout: the host layout (``layer_first``, ``page_first``, ``page_first_direct``).
        device: the device whose kernels move its pages.

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
        owner = find_registration(HostVA(kv_buffer.data_ptr()), layout.nbytes)
        chunked = owner is not None and len(owner.chunks) > 1
        entries = layout.page_block_views(kv_buffer) if chunked else [kv_buffer]
        self.kernel_table: PointerTable[DeviceAlias] = make_kernel_ptr_table(
            entries, self.device, host_memory_registered=True
        )

    @classmethod
    def from_pool(cls, pool: HostKVPool) -> HostKVCacheAdapter:
        """The adapter over a :class:`pointerdomain.HostKVPool`'s buffer."""
        return cls(pool.buffer, pool.layout, pool.device)

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
        """
        regions = self.kv_layout.page_regions()
        base, block = self.host_table[0], self.kv_layout.page_block_bytes()
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
        """
        base = self.host_table[0]
        blocks = [
            block
            for page in self._pages(indices)
            for block in self.kv_layout.page_blocks(page, order="layer_major", merge=False)
        ]
        return PageBufferMeta([base + off for off, _ in blocks], [n for _, n in blocks])

    def backup_from_device_all_layer(
        self,
        device_pool: DevicePool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
        *,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    ) -> None:
        """D2H: token slots ``device_indices`` of ``device_pool`` -> ``host_indices``, every layer.

        Indices are ``int64`` 1-D on the launch device (CPU when emulated).

        Raises:
            InvalidArgumentError: ``io_backend`` is not ``"kernel"`` (a ``ValueError``).
            Everything :func:`pointerdomain.transfer_kv_all_layer` raises.
        """
        _check_backend(io_backend)
        transfer_kv_all_layer(
            device_pool.table, self.kernel_table, device_indices, host_indices,
            src_layout=device_pool.layout, dst_layout=self.kv_layout,
            stream=stream, max_ctas=max_ctas,
        )

    def load_to_device_all_layer(
        self,
        device_pool: DevicePool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
        *,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    ) -> None:
        """H2D: ``host_indices`` -> ``device_indices`` of ``device_pool``, every layer."""
        _check_backend(io_backend)
        transfer_kv_all_layer(
            self.kernel_table, device_pool.table, host_indices, device_indices,
            src_layout=self.kv_layout, dst_layout=device_pool.layout,
            stream=stream, max_ctas=max_ctas,
        )

    def load_to_device_per_layer(
        self,
        device_pool: DevicePool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str = "kernel",
        *,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    ) -> None:
        """H2D for one layer (layer-by-layer loading overlapping the forward pass).

        Raises:
            IndexValidationError: ``layer_id`` outside ``[0, layer_num)``; and all of
                :func:`pointerdomain.transfer_kv_per_layer`'s errors.
        """
        _check_backend(io_backend)
        transfer_kv_per_layer(
            self.kernel_table, device_pool.table, host_indices, device_indices, layer_id=layer_id,
            src_layout=self.kv_layout, dst_layout=device_pool.layout,
            stream=stream, max_ctas=max_ctas,
        )


class DeviceKVBuffers:
    """sglang's device pool buffers (``MHATokenToKVPool.k_buffer`` / ``v_buffer``, or
    ``MLATokenToKVPool.kv_buffer``) as a device pool the host adapter can launch with.

    Args:
        k_buffer: per layer ``[num_slots, head_num, head_dim]`` device tensors
            (MLA: the ``kv_buffer`` list, ``head_num`` 1).
        v_buffer: per layer V tensors of the same shape, or None for MLA.
        device: the device holding them.
        page_size: tokens per page; ``num_slots`` must be a multiple.

    Attributes:
        layout: ``layer_first`` :class:`KVLayout` with ``num_pages = num_slots // page_size``.
        table: ``PointerTable[DeviceAlias]`` of ``k_buffer + v_buffer``.

    Raises:
        LayoutError: buffers of different shapes or dtypes, a non-3-D buffer, an
            unsupported dtype, ``num_slots`` not a multiple of ``page_size``, or
            MLA with ``head_num`` != 1.
        DomainError: a buffer is host memory.
        DeviceMismatchError: a buffer on another device.
    """

    def __init__(
        self,
        k_buffer: Sequence[torch.Tensor],
        v_buffer: Sequence[torch.Tensor] | None,
        device: Device | str | torch.device,
        *,
        page_size: int,
    ) -> None:
        self.k_buffer = list(k_buffer)
        self.v_buffer = None if v_buffer is None else list(v_buffer)
        buffers = self.k_buffer + (self.v_buffer or [])
        if not self.k_buffer or (self.v_buffer is not None and len(self.v_buffer) != len(self.k_buffer)):
            raise LayoutError(
                f"need one K (and V) buffer per layer; got {len(self.k_buffer)} K and "
                f"{'no' if self.v_buffer is None else len(self.v_buffer)} V buffers"
            )
        first = buffers[0]
        for i, b in enumerate(buffers):
            if b.dim() != 3 or b.shape != first.shape or b.dtype != first.dtype:
                raise LayoutError(
                    f"buffer {i}: shape {tuple(b.shape)} {b.dtype}; every buffer must be "
                    f"[num_slots, head_num, head_dim] like buffer 0 {tuple(first.shape)} {first.dtype}"
                )
        num_slots, heads, dim = (int(x) for x in first.shape)
        if type(page_size) is not int or page_size <= 0 or num_slots % page_size:
            raise LayoutError(f"{num_slots} slots is not a whole number of pages of {page_size!r} tokens")
        if self.v_buffer is None and heads != 1:
            raise LayoutError(f"MLA buffers hold one latent vector per token: head_num must be 1, got {heads}")
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
        self._table = make_kernel_ptr_table(buffers, device, host_memory_registered=False)

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def table(self) -> PointerTable[DeviceAlias]:
        return self._table
