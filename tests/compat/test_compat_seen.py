"""Repeats found by their arguments' identity (pointerdomain.compat._raw.Seen): a repeat of a
call shape with the same tensor objects skips the translation and goes to the direct launch.
Each case first makes the call that prepares the shape, then proves the repeat took the
identity path (the translation is made to fail: a repeat that still needed it would raise),
then changes one thing and checks the next call against plain torch on poisoned bytes: a
raw table whose contents changed in place, or whose storage was swapped, is resolved again;
a buffer written in place is still the same buffer."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain.compat import _raw
from pointerdomain.compat import lmcache as lmc
from pointerdomain.compat import sgl_hicache as hc
from pointerdomain.compat import sgl_kernel as sk
from pointerdomain.compat import vllm as vl
from tests.helpers.compat import POISON, rand, same, u8, untouched
from tests.helpers.compat import dev as _dev
from tests.helpers.compat import table as _table

DEV = pd.validate_device("emulated:0")
DT = torch.bfloat16
L, H, D = 3, 2, 8
ITEM = H * D * 2
T, HT = 16, 20  # device and host tokens
S = torch.tensor([3, 17, 8, 0])  # host slots
DI = torch.tensor([15, 2, 7, 9])  # device slots


@pytest.fixture
def regs() -> Iterator[list[pd.RegisteredHostMemory]]:
    owners: list[pd.RegisteredHostMemory] = []
    yield owners
    for mem in owners:
        if not mem.closed:
            mem.close()


@pytest.fixture(autouse=True)
def no_collection() -> Iterator[None]:
    """No garbage collection inside a case: a collection that frees emulated device memory
    (an earlier test's cyclic garbage) moves the memory generation, which drops every cached
    resolution (_raw.memory_current), so a repeat rightly takes the full path again."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


def host(regs: list[pd.RegisteredHostMemory], *shape: int) -> torch.Tensor:
    size = 2 * int(torch.tensor(shape).prod())
    mem = pd.alloc_registered(size, DEV)
    regs.append(mem)
    return mem.tensor[:size].view(DT).view(shape)


def dev(*shape: int) -> torch.Tensor:
    return _dev(*shape, dtype=DT, device=DEV)


def poison(*ts: torch.Tensor) -> None:
    for t in ts:
        u8(t).fill_(POISON)


def _no_translation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the translation of a call fail: a call that still runs after this took the
    identity path (resolved_table / tensor_table are where every full path starts)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("translated again")

    monkeypatch.setattr(_raw, "resolved_table", refuse)
    monkeypatch.setattr(_raw, "tensor_table", refuse)


def _lf_pf_setup(regs: list[pd.RegisteredHostMemory]) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor,
                                                               torch.Tensor, torch.Tensor, torch.Tensor]:
    dks = [rand(dev(T, H, D)) for _ in range(L)]
    dvs = [rand(dev(T, H, D)) for _ in range(L)]
    hk, hv = host(regs, HT, L, H, D), host(regs, HT, L, H, D)
    return dks, dvs, hk, hv, _table(dks, DEV), _table(dvs, DEV)


def _backup(k_tab: torch.Tensor, hk: torch.Tensor, v_tab: torch.Tensor, hv: torch.Tensor) -> None:
    sk.transfer_kv_all_layer_lf_pf(k_tab, hk, v_tab, hv, DI, S, ITEM, L * ITEM, L)


def _backed_up(hk: torch.Tensor, layers: list[torch.Tensor]) -> bool:
    return all(same(hk[S, i], layers[i][DI]) for i in range(L))


def test_a_repeat_takes_the_identity_path(regs: list[pd.RegisteredHostMemory], monkeypatch: pytest.MonkeyPatch) -> None:
    dks, dvs, hk, hv, k_tab, v_tab = _lf_pf_setup(regs)
    _backup(k_tab, hk, v_tab, hv)
    _no_translation(monkeypatch)
    poison(hk, hv)
    _backup(k_tab, hk, v_tab, hv)
    assert _backed_up(hk, dks) and _backed_up(hv, dvs)


def test_table_contents_changed_in_place_are_resolved_again(regs: list[pd.RegisteredHostMemory]) -> None:
    dks, dvs, hk, hv, k_tab, v_tab = _lf_pf_setup(regs)
    _backup(k_tab, hk, v_tab, hv)
    _backup(k_tab, hk, v_tab, hv)
    others = [rand(dev(T, H, D)) for _ in range(L)]
    k_tab.copy_(_table(others, DEV))  # the same table object, new addresses written through torch
    poison(hk, hv)
    _backup(k_tab, hk, v_tab, hv)
    assert _backed_up(hk, others) and _backed_up(hv, dvs)
    k_tab[1] = 0x1000  # an address in no known memory: refused before anything is written
    poison(hk, hv)
    with pytest.raises(pd.errors.NotRegisteredError, match=r"src_k_layers\[1\]"):
        _backup(k_tab, hk, v_tab, hv)
    assert untouched(hk, hv)


