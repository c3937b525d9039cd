"""The sglang adapter over pools as sglang keeps them, on the emulated device: the device
side as separate per-layer K and V lists (MHA) or one per-layer list (MLA), passed as
sglang's pool object or as DeviceKVBuffers; the host side as sglang's MHA / MLA host pool
object, its buffer in the shape sglang allocates. Expected bytes come from plain torch
indexing on those shapes (written out here from sglang's ``init_kv_buffer``, not from the
library's geometry); destinations are poisoned first, so a stray write shows."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import DeviceAlias, PointerTable, errors
from pointerdomain.adapters import sglang
from pointerdomain.compat.wrap import kernel_op

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias

DEV = "emulated:0"
POISON = 0xA5
KINDS = ["layer_first", "page_first", "page_first_direct"]
LAYERS, PAGE, HOST_PAGES, DEVICE_SLOTS = 3, 4, 5, 6 * 4  # device: size + page_size slots, as sglang
HEADS, DIM, MLA_DIM = 2, 8, 24


def random_(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return t


def poison_(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(POISON)
    return t


class MHADevicePool:
    """sglang's MHATokenToKVPool attributes: per-layer ``k_buffer`` / ``v_buffer`` lists."""

    def __init__(self, seed: int | None, layers: int = LAYERS) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, layers, HEADS, DIM
        self.size = DEVICE_SLOTS - PAGE
        self.device = "emulated"  # sglang's own device string names no ordinal
        self.k_buffer = [pd.device_empty((DEVICE_SLOTS, HEADS, DIM), torch.bfloat16, DEV) for _ in range(layers)]
        self.v_buffer = [pd.device_empty((DEVICE_SLOTS, HEADS, DIM), torch.bfloat16, DEV) for _ in range(layers)]
        for i, t in enumerate(self.k_buffer + self.v_buffer):
            poison_(t) if seed is None else random_(t, seed + i)

    def layer(self, kv: int, layer: int) -> torch.Tensor:
        return (self.k_buffer, self.v_buffer)[kv][layer]


class MLADevicePool:
    """sglang's MLATokenToKVPool attributes: one per-layer ``kv_buffer`` list."""

    def __init__(self, seed: int | None, layers: int = LAYERS) -> None:
        self.page_size, self.layer_num, self.kv_cache_dim = PAGE, layers, MLA_DIM
        self.kv_buffer = [pd.device_empty((DEVICE_SLOTS, 1, MLA_DIM), torch.bfloat16, DEV) for _ in range(layers)]
        for i, t in enumerate(self.kv_buffer):
            poison_(t) if seed is None else random_(t, seed + i)

    def layer(self, kv: int, layer: int) -> torch.Tensor:
        assert kv == 0
        return self.kv_buffer[layer]


def sglang_dims(kind: str, mla: bool) -> tuple[int, ...]:
    """The dims sglang's MHATokenToKVPoolHost / MLATokenToKVPoolHost.init_kv_buffer allocate."""
    size, heads, dim = HOST_PAGES * PAGE, (1 if mla else HEADS), (MLA_DIM if mla else DIM)
    if kind == "layer_first":
        dims: tuple[int, ...] = (LAYERS, size, heads, dim)
    elif kind == "page_first":
        dims = (size, LAYERS, heads, dim)
    else:
        dims = (HOST_PAGES, LAYERS, PAGE, heads, dim)
    return dims if mla else (2, *dims)


class HostPool:
    """sglang's host pool attributes over registered host memory (poisoned)."""

    def __init__(self, kind: str, mla: bool) -> None:
        self.layout, self.page_size, self.layer_num = kind, PAGE, LAYERS
        self.size, self.page_num = HOST_PAGES * PAGE, HOST_PAGES
        if mla:
            self.kv_cache_dim = MLA_DIM
        else:
            self.head_num, self.head_dim = HEADS, DIM
        dims = sglang_dims(kind, mla)
        nbytes = 2 * int(torch.tensor(dims).prod())
        self.memory = pd.alloc_registered(nbytes, DEV)
        self.kv_buffer = poison_(self.memory.tensor.view(torch.bfloat16).view(dims))


