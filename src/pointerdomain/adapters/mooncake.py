"""A typed wrapper around a transfer engine (Mooncake ``TransferEngine``) that takes host VAs only.

A transfer engine reads and writes host memory with the CPU or a NIC, by CPU
virtual address: ``register_memory(addr, len)``, ``transfer_sync_read(peer,
buffer, peer_buffer_address, length)``. A device alias handed to it reads the
wrong memory (or faults) wherever aliases differ from host VAs, and nothing in
the engine's ``int`` API notices. :class:`HostTransferEngine` keeps the
engine's method names but accepts only :class:`~pointerdomain.HostVA` and
:class:`~pointerdomain.BufferInfo` (whose address is a HostVA), checked at
runtime as well as by mypy: a :class:`~pointerdomain.DeviceAlias`, a pointer
table, a tensor or a bare ``int`` raises :class:`~pointerdomain.errors.DomainError`
before the engine is called.

Where the addresses come from: ``HostKVPool.get_contiguous_buf_infos()`` for
registration, ``HostKVPool.get_page_buffer_meta(pages)`` for page blocks (on
both sides: the peer sends its blocks as ``BufferInfo`` JSON, which validates
back into HostVA).

This module does not import Mooncake; :meth:`HostTransferEngine.create` does,
lazily (``pip install mooncake-transfer-engine``, or
``mooncake-transfer-engine-non-cuda`` on machines without CUDA; it needs the
``libibverbs1`` and ``libnuma1`` system libraries).
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, Protocol, overload, runtime_checkable

from typing_extensions import TypeAlias

from pointerdomain.arguments import describe
from pointerdomain import BufferInfo, DeviceAlias, HostVA, PointerTable, memory_device_at
from pointerdomain.domains import range_end
from pointerdomain.process_local import ProcessLocal
from pointerdomain.registration.engine_teardown import quarantine_engine_range
from pointerdomain.registration.metadata import EngineHold, check_engine_hold, check_metadata_live, engine_hold
from pointerdomain.transfer.pools import HostKVPool
from pointerdomain.errors import (
    QuarantinedError,
    DomainError,
    ExtensionUnavailableError,
    InvalidArgumentError,
    AlreadyRegisteredError,
    InvalidTypeError,
    NotRegisteredError,
    OverlapError,
    PointerDomainError,
    RuntimeCallError,
)

__all__ = [
    "BatchTransferEngineLike",
    "EngineUnavailableError",
    "HostRegion",
    "HostTransferEngine",
    "RpcPortEngineLike",
    "TransferEngineLike",
    "as_host_va",
]

#: What the wrapper accepts as a buffer: host-VA metadata, or a bare host VA (with ``nbytes``).
HostRegion: TypeAlias = "BufferInfo | HostVA"


@runtime_checkable
class TransferEngineLike(Protocol):
    """What the wrapper needs of an engine: the four calls every path makes, with the raw
    ``int`` addresses (host VAs) and ``int`` return codes (0 = success) of Mooncake's
    Python binding (``transfer_engine_py``). Positional-only, so a stand-in engine may
    name its parameters as it likes. Types :attr:`HostTransferEngine.engine`.

    The batch calls (:class:`BatchTransferEngineLike`) and ``get_rpc_port``
    (:class:`RpcPortEngineLike`) are optional: without them a batch is moved block by
    block, and :attr:`HostTransferEngine.session_id` raises."""

    def register_memory(self, addr: int, length: int, /) -> int: ...
    def unregister_memory(self, addr: int, /) -> int: ...
    def transfer_sync_read(self, target: str, buffer: int, peer_buffer_address: int, length: int, /) -> int: ...
    def transfer_sync_write(self, target: str, buffer: int, peer_buffer_address: int, length: int, /) -> int: ...


@runtime_checkable
class BatchTransferEngineLike(TransferEngineLike, Protocol):
    """An engine with Mooncake's batch calls: the wrapper's batch methods then make one
    engine call per batch."""

    def batch_transfer_sync_read(
        self, target: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], /
    ) -> int: ...
    def batch_transfer_sync_write(
        self, target: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], /
    ) -> int: ...


@runtime_checkable
class RpcPortEngineLike(Protocol):
    """An engine that reports its RPC port (Mooncake's P2P handshake): what
    :attr:`HostTransferEngine.session_id` reads."""

    def get_rpc_port(self) -> int: ...


class EngineUnavailableError(PointerDomainError, ImportError):
    """The transfer engine package is not installed or does not import."""


def _untyped(value: object) -> object:
    """``value`` as the checks see it: callers without types can pass anything."""
    return value


def as_host_va(value: HostRegion, name: str = "address") -> HostVA:
    """The host VA of a :class:`HostVA` or :class:`BufferInfo`; anything else raises
    (typed ``HostVA | BufferInfo``; untyped callers get the runtime check).

    Raises:
        DomainError: a :class:`DeviceAlias`, a ``PointerTable``, a tensor, a plain
            ``int`` (no domain) or any other object.
    """
    obj = _untyped(value)  # untyped callers can pass anything: checked here
    if type(obj) is HostVA:
        return obj
    if type(obj) is BufferInfo:
        return obj.address
    if isinstance(obj, DeviceAlias):
        raise DomainError(
            f"{name}: {describe(obj)} is a device alias; a transfer engine reads host memory by CPU address. "
            "Pass the HostVA (BufferInfo from get_contiguous_buf_infos() / get_page_buffer_meta(), or host_ptr_table)"
        )
    if isinstance(obj, PointerTable):
        raise DomainError(f"{name}: a {describe(obj)} is not an address; pass its entries' HostVA metadata (BufferInfo)")
    if isinstance(obj, int):
        raise DomainError(
            f"{name}: a plain int ({obj:#x}) has no domain; wrap a CPU address as HostVA.unsafe_from_int(...) "
            "explicitly, or pass BufferInfo metadata"
        )
    raise DomainError(f"{name}: expected a HostVA or BufferInfo, got {type(obj).__name__}")


def _device_memory_at(va: HostVA, nbytes: int) -> str | None:
    """Name of the emulated device whose memory holds the range, or None."""
    try:
        where = memory_device_at(va.value, nbytes)
    except ExtensionUnavailableError:
        return None
    return None if where is None else str(where)


def _check_disjoint(name: str, starts: list[int], lengths: list[int], where: str) -> None:
    """Refuse a batch whose destination blocks ``[starts[i], +lengths[i])`` share a byte."""
    order = sorted(range(len(starts)), key=starts.__getitem__)
    for prev, cur in zip(order, order[1:]):
        if starts[cur] < starts[prev] + lengths[prev]:
            a, b = sorted((prev, cur))
            raise OverlapError(
                f"{name}[{a}] and {name}[{b}]: destination blocks overlap in {where} ({lengths[a]} bytes at "
                f"{starts[a]:#x}, {lengths[b]} bytes at {starts[b]:#x}); the blocks of a batch move in no defined "
                "order, so the bytes would depend on it; nothing was moved. Fix: give each destination block once"
            )


class HostTransferEngine(ProcessLocal):
    """Mooncake's ``TransferEngine`` behind a HostVA-only interface.

    Args:
        engine: an initialised engine with Mooncake's ``register_memory``,
            ``unregister_memory``, ``transfer_sync_read`` and ``transfer_sync_write``
            (a :class:`TransferEngineLike`); its batch calls and ``get_rpc_port`` are
            used when it has them.
        local_hostname: the hostname it was initialised with (``"127.0.0.1"``).

    Local buffers must lie inside memory registered through this wrapper
    (Mooncake requires it); remote buffers are the peer's HostVAs, from its
    metadata. Return codes other than 0 raise :class:`RuntimeCallError`.
    Registrations may not overlap (Mooncake's engine refuses an overlapping one with
    ``ERR_ADDRESS_OVERLAPPED``): a range meeting one registered through this wrapper raises
    :class:`AlreadyRegisteredError` before the engine is called, so each registration is
    known by its start address and :meth:`unregister_memory` only ever hands the engine
    a start it registered.
    Use as a context manager, or call :meth:`close` to unregister everything.
    Process-local: ``pickle`` and ``copy`` raise :class:`NotPicklableError` (a copy would
    be a second owner of the same registrations).
    """

    def __init__(self, engine: TransferEngineLike, local_hostname: str) -> None:
        self.engine: TransferEngineLike = engine
        self.local_hostname = local_hostname
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}
        # per registered start: the registration of this process that held the range then
        # (registration.metadata.engine_hold), so a transfer into newer memory there is refused
        self._holds: dict[int, EngineHold | None] = {}
        # ranges whose engine registration is under way: held against overlapping requests
        self._pending: dict[int, int] = {}

    @classmethod
    def create(
        cls,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
    ) -> HostTransferEngine:
        """Make and initialise a ``mooncake.engine.TransferEngine``.

        Args:
            local_hostname: this node's address (optionally ``host:port``).
            metadata_server: ``"P2PHANDSHAKE"`` (no metadata service), or an
                etcd / HTTP metadata URL.
            protocol: ``"tcp"`` or ``"rdma"``.
            device_name: RDMA devices for ``"rdma"`` (``""`` for TCP).

        Raises:
            EngineUnavailableError: Mooncake is not installed or fails to import.
            RuntimeCallError: ``initialize`` returned an error.
        """
        try:
            # imported by name: Mooncake ships no type information (and may be absent)
            transfer_engine: Any = importlib.import_module("mooncake.engine").TransferEngine
        except Exception as exc:  # a missing libibverbs / libnuma raises ImportError or OSError
            raise EngineUnavailableError(
                f"mooncake.engine does not import ({exc}); `pip install mooncake-transfer-engine` (CUDA) or "
                "`mooncake-transfer-engine-non-cuda`, and `apt-get install libibverbs1 libnuma1`"
            ) from exc
        engine: Any = transfer_engine()
        rc = int(engine.initialize(local_hostname, metadata_server, protocol, device_name))
        if rc != 0:
            raise RuntimeCallError("TransferEngine.initialize", rc, f"{local_hostname} / {metadata_server} / {protocol}")
        return cls(engine, local_hostname)

    @property
    def session_id(self) -> str:
        """What a peer passes as ``target_hostname``: ``host:rpc_port`` (P2P handshake).

        Raises:
            InvalidTypeError: the engine has no ``get_rpc_port`` (a ``TypeError``).
        """
        engine = self.engine
        if not isinstance(engine, RpcPortEngineLike):
            raise InvalidTypeError(
                f"session_id: found an engine ({type(engine).__name__}) without get_rpc_port, expected one with it "
                "(Mooncake's TransferEngine). Fix: give the peer this node's address yourself"
            )
        host = self.local_hostname.rsplit(":", 1)[0] if self.local_hostname.count(":") == 1 else self.local_hostname
        return f"{host}:{int(engine.get_rpc_port())}"

    @staticmethod
    def _span(region: HostRegion, nbytes: int | None, name: str) -> tuple[HostVA, int]:
        va = as_host_va(region, name)  # untyped callers: checked at run time
        if nbytes is None:
            if type(region) is not BufferInfo:
                raise InvalidArgumentError(
                    f"{name}: found a bare HostVA with nbytes=None, expected nbytes (a positive int) with a HostVA. "
                    "Fix: pass nbytes=..., or pass the BufferInfo (it carries its size)"
                )
            nbytes = region.nbytes
        if type(nbytes) is not int or nbytes <= 0:
            raise InvalidArgumentError(
                f"{name}: nbytes found {describe(nbytes)}, expected a positive int (bytes). Fix: pass the block's size in bytes"
            )
        if va.value == 0:  # the engine would read or write page zero
            raise InvalidArgumentError(
                f"{name}: found HostVA(0x0), the null address, expected the address of allocated host memory. "
                "Fix: pass the buffer's own address (BufferInfo from live memory)"
            )
        range_end(va, nbytes, name)  # a range past 2**64 would wrap in the engine's 64-bit arithmetic
        return va, nbytes

    @staticmethod
    def _peer(peer: str) -> str:
        """``peer`` as checked: a non-empty ``str`` (the engine takes a session id string)."""
        obj = _untyped(peer)  # untyped callers can pass anything
        if type(obj) is not str:
            raise InvalidTypeError(
                f"peer: found {describe(obj)}, expected a str, the peer's session id (host:rpc_port). "
                "Fix: pass the peer's HostTransferEngine.session_id"
            )
        if not obj or obj.strip() != obj:
            raise InvalidArgumentError(
                f"peer: found {obj!r}, expected a non-empty session id (host:rpc_port) without surrounding "
                "whitespace. Fix: pass the peer's HostTransferEngine.session_id"
            )
        return obj

    def _check_registered(self, va: HostVA, nbytes: int, name: str) -> None:
        with self._lock:
            start = next((s for s, n in self._registered.items() if s <= va.value and va.value + nbytes <= s + n), None)
            hold = None if start is None else self._holds.get(start)
        if start is None:
            raise NotRegisteredError(
                f"{name}: [{describe(va)}, +{nbytes}) is not inside memory registered with this engine; "
                "register_memory() the pool first (get_contiguous_buf_infos())"
            )
        check_engine_hold(hold, va, nbytes, name)  # the memory registered then, not a newer one at its addresses

    @staticmethod
    def _check(call: str, rc: int) -> None:
        code = int(rc)  # an untyped engine may return another int-like
        if code != 0:
            raise RuntimeCallError(f"TransferEngine.{call}", code, "the transfer engine reported a failure")

    @overload
    def register_memory(self, region: BufferInfo, nbytes: int | None = None) -> None: ...
    @overload
    def register_memory(self, region: HostVA, nbytes: int) -> None: ...
    def register_memory(self, region: HostRegion, nbytes: int | None = None) -> None:
        """Register ``[region, region + nbytes)`` (default: a BufferInfo's ``nbytes``;
        a bare HostVA needs ``nbytes``, also statically: see the overloads).

        Raises:
            DomainError: not a HostVA / BufferInfo, or the range is device memory.
            InvalidArgumentError: ``nbytes`` missing or not positive, the null HostVA (0), or
                the range runs past ``2**64`` (a ``ValueError``).
            ClosedError: the memory was closed or released since its metadata was taken.
            AlreadyRegisteredError: the range overlaps one registered through this wrapper
                (the engine is not called).
            RuntimeCallError: the engine refused.
        """
        va, n = self._span(region, nbytes, "region")
        # device memory first: its addresses may reuse released host memory whose metadata
        # was handed out, which the liveness check would name instead
        where = _device_memory_at(va, n)
        if where is not None:
            raise DomainError(f"region: {describe(va)} lies in device memory of {where}; only host memory can be registered here")
        check_metadata_live(va, n, "region")
        with self._lock:
            for start, held in (*self._registered.items(), *self._pending.items()):
                if start < va.value + n and va.value < start + held:
                    raise AlreadyRegisteredError(
                        f"region: [{describe(va)}, +{n}) overlaps [{describe(HostVA.unsafe_from_int(start))}, +{held}), "
                        "already registered with this engine (the engine refuses overlapping registrations). "
                        "Fix: register each range once; memory inside a registered range needs no registration"
                    )
            self._pending[va.value] = n
        hold = engine_hold(va, n)
        try:
            self._check("register_memory", self.engine.register_memory(va.value, n))
        except BaseException:
            with self._lock:
                self._pending.pop(va.value, None)
            raise
        with self._lock:
            self._pending.pop(va.value, None)
            self._registered[va.value] = n
            self._holds[va.value] = hold

    def batch_register_memory(self, regions: Sequence[BufferInfo]) -> None:
        """Register each region (e.g. ``HostKVPool.get_contiguous_buf_infos()``).

        Raises:
            As :meth:`register_memory`; regions registered before a failure stay registered.
        """
        for i, region in enumerate(regions):
            if type(region) is not BufferInfo:
                as_host_va(region, f"regions[{i}]")  # raises for anything but a HostVA
                raise DomainError(f"regions[{i}]: a batch takes BufferInfo, got {type(region).__name__}")
        for region in regions:
            self.register_memory(region)

    def unregister_memory(self, region: HostRegion) -> None:
        """Unregister the registration starting at ``region`` (a HostVA, as cudaHostUnregister takes;
        a BufferInfo must also have the registration's size).

        Raises:
            DomainError: not a HostVA / BufferInfo.
            NotRegisteredError: nothing registered there through this wrapper, or a BufferInfo
                of another size (a block inside the registration); the engine is not called.
            RuntimeCallError: the engine refused.
        """
        va = as_host_va(region, "region")
        with self._lock:
            held = self._registered.get(va.value)
            if held is None:
                raise NotRegisteredError(f"region: no registration starts at {describe(va)}")
            if type(region) is BufferInfo and region.nbytes != held:
                # metadata of a block inside the registration, not of the registration itself
                raise NotRegisteredError(
                    f"region: found a {region.nbytes}-byte BufferInfo at {describe(va)}, but the registration "
                    f"starting there is {held} bytes; nothing was unregistered. Fix: pass the registered range's own "
                    "metadata (get_contiguous_buf_infos()) or its start HostVA"
                )
            # out of the records first (a second unregister finds nothing to hand the engine), but
            # held against overlapping registrations until the engine has let it go
            del self._registered[va.value]
            self._pending[va.value] = held
        try:
            self._check("unregister_memory", self.engine.unregister_memory(va.value))
        except BaseException:
            with self._lock:
                self._registered[va.value] = held  # still registered with the engine
            raise
        else:
            with self._lock:
                if va.value not in self._registered:
                    self._holds.pop(va.value, None)
        finally:
            with self._lock:
                self._pending.pop(va.value, None)

    def _one(
        self, call: Literal["transfer_sync_read", "transfer_sync_write"], peer: str, local: HostRegion,
        remote: HostRegion, nbytes: int | None,
    ) -> None:
        peer = self._peer(peer)
        l_va, l_n = self._span(local, nbytes, "local")
        # a remote BufferInfo carries its own size: compare it, never lend it the local one
        r_size = nbytes if nbytes is not None or type(remote) is BufferInfo else l_n
        r_va, r_n = self._span(remote, r_size, "remote")
        if type(remote) is BufferInfo and (r_n != l_n or r_n > remote.nbytes):
            raise InvalidArgumentError(
                f"remote: found a {remote.nbytes}-byte block for a {l_n}-byte local block, expected equal sizes. "
                "Fix: pair blocks of the same size (or pass nbytes)"
            )
        self._check_registered(l_va, l_n, "local")
        check_metadata_live(l_va, l_n, "local")
        fn = self.engine.transfer_sync_read if call == "transfer_sync_read" else self.engine.transfer_sync_write
        self._check(call, fn(peer, l_va.value, r_va.value, l_n))

    @overload
    def transfer_sync_read(self, peer: str, local: BufferInfo, remote: HostRegion, nbytes: int | None = None) -> None: ...
    @overload
    def transfer_sync_read(self, peer: str, local: HostVA, remote: HostRegion, nbytes: int) -> None: ...
    def transfer_sync_read(self, peer: str, local: HostRegion, remote: HostRegion, nbytes: int | None = None) -> None:
        """Copy ``nbytes`` from the peer's ``remote`` into ``local`` (blocking). A bare
        HostVA as ``local`` needs ``nbytes``, also statically (the overloads).

        Args:
            peer: the peer's session id (``host:rpc_port``).
            local: destination in this process (inside registered memory).
            remote: source, the peer's HostVA (from its metadata).
            nbytes: length; default the BufferInfo's ``nbytes`` (equal on both sides).

        Raises:
            DomainError: an address that is not a HostVA / BufferInfo.
            InvalidTypeError: ``peer`` not a str.
            InvalidArgumentError: sizes missing or different, a null HostVA (0), or an empty
                ``peer`` (a ``ValueError``).
            NotRegisteredError: ``local`` outside registered memory.
            ClosedError: ``local``'s memory was closed or released, or closed and replaced by
                newer memory registered at its addresses (the engine's registration still
                pins the old pages: unregister a range before closing its memory).
            RuntimeCallError: the engine reported a failure.
        """
        self._one("transfer_sync_read", peer, local, remote, nbytes)

    @overload
    def transfer_sync_write(self, peer: str, local: BufferInfo, remote: HostRegion, nbytes: int | None = None) -> None: ...
    @overload
    def transfer_sync_write(self, peer: str, local: HostVA, remote: HostRegion, nbytes: int) -> None: ...
    def transfer_sync_write(self, peer: str, local: HostRegion, remote: HostRegion, nbytes: int | None = None) -> None:
        """Copy ``nbytes`` from ``local`` to the peer's ``remote`` (blocking). As :meth:`transfer_sync_read`."""
        self._one("transfer_sync_write", peer, local, remote, nbytes)

    def _batch(
        self, call: Literal["batch_transfer_sync_read", "batch_transfer_sync_write"], peer: str,
        local: Sequence[BufferInfo], remote: Sequence[BufferInfo],
    ) -> int:
        peer = self._peer(peer)
        if len(local) != len(remote):
            raise InvalidArgumentError(
                f"remote: found {len(remote)} remote blocks for {len(local)} local blocks, expected one remote "
                "block per local block. Fix: pass lists of equal length"
            )
        l_vals: list[int] = []
        r_vals: list[int] = []
        lengths: list[int] = []
        for i, (lb, rb) in enumerate(zip(local, remote)):
            l_va, l_n = self._span(lb, None, f"local[{i}]")
            r_va, r_n = self._span(rb, None, f"remote[{i}]")
            if l_n != r_n:
                raise InvalidArgumentError(
                    f"remote[{i}]: found {r_n} bytes for local[{i}] of {l_n} bytes, expected equal sizes. "
                    "Fix: pair blocks of the same size"
                )
            self._check_registered(l_va, l_n, f"local[{i}]")
            check_metadata_live(l_va, l_n, f"local[{i}]")
            l_vals.append(l_va.value)
            r_vals.append(r_va.value)
            lengths.append(l_n)
        # the blocks of a batch move in no defined order (Mooncake runs them in parallel):
        # two writes into one byte would leave either
        if call == "batch_transfer_sync_read":
            _check_disjoint("local", l_vals, lengths, "local memory")
        else:
            _check_disjoint("remote", r_vals, lengths, "the peer's memory")
        engine = self.engine
        if lengths and isinstance(engine, BatchTransferEngineLike):
            fn = (engine.batch_transfer_sync_read if call == "batch_transfer_sync_read"
                  else engine.batch_transfer_sync_write)
            self._check(call, fn(peer, l_vals, r_vals, lengths))
        elif lengths:  # an engine without batch calls: the same blocks, one call each, in order
            one = "transfer_sync_read" if call == "batch_transfer_sync_read" else "transfer_sync_write"
            fn1 = engine.transfer_sync_read if one == "transfer_sync_read" else engine.transfer_sync_write
            for l_val, r_val, n in zip(l_vals, r_vals, lengths):
                self._check(one, fn1(peer, l_val, r_val, n))
        return sum(lengths)

    def batch_transfer_sync_read(self, peer: str, local: Sequence[BufferInfo], remote: Sequence[BufferInfo]) -> int:
        """Read block ``remote[i]`` of the peer into ``local[i]`` for every ``i``, in one batch (blocking):
        one engine call, or one ``transfer_sync_read`` per block when the engine has no batch calls.

        Returns:
            Bytes moved.

        Raises:
            DomainError: a block that is not a BufferInfo (e.g. a DeviceAlias).
            InvalidTypeError: ``peer`` not a str.
            InvalidArgumentError: lists or block sizes that differ, or an empty ``peer`` (a ``ValueError``).
            OverlapError: two local blocks (the destinations) share a byte; nothing is moved.
            NotRegisteredError: a local block outside registered memory.
            ClosedError: a local block's memory was closed or released, or replaced by newer
                memory registered at its addresses (as :meth:`transfer_sync_read`).
            RuntimeCallError: the engine reported a failure.
        """
        return self._batch("batch_transfer_sync_read", peer, local, remote)

    def batch_transfer_sync_write(self, peer: str, local: Sequence[BufferInfo], remote: Sequence[BufferInfo]) -> int:
        """Write ``local[i]`` to the peer's ``remote[i]`` for every ``i``. As :meth:`batch_transfer_sync_read`,
        the destinations being the remote blocks: two of them sharing a byte raise :class:`OverlapError`."""
        return self._batch("batch_transfer_sync_write", peer, local, remote)

    def register_pool(self, pool: HostKVPool) -> None:
        """Register a host pool's buffers (``pool.get_contiguous_buf_infos()``); closing the
        pool unregisters them from the engine first, before the runtime's unregister
        (:mod:`pointerdomain.registration.teardown`); if the engine refuses then, the pool's
        memory is quarantined, never freed.

        Raises:
            DomainError: not a HostKVPool; ClosedError: the pool is closed.
            AlreadyRegisteredError: the pool's memory overlaps a registration of this wrapper.
            RuntimeCallError: the engine refused (regions registered before stay registered).
        """
        if not isinstance(pool, HostKVPool):
            raise DomainError(f"register_pool takes a HostKVPool, got {type(pool).__name__}")
        infos = pool.get_contiguous_buf_infos()
        self.batch_register_memory(infos)

        def deregister() -> None:  # holds this wrapper: it lets go of the pool's ranges, however referenced
            for info in infos:
                with self._lock:  # this pool's own range only, not one registered there since
                    held = self._registered.get(info.address.value) == info.nbytes
                if held:  # not already let go by close()
                    self.unregister_memory(info)

        def on_collect() -> None:  # the pool went without close(): nothing can raise here
            try:
                deregister()
            except PointerDomainError as exc:  # the engine kept it: never unregistered or freed
                for info in infos:
                    quarantine_engine_range(info.address, info.nbytes, str(exc))

        # a pool collected without close(): the engine lets go when the pool goes, before its
        # memory is unregistered (the memory may outlive the pool object)
        collected = weakref.finalize(pool, on_collect)
        collected.atexit = False  # at exit the engine itself is going

        def on_close() -> None:
            collected.detach()
            deregister()

        pool.add_close_hook(on_close)

    def close(self) -> None:
        """Unregister everything registered through this wrapper (idempotent).

        Raises:
            QuarantinedError: the engine refused to unregister a range: the registered memory
                holding it is quarantined (it may still be reached by the engine), after the
                other ranges were unregistered.
        """
        with self._lock:
            starts = dict(self._registered)
            self._registered.clear()
            self._holds.clear()
        failed: list[QuarantinedError] = []
        for start, n in starts.items():
            rc = int(self.engine.unregister_memory(start))
            if rc != 0:
                failed.append(quarantine_engine_range(HostVA.unsafe_from_int(start), n,
                                                      f"TransferEngine.unregister_memory returned {rc}"))
        if failed:
            raise failed[0]

    def __enter__(self) -> HostTransferEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
