"""Issue 2 on the CPU emulated backend: domains, tables, registration, resolver, guard,
kernels against a torch reference, metadata, pools."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.allocation import memory_device
from tests.reference import as_bytes, fill_pool, fill_random, items, pool_items

DEV = pd.Device("emulated", 0)


def layout(kind: str = "layer_first", pages: int = 8, attention: str = "mha") -> pd.KVLayout:
    heads, dim = (1, 40) if attention == "mla" else (2, 16)
    return pd.KVLayout(kind=kind, attention=attention, num_layers=3, num_pages=pages, page_size=4,
                       num_heads=heads, head_dim=dim, dtype="bfloat16")


# --- address domains ---------------------------------------------------------

def test_address_arithmetic_keeps_domain() -> None:
    a = pd.HostVA(0x1000)
    assert a + 16 == pd.HostVA(0x1010) and isinstance(a + 16, pd.HostVA)
    assert (a + 48) - a == 48
    d = pd.DeviceAlias(0x2000, DEV)
    assert (d + 8).device == DEV and (d + 8).value == 0x2008
    assert d.offset(-0x1000) == pd.DeviceAlias(0x1000, DEV)


@pytest.mark.parametrize("bad", [lambda a, d: a + a, lambda a, d: a - d, lambda a, d: a < d, lambda a, d: a + d])
def test_cross_domain_arithmetic_raises(bad: object) -> None:
    with pytest.raises(errors.DomainError):
        bad(pd.HostVA(0x1000), pd.DeviceAlias(0x1000, DEV))  # type: ignore[operator]


def test_addresses_reject_ints_and_leak_no_int() -> None:
    assert pd.HostVA(5) != pd.DeviceAlias(5, DEV)  # type: ignore[comparison-overlap]
    with pytest.raises(errors.DomainError):
        pd.HostVA(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pd.HostVA(-1)
    with pytest.raises(TypeError):
        int(pd.HostVA(5))  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        [0, 1][pd.HostVA(0)]  # type: ignore[call-overload]


def test_alias_distance_across_devices_raises() -> None:
    with pytest.raises(errors.DeviceMismatchError):
        pd.DeviceAlias(10, DEV) - pd.DeviceAlias(4, pd.Device("emulated", 1))


# --- registration and resolution ----------------------------------------------

def test_emulated_alias_differs_and_sees_host_writes() -> None:
    with pd.alloc_registered(1 << 16, DEV) as mem:
        alias = pd.resolve_alias(mem.host_va + 100, DEV)
        assert alias.value != (mem.host_va + 100).value
        assert alias - pd.resolve_alias(mem.host_va, DEV) == 100  # interior pointer keeps its offset
        mem.tensor[100:108] = torch.arange(8, dtype=torch.uint8) + 1
        import ctypes
        assert ctypes.string_at(alias.value, 8) == bytes(range(1, 9))


def test_double_registration_raises_and_next_works() -> None:
    t = torch.empty(1 << 16, dtype=torch.uint8)
    with pd.register_host_tensor(t, DEV) as mem:
        with pytest.raises(errors.AlreadyRegisteredError):
            pd.register_host_tensor(t[4096:8192], DEV)
        assert not mem.closed
    with pd.register_host_tensor(t, DEV) as again:
        assert pd.resolve_alias(again.host_va, DEV).value != again.host_va.value


def test_register_existing_tensor_keeps_bytes_and_aliases() -> None:
    t = torch.arange(1 << 14, dtype=torch.int32)
    before = t.clone()
    with pd.register_host_tensor(t, DEV) as mem:
        assert torch.equal(t, before)
        import ctypes
        alias = pd.resolve_alias(mem.host_va + 40, DEV)
        assert ctypes.string_at(alias.value, 4) == ctypes.string_at(before.data_ptr() + 40, 4)
        t[10] = 7
        assert int.from_bytes(ctypes.string_at(alias.value, 4), "little") == 7


def test_registration_rules() -> None:
    with pytest.raises(ValueError):
        pd.alloc_registered(0, DEV)
    with pytest.raises(errors.NonContiguousError):
        pd.register_host_tensor(torch.empty(64, 64)[:, :8], DEV)
    with pytest.raises(errors.InvalidDeviceError):
        pd.alloc_registered(4096, "emulated:9")


def test_chunked_registration_cuts_on_granularity() -> None:
    with pd.alloc_registered(10 * 4096, DEV, granularity=4096, max_chunk_bytes=3 * 4096 + 5) as mem:
        assert [c.nbytes for c in mem.chunks] == [3 * 4096, 3 * 4096, 3 * 4096, 4096]
        a0 = pd.resolve_alias(mem.host_va + 3 * 4096 - 1, DEV)
        a1 = pd.resolve_alias(mem.host_va + 3 * 4096, DEV)
        assert a1.value != a0.value + 1  # separate registrations are not contiguous in alias space
        with pytest.raises(errors.RegistrationSpanError):
            pd.make_kernel_ptr_table([mem.tensor[4096 : 5 * 4096]], DEV)


def test_close_is_idempotent_and_blocks_use() -> None:
    mem = pd.alloc_registered(4096, DEV)
    table = pd.make_kernel_ptr_table([mem.tensor], DEV)
    mem.close()
    mem.close()
    with pytest.raises(errors.ClosedError):
        table.check_live()
    with pytest.raises(errors.ClosedError):
        pd.resolve_alias(mem.host_va, DEV)


def test_resolver_policy_and_fallback() -> None:
    from pointerdomain.resolve import decide_policy

    assert pd.alias_policy(DEV) is pd.AliasPolicy.EMULATED
    assert decide_policy("cuda", True, None) is pd.AliasPolicy.RUNTIME_OP
    assert decide_policy("cuda", False, 1) is pd.AliasPolicy.HOST_POINTER_FALLBACK
    for runtime, attr in (("cuda", 0), ("cuda", None), ("hip", 1)):
        with pytest.raises(errors.AliasOpMissingError, match="pip install"):
            decide_policy(runtime, False, attr)
    pd.reset_resolver_cache()
    assert pd.fallback_count() == 0 and pd.alias_policy(DEV) is pd.AliasPolicy.EMULATED


def test_device_guard_restores_on_exception() -> None:
    from pointerdomain.devices import current_device

    assert current_device("emulated") == pd.Device("emulated", 0)
    with pytest.raises(RuntimeError):
        with pd.DeviceGuard("emulated:1"):
            assert current_device("emulated") == pd.Device("emulated", 1)
            raise RuntimeError("boom")
    assert current_device("emulated") == pd.Device("emulated", 0)
    with pytest.raises(errors.InvalidDeviceError):
        pd.DeviceGuard("emulated:5")
    with pytest.raises(errors.InvalidDeviceError):
        pd.DeviceGuard("tpu:0")


# --- tables --------------------------------------------------------------------

def test_kernel_table_of_registered_and_device_memory() -> None:
    dev_buf = pd.device_empty((4, 8), torch.float32, DEV)
    assert memory_device(dev_buf) == DEV
    with pd.alloc_registered(4096, DEV) as mem:
        table = pd.make_kernel_ptr_table([mem.tensor, dev_buf], DEV)
        assert table.domain is pd.DeviceAlias and table.device == DEV and len(table) == 2
        assert table[0] == pd.resolve_alias(mem.host_va, DEV)
        assert table[1] == pd.DeviceAlias(dev_buf.data_ptr(), DEV)
        assert table.sizes == (4096, 128)
        backing = table.as_uint64_tensor()
        assert backing.dtype == torch.uint64 and backing.tolist() == [table[0].value, table[1].value]
        assert pd.memory_device(table._tensor) == DEV  # the table's own array is device memory
        backing.zero_()  # a copy: the table is unchanged
        assert table.as_uint64_tensor().tolist() == [table[0].value, table[1].value]


def test_kernel_table_rejects_unregistered_host_memory_and_other_devices() -> None:
    with pytest.raises(errors.DomainError, match="unregistered host memory"):
        pd.make_kernel_ptr_table([torch.zeros(16)], DEV)
    other = pd.device_empty((16,), torch.float32, "emulated:1")
    with pytest.raises(errors.DeviceMismatchError):
        pd.make_kernel_ptr_table([other], DEV)


def test_host_table_rejects_device_memory() -> None:
    with pytest.raises(errors.DomainError, match="device addresses must"):
        pd.host_ptr_table([pd.device_empty((16,), torch.float32, DEV)])
    with pytest.raises(errors.DomainError):
        pd.host_ptr_table([torch.zeros(4, device="meta")])
    t = torch.zeros(16)
    table = pd.host_ptr_table([t])
    assert table.domain is pd.HostVA and table.device is None and table[0] == pd.HostVA(t.data_ptr())


def test_strided_buffer_is_rejected() -> None:
    # a [2, 7286, 64, 8, 128] strided buffer corrupted a real cache; same shape of bug, smaller
    base = torch.zeros(2, 64, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(errors.NonContiguousError, match="strides"):
        pd.host_ptr_table([base.transpose(0, 1)])


def test_table_keeps_memory_alive() -> None:
    pool = pd.DeviceKVPool(layout(), DEV)
    host_layout = layout("page_first")
    mem = pd.alloc_registered(host_layout.nbytes, DEV)
    fill_random(mem.tensor, 3)
    expected = mem.tensor.clone()
    table = pd.make_kernel_ptr_table([mem.tensor], DEV)
    del mem
    gc.collect()
    slots = torch.arange(host_layout.num_slots)
    pd.transfer_kv_all_layer(table, pool.table, slots, slots, src_layout=host_layout, dst_layout=pool.layout)
    ref = expected.view(torch.bfloat16).view(host_layout.buffer_shape)
    for kv in range(2):
        for layer in range(3):
            assert torch.equal(as_bytes(pool_items(pool, kv, layer, slots)), as_bytes(items(ref, host_layout, kv, layer, slots)))


# --- kernels -------------------------------------------------------------------

def test_host_table_at_launch_raises_before_launch() -> None:
    pool = pd.DeviceKVPool(layout(), DEV)
    host_layout = layout("page_first")
    host = torch.zeros(host_layout.buffer_shape, dtype=torch.bfloat16)
    fill_random(host, 1)
    before = [as_bytes(b).clone() for b in pool.buffers]
    bad = pd.host_ptr_table([host])
    idx = torch.arange(4)
    with pytest.raises(errors.DomainError, match="PointerTable\\[HostVA\\]"):
        pd.transfer_kv_all_layer(bad, pool.table, idx, idx, src_layout=host_layout, dst_layout=pool.layout)  # type: ignore[arg-type]
    assert all(torch.equal(as_bytes(b), w) for b, w in zip(pool.buffers, before))


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("chunked", [False, True])
def test_round_trip_matches_reference(kind: str, attention: str, chunked: bool) -> None:
    dev_layout = layout("layer_first", pages=6, attention=attention)
    host_layout = layout(kind, pages=10, attention=attention)
    pool = pd.DeviceKVPool(dev_layout, DEV)
    fill_pool(pool, 0)
    max_chunk = host_layout.page_block_bytes() * 3 if chunked else 1 << 40
    with pd.HostKVPool(host_layout, DEV, max_chunk_bytes=max_chunk) as host:
        assert (len(host.memory.chunks) > 1) == chunked
        fill_random(host.buffer, 99)
        host_before = as_bytes(host.buffer).clone()
        dev_slots = torch.tensor([0, 5, 23, 7, 12, 13])
        host_slots = torch.tensor([39, 2, 8, 17, 30, 31])
        host.backup(pool, dev_slots, host_slots)
        # D2H: every moved item equals the device item; every other byte is unchanged
        expected = host_before.view(torch.bfloat16).view(host_layout.buffer_shape).clone()
        for kv in range(dev_layout.num_kv):
            for layer in range(3):
                got = items(host.buffer, host_layout, kv, layer, host_slots)
                assert torch.equal(as_bytes(got), as_bytes(pool_items(pool, kv, layer, dev_slots)))
                if host_layout.kind == "layer_first":
                    expected[kv, layer][host_slots] = pool_items(pool, kv, layer, dev_slots)
                elif host_layout.kind == "page_first":
                    expected[kv][host_slots, layer] = pool_items(pool, kv, layer, dev_slots)
                else:
                    expected[kv][host_slots // 4, layer, host_slots % 4] = pool_items(pool, kv, layer, dev_slots)
        assert torch.equal(as_bytes(host.buffer), as_bytes(expected))
        # H2D per layer into a poisoned pool
        saved = [as_bytes(b).clone() for b in pool.buffers]
        fill_pool(pool, 1000)
        poisoned = [as_bytes(b).clone() for b in pool.buffers]
        for layer in range(3):
            host.load_layer(pool, host_slots, dev_slots, layer)
        for i, b in enumerate(pool.buffers):
            want = poisoned[i].view(-1, dev_layout.item_bytes).clone()
            want[dev_slots] = saved[i].view(-1, dev_layout.item_bytes)[dev_slots]
            assert torch.equal(as_bytes(b).view(-1, dev_layout.item_bytes), want)


def test_per_layer_touches_one_layer() -> None:
    pool = pd.DeviceKVPool(layout(), DEV)
    fill_pool(pool, 0)
    before = [as_bytes(b).clone() for b in pool.buffers]
    with pd.HostKVPool(layout("page_first"), DEV) as host:
        fill_random(host.buffer, 5)
        idx = torch.arange(8)
        host.load_layer(pool, idx, idx, 1)
        for kv in range(2):
            for layer in range(3):
                same = torch.equal(as_bytes(pool.buffer(kv, layer)), before[kv * 3 + layer])
                assert same == (layer != 1)


def test_index_validation() -> None:
    pool = pd.DeviceKVPool(layout(), DEV)
    with pd.HostKVPool(layout("page_first"), DEV) as host:
        ok = torch.arange(4)
        cases = [
            (ok.to(torch.int32), ok, "dtype"),
            (ok, ok[:3], "has 3"),
            (ok.view(2, 2), ok.view(2, 2), "1-D"),
            (torch.tensor([0, 1, 2, 32]), ok, "slot 32 outside"),
            (torch.tensor([0, -1, 2, 3]), ok, "slot -1"),
            (ok, torch.tensor([0, 1, 2, 32]), "slot 32 outside"),
        ]
        for dev_idx, host_idx, msg in cases:
            with pytest.raises(errors.IndexValidationError, match=msg):
                host.backup(pool, dev_idx, host_idx)
        with pytest.raises(errors.IndexValidationError, match="layer_id"):
            host.load_layer(pool, ok, ok, 3)


def test_layout_mismatch_is_rejected() -> None:
    pool = pd.DeviceKVPool(layout(), DEV)
    other = layout("page_first").model_copy(update={"head_dim": 8})
    with pd.HostKVPool(other, DEV) as host:
        idx = torch.arange(2)
        with pytest.raises(errors.LayoutError, match="head_dim"):
            host.backup(pool, idx, idx)
    with pytest.raises(Exception, match="num_heads must be 1"):
        pd.KVLayout(kind="page_first", attention="mla", num_layers=1, num_pages=1, page_size=1, num_heads=2, head_dim=4)


# --- metadata, CLI -----------------------------------------------------------------

def test_metadata_is_host_va_only_and_json() -> None:
    with pd.HostKVPool(layout("page_first"), DEV) as host:
        infos = host.get_contiguous_buf_infos()
        assert len(infos) == 1 and infos[0].address == host.memory.host_va
        assert infos[0].nbytes == host.layout.nbytes
        assert json.loads(infos[0].model_dump_json())["address"] == host.memory.host_va.value
        assert pd.BufferInfo.model_validate_json(infos[0].model_dump_json()) == infos[0]
        blocks = host.get_page_buffer_meta([2])
        assert [b.nbytes for b in blocks] == [host.layout.page_block_bytes()] * 2
        assert blocks[0].address == host.memory.host_va + 2 * host.layout.page_block_bytes()
        with pytest.raises(errors.DomainError):
            pd.buffer_infos(host.kernel_table, 64)  # type: ignore[arg-type]
        with pytest.raises(Exception):
            pd.BufferInfo(address=host.kernel_table[0], nbytes=1, item_bytes=1)  # type: ignore[arg-type]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pointerdomain", *args], capture_output=True, text=True, timeout=300)


def test_cli_demo_small_and_doctor() -> None:
    out = _cli("demo", "--layers", "4", "--device-pages", "8", "--host-pages", "12", "--pages", "5", "--device", "emulated:0")
    assert out.returncode == 0, out.stderr
    assert "distinct" in out.stdout and "verified byte-for-byte" in out.stdout
    doc = _cli("doctor", "--device", "emulated:0")
    assert doc.returncode == 0, doc.stderr
    report = json.loads(doc.stdout)
    assert report["devices"][0]["self_test"]["ok"] is True
    assert report["devices"][0]["self_test"]["alias_equals_va"] is False


@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("chunked", [False, True])
def test_copy_engine_path_matches_kernel(kind: str, chunked: bool) -> None:
    dev_layout = layout("layer_first", pages=6)
    host_layout = layout(kind, pages=10)
    pool = pd.DeviceKVPool(dev_layout, DEV)
    fill_pool(pool, 0)
    max_chunk = host_layout.page_block_bytes() * 3 if chunked else 1 << 40
    # runs of consecutive slots, crossing page boundaries, plus singletons
    dev_slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 20, 21, 22, 23, 17])
    host_slots = torch.tensor([2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 12, 13, 14, 15, 39])
    results = []
    for backend in ("kernel", "copy_engine", "auto"):
        with pd.HostKVPool(host_layout, DEV, max_chunk_bytes=max_chunk) as host:
            fill_random(host.buffer, 5)
            host.backup(pool, dev_slots, host_slots, backend=backend)
            results.append(as_bytes(host.buffer).clone())
            for kv in range(2):
                for layer in range(3):
                    assert torch.equal(as_bytes(items(host.buffer, host_layout, kv, layer, host_slots)),
                                       as_bytes(pool_items(pool, kv, layer, dev_slots)))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_copy_runs_merge_consecutive_slots_within_pages() -> None:
    from pointerdomain.plan import plan_for

    dev_layout = layout("layer_first", pages=6)
    host_layout = layout("page_first_direct", pages=10)
    pool = pd.DeviceKVPool(dev_layout, DEV)
    with pd.HostKVPool(host_layout, DEV) as host:
        s = torch.tensor([0, 1, 2, 3, 4, 5, 9])
        d = torch.tensor([4, 5, 6, 7, 8, 9, 20])
        plan = plan_for(pool.table, dev_layout, host.kernel_table, host_layout)
        dsts, srcs, sizes = plan.copy_runs(s, d, 0, 3)
        item = dev_layout.item_bytes
        # per (kv, layer): pages of 4 -> runs [0..3], [4,5], [9]
        assert sizes.tolist() == [4 * item, 2 * item, item] * 6
        assert int(sizes.sum()) == 7 * 6 * item


def test_bad_arguments_get_typed_errors_before_launch() -> None:
    pool = pd.DeviceKVPool(layout(), DEV)
    with pd.HostKVPool(layout("page_first"), DEV) as host:
        fill_random(host.buffer, 4)
        before = [as_bytes(b).clone() for b in pool.buffers]
        idx = torch.arange(4)
        for kwargs in ({"stream": "abc"}, {"stream": -1}, {"max_ctas": 0}, {"backend": "cuda"},
                       {"validate_indices": "no"}):
            with pytest.raises(errors.InvalidArgumentError):
                host.load(pool, idx, idx, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidArgumentError, match="KVLayout"):
            pd.transfer_kv_all_layer(host.kernel_table, pool.table, idx, idx, src_layout=None,  # type: ignore[arg-type]
                                     dst_layout=pool.layout)
        assert all(torch.equal(as_bytes(b), w) for b, w in zip(pool.buffers, before))
    with pytest.raises(errors.InvalidArgumentError):
        pd.DeviceKVPool("layer_first", DEV)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError):
        pd.register_host_tensor([1, 2, 3], DEV)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError):
        pd.HostVA(1 << 64)
    import pydantic
    with pytest.raises(pydantic.ValidationError, match="whole number"):
        pd.BufferInfo(address=pd.HostVA(4096), nbytes=10, item_bytes=4)
    with pytest.raises(pydantic.ValidationError):
        pd.BufferInfo(address=4096, nbytes=8, item_bytes=4)  # type: ignore[arg-type]


def test_cli_demo_refuses_bad_shapes_with_a_message() -> None:
    for args, needle in ((("--layers", "100000"), "GiB of host memory"), (("--layers", "0"), "invalid pool shape"),
                         (("--pages", "0"), "--pages must be"), (("--attention", "mla", "--heads", "8"), "--heads must be 1")):
        out = _cli("demo", "--device", "emulated:0", *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr
