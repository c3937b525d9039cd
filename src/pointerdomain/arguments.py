"""Run-time checks of public parameters, shared by every entry point.

A type checker catches a misspelt ``Literal`` or a string where a bool or a policy
object belongs, but untyped callers reach the library too: ``order="layers_first"``
must not be taken as the default, nor ``merge="no"`` as true. Each check raises a
typed error (:mod:`pointerdomain.errors`) that names the parameter, before anything
is allocated, registered or launched.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeVar

from pointerdomain.domains import ADDRESS_LIMIT
from pointerdomain.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["check_bool", "check_choice", "check_instance", "check_span"]

T = TypeVar("T")


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool (an int, a string or None is not).

    Raises:
        InvalidTypeError: anything else (a ``TypeError`` too), naming ``name``.
    """
    if type(value) is not bool:
        raise InvalidTypeError(
            f"{name}: found {value!r} ({type(value).__name__}), expected a bool (True or False). "
            f"Fix: pass {name}=True or {name}=False"
        )
    return value


def check_choice(name: str, value: T, choices: Collection[object]) -> T:
    """``value`` if it is one of ``choices`` (exactly: a bool is not the int 1).

    Raises:
        InvalidArgumentError: anything else (a ``ValueError`` too), naming ``name``.
    """
    if not any(type(value) is type(c) and value == c for c in choices):
        listed = ", ".join(repr(c) for c in choices)
        raise InvalidArgumentError(f"{name}: found {value!r}, expected one of {listed}. Fix: pass one of them")
    return value


def check_instance(name: str, value: object, cls: type[T], fix: str = "") -> T:
    """``value`` if it is a ``cls`` (a string naming one is not: ``policy="degrade"``).

    Raises:
        InvalidTypeError: anything else (a ``TypeError`` too), naming ``name``.
    """
    if not isinstance(value, cls):
        raise InvalidTypeError(
            f"{name}: found {value!r:.60} ({type(value).__name__}), expected a {cls.__name__}."
            + (f" Fix: {fix}" if fix else f" Fix: pass a {cls.__name__}")
        )
    return value


def check_span(name: str, start: int, nbytes: int) -> None:
    """Refuse a range ``[start, start + nbytes)`` that runs past the 64-bit address
    space: an engine or kernel adding the two would wrap to low memory.

    Raises:
        InvalidArgumentError: ``start + nbytes > 2**64`` (a ``ValueError`` too), naming ``name``.
    """
    if start + nbytes > ADDRESS_LIMIT:
        raise InvalidArgumentError(
            f"{name}: found the range [{start:#x}, +{nbytes}), which runs past the end of the 64-bit address space "
            f"(2**64) and would wrap, expected a range that ends at or below 2**64. Fix: pass the buffer's own "
            "address and size"
        )
