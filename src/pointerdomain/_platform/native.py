"""Build facts of the extension (imported lazily by the package)."""

from __future__ import annotations

from pointerdomain import _C
from pointerdomain._C import KernelPlan

__all__ = ["GPU_BUILT", "OPS", "KernelPlan", "PATH"]

#: The extension was built with the CUDA (or HIP) kernels and runtime ops.
GPU_BUILT: bool = _C.gpu_built
#: The extension's file.
PATH: str = str(_C.__file__)
#: Names of the extension's functions and classes.
OPS: tuple[str, ...] = tuple(sorted(name for name in dir(_C) if not name.startswith("_") and callable(getattr(_C, name))))
