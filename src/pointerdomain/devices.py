"""Devices: :class:`Device`, parsing (:func:`as_device`), validation, the
calling thread's current device and :class:`DeviceGuard`.

Public entry points parse a device argument once (:func:`validate_device`);
internal functions take a :class:`Device` only.

The C++ side has its own RAII guard (``transfer_gpu.cu``) that sets and restores
the device around each runtime call and launch; :class:`DeviceGuard` is for
callers' own code and for the emulated devices, whose "current device" is per
thread.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from typing_extensions import final

from pointerdomain import env
from pointerdomain.arguments import describe
from pointerdomain.errors import InvalidDeviceError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_TYPES",
    "EMULATED_DEVICE_COUNT",
    "Device",
    "DeviceGuard",
    "DeviceRuntime",
    "DeviceType",
    "as_device",
    "current_device",
    "current_ordinal",
    "emulated_device_count",
    "external_stream",
    "install_runtimes",
    "runtime_of",
    "tensor_on",
    "validate_device",
]

DeviceType = Literal["cuda", "emulated"]
DEVICE_TYPES: tuple[DeviceType, ...] = get_args(DeviceType)


class DeviceRuntime(Protocol):
    """What a device type's runtime answers about its devices: their state (the calling
    thread's current device, the count) and what the layers above ask instead of
    branching on the type's name. One per device type, installed by the platform layer
    (:mod:`pointerdomain._platform.runtimes`) when the package is imported.

    Attributes:
        host_memory: the device's memory is host memory (the emulated device): the CPU
            reads its tables and indices without a synchronisation, and the device has no
            memory of its own to count, map for NIXL or place on a NUMA node.
        streams: launches are asynchronous on streams, which may be captured into graphs.
        launch_sets_device: the native kernel launch sets and restores the current device
            itself (no Python device switch around it).
    """

    host_memory: bool
    streams: bool
    launch_sets_device: bool

    def count(self) -> int:
        """Number of devices of this type the process sees."""
        ...

    def current_ordinal(self) -> int:
        """The calling thread's current device of this type."""
        ...

    def set_ordinal(self, ordinal: int) -> None:
        """Make device ``ordinal`` of this type the calling thread's current one."""
        ...

    def bare_ordinal(self, text: str) -> int:
        """The ordinal that ``text`` (the type's name without one) stands for.

        Raises:
            InvalidDeviceError: there is no device to pick.
        """
        ...

    def torch_device(self, ordinal: int) -> torch.device:
        """The torch device whose tensors hold device ``ordinal``'s memory."""
        ...

    def tensor_on(self, tensor: torch.Tensor, ordinal: int) -> bool:
        """True when ``tensor``'s memory is where device ``ordinal``'s kernels read operands."""
        ...

    def external_stream(self, stream: int, ordinal: int) -> Any:
        """``stream`` as the torch stream object of device ``ordinal``, or None where
        launches are synchronous."""
        ...


_runtimes: dict[str, DeviceRuntime] = {}


def install_runtimes(runtimes: dict[str, DeviceRuntime]) -> None:
    """Install each device type's :class:`DeviceRuntime` (the platform layer does, on import)."""
    missing = set(DEVICE_TYPES) - set(runtimes)
    if missing:
        raise InvalidDeviceError(f"no runtime for device type(s) {sorted(missing)}")
    _runtimes.update(runtimes)
    _torch_device.cache_clear()


def runtime_of(kind: str) -> DeviceRuntime:
    """The runtime of device type ``kind``.

    Raises:
        InvalidDeviceError: an unknown device type.
    """
    runtime = _runtimes.get(kind)
    if runtime is None:
        raise InvalidDeviceError(f"unknown device type {describe(kind)}; expected one of {', '.join(DEVICE_TYPES)}")
    return runtime

