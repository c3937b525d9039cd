"""Typed host-memory kinds (pointerdomain.registration.kinds) on the emulated profiles:
``coherent`` (pageable memory device-readable, registration refused with NotSupported) and
``vmm-host`` (host allocations are VMM handles), against the default ``distinct`` one.
Every transfer is compared byte for byte against the plain-torch reference."""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import env, errors, ladder
from pointerdomain.testing import (
    Backend, DelegatingBackend, DriverFaults, EmulatedBackend, NOT_SUPPORTED, VmmAllocation,
    VmmLocation, backend_for, install_backend,
)
from pointerdomain.devices import Device
from pointerdomain.registration import memory
from pointerdomain.registration.kinds import MemoryKind
from pointerdomain.tools.explanation import explain
from tests.reference import DEV, fill_pool, model_layout, pool_bytes, reference_transfer

PAGE = 4096


@pytest.fixture(autouse=True)
def _fresh_counters() -> Iterator[None]:
    ladder.reset_ladder_stats()
    yield
    ladder.reset_ladder_stats()


@pytest.fixture
def emulated_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """explain() reads an unregistered address's memory kind on the default device (cuda:0
    where CUDA is there): these cases mean the emulated one, whose profile they install."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def profile(name: str) -> DriverFaults:
    """The emulated backend of profile ``name``, wrapped to count register calls."""
    return DriverFaults(EmulatedBackend(2, profile=name))


def round_trip(host: pd.HostKVPool) -> None:
    """D2H then H2D through the pool's kernel table; bytes against the reference."""
    pool = pd.DeviceKVPool(model_layout("layer_first", 8), DEV)
    fill_pool(pool, 11)
    before = host.buffer.view(torch.uint8).clone()
    src, dst = torch.tensor([0, 5, 9, 31]), torch.tensor([40, 2, 63, 7])
    expected = reference_transfer(pool_bytes(pool), pool.layout, before, host.layout, src, dst)
    host.backup(pool, src, dst)
    assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)
    back = pd.DeviceKVPool(model_layout("layer_first", 8), DEV)
    back_before = pool_bytes(back).clone()
    expected_back = reference_transfer(expected, host.layout, back_before, back.layout, dst, src)
    host.load(back, dst, src)
    assert torch.equal(pool_bytes(back), expected_back)


# distinct (the default) -----------------------------------------------------------------

def test_default_profile_registers_and_names_the_kind() -> None:
    with pd.alloc_registered(8 * PAGE, DEV) as mem:
        assert mem.kind is MemoryKind.REGISTERED and mem.rung is pd.Rung.SINGLE and mem.owner == "pointerdomain"
        alias = pd.resolve_alias(mem.host_va, DEV)
        assert alias.value != mem.host_va.value  # distinct aliases: the kind changes nothing here
        got = explain(mem.host_va.value + 100)
        assert got.memory_kind == "registered" and "kind: registered" in got.text()


def test_not_supported_without_pageable_access_is_a_failure_not_a_rung() -> None:
    with install_backend(DriverFaults(backend_for(DEV), refuse_all=NOT_SUPPORTED), "emulated") as fb:
        with pytest.raises(errors.RegistrationError, match="error 801") as info:
            pd.alloc_registered(8 * PAGE, DEV)
        assert "not device-accessible without registration (PageableMemoryAccess=0" in str(info.value)
        assert fb.pinned_bytes() == 0
    assert ladder.rung_counts()["not_needed"] == 0


# coherent ---------------------------------------------------------------------------------

def test_coherent_not_supported_is_an_answer_not_a_warning() -> None:
    with install_backend(profile("coherent"), "emulated") as fb, warnings.catch_warnings():
        warnings.simplefilter("error")  # no RegistrationDegradedWarning, nothing else either
        with pd.alloc_registered(8 * PAGE, DEV) as mem:  # the default policy: "fail"
            assert mem.rung is pd.Rung.NOT_NEEDED and mem.kind is MemoryKind.DEVICE_ACCESSIBLE
            assert mem.kernel_readable and mem.chunks[0].owned is False
            assert "error 801" in mem.ladder_record[0] and "PageableMemoryAccess=1" in mem.ladder_record[1]
            assert pd.resolve_alias(mem.host_va + 77, DEV).value == mem.host_va.value + 77  # the VA itself
            assert mem.stats.calls == 1  # the one refused call
            got = explain(mem.host_va.value)
            assert got.memory_kind == "device_accessible" and got.other_domain_address == mem.host_va.value
        assert [st for _, _, st in fb.register_calls] == [NOT_SUPPORTED] and fb.pinned_bytes() == 0
        assert memory.find_registration(mem.host_va) is None
    assert ladder.rung_counts()["not_needed"] == 1


def test_coherent_pool_moves_exact_bytes_without_registration() -> None:
    layout = model_layout("page_first", 64)
    with install_backend(profile("coherent"), "emulated") as fb, pd.HostKVPool(layout, DEV) as host:
        assert host.memory.kind is MemoryKind.DEVICE_ACCESSIBLE
        assert host.kernel_table[0].value == host.memory.host_va.value  # kernels read the host VA
        round_trip(host)
        assert fb.pinned_bytes() == 0 and fb.pinned_calls == 0  # no pinned copy, nothing pinned


