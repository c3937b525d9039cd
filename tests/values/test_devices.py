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


@pytest.mark.parametrize("text", ["emulated:\u0661", "emulated:\u0967", "emulated:\uff11", "emulated:\u00b9",
                                  "cuda:\u0660", "emulated:1\u0661"])
def test_device_ordinal_takes_ascii_digits_only(text: str) -> None:
    # str.isdigit() and int() take the digits of any script ("emulated:\u0661" would be ordinal 1);
    # an ordinal is ASCII, as the environment variables' parser reads it
    with pytest.raises(errors.InvalidDeviceError, match="ASCII digits"):
        pd.as_device(text)
    assert pd.as_device("emulated:1") == pd.Device("emulated", 1)
