"""HostVA / DeviceAlias (pointerdomain.domains): arithmetic keeps the domain, no int leaks."""

from __future__ import annotations

import pytest

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import DEV


def test_address_arithmetic_keeps_domain() -> None:
    a = pd.HostVA(0x1000)
    assert a + 16 == pd.HostVA(0x1010) and isinstance(a + 16, pd.HostVA)
    assert (a + 48) - a == 48
    d = pd.DeviceAlias(0x2000, DEV)
    assert (d + 8).device == DEV and (d + 8).value == 0x2008
    assert d.offset(-0x1000) == pd.DeviceAlias(0x1000, DEV)


@pytest.mark.parametrize("bad", [lambda a, d: a + a, lambda a, d: a - d, lambda a, d: a < d, lambda a, d: a + d])
def test_cross_domain_arithmetic_raises(bad: object) -> None:
    with pytest.raises(errors.DomainError):
        bad(pd.HostVA(0x1000), pd.DeviceAlias(0x1000, DEV))  # type: ignore[operator]


def test_addresses_reject_ints_and_leak_no_int() -> None:
    assert pd.HostVA(5) != pd.DeviceAlias(5, DEV)  # type: ignore[comparison-overlap]
    with pytest.raises(errors.DomainError):
        pd.HostVA(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pd.HostVA(-1)
    with pytest.raises(TypeError):
        int(pd.HostVA(5))  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        [0, 1][pd.HostVA(0)]  # type: ignore[call-overload]


def test_alias_distance_across_devices_raises() -> None:
    with pytest.raises(errors.DeviceMismatchError):
        pd.DeviceAlias(10, DEV) - pd.DeviceAlias(4, pd.Device("emulated", 1))


@pytest.mark.parametrize("bases", [(pd.HostVA,), (pd.DeviceAlias,), (pd.HostVA, pd.DeviceAlias), (pd.DeviceAlias, pd.HostVA)],
                         ids=["host", "alias", "both", "both-reversed"])
def test_the_domains_are_final_at_run_time(bases: tuple[type, ...]) -> None:
    """A class deriving from a domain would pass isinstance checks of a domain it is not in
    (from both: every launch check and every metadata check at once)."""
    with pytest.raises(errors.DomainError, match="final"):
        type("Both", bases, {})
    with pytest.raises(TypeError):  # DomainError is a TypeError too
        type("Both", bases, {})
