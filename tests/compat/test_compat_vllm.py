"""vLLM's swap_blocks / swap_blocks_batch call shapes (pointerdomain.compat.vllm) on the
emulated device: exact bytes against plain torch in every direction, untouched bytes
kept, and every bad argument a typed error before anything is written."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import vllm as ops
from pointerdomain.registration.memory import open_registrations

DEV = pd.validate_device("emulated:0")
POISON = 0xA5
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(params=["one chunk", "chunked"])
def host_alloc(request: pytest.FixtureRequest) -> Iterator[Callable[[tuple[int, ...], torch.dtype], torch.Tensor]]:
    """Registered host tensors of a shape and dtype (each its own registration); "chunked":
    registered in chunks of two blocks (dimension 0), each chunk with its own device alias."""
    owners: list[pd.RegisteredHostMemory] = []

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if request.param == "chunked" and len(shape) > 1 and shape[0] > 2:
            block = nbytes // shape[0]
            mem = pd.alloc_registered(nbytes, DEV, granularity=block, max_chunk_bytes=2 * block)
            assert len(mem.chunks) > 1
        else:
            mem = pd.alloc_registered(nbytes, DEV)
        owners.append(mem)
        return mem.tensor[:nbytes].view(dtype).view(shape)

    yield make
    for mem in owners:
        mem.close()


def _random_fill(t: torch.Tensor) -> None:
    raw = t.view(torch.uint8)  # contiguous tensors only
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))


def _poison(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(POISON)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).clone()


def _make(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
          host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> torch.Tensor:
    return pd.device_empty(shape, dtype=dtype, device=DEV) if kind == "device" else host_alloc(shape, dtype)


DIRECTIONS = [("device", "host"), ("host", "device"), ("device", "device")]


# -- swap_blocks ----------------------------------------------------------------------

# upstream's caches (tests/kernels/attention/test_cache.py, kv_cache_factory): key
# [num_blocks, num_heads, head_size // x, block_size, x], value [num_blocks, num_heads, head_size, block_size]
NUM_BLOCKS, HEADS, HEAD, BLOCK = 12, 2, 16, 4


def _cache_shapes(dtype: torch.dtype) -> list[tuple[int, ...]]:
    x = 16 // torch.empty((), dtype=dtype).element_size()
    return [(NUM_BLOCKS, HEADS, HEAD // x, BLOCK, x), (NUM_BLOCKS, HEADS, HEAD, BLOCK)]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_copies_exactly_the_mapped_blocks(
    direction: tuple[str, str], dtype: torch.dtype, host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    rng = random.Random(7)
    for shape in _cache_shapes(dtype):
        src = _make(direction[0], shape, dtype, host_alloc)
        dst = _make(direction[1], shape, dtype, host_alloc)
        _random_fill(src)
        _poison(dst)
        src_before, want = src.clone(), dst.clone()
        src_blocks = rng.sample(range(NUM_BLOCKS), 5)
        dst_blocks = rng.sample(range(NUM_BLOCKS), 5)
        mapping = torch.tensor(list(zip(src_blocks, dst_blocks)), dtype=torch.int64).view(-1, 2)
        for s, d in zip(src_blocks, dst_blocks):
            want[d] = src_before[s]
        # upstream's call shape: block size = element_size() * stride(0)
        ops.swap_blocks(src, dst, src.element_size() * src.stride(0), mapping)
        assert torch.equal(_bytes(dst), _bytes(want))  # mapped blocks exact, every other byte still poison
        assert torch.equal(_bytes(src), _bytes(src_before))


def test_swap_blocks_under_inference_mode_with_strided_mapping(
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    # upstream's test runs under torch.inference_mode(); the kernel honours block_mapping's strides
    src = pd.device_empty((6, 32), dtype=torch.float32, device=DEV)
    dst = host_alloc((6, 32), torch.float32)
    with torch.inference_mode():
        _random_fill(src)
        _poison(dst)
        want = dst.clone()
        pairs = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int64).t()  # [3, 2], strides (1, 3)
        assert not pairs.is_contiguous()
        for s, d in pairs.tolist():
            want[d] = src[s]
        ops.swap_blocks(src, dst, 128, pairs)
    assert torch.equal(_bytes(dst), _bytes(want))


def test_swap_blocks_host_tensor_registered_in_place() -> None:
    host = torch.empty((8, 64), dtype=torch.uint8)
    _poison(host)
    mem = pd.register_host_tensor(host, DEV)
    try:
        src = pd.device_empty((4, 64), dtype=torch.uint8, device=DEV)
        _random_fill(src)
        ops.swap_blocks(src, host, 64, torch.tensor([[3, 7], [0, 2]], dtype=torch.int64))
        want = torch.full((8, 64), POISON, dtype=torch.uint8)
        want[7], want[2] = src[3], src[0]
        assert torch.equal(host, want)
    finally:
        mem.close()


def test_swap_blocks_inside_one_tensor() -> None:
    t = pd.device_empty((8, 16), dtype=torch.int32, device=DEV)
    _random_fill(t)
    want = t.clone()
    want[5], want[6] = t[0].clone(), t[1].clone()
    ops.swap_blocks(t, t, 64, torch.tensor([[0, 5], [1, 6]], dtype=torch.int64))  # disjoint: defined
    assert torch.equal(t, want)
    with pytest.raises(errors.OverlapError):  # block 5 read and written by one call
        ops.swap_blocks(t, t, 64, torch.tensor([[5, 2], [3, 5]], dtype=torch.int64))
    assert torch.equal(t, want)


def test_swap_blocks_padded_rows_copy_the_whole_block(
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    # kv[:, 0] of a [num_blocks, 2, n] buffer: a block is stride(0) bytes, K and V (as upstream)
    kv = pd.device_empty((5, 2, 8), dtype=torch.float32, device=DEV)
    _random_fill(kv)
    out = host_alloc((5, 2, 8), torch.float32)
    _poison(out)
    want = out.clone()
    want[4] = kv[1]
    ops.swap_blocks(kv[:, 0], out[:, 0], 64, torch.tensor([[1, 4]], dtype=torch.int64))
    assert torch.equal(_bytes(out), _bytes(want))
    # kv[:, 1]: its last block would run 32 bytes past the storage
    before = _bytes(out)
    with pytest.raises(errors.LayoutError, match="past the end of its storage"):
        ops.swap_blocks(kv[:, 1], out[:, 0], 64, torch.tensor([[0, 0]], dtype=torch.int64))
    assert torch.equal(_bytes(out), before)


def _bad_swap(dst: torch.Tensor, call: Callable[[], None], error: type[Exception], match: str | None = None) -> None:
    before = _bytes(dst)
    with pytest.raises(error, match=match):
        call()
    assert torch.equal(_bytes(dst), before)  # nothing was written


def test_swap_blocks_bad_arguments_write_nothing(
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    src = pd.device_empty((6, 32), dtype=torch.bfloat16, device=DEV)
    _random_fill(src)
    dst = host_alloc((4, 32), torch.bfloat16)
    _poison(dst)
    ok = torch.tensor([[0, 0], [1, 1]], dtype=torch.int64)
    block = 64
    cases: list[tuple[Callable[[], None], type[Exception], str | None]] = [
        # block ids outside a tensor's [0, shape[0])
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[0, 1], [6, 2]])), errors.IndexValidationError,
         r"block_mapping\[1\]\[0\]: src block 6 outside \[0, 6\)"),
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[5, 4]])), errors.IndexValidationError,
         r"block_mapping\[0\]\[1\]: dst block 4"),
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[-1, 0]])), errors.IndexValidationError, "-1"),
        # block_mapping's dtype, shape, type, memory
        (lambda: ops.swap_blocks(src, dst, block, ok.to(torch.int32)), errors.IndexValidationError, "int32"),
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[0, 1, 2]])), errors.IndexValidationError,
         "num_pairs, 2"),
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([0, 1])), errors.IndexValidationError, None),
        (lambda: ops.swap_blocks(src, dst, block, [[0, 0]]), errors.InvalidTypeError, None),  # type: ignore[arg-type]
        (lambda: ops.swap_blocks(src, dst, block, pd.device_empty((1, 2), dtype=torch.int64, device=DEV)),
         errors.IndexValidationError, "host memory"),
        # the block size
        (lambda: ops.swap_blocks(src, dst, 0, ok), errors.InvalidArgumentError, None),
        (lambda: ops.swap_blocks(src, dst, -64, ok), errors.InvalidArgumentError, None),
        (lambda: ops.swap_blocks(src, dst, 64.0, ok), errors.InvalidTypeError, None),  # type: ignore[arg-type]
        (lambda: ops.swap_blocks(src, dst, True, ok), errors.InvalidTypeError, None),
        (lambda: ops.swap_blocks(src, dst, 32, ok), errors.LayoutError, "stride"),
        # two copies into one dst block
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[0, 2], [1, 3], [4, 2]])), errors.OverlapError,
         r"block_mapping\[0\] and block_mapping\[2\]"),
        # memory the copy may not use: both sides host memory (pageable src, registered dst)
        (lambda: ops.swap_blocks(torch.zeros(6, 32, dtype=torch.bfloat16), dst, block, ok), errors.DomainError,
         "both host memory"),
        (lambda: ops.swap_blocks(src.view(torch.uint8)[:, :0], dst, block, ok), errors.LayoutError, None),
        (lambda: ops.swap_blocks(src, "dst", block, ok), errors.InvalidTypeError, None),  # type: ignore[arg-type]
    ]
    for call, error, match in cases:
        _bad_swap(dst, call, error, match)
    other = pd.device_empty((4, 32), dtype=torch.bfloat16, device="emulated:1")
    _bad_swap(other, lambda: ops.swap_blocks(src, other, block, ok), errors.DeviceMismatchError)


def test_swap_blocks_empty_mapping_and_closed_memory() -> None:
    src = pd.device_empty((4, 16), dtype=torch.uint8, device=DEV)
    mem = pd.alloc_registered(64, DEV)
    dst = mem.tensor.view(4, 16)
    _poison(dst)
    ops.swap_blocks(src, dst, 16, torch.empty((0, 2), dtype=torch.int64))  # nothing to do
    assert bool((dst == POISON).all())
    mem.close()
    with pytest.raises(errors.ClosedError):
        ops.swap_blocks(src, dst, 16, torch.tensor([[0, 0]], dtype=torch.int64))


# -- swap_blocks with plain pageable host memory ---------------------------------------

PAGEABLE = [("device", "pageable"), ("pageable", "device")]


def _pageable_pair(direction: tuple[str, str], shape: tuple[int, ...], dtype: torch.dtype,
                   dst_shape: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst): one emulated device tensor, one plain torch.empty CPU tensor (pageable)."""
    def make(kind: str, shp: tuple[int, ...]) -> torch.Tensor:
        if kind == "device":
            return pd.device_empty(shp, dtype=dtype, device=DEV)
        return torch.empty(shp, dtype=dtype)

    return make(direction[0], shape), make(direction[1], dst_shape or shape)


