"""The batched copy contract: how :meth:`Backend.copy_runs` hands ``count`` copy
descriptors to the runtime, planned before anything is submitted.

``cudaMemcpyBatchAsync`` (CUDA >= 12.8) moves many descriptors in one call, under
rules that public failures have shown; each rule is a clause of the plan
(:func:`plan_copy_runs`), which the CUDA backend follows and the emulated backend
records (:class:`Submission`) so the CPU suite checks it:

* the legacy default stream (handle 0, or ``cudaStreamLegacy`` = 1) is refused by the
  batch call: such a batch runs on a side stream ordered after the legacy stream's
  earlier work and before its later work by two events (not by the implicit
  synchronisation of blocking streams, which a per-thread default stream lacks);
  ``cudaStreamPerThread`` (2) and created streams are taken as given;
* attributes: one attribute for every descriptor of a submission, given as
  ``numAttrs = 1`` entries of ``attrs`` and ``attrsIdxs = {0}`` (the driver reads
  ``numAttrs`` entries of both arrays: a count of descriptors there reads past them);
* at most :data:`MAX_DESCRIPTORS` descriptors per submission (one call with tens of
  thousands has hung), larger counts in consecutive submissions on the same stream;
* a stream being captured into a graph gets per-run copies (``cudaMemcpyAsync``, which a
  capture records): the batch call is not captured (it returns
  ``cudaErrorStreamCaptureUnsupported`` and the copy would be missing from the graph);
* HIP never takes the batch call: HIP batch copies have corrupted device memory when
  they overlapped a graph replay, and per-run copies have not; the HIP build has no
  batch call, and the plan refuses it for HIP whatever the build.

The C++ side (``src/kernels/transfer_gpu.cu``, ``copy_runs``) applies the same clauses
(the staged path calls it directly): the cap, the attribute arrays, the legacy stream's
side stream and the per-run copies while capturing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from pointerdomain.arguments import describe
from pointerdomain.errors import InvalidArgumentError

__all__ = ["LEGACY_STREAMS", "MAX_DESCRIPTORS", "Submission", "SubmitStream", "batch_allowed", "plan_copy_runs"]

#: Descriptors per batch submission at most (``kMaxBatchDescriptors`` in src/kernels/gpu.h).
MAX_DESCRIPTORS: Final = 8192

#: Stream handles that name the legacy default stream: the null stream and ``cudaStreamLegacy``.
LEGACY_STREAMS: Final = frozenset({0, 1})

#: Where a submission runs: the caller's stream, or the side stream ordered by events
#: before and after it (the batch call on the legacy stream).
SubmitStream = Literal["given", "ordered side stream"]


@dataclass(frozen=True, slots=True)
class Submission:
    """One call to the runtime for descriptors ``[first, first + count)``.

    Attributes:
        first: index of the submission's first descriptor.
        count: descriptors in it (>= 1; at most :data:`MAX_DESCRIPTORS` when batched).
        stream: the caller's stream (an int handle).
        submit_stream: where it runs (see :data:`SubmitStream`).
        batched: one batch call (True) or ``count`` per-run copies (False).
        attr_idxs: the batch call's ``attrsIdxs`` (``(0,)``); empty for per-run copies.
    """

    first: int
    count: int
    stream: int
    submit_stream: SubmitStream
    batched: bool
    attr_idxs: tuple[int, ...]

    @property
    def num_attrs(self) -> int:
        """The batch call's ``numAttrs``: the entries of ``attrs`` and ``attrsIdxs``."""
        return len(self.attr_idxs)


def batch_allowed(runtime: str, built: bool) -> bool:
    """Whether copies on ``runtime`` may take the batch call (``built``: the build has it):
    never on HIP (see the module docstring)."""
    return built and runtime != "hip"


def plan_copy_runs(count: int, stream: int, *, batched: bool, capturing: bool) -> tuple[Submission, ...]:
    """The submissions for ``count`` descriptors on ``stream``.

    Args:
        count: descriptors (>= 0; 0 plans nothing).
        stream: the caller's stream handle (an int in ``[0, 2**64)``).
        batched: the backend may take the batch call (:func:`batch_allowed`).
        capturing: ``stream`` is being captured into a graph.

    Raises:
        InvalidArgumentError: ``count`` or ``stream`` is not a non-negative int.
    """
    if type(count) is not int or count < 0:
        raise InvalidArgumentError(f"count: copy descriptors as an int >= 0, got {describe(count)}")
    if type(stream) is not int or not 0 <= stream < 2**64:
        raise InvalidArgumentError(f"stream: a stream handle as an int in [0, 2**64), got {describe(stream)}")
    if count == 0:
        return ()
    if not batched or capturing:
        return (Submission(0, count, stream, "given", False, ()),)
    where: SubmitStream = "ordered side stream" if stream in LEGACY_STREAMS else "given"
    return tuple(
        Submission(first, min(MAX_DESCRIPTORS, count - first), stream, where, True, (0,))
        for first in range(0, count, MAX_DESCRIPTORS)
    )
