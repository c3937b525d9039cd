"""Break attempts on the engines' call shapes that once got through: each is now a typed
error before anything is written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import lmcache as lmc
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import sgl_kernel as sk

DEV = pd.validate_device("emulated:0")


@pytest.fixture
def regs() -> Iterator[list[pd.RegisteredHostMemory]]:
    owners = [pd.alloc_registered(1024, DEV) for _ in range(3)]
    yield owners
    for mem in owners:
        mem.close()


def _table(ts: list[torch.Tensor]) -> torch.Tensor:  # in device memory, as sglang keeps it
    values = torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    return pd.device_empty((len(ts),), torch.uint64, DEV).copy_(values)


def test_direct_torch_route_still_checks_the_other_buffers() -> None:
    """One pageable buffer sends a direct op down the torch route; a closed registration
    among the others is refused as on the table path, and not written."""
    a, b = (pd.device_empty((16, 32), torch.uint8, DEV).fill_(i + 1) for i in range(2))
    reg = pd.alloc_registered(512, DEV)
    closed = reg.tensor.view(16, 32)
    closed.zero_()
    reg.close()
    plain = torch.zeros(16, 32, dtype=torch.uint8)
    s, d = torch.arange(4), torch.arange(4, 8)
    with pytest.raises(errors.ClosedError, match=r"dst_layers\[0\]"):
        sk.transfer_kv_direct([a, b], [closed, plain], s, d, 4)
    assert bool((closed == 0).all()) and bool((plain == 0).all())


def test_hicache_rows_with_a_strided_last_dimension(regs: list[pd.RegisteredHostMemory]) -> None:
    src = regs[0].tensor[:256].view(2, 8, 16)
    big = pd.device_empty((2, 8, 32), torch.uint8, DEV).fill_(0xA5)
    dk, dv = big[0][:, ::2], big[1][:, ::2]  # a token's 16 bytes two apart
    with pytest.raises(errors.LayoutError, match="adjacent"):
        hc.transfer_hicache_one_layer(dk, dv, torch.tensor([0, 3]), src[0], src[1], torch.tensor([1, 5]))
    assert bool((big == 0xA5).all())


def test_non_dense_tensors_and_out_of_range_sizes(regs: list[pd.RegisteredHostMemory]) -> None:
    k = [pd.device_empty((16, 32), torch.uint8, DEV) for _ in range(2)]
    h = [r.tensor[:512].view(16, 32) for r in regs[:2]]
    s, d = torch.tensor([1, 2]), torch.tensor([3, 4])
    meta_idx = torch.empty(2, dtype=torch.int64, device="meta")
    meta_tab = torch.empty(2, dtype=torch.uint64, device="meta")
    with pytest.raises(errors.IndexValidationError):
        sk.transfer_kv_per_layer(k[0], h[0], k[1], h[1], meta_idx, d, 32)
    with pytest.raises(errors.InvalidTypeError, match="meta"):
        sk.transfer_kv_all_layer(meta_tab, _table(h), _table(k), _table(h), s, d, 32, 2)
    with pytest.raises(errors.InvalidTypeError, match="sparse"):
        sk.transfer_kv_per_layer(k[0].to_sparse(), h[0], k[1], h[1], s, d, 32)
    with pytest.raises(errors.InvalidTypeError, match="sparse"):
        sk.transfer_kv_all_layer_lf_pf(_table(k), h[0].view(8, 64).to_sparse(), _table(k), h[1].view(8, 64), s, d,
                                       32, 64, 2)
    with pytest.raises(errors.LayoutError):
        hc.transfer_hicache_one_layer(h[0], h[1], d, k[0], k[1], s, element_dim=2**63)
    pd_host = regs[2].tensor.view(16, 2, 32)
    with pytest.raises(errors.LayoutError, match="non-empty"):
        hc.transfer_hicache_all_layer_mla_staged_lf_pf(_table(k), torch.arange(4), torch.arange(4),
                                                       pd.device_empty((0, 2, 32), torch.uint8, DEV), pd_host,
                                                       page_size=4)


def test_lmcache_page_buffer_size_beyond_int64() -> None:
    caches = [pd.device_empty((2, 4, 4, 2, 8), torch.bfloat16, DEV) for _ in range(2)]
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    kv = pd.device_empty((2, 2, 5, 16), torch.bfloat16, DEV)
    for huge in (2**58, 2**63, 2**70):
        with pytest.raises(errors.PointerDomainError):
            lmc.multi_layer_kv_transfer(kv, ptrs, torch.arange(5), DEV, huge, 1, 1, 4)


def test_device_memory_freed_under_a_cached_table_is_refused(regs: list[pd.RegisteredHostMemory]) -> None:
    """A raw table resolved once, its device buffers freed: the compat cache sees the
    backend's release count move, looks its regions up again and resolves the table anew,
    which refuses the freed entries before anything is read."""
    k = [pd.device_empty((256, 64), torch.uint8, DEV) for _ in range(2)]
    v = [pd.device_empty((256, 64), torch.uint8, DEV) for _ in range(2)]
    host = regs[0].tensor[:1024].view(2, 4, 128)
    kt, vt = _table(k), _table(v)
    idx = torch.tensor([1, 3])
    sk.transfer_kv_all_layer_lf_pf(kt, host[0], vt, host[1], idx, idx, 64, 128, 2)
    del k, v
    before = host.clone()
    with pytest.raises(errors.NotRegisteredError, match="no memory this process knows"):
        sk.transfer_kv_all_layer_lf_pf(kt, host[0], vt, host[1], idx, idx, 64, 128, 2)
    assert torch.equal(host, before)


def test_pointer_tables_held_in_host_memory_are_named_as_such() -> None:
    """uint64 tables on the CPU whose entries are device buffers: the tables' place is what
    is wrong (the kernel reads them on the device), not the memory their entries name."""
    k = [pd.device_empty((16, 32), torch.uint8, DEV).fill_(7) for _ in range(4)]
    v = [pd.device_empty((16, 32), torch.uint8, DEV).fill_(9) for _ in range(4)]

    def cpu_table(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    s, d = torch.tensor([0, 1]), torch.tensor([2, 3])
    with pytest.raises(errors.DomainError, match=r"src_k_layers.*held in host memory.*\.to\("):
        sk.transfer_kv_all_layer(cpu_table(k[:2]), cpu_table(k[2:]), cpu_table(v[:2]), cpu_table(v[2:]), s, d, 32, 2)
    assert all(bool((t == 7).all()) for t in k) and all(bool((t == 9).all()) for t in v)