def _registrations() -> int:
    return len(open_registrations())


@pytest.mark.parametrize("direction", PAGEABLE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_pageable_host_copies_exactly_the_mapped_blocks(direction: tuple[str, str],
                                                                    dtype: torch.dtype) -> None:
    rng = random.Random(11)
    for shape in _cache_shapes(dtype):
        src, dst = _pageable_pair(direction, shape, dtype)
        _random_fill(src)
        _poison(dst)
        src_before, want = src.clone(), dst.clone()
        pairs = list(zip(rng.sample(range(NUM_BLOCKS), 6), rng.sample(range(NUM_BLOCKS), 6)))
        for s, d in pairs:
            want[d] = src_before[s]
        registered = _registrations()
        ops.swap_blocks(src, dst, src.element_size() * src.stride(0),
                        torch.tensor(pairs, dtype=torch.int64).view(-1, 2))
        assert torch.equal(_bytes(dst), _bytes(want))  # mapped blocks exact, the rest still poison
        assert torch.equal(_bytes(src), _bytes(src_before))
        # nothing pinned or registered behind the caller's back
        assert _registrations() == registered
        host = dst if direction[1] == "pageable" else src
        assert pd.find_registration(pd.HostVA(host.data_ptr())) is None


@pytest.mark.parametrize("direction", PAGEABLE)
def test_swap_blocks_pageable_as_upstreams_test(direction: tuple[str, str]) -> None:
    # upstream's test_swap_blocks: caches made and swapped under inference_mode, plain CPU
    # caches, random distinct blocks, block size = element_size() * stride(0), strided mapping
    rng = random.Random(3)
    num_blocks, num_mappings = 40, 16
    with torch.inference_mode():
        caches = []
        for kind in direction:
            shape = (num_blocks, 2, 8, 4)
            t = pd.device_empty(shape, dtype=torch.float32, device=DEV) if kind == "device" else torch.empty(shape)
            t.uniform_(-1.0, 1.0)
            caches.append(t)
        src, dst = caches
        src_clone, dst_clone = src.clone(), dst.clone()
        pairs = list(zip(rng.sample(range(num_blocks), num_mappings), rng.sample(range(num_blocks), num_mappings)))
        mapping = torch.tensor(pairs, dtype=torch.int64).t().contiguous().t()  # [n, 2], strides (1, n)
        assert not mapping.is_contiguous()
        ops.swap_blocks(src, dst, src.element_size() * src.stride(0), mapping)
        for s, d in pairs:
            dst_clone[d] = src_clone[s]
        assert torch.equal(_bytes(dst), _bytes(dst_clone))
    # inference tensors written outside inference mode too (torch refuses an in-place write there)
    ops.swap_blocks(dst, src, 4 * 64, torch.tensor([[pairs[0][1], 0]], dtype=torch.int64))
    assert torch.equal(src[0], src_clone[pairs[0][0]])


@pytest.mark.parametrize("direction", PAGEABLE)
def test_swap_blocks_pageable_padded_rows_and_steps(direction: tuple[str, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # kv[:, 0] views (a block is stride(0) bytes, K and V), and staging in steps of 2 blocks
    monkeypatch.setattr(ops, "_STAGE_BYTES", 2 * 64)
    src, dst = _pageable_pair(direction, (9, 2, 8), torch.float32, (7, 2, 8))
    _random_fill(src)
    _poison(dst)
    want = dst.clone()
    pairs = [(8, 0), (1, 6), (4, 2), (0, 3), (7, 5)]
    for s, d in pairs:
        want[d] = src[s]
    ops.swap_blocks(src[:, 0], dst[:, 0], 64, torch.tensor(pairs, dtype=torch.int64))
    assert torch.equal(_bytes(dst), _bytes(want))


@pytest.mark.parametrize("direction", PAGEABLE)
def test_swap_blocks_pageable_bad_arguments_write_nothing(direction: tuple[str, str]) -> None:
    src, dst = _pageable_pair(direction, (6, 32), torch.bfloat16, (4, 32))
    _random_fill(src)
    _poison(dst)
    block = 64
    cases: list[tuple[Callable[[], None], type[Exception], str | None]] = [
        # every check runs before the first block is copied: a bad row after good ones
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[0, 1], [6, 2]])), errors.IndexValidationError,
         r"block_mapping\[1\]\[0\]: src block 6 outside \[0, 6\)"),
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[0, 0], [5, 4]])), errors.IndexValidationError,
         r"block_mapping\[1\]\[1\]: dst block 4"),
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[1, 1], [0, -1]])), errors.IndexValidationError,
         "-1"),
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[0, 2], [1, 3], [4, 2]])), errors.OverlapError,
         r"block_mapping\[0\] and block_mapping\[2\]"),
        (lambda: ops.swap_blocks(src, dst, 32, torch.tensor([[0, 0]])), errors.LayoutError, "stride"),
        (lambda: ops.swap_blocks(src, dst, block, torch.tensor([[0, 0]], dtype=torch.int32)),
         errors.IndexValidationError, "int32"),
        # blocks past the storage: the [:, 1] view of a [n, 2, 32] buffer (its last block, 128 bytes from
        # byte 320 of 384, would run 64 bytes past)
        (lambda: ops.swap_blocks(src.view(3, 2, 32)[:, 1], dst.view(2, 2, 32)[:, 0], 128, torch.tensor([[0, 0]])),
         errors.LayoutError, "past the end of its storage"),
    ]
    for call, error, match in cases:
        _bad_swap(dst, call, error, match)


