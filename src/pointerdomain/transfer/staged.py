"""The staged copy-engine path (``backend="staged"``).

For a registered host pool whose per-slot items are one contiguous block (``page_first``:
all layers of a slot and kv are adjacent), the copy engine moves whole runs of host blocks
between the host pool and a small device staging ring, while the ordinary transfer kernel,
at ``max_ctas`` CTAs, scatters (H2D) or gathers (D2H) the items between the ring and the
device pool at HBM speed; chunk k's copies overlap chunk k-1's kernel
(``src/kernels/staged_gpu.cu``); the chunks ramp up and down at both ends (1/8, 1/4, 1/2 of
a ring slot) so the pipeline's fill and drain are short. Through the public API on the H200
with CPU index tensors it gives 0.971-0.980 x bulk at 2 CTAs for 1 KiB and 1152 B MLA items
in both directions (the default 64 MiB ring of 4 slots), above the 0.92-0.93 x ceiling of
every SM-issued H2D copy (docs/performance.md, "What bounds it").

It reads the host pool's indices on the host and so can never be captured in a CUDA
graph. Both index sets are copied to the host once and range-checked there, whatever
``validate_indices`` (so a bad slot leaves everything as it was); the host side's copy is
the one the copy descriptors are built from (no time-of-check/time-of-use gap on the host
side), and the kernel stage skips an out-of-range device slot as the kernel path does.
Either index set may be a CPU tensor (a device pool's CPU indices are checked, then copied
to the device on the launch stream through pinned memory): CPU indices cost no device
sync, while reading CUDA indices waits for the stream's earlier work, which back to back
leaves the GPU idle while the host prepares the next call (docs/performance.md has both
on the H200).

``backend="auto"`` takes it for CPU index tensors wherever it applies, at any size (see
:func:`auto_picks_staged`). Where it applies (else an explicit ``backend="staged"``
raises, and ``"auto"`` uses the kernel, or the copy engine for CPU indices): all layers
(:func:`~pointerdomain.transfer_kv_all_layer`), one table over registered host memory and
the other over device memory of the same device, the host layout ``page_first`` or
``page_first_direct`` with a slot's layers contiguous (``page_first_direct`` only when
``page_size`` is 1: its layers are ``page_size`` items apart), ``page_head`` (a slot's
head holds its layers contiguously; with several heads the launch is lowered to per-head
items, :func:`pointerdomain.layouts.lower_pair`, and ``"auto"`` does not pick the path for
those: their speed is not measured) or ``page_unified`` with one layer, and a staging
buffer that holds at least one slot.

The staging buffer is device memory cached per device (:func:`set_staging`; default
:data:`DEFAULT_STAGING_BYTES` in :data:`DEFAULT_STAGING_RING` ring slots), allocated on the
first staged transfer. Staged transfers on one device run one at a time, and one on another
stream than the previous waits for it on the GPU (the ring is shared).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Final

import torch

from pointerdomain.arguments import describe
from pointerdomain._platform import LaunchArgs, StagedCopy, StagingArgs, backend_for
from pointerdomain.registration.allocation import device_empty, memory_device
from pointerdomain.devices import Device, validate_device
from pointerdomain.domains import DeviceAlias
from pointerdomain.errors import ExtensionUnavailableError, InvalidArgumentError, LayoutError, PointerDomainError
from pointerdomain.transfer.plan import TransferPlan
from pointerdomain.registration.tables import PointerTable

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_STAGING_RING",
    "MAX_STAGING_BYTES",
    "STAGED_MAX_ITEM_BYTES",
    "STAGED_MIN_CHUNKS",
    "STAGED_MIN_CTAS",
    "StagingConfig",
    "auto_picks_staged",
    "chunk_slots",
    "launch_staged",
    "set_staging",
    "staged_refusal",
    "staging_config",
]

#: Default staging buffer: 64 MiB in 4 ring slots (16 MiB chunks), the best point measured
#: through the public API at 2 CTAs (docs/log/2026-12-01.md: 0.971-0.980 x bulk at
#: 1 KiB and 1152 B MLA both ways, where 16 MiB in 2 slots gave H2D 0.967-0.969). 64 MiB is
#: 0.05 % of an H200's memory; set_staging makes it smaller or larger.
DEFAULT_STAGING_BYTES: Final = 64 << 20
DEFAULT_STAGING_RING: Final = 4

#: ``backend="auto"`` picks the staged path only for items up to 4 KiB (the sizes measured:
#: 1 KiB, 1152 B, 2 KiB, 4 KiB, all 0.966-0.978 x bulk at 2 CTAs with the default ring).
STAGED_MAX_ITEM_BYTES: Final = 4 << 10
#: ... and budgets of at least 2 CTAs (or the whole GPU): at 1 CTA the kernel stage bounds it
#: (0.73-0.85 x bulk) below the 1-CTA kernel (0.80-0.86 x).
STAGED_MIN_CTAS: Final = 2
#: ... and transfers of at least 16 ring chunks (256 MiB with the default ring): with 8
#: chunks per transfer (a 256 MiB ring of 4 for 0.5 GiB) too little overlaps and it gave
#: 0.93 x, the kernel's figure; 16 chunks (64 MiB of 2) 0.955-0.961, 32-64 chunks 0.966-0.978
#: (measured before the ramped chunk schedule, which shortens the ends further).
STAGED_MIN_CHUNKS: Final = 16

#: Largest staging buffer :func:`set_staging` accepts: 16 GiB, far past any measured gain
#: (64 MiB already reaches 0.97-0.98 x bulk), so a typo cannot reserve a device's memory.
MAX_STAGING_BYTES: Final = 16 << 30

_MAX_RING = 8  # kMaxRing in staged_gpu.cu
_HEADER = 64 << 10  # kHeader: the ring's tables and the identity slots
_TABLE = 4 << 10  # kTableBytes
_HOST_LAYOUTS = ("page_first", "page_first_direct", "page_head", "page_unified")  # and s_layer == item


@dataclass(frozen=True, slots=True)
class StagingConfig:
    """A device's staging buffer: ``nbytes`` of device memory in ``ring`` slots."""

    nbytes: int
    ring: int


