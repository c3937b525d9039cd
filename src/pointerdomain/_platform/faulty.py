"""A fault-injecting backend for tests: another backend with chosen calls failing.

It is also the example of adding a backend: this one file, installed with
:func:`pointerdomain._platform.testing.install_backend` (a permanent backend is
registered with :func:`pointerdomain._platform.register_backend`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pointerdomain._platform.base import Backend, DeviceAttributeName
from pointerdomain._platform.status import check, check_staged

if TYPE_CHECKING:
    import torch

    from pointerdomain._C import KernelPlan
    from pointerdomain.devices import Device

__all__ = ["FaultyBackend"]


class FaultyBackend:
    """``inner`` with faults.

    Args:
        inner: the backend that does the work.
        fail: call name (``"register"``, ``"unregister"``, ``"launch"``, ``"copy_runs"``,
            ``"staged_transfer"``)
            -> {call number (1-based) -> status to fail with}. A failing ``register`` /
            ``unregister`` returns the status without calling ``inner``; a failing
            ``launch`` / ``copy_runs`` / ``staged_transfer`` raises the typed error for it.

    Attributes:
        calls: how many times each faultable call was made.
    """

    def __init__(self, inner: Backend, fail: Mapping[str, Mapping[int, int]]) -> None:
        self.inner = inner
        self.fail = {name: dict(at) for name, at in fail.items()}
        self.calls = {"register": 0, "unregister": 0, "launch": 0, "copy_runs": 0, "staged_transfer": 0}
        self.name = f"faulty({inner.name})"
        self.runtime = inner.runtime
        self.has_alias_op = inner.has_alias_op
        self.host_readable = inner.host_readable

    def _fault(self, call: str) -> int:
        self.calls[call] += 1
        return self.fail.get(call, {}).get(self.calls[call], 0)

    def register(self, va: int, nbytes: int, device: Device) -> int:
        return self._fault("register") or self.inner.register(va, nbytes, device)

    def unregister(self, va: int, device: Device) -> int:
        return self._fault("unregister") or self.inner.unregister(va, device)

    def describe(self, code: int) -> str:
        return self.inner.describe(code)

    def alias(self, va: int, device: Device) -> tuple[int, int]:
        return self.inner.alias(va, device)

    def pointer_is_host(self, ptr: int) -> bool:
        return self.inner.pointer_is_host(ptr)

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

    def device_alloc(self, nbytes: int, device: Device) -> torch.Tensor:
        return self.inner.device_alloc(nbytes, device)

    def current_stream(self, device: Device) -> int:
        return self.inner.current_stream(device)

    def is_capturing(self, device: Device) -> bool:
        return self.inner.is_capturing(device)

    def launch(
        self, plan: KernelPlan, src_idx: int, dst_idx: int, n: int, layer_begin: int, layer_count: int,
        device: Device, stream: int, max_ctas: int,
    ) -> None:
        check(self, "transfer kernel launch", self._fault("launch"))
        self.inner.launch(plan, src_idx, dst_idx, n, layer_begin, layer_count, device, stream, max_ctas)

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: Device, stream: int) -> None:
        check(self, "copy runs", self._fault("copy_runs"))
        self.inner.copy_runs(dsts, srcs, sizes, count, device, stream)

    def staged_available(self) -> bool:
        return self.inner.staged_available()

    def staged_transfer(
        self, plan: KernelPlan, src_idx: int, dst_idx: int, n: int, layer_begin: int, layer_count: int,
        host_is_src: bool, host_table: int, host_idx: int, staging: int, staging_bytes: int, ring: int,
        device: Device, stream: int, max_ctas: int,
    ) -> None:
        check_staged(self, self._fault("staged_transfer"))
        self.inner.staged_transfer(plan, src_idx, dst_idx, n, layer_begin, layer_count, host_is_src, host_table,
                                   host_idx, staging, staging_bytes, ring, device, stream, max_ctas)

    def synchronize(self, device: Device) -> None:
        self.inner.synchronize(device)
