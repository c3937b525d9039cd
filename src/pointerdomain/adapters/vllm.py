"""vLLM-style block offload: per-block address arrays for a batch copy, from typed tables.

vLLM's CPU offloading worker computes, for every KV tensor and every block to
move, ``tensor.data_ptr() + block_id * page_size_bytes`` on both sides and hands
the three arrays to one batch copy (``ops.swap_blocks_batch(src, dst, sizes)``,
which issues ``cudaMemcpyBatchAsync``). A batch DMA descriptor is not
translated by the runtime: a host address in it must be the **device alias**
of registered memory, which ``data_ptr()`` of a host tensor is not where
``CanUseHostPointerForRegisteredMem`` is 0.

Here the arrays are computed from two ``PointerTable[DeviceAlias]`` (GPU
tensors and registered CPU tensors, same entry order), so only aliases reach
the copy call:

* :func:`block_copy_batch` -- the typed function: tables + block ids ->
  :class:`BlockCopyBatch` (``uint64`` address arrays, ``int64`` sizes);
* :class:`CpuGpuBlockOffload` -- the tables of one offload pair (GPU and CPU
  tensors, block-major) with ``store`` (GPU->CPU) and ``load`` (CPU->GPU);
* :func:`run_batch_copy` -- hands a batch to a copy function shaped like
  ``swap_blocks_batch(src_ptrs, dst_ptrs, sizes)``.

Tensors are *block-major*: dimension 0 is the block, so block ``b`` of entry
``t`` is the ``block_bytes[t]`` bytes at ``b * block_bytes[t]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import cast

import torch
from typing_extensions import final

from pointerdomain.arguments import describe
from pointerdomain import Device, DeviceAlias, PointerTable, index_tensor, require_domain, validate_device
from pointerdomain.adapters.sglang import make_kernel_ptr_table
from pointerdomain.process_local import ProcessLocal
from pointerdomain.errors import (
    DeviceMismatchError,
    DomainError,
    IndexValidationError,
    InvalidTypeError,
    LayoutError,
    OverlapError,
)

__all__ = ["BatchCopyFn", "BlockCopyBatch", "CpuGpuBlockOffload", "block_copy_batch", "run_batch_copy"]

#: A batch copy shaped like vLLM's ``ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes)``:
#: ``src_ptrs`` / ``dst_ptrs`` ``uint64 [N]`` device aliases, ``sizes`` ``int64 [N]`` bytes,
#: all CPU tensors. (For an op that insists on ``int64`` pointers, pass
#: ``src_ptrs.view(torch.int64)``: same bits.)
BatchCopyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

_INT64_MAX = (1 << 63) - 1
_FLIP = -(1 << 63)  # xor with this: uint64 bit patterns in int64 keep their unsigned order


@final
class _BatchToken:
    """Private type of :class:`BlockCopyBatch`'s ``token``: only :func:`block_copy_batch`
    holds one, so a hand-built batch (e.g. of host VAs) is a static and a runtime error."""

    __slots__ = ()


_BATCH_TOKEN = _BatchToken()


@final
@dataclass(frozen=True)
class BlockCopyBatch:
    """The descriptors of one batch copy: ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]``.

    Attributes:
        src_ptrs: ``uint64 [N]`` CPU tensor of source :class:`DeviceAlias` values.
        dst_ptrs: ``uint64 [N]`` CPU tensor of destination :class:`DeviceAlias` values.
        sizes: ``int64 [N]`` CPU tensor, bytes per copy.
        device: the device whose aliases these are (the copy runs there).

    Order: entry-major (all blocks of table entry 0, then entry 1, ...), as vLLM
    orders its copies per KV tensor. The batch keeps its tables alive, so the
    addresses stay valid while it exists.

    Built only by :func:`block_copy_batch` (and :class:`CpuGpuBlockOffload`): the
    constructor's keyword ``token`` is of a private type, so a hand-built batch is a
    static error and :class:`~pointerdomain.errors.DomainError` at run time
    (``dataclasses.replace`` cannot pass the token either: ``ValueError``).
    """

    src_ptrs: torch.Tensor
    dst_ptrs: torch.Tensor
    sizes: torch.Tensor
    device: Device
    _tables: tuple[PointerTable[DeviceAlias], ...] = field(repr=False, compare=False)
    _: KW_ONLY
    token: InitVar[_BatchToken]

    def __post_init__(self, token: _BatchToken) -> None:
        if token is not _BATCH_TOKEN:
            raise DomainError(
                "BlockCopyBatch: build batches with block_copy_batch() or CpuGpuBlockOffload.store()/load(), "
                "which compute the descriptors from kernel tables; a hand-built batch could hold host VAs"
            )

    @property
    def num_ops(self) -> int:
        """Number of copies ``N``."""
        return int(self.sizes.numel())

    @property
    def total_bytes(self) -> int:
        """Bytes moved by the batch."""
        return int(self.sizes.sum()) if self.num_ops else 0

    def src_aliases(self) -> list[DeviceAlias]:
        """The source addresses, typed."""
        return [DeviceAlias.unsafe_from_int(v, self.device) for v in self.src_ptrs.tolist()]

    def dst_aliases(self) -> list[DeviceAlias]:
        """The destination addresses, typed."""
        return [DeviceAlias.unsafe_from_int(v, self.device) for v in self.dst_ptrs.tolist()]

    def check_live(self) -> None:
        """Raises:
        ClosedError: registered memory behind the batch was closed, or was registered
            before this process forked from its parent (none of this runtime's)."""
        for table in self._tables:
            table.check_live()
            table.check_this_process()


def _per_entry(name: str, block_bytes: int | Sequence[int], n: int) -> list[int]:
    values = [block_bytes] * n if isinstance(block_bytes, int) else list(block_bytes)
    if len(values) != n:
        raise LayoutError(f"{name}: {len(values)} block sizes for {n} table entries")
    for v in values:
        if type(v) is not int or v <= 0:
            raise LayoutError(f"{name}: block sizes must be positive ints (bytes), got {describe(v)}")
    return values


def _addresses(table: PointerTable[DeviceAlias], ids: torch.Tensor, block_bytes: list[int], side: str) -> torch.Tensor:
    """``uint64 [len(table) * len(ids)]``: entry-major ``table[t] + ids * block_bytes[t]``."""
    n = ids.numel()
    parts: list[torch.Tensor] = []
    for t in range(len(table)):
        blocks = table.sizes[t] // block_bytes[t]
        if n:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= blocks:
                raise IndexValidationError(
                    f"{side}_block_ids: block {lo if lo < 0 else hi} outside [0, {blocks}) of entry {t} "
                    f"({table.sizes[t]} bytes / {block_bytes[t]} per block); nothing was built"
                )
        base = table[t].value
        if base + blocks * block_bytes[t] <= _INT64_MAX:
            parts.append((ids * block_bytes[t] + base).view(torch.uint64))
        else:  # aliases above 2**63 (not seen on x86-64 or current GPUs): exact Python ints
            parts.append(torch.tensor([base + b * block_bytes[t] for b in ids.tolist()], dtype=torch.uint64))
    if not parts:
        return torch.empty(0, dtype=torch.uint64)
    return torch.cat(parts)


def _where(i: int, n: int, side: str) -> str:
    """Copy ``i`` of an entry-major batch of ``n`` pairs per entry, named by its argument."""
    return f"{side}_block_ids[{i % n}] of entry {i // n}"


def _first(mask: torch.Tensor) -> int | None:
    hits = mask.nonzero()
    return int(hits[0]) if hits.numel() else None


def _check_overlap(
    src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor, n: int, names: tuple[str, str]
) -> None:
    """Refuse a batch where a destination block meets another destination block or any
    source block (the copies of a batch run in no defined order; sources may share bytes)."""
    if sizes.numel() == 0:
        return
    last = sizes - 1  # inclusive ends: memory may end at 2**64
    d_lo = dst_ptrs.view(torch.int64) ^ _FLIP
    d_hi = d_lo + last
    order = torch.argsort(d_lo)
    reach, holder = torch.cummax(d_hi[order], dim=0)
    j = _first(d_lo[order][1:] <= reach[:-1])
    if j is not None:
        a, b = sorted((int(order[j + 1]), int(order[int(holder[j])])))
        raise OverlapError(
            f"{_where(a, n, names[1])} and {_where(b, n, names[1])} write the same bytes: the copies of a batch run in no "
            "defined order, so the result would depend on it; nothing was built. Fix: give each destination block once"
        )
    s_lo = src_ptrs.view(torch.int64) ^ _FLIP
    s_order = torch.argsort(s_lo)
    s_sorted = s_lo[s_order]
    s_reach, s_holder = torch.cummax((s_lo + last)[s_order], dim=0)
    k = torch.searchsorted(s_sorted, d_hi, right=True)  # sources starting at or before each destination's end
    prev = (k - 1).clamp(min=0)
    i = _first((k > 0) & (s_reach[prev] >= d_lo))
    if i is not None:
        other = int(s_order[int(s_holder[int(prev[i])])])
        raise OverlapError(
            f"{_where(i, n, names[1])} shares bytes with {_where(other, n, names[0])}: a copy would read bytes the batch "
            "writes, in no defined order; nothing was built. Fix: copy between blocks that do not share memory"
        )


def _spans_meet(src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias]) -> bool:
    """Whether a destination entry's whole span meets another destination entry's or any
    source entry's span (sorted sweep over the tables' entries)."""
    spans = sorted([(dst[t].value, dst.sizes[t], True) for t in range(len(dst))]
                   + [(src[t].value, src.sizes[t], False) for t in range(len(src))])
    end_any = end_dst = -1
    for start, n, is_dst in spans:
        if start < (end_any if is_dst else end_dst):
            return True
        end_any = max(end_any, start + n)
        if is_dst:
            end_dst = max(end_dst, start + n)
    return False


