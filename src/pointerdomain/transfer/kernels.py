"""The typed launch API for KV page transfers.

Launch functions accept only ``PointerTable[DeviceAlias]`` (mypy) and check, at
runtime and before anything is launched: the tables' domain and device, that
their registrations are still open and their storage unchanged, that each table
fits its layout exactly (so every address the kernel forms lies inside a table
entry's buffer), the index tensors (``int64``, 1-D, contiguous, on the launch
device or, for the paths that read them on the host, the CPU; equal length) and the
overlap rule (:mod:`pointerdomain.transfer.overlap`). The
kernels skip out-of-range slots themselves and record them in the device's error
word (:mod:`pointerdomain.transfer.launch_errors`), so a kernel never reads or writes outside
the tables it was given, CUDA graph replays with new indices included. A launch
leases the registrations it uses (:mod:`pointerdomain.registration.leases`).

Layouts whose items are split into several runs (``page_head`` with several heads,
``page_unified`` with head groups) are lowered once per plan to per-part items
(:func:`pointerdomain.layouts.lower_pair`, :mod:`pointerdomain.transfer.plan`); each launch then
expands its indices to the parts' slots with torch ops on the indices' device and runs
every backend on those. The other layouts' launches skip this.

A launch runs in three steps: :func:`check_call` (every check above, and the call bound
into its plan, :class:`LaunchOptions` and :class:`~pointerdomain._platform.LaunchArgs`),
:func:`choose_path` (the :class:`Path` that runs it) and :func:`run`. :func:`bind_call` is the
first two in one step: what the public launches run before :func:`run`, and all that
:func:`explain_transfer` runs.

Ordering (CUDA): the launch is enqueued on ``stream`` (default: the current
stream of the tables' device) and is asynchronous. The caller orders it after
the work that produced the source (same stream, or an event) and keeps the
tables and index tensors alive until the stream reaches it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import torch

from pointerdomain.arguments import describe, storage_short
from pointerdomain.registration import leases
from pointerdomain.transfer import checked, graphs, launch_errors, overlap, staged
from pointerdomain._platform import LaunchArgs, memory_device
from pointerdomain.devices import Device, DeviceGuard, tensor_on
from pointerdomain.domains import DeviceAlias
from pointerdomain.errors import (
    ClosedError,
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    OverlapError,
    PointerDomainError,
    UnpinnedMemoryError,
)
from pointerdomain.layouts import KVLayout
from pointerdomain.transfer.plan import LAST_BY_SRC as _LAST_BY_SRC, TransferPlan, plan_for
from pointerdomain.registration.tables import PointerTable

if TYPE_CHECKING:
    from pointerdomain._C import KernelPlan

__all__ = [
    "CE_MIN_RUN_BYTES_SMALL_BUDGET",
    "CE_MIN_RUN_BYTES_WHOLE_GPU",
    "DEFAULT_MAX_CTAS",
    "WHOLE_GPU",
    "BoundCall",
    "IndexCheck",
    "LaunchOptions",
    "LayersLaunch",
    "MaxCtas",
    "Path",
    "TransferBackend",
    "TransferChoice",
    "ValidateIndices",
    "WholeGpu",
    "bind_call",
    "check_call",
    "choose_path",
    "explain_transfer",
    "index_tensor",
    "launch_options",
    "layer_range",
    "run",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer",
]


def index_tensor(name: str, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``ids`` (a tensor of any integer dtype on any device, or a sequence of ints) as a
    contiguous 1-D ``int64`` CPU tensor, for callers that take loose id lists (adapters).

    Raises:
        IndexValidationError: not 1-D, not integers, a value outside int64 (a
            ``uint64`` id of 2**63 or more would turn negative), a tensor whose storage
            holds fewer bytes than it views (released), or neither a tensor nor a sequence.
        InvalidTypeError: ``name`` is not a str.
    """
    if type(name) is not str:
        raise InvalidTypeError(f"name: found {describe(name)} ({type(name).__name__}), expected a str naming the ids")
    if isinstance(ids, torch.Tensor):
        _check_storage(name, ids)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise IndexValidationError(f"{name}: dtype {ids.dtype}, expected an integer dtype")
        out = ids.detach().to("cpu", torch.int64).contiguous()
        if ids.dtype == torch.uint64 and bool((out < 0).any()):  # the cast wrapped ids >= 2**63
            raise IndexValidationError(f"{name}: a uint64 id of 2**63 or more, expected ids that fit int64")
    elif isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise IndexValidationError(
            f"{name}: found {describe(ids)} ({type(ids).__name__}), expected a 1-D integer tensor or a list of ints"
        )
    else:
        values = list(ids)
        if any(type(v) is not int for v in values):
            raise IndexValidationError(f"{name}: expected ints, got {[type(v).__name__ for v in values][:4]}")
        big = next((v for v in values if not -(1 << 63) <= v < 1 << 63), None)
        if big is not None:
            raise IndexValidationError(f"{name}: found the id {big}, expected ids that fit int64 (|id| < 2**63)")
        out = torch.tensor(values, dtype=torch.int64)
    if out.dim() != 1:
        raise IndexValidationError(f"{name}: shape {tuple(out.shape)}, expected 1-D")
    return out


def _check_storage(name: str, idx: torch.Tensor) -> None:
    """Refuse an index tensor whose storage holds fewer bytes than it views: reading it
    (on the host or in a kernel) reads freed memory."""
    if storage_short(idx):
        raise IndexValidationError(
            f"{name}: {describe(idx)}: its storage holds {_held_bytes(idx)} bytes, fewer than the tensor views. "
            "Fix: pass indices whose storage is allocated"
        )


def _held_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return 0


