"""Repeated calls of the engines' call shapes (pointerdomain.compat) on the emulated device:
a repeat goes straight to the direct launch, so every case here first makes a call that
prepares the call shape, then changes one thing the prepared translation depends on and
checks the next call against plain torch on bytes (destinations poisoned: what must not be
written stays poisoned) or for its typed error with nothing written."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.compat import clear_cache
from pointerdomain.compat import lmcache as lmc
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import sgl_kernel as sk
from pointerdomain.compat import vllm as vl
from tests.helpers.compat import POISON, rand, same, u8, untouched
from tests.helpers.compat import dev as _dev
from tests.helpers.compat import table as _table

DEV = pd.validate_device("emulated:0")
OTHER = pd.validate_device("emulated:1")
DT = torch.bfloat16
L, H, D = 3, 2, 8
ITEM = H * D * 2
T, HT = 16, 20  # device and host tokens


@pytest.fixture
def regs() -> Iterator[list[pd.RegisteredHostMemory]]:
    owners: list[pd.RegisteredHostMemory] = []
    yield owners
    for mem in owners:
        if not mem.closed:
            mem.close()


def host(regs: list[pd.RegisteredHostMemory], *shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    size = numel * torch.empty(0, dtype=dtype).element_size()
    mem = pd.alloc_registered(size, DEV)
    regs.append(mem)
    return mem.tensor[:size].view(dtype).view(shape)


def dev(*shape: int, dtype: torch.dtype = DT, device: pd.Device = DEV) -> torch.Tensor:
    return _dev(*shape, dtype=dtype, device=device)


def poison(*ts: torch.Tensor) -> None:
    for t in ts:
        u8(t).fill_(POISON)


def table(ts: list[torch.Tensor]) -> torch.Tensor:
    return _table(ts, DEV)


S = torch.tensor([3, 17, 8, 0])  # host slots
DI = torch.tensor([15, 2, 7, 9])  # device slots


def _load(hk: torch.Tensor, hv: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, layer: int = 1,
          **kw: object) -> None:
    sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S, DI, layer, ITEM, L * ITEM, **kw)  # type: ignore[arg-type]


def test_pf_lf_repeat_reads_a_new_buffer_and_refuses_a_reshaped_view(regs: list[pd.RegisteredHostMemory]) -> None:
    pool = rand(host(regs, 2, HT, L, H, D))
    hk, hv = pool[0], pool[1]  # the pool's k_buffer / v_buffer
    dk, dv = dev(T, H, D), dev(T, H, D)
    for _ in range(2):  # prepared, then repeated
        poison(dk, dv)
        _load(hk, hv, dk, dv)
        assert same(dk[DI], hk[S, 1]) and same(dv[DI], hv[S, 1])
    other = rand(host(regs, HT, L, H, D))  # another buffer of the same shape in the K place
    poison(dk, dv)
    _load(other, hv, dk, dv)
    assert same(dk[DI], other[S, 1]) and same(dv[DI], hv[S, 1])
    poison(dk, dv)
    _load(pool[0], pool[1], dk, dv)  # new view objects of the same pool: the same buffers
    assert same(dk[DI], hk[S, 1])
    poison(dk, dv)  # the same bytes with another row: the full path's row check refuses it
    with pytest.raises(errors.LayoutError, match="src_k"):
        _load(hk.view(HT // 2, 2 * L, H, D), hv, dk, dv)
    strided = hk.as_strided(hk.shape, (L * H * D, H * D, 1, H))  # same address, shape and dtype
    with pytest.raises(errors.NonContiguousError, match="src_k"):
        _load(strided, hv, dk, dv)
    assert untouched(dk, dv)
    with pytest.raises(errors.InvalidArgumentError, match="block_quota"):  # True is not the int 1 of a repeat
        _load(hk, hv, dk, dv, block_quota=True)
    _load(hk, hv, dk, dv, block_quota=1)
    with pytest.raises(errors.InvalidArgumentError, match="block_quota"):
        _load(hk, hv, dk, dv, block_quota=True)
    assert same(dk[DI], hk[S, 1])


def test_repeat_with_bad_indices_gets_the_call_shapes_error(regs: list[pd.RegisteredHostMemory]) -> None:
    pool = rand(host(regs, 2, HT, L, H, D))
    dk, dv = dev(T, H, D), dev(T, H, D)
    _load(pool[0], pool[1], dk, dv)
    poison(dk, dv)
    with pytest.raises(errors.IndexValidationError, match=r"dst_indices: slot 16 outside \[0, 16\)"):
        sk.transfer_kv_per_layer_pf_lf(pool[0], dk, pool[1], dv, S, torch.tensor([1, 2, 3, 16]), 1, ITEM, L * ITEM)
    with pytest.raises(errors.IndexValidationError, match="int64"):
        sk.transfer_kv_per_layer_pf_lf(pool[0], dk, pool[1], dv, S.int(), DI, 1, ITEM, L * ITEM)
    assert untouched(dk, dv)


def test_lf_pf_repeat_sees_a_table_set_to_other_storage(regs: list[pd.RegisteredHostMemory]) -> None:
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    dvs = [rand(dev(T, H, D)) for _ in range(L)]
    hk, hv = host(regs, HT, L, H, D), host(regs, HT, L, H, D)
    k_tab, v_tab = table(dks), table(dvs)
    sk.transfer_kv_all_layer_lf_pf(k_tab, hk, v_tab, hv, DI, S, ITEM, L * ITEM, L)
    others = [rand(dev(T, H, D)) for _ in range(L)]
    k_tab.set_(table(others).untyped_storage())  # the same table object over new storage
    poison(hk, hv)
    sk.transfer_kv_all_layer_lf_pf(k_tab, hk, v_tab, hv, DI, S, ITEM, L * ITEM, L)
    for i in range(L):
        assert same(hk[S, i], others[i][DI]) and same(hv[S, i], dvs[i][DI])


def test_inference_mode_table_is_compared_by_contents(regs: list[pd.RegisteredHostMemory]) -> None:
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    dvs = [rand(dev(T, H, D)) for _ in range(L)]
    hk, hv = host(regs, HT, L, H, D), host(regs, HT, L, H, D)
    with torch.inference_mode():
        k_tab = torch.tensor([x.data_ptr() for x in dks], dtype=torch.uint64)
    v_tab = table(dvs)
    sk.transfer_kv_all_layer_lf_pf(k_tab, hk, v_tab, hv, DI, S, ITEM, L * ITEM, L)
    other = rand(dev(T, H, D))
    with torch.inference_mode():
        k_tab[2] = other.data_ptr()  # no version counter to see this
    poison(hk, hv)
    sk.transfer_kv_all_layer_lf_pf(k_tab, hk, v_tab, hv, DI, S, ITEM, L * ITEM, L)
    assert same(hk[S, 2], other[DI]) and same(hk[S, 0], dks[0][DI])


def test_clear_cache_forgets_prepared_calls(regs: list[pd.RegisteredHostMemory]) -> None:
    pool = rand(host(regs, 2, HT, L, H, D))
    dk, dv = dev(T, H, D), dev(T, H, D)
    _load(pool[0], pool[1], dk, dv)
    assert sk.prepared
    clear_cache()
    assert not sk.prepared
    poison(dk, dv)
    _load(pool[0], pool[1], dk, dv)
    assert same(dk[DI], pool[0][S, 1])


def test_hicache_one_layer_repeat_widens_int32_and_reads_a_new_buffer(regs: list[pd.RegisteredHostMemory]) -> None:
    hk, hv = rand(host(regs, HT, H, D)), rand(host(regs, HT, H, D))
    dk, dv = dev(T, H, D), dev(T, H, D)
    hc.transfer_hicache_one_layer(dk, dv, DI, hk, hv, S, element_dim=H * D)
    poison(dk, dv)
    hc.transfer_hicache_one_layer(dk, dv, DI.int(), hk, hv, S.int(), element_dim=H * D)
    assert same(dk[DI], hk[S]) and same(dv[DI], hv[S])
    other = rand(host(regs, HT, H, D))
    poison(dk, dv)
    hc.transfer_hicache_one_layer(dk, dv, DI, other, hv, S, element_dim=H * D)
    assert same(dk[DI], other[S]) and same(dv[DI], hv[S])
    poison(dk, dv)
    with pytest.raises(errors.IndexValidationError, match="indices_src"):
        hc.transfer_hicache_one_layer(dk, dv, DI, other, hv, torch.tensor([0, 1, 2, HT]), element_dim=H * D)
    assert untouched(dk, dv)


def test_hicache_all_layer_repeat_sees_a_rewritten_table(regs: list[pd.RegisteredHostMemory]) -> None:
    hks = [host(regs, HT, H, D) for _ in range(L)]
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    h_tab, d_tab = table(hks), table(dks)
    hc.transfer_hicache_all_layer_mla(h_tab, S, d_tab, DI, cache_src_stride_bytes=ITEM, cache_dst_stride_bytes=ITEM)
    other = rand(dev(T, H, D))
    d_tab[1] = other.data_ptr()
    for t in hks:
        poison(t)
    hc.transfer_hicache_all_layer_mla(h_tab, S, d_tab, DI, cache_src_stride_bytes=ITEM, cache_dst_stride_bytes=ITEM)
    assert same(hks[1][S], other[DI]) and same(hks[0][S], dks[0][DI])
    d_tab[1] = 12345 * 4096  # no memory this process knows
    for t in hks:
        poison(t)
    with pytest.raises(errors.NotRegisteredError, match=r"ptr_src\[1\]"):
        hc.transfer_hicache_all_layer_mla(h_tab, S, d_tab, DI, cache_src_stride_bytes=ITEM,
                                          cache_dst_stride_bytes=ITEM)
    assert untouched(*hks)


# -- LMCache -------------------------------------------------------------------------------------

BLOCKS, BS = 4, 4
CAP = BLOCKS * BS
FMT = lmc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def _caches() -> list[torch.Tensor]:
    return [rand(dev(2, BLOCKS, BS, H, D)) for _ in range(L)]


def _multi(obj: torch.Tensor, ptrs: torch.Tensor, slots: torch.Tensor) -> None:
    lmc.multi_layer_kv_transfer(obj, ptrs, slots, "emulated:0", CAP, lmc.TransferDirection.D2H, FMT, BS)


def _want(caches: list[torch.Tensor], slots: torch.Tensor, obj: torch.Tensor) -> torch.Tensor:
    want = u8(obj).clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for layer, c in enumerate(caches):
            for kv in range(2):
                want[kv, layer, t] = u8(c[kv].reshape(CAP, H * D))[s]
    return want


def test_multi_layer_repeat_skips_negative_slots_and_refuses_slots_past_the_cache(
        regs: list[pd.RegisteredHostMemory]) -> None:
    caches = _caches()
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    obj = host(regs, 2, L, 4, H * D)
    slots = torch.tensor([5, 0, 15, 9])
    for _ in range(2):
        poison(obj)
        _multi(obj, ptrs, slots)
        assert torch.equal(u8(obj), _want(caches, slots, obj))
    padded = torch.tensor([-1, -1, 15, 2])  # a prefix hit: upstream skips the -1 tokens
    poison(obj)
    _multi(obj, ptrs, padded)
    assert torch.equal(u8(obj), _want(caches, padded, obj))
    assert bool((u8(obj[:, :, :2]) == POISON).all())
    poison(obj)
    with pytest.raises(errors.IndexValidationError, match=r"slot_mapping\[3\]: slot 16 outside \[0, 16\)"):
        _multi(obj, ptrs, torch.tensor([1, 2, 3, CAP]))
    with pytest.raises(errors.IndexValidationError, match="slot_mapping"):  # fewer slots than tokens
        _multi(obj, ptrs, torch.tensor([1, 2, 3]))
    assert untouched(obj)
    longer = torch.tensor([4, 5, 6, 7, 8])  # the current shape reads the first T slots
    _multi(obj, ptrs, longer)
    assert torch.equal(u8(obj), _want(caches, longer[:4], obj))


def test_multi_layer_repeat_sees_a_rewritten_pointer_table(regs: list[pd.RegisteredHostMemory]) -> None:
    caches = _caches()
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    obj = host(regs, 2, L, 4, H * D)
    slots = torch.tensor([5, 0, 15, 9])
    _multi(obj, ptrs, slots)
    other = _caches()[0]
    ptrs[0] = other.data_ptr()
    poison(obj)
    _multi(obj, ptrs, slots)
    assert torch.equal(u8(obj), _want([other, *caches[1:]], slots, obj))
    ptrs[1] = obj.data_ptr()  # host memory where a paged cache belongs (and too small for one)
    poison(obj)
    with pytest.raises(errors.PointerDomainError, match=r"key_value_ptrs\[1\]"):
        _multi(obj, ptrs, slots)
    assert untouched(obj)


def test_multi_layer_device_without_ordinal_is_never_keyed() -> None:
    assert not lmc._keyed_device("cuda") and not lmc._keyed_device(torch.device("cuda"))
    assert lmc._keyed_device("cuda:0") and lmc._keyed_device(torch.device("cuda", 1)) and lmc._keyed_device(DEV)


def test_single_layer_repeat_checks_slots_and_dtype(regs: list[pd.RegisteredHostMemory]) -> None:
    cache = rand(dev(2, BLOCKS, BS, H, D))
    lmc_kv = host(regs, 2, 6, H * D)
    slots = torch.tensor([5, 0, 15, 9])

    def want(s: torch.Tensor) -> torch.Tensor:
        w = u8(lmc_kv).clone()
        for t, slot in enumerate(s.tolist()):
            if slot >= 0:
                for kv in range(2):
                    w[kv, t] = u8(cache[kv].reshape(CAP, H * D))[slot]
        return w

    for s in (slots, slots, torch.tensor([3, -1]), torch.tensor([1, 2, 3, 4, 5, 6])):
        poison(lmc_kv)
        lmc.single_layer_kv_transfer(lmc_kv, cache, s, lmc.TransferDirection.D2H, FMT)
        assert torch.equal(u8(lmc_kv), want(s))
    poison(lmc_kv)
    with pytest.raises(errors.IndexValidationError, match="slot_mapping"):  # more slots than the buffer holds
        lmc.single_layer_kv_transfer(lmc_kv, cache, torch.arange(7), lmc.TransferDirection.D2H, FMT)
    with pytest.raises(errors.InvalidTypeError, match="dtype"):  # same bytes, another dtype
        lmc.single_layer_kv_transfer(lmc_kv.view(torch.float16), cache, slots, lmc.TransferDirection.D2H, FMT)
    assert untouched(lmc_kv)


# -- vLLM ------------------------------------------------------------------------------------------

NB, BB = 8, 64  # blocks, bytes a block


def test_swap_blocks_repeat_checks_the_mapping(regs: list[pd.RegisteredHostMemory]) -> None:
    gpu = rand(dev(NB, BB, dtype=torch.uint8))
    cpu = host(regs, NB, BB, dtype=torch.uint8)
    mapping = torch.tensor([[0, 3], [5, 1], [2, 2]])
    for m in (mapping, torch.tensor([[7, 0], [1, 7]])):
        poison(cpu)
        vl.swap_blocks(gpu, cpu, BB, m)
        want = torch.full_like(cpu, POISON)
        want[m[:, 1]] = gpu[m[:, 0]]
        assert torch.equal(cpu, want)
    poison(cpu)
    with pytest.raises(errors.OverlapError, match="dst block 3"):
        vl.swap_blocks(gpu, cpu, BB, torch.tensor([[0, 3], [1, 3]]))
    with pytest.raises(errors.IndexValidationError, match=r"block_mapping\[1\]\[0\]: src block 8"):
        vl.swap_blocks(gpu, cpu, BB, torch.tensor([[0, 3], [NB, 4]]))
    on_device = pd.device_empty((1, 2), dtype=torch.int64, device=DEV).copy_(torch.tensor([[0, 1]]))
    with pytest.raises(errors.IndexValidationError, match="block_mapping"):
        vl.swap_blocks(gpu, cpu, BB, on_device)
    with pytest.raises(errors.IndexValidationError, match="int64"):
        vl.swap_blocks(gpu, cpu, BB, mapping.int())
    assert untouched(cpu)
    with pytest.raises(errors.InvalidTypeError, match="block_size_in_bytes"):
        vl.swap_blocks(gpu, cpu, True, mapping)


def test_swap_blocks_batch_repeat_sees_arrays_rewritten_through_numpy(regs: list[pd.RegisteredHostMemory]) -> None:
    gpu = rand(dev(NB, BB, dtype=torch.uint8))
    cpu = host(regs, NB, BB, dtype=torch.uint8)
    src = np.array([gpu[b].data_ptr() for b in (0, 4, 6)], dtype=np.int64)
    dst = np.array([cpu[b].data_ptr() for b in (1, 2, 7)], dtype=np.int64)
    sizes = np.full(3, BB, dtype=np.int64)
    s_t, d_t, n_t = torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(sizes)
    poison(cpu)
    vl.swap_blocks_batch(s_t, d_t, n_t)
    assert same(cpu[[1, 2, 7]], gpu[[0, 4, 6]]) and untouched(cpu[0], cpu[3])
    src[1] = gpu[5].data_ptr()  # written through numpy: no version counter sees it
    poison(cpu)
    vl.swap_blocks_batch(s_t, d_t, n_t)
    assert same(cpu[2], gpu[5]) and same(cpu[1], gpu[0])
    src[2] = gpu[7].data_ptr() + 1  # a run past the tensor's allocation
    poison(cpu)
    with pytest.raises(errors.RegistrationSpanError, match=r"src_ptrs\[2\]"):
        vl.swap_blocks_batch(s_t, d_t, n_t)
    assert untouched(cpu)


def test_block_quota_variable_is_read_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_HICACHE_BLOCK_QUOTA", raising=False)
    assert sk._default_mla_block_quota() == (16 if sk.IS_HIP else 2) and sk._default_pfdhg_block_quota() == 2
    monkeypatch.setenv("SGLANG_HICACHE_BLOCK_QUOTA", "7")
    assert sk._default_mla_block_quota() == 7 and sk._default_pfdhg_block_quota() == 7
    monkeypatch.setenv("SGLANG_HICACHE_BLOCK_QUOTA", "seven")  # not an int: the default, as upstream
    assert sk._default_pfdhg_block_quota() == 2


def test_repeat_over_memory_registered_again_resolves_it_again() -> None:
    """A registration closed under a prepared call and the same memory registered again: the
    repeat is refused by the launch before writing, and the full path finds the new one."""
    buf = torch.empty(2 * HT * L * H * D, dtype=DT)
    reg = pd.register_host_tensor(buf, DEV)
    pool = rand(buf.view(2, HT, L, H, D))
    dk, dv = dev(T, H, D), dev(T, H, D)
    _load(pool[0], pool[1], dk, dv)
    reg.close()
    poison(dk, dv)
    with pytest.raises(errors.ClosedError):
        _load(pool[0], pool[1], dk, dv)
    assert untouched(dk, dv)
    again = pd.register_host_tensor(buf, DEV)
    try:
        _load(pool[0], pool[1], dk, dv)
        assert same(dk[DI], pool[0][S, 1]) and same(dv[DI], pool[1][S, 1])
    finally:
        again.close()
