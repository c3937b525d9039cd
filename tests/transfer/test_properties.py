"""Property tests: random layouts, page and item sizes, index sets, memory
kinds and directions, every transfer compared byte-for-byte with a plain torch
reference on the CPU (emulated backend, checked mode on).

The reference never uses pointerdomain's geometry: it views each one-buffer
tensor by the shapes the layouts document (``layer_first``
``[kv, layers, pages*page_size, heads, head_dim]``, ``page_first``
``[kv, pages*page_size, layers, heads, head_dim]``, ``page_first_direct``
``[kv, pages, layers, page_size, heads, head_dim]``) as bytes and copies items
with torch indexing. Destinations are poisoned with random bytes first; every
byte the transfer must not touch stays as it was, and the source is unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("hypothesis", reason="hypothesis is a test dependency (pip install '.[test]')")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pointerdomain as pd  # noqa: E402
from pointerdomain import errors  # noqa: E402
from tests.reference import fill_random, reference_transfer, table_storage

KINDS = ["layer_first", "page_first", "page_first_direct"]
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8"]
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])





@dataclass
class Side:
    layout: pd.KVLayout
    flat: torch.Tensor  # uint8 bytes of the one-buffer pool
    table: pd.PointerTable[pd.DeviceAlias]


def make_side(stack: contextlib.ExitStack, layout: pd.KVLayout, memory: str, device: str,
              split: int, chunk_blocks: int, seed: int) -> Side:
    """A pool of ``layout`` in device memory, registered host memory, or a (chunked) HostKVPool."""
    if memory == "host_pool":
        pool = stack.enter_context(
            pd.HostKVPool(layout, device, max_chunk_bytes=chunk_blocks * layout.page_block_bytes())
        )
        flat = pool.memory.tensor[: layout.nbytes]
        table = pool.kernel_table
    else:
        if memory == "device":
            flat = pd.device_empty((layout.nbytes,), torch.uint8, device)
        else:
            flat = stack.enter_context(pd.alloc_registered(layout.nbytes, device)).tensor[: layout.nbytes]
        splits = layout.table_splits()
        n = splits[split % len(splits)]
        size = layout.nbytes // n
        table = pd.make_kernel_ptr_table([flat[i * size : (i + 1) * size] for i in range(n)], device)
    fill_random(flat, seed)
    return Side(layout, flat, table)


@st.composite
def models(draw: st.DrawFn) -> dict[str, Any]:
    attention = draw(st.sampled_from(["mha", "mla"]))
    return dict(
        attention=attention,
        num_layers=draw(st.integers(1, 3)),
        page_size=draw(st.sampled_from([1, 2, 3, 4, 16])),
        num_heads=1 if attention == "mla" else draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([1, 2, 5, 8, 16, 64, 72])),
        dtype=draw(st.sampled_from(DTYPES)),
    )


@st.composite
def transfers(draw: st.DrawFn, direction: str) -> dict[str, Any]:
    model = draw(models())
    src_mem, dst_mem = {"d2h": ("device", "host"), "h2d": ("host", "device"),
                        "h2h": ("host", "host"), "d2d": ("device", "device")}[direction]
    sides = {}
    for name, mem in (("src", src_mem), ("dst", dst_mem)):
        if mem == "host":
            mem = draw(st.sampled_from(["host", "host_pool"]))
        sides[name] = dict(
            layout=pd.KVLayout(kind=draw(st.sampled_from(KINDS)), num_pages=draw(st.integers(1, 5)), **model),
            memory=mem, split=draw(st.integers(0, 10)), chunk_blocks=draw(st.integers(1, 3)),
        )
    src_slots = sides["src"]["layout"].num_slots
    dst_slots = sides["dst"]["layout"].num_slots
    n = draw(st.integers(0, min(src_slots, dst_slots, 40)))
    dst_idx = draw(st.permutations(range(dst_slots)))[:n]  # unique: two writes to one slot race
    src_idx = draw(st.lists(st.integers(0, src_slots - 1), min_size=n, max_size=n))  # duplicates allowed
    layer = draw(st.none() | st.integers(0, model["num_layers"] - 1))
    return dict(
        sides=sides, src_idx=src_idx, dst_idx=dst_idx, layer=layer,
        device=draw(st.sampled_from(["emulated:0", "emulated:1"])),
        backend=draw(st.sampled_from(["kernel", "copy_engine", "auto"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def run_and_check(case: dict[str, Any]) -> None:
    with contextlib.ExitStack() as stack:
        src, dst = (
            make_side(stack, device=case["device"], seed=case["seed"] + k, **case["sides"][name])
            for k, name in enumerate(("src", "dst"))
        )
        s_idx = torch.tensor(case["src_idx"], dtype=torch.int64)
        d_idx = torch.tensor(case["dst_idx"], dtype=torch.int64)
        src_before = src.flat.clone()
        layers = None if case["layer"] is None else [case["layer"]]
        expected = reference_transfer(src.flat, src.layout, dst.flat, dst.layout, s_idx, d_idx, layers)
        launch = dict(src_layout=src.layout, dst_layout=dst.layout, backend=case["backend"])
        if case["layer"] is None:
            pd.transfer_kv_all_layer(src.table, dst.table, s_idx, d_idx, **launch)
        else:
            pd.transfer_kv_per_layer(src.table, dst.table, s_idx, d_idx, layer_id=case["layer"], **launch)
        assert torch.equal(dst.flat, expected), "destination differs from the torch reference"
        assert torch.equal(src.flat, src_before), "the source was modified"


@pytest.mark.parametrize("direction", ["d2h", "h2d", "h2h", "d2d"])
@SETTINGS
@given(data=st.data())
def test_transfer_matches_torch_reference(direction: str, data: st.DataObject) -> None:
    run_and_check(data.draw(transfers(direction)))


@settings(max_examples=40, deadline=None)
@given(
    n_chunks=st.integers(1, 6),
    chunk_pages=st.integers(1, 3),
    offsets=st.lists(st.integers(0, 10**9), min_size=1, max_size=8),
)
def test_interior_aliases_keep_their_offset_inside_their_chunk(n_chunks: int, chunk_pages: int,
                                                               offsets: list[int]) -> None:
    """resolve_alias(va + k) is the alias of k's chunk plus k's offset in that chunk (each
    chunk is a separate registration: alias arithmetic never crosses one)."""
    page = 4096
    with pd.alloc_registered(n_chunks * chunk_pages * page, "emulated:0", max_chunk_bytes=chunk_pages * page) as mem:
        assert len(mem.chunks) == n_chunks
        starts = [pd.resolve_alias(c.host_va, "emulated:0") for c in mem.chunks]
        for k in offsets:
            k %= mem.nbytes
            chunk = k // (chunk_pages * page)
            alias = pd.resolve_alias(mem.host_va + k, "emulated:0")
            assert alias == starts[chunk] + (k - chunk * chunk_pages * page)
            assert alias.value != mem.host_va.value + k


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=transfers("d2h"), which=st.sampled_from(["src", "dst"]), entry=st.integers(0, 10**6),
       delta=st.integers(-(1 << 20), 1 << 20).filter(lambda d: d != 0))
def test_checked_mode_refuses_any_modified_entry(case: dict[str, Any], which: str, entry: int, delta: int) -> None:
    """Any write into a table's tensor is refused before the launch, with nothing copied."""
    if not case["src_idx"]:
        case["src_idx"], case["dst_idx"] = [0], [0]
    with contextlib.ExitStack() as stack:
        src, dst = (
            make_side(stack, device=case["device"], seed=case["seed"] + k, **case["sides"][name])
            for k, name in enumerate(("src", "dst"))
        )
        table = src.table if which == "src" else dst.table
        raw = table_storage(table)
        i = entry % len(table)
        value = int(raw[i]) + delta
        if value < 0:
            value = int(raw[i]) + abs(delta)
        raw[i] = value
        src_before, dst_before = src.flat.clone(), dst.flat.clone()
        with pytest.raises((errors.DomainError, errors.DeviceMismatchError, errors.RegistrationSpanError,
                            errors.LayoutError)) as info:
            pd.transfer_kv_all_layer(src.table, dst.table, torch.tensor(case["src_idx"]),
                                     torch.tensor(case["dst_idx"]), src_layout=src.layout, dst_layout=dst.layout)
        assert f"{which} table entry" in str(info.value)
        assert torch.equal(dst.flat, dst_before) and torch.equal(src.flat, src_before)
        raw[i] = table[i].value
