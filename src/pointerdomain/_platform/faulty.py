"""A fault-injecting backend for tests: another backend with chosen calls failing.

It is also the example of adding a backend: this one file, installed with
:func:`pointerdomain._platform.testing.install_backend` (a permanent backend is
registered with :func:`pointerdomain._platform.register_backend`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pointerdomain._platform.base import Backend, LaunchArgs, LayerWords, PinnedAllocator, StagingArgs
from pointerdomain._platform.delegating import DelegatingBackend
from pointerdomain._platform.status import check, check_staged

if TYPE_CHECKING:
    import torch

    from pointerdomain._C import KernelPlan
    from pointerdomain.devices import Device

__all__ = ["FaultyBackend"]


class FaultyBackend(DelegatingBackend):
    """``inner`` with faults.

    Args:
        inner: the backend that does the work.
        fail: call name (``"register"``, ``"unregister"``, ``"launch"``, ``"copy_runs"``,
            ``"staged"``, ``"pinned_alloc"``)
            -> {call number (1-based) -> status to fail with}. A failing ``register`` /
            ``unregister`` / ``pinned_alloc`` returns the status without calling ``inner``; a
            failing ``launch`` / ``copy_runs`` / ``staged`` raises the typed error for it
            (``launch`` counts the layer pipeline's kernel launches too).

    The double allocates pinned memory (the ladder's ``pinned_copy`` rung,
    :class:`~pointerdomain._platform.base.PinnedAllocator`) exactly when ``inner`` does, so
    the ladder climbs the same rungs under it as under ``inner``. (A subclass is a
    ``PinnedAllocator`` only if it defines those calls itself.)

    Attributes:
        calls: how many times each faultable call was made (``"pinned_alloc"`` from its
            first call on).
    """

    def __new__(cls, *args: object, **kwargs: object) -> FaultyBackend:
        # PinnedAllocator is structural: only a double over a pinned allocator may have its
        # calls. Subclasses (their own constructors) keep the calls they define.
        inner = args[0] if args else kwargs.get("inner")
        if cls is FaultyBackend and isinstance(inner, PinnedAllocator):
            cls = _PinnedFaultyBackend
        return super().__new__(cls)

    def __init__(self, inner: Backend, fail: Mapping[str, Mapping[int, int]]) -> None:
        super().__init__(inner, "faulty")
        self.fail = {name: dict(at) for name, at in fail.items()}
        self.calls = {"register": 0, "unregister": 0, "launch": 0, "copy_runs": 0, "staged": 0}

    def _fault(self, call: str) -> int:
        self.calls[call] = self.calls.get(call, 0) + 1
        return self.fail.get(call, {}).get(self.calls[call], 0)

    def register(self, va: int, nbytes: int, device: Device) -> int:
        return self._fault("register") or self.inner.register(va, nbytes, device)

    def unregister(self, va: int, device: Device) -> int:
        return self._fault("unregister") or self.inner.unregister(va, device)

    def launch(self, plan: KernelPlan, args: LaunchArgs) -> None:
        check(self, "transfer kernel launch", self._fault("launch"))
        self.inner.launch(plan, args)

    def launch_layers(self, plan: KernelPlan, args: LaunchArgs, words: LayerWords, gen: int) -> int:
        # the layer pipeline's kernel launch is a launch too: the same fault, counted alike
        check(self, "transfer kernel launch", self._fault("launch"))
        return super().launch_layers(plan, args, words, gen)

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: Device, stream: int) -> None:
        check(self, "copy runs", self._fault("copy_runs"))
        self.inner.copy_runs(dsts, srcs, sizes, count, device, stream)

    def staged(self, plan: KernelPlan, args: LaunchArgs, staging: StagingArgs) -> None:
        check_staged(self, self._fault("staged"))
        super().staged(plan, args, staging)


class _PinnedFaultyBackend(FaultyBackend):
    """A :class:`FaultyBackend` over a :class:`PinnedAllocator`: forwards its pinned calls."""

    def pinned_alloc(self, nbytes: int, device: Device) -> tuple[int, torch.Tensor | None]:
        code = self._fault("pinned_alloc")
        if code:
            return code, None
        inner = self.inner
        assert isinstance(inner, PinnedAllocator)  # chosen so in FaultyBackend.__new__
        return inner.pinned_alloc(nbytes, device)

    def pinned_release(self, va: int, device: Device) -> None:
        inner = self.inner
        assert isinstance(inner, PinnedAllocator)
        inner.pinned_release(va, device)
