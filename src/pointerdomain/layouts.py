"""KV-cache layouts and the byte geometry the kernels use.

Terms (sglang / vLLM usage): a *page* is ``page_size`` consecutive token slots;
an *item* is one token's K (or V) for one layer, ``num_heads * head_dim`` elements.
MHA stores K and V (``num_kv`` = 2), MLA one latent buffer (``num_kv`` = 1,
``num_heads`` = 1, e.g. ``head_dim`` = 576: 512 latent + 64 rope, 1152 B in bf16).

One-buffer shapes (outermost first):

* ``layer_first``: ``[num_kv, num_layers, num_pages * page_size, num_heads, head_dim]``
* ``page_first``: ``[num_kv, num_pages * page_size, num_layers, num_heads, head_dim]``
* ``page_first_direct``: ``[num_kv, num_pages, num_layers, page_size, num_heads, head_dim]``
  (a page is contiguous across layers and tokens)

A pointer table may cover the buffer with 1 entry, or split it on its leading
dimensions: per kv (``num_kv`` entries), per kv and layer (``layer_first``,
e.g. a device pool's per-layer K/V tensors), or per kv and page (``page_first*``,
what a host pool registered in several chunks needs).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, TypedDict

import torch
from pydantic import ConfigDict, Field, model_validator
from typing_extensions import Unpack

from pointerdomain.errors import IndexValidationError, LayoutError
from pointerdomain.validated import ValidatedModel

__all__ = ["Geometry", "KVLayout", "KVLayoutChanges"]

LayoutKind = Literal["layer_first", "page_first", "page_first_direct"]
DType = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]

_DIM_ORDER: dict[str, tuple[str, ...]] = {
    "layer_first": ("kv", "layer", "page", "tok"),
    "page_first": ("kv", "page", "tok", "layer"),
    "page_first_direct": ("kv", "page", "layer", "tok"),
}

#: The one dtype table: KVLayout dtype names and the torch dtypes they stand for.
_DTYPES: dict[DType, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_NAMES: dict[torch.dtype, DType] = {dtype: name for name, dtype in _DTYPES.items()}

class Geometry(NamedTuple):
    """How the kernels address one table over a layout (``pd::Side`` in ``transfer.h``)::

        entry = kv*e_kv + layer*e_layer + page*e_page
        addr  = table[entry] + kv*s_kv + layer*s_layer + page*s_page + tok*s_tok

    Each dimension feeds either the entry (``e_*`` != 0: a leading dimension the table
    splits) or the byte offset (``s_*`` != 0). Strides in bytes; ``num_slots`` token slots.
    """

    e_kv: int
    e_layer: int
    e_page: int
    s_kv: int
    s_layer: int
    s_page: int
    s_tok: int
    num_slots: int

    @property
    def byte_strides(self) -> tuple[int, int, int, int]:
        """``(s_kv, s_layer, s_page, s_tok)``: the strides that add to an entry's address."""
        return (self.s_kv, self.s_layer, self.s_page, self.s_tok)


class KVLayoutChanges(TypedDict, total=False):
    """The fields :meth:`KVLayout.replace` may change, with their types (checked by mypy
    and pyright: a misspelt field or a wrong type is a static error)."""

    kind: LayoutKind
    attention: Literal["mha", "mla"]
    num_layers: int
    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: DType


