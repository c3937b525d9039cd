"""KV-cache layouts and the byte geometry the kernels use.

Terms (sglang / vLLM usage): a *page* is ``page_size`` consecutive token slots;
an *item* is one token's K (or V) for one layer, ``num_heads * head_dim`` elements.
MHA stores K and V (``num_kv`` = 2), MLA one latent buffer (``num_kv`` = 1,
``num_heads`` = 1, e.g. ``head_dim`` = 576: 512 latent + 64 rope, 1152 B in bf16).

One-buffer shapes (outermost first; the names of sglang's host pool layouts,
``--hicache-mem-layout``):

* ``layer_first``: ``[num_kv, num_layers, num_pages * page_size, num_heads, head_dim]``
* ``page_first``: ``[num_kv, num_pages * page_size, num_layers, num_heads, head_dim]``
* ``page_first_direct``: ``[num_kv, num_pages, num_layers, page_size, num_heads, head_dim]``
  (a page is contiguous across layers and tokens)
* ``page_head``: ``[num_kv, num_pages, num_heads, page_size, num_layers, head_dim]``
  (sglang ``MHATokenToKVPoolHost.init_kv_buffer``, ``python/sglang/srt/mem_cache/pool_host/mha.py``:
  each kv head of a page is one contiguous block, so a page can be split by head
  between ranks of another tensor-parallel size; sglang's MLA host pool has no
  ``page_head``: here MLA takes the same order with one kv and one head, the bytes
  of ``page_first``)
* ``page_unified``: ``[num_pages, head_groups, num_layers, num_kv, page_size,
  num_heads // head_groups, head_dim]`` (sglang ``PageUnifiedLayout.page_dims``,
  ``python/sglang/srt/mem_cache/pool_host/page_unified.py``: K and V inside the layer,
  so a page, a head group or a layer range of it is one run; for MLA sglang writes
  ``[num_pages, num_layers, page_size, head_dim]``, the same bytes)

In ``page_head`` (``num_heads`` > 1) and ``page_unified`` (``head_groups`` > 1) an item
is not one run but :attr:`KVLayout.item_parts` runs (one per head, one per head group).
The kernels move one run per item, so a launch over such a layout is lowered to an
equal launch over per-part items (:func:`lower_pair`): the split layout becomes its
per-part form (:meth:`KVLayout.part_layout`), the other side the same bytes with
``item_parts`` times more, smaller items, and every slot ``item_parts`` slots.

A pointer table may cover the buffer with 1 entry, or split it on its leading
dimensions (:meth:`KVLayout.table_splits`): per kv (``num_kv`` entries), per kv and
layer (``layer_first``, e.g. a device pool's per-layer K/V tensors), per kv and page
(``page_first``, ``page_first_direct``, ``page_head``: what a host pool registered in
several chunks needs), per page (``page_unified``; per page and head group when
``head_groups`` > 1), and further down to per-(page, group, layer, kv) for ``page_unified``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypedDict

import pydantic
import torch
from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import Unpack

from pointerdomain.arguments import describe
from pointerdomain.errors import (
    IndexValidationError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    LayoutFieldError,
)
from pointerdomain.validated import ValidatedModel

__all__ = ["Geometry", "KVLayout", "KVLayoutChanges", "LayoutKind", "Lowering", "lower_pair"]

LayoutKind = Literal["layer_first", "page_first", "page_first_direct", "page_head", "page_unified"]
DType = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]

#: Dimensions outermost first; below the last one lies the item (or, where an item is
#: split, one part of it: ``head`` counts the parts and is left out when there is one).
_DIM_ORDER: dict[str, tuple[str, ...]] = {
    "layer_first": ("kv", "layer", "page", "tok"),
    "page_first": ("kv", "page", "tok", "layer"),
    "page_first_direct": ("kv", "page", "layer", "tok"),
    "page_head": ("kv", "page", "head", "tok", "layer"),
    "page_unified": ("page", "head", "layer", "kv", "tok"),
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

#: What each field accepts, for error messages (the pydantic constraints below).
_EXPECTED: dict[str, str] = {
    "kind": "one of 'layer_first', 'page_first', 'page_first_direct', 'page_head', 'page_unified'",
    "attention": "'mha' or 'mla'",
    "num_layers": "an int > 0",
    "num_pages": "an int > 0",
    "page_size": "an int > 0 (tokens per page)",
    "num_heads": "an int > 0 (1 for MLA)",
    "head_dim": "an int > 0",
    "dtype": f"a dtype name, one of {sorted(_DTYPES)} (a string, not a torch.dtype)",
    "head_groups": "an int > 0 dividing num_heads; 1 unless kind is 'page_unified'",
}

#: The model validator's own error types: the field each is about and what it expects.
_CUSTOM: dict[str, tuple[str, str]] = {
    "mla_heads": ("num_heads", "1 (MLA stores one latent vector per token)"),
    "head_groups": ("head_groups", _EXPECTED["head_groups"]),
    "layout_size": ("num_layers", "a size that keeps the pool below 2**64 bytes"),
}
_SIZE_FIELDS = ("num_layers", "num_pages", "page_size", "num_heads", "head_dim")


def _layout_error(exc: pydantic.ValidationError) -> LayoutFieldError:
    """The first problem of a pydantic validation error as a :class:`LayoutFieldError`
    naming the field, the value found, what is expected and the fix."""
    err = exc.errors()[0]
    inner = err.get("ctx", {}).get("error")
    if isinstance(inner, LayoutFieldError):  # raised by our __init__ inside pydantic's validation
        return inner
    loc = err.get("loc", ())
    custom = _CUSTOM.get(err.get("type", ""))
    raw = err.get("input")
    if err.get("type") == "layout_size" and isinstance(raw, dict):  # name the largest size field
        sizes = {f: raw[f] for f in _SIZE_FIELDS if type(raw.get(f)) is int}
        if sizes:
            custom = (max(sizes, key=lambda f: sizes[f]), _CUSTOM["layout_size"][1])
    field = str(loc[0]) if loc else (custom[0] if custom else "")
    value = err.get("input")
    if custom is not None and isinstance(value, dict):
        value = value.get(custom[0])
    if custom is not None:
        expected = custom[1]
    elif field in _EXPECTED:
        expected = _EXPECTED[field]
    else:
        expected = f"one of the fields {sorted(_EXPECTED)}"
    if isinstance(value, torch.dtype) and value in _NAMES:
        fix = f"pass dtype={_NAMES[value]!r} (KVLayout.dtype_name({value}))"
    elif field in _EXPECTED:
        fix = f"give {field} {expected}"
    else:
        fix = f"remove {describe(field)}: KVLayout has no such field"
    more = f" ({exc.error_count() - 1} more problem(s))" if exc.error_count() > 1 else ""
    message = (
        f"KVLayout.{field or '?'}: found {describe(value)} ({type(value).__name__}), expected {expected}: "
        f"{err.get('msg', '')}{more}. Fix: {fix}"
    )
    return LayoutFieldError(message, field, value, expected)

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
    head_groups: int


class KVLayout(ValidatedModel, frozen=True):
    """A KV pool's layout: kind, shape and dtype. Frozen, strict, JSON-serialisable.

    ``head_groups`` is the number of kv-head groups a ``page_unified`` page is cut into
    (sglang's ``head_group_num``: each group's heads are one run per token); it must
    divide ``num_heads`` and is 1 for every other kind and for MLA.

    Every way to make or derive one validates: construction, :meth:`replace`,
    ``model_copy(update=...)`` from untyped code (pydantic's skips validation: this one
    does not; typed code gets a static error and uses :meth:`replace`),
    ``model_validate`` / ``model_validate_json``; ``model_construct`` is refused
    (:class:`~pointerdomain.validated.ValidatedModel`).

    Raises (on construction and derivation):
        LayoutFieldError: (a :class:`~pointerdomain.errors.LayoutError` and a
            ``ValueError``) a non-positive size, unknown kind or dtype, a torch dtype
            instead of its name, an unknown field, MLA with ``num_heads`` != 1, or
            ``head_groups`` != 1 outside ``page_unified`` or not dividing ``num_heads``;
            the message names the field, the value, what is expected and the fix.
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
    head_groups: int = Field(default=1, gt=0, description="kv-head groups of a page_unified page")

    @model_validator(mode="after")
    def _check(self) -> KVLayout:
        if self.attention == "mla" and self.num_heads != 1:
            raise PydanticCustomError("mla_heads", "MLA stores one latent vector per token: num_heads must be 1")
        if self.head_groups != 1 and (self.kind != "page_unified" or self.num_heads % self.head_groups):
            raise PydanticCustomError(
                "head_groups",
                "only a page_unified page is cut into head groups (sglang's head_group_num), and the groups must "
                "divide num_heads",
            )
        if self.nbytes >= 1 << 64:  # byte offsets and addresses are 64-bit in every kernel and engine
            raise PydanticCustomError(
                "layout_size",
                "the pool is {nbytes} bytes, expected fewer than 2**64 (the address space): fewer layers, pages, "
                "heads or a smaller head_dim", {"nbytes": self.nbytes},
            )
        return self

    if not TYPE_CHECKING:  # runtime wrappers; type checkers keep pydantic's signatures

        def __init__(self, **data: Any) -> None:
            try:
                super().__init__(**data)
            except pydantic.ValidationError as exc:
                raise _layout_error(exc) from None

        __init__.__pydantic_base_init__ = True  # not a custom __init__ for pydantic's validators

        @classmethod
        def model_validate(cls, obj: Any, **kwargs: Any) -> KVLayout:
            try:
                return super().model_validate(obj, **kwargs)
            except pydantic.ValidationError as exc:
                raise _layout_error(exc) from None

        @classmethod
        def model_validate_json(cls, json_data: Any, **kwargs: Any) -> KVLayout:
            try:
                return super().model_validate_json(json_data, **kwargs)
            except pydantic.ValidationError as exc:
                raise _layout_error(exc) from None

        @classmethod
        def model_validate_strings(cls, obj: Any, **kwargs: Any) -> KVLayout:
            try:
                return super().model_validate_strings(obj, **kwargs)
            except pydantic.ValidationError as exc:
                raise _layout_error(exc) from None

        def __setattr__(self, name: str, value: Any) -> None:
            raise LayoutFieldError(
                f"KVLayout.{name}: found an assignment of {describe(value)}, expected no assignment: layouts are frozen. "
                f"Fix: derive a new layout with layout.replace({name}=...)",
                name, value, "no assignment (frozen)",
            )

        def __delattr__(self, name: str) -> None:
            raise LayoutFieldError(
                f"KVLayout.{name}: found a deletion, expected none: layouts are frozen. Fix: derive a new layout "
                "with layout.replace(...)", name, None, "no deletion (frozen)",
            )

    def replace(self, **changes: Unpack[KVLayoutChanges]) -> KVLayout:
        """A copy with ``changes`` applied, **validated** like a new layout, with field
        names and types checked by mypy and pyright (:class:`KVLayoutChanges`);
        pydantic's ``model_copy(update=...)`` takes an unchecked ``dict[str, Any]``.

        Raises:
            LayoutFieldError: a changed value is invalid (e.g. ``head_dim=-8``,
                ``kind="pagefirst"``, ``dtype=torch.bfloat16``, ``num_pages=0``, MLA with 4
                heads) or an unknown field; the message names the field.
        """
        return self._derive(changes)

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
    def item_parts(self) -> int:
        """Separate runs one item occupies in the buffer: ``num_heads`` for ``page_head``
        (one of ``head_dim`` elements per head), ``head_groups`` for ``page_unified`` (one
        per group), else 1 (the item is one run of :attr:`item_bytes`)."""
        if self.kind == "page_head":
            return self.num_heads
        if self.kind == "page_unified":
            return self.head_groups
        return 1

    @property
    def part_bytes(self) -> int:
        """Bytes of one run of an item: ``item_bytes // item_parts``."""
        return self.item_bytes // self.item_parts

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
        """Shape of the one-buffer form (element dtype :attr:`torch_dtype`; see the module
        docstring for each kind's order)."""
        kv, n_l, n_p, ps, h, d = (self.num_kv, self.num_layers, self.num_pages, self.page_size,
                                  self.num_heads, self.head_dim)
        if self.kind == "layer_first":
            return (kv, n_l, n_p * ps, h, d)
        if self.kind == "page_first":
            return (kv, n_p * ps, n_l, h, d)
        if self.kind == "page_head":
            return (kv, n_p, h, ps, n_l, d)
        if self.kind == "page_unified":
            g = self.head_groups
            return (n_p, g, n_l, kv, ps, h // g, d)
        return (kv, n_p, n_l, ps, h, d)

    @property
    def _dims(self) -> tuple[tuple[str, int, int], ...]:
        """(name, count, byte stride) per dimension, outermost first (``head``: the parts
        of a split item, absent when an item is one run)."""
        parts = self.item_parts
        counts = {"kv": self.num_kv, "layer": self.num_layers, "page": self.num_pages, "tok": self.page_size,
                  "head": parts}
        order = _DIM_ORDER[self.kind]
        dims: list[tuple[str, int, int]] = []
        stride = self.item_bytes // parts
        for name in reversed(order):
            if name == "head" and parts == 1:
                continue
            dims.append((name, counts[name], stride))
            stride *= counts[name]
        return tuple(reversed(dims))

    def part_layout(self) -> KVLayout:
        """This buffer with one item per part, a layout whose items are each one run
        (``self`` where they already are, :attr:`item_parts` 1). Same bytes, same tables:

        * ``page_head``: ``page_first`` with 1 head and pages of ``num_heads * page_size``
          tokens; token ``t`` of head ``h`` of a page is its token ``h * page_size + t``.
        * ``page_unified``: ``page_unified`` with 1 group of ``num_heads // head_groups``
          heads and ``head_groups`` times the pages; group ``g`` of page ``p`` is page
          ``p * head_groups + g``.
        """
        if self.item_parts == 1:
            return self
        if self.kind == "page_head":
            return self.replace(kind="page_first", num_heads=1, page_size=self.page_size * self.num_heads)
        g = self.head_groups
        return self.replace(head_groups=1, num_heads=self.num_heads // g, num_pages=self.num_pages * g)

    def table_splits(self) -> tuple[int, ...]:
        """Allowed table lengths, by how many leading dimensions the table covers
        (never the token dimension; for a split item, those of :meth:`part_layout`:
        never inside a ``page_head`` page, and a ``page_unified`` page with head groups
        only per group)."""
        if self.item_parts > 1:
            return self.part_layout().table_splits()
        lengths, n = [1], 1
        for name, count, _ in self._dims:
            if name == "tok":
                break
            n *= count
            lengths.append(n)
        return tuple(lengths)

    def page_block_bytes(self) -> int:
        """Bytes of one page's contiguous block (the page dimension's stride): the
        unit a chunked registration must cut on so no page spans two chunks. One block
        per kv and page, except ``layer_first`` (one per kv, layer and page) and
        ``page_unified`` (one per page: K and V of every layer)."""
        return self._stride("page")

    def _stride(self, dim: str) -> int:
        return next(stride for name, _, stride in self._dims if name == dim)

    def _table_block_bytes(self) -> int:
        """Bytes of each entry of a table cut per page block: :meth:`page_block_bytes`,
        or the head-group block for ``page_unified`` with head groups (launches address
        a group's block through its own entry)."""
        return self.part_layout().page_block_bytes() if self.item_parts > 1 else self.page_block_bytes()

    def split_for_page_blocks(self) -> int:
        """Table length when the entries are the blocks of :meth:`page_block_views`."""
        return self.nbytes // self._table_block_bytes()

    def geometry(self, table_len: int, entry_sizes: tuple[int, ...], name: str) -> Geometry:
        """Kernel geometry for a table of ``table_len`` entries over this layout; for a
        layout whose items are split (:attr:`item_parts` > 1) the geometry of its
        :meth:`part_layout` (same table), whose items are one part.

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
        addressed = self.part_layout() if self.item_parts > 1 else self
        return addressed._geometry_at(splits.index(table_len))

    def _geometry_at(self, k: int) -> Geometry:
        """The geometry of a table covering the first ``k`` dimensions (items one run)."""
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

    def _coordinate(self, name: str, value: object, count: int) -> int:
        if type(value) is not int:
            raise InvalidTypeError(
                f"{name}: found {describe(value)} ({type(value).__name__}), expected an int in [0, {count}) (a bool is not "
                f"an int here). Fix: pass {name} as an int"
            )
        if not 0 <= value < count:
            raise IndexValidationError(f"{name} {value} outside [0, {count}) of this {self.kind} layout")
        return value

    def byte_offset(self, page: int, layer: int, kv: int, *, token: int = 0) -> int:
        """Bytes from the start of the one-buffer form to the item of ``(kv, layer)`` of
        token ``token`` of ``page`` (slot ``page * page_size + token``); for a split item
        (``page_head``, ``page_unified`` with head groups) the offset of its first part
        (head 0, group 0; :meth:`item_spans` gives every part). ``buffer.view(torch.uint8)
        .reshape(-1)[offset:]`` starts with that item.

        Args:
            page: in ``[0, num_pages)``; layer: in ``[0, num_layers)``; kv: 0 (K) or 1 (V)
                for MHA, 0 for MLA; token: in ``[0, page_size)``. All ints.

        Raises:
            InvalidTypeError: an argument is not an int (a bool included).
            IndexValidationError: an argument out of its range.
        """
        page = self._coordinate("page", page, self.num_pages)
        layer = self._coordinate("layer", layer, self.num_layers)
        kv = self._coordinate("kv", kv, self.num_kv)
        token = self._coordinate("token", token, self.page_size)
        coords = {"kv": kv, "layer": layer, "page": page, "tok": token, "head": 0}
        return sum(coords[name] * stride for name, _, stride in self._dims)

    def item_spans(self, page: int, layer: int, kv: int, *, token: int = 0) -> list[tuple[int, int]]:
        """``(byte offset, nbytes)`` of each run of the item :meth:`byte_offset` names, in
        head order: one run of :attr:`item_bytes`, or :attr:`item_parts` runs of
        :attr:`part_bytes` for a split item.

        Raises:
            InvalidTypeError, IndexValidationError: as :meth:`byte_offset`.
        """
        first = self.byte_offset(page, layer, kv, token=token)
        if self.item_parts == 1:
            return [(first, self.item_bytes)]
        step = self._stride("head")
        return [(first + j * step, self.part_bytes) for j in range(self.item_parts)]

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
                is one block per kv (``page_head``: the heads of a page's K, then of its
                V, as sglang's ``get_page_buffer_meta``), or one block in all
                (``page_unified``: K and V of every layer and head group).
            merge: merge blocks that are adjacent in memory (in the order given).

        Raises:
            IndexValidationError: ``page`` not an int in ``[0, num_pages)`` (an ``IndexError`` too).
            InvalidArgumentError: ``order`` is neither ``"kv_major"`` nor ``"layer_major"``.
            InvalidTypeError: ``merge`` is not a bool.
        """
        if type(page) is not int:
            raise IndexValidationError(
                f"page: found {describe(page)} ({type(page).__name__}), expected an int in [0, {self.num_pages}). "
                "Fix: pass int(page) (a numpy or tensor scalar is not an int here)"
            )
        if not 0 <= page < self.num_pages:
            raise IndexValidationError(f"page: found {page}, outside [0, {self.num_pages}). Fix: pass a page of the pool")
        if order != "kv_major" and order != "layer_major":
            raise InvalidArgumentError(f"order must be 'kv_major' or 'layer_major', got {describe(order)}")
        if type(merge) is not bool:
            raise InvalidTypeError(f"merge must be a bool, got {describe(merge)}")
        block = self.page_block_bytes()
        if self.kind == "page_unified":  # kv lies inside the page
            return [(page * block, block)]
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
        layer) for ``layer_first``, one for ``page_unified``, one per kv otherwise (what
        a transfer engine registers)."""
        region = self.num_pages * self.page_block_bytes()
        return [(offset, region) for offset in range(0, self.nbytes, region)]

    def page_block_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """``buffer`` (the one-buffer form, contiguous, any dtype) cut into its
        ``page_block_bytes()`` blocks (for ``page_unified`` with head groups, each page's
        ``head_groups`` group blocks, the unit a launch addresses), as flat ``uint8``
        views in address order: the table entries of a pool registered in several
        chunks (no page spans two), :meth:`split_for_page_blocks` of them.

        Raises:
            LayoutError: ``buffer`` is not ``nbytes`` contiguous bytes.
        """
        if not buffer.is_contiguous() or buffer.numel() * buffer.element_size() != self.nbytes:
            raise LayoutError(f"need the contiguous {self.nbytes}-byte buffer of this layout, got {tuple(buffer.shape)}")
        flat = buffer.reshape(-1).view(torch.uint8)
        block = self._table_block_bytes()
        return [flat[i : i + block] for i in range(0, self.nbytes, block)]

    def vector_bytes(self, *values: int) -> int:
        """Largest copy word in {16, 8, 4, 1} bytes dividing the item size and all ``values``
        (addresses and strides): the kernels use aligned vector loads of that width."""
        g = math.gcd(self.item_bytes, *values) if values else self.item_bytes
        for width in (16, 8, 4):
            if g % width == 0:
                return width
        return 1


class Lowering(NamedTuple):
    """A launch between layouts of which one splits its items (:func:`lower_pair`),
    expressed over per-part items: ``src`` and ``dst`` are the layouts the kernels
    address (same bytes as the given ones, items of one part, ``parts`` times the
    slots), and slot ``s`` of a given layout becomes the ``parts`` slots

    * ``blocked`` (a split layout's own order): ``page * parts * page_size + j * page_size
      + tok`` for ``j`` in ``range(parts)``, where ``page, tok = divmod(s, page_size)``
      of the given layout;
    * otherwise (the other side, re-expressed): ``s * parts + j``.
    """

    parts: int
    src: KVLayout
    dst: KVLayout
    src_blocked: bool
    dst_blocked: bool


def _regrouped(other: KVLayout, split: KVLayout) -> KVLayout:
    """``other`` (items one run) with ``split.item_parts`` times more items of one part
    each, numbered as ``split``'s part layout needs (slot ``s``, part ``j`` -> ``s * parts + j``).

    Raises:
        LayoutError: ``other`` cannot be numbered so (see :func:`lower_pair`).
    """
    k = split.item_parts
    if split.kind == "page_head":
        # The parts of a slot sit right below its token: consecutive slots of k-times-longer pages.
        if other._dims[-1][0] == "tok":
            return other.replace(num_heads=other.num_heads // k, page_size=other.page_size * k)
        supported = "layer_first, page_first_direct, page_unified without head groups, or page_head"
    else:
        # Head groups become pages of their own: only layer_first ignores where pages start.
        if other.kind == "layer_first":
            return other.replace(num_heads=other.num_heads // k, num_pages=other.num_pages * k)
        supported = "layer_first, or page_unified with the same head_groups"
    raise LayoutError(
        f"a {split.kind} layout whose items are {k} separate runs (one per "
        f"{'head' if split.kind == 'page_head' else 'head group'}) cannot be copied to or from {other.kind}"
        f"{' with ' + str(other.head_groups) + ' head groups' if other.kind == 'page_unified' else ''} in one "
        f"launch: the kernels move one run per item, and no slot numbering makes both sides' runs line up. "
        f"Supported partners: {supported}. Fix: copy through a pool of a supported layout (two launches)"
    )


def lower_pair(src: KVLayout, dst: KVLayout) -> Lowering | None:
    """How a launch between ``src`` and ``dst`` (which agree on the model shape) is run
    when one of them splits its items (:attr:`KVLayout.item_parts` > 1: ``page_head``
    with several heads, ``page_unified`` with head groups); None when neither does
    (the launch addresses the given layouts; no extra work).

    The split side becomes its :meth:`KVLayout.part_layout`, the other side the same
    bytes with ``item_parts`` items per slot. Supported pairs:

    * ``page_head`` with ``layer_first``, ``page_first_direct``, ``page_unified``
      without head groups (their heads are innermost under the token), or ``page_head``;
    * ``page_unified`` with ``head_groups`` > 1 with ``layer_first`` (sglang's device
      pool), or ``page_unified`` with the same ``head_groups``.

    The tables stay as they are: every split the given layouts allow is one of the
    lowered layouts', except a ``layer_first`` table cut per page (``num_kv *
    num_layers * num_pages`` entries) with a ``page_unified`` partner with head groups,
    which a launch refuses (``LayoutError`` when its plan is built).

    Raises:
        InvalidTypeError: ``src`` or ``dst`` is not a KVLayout.
        LayoutError: they differ in the model shape (``attention``, ``num_layers``,
            ``page_size``, ``num_heads``, ``head_dim``, ``dtype``), or any other pair with a
            split side (``page_first`` has its layers between a token and its heads;
            different head-group counts cut items differently): copy through an
            intermediate pool.
    """
    for name, value in (("src", src), ("dst", dst)):
        if not isinstance(value, KVLayout):
            raise InvalidTypeError(f"{name}: found a {type(value).__name__}, expected a KVLayout")
    for field in ("attention", "num_layers", "page_size", "num_heads", "head_dim", "dtype"):
        if getattr(src, field) != getattr(dst, field):
            found = f"{getattr(src, field)!r} vs {getattr(dst, field)!r}"
            raise LayoutError(f"src and dst layouts differ in {field}: {found}")
    ks, kd = src.item_parts, dst.item_parts
    if ks == 1 and kd == 1:
        return None
    if ks > 1 and kd > 1:
        if src.kind != dst.kind or ks != kd:
            raise LayoutError(
                f"src is {src.kind} with items in {ks} runs and dst is {dst.kind} with items in {kd} runs: the "
                "kernels move one run per item, and these cut items differently. Fix: copy through a "
                "layer_first pool (two launches), or use the same layout on both sides"
            )
        return Lowering(ks, src.part_layout(), dst.part_layout(), True, True)
    if ks > 1:
        return Lowering(ks, src.part_layout(), _regrouped(dst, src), True, False)
    return Lowering(kd, _regrouped(src, dst), dst.part_layout(), False, True)
