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
import os
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, cast

from typing_extensions import final

from pointerdomain.errors import InvalidDeviceError

if TYPE_CHECKING:
    import torch

__all__ = [
    "EMULATED_DEVICE_COUNT",
    "Device",
    "DeviceGuard",
    "DeviceType",
    "as_device",
    "current_device",
    "current_ordinal",
    "emulated_device_count",
    "external_stream",
    "tensor_on",
    "validate_device",
]

DeviceType = Literal["cuda", "emulated"]

def emulated_device_count() -> int:
    """Number of emulated devices: ``POINTERDOMAIN_EMULATED_DEVICES`` (default 2), read at
    each call so a test may set it.

    Raises:
        InvalidDeviceError: the variable is set but not a positive decimal int (``"0"``,
            ``"two"``, ``"-1"``, ``" 2"``): a typo must not silently give another count.
    """
    text = os.environ.get("POINTERDOMAIN_EMULATED_DEVICES")
    if text is None:
        return 2
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise InvalidDeviceError(
            f"POINTERDOMAIN_EMULATED_DEVICES={text!r} is not a positive int: set it to the number of emulated "
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
        if self.type not in ("cuda", "emulated"):
            raise InvalidDeviceError(f"unknown device type {self.type!r}; expected 'cuda' or 'emulated'")
        if type(self.ordinal) is not int or self.ordinal < 0:
            raise InvalidDeviceError(f"device ordinal must be an int >= 0, got {self.ordinal!r}")

    def __str__(self) -> str:
        return f"{self.type}:{self.ordinal}"

    @property
    def torch_device(self) -> torch.device:
        """The torch device whose tensors hold this device's memory (``cpu`` when emulated)."""
        return _torch_device(self.type, self.ordinal)


@functools.lru_cache(maxsize=64)
def _torch_device(kind: str, ordinal: int) -> torch.device:
    import torch

    return torch.device("cuda", ordinal) if kind == "cuda" else torch.device("cpu")


def as_device(device: Device | str | torch.device) -> Device:
    """Normalise ``Device``, ``"cuda:1"``, ``"emulated:0"``, ``"cpu"`` or a ``torch.device``.

    Raises:
        InvalidDeviceError: an unknown device string or type.
    """
    if isinstance(device, Device):
        return device
    text = str(device)
    kind, _, ordinal = text.partition(":")
    if kind == "cpu" and not ordinal:
        return Device("emulated", 0)
    if kind not in ("cuda", "emulated"):
        raise InvalidDeviceError(f"cannot use {text!r} as a device; expected 'cuda:N', 'emulated:N' or 'cpu'")
    if not ordinal:
        if kind == "cuda":
            import torch

            if not torch.cuda.is_available():  # torch would raise AssertionError / RuntimeError
                raise InvalidDeviceError(
                    f"device {text!r}: found no CUDA device (torch.cuda.is_available() is False: a CPU build of "
                    "torch, or no GPU visible), expected one to pick the current CUDA device from. Fix: pass "
                    "'emulated:0' (or 'cpu') on a machine without a GPU, or an explicit 'cuda:N' where one exists"
                )
            return Device("cuda", torch.cuda.current_device())
        return Device("emulated", 0)
    if not ordinal.isdigit():
        raise InvalidDeviceError(f"bad device ordinal in {text!r}")
    return Device(kind, int(ordinal))  # type: ignore[arg-type]


def external_stream(device: Device, stream: int | None) -> Any:
    """``stream`` (a ``cudaStream_t`` as an int) as a ``torch.cuda.ExternalStream`` of a
    CUDA ``device``, for ``Tensor.record_stream`` / ``PointerTable.record_stream``; None
    when there is nothing to order against (no stream given, or an emulated device,
    whose launches are synchronous)."""
    if not isinstance(device, Device):
        raise InvalidDeviceError(
            f"device: found {device!r} ({type(device).__name__}), expected a pointerdomain.Device. "
            "Fix: parse it first with validate_device(...)"
        )
    if stream is not None and (type(stream) is not int or stream < 0):
        from pointerdomain.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"stream: found {stream!r}, expected a cudaStream_t as a non-negative int or None. "
            "Fix: pass torch.cuda.current_stream().cuda_stream"
        )
    if stream is None or device.type != "cuda":
        return None
    import torch

    return cast(Any, torch.cuda).ExternalStream(stream, device=device.torch_device)


def tensor_on(tensor: torch.Tensor, device: Device) -> bool:
    """True when ``tensor``'s memory is where ``device``'s kernels read operands
    (the CUDA device itself; the CPU for an emulated device)."""
    if device.type == "cuda":
        return tensor.get_device() == device.ordinal  # -1 for CPU tensors
    return not (tensor.is_cuda or tensor.is_meta)  # attributes: ~10x cheaper than tensor.device


_emulated = threading.local()


def _cuda_device_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def validate_device(device: Device | str | torch.device) -> Device:
    """Normalise ``device`` and check that it exists on this machine.

    Raises:
        InvalidDeviceError: unknown type, or ordinal >= the number of devices
            (``torch.cuda.device_count()`` for CUDA, ``POINTERDOMAIN_EMULATED_DEVICES``
            (default 2) for emulated devices), or an invalid ``POINTERDOMAIN_EMULATED_DEVICES``.
    """
    dev = as_device(device)
    count = _cuda_device_count() if dev.type == "cuda" else emulated_device_count()
    if dev.ordinal >= count:
        raise InvalidDeviceError(f"device {dev} does not exist: this process sees {count} {dev.type} device(s)")
    return dev


def current_device(kind: str = "cuda") -> Device:
    """The calling thread's current device of ``kind`` ("cuda" or "emulated")."""
    if kind == "cuda":
        import torch

        return Device("cuda", int(torch.cuda.current_device()))
    return Device("emulated", int(getattr(_emulated, "ordinal", 0)))


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
        self._previous = previous = current_ordinal(device.type)  # ordinals: no Device built per launch
        if previous != device.ordinal:
            self._set(device.type, device.ordinal)
        return device

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        previous = self._previous
        assert previous is not None
        if current_ordinal(self.device.type) != previous:
            self._set(self.device.type, previous)

    @staticmethod
    def _set(kind: str, ordinal: int) -> None:
        if kind == "cuda":
            import torch

            torch.cuda.set_device(ordinal)
        else:
            _emulated.ordinal = ordinal


def current_ordinal(kind: str = "cuda") -> int:
    """``current_device(kind).ordinal`` without building a Device (the launch path)."""
    if kind == "cuda":
        import torch

        return int(torch.cuda.current_device())
    return int(getattr(_emulated, "ordinal", 0))