def _check_indices(name: str, idx: Any, device: Device, host_read: bool = False) -> torch.Tensor:
    """``idx`` checked for a launch on ``device``; ``host_read``: the backend reads these
    indices on the host only (the copy engine; the staged path's host side, which
    :func:`~pointerdomain.transfer.staged.launch_staged` tells apart), so a CPU tensor is fine too."""
    if not isinstance(idx, torch.Tensor):
        raise IndexValidationError(f"{name}: expected an int64 tensor, got {type(idx).__name__}")
    _check_storage(name, idx)
    if idx.dtype != torch.int64:
        raise IndexValidationError(f"{name}: dtype {idx.dtype}, expected torch.int64")
    if idx.dim() != 1:
        raise IndexValidationError(f"{name}: shape {tuple(idx.shape)}, expected 1-D")
    if not idx.is_contiguous():
        raise IndexValidationError(f"{name}: not contiguous (stride {idx.stride()})")
    if not tensor_on(idx, device) and not (host_read and idx.is_cpu):
        raise IndexValidationError(
            f"{name}: on {idx.device}, but the launch runs on {device} (indices must be on {device.torch_device})"
        )
    if device.runtime.host_memory:  # CPU tensors all; emulated device memory must be this device's
        where = memory_device(idx)
        if where is not None and where != device:
            raise IndexValidationError(
                f"{name}: device memory of {where}, but the launch runs on {device}: indices must be on the "
                f"launch device. Fix: copy them to {device} (or to host memory) first"
            )
    return idx


def layer_range(src_layout: object, layer_id: object, all_layers: bool = True) -> tuple[int, int]:
    """``(layer_begin, layer_count)`` of a call's ``layer_id``: None is every layer (where
    ``all_layers``); ``src_layout`` that is not a KVLayout is then ``(0, 0)``, reported by
    :func:`bind_call` after the tables' checks, as the all-layer launch reports it. An int
    is that one layer, checked here.

    Raises:
        InvalidArgumentError: a layer given and ``src_layout`` is not a KVLayout.
        IndexValidationError: ``layer_id`` is not an int (nor None where ``all_layers``),
            or outside ``[0, num_layers)``.
    """
    if layer_id is None and all_layers:
        return (0, src_layout.num_layers) if isinstance(src_layout, KVLayout) else (0, 0)
    if not isinstance(src_layout, KVLayout):
        raise InvalidArgumentError(f"src_layout must be a KVLayout, got {type(src_layout).__name__}")
    if type(layer_id) is not int:
        raise IndexValidationError(f"layer_id must be an int, got {describe(layer_id)}")
    if not 0 <= layer_id < src_layout.num_layers:
        raise IndexValidationError(f"layer_id {describe(layer_id)} outside [0, {src_layout.num_layers})")
    return layer_id, 1


def _check_range(s_idx: torch.Tensor, d_idx: torch.Tensor, plan: TransferPlan) -> None:
    """:meth:`TransferPlan.check_slot_range` where the launch may read indices on the host:
    never during capture (no host sync there; the kernel skips out-of-range slots)."""
    if s_idx.numel() and not plan.platform.is_capturing(plan.device):
        plan.check_slot_range(s_idx, d_idx)


class WholeGpu(enum.Enum):
    """The type of :data:`WHOLE_GPU`."""

    WHOLE_GPU = "whole_gpu"


#: ``max_ctas=WHOLE_GPU``: as many CTAs as the GPU holds at once (the runtime's
#: occupancy, chosen in transfer_gpu.cu), for a copy that may take every SM.
WHOLE_GPU: Final = WholeGpu.WHOLE_GPU

#: An SM budget: a positive number of CTAs, or :data:`WHOLE_GPU`.
MaxCtas = int | WholeGpu

#: Default SM budget: serving engines give copy kernels a few CTAs so the copy
#: overlaps model compute (docs/performance.md has the bandwidth at 2, 4 and 8 CTAs
#: and the whole GPU). The same default in the core and the adapters.
DEFAULT_MAX_CTAS: Final = 4

#: Runs at least this long go to the copy engine under ``backend="auto"``. Measured on
#: the H200 (docs/performance.md): cudaMemcpyBatchAsync of 64 KiB runs gave 0.72-0.79 x
#: bulk while the kernel gave 0.91-0.94 x with only 2-4 CTAs, so the engine only pays
#: for runs far longer than a KV item, where it approaches a bulk copy and frees the SMs.
CE_MIN_RUN_BYTES_SMALL_BUDGET: Final = 512 << 10
CE_MIN_RUN_BYTES_WHOLE_GPU: Final = 1 << 20

#: How a launch moves bytes (the ``backend`` argument): see :func:`transfer_kv_all_layer`.
TransferBackend = Literal["auto", "kernel", "copy_engine", "staged"]

#: The ``validate_indices`` argument: see :func:`transfer_kv_all_layer`.
ValidateIndices = bool | Literal["host"]


_INT64: Final = torch.int64
_Tensor: Final = torch.Tensor


_UNIT = (1,)
_CURRENT_STREAM: Final = -1  # LaunchArgs.stream until the launch asks the device's current stream
_NO_TOKENS: Final[list[int]] = []  # the leases of a launch over tables without registrations
_MAX_CTAS = 2**31 - 1  # a CUDA grid's x dimension (and the C++ int the budget travels in)


# Where check_call found the index tensors (its combined test of every check of
# _check_indices, without messages: only a failure runs the per-tensor checks that word
# the error; CPU indices of a GPU launch take that way too).
_IDX_BAD: Final = 0  # a check fails: run the worded checks
_IDX_DEVICE: Final = 1  # both in the launch device's memory
_IDX_HOST: Final = 2  # both pass, one or both in host memory (read there, or by a kernel that reads host memory)


def _in_host_memory(idx: torch.Tensor) -> bool:
    """Whether checked indices lie in host memory rather than the launch device's."""
    return idx.is_cpu and memory_device(idx) is None


class Path(enum.Enum):
    """How a launch moves bytes: the ``backend`` argument, validated (:class:`LaunchOptions`)."""

    AUTO = "auto"
    KERNEL = "kernel"
    COPY_ENGINE = "copy_engine"
    STAGED = "staged"


