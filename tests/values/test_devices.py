"""Devices (pointerdomain.devices): the device guard."""

from __future__ import annotations

import pytest

import pointerdomain as pd
from pointerdomain import errors


def test_device_guard_restores_on_exception() -> None:
    from pointerdomain.devices import current_device

    assert current_device("emulated") == pd.Device("emulated", 0)
    with pytest.raises(RuntimeError):
        with pd.DeviceGuard("emulated:1"):
            assert current_device("emulated") == pd.Device("emulated", 1)
            raise RuntimeError("boom")
    assert current_device("emulated") == pd.Device("emulated", 0)
    with pytest.raises(errors.InvalidDeviceError):
        pd.DeviceGuard("emulated:5")
    with pytest.raises(errors.InvalidDeviceError):
        pd.DeviceGuard("tpu:0")