_lock = threading.Lock()
_configs: dict[Device, StagingConfig] = {}
# Kept across backend swaps on purpose: a staged transfer may still be using a buffer, and
# dropping it would let the caching allocator hand its memory out under the copy.
_buffers: dict[Device, torch.Tensor] = {}


def set_staging(
    device: Device | str | torch.device, *, nbytes: int = DEFAULT_STAGING_BYTES, ring: int = DEFAULT_STAGING_RING
) -> None:
    """Set the staging buffer of ``device``'s staged transfers: ``nbytes`` bytes of device
    memory (at least 64 KiB of ring tables plus one 4 KiB-rounded chunk per ring slot) in
    ``ring`` slots (2..8). A buffer already allocated is freed after the device's work is
    done (a device synchronisation); the new one is allocated by the next staged transfer.

    Raises:
        InvalidDeviceError: not a device of this machine.
        InvalidArgumentError: ``nbytes`` or ``ring`` not an int in range (``nbytes`` at most
            :data:`MAX_STAGING_BYTES`).
    """
    dev = validate_device(device)
    if type(ring) is not int or not 2 <= ring <= _MAX_RING:
        raise InvalidArgumentError(f"ring must be an int in [2, {_MAX_RING}], got {describe(ring)}")
    if type(nbytes) is not int or not _HEADER + ring * 4096 <= nbytes <= MAX_STAGING_BYTES:
        raise InvalidArgumentError(
            f"nbytes must be an int of at least {_HEADER + ring * 4096} (64 KiB of ring tables and one "
            f"4 KiB page per ring slot) and at most {MAX_STAGING_BYTES} (16 GiB), got {describe(nbytes)}"
        )
    with _lock:
        _configs[dev] = StagingConfig(nbytes, ring)
        old = _buffers.pop(dev, None)
    if old is not None:
        backend_for(dev).synchronize(dev)  # a staged transfer in flight may still use it


def staging_config(device: Device | str | torch.device) -> StagingConfig:
    """The staging configuration of ``device`` (default 64 MiB, 4 slots).

    Raises:
        InvalidDeviceError: not a device of this machine.
    """
    return _config_of(validate_device(device))


_DEFAULT = StagingConfig(DEFAULT_STAGING_BYTES, DEFAULT_STAGING_RING)


def _config_of(device: Device) -> StagingConfig:
    return _configs.get(device, _DEFAULT)  # launch path: the device is checked already


