"""Environment variables pointerdomain reads, parsed strictly, in one place.

========================================  ==============================================  =========
variable                                  values                                           default
========================================  ==============================================  =========
``POINTERDOMAIN_CHECKED``                 ``0`` (off) or ``1`` (checked mode on, read at   ``0``
                                          import; :mod:`pointerdomain.transfer.checked`)
``POINTERDOMAIN_EMULATE_MEMLOCK``         ``0`` or ``1`` (the emulated backend counts      ``0``
                                          registered bytes against RLIMIT_MEMLOCK)
``POINTERDOMAIN_EMULATED_DEVICES``        a positive int (number of emulated devices;     ``2``
                                          ``devices.emulated_device_count`` raises
                                          InvalidDeviceError for anything else)
========================================  ==============================================  =========

Unset or empty means the default. Any other value of a flag (``true``, ``yes``, ``2``)
is not silently ignored: it gives an :class:`EnvironmentValueWarning` naming the
variable, the value found, the values accepted and the default used instead. (``POINTERDOMAIN_GPU`` is a build-time CMake
option, see the README; it is not read at run time.) docs/design.md lists them too.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["CHECKED", "EMULATE_MEMLOCK", "EMULATED_DEVICES", "EnvironmentValueWarning", "flag", "positive_int"]

CHECKED = "POINTERDOMAIN_CHECKED"
EMULATE_MEMLOCK = "POINTERDOMAIN_EMULATE_MEMLOCK"
EMULATED_DEVICES = "POINTERDOMAIN_EMULATED_DEVICES"


class EnvironmentValueWarning(UserWarning):
    """A pointerdomain environment variable holds an undocumented value; the default
    is used instead (the message names the variable, the value and the values accepted)."""


def _warn(name: str, text: str, accepted: str, default: object) -> None:
    warnings.warn(
        f"{name}={text!r}: found an undocumented value, expected {accepted}; using the default {default!r}. "
        f"Fix: set {name} to {accepted} or unset it (pointerdomain.env lists every variable)",
        EnvironmentValueWarning,
        stacklevel=3,
    )


def flag(name: str) -> bool:
    """``name`` as a flag: ``"1"`` is True; unset, ``""`` or ``"0"`` False; anything
    else warns (:class:`EnvironmentValueWarning`) and is False."""
    text = os.environ.get(name, "")
    if text in ("", "0"):
        return False
    if text == "1":
        return True
    _warn(name, text, "'0' or '1'", "0")
    return False


def positive_int(name: str, default: int) -> int:
    """``name`` as a positive decimal int; unset or ``""`` gives ``default``; anything
    else warns (:class:`EnvironmentValueWarning`) and gives ``default``."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    if text.isascii() and text.isdigit() and int(text) >= 1:
        return int(text)
    _warn(name, text, "a positive int", default)
    return default