def _check_destinations(
    src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], d_ids: torch.Tensor, src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor, sizes: torch.Tensor, names: tuple[str, str],
) -> None:
    """Refuse a batch whose copies meet (see :func:`_check_overlap`). Where no destination
    entry's span meets another entry's (the usual GPU / CPU pair), two copies meet only
    through a destination block id given twice: checked on the ids, not per copy."""
    n = d_ids.numel()
    if n == 0:
        return
    if _spans_meet(src, dst):
        _check_overlap(src_ptrs, dst_ptrs, sizes, n, names)
        return
    ordered, order = torch.sort(d_ids, stable=True)
    j = _first(ordered[1:] == ordered[:-1])
    if j is not None:
        a, b = int(order[j]), int(order[j + 1])
        raise OverlapError(
            f"{_where(a, n, names[1])} and {_where(b, n, names[1])} write the same bytes (block "
            f"{int(ordered[j])}, in every entry): the copies of a batch run in no defined order, so the result "
            "would depend on it; nothing was built. Fix: give each destination block once"
        )


def block_copy_batch(
    src: PointerTable[DeviceAlias],
    dst: PointerTable[DeviceAlias],
    src_block_ids: torch.Tensor | Sequence[int],
    dst_block_ids: torch.Tensor | Sequence[int],
    *,
    block_bytes: int | Sequence[int],
) -> BlockCopyBatch:
    """Per-block source/destination aliases for one batch copy.

    For every table entry ``t`` (outer) and pair ``i`` (inner), one copy of
    ``block_bytes[t]`` bytes from ``src[t] + src_block_ids[i] * block_bytes[t]`` to
    ``dst[t] + dst_block_ids[i] * block_bytes[t]``.

    Args:
        src, dst: kernel tables of the same device and length, entry ``t`` of
            both being the same KV tensor (e.g. layer) on each side.
        src_block_ids, dst_block_ids: block numbers, ``int`` 1-D, equal length.
        block_bytes: bytes of one block, per entry or one for all.

    Returns:
        :class:`BlockCopyBatch` with ``N = len(src) * len(src_block_ids)`` copies.

    Raises:
        DomainError: a table is not a ``PointerTable[DeviceAlias]`` (a host table
            would put host VAs in DMA descriptors).
        DeviceMismatchError: the tables are for different devices.
        ClosedError: a table's registered memory was closed.
        LayoutError: tables of different lengths, or bad ``block_bytes``.
        IndexValidationError: id lists of different lengths or shapes, or a block
            past an entry's end.
        OverlapError: two copies write the same bytes (a destination block given
            twice), or a copy writes bytes another copy reads; nothing is built.
    """
    return _block_copy_batch(src, dst, src_block_ids, dst_block_ids, block_bytes, ("src", "dst"))


