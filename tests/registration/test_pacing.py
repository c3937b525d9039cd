"""Fast registration that bounds one driver call (pointerdomain.registration.pacing) and the
prefault before it (pointerdomain.registration.prefault), on the emulated backend with a
register call made slow on purpose (time proportional to the bytes, as faulting and
pinning are)."""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import Backend, DelegatingBackend, DriverFaults, backend_for, install_backend
from pointerdomain.devices import Device
from pointerdomain.registration import memory, pacing, prefault
from tests.reference import DEV, fill_random

PAGE = 4096
MIB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowRegister(DelegatingBackend):
    """Each register call takes ``overhead + nbytes * seconds_per_byte``: on ``clock`` (a
    FakeClock, advanced) or for real (slept)."""

    def __init__(self, inner: Backend, seconds_per_mib: float, overhead: float = 0.0,
                 clock: FakeClock | None = None) -> None:
        super().__init__(inner, "slow")
        self.per_byte, self.overhead, self.clock = seconds_per_mib / MIB, overhead, clock
        self.calls: list[int] = []

    def register(self, va: int, nbytes: int, device: Device) -> int:
        self.calls.append(nbytes)
        cost = self.overhead + nbytes * self.per_byte
        if self.clock is not None:
            self.clock.now += cost
        else:
            time.sleep(cost)
        return super().register(va, nbytes, device)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(pacing, "CLOCK", fake)
    yield fake