def emulated_device_count() -> int:
    """Number of emulated devices: ``POINTERDOMAIN_EMULATED_DEVICES`` (default 2), read at
    each call so a test may set it.

    Raises:
        InvalidDeviceError: the variable is set to something other than a positive decimal
            int (``"0"``, ``"two"``, ``"-1"``, ``" 2"``): a typo must not silently give
            another count. Empty is unset (the default), as for every variable.
    """
    text = env.text(env.EMULATED_DEVICES)
    if not text:  # unset or empty: the default, as env.py reads every variable
        return 2
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise InvalidDeviceError(
            f"POINTERDOMAIN_EMULATED_DEVICES={describe(text)} is not a positive int: set it to the number of emulated "
            "devices (e.g. 2) or unset it (default 2)"
        )
    return int(text)


def _emulated_device_count() -> int:
    try:
        return emulated_device_count()
    except InvalidDeviceError:
        return 0  # import still works; emulated_device_count() raises at first use


#: Number of emulated devices when the package was imported (0 when
#: ``POINTERDOMAIN_EMULATED_DEVICES`` is invalid); :func:`emulated_device_count` is the
#: checked, current value that device validation uses.
EMULATED_DEVICE_COUNT = _emulated_device_count()


@final
@dataclass(frozen=True, slots=True)
class Device:
    """A device: ``Device("cuda", 0)`` or ``Device("emulated", 0)``.

    ``"emulated"`` is the CPU backend that stands in for a GPU whose device
    aliases differ from host VAs; ``torch.device("cpu")`` maps to ``emulated:0``.
    ``"cuda"`` also covers ROCm builds of torch, which name HIP devices ``cuda``.
    """

    type: DeviceType
    ordinal: int

    def __post_init__(self) -> None:
        if self.type not in DEVICE_TYPES:
            raise InvalidDeviceError(f"unknown device type {describe(self.type)}; expected 'cuda' or 'emulated'")
        if type(self.ordinal) is not int or self.ordinal < 0:
            raise InvalidDeviceError(f"device ordinal must be an int >= 0, got {describe(self.ordinal)}")

    def __str__(self) -> str:
        return f"{self.type}:{self.ordinal}"

    @property
    def torch_device(self) -> torch.device:
        """The torch device whose tensors hold this device's memory (``cpu`` when emulated)."""
        return _torch_device(self.type, self.ordinal)

    @property
    def runtime(self) -> DeviceRuntime:
        """What this device's runtime answers (:class:`DeviceRuntime`): its capabilities and state."""
        return _runtimes[self.type]

    def same_type(self, other: Device) -> bool:
        """True when ``other`` is a device of this one's type (the same runtime)."""
        return self.runtime is other.runtime  # one runtime object per type


@functools.lru_cache(maxsize=64)
def _torch_device(kind: str, ordinal: int) -> torch.device:
    return _runtimes[kind].torch_device(ordinal)


#: device texts without a runtime's own name: the host (``torch.device("cpu")``)
_HOST_TEXTS: dict[str, tuple[DeviceType, int]] = {"cpu": ("emulated", 0)}


def as_device(device: Device | str | torch.device) -> Device:
    """Normalise ``Device``, ``"cuda:1"``, ``"emulated:0"``, ``"cpu"`` or a ``torch.device``.

    Raises:
        InvalidDeviceError: an unknown device string or type, or ``device`` is none of
            those types.
    """
    if isinstance(device, Device):
        return device
    import torch  # devices is imported before torch is needed anywhere else

    if not isinstance(device, (str, torch.device)):  # str() of anything else may read it (a tensor's elements)
        raise InvalidDeviceError(
            f"device: found {describe(device)} ({type(device).__name__}), expected a Device, a str such as "
            "'cuda:0' or 'emulated:0', or a torch.device"
        )
    text = str(device)
    kind, _, ordinal = text.partition(":")
    host = _HOST_TEXTS.get(text)
    if host is not None:
        return Device(*host)
    if kind not in DEVICE_TYPES:
        raise InvalidDeviceError(f"cannot use {describe(text)} as a device; expected 'cuda:N', 'emulated:N' or 'cpu'")
    if not ordinal:
        return Device(kind, runtime_of(kind).bare_ordinal(text))
    if not (ordinal.isascii() and ordinal.isdigit()):  # str.isdigit takes any script's digits (and "¹")
        raise InvalidDeviceError(f"bad device ordinal in {describe(text)}: expected ASCII digits 0-9")
    return Device(kind, int(ordinal))


