"""The backend's count of device-memory releases, which the compat caches compare on
every cached call (:func:`pointerdomain._platform.memory_generation`)."""

from __future__ import annotations

import torch

import pointerdomain as pd

DEV = pd.Device("emulated", 0)


def test_the_release_count_moves_on_a_free_and_only_then() -> None:
    from pointerdomain._platform import memory_generation

    t = pd.device_empty((4096,), dtype=torch.uint8, device=DEV)
    before = memory_generation()
    kept = pd.device_empty((4096,), dtype=torch.uint8, device=DEV)
    assert memory_generation() == before  # an allocation frees nothing
    del t
    assert memory_generation() == before + 1
    del kept
    assert memory_generation() == before + 2