def test_coherent_degrade_takes_not_needed_before_any_copy() -> None:
    policy = pd.RegistrationPolicy(on_failure="degrade", chunk_bytes=2 * PAGE)
    with install_backend(DriverFaults(EmulatedBackend(2, profile="coherent"), refuse_all=2), "emulated") as fb:
        with pytest.warns(ladder.RegistrationDegradedWarning, match="not_needed"):
            mem = pd.alloc_registered(8 * PAGE, DEV, policy=policy)
        with mem:
            assert mem.rung is pd.Rung.NOT_NEEDED and fb.pinned_calls == 0  # never the pinned_copy rung


@pytest.mark.usefixtures("emulated_default")
def test_coherent_unregistered_host_memory_is_named_device_accessible() -> None:
    t = torch.zeros(4 * PAGE, dtype=torch.uint8)
    with install_backend(profile("coherent"), "emulated"):
        got = explain(t.data_ptr())
    assert got.domain == "unknown" and got.memory_kind == "device_accessible"
    assert explain(t.data_ptr()).memory_kind is None  # the distinct profile reads no pageable memory


# vmm-host ---------------------------------------------------------------------------------

def test_vmm_host_memory_is_detected_never_registered() -> None:
    with install_backend(profile("vmm-host"), "emulated") as fb:
        with pd.alloc_registered(8 * PAGE, DEV) as mem:
            assert mem.rung is pd.Rung.VMM_HOST and mem.kind is MemoryKind.VMM_HOST
            assert mem.owner.startswith("VMM handle 0x") and "host_numa node 0" in mem.owner
            assert pd.resolve_alias(mem.host_va + 8, DEV).value == mem.host_va.value + 8
            got = explain(mem.host_va.value + 8)
            assert got.memory_kind == "vmm_host" and got.memory_owner == mem.owner
            assert "memory owner: VMM handle" in got.text()
        assert fb.register_calls == [] and fb.pinned_bytes() == 0  # not one registration call


def test_vmm_host_pool_moves_exact_bytes() -> None:
    layout = model_layout("page_first", 64)
    with install_backend(profile("vmm-host"), "emulated") as fb, pd.HostKVPool(layout, DEV) as host:
        assert host.memory.kind is MemoryKind.VMM_HOST
        round_trip(host)
        assert fb.register_calls == []


def test_vmm_host_caller_tensor_inside_the_mapping_is_used_in_place() -> None:
    backend = profile("vmm-host")
    with install_backend(backend, "emulated"):
        raw = backend.host_alloc(16 * PAGE)
        view = raw[4 * PAGE: 12 * PAGE]
        with pd.register_host_tensor(view, DEV) as mem:
            assert mem.kind is MemoryKind.VMM_HOST and mem.nbytes == 8 * PAGE
        assert backend.register_calls == []
        del view, raw


class _HalfVmm(DelegatingBackend):
    """The first ``nbytes`` bytes at ``base`` are VMM memory of ``location``; the rest ordinary."""

    def __init__(self, inner: Backend, base: int, nbytes: int, location: VmmLocation = "host_numa") -> None:
        super().__init__(inner, "half-vmm")
        self.base, self.nbytes, self.location = base, nbytes, location
        self.registers = 0

    def vmm_allocation(self, addr: int, device: Device) -> VmmAllocation | None:
        if self.base <= addr < self.base + self.nbytes:
            return VmmAllocation(self.base, self.nbytes, self.location, 1, 0x2A)
        return None

    def register(self, va: int, nbytes: int, device: Device) -> int:
        self.registers += 1
        return super().register(va, nbytes, device)


def test_a_range_crossing_the_vmm_mapping_is_a_typed_refusal() -> None:
    t = torch.zeros(8 * PAGE, dtype=torch.uint8)
    fake = _HalfVmm(backend_for(DEV), t.data_ptr(), 4 * PAGE)
    with install_backend(fake, "emulated"):
        with pytest.raises(errors.MemoryKindError) as info:
            pd.register_host_tensor(t, DEV)
    text = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, errors.RegistrationError)
    assert "VMM handle 0x2a" in text and f"{t.data_ptr() + 4 * PAGE:#x}" in text and "host_numa node 1" in text
    assert fake.registers == 0 and memory.find_registration(pd.HostVA(t.data_ptr())) is None


def test_vmm_device_memory_is_a_domain_error() -> None:
    t = torch.zeros(4 * PAGE, dtype=torch.uint8)
    fake = _HalfVmm(backend_for(DEV), t.data_ptr(), 4 * PAGE, location="device")
    with install_backend(fake, "emulated"):
        with pytest.raises(errors.DomainError, match="VMM device memory"):
            pd.register_host_tensor(t, DEV)
    assert fake.registers == 0


