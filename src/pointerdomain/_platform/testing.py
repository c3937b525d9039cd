"""The test hook: run a block with another backend for a device type.

Example (fail the third registration call with status 2)::

    from pointerdomain._platform import backend_for
    from pointerdomain._platform.faulty import FaultyBackend
    from pointerdomain._platform.testing import install_backend

    with install_backend(FaultyBackend(backend_for(dev), fail={"register": {3: 2}}), "emulated"):
        ...  # every backend_for(Device("emulated", n)) returns the faulty backend

Objects created inside the block (registrations) keep the backend they were made
with, so they unregister through it after the block. Not thread-safe against
launches on the same device type in other threads: for tests only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

from pointerdomain._platform import _swap
from pointerdomain._platform.base import Backend

__all__ = ["install_backend"]

B = TypeVar("B", bound=Backend)


@contextlib.contextmanager
def install_backend(backend: B, device_type: str) -> Iterator[B]:
    """Make ``backend`` the backend of every ``device_type`` device for the block;
    the previous one comes back on exit, exceptions included."""
    previous = _swap(device_type, backend)
    try:
        yield backend
    finally:
        _swap(device_type, previous)
