"""Strict alias mode (pointerdomain.registration.strict): the host VA of library-allocated memory is a
never-registered second mapping; aliases come from the registered mapping.

CPU tests run on the emulated backend (host mapping, registered mapping and the emulated
alias are three mappings of the same pages); the GPU tests (marker gpu) run on the H200,
where a host VA handed to a kernel must fault (error 700) in strict mode."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import backend_for
from pointerdomain.registration.resolve import can_use_host_pointer
from pointerdomain.registration.strict import ENV_VAR
from tests.helpers.checks import assert_round_trip
from tests.reference import DEV, fill_random, filled_pools, model_layout, pool_bytes, reference_transfer

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias


def test_off_by_default_and_switches_back() -> None:
    if os.environ.get(ENV_VAR) != "1":
        with pd.strict_alias(False):
            assert not pd.strict_alias_enabled()
            with pd.strict_alias(True):
                assert pd.strict_alias_enabled()
            assert not pd.strict_alias_enabled()
    with pytest.raises(errors.InvalidArgumentError):
        pd.strict_alias(1)  # type: ignore[arg-type]


def test_env_var_turns_it_on_at_import() -> None:
    code = "import pointerdomain as pd; print(pd.strict_alias_enabled())"
    env = dict(os.environ, POINTERDOMAIN_STRICT_ALIAS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    env[ENV_VAR] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_strict_allocation_is_two_mappings_of_the_same_bytes() -> None:
    with pd.strict_alias(True), pd.alloc_registered(3 * 4096 + 100, DEV) as mem:
        assert mem.strict and mem.rung is pd.Rung.SINGLE
        registered = mem.registered_address_of(mem.host_va)
        alias = pd.resolve_alias(mem.host_va + 100, DEV)
        assert len({mem.host_va.value, registered, alias.value - 100}) == 3  # three distinct mappings
        fill_random(mem.tensor, 1)
        want = bytes(mem.tensor[100:164].tolist())
        assert ctypes.string_at(alias.value, 64) == want  # written through the host VA, read through the alias
        assert ctypes.string_at(registered + 100, 64) == want
        ctypes.memmove(alias.value, b"\x5a" * 8, 8)  # written through the alias, read through the host VA
        assert bytes(mem.tensor[100:108].tolist()) == b"\x5a" * 8
        # the host VA itself is not what the backend registered: asking its alias directly fails
        status, _ = backend_for(DEV).alias(mem.host_va.value, DEV)
        assert status != 0


def test_strict_pool_round_trip_matches_reference() -> None:
    dev_layout, host_layout = model_layout("layer_first", 6), model_layout("page_first", 10)
    with pd.strict_alias(True), filled_pools(dev_layout, host_layout, DEV, chunk_blocks=3, seed=2) as (pool, host):
        assert host.memory.strict
        src, dst = torch.tensor([0, 5, 9, 17, 23]), torch.tensor([39, 1, 2, 20, 33])
        assert_round_trip(pool, host, src, dst, poison_seed=50,
                          load=lambda: host.load(pool, dst, src, backend="copy_engine"))


def test_explain_knows_the_registered_twin_mapping() -> None:
    """A fault report may carry an address of strict mode's registered mapping (the one the
    driver knows): explain() names its registration and the alias of the same byte."""
    with pd.strict_alias(True), pd.alloc_registered(3 * 4096, DEV) as mem:
        registered = mem.registered_address_of(mem.host_va + 5000)
        got = pd.explain(registered)
        assert (got.domain, got.kind, got.state) == ("host_va", "registration (strict mode's registered mapping)",
                                                      "open")
        assert got.offset == 5000 - (mem.chunks[got.chunk[0] - 1].host_va.value - mem.host_va.value)  # type: ignore[index]
        assert got.other_domain_address == pd.resolve_alias(mem.host_va + 5000, DEV).value
        assert any(f"{mem.host_va.value + 5000:#x}" in n for n in got.notes)
    assert pd.explain(registered).domain == "unknown"  # closed: the twin mapping is gone


def test_register_host_tensor_in_strict_mode_is_registered_as_usual_and_not_strict() -> None:
    t = torch.zeros(2 * 4096, dtype=torch.uint8)
    with pd.strict_alias(True), pd.register_host_tensor(t, DEV) as mem:
        assert not mem.strict
        assert mem.registered_address_of(mem.host_va) == mem.host_va.value
        alias = pd.resolve_alias(mem.host_va, DEV)
        t[:4] = 7
        assert ctypes.string_at(alias.value, 4) == b"\x07" * 4


def test_capability_emulated_cannot_fault() -> None:
    cap = pd.strict_mode_capability(DEV)
    assert cap.can_fault is False and cap.device == DEV and "emulated" in cap.reason


# GPU --------------------------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import os, sys, torch
    import pointerdomain as pd
    from pointerdomain import _C
    from pointerdomain.testing import kernel_plan
    from pointerdomain.transfer.plan import plan_for
    strict = sys.argv[1] == "1"
    dev = pd.Device("cuda", 0)
    lay = pd.KVLayout(kind="page_first", attention="mha", num_layers=2, num_pages=8, page_size=16,
                      num_heads=8, head_dim=128, dtype="bfloat16")
    with pd.strict_alias(strict):
        host = pd.HostKVPool(lay, dev)
    pool = pd.DeviceKVPool(pd.KVLayout(kind="layer_first", attention="mha", num_layers=2, num_pages=8,
                           page_size=16, num_heads=8, head_dim=128, dtype="bfloat16"), dev)
    idx = torch.arange(16, device="cuda")
    host.backup(pool, idx, idx)  # the typed API: aliases, works in both modes
    torch.cuda.synchronize()
    plan = plan_for(pool.table, pool.layout, host.kernel_table, lay).kernel
    # the original bug: a HOST-VA table handed to the raw entry point, bypassing the typed API
    bad = torch.tensor([host.memory.host_va.value], dtype=torch.int64, device="cuda")
    raw = kernel_plan(plan.src_table, plan.src_geometry, bad.data_ptr(), plan.dst_geometry, plan.page_size,
                      plan.num_kv, plan.item_bytes, plan.vec_bytes)
    status = _C.gpu_transfer(raw, idx.data_ptr(), idx.data_ptr(), 16, 0, 2, 0,
                             torch.cuda.current_stream().cuda_stream, 2)
    try:
        torch.cuda.synchronize()
        print("STATUS", status, "OK")
    except Exception as exc:
        print("STATUS", status, "FAULT", exc, flush=True)
        os._exit(70)  # the context is lost (error 700 is sticky): no clean-up through it
""")


