"""LMCache's c_ops KV transfers (pointerdomain.compat.lmcache) on the emulated device: every
format and direction against plain torch indexing on bytes, untouched bytes kept, negative
slots skipped, both upstream call shapes, and every bad argument a typed error before
anything is written."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import lmcache as ops

DEV = pd.validate_device("emulated:0")
OTHER = pd.validate_device("emulated:1")
POISON = 0xA5
F = ops.EngineKVFormat
H2D, D2H = int(ops.TransferDirection.H2D), int(ops.TransferDirection.D2H)
L, NB, BS, NH, HS, T = 2, 3, 4, 2, 8, 5
DTYPE = torch.bfloat16


# -- buffers and the plain-torch reference ----------------------------------------------------

@pytest.fixture
def host() -> Iterator[Callable[[tuple[int, ...]], torch.Tensor]]:
    """Registered host tensors of a shape (bf16, each its own registration)."""
    owners: list[pd.RegisteredHostMemory] = []

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        mem = pd.alloc_registered(numel * 2, DEV)
        owners.append(mem)
        return mem.tensor[: numel * 2].view(DTYPE).view(shape)

    yield make
    for mem in owners:
        mem.close()


def _dev(shape: tuple[int, ...], device: pd.Device = DEV) -> torch.Tensor:
    return pd.device_empty(shape, dtype=DTYPE, device=device)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _random(t: torch.Tensor) -> torch.Tensor:
    _u8(t).copy_(torch.randint(0, 256, _u8(t).shape, dtype=torch.uint8))
    return t


def _poison(t: torch.Tensor) -> torch.Tensor:
    _u8(t).fill_(POISON)
    return t


def _snapshot(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_u8(t).clone() for t in ts]


def _unchanged(ts: list[torch.Tensor], before: list[torch.Tensor]) -> bool:
    return all(torch.equal(_u8(t), b) for t, b in zip(ts, before))


def _kv_size(fmt: int) -> int:
    return 1 if fmt in (F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS, F.NL_X_NB_NH_BS_TWO_HS) else 2


class Dims(NamedTuple):
    """A layer cache's blocks, block size, heads and head size (elements)."""

    nb: int = NB
    bs: int = BS
    nh: int = NH
    hs: int = HS


SMALL = Dims()


def _item(fmt: int, d: Dims = SMALL) -> int:
    if fmt in (F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS):
        return d.hs
    return d.nh * 2 * d.hs if fmt == F.NL_X_NB_NH_BS_TWO_HS else d.nh * d.hs


def _cache_shape(fmt: int, d: Dims = SMALL) -> tuple[int, ...]:
    NB, BS, NH, HS = d  # the engine's names, shadowing the small defaults
    return {
        F.NB_NL_TWO_BS_NH_HS: (2, NB, BS, NH, HS),  # the kernel addresses format 0 as format 1
        F.NL_X_TWO_NB_BS_NH_HS: (2, NB, BS, NH, HS),
        F.NL_X_NB_TWO_BS_NH_HS: (NB, 2, BS, NH, HS),
        F.NL_X_NB_BS_HS: (NB, BS, HS),
        F.NL_X_NBBS_ONE_HS: (NB * BS, 1, HS),
        F.NL_X_TWO_NB_NH_BS_HS: (2, NB, NH, BS, HS),
        F.NL_X_NB_TWO_NH_BS_HS: (NB, 2, NH, BS, HS),
        F.NL_X_NB_NH_BS_TWO_HS: (NB, NH, BS, 2 * HS),
    }[F(fmt)]


def _slot(fmt: int, cache: torch.Tensor, kv: int, s: int, d: Dims = SMALL) -> torch.Tensor:
    """The bytes of slot ``s`` (K: kv 0, V: kv 1) of one layer's cache, as a view (plain indexing
    of the engine's shape: heads x head bytes, or head bytes for MLA)."""
    c, (b, o) = _u8(cache), divmod(s, d.bs)
    return {
        F.NB_NL_TWO_BS_NH_HS: lambda: c[kv, b, o],
        F.NL_X_TWO_NB_BS_NH_HS: lambda: c[kv, b, o],
        F.NL_X_NB_TWO_BS_NH_HS: lambda: c[b, kv, o],
        F.NL_X_NB_BS_HS: lambda: c[b, o],
        F.NL_X_NBBS_ONE_HS: lambda: c[s, 0],
        F.NL_X_TWO_NB_NH_BS_HS: lambda: c[kv, b, :, o],
        F.NL_X_NB_TWO_NH_BS_HS: lambda: c[b, kv, :, o],
        F.NL_X_NB_NH_BS_TWO_HS: lambda: c[b, :, o],
    }[F(fmt)]()


def _slots(n: int, capacity: int, pad: tuple[int, ...] = ()) -> torch.Tensor:
    """``n`` distinct slots, -1 (skip) at the positions in ``pad``."""
    values = random.Random(n * 31 + capacity).sample(range(capacity), n)
    for i in pad:
        values[i] = -1
    return torch.tensor(values, dtype=torch.int64)


def _ptrs(caches: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)


# -- multi_layer_kv_transfer: every format, both directions -----------------------------------