class IndexCheck(enum.Enum):
    """The ``validate_indices`` argument, validated: ``True``, ``"host"``, ``False``."""

    DEFERRED = True  #: the kernel's error word (on the host right after the launch where it is host-readable)
    HOST = "host"  #: on the host before the launch
    OFF = False  #: skipped slots are not reported


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """A launch's options, validated once per distinct combination and cached
    (:func:`launch_options`): the launch path compares enums, never strings."""

    path: Path
    ctas: int  #: the CTA budget for the native call; 0 is the whole GPU
    check: IndexCheck


_PATHS: Final = {p.value: p for p in Path}
_CHECKS: Final = {True: IndexCheck.DEFERRED, False: IndexCheck.OFF}
_options: dict[tuple[object, ...], LaunchOptions] = {}
# the hot path's constants: module globals, not enum class attributes (a lookup each)
_AUTO, _KERNEL, _COPY_ENGINE, _STAGED = Path.AUTO, Path.KERNEL, Path.COPY_ENGINE, Path.STAGED
_CHECK_DEFERRED, _CHECK_HOST, _CHECK_OFF = IndexCheck.DEFERRED, IndexCheck.HOST, IndexCheck.OFF
_new_args: Final = tuple.__new__  # LaunchArgs from a tuple without NamedTuple's Python-level __new__
_options_lock = threading.Lock()
_UNSET = object()  # matches no argument
_STAGED_MIN_CHUNKS: Final = staged.STAGED_MIN_CHUNKS
_thread_id: Final = threading.get_ident
_last: tuple[object, object, object, LaunchOptions] = (_UNSET, _UNSET, _UNSET, LaunchOptions(Path.KERNEL, 0, IndexCheck.OFF))
_OPTIONS_CACHE_MAX = 256


def launch_options(max_ctas: object, backend: object, validate_indices: object, stream: object) -> LaunchOptions:
    """``max_ctas``, ``backend`` and ``validate_indices`` validated, from a cache keyed by
    value and type (``True`` is no CTA budget); ``stream`` is checked each call.

    Raises:
        InvalidArgumentError: a bad ``max_ctas``, ``backend``, ``stream`` or ``validate_indices``
            (in that order).
    """
    last = _last
    if max_ctas is last[0] and backend is last[1] and validate_indices is last[2]:  # the same objects: valid
        options = last[3]
    else:
        options = _cached_options(max_ctas, backend, validate_indices, stream)
    if stream is not None and (type(stream) is not int or not 0 <= stream < 2**64):
        raise InvalidArgumentError(f"stream must be a cudaStream_t as an int in [0, 2**64) or None, got {describe(stream)}")
    return options


def _cached_options(max_ctas: object, backend: object, validate_indices: object, stream: object) -> LaunchOptions:
    global _last
    key = (max_ctas, type(max_ctas), backend, type(backend), validate_indices, type(validate_indices))
    try:
        options = _options[key]
    except (KeyError, TypeError):  # TypeError: an unhashable argument, reported below
        options = _validate_options(max_ctas, backend, validate_indices, stream)
        if len(_options) < _OPTIONS_CACHE_MAX:
            with _options_lock:
                _options[key] = options
    _last = (max_ctas, backend, validate_indices, options)  # one tuple, replaced whole: thread-safe to read
    return options


def _validate_options(max_ctas: object, backend: object, validate_indices: object, stream: object) -> LaunchOptions:
    if type(max_ctas) is int and 0 < max_ctas <= _MAX_CTAS:
        ctas = max_ctas
    elif max_ctas is WHOLE_GPU:
        ctas = 0  # the C++ side: the whole GPU
    else:
        raise InvalidArgumentError(
            f"max_ctas must be an int in [1, {_MAX_CTAS}] or pointerdomain.WHOLE_GPU, got {describe(max_ctas)}"
        )
    path = _PATHS.get(backend) if isinstance(backend, str) else None
    if path is None:
        raise InvalidArgumentError(f"backend must be 'auto', 'kernel', 'copy_engine' or 'staged', got {describe(backend)}")
    if stream is not None and (type(stream) is not int or not 0 <= stream < 2**64):
        raise InvalidArgumentError(f"stream must be a cudaStream_t as an int in [0, 2**64) or None, got {describe(stream)}")
    if type(validate_indices) is bool:
        check: IndexCheck | None = _CHECKS[validate_indices]
    else:
        check = IndexCheck.HOST if validate_indices == "host" else None
    if check is None:
        raise InvalidArgumentError(f"validate_indices must be True, False or 'host', got {describe(validate_indices)}")
    return LaunchOptions(path, ctas, check)


#: One call checked and bound (:func:`bind_call`), ready for :func:`run`: its plan, options,
#: :class:`LaunchArgs`, whether an index tensor lies in host memory (:func:`choose_path`
#: reads it), and the path that runs it (never AUTO; None where bind_call was not asked to
#: choose). A plain tuple: built on every launch.
BoundCall = tuple[TransferPlan, LaunchOptions, LaunchArgs, bool, Path | None]


def check_call(
    src: PointerTable[DeviceAlias],
    src_layout: KVLayout,
    dst: PointerTable[DeviceAlias],
    dst_layout: KVLayout,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_count: int,
    stream: int | None,
    max_ctas: MaxCtas,
    backend: TransferBackend,
    validate_indices: ValidateIndices,
) -> tuple[TransferPlan, LaunchOptions, LaunchArgs, bool]:
    """The launch's first step: every check of the call (tables, indices, options), and the
    call bound into its plan, options and :class:`LaunchArgs`, and whether an index tensor
    lies in host memory (:func:`choose_path` reads it). Nothing is launched: :func:`bind_call`
    without choosing the path."""
    plan, options, args, host, _path = bind_call(src, src_layout, dst, dst_layout, src_indices, dst_indices,
                                                 layer_begin, layer_count, stream, max_ctas, backend,
                                                 validate_indices, False)
    return plan, options, args, host


