"""The install hint for builds without the GPU ops (no extension import needed)."""

from __future__ import annotations

__all__ = ["BUILD_HINT"]

BUILD_HINT = (
    "install a pointerdomain build with the GPU ops: `pip install --no-build-isolation .` on a machine "
    "with the CUDA toolkit (nvcc on PATH) or, for ROCm, with POINTERDOMAIN_GPU=hip (README, Building)"
)
