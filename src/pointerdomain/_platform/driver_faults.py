"""A backend that refuses registrations the way real drivers and kernels do, so the
registration ladder, rollback, ownership and messages are tested on
CPU. Wraps another backend (normally the emulated one) and is installed with
:func:`pointerdomain._platform.testing.install_backend`::

    with install_backend(DriverFaults(backend_for(dev), per_call_cap=2 << 30), "emulated"):
        ...

Each fault and the public report it imitates (docs/reliability.md):

* ``refuse_all=801``: every registration fails at every size (Confidential Computing:
  cudaHostRegister returns 801 while cudaHostAlloc works, vLLM #55428);
* ``per_call_cap``: one call larger than this fails (Linux 6.11-6.13 cap a single pin at
  2 GB, TensorRT-LLM PR #17773; one call near 512 GiB fails, vLLM #51080);
* ``total_cap``: pinned bytes of this backend beyond this fail;
* ``memlock``: an RLIMIT_MEMLOCK of this many bytes (containers: 8 MiB); the status is
  out-of-memory and :meth:`describe` names the limit;
* ``fail_at``: call number k (1-based, counting every register call) fails with a status;
* :meth:`register_foreign`: a range pinned by "another library" (UCX, NIXL, torch):
  registering over it gives 712, pointer attributes report it as host memory, and the
  library must never unregister it (:attr:`foreign_unregisters` counts attempts);
* ``refuse_pinned_alloc``: the pinned-allocation rung fails too.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pointerdomain._platform.base import Backend, PinnedAllocator
from pointerdomain._platform.delegating import DelegatingBackend

if TYPE_CHECKING:
    import torch

    from pointerdomain.devices import Device

__all__ = ["NOT_SUPPORTED", "DriverFaults"]

#: cudaErrorNotSupported: what cudaHostRegister returns under Confidential Computing.
NOT_SUPPORTED = 801


class DriverFaults(DelegatingBackend):
    """``inner`` with driver-like registration failures (see the module docstring).

    Attributes:
        register_calls: every register call as (va, nbytes, status returned).
        foreign_unregisters: unregister calls that hit a foreign range (must stay 0).
        pinned_calls: pinned allocations attempted.
    """

    def __init__(
        self,
        inner: Backend,
        *,
        refuse_all: int | None = None,
        per_call_cap: int | None = None,
        total_cap: int | None = None,
        memlock: int | None = None,
        fail_at: Mapping[int, int] | None = None,
        refuse_pinned_alloc: int | None = None,
    ) -> None:
        super().__init__(inner, "driver-faults")
        self.refuse_all = refuse_all
        self.per_call_cap = per_call_cap
        self.total_cap = total_cap
        self.memlock = memlock
        self.fail_at = dict(fail_at or {})
        self.refuse_pinned_alloc = refuse_pinned_alloc
        self.register_calls: list[tuple[int, int, int]] = []
        self.foreign_unregisters = 0
        self.pinned_calls = 0
        self._lock = threading.Lock()
        self._pinned: dict[int, int] = {}
        self._foreign: dict[int, tuple[int, Device]] = {}
        self._memlock_hit = False

    # the "other library" --------------------------------------------------------
    def register_foreign(self, va: int, nbytes: int, device: Device) -> int:
        """Pin ``[va, va + nbytes)`` as another owner would (through ``inner``): status."""
        status = self.inner.register(va, nbytes, device)
        if status == 0:
            self._foreign[va] = (nbytes, device)
        return status

    def unregister_foreign(self, va: int) -> int:
        """The other owner lets go of its range: status."""
        nbytes, device = self._foreign.pop(va)
        return self.inner.unregister(va, device)

    def _foreign_overlap(self, va: int, nbytes: int) -> bool:
        return any(f < va + nbytes and va < f + n for f, (n, _d) in self._foreign.items())

    # registration ---------------------------------------------------------------
    def _refusal(self, va: int, nbytes: int) -> int:
        k = len(self.register_calls) + 1
        if k in self.fail_at:
            return self.fail_at[k]
        codes = self.status  # the wrapped runtime's numbers
        if self._foreign_overlap(va, nbytes):
            return codes.already_registered
        if self.refuse_all is not None:
            return self.refuse_all
        if self.per_call_cap is not None and nbytes > self.per_call_cap:
            return codes.out_of_memory
        pinned = sum(self._pinned.values()) + nbytes
        if self.total_cap is not None and pinned > self.total_cap:
            return codes.out_of_memory
        if self.memlock is not None and pinned > self.memlock:
            self._memlock_hit = True
            return codes.out_of_memory
        return 0

    def register(self, va: int, nbytes: int, device: Device) -> int:
        with self._lock:
            status = self._refusal(va, nbytes) or self.inner.register(va, nbytes, device)
            self.register_calls.append((va, nbytes, status))
            if status == 0:
                self._pinned[va] = nbytes
            return status

    def unregister(self, va: int, device: Device) -> int:
        with self._lock:
            if va in self._foreign or self._foreign_overlap(va, 1):
                self.foreign_unregisters += 1
                return 0  # refused silently, as a real unregister of a foreign pin would "succeed"
            if va not in self._pinned:
                return self.status.not_registered
            del self._pinned[va]
            return self.inner.unregister(va, device)

    def pinned_bytes(self) -> int:
        """Bytes this backend holds registered for the library (foreign ranges excluded)."""
        with self._lock:
            return sum(self._pinned.values())

    def describe(self, code: int) -> str:
        if code == self.status.out_of_memory and self._memlock_hit:
            return f"out of memory: RLIMIT_MEMLOCK ({self.memlock} bytes, injected) reached"
        if code == NOT_SUPPORTED:
            return "operation not supported (injected: host registration refused at every size)"
        return self.inner.describe(code)

    # pinned allocation (the ladder's third rung) ------------------------------------
    def pinned_alloc(self, nbytes: int, device: Device) -> tuple[int, torch.Tensor | None]:
        self.pinned_calls += 1
        if self.refuse_pinned_alloc is not None:
            return self.refuse_pinned_alloc, None
        if not isinstance(self.inner, PinnedAllocator):
            return NOT_SUPPORTED, None
        return self.inner.pinned_alloc(nbytes, device)

    def pinned_release(self, va: int, device: Device) -> None:
        if isinstance(self.inner, PinnedAllocator):
            self.inner.pinned_release(va, device)

    # everything else: the inner backend's (DelegatingBackend) ------------------------
    def pointer_is_host(self, ptr: int) -> bool:
        return self._foreign_overlap(ptr, 1) or self.inner.pointer_is_host(ptr)
