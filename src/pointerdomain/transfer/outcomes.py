"""Honest completion: a transfer is reported done only when every byte of it was copied.

The launch functions (:func:`~pointerdomain.transfer_kv_all_layer`, ...) raise on a
failure before the launch and, on CUDA, enqueue asynchronously: a skipped slot or a fault
shows only at :func:`~pointerdomain.synchronize`. A caller that splits a request into
several launches (chunks) and drops an error on the way can report a partly copied
request as complete. This module gives the result a type:

* :class:`TransferOutcome`: ``done``, ``failed`` (with the reason and the error), or
  ``partial`` (with the spans of the request that were not copied);
* :func:`transfer_outcome`: one request in chunks of ``chunk_slots`` slot pairs, then a
  drain of the device (its queued copies and its error word): the outcome says which
  chunks were copied. The whole request is checked first, as one direct launch would be
  (tables, index dtype, shape, lengths, slot range, a destination slot written twice, a
  slot both read and written over shared memory, across chunks too): bad input fails the
  whole request with that launch's typed error and nothing is written. A chunk that
  raised at its launch, and every chunk after it, is a failed span (nothing after a
  failure is launched); an error word set by the drain (a slot skipped somewhere on the
  device) fails the whole request, since which launch skipped is not recorded;
* :class:`TransferStream`: a sequence of requests on one device whose first failed or
  partial outcome latches: later submissions raise
  :class:`~pointerdomain.errors.LatchedError` until :meth:`TransferStream.reset`, which
  drains the device first, so no queued copy still writes a buffer or page the caller
  then reuses;
* the engine adapters' failures become outcomes too
  (:mod:`pointerdomain.adapters.outcomes`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import torch

from pointerdomain.arguments import describe
from pointerdomain.devices import Device, validate_device
from pointerdomain.domains import DeviceAlias
from pointerdomain.errors import (
    DeviceMismatchError,
    InvalidArgumentError,
    LatchedError,
    PointerDomainError,
)
from pointerdomain.layouts import KVLayout
from pointerdomain.registration.tables import PointerTable
from pointerdomain.transfer import launch_errors, overlap
from pointerdomain.transfer.kernels import (
    DEFAULT_MAX_CTAS,
    MaxCtas,
    TransferBackend,
    bind_call,
    layer_range,
    transfer_kv_all_layer,
)

__all__ = ["Status", "TransferOutcome", "TransferStream", "run_spans", "transfer_outcome"]

#: What happened to a request.
Status = Literal["done", "failed", "partial"]


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """The result of one request.

    Attributes:
        status: ``"done"`` (every span copied), ``"failed"`` (nothing is known copied),
            ``"partial"`` (the spans outside :attr:`failed_spans` were copied).
        total: the request's size in its units (slot pairs; blocks for an engine).
        failed_spans: ``[start, stop)`` ranges of the request that were not copied (or
            may not have been), in order; empty when done.
        reason: one line saying why, None when done.
        error: the exception behind it, None when done.
    """

    status: Status
    total: int
    failed_spans: tuple[tuple[int, int], ...] = ()
    reason: str | None = None
    error: BaseException | None = field(default=None, compare=False)

    @property
    def done(self) -> bool:
        return self.status == "done"

    def raise_for_status(self) -> None:
        """Raise the error behind a failed or partial outcome (the reason as a note)."""
        if self.error is not None:
            self.error.add_note(f"transfer outcome: {self.status}, not copied: {list(self.failed_spans)}")
            raise self.error

    @classmethod
    def failure(cls, total: int, error: BaseException, spans: Sequence[tuple[int, int]] | None = None) -> TransferOutcome:
        """``failed`` when ``spans`` (default: the whole request) covers the request, else ``partial``."""
        failed = tuple(spans) if spans is not None else ((0, total),)
        covered = sum(b - a for a, b in failed)
        status: Status = "failed" if covered >= total else "partial"
        return cls(status, total, failed, f"{type(error).__name__}: {error}", error)


#: What a failing unit of work may raise and still be an outcome (anything else propagates).
OUTCOME_ERRORS: tuple[type[BaseException], ...] = (PointerDomainError, RuntimeError, OSError)


def _check_spans(total: object, spans: object) -> list[tuple[int, int]]:
    if type(total) is not int or total < 0:
        raise InvalidArgumentError(f"total must be an int >= 0, got {describe(total)}")
    if not isinstance(spans, Sequence):
        raise InvalidArgumentError(f"spans must be a sequence of (start, stop) pairs, got {type(spans).__name__}")
    out: list[tuple[int, int]] = []
    prev = 0
    for span in spans:
        if not (isinstance(span, tuple | list) and len(span) == 2 and all(type(v) is int for v in span)):
            raise InvalidArgumentError(f"spans: found {describe(span)}, expected a (start, stop) pair of ints")
        start, stop = span
        if not (start == prev and start <= stop <= total):
            raise InvalidArgumentError(
                f"spans: found {(start, stop)}, expected [start, stop) ranges in order that tile [0, total) with no "
                f"gap or overlap: this one must start at {prev} and end by total ({total}); nothing was run"
            )
        out.append((start, stop))
        prev = stop
    if prev != total:
        # an outcome speaks for the whole request: blocks no span runs would be reported copied
        raise InvalidArgumentError(
            f"spans: end at {prev}, but the request has total {total} blocks: [{prev}, {total}) would be reported "
            "copied without being run. Fix: give spans that tile [0, total); nothing was run"
        )
    return out


def run_spans(total: int, spans: Sequence[tuple[int, int]], run: Callable[[int, int], None]) -> TransferOutcome:
    """Run ``run(start, stop)`` for each span in order; the first that raises fails itself
    and every later span (they are not run). ``total``: the request's size; ``spans``:
    ``[start, stop)`` ranges that tile ``[0, total)`` in order (each starts where the one
    before it stopped, the first at 0, the last stops at ``total``; empty spans allowed),
    so ``done`` means every block ran.

    Raises:
        InvalidArgumentError: ``total`` is not an int >= 0, or the spans are not pairs of
            ints tiling ``[0, total)`` (inverted, a gap, an overlap, past ``total``, or
            ending before it); nothing is run.
    """
    spans = _check_spans(total, spans)
    for i, (start, stop) in enumerate(spans):
        try:
            run(start, stop)
        except OUTCOME_ERRORS as exc:
            return TransferOutcome.failure(total, exc, list(spans[i:]))
    return TransferOutcome("done", total)


def _check_chunk(chunk_slots: object, n: int) -> int:
    if chunk_slots is None:
        return max(n, 1)
    if type(chunk_slots) is not int or chunk_slots <= 0:
        raise InvalidArgumentError(f"chunk_slots must be a positive int or None, got {describe(chunk_slots)}")
    return chunk_slots


def _check_request(
    src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], src_indices: torch.Tensor,
    dst_indices: torch.Tensor, src_layout: KVLayout, dst_layout: KVLayout, stream: int | None, max_ctas: MaxCtas,
    backend: TransferBackend,
) -> None:
    """Every check one launch of the whole request would run, on the host, before any chunk
    is launched: chunks checked one by one would miss a destination slot written in two
    chunks, or a slot read in one and written in another, and would copy the chunks
    before a bad one."""
    # the launch's own checks and binding; not its path: each chunk's launch chooses its own
    # (refused paths fail at that chunk, as they did before the request check existed)
    layer_begin, layer_count = layer_range(src_layout, None)
    plan, _options, args, _host, _path = bind_call(src, src_layout, dst, dst_layout, src_indices, dst_indices,
                                                   layer_begin, layer_count, stream, max_ctas, backend, True, False)
    if plan.platform.is_capturing(plan.device):
        # a graph being captured runs nothing now: no outcome can say what was copied
        raise InvalidArgumentError(
            f"transfer_outcome: {plan.device}'s current stream is capturing a graph; nothing runs during capture, so "
            "no outcome can say what was copied. Fix: call transfer_kv_all_layer inside the capture and check the "
            "replay (pointerdomain.check_errors / synchronize after it), or call transfer_outcome outside capture"
        )
    if not args.n:
        return
    s_idx, d_idx = src_indices, dst_indices
    if s_idx.device != d_idx.device:  # the range check compares both on one device
        s_idx, d_idx = s_idx.cpu(), d_idx.cpu()
    plan.check_slot_range(s_idx, d_idx)  # range, and a destination slot named twice
    if plan.same_memory:
        overlap.check_slots(s_idx, d_idx, False)


def transfer_outcome(
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    src_layout: KVLayout,
    dst_layout: KVLayout,
    chunk_slots: int | None = None,
    stream: int | None = None,
    max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    backend: TransferBackend = "auto",
) -> TransferOutcome:
    """:func:`~pointerdomain.transfer_kv_all_layer` of ``n`` slot pairs in chunks of
    ``chunk_slots`` (default: one launch), then a drain of the tables' device
    (``pointerdomain.synchronize``: its queued work and its error word); see the module
    docstring for what each outcome means. The arguments are those of
    :func:`~pointerdomain.transfer_kv_all_layer` (indices: ``int64`` 1-D, equal length).
    The whole request is checked on the host before the first chunk runs (CUDA indices:
    one device sync): a check that fails makes a ``failed`` outcome over the whole request
    with the error the direct launch raises (``IndexValidationError``, ``OverlapError``,
    ``ClosedError``, ...), and nothing is written. Called while the device's stream
    captures a graph (nothing would run now, so no outcome could say what was copied): a
    ``failed`` outcome with ``InvalidArgumentError``, nothing captured.

    Returns:
        The outcome; ``failed_spans`` index the request's slot pairs ``[start, stop)``.

    Raises:
        InvalidArgumentError: ``chunk_slots`` is not a positive int or None. Every other
            error (bad tables, indices, a runtime failure) is in the outcome.
    """
    given = cast(object, src_indices)  # an untyped caller's non-tensor: the launch reports it in the outcome
    n = int(given.numel()) if isinstance(given, torch.Tensor) else 0
    step = _check_chunk(chunk_slots, n)
    spans = [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]
    try:
        _check_request(src, dst, src_indices, dst_indices, src_layout, dst_layout, stream, max_ctas, backend)
    except OUTCOME_ERRORS as exc:
        return TransferOutcome.failure(n, exc)  # nothing was launched

    def launch(start: int, stop: int) -> None:
        transfer_kv_all_layer(src, dst, src_indices[start:stop], dst_indices[start:stop], src_layout=src_layout,
                              dst_layout=dst_layout, stream=stream, max_ctas=max_ctas, backend=backend)

    outcome = run_spans(n, spans, launch)
    device = cast(object, getattr(src, "device", None))  # an untyped caller's bad table: its error is in the outcome
    if not isinstance(device, Device):
        return outcome
    try:
        launch_errors.synchronize(device)  # queued copies finished, and the error word read
    except OUTCOME_ERRORS as exc:  # a skipped slot, a destination twice, a runtime failure
        return TransferOutcome.failure(n, exc)  # which launch skipped is not recorded: the whole request
    return outcome


class TransferStream:
    """Requests on one device whose first failure latches (see the module docstring).

    Args:
        device: the device the requests' tables are for.

    Attributes:
        latched: the failed or partial outcome that latched the stream, or None.
    """

    def __init__(self, device: Device | str | torch.device) -> None:
        self.device = validate_device(device)
        self.latched: TransferOutcome | None = None
        self._lock = threading.Lock()

    def submit(
        self,
        src: PointerTable[DeviceAlias],
        dst: PointerTable[DeviceAlias],
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        *,
        src_layout: KVLayout,
        dst_layout: KVLayout,
        chunk_slots: int | None = None,
        stream: int | None = None,
        max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
        backend: TransferBackend = "auto",
    ) -> TransferOutcome:
        """:func:`transfer_outcome` of one request; a failed or partial outcome latches.

        Raises:
            LatchedError: an earlier request failed and :meth:`reset` was not called;
                nothing was launched.
            DeviceMismatchError: ``src`` or ``dst`` is a table of another device than the
                stream's (its :meth:`reset` would drain the wrong device); nothing was launched.
            InvalidArgumentError: as :func:`transfer_outcome`.
        """
        for name, table in (("src", src), ("dst", dst)):
            where = cast(object, getattr(table, "device", None))  # not a table: the outcome reports it
            if isinstance(where, Device) and where != self.device:
                raise DeviceMismatchError(
                    f"{name}: a table of {where}, but this transfer stream is for {self.device} (its reset() drains "
                    f"that device); nothing was launched. Fix: one TransferStream per device")
        with self._lock:
            self._check_unlatched()
            outcome = transfer_outcome(src, dst, src_indices, dst_indices, src_layout=src_layout,
                                       dst_layout=dst_layout, chunk_slots=chunk_slots, stream=stream,
                                       max_ctas=max_ctas, backend=backend)
            if not outcome.done:
                self.latched = outcome
            return outcome

    def run(self, total: int, spans: Sequence[tuple[int, int]], work: Callable[[int, int], None]) -> TransferOutcome:
        """:func:`run_spans` of other work on this stream (an engine's blocks); latches the same way.

        Raises:
            LatchedError: as :meth:`submit`.
            InvalidArgumentError: bad ``total`` or ``spans`` (as :func:`run_spans`); nothing
                is run and the stream does not latch.
        """
        with self._lock:
            self._check_unlatched()
            _check_spans(total, spans)
            outcome = run_spans(total, spans, work)
            if not outcome.done:
                self.latched = outcome
            return outcome

    def _check_unlatched(self) -> None:
        if self.latched is not None:
            raise LatchedError(
                f"transfer stream on {self.device} latched a {self.latched.status} outcome ({self.latched.reason}); "
                f"not copied: {list(self.latched.failed_spans)}. Nothing was launched. Fix: handle the failed "
                "request (its pages are not valid), then reset() the stream"
            )

    def reset(self) -> TransferOutcome | None:
        """Drain the device (every queued copy finishes before a buffer or page of the
        failed request is reused), then clear the latch. Returns the outcome that had
        latched, or None.

        Raises:
            IndexValidationError, OverlapError, RuntimeCallError: the drain found a new
                failure; the stream stays latched.
        """
        with self._lock:
            launch_errors.synchronize(self.device)
            latched, self.latched = self.latched, None
            return latched
