"""Double-mapped host memory for strict alias mode (``src/kernels/strict_alloc.cpp``).

:func:`double_map` returns two uint8 tensors over the same physical pages: the
*host* mapping (what :class:`~pointerdomain.HostVA` holds: CPU code, metadata,
host tables, transfer engines; never registered) and the *registered* mapping
(what the backend registers and asks the device alias of). Bytes written through
one are read through the other. On CUDA the registered mapping is a memfd of its
own; on the emulated backend it is the backend's own memfd allocation, so the
emulated registration (a third mapping) still works.

Memory registered in several chunks gets one more mapping per chunk (:class:`ChunkTwins`):
each chunk is registered at its own twin, placed apart from the others with guard pages
between, so where the alias is the registered address (CUDA with
``CanUseHostPointerForRegisteredMem`` = 1) the chunks' aliases are not one range either,
as they are not on MI355X: alias arithmetic that crosses a chunk boundary faults. The
emulated backend's alias is already a mapping of its own per registration, apart from
the others, so there the chunks are registered on the one registered mapping.
"""

from __future__ import annotations

import mmap

import torch

from pointerdomain import _C
from pointerdomain._platform.base import Backend

__all__ = ["ChunkTwins", "double_map"]


def double_map(backend: Backend, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(host mapping, registered mapping) of ``nbytes`` page-aligned bytes.

    Raises:
        MemoryError: the memfd or a mapping could not be made.
    """
    registered = backend.shareable_host_alloc(nbytes)
    host = _C.strict_mirror(registered.data_ptr(), nbytes)
    return host[:nbytes], registered[:nbytes]


class ChunkTwins:
    """Where each chunk of a strict registration is registered (see the module docstring).

    Args:
        backend: the registration's backend.
        registered: the registered mapping from :func:`double_map`.

    Attributes:
        maps: the twin mappings made so far (kept alive by the registration until its
            chunks are unregistered).
    """

    def __init__(self, backend: Backend, registered: torch.Tensor) -> None:
        self._own_mappings = not backend.alias_is_mapping
        self._base = registered.data_ptr()
        self.maps: list[torch.Tensor] = []

    def address(self, offset: int, nbytes: int, whole: bool) -> int:
        """The address to register bytes ``[offset, offset + nbytes)`` of the memory at:
        the registered mapping itself for the only chunk (``whole``) or on the emulated
        backend, else a new twin of the pages holding them (the same offset in the page).

        Raises:
            MemoryError: the twin could not be mapped.
        """
        if whole or not self._own_mappings:
            return self._base + offset
        lo = (self._base + offset) // mmap.PAGESIZE * mmap.PAGESIZE
        skip = self._base + offset - lo
        twin = _C.strict_twin(lo, skip + nbytes)
        self.maps.append(twin)
        return twin.data_ptr() + skip
