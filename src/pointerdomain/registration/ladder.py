"""The registration ladder: what registration does when the driver refuses.

Rungs, top to bottom (:class:`Rung`); each registration records the rung it took
(:attr:`RegisteredHostMemory.rung <pointerdomain.RegisteredHostMemory>`) and why the
rungs above it failed (``ladder_record``):

1. ``single``: one registration call for the whole range (or the caller's own
   ``max_chunk_bytes`` cuts, which are not a degradation);
2. ``chunked``: page-aligned chunks of :attr:`RegistrationPolicy.chunk_bytes`, rounded
   down to the registration's granularity, so a cut never splits a page of the layout
   (one call near 512 GiB fails, vLLM #51080; Linux 6.11-6.13 cap one pin at 2 GB,
   TensorRT-LLM PR #17773);
3. ``pinned_copy``: for memory the library allocates (``alloc_registered``,
   ``HostKVPool``): the runtime allocates pinned memory (``cudaHostAlloc`` /
   ``hipHostMalloc``) and the bytes are copied in (Confidential Computing refuses
   ``cudaHostRegister`` at every size while ``cudaHostAlloc`` works, vLLM #55428);
4. ``unpinned``: only when :attr:`RegistrationPolicy.allow_unpinned`: nothing is
   registered; kernels refuse the memory (:class:`~pointerdomain.errors.UnpinnedMemoryError`)
   and only the copy engine reads it (it stages pageable memory itself).

Between ``chunked`` and ``pinned_copy``, on a device that reads pageable memory in
place (``PageableMemoryAccess`` and ``PageableMemoryAccessUsesHostPageTables`` both 1:
GH200, GB200, GB10), ``not_needed``: nothing is registered and kernels read the host VA
itself (:class:`~pointerdomain.registration.kinds.MemoryKind` ``device_accessible``).
There a registration refused with ``NotSupported`` is an answer, taken under either
policy without a warning; a copy to device memory in its place would move every byte
for nothing. A device without that access never takes this rung.

``foreign`` is not a rung but an outcome: the range was already registered by another
owner (UCX, NIXL, torch; status 712 or the runtime's pointer attributes), so it is used
without taking ownership and never unregistered (QUDA PR #1639, intel/llvm PR #21725).
``vmm_host`` is another: the range is VMM host memory (``cuMemCreate`` with a host
location, EGM), mapped for the device by its VMM handle, which owns it; it is never
registered nor unregistered.

How fast registration runs and how long one driver call may hold the driver
(:attr:`RegistrationPolicy.max_call_seconds`, ``prefault_threads``, ``huge_pages``) is
:mod:`pointerdomain.registration.pacing`.

With the default policy (``on_failure="fail"``) the first refusal raises, as before the
ladder; ``"degrade"`` climbs down, counts each rung taken (:func:`rung_counts`) and warns
once per cause (:class:`RegistrationDegradedWarning`).
"""

from __future__ import annotations

import enum
import math
import mmap
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pointerdomain.arguments import check_instance, describe
from pointerdomain.errors import InvalidRegistrationError

if TYPE_CHECKING:
    import torch

    from pointerdomain.devices import Device

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "RegistrationDegradedWarning",
    "RegistrationPolicy",
    "Rung",
    "default_policy",
    "note_rung",
    "probe_rungs",
    "reset_ladder_stats",
    "rung_counts",
    "set_default_policy",
    "warn_degraded",
]

#: Chunk size of the ``chunked`` rung, bytes: under the 2 GB single-pin cap of Linux 6.11-6.13.
DEFAULT_CHUNK_BYTES = 1 << 30


class Rung(str, enum.Enum):
    """How a registration was made (see the module docstring)."""

    SINGLE = "single"
    CHUNKED = "chunked"
    NOT_NEEDED = "not_needed"
    PINNED_COPY = "pinned_copy"
    UNPINNED = "unpinned"
    FOREIGN = "foreign"
    VMM_HOST = "vmm_host"


class RegistrationDegradedWarning(RuntimeWarning):
    """A registration took a lower rung of the ladder (once per cause and process)."""