def bind_call(
    src: PointerTable[DeviceAlias],
    src_layout: KVLayout,
    dst: PointerTable[DeviceAlias],
    dst_layout: KVLayout,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_count: int,
    stream: int | None,
    max_ctas: MaxCtas,
    backend: TransferBackend,
    validate_indices: ValidateIndices,
    choose: bool = True,
) -> BoundCall:
    """Everything a transfer call does before its launch, in one step: every check of
    :func:`check_call`, the call bound, and (``choose``) :func:`choose_path`. The public
    launches run this, then :func:`run`; :func:`explain_transfer` and the request check of
    :func:`~pointerdomain.transfer.outcomes.transfer_outcome` run it alone. Layers
    ``[layer_begin, layer_begin + layer_count)`` (:func:`layer_range` checks a caller's
    ``layer_id``). Nothing is launched.

    Raises:
        PointerDomainError: every error :func:`transfer_kv_all_layer` raises before its
            launch (the ``choose_path`` ones only with ``choose``).
    """
    # Every check below runs on every launch; the common case takes one combined test per
    # group (the tables' liveness words, the index tests, the options cache) and only a
    # failure runs the per-item checks that word the error.
    plan = _LAST_BY_SRC.get(id(src))  # plan_for's first look, inlined: the plan src last launched with
    if (plan is None or plan.src_ref() is not src or plan.dst_ref() is not dst or plan.given_src_layout is not src_layout
            or plan.given_dst_layout is not dst_layout):
        plan = plan_for(src, src_layout, dst, dst_layout)
    if plan.dst_clashes and layer_count > 1:  # dst entries of two layers share memory (rare): not over both
        overlap.check_layers(plan.dst_clashes, layer_begin, layer_count)
    watch = plan.watch  # plan.live, inlined: both tables' liveness words in one native call
    live = watch.first_changed() < 0 if watch is not None else plan.live(src, dst)
    for owner in plan.owners:
        if owner.closed or owner.inherited:
            live = False
    if not live:
        for name, table in (("src", src), ("dst", dst)):
            try:
                table.check_live()
                table.check_this_process()
            except ClosedError as exc:
                raise ClosedError(f"{name}: {exc}; rebuild the table over open registered memory") from None
    device = plan.device
    # the index tests: each tensor query costs ~0.1 us, so each is asked once here
    s_idx: object = src_indices  # checked at run time too: callers may be untyped
    d_idx: object = dst_indices
    where = _IDX_BAD
    pair = plan.index_pair  # the same tests as below in one native call (None: not torch.Tensor
    # itself, a test fails, or memory of another device); the emulated device's are looked up
    host_memory = plan.host_memory
    got = pair(s_idx, d_idx, plan.index_meta, device.ordinal if host_memory else -1) if pair is not None else None
    if got is not None:
        n, nd, sp, dp, in_host = got
        where = _IDX_HOST if in_host and host_memory else _IDX_DEVICE
    elif (isinstance(s_idx, _Tensor) and isinstance(d_idx, _Tensor) and s_idx.dtype is _INT64
            and d_idx.dtype is _INT64 and s_idx.stride() == _UNIT and d_idx.stride() == _UNIT):
        n, nd = s_idx.numel(), d_idx.numel()
        # storages that hold what the tensors view (a released one reads freed memory)
        if (s_idx.untyped_storage().nbytes() >= 8 * (s_idx.storage_offset() + n)
                and d_idx.untyped_storage().nbytes() >= 8 * (d_idx.storage_offset() + nd)):
            if not plan.host_memory:
                if s_idx.get_device() == device.ordinal and d_idx.get_device() == device.ordinal:
                    where = _IDX_DEVICE
                    sp, dp = s_idx.data_ptr(), d_idx.data_ptr()
            elif s_idx.is_cpu and d_idx.is_cpu:  # emulated: host memory or this emulated device's, by address
                sp, dp = s_idx.data_ptr(), d_idx.data_ptr()
                lookup, ordinal = plan.platform.device_lookup, device.ordinal
                s_where = lookup(sp, n * 8 or 8)
                d_where = lookup(dp, nd * 8 or 8)
                if (s_where < 0 or s_where == ordinal) and (d_where < 0 or d_where == ordinal):
                    where = _IDX_HOST if s_where < 0 or d_where < 0 else _IDX_DEVICE
    if where == _IDX_BAD:  # not both on the device: the worded checks
        host_read = backend != "kernel"  # the other paths may take CPU indices
        _check_indices("src_indices", src_indices, device, host_read)
        _check_indices("dst_indices", dst_indices, device, host_read)
        where = _IDX_HOST if _in_host_memory(src_indices) or _in_host_memory(dst_indices) else _IDX_DEVICE
        n, nd, sp, dp = src_indices.numel(), dst_indices.numel(), src_indices.data_ptr(), dst_indices.data_ptr()
    if n != nd:
        raise IndexValidationError(f"src_indices has {n} slots but dst_indices has {nd}")
    if not n:
        sp = dp = 0
    # plan.indices_in_dst, inlined for the span from the first storage's start to the last
    # one's end (the storages are sorted and merged): the whole test for one storage, and
    # for several, indices outside it (the common case) need no search
    starts = plan.dst_starts
    if n and starts and ((sp < plan.dst_ends[-1] and sp + 8 * n > starts[0])
                         or (dp < plan.dst_ends[-1] and dp + 8 * n > starts[0])) and (
            len(starts) == 1 or plan.indices_in_dst(sp, dp, 8 * n)):
        raise OverlapError(
            "src_indices or dst_indices lie in the memory of the destination table's buffers: the copy would "
            "overwrite the indices it is reading, and later slots would land in the wrong place; nothing was "
            "copied. Fix: keep index tensors in memory of their own"
        )
    last = _last  # launch_options, inlined: the last call's options where these are the same objects
    if max_ctas is last[0] and backend is last[1] and validate_indices is last[2]:
        options = last[3]
        if stream is not None and (type(stream) is not int or not 0 <= stream < 2**64):
            raise InvalidArgumentError(f"stream must be a cudaStream_t as an int in [0, 2**64) or None, got {describe(stream)}")
    else:
        options = launch_options(max_ctas, backend, validate_indices, stream)
    if stream is None:  # asked at the launch, where streams exist (run)
        stream = _CURRENT_STREAM if plan.streams else 0
    args = _new_args(LaunchArgs, (sp, dp, n, layer_begin, layer_count, device, stream, options.ctas))
    host = where == _IDX_HOST
    if not choose:
        return plan, options, args, host, None
    # choose_path's answer where it is the kernel without asking anything of the call but
    # its size (no capture query, no staged test): "kernel" asked for, or "auto" with runs
    # shorter than either copy-engine threshold and indices the staged path would not take
    # (host memory the kernel reads itself, or fewer device slots than the staged minimum)
    path = options.path
    if plan.unpinned is None and (path is _KERNEL or (
            path is _AUTO and plan.run_bytes < CE_MIN_RUN_BYTES_SMALL_BUDGET
            and (plan.auto_host_kernel if host else n < _STAGED_MIN_CHUNKS))):
        return plan, options, args, host, _KERNEL
    return plan, options, args, host, choose_path(plan, src, dst, options, args, host)