@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("direction", [D2H, H2D])
@pytest.mark.parametrize("fmt", sorted(int(f) for f in ops.MULTI_LAYER_FORMATS))
def test_multi_layer_every_format(fmt: int, direction: int, where: str,
                                  host: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
    kv, item = _kv_size(fmt), _item(fmt)
    caches = [_dev(_cache_shape(fmt)) for _ in range(L)]
    mem = _dev((kv, L, T, item)) if where == "device" else host((kv, L, T, item))
    slots = _slots(T, NB * BS, pad=(2,))  # token 2 is padding: skipped
    if direction == D2H:
        for c in caches:
            _random(c)
        _poison(mem)
    else:
        for c in caches:
            _poison(c)
        _random(mem)
    want_mem, want_caches = _u8(mem).clone(), [_u8(c).clone() for c in caches]
    for layer, cache in enumerate(caches):
        for k in range(kv):
            for t, s in enumerate(slots.tolist()):
                if s < 0:
                    continue
                token = want_mem[k, layer, t]
                if direction == D2H:
                    token.copy_(_slot(fmt, cache, k, s).reshape(-1))
                else:
                    target = _slot(fmt, want_caches[layer], k, s)  # uint8 clone: same leading dims
                    target.copy_(token.view(target.shape))
    ops.multi_layer_kv_transfer(mem, _ptrs(caches), slots, DEV, NB * BS, direction, fmt, BS, HS)
    assert torch.equal(_u8(mem), want_mem)
    for cache, want in zip(caches, want_caches):
        assert torch.equal(_u8(cache), want)


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS, F.NL_X_NB_BS_HS])
def test_round_trip_with_skip_prefix(fmt: int) -> None:
    kv, item = _kv_size(fmt), _item(fmt)
    src = [_random(_dev(_cache_shape(fmt))) for _ in range(L)]
    dst = [_poison(_dev(_cache_shape(fmt))) for _ in range(L)]
    mem = _poison(_dev((kv, L, T, item)))
    slots = _slots(T, NB * BS)
    ops.multi_layer_kv_transfer(mem, _ptrs(src), slots, DEV, NB * BS, D2H, fmt, BS, HS, skip_prefix_n_tokens=2)
    assert torch.equal(_u8(mem)[:, :, :2], torch.full_like(_u8(mem)[:, :, :2], POISON))  # the prefix stays
    ops.multi_layer_kv_transfer(mem, _ptrs(dst), slots, DEV, NB * BS, H2D, fmt, BS, HS, skip_prefix_n_tokens=2)
    for s_cache, d_cache in zip(src, dst):
        for k in range(kv):
            for t, s in enumerate(slots.tolist()):
                got = _slot(fmt, d_cache, k, s)
                want = _slot(fmt, s_cache, k, s) if t >= 2 else torch.full_like(got, POISON)
                assert torch.equal(got, want)


def test_all_padding_writes_nothing() -> None:
    caches = [_random(_dev(_cache_shape(1))) for _ in range(L)]
    mem = _poison(_dev((2, L, 3, NH * HS)))
    ops.multi_layer_kv_transfer(mem, _ptrs(caches), torch.full((3,), -1, dtype=torch.int64), DEV, NB * BS, D2H, 1,
                                BS)
    assert torch.equal(_u8(mem), torch.full_like(_u8(mem), POISON))


# -- the legacy call shapes (tests/v1/test_mem_kernels.py) ------------------------------------