@dataclass(frozen=True, slots=True)
class RegistrationPolicy:
    """What registration does when the driver refuses.

    Attributes:
        on_failure: ``"fail"`` raises the first refusal (the default); ``"degrade"`` climbs
            down the ladder and records why.
        chunk_bytes: chunk size of the ``chunked`` rung, bytes (> 0; rounded down to the
            registration's granularity, at least one granule).
        allow_pinned_copy: the ``pinned_copy`` rung may be used (library-allocated memory only).
        allow_unpinned: the ``unpinned`` rung may be used (kernels then refuse the memory).
        max_call_seconds: bound on one registration call, seconds (> 0), or None (calls
            of ``max_chunk_bytes``). The driver faults and pins pages inside the call while
            holding a lock other processes' calls wait on; with a bound, a first small call
            measures the rate and each later call is sized to end within the bound.
        prefault_threads: threads that fault the pages in (writable, contents kept) before
            the first registration call, so the driver pins populated pages instead of
            faulting them one by one under its lock; 0 (the default) leaves it to the driver.
        huge_pages: ``"thp"`` advises transparent huge pages (``madvise(MADV_HUGEPAGE)``)
            before the pages are faulted in; ``"hugetlbfs"`` takes memory the library
            allocates (``alloc_registered``, ``HostKVPool``) from the reserved huge-page pool
            (``MAP_HUGETLB``, 2 MiB pages; ``OutOfMemoryError`` naming the pool where it is
            short; not in strict alias mode); ``"off"`` leaves the system's setting. For a
            caller's tensor ``"hugetlbfs"`` changes nothing: its pages are what they are.
    """

    on_failure: Literal["fail", "degrade"] = "fail"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    allow_pinned_copy: bool = True
    allow_unpinned: bool = False
    max_call_seconds: float | None = None
    prefault_threads: int = 0
    huge_pages: Literal["off", "thp", "hugetlbfs"] = "off"

    def __post_init__(self) -> None:
        if self.on_failure not in ("fail", "degrade"):
            raise InvalidRegistrationError(f"on_failure must be 'fail' or 'degrade', got {describe(self.on_failure)}")
        if type(self.chunk_bytes) is not int or self.chunk_bytes <= 0:
            raise InvalidRegistrationError(f"chunk_bytes must be a positive int (bytes), got {describe(self.chunk_bytes)}")
        for name in ("allow_pinned_copy", "allow_unpinned"):
            if type(getattr(self, name)) is not bool:
                raise InvalidRegistrationError(f"{name} must be a bool, got {describe(getattr(self, name))}")
        bound = self.max_call_seconds
        if bound is not None and (type(bound) not in (int, float) or not math.isfinite(bound) or bound <= 0):
            raise InvalidRegistrationError(
                f"max_call_seconds: found {describe(bound)}, expected None or a finite number of seconds > 0. Fix: pass e.g. 0.25")
        if type(self.prefault_threads) is not int or not 0 <= self.prefault_threads <= 1024:
            raise InvalidRegistrationError(
                f"prefault_threads: found {describe(self.prefault_threads)}, expected an int in [0, 1024]. Fix: pass e.g. 8 "
                "(0: the driver faults the pages)")
        if self.huge_pages not in ("off", "thp", "hugetlbfs"):
            raise InvalidRegistrationError(
                f"huge_pages: found {describe(self.huge_pages)}, expected 'off', 'thp' or 'hugetlbfs'. Fix: pass one of them")


_lock = threading.Lock()
_default = RegistrationPolicy()
_counts: dict[Rung, int] = dict.fromkeys(Rung, 0)
_warned: set[str] = set()


def resolve_policy(policy: object) -> RegistrationPolicy:
    """``policy``, or the process default for None.

    Raises:
        InvalidTypeError: not a RegistrationPolicy (e.g. the string ``"degrade"``).
    """
    if policy is None:
        return default_policy()
    return check_instance("policy", policy, RegistrationPolicy,
                          'pass RegistrationPolicy(on_failure="degrade"), not the string, or None for the default')


def default_policy() -> RegistrationPolicy:
    """The policy used when a call passes none."""
    return _default


