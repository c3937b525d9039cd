"""One layout builder for the tests' model shapes."""

from __future__ import annotations

from dataclasses import dataclass

from pointerdomain import KVLayout

__all__ = ["SMALL", "Model"]


@dataclass(frozen=True)
class Model:
    """A model shape: layers, tokens per page, dtype, MHA heads ``(num_heads, head_dim)``
    and the MLA latent width; :meth:`layout` gives its :class:`~pointerdomain.KVLayout`
    of any kind and size. The default is the CPU tests' small model (3 layers, pages of
    4 tokens, bf16, MHA 2 x 16, MLA 1 x 40)."""

    layers: int = 3
    page_size: int = 4
    mha: tuple[int, int] = (2, 16)
    mla_dim: int = 40
    dtype: str = "bfloat16"
    pages: int = 8

    def layout(self, kind: str = "layer_first", pages: int | None = None, attention: str = "mha", *,
               heads: int | None = None, groups: int = 1, page_size: int | None = None) -> KVLayout:
        """The layout of ``kind`` with ``pages`` pages (default :attr:`pages`); ``heads``
        overrides the MHA head count (MLA has one), ``groups`` is ``head_groups``,
        ``page_size`` overrides the model's. Validated as a user's dict would be."""
        mla = attention == "mla"
        num_heads, head_dim = (1, self.mla_dim) if mla else (self.mha[0] if heads is None else heads, self.mha[1])
        return KVLayout.model_validate({
            "kind": kind, "attention": attention, "num_layers": self.layers,
            "num_pages": self.pages if pages is None else pages,
            "page_size": self.page_size if page_size is None else page_size,
            "num_heads": num_heads, "head_dim": head_dim, "dtype": self.dtype, "head_groups": groups,
        })


#: The CPU tests' small model (tests/reference.py's ``model_layout``).
SMALL = Model()