def test_swap_blocks_registered_and_pageable_routes(
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = pd.device_empty((4, 64), dtype=torch.uint8, device=DEV)
    _random_fill(dev)
    mapping = torch.tensor([[3, 1]], dtype=torch.int64)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("wrong route")

    # registered host memory: the copy-engine transfer, never the torch copy
    monkeypatch.setattr(ops, "_copy_pageable", refuse)
    registered = host_alloc((4, 64), torch.uint8)
    _poison(registered)
    ops.swap_blocks(dev, registered, 64, mapping)
    assert torch.equal(registered[1], dev[3]) and bool((registered[0] == POISON).all())
    monkeypatch.undo()
    # pageable host memory: the torch copy, never a launch (it would need an alias)
    monkeypatch.setattr(pd, "transfer_kv_all_layer", refuse)
    pageable = torch.full((4, 64), POISON, dtype=torch.uint8)
    ops.swap_blocks(dev, pageable, 64, mapping)
    assert torch.equal(pageable[1], dev[3]) and bool((pageable[2] == POISON).all())


def test_swap_blocks_partly_registered_host_memory_is_not_pageable() -> None:
    # a registration covering only the first blocks: refused as the copy engine refuses it,
    # not copied by torch as if no byte were registered
    host = torch.full((8, 64), POISON, dtype=torch.uint8)
    mem = pd.register_host_tensor(host[:4], DEV)
    try:
        dev = pd.device_empty((8, 64), dtype=torch.uint8, device=DEV)
        _random_fill(dev)
        _bad_swap(host, lambda: ops.swap_blocks(dev, host, 64, torch.tensor([[0, 7]], dtype=torch.int64)),
                  errors.RegistrationSpanError)
    finally:
        mem.close()


# -- swap_blocks_batch ----------------------------------------------------------------

def _descriptors(
    src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]], dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's offload worker's arrays: per tensor, per block pair, ``data_ptr() + b * stride``."""
    s_ptrs, d_ptrs, sizes = [], [], []
    for s_t, d_t in zip(src, dst):
        row = s_t.stride(0) * s_t.element_size()
        for s, d in pairs:
            s_ptrs.append(s_t.data_ptr() + s * row)
            d_ptrs.append(d_t.data_ptr() + d * row)
            sizes.append(row)
    if dtype == torch.uint64:
        return (torch.tensor(s_ptrs, dtype=torch.uint64), torch.tensor(d_ptrs, dtype=torch.uint64),
                torch.tensor(sizes, dtype=torch.uint64))
    return torch.tensor(s_ptrs), torch.tensor(d_ptrs), torch.tensor(sizes)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint64])
def test_swap_blocks_batch_copies_exactly_the_described_runs(
    direction: tuple[str, str], dtype: torch.dtype, host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    # vLLM's offload tensors: int8 [num_blocks, page_bytes], one per KV tensor
    src = [_make(direction[0], (10, 96), torch.int8, host_alloc) for _ in range(2)]
    dst = [_make(direction[1], (7, 96), torch.int8, host_alloc) for _ in range(2)]
    for t in src:
        _random_fill(t)
    for t in dst:
        _poison(t)
    pairs = [(9, 0), (2, 6), (5, 3)]
    want = [t.clone() for t in dst]
    for s_t, w in zip(src, want):
        for s, d in pairs:
            w[d] = s_t[s]
    src_ptrs, dst_ptrs, sizes = _descriptors(src, dst, pairs, dtype)
    ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes)
    for t, w in zip(dst, want):
        assert torch.equal(_bytes(t), _bytes(w))


def test_swap_blocks_batch_mixed_sizes_and_offsets(
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    # two KV groups of different page sizes, sub-block offsets, overlapping sources (reads only)
    dev = pd.device_empty((4096,), dtype=torch.uint8, device=DEV)
    _random_fill(dev)
    host = host_alloc((4096,), torch.uint8)
    _poison(host)
    runs = [(0, 100, 256), (512, 3000, 64), (40, 700, 256), (520, 4000, 64), (1000, 2000, 13)]  # (src, dst, n)
    want = _bytes(host)
    for s, d, n in runs:
        want[d : d + n] = dev[s : s + n]
    base_s, base_d = dev.data_ptr(), host.data_ptr()
    ops.swap_blocks_batch(torch.tensor([base_s + s for s, _, _ in runs]),
                          torch.tensor([base_d + d for _, d, _ in runs]),
                          torch.tensor([n for _, _, n in runs]), is_src_access_order_any=True)
    assert torch.equal(_bytes(host), want)


def test_swap_blocks_batch_under_inference_mode_and_empty(
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    src = host_alloc((4, 128), torch.uint8)
    dst = pd.device_empty((4, 128), dtype=torch.uint8, device=DEV)
    _random_fill(src)
    _poison(dst)
    with torch.inference_mode():
        empty = torch.empty(0, dtype=torch.int64)
        ops.swap_blocks_batch(empty, empty, empty)  # nothing to do
        assert bool((dst == POISON).all())
        ops.swap_blocks_batch(*_descriptors([src], [dst], [(3, 1), (0, 2)]))
    want = torch.full((4, 128), POISON, dtype=torch.uint8)
    want[1], want[2] = src[3], src[0]
    assert torch.equal(dst, want)


def test_swap_blocks_batch_bad_arguments_write_nothing(
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    dev = pd.device_empty((8, 64), dtype=torch.uint8, device=DEV)
    _random_fill(dev)
    host = host_alloc((8, 64), torch.uint8)
    _poison(host)
    d0, h0 = dev.data_ptr(), host.data_ptr()
    owner = pd.find_registration(pd.HostVA.unsafe_from_int(h0))
    chunked = owner is not None and len(owner.chunks) > 1
    plain = torch.zeros(64, dtype=torch.uint8)  # pageable host memory
    other = pd.device_empty((64,), dtype=torch.uint8, device="emulated:1")

    def t(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    sz = t(64, 64)
    src_ok, dst_ok = t(d0, d0 + 64), t(h0, h0 + 128)
    cases: list[tuple[Callable[[], None], type[Exception], str | None]] = [
        # addresses that are no known memory, or not the copy's
        (lambda: ops.swap_blocks_batch(t(d0, 12345), dst_ok, sz), errors.NotRegisteredError, r"src_ptrs\[1\]"),
        (lambda: ops.swap_blocks_batch(src_ok, t(h0, plain.data_ptr()), sz), errors.NotRegisteredError,
         r"dst_ptrs\[1\]"),
        (lambda: ops.swap_blocks_batch(src_ok, t(h0, other.data_ptr()), sz), errors.DeviceMismatchError,
         "emulated:1"),
        # runs past an allocation's end
        (lambda: ops.swap_blocks_batch(t(d0 + 7 * 64, d0), dst_ok, t(65, 64)), errors.RegistrationSpanError,
         r"src_ptrs\[0\]: 65 bytes"),
        (lambda: ops.swap_blocks_batch(src_ok, t(h0, h0 + 7 * 64 + 1), sz), errors.RegistrationSpanError,
         r"dst_ptrs\[1\]"),
        # sizes <= 0
        (lambda: ops.swap_blocks_batch(src_ok, dst_ok, t(64, 0)), errors.InvalidArgumentError, r"sizes\[1\]"),
        (lambda: ops.swap_blocks_batch(src_ok, dst_ok, t(-8, 64)), errors.InvalidArgumentError, r"sizes\[0\]"),
        # lengths, dtypes, shapes, types, memory of the arrays
        (lambda: ops.swap_blocks_batch(src_ok, t(h0), sz), errors.IndexValidationError, None),
        (lambda: ops.swap_blocks_batch(src_ok, dst_ok, t(64)), errors.IndexValidationError, None),
        (lambda: ops.swap_blocks_batch(src_ok.to(torch.int32), dst_ok, sz), errors.InvalidTypeError, "int32"),
        (lambda: ops.swap_blocks_batch(src_ok, dst_ok, sz.to(torch.float64)), errors.InvalidTypeError, None),
        (lambda: ops.swap_blocks_batch(src_ok.view(1, 2), dst_ok.view(1, 2), sz.view(1, 2)),
         errors.IndexValidationError, None),
        (lambda: ops.swap_blocks_batch([d0, d0 + 64], dst_ok, sz),  # type: ignore[arg-type]
         errors.InvalidTypeError, None),
        (lambda: ops.swap_blocks_batch(src_ok, dst_ok, sz, 1), errors.InvalidTypeError, None),  # type: ignore[arg-type]
        (lambda: ops.swap_blocks_batch(pd.device_empty((2,), dtype=torch.int64, device=DEV), dst_ok, sz),
         errors.DeviceMismatchError, "host memory"),
        # overlaps: dst with dst, dst with src (also in a batch of mixed sizes)
        (lambda: ops.swap_blocks_batch(src_ok, t(h0, h0 + 63), sz), errors.OverlapError,
         r"dst_ptrs\[0\] and dst_ptrs\[1\]"),
        # (host registered in chunks of 128 bytes: the 101-byte run from h0 + 100 crosses a cut, which
        # batch descriptors may not, and is refused first)
        (lambda: ops.swap_blocks_batch(t(d0, d0 + 64, d0 + 300), t(h0, h0 + 200, h0 + 100), t(64, 32, 101)),
         *((errors.RegistrationSpanError, r"dst_ptrs\[2\]: 101 bytes") if chunked else
           (errors.OverlapError, r"dst_ptrs\[1\] and dst_ptrs\[2\]"))),
        (lambda: ops.swap_blocks_batch(t(h0 + 64, h0), t(h0 + 256, h0 + 32), sz), errors.OverlapError,
         r"dst_ptrs\[1\] and src_ptrs\[\d\]"),
        # an entry's index is its own in a batch of mixed sizes too
        (lambda: ops.swap_blocks_batch(t(d0, d0 + 64, d0 + 128, 4096), t(h0, h0 + 64, h0 + 128, h0 + 256),
                                       t(64, 32, 64, 16)), errors.NotRegisteredError, r"src_ptrs\[3\]"),
    ]
    for call, error, match in cases:
        _bad_swap(host, call, error, match)


def test_both_ops_run_on_the_device_of_their_memory() -> None:
    # emulated:1 memory (registrations are portable): the copy runs there, not on the current device
    dev1 = pd.device_empty((4, 256), dtype=torch.uint8, device="emulated:1")
    _random_fill(dev1)
    mem = pd.alloc_registered(4 * 256, "emulated:1")
    try:
        host = mem.tensor.view(4, 256)
        _poison(host)
        ops.swap_blocks(dev1, host, 256, torch.tensor([[2, 0]], dtype=torch.int64))
        ops.swap_blocks_batch(torch.tensor([dev1[3].data_ptr()]), torch.tensor([host[1].data_ptr()]),
                              torch.tensor([256]))
        want = torch.full((4, 256), POISON, dtype=torch.uint8)
        want[0], want[1] = dev1[2], dev1[3]
        assert torch.equal(host, want)
    finally:
        mem.close()


def test_swap_blocks_batch_closed_registration(
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> None:
    dev = pd.device_empty((64,), dtype=torch.uint8, device=DEV)
    mem = pd.alloc_registered(64, DEV)
    addr = mem.tensor.data_ptr()
    mem.close()
    with pytest.raises(errors.ClosedError, match=r"dst_ptrs\[0\]"):
        ops.swap_blocks_batch(torch.tensor([dev.data_ptr()]), torch.tensor([addr]), torch.tensor([64]))


hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a test dependency (pip install '.[test]')")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), st.integers(1, 48)), min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_swap_blocks_batch_matches_torch(runs: list[tuple[int, int]], rng: random.Random) -> None:
    # destinations: disjoint 64-byte slots in a random order; sources anywhere in device memory
    dev = pd.device_empty((2048,), dtype=torch.uint8, device=DEV)
    dev.copy_(torch.randint(0, 256, (2048,), dtype=torch.uint8))
    mem = pd.alloc_registered(2048, DEV)
    try:
        host = mem.tensor
        _poison(host)
        slots = rng.sample(range(32), len(runs))
        want = _bytes(host)
        srcs, dsts, sizes = [], [], []
        for (s, n), d in zip(runs, slots):
            srcs.append(dev.data_ptr() + s * 64 + (n % 5))
            dsts.append(host.data_ptr() + d * 64)
            sizes.append(n)
            want[d * 64 : d * 64 + n] = dev[s * 64 + (n % 5) : s * 64 + (n % 5) + n]
        ops.swap_blocks_batch(torch.tensor(srcs), torch.tensor(dsts), torch.tensor(sizes))
        assert torch.equal(_bytes(host), want)
    finally:
        mem.close()


# -- on a GPU: CUDA device memory with pageable, runtime-pinned and registered host memory -------

def _cuda_host(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
               owners: list[pd.RegisteredHostMemory]) -> torch.Tensor:
    if kind == "pageable":
        return torch.empty(shape, dtype=dtype)
    if kind == "pinned":
        return torch.empty(shape, dtype=dtype, pin_memory=True)  # pinned by the runtime, not registered here
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mem = pd.alloc_registered(nbytes, "cuda:0")
    owners.append(mem)
    return mem.tensor[:nbytes].view(dtype).view(shape)


@pytest.mark.gpu
@pytest.mark.parametrize("host_kind", ["pageable", "pinned", "registered"])
@pytest.mark.parametrize("to_host", [True, False])
def test_gpu_swap_blocks_host_memory_of_each_kind(host_kind: str, to_host: bool) -> None:
    rng = random.Random(5)
    owners: list[pd.RegisteredHostMemory] = []
    try:
        for dtype in DTYPES:
            for shape in _cache_shapes(dtype):
                shape = (64, *shape[1:])
                dev = torch.empty(shape, dtype=dtype, device="cuda")
                host = _cuda_host(host_kind, shape, dtype, owners)
                src, dst = (dev, host) if to_host else (host, dev)
                src.view(torch.uint8).copy_(torch.randint(0, 256, src.view(torch.uint8).shape, dtype=torch.uint8))
                dst.view(torch.uint8).fill_(POISON)
                want = dst.cpu().clone()
                src_cpu = src.cpu()
                pairs = list(zip(rng.sample(range(64), 20), rng.sample(range(64), 20)))
                for s, d in pairs:
                    want[d] = src_cpu[s]
                ops.swap_blocks(src, dst, src.element_size() * src.stride(0),
                                torch.tensor(pairs, dtype=torch.int64).view(-1, 2))
                torch.cuda.synchronize()
                assert torch.equal(_bytes(dst.cpu()), _bytes(want))
                if host_kind == "pageable":
                    assert pd.find_registration(pd.HostVA(host.data_ptr())) is None
                # a bad block id after good ones: nothing written
                before = _bytes(dst.cpu())
                with pytest.raises(errors.IndexValidationError):
                    ops.swap_blocks(src, dst, src.element_size() * src.stride(0),
                                    torch.tensor([[0, 1], [64, 2]], dtype=torch.int64))
                torch.cuda.synchronize()
                assert torch.equal(_bytes(dst.cpu()), before)
    finally:
        for mem in owners:
            mem.close()


@pytest.mark.gpu
def test_gpu_swap_blocks_batch_pinned_and_registered_host() -> None:
    owners: list[pd.RegisteredHostMemory] = []
    try:
        dev = [torch.randint(-128, 127, (16, 512), dtype=torch.int8, device="cuda") for _ in range(3)]
        host = [_cuda_host(kind, (16, 512), torch.int8, owners) for kind in ("pinned", "registered", "pinned")]
        for t in host:
            t.fill_(-91)  # 0xA5
        pairs = [(15, 0), (3, 7), (8, 2)]
        want = [t.clone() for t in host]
        for d_t, w in zip(dev, want):
            for s, d in pairs:
                w[d] = d_t[s].cpu()
        ops.swap_blocks_batch(*_descriptors(dev, host, pairs))
        torch.cuda.synchronize()
        for t, w in zip(host, want):
            assert torch.equal(_bytes(t), _bytes(w))
        # and back, into poisoned device memory
        back = [torch.full((16, 512), -91, dtype=torch.int8, device="cuda") for _ in range(3)]
        ops.swap_blocks_batch(*_descriptors(host, back, [(d, s) for s, d in pairs]))
        torch.cuda.synchronize()
        for b, d_t in zip(back, dev):
            ref = torch.full((16, 512), -91, dtype=torch.int8)
            for s, _ in pairs:
                ref[s] = d_t[s].cpu()
            assert torch.equal(_bytes(b.cpu()), _bytes(ref))
        # pageable host memory has no device alias: refused before anything is written
        plain = torch.full((16, 512), -91, dtype=torch.int8)
        with pytest.raises(errors.NotRegisteredError, match=r"dst_ptrs\[0\]"):
            ops.swap_blocks_batch(*_descriptors(dev[:1], [plain], pairs))
        torch.cuda.synchronize()
        assert bool((plain == -91).all())
    finally:
        for mem in owners:
            mem.close()


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_host_tensor_whose_storage_was_released_is_a_layout_error(side: str) -> None:
    """A host cache whose storage was released (``untyped_storage().resize_(0)``, shape
    kept): its blocks run past its storage, refused before anything is copied."""
    block = 4096
    device = pd.device_empty((8, block), torch.uint8, DEV)
    device.fill_(0x5A)
    before = device.clone()
    host = torch.zeros(8, block, dtype=torch.uint8)
    host.untyped_storage().resize_(0)
    src, dst = (host, device) if side == "src" else (device, host)
    with pytest.raises(errors.LayoutError, match="past the end of its storage"):
        ops.swap_blocks(src, dst, block, torch.tensor([[1, 2]]))
    assert torch.equal(device, before)