class KVLayout(ValidatedModel, frozen=True):
    """A KV pool's layout: kind, shape and dtype. Frozen, strict, JSON-serialisable.

    Raises (on construction):
        pydantic.ValidationError: a non-positive size, unknown kind or dtype, or MLA
            with ``num_heads`` != 1.
    """

    model_config = ConfigDict(strict=True, extra="forbid")  # frozen: class keyword, seen by type checkers

    kind: LayoutKind
    attention: Literal["mha", "mla"] = "mha"
    num_layers: int = Field(gt=0)
    num_pages: int = Field(gt=0)
    page_size: int = Field(gt=0, description="tokens per page")
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype: DType = "bfloat16"

    @model_validator(mode="after")
    def _check(self) -> KVLayout:
        if self.attention == "mla" and self.num_heads != 1:
            raise ValueError("MLA stores one latent vector per token: num_heads must be 1")
        return self

    def replace(self, **changes: Unpack[KVLayoutChanges]) -> KVLayout:
        """A copy with ``changes`` applied, **validated** like a new layout, with field
        names and types checked by mypy and pyright (:class:`KVLayoutChanges`);
        pydantic's ``model_copy(update=...)`` takes an unchecked ``dict[str, Any]``.

        Raises:
            pydantic.ValidationError: a changed value is invalid (e.g. ``num_pages=0``),
                or an unknown field.
        """
        return type(self).model_validate({**self.model_dump(), **changes})

    @property
    def num_kv(self) -> int:
        """2 for MHA (K and V), 1 for MLA."""
        return 2 if self.attention == "mha" else 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @staticmethod
    def dtype_name(dtype: torch.dtype) -> DType:
        """The layout name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``).

        Raises:
            LayoutError: a dtype the kernels do not move.
        """
        try:
            return _NAMES[dtype]
        except KeyError:
            raise LayoutError(f"dtype {dtype} is not a KV dtype; expected one of {sorted(_DTYPES)}") from None

    @property
    def item_bytes(self) -> int:
        """Bytes of one (kv, layer, token) item: ``num_heads * head_dim * itemsize``."""
        return self.num_heads * self.head_dim * _DTYPES[self.dtype].itemsize

    @property
    def num_slots(self) -> int:
        """Token slots: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_kv * self.num_layers * self.num_slots * self.item_bytes

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        """Shape of the one-buffer form (element dtype :attr:`torch_dtype`)."""
        kv, n_l, n_p, ps, h, d = (self.num_kv, self.num_layers, self.num_pages, self.page_size,
                                  self.num_heads, self.head_dim)
        if self.kind == "layer_first":
            return (kv, n_l, n_p * ps, h, d)
        if self.kind == "page_first":
            return (kv, n_p * ps, n_l, h, d)
        return (kv, n_p, n_l, ps, h, d)

    @property
    def _dims(self) -> tuple[tuple[str, int, int], ...]:
        """(name, count, byte stride) per dimension, outermost first."""
        counts = {"kv": self.num_kv, "layer": self.num_layers, "page": self.num_pages, "tok": self.page_size}
        order = _DIM_ORDER[self.kind]
        dims: list[tuple[str, int, int]] = []
        stride = self.item_bytes
        for name in reversed(order):
            dims.append((name, counts[name], stride))
            stride *= counts[name]
        return tuple(reversed(dims))

    def table_splits(self) -> tuple[int, ...]:
        """Allowed table lengths, by how many leading dimensions the table covers
        (never the token dimension)."""
        lengths, n = [1], 1
        for name, count, _ in self._dims:
            if name == "tok":
                break
            n *= count
            lengths.append(n)
        return tuple(lengths)

    def page_block_bytes(self) -> int:
        """Bytes of one page's contiguous block (the page dimension's stride): the
        unit a chunked registration must cut on so no page spans two chunks."""
        return self._stride("page")

    def _stride(self, dim: str) -> int:
        return next(stride for name, _, stride in self._dims if name == dim)

    def split_for_page_blocks(self) -> int:
        """Table length when every entry is one :meth:`page_block_bytes` block."""
        return self.nbytes // self.page_block_bytes()

    def geometry(self, table_len: int, entry_sizes: tuple[int, ...], name: str) -> Geometry:
        """Kernel geometry for a table of ``table_len`` entries over this layout.

        Raises:
            LayoutError: the table length matches no split, or an entry's size is not
                exactly the block it must hold (smaller: the kernel would read past it;
                larger: the layout does not describe the buffer, e.g. too few pages).
        """
        splits = self.table_splits()
        if table_len not in splits:
            raise LayoutError(
                f"{name}: a table of {table_len} entries does not fit a {self.kind} layout "
                f"({self.attention}, {self.num_layers} layers, {self.num_pages} pages); allowed lengths {splits}"
            )
        k = splits.index(table_len)
        entry_bytes = self.nbytes // table_len
        for i, size in enumerate(entry_sizes):
            if size != entry_bytes:
                why = ("the kernel would read or write past the buffer" if size < entry_bytes else
                       "the layout does not describe this buffer (fewer pages, or another kind with the same "
                       "item size), so data would land in the wrong place")
                raise LayoutError(
                    f"{name}: entry {i} holds {size} bytes but the layout describes exactly {entry_bytes} per "
                    f"entry; {why}. Fix: pass the layout the buffers were allocated for"
                )
        e = {"kv": 0, "layer": 0, "page": 0}
        s = {"kv": 0, "layer": 0, "page": 0, "tok": 0}
        entry_stride = 1
        for j in range(k - 1, -1, -1):
            dim, count, _ = self._dims[j]
            e[dim] = entry_stride
            entry_stride *= count
        for dim, _, stride in self._dims[k:]:
            s[dim] = stride
        return Geometry(e["kv"], e["layer"], e["page"], s["kv"], s["layer"], s["page"], s["tok"], self.num_slots)

    def page_blocks(
        self, page: int, *, order: Literal["kv_major", "layer_major"] = "kv_major", merge: bool = True
    ) -> list[tuple[int, int]]:
        """``(byte offset, nbytes)`` of the contiguous blocks holding ``page`` in the
        one-buffer form. Used for transfer-engine and storage metadata.

        Args:
            page: the page number.
            order: ``"kv_major"``: K of every layer, then V; ``"layer_major"``: K, V of
                layer 0, then layer 1 (sglang's ``get_page_buffer_meta`` order). Only
                ``layer_first`` has a layer dimension above the page: elsewhere a page
                is one block per kv.
            merge: merge blocks that are adjacent in memory (in the order given).

        Raises:
            IndexValidationError: ``page`` not an int in ``[0, num_pages)`` (an ``IndexError`` too).
        """
        if type(page) is not int or not 0 <= page < self.num_pages:
            raise IndexValidationError(f"page {page!r} outside [0, {self.num_pages}) (pages are ints)")
        block = self.page_block_bytes()
        # Below the page dimension only layer_first has an outer layer dimension.
        layers = range(self.num_layers) if self.kind == "layer_first" else range(1)
        pairs = [(kv, layer) for kv in range(self.num_kv) for layer in layers]
        if order == "layer_major":
            pairs.sort(key=lambda kv_layer: (kv_layer[1], kv_layer[0]))
        blocks: list[tuple[int, int]] = []
        for kv, layer in pairs:
            off = kv * self._stride("kv") + layer * self._stride("layer") + page * block
            if merge and blocks and blocks[-1][0] + blocks[-1][1] == off:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + block)
            else:
                blocks.append((off, block))
        return blocks

    def page_regions(self) -> list[tuple[int, int]]:
        """``(byte offset, nbytes)`` of the contiguous regions of whole pages in the
        one-buffer form, each ``num_pages * page_block_bytes()`` bytes: one per (kv,
        layer) for ``layer_first``, one per kv otherwise (what a transfer engine registers)."""
        region = self.num_pages * self.page_block_bytes()
        return [(offset, region) for offset in range(0, self.nbytes, region)]

    def page_block_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """``buffer`` (the one-buffer form, contiguous, any dtype) cut into its
        ``page_block_bytes()`` blocks, as flat ``uint8`` views in address order: the
        table entries of a pool registered in several chunks (no page spans two).

        Raises:
            LayoutError: ``buffer`` is not ``nbytes`` contiguous bytes.
        """
        if not buffer.is_contiguous() or buffer.numel() * buffer.element_size() != self.nbytes:
            raise LayoutError(f"need the contiguous {self.nbytes}-byte buffer of this layout, got {tuple(buffer.shape)}")
        flat = buffer.reshape(-1).view(torch.uint8)
        block = self.page_block_bytes()
        return [flat[i : i + block] for i in range(0, self.nbytes, block)]

    def vector_bytes(self, *values: int) -> int:
        """Largest copy word in {16, 8, 4, 1} bytes dividing the item size and all ``values``
        (addresses and strides): the kernels use aligned vector loads of that width."""
        g = math.gcd(self.item_bytes, *values) if values else self.item_bytes
        for width in (16, 8, 4):
            if g % width == 0:
                return width
        return 1