def _block_copy_batch(
    src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], src_block_ids: torch.Tensor | Sequence[int],
    dst_block_ids: torch.Tensor | Sequence[int], block_bytes: int | Sequence[int], names: tuple[str, str],
) -> BlockCopyBatch:
    """:func:`block_copy_batch`, naming the id arguments ``names`` in overlap errors."""
    s = _kernel_table("src", src)
    d = _kernel_table("dst", dst)
    device = _same_device("block_copy_batch", s.device, d.device)
    if len(s) != len(d):
        raise LayoutError(f"src has {len(s)} entries but dst has {len(d)}; entry t must be the same tensor on both sides")
    sizes_per_entry = _per_entry("block_bytes", block_bytes, len(s))
    s_ids = index_tensor("src_block_ids", src_block_ids)
    d_ids = index_tensor("dst_block_ids", dst_block_ids)
    if s_ids.numel() != d_ids.numel():
        raise IndexValidationError(f"src_block_ids has {s_ids.numel()} blocks but dst_block_ids has {d_ids.numel()}")
    src_ptrs = _addresses(s, s_ids, sizes_per_entry, "src")
    dst_ptrs = _addresses(d, d_ids, sizes_per_entry, "dst")
    sizes = torch.tensor(sizes_per_entry, dtype=torch.int64).repeat_interleave(s_ids.numel())
    _check_destinations(s, d, d_ids, src_ptrs, dst_ptrs, sizes, names)
    return BlockCopyBatch(src_ptrs, dst_ptrs, sizes, device, (s, d), token=_BATCH_TOKEN)


