"""LMCache's KV transfer ops (``lmcache.c_ops``), same call shapes, checked before anything is written.

Upstream (LMCache/LMCache; read at the commits named). Two generations of the bindings are
in use and both call shapes are accepted here (told apart by the type of one argument, below).

Current (``csrc/cuda/pybind.cpp`` at 6a04ea195309c572b15c9066c4d0ae5d4849e99f; the CUDA
bodies in ``csrc/cuda/mem_kernels.cu`` at 0a353d636bbf6cf8a5a2370a07317fedf9bc9a5c)::

    multi_layer_kv_transfer(key_value, key_value_ptrs, slot_mapping, paged_memory_device,
                            page_buffer_size: int, direction: int, engine_kv_format: int,
                            block_size: int = 0, head_size: int = 0, skip_prefix_n_tokens: int = 0)
    multi_layer_kv_transfer_unilateral(key_value, key_value_ptrs, slot_mapping, paged_memory_device,
                                       page_buffer_size: int, direction: int, engine_kv_format: int)
    single_layer_kv_transfer(lmc_key_value_cache, vllm_key_value_cache, slot_mapping,
                             direction: int, engine_kv_format: int, token_major: bool = False)
    load_and_reshape_flash(key_value, key_cache, value_cache, slot_mapping, layer_idx: int)
    reshape_and_cache_back_flash(key_value, key_cache, value_cache, slot_mapping, layer_idx: int)

``direction``: ``TransferDirection`` of ``csrc/kv_transfer_types.h``
(2573f5fa7beaf4a8d8fc18156ec9d285edd0269f): ``H2D = 0`` (memory object -> paged cache),
``D2H = 1`` (paged cache -> memory object). ``engine_kv_format``: ``EngineKVFormat`` of
``csrc/engine_kv_format.def`` (e877b1b307561027b28181885014aa27e2fabf0b), values 0-10
(:class:`EngineKVFormat` here).

Legacy (``csrc/pybind.cpp`` at b98a5592cb81317ba4c5c520415339cb0e074d78, bodies in
``csrc/mem_kernels.cu`` at c1d82aac1f8a28326d8c408c83c4ef19e34227b7; the call shapes of
``tests/v1/test_mem_kernels.py`` at b98a5592...), positional only::

    multi_layer_kv_transfer(key_value, key_value_ptrs, slot_mapping, paged_memory_device,
                            page_buffer_size, direction: bool, use_mla: bool)
    multi_layer_kv_transfer_unilateral(... same ..., direction: bool, use_mla: bool)
    single_layer_kv_transfer(lmc_key_value_cache, vllm_key_value_cache, slot_mapping,
                             direction: bool, token_major: bool, vllm_two_major: bool)

A ``bool`` where the current shape has ``engine_kv_format`` selects the legacy shape: for the
multi-layer ops it is ``use_mla`` (False: the vLLM flash-attention layout, format 1; True:
vLLM MLA, format 3); for ``single_layer_kv_transfer`` it is ``token_major`` and the next
argument is ``vllm_two_major`` (True: format 1, False: format 2). ``direction`` as a bool
reads the same in both (True is D2H).

Shapes (elements; ``E`` = one token's item, ``key_value.size(3)``; ``P`` = ``page_buffer_size``
= ``NB * BS`` token slots; what each kernel addresses, from ``page_buffer_offset`` and
``key_value_offset`` in mem_kernels.cu):

* memory object ``key_value``: ``[kv, L, T, E]`` contiguous, GPU or pinned host memory;
  ``kv`` = 2, or 1 for MLA (3, 5) and the fused format 10. Token ``t`` of layer ``l`` (K: 0,
  V: 1) is ``key_value[kv, l, t]``, and goes to slot ``slot_mapping[t]`` of layer ``l``.
* ``key_value_ptrs``: ``[L]`` int64 of ``data_ptr()`` of each layer's paged cache (the
  unilateral op: ``[2L]``, all K buffers then all V buffers), on the CPU or the GPU.
* each layer's paged cache, by format:

  ====  ========================  ==============================================
  fmt   name                      per-layer memory
  ====  ========================  ==============================================
  0     NB_NL_TWO_BS_NH_HS        addressed as format 1 (the kernel's offsets)
  1     NL_X_TWO_NB_BS_NH_HS      ``[2, NB, BS, NH, HS]`` (vLLM flash attention)
  2     NL_X_NB_TWO_BS_NH_HS      ``[NB, 2, BS, NH, HS]`` (vLLM flash infer)
  3     NL_X_NB_BS_HS             ``[NB, BS, HS]`` (vLLM MLA)
  5     NL_X_NBBS_ONE_HS          ``[NB * BS, 1, HS]`` (SGLang MLA)
  6     NL_X_TWO_NB_NH_BS_HS      ``[2, NB, NH, BS, HS]`` (flash attention, HND)
  7     NL_X_NB_TWO_NH_BS_HS      ``[NB, 2, NH, BS, HS]`` (flash infer, HND)
  10    NL_X_NB_NH_BS_TWO_HS      ``[NB, NH, BS, 2 * HS]`` (K|V fused per head, kv = 1)
  ====  ========================  ==============================================

  4 (TWO_X_NL_X_NBBS_NH_HS, SGLang's separate K/V buffers) is the unilateral op's layout;
  upstream's ``multi_layer_kv_transfer`` throws "Unsupported EngineKVFormat" for 4, 8 and 9,
  and so does this one (:class:`~pointerdomain.errors.InvalidArgumentError`). HND and fused
  formats need ``head_size`` (HS, elements); every paged format but MLA needs ``block_size``
  (> 0; only the formats that address by block, 2, 6, 7 and 10, need ``page_buffer_size`` to be
  whole blocks of it: 0 and 1 place slot ``s`` at ``s * E`` and never read it, as upstream).
* ``single_layer_kv_transfer``: ``lmc_key_value_cache`` ``[T', 2, E]`` (token_major),
  ``[2, T', E]`` or, MLA, ``[T', E]``, ``T' >= len(slot_mapping)``; ``vllm_key_value_cache``
  one layer of format 1, 2, 3, 6 or 7 (its switch), as a tensor.
* ``load_and_reshape_flash`` (D2H) / ``reshape_and_cache_back_flash`` (H2D): layer
  ``layer_idx`` of ``key_value`` ``[2, L, T, NH * HS]`` <-> ``key_cache`` / ``value_cache``
  ``[NB, BS, NH, HS]``.

Negative slots: every upstream kernel returns early for ``slot_mapping[t] < 0`` (vLLM pads
with -1; lmcache/v1/gpu_connector.py at 009c5a394df25ea23208727c9ea53a1c374dcc6b: a prefix
hit starts the slot mapping with -1s), so such a token is skipped here too: nothing is
read or written for it.

Here every call is one :func:`pointerdomain.transfer_kv_all_layer` (``backend="kernel"``, the
current stream of the device, the whole GPU as upstream's grid of ``T x L x kv`` blocks),
over ``uint8`` :class:`~pointerdomain.KVLayout` s whose item is one contiguous run of the
format (a token's item; one head's ``HS`` for HND; one head's ``2 * HS`` for format 10), so
the bytes moved are exactly upstream's. Before anything is launched:

* every ``key_value_ptrs`` entry is resolved (:func:`pointerdomain.compat._raw.resolved_table`):
  device memory of ``paged_memory_device``, each reaching ``kv * P * E`` bytes inside its
  allocation; host memory there is a :class:`~pointerdomain.errors.DomainError` (a paged KV
  cache is device memory). With ``page_buffer_size`` 0 (upstream's MLA callers pass 0; the
  kernels do not use it for formats 2, 3, 5, 7 and 10) the capacity is what the smallest
  allocation holds from its entry (a raw address cannot say more: for torch's caching
  allocator that is the segment), and no more than the least distance between two entries
  (layers inside one segment end where the next begins); formats 0, 1 and 6 need it (their
  K/V offset is ``P * E``);
* buffer tensors must be contiguous, registered or runtime-pinned host memory or device
  memory of that device (:func:`pointerdomain.compat._raw.tensor_table`);
* ``slot_mapping`` (int64, 1-D, CPU or that device) is read on the host (a device sync for a
  CUDA tensor): a slot at or past the capacity is an
  :class:`~pointerdomain.errors.IndexValidationError` naming it (upstream writes out of range);
* every shape, dtype, size and flag is checked, with a typed error.

Narrower than upstream: buffers must be contiguous (upstream's single-layer and flash ops
honour the strides of the outer dimensions); the legacy multi-layer ops need
``len(slot_mapping) == key_value.size(2)`` (their kernel uses the slot count as the token
stride); the current one ``len(slot_mapping) >= key_value.size(2)`` (upstream reads the first
``T``). Wider: item sizes that upstream's 8-byte words cannot express exactly (upstream drops
the remainder) are moved exactly. Not here: formats 11-14 (added after the ``.def`` above),
``block_stride_elems``, the fused multi-chunk variant and the other ``c_ops``.
"""

