"""NIXL (NVIDIA Inference Xfer Library) on typed descriptors: DRAM from HostVA metadata only.

NIXL moves memory described by ``(addr, len, dev_id)`` descriptors of one memory
type. What each field means depends on the type (NIXL ``nixl_agent.register_memory`` /
``get_xfer_descs``; ``nixlBind.DRAM_SEG`` / ``VRAM_SEG`` / ``FILE_SEG``):

======  ==========================================  =========================
type    ``addr``                                    ``dev_id``
======  ==========================================  =========================
DRAM    host VA (the NIC / the CPU reads by VA)     0
VRAM    device address of CUDA device memory        the GPU ordinal
FILE    byte offset in the file                     the file descriptor
======  ==========================================  =========================

A device alias of registered host memory is neither: in a DRAM descriptor it names
other memory wherever aliases differ from host VAs (MI355X, WSL2, the emulated
device), and it is not device memory either. So descriptors are built only here:

* :func:`dram_desc` from a :class:`~pointerdomain.BufferInfo` or a
  :class:`~pointerdomain.HostVA` (``HostKVPool.get_contiguous_buf_infos()``,
  ``get_page_buffer_meta(pages)``, or a peer's ``BufferInfo`` JSON). A
  :class:`~pointerdomain.DeviceAlias`, a pointer table, a tensor or a plain ``int``
  raises :class:`~pointerdomain.errors.DomainError` (mypy rejects them too);
* :func:`vram_desc` from a CUDA tensor of the named device only;
* :func:`file_desc` / :func:`file_region` from a file descriptor.

:class:`HostNixlAgent` wraps a ``nixl_agent``: registrations are tied to their owner
(``register_pool(pool)`` deregisters when the pool is closed, or collected), and a
transfer's local descriptors must lie inside a live registration of that agent
(:class:`~pointerdomain.errors.NotRegisteredError` / ``ClosedError`` otherwise), its
destinations may not share a byte (``OverlapError``) and a registration may not overlap
an open one (``AlreadyRegisteredError``), all before NIXL is called.

This module does not import NIXL; :class:`HostNixlAgent` does, lazily
(``pip install nixl-cu13==1.5.1`` then ``pip install --no-deps nixl==1.5.1`` with
torch installed first: docs/embedding.md). Measured on a CPU machine (field notes):
the UCX and POSIX back-ends load without a GPU.
"""

from __future__ import annotations

import importlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal, Protocol

import torch
from typing_extensions import final

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.arguments import check_span, describe
from pointerdomain.domains import range_end
from pointerdomain.process_local import ProcessLocal
from pointerdomain.registration.engine_teardown import quarantine_engine_range
from pointerdomain.registration.metadata import EngineHold, check_engine_hold, check_metadata_live, engine_hold

__all__ = [
    "HostNixlAgent",
    "MemType",
    "NixlAgentLike",
    "NixlDesc",
    "NixlRegistration",
    "NixlUnavailableError",
    "dram_desc",
    "file_desc",
    "file_region",
    "vram_desc",
]

#: NIXL memory types this adapter builds descriptors for.
MemType = Literal["DRAM", "VRAM", "FILE"]
Operation = Literal["READ", "WRITE"]

_TOKEN = object()


class NixlUnavailableError(errors.PointerDomainError, ImportError):
    """NIXL is not installed or does not import (``import nixl._api``)."""


class NixlAgentLike(Protocol):
    """The calls :class:`HostNixlAgent` makes on a ``nixl._api.nixl_agent`` (NIXL 1.5's
    Python API), and nothing more: what a stand-in agent must have. Positional-only, so
    an agent may name its parameters as it likes; handles and descriptor lists are
    NIXL's own objects (``Any``)."""

    def register_memory(
        self, reg_list: list[tuple[int, int, int, str]], mem_type: str, backends: list[str], /
    ) -> Any: ...
    def deregister_memory(self, handle: Any, /) -> Any: ...
    def get_agent_metadata(self) -> bytes: ...
    def add_remote_agent(self, metadata: bytes, /) -> Any: ...
    def remove_remote_agent(self, agent: str, /) -> Any: ...
    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str, /) -> Any: ...
    def initialize_xfer(
        self, operation: str, local_descs: Any, remote_descs: Any, remote_agent: str, notif_msg: bytes,
        backends: list[str], /,
    ) -> Any: ...
    def transfer(self, handle: Any, /) -> Any: ...
    def check_xfer_state(self, handle: Any, /) -> Any: ...
    def release_xfer_handle(self, handle: Any, /) -> Any: ...