def bytes_through_aliases(mem: pd.RegisteredHostMemory) -> None:
    fill_random(mem.tensor, 5)
    for off in (0, 1, mem.nbytes // 3, mem.nbytes - 16):
        alias = pd.resolve_alias(mem.host_va + off, DEV)
        assert ctypes.string_at(alias.value, 16) == bytes(mem.tensor[off:off + 16].tolist())


def test_the_bound_holds_for_every_call(clock: FakeClock) -> None:
    # 64 MiB at 10 ms/MiB: one call would hold the "driver" 640 ms; the bound is 40 ms
    bound = 0.040
    slow = SlowRegister(backend_for(DEV), 0.010, overhead=0.0005, clock=clock)
    policy = pd.RegistrationPolicy(max_call_seconds=bound)
    with install_backend(slow, "emulated"), pd.alloc_registered(64 * MIB, DEV, policy=policy) as mem:
        durations = [0.0005 + n * 0.010 / MIB for n in slow.calls]
        assert max(durations) <= bound and mem.stats.longest_call_s == pytest.approx(max(durations))
        assert len(slow.calls) >= 640 / 40  # at least as many calls as the bound forces
        assert slow.calls[0] == 64 * MIB // 64  # the probe: 1/64 of the range
        assert sum(slow.calls) == mem.nbytes and [c.nbytes for c in mem.chunks] == slow.calls
        assert all(n % PAGE == 0 for n in slow.calls)
        assert mem.rung is pd.Rung.SINGLE and mem.ladder_record == ()  # the caller's own cuts: no degradation
        assert mem.stats.calls == len(slow.calls) and mem.stats.max_call_seconds == bound
        assert mem.stats.seconds_per_gib == pytest.approx(sum(durations) / (64 / 1024))
        bytes_through_aliases(mem)
    # without a bound: one call of the whole range, 16x the bound
    slow.calls.clear()
    with install_backend(slow, "emulated"), pd.alloc_registered(64 * MIB, DEV) as mem:
        assert slow.calls == [64 * MIB] and mem.stats.longest_call_s == pytest.approx(0.6405)


def test_calls_shrink_when_the_memory_gets_slower(clock: FakeClock) -> None:
    class Slower(SlowRegister):
        def register(self, va: int, nbytes: int, device: Device) -> int:
            if sum(self.calls) >= 16 * MIB:
                self.per_byte = 0.012 / MIB  # the second half faults slower (e.g. another NUMA node)
            return super().register(va, nbytes, device)

    bound = 0.040
    slow = Slower(backend_for(DEV), 0.010, clock=clock)
    with install_backend(slow, "emulated"), pd.alloc_registered(
            32 * MIB, DEV, policy=pd.RegistrationPolicy(max_call_seconds=bound)) as mem:
        # a rate 20% worse than the call before: still within the bound (3/4 target)
        assert mem.stats.longest_call_s <= bound
        assert sum(c.nbytes for c in mem.chunks) == 32 * MIB


def test_granularity_and_max_chunk_bytes_still_cut(clock: FakeClock) -> None:
    block = 3 * PAGE  # a page block that is not a power of two
    slow = SlowRegister(backend_for(DEV), 0.010, clock=clock)
    policy = pd.RegistrationPolicy(max_call_seconds=10.0)  # a loose bound: max_chunk_bytes decides
    with install_backend(slow, "emulated"), pd.alloc_registered(
            300 * block, DEV, granularity=block, max_chunk_bytes=64 * block, policy=policy) as mem:
        assert all(n % block == 0 for n in slow.calls[:-1]) and max(slow.calls) <= 64 * block
        assert sum(slow.calls) == 300 * block


def test_a_failing_paced_call_leaves_nothing_registered(clock: FakeClock) -> None:
    faults = DriverFaults(SlowRegister(backend_for(DEV), 0.010, clock=clock), fail_at={3: 2})
    with install_backend(faults, "emulated") as fb:
        with pytest.raises(errors.RegistrationError) as info:
            pd.alloc_registered(16 * MIB, DEV, policy=pd.RegistrationPolicy(max_call_seconds=0.02))
        assert "chunk 3/" in str(info.value) and "the 2 chunk(s) before it were unregistered" in str(info.value)
        assert fb.pinned_bytes() == 0 and len(fb.register_calls) == 3


def test_real_sleeping_register_stays_near_the_bound() -> None:
    bound = 0.050
    slow = SlowRegister(backend_for(DEV), 0.020)  # 8 MiB would be one 160 ms call
    with install_backend(slow, "emulated"), pd.alloc_registered(
            8 * MIB, DEV, policy=pd.RegistrationPolicy(max_call_seconds=bound)) as mem:
        assert len(slow.calls) > 3
        assert mem.stats.longest_call_s < 1.6 * bound  # sleep overshoots on a loaded machine, never 3x
        assert mem.stats.call_seconds >= 0.16


# counters -------------------------------------------------------------------------------

def test_stats_and_counters_are_present_and_plausible() -> None:
    pacing.reset_registration_counters()
    policy = pd.RegistrationPolicy(prefault_threads=4, huge_pages="thp")
    with pd.alloc_registered(4 * MIB, DEV, policy=policy, max_chunk_bytes=MIB) as mem:
        st = mem.stats
        assert st.calls == len(mem.chunks) == 4 and 0 < st.longest_call_s <= st.call_seconds
        assert st.seconds_per_gib == pytest.approx(st.call_seconds / (4 / 1024))
        assert st.prefault.threads == 2 and st.prefault.method  # 4 MiB: two 2 MiB-aligned pieces in ("populate_write", "touch")
        assert st.prefault.huge_pages == "thp" and st.prefault.seconds > 0
        assert st.huge_page_share is None or 0.0 <= st.huge_page_share <= 1.0
        json = st.to_json()
        assert json["calls"] == 4 and isinstance(json["prefault"], dict)
    with pd.alloc_registered(2 * MIB, DEV) as second:
        assert second.stats.prefault.method == "none" and second.stats.prefault.threads == 0
    totals = pacing.registration_counters()
    assert totals["registrations"] == 2 and totals["calls"] == 5 and totals["bytes"] == 6 * MIB
    assert totals["call_seconds"] == pytest.approx(mem.stats.call_seconds + second.stats.call_seconds)
    assert totals["longest_call_s"] == max(mem.stats.longest_call_s, second.stats.longest_call_s)
    gib = 6 * MIB / (1 << 30)
    assert totals["seconds_per_gib"] == pytest.approx(totals["call_seconds"] / gib)  # type: ignore[operator]


# prefault ----------------------------------------------------------------------------------

@pytest.mark.parametrize("huge", ["off", "thp"])
def test_prefault_keeps_a_caller_tensors_bytes(huge: str) -> None:
    t = torch.empty(3 * MIB + 5 * PAGE, dtype=torch.uint8)[100:]  # mid-page start, odd length
    fill_random(t, 9)
    before = t.clone()
    policy = pd.RegistrationPolicy(prefault_threads=3, huge_pages=huge)  # type: ignore[arg-type]
    with pd.register_host_tensor(t, DEV, policy=policy) as mem:
        assert torch.equal(mem.tensor, before) and 1 <= mem.stats.prefault.threads <= 3
        bytes_through_aliases(mem)  # writes new bytes through the host VA, reads them through the alias
        after = mem.tensor.clone()
    assert torch.equal(t, after)  # the caller's view sees them: the same pages


def test_prefault_touch_fallback_keeps_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault, "_MADV_POPULATE_WRITE", 12345)  # an advice no kernel knows: EINVAL
    monkeypatch.setattr(prefault, "_SUPPORTED", [False])
    t = torch.empty(2 * MIB + 17, dtype=torch.uint8)
    fill_random(t, 4)
    before = t.clone()
    report = prefault.prefault(t, 4)
    assert report.method == "touch" and "MADV_POPULATE_WRITE unavailable" in report.note
    assert torch.equal(t, before)


def test_prefault_pieces_cover_the_range_once() -> None:
    pieces = prefault._pieces(0, 10 * PAGE, 3, PAGE)
    assert pieces[0][0] == 0 and pieces[-1][1] == 10 * PAGE
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])) and all(a % PAGE == 0 for a, _ in pieces)
    huge = prefault._pieces(0, 9 << 20, 4, 2 << 20)
    assert all(a % (2 << 20) == 0 for a, _ in huge) and huge[-1][1] == 9 << 20


