"""Knowing when a captured graph is gone.

A launch captured into a graph runs again at every replay with the raw addresses it was
given (tables, pools, staging buffers). The launch path asks the backend for a
:class:`HeldGraph` of the graph being captured (:class:`GraphHolder`, optional), and the
memory the launch used stays open while :meth:`HeldGraph.alive` is true
(:mod:`pointerdomain.transfer.graphs`).

* CUDA (:class:`CudaGraphHolds`): ``cuStreamGetCaptureInfo`` gives the graph under
  capture, and a CUDA user object retained by it (``cuUserObjectCreate`` +
  ``cuGraphRetainUserObject``) runs its destructor once the graph and every executable
  graph instantiated from it are destroyed (CUDA Programming Guide, "Graph memory
  nodes / user objects"). The destructor only sets a flag (it runs on a CUDA thread and
  must call no CUDA function); nothing is linked, the driver is loaded with ctypes.
* The emulated device (:class:`EmulatedGraph`): a stand-in for a captured graph. While
  :meth:`EmulatedGraph.capture` is open on a thread, the emulated backend reports that
  thread's launches on the device as captured and records them instead of running them;
  :meth:`EmulatedGraph.replay` runs them again with the same raw addresses, as a CUDA
  graph replays; :meth:`EmulatedGraph.reset` destroys it.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pointerdomain.arguments import describe
from pointerdomain.errors import GraphInvalidatedError, InvalidArgumentError

if TYPE_CHECKING:
    from pointerdomain.devices import Device

__all__ = [
    "EMULATED_CAPTURES",
    "CaptureCount",
    "CudaGraphHolds",
    "EmulatedGraph",
    "GraphHolder",
    "HeldGraph",
    "capture_site",
    "emulated_capture",
]


def capture_site() -> str:
    """``file:line`` of the first caller frame outside pointerdomain (where the capture ran)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename.replace("\\", "/")
        if "/pointerdomain/" not in path and not path.endswith("/contextlib.py"):
            return f"{frame.filename}:{frame.lineno}"
    return "unknown"


class HeldGraph:
    """One captured graph, as the memory it holds sees it.

    Attributes:
        name: what the graph is, for messages (device, capture id or name, capture site).
        key: identifies the graph across launches captured into it.
        release_lag: seconds the graph's end may take to be seen once it is destroyed
            (CUDA runs the user object's destructor after the graph's executions end).
        keep: what the graph's launches use by address (tables, plans, index tensors),
            kept alive with it; dropped once the graph is seen gone.
    """

    __slots__ = ("name", "key", "release_lag", "keep", "_alive", "__weakref__")

    def __init__(self, name: str, key: object, alive: Callable[[], bool], release_lag: float = 0.0) -> None:
        self.name = name
        self.key = key
        self.release_lag = release_lag
        self.keep: list[object] = []
        self._alive = alive

    def alive(self) -> bool:
        """True while the graph (or an executable instance of it) exists."""
        if self._alive():
            return True
        self.keep.clear()
        return False

    def __repr__(self) -> str:
        return f"HeldGraph({self.name}, {'alive' if self.alive() else 'released'})"


class CaptureCount:
    """How many graph captures are open in this process, on any thread: while it is 0 no
    launch can be captured, so the launch path skips the per-launch capture query
    (:func:`pointerdomain.transfer.graphs.note_launch`) with one attribute test.

    Attributes:
        open: the count (changed under :attr:`lock` only).
        lock: serialises the changes (``+=`` on an attribute is not atomic).
    """

    __slots__ = ("open", "lock")

    def __init__(self) -> None:
        self.open = 0
        self.lock = threading.Lock()


@runtime_checkable
class GraphHolder(Protocol):
    """A backend that can tell when a graph that captured a launch is destroyed.

    A backend that sees every capture start and end may also have a ``graph_captures``
    attribute, a :class:`CaptureCount` (the emulated backend); where it has none, or it is
    None (CUDA: captures begin in torch, unseen), every launch that recorded no event asks
    :meth:`graph_hold`.
    """

    def graph_hold(self, device: Device, stream: int) -> HeldGraph | None:
        """The graph that ``stream`` of ``device`` is being captured into, or None when the
        stream is not being captured (the same object for every launch of one capture)."""
        ...


# CUDA --------------------------------------------------------------------------------------

_CU_USER_OBJECT_NO_DESTRUCTOR_SYNC = 1  # CU_USER_OBJECT_NO_DESTRUCTOR_SYNC: CUDA never waits on it
_CU_GRAPH_USER_OBJECT_MOVE = 1  # the graph takes the reference made with the object
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CUDA_RELEASE_LAG_S = 1.0  # a destroyed graph's user object is released once its last execution ends


