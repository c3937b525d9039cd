"""Device validation and the device guard used around every launch.

The C++ side has its own RAII guard (``transfer_gpu.cu``) that sets and restores
the device around each runtime call and launch; this Python guard is for
callers' own code and for the emulated devices, whose "current device" is
per thread.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pointerdomain.domains import EMULATED_DEVICE_COUNT, Device, as_device
from pointerdomain.errors import InvalidDeviceError

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceGuard", "current_device", "validate_device"]

_emulated = threading.local()


def _cuda_device_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def validate_device(device: Device | str | torch.device) -> Device:
    """Normalise ``device`` and check that it exists on this machine.

    Raises:
        InvalidDeviceError: unknown type, or ordinal >= the number of devices
            (``torch.cuda.device_count()`` for CUDA, ``POINTERDOMAIN_EMULATED_DEVICES``
            (default 2) for emulated devices).
    """
    dev = as_device(device)
    count = _cuda_device_count() if dev.type == "cuda" else EMULATED_DEVICE_COUNT
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
        self._previous: Device | None = None

    def __enter__(self) -> Device:
        self._previous = current_device(self.device.type)
        self._set(self.device)
        return self.device

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._previous is not None
        self._set(self._previous)

    @staticmethod
    def _set(device: Device) -> None:
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device.ordinal)
        else:
            _emulated.ordinal = device.ordinal
