"""Environment variables pointerdomain reads, parsed strictly, in one place.

========================================  ==============================================  =========
variable                                  values                                           default
========================================  ==============================================  =========
``POINTERDOMAIN_CHECKED``                 ``0`` (off) or ``1`` (checked mode on, read at   ``0``
                                          import; :mod:`pointerdomain.transfer.checked`)
``POINTERDOMAIN_CGROUP_ROOT``             the cgroup file system's directory (the memory  ``/sys/fs/cgroup``
                                          budget reads ``memory.max`` / ``memory.current``)
``POINTERDOMAIN_EMULATE_MEMLOCK``         ``0`` or ``1`` (the emulated backend counts      ``0``
                                          registered bytes against RLIMIT_MEMLOCK)
``POINTERDOMAIN_SEGMENT_DIR``             the ledger of registered shared segments         ``/dev/shm/...``
``POINTERDOMAIN_EMULATED_DEVICES``        a positive int (number of emulated devices;     ``2``
                                          ``devices.emulated_device_count`` raises
                                          InvalidDeviceError for anything else)
========================================  ==============================================  =========

Unset or empty means the default. Any other value of a flag (``true``, ``yes``, ``2``)
is not silently ignored: it gives an :class:`EnvironmentValueWarning` naming the
variable, the value found, the values accepted and the default used instead. (``POINTERDOMAIN_GPU`` is a build-time CMake
option, see the README; it is not read at run time.)

Every variable the package reads is in :data:`VARIABLES` and read through :func:`text`,
:func:`flag` or :func:`positive_int`; docs/design.md's table is :func:`markdown_table`
(tests/platform/test_env.py keeps the two the same).
"""

from __future__ import annotations

import os
import warnings
from typing import Any
from dataclasses import dataclass

__all__ = [
    "BUILD_TIME",
    "CGROUP_ROOT",
    "CHECKED",
    "EMULATED_DEVICES",
    "EMULATED_PROFILE",
    "EMULATE_MEMLOCK",
    "REGISTRATION_API",
    "SEGMENT_DIR",
    "SGLANG_BLOCK_QUOTA",
    "STRICT_ALIAS",
    "VARIABLES",
    "EnvironmentValueWarning",
    "Variable",
    "choice",
    "flag",
    "markdown_table",
    "positive_int",
    "text",
]

CHECKED = "POINTERDOMAIN_CHECKED"
CGROUP_ROOT = "POINTERDOMAIN_CGROUP_ROOT"
EMULATE_MEMLOCK = "POINTERDOMAIN_EMULATE_MEMLOCK"
EMULATED_DEVICES = "POINTERDOMAIN_EMULATED_DEVICES"
EMULATED_PROFILE = "POINTERDOMAIN_EMULATED_PROFILE"
STRICT_ALIAS = "POINTERDOMAIN_STRICT_ALIAS"
REGISTRATION_API = "POINTERDOMAIN_REGISTRATION_API"
SEGMENT_DIR = "POINTERDOMAIN_SEGMENT_DIR"
SGLANG_BLOCK_QUOTA = "SGLANG_HICACHE_BLOCK_QUOTA"


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, the values it takes, its default and its
    effect, as docs/design.md's table shows them (Markdown)."""

    name: str
    values: str
    default: str
    effect: str


