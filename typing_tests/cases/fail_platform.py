"""The platform layer's Backend protocol (pointerdomain._platform): raw ints in,
exact arity, the bound launch plan rather than loose geometry; the test hook
takes a device type name."""

from __future__ import annotations

from pointerdomain import Device, DeviceAlias, HostVA, PointerTable, _C
from pointerdomain._platform import Backend, LaunchArgs, backend_for
from pointerdomain._platform.testing import install_backend


def platform(va: HostVA, table: PointerTable[DeviceAlias], plan: _C.KernelPlan, geometry: tuple[int, ...]) -> None:
    dev = Device("emulated", 0)
    backend: Backend = backend_for(dev)
    # Wrong arity.
    backend.register(va.value, 4096)  # type: ignore[call-arg]
    backend.alias(va.value)  # type: ignore[call-arg]
    backend.launch(plan)  # type: ignore[call-arg]
    # An address object or a table where the backend takes a raw int.
    backend.unregister(va, dev)  # type: ignore[arg-type]
    backend.copy_runs(table, 0, 0, 1, dev, 0)  # type: ignore[arg-type]
    # A loose geometry where the launch takes the bound plan; an ordinal where it takes a Device.
    backend.launch(geometry, LaunchArgs(0, 0, 1, 0, 1, dev, 0, 4))  # type: ignore[arg-type]
    backend.device_alloc(4096, 0)  # type: ignore[arg-type]
    # The hook takes the device type's name.
    install_backend(backend, dev)  # type: ignore[arg-type]
    backend_for("emulated:0")  # type: ignore[arg-type]
