"""Double-mapped host memory for strict alias mode (``src/kernels/strict_alloc.cpp``).

:func:`double_map` returns two uint8 tensors over the same physical pages: the
*host* mapping (what :class:`~pointerdomain.HostVA` holds: CPU code, metadata,
host tables, transfer engines; never registered) and the *registered* mapping
(what the backend registers and asks the device alias of). Bytes written through
one are read through the other. On CUDA the registered mapping is a memfd of its
own; on the emulated backend it is the backend's own memfd allocation, so the
emulated registration (a third mapping) still works.
"""

from __future__ import annotations

import torch

from pointerdomain import _C
from pointerdomain._platform.base import Backend

__all__ = ["double_map"]


def double_map(backend: Backend, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(host mapping, registered mapping) of ``nbytes`` page-aligned bytes.

    Raises:
        MemoryError: the memfd or a mapping could not be made.
    """
    registered = backend.shareable_host_alloc(nbytes)
    host = _C.strict_mirror(registered.data_ptr(), nbytes)
    return host[:nbytes], registered[:nbytes]
