"""Bad-input catalogue: one case per input that would have corrupted
memory or faulted, with the exact typed error it now gets.

Every case asserts
* the exact error class (``type(exc) is Cls``, not a subclass) and that the
  message names what it must (the table / index, the domain or value found and
  expected, the fix);
* that nothing was corrupted: destinations are poisoned with random bytes first
  and must be byte-for-byte unchanged after the refused call, and refused
  registrations leave nothing registered;
* that the process is still usable: a correct launch right after works and
  moves the exact bytes (:func:`still_usable`).

Runs on the emulated backend (CPU), with checked mode on (the cases that only
checked mode catches, marked "checked:", overwrite a table's own array, standing in
for a stray write from native code: ``as_uint64_tensor()`` hands out a copy, so no
Python API can change what a launch reads).
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import checked, errors
from pointerdomain.registration import memory
from pointerdomain.testing import FaultyBackend, NOT_REGISTERED, install_backend
from pointerdomain.domains import HostVA
from tests.reference import EMU, fill_pool, fill_random, items, same, table_storage

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias

DEV = "emulated:0"
DEV1 = "emulated:1"
PAGE = mmap.PAGESIZE
MODEL: dict[str, Any] = dict(attention="mha", num_layers=2, page_size=4, num_heads=2, head_dim=16, dtype="bfloat16")
HOST_LAYOUT = pd.KVLayout(kind="page_first", num_pages=6, **MODEL)
DEV_LAYOUT = pd.KVLayout(kind="layer_first", num_pages=4, **MODEL)





# ---------------------------------------------------------------- helpers


def snap(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1).clone()


def unchanged(t: torch.Tensor, before: torch.Tensor) -> bool:
    return torch.equal(t.view(torch.uint8).reshape(-1), before)


def expect(info: pytest.ExceptionInfo[BaseException], cls: type[BaseException], *needles: str) -> str:
    """The exact class, and every needle (case-insensitive) in the message."""
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for needle in needles:
        assert needle.lower() in message.lower(), f"{needle!r} not in: {message}"
    return message


class Rig:
    """A device pool and a host pool of one model, filled with random bytes."""

    def __init__(self, device: str = DEV, seed: int = 0, **host: Any) -> None:
        self.dev = pd.DeviceKVPool(DEV_LAYOUT, device)
        self.host = pd.HostKVPool(HOST_LAYOUT, device, **host)
        fill_pool(self.dev, seed * 100)
        fill_random(self.host.buffer, seed * 100 + 99)
        self.slots = torch.tensor([5, 0, 13, 7], dtype=torch.int64)
        self.host_slots = torch.tensor([20, 3, 9, 14], dtype=torch.int64)

    def dev_snap(self) -> list[torch.Tensor]:
        return [snap(b) for b in self.dev.buffers]

    def dev_unchanged(self, before: list[torch.Tensor]) -> bool:
        return all(unchanged(b, s) for b, s in zip(self.dev.buffers, before))

    def backup_ok(self) -> bool:
        """Back up ``slots`` to ``host_slots`` and compare with torch."""
        self.host.backup(self.dev, self.slots, self.host_slots)
        return all(
            same(items(self.host.buffer, HOST_LAYOUT, kv, layer, self.host_slots),
                 self.dev.buffer(kv, layer)[self.slots])
            for kv in range(2) for layer in range(2)
        )

    def close(self) -> None:
        self.host.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def still_usable(device: str = DEV) -> None:
    """A fresh correct D2H + H2D round trip moves exactly the expected bytes."""
    r = Rig(device, seed=7)
    try:
        assert r.backup_ok()
        before = snap(r.host.buffer)
        for buf in r.dev.buffers:
            buf.view(torch.uint8).fill_(0xA5)
        r.host.load(r.dev, r.host_slots, r.slots)
        assert unchanged(r.host.buffer, before)
        for kv in range(2):
            for layer in range(2):
                got = r.dev.buffer(kv, layer)
                assert same(got[r.slots], items(r.host.buffer, HOST_LAYOUT, kv, layer, r.host_slots))
                others = torch.ones(DEV_LAYOUT.num_slots, dtype=torch.bool)
                others[r.slots] = False
                assert bool((got[others].view(torch.uint8) == 0xA5).all())
    finally:
        r.close()


def registered_nothing_at(va: int, nbytes: int) -> bool:
    """Neither pointerdomain's registry nor the emulated backend knows any page of the range."""
    if memory.find_registration(HostVA(va), nbytes) is not None:
        return False
    return all(EMU.alias(a, pd.as_device(DEV))[0] == NOT_REGISTERED for a in range(va, va + nbytes, PAGE))


def host_buffer(nbytes: int, seed: int = 1) -> torch.Tensor:
    """Page-aligned host memory (memfd backed, like alloc_registered's) with random bytes, unregistered."""
    t = EMU.host_alloc(nbytes)
    fill_random(t, seed)
    return t


# ---------------------------------------------------------------- registration


