"""Memory kinds and paced registration on a real GPU (the H200): the coherent rung is
refused there (PageableMemoryAccess is 0), VMM host memory (``cuMemCreate`` with a
HOST_NUMA location) is found through the driver and never registered, and pools over it
move exactly the reference bytes; a bounded registration keeps every driver call short."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors, ladder
from pointerdomain.testing import (
    Backend, DelegatingBackend, DriverFaults, NOT_SUPPORTED, backend_for, install_backend,
    pageable_access,
)
from pointerdomain.devices import Device
from pointerdomain.registration import memory
from pointerdomain.registration.kinds import MemoryKind
from pointerdomain.tools.explanation import explain
from tests.reference import fill_pool, fill_random, model_layout, pool_bytes, reference_transfer

pytestmark = pytest.mark.gpu

_PINNED, _DEVICE, _HOST_NUMA, _READWRITE = 1, 1, 3, 3  # cuda.h enum values
_HOST_NUMA_ID = 134  # CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8), ("_room", ctypes.c_ubyte * 64)]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


class VmmHost(DelegatingBackend):
    """``inner``, but host allocations are VMM memory on the device's host NUMA node
    (cuMemCreate HOST_NUMA, mapped for the device and the CPU), as an EGM / NUMA-aware
    allocator hands out; counts register calls (there must be none over it)."""

    def __init__(self, inner: Backend, device: Device) -> None:
        super().__init__(inner, "vmm-host")
        self.device = device
        self.registers = 0
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t = ctypes.c_uint64, ctypes.c_size_t
        lib.cuMemCreate.argtypes = [ctypes.POINTER(u64), size_t, ctypes.POINTER(_Prop), u64]
        lib.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(size_t), ctypes.POINTER(_Prop), ctypes.c_int]
        lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size_t, size_t, u64, u64]
        lib.cuMemMap.argtypes = [u64, size_t, size_t, u64, u64]
        lib.cuMemSetAccess.argtypes = [u64, size_t, ctypes.POINTER(_Access), size_t]
        lib.cuMemUnmap.argtypes = [u64, size_t]
        lib.cuMemAddressFree.argtypes = [u64, size_t]
        lib.cuMemRelease.argtypes = [u64]
        lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self.lib = lib
        node = ctypes.c_int(-1)
        lib.cuDeviceGetAttribute(ctypes.byref(node), _HOST_NUMA_ID, device.ordinal)
        self.node = max(node.value, 0)

    def host_alloc(self, nbytes: int) -> torch.Tensor:
        torch.zeros(1, device=self.device.torch_device)  # the primary context, current on this thread
        lib, u64 = self.lib, ctypes.c_uint64
        prop = _Prop(type=_PINNED, location=_Loc(_HOST_NUMA, self.node))
        gran = ctypes.c_size_t(0)
        assert lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0) == 0
        size = -(-nbytes // gran.value) * gran.value
        handle, ptr = u64(0), u64(0)
        assert lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0) == 0
        assert lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0) == 0
        assert lib.cuMemMap(ptr.value, size, 0, handle.value, 0) == 0
        access = (_Access * 2)(_Access(_Loc(_DEVICE, self.device.ordinal), _READWRITE),
                               _Access(_Loc(_HOST_NUMA, self.node), _READWRITE))
        assert lib.cuMemSetAccess(ptr.value, size, access, 2) == 0
        tensor = torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr.value), dtype=torch.uint8)[:nbytes]
        weakref.finalize(tensor, self._free, ptr.value, size, handle.value)
        return tensor

    def _free(self, ptr: int, size: int, handle: int) -> None:
        self.lib.cuMemUnmap(ptr, size)
        self.lib.cuMemAddressFree(ptr, size)
        self.lib.cuMemRelease(handle)

    def register(self, va: int, nbytes: int, device: Device) -> int:
        self.registers += 1
        return super().register(va, nbytes, device)


@pytest.fixture
def dev() -> Iterator[Device]:
    ladder.reset_ladder_stats()
    yield pd.Device("cuda", 0)
    ladder.reset_ladder_stats()


def test_h200_reads_no_pageable_memory_so_the_coherent_rung_is_refused(dev: Device) -> None:
    access = pageable_access(backend_for(dev), dev)
    assert access.pageable_memory_access == 0 and not access.coherent
    assert ladder.probe_rungs(dev)["not_needed"].startswith("PageableMemoryAccess=0")
    with install_backend(DriverFaults(backend_for(dev), refuse_all=NOT_SUPPORTED), "cuda") as fb:
        with pytest.raises(errors.RegistrationError, match="error 801"):
            pd.alloc_registered(1 << 20, dev)
        t = torch.empty(1 << 20, dtype=torch.uint8)
        with pytest.raises(errors.RegistrationError, match="ladder exhausted"):
            pd.register_host_tensor(t, dev, policy=pd.RegistrationPolicy(on_failure="degrade"))
        assert fb.pinned_bytes() == 0 and memory.find_registration(pd.HostVA(t.data_ptr())) is None
    assert ladder.rung_counts()["not_needed"] == 0


def test_vmm_host_numa_memory_is_detected_never_registered(dev: Device) -> None:
    if pd.strict_alias_enabled():
        pytest.skip("strict alias mode allocates host memory itself (double-mapped twins), not through the VMM backend")
    vmm = VmmHost(backend_for(dev), dev)
    with install_backend(vmm, "cuda"):
        with pd.alloc_registered(4 << 20, dev) as mem:
            assert mem.kind is MemoryKind.VMM_HOST and mem.rung is pd.Rung.VMM_HOST
            assert mem.owner.startswith("VMM handle 0x") and "host_numa" in mem.owner
            assert pd.resolve_alias(mem.host_va + 64, dev).value == mem.host_va.value + 64
            got = explain(mem.host_va.value)
            assert got.memory_kind == "vmm_host" and got.memory_owner == mem.owner
        assert vmm.registers == 0
        # the raw query too: a caller's tensor over VMM memory
        raw = vmm.host_alloc(2 << 20)
        with pd.register_host_tensor(raw[4096:], dev) as mem:
            assert mem.kind is MemoryKind.VMM_HOST
        assert vmm.registers == 0


def test_vmm_host_pool_moves_exact_bytes(dev: Device) -> None:
    if pd.strict_alias_enabled():
        pytest.skip("strict alias mode allocates host memory itself (double-mapped twins), not through the VMM backend")
    dev_layout, host_layout = model_layout("layer_first", 8), model_layout("page_first", 64)
    vmm = VmmHost(backend_for(dev), dev)
    with install_backend(vmm, "cuda"), pd.HostKVPool(host_layout, dev) as host:
        assert host.memory.kind is MemoryKind.VMM_HOST and vmm.registers == 0
        pool = pd.DeviceKVPool(dev_layout, dev)
        fill_pool(pool, 8)
        fill_random(host.buffer, 9)
        before = host.buffer.view(torch.uint8).clone()
        src, dst = torch.tensor([0, 5, 9, 31]), torch.tensor([40, 1, 63, 20])
        expected = reference_transfer(pool_bytes(pool), dev_layout, before, host_layout, src, dst)
        host.backup(pool, src.cuda(), dst.cuda(), backend="kernel")
        torch.cuda.synchronize()
        assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)
        back = pd.DeviceKVPool(dev_layout, dev)
        back_before = pool_bytes(back).clone()
        expected_back = reference_transfer(expected, host_layout, back_before, dev_layout, dst, src)
        host.load(back, dst.cuda(), src.cuda(), backend="kernel")
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes(back), expected_back)


def test_bounded_registration_keeps_every_call_short(dev: Device) -> None:
    bound = 0.05
    policy = pd.RegistrationPolicy(max_call_seconds=bound, prefault_threads=8, huge_pages="thp")
    with pd.alloc_registered(2 << 30, dev, policy=policy) as mem:
        st = mem.stats
        assert st.calls == len(mem.chunks) > 1 and st.prefault.threads == 8
        assert st.longest_call_s < 2 * bound  # the probe and rate swings, never the whole 2 GiB in one call
        if pd.strict_alias_enabled():  # strict twins are shared mappings: no transparent huge pages to count
            assert st.huge_page_share is None
        else:
            assert st.huge_page_share is not None and 0.0 <= st.huge_page_share <= 1.0
        data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        mem.tensor[-(1 << 20):].copy_(data)
        alias = pd.resolve_alias(mem.host_va + (mem.nbytes - (1 << 20)), dev)
        out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        from pointerdomain.testing import load_cudart

        assert load_cudart().cudaMemcpy(ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(alias.value),
                                        ctypes.c_size_t(1 << 20), 4) == 0  # cudaMemcpyDefault, through the alias
        assert torch.equal(out.cpu(), data)


def test_pin_memory_is_foreign_and_its_rounded_block_is_named(dev: Device) -> None:
    nbytes = (20 << 20) + 100 * 4096  # 20.4 MiB asked
    t = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    got = explain(t.data_ptr())
    assert got.memory_kind == "foreign"
    (note,) = [n for n in got.notes if "pinned block" in n]
    size = int(note.split("+")[1].split(")")[0])
    assert size >= nbytes  # torch's caching host allocator rounds the block up (a power of two: 32 MiB)
    with pd.register_host_tensor(t, dev) as mem:  # used, never unregistered by pointerdomain
        assert mem.kind is MemoryKind.FOREIGN and mem.owner == "foreign"
