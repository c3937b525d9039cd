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

DEV = pd.validate_device("emulated:0")
POISON = 0xA5
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture
def host_alloc() -> Iterator[Callable[[tuple[int, ...], torch.dtype], torch.Tensor]]:
    """Registered host tensors of a shape and dtype (each its own registration)."""
    owners: list[pd.RegisteredHostMemory] = []

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
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
        # memory the copy may not use
        (lambda: ops.swap_blocks(torch.zeros(6, 32, dtype=torch.bfloat16), dst, block, ok), errors.DomainError,
         None),
        (lambda: ops.swap_blocks(src, torch.zeros(4, 32, dtype=torch.bfloat16), block, ok), errors.DomainError,
         "unregistered"),
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
        (lambda: ops.swap_blocks_batch(t(d0, d0 + 64, d0 + 300), t(h0, h0 + 200, h0 + 100), t(64, 32, 101)),
         errors.OverlapError, r"dst_ptrs\[1\] and dst_ptrs\[2\]"),
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
