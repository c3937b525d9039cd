"""Validated layouts, the one error tree, emulated parity with CUDA, strict environment
variables (docs/reliability.md, "Layouts, the error tree"). Each test fails on the code
before its fix (commit d9a3495) and passes after it."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import FaultyBackend, backend_for, install_backend
from pointerdomain.adapters.mooncake import HostTransferEngine
from tests.reference import DEV, as_bytes, fill_random, model_layout, reference_transfer, table_storage

BASE = model_layout("layer_first", pages=4)


def _run(code: str, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ) | (env or {})
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                                                       *sys.path]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full, timeout=timeout)


def expect(info: pytest.ExceptionInfo[BaseException], cls: type[BaseException], builtin: type[BaseException],
           *needles: str) -> None:
    """The exact class, inside the tree and the builtin, and every needle in the message."""
    assert type(info.value) is cls, (type(info.value), info.value)
    assert isinstance(info.value, errors.PointerDomainError) and isinstance(info.value, builtin)
    text = str(info.value)
    for needle in needles:
        assert needle in text, (needle, text)


# 4. layouts that cannot be invalid --------------------------------------------------

BAD_CHANGES: list[tuple[dict[str, Any], str, str]] = [
    ({"head_dim": -8}, "head_dim", "-8"),
    ({"kind": "pagefirst"}, "kind", "'pagefirst'"),
    ({"dtype": torch.bfloat16}, "dtype", "torch.bfloat16"),
    ({"num_pages": -3}, "num_pages", "-3"),
    ({"attention": "mla", "num_heads": 4}, "num_heads", "4"),
    ({"page_size": 0}, "page_size", "0"),
    ({"num_layers": "3"}, "num_layers", "'3'"),
    ({"heads": 2}, "heads", "2"),
]
DERIVATIONS: dict[str, Callable[[pd.KVLayout, dict[str, Any]], object]] = {
    "replace": lambda lay, ch: lay.replace(**ch),
    "model_copy": lambda lay, ch: lay.model_copy(update=ch),
    "model_validate": lambda lay, ch: pd.KVLayout.model_validate(lay.model_dump() | ch),
    "constructor": lambda lay, ch: pd.KVLayout(**(lay.model_dump() | ch)),
}


@pytest.mark.parametrize("how", sorted(DERIVATIONS))
@pytest.mark.parametrize(("changes", "field", "value"), BAD_CHANGES, ids=[f for _, f, _ in BAD_CHANGES])
def test_every_derivation_of_a_layout_validates(how: str, changes: dict[str, Any], field: str, value: str) -> None:
    with pytest.raises(errors.LayoutError) as info:
        DERIVATIONS[how](BASE, changes)
    expect(info, errors.LayoutFieldError, ValueError, f"KVLayout.{field}", value, "expected", "Fix:")
    assert info.value.field == field  # type: ignore[attr-defined]


def test_model_construct_is_refused() -> None:
    # pydantic's model_construct skips validation; here it is refused (pointerdomain.validated)
    with pytest.raises(errors.DomainError, match="skips validation"):
        pd.KVLayout.model_construct(**(BASE.model_dump() | {"head_dim": -8}))


def test_torch_dtype_fix_names_the_string() -> None:
    with pytest.raises(errors.LayoutFieldError, match="pass dtype='bfloat16'"):
        BASE.replace(dtype=torch.bfloat16)


def test_valid_derivations_are_equal_and_layouts_stay_frozen() -> None:
    host = BASE.replace(kind="page_first", num_pages=8)
    assert host == BASE.model_copy(update={"kind": "page_first", "num_pages": 8})
    assert (host.kind, host.num_pages, host.head_dim) == ("page_first", 8, BASE.head_dim)
    assert pickle.loads(pickle.dumps(host)) == host and copy.deepcopy(host) == host
    with pytest.raises(errors.LayoutFieldError, match="frozen"):
        host.head_dim = -8  # type: ignore[misc]
    assert host.head_dim == BASE.head_dim


def test_negative_head_dim_through_model_copy_no_longer_reaches_a_launch() -> None:
    # before: model_copy(update={"head_dim": -8}) skipped validation and the launch segfaulted
    with pytest.raises(errors.LayoutFieldError):
        BASE.model_copy(update={"head_dim": -8})


# 7. the error tree ------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cuda_without_ordinal_on_a_cpu_torch() -> None:
    with pytest.raises(errors.InvalidDeviceError) as info:
        pd.as_device("cuda")
    expect(info, errors.InvalidDeviceError, ValueError, "'cuda'", "no CUDA device", "Fix:")


def test_bare_tensor_is_not_a_list_of_tensors() -> None:
    rows = torch.zeros(4, 16, dtype=torch.uint8)
    for build in (lambda: pd.make_kernel_ptr_table(rows, DEV), lambda: pd.host_ptr_table(rows)):  # type: ignore[arg-type]
        with pytest.raises(TypeError) as info:
            build()
        expect(info, errors.InvalidTypeError, TypeError, "tensors", "bare torch.Tensor", "(4, 16)", "Fix:")


def test_table_builders_raise_typed_errors() -> None:
    with pytest.raises(TypeError) as info:
        pd.make_kernel_ptr_table([b"abc"], DEV)  # type: ignore[list-item]
    expect(info, errors.InvalidTypeError, TypeError, "tensors[0]", "bytes", "expected a torch.Tensor", "Fix:")
    with pytest.raises(ValueError) as info2:
        pd.host_ptr_table([torch.zeros(0)])
    expect(info2, errors.InvalidArgumentError, ValueError, "tensors[0]", "empty", "Fix:")


def test_host_pool_methods_refuse_what_is_not_a_device_pool() -> None:
    with pd.HostKVPool(model_layout("page_first", pages=4), DEV) as host:
        slots = torch.arange(4)
        calls: dict[str, Callable[[Any], None]] = {
            "backup": lambda pool: host.backup(pool, slots, slots),
            "load": lambda pool: host.load(pool, slots, slots),
            "load_layer": lambda pool: host.load_layer(pool, slots, slots, 0),
        }
        for method, call in calls.items():
            for bad, found in ((None, "found None"), (host, "found a HostKVPool")):
                with pytest.raises(TypeError) as info:
                    call(bad)
                expect(info, errors.InvalidTypeError, TypeError, f"HostKVPool.{method}", "device_pool", found,
                       "expected a device pool", "Fix:")


def test_huge_allocations_give_a_typed_out_of_memory_error() -> None:
    huge = 1 << 50
    with pytest.raises(MemoryError) as info:
        pd.alloc_registered(huge, DEV)
    expect(info, errors.OutOfMemoryError, MemoryError, "nbytes", str(huge), "GiB", "Fix:")
    assert info.value.nbytes == huge  # type: ignore[attr-defined]
    with pytest.raises(MemoryError) as info2:
        pd.device_empty((huge,), torch.uint8, DEV)
    expect(info2, errors.OutOfMemoryError, MemoryError, str(huge), "device memory", "Fix:")


def test_pickle_and_copy_of_process_local_objects() -> None:
    pool = pd.DeviceKVPool(BASE, DEV)
    with pd.HostKVPool(BASE.replace(kind="page_first"), DEV) as host:
        for obj in (pool, host, host.kernel_table, host.host_table, host.memory, pool.table):
            for how in (pickle.dumps, copy.copy, copy.deepcopy):
                with pytest.raises(TypeError) as info:
                    how(obj)
                expect(info, errors.NotPicklableError, TypeError, type(obj).__name__, "process-local", "Fix:")


def test_mooncake_wrapper_raises_typed_errors() -> None:
    engine = HostTransferEngine(object(), "localhost:1")
    with pytest.raises(ValueError) as info:
        engine.register_memory(pd.HostVA(4096))
    expect(info, errors.InvalidArgumentError, ValueError, "region", "nbytes", "Fix:")
    with pytest.raises(ValueError) as info:
        engine.register_memory(pd.HostVA(4096), -1)
    expect(info, errors.InvalidArgumentError, ValueError, "nbytes", "-1", "positive int", "Fix:")
    with pytest.raises(ValueError) as info:
        engine.batch_transfer_sync_read("peer", [], [pd.BufferInfo(address=pd.HostVA(4096), nbytes=8, item_bytes=8)])
    expect(info, errors.InvalidArgumentError, ValueError, "remote", "1 remote", "0 local", "Fix:")


def test_no_nanobind_message_for_a_bad_address() -> None:
    for bad in ("x", -1, 1 << 70):
        with pytest.raises(ValueError) as info:
            pd.memory_device_at(bad, 8)  # type: ignore[arg-type]
        expect(info, errors.InvalidArgumentError, ValueError, "address", repr(bad), "[0, 2**64)", "Fix:")
        assert "emu_" not in str(info.value) and "incompatible function arguments" not in str(info.value)


def test_ranges_reaching_the_top_of_the_address_space_lie_in_no_allocation() -> None:
    """The emulated lookups never form ``address + nbytes`` (it wrapped past 2**64, so the top
    address read as inside every allocation and registration before it)."""
    dev = pd.device_empty((4096,), torch.uint8, "emulated:0")
    assert pd.memory_device_at(dev.data_ptr() + 16, 16) == pd.Device("emulated", 0)  # a real hit still hits
    assert pd.memory_device_at(dev.data_ptr() + 16, 2**64 - 1) is None
    assert pd.memory_device_at(dev.data_ptr() + 4095, 2) is None  # one byte past the end
    assert pd.memory_device_at(2**64 - 1, 1) is None
    with pd.alloc_registered(4096, DEV) as mem:
        top = pd.explain(2**64 - 1)
        assert top.domain == "unknown"
        assert top.pointer_attributes["emulated"]["registered_host"] is False
        assert top.pointer_attributes["emulated"]["alias_status"] != 0
        assert pd.explain(mem.host_va.value).domain == "host_va"  # a real registration still found


def test_page_sharing_above_the_memlock_limit_is_not_a_memlock_error() -> None:
    # RLIMIT_MEMLOCK lowered to 64 KiB, the emulated limit off: the second tensor shares a
    # page with the first registration, which is the cause, not the limit.
    proc = _run("""
        import resource, torch, pointerdomain as pd
        from pointerdomain import errors
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
        base = torch.zeros(80 * 4096, dtype=torch.uint8)
        start = -base.data_ptr() % 4096
        a = pd.register_host_tensor(base[start + 100 : start + 2000], "emulated:0")
        try:
            pd.register_host_tensor(base[start + 3000 : start + 3000 + 70 * 4096], "emulated:0")
        except errors.RegistrationError as exc:
            print(type(exc).__name__, "|", exc)
    """)
    assert proc.returncode == 0, proc.stderr
    name, _, text = proc.stdout.partition(" | ")
    assert name == "RegistrationError", proc.stdout
    assert "share a page" in text and "ulimit -l" not in text


def test_address_space_failure_is_not_a_memlock_error() -> None:
    # An out-of-memory status from the emulated backend (mmap failed: address space) above
    # RLIMIT_MEMLOCK: the emulated backend reports the limit itself, so this is not one.
    proc = _run("""
        import resource, pointerdomain as pd
        from pointerdomain import errors
        from pointerdomain.testing import FaultyBackend, backend_for, install_backend
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
        inner = backend_for(pd.Device("emulated", 0))
        with install_backend(FaultyBackend(inner, {"register": {1: 2}}), "emulated"):
            try:
                pd.alloc_registered(1 << 20, "emulated:0")
            except errors.RegistrationError as exc:
                print(type(exc).__name__, "|", exc)
    """)
    assert proc.returncode == 0, proc.stderr
    name, _, text = proc.stdout.partition(" | ")
    assert name == "RegistrationError", proc.stdout
    assert "address space" in text and "ulimit -l" not in text


def test_checked_mode_reports_an_overwritten_entry_as_a_domain_error() -> None:
    dev_layout, host_layout = BASE, BASE.replace(kind="page_first")
    pool = pd.DeviceKVPool(dev_layout, DEV)
    block = host_layout.page_block_bytes()
    with pd.HostKVPool(host_layout, DEV, max_chunk_bytes=block) as host, pd.checked.checked_mode():
        fill_random(host.buffer, 1)
        before = [as_bytes(b).clone() for b in pool.buffers]
        storage = table_storage(host.kernel_table)
        storage[0] = int(storage[0]) + block // 2  # inside its chunk, pages now cross the chunk end
        idx = torch.arange(4)
        with pytest.raises(errors.DomainError) as info:
            host.load(pool, idx, idx)
        expect(info, errors.DomainError, TypeError, "entry 0", "written into the table", "Fix:")
        assert all(torch.equal(as_bytes(b), w) for b, w in zip(pool.buffers, before))


# 8. emulated parity with CUDA -------------------------------------------------------

def test_chunked_registration_of_a_tensor_starting_mid_page() -> None:
    # page_first, 1 layer, 128-token pages of 32 B items: one page block is 4096 B
    host_layout = pd.KVLayout(kind="page_first", num_layers=1, num_pages=3, page_size=128, num_heads=1,
                              head_dim=8, dtype="float32")
    dev_layout = host_layout.replace(kind="layer_first")
    block = host_layout.page_block_bytes()
    backing = torch.zeros(host_layout.nbytes + 3 * 4096, dtype=torch.uint8)
    start = -backing.data_ptr() % 4096 + 1000  # mid-page, as an ordinary torch tensor may start
    view = backing[start : start + host_layout.nbytes]
    with pd.register_host_tensor(view, DEV, granularity=block, max_chunk_bytes=block) as mem:
        assert len(mem.chunks) == host_layout.nbytes // block
        buffer = view.view(torch.float32).view(host_layout.buffer_shape)
        fill_random(buffer, 3)
        table = pd.make_kernel_ptr_table(host_layout.page_block_views(buffer), DEV)
        pool = pd.DeviceKVPool(dev_layout, DEV)
        for b in pool.buffers:
            b.zero_()
        src = torch.tensor([5, 130, 383, 0]); dst = torch.tensor([0, 1, 2, 300])
        pd.transfer_kv_all_layer(table, pool.table, src, dst, src_layout=host_layout, dst_layout=dev_layout)
        want = reference_transfer(buffer, host_layout, torch.cat([b.reshape(-1) for b in pool.buffers]) * 0,
                                  dev_layout, src, dst)
        got = torch.cat([as_bytes(b).reshape(-1) for b in pool.buffers])
        assert torch.equal(got, want)


def test_indices_in_another_emulated_devices_memory_are_refused() -> None:
    pool = pd.DeviceKVPool(BASE, DEV)
    with pd.HostKVPool(BASE.replace(kind="page_first"), DEV) as host:
        fill_random(host.buffer, 2)
        before = [as_bytes(b).clone() for b in pool.buffers]
        other = pd.device_empty((4,), torch.int64, "emulated:1")
        other.copy_(torch.arange(4))
        for src, dst in ((other, torch.arange(4)), (torch.arange(4), other)):
            with pytest.raises(IndexError) as info:
                host.load(pool, src, dst)
            expect(info, errors.IndexValidationError, IndexError, "emulated:1", "emulated:0", "Fix:")
        assert all(torch.equal(as_bytes(b), w) for b, w in zip(pool.buffers, before))
        same_device = pd.device_empty((4,), torch.int64, DEV)
        same_device.copy_(torch.arange(4))
        host.load(pool, same_device, torch.arange(4))  # the launch device's own memory is fine


def test_a_forked_childs_writes_do_not_reach_the_parent() -> None:
    proc = _run("""
        import os, torch, pointerdomain as pd
        mem = pd.alloc_registered(3 * 4096, "emulated:0")
        mem.tensor.fill_(1)
        backing = torch.zeros(4 * 4096, dtype=torch.uint8)
        view = backing[100 : 100 + 2 * 4096]
        reg = pd.register_host_tensor(view, "emulated:0")
        view.fill_(5)
        pid = os.fork()
        if pid == 0:
            mem.tensor.fill_(7)
            view.fill_(9)
            os._exit(0 if int(mem.tensor.sum()) == 7 * 3 * 4096 and int(view[0]) == 9 else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), int(mem.tensor.sum()), int(view.sum()))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", str(3 * 4096), str(5 * 2 * 4096)]