from __future__ import annotations

import enum
import functools
import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final, NamedTuple, SupportsIndex

import torch

import pointerdomain as pd
from pointerdomain.arguments import describe
from pointerdomain._platform import backend_for
from pointerdomain._platform.runtimes import names_one_device
from pointerdomain.compat import _raw
from pointerdomain.compat._raw import held, table_key, view_key
from pointerdomain.compat.sgl_kernel import Side, apart
from pointerdomain.devices import Device
from pointerdomain.domains import DeviceAlias
from pointerdomain.errors import (
    ClosedError,
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    NonContiguousError,
    RegistrationSpanError,
)
from pointerdomain.registration.tables import PointerTable, resolved_kernel_table
from pointerdomain.transfer.overlap import allow_interleaved

__all__ = [
    "MULTI_LAYER_FORMATS",
    "SINGLE_LAYER_FORMATS",
    "EngineKVFormat",
    "TransferDirection",
    "load_and_reshape_flash",
    "multi_layer_kv_transfer",
    "multi_layer_kv_transfer_unilateral",
    "reshape_and_cache_back_flash",
    "single_layer_kv_transfer",
]


class EngineKVFormat(enum.IntEnum):
    """LMCache's ``EngineKVFormat`` (``csrc/engine_kv_format.def`` at e877b1b3...): the physical
    layout of an engine's KV cache. ``NL_X_...``: one tensor per layer; ``TWO_X_...``: K and V
    lists; ``NB_NL_...``: one tensor for all layers."""

    NB_NL_TWO_BS_NH_HS = 0
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2
    NL_X_NB_BS_HS = 3
    TWO_X_NL_X_NBBS_NH_HS = 4
    NL_X_NBBS_ONE_HS = 5
    NL_X_TWO_NB_NH_BS_HS = 6
    NL_X_NB_TWO_NH_BS_HS = 7
    NB_NL_TWO_NH_BS_HS = 8
    TWO_X_NL_X_NB_BS_NH_HS = 9
    NL_X_NB_NH_BS_TWO_HS = 10


class TransferDirection(enum.IntEnum):
    """LMCache's ``TransferDirection`` (``csrc/kv_transfer_types.h``): ``H2D`` moves the memory
    object into the paged cache, ``D2H`` the paged cache into the memory object (whatever
    memory each lives in)."""

    H2D = 0
    D2H = 1


F = EngineKVFormat
#: Formats ``multi_layer_kv_transfer`` moves (upstream's switch in mem_kernels.cu, 0-10).
MULTI_LAYER_FORMATS: Final = frozenset({F.NB_NL_TWO_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_BS_NH_HS,
                                        F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS, F.NL_X_TWO_NB_NH_BS_HS,
                                        F.NL_X_NB_TWO_NH_BS_HS, F.NL_X_NB_NH_BS_TWO_HS})
#: Formats ``single_layer_kv_transfer`` moves (its switch).
SINGLE_LAYER_FORMATS: Final = frozenset({F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_NB_BS_HS,
                                         F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS})
_MLA: Final = frozenset({F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS})
_HND: Final = frozenset({F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS})
#: formats whose K/V offset is ``page_buffer_size * E``: they need it
_USES_PAGE_BUFFER_SIZE: Final = frozenset({F.NB_NL_TWO_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS})

#: upstream's kernels run a grid over every (token, layer, kv): not a few-CTA background copy
_MAX_CTAS: Final = pd.WHOLE_GPU


# -- argument checks -----------------------------------------------------------------------

def _tensor(name: str, t: object) -> torch.Tensor:
    return _raw.plain_tensor(name, t)  # a tensor with memory behind it (not sparse, not meta)