def test_zero_length_alloc_registered_is_refused() -> None:
    before = memory.pinned_bytes()
    with pytest.raises(errors.InvalidRegistrationError) as info:
        pd.alloc_registered(0, DEV)
    expect(info, errors.InvalidRegistrationError, "0-byte registration is invalid", "got 0")
    for bad in (-1, 2.5, "8"):
        with pytest.raises(errors.InvalidRegistrationError) as info:
            pd.alloc_registered(bad, DEV)  # type: ignore[arg-type]
        expect(info, errors.InvalidRegistrationError, "positive int", f"got {bad!r}")
        assert "0-byte" not in str(info.value)
    # the backend itself refuses a 0-byte range (cudaErrorInvalidValue's counterpart)
    t = host_buffer(PAGE)
    assert EMU.register(t.data_ptr(), 0, pd.as_device(DEV)) == 1
    assert memory.pinned_bytes() == before and registered_nothing_at(t.data_ptr(), PAGE)
    still_usable()


def test_zero_length_register_host_tensor_is_refused() -> None:
    with pytest.raises(errors.InvalidRegistrationError) as info:
        pd.register_host_tensor(torch.empty(0, dtype=torch.uint8), DEV)
    expect(info, errors.InvalidRegistrationError, "empty tensor", "0-byte registration is invalid")
    still_usable()


def test_misaligned_interior_registration_keeps_in_page_offset() -> None:
    """Decision: an interior, non-page-aligned range registers (cudaHostRegister pins the
    whole pages around it) and its alias keeps the in-page offset; kernels through it
    read and write exactly that range."""
    backing = torch.zeros(4 * PAGE, dtype=torch.uint8)
    start = (100 - backing.data_ptr()) % PAGE
    layout = pd.KVLayout(kind="layer_first", attention="mla", num_layers=1, num_pages=2, page_size=4,
                         num_heads=1, head_dim=64, dtype="uint8")
    fill_random(backing, 3)
    outside = torch.cat([backing[:start], backing[start + layout.nbytes:]]).clone()
    region = backing[start : start + layout.nbytes]
    with pd.register_host_tensor(region, DEV) as mem:
        assert mem.host_va.value % PAGE == 100
        alias = pd.resolve_alias(mem.host_va, DEV)
        assert alias.value % PAGE == 100 and alias.value != mem.host_va.value
        assert pd.resolve_alias(mem.host_va + 37, DEV) == alias + 37
        src = pd.device_empty(layout.buffer_shape, torch.uint8, DEV)
        fill_random(src, 4)
        slots = torch.tensor([6, 1, 3], dtype=torch.int64)
        pd.transfer_kv_all_layer(pd.make_kernel_ptr_table([src], DEV), pd.make_kernel_ptr_table([region], DEV),
                                 slots, slots, src_layout=layout, dst_layout=layout)
        assert torch.equal(region.view(layout.buffer_shape)[0, 0][slots], src[0, 0][slots])
        assert torch.equal(torch.cat([backing[:start], backing[start + layout.nbytes:]]), outside)
    still_usable()


def test_registration_sharing_a_page_with_another_is_refused() -> None:
    """A second, separate registration that shares a 4 KiB page with the first but extends
    past it cannot get a consistent alias: RegistrationError (not MemlockLimitError, whatever
    RLIMIT_MEMLOCK is), nothing stays registered, the first still works."""
    backing = torch.zeros(5 * PAGE, dtype=torch.uint8)
    start = (100 - backing.data_ptr()) % PAGE
    fill_random(backing, 5)
    with pd.register_host_tensor(backing[start : start + 3000], DEV) as first:
        before = snap(backing)
        second = backing[start + 3000 : start + 3000 + 2 * PAGE]
        with pytest.raises(errors.RegistrationError) as info:
            pd.register_host_tensor(second, DEV)
        expect(info, errors.RegistrationError, "chunk 1/1", "share a page with memory registered separately",
               "allocate with alloc_registered")
        assert unchanged(backing, before)
        assert memory.find_registration(HostVA(second.data_ptr()), second.numel()) is None
        assert EMU.alias(second.data_ptr() + PAGE, pd.as_device(DEV))[0] == NOT_REGISTERED
        table = pd.make_kernel_ptr_table([backing[start : start + 3000]], DEV)
        assert table[0] == pd.resolve_alias(first.host_va, DEV)
    still_usable()


@pytest.mark.parametrize("fail_at", [1, 3, 5])
def test_registration_failing_half_way_rolls_back(fail_at: int) -> None:
    t = host_buffer(5 * PAGE, seed=fail_at)
    before_bytes, before_pinned = snap(t), memory.pinned_bytes()
    with install_backend(FaultyBackend(EMU, fail={"register": {fail_at: 1}}), "emulated") as faulty:
        with pytest.raises(errors.RegistrationError) as info:
            pd.register_host_tensor(t, DEV, max_chunk_bytes=PAGE)
    assert faulty.calls["register"] == fail_at and faulty.calls["unregister"] == fail_at - 1
    rolled = f"the {fail_at - 1} chunk(s) before it were unregistered" if fail_at > 1 else "invalid value"
    expect(info, errors.RegistrationError, f"chunk {fail_at}/5", rolled)
    assert registered_nothing_at(t.data_ptr(), t.numel())
    assert memory.pinned_bytes() == before_pinned and unchanged(t, before_bytes)
    with pd.register_host_tensor(t, DEV, max_chunk_bytes=PAGE) as mem:  # the same range registers fine
        assert len(mem.chunks) == 5
        assert unchanged(t, before_bytes)
    still_usable()


