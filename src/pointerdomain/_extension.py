"""Loading of the compiled extension, kept lazy so the typed layer imports even
when the extension is missing (the error then names the fix)."""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

from pointerdomain.errors import ExtensionUnavailableError

_lock = threading.Lock()
_module: ModuleType | None = None


def extension() -> ModuleType:
    """Return ``pointerdomain._C``.

    Raises:
        ExtensionUnavailableError: the module is not built or fails to import.
    """
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                try:
                    _module = importlib.import_module("pointerdomain._C")
                except ImportError as exc:
                    raise ExtensionUnavailableError(
                        "pointerdomain._C could not be imported "
                        f"({exc}); reinstall with `pip install .` from a source checkout "
                        "so the extension is built for this Python"
                    ) from exc
    return _module


def gpu_ops_built() -> bool:
    """True when the extension was built with the CUDA (or HIP) kernels and runtime ops."""
    return bool(getattr(extension(), "gpu_built", False))