def _contiguous(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise NonContiguousError(
            f"{name}: shape {tuple(t.shape)} with strides {t.stride()} is not contiguous; this op addresses it "
            "as packed. Fix: pass a contiguous buffer (.contiguous() a copy and copy back)")
    return t


def _count(name: str, x: object) -> int:
    """A size argument: an int >= 0 (not a bool)."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidTypeError(f"{name}: found {describe(x)} ({type(x).__name__}), expected an int")
    if x < 0:
        raise InvalidArgumentError(f"{name}: found {x}, expected an int >= 0")
    return int(x)


def _flag(name: str, x: object) -> bool:
    if not isinstance(x, bool):
        raise InvalidTypeError(f"{name}: found {describe(x)} ({type(x).__name__}), expected a bool")
    return x


def _index_value(name: str, x: object) -> int:
    """An enum-like argument as its int (ints, IntEnums, bools, pybind11 enums)."""
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidTypeError(
            f"{name}: found {describe(x)} ({type(x).__name__}), expected an int or an enum with an integer value") from None


def _to_paged(direction: object) -> bool:
    """True for H2D (memory object -> paged cache), False for D2H."""
    value = _index_value("direction", direction)
    if value not in (TransferDirection.H2D, TransferDirection.D2H):
        raise InvalidArgumentError(f"direction: found {value}, expected 0 (H2D) or 1 (D2H)")
    return value == TransferDirection.H2D


def _format(x: object, allowed: frozenset[EngineKVFormat], op: str) -> EngineKVFormat:
    value = _index_value("engine_kv_format", x)
    try:
        fmt = EngineKVFormat(value)
    except ValueError:
        raise InvalidArgumentError(
            f"engine_kv_format: found {value}, expected an EngineKVFormat value in [0, {len(EngineKVFormat) - 1}]"
        ) from None
    if fmt not in allowed:
        raise InvalidArgumentError(
            f"engine_kv_format: {fmt.name} ({int(fmt)}) is not a format {op} moves (upstream throws "
            f"'Unsupported EngineKVFormat'); expected one of {sorted(int(f) for f in allowed)}")
    return fmt


def _launch_device(x: object) -> Device:
    if not isinstance(x, (Device, str, torch.device)):
        raise InvalidTypeError(
            f"paged_memory_device: found a {type(x).__name__}, expected a torch.device, a device string or a "
            "pointerdomain.Device")
    return pd.validate_device(x)


def _device_tensor(name: str, t: torch.Tensor) -> Device:
    """The device whose memory holds ``t``, which must be device memory."""
    where = _raw.memory_device_of(name, t)
    if where is None:
        raise DomainError(
            f"{name}: host memory at {t.data_ptr():#x}, expected device memory: a paged KV cache lives on the GPU")
    return where


def _host_slots(name: str, t: object, device: Device) -> torch.Tensor:
    """``slot_mapping`` checked and read on the host: a CPU int64 tensor (a CUDA tensor costs
    one device sync, the price of checking before the launch). Refused during graph capture:
    the launch would read indices computed here from this call's slots, so a replay would
    write where the slots pointed at capture; and a launch reading ``slot_mapping`` itself
    would take its padding (-1, which upstream skips) for slots out of range. LMCache moves
    KV between its memory objects and the paged cache outside the model's graphs."""
    if backend_for(device).is_capturing(device):
        raise InvalidArgumentError(
            f"{name}: the LMCache call shapes are not capturable: the slots are read on the host and turned into "
            "the cache's indices before the launch, so a graph replay would move the tokens to the slots of the "
            "capture, not the slots slot_mapping holds then (and padding slots, -1, are dropped there). Fix: call "
            "it outside graph capture, as LMCache's connector does")
    slots = _tensor(name, t)
    if slots.dtype != torch.int64:
        raise IndexValidationError(f"{name}: dtype {slots.dtype}, expected torch.int64 (upstream reads int64 slots)")
    if slots.dim() != 1:
        raise IndexValidationError(f"{name}: shape {tuple(slots.shape)}, expected 1-D")
    if slots.is_cpu:
        where = _raw.memory_device_of(name, slots)
        if where is not None and where != device:
            raise DeviceMismatchError(f"{name}: memory of {where}, but the launch runs on {device}")
    elif not (not device.runtime.host_memory and slots.is_cuda and slots.get_device() == device.ordinal):
        raise DeviceMismatchError(f"{name}: on {slots.device}, but the launch runs on {device}")
    return slots.detach().to("cpu")


def _same_device(name: str, t: torch.Tensor, device: Device) -> None:
    where = _raw.memory_device_of(name, t)
    if where is None:
        raise DomainError(f"{name}: host memory, expected device memory of {device} (a paged KV cache)")
    if where != device:
        raise DeviceMismatchError(f"{name}: memory of {where}, the other cache is on {device}")


# -- geometry --------------------------------------------------------------------------------

class _Paged(NamedTuple):
    """One layer's paged cache as uint8 runs: table entry ``kv`` of a layer starts
    ``kv_base[kv]`` elements into the layer and holds ``runs`` runs of ``run`` elements; slot
    ``s`` (block ``b``, offset ``o``) and head ``h`` is run ``b * block_runs + o + h * head_runs``
    (``block`` 0: run ``s + h * head_runs``)."""

    kv_size: int
    run: int
    heads: int
    kv_base: tuple[int, ...]
    runs: int
    block: int
    block_runs: int
    head_runs: int


def _head_split(fmt: EngineKVFormat, item: int, head_size: int) -> tuple[int, int]:
    """(run elements, heads per token item) of an HND or fused format."""
    run = 2 * head_size if fmt == F.NL_X_NB_NH_BS_TWO_HS else head_size
    if head_size <= 0:
        raise InvalidArgumentError(f"head_size: found {head_size}, expected an int > 0 for {fmt.name} (elements)")
    if item % run:
        raise LayoutError(
            f"head_size: {head_size} does not divide the item of {item} elements into heads of {run} ({fmt.name})")
    return run, item // run


def _paged_geometry(fmt: EngineKVFormat, item: int, capacity: int, block_size: int, head_size: int) -> _Paged:
    """The runs of ``fmt`` with ``capacity`` slots (a multiple of ``block_size`` for block formats)
    of ``item`` elements per kv, exactly covering ``kv_size * capacity * item`` elements per layer."""
    if fmt in _MLA:
        return _Paged(1, item, 1, (0,), capacity, 0, 0, 0)
    if fmt in (F.NB_NL_TWO_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS):
        return _Paged(2, item, 1, (0, capacity * item), capacity, 0, 0, 0)
    blocks = capacity // block_size
    if fmt == F.NL_X_NB_TWO_BS_NH_HS:  # [NB, 2, BS, item]: K and V interleave per block
        return _Paged(2, item, 1, (0, block_size * item), (2 * blocks - 1) * block_size, block_size,
                      2 * block_size, 0)
    run, heads = _head_split(fmt, item, head_size)
    if fmt == F.NL_X_TWO_NB_NH_BS_HS:  # [2, NB, NH, BS, HS]
        return _Paged(2, run, heads, (0, capacity * item), capacity * heads, block_size, heads * block_size,
                      block_size)
    if fmt == F.NL_X_NB_TWO_NH_BS_HS:  # [NB, 2, NH, BS, HS]
        return _Paged(2, run, heads, (0, block_size * item), (2 * blocks - 1) * heads * block_size, block_size,
                      2 * heads * block_size, block_size)
    # F.NL_X_NB_NH_BS_TWO_HS: [NB, NH, BS, 2 * HS], K|V of a head in one run
    return _Paged(1, run, heads, (0,), capacity * heads, block_size, heads * block_size, block_size)


def _alternating(g: _Paged, es: int) -> tuple[int, int] | None:
    """``(stride, row)`` bytes of a per-layer entry whose K and V blocks alternate (K block at
    0, V block at ``kv_base[1]``, each ``kv_base[1]`` elements), else None."""
    if len(g.kv_base) == 2 and g.kv_base[1] < g.runs * g.run:
        return 2 * g.kv_base[1] * es, g.kv_base[1] * es
    return None


def _check_block_args(fmt: EngineKVFormat, page_buffer_size: int, block_size: int, item: int,
                      head_size: int) -> None:
    """Upstream's check_block_size / check_head_size, and the sizes the offsets need."""
    if fmt in _MLA:
        return
    if block_size <= 0:
        raise InvalidArgumentError(f"block_size: found {block_size}, expected an int > 0 for {fmt.name}")
    if fmt in _HND or fmt == F.NL_X_NB_NH_BS_TWO_HS:
        _head_split(fmt, item, head_size)
    if fmt in _USES_PAGE_BUFFER_SIZE and page_buffer_size == 0:
        raise InvalidArgumentError(
            f"page_buffer_size: found 0, expected NB * BS token slots > 0: {fmt.name} places V "
            "page_buffer_size items after K (with 0 both would land on the same bytes)")
    if page_buffer_size and fmt not in (F.NB_NL_TWO_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS) and page_buffer_size % block_size:
        raise InvalidArgumentError(
            f"page_buffer_size: {page_buffer_size} slots is not a whole number of blocks of {block_size}")


@functools.lru_cache(maxsize=512)
def _layout(kv_size: int, num_layers: int, runs: int, run_bytes: int) -> pd.KVLayout:
    """A uint8 layout of ``runs`` runs of ``run_bytes`` per (kv, layer) entry; cached so a repeated
    call shape finds its transfer plan again (plans are keyed by the layout objects)."""
    return pd.KVLayout(kind="layer_first", attention="mha" if kv_size == 2 else "mla", num_layers=num_layers,
                       num_pages=runs, page_size=1, num_heads=1, head_dim=run_bytes, dtype="uint8")


# -- tables ----------------------------------------------------------------------------------

class _Derived(NamedTuple):
    ref: weakref.ref[PointerTable[DeviceAlias]]
    table: PointerTable[DeviceAlias]


#: (id(resolved table), bases, entry bytes) -> the per-kv table over it; the resolved table is
#: _raw's cached object, so a pool's unchanged pointer table finds its derived table again
_derived: OrderedDict[tuple[int, tuple[int, ...], int], _Derived] = _raw.owned_cache()
_DERIVED_MAX: Final = 64
_lock = threading.Lock()


def _check_device_entries(name: str, table: PointerTable[DeviceAlias]) -> None:
    regions = table.resolved_regions()
    for i, value in enumerate(table.raw_values()):
        kind = next((k for lo, hi, k in regions if lo <= value < hi), "registered")
        if kind != "device":
            raise DomainError(
                f"{name}[{i}]: lies in {kind} host memory (device alias {value:#x}), expected device memory of "
                f"{table.device}: a paged KV cache lives on the GPU. Fix: pass the data_ptr() of the engine's "
                "per-layer KV cache tensors")


def _paged_table(name: str, table: PointerTable[DeviceAlias], bases: tuple[int, ...],
                 entry_bytes: int) -> PointerTable[DeviceAlias]:
    """Entries ``alias + base`` (bytes) for each base, each over all of ``table``'s entries
    (base-major), ``entry_bytes`` each: inside the reach ``table`` was resolved with, by the
    caller's construction. Only device-memory entries are accepted."""
    key = (id(table), bases, entry_bytes)
    hit = _derived.get(key)
    if hit is not None and hit.ref() is table:
        return hit.table
    _check_device_entries(name, table)
    for i, size in enumerate(table.sizes):
        if max(bases) + entry_bytes > size:  # not reachable by construction: a guard, not a check
            raise LayoutError(f"{name}[{i}]: a run of {entry_bytes} bytes at +{max(bases)} passes its {size} bytes")
    aliases = table.raw_values()
    values = [a + b for b in bases for a in aliases]
    device = table.device
    derived = resolved_kernel_table(values, [entry_bytes] * len(values), device, table.registrations(),
                                    table.resolved_regions(), [a + b for b in bases for a in table.entry_addresses()])
    # K and V blocks alternating (rows of bases[1] bytes, 2 * bases[1] apart), or entries that must not meet
    allow_interleaved(derived, (2 * bases[1], bases[1]) if len(bases) == 2 and bases[1] < entry_bytes else None)
    with _lock:
        _raw.remember(_derived, key, _Derived(weakref.ref(table), derived), _DERIVED_MAX)
    return derived


def _raw_layers(name: str, ptrs: object, count: int, device: Device, per_entry: int, capacity: int,
                block: int) -> tuple[PointerTable[DeviceAlias], int]:
    """``ptrs`` resolved (``count`` entries, device memory of ``device``), and the capacity in slots:
    ``capacity`` when given (each entry must reach ``capacity * per_entry`` bytes), else what the
    smallest allocation holds from its entry, and no more than the least distance between two
    entries (whole blocks of ``block`` slots when ``block`` > 0).

    Raises:
        OverlapError: two entries at one address."""
    t = _tensor(name, ptrs)
    if t.dim() != 1 or t.numel() != count:
        raise LayoutError(f"{name}: shape {tuple(t.shape)}, expected [{count}] (one address per buffer)")
    if capacity:
        return _raw.resolved_table(name, t, device, reach=capacity * per_entry), capacity
    table = _raw.resolved_table(name, t, device)
    i = min(range(count), key=lambda j: table.sizes[j])
    unit = per_entry * max(block, 1)
    held = table.sizes[i]
    # layers inside one allocation (a caching allocator's segment): an entry holds up to the next
    # entry, not the allocation's end, so a layer's slots never run into the next layer's bytes
    # (entries at one address are one cache shared by layers: whether it may be written
    # twice is the copy's own check, by direction)
    gap = _raw.entry_gap(name, [table], same_ok=True)
    if gap is not None and gap < held:
        held = gap
    slots = held // unit * max(block, 1)
    if slots == 0:
        raise RegistrationSpanError(
            f"{name}[{i}]: its allocation holds {table.sizes[i]} bytes from the entry, less than one "
            f"{'block' if block else 'slot'} of {unit} bytes")
    return table, slots


def _byte_slices(t: torch.Tensor, starts: Sequence[int], nbytes: int) -> list[torch.Tensor]:
    flat = t.reshape(-1).view(torch.uint8)  # contiguous: a view
    return [flat[s: s + nbytes] for s in starts]


# -- slots -----------------------------------------------------------------------------------

def _pairs(slots: torch.Tensor, first: int, capacity: int, tok_runs: int, g: _Paged,
           name: str = "slot_mapping") -> tuple[torch.Tensor, torch.Tensor] | None:
    """(memory-object runs, paged runs) of tokens ``first + j`` for slots ``slots[j]``; tokens with
    a negative slot are dropped (upstream skips them); None when nothing is left.

    Raises:
        IndexValidationError: a slot >= ``capacity``, named by its position in ``name``.
    """
    if slots.numel() == 0:
        return None
    over = slots >= capacity
    if bool(over.any()):
        j = int(over.nonzero()[0])
        raise IndexValidationError(
            f"{name}[{first + j}]: slot {int(slots[j])} outside [0, {capacity}) (the paged cache's token slots); "
            "nothing was copied")
    tokens = torch.arange(first, first + slots.numel(), dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        tokens, slots = tokens[keep], slots[keep]
        if slots.numel() == 0:
            return None
    base = slots if not g.block else slots // g.block * g.block_runs + slots % g.block
    mem = tokens * tok_runs
    if g.heads == 1:
        return mem.contiguous(), base.contiguous()
    heads = torch.arange(g.heads, dtype=torch.int64)
    return (mem[:, None] + heads).reshape(-1), (base[:, None] + heads * g.head_runs).reshape(-1)


#: (id(mem), id(paged), to_paged) of table pairs :func:`_apart` passed, with references that
#: rule out a reused id: a call shape met again pays a look-up.
_apart_seen: dict[tuple[int, int, bool, tuple[int, int] | None], tuple[weakref.ref[PointerTable[DeviceAlias]], weakref.ref[PointerTable[DeviceAlias]]]] = {}


def _apart(mem: PointerTable[DeviceAlias], mem_layout: pd.KVLayout, mem_names: tuple[str, ...],
           paged: PointerTable[DeviceAlias], paged_layout: pd.KVLayout, paged_names: tuple[str, ...],
           to_paged: bool, rows: tuple[int, int] | None = None) -> None:
    """Refuse destination buffers that overlap each other or a source buffer, naming the
    arguments (:func:`pointerdomain.compat.sgl_kernel.apart`; K and V one base apart in a
    block are interleaved by design: ``rows``, the destination's ``(stride, row)`` bytes, for
    :func:`~pointerdomain.transfer.overlap.rows_clash`). Once per pair of tables.

    Raises:
        OverlapError: naming the two arguments.
    """
    key = (id(mem), id(paged), to_paged, rows)
    seen = _apart_seen.get(key)
    if seen is not None and seen[0]() is mem and seen[1]() is paged:
        return
    m, p = Side(mem, 0, mem_layout), Side(paged, 0, paged_layout)
    if to_paged:
        apart(m, mem_names, p, paged_names, rows=rows)
    else:
        apart(p, paged_names, m, mem_names, rows=rows)
    if len(_apart_seen) >= 1024:
        _apart_seen.clear()
    _apart_seen[key] = (weakref.ref(mem), weakref.ref(paged))


def _launch(mem: PointerTable[DeviceAlias], mem_layout: pd.KVLayout, paged: PointerTable[DeviceAlias],
            paged_layout: pd.KVLayout, idx: tuple[torch.Tensor, torch.Tensor], to_paged: bool, device: Device) -> None:
    # index tensors on the launch device; made on its current stream, the stream the launch uses
    mem_idx, paged_idx = (t.to(device.torch_device) for t in idx)
    if to_paged:
        pd.transfer_kv_all_layer(mem, paged, mem_idx, paged_idx, src_layout=mem_layout, dst_layout=paged_layout,
                                 max_ctas=_MAX_CTAS, backend="kernel")
    else:
        pd.transfer_kv_all_layer(paged, mem, paged_idx, mem_idx, src_layout=paged_layout, dst_layout=mem_layout,
                                 max_ctas=_MAX_CTAS, backend="kernel")


# -- prepared calls --------------------------------------------------------------------------
# LMCache moves the same memory-object buffers to and from the same per-layer caches call
# after call; only the slots change. For a format whose slot is one run of the paged cache
# and whose memory-object token is one run (0, 1, 3 and 5, and single-layer 1 and 3 with
# the [2, T, E] / MLA object), the checked translation (tables, layouts, the token indices
# of the memory object) is kept per call shape, keyed as sglang's prepared calls
# (:func:`pointerdomain.compat._raw.view_key` / ``table_key``), and a repeat hands
# ``slot_mapping`` itself to the direct launch with ``validate_indices="host"``: the slots
# are read and checked there, before anything is written. A negative slot (upstream skips
# its token) or one past the cache makes that launch refuse, and the full path below then
# drops the negative slots or words the error. A device argument without an ordinal
# ("cuda": the current device, which may change) is never keyed.

class _Ready(NamedTuple):
    held: tuple[torch.Tensor, ...]
    mem: PointerTable[DeviceAlias]
    mem_layout: pd.KVLayout
    paged: PointerTable[DeviceAlias]
    paged_layout: pd.KVLayout
    to_paged: bool
    #: memory-object token runs per call length (slots of tokens [first, first + n))
    tokens: dict[int, torch.Tensor]
    #: the slots used: slot_mapping[first:first + moved], slot_mapping holding at least
    #: ``first + moved`` (exactly, where ``exact``); moved None: all of slot_mapping, at most ``limit``
    first: int
    moved: int | None
    exact: bool
    limit: int
    device: Device
    #: the arguments of the last memory-keyed hit (:func:`pointerdomain.compat._raw.met_again`)
    last: list[tuple[object, ...]]


_ready: OrderedDict[tuple[object, ...], _Ready] = _raw.owned_cache()
_READY_MAX: Final = 256


def _keyed_device(x: object) -> bool:
    """A device argument that names one device whatever the current device is."""
    return isinstance(x, Device) or (isinstance(x, (str, torch.device)) and names_one_device(x))


#: per device the longest 0, 1, 2, ... index ramp made so far; every ramp ever made is kept
#: (never freed): a launch in flight on any stream may still read a view of one, and a
#: freed block could be handed to new work on another stream meanwhile
_ramps: dict[Device, torch.Tensor] = {}
_ramps_made: list[torch.Tensor] = []


def _ramp(device: Device, first: int, n: int) -> torch.Tensor:
    """``[first, first + n)`` as int64 on ``device``, a view of a ramp that is complete
    before any stream reads it (built on the host, copied with a blocking copy)."""
    ramp = _ramps.get(device)
    if ramp is None or ramp.numel() < first + n:
        with _lock:
            ramp = _ramps.get(device)
            if ramp is None or ramp.numel() < first + n:
                size = max(first + n, 1024, 2 * (0 if ramp is None else ramp.numel()))
                with torch.inference_mode(False):  # a plain tensor: read outside inference mode too
                    ramp = torch.arange(size, dtype=torch.int64).to(device.torch_device)
                _ramps_made.append(ramp)
                _ramps[device] = ramp
    return ramp[first:first + n]


def _token_runs(ready: _Ready, n: int) -> torch.Tensor:
    t = ready.tokens.get(n)
    if t is None:
        t = _ramp(ready.device, ready.first, n)
        with _lock:
            if len(ready.tokens) < 8:
                ready.tokens[n] = t
    return t


def _launch_ready(ready: _Ready, slot_mapping: torch.Tensor) -> bool:
    """A prepared call's direct launch; False when it was refused before anything was written
    (the caller then takes the full path), or during graph capture (the full path refuses it)."""
    if backend_for(ready.device).is_capturing(ready.device):
        return False
    try:
        total = slot_mapping.shape[0]
        if ready.moved is None:
            if total > ready.limit:
                return False
            slots, n = slot_mapping, total
        else:
            end = ready.first + ready.moved
            if total < end or (ready.exact and total != end):
                return False
            slots, n = (slot_mapping, total) if ready.first == 0 and total == end else (
                slot_mapping[ready.first:end], ready.moved)
        mem_idx = _token_runs(ready, n)
    except Exception:  # not a 1-D tensor, or too short: the full path names it
        return False
    try:
        if ready.to_paged:
            pd.transfer_kv_all_layer(ready.mem, ready.paged, mem_idx, slots, src_layout=ready.mem_layout,
                                     dst_layout=ready.paged_layout, max_ctas=_MAX_CTAS, backend="kernel",
                                     validate_indices="host")
        else:
            pd.transfer_kv_all_layer(ready.paged, ready.mem, slots, mem_idx, src_layout=ready.paged_layout,
                                     dst_layout=ready.mem_layout, max_ctas=_MAX_CTAS, backend="kernel",
                                     validate_indices="host")
    except (IndexValidationError, ClosedError):  # refused before writing: the full path
        return False
    return True


def _remember_ready(key: tuple[object, ...] | None, ready: _Ready) -> None:
    if key is not None:
        with _lock:
            _raw.remember(_ready, key, ready, _READY_MAX)


#: the same prepared calls by their arguments' identity (:class:`pointerdomain.compat._raw.Seen`):
#: the first look-up of a repeat, before the memory-keyed one above
_seen: OrderedDict[tuple[object, ...], _raw.Seen] = _raw.owned_cache()


def _replay(fast: tuple[object, ...], tensors: tuple[object, object], slot_mapping: object) -> bool:
    """The prepared call kept under ``fast`` launched, when ``tensors`` (the memory object and
    the pointer table or cache) are still what it was made from; False otherwise (the caller
    takes its keyed path)."""
    try:
        entry = _seen.get(fast)
        if entry is None or not _raw.seen_again(entry, tensors):  # type: ignore[arg-type]
            return False
    except Exception:  # an unhashable argument: the full path names it
        return False
    return _launch_ready(entry.value, slot_mapping)  # type: ignore[arg-type]


def _remember_seen(fast: tuple[object, ...], tensors: tuple[object, object], tables: tuple[bool, bool],
                   ready: _Ready, *, again: bool = False) -> None:
    """Keep a prepared call for :func:`_replay`; ``again`` (after a memory-keyed hit): only
    for objects met again (:func:`pointerdomain.compat._raw.met_again`; views made anew per
    call would churn)."""
    if again and not _raw.met_again(tensors, ready.held, ready.last):
        return
    _raw.remember_seen(_seen, fast, tensors, tables, ready)  # type: ignore[arg-type]


def _memory_object(key_value: object, kv_size: int) -> torch.Tensor:
    kv = _contiguous("key_value", _tensor("key_value", key_value))
    if kv.dim() != 4 or kv.shape[0] != kv_size:
        raise LayoutError(
            f"key_value: shape {tuple(kv.shape)}, expected [{kv_size}, num_layers, num_tokens, item] "
            f"({'MLA / fused K|V: 1' if kv_size == 1 else 'K and V: 2'} leading)")
    if kv.shape[1] == 0 or kv.shape[3] == 0:
        raise LayoutError(f"key_value: shape {tuple(kv.shape)} has no layers or an empty item")
    return kv


# -- the ops ---------------------------------------------------------------------------------

def multi_layer_kv_transfer(
    key_value: torch.Tensor,
    key_value_ptrs: torch.Tensor,
    slot_mapping: torch.Tensor,
    paged_memory_device: torch.device | str | Device,
    page_buffer_size: int,
    direction: SupportsIndex,
    engine_kv_format: SupportsIndex,
    block_size: int = 0,
    head_size: int = 0,
    skip_prefix_n_tokens: int = 0,
) -> None:
    """Move tokens of every layer between a memory object and the per-layer paged caches.

    Token ``t`` in ``[skip_prefix_n_tokens, T)`` of ``key_value`` ``[kv, L, T, E]`` <-> slot
    ``slot_mapping[t]`` of layer ``l``'s cache at ``key_value_ptrs[l]`` (format: module docstring);
    a negative slot skips its token.

    Args:
        key_value: the memory object, contiguous, device memory of ``paged_memory_device`` or
            registered / runtime-pinned host memory; any dtype (``E`` elements per token item).
        key_value_ptrs: ``[L]`` int64 (or uint64) ``data_ptr()`` of each layer's cache, on the CPU
            or the device.
        slot_mapping: int64 ``[>= T]`` slots (``== T`` in the legacy shape), CPU or the device.
        paged_memory_device: the caches' device (``torch.device``, ``"cuda:0"``, a Device;
            ``cpu`` is the emulated device 0).
        page_buffer_size: ``NB * BS`` token slots per layer (0: MLA and block formats take the
            capacity from the allocation, see the module docstring).
        direction: 0 / False (H2D: memory object -> caches) or 1 / True (D2H).
        engine_kv_format: an :data:`MULTI_LAYER_FORMATS` value, or a bool: the legacy ``use_mla``.
        block_size, head_size: ``BS`` slots per block and ``HS`` elements per head, where the
            format needs them (0: not given).
        skip_prefix_n_tokens: tokens at the start of ``key_value`` left alone.

    Raises:
        InvalidTypeError: a non-tensor, a non-int size, a direction or format that is no integer.
        InvalidArgumentError: an unknown or unsupported format, a direction other than 0/1, a
            negative size, a missing block_size / head_size / page_buffer_size, a page_buffer_size
            that is not whole blocks in a format addressed by blocks (2, 6, 7, 10; formats 0, 1
            and 3 never read block_size, and upstream checks no divisibility there, so any
            block_size > 0 is taken, and MLA's is not read at all), current-shape arguments with
            the legacy shape.
        LayoutError: a memory object of the wrong shape, ``key_value_ptrs`` not ``[L]``, a head_size
            that does not divide the item.
        NonContiguousError: a strided memory object.
        IndexValidationError: slot_mapping of the wrong dtype, shape or length, a slot >= the
            capacity, a skip past the tokens.
        DeviceMismatchError: memory or slots of another device.
        DomainError: a ``key_value_ptrs`` entry in host memory; an unregistered host memory object.
        NotRegisteredError, ClosedError, RegistrationSpanError: a ``key_value_ptrs`` entry in no
            known allocation, in a closed registration, or reaching past its allocation.
        Everything :func:`pointerdomain.transfer_kv_all_layer` raises.
    """
    # the scalars with their types: 1, True and D2H are one direction here, 1.0 is refused
    scalars = (paged_memory_device, page_buffer_size, direction, type(direction), engine_kv_format,
               type(engine_kv_format), block_size, head_size, skip_prefix_n_tokens)
    plain = type(page_buffer_size) is type(block_size) is type(head_size) is type(skip_prefix_n_tokens) is int
    fast = ("multi", id(key_value), id(key_value_ptrs), scalars)
    if plain and _replay(fast, (key_value, key_value_ptrs), slot_mapping):
        return
    key: tuple[object, ...] | None
    try:
        key = ("multi", view_key(key_value), table_key(key_value_ptrs), scalars)
        hit = _ready.get(key)
    except Exception:  # not plain tensors, an inference-mode table: the full path
        key = hit = None
    if hit is not None and plain and _launch_ready(hit, slot_mapping):
        _remember_seen(fast, (key_value, key_value_ptrs), (False, True), hit, again=True)
        return
    device = _launch_device(paged_memory_device)
    to_paged = _to_paged(direction)
    capacity = _count("page_buffer_size", page_buffer_size)
    bs, hs = _count("block_size", block_size), _count("head_size", head_size)
    skip = _count("skip_prefix_n_tokens", skip_prefix_n_tokens)
    legacy = isinstance(engine_kv_format, bool)
    if isinstance(engine_kv_format, bool):  # the legacy use_mla
        fmt = F.NL_X_NB_BS_HS if engine_kv_format else F.NL_X_TWO_NB_BS_NH_HS
        if bs or hs or skip:
            raise InvalidArgumentError(
                "block_size / head_size / skip_prefix_n_tokens: given with the legacy call shape (a bool use_mla); "
                "pass an EngineKVFormat value instead")
        if fmt == F.NL_X_TWO_NB_BS_NH_HS:
            bs = 1  # the legacy kernel addresses flat slots: any block size is the same
    else:
        fmt = _format(engine_kv_format, MULTI_LAYER_FORMATS, "multi_layer_kv_transfer")
    kv_size = 1 if fmt in _MLA or fmt == F.NL_X_NB_NH_BS_TWO_HS else 2
    kv = _memory_object(key_value, kv_size)
    num_layers, num_tokens, item = (int(n) for n in kv.shape[1:])
    es = kv.element_size()
    _check_block_args(fmt, capacity, bs, item, hs)
    slots = _host_slots("slot_mapping", slot_mapping, device)
    if legacy and slots.numel() != num_tokens:
        raise IndexValidationError(
            f"slot_mapping: {slots.numel()} slots for the {num_tokens} tokens of key_value; the legacy kernel "
            "needs one slot per token (it strides the memory object by the slot count)")
    if slots.numel() < num_tokens:
        raise IndexValidationError(f"slot_mapping: {slots.numel()} slots for the {num_tokens} tokens of key_value")
    if skip > num_tokens:
        raise IndexValidationError(f"skip_prefix_n_tokens: {skip} past the {num_tokens} tokens of key_value")
    block = bs if fmt not in _MLA and fmt not in (F.NB_NL_TWO_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS) else 0
    table, capacity = _raw_layers("key_value_ptrs", key_value_ptrs, num_layers, device, kv_size * item * es,
                                  capacity, block)
    g = _paged_geometry(fmt, item, capacity, bs, hs)
    paged = _paged_table("key_value_ptrs", table, tuple(b * es for b in g.kv_base), g.runs * g.run * es)
    mem = _raw.tensor_table("key_value", [kv], device)
    mem_layout = _layout(kv_size, num_layers, num_tokens * g.heads, g.run * es)
    paged_layout = _layout(kv_size, num_layers, g.runs, g.run * es)
    ptr_names = ("key_value_ptrs[{}]",) if len(g.kv_base) == 1 else ("key_value_ptrs[{}] (K)", "key_value_ptrs[{}] (V)")
    _apart(mem, mem_layout, ("key_value",), paged, paged_layout, ptr_names, to_paged,
           _alternating(g, es) if to_paged else None)
    pairs = _pairs(slots[skip:num_tokens], skip, capacity, g.heads, g)
    if pairs is not None:
        _launch(mem, mem_layout, paged, paged_layout, pairs, to_paged, device)
    if g.heads == 1 and not g.block and _keyed_device(paged_memory_device) and key is not None:
        ready = _Ready(held(key_value, key_value_ptrs), mem, mem_layout, paged, paged_layout, to_paged, {}, skip,
                       num_tokens - skip, legacy, num_tokens, device, [()])
        _remember_ready(key, ready)
        _remember_seen(fast, (key_value, key_value_ptrs), (False, True), ready)


def multi_layer_kv_transfer_unilateral(
    key_value: torch.Tensor,
    key_value_ptrs: torch.Tensor,
    slot_mapping: torch.Tensor,
    paged_memory_device: torch.device | str | Device,
    page_buffer_size: int,
    direction: SupportsIndex,
    engine_kv_format: SupportsIndex,
) -> None:
    """SGLang's separate K and V buffers: token ``t`` of ``key_value`` ``[2, L, T, E]`` <-> row
    ``slot_mapping[t]`` of ``K_l`` = ``key_value_ptrs[l]`` and ``V_l`` = ``key_value_ptrs[L + l]``
    (each ``[P, E]``). An MLA format (3, 5; legacy ``use_mla`` True) is
    :func:`multi_layer_kv_transfer` instead (upstream falls back to it); any other format value
    is this layout (upstream looks only at ``is_mla``).

    Args and errors as :func:`multi_layer_kv_transfer` (``key_value_ptrs``: ``[2L]``;
    ``slot_mapping``: exactly ``T`` slots, upstream's token stride; ``page_buffer_size`` 0: the
    capacity of the smallest allocation).
    """
    device = _launch_device(paged_memory_device)
    if isinstance(engine_kv_format, bool):
        mla = engine_kv_format
    else:
        mla = _format(engine_kv_format, frozenset(EngineKVFormat), "multi_layer_kv_transfer_unilateral") in _MLA
    if mla:
        multi_layer_kv_transfer(key_value, key_value_ptrs, slot_mapping, paged_memory_device, page_buffer_size,
                                direction, engine_kv_format)
        return
    to_paged = _to_paged(direction)
    capacity = _count("page_buffer_size", page_buffer_size)
    kv = _memory_object(key_value, 2)
    num_layers, num_tokens, item = (int(n) for n in kv.shape[1:])
    es = kv.element_size()
    slots = _host_slots("slot_mapping", slot_mapping, device)
    if slots.numel() != num_tokens:
        raise IndexValidationError(
            f"slot_mapping: {slots.numel()} slots for the {num_tokens} tokens of key_value; the kernel needs one "
            "slot per token (it strides the memory object by the slot count)")
    table, capacity = _raw_layers("key_value_ptrs", key_value_ptrs, 2 * num_layers, device, item * es, capacity, 0)
    g = _Paged(2, item, 1, (0,), capacity, 0, 0, 0)
    paged = _paged_table("key_value_ptrs", table, (0,), capacity * item * es)
    mem = _raw.tensor_table("key_value", [kv], device)
    mem_layout, paged_layout = _layout(2, num_layers, num_tokens, item * es), _layout(2, num_layers, capacity, item * es)
    _apart(mem, mem_layout, ("key_value",), paged, paged_layout, ("key_value_ptrs[{}]",), to_paged)
    pairs = _pairs(slots, 0, capacity, 1, g)
    if pairs is None:
        return
    _launch(mem, mem_layout, paged, paged_layout, pairs, to_paged, device)


def _single_layer_shape(fmt: EngineKVFormat, cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(NB, BS, NH, HS) of one layer's cache in ``fmt``."""
    want = {
        F.NL_X_NB_BS_HS: "[NB, BS, HS]",
        F.NL_X_TWO_NB_BS_NH_HS: "[2, NB, BS, NH, HS]",
        F.NL_X_NB_TWO_BS_NH_HS: "[NB, 2, BS, NH, HS]",
        F.NL_X_TWO_NB_NH_BS_HS: "[2, NB, NH, BS, HS]",
        F.NL_X_NB_TWO_NH_BS_HS: "[NB, 2, NH, BS, HS]",
    }[fmt]
    shape = tuple(int(n) for n in cache.shape)
    ok = len(shape) == (3 if fmt == F.NL_X_NB_BS_HS else 5) and all(shape)
    if ok and fmt in (F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS):
        ok = shape[0] == 2
    if ok and fmt in (F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS):
        ok = shape[1] == 2
    if not ok:
        raise LayoutError(f"vllm_key_value_cache: shape {shape}, expected {want} for {fmt.name}")
    if fmt == F.NL_X_NB_BS_HS:
        return shape[0], shape[1], 1, shape[2]
    if fmt == F.NL_X_TWO_NB_BS_NH_HS:
        return shape[1], shape[2], shape[3], shape[4]
    if fmt == F.NL_X_NB_TWO_BS_NH_HS:
        return shape[0], shape[2], shape[3], shape[4]
    if fmt == F.NL_X_TWO_NB_NH_BS_HS:
        return shape[1], shape[3], shape[2], shape[4]
    return shape[0], shape[3], shape[2], shape[4]


def single_layer_kv_transfer(
    lmc_key_value_cache: torch.Tensor,
    vllm_key_value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    direction: SupportsIndex,
    engine_kv_format: SupportsIndex,
    token_major: bool | None = None,
) -> None:
    """Move the tokens of one layer: token ``t`` of ``lmc_key_value_cache`` <-> slot
    ``slot_mapping[t]`` of ``vllm_key_value_cache``; a negative slot skips its token.

    Args:
        lmc_key_value_cache: ``[T', 2, E]`` (token_major), ``[2, T', E]``, or ``[T', E]`` for MLA
            (``E = NH * HS``, ``T' >= len(slot_mapping)``), contiguous, the cache's dtype, device
            memory of the cache's device or registered / runtime-pinned host memory.
        vllm_key_value_cache: one layer of a :data:`SINGLE_LAYER_FORMATS` format (module
            docstring), contiguous device memory; the launch runs on its device.
        slot_mapping: int64 ``[T]``, CPU or that device.
        direction: 0 / False (H2D: lmc -> vllm) or 1 / True (D2H).
        engine_kv_format: the cache's format; or a bool: the legacy ``token_major``, and then
            ``token_major`` is the legacy ``vllm_two_major`` (True: format 1, False: format 2).
        token_major: the ``[T', 2, E]`` form (default False); legacy: ``vllm_two_major``, required.

    Raises:
        InvalidTypeError: a non-tensor, a flag that is no bool, a dtype that differs between the
            two buffers, a direction or format that is no integer.
        InvalidArgumentError: an unknown or unsupported format or direction, a legacy call
            without ``vllm_two_major``.
        LayoutError: a buffer of the wrong shape for the format.
        NonContiguousError: a strided buffer.
        IndexValidationError: slot_mapping of the wrong dtype or shape, more slots than buffer
            tokens, a slot >= ``NB * BS``.
        DomainError: the cache in host memory, an unregistered host buffer.
        DeviceMismatchError: memory or slots of another device.
        Everything :func:`pointerdomain.transfer_kv_all_layer` raises.
    """
    scalars = (direction, type(direction), engine_kv_format, type(engine_kv_format), token_major, type(token_major))
    fast = ("single", id(lmc_key_value_cache), id(vllm_key_value_cache), scalars)
    if _replay(fast, (lmc_key_value_cache, vllm_key_value_cache), slot_mapping):
        return
    key: tuple[object, ...] | None
    try:
        key = ("single", view_key(lmc_key_value_cache), view_key(vllm_key_value_cache), scalars)
        hit = _ready.get(key)
    except Exception:  # not plain tensors: the full path
        key = hit = None
    if hit is not None and _launch_ready(hit, slot_mapping):
        _remember_seen(fast, (lmc_key_value_cache, vllm_key_value_cache), (False, False), hit, again=True)
        return
    to_paged = _to_paged(direction)
    if isinstance(engine_kv_format, bool):
        major = engine_kv_format
        if token_major is None:
            raise InvalidArgumentError(
                "vllm_two_major: missing; the legacy call shape (a bool in place of engine_kv_format) is "
                "(lmc, vllm, slot_mapping, direction, token_major, vllm_two_major)")
        fmt = F.NL_X_TWO_NB_BS_NH_HS if _flag("vllm_two_major", token_major) else F.NL_X_NB_TWO_BS_NH_HS
    else:
        fmt = _format(engine_kv_format, SINGLE_LAYER_FORMATS, "single_layer_kv_transfer")
        major = False if token_major is None else _flag("token_major", token_major)
    cache = _contiguous("vllm_key_value_cache", _tensor("vllm_key_value_cache", vllm_key_value_cache))
    device = _device_tensor("vllm_key_value_cache", cache)
    blocks, bs, heads, hs = _single_layer_shape(fmt, cache)
    item, capacity, es = heads * hs, blocks * bs, cache.element_size()
    lmc = _contiguous("lmc_key_value_cache", _tensor("lmc_key_value_cache", lmc_key_value_cache))
    if lmc.dtype != cache.dtype:
        raise InvalidTypeError(f"lmc_key_value_cache: dtype {lmc.dtype}, the cache's is {cache.dtype}")
    mla = fmt == F.NL_X_NB_BS_HS
    shape = tuple(int(n) for n in lmc.shape)
    if mla:
        ok, want = len(shape) == 2 and shape[1] == item, f"[T, {item}]"
    elif major:
        ok, want = len(shape) == 3 and shape[1:] == (2, item), f"[T, 2, {item}]"
    else:
        ok, want = len(shape) == 3 and shape[0] == 2 and shape[2] == item, f"[2, T, {item}]"
    if not ok or 0 in shape:
        raise LayoutError(f"lmc_key_value_cache: shape {shape}, expected {want} for {fmt.name}")
    buffered = shape[1] if not mla and not major else shape[0]
    slots = _host_slots("slot_mapping", slot_mapping, device)
    if slots.numel() > buffered:
        raise IndexValidationError(f"slot_mapping: {slots.numel()} slots, lmc_key_value_cache holds {buffered} tokens")
    g = _paged_geometry(fmt, item, capacity, bs, hs)
    paged = _raw.tensor_table("vllm_key_value_cache", _byte_slices(cache, [b * es for b in g.kv_base],
                                                                   g.runs * g.run * es), device)
    paged_rows = _alternating(g, es)  # K and V blocks alternate in the cache
    allow_interleaved(paged, paged_rows)
    mem_rows = None
    if mla or not major:
        mem_runs, tok_runs = buffered * g.heads, g.heads
        mem = _raw.tensor_table("lmc_key_value_cache", [lmc], device)
    else:  # [T', 2, E]: K and V entries one item apart, tokens two items apart
        mem_runs, tok_runs = (2 * buffered - 1) * g.heads, 2 * g.heads
        mem = _raw.tensor_table("lmc_key_value_cache", _byte_slices(lmc, [0, item * es], mem_runs * g.run * es),
                                device)
        mem_rows = (2 * item * es, item * es)  # K and V of a token side by side
        allow_interleaved(mem, mem_rows)
    pairs = _pairs(slots, 0, capacity, tok_runs, g)
    run_bytes = g.run * es
    mem_layout, paged_layout = _layout(g.kv_size, 1, mem_runs, run_bytes), _layout(g.kv_size, 1, g.runs, run_bytes)
    _apart(mem, mem_layout, ("lmc_key_value_cache",), paged, paged_layout, ("vllm_key_value_cache",), to_paged,
           paged_rows if to_paged else mem_rows)
    if pairs is not None:
        _launch(mem, mem_layout, paged, paged_layout, pairs, to_paged, device)
    if tok_runs == 1 and not g.block and key is not None:
        ready = _Ready(held(lmc_key_value_cache, vllm_key_value_cache), mem, mem_layout, paged, paged_layout, to_paged,
                       {}, 0, None, False, buffered, device, [()])
        _remember_ready(key, ready)
        _remember_seen(fast, (lmc_key_value_cache, vllm_key_value_cache), (False, False), ready)


def _flash(key_value: object, key_cache: object, value_cache: object, slot_mapping: object, layer_idx: object,
           to_paged: bool) -> None:
    k = _contiguous("key_cache", _tensor("key_cache", key_cache))
    v = _contiguous("value_cache", _tensor("value_cache", value_cache))
    if k.dim() != 4 or 0 in k.shape:
        raise LayoutError(f"key_cache: shape {tuple(k.shape)}, expected [num_blocks, block_size, num_heads, head_size]")
    if v.shape != k.shape or v.dtype != k.dtype:
        raise LayoutError(f"value_cache: {tuple(v.shape)} {v.dtype}, key_cache is {tuple(k.shape)} {k.dtype}")
    device = _device_tensor("key_cache", k)
    _same_device("value_cache", v, device)
    blocks, bs, heads, hs = (int(n) for n in k.shape)
    item, capacity, es = heads * hs, blocks * bs, k.element_size()
    kv = _contiguous("key_value", _tensor("key_value", key_value))
    if kv.dtype != k.dtype:
        raise InvalidTypeError(f"key_value: dtype {kv.dtype}, the caches' is {k.dtype}")
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[3] != item or kv.shape[1] == 0:
        raise LayoutError(f"key_value: shape {tuple(kv.shape)}, expected [2, num_layers, num_tokens, {item}]")
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise InvalidTypeError(f"layer_idx: found {describe(layer_idx)} ({type(layer_idx).__name__}), expected an int")
    if not 0 <= layer_idx < kv.shape[1]:
        raise IndexValidationError(f"layer_idx: {layer_idx} outside [0, {kv.shape[1]}) (key_value's layers)")
    num_tokens = int(kv.shape[2])
    slots = _host_slots("slot_mapping", slot_mapping, device)
    if slots.numel() > num_tokens:
        raise IndexValidationError(f"slot_mapping: {slots.numel()} slots, key_value holds {num_tokens} tokens")
    g = _Paged(2, item, 1, (0,), capacity, 0, 0, 0)
    paged = _raw.tensor_table("key_cache, value_cache", [k, v], device)
    mem = _raw.tensor_table("key_value", [kv[0, layer_idx], kv[1, layer_idx]], device)
    mem_layout, paged_layout = _layout(2, 1, num_tokens, item * es), _layout(2, 1, capacity, item * es)
    _apart(mem, mem_layout, ("key_value",), paged, paged_layout, ("key_cache", "value_cache"), to_paged)
    pairs = _pairs(slots, 0, capacity, 1, g)
    if pairs is None:
        return
    _launch(mem, mem_layout, paged, paged_layout, pairs, to_paged, device)


def load_and_reshape_flash(key_value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, layer_idx: int) -> None:
    """D2H for one layer: ``key_value[0 / 1, layer_idx, t]`` = token slot ``slot_mapping[t]`` of
    ``key_cache`` / ``value_cache`` (``[NB, BS, NH, HS]``, contiguous device memory); a negative
    slot skips its token.

    Args:
        key_value: ``[2, L, T, NH * HS]`` contiguous, the caches' dtype, ``T >= len(slot_mapping)``.
        key_cache, value_cache: one layer's K and V caches, same shape, dtype and device.
        slot_mapping: int64 ``[n]``, CPU or that device.
        layer_idx: the layer of ``key_value``.

    Raises:
        PointerDomainError: as :func:`single_layer_kv_transfer` (InvalidTypeError, LayoutError,
            NonContiguousError, IndexValidationError, DomainError, DeviceMismatchError;
            ``layer_idx`` outside ``[0, L)``: IndexValidationError); everything
            :func:`pointerdomain.transfer_kv_all_layer` raises.
    """
    _flash(key_value, key_cache, value_cache, slot_mapping, layer_idx, to_paged=False)


def reshape_and_cache_back_flash(key_value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, layer_idx: int) -> None:
    """H2D for one layer, the reverse of :func:`load_and_reshape_flash` (same arguments and errors)."""
    _flash(key_value, key_cache, value_cache, slot_mapping, layer_idx, to_paged=True)