def choose_path(
    plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], options: LaunchOptions,
    args: LaunchArgs, host_indices: bool = False,
) -> Path:
    """The launch's second step: the path that runs it (never :attr:`Path.AUTO`);
    ``host_indices``: an index tensor lies in host memory (from :func:`check_call`).

    Raises:
        UnpinnedMemoryError: a table over unpinned memory with a path other than the copy engine.
        InvalidArgumentError: the copy engine or the staged path during graph capture, or
            ``"auto"`` with CPU indices that only a path reading them on the host can take
            during capture.
    """
    path = options.path
    unpinned = plan.unpinned  # a registration of either table that kernels cannot read
    if unpinned is not None:
        if path is _AUTO:
            path = _COPY_ENGINE
        elif path is not _COPY_ENGINE:
            raise UnpinnedMemoryError(
                f"host memory at {unpinned.host_va!r} (+{unpinned.nbytes} bytes) is not pinned (registration "
                f"ladder rung 'unpinned': {'; '.join(unpinned.ladder_record) or 'allowed by the policy'}): kernels "
                "cannot read it. Fix: backend='copy_engine' (or 'auto'), or register the memory pinned"
            )
    # The capture queries ask the tables' device's current stream (Backend.is_capturing),
    # so they run before any device switch.
    platform, device = plan.platform, plan.device
    if path is _AUTO:  # the capture query only where it decides something
        threshold = CE_MIN_RUN_BYTES_WHOLE_GPU if args.max_ctas == 0 else CE_MIN_RUN_BYTES_SMALL_BUDGET
        if plan.run_bytes >= threshold and not platform.is_capturing(device):
            return _COPY_ENGINE
        if host_indices:  # read on the host anyway: the staged path wherever it applies
            if platform.staged_auto and staged.auto_picks_staged(plan, src, dst, args, host_indices=True):
                return _STAGED
            if plan.host_memory:
                return _KERNEL  # the kernel reads host memory (emulated device)
            if platform.is_capturing(device):
                raise InvalidArgumentError(
                    "backend='auto' with CPU index tensors reads them on the host, which cannot be captured in a "
                    "CUDA graph; pass indices on the device for a captured launch"
                )
            return _COPY_ENGINE  # a kernel on the GPU cannot read them
        if args.n >= staged.STAGED_MIN_CHUNKS and staged.auto_picks_staged(plan, src, dst, args):
            return _STAGED
        return _KERNEL
    if path is _STAGED and platform.is_capturing(device):
        raise InvalidArgumentError(
            "backend='staged' reads the indices on the host and cannot be captured in a CUDA graph; "
            "use backend='kernel' (or 'auto', which falls back to it) inside capture"
        )
    if path is _COPY_ENGINE and platform.is_capturing(device):
        raise InvalidArgumentError(
            "backend='copy_engine' reads the indices on the host and cannot be captured in a CUDA graph"
        )
    return path


#: The layer pipeline's kernel launch (:mod:`pointerdomain.transfer.layers`): called by
#: :func:`run` in place of the plain launch with the kernel plan and the bound arguments;
#: returns the event recorded after it (0: none, as ``launch_recorded``).
LayersLaunch = Callable[["KernelPlan", LaunchArgs], int]