@final
class NixlDesc:
    """One NIXL descriptor; build with :func:`dram_desc`, :func:`vram_desc`,
    :func:`file_desc` or :func:`file_region`.

    Attributes:
        mem_type: ``"DRAM"``, ``"VRAM"`` or ``"FILE"``.
        addr: DRAM: host VA; VRAM: device address; FILE: byte offset in the file.
        nbytes: length in bytes (> 0).
        dev_id: DRAM: 0; VRAM: the GPU ordinal; FILE: the file descriptor.
        meta: registration metadata (FILE: the path; otherwise empty).
    """

    __slots__ = ("mem_type", "addr", "nbytes", "dev_id", "meta")

    def __init__(self, token: object, mem_type: MemType, addr: int, nbytes: int, dev_id: int, meta: str = "") -> None:
        if token is not _TOKEN:
            raise errors.InvalidTypeError("build NIXL descriptors with dram_desc(), vram_desc(), file_desc() or file_region()")
        self.mem_type: MemType = mem_type
        self.addr = addr
        self.nbytes = nbytes
        self.dev_id = dev_id
        self.meta = meta

    def xfer_tuple(self) -> tuple[int, int, int]:
        """``(addr, nbytes, dev_id)``, what ``nixl_agent.get_xfer_descs`` takes."""
        return (self.addr, self.nbytes, self.dev_id)

    def reg_tuple(self) -> tuple[int, int, int, str]:
        """``(addr, nbytes, dev_id, meta)``, what ``nixl_agent.register_memory`` takes."""
        return (self.addr, self.nbytes, self.dev_id, self.meta)

    def overlaps(self, other: NixlDesc) -> bool:
        """Whether the two share a byte (same memory type and ``dev_id``)."""
        return (other.mem_type == self.mem_type and other.dev_id == self.dev_id
                and self.addr < other.addr + other.nbytes and other.addr < self.addr + self.nbytes)

    def contains(self, other: NixlDesc) -> bool:
        return (other.mem_type == self.mem_type and other.dev_id == self.dev_id
                and self.addr <= other.addr and other.addr + other.nbytes <= self.addr + self.nbytes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NixlDesc) and (self.mem_type, *self.reg_tuple()) == (other.mem_type, *other.reg_tuple())

    def __hash__(self) -> int:
        return hash((self.mem_type, *self.reg_tuple()))

    def __repr__(self) -> str:
        return f"NixlDesc({self.mem_type}, addr={self.addr:#x}, nbytes={self.nbytes}, dev_id={self.dev_id})"


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value <= 0:
        raise errors.InvalidArgumentError(f"{name} must be a positive int (bytes), got {describe(value)}")
    return value


def _check_local_dram(d: NixlDesc, name: str) -> None:
    """Refuse a DRAM descriptor of this process that is device memory, or metadata of
    closed / released memory (the Mooncake adapter's checks at registration)."""
    va = pd.HostVA.unsafe_from_int(d.addr)
    try:
        where = pd.memory_device_at(d.addr, d.nbytes)
    except errors.ExtensionUnavailableError:
        where = None
    # device memory first: it may reuse released host memory whose metadata was handed out
    if where is not None:
        raise errors.DomainError(
            f"{name}: {describe(va)} lies in device memory of {where}; a DRAM descriptor is host memory. "
            "Fix: pass host-VA metadata of a host pool, or vram_desc(tensor, device) for device memory"
        )
    check_metadata_live(va, d.nbytes, name)