@pytest.mark.parametrize("swap", ["set_", "data", "swap_tensors"])
def test_table_storage_swapped_is_resolved_again(regs: list[pd.RegisteredHostMemory], swap: str) -> None:
    dks, dvs, hk, hv, k_tab, v_tab = _lf_pf_setup(regs)
    _backup(k_tab, hk, v_tab, hv)
    _backup(k_tab, hk, v_tab, hv)
    others = [rand(dev(T, H, D)) for _ in range(L)]
    new = _table(others, DEV)
    if swap == "set_":
        k_tab.set_(new.untyped_storage())  # bumps the version counter
    elif swap == "data":
        k_tab.data = new  # no version bump: the data pointer moved
    else:  # torch refuses to swap a tensor with weak references: the table cache holds one
        with pytest.raises(RuntimeError, match="weakref"):
            torch.utils.swap_tensors(k_tab, new)
        others = dks
    poison(hk, hv)
    _backup(k_tab, hk, v_tab, hv)
    assert _backed_up(hk, others) and _backed_up(hv, dvs)


def test_buffer_written_in_place_is_still_the_same_buffer(regs: list[pd.RegisteredHostMemory],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pool = rand(host(regs, 2, HT, L, H, D))
    hk, hv = pool[0], pool[1]
    dk, dv = dev(T, H, D), dev(T, H, D)
    sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S, DI, 1, ITEM, L * ITEM)
    dk.fill_(0)  # the engine writes its device layer: contents, not what the buffer is
    _no_translation(monkeypatch)
    poison(dk, dv)
    sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S, DI, 1, ITEM, L * ITEM)
    assert same(dk[DI], hk[S, 1]) and same(dv[DI], hv[S, 1])
    assert untouched(dk[[i for i in range(T) if i not in DI.tolist()]])


def test_buffer_reshaped_in_place_is_translated_again(regs: list[pd.RegisteredHostMemory]) -> None:
    pool = rand(host(regs, 2, HT, L, H, D))
    hk, hv = pool[0], pool[1]
    dk, dv = dev(T, H, D), dev(T, H, D)
    sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S, DI, 1, ITEM, L * ITEM)
    dk.unsqueeze_(0)  # an in-place view op: [1, T, H, D], the same bytes with another dim-0 row
    poison(dk, dv)
    with pytest.raises(pd.errors.LayoutError, match="dst_k"):
        sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S, DI, 1, ITEM, L * ITEM)
    assert untouched(dk, dv)


def test_new_views_per_call_keep_the_memory_keyed_path(regs: list[pd.RegisteredHostMemory]) -> None:
    pool = rand(host(regs, 2, HT, L, H, D))
    dk, dv = dev(T, H, D), dev(T, H, D)
    sk.transfer_kv_per_layer_pf_lf(pool[0], dk, pool[1], dv, S, DI, 1, ITEM, L * ITEM)
    kept = len(sk.seen)
    for _ in range(5):  # sglang's k_buffer[layer] style: a new view object every call
        poison(dk, dv)
        sk.transfer_kv_per_layer_pf_lf(pool[0], dk, pool[1], dv, S, DI, 1, ITEM, L * ITEM)
        assert same(dk[DI], pool[0][S, 1]) and same(dv[DI], pool[1][S, 1])
    assert len(sk.seen) == kept  # views made per call are not kept by identity (they would churn)


