"""KV pools: a device pool (per-layer K/V buffers, layer_first) and a host pool in
registered host memory that backs pages up from it and loads them back.

:class:`HostKVPool` is the example other caches copy: it keeps a kernel table
(``PointerTable[DeviceAlias]``) for launches and a host table
(``PointerTable[HostVA]``) for metadata, and never mixes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Literal, Protocol, cast

import torch

from pointerdomain.arguments import describe
from pointerdomain.registration.allocation import alloc_registered, device_empty
from pointerdomain.devices import Device, validate_device
from pointerdomain.domains import DeviceAlias, HostVA
from pointerdomain.errors import ClosedError, InvalidArgumentError, InvalidTypeError, LayoutError, QuarantinedError
from pointerdomain.transfer.kernels import (
    DEFAULT_MAX_CTAS,
    MaxCtas,
    TransferBackend,
    ValidateIndices,
    bind_call,
    run,
    transfer_kv_per_layer,
)
from pointerdomain.registration.ladder import RegistrationPolicy
from pointerdomain.layouts import KVLayout
from pointerdomain.process_local import ProcessLocal
from pointerdomain.registration.leases import DEFAULT_CLOSE_TIMEOUT_S
from pointerdomain.registration.memory import DEFAULT_MAX_CHUNK_BYTES, RegisteredHostMemory
from pointerdomain.registration.metadata import BufferInfo, buffer_infos, metadata_table, page_buffer_meta
from pointerdomain.registration.tables import PointerTable, host_ptr_table, make_kernel_ptr_table
from pointerdomain.transfer.launch_errors import ensure_error_word
from pointerdomain.transfer.layers import LayerLoad, load_layers

__all__ = ["DeviceKVPool", "DevicePool", "HostKVPool"]


class DevicePool(Protocol):
    """What a host pool needs from a device pool: its layout and its kernel table.

    :class:`pointerdomain.DeviceKVPool` and
    :class:`pointerdomain.adapters.sglang.DeviceKVBuffers` satisfy it.
    """

    @property
    def layout(self) -> KVLayout: ...

    @property
    def table(self) -> PointerTable[DeviceAlias]: ...


def _check_device_pool(method: str, device_pool: object) -> None:
    """``device_pool`` has what :class:`DevicePool` promises (a KVLayout ``layout`` and a
    PointerTable ``table``), checked before anything is launched.

    Raises:
        InvalidTypeError: it does not (None, a HostKVPool, a bare table, ...).
    """
    if isinstance(getattr(device_pool, "layout", None), KVLayout) and isinstance(
            getattr(device_pool, "table", None), PointerTable):
        return
    found = "None" if device_pool is None else f"a {type(device_pool).__name__}"
    also = (" (a host pool: it is the other side of the copy; pass the device pool it backs up)"
            if isinstance(device_pool, HostKVPool) else "")
    raise InvalidTypeError(
        f"HostKVPool.{method}: device_pool: found {found}{also}, expected a device pool (a DeviceKVPool, or an "
        "object with .layout (a KVLayout) and .table (its PointerTable[DeviceAlias])). "
        "Fix: pass the DeviceKVPool whose pages to copy"
    )


class DeviceKVPool(ProcessLocal):
    """A device KV pool: per-layer buffers of shape ``[num_slots, num_heads, head_dim]``
    (K layers then V layers for MHA), ``layout.kind == "layer_first"``.

    Attributes:
        buffers: ``num_kv * num_layers`` device tensors.
        table: their kernel table (``num_kv * num_layers`` entries).

    Raises:
        LayoutError: ``layout.kind`` is not ``layer_first``.
        InvalidDeviceError: the device does not exist.
    """

    def __init__(self, layout: KVLayout, device: Device | str | torch.device) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if layout.kind != "layer_first":
            raise LayoutError(f"a device pool is layer_first, got {layout.kind}")
        self.layout = layout
        self.device = validate_device(device)
        shape = (layout.num_slots, layout.num_heads, layout.head_dim)
        # One allocation viewed per buffer: the launch's storage check (PointerTable.check_live)
        # then costs one storage, not num_kv * num_layers.
        whole = device_empty((layout.num_kv * layout.num_layers, *shape), layout.torch_dtype, self.device)
        self.buffers = list(whole.unbind(0))
        self.table: PointerTable[DeviceAlias] = make_kernel_ptr_table(self.buffers, self.device, layout=layout)
        ensure_error_word(self.device)  # the device readied for launches now, outside the first launch

    def __repr__(self) -> str:
        lay = self.layout
        return (f"DeviceKVPool({lay.kind}, {lay.attention}, {lay.num_layers} layer(s), {lay.num_slots} slot(s), "
                f"{lay.nbytes} bytes, {self.device})")

    @property
    def generation(self) -> int:
        """0: device memory never closes under a pool (:mod:`pointerdomain.transfer.graphs`)."""
        return self.table.generation

    def buffer(self, kv: int, layer: int) -> torch.Tensor:
        """The ``[num_slots, num_heads, head_dim]`` buffer of K (kv=0) or V (kv=1) of ``layer``."""
        return self.buffers[kv * self.layout.num_layers + layer]


class HostKVPool(ProcessLocal):
    """A host KV pool in registered host memory.

    Args:
        layout: the host layout (any kind: ``layer_first``, ``page_first``,
            ``page_first_direct``, ``page_head``, ``page_unified``), same model shape as the
            device pool it serves (launches between ``page_head`` or ``page_unified`` with
            head groups and the device pool's ``layer_first`` run over per-head items,
            :func:`pointerdomain.layouts.lower_pair`).
        device: the device whose kernels move its pages.
        max_chunk_bytes: largest registration call; pools larger than this are
            registered in chunks cut on page blocks, and the kernel table then has
            one entry per page block (per head-group block of a ``page_unified`` page
            with head groups: :meth:`KVLayout.page_block_views`) so alias arithmetic
            never crosses a chunk.
        policy: the registration ladder's policy (see :func:`pointerdomain.alloc_registered`;
            chunks of the ``chunked`` rung are cut on page blocks too).
        numa: ``"local"``: place the pool on the device's NUMA node.

    Attributes:
        buffer: the pool as a tensor of ``layout.buffer_shape`` (host VA side).
        kernel_table: ``PointerTable[DeviceAlias]`` for launches.
        host_table: ``PointerTable[HostVA]`` (one entry, the whole buffer) for metadata.
    """

    def __init__(
        self, layout: KVLayout, device: Device | str | torch.device, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        policy: RegistrationPolicy | None = None, numa: Literal["local"] | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.layout = layout
        self.device = validate_device(device)
        self.memory: RegisteredHostMemory = alloc_registered(
            layout.nbytes, self.device, granularity=layout.page_block_bytes(), max_chunk_bytes=max_chunk_bytes,
            policy=policy, numa=numa,
        )
        self.buffer = self.memory.tensor[: layout.nbytes].view(layout.torch_dtype).view(layout.buffer_shape)
        entries = [self.buffer] if len(self.memory.chunks) == 1 else layout.page_block_views(self.buffer)
        self.kernel_table: PointerTable[DeviceAlias] = make_kernel_ptr_table(entries, self.device, layout=layout)
        ensure_error_word(self.device)  # the device readied for launches now, outside the first launch
        self.host_table: PointerTable[HostVA] = host_ptr_table([self.buffer])
        self._close_hooks: list[Callable[[], None]] = []
        self._entries = entries
        self._tables_lock = threading.Lock()
        self._tables: dict[Device, PointerTable[DeviceAlias]] = {self.device: self.kernel_table}
        # one close at a time: a second caller waits for the first's hooks and unregister
        # (the teardown order holds), then finds the pool closed
        self._close_lock = threading.RLock()
        self._closing = False  # set while close() runs the hooks (a hook's own close() returns at once)
        self.memory.set_owner_close(self.close)  # pool.memory.close() runs the pool's hooks too

    def __repr__(self) -> str:
        lay = self.layout
        state = "closed" if self.memory.closed else f"at {self.memory.host_va!r}, {len(self.memory.chunks)} chunk(s)"
        return (f"HostKVPool({lay.kind}, {lay.attention}, {lay.num_layers} layer(s), {lay.num_pages} page(s), "
                f"{lay.nbytes} bytes, {self.device}, {state})")

    def kernel_table_for(self, device: Device | str | torch.device) -> PointerTable[DeviceAlias]:
        """The kernel table of this pool for ``device``: the same registration (portable,
        so every device of the type may map it), its aliases resolved for ``device``
        (``cudaHostGetDevicePointer`` with ``device`` current; on the emulated backend
        each device's own mapping). Built on first use, then cached; ``kernel_table`` is
        the one for ``self.device``. A launch on another device refuses it.

        Raises:
            InvalidDeviceError: the device does not exist.
            DeviceMismatchError: a device of another type than the pool's.
            ClosedError: the pool was closed.
        """
        dev = validate_device(device)
        self.memory.check_open()
        with self._tables_lock:
            table = self._tables.get(dev)
            if table is None:
                table = make_kernel_ptr_table(self._entries, dev, layout=self.layout)
                ensure_error_word(dev)
                self._tables[dev] = table
        return table

    def backup(
        self, device_pool: DeviceKVPool, device_indices: torch.Tensor, host_indices: torch.Tensor, *,
        stream: int | None = None, max_ctas: MaxCtas = DEFAULT_MAX_CTAS, backend: TransferBackend = "auto",
        validate_indices: ValidateIndices = True,
    ) -> None:
        """D2H: copy token slots ``device_indices`` of ``device_pool`` to ``host_indices``, all layers.

        ``device_pool`` may be on any device of the pool's type (one host pool serving
        several GPUs): the launch uses :meth:`kernel_table_for` its device and runs there.

        Keywords and errors as :func:`transfer_kv_all_layer`, and InvalidTypeError where
        ``device_pool`` is not a device pool (None, a HostKVPool, ...): raised before any launch.
        """
        _check_device_pool("backup", device_pool)
        # transfer_kv_all_layer's two steps, called directly (no keyword call on the hot path)
        src, src_layout, dst = device_pool.table, device_pool.layout, self._table_for_pool(device_pool)
        plan, options, args, _host, path = bind_call(src, src_layout, dst, self.layout, device_indices, host_indices,
                                                     0, src_layout.num_layers, stream, max_ctas, backend,
                                                     validate_indices)
        run(plan, src, dst, device_indices, host_indices, args, path, options.check)  # type: ignore[arg-type]

    def load(
        self, device_pool: DeviceKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor, *,
        stream: int | None = None, max_ctas: MaxCtas = DEFAULT_MAX_CTAS, backend: TransferBackend = "auto",
        validate_indices: ValidateIndices = True,
    ) -> None:
        """H2D: copy ``host_indices`` back to ``device_indices`` of ``device_pool``, all layers."""
        _check_device_pool("load", device_pool)
        # transfer_kv_all_layer's two steps, called directly (no keyword call on the hot path)
        src, dst, layout = self._table_for_pool(device_pool), device_pool.table, self.layout
        plan, options, args, _host, path = bind_call(src, layout, dst, device_pool.layout, host_indices,
                                                     device_indices, 0, layout.num_layers, stream, max_ctas, backend,
                                                     validate_indices)
        run(plan, src, dst, host_indices, device_indices, args, path, options.check)  # type: ignore[arg-type]

    def load_layer(
        self, device_pool: DeviceKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int, *,
        stream: int | None = None, max_ctas: MaxCtas = DEFAULT_MAX_CTAS, backend: TransferBackend = "auto",
        validate_indices: ValidateIndices = True,
    ) -> None:
        """H2D for one layer (overlaps the forward pass layer by layer)."""
        _check_device_pool("load_layer", device_pool)
        transfer_kv_per_layer(
            self._table_for_pool(device_pool), device_pool.table, host_indices, device_indices,
            layer_id=layer_id, src_layout=self.layout, dst_layout=device_pool.layout, stream=stream,
            max_ctas=max_ctas, backend=backend, validate_indices=validate_indices,
        )

    def load_layers(
        self, device_pool: DeviceKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor, *,
        stream: int | None = None, max_ctas: MaxCtas = DEFAULT_MAX_CTAS, backend: TransferBackend = "auto",
        validate_indices: ValidateIndices = True,
    ) -> LayerLoad:
        """H2D for every layer, queued at once on ``stream`` with a completion per layer:
        the model's layer ``i`` calls ``load.wait(i)`` on its own stream (see
        :func:`pointerdomain.transfer.layers.load_layers`). Moves what :meth:`load` moves.

        Keywords and errors as :meth:`load`, all raised before the first layer is queued.
        """
        _check_device_pool("load_layers", device_pool)
        return load_layers(
            self._table_for_pool(device_pool), device_pool.table, host_indices, device_indices,
            src_layout=self.layout, dst_layout=device_pool.layout, stream=stream, max_ctas=max_ctas,
            backend=backend, validate_indices=validate_indices,
        )

    def _table_for_pool(self, device_pool: DevicePool) -> PointerTable[DeviceAlias]:
        # one host pool serves device pools on several devices, each through its own table
        # a Device for a kernel table (its type); None only for a host table cast to one
        device: Device | None = device_pool.table.device  # (no typing.cast call on the launch path)
        if device is None or device is self.device or device == self.device:
            return self.kernel_table  # a bad table is reported by the launch's own checks
        return self.kernel_table_for(device)

    def host_va(self, page: int, layer: int, kv: int, *, token: int = 0) -> HostVA:
        """The host VA of the item of ``(kv, layer)`` of token ``token`` of ``page``: the
        buffer's address plus :meth:`KVLayout.byte_offset` (for ``page_head`` and
        ``page_unified`` with head groups, the first part of the item: head 0, group 0;
        :meth:`KVLayout.item_spans` has the others). For CPU code and transfer engines,
        never for a kernel (that needs the kernel table's device alias).

        Raises:
            InvalidTypeError: an argument is not an int (a bool included).
            IndexValidationError: an argument out of its range (see :meth:`KVLayout.byte_offset`).
            ClosedError: the pool was closed, or its buffer's storage was released or
                swapped since the pool was built (``share_memory_()``, ``set_()``).
        """
        offset = self.layout.byte_offset(page, layer, kv, token=token)
        # the address goes to engines as metadata does: refused once the buffer's storage moved
        return metadata_table(self.host_table)[0] + offset

    @property
    def generation(self) -> int:
        """Changes (grows) when the pool closes: an engine records it with a graph that
        captured the pool's launches and compares before a replay
        (:mod:`pointerdomain.transfer.graphs`)."""
        return self.memory.leases.generation

    def get_contiguous_buf_infos(self) -> list[BufferInfo]:
        """The pool buffer as host-VA metadata (for a transfer engine's ``register_memory``)."""
        return buffer_infos(self.host_table, self.layout.item_bytes)

    def get_page_buffer_meta(self, pages: list[int]) -> list[BufferInfo]:
        """Host-VA blocks holding ``pages``, in order (for a transfer engine's reads/writes).

        Raises:
            InvalidTypeError: ``pages`` is not a sequence of page numbers.
            IndexValidationError: a page that is not an int in ``[0, num_pages)``.
            ClosedError: the pool was closed, or its buffer's storage was released or swapped.
        """
        return page_buffer_meta(self.host_table, self.layout, pages)

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once, at :meth:`close`, before the memory is unregistered (last
        added runs first). For registrations that must end with the pool, e.g. a transfer
        engine's (``pointerdomain.adapters.nixl``).

        Raises:
            InvalidTypeError: ``hook`` is not callable.
            ClosedError: the pool is closed (the hook would never run).
        """
        if not callable(hook):
            raise InvalidTypeError(
                f"hook: found a {type(hook).__name__} ({describe(hook, 60)}), expected a callable taking no arguments. "
                "Fix: pass the function itself (e.g. registration.close), not its result"
            )
        with self._tables_lock:
            self.memory.check_open()
            if self.memory.leases.closing:
                raise ClosedError(f"host KV pool at {self.memory.host_va!r} is closing: a hook added now would never run")
            self._close_hooks.append(hook)

    def close(self, *, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Wait for launches using the pool (up to ``timeout`` s, see
        :meth:`RegisteredHostMemory.close`), run the close hooks, then unregister the
        pool's memory; launches with its tables raise ClosedError after this.

        Raises:
            BusyError: a launch still used the pool after ``timeout``; nothing was closed
                and no hook ran.
            QuarantinedError: a close hook (an engine's deregistration) raised: after every
                hook ran the pool is closed but its memory is quarantined, not unregistered
                (the first exception is the cause, the others notes; registration.teardown).
                A hook interrupted by a ``BaseException`` (``KeyboardInterrupt``) stops the
                close there: the memory is quarantined and that exception propagates. A
                hook that closes the pool itself returns at once: the close running the
                hooks unregisters, after the last one.
            InvalidTypeError: ``timeout`` is not an int or float; InvalidArgumentError:
                negative or NaN (both before anything is closed).
        """
        with self._close_lock:
            if self._closing:
                return  # a hook closing the pool (or its memory): the close running it unregisters, last
            self._closing = True
            try:
                self._close_locked(timeout)
            finally:
                self._closing = False

    def _close_locked(self, timeout: float) -> None:
        if self.memory.closed:
            return
        self.memory.leases.drain(f"host KV pool {self.layout.kind} at {self.memory.host_va!r}", timeout)
        with self._tables_lock:
            hooks, self._close_hooks = self._close_hooks, []
        failures: list[Exception] = []
        for k, hook in enumerate(reversed(hooks)):  # every hook runs once, whatever the others do
            try:
                hook()
            except Exception as exc:  # re-raised below, once the pool is closed
                failures.append(exc)
            except BaseException as exc:
                # interrupted (KeyboardInterrupt, SystemExit): the hooks after this one did not
                # run, so an engine may still reach the memory: quarantined, never unregistered
                self.memory.quarantine("engine", f"close hook {k + 1} of {len(hooks)} was interrupted "
                                       f"({type(exc).__name__}); {len(hooks) - k - 1} later hook(s) did not run")
                raise
        if not failures:
            self.memory._close_now(timeout)  # noqa: SLF001 -- engines first, then the runtime (registration.teardown)
            return
        # an engine may still reach the memory: it stays registered and mapped (quarantined)
        first = failures[0]
        reason = f"{type(first).__name__}: {first}"
        record = self.memory.quarantine("engine", reason)
        error = QuarantinedError(
            f"closing the host KV pool at {self.memory.host_va!r}: a close hook (an engine's deregistration) "
            f"failed ({reason}), so its memory ({record.owner}) is quarantined: the pool is closed but the memory "
            "stays registered and mapped for the life of the process and is never registered again. Fix: find why "
            "the engine kept the memory (`pointerdomain doctor` lists quarantined ranges)",
            record.owner, "engine",
        )
        error.add_note(f"every hook ran ({len(hooks)}, {len(failures)} raised) and the pool is closed (quarantined)")
        for other in failures[1:]:
            error.add_note(f"another close hook raised too: {type(other).__name__}: {other}")
        raise error from first

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
