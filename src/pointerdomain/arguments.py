"""Run-time checks of public parameters, shared by every entry point.

A type checker catches a misspelt ``Literal`` or a string where a bool or a policy
object belongs, but untyped callers reach the library too: ``order="layers_first"``
must not be taken as the default, nor ``merge="no"`` as true. Each check raises a
typed error (:mod:`pointerdomain.errors`) that names the parameter, before anything
is allocated, registered or launched.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

from pointerdomain.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["check_bool", "check_choice", "check_instance", "check_span", "describe", "storage_short"]

T = TypeVar("T")

#: the end of the 64-bit address space (domains.ADDRESS_LIMIT; domains imports this module)
_ADDRESS_LIMIT = 2**64

#: the most characters :func:`describe` gives for one value
_DESCRIBE_LIMIT = 80


def storage_short(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s storage holds fewer bytes than the tensor views (its storage
    was released with ``untyped_storage().resize_(0)``, or shrunk): reading its elements,
    even to print them, reads freed memory. Negative strides are not made by torch; a
    tensor without a storage (sparse, nested) counts as short."""
    try:
        held = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return True
    if tensor.numel() == 0:
        return False
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return held < (last + 1) * tensor.element_size()


def _describe_tensor(tensor: torch.Tensor) -> str:
    state = ", storage released" if storage_short(tensor) else ""
    return f"Tensor(shape={tuple(tensor.shape)}, dtype={tensor.dtype}, device={tensor.device}{state})"


def describe(value: object, limit: int = _DESCRIBE_LIMIT) -> str:
    """``value`` for an error message: ``repr`` cut to ``limit`` characters, except that a
    tensor (also inside a list, tuple or dict) is its shape, dtype and device, never its
    elements (``repr`` of a tensor whose storage was released reads freed memory), a
    container shows its first 4 items, and a ``repr`` that raises is the type's name.
    Never raises."""
    try:
        torch_module = sys.modules.get("torch")  # not imported: no tensor exists (importing it costs seconds)
        if torch_module is not None and isinstance(value, torch_module.Tensor):
            return _describe_tensor(value)
        if isinstance(value, (list, tuple)):
            inner = ", ".join(describe(v, limit) for v in list(value)[:4]) + (", ..." if len(value) > 4 else "")
            text = f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        elif isinstance(value, dict):
            items = list(value.items())
            inner = ", ".join(f"{describe(k, limit)}: {describe(v, limit)}" for k, v in items[:4])
            text = "{" + inner + (", ..." if len(items) > 4 else "") + "}"
        else:
            text = repr(value)
            return text if len(text) <= limit else text[: limit - 3] + "..."
    except Exception:  # a broken __repr__ must not replace the error being reported
        return f"<{type(value).__name__} object>"
    return text


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool (an int, a string or None is not).

    Raises:
        InvalidTypeError: anything else (a ``TypeError`` too), naming ``name``.
    """
    if type(value) is not bool:
        raise InvalidTypeError(
            f"{name}: found {describe(value)} ({type(value).__name__}), expected a bool (True or False). "
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
        raise InvalidArgumentError(f"{name}: found {describe(value)}, expected one of {listed}. Fix: pass one of them")
    return value


def check_instance(name: str, value: object, cls: type[T], fix: str = "") -> T:
    """``value`` if it is a ``cls`` (a string naming one is not: ``policy="degrade"``).

    Raises:
        InvalidTypeError: anything else (a ``TypeError`` too), naming ``name``.
    """
    if not isinstance(value, cls):
        raise InvalidTypeError(
            f"{name}: found {describe(value, 60)} ({type(value).__name__}), expected a {cls.__name__}."
            + (f" Fix: {fix}" if fix else f" Fix: pass a {cls.__name__}")
        )
    return value


def check_span(name: str, start: int, nbytes: int) -> None:
    """Refuse a range ``[start, start + nbytes)`` that runs past the 64-bit address
    space: an engine or kernel adding the two would wrap to low memory.

    Raises:
        InvalidArgumentError: ``start + nbytes > 2**64`` (a ``ValueError`` too), naming ``name``.
    """
    if start + nbytes > _ADDRESS_LIMIT:
        raise InvalidArgumentError(
            f"{name}: found the range [{start:#x}, +{nbytes}), which runs past the end of the 64-bit address space "
            f"(2**64) and would wrap, expected a range that ends at or below 2**64. Fix: pass the buffer's own "
            "address and size"
        )
