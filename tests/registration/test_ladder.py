"""The registration ladder (pointerdomain.registration.ladder) against driver-like refusals injected
on the emulated backend (pointerdomain.testing.DriverFaults)."""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors, ladder
from pointerdomain.registration import memory
from pointerdomain.testing import DriverFaults, NOT_SUPPORTED, backend_for, install_backend
from tests.reference import DEV, fill_pool, fill_random, filled_pools, model_layout, pool_bytes, reference_transfer

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias

PAGE = 4096
DEGRADE = pd.RegistrationPolicy(on_failure="degrade", chunk_bytes=4 * PAGE)


@pytest.fixture(autouse=True)
def _fresh_counters() -> Iterator[None]:
    ladder.reset_ladder_stats()
    yield
    ladder.reset_ladder_stats()


def faults(**kw: object) -> DriverFaults:
    return DriverFaults(backend_for(DEV), **kw)  # type: ignore[arg-type]


def readable_through_alias(mem: pd.RegisteredHostMemory) -> None:
    fill_random(mem.tensor, 7)
    for off in (0, mem.nbytes // 2, mem.nbytes - 8):
        alias = pd.resolve_alias(mem.host_va + off, DEV)
        assert ctypes.string_at(alias.value, 8) == bytes(mem.tensor[off:off + 8].tolist())


def test_default_policy_fails_and_rolls_back() -> None:
    with install_backend(faults(fail_at={3: 2}), "emulated") as fb:
        with pytest.raises(errors.RegistrationError) as info:
            pd.alloc_registered(8 * PAGE, DEV, max_chunk_bytes=2 * PAGE)
        assert "chunk 3/4" in str(info.value) and "the 2 chunk(s) before it were unregistered" in str(info.value)
        assert fb.pinned_bytes() == 0 and fb.pinned_calls == 0
    assert ladder.rung_counts() == dict.fromkeys([r.value for r in pd.Rung], 0)


def test_single_call_is_the_first_rung() -> None:
    with install_backend(faults(), "emulated") as fb, pd.alloc_registered(16 * PAGE, DEV, policy=DEGRADE) as mem:
        assert mem.rung is pd.Rung.SINGLE and mem.ladder_record == () and len(fb.register_calls) == 1
        readable_through_alias(mem)
    assert ladder.rung_counts()["single"] == 1


def test_per_call_cap_degrades_to_chunks_that_never_split_a_page() -> None:
    layout = model_layout("page_first", 24)
    block = layout.page_block_bytes()
    policy = pd.RegistrationPolicy(on_failure="degrade", chunk_bytes=3 * block + 100)  # not a block multiple
    with install_backend(faults(per_call_cap=4 * block), "emulated") as fb, \
            pytest.warns(ladder.RegistrationDegradedWarning, match="'chunked' rung"):
        host = pd.HostKVPool(layout, DEV, policy=policy)
    with host:
        assert host.memory.rung is pd.Rung.CHUNKED and "single (1 call(s)" in host.memory.ladder_record[0]
        sizes = [c.nbytes for c in host.memory.chunks]
        assert all(n % block == 0 for n in sizes[:-1]) and sizes[0] == 3 * block  # cut on page blocks
        assert sum(sizes) == layout.nbytes
        assert [n for _, n, st in fb.register_calls if st == 0] == sizes
        pool = pd.DeviceKVPool(model_layout("layer_first", 8), DEV)
        fill_pool(pool, 1)
        before = host.buffer.view(torch.uint8).clone()
        src, dst = torch.tensor([0, 7, 13, 31]), torch.tensor([95, 2, 50, 51])
        expected = reference_transfer(pool_bytes(pool), pool.layout, before, layout, src, dst)
        host.backup(pool, src, dst)
        assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)
    assert fb.pinned_bytes() == 0 and ladder.rung_counts()["chunked"] == 1


def test_801_at_every_size_takes_the_pinned_copy_rung_for_library_memory() -> None:
    with install_backend(faults(refuse_all=NOT_SUPPORTED), "emulated") as fb:
        with pytest.warns(ladder.RegistrationDegradedWarning, match="pinned_copy"):
            mem = pd.alloc_registered(16 * PAGE, DEV, policy=DEGRADE)
        with mem:
            assert mem.rung is pd.Rung.PINNED_COPY and not mem.strict
            assert len(mem.ladder_record) == 2 and all("error 801" in r for r in mem.ladder_record)
            assert fb.pinned_calls == 1
            readable_through_alias(mem)
        assert memory.find_registration(mem.host_va) is None


