"""Helpers shared by the pass_*.py case files (not a case file itself).

The pass files run as scripts on a CPU-only machine, on the emulated device, so
they need no pytest: ``raises`` is a small stand-in for ``pytest.raises``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch

from pointerdomain import KVLayout

#: The emulated devices every pass file runs on (POINTERDOMAIN_EMULATED_DEVICES >= 2).
DEVICE = "emulated:0"
OTHER_DEVICE = "emulated:1"


@contextmanager
def raises(expected: type[BaseException], match: str = "") -> Generator[None, None, None]:
    """Fail unless the block raises ``expected`` with ``match`` in its message."""
    try:
        yield
    except expected as exc:
        if match not in str(exc):
            raise AssertionError(f"{type(exc).__name__} raised, but {match!r} is not in {str(exc)!r}") from exc
        return
    raise AssertionError(f"{expected.__name__} was not raised")


def small_layout(kind: str = "layer_first") -> KVLayout:
    """A small MHA layout (2 layers, 4 pages of 4 tokens, 2 heads of 8 float16)."""
    return KVLayout.model_validate(
        {"kind": kind, "num_layers": 2, "num_pages": 4, "page_size": 4, "num_heads": 2, "head_dim": 8,
         "dtype": "float16"}
    )


def slots(*values: int) -> torch.Tensor:
    """An int64 index tensor on the emulated device (CPU)."""
    return torch.tensor(values, dtype=torch.int64)