def set_default_policy(policy: RegistrationPolicy) -> RegistrationPolicy:
    """Make ``policy`` the process default; returns the previous one."""
    global _default
    if not isinstance(policy, RegistrationPolicy):
        raise InvalidRegistrationError(f"expected a RegistrationPolicy, got {type(policy).__name__}")
    with _lock:
        previous, _default = _default, policy
    return previous


def rung_counts() -> dict[str, int]:
    """Registrations made on each rung in this process (``{"single": n, ...}``)."""
    with _lock:
        return {rung.value: n for rung, n in _counts.items()}


def reset_ladder_stats() -> None:
    """Zero the counters and forget which causes were warned about (tests, doctor)."""
    with _lock:
        for rung in _counts:
            _counts[rung] = 0
        _warned.clear()


def note_rung(rung: Rung) -> None:
    """Count one registration made on ``rung``."""
    with _lock:
        _counts[rung] += 1


def warn_degraded(cause: str, message: str) -> None:
    """Warn ``message`` unless ``cause`` was warned about already in this process."""
    with _lock:
        if cause in _warned:
            return
        _warned.add(cause)
    warnings.warn(message, RegistrationDegradedWarning, stacklevel=4)


def probe_rungs(device: Device | str | torch.device, nbytes: int = 1 << 20) -> dict[str, str]:
    """Self-test of each rung on ``device`` (for ``pointerdomain doctor``): ``{rung: "ok" or
    why not}``. Makes real, small calls through the device's backend and undoes them:
    ``single`` one registration of ``nbytes``; ``chunked`` the same range in two page-aligned
    calls; ``not_needed`` reads the device's pageable-access attributes (on a coherent part
    a NotSupported from the first two is reported as recognised); ``pinned_copy`` one pinned
    allocation; ``unpinned`` needs no runtime call.

    Raises:
        InvalidDeviceError: the device does not exist.
    """
    from pointerdomain._platform import backend_for
    from pointerdomain._platform.base import PinnedAllocator
    from pointerdomain.devices import validate_device

    dev = validate_device(device)
    backend = backend_for(dev)
    out: dict[str, str] = {}
    from pointerdomain._platform.host_memory import vmm_allocation

    buf = backend.host_alloc(nbytes)
    if vmm_allocation(backend, buf.data_ptr(), dev) is not None:
        # the backend hands out VMM memory, which is never registered: probe ordinary pages instead
        import torch

        raw = torch.empty(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
        buf = raw[-raw.data_ptr() % mmap.PAGESIZE:][:nbytes]
    va = buf.data_ptr()
    half = (nbytes // 2) & ~(mmap.PAGESIZE - 1)

    def attempt(ranges: list[tuple[int, int]]) -> str:
        done: list[int] = []
        for start, size in ranges:
            code = backend.register(start, size, dev)
            if code != 0:
                for d in reversed(done):
                    backend.unregister(d, dev)
                return f"{backend.describe(code)} (error {code})"
            done.append(start)
        for d in reversed(done):
            backend.unregister(d, dev)
        return "ok"

    from pointerdomain._platform.host_memory import pageable_access

    access = pageable_access(backend, dev)
    recognised = f"not supported ({access.reason}: the not_needed rung serves)"
    out[Rung.SINGLE.value] = attempt([(va, nbytes)])
    out[Rung.CHUNKED.value] = attempt([(va, half), (va + half, nbytes - half)])
    for rung in (Rung.SINGLE.value, Rung.CHUNKED.value):
        if access.coherent and out[rung].endswith(f"(error {backend.status.not_supported})"):
            out[rung] = recognised  # an answer on a coherent part, not a failure
    out[Rung.NOT_NEEDED.value] = "ok (device reads pageable memory in place)" if access.coherent else access.reason
    if isinstance(backend, PinnedAllocator):
        status, pinned = backend.pinned_alloc(nbytes, dev)
        if status == 0 and pinned is not None:
            backend.pinned_release(pinned.data_ptr(), dev)
            out[Rung.PINNED_COPY.value] = "ok"
        else:
            out[Rung.PINNED_COPY.value] = f"{backend.describe(status)} (error {status})"
        del pinned
    else:
        out[Rung.PINNED_COPY.value] = f"the {backend.name} backend cannot allocate pinned memory"
    out[Rung.UNPINNED.value] = "ok (copy engine only)"
    return out