def external_stream(device: Device, stream: int | None) -> Any:
    """``stream`` (a ``cudaStream_t`` as an int) as a ``torch.cuda.ExternalStream`` of a
    CUDA ``device``, for ``Tensor.record_stream`` / ``PointerTable.record_stream``; None
    when there is nothing to order against (no stream given, or an emulated device,
    whose launches are synchronous)."""
    if not isinstance(device, Device):
        raise InvalidDeviceError(
            f"device: found {describe(device)} ({type(device).__name__}), expected a pointerdomain.Device. "
            "Fix: parse it first with validate_device(...)"
        )
    if stream is not None and (type(stream) is not int or stream < 0):
        from pointerdomain.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"stream: found {describe(stream)}, expected a cudaStream_t as a non-negative int or None. "
            "Fix: pass torch.cuda.current_stream().cuda_stream"
        )
    if stream is None:
        return None
    return device.runtime.external_stream(stream, device.ordinal)


def tensor_on(tensor: torch.Tensor, device: Device) -> bool:
    """True when ``tensor``'s memory is where ``device``'s kernels read operands
    (the CUDA device itself; the CPU for an emulated device)."""
    return _runtimes[device.type].tensor_on(tensor, device.ordinal)


def validate_device(device: Device | str | torch.device) -> Device:
    """Normalise ``device`` and check that it exists on this machine.

    Raises:
        InvalidDeviceError: unknown type, or ordinal >= the number of devices
            (``torch.cuda.device_count()`` for CUDA, ``POINTERDOMAIN_EMULATED_DEVICES``
            (default 2) for emulated devices), or an invalid ``POINTERDOMAIN_EMULATED_DEVICES``.
    """
    dev = as_device(device)
    count = dev.runtime.count()
    if dev.ordinal >= count:
        raise InvalidDeviceError(f"device {dev} does not exist: this process sees {count} {dev.type} device(s)")
    return dev


def current_device(kind: str = "cuda") -> Device:
    """The calling thread's current device of ``kind`` ("cuda" or "emulated").

    Raises:
        InvalidDeviceError: an unknown device type.
    """
    return Device(kind, runtime_of(kind).current_ordinal())  # type: ignore[arg-type]


class DeviceGuard:
    """Make ``device`` current for the block; restore the previous device on exit,
    exceptions included.

    Raises:
        InvalidDeviceError: on construction, for a device that does not exist.
    """

    __slots__ = ("device", "_previous")

    def __init__(self, device: Device | str | torch.device) -> None:
        self.device = validate_device(device)
        self._previous: int | None = None  # the previous ordinal of the device's type

    @classmethod
    def for_launch(cls, device: Device) -> DeviceGuard:
        """A guard for a device already validated (the launch path: no device-count query).
        Launches on emulated devices, copy-engine and staged launches and checked-mode
        launches run under one, so the work runs on its tables' device whatever the
        caller's current device, and the caller's comes back afterwards, also on error
        (CUDA kernel launches need none: the C++ call sets and restores the device itself)."""
        guard = cls.__new__(cls)
        guard.device = device
        guard._previous = None
        return guard

    def __enter__(self) -> Device:
        device = self.device
        runtime = _runtimes[device.type]
        self._previous = previous = runtime.current_ordinal()  # ordinals: no Device built per launch
        if previous != device.ordinal:
            runtime.set_ordinal(device.ordinal)
        return device

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        previous = self._previous
        assert previous is not None
        runtime = _runtimes[self.device.type]
        if runtime.current_ordinal() != previous:
            runtime.set_ordinal(previous)


def current_ordinal(kind: str = "cuda") -> int:
    """``current_device(kind).ordinal`` without building a Device (the launch path).

    Raises:
        InvalidDeviceError: an unknown device type.
    """
    return runtime_of(kind).current_ordinal()