def at(kind: str, mla: bool, kv: int, layer: int, slots: torch.Tensor) -> tuple[int | torch.Tensor, ...]:
    """The index of the items of ``slots`` in sglang's host shape (result ``[n, heads, dim]``)."""
    if kind == "layer_first":
        idx: tuple[int | torch.Tensor, ...] = (layer, slots)
    elif kind == "page_first":
        idx = (slots, layer)
    else:
        idx = (slots // PAGE, layer, slots % PAGE)
    return idx if mla else (kv, *idx)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def hosts() -> Iterator[list[HostPool]]:
    made: list[HostPool] = []
    yield made
    for h in made:
        h.memory.close()


def new_host(hosts: list[HostPool], kind: str, mla: bool) -> HostPool:
    h = HostPool(kind, mla)
    hosts.append(h)
    return h


def device_pool(mla: bool, seed: int | None) -> MHADevicePool | MLADevicePool:
    return MLADevicePool(seed) if mla else MHADevicePool(seed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("as_object", [True, False], ids=["sglang_pool", "DeviceKVBuffers"])
def test_backup_load_and_per_layer_load_exact_bytes(kind: str, mla: bool, as_object: bool,
                                                    hosts: list[HostPool]) -> None:
    host = new_host(hosts, kind, mla)
    cache = sglang.HostKVCacheAdapter.from_sglang(host, DEV)
    assert cache.layout == kind and cache.size == HOST_PAGES * PAGE and cache.layer_num == LAYERS
    num_kv = 1 if mla else 2

    def wrap(pool: MHADevicePool | MLADevicePool) -> sglang.DeviceKVBuffers | MHADevicePool | MLADevicePool:
        if as_object:
            return pool
        if isinstance(pool, MLADevicePool):
            return sglang.DeviceKVBuffers.mla(pool.kv_buffer, DEV, page_size=PAGE)
        return sglang.DeviceKVBuffers.mha(pool.k_buffer, pool.v_buffer, DEV, page_size=PAGE)

    # write-back: device pages 1 and 4 -> host pages 3 and 0, every layer
    src = device_pool(mla, seed=7)
    d_slots = torch.cat([torch.arange(1 * PAGE, 2 * PAGE), torch.arange(4 * PAGE, 5 * PAGE)])
    h_slots = torch.cat([torch.arange(3 * PAGE, 4 * PAGE), torch.arange(0, PAGE)])
    cache.backup_from_device_all_layer(wrap(src), h_slots, d_slots, "kernel")
    expected = poison_(torch.empty_like(host.kv_buffer))
    for kv in range(num_kv):
        for layer in range(LAYERS):
            expected[at(kind, mla, kv, layer, h_slots)] = src.layer(kv, layer)[d_slots]
    assert torch.equal(bits(host.kv_buffer), bits(expected))

    # load back, every layer, into other slots of a poisoned device pool
    dst = device_pool(mla, seed=None)
    target = torch.cat([torch.arange(5 * PAGE, 6 * PAGE), torch.arange(2 * PAGE, 3 * PAGE)])
    cache.load_to_device_all_layer(wrap(dst), h_slots, target, "kernel")
    for kv in range(num_kv):
        for layer in range(LAYERS):
            want = poison_(torch.empty_like(dst.layer(kv, layer)))
            want[target] = src.layer(kv, layer)[d_slots]
            assert torch.equal(bits(dst.layer(kv, layer)), bits(want)), (kv, layer)

    # layer by layer: only layer 1 of a fresh poisoned pool is written
    per = device_pool(mla, seed=None)
    cache.load_to_device_per_layer(wrap(per), h_slots, target, 1, "kernel")
    for kv in range(num_kv):
        for layer in range(LAYERS):
            want = poison_(torch.empty_like(per.layer(kv, layer)))
            if layer == 1:
                want[target] = src.layer(kv, layer)[d_slots]
            assert torch.equal(bits(per.layer(kv, layer)), bits(want)), (kv, layer)


def test_a_pool_object_whose_list_changed_is_read_again(hosts: list[HostPool]) -> None:
    host = new_host(hosts, "page_first", False)
    cache = sglang.HostKVCacheAdapter.from_sglang(host, DEV)
    random_(host.kv_buffer, 3)
    pool = MHADevicePool(seed=None)
    slots = torch.arange(0, PAGE)
    cache.load_to_device_all_layer(pool, slots, slots)
    old = pool.v_buffer[2]
    assert not bool((bits(old[slots]) == POISON).all())
    # sglang replaced one layer's buffer (e.g. a pool rebuilt after a memory-saver pause)
    pool.v_buffer[2] = poison_(pd.device_empty((DEVICE_SLOTS, HEADS, DIM), torch.bfloat16, DEV))
    before_old = old.clone()
    poison_(old)
    cache.load_to_device_all_layer(pool, slots, slots)
    assert torch.equal(bits(pool.v_buffer[2][slots]), bits(before_old[slots]))  # the new buffer got the bytes
    assert bool((bits(old) == POISON).all())  # the old one was not written
    # a bad replacement is refused before anything is written
    pool.v_buffer[0] = pd.device_empty((DEVICE_SLOTS, HEADS, DIM + 1), torch.bfloat16, DEV)
    poison_(pool.k_buffer[0])
    with pytest.raises(errors.LayoutError, match=r"v_buffer\[0\]"):
        cache.load_to_device_all_layer(pool, slots, slots)
    assert bool((bits(pool.k_buffer[0]) == POISON).all())


def test_per_kv_tables_feed_an_op_that_takes_k_and_v_apart(hosts: list[HostPool]) -> None:
    """DeviceKVBuffers.k_table / v_table are sglang's k_data_ptrs / v_data_ptrs, typed:
    through kernel_op an sgl_kernel-style op (separate K and V tables) moves the bytes."""
    host = new_host(hosts, "layer_first", False)
    pool = MHADevicePool(seed=11)
    buffers = sglang.DeviceKVBuffers.from_sglang(pool, DEV)
    assert buffers.v_table is not None
    assert [a.value for a in buffers.k_table] == [t.data_ptr() for t in pool.k_buffer]  # device memory: itself
    assert [a.value for a in buffers.v_table] == [t.data_ptr() for t in pool.v_buffer]
    assert len(buffers.table) == 2 * LAYERS

    def op(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor, dst_v: torch.Tensor,
           src_idx: torch.Tensor, dst_idx: torch.Tensor, item_size: int, num_layers: int) -> None:
        for s_t, d_t in ((src_k, dst_k), (src_v, dst_v)):
            for s_base, d_base in zip(s_t.tolist()[:num_layers], d_t.tolist()[:num_layers]):
                for s, d in zip(src_idx.tolist(), dst_idx.tolist()):
                    ctypes.memmove(d_base + d * item_size, s_base + s * item_size, item_size)

    @kernel_op(op)
    def transfer_kv_all_layer(src_k_layers: PointerTable[DeviceAlias], dst_k_layers: PointerTable[DeviceAlias],
                              src_v_layers: PointerTable[DeviceAlias], dst_v_layers: PointerTable[DeviceAlias],
                              src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int,
                              num_layers: int) -> None: ...

    # sglang's host k_data_refs / v_data_refs (layer_first): kv_buffer[kv][layer]
    host_k = pd.make_kernel_ptr_table([host.kv_buffer[0, i] for i in range(LAYERS)], DEV)
    host_v = pd.make_kernel_ptr_table([host.kv_buffer[1, i] for i in range(LAYERS)], DEV)
    src, dst = torch.tensor([9, 2, 17]), torch.tensor([0, 19, 5])
    transfer_kv_all_layer(buffers.k_table, host_k, buffers.v_table, host_v, src, dst, HEADS * DIM * 2, LAYERS)
    expected = poison_(torch.empty_like(host.kv_buffer))
    for kv in range(2):
        for layer in range(LAYERS):
            expected[kv, layer][dst] = pool.layer(kv, layer)[src]
    assert torch.equal(bits(host.kv_buffer), bits(expected))
    assert sglang.DeviceKVBuffers.mla(MLADevicePool(seed=1).kv_buffer, DEV, page_size=PAGE).v_table is None


# --------------------------------------------------------------------------- bad input


def k_v(v_shape: tuple[int, ...] = (DEVICE_SLOTS, HEADS, DIM), layers: int = LAYERS) -> tuple[list[torch.Tensor], ...]:
    k = [pd.device_empty((DEVICE_SLOTS, HEADS, DIM), torch.bfloat16, DEV) for _ in range(LAYERS)]
    v = [pd.device_empty(v_shape, torch.bfloat16, DEV) for _ in range(layers)]
    return k, v


def bad_lists() -> list[tuple[str, object, object, type[Exception], str]]:
    k, v = k_v()
    other = [pd.device_empty((DEVICE_SLOTS, HEADS, DIM), torch.bfloat16, "emulated:1") for _ in range(LAYERS)]
    return [
        ("fewer V", k, v[:2], errors.LayoutError, "found 2 buffers for 3 K"),
        ("V of another shape", k, k_v(v_shape=(DEVICE_SLOTS, HEADS, DIM * 2))[1], errors.LayoutError,
         r"v_buffer\[0\]: shape \(24, 2, 16\)"),
        ("one K layer of another shape", [*k[:2], pd.device_empty((DEVICE_SLOTS, 1, DIM), torch.bfloat16, DEV)], v,
         errors.LayoutError, r"k_buffer\[2\]"),
        ("V of another dtype", k, [pd.device_empty((DEVICE_SLOTS, HEADS, DIM), torch.float16, DEV)] * LAYERS,
         errors.LayoutError, r"v_buffer\[0\].*float16"),
        ("a V layer on another device", k, [*v[:1], other[0], *v[2:]], errors.DeviceMismatchError,
         r"v_buffer\[1\]: memory of emulated:1"),
        ("K all on another device", other, v, errors.DeviceMismatchError, r"k_buffer\[0\]"),
        ("a host tensor", k, [*v[:2], torch.zeros(DEVICE_SLOTS, HEADS, DIM, dtype=torch.bfloat16)], errors.DomainError,
         r"v_buffer\[2\]: host memory"),
        ("a non-tensor", k, [*v[:2], None], errors.InvalidTypeError, r"v_buffer\[2\]: found a NoneType"),
        ("one tensor for all layers", torch.stack(k), v, errors.InvalidTypeError, "k_buffer.*one tensor|k_buffer: found a Tensor"),
        ("empty lists", [], [], errors.LayoutError, "empty"),
        ("2-D buffers", [t[:, 0] for t in k], [t[:, 0] for t in v], errors.LayoutError, "k_buffer"),
        ("strided buffers", [t[:, :1] for t in k], [t[:, :1] for t in v], errors.NonContiguousError,
         r"k_buffer\[0\]: strides"),
    ]


@pytest.mark.parametrize("case", range(len(bad_lists())), ids=[c[0] for c in bad_lists()])
def test_bad_device_lists_are_typed_errors(case: int, hosts: list[HostPool]) -> None:
    _, k, v, exc, match = bad_lists()[case]
    with pytest.raises(exc, match=match):
        sglang.DeviceKVBuffers(k, v, DEV, page_size=PAGE)  # type: ignore[arg-type]
    # the same lists inside sglang's pool object reach the host adapter: refused, nothing written
    host = new_host(hosts, "layer_first", False)
    cache = sglang.HostKVCacheAdapter.from_sglang(host, DEV)
    pool = MHADevicePool(seed=None)
    pool.k_buffer, pool.v_buffer = k, v  # type: ignore[assignment]
    slots = torch.arange(0, PAGE)
    with pytest.raises(exc, match=match):
        cache.backup_from_device_all_layer(pool, slots, slots)
    assert bool((bits(host.kv_buffer) == POISON).all())


def test_bad_device_pool_arguments() -> None:
    k, v = k_v()
    for bad in (0, 4.0, True, "4", -4, None):
        with pytest.raises(errors.InvalidArgumentError, match="page_size"):
            sglang.DeviceKVBuffers(k, v, DEV, page_size=bad)  # type: ignore[arg-type]
    with pytest.raises(errors.LayoutError, match="whole number of pages"):
        sglang.DeviceKVBuffers(k, v, DEV, page_size=5)
    with pytest.raises(errors.LayoutError, match="head_num 2 with v_buffer=None"):
        sglang.DeviceKVBuffers.mla(k, DEV, page_size=PAGE)
    with pytest.raises(errors.InvalidTypeError, match="v_buffer"):
        sglang.DeviceKVBuffers.mha(k, None, DEV, page_size=PAGE)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidTypeError, match="page_size"):
        sglang.DeviceKVBuffers.from_sglang(type("Pool", (), {"k_buffer": k, "v_buffer": v})(), DEV)
    with pytest.raises(errors.InvalidDeviceError):
        sglang.DeviceKVBuffers(k, v, "emulated:9", page_size=PAGE)


def test_wrong_device_pool_objects(hosts: list[HostPool]) -> None:
    host = new_host(hosts, "page_first", False)
    cache = sglang.HostKVCacheAdapter.from_sglang(host, DEV)
    slots = torch.arange(0, PAGE)
    for bad in (None, cache, cache.kernel_table, object()):
        with pytest.raises(errors.InvalidTypeError, match="device_pool"):
            cache.load_to_device_all_layer(bad, slots, slots)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidTypeError, match="device_pool.*kv_buffer is one tensor"):  # a host pool
        cache.load_to_device_per_layer(host, slots, slots, 0)  # type: ignore[arg-type]
    # a device pool of another model (fewer layers) does not fit the host layout
    small = MHADevicePool(seed=1, layers=2)
    with pytest.raises(errors.LayoutError):
        cache.backup_from_device_all_layer(small, slots, slots)
    assert bool((bits(host.kv_buffer) == POISON).all())


