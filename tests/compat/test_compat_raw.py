"""Raw engine addresses resolved before launch (pointerdomain.compat._raw): every entry
found in a registration, runtime-pinned memory or device memory of the launch device,
translated to its alias, its reach checked; the cache follows the table tensor."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import _raw

DEV = pd.validate_device("emulated:0")
PAGE = 4096


def _alias(addr: int) -> int:
    return pd.resolve_alias(pd.HostVA(addr), DEV).value


@pytest.fixture
def host() -> pd.RegisteredHostMemory:
    mem = pd.alloc_registered(4 * PAGE, DEV, max_chunk_bytes=2 * PAGE)  # two chunks: aliases not contiguous
    yield mem
    mem.close()


def test_entries_become_aliases_with_their_spans(host: pd.RegisteredHostMemory) -> None:
    dev = pd.device_empty((3000,), torch.uint8, DEV)
    va = host.tensor.data_ptr()
    ptrs = torch.tensor([dev.data_ptr() + 100, va + 8, va + 2 * PAGE + 16], dtype=torch.uint64)
    table = _raw.resolved_table("ptrs", ptrs, DEV)
    assert table.raw_values() == (dev.data_ptr() + 100, _alias(va + 8), _alias(va + 2 * PAGE + 16))
    # reach None: what the allocation / chunk holds from the entry on
    assert table.sizes == (2900, 2 * PAGE - 8, 2 * PAGE - 16)
    assert [o.host_va for o in table.registrations()] == [host.host_va]
    exact = _raw.resolved_table("ptrs", ptrs, DEV, reach=[64, 128, 256])
    assert exact.sizes == (64, 128, 256) and exact.raw_values() == table.raw_values()


def test_int64_tables_and_the_kernel_moves_the_right_bytes(host: pd.RegisteredHostMemory) -> None:
    # a raw host table (as an engine builds it) feeding a real launch: exact bytes, poisoned rest
    layout_d = pd.KVLayout(kind="layer_first", num_layers=2, num_pages=4, page_size=2, num_heads=1, head_dim=64,
                           dtype="uint8", attention="mla")
    layout_h = layout_d.replace(kind="page_first")
    dev = pd.device_empty((layout_d.nbytes,), torch.uint8, DEV)
    dev.copy_(torch.randint(0, 256, (layout_d.nbytes,), dtype=torch.uint8))
    hbuf = host.tensor[: layout_h.nbytes]
    hbuf.fill_(0xA5)
    src = _raw.resolved_table("src", torch.tensor([dev.data_ptr()], dtype=torch.int64), DEV, reach=layout_d.nbytes)
    dst = _raw.resolved_table("dst", torch.tensor([hbuf.data_ptr()], dtype=torch.int64), DEV, reach=layout_h.nbytes)
    s_idx = torch.tensor([5, 0, 7], dtype=torch.int64)
    d_idx = torch.tensor([1, 6, 3], dtype=torch.int64)
    pd.transfer_kv_all_layer(src, dst, s_idx, d_idx, src_layout=layout_d, dst_layout=layout_h, backend="kernel")
    want = torch.full((8, 2, 64), 0xA5, dtype=torch.uint8)  # page_first: [slot, layer, item]
    src_view = dev.view(2, 8, 64)  # layer_first: [layer, slot, item]
    for s, d in zip(s_idx.tolist(), d_idx.tolist()):
        want[d] = src_view[:, s]
    assert torch.equal(hbuf.view(8, 2, 64), want)


def test_unknown_address_is_a_typed_error_naming_the_entry() -> None:
    dev = pd.device_empty((64,), torch.uint8, DEV)
    for bad in (12345, (1 << 63) + 4096, (1 << 64) - 8):
        ptrs = torch.tensor([dev.data_ptr(), bad - (1 << 64) if bad >> 63 else bad], dtype=torch.int64)
        with pytest.raises(errors.NotRegisteredError, match=r"ptrs\[1\]"):
            _raw.resolved_table("ptrs", ptrs, DEV)


def test_unregistered_host_memory_is_refused() -> None:
    plain = torch.empty(4096, dtype=torch.uint8)  # a host VA no kernel may read
    with pytest.raises(errors.NotRegisteredError, match=r"t\[0\]"):
        _raw.resolved_table("t", torch.tensor([plain.data_ptr()], dtype=torch.uint64), DEV)


def test_reach_past_the_allocation_or_chunk(host: pd.RegisteredHostMemory) -> None:
    dev = pd.device_empty((1000,), torch.uint8, DEV)
    with pytest.raises(errors.RegistrationSpanError, match=r"p\[0\].*1 bytes past"):
        _raw.resolved_table("p", torch.tensor([dev.data_ptr()], dtype=torch.uint64), DEV, reach=1001)
    with pytest.raises(errors.RegistrationSpanError, match="registration chunk"):  # crosses into chunk 2
        _raw.resolved_table("p", torch.tensor([host.tensor.data_ptr() + PAGE], dtype=torch.uint64), DEV,
                            reach=PAGE + 1)


def test_memory_of_another_device_is_refused() -> None:
    other = pd.device_empty((64,), torch.uint8, "emulated:1")
    with pytest.raises(errors.DeviceMismatchError, match="emulated:1"):
        _raw.resolved_table("k", torch.tensor([other.data_ptr()], dtype=torch.uint64), DEV)
    mem1 = pd.alloc_registered(PAGE, "emulated:1")  # registrations are portable (cudaHostRegisterPortable)
    try:
        table = _raw.resolved_table("k", torch.tensor([mem1.tensor.data_ptr()], dtype=torch.uint64), DEV)
        assert table.raw_values() == (_alias(mem1.tensor.data_ptr()),)
    finally:
        mem1.close()


def test_bad_tables() -> None:
    dev = pd.device_empty((64,), torch.uint8, DEV)
    with pytest.raises(errors.InvalidTypeError):
        _raw.resolved_table("p", [dev.data_ptr()], DEV)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidTypeError):
        _raw.resolved_table("p", torch.tensor([1.0]), DEV)
    with pytest.raises(errors.IndexValidationError):
        _raw.resolved_table("p", torch.zeros((1, 1), dtype=torch.uint64), DEV)
    with pytest.raises(errors.IndexValidationError):
        _raw.resolved_table("p", torch.zeros((0,), dtype=torch.uint64), DEV)
    for reach in (0, -1, [1, 2], True, [1.5]):
        with pytest.raises(errors.InvalidArgumentError):
            _raw.resolved_table("p", torch.tensor([dev.data_ptr()], dtype=torch.uint64), DEV, reach=reach)  # type: ignore[arg-type]


def test_cache_follows_the_table_tensor(host: pd.RegisteredHostMemory) -> None:
    dev = pd.device_empty((4096,), torch.uint8, DEV)
    ptrs = torch.tensor([dev.data_ptr(), host.tensor.data_ptr()], dtype=torch.uint64)
    first = _raw.resolved_table("p", ptrs, DEV, reach=64)
    assert _raw.resolved_table("p", ptrs, DEV, reach=64) is first  # a pool's table: resolved once
    ptrs[0] = dev.data_ptr() + 64  # an in-place write: re-resolved
    again = _raw.resolved_table("p", ptrs, DEV, reach=64)
    assert again is not first and again.raw_values()[0] == dev.data_ptr() + 64
    ptrs[1] = 12345
    with pytest.raises(errors.NotRegisteredError, match=r"p\[1\]"):
        _raw.resolved_table("p", ptrs, DEV, reach=64)
    copy = ptrs.clone()
    copy[1] = host.tensor.data_ptr()
    assert _raw.resolved_table("p", copy, DEV, reach=64).raw_values()[1] == _alias(host.tensor.data_ptr())


def test_closed_registration_under_a_cached_table() -> None:
    mem = pd.alloc_registered(PAGE, DEV)
    ptrs = torch.tensor([mem.tensor.data_ptr()], dtype=torch.uint64)
    table = _raw.resolved_table("p", ptrs, DEV)
    mem.close()
    with pytest.raises(errors.ClosedError, match=r"p\[0\]"):
        _raw.resolved_table("p", ptrs, DEV)
    layout = pd.KVLayout(kind="layer_first", num_layers=1, num_pages=1, page_size=1, num_heads=1, head_dim=64,
                         dtype="uint8", attention="mla")
    dev = pd.device_empty((64,), torch.uint8, DEV)
    src = _raw.tensor_table("src", [dev], DEV)
    idx = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(errors.ClosedError):  # the table kept from before the close is refused at launch too
        pd.transfer_kv_all_layer(src, table, idx, idx, src_layout=layout, dst_layout=layout.replace(num_pages=PAGE // 64),
                                 backend="kernel")


def test_resolve_addresses_vectorised(host: pd.RegisteredHostMemory) -> None:
    dev = pd.device_empty((8192,), torch.uint8, DEV)
    va = host.tensor.data_ptr()
    addrs = [dev.data_ptr() + 512 * i for i in range(8)] + [va + 1024 * i for i in range(8)] + [va + 2 * PAGE + 7]
    out = _raw.resolve_addresses("src_ptrs", torch.tensor(addrs, dtype=torch.int64), 256, DEV)
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert out.tolist() == addrs[:8] + [_alias(a) for a in addrs[8:]]
    sizes = torch.tensor([512] * 8 + [1024] * 8 + [PAGE], dtype=torch.int64)
    owners = _raw.addresses_table("src_ptrs", torch.tensor(addrs, dtype=torch.int64), sizes, DEV).registrations()
    assert len(owners) == 1
    sizes[7] = 8192 - 7 * 512 + 1  # one byte past the device allocation's end
    with pytest.raises(errors.RegistrationSpanError, match=r"src_ptrs\[7\]"):
        _raw.resolve_addresses("src_ptrs", torch.tensor(addrs, dtype=torch.int64), sizes, DEV)
    sizes[7] = 512
    sizes[15] = 1025  # va + 7 * 1024 + 1025 crosses into the second chunk
    with pytest.raises(errors.RegistrationSpanError, match=r"src_ptrs\[15\]"):
        _raw.resolve_addresses("src_ptrs", torch.tensor(addrs, dtype=torch.int64), sizes, DEV)
    for bad_sizes in (0, -4, torch.zeros(len(addrs), dtype=torch.int64), torch.ones(3, dtype=torch.int64), 1.0):
        with pytest.raises(errors.InvalidArgumentError):
            _raw.resolve_addresses("p", torch.tensor(addrs, dtype=torch.int64), bad_sizes, DEV)  # type: ignore[arg-type]
    with pytest.raises(errors.NotRegisteredError, match=r"p\[1\]"):
        _raw.resolve_addresses("p", torch.tensor([dev.data_ptr(), -4096], dtype=torch.int64), 8, DEV)


def test_tensor_table_cache() -> None:
    dev = pd.device_empty((256,), torch.uint8, DEV)
    mem = pd.alloc_registered(PAGE, DEV)
    try:
        first = _raw.tensor_table("bufs", [dev, mem.tensor], DEV)
        assert _raw.tensor_table("bufs", [dev, mem.tensor], DEV) is first
        assert _raw.tensor_table("bufs", [dev, mem.tensor[:]], DEV) is first  # a new view of the same bytes
        assert first.raw_values() == (dev.data_ptr(), _alias(mem.tensor.data_ptr()))
        with pytest.raises(errors.InvalidTypeError, match=r"bufs\[1\]"):
            _raw.tensor_table("bufs", [dev, 3], DEV)  # type: ignore[list-item]
        plain = torch.empty(16, dtype=torch.uint8)
        with pytest.raises(errors.DomainError, match="^bufs"):
            _raw.tensor_table("bufs", [plain], DEV)
    finally:
        mem.close()
    with pytest.raises(errors.ClosedError):
        _raw.tensor_table("bufs", [dev, mem.tensor], DEV)  # the cached table is not handed out after close


def test_strict_mode_alias_is_the_registered_mapping() -> None:
    with pd.strict_alias(True):
        mem = pd.alloc_registered(PAGE, DEV)
    try:
        table = _raw.resolved_table("p", torch.tensor([mem.tensor.data_ptr() + 64], dtype=torch.uint64), DEV)
        assert table.raw_values() == (_alias(mem.tensor.data_ptr() + 64),)
        assert table.raw_values()[0] != mem.tensor.data_ptr() + 64
    finally:
        mem.close()


def test_inference_mode_tables_are_compared_by_content() -> None:
    dev = pd.device_empty((4096,), torch.uint8, DEV)
    with torch.inference_mode():
        ptrs = torch.tensor([dev.data_ptr()], dtype=torch.uint64)
        first = _raw.resolved_table("p", ptrs, DEV, reach=64)
        assert _raw.resolved_table("p", ptrs, DEV, reach=64) is first
        ptrs[0] = dev.data_ptr() + 64  # no version counter here: the contents tell
        again = _raw.resolved_table("p", ptrs, DEV, reach=64)
    assert again is not first and again.raw_values() == (dev.data_ptr() + 64,)


def test_addresses_table_matches_resolve_addresses(host: pd.RegisteredHostMemory) -> None:
    dev = pd.device_empty((8192,), torch.uint8, DEV)
    addrs = torch.tensor([dev.data_ptr() + 64 * i for i in range(100)] + [host.tensor.data_ptr() + 64 * i for i in range(100)],
                         dtype=torch.int64)
    table = _raw.addresses_table("a", addrs, 64, DEV)
    assert list(table.raw_values()) == _raw.resolve_addresses("a", addrs, 64, DEV).tolist()
    assert table.sizes == (64,) * 200 and len(table.registrations()) == 1
    assert [kind for _, _, kind in table.resolved_regions()] == ["device"]
