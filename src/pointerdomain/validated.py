"""Pydantic models that are always validated: the base of pointerdomain's metadata models.

pydantic's ``model_construct(**values)`` builds a model **without validation**: on a
model with a :class:`~pointerdomain.HostVA` field, ``BufferInfo.model_construct(address=alias)``
would hold a :class:`~pointerdomain.DeviceAlias` and serialise it as a host VA, and
``KVLayout.model_construct(num_pages=0)`` a layout the kernels would trust (issue 11).
:class:`ValidatedModel` refuses it twice: statically (its parameters are ``Never``, so
any argument is a type error under mypy and pyright) and at run time
(:class:`~pointerdomain.errors.DomainError`). Build models with the class call or
``model_validate``; derive layouts with ``KVLayout.replace(**changes)``.
"""

from __future__ import annotations

from typing_extensions import Never, Self

from pydantic import BaseModel

from pointerdomain.errors import DomainError

__all__ = ["ValidatedModel"]


class ValidatedModel(BaseModel, frozen=True):
    """A frozen pydantic model without the unvalidated ``model_construct``."""

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