def test_hicache_one_layer_and_lmcache_and_swap_repeat_by_identity(regs: list[pd.RegisteredHostMemory],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    hk, hv = rand(host(regs, HT, H, D)), rand(host(regs, HT, H, D))
    dk, dv = dev(T, H, D), dev(T, H, D)
    caches = [rand(dev(2, 4, 4, H, D)) for _ in range(L)]  # LMCache format 1: [2, NB, BS, NH, HS]
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    obj = host(regs, 2, L, 4, H * D)
    slots = torch.tensor([5, 0, 9, 14])
    gpu, cpu = rand(dev(8, 64)), host(regs, 8, 64)
    mapping = torch.tensor([[1, 2], [5, 0], [7, 7]], dtype=torch.int64)

    def calls() -> None:
        hc.transfer_hicache_one_layer(dk, dv, DI, hk, hv, S, element_dim=H * D)
        lmc.multi_layer_kv_transfer(obj, ptrs, slots, DEV, 16, lmc.TransferDirection.D2H,
                                    lmc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 4)
        vl.swap_blocks(gpu, cpu, 128, mapping)

    calls()
    _no_translation(monkeypatch)
    poison(dk, dv, obj, cpu)
    calls()
    assert same(dk[DI], hk[S]) and same(dv[DI], hv[S])
    for layer, cache in enumerate(caches):
        for kv in range(2):
            assert same(obj[kv, layer], cache[kv].reshape(16, H * D)[slots])
    for s, d in mapping.tolist():
        assert same(cpu[d], gpu[s])
    assert untouched(cpu[[3, 4, 5, 6]])
    ptrs[1] = caches[0].data_ptr()  # LMCache's pointer table rewritten in place: resolved again
    monkeypatch.undo()
    poison(obj)
    lmc.multi_layer_kv_transfer(obj, ptrs, slots, DEV, 16, lmc.TransferDirection.D2H,
                                lmc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 4)
    assert same(obj[:, 1], obj[:, 0])


def test_clear_cache_forgets_the_identity_entries(regs: list[pd.RegisteredHostMemory]) -> None:
    dks, dvs, hk, hv, k_tab, v_tab = _lf_pf_setup(regs)
    _backup(k_tab, hk, v_tab, hv)
    assert len(sk.seen) > 0
    _raw.clear_cache()
    assert len(sk.seen) == 0 and len(vl._seen) == 0 and len(lmc._seen) == 0


def test_layer_first_ops_repeat_and_check_what_they_are_given(regs: list[pd.RegisteredHostMemory],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """kvcacheio's layer_first pair (sglang's fallback for a layer_first host pool): the
    per-layer load over buffers and the all-layer backup over raw tables of both sides."""
    pool = rand(host(regs, 2, L, HT, H, D))  # [2, L, size, H, D], as sglang's layer_first host pool
    hks, hvs = [pool[0, i] for i in range(L)], [pool[1, i] for i in range(L)]
    dks, dvs = [rand(dev(T, H, D)) for _ in range(L)], [rand(dev(T, H, D)) for _ in range(L)]
    tabs = [_table(x, DEV) for x in (dks, hks, dvs, hvs)]

    def load() -> None:
        sk.transfer_kv_per_layer(hks[1], dks[1], hvs[1], dvs[1], S, DI, ITEM)

    def backup() -> None:
        sk.transfer_kv_all_layer(tabs[0], tabs[1], tabs[2], tabs[3], DI, S, ITEM, L)

    load()
    backup()
    monkeypatch.setattr(sk, "buffers_table", lambda *a, **k: pytest.fail("translated again"))
    monkeypatch.setattr(sk, "raw_side", lambda *a, **k: pytest.fail("translated again"))
    poison(dks[1], dvs[1])
    load()
    assert same(dks[1][DI], hks[1][S]) and same(dvs[1][DI], hvs[1][S])
    poison(pool)
    backup()
    for i in range(L):
        assert same(hks[i][S], dks[i][DI]) and same(hvs[i][S], dvs[i][DI])
    monkeypatch.undo()
    poison(dks[1], dvs[1])  # a slot past the device layer: the call's own error, nothing written
    with pytest.raises(pd.errors.IndexValidationError, match=r"dst_indices: slot 16 outside \[0, 16\)"):
        sk.transfer_kv_per_layer(hks[1], dks[1], hvs[1], dvs[1], S, torch.tensor([1, 2, 3, 16]), ITEM)
    assert untouched(dks[1], dvs[1])
    others = [host(regs, HT, H, D) for _ in range(L)]
    tabs[1].copy_(_table(others, DEV))  # the K destination table rewritten in place: resolved again
    poison(pool, *others)
    backup()
    for i in range(L):
        assert same(others[i][S], dks[i][DI]) and same(hvs[i][S], dvs[i][DI])
    assert untouched(pool[0])


def test_own_tensors_met_after_views_are_kept_by_identity(regs: list[pd.RegisteredHostMemory]) -> None:
    """The prepared call was made from views made per call; the engine's own tensors over
    the same memory, met twice, are then kept by identity all the same."""
    pool = rand(host(regs, 2, HT, L, H, D))
    dk, dv = dev(T, H, D), dev(T, H, D)
    for _ in range(3):
        sk.transfer_kv_per_layer_pf_lf(pool[0], dk, pool[1], dv, S, DI, 1, ITEM, L * ITEM)
    hk, hv = pool[0], pool[1]  # kept by the engine from now on

    def kept() -> bool:  # counted by identity: entries of freed memory may leave meanwhile
        return any(len(e.tensors) == 4 and all(a is b for a, b in zip(e.tensors, (hk, dk, hv, dv)))
                   for e in sk.seen.values())

    assert not kept()
    for _ in range(3):
        poison(dk, dv)
        sk.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, S, DI, 1, ITEM, L * ITEM)
        assert same(dk[DI], hk[S, 1]) and same(dv[DI], hv[S, 1])
    assert kept()
    entry = next(reversed(sk.seen.values()))
    assert entry.tensors[0] is hk and entry.tensors[2] is hv