def _kernel_table(name: str, table: object) -> PointerTable[DeviceAlias]:
    checked = require_domain(name, table, DeviceAlias, "a batch copy",
                             "copy descriptors and kernels take device aliases, never host VAs; build it with "
                             "make_kernel_ptr_table")
    checked.check_live()
    checked.check_this_process()  # a fork child's runtime holds none of the parent's registrations
    return checked


def _same_device(name: str, a: Device | None, b: Device | None) -> Device:
    """The common device of two kernel tables.

    Raises:
        DomainError: a host table (no device).
        DeviceMismatchError: different devices.
    """
    if a is None or b is None:
        raise DomainError(f"{name}: a host table has no device")
    if a != b:
        raise DeviceMismatchError(f"{name}: tables for {a} and {b}; a batch copy runs on one device")
    return a


def run_batch_copy(batch: BlockCopyBatch, copy_fn: BatchCopyFn) -> int:
    """Check the batch's memory is still registered, then ``copy_fn(src_ptrs, dst_ptrs, sizes)``.

    Ordering is the copy function's (on CUDA: the current stream; order it after
    the producer and keep ``batch`` alive until the stream reaches it).

    Returns:
        Bytes handed to the copy (``batch.total_bytes``).

    Raises:
        DomainError: ``batch`` is not a :class:`BlockCopyBatch` (e.g. a look-alike object).
        ClosedError: registered memory behind the batch was closed.
    """
    if type(batch) is not BlockCopyBatch:
        raise DomainError(
            f"batch: found a {type(batch).__name__}, expected a BlockCopyBatch. Fix: build it with block_copy_batch()"
        )
    batch.check_live()
    if batch.num_ops:
        copy_fn(batch.src_ptrs, batch.dst_ptrs, batch.sizes)
    return batch.total_bytes


