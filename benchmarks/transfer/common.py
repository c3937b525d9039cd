"""The benchmark's ground floor: sizes, directions, formatting, the pools of a case and
their torch reference, the run's environment, and the view of the bench that
:mod:`.methods` and :mod:`.report` are given. It imports no other module of the
benchmark, so harness -> methods / report -> common has no loop.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

try:
    import pointerdomain as pd
except ImportError:  # a source checkout that was not installed: use src/ (needs the built extension there)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "src"))
    import pointerdomain as pd

__all__ = ["BenchView", "Case", "Side", "Skip", "fmt_bytes", "fmt_size", "load_average", "model_shape", "optional",
           "pd", "run_date", "versions"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ITEM_SIZES = (512, 1024, 1152, 2048, 4096, 16384, 65536)
DIRECTIONS = ("D2H", "H2D")
DIRECTION_TEXT = {
    "D2H": "D2H: device pool -> host pool (backup)",
    "H2D": "H2D: host pool -> device pool (load)",
}
CHECK_POOL_BYTES = {True: 8 * MiB, False: 2 * MiB}  # the small case compared byte for byte (CUDA / CPU)
SAMPLE_CHECK_BYTES = 16 * MiB  # CPU full-size check: items compared (all of them on CUDA)
NOISE_SLACK = 1 * MiB  # CPU poison: a window of a noise buffer at one of this many offsets


class Skip(Exception):
    """A method that cannot run here (reason in the message)."""


def fmt_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def optional(name: str) -> Any:
    try:
        module = __import__(name)
        for part in name.split(".")[1:]:
            module = getattr(module, part)
        return module
    except Exception:
        return None


def model_shape(item: int, attention: str) -> dict[str, Any]:
    """Heads / head_dim (bf16) giving ``item`` bytes per token-layer: GQA-like 128-wide
    heads where the size allows (2 KiB = 8 x 128), else one head; MLA one latent vector."""
    if attention == "mla":
        return dict(attention="mla", num_heads=1, head_dim=item // 2, dtype="bfloat16")
    if item % 256 == 0:
        return dict(attention="mha", num_heads=item // 256, head_dim=128, dtype="bfloat16")
    return dict(attention="mha", num_heads=1, head_dim=item // 2, dtype="bfloat16")


# ----------------------------------------------------------------------------- the torch reference


@dataclass
class Side:
    """One pool of a case: its layout, kernel table and bytes (``flat``: uint8, exactly
    ``layout.nbytes``)."""

    name: str
    layout: Any
    table: Any
    flat: torch.Tensor
    is_host: bool

    def items_view(self, flat: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The one-buffer form (``KVLayout.buffer_shape``) with the item as a byte row."""
        lo = self.layout
        shape = lo.buffer_shape[:-2] + (lo.item_bytes,)
        return (self.flat if flat is None else flat).view(shape)

    def gather(self, slots: torch.Tensor, flat: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Items of ``slots`` as [kv, layers, n, item] by torch indexing (the reference)."""
        v = self.items_view(flat)
        return _pick(self.layout, v, slots.to(v.device))

    def scatter(self, slots: torch.Tensor, items: torch.Tensor, flat: torch.Tensor) -> None:
        """Write [kv, layers, n, item] ``items`` to ``slots`` of ``flat`` by torch indexing."""
        v = self.items_view(flat)
        idx = slots.to(v.device)
        items = items.to(v.device)
        kind = self.layout.kind
        if kind == "layer_first":
            v[:, :, idx] = items
        elif kind == "page_first":
            v[:, idx] = items.transpose(1, 2)
        else:
            ps = self.layout.page_size
            v[:, idx // ps, :, idx % ps] = items.permute(2, 0, 1, 3)

    def item_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Byte offset in ``flat`` of every item of ``slots`` as int64 [n, kv, layers]
        (slot-major), found by picking item numbers with the same torch indexing as the
        reference (no address formula of its own)."""
        lo = self.layout
        numbers = torch.arange(lo.nbytes // lo.item_bytes, dtype=torch.int64).view(lo.buffer_shape[:-2] + (1,))
        return (_pick(lo, numbers, slots.cpu())[..., 0].permute(2, 0, 1) * lo.item_bytes).contiguous()


def _pick(layout: Any, v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[kv, layers, n, item] from a one-buffer-shaped view ``v`` with the item as its last dim."""
    if layout.kind == "layer_first":
        return v[:, :, idx]
    if layout.kind == "page_first":
        return v[:, idx].transpose(1, 2)
    ps = layout.page_size  # page_first_direct [kv, pages, layers, page_size, item]
    return v[:, idx // ps, :, idx % ps].permute(1, 2, 0, 3)  # [n, kv, layers, item] -> [kv, layers, n, item]


@dataclass
class Case:
    """A device pool and a host pool of one model shape and the slots moved between them:
    whole pages in random order, expanded to token slots (CPU int64)."""

    item: int
    attention: str
    dev: Side
    host: Side
    dev_slots: torch.Tensor
    host_slots: torch.Tensor

    @property
    def bytes_per_slot(self) -> int:
        lo = self.dev.layout
        return lo.num_kv * lo.num_layers * lo.item_bytes

    def ends(self, direction: str) -> tuple[Side, Side]:
        return (self.dev, self.host) if direction == "D2H" else (self.host, self.dev)

    def slots(self, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.dev_slots, self.host_slots) if direction == "D2H" else (self.host_slots, self.dev_slots)


def load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run_date() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, Any]:
    return dict(pointerdomain=getattr(pd, "__version__", "?"), torch=torch.__version__, torch_cuda=torch.version.cuda,
                python=platform.python_version(), platform=platform.platform())


class BenchView(Protocol):
    """What :mod:`.methods` and :mod:`.report` read of the running bench
    (:class:`.harness.Bench`)."""

    args: Any
    cuda: bool
    device: Any
    tdev: torch.device
    stream: Any
    sms: Optional[int]
    methods: list[Any]
    notes: list[str]
    results: list[dict[str, Any]]