def test_801_for_a_caller_tensor_has_no_pinned_rung_and_fails_with_the_record() -> None:
    t = torch.zeros(16 * PAGE, dtype=torch.uint8)
    with install_backend(faults(refuse_all=NOT_SUPPORTED), "emulated") as fb:
        with pytest.raises(errors.RegistrationError, match="ladder exhausted") as info:
            pd.register_host_tensor(t, DEV, policy=DEGRADE)
        assert "single" in str(info.value) and "chunked" in str(info.value) and fb.pinned_calls == 0
        assert memory.find_registration(pd.HostVA(t.data_ptr())) is None


def test_unpinned_only_when_allowed_and_kernels_refuse_it() -> None:
    policy = pd.RegistrationPolicy(on_failure="degrade", chunk_bytes=4 * PAGE, allow_unpinned=True)
    layout = model_layout("layer_first", 8)
    with install_backend(faults(refuse_all=NOT_SUPPORTED, refuse_pinned_alloc=2), "emulated"):
        with pytest.warns(ladder.RegistrationDegradedWarning, match="'unpinned'"):
            host = pd.HostKVPool(layout, DEV, policy=policy)
        with host:
            assert host.memory.rung is pd.Rung.UNPINNED and not host.memory.kernel_readable
            assert "pinned_copy: the runtime's pinned allocation failed" in host.memory.ladder_record[-1]
            pool = pd.DeviceKVPool(layout, DEV)
            fill_pool(pool, 3)
            idx = torch.tensor([0, 3, 17])
            with pytest.raises(errors.UnpinnedMemoryError, match="only|copy_engine"):
                host.backup(pool, idx, idx, backend="kernel")
            before = host.buffer.view(torch.uint8).clone()
            expected = reference_transfer(pool_bytes(pool), layout, before, layout, idx, idx)
            host.backup(pool, idx, idx)  # auto: the copy engine
            assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)
    assert issubclass(errors.UnpinnedMemoryError, ValueError)


def test_unpinned_memory_reaches_no_kernel_outside_the_library_either() -> None:
    """Tables over unpinned memory hold host VAs: the boundaries that hand a table to a
    custom kernel (pointer tensor, Triton argument, kernel_op) and resolve_alias refuse
    it, as the library's own kernel launch does; a copy-engine transfer still moves it."""
    from pointerdomain.compat.wrap import kernel_op
    from pointerdomain.transfer.kernel_args import kernel_table_tensor
    from pointerdomain.transfer.triton import kernel_table_arg

    policy = pd.RegistrationPolicy(on_failure="degrade", allow_unpinned=True, allow_pinned_copy=False)
    good = pd.alloc_registered(PAGE, DEV)
    with good, install_backend(faults(refuse_all=NOT_SUPPORTED), "emulated"):
        with pytest.warns(ladder.RegistrationDegradedWarning, match="'unpinned'"):
            mem = pd.alloc_registered(8 * PAGE, DEV, policy=policy)
        with mem:
            assert not mem.kernel_readable
            table = pd.make_kernel_ptr_table([mem.tensor], DEV)
            calls: list[object] = []

            @kernel_op(calls.append)
            def op(ptrs: pd.PointerTable[pd.DeviceAlias]) -> None: ...

            for boundary in (lambda: kernel_table_tensor(table, DEV), lambda: kernel_table_arg(table, DEV),
                             lambda: op(table), lambda: pd.resolve_alias(mem.host_va + 64, DEV)):
                with pytest.raises(errors.UnpinnedMemoryError, match="not pinned"):
                    boundary()
            assert calls == []
            # a registered table beside it is still handed over, with its aliases
            ok = pd.make_kernel_ptr_table([good.tensor], DEV)
            assert kernel_table_tensor(ok, DEV).tolist() == [pd.resolve_alias(good.host_va, DEV).value]
            with pytest.raises(errors.UnpinnedMemoryError):  # one unpinned entry is enough
                kernel_table_tensor(pd.make_kernel_ptr_table([good.tensor, mem.tensor], DEV), DEV)
            # the copy engine reads it through its host VA
            device = pd.device_empty((8 * PAGE,), torch.uint8, DEV)
            fill_random(device, 5)
            layout = pd.KVLayout(kind="layer_first", attention="mla", num_layers=1, num_pages=8 * PAGE // 256,
                                 page_size=1, num_heads=1, head_dim=256, dtype="uint8")
            idx = torch.tensor([0, 5, 9])
            pd.transfer_kv_all_layer(pd.make_kernel_ptr_table([device], DEV), table, idx, idx, src_layout=layout,
                                     dst_layout=layout, backend="copy_engine")
            for i in idx.tolist():
                assert torch.equal(mem.tensor[i * 256:(i + 1) * 256], device[i * 256:(i + 1) * 256])


def test_unpinned_is_never_taken_unless_allowed() -> None:
    with install_backend(faults(refuse_all=NOT_SUPPORTED, refuse_pinned_alloc=2), "emulated"):
        with pytest.raises(errors.RegistrationError, match="ladder exhausted"):
            pd.alloc_registered(8 * PAGE, DEV, policy=DEGRADE)


