"""Test doubles for code that uses pointerdomain (the ``numpy.testing`` pattern): run a
block with another backend for a device type, backends that fail chosen calls, and a profile
whose device aliases are >= 2**63 (:class:`TopBitAliases`). (A host the memory budget sees
differently: ``pointerdomain.registration.budget.simulated_host``.)

Example (fail the third registration call with status 2)::

    import pointerdomain as pd
    from pointerdomain.testing import FaultyBackend, backend_for, install_backend

    dev = pd.Device("emulated", 0)
    with install_backend(FaultyBackend(backend_for(dev), fail={"register": {3: 2}}), "emulated"):
        ...  # every backend_for(Device("emulated", n)) returns the faulty backend

:class:`EmulatedGraph` stands in for a CUDA graph on the emulated device (capture,
replay, reset), so code that captures transfers is tested on CPU.

A double is a :class:`Backend`; :class:`DelegatingBackend` forwards every call to another
one, so a double overrides only the calls it changes. ``EmulatedBackend``,
``TorchCudartBackend``, ``KernelPlan`` and ``load_cudart`` need the extension and are imported on first use.
Also here for tests that drive the platform directly: :func:`kernel_plan` (a launch struct),
:func:`default_device` (the device the CLI picks), :func:`load_cudart` (libcudart by ctypes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pointerdomain._platform import backend_for, default_device, kernel_plan
from pointerdomain._platform.base import Backend, DeviceAttributeName, LaunchArgs, StagingArgs
from pointerdomain._platform.delegating import DelegatingBackend
from pointerdomain._platform.driver_faults import NOT_SUPPORTED, DriverFaults
from pointerdomain._platform.faulty import FaultyBackend
from pointerdomain._platform.graph_holds import EmulatedGraph
from pointerdomain._platform.host_memory import VmmAllocation, VmmLocation, pageable_access
from pointerdomain._platform.status import NOT_REGISTERED
from pointerdomain._platform.testing import install_backend
from pointerdomain._platform.top_bit import TOP_BIT, TopBitAliases

if TYPE_CHECKING:
    from pointerdomain._platform.cuda import TorchCudartBackend
    from pointerdomain._platform.cuda import load_cudart
    from pointerdomain._platform.emulated import EmulatedBackend
    from pointerdomain._platform.native import KernelPlan

__all__ = [
    "NOT_REGISTERED",
    "NOT_SUPPORTED",
    "TOP_BIT",
    "Backend",
    "DelegatingBackend",
    "DeviceAttributeName",
    "DriverFaults",
    "EmulatedBackend",
    "EmulatedGraph",
    "FaultyBackend",
    "KernelPlan",
    "LaunchArgs",
    "StagingArgs",
    "TopBitAliases",
    "TorchCudartBackend",
    "VmmAllocation",
    "VmmLocation",
    "backend_for",
    "default_device",
    "install_backend",
    "kernel_plan",
    "load_cudart",
    "pageable_access",
]

#: the doubles whose modules import the extension: loaded on first use
_NATIVE = {
    "EmulatedBackend": "pointerdomain._platform.emulated",
    "TorchCudartBackend": "pointerdomain._platform.cuda",
    "load_cudart": "pointerdomain._platform.cuda",
    "KernelPlan": "pointerdomain._platform.native",
}


def __getattr__(name: str) -> object:
    module = _NATIVE.get(name)
    if module is None:
        raise AttributeError(f"module 'pointerdomain.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
