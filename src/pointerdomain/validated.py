"""Pydantic models that are always validated: the base of pointerdomain's public models.

pydantic builds a model **without validation** in two ways: ``model_construct(**values)``
and ``model_copy(update=...)``. On a model with a :class:`~pointerdomain.HostVA` field,
``BufferInfo.model_copy(update={"address": alias})`` would hold a
:class:`~pointerdomain.DeviceAlias` (and serialise it as a host VA, which a transfer
engine then reads), ``update={"nbytes": -1}`` a negative size, and
``KVLayout.model_construct(num_pages=0)`` a layout the kernels would trust.

:class:`ValidatedModel` closes both:

* ``model_construct`` is refused statically (its parameters are ``Never``, so any
  argument is a type error under mypy and pyright) and at run time
  (:class:`~pointerdomain.errors.DomainError`);
* ``model_copy`` validates the copy like a new model (an invalid update raises the
  model's validation error; a misspelt field is an unknown field), and its ``update``
  parameter is typed ``None``: an ``update=`` dict is a static error, because a
  ``dict[str, Any]`` cannot be checked field by field. Typed code derives a model with
  its ``replace(**changes)`` (``KVLayout.replace``, ``BufferInfo.replace``), whose
  changes are a ``TypedDict``. ``copy.replace`` (Python 3.13) goes through
  ``model_copy`` and is validated too.

Build models with the class call or ``model_validate``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from typing_extensions import Never, Self

from pydantic import BaseModel, ConfigDict

from pointerdomain.errors import DomainError, InvalidTypeError

__all__ = ["ValidatedModel"]


class ValidatedModel(BaseModel, frozen=True):
    """A frozen pydantic model whose every derivation is validated: no unvalidated
    ``model_construct``, and a ``model_copy`` that validates. Strict and ``extra="forbid"``
    by default, so a misspelt field in an untyped update is an error, not ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @classmethod
    def model_construct(cls, *args: Never, **values: Never) -> Self:  # type: ignore[override]  # refused on purpose
        """Refused: it would skip validation (a DeviceAlias in a HostVA field).

        Typed with ``Never`` parameters, so a call with any argument is a static error;
        the return type stays ``Self`` (not ``Never``) so that checkers keep checking the
        code after a call instead of treating it as unreachable.

        Raises:
            DomainError: always; use ``cls(**fields)`` or ``cls.model_validate(data)``.
        """
        raise DomainError(
            f"{cls.__name__}.model_construct() skips validation (a device alias could land in a HostVA "
            f"field, a bad size in a layout): build it with {cls.__name__}(...) or {cls.__name__}.model_validate(...)"
        )

    def model_copy(self, *, update: None = None, deep: bool = False) -> Self:  # type: ignore[override]  # validated
        """A copy of this model, **validated** like a new one.

        ``update`` is typed ``None``: a mapping of changes cannot be type-checked field by
        field, so passing one is a static error; derive with the model's typed
        ``replace(**changes)`` instead. Untyped callers may still pass a mapping: it is
        applied and the result validated (an unknown field, a wrong type or an invalid
        value raises, nothing is copied).

        Args:
            update: None; or, from untyped code, a mapping of field name to new value.
            deep: deep-copy the field values first.

        Raises:
            InvalidTypeError: ``update`` is neither None nor a mapping (a ``TypeError``).
            pydantic.ValidationError: the result is invalid (the model's own subclass of
                it: ``MetadataValidationError`` for metadata, ``LayoutFieldError`` for a
                layout, both also ``ValueError`` / ``PointerDomainError``).
        """
        changes: object = update  # untyped callers pass a dict here
        if changes is not None and not isinstance(changes, Mapping):
            raise InvalidTypeError(
                f"{type(self).__name__}.model_copy: update found a {type(changes).__name__}, expected a mapping of "
                f"field names to values or None. Fix: use {type(self).__name__}.replace(field=value)"
            )
        return self._derive(changes or {}, deep=deep)

    def _derive(self, changes: Mapping[str, object], *, deep: bool = False) -> Self:
        """This model's fields with ``changes`` applied, validated by ``model_validate``
        (each subclass's, so its own error type). The field values themselves are used,
        not ``model_dump()``: that serialises (a HostVA to its int) and drops excluded
        fields."""
        data: dict[str, Any] = {name: getattr(self, name) for name in type(self).model_fields}
        if deep:
            data = copy.deepcopy(data)
        data.update(changes)
        return type(self).model_validate(data)