def test_total_cap_and_memlock_name_the_cause() -> None:
    with install_backend(faults(total_cap=8 * PAGE), "emulated") as fb:
        with pd.alloc_registered(8 * PAGE, DEV):
            with pytest.raises(errors.RegistrationError, match="error 2"):
                pd.alloc_registered(PAGE, DEV)
        assert fb.pinned_bytes() == 0
    with install_backend(faults(memlock=8 << 20), "emulated"):
        with pytest.raises(errors.RegistrationError, match=r"RLIMIT_MEMLOCK \(8388608 bytes"):
            pd.alloc_registered(9 << 20, DEV)


def test_failure_at_chunk_k_of_the_chunked_rung_rolls_back_that_rung() -> None:
    # call 1: the single call (refused by the cap); calls 2..: chunks, the 3rd chunk fails
    with install_backend(faults(per_call_cap=8 * PAGE, fail_at={4: 2}, refuse_pinned_alloc=2), "emulated") as fb:
        with pytest.raises(errors.RegistrationError) as info:
            pd.alloc_registered(16 * PAGE, DEV, policy=DEGRADE)
        assert "chunk 3/4" in str(info.value) and "the 2 chunk(s) before it were unregistered" in str(info.value)
        assert fb.pinned_bytes() == 0


def test_one_warning_per_cause() -> None:
    with install_backend(faults(per_call_cap=4 * PAGE), "emulated"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                pd.alloc_registered(8 * PAGE, DEV, policy=DEGRADE).close()
        assert len([w for w in seen if issubclass(w.category, ladder.RegistrationDegradedWarning)]) == 1
    assert ladder.rung_counts()["chunked"] == 3


def test_policy_is_validated_and_the_default_settable() -> None:
    with pytest.raises(errors.InvalidRegistrationError):
        pd.RegistrationPolicy(on_failure="retry")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidRegistrationError):
        pd.RegistrationPolicy(chunk_bytes=0)
    previous = ladder.set_default_policy(DEGRADE)
    try:
        with install_backend(faults(per_call_cap=4 * PAGE), "emulated"), \
                pytest.warns(ladder.RegistrationDegradedWarning):
            with pd.alloc_registered(8 * PAGE, DEV) as mem:
                assert mem.rung is pd.Rung.CHUNKED
    finally:
        ladder.set_default_policy(previous)
    assert ladder.default_policy() is previous


def test_strict_mode_chunked_rung_registers_the_second_mapping() -> None:
    with pd.strict_alias(True), install_backend(faults(per_call_cap=4 * PAGE), "emulated") as fb, \
            pytest.warns(ladder.RegistrationDegradedWarning):
        with pd.alloc_registered(12 * PAGE, DEV, policy=DEGRADE) as mem:
            assert mem.strict and mem.rung is pd.Rung.CHUNKED
            registered = {va for va, _, st in fb.register_calls if st == 0}
            assert mem.host_va.value not in registered and mem.registered_address_of(mem.host_va) in registered
            readable_through_alias(mem)
        assert fb.pinned_bytes() == 0


def test_probe_rungs_on_emulated_and_with_refusals() -> None:
    out = ladder.probe_rungs(DEV)
    assert out.pop("not_needed").startswith("PageableMemoryAccess=0")  # the distinct profile reads no pageable memory
    assert out == {"single": "ok", "chunked": "ok", "pinned_copy": "ok", "unpinned": "ok (copy engine only)"}
    with install_backend(faults(refuse_all=NOT_SUPPORTED, refuse_pinned_alloc=2), "emulated") as fb:
        out = ladder.probe_rungs(DEV)
        assert "error 801" in out["single"] and "error 801" in out["chunked"] and "error 2" in out["pinned_copy"]
        assert "cannot read unregistered memory" in out["not_needed"]
        assert fb.pinned_bytes() == 0


# GPU (the H200): the same rungs through the real runtime ---------------------------------------

@pytest.mark.gpu
def test_gpu_registration_uses_the_driver_api_and_leaves_no_pending_error() -> None:
    from pointerdomain.testing import load_cudart

    dev = pd.Device("cuda", 0)
    backend = backend_for(dev)
    assert backend.name == "cuda-driver"  # POINTERDOMAIN_REGISTRATION_API unset: the driver API
    t = torch.empty(1 << 20, dtype=torch.uint8)
    with pd.register_host_tensor(t, dev) as mem:
        assert mem.rung is pd.Rung.SINGLE and not mem.foreign
        assert backend.register(t.data_ptr(), t.numel(), dev) == 712  # the driver's own refusal
        assert load_cudart().cudaGetLastError() == 0  # ... left nothing for the runtime to report
    out = ladder.probe_rungs(dev)
    assert out.pop("not_needed").startswith("PageableMemoryAccess=0")  # the H200 reads no pageable memory
    assert out == {"single": "ok", "chunked": "ok", "pinned_copy": "ok", "unpinned": "ok (copy engine only)"}