def run(
    plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], s_idx: torch.Tensor,
    d_idx: torch.Tensor, args: LaunchArgs, path: Path, check: IndexCheck, layers: LayersLaunch | None = None,
    _on_device: bool = False,
) -> None:
    """The launch's last step: run ``path`` (from :func:`choose_path`: never AUTO) on the
    call bound by :func:`check_call`; ``layers``: the kernel path's launch is this one instead."""
    # One frame for the common case: the launch runs here unless the tables' device must be
    # made current first, which runs this again inside the guard (_on_device).
    if not _on_device and not (path is _KERNEL and plan.launch_sets_device and not checked.enabled()):
        # (where the native launch sets and restores the device itself, and reads the
        # capture state of the launch stream there, no Python device switch on the hot path)
        runtime = plan.runtime
        if runtime is None or runtime.current_ordinal() != args.device.ordinal:
            # The rest (host copies of the indices, checked mode, the staged path's streams
            # and events, the emulated kernels) on the tables' device; the caller's current
            # device comes back afterwards, also on error.
            with DeviceGuard.for_launch(plan.device):
                run(plan, src, dst, s_idx, d_idx, args, path, check, layers, True)
            return
    device, platform = plan.device, plan.platform
    if path is _COPY_ENGINE:
        # Read the indices once: the copy validated is the copy the descriptors are built from,
        # so another thread changing an index meanwhile cannot move a copy outside the tables.
        s_idx = s_idx.to("cpu", copy=True)
        d_idx = d_idx.to("cpu", copy=True)
        _check_range(s_idx, d_idx, plan)
        if args.n:  # the call names the copies it runs on
            args = args._replace(src_idx=s_idx.data_ptr(), dst_idx=d_idx.data_ptr())
    elif path is _STAGED:
        if plan.lowering is not None:  # launch_staged checks the parts' slots: report the caller's
            _check_range(s_idx, d_idx, plan)
    elif check is _CHECK_HOST or (check is _CHECK_DEFERRED and platform.host_readable):
        # host-readable indices (emulated device): no sync, so check before launching
        # (staged: launch_staged checks its own host copies of the indices)
        if not (plan.host_memory and args.n and plan.lowering is None) or plan.slots_problem(
                args.src_idx, args.dst_idx, args.n, plan.src_slots, plan.dst_slots):
            _check_range(s_idx, d_idx, plan)  # (the addresses in args are these indices': check_call)
    if plan.same_memory:
        overlap.check_slots(s_idx, d_idx, platform.is_capturing(device))
    if args.n == 0:
        return
    stream = args.stream
    given = None
    if plan.lowering is not None:  # a layout that splits items: from here on, the parts' slots
        given = (s_idx, d_idx)
        s_idx, d_idx = plan.expand(s_idx, d_idx, None if stream == _CURRENT_STREAM else stream)
        args = args._replace(src_idx=s_idx.data_ptr(), dst_idx=d_idx.data_ptr(), n=s_idx.numel())
    if stream == _CURRENT_STREAM:  # asked here: after the host copies of the indices were taken
        args = _new_args(LaunchArgs, (args[0], args[1], args[2], args[3], args[4], device,
                                      platform.current_stream(device), args[7]))
    if checked.enabled():
        checked.verify_launch(plan, src, dst, s_idx, d_idx, args)
    kernel = plan.kernel if check is not _CHECK_OFF or plan.unchecked is None else plan.unchecked
    # Lease the registrations both tables point into (device memory alone has none: a table
    # keeps its tensors alive); with leases, an event after the launch tells close() when
    # the GPU is past it.
    owners = plan.owners
    single = plan.lease  # the one owner's leases: the common case (one host pool)
    if single is not None:  # acquire_all without its list
        token = single.acquire(("transfer", args.n, device, _thread_id()))
        tokens: list[int] | None = None if token == -1 else _NO_TOKENS
    else:
        tokens = leases.acquire_all(owners, ("transfer", args.n, device, threading.get_ident())) if owners else _NO_TOKENS
    if tokens is None:
        for owner in owners:
            owner.check_open()  # the closed one raises ClosedError
        raise ClosedError(f"registered memory under {describe(src)} or {describe(dst)} is being closed; nothing was copied")
    event = 0  # the backend's event recorded after the launch (0: none, e.g. synchronous or captured)
    try:
        if path is _STAGED:
            staged.launch_staged(plan, src, dst, s_idx, d_idx, args)
            event = platform.record_event(device, args.stream) if owners else 0
        elif path is _COPY_ENGINE:
            dsts, srcs, sizes = plan.copy_runs(s_idx, d_idx, args.layer_begin, args.layer_count)
            platform.copy_runs(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), dsts.numel(), device, args.stream)
            event = platform.record_event(device, args.stream) if owners else 0
        elif layers is not None:  # the layer pipeline: every layer and its flag in one native call
            event = layers(kernel, args)
        elif owners:  # launch and record in one native call on CUDA
            event = platform.launch_recorded(kernel, args)
        else:
            platform.launch(kernel, args)
        # nothing to wait for: synchronous, or captured into a graph (which then holds the
        # memory); where the backend counts open captures, none open is one attribute test
        if event == 0 and (plan.captures is None or plan.captures.open):
            if given is None:
                graphs.note_launch(platform, plan, src, dst, device, args.stream, (s_idx, d_idx))
            else:  # the graph reads the caller's indices through the parts computed from them
                graphs.note_launch(platform, plan, src, dst, device, args.stream, given, (s_idx, d_idx))
    finally:
        if single is not None:
            single.release(token, event, platform)
        elif owners:
            leases.release_all(owners, tokens, event, platform)
    word = plan.host_word  # host-readable error word: the launch was synchronous
    if word is not None and word.value and path is not _COPY_ENGINE and check is not _CHECK_OFF and \
            platform.host_readable:
        launch_errors.raise_now(device)  # a slot the kernel skipped (indices changed after the check)


