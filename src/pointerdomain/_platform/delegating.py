"""A backend that forwards every call to another one: the base of the wrapping test
backends (:mod:`~pointerdomain._platform.faulty`, :mod:`~pointerdomain._platform.driver_faults`),
which override only the calls they fault, so a new :class:`~pointerdomain._platform.base.Backend`
method is forwarded in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pointerdomain._platform.base import (
    Backend,
    DeviceAttributeName,
    LaunchArgs,
    LayerSignals,
    LayerWords,
    PointerQuery,
    RuntimeTraits,
    StagedCopy,
    StagingArgs,
)
from pointerdomain._platform.host_memory import VmmAllocation, vmm_allocation
from pointerdomain._platform.graph_holds import CaptureCount, GraphHolder, HeldGraph
from pointerdomain.errors import ExtensionUnavailableError

if TYPE_CHECKING:
    import torch

    from pointerdomain._C import KernelPlan
    from pointerdomain._platform.pointer_query import PointerInfo
    from pointerdomain.devices import Device

__all__ = ["DelegatingBackend"]


class DelegatingBackend(RuntimeTraits):
    """``inner``'s behaviour, call for call, under the name ``f"{label}({inner.name})"``."""

    def __init__(self, inner: Backend, label: str) -> None:
        self.inner = inner
        self.name = f"{label}({inner.name})"
        self.runtime = inner.runtime
        self.has_alias_op = inner.has_alias_op
        self.host_readable = inner.host_readable

    def register(self, va: int, nbytes: int, device: Device) -> int:
        return self.inner.register(va, nbytes, device)

    def unregister(self, va: int, device: Device) -> int:
        return self.inner.unregister(va, device)

    def describe(self, code: int) -> str:
        return self.inner.describe(code)

    def alias(self, va: int, device: Device) -> tuple[int, int]:
        return self.inner.alias(va, device)

    def pointer_is_host(self, ptr: int) -> bool:
        return self.inner.pointer_is_host(ptr)

    def vmm_allocation(self, addr: int, device: Device) -> VmmAllocation | None:
        return vmm_allocation(self.inner, addr, device)

    def memory_generation(self) -> int:
        count: int = getattr(self.inner, "memory_generation", lambda: 0)()
        return count

    def pointer_info(self, addr: int) -> PointerInfo | None:
        return self.inner.pointer_info(addr) if isinstance(self.inner, PointerQuery) else None

    def device_lookup(self, addr: int, nbytes: int) -> int:
        return self.inner.device_lookup(addr, nbytes)

    def device_count(self) -> int:
        return self.inner.device_count()

    def can_use_host_pointer(self, device: Device) -> int | None:
        return self.inner.can_use_host_pointer(device)

    def device_name(self, device: Device) -> str:
        return self.inner.device_name(device)

    def device_attribute(self, name: DeviceAttributeName, device: Device) -> int | None:
        return self.inner.device_attribute(name, device)

    def free_device_memory(self, device: Device) -> int | None:
        return self.inner.free_device_memory(device)

    def host_alloc(self, nbytes: int) -> torch.Tensor:
        return self.inner.host_alloc(nbytes)

    def shareable_host_alloc(self, nbytes: int) -> torch.Tensor:
        return self.inner.shareable_host_alloc(nbytes)

    def device_alloc(self, nbytes: int, device: Device) -> torch.Tensor:
        return self.inner.device_alloc(nbytes, device)

    def current_stream(self, device: Device) -> int:
        return self.inner.current_stream(device)

    def is_capturing(self, device: Device) -> bool:
        return self.inner.is_capturing(device)

    def graph_hold(self, device: Device, stream: int) -> HeldGraph | None:
        return self.inner.graph_hold(device, stream) if isinstance(self.inner, GraphHolder) else None

    @property
    def graph_captures(self) -> CaptureCount | None:
        """The inner backend's count of open captures (:class:`GraphHolder`); a wrapper
        that overrides :meth:`graph_hold` must answer None here."""
        captures: CaptureCount | None = getattr(self.inner, "graph_captures", None)
        return captures

    def load_kernels(self, device: Device) -> None:
        self.inner.load_kernels(device)

    def launch(self, plan: KernelPlan, args: LaunchArgs) -> None:
        self.inner.launch(plan, args)

    def launch_recorded(self, plan: KernelPlan, args: LaunchArgs) -> int:
        # Two calls, not the inner one: a wrapper that overrides launch or record_event
        # (faults, blocking test backends) sees every kernel launch and record.
        self.launch(plan, args)
        return self.record_event(args.device, args.stream)

    def record_event(self, device: Device, stream: int) -> int:
        return self.inner.record_event(device, stream)

    def event_done(self, event: int) -> bool:
        return self.inner.event_done(event)

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: Device, stream: int) -> None:
        self.inner.copy_runs(dsts, srcs, sizes, count, device, stream)

    def staged_available(self) -> bool:
        inner = self.inner
        return isinstance(inner, StagedCopy) and inner.staged_available()

    def staged(self, plan: KernelPlan, args: LaunchArgs, staging: StagingArgs) -> None:
        inner = self.inner
        if not isinstance(inner, StagedCopy):
            raise ExtensionUnavailableError(f"the {inner.name} backend has no staged copy-engine path")
        inner.staged(plan, args, staging)

    def _layers(self) -> LayerSignals:
        inner = self.inner
        if not isinstance(inner, LayerSignals):
            raise ExtensionUnavailableError(f"the {inner.name} backend has no layer pipeline")
        return inner

    def layer_words(self, device: Device, capacity: int) -> LayerWords:
        return self._layers().layer_words(device, capacity)

    def capturing(self, device: Device, stream: int) -> bool:
        return self._layers().capturing(device, stream)

    def launch_layers(self, plan: KernelPlan, args: LaunchArgs, words: LayerWords, gen: int) -> int:
        return self._layers().launch_layers(plan, args, words, gen)

    def signal_layer(self, words: LayerWords, index: int, gen: int, device: Device, stream: int) -> None:
        self._layers().signal_layer(words, index, gen, device, stream)

    def wait_layer(self, words: LayerWords, index: int, gen: int, device: Device, stream: int) -> None:
        self._layers().wait_layer(words, index, gen, device, stream)

    def layer_flag(self, words: LayerWords, index: int) -> int:
        return self._layers().layer_flag(words, index)

    def wait_event_done(self, event: int) -> None:
        self._layers().wait_event_done(event)

    def synchronize(self, device: Device) -> None:
        self.inner.synchronize(device)