@pytest.mark.gpu
def test_gpu_pinned_copy_rung_under_injected_801_moves_the_right_bytes() -> None:
    dev = pd.Device("cuda", 0)
    dev_layout, host_layout = model_layout("layer_first", 6), model_layout("page_first", 10)
    with install_backend(DriverFaults(backend_for(dev), refuse_all=NOT_SUPPORTED), "cuda"):
        with pytest.warns(ladder.RegistrationDegradedWarning):
            host = pd.HostKVPool(host_layout, dev, policy=DEGRADE)
        with host:
            assert host.memory.rung is pd.Rung.PINNED_COPY
            pool = pd.DeviceKVPool(dev_layout, dev)
            fill_pool(pool, 8)
            fill_random(host.buffer, 9)
            before = host.buffer.view(torch.uint8).clone()
            src, dst = torch.tensor([0, 5, 9, 17]), torch.tensor([39, 1, 2, 20])
            expected = reference_transfer(pool_bytes(pool), dev_layout, before, host_layout, src, dst)
            host.backup(pool, src.cuda(), dst.cuda(), backend="kernel")
            torch.cuda.synchronize()
            assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)


@pytest.mark.gpu
def test_gpu_chunked_rung_under_a_per_call_cap() -> None:
    dev = pd.Device("cuda", 0)
    layout = model_layout("page_first", 24)
    block = layout.page_block_bytes()
    policy = pd.RegistrationPolicy(on_failure="degrade", chunk_bytes=3 * block)
    with install_backend(DriverFaults(backend_for(dev), per_call_cap=4 * block), "cuda"):
        with pytest.warns(ladder.RegistrationDegradedWarning):
            host = pd.HostKVPool(layout, dev, policy=policy)
        with host:
            assert host.memory.rung is pd.Rung.CHUNKED and len(host.memory.chunks) > 1
            pool = pd.DeviceKVPool(model_layout("layer_first", 8), dev)
            fill_pool(pool, 1)
            before = host.buffer.view(torch.uint8).clone()
            src, dst = torch.tensor([0, 7, 13, 31]), torch.tensor([95, 2, 50, 51])
            expected = reference_transfer(pool_bytes(pool), pool.layout, before, layout, src, dst)
            host.backup(pool, src.cuda(), dst.cuda(), backend="kernel")
            torch.cuda.synchronize()
            assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)


def test_faulty_double_keeps_the_pinned_copy_rung_of_its_inner_backend() -> None:
    # a double changes only the calls it fails: over a backend that allocates pinned
    # memory, a refused registration still degrades to pinned_copy
    from pointerdomain.testing import DelegatingBackend, FaultyBackend

    real = backend_for(pd.Device("emulated", 0))
    assert hasattr(real, "pinned_alloc")  # the ladder's PinnedAllocator protocol, structurally
    double = FaultyBackend(real, fail={"register": {1: 2}})
    assert hasattr(double, "pinned_alloc") and hasattr(double, "pinned_release") and isinstance(double, FaultyBackend)
    layout = pd.KVLayout(kind="page_first", num_layers=2, num_pages=8, page_size=4, num_heads=2, head_dim=8)
    with install_backend(double, "emulated"):
        with pytest.warns(ladder.RegistrationDegradedWarning, match="pinned_copy"):
            host = pd.HostKVPool(layout, DEV, policy=pd.RegistrationPolicy(on_failure="degrade"))
        with host:
            assert host.memory.rung is ladder.Rung.PINNED_COPY and double.calls["pinned_alloc"] == 1
            n = host.buffer.nbytes
            want = (torch.arange(n) % 251).to(torch.uint8)
            host.buffer.view(torch.uint8).view(-1).copy_(want)
            alias = pd.resolve_alias(host.memory.host_va, DEV).value
            assert ctypes.string_at(alias, n) == bytes(want.tolist())  # the device's view of the bytes
    # the pinned allocation failing as chosen: recorded, and the ladder goes on (here: ends)
    refused = FaultyBackend(real, fail={"register": {1: 2}, "pinned_alloc": {1: 2}})
    with install_backend(refused, "emulated"), pytest.raises(errors.RegistrationError, match="pinned_copy"):
        pd.HostKVPool(layout, DEV, policy=pd.RegistrationPolicy(on_failure="degrade"))
    assert refused.calls["pinned_alloc"] == 1
    plain = FaultyBackend(DelegatingBackend(real, "no pinned allocation"), fail={})
    assert not hasattr(plain, "pinned_alloc")  # over a backend without it: still without it