def test_huge_page_share_of_unmapped_memory_is_none() -> None:
    assert prefault.huge_page_share(8, 8) is None  # no mapping at the zero page


# policy checks ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, needle", [
    ({"max_call_seconds": 0}, "max_call_seconds: found 0"),
    ({"max_call_seconds": math.nan}, "max_call_seconds: found nan"),
    ({"max_call_seconds": True}, "max_call_seconds: found True"),
    ({"max_call_seconds": "1"}, "max_call_seconds: found '1'"),
    ({"prefault_threads": -1}, "prefault_threads: found -1"),
    ({"prefault_threads": 2.0}, "prefault_threads: found 2.0"),
    ({"prefault_threads": 5000}, "prefault_threads: found 5000"),
    ({"huge_pages": "always"}, "huge_pages: found 'always'"),
])
def test_bad_policy_values_are_typed_errors(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(errors.InvalidRegistrationError, match=needle.replace("(", r"\(")) as info:
        pd.RegistrationPolicy(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_nothing_registered_after_a_refused_policy() -> None:
    before = len(memory.open_registrations())
    with pytest.raises(errors.InvalidRegistrationError):
        pd.alloc_registered(MIB, DEV, policy=pd.RegistrationPolicy(prefault_threads=-3))
    assert len(memory.open_registrations()) == before


def test_numa_local_prefaults_on_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from pointerdomain.registration import allocation

    bound: list[tuple[int, int, int]] = []
    monkeypatch.setattr(allocation, "node_count", lambda: 2)  # as on a two-socket host
    monkeypatch.setattr(allocation, "bind_to_node", lambda va, n, node: bound.append((va, n, node)) or "")
    seen: list[int | None] = []
    real = prefault.prefault

    def spy(t: torch.Tensor, threads: int, huge: str = "off", node: int | None = None) -> prefault.PrefaultReport:
        seen.append(node)
        return real(t, threads, huge, node)  # type: ignore[arg-type]

    monkeypatch.setattr(allocation, "prefault", spy)
    policy = pd.RegistrationPolicy(prefault_threads=2)
    with pd.alloc_registered(2 * MIB, DEV, numa="local", policy=policy) as mem:
        assert bound == [(mem.host_va.value, 2 * MIB, 0)] and seen == [0]  # bound first, then touched on node 0
        assert mem.stats.prefault.threads == 2  # the report of the node-bound prefault, not a second one
        bytes_through_aliases(mem)


def test_prefault_never_writes_a_read_only_mapping() -> None:
    import mmap as mm
    import warnings

    if not prefault.populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    ro = mm.mmap(-1, 2 * MIB, prot=mm.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        t = torch.frombuffer(ro, dtype=torch.uint8)
    report = prefault.prefault(t, 2)  # a write here would be a SIGSEGV, not an exception
    assert report.method == "populate_write" and "MADV_POPULATE_WRITE refused" in report.note
    assert int(t.sum()) == 0


# huge-page pool (hugetlbfs) ---------------------------------------------------------------

def test_hugetlbfs_where_the_pool_is_short_is_a_typed_refusal() -> None:
    free, total, size = prefault.hugetlb_pool()
    if free * size >= 4 * MIB:
        pytest.skip(f"this machine has {free} free huge pages: the pool is not short")
    before = len(memory.open_registrations())
    with pytest.raises(errors.OutOfMemoryError) as info:
        pd.alloc_registered(4 * MIB, DEV, policy=pd.RegistrationPolicy(huge_pages="hugetlbfs"))
    text = str(info.value)
    assert isinstance(info.value, MemoryError) and info.value.nbytes == 4 * MIB
    assert f"HugePages_Free: {free} (HugePages_Total: {total}" in text and "vm.nr_hugepages=" in text
    assert len(memory.open_registrations()) == before


def test_hugetlbfs_memory_registers_and_moves_bytes_where_the_pool_has_pages() -> None:
    free, _total, size = prefault.hugetlb_pool()
    if free * size < 4 * MIB:
        pytest.skip("no free huge pages here (HugePages_Free too small)")
    with pd.alloc_registered(4 * MIB, DEV, policy=pd.RegistrationPolicy(huge_pages="hugetlbfs")) as mem:
        assert mem.nbytes == 4 * MIB and mem.host_va.value % (2 << 20) == 0  # whole huge pages
        share = mem.stats.huge_page_share
        assert share is None or 0.0 <= share <= 1.0
        bytes_through_aliases(mem)


def test_hugetlbfs_is_refused_in_strict_alias_mode() -> None:
    with pd.strict_alias(True), pytest.raises(errors.InvalidRegistrationError, match="strict alias mode"):
        pd.alloc_registered(4 * MIB, DEV, policy=pd.RegistrationPolicy(huge_pages="hugetlbfs"))
