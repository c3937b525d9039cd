"""The layer pipeline: a request's H2D load queued for every layer at once, with a
per-layer completion the model waits on from its own stream.

An engine that overlaps loading with the forward pass (sglang's HiCache layer-wise
load) queues each layer's copy on a load stream and has the model's layer ``i``
wait for copy ``i`` only, so layer 0 computes while layers 1.. are still in flight.
:func:`load_layers` does the checks of the whole call once (tables, indices,
options: the same as :func:`~pointerdomain.transfer_kv_all_layer`), picks one path
for every layer, queues one launch per layer on ``stream`` and records an event after
each; :class:`LayerLoad` hands them out. The per-layer launches and event records are
plain stream work, so the whole pipeline can be captured into a CUDA graph (with the
kernel path: the staged and copy-engine paths read indices on the host), as long as
every :meth:`LayerLoad.wait` is captured with it.

Synchronous devices (the emulated device) have nothing in flight: every layer is done
when :func:`load_layers` returns, and waits are no-ops.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from pointerdomain.arguments import describe
from pointerdomain._platform import Backend
from pointerdomain.devices import Device
from pointerdomain.domains import DeviceAlias
from pointerdomain.errors import IndexValidationError, InvalidArgumentError
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


def _check_stream(name: str, stream: object) -> int | None:
    if stream is None or (type(stream) is int and 0 <= stream < 2**64):
        return stream
    raise InvalidArgumentError(f"{name}: found {describe(stream)}, expected a cudaStream_t as an int in [0, 2**64) or None")


class LayerLoad:
    """Per-layer completion of a :func:`load_layers` call (also from
    :meth:`HostKVPool.load_layers <pointerdomain.HostKVPool.load_layers>`).

    Holds the tables and index tensors of the load until it is collected, so they stay
    alive while the copies are in flight.

    Attributes:
        num_layers: the layers queued (``0 .. num_layers - 1``).
        device: the device the copies run on.
        stream: the stream they were queued on (an int; 0 on the emulated device).
    """

    __slots__ = ("_events", "_keep", "_platform", "device", "num_layers", "stream")

    def __init__(
        self, platform: Backend, device: Device, stream: int, events: list[Any], keep: tuple[object, ...]
    ) -> None:
        self._platform = platform
        self.device = device
        self.stream = stream
        self.num_layers = len(events)
        self._events = events
        self._keep = keep

    def __repr__(self) -> str:
        return f"LayerLoad({self.num_layers} layers on {self.device}, stream={self.stream:#x})"

    def _event(self, layer: object) -> Any:
        if type(layer) is not int:
            raise IndexValidationError(f"layer: found {describe(layer)}, expected an int in [0, {self.num_layers})")
        if not 0 <= layer < self.num_layers:
            raise IndexValidationError(f"layer: found {layer}, outside [0, {self.num_layers}) (the layers queued)")
        return self._events[layer]

    def wait(self, layer: int, stream: int | None = None) -> None:
        """Make ``stream`` (default: the device's current stream) wait, on the device,
        until layer ``layer``'s copy is done; the host does not block. Captured into a
        graph when called while ``stream`` is capturing.

        Raises:
            IndexValidationError: ``layer`` is not an int in ``[0, num_layers)``.
            InvalidArgumentError: ``stream`` is not an int in ``[0, 2**64)`` or None.
        """
        event = self._event(layer)
        target = _check_stream("stream", stream)
        if event is None:  # synchronous device: already done
            return
        runtime = self.device.runtime
        waiter = runtime.external_stream(
            self._platform.current_stream(self.device) if target is None else target, self.device.ordinal)
        waiter.wait_event(event)

    def ready(self, layer: int) -> bool:
        """Whether layer ``layer``'s copy is done (a host query; not during capture).

        Raises:
            IndexValidationError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        event = self._event(layer)
        return True if event is None else bool(event.query())

    def synchronize(self) -> None:
        """Block the host until every layer's copy is done."""
        if self._events and self._events[-1] is not None:
            self._events[-1].synchronize()  # one stream: the last layer's event follows every other


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
    0 first, with an event after each: :meth:`LayerLoad.wait` gives a layer to a stream.

    Moves what :func:`~pointerdomain.transfer_kv_all_layer` moves (``n * num_kv *
    num_layers * item_bytes`` bytes) on the same path, chosen once for all layers.
    ``stream`` (default: the device's current stream) first waits for the device's
    current stream, so the copies follow the work that freed the destination slots.

    Raises:
        Every error of :func:`~pointerdomain.transfer_kv_all_layer`, before the first
        layer is queued. A launch failing after that (e.g. a registration closed by
        another thread) raises with the earlier layers queued.
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
    device = plan.device
    runtime = device.runtime
    current = plan.platform.current_stream(device)
    load = current if stream is None else stream
    queue = runtime.external_stream(load, device.ordinal)  # None: synchronous launches
    if queue is not None and load != current:
        queue.wait_stream(runtime.external_stream(current, device.ordinal))
    events: list[Any] = []
    for layer in range(num_layers):
        run(plan, src, dst, src_indices, dst_indices, one._replace(layer_begin=layer), path, options.check)
        events.append(None if queue is None else queue.record_event())
    return LayerLoad(plan.platform, device, load, events, (src, dst, src_indices, dst_indices))