# 9. environment variables -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("value", ["true", "yes", "2", "on"])
def test_undocumented_checked_values_warn(value: str) -> None:
    proc = _run("""
        import warnings
        warnings.simplefilter("always")
        import pointerdomain as pd
        print(pd.checked.enabled())
    """, env={"POINTERDOMAIN_CHECKED": value})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert "EnvironmentValueWarning" in proc.stderr and f"POINTERDOMAIN_CHECKED={value!r}" in proc.stderr
    assert "'0' or '1'" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("", False)])
def test_documented_checked_values(value: str, on: bool) -> None:
    proc = _run("import pointerdomain as pd; print(pd.checked.enabled())", env={"POINTERDOMAIN_CHECKED": value})
    assert proc.returncode == 0 and proc.stdout.strip() == str(on) and "Warning" not in proc.stderr, proc.stderr


def test_undocumented_emulate_memlock_value_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    from pointerdomain import env

    monkeypatch.setenv("POINTERDOMAIN_EMULATE_MEMLOCK", "yes")
    with pytest.warns(env.EnvironmentValueWarning, match="POINTERDOMAIN_EMULATE_MEMLOCK='yes'"):
        with pd.alloc_registered(4096, DEV):
            pass
    monkeypatch.setenv("POINTERDOMAIN_EMULATE_MEMLOCK", "1")
    assert env.flag(env.EMULATE_MEMLOCK) is True


def test_undocumented_emulated_device_count_is_a_typed_error() -> None:
    proc = _run("""
        import pointerdomain as pd
        try:
            pd.validate_device("emulated:0")
        except pd.errors.InvalidDeviceError as exc:
            print(exc)
    """, env={"POINTERDOMAIN_EMULATED_DEVICES": "-1"})
    assert proc.returncode == 0, proc.stderr
    assert "POINTERDOMAIN_EMULATED_DEVICES='-1'" in proc.stdout and "positive int" in proc.stdout