def _check_disjoint(name: str, descs: tuple[NixlDesc, ...], where: str) -> None:
    """Refuse destination descriptors that share a byte: NIXL moves the descriptors of one
    request in no defined order, so the bytes left would depend on it."""
    order = sorted(range(len(descs)), key=lambda i: (descs[i].dev_id, descs[i].addr))
    for prev, cur in zip(order, order[1:]):
        if descs[prev].overlaps(descs[cur]):
            a, b = sorted((prev, cur))
            raise errors.OverlapError(
                f"{name}[{a}] and {name}[{b}]: destination blocks overlap in {where} ({describe(descs[a])}, "
                f"{describe(descs[b])}); NIXL moves the blocks of a transfer in no defined order, so the bytes "
                "would depend on it; nothing was moved. Fix: give each destination block once"
            )


def dram_desc(region: pd.BufferInfo | pd.HostVA, nbytes: int | None = None) -> NixlDesc:
    """A DRAM descriptor (``dev_id`` 0) from host-VA metadata.

    Args:
        region: a :class:`~pointerdomain.BufferInfo` (its address and ``nbytes``), or a
            :class:`~pointerdomain.HostVA` with ``nbytes``.
        nbytes: length in bytes; only with a bare HostVA (a BufferInfo carries its own).

    Raises:
        DomainError: a DeviceAlias (kernel address), a pointer table, a tensor, a plain
            int or anything else that is not host-VA metadata.
        InvalidArgumentError: ``nbytes`` missing, not positive, or given with a BufferInfo;
            a HostVA range that runs past ``2**64``; the null HostVA (0).

    A descriptor may describe a peer's memory (its BufferInfo, validated from JSON), whose
    addresses mean nothing in this process, so the memory behind it is not checked here:
    :meth:`HostNixlAgent.register` and the local side of :meth:`HostNixlAgent.transfer`
    refuse a DRAM descriptor in device memory (``DomainError``) or over closed or released
    memory (``ClosedError``) before NIXL is called.
    """
    value: object = region  # checked at run time too: callers may be untyped
    if type(value) is pd.BufferInfo:
        region = value
        if nbytes is not None:
            raise errors.InvalidArgumentError("a BufferInfo carries its nbytes; do not pass nbytes with it")
        return NixlDesc(_TOKEN, "DRAM", region.address.value, region.nbytes, 0)
    if type(value) is pd.HostVA:
        if nbytes is None:
            raise errors.InvalidArgumentError("nbytes: a bare HostVA needs nbytes")
        n = _positive("nbytes", nbytes)
        if value.value == 0:
            raise errors.InvalidArgumentError(
                "region: found HostVA(0x0), the null address, expected the address of allocated host memory. "
                "Fix: pass the buffer's own address (BufferInfo from live memory)"
            )
        range_end(value, n, "region")  # a range past 2**64 would wrap in NIXL's 64-bit descriptor
        return NixlDesc(_TOKEN, "DRAM", value.value, n, 0)
    if isinstance(value, pd.DeviceAlias):
        raise errors.DomainError(
            f"{describe(value)} is a device alias (what kernels read); a DRAM descriptor is read by the NIC or the CPU by "
            "host VA. Use the HostVA metadata: HostKVPool.get_contiguous_buf_infos() / get_page_buffer_meta(pages)"
        )
    if isinstance(value, pd.PointerTable):
        raise errors.DomainError(f"a {describe(value)} is not a descriptor; pass its HostVA metadata (BufferInfo)")
    if isinstance(value, torch.Tensor):
        raise errors.DomainError(
            "a tensor has no address domain here (pinned host memory, emulated device memory and CUDA memory all "
            "look alike to NIXL's tensor path): pass BufferInfo metadata for DRAM, or vram_desc(tensor, device)"
        )
    if isinstance(value, int):
        raise errors.DomainError(
            f"a plain int ({value:#x}) has no domain; wrap a CPU address as HostVA.unsafe_from_int(...) explicitly, "
            "or pass BufferInfo"
        )
    raise errors.DomainError(f"a DRAM descriptor is built from a BufferInfo or HostVA, got {type(value).__name__}")