def test_bad_sglang_host_pools(hosts: list[HostPool]) -> None:
    host = new_host(hosts, "page_first", False)
    flat = host.kv_buffer.view(-1)

    def pool(**changes: object) -> object:
        attrs = {"kv_buffer": host.kv_buffer, "layout": "page_first", "page_size": PAGE, "layer_num": LAYERS,
                 "size": HOST_PAGES * PAGE, "head_num": HEADS, "head_dim": DIM}
        attrs.update(changes)
        return type("Host", (), {k: v for k, v in attrs.items() if v is not None})()

    cases: list[tuple[object, type[Exception], str]] = [
        (pool(kv_buffer=flat), errors.LayoutError, "sglang allocates"),  # the right bytes, not sglang's shape
        (pool(layout="layer_first"), errors.LayoutError, "sglang allocates"),
        (pool(size=HOST_PAGES * PAGE - 1), errors.LayoutError, "whole number of pages"),
        (pool(head_num=None), errors.InvalidTypeError, "head_num"),
        (pool(kv_buffer=[host.kv_buffer]), errors.InvalidTypeError, "kv_buffer"),
        (pool(layout="page_unified"), errors.InvalidArgumentError, "layout"),
        (pool(layout=1), errors.InvalidArgumentError, "layout"),
        (pool(page_size="4"), errors.InvalidArgumentError, "page_size"),
        (pool(layer_num=0), errors.InvalidArgumentError, "layer_num"),
        (pool(kv_cache_dim=DIM, layout="page_head"), errors.InvalidArgumentError, "MLA"),
        (pool(kv_buffer=torch.zeros(sglang_dims("page_first", False), dtype=torch.bfloat16)), errors.DomainError,
         "unregistered|not registered"),
    ]
    for bad, exc, match in cases:
        with pytest.raises(exc, match=match):
            sglang.HostKVCacheAdapter.from_sglang(bad, DEV)  # type: ignore[arg-type]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("kind", KINDS)
def test_sglang_host_shape_is_sglangs(kind: str, mla: bool) -> None:
    layout = pd.KVLayout(kind=kind, attention="mla" if mla else "mha", num_layers=LAYERS,  # type: ignore[arg-type]
                         num_pages=HOST_PAGES, page_size=PAGE, num_heads=1 if mla else HEADS,
                         head_dim=MLA_DIM if mla else DIM)
    assert sglang.sglang_host_shape(layout) == sglang_dims(kind, mla)
    assert 2 * int(torch.tensor(sglang_dims(kind, mla)).prod()) == layout.nbytes


def test_sglang_host_shape_takes_a_layout() -> None:
    with pytest.raises(errors.InvalidTypeError):
        sglang.sglang_host_shape("layer_first")  # type: ignore[arg-type]