def transfer_kv_all_layer(
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    src_layout: KVLayout,
    dst_layout: KVLayout,
    stream: int | None = None,
    max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    backend: TransferBackend = "auto",
    validate_indices: ValidateIndices = True,
) -> None:
    """Copy token slots ``src_indices[i] -> dst_indices[i]`` for every layer and K/V.

    Use for a device pool -> host pool backup (D2H) or a load back (H2D); the
    direction follows from which table is which.

    Args:
        src, dst: kernel tables (see :func:`make_kernel_ptr_table`) over buffers of
            ``src_layout`` / ``dst_layout``; same device.
        src_indices, dst_indices: ``int64`` 1-D token slots of equal length ``n``,
            on the launch device (CPU for an emulated device). With
            ``backend="auto"``, ``"copy_engine"`` or ``"staged"``, which can read the
            indices on the host, they may be CPU tensors instead, which saves the device
            sync of reading them (the staged path copies a device pool's checked indices
            to the device itself); ``"kernel"`` needs them on the device.
        src_layout, dst_layout: must agree on everything but ``kind``, ``num_pages`` and
            ``head_groups``. Where one splits its items (``page_head`` with
            ``num_heads`` > 1, ``page_unified`` with ``head_groups`` > 1) the launch runs
            over per-part items (:func:`pointerdomain.layouts.lower_pair` lists the pairs
            it supports): it first computes ``n * item_parts`` slot indices, new ``int64``
            tensors on the indices' device (torch ops on ``stream``, no host sync; under
            CUDA-graph capture capture with ``torch.cuda.graph``, whose memory pool keeps
            them for the replays), and the copy moves runs of ``part_bytes``. Measured on
            the H200 (8 heads of 128 bf16, 32 layers, 2048 slots): the expansion adds about
            90 us of host time per launch; the copy is as fast as ``page_first``'s with
            :data:`WHOLE_GPU` (49-51 GB/s), slower at 4 CTAs (256-byte runs: D2H 37, H2D
            18 GB/s where whole items give 50-52).
        stream: a ``cudaStream_t`` as an int; default the device's current stream.
        max_ctas: SM budget: at most this many CTAs (thread blocks) for the kernel
            (default :data:`DEFAULT_MAX_CTAS` = 4, so the copy overlaps compute), or
            :data:`WHOLE_GPU`. Ignored on the emulated device.
        backend: ``"kernel"`` (graph-safe: no host sync, allocation or index read; a
            lowered launch allocates its part indices, see ``src_layout``),
            ``"copy_engine"`` (cudaMemcpyBatchAsync of runs of consecutive slots inside
            a page, fed device aliases; reads the indices on the host, so it syncs on
            CUDA indices and cannot be captured), or ``"auto"``: the copy engine when
            both layouts give runs of at least 512 KiB (1 MiB with the whole GPU) and
            not capturing, else the staged path where it wins, else the kernel (faster
            than the engine up to 64 KiB runs even at 2 CTAs, measured on the H200).
            With CPU index tensors (host memory on the emulated device) ``"auto"`` reads
            them on the host: the staged path wherever it applies (any size; with CPU
            indices it is the fastest path measured on the H200, 0.97-0.99 x bulk), else
            the copy engine (the kernel on the emulated device, which reads host memory);
            during capture CPU indices are refused. :func:`explain_transfer` says which
            path a call takes and why.
            ``"staged"`` (:mod:`pointerdomain.transfer.staged`): the copy engine moves whole host
            runs of a ``page_first`` pool through a small device staging ring while the
            kernel (``max_ctas`` CTAs) scatters or gathers the items; all layers only,
            reads the indices on the host (always checks them, whatever
            ``validate_indices``) and cannot be captured. ``"auto"`` takes it on CUDA,
            outside capture, for items <= 4 KiB, >= 2 CTAs (or the whole GPU) and
            transfers of >= 16 staging chunks (0.97 x bulk at 2 CTAs on the H200 where
            the kernel gives 0.92-0.95).
        validate_indices: how a slot outside ``[0, num_slots)`` is reported (the kernel
            always skips such a pair, so nothing outside the tables is touched):
            ``True`` (default): on the emulated device checked on the host before the
            launch (no sync: the indices are host memory), and the kernel's error word
            read right after it; on CUDA no host work at all: the kernel records the
            skip in the device's error word and :func:`pointerdomain.check_errors` /
            :func:`pointerdomain.synchronize` raise ``IndexValidationError`` later
            (graph replays included; see :mod:`pointerdomain.transfer.launch_errors`).
            ``"host"``: check on the host before launching (a device sync for CUDA
            indices; skipped during capture, the error word still covers it), so the
            launch raises before anything is copied. ``False``: skipped slots are not
            reported. A destination slot given twice is refused the same way: on the
            host where the indices are read there (``OverlapError`` before the launch),
            else (``True`` on CUDA, graph replays) by a validation pass on the device
            ahead of the copy, which then writes nothing, reported as ``OverlapError`` by
            :func:`pointerdomain.check_errors` (:mod:`pointerdomain.transfer.launch_errors`);
            ``False`` skips that check too. The copy engine and the staged path always check on the host
            (they read the indices there anyway, once: the checked copy is the one
            they use).

    Moves ``n * num_kv * num_layers * item_bytes`` bytes.

    Raises:
        DomainError: a table is not a PointerTable[DeviceAlias].
        DeviceMismatchError: the tables are for different devices.
        ClosedError: a table's registered memory was closed or is being closed, or a
            table entry's storage was released or reallocated under the table.
        LayoutError: layouts disagree, a table does not fit its layout exactly, a
            layout differs from the one a pool table was built for, or a layout that splits
            its items is paired with one it cannot be lowered with (e.g. ``page_head`` and
            ``page_first``: see :func:`pointerdomain.layouts.lower_pair`).
        IndexValidationError: bad dtype, shape, device, lengths; a slot out of range
            (when: see ``validate_indices``).
        OverlapError: src and dst share memory and a slot is both read and written
            (rules in :mod:`pointerdomain.transfer.overlap`), two entries of the dst table
            that the launch writes share memory, a destination slot is given twice (where
            the indices are read on the host), or an index tensor lies in the storage
            of a buffer of the dst table (the copy would overwrite its own indices).
        InvalidArgumentError: a layout that is not a KVLayout, a bad ``stream``,
            ``max_ctas``, ``backend`` or ``validate_indices``; ``backend="staged"`` or
            ``"copy_engine"`` during CUDA-graph capture, or ``"auto"`` with CPU index
            tensors there; ``"staged"`` per-layer, not
            between a host and a device pool, or with a staging buffer too small.
        LayoutError: ``backend="staged"`` with a host layout whose slot is not one block.
        ExtensionUnavailableError: ``backend="staged"`` in a build without it.
        RuntimeCallError: the launch failed.

    While the copy can run (the CPU call; on CUDA until the stream reaches it) the
    registrations it uses are leased: their ``close()`` waits (:mod:`pointerdomain.registration.leases`).
    """
    layout: object = src_layout  # layer_range(src_layout, None), inlined (a non-KVLayout: reported by bind_call)
    plan, options, args, _host, path = bind_call(src, src_layout, dst, dst_layout, src_indices, dst_indices, 0,
                                                 layout.num_layers if isinstance(layout, KVLayout) else 0, stream,
                                                 max_ctas, backend, validate_indices)
    run(plan, src, dst, src_indices, dst_indices, args, path, options.check)  # type: ignore[arg-type]  # chosen


def transfer_kv_per_layer(
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    layer_id: int,
    src_layout: KVLayout,
    dst_layout: KVLayout,
    stream: int | None = None,
    max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    backend: TransferBackend = "auto",
    validate_indices: ValidateIndices = True,
) -> None:
    """As :func:`transfer_kv_all_layer`, for one layer (layer-by-layer loading that
    overlaps the forward pass). Moves ``n * num_kv * item_bytes`` bytes.

    Raises:
        IndexValidationError: ``layer_id`` outside ``[0, num_layers)``; and all of
            :func:`transfer_kv_all_layer`'s errors.
    """
    layout: object = src_layout
    if type(layer_id) is int and isinstance(layout, KVLayout) and 0 <= layer_id < layout.num_layers:
        layer_begin, layer_count = layer_id, 1  # layer_range's answer, inlined for a layer in range
    else:
        layer_begin, layer_count = layer_range(src_layout, layer_id, False)
    plan, options, args, _host, path = bind_call(src, src_layout, dst, dst_layout, src_indices, dst_indices,
                                                 layer_begin, layer_count, stream, max_ctas, backend,
                                                 validate_indices)
    run(plan, src, dst, src_indices, dst_indices, args, path, options.check)  # type: ignore[arg-type]  # chosen


