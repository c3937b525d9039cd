"""The platform layer: the only code that imports the compiled extension (``_C``).

Everything the library asks of a platform goes through a :class:`Backend`
(``base.py``): registration, device aliases, pointer queries, device
attributes, allocation, launches, copy-engine runs and synchronisation. One
module per backend:

* ``emulated.py``: the CPU stand-in whose aliases differ from host VAs;
* ``cuda.py``: CUDA (HIP builds share it), and the torch-cudart stand-in for
  builds without the GPU ops;
* ``faulty.py``: a fault-injecting wrapper for tests (the example of a new backend:
  one file, installed with :func:`pointerdomain._platform.testing.install_backend`;
  :mod:`pointerdomain.testing` is the public face of the doubles);
* ``runtimes.py``: each device type's device state (current device, device count) and
  the capabilities the layers above ask (``Device.runtime``) instead of a type's name.

The backend for a device is chosen here, by :func:`backend_for`, and nowhere
else. Backend modules import ``_C`` at their top (so mypy checks every call
against ``_C.pyi``); this package imports them on first use, so
``import pointerdomain`` works without the extension and the first call that
needs it raises :class:`~pointerdomain.errors.ExtensionUnavailableError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pointerdomain._platform.base import (
    Backend,
    LaunchArgs,
    LayerSignals,
    LayerWords,
    PointerQuery,
    StagedCopy,
    StagingArgs,
)
from pointerdomain._platform.pointer_query import PointerInfo
from pointerdomain.errors import ExtensionUnavailableError

if TYPE_CHECKING:
    import torch

    from pointerdomain._C import KernelPlan
    from pointerdomain.devices import Device

__all__ = [
    "Backend",
    "LaunchArgs",
    "LayerSignals",
    "LayerWords",
    "StagedCopy",
    "StagingArgs",
    "backend_for",
    "default_device",
    "device_holding",
    "extension_ops",
    "extension_path",
    "gpu_ops_built",
    "host_pointer_fallback",
    "kernel_plan",
    "memory_device",
    "memory_generation",
    "on_backend_change",
    "pointer_info",
    "register_backend",
    "runtime_devices",
    "scoped_backend",
    "visible_devices",
]

_lock = threading.Lock()
_factories: dict[str, Callable[[], Backend]] = {}
_backends: dict[str, Backend] = {}  # device type -> the backend in use (read without the lock)
_on_swap: list[Callable[[], None]] = []  # caches of backend-derived state (launch plans)
#: device type -> backend for the current thread / task only (scoped_backend); None: none set
_scoped: contextvars.ContextVar[dict[str, Backend] | None] = contextvars.ContextVar("pointerdomain_scoped_backends",
                                                                                     default=None)

#: each backend in use's memory_generation, read on every cached compat call (no dict walk)
_generations: tuple[Callable[[], int], ...] = ()


def _recount() -> None:
    """Rebuild :data:`_generations` and :data:`generation_count` from :data:`_backends`
    (the caller holds the lock)."""
    global _generations, generation_count
    _generations = tuple(getattr(b, "memory_generation", lambda: 0) for b in _backends.values())
    generation_count = _generations[0] if len(_generations) == 1 else memory_generation


def memory_generation() -> int:
    """A count that grows whenever a backend in use released device memory it tracks (the
    emulated device: every free; CUDA: nothing, see :meth:`RuntimeTraits.memory_generation`).
    A cache of resolved raw addresses compares it per call and re-checks its entries only
    when it moved: one native call when nothing was freed."""
    total = 0
    for count in _generations:
        total += count()
    return total


#: :func:`memory_generation` as one call: the one backend in use's own counter (the
#: emulated device's is native), else the sum; read as ``_platform.generation_count`` on
#: every cached compat call (replaced whenever a backend comes or goes)
generation_count: Callable[[], int] = memory_generation


def _import(name: str) -> object:
    import torch

    from pointerdomain.buildinfo import build_facts, check_torch_runtime

    facts = build_facts()
    # GPU ops built for another runtime major than torch's: a typed error, not a loader failure
    check_torch_runtime(facts, torch.version.cuda, getattr(torch.version, "hip", None))
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ExtensionUnavailableError(
            f"pointerdomain._C ({facts.gpu_summary()}) could not be imported ({exc}); reinstall with "
            "`pip install .` from a source checkout so the extension is built for this Python"
        ) from exc


def _emulated() -> Backend:
    from pointerdomain.devices import emulated_device_count

    _import("pointerdomain._platform.emulated")
    from pointerdomain._platform.emulated import EmulatedBackend

    return EmulatedBackend(emulated_device_count())


def _cuda() -> Backend:
    _import("pointerdomain._platform.cuda")
    from pointerdomain._platform.cuda import TorchCudartBackend
    from pointerdomain._platform.cuda_driver import cuda_backend

    return cuda_backend() if gpu_ops_built() else TorchCudartBackend()


def register_backend(device_type: str, factory: Callable[[], Backend]) -> None:
    """Make ``factory`` build the backend of ``device_type`` devices (on first use)."""
    with _lock:
        _factories[device_type] = factory
        replaced = _backends.pop(device_type, None) is not None
        _recount()
    if replaced:
        for callback in _on_swap:
            callback()


register_backend("emulated", _emulated)
register_backend("cuda", _cuda)


def _install_runtimes() -> None:
    from pointerdomain import devices
    from pointerdomain._platform.runtimes import runtimes

    devices.install_runtimes(runtimes())


_install_runtimes()


def backend_for(device: Device) -> Backend:
    """The backend of ``device`` (built on first use, then cached).

    Raises:
        ExtensionUnavailableError: the extension does not import.
    """
    scoped = _scoped.get()
    if scoped is not None and device.type in scoped:
        return scoped[device.type]
    backend = _backends.get(device.type)
    if backend is not None:
        return backend
    with _lock:
        backend = _backends.get(device.type)
        if backend is None:
            backend = _factories[device.type]()
            _backends[device.type] = backend
            _recount()
    return backend


@contextlib.contextmanager
def scoped_backend(device_type: str, backend: Backend) -> Iterator[Backend]:
    """Make ``backend`` the backend of ``device_type`` devices for the block, in the
    current thread (or asyncio task) only: other threads keep the process's backend.
    Objects made inside keep the backend they were made with."""
    current = _scoped.get()
    token = _scoped.set({**(current or {}), device_type: backend})
    try:
        yield backend
    finally:
        _scoped.reset(token)


def on_backend_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever a device type's backend is replaced (caches that hold
    a backend, such as launch plans, drop their entries)."""
    _on_swap.append(callback)