def chunk_slots(config: StagingConfig, num_kv: int, block_bytes: int) -> int:
    """Slots one ring slot holds for blocks of ``block_bytes`` per slot and kv (the
    C++ rule in ``staged_gpu.cu``: the ring slot's bytes, rounded down to 4 KiB, and at
    most 7680 slots, the identity list's room in the header); 0: the buffer holds none."""
    slot_bytes = ((config.nbytes - _HEADER) // config.ring) & ~4095 if config.nbytes > _HEADER else 0
    return min(slot_bytes // (num_kv * block_bytes), (_HEADER - _TABLE) // 8)


# A table's buffers never change, so where they lie is computed once per table (a device
# pool's table holds one buffer per layer and kv: 64 lookups cost ~0.5 ms per call).
_sides: weakref.WeakKeyDictionary[PointerTable[DeviceAlias], str] = weakref.WeakKeyDictionary()


def _side_memory(table: PointerTable[DeviceAlias]) -> str:
    """``"host"``, ``"device"`` or ``"mixed"``: where every buffer of the table lies."""
    side = _sides.get(table)
    if side is None:
        where = {"host" if memory_device(t) is None else "device" for t in table.kept_tensors()}
        side = where.pop() if len(where) == 1 else "mixed"
        _sides[table] = side
    return side


def staged_refusal(
    plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias],
    layer_begin: int, layer_count: int,
) -> bool | PointerDomainError:
    """``host_is_src`` where the staged path applies to this transfer, else the typed
    error an explicit ``backend="staged"`` raises (see the module docstring)."""
    layout = plan.src_layout
    if layer_begin != 0 or layer_count != layout.num_layers:
        return InvalidArgumentError(
            "backend='staged' moves all layers (transfer_kv_all_layer); per-layer transfers use the kernel "
            "(backend='kernel' or 'auto')"
        )
    sides = (_side_memory(src), _side_memory(dst))
    if sides not in (("host", "device"), ("device", "host")):
        return InvalidArgumentError(
            f"backend='staged' moves between a registered host pool and a device pool; src is {sides[0]} "
            f"memory and dst is {sides[1]} memory"
        )
    host_is_src = sides[0] == "host"
    host_layout, host_geometry = (plan.src_layout, plan.src_geometry) if host_is_src else (plan.dst_layout, plan.dst_geometry)
    item = layout.item_bytes
    if host_layout.kind not in _HOST_LAYOUTS or (layout.num_layers > 1 and host_geometry.s_layer != item):
        given = plan.given_src_layout if host_is_src else plan.given_dst_layout
        return LayoutError(
            f"backend='staged' needs a host layout whose slot holds its layers contiguously (page_first, "
            f"page_first_direct with page_size 1, page_head, or page_unified with one layer); the host pool is "
            f"{given.kind} with page_size {given.page_size}"
        )
    config = _config_of(plan.device)
    if chunk_slots(config, layout.num_kv, layout.num_layers * item) < 1:
        return InvalidArgumentError(
            f"the staging buffer of {plan.device} ({config.nbytes} bytes, {config.ring} slots) holds no slot of "
            f"{layout.num_kv * layout.num_layers * item} bytes; enlarge it with pointerdomain.staged.set_staging"
        )
    return host_is_src


def auto_picks_staged(
    plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], args: LaunchArgs,
    host_indices: bool = False,
) -> bool:
    """Whether ``backend="auto"`` takes the staged path (CUDA with the path built, not
    capturing, items <= :data:`STAGED_MAX_ITEM_BYTES`, a budget of at least
    :data:`STAGED_MIN_CTAS` CTAs or the whole GPU (``ctas`` 0), and :func:`staged_refusal`
    none; with indices on the device also at least :data:`STAGED_MIN_CHUNKS` ring chunks of
    slots, while indices in host memory (``host_indices``), which every other path but the
    copy engine would first have to copy to the device, take it at any size: with CPU
    indices it is the fastest path measured on the H200, 0.97-0.99 x bulk).
    The cheap tests first: the kernel launch path pays only for them."""
    layout, platform = plan.src_layout, plan.platform
    n, layer_begin, layer_count, ctas = args.n, args.layer_begin, args.layer_count, args.max_ctas
    if layer_count != layout.num_layers or layout.item_bytes > STAGED_MAX_ITEM_BYTES or plan.lowering is not None:
        return False  # (per-part items of a lowered launch: not measured, so only when asked)
    if 0 < ctas < STAGED_MIN_CTAS or not platform.staged_auto:
        return False  # the figures are CUDA's (H200); HIP runs it only when asked
    block = layout.num_layers * layout.item_bytes
    if not host_indices and n < STAGED_MIN_CHUNKS * chunk_slots(_config_of(plan.device), layout.num_kv, block):
        return False
    if not (isinstance(platform, StagedCopy) and platform.staged_available()) or platform.is_capturing(plan.device):
        return False
    return not isinstance(staged_refusal(plan, src, dst, layer_begin, layer_count), PointerDomainError)