# pinned, foreign, pageable ------------------------------------------------------------------

class _CountPinned(DriverFaults):
    asked: list[int]

    def pinned_alloc(self, nbytes: int, device: Device) -> tuple[int, torch.Tensor | None]:
        self.asked = [*getattr(self, "asked", []), nbytes]
        return super().pinned_alloc(nbytes, device)


def test_pinned_kind_is_exactly_the_bytes_asked_for() -> None:
    nbytes = 5 * PAGE + 123  # not a power of two: a rounding allocator would pin 8 pages
    with install_backend(_CountPinned(backend_for(DEV), refuse_all=NOT_SUPPORTED), "emulated") as fb:
        with pytest.warns(ladder.RegistrationDegradedWarning):
            mem = pd.alloc_registered(nbytes, DEV, policy=pd.RegistrationPolicy(on_failure="degrade"))
        with mem:
            assert mem.kind is MemoryKind.PINNED and mem.rung is pd.Rung.PINNED_COPY
            assert fb.asked == [nbytes] and mem.tensor.numel() == nbytes and mem.nbytes == nbytes
            mem.tensor.copy_(torch.arange(nbytes, dtype=torch.int64).to(torch.uint8))
            alias = pd.resolve_alias(mem.host_va, DEV)
            assert ctypes.string_at(alias.value, nbytes) == bytes(mem.tensor.numpy().tobytes())


def test_foreign_and_pageable_kinds() -> None:
    t = torch.zeros(8 * PAGE, dtype=torch.uint8)
    with install_backend(DriverFaults(backend_for(DEV)), "emulated") as fb:
        assert fb.register_foreign(t.data_ptr(), t.numel(), DEV) == 0
        try:
            with pd.register_host_tensor(t, DEV) as mem:
                assert mem.kind is MemoryKind.FOREIGN and mem.owner == "foreign"
        finally:
            fb.unregister_foreign(t.data_ptr())
    policy = pd.RegistrationPolicy(on_failure="degrade", allow_unpinned=True, allow_pinned_copy=False)
    with install_backend(DriverFaults(backend_for(DEV), refuse_all=2), "emulated"):
        with pytest.warns(ladder.RegistrationDegradedWarning), pd.register_host_tensor(t, DEV, policy=policy) as mem:
            assert mem.kind is MemoryKind.PAGEABLE and not mem.kernel_readable


def test_every_rung_has_a_kind() -> None:
    from pointerdomain.registration.kinds import kind_of

    assert {kind_of(r) for r in pd.Rung} == set(MemoryKind)


# the profile from the environment -------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [("coherent", "coherent"), ("vmm-host", "vmm-host"), ("", "distinct")])
def test_profile_is_chosen_by_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, expected: str) -> None:
    monkeypatch.setenv(env.EMULATED_PROFILE, value)
    # what the emulated backend's factory builds (EmulatedBackend(count)): the profile from the environment
    with install_backend(EmulatedBackend(2), "emulated"):
        backend = backend_for(DEV)
        assert isinstance(backend, EmulatedBackend) and backend.profile == expected
        with pd.alloc_registered(4 * PAGE, DEV) as mem:
            want = {"coherent": MemoryKind.DEVICE_ACCESSIBLE, "vmm-host": MemoryKind.VMM_HOST}
            assert mem.kind is want.get(expected, MemoryKind.REGISTERED)


def test_unknown_profile_warns_and_is_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.EMULATED_PROFILE, "gh200")
    with pytest.warns(env.EnvironmentValueWarning, match="POINTERDOMAIN_EMULATED_PROFILE='gh200'"):
        backend = EmulatedBackend(2)
    assert backend.profile == "distinct"
    with pytest.raises(errors.InvalidArgumentError, match="profile: found 'gh200'"):
        EmulatedBackend(2, profile="gh200")


@pytest.mark.usefixtures("emulated_default")
def test_explain_names_another_owners_pin_foreign() -> None:
    t = torch.zeros(8 * PAGE, dtype=torch.uint8)
    with install_backend(DriverFaults(backend_for(DEV)), "emulated") as fb:
        assert fb.register_foreign(t.data_ptr(), t.numel(), DEV) == 0
        try:
            got = explain(t.data_ptr() + 5)
        finally:
            fb.unregister_foreign(t.data_ptr())
    assert got.domain == "unknown" and got.memory_kind == "foreign"
    assert any("pinned) by another owner" in note for note in got.notes)
    assert explain(t.data_ptr() + 5).memory_kind is None  # the pin is gone: plain pageable memory


def test_a_second_registration_of_vmm_memory_names_the_first_and_its_owner() -> None:
    with install_backend(profile("vmm-host"), "emulated"), pd.alloc_registered(8 * PAGE, DEV) as mem:
        with pytest.raises(errors.AlreadyRegisteredError) as info:
            pd.register_host_tensor(mem.tensor[PAGE:], DEV)
    assert f"{mem.host_va!r}" in str(info.value) and "vmm_host memory, owner VMM handle 0x" in str(info.value)