def _swap(device_type: str, backend: Backend | None) -> Backend | None:
    """Install ``backend`` for ``device_type`` (None: the registered one, rebuilt on
    next use) and return the one it replaces. For :mod:`.testing`."""
    with _lock:
        previous = _backends.get(device_type)
        if backend is None:
            _backends.pop(device_type, None)
        else:
            _backends[device_type] = backend
        _recount()
    for callback in _on_swap:
        callback()
    return previous


def host_pointer_fallback(runtime: str) -> bool:
    """True where ``runtime`` ("cuda", "hip") lets kernels use a registered host VA as its
    device address when ``CanUseHostPointerForRegisteredMem`` is 1 (CUDA; HIP defines no
    such guarantee), so a build without the alias op may fall back to it."""
    return runtime != "hip"


def gpu_ops_built() -> bool:
    """True when the extension was built with the CUDA (or HIP) kernels and runtime ops.

    Raises:
        ExtensionUnavailableError: the extension does not import.
    """
    _import("pointerdomain._platform.native")
    from pointerdomain._platform.native import GPU_BUILT

    return GPU_BUILT


def extension_path() -> str:
    """File of the loaded extension (for ``pointerdomain doctor``).

    Raises:
        ExtensionUnavailableError: the extension does not import.
    """
    _import("pointerdomain._platform.native")
    from pointerdomain._platform.native import PATH

    return PATH


