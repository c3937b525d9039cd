"""The layer pipeline: a request's H2D load queued for every layer at once, with a
per-layer completion the model waits on from its own stream.

An engine that overlaps loading with the forward pass (sglang's HiCache layer-wise
load) queues each layer's copy on a load stream and has the model's layer ``i``
wait for copy ``i`` only, so layer 0 computes while layers 1.. are still in flight.
:func:`load_layers` does the checks of the whole call once (tables, indices,
options: the same as :func:`~pointerdomain.transfer_kv_all_layer`), picks one path
for every layer and queues the layers:

* the kernel path (the default for KV items), in ONE native call: one kernel walks the
  layers in order. Its CTAs move their share of layer 0, then of layer 1, ...; the last
  CTA to finish a layer (an atomic counter per layer; no CTA ever waits for another, so
  nothing depends on which CTAs are resident) writes the load's generation to that
  layer's flag word. :meth:`LayerLoad.wait` enqueues one stream wait on the word
  (``cuStreamWaitValue32``, ">= generation"), :meth:`LayerLoad.ready` reads it on the
  host (host-mapped pinned memory);
* the copy-engine path (runs of 512 KiB and more): one copy per layer from Python, each
  followed by a stream write of the layer's flag (``cuStreamWriteValue32``).

The words are per (backend, device, stream) and every load on a stream takes the next
generation (assigned and queued under one lock, so launches on a stream publish
increasing values): a flag at or past a load's generation means its layer is done (a
later load on the same stream publishes only after the earlier one finished: stream
order), so a :class:`LayerLoad` stays valid after later loads. A stream wait is queued
after the kernel that sets its flag (``wait`` is called after ``load_layers``), so even
streams that share a hardware queue cannot stall the kernel behind the wait.

A stream is known here only by its handle, which outlives nothing: the loads own their
stream's words. Once no :class:`LayerLoad` of a stream is left, its entry rests among the
eight streams most recently let go of (their next load finds it); past those, the entry is
dropped and, once its last launch is done, its words go back to a spare list of the
backend and device, for the next stream that needs words (so a program that makes a
stream per request holds words for the streams in use at once and a few more, not for
every handle it ever used).
A stream (or a new stream on a reused handle) that takes spare words starts past every
generation they published: their flags only ever grow, so a stream wait still queued on
them (or captured into a graph) stays satisfied, and no flag reads as a new load's layer
done before its kernel sets it. A handle whose loads are still held keeps its entry.

Captured into a CUDA graph (the load stream capturing), the pipeline is one launch per
layer with an event after each, and a captured :meth:`LayerLoad.wait` is an event wait:
in a graph the scheduler orders nodes by the graph's edges alone and could put a flag
wait ahead of the kernel that sets the flag, so the graph gets its per-layer order as
edges (and a replay has no flags to go stale). The captured launches and event records
are plain stream work, so the whole pipeline is captured as long as every
:meth:`LayerLoad.wait` is captured with it.

On the emulated device the CPU kernel does the same in one native call (each layer's
flag set once its bytes are written); it is synchronous, so every layer is done when
:func:`load_layers` returns, and a wait checks the flag (a flag nothing will set raises,
where a GPU stream would wait forever). Under its stand-in graph the layers are recorded
one launch each and replayed in order; waits have nothing to wait for.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any, Final, cast

import torch

from pointerdomain.arguments import describe
from pointerdomain._platform import Backend, LayerSignals, LayerWords
from pointerdomain.devices import Device
from pointerdomain.domains import DeviceAlias
from pointerdomain.errors import ExtensionUnavailableError, IndexValidationError, InvalidArgumentError
from pointerdomain.layouts import KVLayout
from pointerdomain.registration.tables import PointerTable
from pointerdomain.transfer.kernels import (
    DEFAULT_MAX_CTAS,
    MaxCtas,
    Path,
    TransferBackend,
    ValidateIndices,
    check_call,
    choose_path,
    run,
)

__all__ = ["LayerLoad", "load_layers"]

_MASK: Final = 0xFFFFFFFF
_HALF: Final = 1 << 31  # flags compare cyclically: f satisfies g when (f - g) mod 2**32 < 2**31


def _check_stream(name: str, stream: object) -> int | None:
    if stream is None or (type(stream) is int and 0 <= stream < 2**64):
        return stream
    raise InvalidArgumentError(f"{name}: found {describe(stream)}, expected a cudaStream_t as an int in [0, 2**64) or None")


class LayerLoad:
    """Per-layer completion of a :func:`load_layers` call (also from
    :meth:`HostKVPool.load_layers <pointerdomain.HostKVPool.load_layers>`).

    Holds the tables, index tensors and completion words of the load until it is
    collected, so they stay alive while the copies are in flight.

    Attributes:
        num_layers: the layers queued (``0 .. num_layers - 1``).
        device: the device the copies run on.
        stream: the stream they were queued on (an int; 0 on the emulated device).
        generation: the value each layer's flag word reaches once the layer is done (0: the
            load has no flags: no slots, or captured into a graph).
    """

    __slots__ = ("_captured", "_entry", "_event", "_events", "_keep", "_platform", "_signals", "_words", "device",
                 "generation", "num_layers", "stream")

    def __init__(
        self, platform: Backend, signals: LayerSignals, device: Device, stream: int, num_layers: int,
        words: LayerWords | None, generation: int, event: int, captured: list[Any] | None, keep: tuple[object, ...],
    ) -> None:
        self._platform = platform
        self._signals = signals
        self.device = device
        self.stream = stream
        self.num_layers = num_layers
        self.generation = generation
        self._words = words
        self._event = event
        self._events = captured  # a captured load's per-layer events (None elsewhere; all None on a synchronous device)
        self._captured = captured is not None
        self._keep = keep
        self._entry: _StreamWords | None = None  # the stream's words this load holds (set by _queue)

    def __del__(self) -> None:
        entry = self._entry
        if entry is not None:
            try:
                _dropped.append(entry)  # taken under the lock by the next load (_settle)
            except Exception:  # interpreter shutdown: the module is gone
                pass

    def __repr__(self) -> str:
        return f"LayerLoad({self.num_layers} layers on {self.device}, stream={self.stream:#x})"

    def _check_layer(self, layer: object) -> int:
        if type(layer) is not int:
            raise IndexValidationError(f"layer: found {describe(layer)}, expected an int in [0, {self.num_layers})")
        if not 0 <= layer < self.num_layers:
            raise IndexValidationError(f"layer: found {layer}, outside [0, {self.num_layers}) (the layers queued)")
        return layer

    def wait(self, layer: int, stream: int | None = None) -> None:
        """Make ``stream`` (default: the device's current stream) wait, on the device,
        until layer ``layer``'s copy is done; the host does not block (one stream wait on
        the layer's flag word; an event wait for a captured load). Captured into a graph
        when called while ``stream`` is capturing; a load captured into a graph must have
        its waits captured with it.

        Raises:
            IndexValidationError: ``layer`` is not an int in ``[0, num_layers)``.
            InvalidArgumentError: ``stream`` is not an int in ``[0, 2**64)`` or None.
            RuntimeCallError: the runtime refused the wait; on the emulated device, a flag
                nothing will set.
        """
        index = self._check_layer(layer)
        target = _check_stream("stream", stream)
        words = self._words
        if words is not None:
            if target is None:
                target = self._platform.current_stream(self.device)
            self._signals.wait_layer(words, index, self.generation, self.device, target)
            return
        events = self._events
        if events is None or events[index] is None:  # nothing queued, or synchronous: done
            return
        device = self.device
        waiter = device.runtime.external_stream(
            self._platform.current_stream(device) if target is None else target, device.ordinal)
        waiter.wait_event(events[index])

    def ready(self, layer: int) -> bool:
        """Whether layer ``layer``'s copy is done: its flag word read on the host (not
        during capture; a captured load: its event's state, which says nothing of replays).

        Raises:
            IndexValidationError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        index = self._check_layer(layer)
        words = self._words
        if words is not None:
            return (self._signals.layer_flag(words, index) - self.generation) & _MASK < _HALF
        events = self._events
        return True if events is None or events[index] is None else bool(events[index].query())

    def synchronize(self) -> None:
        """Block the host until every layer's copy is done (and any work queued on the
        load's stream before the last layer's completion was recorded).

        Raises:
            InvalidArgumentError: the load was captured into a graph (its copies run at each
                replay: synchronize the stream the graph is replayed on).
        """
        if self._captured:
            raise InvalidArgumentError(
                f"{self!r} was captured into a graph: its copies run at each replay; synchronize the stream the graph "
                "is replayed on")
        if self._event:
            self._signals.wait_event_done(self._event)


class _StreamWords:
    """The completion words of one (backend, device, stream) for loads outside capture,
    the last generation handed out on them, the loads that hold the entry and the event
    recorded after its last launch. ``lock`` is held from a load's generation to its
    launch, so launches on the stream publish increasing values."""

    __slots__ = ("device", "event", "gen", "key", "loads", "lock", "platform", "words")

    def __init__(self, platform: Backend, key: tuple[int, Device, int], device: Device) -> None:
        self.platform = platform  # the key holds the backend's id: keep it alive
        self.key = key
        self.device = device
        self.lock = threading.Lock()
        self.words: LayerWords | None = None
        self.gen = 0
        self.loads = 0  # LayerLoads (and loads being queued) that hold this entry; under _streams_lock
        self.event = 0  # recorded after the last launch (0: none, or synchronous)


_streams: dict[tuple[int, Device, int], _StreamWords] = {}
_streams_lock = threading.Lock()
_has_signals: dict[type, bool] = {}
#: entries whose loads were collected since the last look: a load's ``__del__`` only appends
#: here (it may run inside a locked section, on any thread), _settle takes them under the lock
_dropped: deque[_StreamWords] = deque()
#: entries no load holds, still in _streams (the most recent few: a stream's next load, the
#: common case, finds its entry), oldest first
_resting: OrderedDict[tuple[int, Device, int], _StreamWords] = OrderedDict()
_RESTING_MAX: Final = 8
#: entries no load holds whose last launch may still run (their words are not reused until it is done)
_idle: list[_StreamWords] = []
#: words of streams no load holds, with the last generation each published, per (backend id, device)
_spare: dict[tuple[int, Device], tuple[Backend, list[tuple[LayerWords, int]]]] = {}
#: words replaced on a live stream (grown, or their generations used up): stream waits queued
#: on them, or captured into graphs, may still read them, so they are never freed
_retired: list[LayerWords] = []


def _settle() -> None:
    """Under ``_streams_lock``: the collected loads let go of their entries; an entry no load
    holds leaves ``_streams``, and its words become spare once its last launch is done."""
    while _dropped:
        entry = _dropped.popleft()
        entry.loads -= 1
        if entry.loads == 0:
            _resting[entry.key] = entry
            if len(_resting) > _RESTING_MAX:  # the stream least recently let go of leaves
                _key, oldest = _resting.popitem(last=False)
                if _streams.get(oldest.key) is oldest:
                    del _streams[oldest.key]
                if oldest.words is not None:
                    _idle.append(oldest)
    if not _idle:
        return
    waiting = []
    for entry in _idle:
        try:
            done = entry.event == 0 or entry.platform.event_done(entry.event)
        except Exception:  # a faulted context: keep the words out of use
            done = False
        if not done:
            waiting.append(entry)
            continue
        assert entry.words is not None
        spare = _spare.get((id(entry.platform), entry.device))
        if spare is None or spare[0] is not entry.platform:
            spare = _spare[(id(entry.platform), entry.device)] = (entry.platform, [])
        spare[1].append((entry.words, entry.gen))
        entry.words = None
    _idle[:] = waiting


def _signals_of(platform: Backend) -> LayerSignals:
    kind = type(platform)
    has = _has_signals.get(kind)
    if has is None:
        has = _has_signals[kind] = isinstance(platform, LayerSignals)  # a Protocol check: once per type
    if not has:
        raise ExtensionUnavailableError(f"the {platform.name} backend has no layer pipeline (a build without the GPU "
                                        "kernels, or a backend that does not implement LayerSignals)")
    return cast(LayerSignals, platform)


def _stream_words(platform: Backend, device: Device, stream: int) -> _StreamWords:
    """The entry of (``platform``, ``device``, ``stream``), held for one more load (the
    caller hands the hold to its :class:`LayerLoad`, or gives it back with ``_dropped``)."""
    key = (id(platform), device, stream)
    with _streams_lock:
        if _dropped or _idle:
            _settle()
        found = _streams.get(key)
        if found is None:
            found = _streams[key] = _StreamWords(platform, key, device)
        elif not found.loads:
            _resting.pop(key, None)
        found.loads += 1
    return found


def _take_words(platform: Backend, signals: LayerSignals, device: Device, capacity: int) -> tuple[LayerWords, int]:
    """Spare words of at least ``capacity`` layers and the last generation they published,
    or new (zeroed) words and 0."""
    with _streams_lock:
        spare = _spare.get((id(platform), device))
        if spare is not None and spare[0] is platform:
            for i, (words, gen) in enumerate(spare[1]):
                if words.capacity >= capacity and gen < _HALF - 1:
                    del spare[1][i]
                    return words, gen
    return signals.layer_words(device, capacity), 0


def load_layers(
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    src_layout: KVLayout,
    dst_layout: KVLayout,
    stream: int | None = None,
    max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    backend: TransferBackend = "auto",
    validate_indices: ValidateIndices = True,
) -> LayerLoad:
    """Queue every layer's copy of ``src_indices`` -> ``dst_indices`` on ``stream``, layer
    0 first, each layer's completion published in its flag word (module docstring):
    :meth:`LayerLoad.wait` gives a layer to a stream.

    Moves what :func:`~pointerdomain.transfer_kv_all_layer` moves (``n * num_kv *
    num_layers * item_bytes`` bytes) on the same path, chosen once for all layers; the
    kernel path queues all layers in one launch, the copy-engine path one copy per layer,
    and a capture (``stream`` capturing; the kernel path only) one launch per layer with
    an event after each. ``stream`` (default: the device's current stream) first waits for
    the device's current stream, so the copies follow the work that freed the
    destination slots. With no slots nothing is queued and every layer is done.

    Raises:
        Every error of :func:`~pointerdomain.transfer_kv_all_layer`, before the first
        layer is queued. A launch failing after that (the copy-engine path: e.g. a
        registration closed by another thread) raises with the earlier layers queued.
        ExtensionUnavailableError: the backend has no layer pipeline (a build without
            the GPU kernels).
    """
    if not isinstance(cast(object, src_layout), KVLayout):
        raise InvalidArgumentError(f"src_layout: found {type(src_layout).__name__}, expected a KVLayout")
    num_layers = src_layout.num_layers
    plan, options, args, host_indices = check_call(src, src_layout, dst, dst_layout, src_indices, dst_indices, 0,
                                                   num_layers, stream, max_ctas, backend, validate_indices)
    if options.path is Path.STAGED:
        raise InvalidArgumentError(
            "backend: found 'staged', which moves all layers in one pass (HostKVPool.load); a layer pipeline "
            "queues one copy per layer: use backend='kernel', 'copy_engine' or 'auto'"
        )
    one = args._replace(layer_count=1)
    path = choose_path(plan, src, dst, options, one, host_indices)  # as each layer's launch would choose it
    platform = plan.platform
    signals = _signals_of(platform)
    device = plan.device
    current = platform.current_stream(device)
    load = current if stream is None else stream
    keep: tuple[object, ...] = (src, dst, src_indices, dst_indices)
    if not args.n:  # nothing to move: nothing queued, every layer done
        return LayerLoad(platform, signals, device, load, num_layers, None, 0, 0, None, keep)
    runtime = device.runtime
    if signals.capturing(device, load):  # one launch per layer, an event after each (module docstring)
        queue = runtime.external_stream(load, device.ordinal)  # None: synchronous launches
        if queue is not None and load != current:
            queue.wait_stream(runtime.external_stream(current, device.ordinal))
        events: list[Any] = []
        for layer in range(num_layers):
            run(plan, src, dst, src_indices, dst_indices, one._replace(layer_begin=layer, stream=load), path,
                options.check)
            events.append(None if queue is None else queue.record_event())
        return LayerLoad(platform, signals, device, load, num_layers, None, 0, 0, events, keep)
    entry = _stream_words(platform, device, load)  # held for this load: the LayerLoad lets go of it when collected
    try:
        with entry.lock:  # the generation and the launch together: a stream's flags only grow
            old = entry.words
            if old is None or old.capacity < num_layers or entry.gen >= _HALF - 1:
                # spare words (flags at or below entry.gen: nothing reads as done early), or new
                # ones zeroed before the launch is ordered (on the current stream, which the load
                # stream waits for below); replaced ones may be in use by queued kernels and waits
                capacity = max(num_layers, 64)
                if old is not None:
                    _retired.append(old)
                    capacity = max(capacity, 2 * old.capacity)
                words, entry.gen = _take_words(platform, signals, device, capacity)
                entry.words = words
            else:
                words = old
            gen = entry.gen = entry.gen + 1
            if load != current:  # after the current stream's work so far (and the new words' zeroing)
                queue = runtime.external_stream(load, device.ordinal)  # None: synchronous launches
                if queue is not None:
                    queue.wait_stream(runtime.external_stream(current, device.ordinal))
            bound = args._replace(stream=load)
            if path is Path.KERNEL:
                recorded = [0]

                def launch(kernel: Any, launch_args: Any) -> int:
                    recorded[0] = signals.launch_layers(kernel, launch_args, words, gen)
                    return recorded[0]

                run(plan, src, dst, src_indices, dst_indices, bound, path, options.check, launch)
                event = recorded[0]
            else:  # the copy engine: one copy per layer (descriptors built on the host), each then its flag
                for layer in range(num_layers):
                    run(plan, src, dst, src_indices, dst_indices, one._replace(layer_begin=layer, stream=load), path,
                        options.check)
                    signals.signal_layer(words, layer, gen, device, load)
                event = platform.record_event(device, load)
            entry.event = event
        done = LayerLoad(platform, signals, device, load, num_layers, words, gen, event, None, keep + (words,))
        done._entry = entry  # the load owns its hold on the stream's words
        return done
    except BaseException:
        _dropped.append(entry)  # no load holds it
        raise
