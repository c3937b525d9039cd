"""Call shapes whose tables are raw addresses refuse index tensors that lie in the
destination's memory (the copy would overwrite the indices it still reads), before any
byte is written, as typed tables do: the destination's extent is what its entries address."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import sgl_kernel as sk
from tests.helpers.compat import POISON, rand, table, u8

DEV = pd.validate_device("emulated:0")
N, D, NL = 16, 16, 2
ITEM = 2 * D  # bytes of one bf16 row


def dev_rows() -> torch.Tensor:
    return pd.device_empty((N, D), dtype=torch.bfloat16, device=DEV)


def idx_in(t: torch.Tensor, row: int, values: list[int]) -> torch.Tensor:
    """An int64 index tensor over row ``row`` of ``t`` (a view: it shares t's memory)."""
    view = u8(t)[row].view(torch.int64)[: len(values)]
    view.copy_(torch.tensor(values, dtype=torch.int64))
    return view


def snapshot(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [u8(t).clone() for t in ts]


def unchanged(ts: list[torch.Tensor], before: list[torch.Tensor]) -> bool:
    return all(torch.equal(u8(t), b) for t, b in zip(ts, before))


Call = Callable[[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                 torch.Tensor, torch.Tensor], None]


def _kv(sk_: list[torch.Tensor], dk: list[torch.Tensor], sv: list[torch.Tensor], dv: list[torch.Tensor],
        s: torch.Tensor, d: torch.Tensor) -> None:
    sk.transfer_kv_all_layer(table(sk_, DEV), table(dk, DEV), table(sv, DEV), table(dv, DEV), s, d, ITEM, NL)


def _mla(sk_: list[torch.Tensor], dk: list[torch.Tensor], sv: list[torch.Tensor], dv: list[torch.Tensor],
         s: torch.Tensor, d: torch.Tensor) -> None:
    sk.transfer_kv_all_layer_mla(table(sk_, DEV), table(dk, DEV), s, d, ITEM, NL)


def _hicache(sk_: list[torch.Tensor], dk: list[torch.Tensor], sv: list[torch.Tensor], dv: list[torch.Tensor],
             s: torch.Tensor, d: torch.Tensor) -> None:
    hc.transfer_hicache_all_layer(table(dk, DEV), table(dv, DEV), d, table(sk_, DEV), table(sv, DEV), s,
                                  kv_cache_src_stride_bytes=ITEM, kv_cache_dst_stride_bytes=ITEM,
                                  element_size=ITEM)


CALLS = {"transfer_kv_all_layer": _kv, "transfer_kv_all_layer_mla": _mla, "transfer_hicache_all_layer": _hicache}


@pytest.fixture
def bufs() -> Iterator[tuple[list[torch.Tensor], ...]]:
    src_k = [rand(dev_rows()) for _ in range(NL)]
    src_v = [rand(dev_rows()) for _ in range(NL)]
    dst_k = [dev_rows() for _ in range(NL)]
    dst_v = [dev_rows() for _ in range(NL)]
    for t in (*dst_k, *dst_v):
        u8(t).fill_(POISON)
    yield src_k, dst_k, src_v, dst_v


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("side", ["dst", "src"])
@pytest.mark.parametrize("layer", [0, 1])
def test_indices_in_destination_refused(bufs: tuple[list[torch.Tensor], ...], name: str, side: str,
                                        layer: int) -> None:
    src_k, dst_k, src_v, dst_v = bufs
    # the indices live in row 0 of a destination buffer, which the copy writes
    inside = idx_in(dst_k[layer], 0, [0, 1] if side == "dst" else [1, 2])
    other = torch.tensor([1, 2] if side == "dst" else [0, 1], dtype=torch.int64)
    s, d = (other, inside) if side == "dst" else (inside, other)
    before = snapshot([*dst_k, *dst_v])
    with pytest.raises(errors.OverlapError, match="memory of the destination"):
        CALLS[name](src_k, dst_k, src_v, dst_v, s, d)
    assert unchanged([*dst_k, *dst_v], before)
    assert inside.tolist() == ([0, 1] if side == "dst" else [1, 2])


@pytest.mark.parametrize("name", list(CALLS))
def test_out_of_range_indices_in_destination_refused_before_writing(
        bufs: tuple[list[torch.Tensor], ...], name: str) -> None:
    src_k, dst_k, src_v, dst_v = bufs
    d = idx_in(dst_v[1], 3, [0, 1_000_000])  # refused for its range or for where it lies: either before a write
    before = snapshot([*dst_k, *dst_v])
    with pytest.raises((errors.OverlapError, errors.IndexValidationError)):
        CALLS[name](src_k, dst_k, src_v, dst_v, torch.tensor([1, 2]), d)
    assert unchanged([*dst_k, *dst_v], before)


@pytest.mark.parametrize("name", list(CALLS))
def test_indices_elsewhere_copy_exact(bufs: tuple[list[torch.Tensor], ...], name: str) -> None:
    src_k, dst_k, src_v, dst_v = bufs
    spare = dev_rows()  # device memory outside every table: legitimate
    d = idx_in(spare, 0, [7, 0, 3])
    s = torch.tensor([2, 5, 15], dtype=torch.int64)
    for _ in range(2):  # the second call takes the prepared path
        CALLS[name](src_k, dst_k, src_v, dst_v, s, d)
    sides = [(src_k, dst_k)] + ([] if name.endswith("mla") else [(src_v, dst_v)])
    for srcs, dsts in sides:
        for a, b in zip(srcs, dsts):
            want = torch.full_like(u8(b), POISON)
            want[d] = u8(a)[s]
            assert torch.equal(u8(b), want)
    if name.endswith("mla"):
        assert all(bool((u8(t) == POISON).all()) for t in dst_v)


def test_registered_host_destination_refused() -> None:
    # a host destination registered with the device: its table holds host VAs (aliases
    # differ from them in strict alias mode), the indices a view of the same bytes
    mems = [pd.alloc_registered(N * ITEM, DEV) for _ in range(2 * NL)]
    try:
        dst = [m.tensor[: N * ITEM].view(torch.bfloat16).view(N, D) for m in mems]
        for t in dst:
            u8(t).fill_(POISON)
        src = [rand(dev_rows()) for _ in range(2 * NL)]
        d = idx_in(dst[NL + 1], 9, [4, 5])
        before = snapshot(dst)
        with pytest.raises(errors.OverlapError, match="memory of the destination"):
            _hicache(src[:NL], dst[:NL], src[NL:], dst[NL:], torch.tensor([0, 1]), d)
        assert unchanged(dst, before)
    finally:
        for m in mems:
            m.close()