class CudaGraphHolds:
    """:class:`HeldGraph` of CUDA graphs through the driver API (see the module docstring).

    Raises:
        OSError: libcuda cannot be loaded or lacks an entry point (CUDA < 11.3).
    """

    def __init__(self, path: str = "libcuda.so.1") -> None:
        lib: Any = ctypes.CDLL(path)
        for name in ("cuStreamGetCaptureInfo_v2", "cuUserObjectCreate", "cuGraphRetainUserObject",
                     "cuUserObjectRelease"):
            getattr(lib, name).restype = ctypes.c_int
        lib.cuStreamGetCaptureInfo_v2.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p,
        ]
        lib.cuUserObjectCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, _HOST_FN, ctypes.c_uint,
                                           ctypes.c_uint]
        lib.cuGraphRetainUserObject.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.cuUserObjectRelease.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self._lib = lib
        self._lock = threading.Lock()
        self._released: set[int] = set()  # tokens whose graph is gone (set by the destructor)
        self._by_capture: dict[tuple[int, int], HeldGraph] = {}  # (ordinal, capture id) -> hold
        self._tokens = itertools.count(1)
        self._destructor = _HOST_FN(self._on_destroy)  # kept: CUDA calls it after the graph is gone

    def _on_destroy(self, token: int | None) -> None:
        # A CUDA thread, or the thread destroying the graph: no CUDA call here.
        self._released.add(int(token or 0))

    def hold(self, device: Device, stream: int) -> HeldGraph | None:
        """The hold of the graph ``stream`` is captured into (the calling thread's current
        device must be ``device``: the launch path makes it so), or None.

        Raises:
            RuntimeError: a driver call failed (the CUresult is in the message).
        """
        lib = self._lib
        status, capture_id, graph = ctypes.c_int(0), ctypes.c_uint64(0), ctypes.c_void_p(None)
        err = int(lib.cuStreamGetCaptureInfo_v2(ctypes.c_void_p(stream), ctypes.byref(status),
                                                ctypes.byref(capture_id), ctypes.byref(graph), None, None))
        if err != 0:
            raise RuntimeError(f"cuStreamGetCaptureInfo failed with CUresult {err}")
        if status.value != 1:  # CU_STREAM_CAPTURE_STATUS_ACTIVE
            return None
        key = (device.ordinal, int(capture_id.value))
        with self._lock:
            held = self._by_capture.get(key)
            if held is not None:
                return held
            token = next(self._tokens)
            obj = ctypes.c_void_p(None)
            err = int(lib.cuUserObjectCreate(ctypes.byref(obj), ctypes.c_void_p(token), self._destructor, 1,
                                             _CU_USER_OBJECT_NO_DESTRUCTOR_SYNC))
            if err == 0:
                err = int(lib.cuGraphRetainUserObject(graph, obj, 1, _CU_GRAPH_USER_OBJECT_MOVE))
                if err != 0:
                    lib.cuUserObjectRelease(obj, 1)
            if err != 0:
                raise RuntimeError(f"cuUserObjectCreate/cuGraphRetainUserObject failed with CUresult {err}")
            released = self._released
            held = HeldGraph(f"CUDA graph of capture {capture_id.value} on {device} (captured at {capture_site()})",
                             key, lambda: token not in released, release_lag=_CUDA_RELEASE_LAG_S)
            self._by_capture[key] = held
            if len(self._by_capture) > 4096:  # forget captures whose graphs are gone
                self._by_capture = {k: h for k, h in self._by_capture.items() if h.alive()}
            return held


# the emulated stand-in -------------------------------------------------------------------

_capturing = threading.local()  # .graphs: {ordinal: EmulatedGraph} of this thread's open captures
_names = itertools.count(1)

#: The stand-in captures open on any thread (the emulated backend's ``graph_captures``).
EMULATED_CAPTURES = CaptureCount()


def emulated_capture(device: Device) -> EmulatedGraph | None:
    """The stand-in graph the calling thread is capturing ``device``'s launches into, or None."""
    if not EMULATED_CAPTURES.open:  # no capture open anywhere: no thread-local read
        return None
    graphs: dict[int, EmulatedGraph] | None = getattr(_capturing, "graphs", None)
    return None if graphs is None else graphs.get(device.ordinal)


