"""Registration calls sized so no single driver call runs longer than a bound.

A registration call holds a driver-global lock while it faults and pins pages; another
process's driver calls (``cudaMemGetInfo``, launches, allocations) wait meanwhile. One
call over a 64 GiB pool can stall every neighbour for tens of seconds. With
:attr:`RegistrationPolicy.max_call_seconds <pointerdomain.registration.ladder.RegistrationPolicy>`
set, :func:`register_in_calls` makes a first small call, measures the rate (seconds per
byte), and sizes every later call to end within 3/4 of the bound at the slowest rate of the
last four calls (growing at most 4x per call, never past ``max_chunk_bytes``), so a
slower stretch of memory shrinks the next call instead of stretching the stall. The bound
holds while no call runs more than a third slower than the slowest of the four before
it; the first call, of :data:`PROBE_BYTES` or 1/64 of the range, is the one sized blind.

Every registration records its calls (:class:`RegistrationStats`, the owner's
``stats``) and the process keeps totals (:func:`registration_counters`, shown by
``pointerdomain doctor --json``): seconds per GiB, the longest single call, the
prefault time and the huge-page share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pointerdomain.registration.prefault import NONE, PrefaultReport

__all__ = [
    "CLOCK",
    "PROBE_BYTES",
    "RegistrationStats",
    "Stopwatch",
    "note_registration",
    "register_in_calls",
    "registration_counters",
    "reset_registration_counters",
]

#: Size of the first, measuring call of a bounded registration, bytes (at most 1/64 of
#: the range, at least one granule). Its rate is not known before it runs: the bound
#: holds from the second call on.
PROBE_BYTES = 16 << 20
_TARGET = 0.75  # of the bound: room for the rate to vary between calls
_GROWTH = 4
_WINDOW = 4  # calls whose slowest rate sizes the next one


@dataclass(frozen=True, slots=True)
class RegistrationStats:
    """How one registration ran.

    Attributes:
        calls: registration calls made (all chunks; 0 where nothing was registered).
        call_seconds: total seconds inside registration calls.
        longest_call_s: the longest single call, seconds.
        seconds_per_gib: ``call_seconds`` per GiB registered (None: nothing registered).
        max_call_seconds: the bound asked for (None: none).
        prefault: what the prefault did (:class:`~pointerdomain.registration.prefault.PrefaultReport`).
        huge_page_share: share of the range's resident memory on huge pages, read when the
            policy asked for huge pages (``huge_pages="thp"``); None otherwise or where unknown.
    """

    calls: int = 0
    call_seconds: float = 0.0
    longest_call_s: float = 0.0
    seconds_per_gib: float | None = None
    max_call_seconds: float | None = None
    prefault: PrefaultReport = NONE
    huge_page_share: float | None = None

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return asdict(self)


#: The clock registration calls are timed with (a test may put a fake one here).
CLOCK: Callable[[], float] = time.perf_counter


class Stopwatch:
    """Durations of the registration calls of one registration (thread-confined)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = CLOCK if clock is None else clock
        self.durations: list[float] = []
        self.nbytes = 0

    def stats(self, max_call_seconds: float | None, prefault: PrefaultReport,
              huge_page_share: float | None) -> RegistrationStats:
        total = sum(self.durations)
        per_gib = total / (self.nbytes / (1 << 30)) if self.nbytes else None
        return RegistrationStats(len(self.durations), total, max(self.durations, default=0.0), per_gib,
                                 max_call_seconds, prefault, huge_page_share)


def register_in_calls(
    nbytes: int, granularity: int, cap: int, max_call_seconds: float | None,
    call: Callable[[int, int], int], watch: Stopwatch,
) -> tuple[int, int, int]:
    """Register ``nbytes`` through ``call(offset, length) -> status`` in calls of at most
    ``cap`` bytes (a multiple of ``granularity``), each cut on a multiple of
    ``granularity`` from the start; with ``max_call_seconds``, sized from the measured rate
    (see the module docstring). Stops at the first failing call.

    Returns:
        (status of the last call, calls made, calls planned: exact without a bound, else
        the calls made plus those the last rate predicts).
    """
    if max_call_seconds is None:
        planned = -(-nbytes // cap)
        for k, start in enumerate(range(0, nbytes, cap)):
            status = _timed(call, start, min(cap, nbytes - start), watch)
            if status != 0:
                return status, k + 1, planned
        return 0, planned, planned
    size = max(granularity, min(cap, PROBE_BYTES, nbytes // 64) // granularity * granularity)
    start = made = 0
    rates: list[float] = []
    while start < nbytes:
        length = min(size, nbytes - start)
        status = _timed(call, start, length, watch)
        made += 1
        if status != 0:
            left = nbytes - start - length
            return status, made, made + (-(-left // max(size, 1)) if left > 0 else 0)
        start += length
        rates.append(watch.durations[-1] / length)  # seconds per byte, of this stretch of memory
        rate = max(rates[-_WINDOW:])  # the slowest recent call: one fast call must not size a long one
        want = int(_TARGET * max_call_seconds / rate) if rate > 0 else cap
        size = max(granularity, min(cap, _GROWTH * length, want) // granularity * granularity)
    return 0, made, made


def _timed(call: Callable[[int, int], int], start: int, length: int, watch: Stopwatch) -> int:
    t0 = watch.clock()
    status = call(start, length)
    watch.durations.append(watch.clock() - t0)
    if status == 0:
        watch.nbytes += length
    return status


_lock = threading.Lock()
_totals: dict[str, float] = {}


def reset_registration_counters() -> None:
    """Zero the process-wide counters (tests, benchmarks)."""
    with _lock:
        _totals.clear()
        _totals.update(registrations=0, bytes=0, calls=0, call_seconds=0.0, longest_call_s=0.0,
                       prefault_seconds=0.0, not_needed=0, vmm_host=0)
        _last.clear()


_last: dict[str, object] = {}
reset_registration_counters()


def note_registration(stats: RegistrationStats, nbytes: int, kind: str) -> None:
    """Add one registration's record to the process totals."""
    with _lock:
        _totals["registrations"] += 1
        _totals["calls"] += stats.calls
        _totals["call_seconds"] += stats.call_seconds
        _totals["longest_call_s"] = max(_totals["longest_call_s"], stats.longest_call_s)
        _totals["prefault_seconds"] += stats.prefault.seconds
        if stats.calls:
            _totals["bytes"] += nbytes
        if kind in ("device_accessible", "vmm_host"):
            _totals["not_needed" if kind == "device_accessible" else "vmm_host"] += 1
        _last.update(huge_page_share=stats.huge_page_share, seconds_per_gib=stats.seconds_per_gib,
                     longest_call_s=stats.longest_call_s)


def registration_counters() -> dict[str, object]:
    """The process's registration totals: registrations, bytes registered through calls,
    calls, seconds in calls, ``seconds_per_gib`` over all of them, the longest single call,
    prefault seconds, registrations that needed no call (``not_needed``: device-accessible
    memory; ``vmm_host``), and the last registration's figures (``last``)."""
    with _lock:
        out: dict[str, object] = dict(_totals)
        gib = _totals["bytes"] / (1 << 30)
        out["seconds_per_gib"] = _totals["call_seconds"] / gib if gib else None
        out["last"] = dict(_last)
    for key in ("registrations", "bytes", "calls", "not_needed", "vmm_host"):
        out[key] = int(out[key])  # type: ignore[call-overload]
    return out
