"""Memory a captured graph uses stays as it was while the graph exists.

A launch captured into a graph (``torch.cuda.graph``, or the emulated device's stand-in
:class:`~pointerdomain.testing.EmulatedGraph`) is baked in with raw addresses: the kernel
tables, the table entries' buffers (pool memory, registered host memory), the plan, the
index tensors' storages. Every replay reads and writes them again. The rules:

* the launch path asks the backend for the graph being captured
  (:class:`~pointerdomain._platform.graph_holds.GraphHolder`) and, when there is one,
  keeps the launch's tables, plan and index tensors alive for as long as the graph
  exists, with the storages the index tensors had at capture (a ``set_`` that moves an
  index tensor to other storage leaves the captured one allocated, so a CUDA replay
  never reads freed or reused memory), and adds the graph to the lease set of every
  registration the tables point into (a backend that sees every capture open and close,
  the emulated one, counts them: while none is open anywhere, the launch asks nothing);
* ``close()`` of such a registration, or of a :class:`~pointerdomain.HostKVPool` over
  it, raises :class:`~pointerdomain.errors.BusyError` naming the graph (device, capture
  id or name, where it was captured) until the graph is destroyed, and nothing closes;
  tables are immutable and device pools have no ``close()``; a cache that replaces a
  table (:class:`pointerdomain.adapters.lmcache.LayerPointerCache`) refuses to while a
  graph captured it (:func:`refuse_while_held`);
* :attr:`PointerTable.generation <pointerdomain.PointerTable.generation>` and
  :attr:`HostKVPool.generation <pointerdomain.HostKVPool.generation>` change when memory
  under them closes: an engine that keeps graphs records them at capture
  (:func:`generations`) and compares before a replay (:func:`still_valid`);
* the emulated stand-in checks before each replay that every registration it captured is
  open, every table's storage intact, and every index tensor it captured still on the
  storage it had at capture (same address and size: not resized, released or swapped
  with ``set_``), else raises :class:`~pointerdomain.errors.GraphInvalidatedError` and
  runs nothing; a reset graph refuses to replay. (A CUDA graph replays through torch,
  which the library does not see: the refusal to close is what keeps its memory valid.)

Not held, and why: staging buffers (the staged path reads indices on the host and is never
captured); the error word (kept for the life of the process). A tensor's storage resized
or swapped under a graph (``resize_``, ``set_``) is torch's operation, which the library
does not see and cannot refuse: the stand-in refuses the next replay; a CUDA graph replays
with the captured addresses: after a ``set_`` of an index tensor it reads the old storage
(kept allocated, so valid memory, but no longer the tensor the caller writes), after a
``resize_`` of a storage it reads or writes freed memory. Under a CUDA graph, change index
values in place (``copy_``), never their storage. Where a launch computes part indices
(a layout that splits its items) the captured kernel reads those computed tensors, which
are what is held and checked; the caller's tensors are read by the captured torch ops.

Where the graph's end is seen: CUDA through a user object the graph retains (its
destructor runs once the graph and its executable instances are destroyed, shortly after
the caller drops them); the stand-in at :meth:`EmulatedGraph.reset`. HIP graphs are not
tracked.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from pointerdomain._platform import backend_for
from pointerdomain._platform.graph_holds import HeldGraph
from pointerdomain.errors import BusyError

if TYPE_CHECKING:
    from pointerdomain.devices import Device
    from pointerdomain.domains import DeviceAlias
    from pointerdomain.registration.tables import PointerTable
    from pointerdomain.transfer.plan import TransferPlan

__all__ = ["CapturedIndex", "Versioned", "generations", "graphs_holding", "held_graphs", "note_launch", "recompute_before_last",
           "refuse_while_held", "still_valid"]

_lock = threading.Lock()
#: the holds of graphs that captured launches (each keeps what its launches use)
_holds: weakref.WeakSet[HeldGraph] = weakref.WeakSet()


def note_launch(
    platform: object, plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias],
    device: Device, stream: int, indices: tuple[object, ...] = (),
    lowered: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> HeldGraph | None:
    """Called by the launch path after a launch that recorded no event: when ``stream`` is
    being captured into a graph, tie the launch's memory to the graph (module docstring).
    ``indices``: the index tensors the launch was given by address (``src_indices``,
    ``dst_indices``), kept with the graph too, each with the storage it has now (a CUDA
    graph's memory pool keeps only those it allocated; the stand-in has no pool).
    ``lowered``: where the plan splits items (``plan.lowering``), the parts' indices the
    launch read, computed from ``indices`` by :meth:`TransferPlan.expand`. A CUDA graph
    captures expand's torch ops with the launch, so a replay computes the parts again from
    the caller's indices as they are then; the emulated stand-in is told to do the same
    before the launch at each replay (else a replay would write where the indices pointed
    at capture).
    Returns the graph's hold, or None (not capturing, or a backend that cannot tell)."""
    hold = getattr(platform, "graph_hold", None)  # GraphHolder (optional); no Protocol check per launch
    if hold is None:
        return None
    held: HeldGraph | None = hold(device, stream)
    if held is None:
        return None
    for owner in plan.owners:
        owner.leases.hold_graph(held)
    names = ("src_indices", "dst_indices") if len(indices) == 2 else [f"index tensor {i}" for i in range(len(indices))]
    captured = tuple(CapturedIndex(name, t) for name, t in zip(names, indices) if isinstance(t, torch.Tensor))
    with _lock:
        _holds.add(held)
        held.keep.extend(o for o in (plan, src, dst) if all(k is not o for k in held.keep))
        held.keep.extend(captured)  # the storages too: a set_ under the graph leaves the captured one allocated
        if lowered is not None:
            held.keep.extend(lowered)
    add_check = getattr(held.key, "add_check", None)  # the emulated stand-in checks before replays
    if add_check is not None:
        add_check(lambda: _why_invalid(plan, src, dst, captured))
    if lowered is not None:
        before_last = getattr(held.key, "before_last_launch", None)  # the stand-in's replays
        if before_last is not None and len(indices) == 2:
            given = (indices[0], indices[1])
            before_last(lambda: _lower_again(plan, given, lowered))
    return held


def recompute_before_last(device: Device, derived: tuple[torch.Tensor, ...],
                          derive: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    """After a launch that read index tensors ``derived``, computed by ``derive`` (torch ops
    on the caller's indices: a row as several slots, page runs): where ``device``'s current
    stream is being captured into a graph that replays host-side steps (the emulated
    stand-in), ``derive`` runs again before that launch at each replay and its result is
    copied into ``derived``. A CUDA graph captures ``derive``'s torch ops with the launch
    itself, so its replay follows the caller's indices as they are then; so does the
    stand-in's. A no-op when nothing is being captured."""
    platform = backend_for(device)
    hold = getattr(platform, "graph_hold", None)
    if hold is None:
        return
    held = hold(device, platform.current_stream(device))
    if held is None:
        return
    before_last = getattr(held.key, "before_last_launch", None)
    if before_last is None:
        return
    with _lock:
        held.keep.extend(derived)

    def again() -> None:
        for into, fresh in zip(derived, derive()):
            if into is not fresh:
                into.copy_(fresh)

    before_last(again)


def _lower_again(plan: TransferPlan, given: tuple[object, object], lowered: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The parts' indices of a captured launch, recomputed in place from the caller's
    indices (what a CUDA replay does by replaying expand's captured torch ops)."""
    s_idx, d_idx = given
    assert isinstance(s_idx, torch.Tensor) and isinstance(d_idx, torch.Tensor)
    s_parts, d_parts = plan.expand(s_idx, d_idx)
    lowered[0].copy_(s_parts)
    lowered[1].copy_(d_parts)


class CapturedIndex:
    """An index tensor a captured launch reads by address, with the storage it had at
    capture (kept alive) and that storage's address and size then.

    Attributes:
        name: ``src_indices`` or ``dst_indices``, for messages.
        tensor: the caller's tensor.
        storage: its storage at capture.
        ptr, nbytes, data_ptr: the storage's address and size in bytes, and the tensor's
            first element's address, at capture.
    """

    __slots__ = ("name", "tensor", "storage", "ptr", "nbytes", "data_ptr")

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name = name
        self.tensor = tensor
        self.storage = tensor.untyped_storage()
        self.ptr = int(self.storage.data_ptr())
        self.nbytes = int(self.storage.nbytes())
        self.data_ptr = int(tensor.data_ptr())

    def why_invalid(self) -> str | None:
        """Why a replay reading this index tensor by its captured address would be wrong, or None."""
        if int(self.storage.data_ptr()) != self.ptr or int(self.storage.nbytes()) != self.nbytes:
            return (f"the storage of {self.name} it captured was resized or released (captured {self.nbytes} bytes at "
                    f"{self.ptr:#x}, now {int(self.storage.nbytes())} bytes at {int(self.storage.data_ptr()):#x})")
        if int(self.tensor.untyped_storage().data_ptr()) != self.ptr or int(self.tensor.data_ptr()) != self.data_ptr:
            return (f"{self.name} was moved to other storage since capture (set_ or a resize that reallocated): the "
                    "graph still reads the captured storage, not the values the caller writes")
        return None


def _why_invalid(plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias],
                 indices: tuple[CapturedIndex, ...] = ()) -> str | None:
    for owner in plan.owners:
        if owner.closed:
            return f"registered memory at {owner.host_va!r} (+{owner.nbytes} bytes) it captured was closed"
    for name, table in (("src", src), ("dst", dst)):
        if not table.storages_intact():
            return f"the {name} table's storage was released or reallocated"
    for index in indices:
        why = index.why_invalid()
        if why is not None:
            return why
    return None


def held_graphs(obj: object) -> list[str]:
    """Names of the live graphs that captured a launch over ``obj`` (a registration, a
    host pool, or a kernel table)."""
    leases = getattr(getattr(obj, "memory", obj), "leases", None)
    if leases is not None:
        return [h.name for h in leases.graphs()]
    names: list[str] = []
    for owner in getattr(obj, "registrations", ()):
        names.extend(h.name for h in owner.leases.graphs() if h.name not in names)
    return names


def graphs_holding(obj: object) -> list[str]:
    """Names of the live graphs that captured a launch with ``obj`` (a kernel table or a
    plan) itself: what replays would read if ``obj`` were replaced."""
    with _lock:
        holds = list(_holds)
    return [held.name for held in holds if held.alive() and any(o is obj for o in held.keep)]


def refuse_while_held(obj: object, action: str) -> None:
    """Raise when a live graph captured a launch with ``obj`` (re-tabling it would leave
    the graph replaying the old table).

    Raises:
        BusyError: naming the graphs; the caller changes nothing.
    """
    names = graphs_holding(obj)
    if names:
        raise BusyError(
            f"cannot {action}: {len(names)} captured graph(s) replay with it: {'; '.join(names[:3])}; nothing was "
            "changed. Fix: destroy the graph first (del it, or reset() it), then rebuild and capture again"
        )


class Versioned(Protocol):
    """Something with a generation number (tables, pools)."""

    @property
    def generation(self) -> int: ...


def generations(*objs: Versioned) -> tuple[int, ...]:
    """The generation numbers of ``objs`` now: record them when capturing a graph."""
    return tuple(o.generation for o in objs)


def still_valid(recorded: tuple[int, ...], *objs: Versioned) -> bool:
    """True when ``objs`` have the generations :func:`generations` recorded (nothing under
    them closed since): the graph captured over them may be replayed."""
    return generations(*objs) == recorded