def vram_desc(tensor: torch.Tensor, device: pd.Device | str | torch.device) -> NixlDesc:
    """A VRAM descriptor (``dev_id`` = the GPU ordinal) for CUDA device memory of ``device``.

    Args:
        tensor: a contiguous CUDA tensor on ``device`` (its whole storage range
            ``data_ptr()`` .. ``+ numel * element_size``).
        device: the CUDA device the memory belongs to.

    Raises:
        InvalidDeviceError: ``device`` is not a CUDA device (NIXL has no access to emulated
            device memory), or does not exist.
        DomainError: ``tensor`` is host memory (registered or not: that is DRAM, described
            from HostVA metadata) or not a tensor.
        DeviceMismatchError: memory of another GPU.
        NonContiguousError: a strided tensor.
    """
    dev = pd.as_device(device)
    if dev.runtime.host_memory:
        raise errors.InvalidDeviceError(
            f"VRAM descriptors are CUDA device memory; {dev} is not a CUDA device (NIXL cannot reach emulated memory)"
        )
    if not isinstance(tensor, torch.Tensor):
        raise errors.DomainError(f"vram_desc takes a CUDA tensor, got {type(tensor).__name__}")
    if not tensor.is_cuda:
        raise errors.DomainError(
            f"memory on {tensor.device} is host memory, not VRAM: describe it as DRAM from HostVA metadata "
            "(dram_desc(BufferInfo)), never by a device alias"
        )
    dev = pd.validate_device(dev)  # one that exists: a missing GPU is not a mismatch with the tensor
    if tensor.device.index != dev.ordinal:
        raise errors.DeviceMismatchError(f"memory of cuda:{tensor.device.index}, but the descriptor is for {dev}")
    if not tensor.is_contiguous():
        raise errors.NonContiguousError(f"tensor of shape {tuple(tensor.shape)} is strided; a descriptor is one range")
    return NixlDesc(_TOKEN, "VRAM", int(tensor.data_ptr()), _positive("nbytes", tensor.numel() * tensor.element_size()),
                    dev.ordinal)


def _fd(fd: object) -> int:
    if type(fd) is not int or fd < 0:
        raise errors.InvalidArgumentError(
            f"fd: found {describe(fd)}, expected a file descriptor (an int >= 0). Fix: pass os.open(...)'s result or file.fileno()"
        )
    return fd


def file_desc(fd: int, offset: int, nbytes: int) -> NixlDesc:
    """A FILE transfer descriptor: ``nbytes`` at byte ``offset`` of open file ``fd``
    (``dev_id`` = ``fd``).

    Raises:
        InvalidArgumentError: negative ``fd`` or ``offset``, non-positive ``nbytes``.
    """
    if type(offset) is not int or offset < 0:
        raise errors.InvalidArgumentError(f"offset must be an int >= 0, got {describe(offset)}")
    check_span("offset", offset, _positive("nbytes", nbytes))
    return NixlDesc(_TOKEN, "FILE", offset, nbytes, _fd(fd))


def file_region(fd: int, nbytes: int, path: str = "") -> NixlDesc:
    """The FILE registration descriptor of ``[0, nbytes)`` of open file ``fd``; ``path``
    is NIXL's metadata string for it."""
    return NixlDesc(_TOKEN, "FILE", 0, _positive("nbytes", nbytes), _fd(fd), str(path))


def _nixl_api() -> Any:
    try:
        return importlib.import_module("nixl._api")
    except Exception as exc:  # ImportError, or a back-end library that fails to load
        raise NixlUnavailableError(
            f"NIXL does not import ({type(exc).__name__}: {exc}). Install it after torch: "
            "`pip install nixl-cu13==1.5.1` then `pip install --no-deps nixl==1.5.1`"
        ) from exc


