"""A backend that refuses the registration calls of the rungs above a target rung, so a
rank re-registers where the rest of its group is (``on_mismatch="match"``). Installed for
the calling thread only (:func:`pointerdomain._platform.scoped_backend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pointerdomain._platform.base import Backend, PinnedAllocator
from pointerdomain._platform.delegating import DelegatingBackend
from pointerdomain.registration.ladder import Rung

if TYPE_CHECKING:
    import torch

    from pointerdomain.devices import Device

__all__ = ["REFUSED", "RungCap"]

#: The status of a refused call (cudaErrorNotSupported, the code Confidential Computing
#: gives): never 712, which the ladder treats as another owner's registration.
REFUSED = 801


class RungCap(DelegatingBackend):
    """``inner``, except that registration calls above ``target`` are refused:
    ``chunked``: calls of more than ``chunk_bytes``; ``pinned_copy``: every registration
    call; ``unpinned``: those and pinned allocations too."""

    def __init__(self, inner: Backend, target: Rung, chunk_bytes: int) -> None:
        super().__init__(inner, "group-rung-cap")
        self.target = target
        self.chunk_bytes = chunk_bytes
        prepare = getattr(inner, "prepare", None)  # the emulated backend's one memfd for chunked registrations
        if prepare is not None:
            self.prepare = prepare

    def register(self, va: int, nbytes: int, device: Device) -> int:
        if self.target is Rung.CHUNKED and nbytes <= self.chunk_bytes:
            return self.inner.register(va, nbytes, device)
        if self.target in (Rung.SINGLE, Rung.FOREIGN):
            return self.inner.register(va, nbytes, device)
        return REFUSED

    def describe(self, code: int) -> str:
        if code == REFUSED:
            return (f"not tried: the process group registered on the {self.target.value!r} rung "
                    "(pointerdomain.distributed.register_group, on_mismatch='match')")
        return self.inner.describe(code)

    def pinned_alloc(self, nbytes: int, device: Device) -> tuple[int, torch.Tensor | None]:
        if self.target is Rung.UNPINNED or not isinstance(self.inner, PinnedAllocator):
            return REFUSED, None
        return self.inner.pinned_alloc(nbytes, device)

    def pinned_release(self, va: int, device: Device) -> None:
        if isinstance(self.inner, PinnedAllocator):
            self.inner.pinned_release(va, device)
