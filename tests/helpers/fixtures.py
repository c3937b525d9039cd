"""The tests' fixtures, made available to every test by tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pointerdomain import checked

__all__ = ["checked_launches"]


@pytest.fixture(autouse=True)
def checked_launches() -> Iterator[None]:
    """Every test launches in checked mode: each address a launch touches is verified
    against the registry first. Tests that measure or toggle it set it themselves; the
    state before the test is restored after it."""
    with checked.checked_mode(True):
        yield
