"""Memory a captured graph uses stays as it was while the graph exists.

A launch captured into a graph (``torch.cuda.graph``, or the emulated device's stand-in
:class:`~pointerdomain.testing.EmulatedGraph`) is baked in with raw addresses: the kernel
tables, the table entries' buffers (pool memory, registered host memory), the plan. Every
replay reads and writes them again. The rules:

* the launch path asks the backend for the graph being captured
  (:class:`~pointerdomain._platform.graph_holds.GraphHolder`) and, when there is one,
  keeps the launch's tables and plan alive for as long as the graph exists and adds the
  graph to the lease set of every registration the tables point into;
* ``close()`` of such a registration, or of a :class:`~pointerdomain.HostKVPool` over
  it, raises :class:`~pointerdomain.errors.BusyError` naming the graph (device, capture
  id or name, where it was captured) until the graph is destroyed, and nothing closes;
  tables are immutable and device pools have no ``close()``, so nothing else a graph
  captured can change under it;
* :attr:`PointerTable.generation <pointerdomain.PointerTable.generation>` and
  :attr:`HostKVPool.generation <pointerdomain.HostKVPool.generation>` change when memory
  under them closes: an engine that keeps graphs records them at capture
  (:func:`generations`) and compares before a replay (:func:`still_valid`);
* the emulated stand-in checks before each replay that every registration it captured is
  open and every table's storage intact, else raises
  :class:`~pointerdomain.errors.GraphInvalidatedError`; a reset graph refuses to replay.
  (A CUDA graph replays through torch, which the library does not see: the refusal to
  close is what keeps its memory valid.)

Where the graph's end is seen: CUDA through a user object the graph retains (its
destructor runs once the graph and its executable instances are destroyed, shortly after
the caller drops them); the stand-in at :meth:`EmulatedGraph.reset`. HIP graphs are not
tracked.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

from pointerdomain._platform.graph_holds import HeldGraph

if TYPE_CHECKING:
    from pointerdomain.devices import Device
    from pointerdomain.domains import DeviceAlias
    from pointerdomain.registration.tables import PointerTable
    from pointerdomain.transfer.plan import TransferPlan

__all__ = ["Versioned", "generations", "held_graphs", "note_launch", "still_valid"]

_lock = threading.Lock()
#: id(hold) -> (hold, objects the captured launches use): kept while the graph is alive
_kept: dict[int, tuple[HeldGraph, list[object]]] = {}


def _prune() -> None:
    for key in [k for k, (held, _objs) in _kept.items() if not held.alive()]:
        del _kept[key]


def note_launch(
    platform: object, plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias],
    device: Device, stream: int,
) -> HeldGraph | None:
    """Called by the launch path after a launch that recorded no event: when ``stream`` is
    being captured into a graph, tie the launch's memory to the graph (module docstring).
    Returns the graph's hold, or None (not capturing, or a backend that cannot tell)."""
    hold = getattr(platform, "graph_hold", None)  # GraphHolder (optional); no Protocol check per launch
    if hold is None:
        return None
    held: HeldGraph | None = hold(device, stream)
    if held is None:
        return None
    for owner in plan.owners:
        owner.leases.hold_graph(held)
    with _lock:
        _prune()
        entry = _kept.setdefault(id(held), (held, []))
        if all(o is not plan for o in entry[1]):
            entry[1].extend((plan, src, dst))
    add_check = getattr(held.key, "add_check", None)  # the emulated stand-in checks before replays
    if add_check is not None:
        add_check(lambda: _why_invalid(plan, src, dst))
    return held


def _why_invalid(plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias]) -> str | None:
    for owner in plan.owners:
        if owner.closed:
            return f"registered memory at {owner.host_va!r} (+{owner.nbytes} bytes) it captured was closed"
    for name, table in (("src", src), ("dst", dst)):
        if not table.storages_intact():
            return f"the {name} table's storage was released or reallocated"
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
