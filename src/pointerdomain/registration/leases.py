"""Launch leases: memory a launch uses cannot be unregistered under the copy.

Each :class:`~pointerdomain.RegisteredHostMemory` owns a :class:`LeaseSet`. A launch
acquires a lease on every registration its two tables point into before the copy
starts and releases it when the copy can no longer run:

* on a synchronous backend (the emulated CPU device) when the GIL-released C++ call
  returns;
* on CUDA when the launch is enqueued, after recording one event on the launch
  stream that every leased registration keeps (one event per device and stream,
  re-recorded by each launch on it: waiting on the latest record waits for every
  earlier launch on that stream, so one event per owner and stream is enough and no
  launch allocates). The backend owns the events and records them in the same native
  call as the kernel launch (``Backend.launch_recorded``; copy-engine and staged
  launches through ``Backend.record_event``); :meth:`LeaseSet.release` hands the event
  to the lease set, and ``close()`` polls it with ``Backend.event_done``. Nothing is
  recorded for a launch captured into a CUDA graph: it runs at replay, which the
  caller orders (docs/reliability.md).

A launch captured into a graph (a CUDA graph, or the emulated device's stand-in) holds
the raw addresses it was given for as long as the graph exists: the launch path adds a
:class:`GraphHold` to the set (:mod:`pointerdomain.transfer.graphs`), and ``close()``
refuses with :class:`~pointerdomain.errors.BusyError` naming the graph while one is alive.
:attr:`LeaseSet.generation` changes when the memory closes.

``close()`` marks the set closing (new launches then get ``ClosedError``), waits up
to a bound for the running leases and then for the recorded events, and only then
unregisters. When the bound passes it raises :class:`~pointerdomain.errors.BusyError`
naming the launch still in flight and leaves the memory registered and usable.

In a fork child only the forking thread exists: the leases of the other threads are
dropped there (``os.register_at_fork``), so the child can close; the parent keeps them.

Device memory (torch tensors, emulated device memory) has no ``close()``: a table
keeps its tensors alive, and storage released under a table is refused at the next
launch (``PointerTable.check_live``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from typing import Final, Protocol, runtime_checkable

from pointerdomain.arguments import describe
from pointerdomain.errors import BusyError, InvalidArgumentError, InvalidTypeError

__all__ = ["DEFAULT_CLOSE_TIMEOUT_S", "GRAPH_RELEASE_WAIT_S", "EventBackend", "GraphHold", "next_generation", "LaunchInfo", "LeaseSet", "Leased", "acquire_all", "release_all"]

#: How long ``close()`` waits for launches using the memory, seconds: far longer than
#: any single copy of a KV pool (a 64 GiB pool at 50 GB/s is 1.3 s), short enough that
#: a stuck launch is reported rather than hanging shutdown.
DEFAULT_CLOSE_TIMEOUT_S: Final = 30.0

#: The longest ``close()`` waits for a graph that holds the memory to be seen destroyed,
#: seconds (at most its timeout, and at most the hold's own ``release_lag``): a CUDA
#: graph's release reaches the library after the graph and its executions are gone,
#: shortly after the caller dropped it; the emulated stand-in's at once.
GRAPH_RELEASE_WAIT_S: Final = 2.0

_generations = itertools.count(1)


def next_generation() -> int:
    """A process-wide generation number, larger than every one handed out before."""
    return next(_generations)


@runtime_checkable
class GraphHold(Protocol):
    """A captured graph's hold on memory (:mod:`pointerdomain.transfer.graphs`)."""

    @property
    def name(self) -> str: ...

    @property
    def release_lag(self) -> float:
        """Seconds the end of the graph may take to be seen after it was destroyed."""
        ...

    def alive(self) -> bool: ...


#: (what, slots, device, thread id) of one launch, formatted only for a BusyError.
LaunchInfo = tuple[str, int, object, int]


class EventBackend(Protocol):
    """What a lease set asks of the backend that recorded an event (``Backend.event_done``)."""

    def event_done(self, event: int) -> bool: ...


def _describe(info: LaunchInfo) -> str:
    what, n, device, thread = info
    name = next((t.name for t in threading.enumerate() if t.ident == thread), str(thread))
    return f"{what} of {n} slot pair(s) on {device} from thread {describe(name)}"


