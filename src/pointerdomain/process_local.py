"""Objects whose state is only meaningful in this process (addresses, registrations,
device memory) refuse ``pickle`` and ``copy`` with a typed error.

Without this, ``pickle.dumps(table)`` fails deep inside with ``cannot pickle
'_thread.lock'``, and a shallow ``copy.copy`` would give two owners of one
registration (two ``close()`` calls, one unregistering under the other).
"""

from __future__ import annotations

from typing import NoReturn

from pointerdomain.errors import NotPicklableError

__all__ = ["ProcessLocal"]


class ProcessLocal:
    """Mixin: ``pickle``, ``copy.copy`` and ``copy.deepcopy`` raise :class:`NotPicklableError`."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        name = type(self).__name__
        raise NotPicklableError(
            f"{name}: found an attempt to pickle or copy a {name}, expected none: it holds process-local "
            "addresses (host VAs, device aliases) and registrations, which mean nothing in another process and "
            "must have one owner. Fix: share the data instead (copy the bytes into a new tensor, or send the "
            "KVLayout and BufferInfo metadata, which pickle) and build new pools/tables in the other process"
        )

    def __copy__(self) -> NoReturn:
        self.__reduce_ex__(0)

    def __deepcopy__(self, memo: object) -> NoReturn:
        self.__reduce_ex__(0)