def visible_devices() -> list[Device]:
    """The CUDA devices torch sees, or ``[emulated:0]`` when there are none."""
    from pointerdomain.devices import Device

    count = backend_for(Device("cuda", 0)).device_count() if _cuda_visible() else 0
    return [Device("cuda", i) for i in range(count)] or [Device("emulated", 0)]


def default_device() -> Device:
    """``cuda:<current>`` when a GPU and the GPU ops are there, else ``emulated:0``."""
    from pointerdomain.devices import Device, current_device

    if _cuda_visible() and gpu_ops_built():
        return current_device("cuda")
    return Device("emulated", 0)


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def runtime_devices() -> dict[str, object]:
    """The GPU runtime's own device count and version (``pointerdomain doctor``); only
    for builds with the GPU ops (:func:`gpu_ops_built`).

    Raises:
        ExtensionUnavailableError: the extension does not import.
    """
    _import("pointerdomain._platform.cuda")
    from pointerdomain._platform.cuda import runtime_report

    return runtime_report()


def extension_ops() -> list[str]:
    """Names of the extension's functions and classes, sorted (for ``pointerdomain doctor``).

    Raises:
        ExtensionUnavailableError: the extension does not import.
    """
    _import("pointerdomain._platform.native")
    from pointerdomain._platform.native import OPS

    return list(OPS)


def kernel_plan(
    src_table: int, src_geometry: tuple[int, ...], dst_table: int, dst_geometry: tuple[int, ...],
    page_size: int, num_kv: int, item_bytes: int, vec_bytes: int, oob: int = 0,
) -> KernelPlan:
    """The bound launch struct (``_C.KernelPlan``) every backend's :meth:`~Backend.launch` takes;
    ``oob``: address of the device's error word the kernels set on a skipped slot (0: none)."""
    _import("pointerdomain._platform.native")
    from pointerdomain._platform.native import KernelPlan

    return KernelPlan(src_table, src_geometry, dst_table, dst_geometry, page_size, num_kv, item_bytes, vec_bytes, oob)


def memory_device(tensor: torch.Tensor, *, whole_storage: bool = False) -> Device | None:
    """The device whose memory holds ``tensor`` (its elements, or its whole storage),
    a CUDA device or an emulated device for emulated device memory; None for host memory."""
    if tensor.is_cuda:  # (an attribute: no torch.device object built)
        from pointerdomain.devices import Device

        return Device("cuda", int(tensor.get_device()))
    if whole_storage:
        storage = tensor.untyped_storage()
        return device_holding(int(storage.data_ptr()), int(storage.nbytes()))
    return device_holding(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def pointer_info(device: Device, addr: int) -> PointerInfo | None:
    """What ``device``'s backend knows of the allocation holding ``addr`` (host or device
    memory, its range), or None where it knows none or cannot ask (:mod:`.pointer_query`).

    Raises:
        ExtensionUnavailableError: the extension does not import.
    """
    backend = backend_for(device)
    return backend.pointer_info(addr) if isinstance(backend, PointerQuery) else None


def device_holding(addr: int, nbytes: int) -> Device | None:
    """The emulated device whose allocation holds ``[addr, addr + nbytes)``, or None
    (CUDA memory is known by its tensor, not by address: see :func:`memory_device`)."""
    # host memory, the common answer, builds no Device (and imports nothing): ~1 us less
    ordinal = backend_for(_emulated_0 or _emulated_device(0)).device_lookup(addr, max(nbytes, 1))
    return _emulated_device(ordinal) if ordinal >= 0 else None


_emulated_0: Device | None = None  # emulated:0, the emulated backend's key (an immutable value, built once)


def _emulated_device(ordinal: int) -> Device:
    global _emulated_0
    from pointerdomain.devices import Device

    device = Device("emulated", ordinal)
    if ordinal == 0:
        _emulated_0 = device
    return device