def _run_child(strict: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, "1" if strict else "0"], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


@pytest.mark.gpu
def test_gpu_host_va_table_faults_with_700_in_strict_mode() -> None:
    cap = pd.strict_mode_capability("cuda:0")
    if cap.can_fault is not True:
        pytest.skip(f"strict mode cannot fault here: {cap.reason}")
    out = _run_child(strict=True)
    text = out.stdout + out.stderr
    assert out.returncode == 70, text
    assert "illegal memory access" in text or "700" in text, text


@pytest.mark.gpu
def test_gpu_host_va_table_works_by_accident_without_strict_mode() -> None:
    """The control: with CanUseHostPointerForRegisteredMem = 1 the same bug goes unseen."""
    if can_use_host_pointer(pd.Device("cuda", 0)) != 1:
        pytest.skip("alias != host VA on this device: the bug faults without strict mode too")
    out = _run_child(strict=False)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


@pytest.mark.gpu
def test_gpu_strict_mapping_bytes_cross_and_kernel_reads_the_alias() -> None:
    dev = pd.Device("cuda", 0)
    with pd.strict_alias(True), pd.alloc_registered(1 << 20, dev) as mem:
        assert mem.strict
        assert mem.host_va.value != mem.registered_address_of(mem.host_va)
        fill_random(mem.tensor, 3)
        alias = pd.resolve_alias(mem.host_va, dev)
        assert alias.value == backend_for(dev).alias(mem.registered_address_of(mem.host_va), dev)[1]
    dev_layout, host_layout = model_layout("layer_first", 6), model_layout("page_first_direct", 10)
    with pd.strict_alias(True), filled_pools(dev_layout, host_layout, "cuda:0", chunk_blocks=None, seed=4) as (pool, host):
        before = host.buffer.view(torch.uint8).clone()
        src, dst = torch.tensor([0, 5, 9, 17]), torch.tensor([39, 1, 2, 20])
        expected = reference_transfer(pool_bytes(pool), dev_layout, before, host_layout, src, dst)
        host.backup(pool, src.cuda(), dst.cuda(), backend="kernel")
        torch.cuda.synchronize()
        assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)