@final
class NixlRegistration(ProcessLocal):
    """Memory registered with one agent; deregistered once, by :meth:`close`, by the
    owner's close hook, or when the owner is collected.

    Attributes:
        descs: the registered descriptors (one memory type).
    """

    def __init__(self, token: object, agent: HostNixlAgent, descs: tuple[NixlDesc, ...], handle: Any) -> None:
        if token is not _TOKEN:
            raise errors.InvalidTypeError("register memory with HostNixlAgent.register() / register_pool()")
        self.descs = descs
        self._agent: weakref.ref[HostNixlAgent] = weakref.ref(agent)
        self._handle = handle
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # per DRAM descriptor: the registration of this process that held it when NIXL
        # registered it (registration.metadata.engine_hold); a transfer into newer memory
        # at its addresses is refused
        self._holds: tuple[EngineHold | None, ...] = tuple(
            engine_hold(pd.HostVA.unsafe_from_int(d.addr), d.nbytes) if d.mem_type == "DRAM" else None for d in descs)

    @property
    def mem_type(self) -> MemType:
        return self.descs[0].mem_type

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Deregister from NIXL (once; later calls do nothing).

        Raises:
            QuarantinedError: NIXL refused to deregister DRAM memory: the registered memory
                holding it is quarantined (NIXL may still reach it), never freed.
            RuntimeCallError: NIXL refused to deregister other memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        agent = self._agent()
        if agent is not None:
            agent._deregister(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"NixlRegistration({self.mem_type}, {len(self.descs)} region(s), {state})"


def _close_registration(ref: weakref.ref[NixlRegistration]) -> None:
    reg = ref()
    if reg is not None:
        reg.close()


class HostNixlAgent(ProcessLocal):
    """A NIXL agent that takes typed descriptors only.

    Args:
        name: the agent's name (unique among the peers).
        backends: NIXL back-ends to create (``"UCX"`` for network/loopback, ``"POSIX"``
            for files, ...).
        agent: an existing ``nixl._api.nixl_agent`` (or a stand-in with its calls, a
            :class:`NixlAgentLike`) to wrap instead (then ``backends`` is ignored).

    Process-local, as its registrations: ``pickle`` and ``copy`` raise
    :class:`~pointerdomain.errors.NotPicklableError`.

    Raises:
        NixlUnavailableError: NIXL does not import.
    """

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",), *, agent: NixlAgentLike | None = None) -> None:
        if agent is None:
            api = _nixl_api()
            agent = api.nixl_agent(name, api.nixl_agent_config(backends=list(backends)))
        self.name = name
        self.agent: NixlAgentLike = agent
        self._lock = threading.Lock()
        self._registrations: list[NixlRegistration] = []
        # descriptors being registered (NIXL not yet returned): a concurrent overlapping one is refused too
        self._pending: list[tuple[NixlDesc, ...]] = []
        self._remotes: list[str] = []

    # -- registration -------------------------------------------------------------
    def register(self, descs: Sequence[NixlDesc], *, owner: object = None, backends: Sequence[str] = ()) -> NixlRegistration:
        """Register ``descs`` (one memory type) with NIXL.

        Args:
            descs: from :func:`dram_desc` / :func:`vram_desc` / :func:`file_region`.
            owner: the object whose lifetime bounds the registration: when it is
                collected, or closed if it has ``add_close_hook`` (``HostKVPool``), the
                memory is deregistered first.
            backends: restrict to these back-ends (default: every one that supports the type).

        Raises:
            DomainError: something that is not a NixlDesc, or a DRAM descriptor in device memory.
            InvalidArgumentError: no descriptors, or mixed memory types.
            ClosedError: a DRAM descriptor's memory was closed or released since its
                metadata was taken (a closed pool included).
            AlreadyRegisteredError: a descriptor overlaps another of ``descs`` or an open
                registration of this agent (same type and ``dev_id``); NIXL is not called.
            RuntimeCallError: NIXL refused the registration.
        """
        checked = tuple(descs)
        if not checked:
            raise errors.InvalidArgumentError("register: no descriptors")
        for d in checked:
            if type(d) is not NixlDesc:
                raise errors.DomainError(
                    f"register takes NixlDesc (dram_desc / vram_desc / file_region), got {type(d).__name__}"
                )
        kinds = {d.mem_type for d in checked}
        if len(kinds) != 1:
            raise errors.InvalidArgumentError(f"register: one memory type per call, got {sorted(kinds)}")
        mem_type = checked[0].mem_type
        if mem_type == "DRAM":
            for i, d in enumerate(checked):
                _check_local_dram(d, f"descs[{i}]")
        for i, d in enumerate(checked):
            for j in range(i):
                if checked[j].overlaps(d):
                    raise errors.AlreadyRegisteredError(
                        f"descs[{j}] and descs[{i}] overlap ({describe(checked[j])}, {describe(d)}): one range "
                        "would be registered twice. Fix: register each range once"
                    )
        with self._lock:
            held = [r.descs for r in self._registrations] + self._pending
            for i, d in enumerate(checked):
                for other in (o for descs in held for o in descs):
                    if other.overlaps(d):
                        raise errors.AlreadyRegisteredError(
                            f"descs[{i}]: {describe(d)} overlaps {describe(other)}, already registered with agent "
                            f"{self.name!r}. Fix: register each range once; memory inside a registered range needs "
                            "no registration"
                        )
            self._pending.append(checked)
        try:
            handle = self._call("register_memory", [d.reg_tuple() for d in checked], mem_type, list(backends))
            reg = NixlRegistration(_TOKEN, self, checked, handle)
            with self._lock:
                self._registrations.append(reg)
        finally:
            with self._lock:
                self._pending.remove(checked)
        if owner is not None:
            reg._finalizer = weakref.finalize(owner, _close_registration, weakref.ref(reg))
            hook: Callable[[Callable[[], None]], None] | None = getattr(owner, "add_close_hook", None)
            if hook is not None:
                hook(reg.close)
        return reg

    def register_pool(self, pool: pd.HostKVPool, *, backends: Sequence[str] = ()) -> NixlRegistration:
        """Register a host pool as DRAM from its HostVA metadata
        (``pool.get_contiguous_buf_infos()``); closing the pool deregisters it first."""
        if not isinstance(pool, pd.HostKVPool):
            raise errors.DomainError(f"register_pool takes a HostKVPool, got {type(pool).__name__}")
        return self.register([dram_desc(b) for b in pool.get_contiguous_buf_infos()], owner=pool, backends=backends)

    def _deregister(self, reg: NixlRegistration) -> None:
        with self._lock:
            if reg in self._registrations:
                self._registrations.remove(reg)
        try:
            self._call("deregister_memory", reg._handle)
        except errors.RuntimeCallError as exc:
            if reg.mem_type != "DRAM":
                raise
            # NIXL may still reach the memory: it stays registered and mapped (registration.teardown)
            failed = [quarantine_engine_range(pd.HostVA.unsafe_from_int(d.addr), d.nbytes, str(exc))
                      for d in reg.descs]
            raise failed[0] from exc

    def registrations(self) -> list[NixlRegistration]:
        """The open registrations, in registration order."""
        with self._lock:
            return list(self._registrations)

    # -- peers ----------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata (send it to a peer's :meth:`add_remote`)."""
        return bytes(self._call("get_agent_metadata"))

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name for :meth:`transfer`."""
        name = self._call("add_remote_agent", metadata)
        peer = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            self._remotes.append(peer)
        return peer

    # -- transfers ------------------------------------------------------------------
    def _check_local(self, desc: NixlDesc, name: str = "local") -> None:
        for reg in self.registrations():
            for r, hold in zip(reg.descs, reg._holds):
                if r.contains(desc):
                    if desc.mem_type == "DRAM":  # the memory NIXL registered, not a newer one at its addresses
                        check_engine_hold(hold, pd.HostVA.unsafe_from_int(desc.addr), desc.nbytes, name)
                    return
        raise errors.NotRegisteredError(
            f"local {describe(desc)} is not inside memory registered with agent {self.name!r}: register the pool "
            "(register_pool) or the region first"
        )

    def transfer(
        self, op: Operation, local: Sequence[NixlDesc], remote: Sequence[NixlDesc], peer: str, *,
        timeout_s: float = 60.0, backends: Sequence[str] = (),
    ) -> None:
        """Move ``remote[i]`` -> ``local[i]`` (``"READ"``) or ``local[i]`` -> ``remote[i]``
        (``"WRITE"``) and wait until NIXL reports DONE.

        Args:
            op: ``"READ"`` or ``"WRITE"``.
            local: this agent's descriptors, one memory type, each inside one of its
                open registrations.
            remote: the peer's descriptors (a peer's page blocks: ``dram_desc`` of the
                BufferInfo it sent), one memory type, same sizes as ``local``. For a file
                on this agent's own POSIX back-end, ``peer`` is this agent's name.
            peer: the peer's agent name (:meth:`add_remote`), or ``self.name``.
            timeout_s: seconds to wait for completion.

        Raises:
            DomainError: an entry that is not a NixlDesc, or a local DRAM descriptor in device memory.
            InvalidArgumentError: unknown ``op``, lists of different lengths, mixed types.
            LayoutError: ``local[i]`` and ``remote[i]`` differ in size.
            OverlapError: two destination descriptors (``local`` on a READ, ``remote`` on a
                WRITE) share a byte; reading one source into several destinations is fine.
            NotRegisteredError: a local descriptor outside this agent's open registrations
                (a closed pool's registration is gone).
            ClosedError: a local DRAM descriptor's memory was released since its metadata was
                taken, or closed and replaced by newer memory registered at its addresses
                (NIXL's registration still pins the old pages).
            RuntimeCallError: NIXL refused the request, reported ERR, or timed out.
        """
        if op not in ("READ", "WRITE"):
            raise errors.InvalidArgumentError(f"op must be 'READ' or 'WRITE', got {describe(op)}")
        loc, rem = tuple(local), tuple(remote)
        for side, descs in (("local", loc), ("remote", rem)):
            for d in descs:
                if type(d) is not NixlDesc:
                    raise errors.DomainError(f"{side}: transfers take NixlDesc (dram_desc ...), got {type(d).__name__}")
            if len({d.mem_type for d in descs}) > 1:
                raise errors.InvalidArgumentError(f"{side}: one memory type per transfer")
        if not loc or len(loc) != len(rem):
            raise errors.InvalidArgumentError(f"local and remote need the same, non-zero length ({len(loc)} vs {len(rem)})")
        for i, (a, b) in enumerate(zip(loc, rem)):
            if a.nbytes != b.nbytes:
                raise errors.LayoutError(f"block {i}: local {a.nbytes} bytes, remote {b.nbytes} bytes")
        if op == "READ":
            _check_disjoint("local", loc, "local memory")
        else:
            _check_disjoint("remote", rem, "the peer's memory")
        for i, d in enumerate(loc):
            self._check_local(d, f"local[{i}]")
            if d.mem_type == "DRAM":
                _check_local_dram(d, f"local[{i}]")
        local_list = self._call("get_xfer_descs", [d.xfer_tuple() for d in loc], loc[0].mem_type)
        remote_list = self._call("get_xfer_descs", [d.xfer_tuple() for d in rem], rem[0].mem_type)
        handle = self._call("initialize_xfer", op, local_list, remote_list, peer, b"", list(backends))
        try:
            state = self._call("transfer", handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise errors.RuntimeCallError("nixl transfer", -1, f"not DONE after {timeout_s} s")
                time.sleep(0.0005)
                state = self._call("check_xfer_state", handle)
            if state != "DONE":
                raise errors.RuntimeCallError("nixl transfer", -1, f"state {state}")
        finally:
            self._call("release_xfer_handle", handle)

    def read(self, peer: str, local: Sequence[pd.BufferInfo], remote: Sequence[pd.BufferInfo], **kw: Any) -> None:
        """Pull a peer's host blocks into this agent's host blocks (DRAM <- DRAM), from
        BufferInfo metadata on both sides (``get_page_buffer_meta`` here and there)."""
        self.transfer("READ", [dram_desc(b) for b in local], [dram_desc(b) for b in remote], peer, **kw)

    def write(self, peer: str, local: Sequence[pd.BufferInfo], remote: Sequence[pd.BufferInfo], **kw: Any) -> None:
        """Push this agent's host blocks to a peer's host blocks (DRAM -> DRAM)."""
        self.transfer("WRITE", [dram_desc(b) for b in local], [dram_desc(b) for b in remote], peer, **kw)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.agent, method)(*args)
        except errors.PointerDomainError:
            raise
        except Exception as exc:  # nixl's binding errors (nixlNotFoundError, ...)
            raise errors.RuntimeCallError(f"nixl_agent.{method}", -1, f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Deregister everything still registered and forget the peers."""
        for reg in self.registrations():
            reg.close()
        with self._lock:
            remotes, self._remotes = self._remotes, []
        for peer in remotes:
            try:
                self.agent.remove_remote_agent(peer)
            except Exception:  # the peer may already be gone; nothing of ours is held
                pass

    def __enter__(self) -> HostNixlAgent:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
