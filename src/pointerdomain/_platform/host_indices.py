"""The host-side check of index arrays in host memory, in one native pass.

Where the indices are host memory (every launch on the emulated device, the copy
engine's and the staged path's host copies) the launch checks them on the host before
anything is copied: every slot inside its side's ``[0, num_slots)`` and no destination
slot twice. :func:`slots_problem` answers that in one native call (a Python pass costs
about a microsecond even for one slot); the caller words the error from the indices
when it says there is one.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["native_slots_problem", "slots_problem"]

#: ``slots_problem`` results
OK = 0
SRC_OUT_OF_RANGE = 1
DST_OUT_OF_RANGE = 2
DST_TWICE = 3


def _load() -> Callable[[int, int, int, int, int], int]:
    from pointerdomain import _C

    global _native
    _native = _C.host_slots_problem
    return _native


_native: Callable[[int, int, int, int, int], int] | None = None


def native_slots_problem() -> Callable[[int, int, int, int, int], int]:
    """:func:`slots_problem` itself, the native function (for a caller that binds it once:
    the launch path keeps it on the plan, no Python frame per launch)."""
    return _native or _load()


def slots_problem(src_idx: int, dst_idx: int, n: int, src_slots: int, dst_slots: int) -> int:
    """For ``n`` slot pairs of ``int64`` arrays in host memory at ``src_idx`` / ``dst_idx``:
    :data:`OK`, or the first problem found (:data:`SRC_OUT_OF_RANGE`,
    :data:`DST_OUT_OF_RANGE`, :data:`DST_TWICE`)."""
    native = _native or _load()
    return native(src_idx, dst_idx, n, src_slots, dst_slots)
