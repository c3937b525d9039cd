"""The two address domains of registered host memory, and devices.

Registered (pinned) host memory has a **host VA**, the address CPU code uses,
and a **device alias**, the address a kernel must use (``cudaHostGetDevicePointer``
/ ``hipHostGetDevicePointer``). They are equal only where
``cudaDevAttrCanUseHostPointerForRegisteredMem`` is 1 (CUDA Runtime API,
"Device Management"); on MI355X, WSL2 and some host kernels they differ.

:class:`HostVA` and :class:`DeviceAlias` are distinct final types: mypy rejects
one where the other is expected, a plain ``int`` is accepted by neither, and
arithmetic keeps the domain (``addr + nbytes`` is the same type, ``a - b`` is an
``int`` inside one domain, ``a + b`` does not exist). Neither defines
``__int__`` or ``__index__``: the raw value is reachable only through ``.value``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from typing_extensions import Self, final

from pointerdomain.errors import DeviceMismatchError, DomainError, InvalidArgumentError, InvalidDeviceError

if TYPE_CHECKING:
    import torch

__all__ = ["Address", "Device", "DeviceAlias", "HostVA", "as_device"]

_ADDR_LIMIT = 1 << 64

DeviceType = Literal["cuda", "emulated"]

def _emulated_device_count() -> int:
    text = os.environ.get("POINTERDOMAIN_EMULATED_DEVICES", "2")
    if not text.isdigit() or int(text) < 1:
        import warnings

        warnings.warn(f"POINTERDOMAIN_EMULATED_DEVICES={text!r} is not a positive int; using 2", stacklevel=2)
        return 2
    return int(text)


#: Number of emulated devices on a machine without a GPU (``POINTERDOMAIN_EMULATED_DEVICES``, default 2).
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
    def torch_device(self) -> Any:
        """The torch device whose tensors hold this device's memory (``cpu`` when emulated)."""
        return _torch_device(self.type, self.ordinal)


@functools.lru_cache(maxsize=64)
def _torch_device(kind: str, ordinal: int) -> Any:
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

            return Device("cuda", torch.cuda.current_device())
        return Device("emulated", 0)
    if not ordinal.isdigit():
        raise InvalidDeviceError(f"bad device ordinal in {text!r}")
    return Device(kind, int(ordinal))  # type: ignore[arg-type]


def _check_value(value: object) -> int:
    if type(value) is not int:
        raise DomainError(f"an address is built from an int, got {type(value).__name__}")
    if not 0 <= value < _ADDR_LIMIT:
        raise InvalidArgumentError(f"address {value:#x} is outside [0, 2**64)")
    return value


@dataclass(frozen=True, slots=True)
class Address:
    """Common base of the two address domains; never instantiated or annotated directly.

    Launch and metadata APIs take :class:`DeviceAlias` or :class:`HostVA`, never
    ``Address``: a base-typed parameter would accept either domain.
    """

    value: int

    def __post_init__(self) -> None:
        if type(self) is Address:
            raise TypeError("Address is abstract: use HostVA or DeviceAlias")
        _check_value(self.value)

    def offset(self, nbytes: int) -> Self:
        """The address ``nbytes`` bytes further on, in the same domain (and device).

        Raises:
            DomainError: ``nbytes`` is not an int (e.g. another address).
        """
        if type(nbytes) is not int:
            raise DomainError(
                f"{type(self).__name__} + {type(nbytes).__name__}: only a byte count (int) can be added to an address"
            )
        return self._with_value(_check_value(self.value + nbytes))

    def _with_value(self, value: int) -> Self:
        raise NotImplementedError

    def __add__(self, nbytes: int) -> Self:
        return self.offset(nbytes)

    @overload
    def __sub__(self, other: Self) -> int: ...
    @overload
    def __sub__(self, other: int) -> Self: ...
    def __sub__(self, other: Self | int) -> int | Self:
        if type(other) is int:
            return self.offset(-other)
        if type(other) is not type(self):
            raise DomainError(
                f"{type(self).__name__} - {type(other).__name__}: a distance is only defined inside one domain"
            )
        self._check_same_device(other)
        return self.value - other.value

    def _check_same_device(self, other: Self) -> None:
        pass

    def _ordered(self, other: Self) -> int:
        if type(other) is not type(self):
            raise DomainError(f"cannot order {type(self).__name__} against {type(other).__name__}")
        self._check_same_device(other)
        return other.value

    def __lt__(self, other: Self) -> bool:
        return self.value < self._ordered(other)

    def __le__(self, other: Self) -> bool:
        return self.value <= self._ordered(other)

    def __gt__(self, other: Self) -> bool:
        return self.value > self._ordered(other)

    def __ge__(self, other: Self) -> bool:
        return self.value >= self._ordered(other)


@final
@dataclass(frozen=True, slots=True, repr=False)
class HostVA(Address):
    """A CPU virtual address: what memcpy, storage back-ends, transfer engines
    (Mooncake ``register_memory``, NIXL) and ``cudaHostUnregister`` take.
    A kernel must never read it (unless CanUseHostPointerForRegisteredMem is 1).

    Pydantic fields typed ``HostVA`` take a ``HostVA`` in Python and a strict int in
    [0, 2**64) in JSON, and serialise to that int.
    """

    def _with_value(self, value: int) -> HostVA:
        return HostVA(value)

    def __repr__(self) -> str:
        return f"HostVA({self.value:#x})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        # Python: a HostVA only (a bare int may be a device alias's value). JSON: the int
        # that serialisation wrote, validated to [0, 2**64) and wrapped back.
        return core_schema.json_or_python_schema(
            json_schema=core_schema.no_info_after_validator_function(
                _from_json_int, core_schema.int_schema(strict=True, ge=0, lt=_ADDR_LIMIT)
            ),
            python_schema=core_schema.is_instance_schema(HostVA),
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda a: a.value, return_schema=core_schema.int_schema()
            ),
        )


def _from_json_int(value: int) -> HostVA:
    return HostVA(value)


@final
@dataclass(frozen=True, slots=True, repr=False)
class DeviceAlias(Address):
    """An address a kernel on ``device`` may use: the device alias of registered
    host memory, or a device allocation's own address.

    Arithmetic keeps the device; a distance between aliases of two devices raises
    :class:`~pointerdomain.errors.DeviceMismatchError`. Keep arithmetic inside one
    registration: separately registered ranges are not contiguous in alias space.
    """

    device: Device

    def __post_init__(self) -> None:
        Address.__post_init__(self)
        if not isinstance(self.device, Device):
            raise InvalidDeviceError(f"DeviceAlias needs a Device, got {self.device!r}")

    def _with_value(self, value: int) -> DeviceAlias:
        return DeviceAlias(value, self.device)

    def _check_same_device(self, other: DeviceAlias) -> None:
        if other.device != self.device:
            raise DeviceMismatchError(f"aliases of {self.device} and {other.device} cannot be compared or subtracted")

    def __repr__(self) -> str:
        return f"DeviceAlias({self.value:#x}, {self.device})"