class EmulatedGraph:
    """A stand-in for a CUDA graph on the emulated device (see the module docstring).

    Args:
        name: for messages; default ``emulated graph <n>``.

    Attributes:
        launches: the recorded launches, in order: (kernel plan, its raw launch arguments, its
            duplicate-check scratch or None).
        held: its :class:`HeldGraph` (what the launches captured is kept there).
    """

    def __init__(self, name: str | None = None) -> None:
        if name is not None and type(name) is not str:
            raise InvalidArgumentError(f"name: found {describe(name)}, expected a str or None")
        self.name = name or f"emulated graph {next(_names)}"
        self.launches: list[tuple[Any, tuple[int, int, int, int, int], Any]] = []
        self._device: Device | None = None
        self._reset = False
        self._checks: list[Callable[[], str | None]] = []
        self._before: dict[int, Callable[[], None]] = {}  # launch index -> its step at replays
        self._site = "unknown"
        self.held = HeldGraph(self.name, self, lambda: not self._reset)

    @contextmanager
    def capture(self, device: Device | str) -> Iterator[EmulatedGraph]:
        """Record the calling thread's launches on ``device`` (an emulated device) into
        this graph: they run only at :meth:`replay`.

        Raises:
            InvalidArgumentError: already captured, reset, another capture is open on
                this thread for ``device``, or ``device`` is not an emulated device.
            InvalidDeviceError: the device does not exist.
        """
        from pointerdomain.devices import validate_device

        device = validate_device(device)
        if not device.runtime.host_memory:
            raise InvalidArgumentError(f"EmulatedGraph captures an emulated device, got {device}: use torch.cuda.graph")
        if self._reset or self._device is not None:
            raise InvalidArgumentError(f"{self.name} was captured already: capture a new graph")
        graphs: dict[int, EmulatedGraph] = getattr(_capturing, "graphs", None) or {}
        if device.ordinal in graphs:
            raise InvalidArgumentError(f"{device} is being captured into {graphs[device.ordinal].name} already")
        self._device = device
        self._site = capture_site()
        self.held.name = f"{self.name} on {device} (captured at {self._site})"
        graphs[device.ordinal] = self
        _capturing.graphs = graphs
        with EMULATED_CAPTURES.lock:
            EMULATED_CAPTURES.open += 1
        try:
            yield self
        finally:
            del graphs[device.ordinal]
            with EMULATED_CAPTURES.lock:
                EMULATED_CAPTURES.open -= 1

    def record(self, plan: Any, args: tuple[int, int, int, int, int]) -> None:
        """A launch captured into this graph (the emulated backend's launch while capturing).
        A checked plan's launch (``plan.oob``) gets the duplicate check's scratch of its own,
        as a captured CUDA launch does: a replay runs the validation pass before the copy
        (no host check runs at a replay), and a destination slot given twice copies
        nothing and sets the error word's duplicate bit."""
        import torch

        marks = torch.empty((plan.dst_marks_words,), dtype=torch.int32) if plan.oob and args[2] > 1 else None
        self.launches.append((plan, args, marks))

    def before_last_launch(self, step: Callable[[], None]) -> None:
        """Run ``step`` before the last recorded launch at each replay: the host-side
        stand-in for the torch ops a CUDA graph captures with a launch (the parts' indices
        of a layout that splits items, computed from the caller's indices as they are at
        that replay)."""
        if not self.launches:
            raise InvalidArgumentError(f"{self.name} has recorded no launch to run a step before")
        i = len(self.launches) - 1
        prev = self._before.get(i)
        if prev is None:
            self._before[i] = step
        else:  # a step told later was computed earlier (the caller's, before the launch's own)
            def both() -> None:
                step()
                prev()
            self._before[i] = both

    def add_check(self, check: Callable[[], str | None]) -> None:
        """A check run before each replay: a message when what the graph captured changed."""
        self._checks.append(check)

    def replay(self) -> None:
        """Run the recorded launches again, with the raw addresses they were captured with
        (index tensors included: their current values are read, as a CUDA replay reads them).

        Raises:
            GraphInvalidatedError: the graph was reset, or memory it captured was released
                (a registration closed, a table's storage released or reallocated, an index
                tensor's storage resized, released or swapped with ``set_``); nothing runs.
        """
        if self._reset:
            raise GraphInvalidatedError(f"{self.held.name} was reset: it cannot be replayed; nothing was copied")
        for check in self._checks:
            why = check()
            if why is not None:
                raise GraphInvalidatedError(f"{self.held.name} cannot be replayed: {why}; nothing was copied")
        import torch

        from pointerdomain import _C

        for i, (plan, args, marks) in enumerate(self.launches):
            step = self._before.get(i)
            if step is not None:
                step()
            _C.cpu_transfer(plan, args[0], args[1], args[2], args[3], args[4], torch.get_num_threads(),
                            0 if marks is None else marks.data_ptr())

    def reset(self) -> None:
        """Destroy the graph: its holds end, a replay raises GraphInvalidatedError."""
        self._reset = True
        self.launches.clear()
        self._before.clear()
        self.held.keep.clear()
        self._checks.clear()

    @property
    def is_reset(self) -> bool:
        return self._reset
