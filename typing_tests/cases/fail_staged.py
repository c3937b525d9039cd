"""The staged path's configuration and backend name are typed: a misspelt backend, a
size given as a string or a float, a ring given as a string are static errors."""

from __future__ import annotations

from pointerdomain import TransferBackend, staged

bad: TransferBackend = "stage"  # type: ignore[assignment]
staged.set_staging("cuda:0", nbytes="16MiB")  # type: ignore[arg-type]
staged.set_staging("cuda:0", nbytes=1.6e7)  # type: ignore[arg-type]
staged.set_staging("cuda:0", ring="2")  # type: ignore[arg-type]
staged.set_staging("cuda:0", 16 << 20)  # type: ignore[call-arg]