_MEMLOCK_CHILD = textwrap.dedent(
    """
    import json, resource, torch
    import pointerdomain as pd
    from pointerdomain import errors
    from pointerdomain.registration import memory
    from pointerdomain.testing import backend_for
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, hard))
    out = {}
    for name, kwargs in (("one", {}), ("chunked", {"max_chunk_bytes": 16 << 10})):
        try:
            pd.alloc_registered(128 << 10, "emulated:0", **kwargs)
            out[name] = ["no error", ""]
        except errors.PointerDomainError as exc:
            out[name] = [type(exc).__name__, str(exc)]
    out["pinned_after"] = memory.pinned_bytes() + backend_for(pd.Device("emulated", 0)).pinned_bytes()
    with pd.alloc_registered(16 << 10, "emulated:0") as small:  # still usable: under the limit
        src = pd.device_empty((16 << 10,), torch.uint8, "emulated:0")
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
        layout = pd.KVLayout(kind="layer_first", attention="mla", num_layers=1, num_pages=4, page_size=4,
                             num_heads=1, head_dim=1024, dtype="uint8")
        slots = torch.arange(16)
        pd.transfer_kv_all_layer(pd.make_kernel_ptr_table([src], "emulated:0"),
                                 pd.make_kernel_ptr_table([small.tensor], "emulated:0"),
                                 slots, slots, src_layout=layout, dst_layout=layout)
        out["usable"] = bool(torch.equal(small.tensor, src))
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_memlock_limit_gives_hint_and_rolls_back() -> None:
    env = dict(os.environ, POINTERDOMAIN_EMULATE_MEMLOCK="1", POINTERDOMAIN_CHECKED="1")
    proc = subprocess.run([sys.executable, "-c", _MEMLOCK_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("one", "chunked"):
        cls, message = out[name]
        assert cls == "MemlockLimitError", message
        for needle in ("RLIMIT_MEMLOCK is 65536 bytes", "131072 would be pinned", "ulimit -l unlimited",
                       "--ulimit memlock=-1", "register less"):
            assert needle in message, message
    assert "chunk 5/8" in out["chunked"][1] and "the 4 chunk(s) before it were unregistered" in out["chunked"][1]
    assert out["pinned_after"] == 0 and out["usable"] is True
    still_usable()


def test_double_registration_raises_and_next_registration_works() -> None:
    t = host_buffer(2 * PAGE)
    before = snap(t)
    with pd.register_host_tensor(t, DEV) as first:
        with pytest.raises(errors.AlreadyRegisteredError) as info:
            pd.register_host_tensor(t[PAGE:], DEV)
        expect(info, errors.AlreadyRegisteredError, "overlaps a registration", f"{first.host_va!r}",
               "close that one first or reuse it")
        assert memory.find_registration(HostVA(t.data_ptr()), t.numel()) is first
    assert unchanged(t, before)
    with pd.register_host_tensor(t[PAGE:], DEV) as again:
        assert again.nbytes == PAGE
    still_usable()


def test_close_twice_is_a_no_op_and_the_backend_refuses_a_double_unregister() -> None:
    mem = pd.alloc_registered(2 * PAGE, DEV)
    va = mem.host_va.value
    mem.close()
    mem.close()  # by design: exactly one unregister
    assert mem.closed and registered_nothing_at(va, 2 * PAGE)
    # below the API a second unregister of the range is an error (cudaErrorHostMemoryNotRegistered, 713)
    assert EMU.unregister(va, pd.as_device(DEV)) == NOT_REGISTERED
    with pd.register_host_tensor(mem.tensor, DEV):  # the range registers again
        pass
    still_usable()


def test_range_unregistered_behind_the_owner_is_refused(rig: Rig) -> None:
    """A second unregister from outside pointerdomain (another library's cudaHostUnregister)
    leaves the owner open but the alias mapping gone: building a table gives
    NotRegisteredError, and checked mode refuses a launch with a table built before
    (without it the kernel would read an unmapped alias)."""
    mem = rig.host.memory
    table = rig.host.kernel_table
    assert EMU.unregister(mem.registered_address_of(mem.host_va), pd.as_device(DEV)) == 0
    try:
        with pytest.raises(errors.NotRegisteredError) as info:
            pd.make_kernel_ptr_table([rig.host.buffer], DEV)
        expect(info, errors.NotRegisteredError, "no emulated alias", "713")
        before = rig.dev_snap()
        with pytest.raises(errors.NotRegisteredError) as info:
            pd.transfer_kv_all_layer(table, rig.dev.table, rig.host_slots, rig.slots,
                                     src_layout=HOST_LAYOUT, dst_layout=DEV_LAYOUT)
        expect(info, errors.NotRegisteredError, "src table", "chunk 1/1", "unregistered outside pointerdomain",
               "found: no device alias", "expected: a registered range", "fix: unregister only through")
        assert rig.dev_unchanged(before)
    finally:
        rig.host.close()  # its own unregister now gets 713; close still completes
    with pd.register_host_tensor(mem.tensor, DEV):
        pass
    still_usable()


# ---------------------------------------------------------------- use after close


def test_launch_with_a_table_over_closed_memory(rig: Rig) -> None:
    rig.host.close()
    before = rig.dev_snap()
    with pytest.raises(errors.ClosedError) as info:
        rig.host.load(rig.dev, rig.host_slots, rig.slots)
    expect(info, errors.ClosedError, f"{rig.host.memory.host_va!r}", "was closed", "found a closed registration",
           "expected an open one", "fix:")
    assert rig.dev_unchanged(before)
    still_usable()


def test_building_a_table_over_closed_memory(rig: Rig) -> None:
    rig.host.close()
    with pytest.raises(errors.ClosedError) as info:
        pd.make_kernel_ptr_table([rig.dev.buffers[0], rig.host.buffer], DEV)
    expect(info, errors.ClosedError, "tensors[1]", "registration was closed", "found a closed registration",
           "expected an open one", "register the memory again")
    still_usable()


# ---------------------------------------------------------------- indices


def _launch(rig: Rig, src_idx: Any, dst_idx: Any, **kw: Any) -> None:
    pd.transfer_kv_all_layer(rig.dev.table, rig.host.kernel_table, src_idx, dst_idx,
                             src_layout=DEV_LAYOUT, dst_layout=HOST_LAYOUT, **kw)


@pytest.mark.parametrize(
    ("src_idx", "dst_idx", "needles"),
    [
        pytest.param(torch.tensor([0, 16]), torch.tensor([0, 1]),
                     ("src_indices", "slot 16 outside [0, 16)", "nothing was copied"), id="out-of-range"),
        pytest.param(torch.tensor([0, 1]), torch.tensor([2, -1]),
                     ("dst_indices", "slot -1 outside [0, 24)", "nothing was copied"), id="negative"),
        pytest.param(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]),
                     ("src_indices", "dtype torch.int32", "expected torch.int64"), id="wrong-dtype"),
        pytest.param(torch.tensor([0, 1]), torch.tensor([0, 1], device="meta"),
                     ("dst_indices", "on meta", "the launch runs on emulated:0", "indices must be on cpu"),
                     id="wrong-device"),
        pytest.param(torch.tensor([0, 1, 2]), torch.tensor([0, 1]),
                     ("src_indices has 3 slots but dst_indices has 2",), id="length-mismatch"),
        pytest.param(torch.tensor([[0, 1]]), torch.tensor([[0, 1]]),
                     ("src_indices", "shape (1, 2)", "expected 1-d"), id="2-d"),
        pytest.param(torch.tensor([0, 5, 1, 6])[::2], torch.tensor([0, 1]),
                     ("src_indices", "not contiguous"), id="strided"),
        pytest.param([0, 1], torch.tensor([0, 1]), ("src_indices", "expected an int64 tensor", "list"), id="list"),
    ],
)
def test_bad_indices(rig: Rig, src_idx: Any, dst_idx: Any, needles: tuple[str, ...]) -> None:
    """Wrong device: no CUDA tensor can be made here; a meta tensor is the meaningful
    stand-in (memory the launch device cannot read), and the check is the same
    device comparison a cuda:1 tensor meets on a cuda:0 launch."""
    before = snap(rig.host.buffer)
    with pytest.raises(errors.IndexValidationError) as info:
        _launch(rig, src_idx, dst_idx)
    expect(info, errors.IndexValidationError, *needles)
    assert unchanged(rig.host.buffer, before)
    assert rig.backup_ok()
    still_usable()


def test_layer_id_out_of_range(rig: Rig) -> None:
    before = rig.dev_snap()
    with pytest.raises(errors.IndexValidationError) as info:
        rig.host.load_layer(rig.dev, rig.host_slots, rig.slots, 2)
    expect(info, errors.IndexValidationError, "layer_id 2 outside [0, 2)")
    assert rig.dev_unchanged(before)
    still_usable()


def test_out_of_range_slots_unvalidated_are_skipped_by_the_kernel(rig: Rig) -> None:
    """validate_indices=False (what a replayed CUDA graph gets): no error, but the kernel skips
    every pair with a slot out of range, so nothing outside the tables is touched."""
    before = snap(rig.host.buffer)
    src = torch.tensor([1, 99, 2, -5, 3])
    dst = torch.tensor([4, 5, -1, 6, 400])
    _launch(rig, src, dst, validate_indices=False)
    expected = before.clone().view(HOST_LAYOUT.torch_dtype).view(HOST_LAYOUT.buffer_shape)
    for kv in range(2):
        for layer in range(2):
            expected[kv, 4, layer] = rig.dev.buffer(kv, layer)[1]
    assert torch.equal(snap(rig.host.buffer), snap(expected))
    still_usable()


# ---------------------------------------------------------------- registrations crossed


def test_tensor_spanning_two_chunks_of_one_registration() -> None:
    with pd.alloc_registered(2 * PAGE, DEV, granularity=PAGE, max_chunk_bytes=PAGE) as mem:
        with pytest.raises(errors.RegistrationSpanError) as info:
            pd.make_kernel_ptr_table([mem.tensor[PAGE - 64 : PAGE + 64]], DEV)
        expect(info, errors.RegistrationSpanError, "spans two registration chunks", "not contiguous",
               "granularity")
    still_usable()


def test_tensor_spanning_two_adjacent_registrations() -> None:
    t = host_buffer(2 * PAGE)
    with pd.register_host_tensor(t[:PAGE], DEV) as a, pd.register_host_tensor(t[PAGE:], DEV) as b:
        assert pd.resolve_alias(b.host_va, DEV) != pd.resolve_alias(a.host_va, DEV) + PAGE  # not contiguous
        with pytest.raises(errors.RegistrationSpanError) as info:
            pd.make_kernel_ptr_table([t[PAGE - 64 : PAGE + 64]], DEV)
        expect(info, errors.RegistrationSpanError, "tensors[0]", "runs past registration", f"{a.host_va!r}")
    still_usable()


def test_kv_page_block_straddling_a_chunk_boundary() -> None:
    """Registering with a granularity that is not a multiple of the page block cuts a KV
    page in two: the per-page-block table refuses the straddling entry."""
    layout = pd.KVLayout(kind="page_first", attention="mla", num_layers=3, num_pages=4, page_size=8,
                         num_heads=1, head_dim=256, dtype="uint8")
    block = layout.page_block_bytes()
    assert block % PAGE and block > PAGE
    with pd.alloc_registered(layout.nbytes, DEV, granularity=PAGE, max_chunk_bytes=PAGE) as mem:
        entries = [mem.tensor[i : i + block] for i in range(0, layout.nbytes, block)]
        with pytest.raises(errors.RegistrationSpanError) as info:
            pd.make_kernel_ptr_table(entries, DEV)
        expect(info, errors.RegistrationSpanError, "tensors[0]", "spans two registration chunks",
               "granularity that is a multiple of the buffer's page block")
    still_usable()


def test_checked_page_running_past_its_chunk() -> None:
    """checked: an entry shifted inside its chunk so that a touched page would cross the chunk end.
    The shifted entry is reported first as what it is, an overwritten table array
    (DomainError, as the checked module documents), not as a granularity problem."""
    r = Rig(seed=2, max_chunk_bytes=HOST_LAYOUT.page_block_bytes())
    try:
        table = r.host.kernel_table
        assert len(table) == HOST_LAYOUT.split_for_page_blocks()
        raw = table_storage(table)
        raw[1] = int(raw[1]) + 64
        before = snap(r.host.buffer)
        with pytest.raises(errors.DomainError) as info:
            r.host.backup(r.dev, r.slots, torch.tensor([4, 5, 6, 7]))
        expect(info, errors.DomainError, "checked mode", "dst table entry 1", "the kernel would read",
               "found: an address written into the table's uint64 tensor after it was built", "expected:", "fix:")
        assert unchanged(r.host.buffer, before)
        raw[1] = table[1].value
        assert r.backup_ok()
    finally:
        r.close()
    still_usable()


# ---------------------------------------------------------------- devices


def test_tables_of_two_devices_in_one_launch(rig: Rig) -> None:
    other = pd.DeviceKVPool(DEV_LAYOUT, DEV1)
    before = [snap(b) for b in other.buffers]
    with pytest.raises(errors.DeviceMismatchError) as info:  # (HostKVPool.load would use its table for emulated:1)
        pd.transfer_kv_all_layer(rig.host.kernel_table, other.table, rig.host_slots, rig.slots,
                                 src_layout=rig.host.layout, dst_layout=other.layout)
    expect(info, errors.DeviceMismatchError, "src table is for emulated:0", "dst table is for emulated:1")
    assert all(unchanged(b, s) for b, s in zip(other.buffers, before))
    still_usable()
    still_usable(DEV1)


def test_device_memory_of_another_device_in_a_table() -> None:
    mine = pd.device_empty((64,), torch.uint8, DEV)
    theirs = pd.device_empty((64,), torch.uint8, DEV1)
    with pytest.raises(errors.DeviceMismatchError) as info:
        pd.make_kernel_ptr_table([mine, theirs], DEV)
    expect(info, errors.DeviceMismatchError, "tensors[1]", "device memory of emulated:1", "table is for emulated:0")
    still_usable()


def test_checked_device_memory_of_another_device_written_into_a_table(rig: Rig) -> None:
    theirs = pd.device_empty(DEV_LAYOUT.buffer_shape, torch.bfloat16, DEV1)
    raw = table_storage(rig.dev.table)
    raw[2] = theirs.data_ptr()
    before = snap(theirs)
    with pytest.raises(errors.DeviceMismatchError) as info:
        rig.host.load(rig.dev, rig.host_slots, rig.slots)
    expect(info, errors.DeviceMismatchError, "checked mode", "dst table entry 2", "found: device memory of emulated:1",
           "expected: a DeviceAlias for emulated:0", "fix:")
    assert unchanged(theirs, before)
    raw[2] = rig.dev.table[2].value
    assert rig.backup_ok()
    still_usable()


_N_CUDA = torch.cuda.device_count() if torch.cuda.is_available() else 0  # the first ordinal that does not exist


@pytest.mark.parametrize(
    ("device", "needles"),
    [
        ("emulated:7", ("emulated:7 does not exist", "2 emulated device(s)")),
        (f"cuda:{_N_CUDA}", (f"cuda:{_N_CUDA} does not exist", f"{_N_CUDA} cuda device(s)")),
        ("bogus:0", ("cannot use 'bogus:0' as a device",)),
        ("emulated:-1", ("bad device ordinal",)),
    ],
)
def test_invalid_device_to_device_guard(device: str, needles: tuple[str, ...]) -> None:
    from pointerdomain.devices import current_device

    with pd.DeviceGuard(DEV1):
        with pytest.raises(errors.InvalidDeviceError) as info:
            pd.DeviceGuard(device)
        expect(info, errors.InvalidDeviceError, *needles)
        assert current_device("emulated") == pd.as_device(DEV1)
    assert current_device("emulated") == pd.as_device(DEV)
    still_usable()


# ---------------------------------------------------------------- address domains


def test_host_va_table_to_a_launch(rig: Rig) -> None:
    host_table = pd.host_ptr_table([rig.host.buffer])
    before = rig.dev_snap()
    with pytest.raises(errors.DomainError) as info:
        pd.transfer_kv_all_layer(host_table, rig.dev.table, rig.host_slots, rig.slots,  # type: ignore[arg-type]
                                 src_layout=HOST_LAYOUT, dst_layout=DEV_LAYOUT)
    expect(info, errors.DomainError, "src", "PointerTable[HostVA] reached a kernel launch",
           "kernels need PointerTable[DeviceAlias]", "make_kernel_ptr_table")
    assert rig.dev_unchanged(before)
    still_usable()


def test_raw_address_tensor_to_a_launch(rig: Rig) -> None:
    raw = torch.tensor([rig.host.memory.host_va.value], dtype=torch.uint64)
    before = rig.dev_snap()
    with pytest.raises(errors.DomainError) as info:
        pd.transfer_kv_all_layer(raw, rig.dev.table, rig.host_slots, rig.slots,  # type: ignore[arg-type]
                                 src_layout=HOST_LAYOUT, dst_layout=DEV_LAYOUT)
    expect(info, errors.DomainError, "src", "expected a PointerTable[DeviceAlias]", "Tensor")
    assert rig.dev_unchanged(before)
    still_usable()


def test_device_memory_to_host_ptr_table(rig: Rig) -> None:
    with pytest.raises(errors.DomainError) as info:
        pd.host_ptr_table([rig.host.buffer, rig.dev.buffers[1]])
    expect(info, errors.DomainError, "tensors[1]", "memory of emulated:0 is not host memory",
           "device addresses must never reach CPU code", "copy the data to host memory first")
    still_usable()


def test_device_memory_registered_as_host_memory() -> None:
    dev_mem = pd.device_empty((2 * PAGE,), torch.uint8, DEV1)
    with pytest.raises(errors.DomainError) as info:
        pd.register_host_tensor(dev_mem, DEV)
    expect(info, errors.DomainError, "device memory of emulated:1", "expected host memory", "fix:")
    assert memory.find_registration(HostVA(dev_mem.data_ptr()), dev_mem.numel()) is None
    still_usable()


def test_unregistered_host_memory_in_a_kernel_table() -> None:
    plain = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(errors.DomainError) as info:
        pd.make_kernel_ptr_table([plain], DEV)
    expect(info, errors.DomainError, "tensors[0]", "unregistered host memory", "(a HostVA)",
           "alloc_registered", "register_host_tensor")
    still_usable()


def test_kernel_table_to_metadata(rig: Rig) -> None:
    with pytest.raises(errors.DomainError) as info:
        pd.buffer_infos(rig.host.kernel_table, HOST_LAYOUT.item_bytes)  # type: ignore[arg-type]
    expect(info, errors.DomainError, "PointerTable[HostVA]", "got PointerTable[DeviceAlias]",
           "device aliases must never reach transfer engines")
    still_usable()


def test_checked_host_va_written_into_a_kernel_table(rig: Rig) -> None:
    """checked: the core fault, a host VA reaching a kernel (on MI355X/WSL2 it is not a device address)."""
    raw = table_storage(rig.host.kernel_table)
    raw[0] = rig.host.memory.host_va.value
    before = rig.dev_snap()
    with pytest.raises(errors.DomainError) as info:
        rig.host.load(rig.dev, rig.host_slots, rig.slots)
    expect(info, errors.DomainError, "checked mode", "src table entry 0", "found: a HostVA",
           f"registered at {rig.host.memory.host_va!r}", "expected: a DeviceAlias for emulated:0",
           "fix: build kernel tables only with make_kernel_ptr_table")
    assert rig.dev_unchanged(before)
    raw[0] = rig.host.kernel_table[0].value
    assert rig.backup_ok()
    still_usable()


def test_checked_interior_alias_that_lost_its_offset(rig: Rig) -> None:
    """checked: an interior pointer translated without its offset (the alias of the
    registration's start) is a valid address but the wrong one."""
    inner = rig.host.memory.tensor[HOST_LAYOUT.nbytes // 2 :]
    layout = HOST_LAYOUT.model_copy(update={"num_pages": 3})
    table = pd.make_kernel_ptr_table([inner[: layout.nbytes]], DEV)
    assert table[0] == pd.resolve_alias(rig.host.memory.host_va, DEV) + HOST_LAYOUT.nbytes // 2  # offset kept
    raw = table_storage(table)
    raw[0] = pd.resolve_alias(rig.host.memory.host_va, DEV).value
    before = rig.dev_snap()
    with pytest.raises(errors.DomainError) as info:
        pd.transfer_kv_all_layer(table, rig.dev.table, torch.tensor([0, 1]), torch.tensor([2, 3]),
                                 src_layout=layout, dst_layout=DEV_LAYOUT)
    expect(info, errors.DomainError, "checked mode", "src table entry 0", "the kernel would read",
           f"built with {table[0].value:#x}", "lost its interior offset", "fix:")
    assert rig.dev_unchanged(before)
    still_usable()


def test_checked_address_of_a_registration_the_table_does_not_hold(rig: Rig) -> None:
    with pd.alloc_registered(HOST_LAYOUT.nbytes, DEV) as stranger:
        raw = table_storage(rig.host.kernel_table)
        raw[0] = pd.resolve_alias(stranger.host_va, DEV).value
        before = snap(stranger.tensor)
        with pytest.raises(errors.DomainError) as info:
            rig.host.backup(rig.dev, rig.slots, rig.host_slots)
        expect(info, errors.DomainError, "checked mode", "dst table entry 0", "a registration this table does not hold",
               "can be closed under the launch", "expected: a DeviceAlias for emulated:0", "fix:")
        assert unchanged(stranger.tensor, before)
        raw[0] = rig.host.kernel_table[0].value
    still_usable()


def test_checked_unknown_address_in_a_table(rig: Rig) -> None:
    loose = torch.zeros(HOST_LAYOUT.nbytes, dtype=torch.uint8)
    raw = table_storage(rig.host.kernel_table)
    raw[0] = loose.data_ptr()
    with pytest.raises(errors.DomainError) as info:
        rig.host.backup(rig.dev, rig.slots, rig.host_slots)
    expect(info, errors.DomainError, "checked mode", "dst table entry 0", "no open registration and no device "
           "allocation", "expected: a DeviceAlias", "fix:")
    assert bool((loose == 0).all())
    raw[0] = rig.host.kernel_table[0].value
    still_usable()


def test_interior_pointer_keeps_its_offset_through_a_launch() -> None:
    """Made impossible: a table over an interior slice of registered memory holds the
    alias plus the same offset, so the kernel moves exactly that slice."""
    layout = pd.KVLayout(kind="layer_first", attention="mla", num_layers=1, num_pages=2, page_size=4,
                         num_heads=1, head_dim=32, dtype="uint8")
    with pd.alloc_registered(3 * PAGE, DEV, granularity=PAGE) as mem:
        fill_random(mem.tensor, 9)
        off = PAGE + 96
        inner = mem.tensor[off : off + layout.nbytes]
        table = pd.make_kernel_ptr_table([inner], DEV)
        assert table[0] == pd.resolve_alias(mem.host_va, DEV) + off
        dst = pd.device_empty(layout.buffer_shape, torch.uint8, DEV)
        dst.fill_(0)
        slots = torch.arange(layout.num_slots)
        pd.transfer_kv_all_layer(table, pd.make_kernel_ptr_table([dst], DEV), slots, slots,
                                 src_layout=layout, dst_layout=layout)
        assert torch.equal(dst.reshape(-1), inner)
    still_usable()


# ---------------------------------------------------------------- strided buffers


def _strided_pool_view() -> torch.Tensor:
    """A [2, 7286, 64, 8, 128]-like KV buffer, smaller, and a strided view of it
    (one head: what a tensor-parallel slice of a pool looks like)."""
    full = torch.zeros(2, 37, 4, 8, 16, dtype=torch.bfloat16)
    view = full[:, :, :, 3]
    assert not view.is_contiguous()
    return view


def test_strided_buffer_in_a_kernel_table() -> None:
    with pd.alloc_registered(2 * 37 * 4 * 8 * 16 * 2, DEV) as mem:
        view = mem.tensor.view(torch.bfloat16).view(2, 37, 4, 8, 16)[:, :, :, 3]
        with pytest.raises(errors.NonContiguousError) as info:
            pd.make_kernel_ptr_table([view], DEV)
        expect(info, errors.NonContiguousError, "tensors[0]", "shape (2, 37, 4, 16)", "not contiguous",
               "would be read as if packed", "contiguous base buffer")
    still_usable()


def test_strided_buffer_registered() -> None:
    view = _strided_pool_view()
    with pytest.raises(errors.NonContiguousError) as info:
        pd.register_host_tensor(view, DEV)
    expect(info, errors.NonContiguousError, "strided tensor", "stride", "register its contiguous base buffer")
    assert memory.find_registration(HostVA(view.data_ptr()), 16) is None
    still_usable()


def test_strided_buffer_in_a_host_table() -> None:
    with pytest.raises(errors.NonContiguousError) as info:
        pd.host_ptr_table([_strided_pool_view()])
    expect(info, errors.NonContiguousError, "tensors[0]", "not contiguous")
    still_usable()


# ---------------------------------------------------------------- lifetimes


@pytest.mark.slow
def test_table_keeps_its_memory_alive_after_the_caller_drops_it() -> None:
    layout = pd.KVLayout(kind="layer_first", attention="mla", num_layers=2, num_pages=2, page_size=4,
                         num_heads=1, head_dim=64, dtype="uint8")
    src = pd.device_empty(layout.buffer_shape, torch.uint8, DEV)
    fill_random(src, 11)
    expected = src.clone()
    mem = pd.alloc_registered(layout.nbytes, DEV)
    fill_random(mem.tensor, 12)
    src_table = pd.make_kernel_ptr_table([src], DEV)
    mid_table = pd.make_kernel_ptr_table([mem.tensor], DEV)
    del src, mem
    gc.collect()
    slots = torch.arange(layout.num_slots)
    pd.transfer_kv_all_layer(src_table, mid_table, slots, slots, src_layout=layout, dst_layout=layout)
    out = pd.device_empty(layout.buffer_shape, torch.uint8, DEV)
    out.fill_(0)
    del src_table
    gc.collect()
    pd.transfer_kv_all_layer(mid_table, pd.make_kernel_ptr_table([out], DEV), slots, slots,
                             src_layout=layout, dst_layout=layout)
    assert torch.equal(out, expected)
    still_usable()


# ---------------------------------------------------------------- layouts


def test_table_length_that_fits_no_split(rig: Rig) -> None:
    table = pd.make_kernel_ptr_table(rig.dev.buffers[:3], DEV)
    before = snap(rig.host.buffer)
    with pytest.raises(errors.LayoutError) as info:
        pd.transfer_kv_all_layer(table, rig.host.kernel_table, rig.slots, rig.host_slots,
                                 src_layout=DEV_LAYOUT, dst_layout=HOST_LAYOUT)
    expect(info, errors.LayoutError, "src", "table of 3 entries", "allowed lengths (1, 2, 4, 16)")
    assert unchanged(rig.host.buffer, before)
    still_usable()


def test_entry_smaller_than_the_layout_needs(rig: Rig) -> None:
    small = [b[: DEV_LAYOUT.num_slots - 1] for b in rig.dev.buffers]
    table = pd.make_kernel_ptr_table(small, DEV)
    before = snap(rig.host.buffer)
    with pytest.raises(errors.LayoutError) as info:
        pd.transfer_kv_all_layer(table, rig.host.kernel_table, rig.slots, rig.host_slots,
                                 src_layout=DEV_LAYOUT, dst_layout=HOST_LAYOUT)
    expect(info, errors.LayoutError, "src: entry 0 holds", "the kernel would read or write past the buffer")
    assert unchanged(rig.host.buffer, before)
    still_usable()


def test_layouts_of_different_models(rig: Rig) -> None:
    wrong = HOST_LAYOUT.model_copy(update={"head_dim": 8})
    before = snap(rig.host.buffer)
    with pytest.raises(errors.LayoutError) as info:
        pd.transfer_kv_all_layer(rig.dev.table, rig.host.kernel_table, rig.slots, rig.host_slots,
                                 src_layout=DEV_LAYOUT, dst_layout=wrong)
    expect(info, errors.LayoutError, "differ in head_dim", "16 vs 8")
    assert unchanged(rig.host.buffer, before)
    still_usable()


def test_checked_entry_past_the_end_of_its_device_allocation(rig: Rig) -> None:
    """checked: a device-memory entry moved so the last touched page would run past its allocation
    (the device pool's buffers are views of one allocation: its last entry); reported first
    as what it is, an overwritten table array (DomainError)."""
    raw = table_storage(rig.dev.table)
    last = len(rig.dev.table) - 1
    raw[last] = int(raw[last]) + 2
    before = snap(rig.host.buffer)
    with pytest.raises(errors.DomainError) as info:
        rig.host.backup(rig.dev, torch.tensor([15]), torch.tensor([0]))
    expect(info, errors.DomainError, "checked mode", f"src table entry {last}", "device memory of emulated:0",
           "found: an address written into the table's uint64 tensor after it was built", "fix:")
    assert unchanged(rig.host.buffer, before)
    raw[last] = rig.dev.table[last].value
    assert rig.backup_ok()
    still_usable()


@pytest.mark.slow
def test_checked_mode_is_off_by_default_and_switchable() -> None:
    env = {k: v for k, v in os.environ.items() if k != "POINTERDOMAIN_CHECKED"}
    code = "from pointerdomain import checked; print(checked.enabled())"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "False"
    env["POINTERDOMAIN_CHECKED"] = "1"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "True"
    with checked.checked_mode(False):
        assert not checked.enabled()
        with checked.checked_mode():
            assert checked.enabled()
        assert not checked.enabled()
    assert checked.enabled()


def test_writing_into_the_escape_hatch_copy_changes_nothing(rig: Rig) -> None:
    """as_uint64_tensor() is a copy: zeroing it (which segfaulted when it was the live
    array) leaves the table and the next launch intact."""
    raw = rig.host.kernel_table.as_uint64_tensor()
    raw.zero_()
    assert rig.host.kernel_table.as_uint64_tensor().tolist() == [a.value for a in rig.host.kernel_table]
    assert rig.backup_ok()
    still_usable()
