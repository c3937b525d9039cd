"""The two address domains of registered host memory.

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

A raw ``int`` becomes an address only through the explicit, greppable
:meth:`HostVA.unsafe_from_int` / :meth:`DeviceAlias.unsafe_from_int`: nothing can
check which domain an ``int`` came from. For type checkers the plain constructors
take a keyword that cannot be given (``use_unsafe_from_int: Never``), so
``HostVA(x)`` is a static error under mypy and pyright, also when ``x`` is ``Any``
(``tolist()``, ``json.loads``). At run time the plain constructor still works (old
code keeps running; ``pointerdomain audit`` lists it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar, overload

from typing_extensions import Never, Self, final

from pointerdomain.arguments import describe
from pointerdomain.devices import Device
from pointerdomain.errors import (
    DeviceMismatchError,
    DomainError,
    InvalidArgumentError,
    InvalidDeviceError,
    RegistrationSpanError,
)

__all__ = ["ADDRESS_LIMIT", "Address", "AddressT", "DeviceAlias", "HostVA", "range_end"]

#: One past the largest address: an address and the end of a range lie in [0, 2**64].
ADDRESS_LIMIT = 1 << 64

def _check_value(value: object) -> int:
    if type(value) is not int:
        raise DomainError(f"an address is built from an int, got {type(value).__name__}")
    if not 0 <= value < ADDRESS_LIMIT:
        raise InvalidArgumentError(f"address {value:#x} is outside [0, 2**64)")
    return value


def range_end(start: Address, nbytes: int, name: str = "range") -> int:
    """The end ``start.value + nbytes`` of a range of ``nbytes`` bytes (> 0), checked to be
    at most ``2**64``: a range that wraps past the top of the address space would reach low
    memory in any engine that adds in 64 bits.

    Raises:
        InvalidArgumentError: ``nbytes`` is not a positive int, or the range runs past
            ``2**64`` (a ``ValueError``).
    """
    if type(nbytes) is not int or nbytes <= 0:
        raise InvalidArgumentError(f"{name}: nbytes found {describe(nbytes)}, expected a positive int (bytes)")
    end = start.value + nbytes
    if end > ADDRESS_LIMIT:
        raise InvalidArgumentError(
            f"{name}: [{describe(start)}, +{nbytes}) runs past 2**64 (found an end of {end:#x}, expected at most 2**64). "
            "Fix: the address or the size is wrong"
        )
    return end


@dataclass(frozen=True, slots=True)
class Address:
    """Common base of the two address domains; never instantiated or annotated directly.

    Launch and metadata APIs take :class:`DeviceAlias` or :class:`HostVA`, never
    ``Address``: a base-typed parameter would accept either domain.
    """

    value: int
    #: ``(lo, hi)``: the span of the buffer or registration this address was taken from
    #: (a table entry, :func:`~pointerdomain.resolve_alias`), or None. Arithmetic must
    #: stay in ``[lo, hi]`` (``hi``, one past the end, included): separately registered
    #: ranges are not contiguous in alias space, so a step outside names other memory.
    span: tuple[int, int] | None = field(default=None, kw_only=True, compare=False, repr=False)

    if TYPE_CHECKING:  # a raw int is wrapped only by unsafe_from_int (see the module docstring)

        def __init__(self, value: int, *, use_unsafe_from_int: Never) -> None: ...

    def __init_subclass__(cls, **kwargs: object) -> None:
        # The two domains are final at run time too: a class deriving from HostVA or
        # DeviceAlias (or from both) would pass every isinstance check of a domain it is not.
        if cls.__bases__ != (Address,):
            raise DomainError(
                f"class {cls.__name__}: derives from {', '.join(b.__name__ for b in cls.__bases__)}; HostVA and "
                "DeviceAlias are final (an address is in exactly one domain)")
        super(Address, cls).__init_subclass__(**kwargs)  # (slots=True remade the class: no bare super())

    def __post_init__(self) -> None:
        if type(self) is Address:
            raise DomainError("Address is abstract: use HostVA or DeviceAlias")
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
        value = _check_value(self.value + nbytes)
        if self.span is not None and not self.span[0] <= value <= self.span[1]:
            lo, hi = self.span
            raise RegistrationSpanError(
                f"nbytes: {self!r} + {nbytes} = {value:#x} leaves the buffer it was taken from ([{lo:#x}, {hi:#x}), "
                f"{hi - lo} bytes), expected a result inside it: outside lies other memory (another registration's "
                "alias range, or none). Fix: take the address of the other buffer from its own table entry or "
                "registration"
            )
        return self._with_value(value)

    def bounded(self, lo: int, hi: int) -> Self:
        """This address, knowing the span ``[lo, hi)`` of its buffer or registration:
        arithmetic that leaves it raises :class:`~pointerdomain.errors.RegistrationSpanError`.

        Raises:
            InvalidArgumentError: the address is not in ``[lo, hi]``.
        """
        if not (type(lo) is int and type(hi) is int and lo <= self.value <= hi):
            raise InvalidArgumentError(f"span: found [{describe(lo)}, {describe(hi)}), expected a range holding {self!r}")
        return replace(self, span=(lo, hi))

    def _with_value(self, value: int) -> Self:
        raise NotImplementedError

    def __add__(self, nbytes: int) -> Self:
        return self.offset(nbytes)

    # Distance and ordering are defined on each final domain class, typed with that
    # class (not Self on the base): widened to Address, ``a - b`` and ``a < b`` are
    # static errors instead of accepting the other domain. Generic
    # helpers use AddressT. The shared runtime checks are here.
    def _distance(self, other: object) -> int | Self:
        if type(other) is int:
            return self.offset(-other)
        if type(other) is not type(self):
            raise DomainError(
                f"{type(self).__name__} - {type(other).__name__}: a distance is only defined inside one domain"
            )
        assert isinstance(other, type(self))
        self._check_same_device(other)
        return self.value - other.value

    def _check_same_device(self, other: Self) -> None:
        pass

    def _ordered(self, other: object) -> int:
        if type(other) is not type(self):
            raise DomainError(f"cannot order {type(self).__name__} against {type(other).__name__}")
        assert isinstance(other, type(self))
        self._check_same_device(other)
        return other.value


@final
@dataclass(frozen=True, slots=True, repr=False)
class HostVA(Address):
    """A CPU virtual address: what memcpy, storage back-ends, transfer engines
    (Mooncake ``register_memory``, NIXL) and ``cudaHostUnregister`` take.
    A kernel must never read it (unless CanUseHostPointerForRegisteredMem is 1).

    Pydantic fields typed ``HostVA`` take a ``HostVA`` in Python and a strict int in
    [0, 2**64) in JSON, and serialise to that int.
    """

    if TYPE_CHECKING:

        def __init__(self, value: int, *, use_unsafe_from_int: Never) -> None: ...

    @classmethod
    def unsafe_from_int(cls, value: int) -> HostVA:
        """``value`` declared a host VA: the one way to wrap a raw ``int`` (``data_ptr()``
        of host memory, a field of an engine's metadata) that type-checks. Nothing checks
        the domain; keep these calls at the boundary where the int is known to be a CPU
        address (``pointerdomain audit`` lists them).

        Raises:
            DomainError: ``value`` is not an int (a ``TypeError``).
            InvalidArgumentError: ``value`` is outside ``[0, 2**64)`` (a ``ValueError``).
        """
        return cls(value)  # type: ignore[call-arg]  # the sanctioned raw wrap

    def _with_value(self, value: int) -> HostVA:
        alias = HostVA.unsafe_from_int(value)
        return alias if self.span is None else replace(alias, span=self.span)

    @overload
    def __sub__(self, other: HostVA) -> int: ...
    @overload
    def __sub__(self, other: int) -> HostVA: ...
    def __sub__(self, other: HostVA | int) -> int | HostVA:
        return self._distance(other)

    def __lt__(self, other: HostVA) -> bool:
        return self.value < self._ordered(other)

    def __le__(self, other: HostVA) -> bool:
        return self.value <= self._ordered(other)

    def __gt__(self, other: HostVA) -> bool:
        return self.value > self._ordered(other)

    def __ge__(self, other: HostVA) -> bool:
        return self.value >= self._ordered(other)

    def __repr__(self) -> str:
        return f"HostVA({self.value:#x})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        # Python: a HostVA only (a bare int may be a device alias's value). JSON: the int
        # that serialisation wrote, validated to [0, 2**64) and wrapped back.
        return core_schema.json_or_python_schema(
            json_schema=core_schema.no_info_after_validator_function(
                _from_json_int, core_schema.int_schema(strict=True, ge=0, lt=ADDRESS_LIMIT)
            ),
            python_schema=core_schema.is_instance_schema(HostVA),
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda a: a.value, return_schema=core_schema.int_schema()
            ),
        )


def _from_json_int(value: int) -> HostVA:
    return HostVA.unsafe_from_int(value)  # validated to [0, 2**64) by the schema


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

    if TYPE_CHECKING:

        def __init__(self, value: int, device: Device, *, use_unsafe_from_int: Never) -> None: ...

    def __post_init__(self) -> None:
        Address.__post_init__(self)
        if not isinstance(self.device, Device):
            raise InvalidDeviceError(f"DeviceAlias needs a Device, got {describe(self.device)}")

    @classmethod
    def unsafe_from_int(cls, value: int, device: Device) -> DeviceAlias:
        """``value`` declared a device alias for kernels on ``device``: the one way to wrap
        a raw ``int`` that type-checks. Nothing checks the domain or the device (an int
        from ``tolist()`` of a pointer tensor, a host VA's ``.value``); prefer the aliases
        a :class:`~pointerdomain.PointerTable` or ``resolve_alias`` gives.

        Raises:
            DomainError: ``value`` is not an int (a ``TypeError``).
            InvalidArgumentError: ``value`` is outside ``[0, 2**64)`` (a ``ValueError``).
            InvalidDeviceError: ``device`` is not a :class:`~pointerdomain.Device`.
        """
        return cls(value, device)  # type: ignore[call-arg]  # the sanctioned raw wrap

    def _with_value(self, value: int) -> DeviceAlias:
        alias = DeviceAlias.unsafe_from_int(value, self.device)
        return alias if self.span is None else replace(alias, span=self.span)

    @overload
    def __sub__(self, other: DeviceAlias) -> int: ...
    @overload
    def __sub__(self, other: int) -> DeviceAlias: ...
    def __sub__(self, other: DeviceAlias | int) -> int | DeviceAlias:
        return self._distance(other)

    def __lt__(self, other: DeviceAlias) -> bool:
        return self.value < self._ordered(other)

    def __le__(self, other: DeviceAlias) -> bool:
        return self.value <= self._ordered(other)

    def __gt__(self, other: DeviceAlias) -> bool:
        return self.value > self._ordered(other)

    def __ge__(self, other: DeviceAlias) -> bool:
        return self.value >= self._ordered(other)

    def _check_same_device(self, other: DeviceAlias) -> None:
        if other.device != self.device:
            raise DeviceMismatchError(f"aliases of {self.device} and {other.device} cannot be compared or subtracted")

    def __repr__(self) -> str:
        return f"DeviceAlias({self.value:#x}, {self.device})"


#: One concrete address domain, for helpers generic over the domain::
#:
#:     def span(lo: AddressT, hi: AddressT) -> int:
#:         return hi - lo          # both HostVA, or both DeviceAlias
#:
#: Constrained (not bound to Address), so ``span(va, alias)`` is a static error and
#: the body is checked once per domain.
AddressT = TypeVar("AddressT", HostVA, DeviceAlias)
