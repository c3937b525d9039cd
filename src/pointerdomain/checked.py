"""Checked mode: before a launch, every address the launch will touch is looked up
in the registry of known registrations and device allocations.

Off by default; on with ``POINTERDOMAIN_CHECKED=1`` or :func:`set_enabled`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pointerdomain.domains import DeviceAlias
    from pointerdomain.layouts import KVLayout
    from pointerdomain.tables import PointerTable

__all__ = ["enabled", "set_enabled", "verify_launch"]

_enabled = os.environ.get("POINTERDOMAIN_CHECKED") == "1"


def enabled() -> bool:
    """Whether checked mode is on."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn checked mode on or off for this process."""
    global _enabled
    _enabled = bool(on)


def verify_launch(
    src: PointerTable[DeviceAlias],
    src_layout: KVLayout,
    dst: PointerTable[DeviceAlias],
    dst_layout: KVLayout,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_count: int,
) -> None:
    """Check every page the launch touches against the registry (not yet implemented)."""
    raise NotImplementedError("checked mode is not implemented yet")