def test_legacy_multi_layer_mha_as_upstream_test_calls_it(host: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
    caches = [_random(_dev((2, NB, BS, NH, HS))) for _ in range(L)]
    fresh = [_poison(_dev((2, NB, BS, NH, HS))) for _ in range(L)]
    slots = _slots(T, NB * BS)
    mem = _poison(host((2, L, T, NH * HS)))
    device = caches[0].device  # upstream passes kv_cache[0].device: cpu is the emulated device 0
    ops.multi_layer_kv_transfer(mem, _ptrs(caches), slots, device, NB * BS, True, False)
    for layer in range(L):
        flat = _u8(caches[layer]).view(2, NB * BS, -1)
        assert torch.equal(_u8(mem)[:, layer], flat[:, slots])
    ops.multi_layer_kv_transfer(mem, _ptrs(fresh), slots, device, NB * BS, False, False)
    for old, new in zip(caches, fresh):
        o, n = _u8(old).view(2, NB * BS, -1), _u8(new).view(2, NB * BS, -1)
        assert torch.equal(n[:, slots], o[:, slots])
        rest = torch.ones(NB * BS, dtype=torch.bool)
        rest[slots] = False
        assert torch.equal(n[:, rest], torch.full_like(n[:, rest], POISON))


def test_legacy_multi_layer_mla_page_buffer_size_zero() -> None:
    caches = [_random(_dev((NB, BS, 576))) for _ in range(L)]  # upstream's MLA head: 576 elements
    slots = _slots(T, NB * BS)
    mem = _poison(_dev((1, L, T, 576)))
    ops.multi_layer_kv_transfer(mem, _ptrs(caches), slots, DEV, 0, True, True)  # as upstream: 0 slots given
    for layer in range(L):
        assert torch.equal(_u8(mem)[0, layer], _u8(caches[layer]).view(NB * BS, -1)[slots])
    fresh = [_poison(_dev((NB, BS, 576))) for _ in range(L)]
    ops.multi_layer_kv_transfer(mem, _ptrs(fresh), slots, DEV, 0, False, True)
    for old, new in zip(caches, fresh):
        assert torch.equal(_u8(new).view(NB * BS, -1)[slots], _u8(old).view(NB * BS, -1)[slots])


def test_mla_capacity_from_the_allocation() -> None:
    # page_buffer_size 0: the bound is the allocation behind each entry, never past it
    caches = [_random(_dev((NB, BS, HS))) for _ in range(L)]
    mem = _poison(_dev((1, L, 1, HS)))
    ops.multi_layer_kv_transfer(mem, _ptrs(caches), torch.tensor([NB * BS - 1]), DEV, 0, D2H, F.NL_X_NB_BS_HS)
    assert torch.equal(_u8(mem)[0, 1, 0], _u8(caches[1]).view(NB * BS, -1)[-1])
    _poison(mem)
    with pytest.raises(errors.IndexValidationError, match=r"slot_mapping\[0\]: slot 12 outside \[0, 12\)"):
        ops.multi_layer_kv_transfer(mem, _ptrs(caches), torch.tensor([NB * BS]), DEV, 0, D2H, F.NL_X_NB_BS_HS)
    assert torch.equal(_u8(mem), torch.full_like(_u8(mem), POISON))


@pytest.mark.parametrize("vllm_two_major", [True, False])
@pytest.mark.parametrize("token_major", [True, False])
def test_legacy_single_layer(token_major: bool, vllm_two_major: bool) -> None:
    shape = (2, NB, BS, NH, HS) if vllm_two_major else (NB, 2, BS, NH, HS)
    fmt = F.NL_X_TWO_NB_BS_NH_HS if vllm_two_major else F.NL_X_NB_TWO_BS_NH_HS
    src, dst = _random(_dev(shape)), _poison(_dev(shape))
    slots = _slots(T, NB * BS)
    buf = _poison(_dev((T, 2, NH * HS) if token_major else (2, T, NH * HS)))
    ops.single_layer_kv_transfer(buf, src, slots, True, token_major, vllm_two_major)
    for t, s in enumerate(slots.tolist()):
        for k in range(2):
            got = _u8(buf)[t, k] if token_major else _u8(buf)[k, t]
            assert torch.equal(got, _slot(fmt, src, k, s).reshape(-1))
    ops.single_layer_kv_transfer(buf, dst, slots, False, token_major, vllm_two_major)
    for s in range(NB * BS):
        for k in range(2):
            want = _slot(fmt, src, k, s) if s in slots.tolist() else torch.full_like(_slot(fmt, dst, k, s), POISON)
            assert torch.equal(_slot(fmt, dst, k, s), want)


# -- single_layer_kv_transfer: every format ---------------------------------------------------

@pytest.mark.parametrize("direction", [D2H, H2D])
@pytest.mark.parametrize("token_major", [True, False])
@pytest.mark.parametrize("fmt", sorted(int(f) for f in ops.SINGLE_LAYER_FORMATS))
def test_single_layer_every_format(fmt: int, token_major: bool, direction: int,
                                   host: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
    mla = fmt == F.NL_X_NB_BS_HS
    if mla and token_major:
        pytest.skip("MLA has one [T, HS] form")
    item, buffered = _item(fmt), T + 2  # a buffer longer than the slots: only the first T move
    shape = (buffered, item) if mla else (buffered, 2, item) if token_major else (2, buffered, item)
    cache, buf = _dev(_cache_shape(fmt)), host(shape)
    slots = _slots(T, NB * BS, pad=(1,))
    if direction == D2H:
        _random(cache)
        _poison(buf)
    else:
        _poison(cache)
        _random(buf)
    want_buf, want_cache = _u8(buf).clone(), _u8(cache).clone()
    for t, s in enumerate(slots.tolist()):
        for k in range(1 if mla else 2):
            token = want_buf[t] if mla else want_buf[t, k] if token_major else want_buf[k, t]
            if s < 0:
                continue
            if direction == D2H:
                token.copy_(_slot(fmt, cache, k, s).reshape(-1))
            else:
                target = _slot(fmt, want_cache, k, s)
                target.copy_(token.view(target.shape))
    ops.single_layer_kv_transfer(buf, cache, slots, direction, fmt, token_major)
    assert torch.equal(_u8(buf), want_buf)
    assert torch.equal(_u8(cache), want_cache)


# -- multi_layer_kv_transfer_unilateral and the flash ops -------------------------------------

@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize("direction", [D2H, H2D])
def test_unilateral_sglang_kv_lists(direction: int, legacy: bool) -> None:
    ks = [_dev((NB * BS, NH, HS)) for _ in range(L)]
    vs = [_dev((NB * BS, NH, HS)) for _ in range(L)]
    mem = _dev((2, L, T, NH * HS))
    for buf in ks + vs if direction == D2H else [mem]:
        _random(buf)
    for buf in [mem] if direction == D2H else ks + vs:
        _poison(buf)
    before = [_u8(buf).clone() for buf in ks + vs]
    slots = _slots(T, NB * BS, pad=(0,))
    fmt: object = False if legacy else F.TWO_X_NL_X_NBBS_NH_HS
    mem_before = _u8(mem).clone()
    ops.multi_layer_kv_transfer_unilateral(mem, _ptrs(ks + vs), slots, DEV, NB * BS,
                                           bool(direction) if legacy else direction, fmt)  # type: ignore[arg-type]
    for k, buffers in enumerate((ks, vs)):
        for layer, b in enumerate(buffers):
            rows = _u8(b).view(NB * BS, -1)
            for t, s in enumerate(slots.tolist()):
                if direction == D2H:
                    want = rows[s] if s >= 0 else torch.full_like(rows[0], POISON)
                    assert torch.equal(_u8(mem)[k, layer, t], want)
                elif s >= 0:
                    assert torch.equal(rows[s], mem_before[k, layer, t])
            if direction == H2D:
                untouched = [s for s in range(NB * BS) if s not in slots.tolist()]
                assert torch.equal(rows[untouched], before[k * L + layer].view(NB * BS, -1)[untouched])


def test_unilateral_mla_falls_back_to_multi_layer() -> None:
    caches = [_random(_dev((NB * BS, 1, HS))) for _ in range(L)]
    mem = _poison(_dev((1, L, T, HS)))
    slots = _slots(T, NB * BS)
    ops.multi_layer_kv_transfer_unilateral(mem, _ptrs(caches), slots, DEV, NB * BS, D2H, F.NL_X_NBBS_ONE_HS)
    for layer in range(L):
        assert torch.equal(_u8(mem)[0, layer], _u8(caches[layer]).view(NB * BS, -1)[slots])


def test_flash_ops_round_trip(host: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
    keys = [_random(_dev((NB, BS, NH, HS))) for _ in range(L)]
    values = [_random(_dev((NB, BS, NH, HS))) for _ in range(L)]
    mem = _poison(host((2, L, T, NH * HS)))
    slots = _slots(T, NB * BS, pad=(4,))
    for layer in range(L):
        ops.load_and_reshape_flash(mem, keys[layer], values[layer], slots, layer)
    for layer in range(L):
        for k, caches in enumerate((keys, values)):
            rows = _u8(caches[layer]).view(NB * BS, -1)
            for t, s in enumerate(slots.tolist()):
                want = rows[s] if s >= 0 else torch.full_like(rows[0], POISON)
                assert torch.equal(_u8(mem)[k, layer, t], want)
    new_k = [_poison(_dev((NB, BS, NH, HS))) for _ in range(L)]
    new_v = [_poison(_dev((NB, BS, NH, HS))) for _ in range(L)]
    for layer in range(L):
        ops.reshape_and_cache_back_flash(mem, new_k[layer], new_v[layer], slots, layer)
    kept = [s for s in slots.tolist() if s >= 0]
    for old, new in zip(keys + values, new_k + new_v):
        o, n = _u8(old).view(NB * BS, -1), _u8(new).view(NB * BS, -1)
        assert torch.equal(n[kept], o[kept])
        rest = [s for s in range(NB * BS) if s not in kept]
        assert torch.equal(n[rest], torch.full_like(n[rest], POISON))


# -- cached tables follow the engine's pointer table ------------------------------------------

def test_rewritten_pointer_table_moves_to_the_new_caches() -> None:
    first = [_random(_dev((2, NB, BS, NH, HS))) for _ in range(L)]
    second = [_random(_dev((2, NB, BS, NH, HS))) for _ in range(L)]
    ptrs = _ptrs(first)
    mem = _poison(_dev((2, L, 1, NH * HS)))
    slot = torch.tensor([5])
    ops.multi_layer_kv_transfer(mem, ptrs, slot, DEV, NB * BS, D2H, 1, BS)
    ops.multi_layer_kv_transfer(mem, ptrs, slot, DEV, NB * BS, D2H, 1, BS)  # the cached tables again
    assert torch.equal(_u8(mem)[:, 1, 0], _u8(first[1]).view(2, NB * BS, -1)[:, 5])
    ptrs.copy_(_ptrs(second))  # the engine reallocated its caches and rewrote the table in place
    ops.multi_layer_kv_transfer(mem, ptrs, slot, DEV, NB * BS, D2H, 1, BS)
    assert torch.equal(_u8(mem)[:, 1, 0], _u8(second[1]).view(2, NB * BS, -1)[:, 5])


# -- bad arguments: typed errors, nothing written ---------------------------------------------

@pytest.fixture
def mha() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Layer caches (format 1), a poisoned memory object and its slots, for D2H error cases."""
    caches = [_random(_dev((2, NB, BS, NH, HS))) for _ in range(L)]
    return caches, _poison(_dev((2, L, T, NH * HS))), _slots(T, NB * BS)


def _refused(exc: type[Exception], match: str, call: Callable[[], None], watched: list[torch.Tensor]) -> None:
    before = _snapshot(watched)
    with pytest.raises(exc, match=match):
        call()
    assert _unchanged(watched, before), "a refused call wrote"


BAD_MULTI: list[tuple[str, type[Exception], str]] = [
    ("int32 slots", errors.IndexValidationError, r"slot_mapping: dtype torch.int32"),
    ("2-D slots", errors.IndexValidationError, r"slot_mapping: shape \(1, 5\)"),
    ("short slots", errors.IndexValidationError, r"4 slots for the 5 tokens"),
    ("slot past the cache", errors.IndexValidationError, r"slot_mapping\[3\]: slot 12 outside \[0, 12\)"),
    ("skip past the tokens", errors.IndexValidationError, r"skip_prefix_n_tokens: 6"),
    ("K only memory object", errors.LayoutError, r"key_value: shape \(1, 2, 5, 16\)"),
    ("strided memory object", errors.NonContiguousError, r"key_value: .* not contiguous"),
    ("float pointer table", errors.InvalidTypeError, r"key_value_ptrs: dtype torch.float64"),
    ("one pointer short", errors.LayoutError, r"key_value_ptrs: shape \(1,\), expected \[2\]"),
    ("unknown address", errors.NotRegisteredError, r"key_value_ptrs\[1\]"),
    ("reach past the allocation", errors.RegistrationSpanError, r"key_value_ptrs\[0\]: .* past the end"),
    ("host memory as a layer", errors.DomainError, r"key_value_ptrs\[1\]: lies in registered host memory"),
    ("caches of another device", errors.DeviceMismatchError, r"key_value_ptrs\[0\]"),
    ("slots in another device's memory", errors.DeviceMismatchError, r"slot_mapping: memory of emulated:1"),
    ("unregistered host memory object", errors.DomainError, r"key_value.*unregistered host memory"),
    ("direction 2", errors.InvalidArgumentError, r"direction: found 2"),
    ("direction str", errors.InvalidTypeError, r"direction: found 'D2H'"),
    ("format 4", errors.InvalidArgumentError, r"TWO_X_NL_X_NBBS_NH_HS \(4\) is not a format"),
    ("format 8", errors.InvalidArgumentError, r"NB_NL_TWO_NH_BS_HS \(8\) is not a format"),
    ("format 99", errors.InvalidArgumentError, r"engine_kv_format: found 99"),
    ("no block_size", errors.InvalidArgumentError, r"block_size: found 0"),
    ("no page_buffer_size", errors.InvalidArgumentError, r"page_buffer_size: found 0"),
    ("bool page_buffer_size", errors.InvalidTypeError, r"page_buffer_size: found True"),
    ("negative block_size", errors.InvalidArgumentError, r"block_size: found -4"),
    ("legacy with block_size", errors.InvalidArgumentError, r"legacy call shape"),
    ("legacy with fewer slots", errors.IndexValidationError, r"legacy kernel needs one slot per token"),
    ("bad device", errors.InvalidTypeError, r"paged_memory_device: found a int"),
]


@pytest.mark.parametrize("case", [c[0] for c in BAD_MULTI])
def test_multi_layer_refuses(case: str, mha: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor],
                             host: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
    caches, mem, slots = mha
    exc, match = next((e, m) for name, e, m in BAD_MULTI if name == case)
    ptrs, device, pbs, direction, fmt, bs, skip = _ptrs(caches), DEV, NB * BS, D2H, 1, BS, 0
    kv: torch.Tensor = mem
    extra: list[torch.Tensor] = []
    if case == "int32 slots":
        slots = slots.to(torch.int32)
    elif case == "2-D slots":
        slots = slots.view(1, T)
    elif case == "short slots":
        slots = slots[:4]
    elif case == "slot past the cache":
        slots = slots.clone()
        slots[3] = NB * BS
    elif case == "skip past the tokens":
        skip = T + 1
    elif case == "K only memory object":
        kv = mem[:1]
    elif case == "strided memory object":
        kv = _poison(_dev((2, L, 2 * T, NH * HS)))[:, :, ::2]
    elif case == "float pointer table":
        ptrs = ptrs.to(torch.float64)
    elif case == "one pointer short":
        ptrs = ptrs[:1]
    elif case == "unknown address":
        ptrs[1] = 0x1234000
    elif case == "reach past the allocation":
        pbs = NB * BS + BS  # one block more than the caches hold
    elif case == "host memory as a layer":
        fake = _random(host((2, NB, BS, NH, HS)))
        extra.append(fake)
        ptrs[1] = fake.data_ptr()
    elif case == "caches of another device":
        other = [_random(_dev((2, NB, BS, NH, HS), OTHER)) for _ in range(L)]
        extra += other
        ptrs = _ptrs(other)
    elif case == "slots in another device's memory":
        far = pd.device_empty((T,), dtype=torch.int64, device=OTHER)
        far.copy_(slots)
        slots = far
    elif case == "unregistered host memory object":
        kv = _poison(torch.empty((2, L, T, NH * HS), dtype=DTYPE))
        extra.append(kv)
    elif case == "direction 2":
        direction = 2
    elif case == "direction str":
        direction = "D2H"  # type: ignore[assignment]
    elif case == "format 4":
        fmt = F.TWO_X_NL_X_NBBS_NH_HS
    elif case == "format 8":
        fmt = F.NB_NL_TWO_NH_BS_HS
    elif case == "format 99":
        fmt = 99
    elif case == "no block_size":
        bs = 0
    elif case == "no page_buffer_size":
        pbs = 0
    elif case == "bool page_buffer_size":
        pbs = True
    elif case == "negative block_size":
        bs = -4
    elif case == "legacy with block_size":
        fmt = False
    elif case == "legacy with fewer slots":
        fmt, bs = False, 0
        slots = torch.cat([slots, torch.tensor([0])])
    elif case == "bad device":
        device = 0  # type: ignore[assignment]
    watched = [mem, kv, *caches, *extra]
    _refused(exc, match, lambda: ops.multi_layer_kv_transfer(kv, ptrs, slots, device, pbs, direction, fmt, bs, 0,
                                                             skip), watched)


def test_hnd_and_fused_need_head_size(mha: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]) -> None:
    caches, mem, slots = mha
    for fmt in (F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS):
        _refused(errors.InvalidArgumentError, r"head_size: found 0",
                 lambda: ops.multi_layer_kv_transfer(mem, _ptrs(caches), slots, DEV, NB * BS, D2H, fmt, BS),
                 [mem, *caches])
        _refused(errors.LayoutError, r"head_size: 5 does not divide",
                 lambda: ops.multi_layer_kv_transfer(mem, _ptrs(caches), slots, DEV, NB * BS, D2H, fmt, BS, 5),
                 [mem, *caches])
    fused = _poison(_dev((1, L, T, NH * HS)))
    _refused(errors.InvalidArgumentError, r"head_size: found 0",
             lambda: ops.multi_layer_kv_transfer(fused, _ptrs(caches), slots, DEV, NB * BS, D2H, 10, BS),
             [fused, *caches])
    _refused(errors.InvalidArgumentError, r"not a whole number of blocks",
             lambda: ops.multi_layer_kv_transfer(mem, _ptrs(caches), slots, DEV, NB * BS - 1, D2H, 2, BS),
             [mem, *caches])


BAD_SINGLE: list[tuple[str, type[Exception], str]] = [
    ("cache in host memory", errors.DomainError, r"vllm_key_value_cache: host memory"),
    ("dtype mismatch", errors.InvalidTypeError, r"lmc_key_value_cache: dtype torch.float16"),
    ("wrong cache shape", errors.LayoutError, r"vllm_key_value_cache: shape \(3, 2, 4, 2, 8\), expected \[2, NB"),
    ("wrong buffer shape", errors.LayoutError, r"lmc_key_value_cache: shape \(5, 2, 16\), expected \[2, T, 16\]"),
    ("more slots than tokens", errors.IndexValidationError, r"6 slots, lmc_key_value_cache holds 5"),
    ("slot past the cache", errors.IndexValidationError, r"slot_mapping\[0\]: slot 99 outside"),
    ("format 0", errors.InvalidArgumentError, r"NB_NL_TWO_BS_NH_HS \(0\) is not a format"),
    ("legacy without vllm_two_major", errors.InvalidArgumentError, r"vllm_two_major: missing"),
    ("token_major not a bool", errors.InvalidTypeError, r"token_major: found 1"),
    ("strided buffer", errors.NonContiguousError, r"lmc_key_value_cache: .* not contiguous"),
]


@pytest.mark.parametrize("case", [c[0] for c in BAD_SINGLE])
def test_single_layer_refuses(case: str, host: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
    exc, match = next((e, m) for name, e, m in BAD_SINGLE if name == case)
    cache = _random(_dev((2, NB, BS, NH, HS)))
    buf = _poison(_dev((2, T, NH * HS)))
    slots = _slots(T, NB * BS)
    fmt: object = F.NL_X_TWO_NB_BS_NH_HS
    token_major: object = False
    watched = [cache, buf]
    if case == "cache in host memory":
        cache = _random(host((2, NB, BS, NH, HS)))
        watched.append(cache)
    elif case == "dtype mismatch":
        buf = _poison(pd.device_empty((2, T, NH * HS), dtype=torch.float16, device=DEV))
        watched.append(buf)
    elif case == "wrong cache shape":
        cache = _random(_dev((NB, 2, BS, NH, HS)))
        watched.append(cache)
    elif case == "wrong buffer shape":
        buf = _poison(_dev((T, 2, NH * HS)))
        watched.append(buf)
    elif case == "more slots than tokens":
        slots = _slots(T + 1, NB * BS)
    elif case == "slot past the cache":
        slots[0] = 99
    elif case == "format 0":
        fmt = 0
    elif case == "legacy without vllm_two_major":
        fmt, token_major = False, None
    elif case == "token_major not a bool":
        token_major = 1
    elif case == "strided buffer":
        buf = _poison(_dev((2, 2 * T, NH * HS)))[:, ::2]
        watched.append(buf)
    _refused(exc, match, lambda: ops.single_layer_kv_transfer(buf, cache, slots, D2H, fmt,  # type: ignore[arg-type]
                                                              token_major), watched)  # type: ignore[arg-type]


def test_flash_ops_refuse(host: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
    k, v = _random(_dev((NB, BS, NH, HS))), _random(_dev((NB, BS, NH, HS)))
    mem = _poison(_dev((2, L, T, NH * HS)))
    slots = _slots(T, NB * BS)
    watched = [k, v, mem]
    _refused(errors.IndexValidationError, r"layer_idx: 2 outside \[0, 2\)",
             lambda: ops.load_and_reshape_flash(mem, k, v, slots, L), watched)
    _refused(errors.LayoutError, r"value_cache: \(3, 4, 2, 4\)",
             lambda: ops.load_and_reshape_flash(mem, k, _dev((NB, BS, NH, HS // 2)), slots, 0), watched)
    hv = _random(host((NB, BS, NH, HS)))
    _refused(errors.DomainError, r"value_cache: host memory",
             lambda: ops.reshape_and_cache_back_flash(mem, k, hv, slots, 0), [*watched, hv])
    far = _random(_dev((NB, BS, NH, HS), OTHER))
    _refused(errors.DeviceMismatchError, r"value_cache: memory of emulated:1",
             lambda: ops.reshape_and_cache_back_flash(mem, k, far, slots, 0), [*watched, far])
    _refused(errors.InvalidTypeError, r"layer_idx: found True",
             lambda: ops.load_and_reshape_flash(mem, k, v, slots, True), watched)


def test_unilateral_refuses(mha: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]) -> None:
    caches, mem, slots = mha
    ks = [_random(_dev((NB * BS, NH, HS))) for _ in range(2 * L)]
    _refused(errors.LayoutError, r"key_value_ptrs: shape \(2,\), expected \[4\]",
             lambda: ops.multi_layer_kv_transfer_unilateral(mem, _ptrs(ks[:2]), slots, DEV, NB * BS, D2H, 4),
             [mem, *ks])
    _refused(errors.IndexValidationError, r"one slot per token",
             lambda: ops.multi_layer_kv_transfer_unilateral(mem, _ptrs(ks), slots[:3], DEV, NB * BS, D2H, 4),
             [mem, *ks])
    _refused(errors.RegistrationSpanError, r"key_value_ptrs\[0\]",
             lambda: ops.multi_layer_kv_transfer_unilateral(mem, _ptrs(ks), slots, DEV, NB * BS + 1, D2H, 4),
             [mem, *ks])


# -- on a GPU: upstream's own call shapes (tests/v1/test_mem_kernels.py), smaller -------------

def _cuda_caches(count: int, shape: tuple[int, ...],
                 fill: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    return [fill(torch.empty(shape, dtype=DTYPE, device="cuda")) for _ in range(count)]


def _pinned(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=DTYPE, pin_memory=True)  # pinned by the runtime, not registered here


@pytest.mark.gpu
@pytest.mark.parametrize("table_on", ["pinned", "cuda"])
def test_gpu_multi_layer_kernel_as_upstream(table_on: str) -> None:
    layers, blocks, bs, heads, hs, chunk = 4, 64, 16, 8, 128, 256
    caches = _cuda_caches(layers, (2, blocks, bs, heads, hs), _random)
    slots = torch.tensor(random.Random(0).sample(range(blocks * bs), 500), device="cuda")
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).pin_memory()
    if table_on == "cuda":
        ptrs = ptrs.to("cuda")
    objs = []
    for part in torch.split(slots, chunk):
        obj = _poison(_pinned((2, layers, len(part), heads * hs)))
        ops.multi_layer_kv_transfer(obj, ptrs, part, caches[0].device, blocks * bs, True, False)
        objs.append(obj)
    torch.cuda.synchronize()
    for obj, part in zip(objs, torch.split(slots.cpu(), chunk)):
        for layer in range(layers):
            assert torch.equal(_u8(obj)[:, layer], _u8(caches[layer]).view(2, blocks * bs, -1)[:, part].cpu())
    fresh = _cuda_caches(layers, (2, blocks, bs, heads, hs), _poison)
    fresh_ptrs = torch.tensor([c.data_ptr() for c in fresh], dtype=torch.int64).pin_memory()
    for obj, part in zip(objs, torch.split(slots, chunk)):  # the current call shape back
        ops.multi_layer_kv_transfer(obj, fresh_ptrs, part, fresh[0].device, blocks * bs, H2D,
                                    F.NL_X_TWO_NB_BS_NH_HS, bs)
    torch.cuda.synchronize()
    rest = torch.ones(blocks * bs, dtype=torch.bool)
    rest[slots.cpu()] = False
    for old, new in zip(caches, fresh):
        o, n = _u8(old).view(2, blocks * bs, -1).cpu(), _u8(new).view(2, blocks * bs, -1).cpu()
        assert torch.equal(n[:, slots.cpu()], o[:, slots.cpu()])
        assert bool((n[:, rest] == POISON).all())


@pytest.mark.gpu
def test_gpu_multi_layer_mla_and_padding() -> None:
    layers, blocks, bs, hs = 3, 32, 64, 576
    caches = _cuda_caches(layers, (blocks, bs, hs), _random)
    slots = torch.tensor(random.Random(1).sample(range(blocks * bs), 300), device="cuda")
    slots[7] = -1
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).pin_memory()
    obj = _poison(_pinned((1, layers, 300, hs)))
    ops.multi_layer_kv_transfer(obj, ptrs, slots, caches[0].device, 0, True, True)  # upstream's MLA: 0 slots
    torch.cuda.synchronize()
    s = slots.cpu()
    for layer in range(layers):
        rows = _u8(caches[layer]).view(blocks * bs, -1).cpu()
        got = _u8(obj)[0, layer]
        keep = s >= 0
        assert torch.equal(got[keep], rows[s[keep]])
        assert bool((got[7] == POISON).all())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", sorted(int(f) for f in ops.SINGLE_LAYER_FORMATS))
def test_gpu_single_layer(fmt: int) -> None:
    d = Dims(16, 16, 8, 128)
    cache = _cuda_caches(1, _cache_shape(fmt, d), _random)[0]
    mla = fmt == F.NL_X_NB_BS_HS
    slots = torch.tensor(random.Random(2).sample(range(d.nb * d.bs), 40), device="cuda")
    slots[3] = -1
    item = _item(fmt, d)
    buf = _poison(torch.empty((40, item) if mla else (2, 40, item), dtype=DTYPE, device="cuda"))
    ops.single_layer_kv_transfer(buf, cache, slots, D2H, fmt)
    torch.cuda.synchronize()
    host_cache, host_buf = cache.cpu(), buf.cpu()
    for t, s in enumerate(slots.tolist()):
        for k in range(1 if mla else 2):
            got = _u8(host_buf)[t] if mla else _u8(host_buf)[k, t]
            want = _slot(fmt, host_cache, k, s, d).reshape(-1) if s >= 0 else torch.full_like(got, POISON)
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_refusals_write_nothing() -> None:
    caches = _cuda_caches(2, (2, 8, 16, 2, 64), _random)
    slots = torch.arange(4, device="cuda")
    obj = _poison(_pinned((2, 2, 4, 128)))
    host_layer = _random(_pinned((2, 8, 16, 2, 64)))
    cases: list[tuple[type[Exception], str, torch.Tensor, torch.Tensor]] = [
        (errors.DomainError, r"key_value_ptrs\[1\]: lies in pinned host memory",
         torch.tensor([caches[0].data_ptr(), host_layer.data_ptr()]), slots),
        (errors.NotRegisteredError, r"key_value_ptrs\[0\]", torch.tensor([12345 << 12, caches[1].data_ptr()]), slots),
        (errors.IndexValidationError, r"slot_mapping\[2\]: slot 128 outside",
         torch.tensor([c.data_ptr() for c in caches]), torch.tensor([0, 1, 128, 3], device="cuda")),
    ]
    before = _snapshot([obj, *caches])
    for exc, match, ptrs, s in cases:
        with pytest.raises(exc, match=match):
            ops.multi_layer_kv_transfer(obj, ptrs, s, "cuda:0", 128, D2H, 1, 16)
    torch.cuda.synchronize()
    assert _unchanged([obj, *caches], before)


# -- graph capture ----------------------------------------------------------------------------
# Not capturable: the slots are read on the host and turned into the cache's indices there, so
# a replay would use the capture's slots; a launch reading slot_mapping itself would take its
# padding (-1, skipped upstream) for slots out of range. Refused whether or not the call shape
# was prepared by an earlier call, nothing written, nothing recorded.

@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS])
@pytest.mark.parametrize("prepared", [False, True], ids=["first", "repeat"])
def test_calls_are_refused_during_capture_and_write_nothing(fmt: int, prepared: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from pointerdomain import _platform
    from pointerdomain.compat import _raw
    from pointerdomain.testing import EmulatedGraph

    # a device free drops prepared calls over raw addresses on the emulated device (CUDA's
    # backend sees none): held still so that the repeat is a prepared one, as on CUDA
    monkeypatch.setattr(_raw, "memory_generation", lambda: 0)
    monkeypatch.setattr(_platform, "generation_count", lambda: 0)
    kv = _kv_size(fmt)
    caches = [_poison(_dev(_cache_shape(fmt))) for _ in range(L)]
    mem = _random(_dev((kv, L, T, _item(fmt))))
    ptrs, slots = _ptrs(caches), _slots(T, NB * BS)
    if prepared:
        ops.multi_layer_kv_transfer(mem, ptrs, slots, DEV, NB * BS, H2D, fmt, BS, HS)
        for c in caches:
            _poison(c)
    before = _snapshot(caches)
    graph = EmulatedGraph()
    with graph.capture(DEV), pytest.raises(errors.InvalidArgumentError, match="not capturable"):
        ops.multi_layer_kv_transfer(mem, ptrs, slots, DEV, NB * BS, H2D, fmt, BS, HS)
    assert graph.launches == []
    graph.replay()
    assert _unchanged(caches, before)
    graph.reset()


# -- block_size where the format does not address by blocks -----------------------------------

@pytest.mark.parametrize("direction", [D2H, H2D])
@pytest.mark.parametrize("fmt", [F.NB_NL_TWO_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS])
def test_block_size_not_dividing_accepted_where_unused(fmt: int, direction: int) -> None:
    # formats 0 and 1 place slot s at s * E (V after page_buffer_size slots) and MLA format 3 at
    # s * E: upstream's kernels never read block_size there and it checks no divisibility, so
    # a block_size that does not divide page_buffer_size moves the same bytes as the true one
    kv, item = _kv_size(fmt), _item(fmt)
    caches = [_dev(_cache_shape(fmt)) for _ in range(L)]
    mem = _dev((kv, L, T, item))
    slots = _slots(T, NB * BS)
    src, dst = (caches, [mem]) if direction == D2H else ([mem], caches)
    for t in src:
        _random(t)
    for t in dst:
        _poison(t)
    want_mem, want_caches = _u8(mem).clone(), [_u8(c).clone() for c in caches]
    for layer, cache in enumerate(caches):
        for k in range(kv):
            for t, s in enumerate(slots.tolist()):
                if direction == D2H:
                    want_mem[k, layer, t].copy_(_slot(fmt, cache, k, s).reshape(-1))
                else:
                    target = _slot(fmt, want_caches[layer], k, s)
                    target.copy_(want_mem[k, layer, t].view(target.shape))
    assert (NB * BS) % 5
    ops.multi_layer_kv_transfer(mem, _ptrs(caches), slots, DEV, NB * BS, direction, fmt, 5, HS)
    assert torch.equal(_u8(mem), want_mem)
    for cache, want in zip(caches, want_caches):
        assert torch.equal(_u8(cache), want)


@pytest.mark.parametrize("fmt", [F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS,
                                 F.NL_X_NB_NH_BS_TWO_HS])
def test_block_size_not_dividing_refused_where_blocks_are_addressed(fmt: int) -> None:
    kv, item = _kv_size(fmt), _item(fmt)
    caches = [_poison(_dev(_cache_shape(fmt))) for _ in range(L)]
    mem = _random(_dev((kv, L, T, item)))
    before = _snapshot(caches)
    with pytest.raises(errors.InvalidArgumentError, match=r"page_buffer_size: 12 slots is not a whole number of "
                                                          r"blocks of 5"):
        ops.multi_layer_kv_transfer(mem, _ptrs(caches), _slots(T, NB * BS), DEV, NB * BS, H2D, fmt, 5, HS)
    assert _unchanged(caches, before)


@pytest.mark.parametrize("trailing_rows", [0, 1, 9])
def test_legacy_mla_layers_inside_one_allocation_hold_up_to_the_next_layer(trailing_rows: int) -> None:
    """Upstream's MLA callers pass page_buffer_size 0; per-layer caches inside one
    allocation (a caching allocator's segment, spare rows after the last layer): each layer
    holds up to the next one, so the load is accepted and byte-exact, and a slot past a
    layer's own rows is refused instead of reading the next layer's."""
    layers_n, blocks, block, hs, tokens = 3, 4, 4, 16, 5
    p = blocks * block
    seg = pd.device_empty((layers_n * p + trailing_rows, hs), torch.bfloat16, DEV)
    seg.view(torch.uint8).fill_(0xA5)
    layers = [seg[i * p:(i + 1) * p].view(blocks, block, hs) for i in range(layers_n)]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    mem = pd.device_empty((1, layers_n, tokens, hs), torch.bfloat16, DEV)
    mem.view(torch.uint8).copy_(torch.randint(0, 256, (1, layers_n, tokens, hs * 2), dtype=torch.uint8))
    slots = torch.tensor([0, 3, 5, p - 1, 7])
    ops.multi_layer_kv_transfer(mem, ptrs, slots, DEV, 0, False, True)  # H2D, the legacy use_mla shape
    for i in range(layers_n):
        assert torch.equal(layers[i].reshape(p, hs)[slots].view(torch.uint8), mem[0, i].view(torch.uint8))
    before = seg.clone()
    with pytest.raises(errors.IndexValidationError, match="outside"):
        ops.multi_layer_kv_transfer(mem, ptrs, torch.tensor([0, 1, 2, 3, p]), DEV, 0, True, True)  # D2H past a layer
    assert torch.equal(seg.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("page_buffer_size", [0, 16])
def test_layers_sharing_one_cache_read_back_but_are_not_written_twice(page_buffer_size: int) -> None:
    """Cross-layer KV sharing (one cache named by two layers): a device-to-host read of it
    is accepted and byte-exact whatever page_buffer_size says; a host-to-device write would
    write that cache twice and is refused."""
    layers_n, blocks, block, hs, tokens = 3, 4, 4, 16, 5
    caches = [pd.device_empty((blocks, block, hs), torch.bfloat16, DEV) for _ in range(2)]
    for k, c in enumerate(caches):
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8,
                                                generator=torch.Generator().manual_seed(k)))
    named = [caches[0], caches[1], caches[0]]
    ptrs = torch.tensor([c.data_ptr() for c in named], dtype=torch.int64)
    mem = pd.device_empty((1, layers_n, tokens, hs), torch.bfloat16, DEV)
    slots = torch.tensor([0, 3, 5, 15, 7])
    ops.multi_layer_kv_transfer(mem, ptrs, slots, DEV, page_buffer_size, True, True)  # D2H
    for i, c in enumerate(named):
        assert torch.equal(mem[0, i].view(torch.uint8), c.reshape(-1, hs)[slots].view(torch.uint8))
    with pytest.raises(errors.OverlapError):
        ops.multi_layer_kv_transfer(mem, ptrs, slots, DEV, page_buffer_size, False, True)  # H2D: c0 twice