def _block_bytes(name: str, tensors: Sequence[torch.Tensor]) -> list[int]:
    out: list[int] = []
    for i, t in enumerate(tensors):
        if t.dim() < 1 or t.shape[0] == 0:
            raise LayoutError(f"{name}[{i}]: shape {tuple(t.shape)}; expected block-major [num_blocks, ...]")
        out.append(t.nbytes // int(t.shape[0]))
    return out


class CpuGpuBlockOffload(ProcessLocal):
    """The typed tables of one vLLM offload pair: GPU KV tensors and their CPU copies.

    Args:
        gpu_tensors: block-major device tensors ``[num_gpu_blocks, ...]`` (one per
            layer / KV group), device memory of ``device``.
        cpu_tensors: block-major CPU tensors ``[num_cpu_blocks, ...]`` in the same
            order, in host memory registered for ``device``.
        device: the GPU (or ``"emulated:N"``).

    Attributes:
        gpu_table, cpu_table: ``PointerTable[DeviceAlias]`` of each side.
        block_bytes: bytes of one block of each entry (equal on both sides).

    Raises:
        LayoutError: different tensor counts, a non-block-major tensor, or block
            sizes that differ between the sides.
        DomainError: unregistered CPU memory, or host memory on the GPU side.
        DeviceMismatchError, NonContiguousError, InvalidDeviceError: as
            :func:`pointerdomain.make_kernel_ptr_table`.
    """

    def __init__(
        self, gpu_tensors: Sequence[torch.Tensor], cpu_tensors: Sequence[torch.Tensor], device: Device | str | torch.device
    ) -> None:
        for name, given in (("gpu_tensors", cast(object, gpu_tensors)), ("cpu_tensors", cast(object, cpu_tensors))):
            if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
                raise InvalidTypeError(
                    f"{name}: found a {'bare torch.Tensor' if isinstance(given, torch.Tensor) else type(given).__name__}"
                    ", expected a list of per-layer tensors. Fix: pass [tensor, ...]"
                )
        if len(gpu_tensors) != len(cpu_tensors) or not gpu_tensors:
            raise LayoutError(f"{len(gpu_tensors)} GPU tensors but {len(cpu_tensors)} CPU tensors; need a non-empty pair list")
        gpu_bytes = _block_bytes("gpu_tensors", gpu_tensors)
        cpu_bytes = _block_bytes("cpu_tensors", cpu_tensors)
        if gpu_bytes != cpu_bytes:
            raise LayoutError(f"block sizes differ: GPU {gpu_bytes} vs CPU {cpu_bytes} bytes")
        self.device: Device = validate_device(device)
        self.block_bytes: list[int] = gpu_bytes
        self.gpu_table: PointerTable[DeviceAlias] = make_kernel_ptr_table(
            gpu_tensors, self.device, host_memory_registered=False
        )
        self.cpu_table: PointerTable[DeviceAlias] = make_kernel_ptr_table(
            cpu_tensors, self.device, host_memory_registered=True
        )

    def store(self, gpu_block_ids: torch.Tensor | Sequence[int], cpu_block_ids: torch.Tensor | Sequence[int]) -> BlockCopyBatch:
        """GPU -> CPU: the batch copying ``gpu_block_ids[i]`` to ``cpu_block_ids[i]`` in every tensor.

        Raises:
            OverlapError: a CPU block given twice. Otherwise as :func:`block_copy_batch`.
        """
        return _block_copy_batch(self.gpu_table, self.cpu_table, gpu_block_ids, cpu_block_ids, self.block_bytes,
                                 ("gpu", "cpu"))

    def load(self, cpu_block_ids: torch.Tensor | Sequence[int], gpu_block_ids: torch.Tensor | Sequence[int]) -> BlockCopyBatch:
        """CPU -> GPU: the batch copying ``cpu_block_ids[i]`` to ``gpu_block_ids[i]`` in every tensor.

        Raises:
            OverlapError: a GPU block given twice. Otherwise as :func:`block_copy_batch`.
        """
        return _block_copy_batch(self.cpu_table, self.gpu_table, cpu_block_ids, gpu_block_ids, self.block_bytes,
                                 ("cpu", "gpu"))