@pytest.mark.gpu
def test_gpu_capability_reports_pageable_memory_access() -> None:
    cap = pd.strict_mode_capability("cuda:0")
    assert cap.pageable_memory_access in (0, 1)
    assert cap.can_fault is (cap.pageable_memory_access == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("strict", [False, True], ids=["normal", "strict"])
def test_gpu_copy_engine_backup_read_back_on_the_legacy_stream(strict: bool) -> None:
    # One D2H copy-engine backup of 8192 runs with stream=0 while the legacy stream is current,
    # read back the ways docs/reliability.md ("Reading the host view in strict mode") calls safe.
    from tests.reference import fill_pool

    dev = pd.Device("cuda", 0)
    dl = pd.KVLayout(kind="layer_first", num_layers=4, num_pages=128, page_size=16, num_heads=8, head_dim=128,
                     dtype="bfloat16")
    hl = dl.replace(kind="page_first", num_pages=256)
    legacy = torch.cuda.default_stream(dev.ordinal)
    with torch.cuda.device(dev.ordinal), torch.cuda.stream(legacy):
        assert torch.cuda.current_stream().cuda_stream == 0  # the legacy stream is current
        pool = pd.DeviceKVPool(dl, dev)
        fill_pool(pool, 21)
        with pd.strict_alias(strict):
            host = pd.HostKVPool(hl, dev)
        try:
            assert host.memory.strict is strict
            host.buffer.view(torch.uint8).fill_(0xA5)  # poison
            dev_slots = torch.arange(0, dl.num_slots, 2, device="cuda")  # every other slot: no run merges
            host_slots = torch.arange(1, hl.num_slots, 4, device="cuda")[: dev_slots.numel()]
            torch.cuda.synchronize()
            want = reference_transfer(pool_bytes(pool), dl, host.buffer, hl, dev_slots, host_slots)
            host.backup(pool, dev_slots, host_slots, backend="copy_engine", stream=0)
            if not strict:  # the registered view: torch's copy is ordered on the stream, no wait needed
                early = host.buffer.to("cuda", non_blocking=True)
                assert torch.equal(early.view(torch.uint8).reshape(-1).cpu(), want)
            # the library's read: through the aliases, in stream order, no wait
            back = pd.DeviceKVPool(dl, dev)
            for b in back.buffers:
                b.view(torch.uint8).fill_(0x5A)
            want_back = reference_transfer(want, hl, pool_bytes(back), dl, host_slots, dev_slots)
            host.load(back, host_slots, dev_slots, backend="copy_engine", stream=0)
            assert torch.equal(pool_bytes(back), want_back)
            # torch or the CPU after the work is done: exact in both modes
            torch.cuda.current_stream().synchronize()
            read = host.buffer.to("cuda", non_blocking=True)
            assert torch.equal(read.view(torch.uint8).reshape(-1).cpu(), want)
            assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), want)
        finally:
            torch.cuda.synchronize()
            host.close()