class LeaseSet:
    """The leases on one registration (see the module docstring). Thread-safe."""

    __slots__ = ("_cond", "_active", "_next", "_closing", "_events", "_graphs", "generation", "__weakref__")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active: dict[int, LaunchInfo] = {}
        self._next = itertools.count(1)
        self._closing = False
        # event (one per device and stream) -> (its backend, the last launch that recorded it)
        self._events: dict[int, tuple[EventBackend, LaunchInfo]] = {}
        self._graphs: list[GraphHold] = []  # graphs that captured a launch over this memory
        #: changes (to a larger process-wide number) when the memory closes
        self.generation = next_generation()
        _all_sets.add(self)

    def _after_fork_in_child(self, forking_thread: int) -> None:
        """In a fork child only the thread that forked exists: leases of the other threads
        can never be released there, so they are dropped (the parent still holds them), and
        the condition is made anew (another thread may have held its lock at the fork)."""
        self._cond = threading.Condition(threading.Lock())
        for token, info in list(self._active.items()):
            if info[3] != forking_thread:
                self._active.pop(token, None)

    def hold_graph(self, hold: GraphHold) -> None:
        """Keep the memory open while ``hold`` is alive (a graph captured a launch over it)."""
        with self._cond:
            if all(h is not hold for h in self._graphs):
                self._graphs.append(hold)

    def graphs(self) -> list[GraphHold]:
        """The graphs alive now that captured a launch over this memory."""
        with self._cond:
            self._graphs = [h for h in self._graphs if h.alive()]
            return list(self._graphs)

    def _refuse_while_graphs(self, what: str, timeout: float) -> None:
        held = self.graphs()
        lag = max((h.release_lag for h in held), default=0.0)
        deadline = time.monotonic() + min(timeout, GRAPH_RELEASE_WAIT_S, lag)
        while held and time.monotonic() < deadline:
            time.sleep(0.005)
            held = self.graphs()
        if held:
            names = "; ".join(h.name for h in held[:3])
            raise BusyError(
                f"cannot close {what}: {len(held)} captured graph(s) hold its addresses and would replay into it "
                f"once released: {names}; nothing was unregistered. Fix: destroy the graph first (del it, or "
                "reset() it), then close"
            )

    # acquire/release take no lock (a lock pair cost more than the rest of a launch's
    # checks): each step is one GIL-atomic operation, and acquire publishes the lease
    # before it reads _closing while drain sets _closing before it reads _active, so
    # one of the two always sees the other.
    def acquire(self, info: LaunchInfo) -> int:
        """A lease token, or -1 when the memory is closing or closed (the caller raises
        ``ClosedError``)."""
        token = next(self._next)
        self._active[token] = info
        if self._closing:
            self.release(token)
            return -1
        return token

    def release(self, token: int, event: int = 0, backend: EventBackend | None = None) -> None:
        """End lease ``token``. ``event``: nonzero when the copy may still run on the GPU
        (an event ``backend`` recorded after it, see ``Backend.launch_recorded``), kept for
        :meth:`drain` to wait on; recorded before the lease ends, so a drain that has
        seen every lease end sees the event too (no lock, as for acquire)."""
        if event and backend is not None:
            self._events[event] = (backend, self._active[token])
        del self._active[token]
        if self._closing:
            with self._cond:
                self._cond.notify_all()

    def drain(self, what: str, timeout: float) -> None:
        """Refuse new leases, then wait up to ``timeout`` seconds for the running ones
        and for the GPU work whose events :meth:`release` kept.

        Raises:
            BusyError: the time passed; the set accepts leases again (nothing closed).
            InvalidTypeError: ``timeout`` is not an int or float (a ``TypeError`` too).
            InvalidArgumentError: ``timeout`` is negative or NaN (``math.inf``: no limit).
        """
        if type(timeout) is not float and type(timeout) is not int:
            raise InvalidTypeError(f"close: timeout must be seconds as an int or float, got {describe(timeout)}")
        if not timeout >= 0:  # NaN too
            raise InvalidArgumentError(f"close: timeout must be >= 0 seconds (math.inf: no limit), got {describe(timeout)}")
        self._refuse_while_graphs(what, timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            while self._active and time.monotonic() < deadline:  # short waits: a release may not notify
                self._cond.wait(min(0.01, max(0.0, deadline - time.monotonic())))
            if self._active:
                self._closing = False
                info = list(self._active.values())[0]
                raise BusyError(
                    f"cannot close {what}: {len(self._active)} launch(es) still copy from or to it after "
                    f"{timeout:g} s, e.g. {_describe(info)}; nothing was unregistered. Fix: wait for the "
                    "launch (join the thread that launches) before close(), or pass a longer timeout"
                )
            late = [h for h in self._graphs if h.alive()]  # captured by a launch that ran during the wait
            if late:
                self._closing = False
                raise BusyError(
                    f"cannot close {what}: a graph captured a launch over it while it was closing: {late[0].name}; "
                    "nothing was unregistered. Fix: destroy the graph first, then close"
                )
            events = list(self._events.items())
        for event, (backend, info) in events:
            while not backend.event_done(event):
                if time.monotonic() >= deadline:
                    with self._cond:
                        self._closing = False
                    raise BusyError(
                        f"cannot close {what}: GPU work queued by {_describe(info)} still reads or writes it "
                        f"after {timeout:g} s; nothing was unregistered. Fix: synchronize the stream first "
                        "(pointerdomain.synchronize(device)), or pass a longer timeout"
                    )
                time.sleep(0.0005)
        with self._cond:
            self._events.clear()
            self.generation = next_generation()

    @property
    def closing(self) -> bool:
        return self._closing


#: every lease set alive, for the fork hook
_all_sets: weakref.WeakSet[LeaseSet] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    forking_thread = threading.get_ident()  # the same ident in the child as in the parent
    for lease_set in list(_all_sets):
        lease_set._after_fork_in_child(forking_thread)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Leased(Protocol):
    """What a launch leases: a registration with its :class:`LeaseSet`."""

    @property
    def leases(self) -> LeaseSet: ...


def acquire_all(owners: tuple[Leased, ...], info: LaunchInfo) -> list[int] | None:
    """One lease on each of ``owners`` for the launch ``info``, or None (holding none)
    when one of them is closing or closed: the caller then raises ``ClosedError``."""
    tokens: list[int] = []
    for owner in owners:
        token = owner.leases.acquire(info)
        if token == -1:
            release_all(owners, tokens, 0, None)
            return None
        tokens.append(token)
    return tokens


def release_all(owners: tuple[Leased, ...], tokens: list[int], event: int, backend: EventBackend | None) -> None:
    """End the leases :func:`acquire_all` gave (``tokens[i]`` on ``owners[i]``), keeping
    ``event`` for each owner's drain (see :meth:`LeaseSet.release`)."""
    for owner, token in zip(owners, tokens):
        owner.leases.release(token, event, backend)