#: Every variable read at run time (through this module).
VARIABLES: tuple[Variable, ...] = (
    Variable(CHECKED, "`0`, `1`", "`0`", "checked mode (read at import; `checked.set_enabled` at run time)"),
    Variable(EMULATE_MEMLOCK, "`0`, `1`", "`0`", "emulated registrations count against `RLIMIT_MEMLOCK`"),
    Variable(EMULATED_DEVICES, "a positive decimal int", "`2`",
             "number of emulated devices; anything else: `InvalidDeviceError` at first use "
             "(`devices.emulated_device_count`)"),
    Variable(EMULATED_PROFILE, "`distinct`, `coherent`, `vmm-host`", "`distinct`",
             "the emulated platform: distinct aliases; a coherent part (pageable memory device-readable, "
             "registration refused); host allocations as VMM handles (read when the emulated backend is built)"),
    Variable(STRICT_ALIAS, "`0`, `1`", "`0`",
             "strict alias mode at import (`pointerdomain.strict_alias` at run time)"),
    Variable(REGISTRATION_API, "`driver`, `runtime`", "`driver`",
             "CUDA registrations through the driver API (`runtime`: the runtime API; HIP: always the runtime)"),
    Variable(CGROUP_ROOT, "a directory", "`/sys/fs/cgroup`",
             "where the memory budget reads the cgroup's `memory.max` / `memory.current` (v1: `memory/`); one "
             "that is not a directory warns (`EnvironmentValueWarning`) and no cgroup limit is read"),
    Variable(SEGMENT_DIR, "a directory", "`/dev/shm/pointerdomain-segments-<uid>`",
             "the host-wide ledger of registered shared segments (processes that share one must agree)"),
    Variable(SGLANG_BLOCK_QUOTA, "an int; anything else is the default", "`2` (HIP: `16`)",
             "upstream sgl-kernel's block quota, read by `pointerdomain.compat.sgl_kernel` as upstream reads it"),
)

#: Variables of the build, not read at run time (the table lists them after :data:`VARIABLES`).
BUILD_TIME: tuple[Variable, ...] = (
    Variable("POINTERDOMAIN_GPU", "`auto`, `cuda`, `hip`, `none`", "`auto`", 'build time only (CMake, README "Building")'),
)

_NAMES = frozenset(v.name for v in VARIABLES)
_STORE: dict[object, object] | None = getattr(os.environ, "_data", None)
if type(_STORE) is not dict:
    _STORE = None
_KEYS: dict[str, object] = {n: getattr(os.environ, "encodekey", lambda k: k)(n) for n in _NAMES}
_DECODE: Any = getattr(os.environ, "decodevalue", str)


def text(name: str) -> str | None:
    """The raw value of ``name`` (one of :data:`VARIABLES`), or None where unset: for the
    variables whose own parser gives a typed error or follows upstream.

    Raises:
        KeyError: ``name`` is not in :data:`VARIABLES` (a variable must be listed to be read).
    """
    if name not in _NAMES:
        raise KeyError(f"{name} is not in pointerdomain.env.VARIABLES: list it there (and in the docs) first")
    if _STORE is not None:
        # os.environ's own dict (kept in step by os.environ writes): a miss through the
        # Mapping API raises and catches a KeyError, about 1 us on the per-call compat path.
        raw = _STORE.get(_KEYS[name])
        return None if raw is None else _DECODE(raw)
    return os.environ.get(name)



def markdown_table() -> str:
    """docs/design.md's table of :data:`VARIABLES` and :data:`BUILD_TIME`."""
    rows = ["| variable | values | default | effect |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.values} | {v.default} | {v.effect} |" for v in (*VARIABLES, *BUILD_TIME)]
    return "\n".join(rows) + "\n"


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
    text = _read(name)
    if text in ("", "0"):
        return False
    if text == "1":
        return True
    _warn(name, text, "'0' or '1'", "0")
    return False


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """``name`` as one of ``choices``; unset or ``""`` gives ``default``; anything else
    warns (:class:`EnvironmentValueWarning`) and gives ``default``."""
    text = _read(name)
    if text == "":
        return default
    if text in choices:
        return text
    _warn(name, text, " or ".join(repr(c) for c in choices), default)
    return default


def positive_int(name: str, default: int) -> int:
    """``name`` as a positive decimal int; unset or ``""`` gives ``default``; anything
    else warns (:class:`EnvironmentValueWarning`) and gives ``default``."""
    text = _read(name)
    if text == "":
        return default
    if text.isascii() and text.isdigit() and int(text) >= 1:
        return int(text)
    _warn(name, text, "a positive int", default)
    return default


def _read(name: str) -> str:
    value = text(name)
    return "" if value is None else value