def _staging_buffer(device: Device, config: StagingConfig) -> torch.Tensor:
    with _lock:
        buf = _buffers.get(device)
        if buf is None or buf.numel() != config.nbytes:
            buf = device_empty((config.nbytes,), torch.uint8, device)  # OutOfMemoryError when it does not fit
            _buffers[device] = buf
    return buf


def _on_device(checked: torch.Tensor, device: Device, stream: int) -> torch.Tensor:
    """``checked`` (a CPU tensor) copied to ``device`` on ``stream``, through pinned memory
    (torch keeps the pinned block until the copy is done; the device copy is allocated on
    ``stream``, so the caching allocator reuses it only after the stream's work)."""
    cuda: Any = torch.cuda  # ExternalStream is untyped in torch's stubs
    ext = cuda.ExternalStream(stream, device=device.torch_device)
    pinned = checked.pin_memory()
    with cuda.stream(ext):
        return pinned.to(device.torch_device, non_blocking=True)


def launch_staged(
    plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias],
    s_idx: torch.Tensor, d_idx: torch.Tensor, args: LaunchArgs,
) -> None:
    """Run the staged transfer of the checked index tensors (``int64``, 1-D, contiguous,
    equal length ``n`` > 0, each on the device or the CPU) for the call ``args`` (its
    layer range, stream and CTA budget; the tensors' own addresses are read here).

    Raises:
        InvalidArgumentError, LayoutError: the path does not apply (:func:`staged_refusal`),
            or the stream is being captured.
        IndexValidationError: a slot out of range (nothing was copied).
        OutOfMemoryError: the staging buffer (:func:`set_staging`) does not fit the device's
            free memory (nothing was copied).
        RuntimeCallError: a runtime call failed.
    """
    layer_begin, layer_count, stream = args.layer_begin, args.layer_count, args.stream
    verdict = staged_refusal(plan, src, dst, layer_begin, layer_count)
    if isinstance(verdict, PointerDomainError):
        raise verdict
    host_is_src = verdict
    # One host copy of each side, range-checked here, so a bad slot leaves everything as it
    # was; the host side's copy is the one the copy descriptors are built from (a CPU tensor
    # is copied too: another thread may change it meanwhile). CUDA indices cost a sync here.
    n = s_idx.numel()
    if s_idx.is_cuda and d_idx.is_cuda:  # one device-to-host copy (one sync), not two
        both = torch.cat((s_idx, d_idx)).cpu()
        s_host, d_host = both[:n], both[n:]
    else:
        s_host = s_idx.to("cpu", copy=True)
        d_host = d_idx.to("cpu", copy=True)
    plan.check_addressed_range(s_host, d_host)
    host_idx = s_host if host_is_src else d_host
    if plan.platform.host_readable:  # the kernel reads host memory: give it the checked copies too
        s_idx, d_idx = s_host, d_host
    elif host_is_src and not d_idx.is_cuda:  # the kernel reads the device pool's side: upload it
        d_idx = _on_device(d_host, plan.device, stream)
    elif not host_is_src and not s_idx.is_cuda:
        s_idx = _on_device(s_host, plan.device, stream)
    host_table = torch.tensor(plan.src_values if host_is_src else plan.dst_values, dtype=torch.uint64)
    config = _config_of(plan.device)
    staging = _staging_buffer(plan.device, config)
    platform = plan.platform
    if not isinstance(platform, StagedCopy):
        raise ExtensionUnavailableError(f"the {platform.name} backend has no staged copy-engine path")
    platform.staged(plan.kernel, args._replace(src_idx=s_idx.data_ptr(), dst_idx=d_idx.data_ptr()),
                    StagingArgs(host_is_src, host_table.data_ptr(), host_idx.data_ptr(), staging.data_ptr(),
                                config.nbytes, config.ring))