@dataclass(frozen=True, slots=True)
class TransferChoice:
    """What a transfer call would run (:func:`explain_transfer`).

    Attributes:
        path: ``"kernel"``, ``"copy_engine"`` or ``"staged"``: the path ``backend`` resolves to.
        reason: why, in one sentence.
        host_indices: an index tensor lies in host memory (read on the host, or by a
            kernel that reads host memory: the emulated device).
    """

    path: str
    reason: str
    host_indices: bool


def _reason(plan: TransferPlan, options: LaunchOptions, args: LaunchArgs, path: Path, host: bool) -> str:
    if options.path is not _AUTO:
        return f"backend={options.path.value!r} was asked for"
    if plan.unpinned is not None:
        return "a table is over unpinned host memory, which only the copy engine reads"
    threshold = CE_MIN_RUN_BYTES_WHOLE_GPU if args.max_ctas == 0 else CE_MIN_RUN_BYTES_SMALL_BUDGET
    if path is _COPY_ENGINE and plan.run_bytes >= threshold:
        return f"both layouts give contiguous runs of {plan.run_bytes} bytes (>= {threshold}): the copy engine's size"
    if path is _STAGED:
        return ("CPU index tensors and a host pool whose slots are one block: the staged path reads them on the host "
                "(the fastest path measured with CPU indices)" if host else
                f"{args.n} slots fill at least {staged.STAGED_MIN_CHUNKS} staging chunks: the staged path overlaps "
                "the copy engine with the kernel")
    if path is _COPY_ENGINE:
        return "CPU index tensors where the staged path does not apply: the copy engine reads them on the host"
    if host and plan.host_memory:
        return "the kernel (it reads host-memory indices on this device)"
    return "the kernel (graph-safe, no host sync; faster than the copy engine for runs this short)"


def _check_values(
    plan: TransferPlan, src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], s_idx: torch.Tensor,
    d_idx: torch.Tensor, args: LaunchArgs, path: Path, check: IndexCheck,
) -> None:
    """The checks :func:`run` makes before launching ``path``, in its order, without
    launching: the slot range and destination slots given twice where the launch reads the
    indices on the host (the copy engine, the staged path, ``validate_indices="host"``, the
    default check on a device whose memory the host reads; a device sync for CUDA indices,
    as the launch's), the same-memory slot overlap (:func:`overlap.check_slots`), and the
    staged path's own refusal and checks (:func:`staged.launch_staged`)."""
    platform = plan.platform
    if path is _COPY_ENGINE:
        _check_range(s_idx, d_idx, plan)
    elif path is _STAGED:
        if plan.lowering is not None:  # launch_staged checks the parts' slots: the caller's first
            _check_range(s_idx, d_idx, plan)
    elif check is _CHECK_HOST or (check is _CHECK_DEFERRED and platform.host_readable):
        _check_range(s_idx, d_idx, plan)
    if plan.same_memory:
        overlap.check_slots(s_idx, d_idx, platform.is_capturing(plan.device))
    if args.n == 0 or path is not _STAGED:
        return
    verdict = staged.staged_refusal(plan, src, dst, args.layer_begin, args.layer_count)
    if isinstance(verdict, PointerDomainError):
        raise verdict
    plan.check_addressed_range(s_idx.cpu(), d_idx.cpu())


def explain_transfer(
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    src_layout: KVLayout,
    dst_layout: KVLayout,
    layer_id: int | None = None,
    stream: int | None = None,
    max_ctas: MaxCtas = DEFAULT_MAX_CTAS,
    backend: TransferBackend = "auto",
    validate_indices: ValidateIndices = True,
) -> TransferChoice:
    """The path :func:`transfer_kv_all_layer` (``layer_id`` None) or
    :func:`transfer_kv_per_layer` (``layer_id``) would run with these arguments, and why;
    every check of the call runs, nothing is launched or copied; the index values are
    checked exactly where and in the order the launch checks them before launching (slot
    range, a destination slot given twice, a slot both read and written in one memory; the
    staged path's refusals), so the verdict is the launch's: the same error class and
    message, or none. Where the launch reads CUDA indices on the host (the copy engine, the
    staged path, ``validate_indices="host"``) so does this, a device sync; CUDA indices the
    launch leaves to the kernel (``validate_indices=True``: reported later by
    :func:`pointerdomain.check_errors`) are not read. With ``backend="auto"``
    the answer can change with the arguments' sizes, the indices' memory, the stream's
    capture state and the staging configuration, so it holds for this call.

    Returns:
        A :class:`TransferChoice`.

    Raises:
        PointerDomainError: what the transfer call raises before its launch
            (:func:`transfer_kv_all_layer`: DomainError, DeviceMismatchError, ClosedError,
            LayoutError, IndexValidationError, OverlapError, InvalidArgumentError,
            UnpinnedMemoryError), the same class and message.
        IndexValidationError: also for a ``layer_id`` that is not None or a layer.
    """
    if not isinstance(cast(object, src_layout), KVLayout):  # before the tables' checks, also for every layer
        raise InvalidArgumentError(f"src_layout must be a KVLayout, got {type(src_layout).__name__}")
    layer_begin, layer_count = layer_range(src_layout, layer_id)
    plan, options, args, host, path = bind_call(src, src_layout, dst, dst_layout, src_indices, dst_indices,
                                                layer_begin, layer_count, stream, max_ctas, backend, validate_indices)
    assert path is not None  # chosen
    _check_values(plan, src, dst, src_indices, dst_indices, args, path, options.check)
    return TransferChoice(path.value, _reason(plan, options, args, path, host), host)
