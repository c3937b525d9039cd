"""Shared segments (pointerdomain.registration.segments): two processes that map one memfd
each register their own mapping, and the host-wide ledger and the budget count it once."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pointerdomain as pd
from pointerdomain import env, errors
from pointerdomain.registration import budget, memory, segments
from tests.childenv import pythonpath
from tests.reference import DEV

MIB = 1 << 20


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(env.SEGMENT_DIR, str(tmp_path))
    yield tmp_path


def _memfd(nbytes: int) -> tuple[int, mmap.mmap, torch.Tensor]:
    fd = os.memfd_create("pd-test-pool")
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return fd, mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def test_segment_of_names_the_file_of_the_mapping(ledger: Path) -> None:
    fd, mapping, tensor = _memfd(4 * 4096)
    try:
        seg = segments.segment_of(tensor.data_ptr() + 4096, 2 * 4096)
        st = os.fstat(fd)
        assert seg is not None and seg.key == segments.SegmentKey(st.st_dev, st.st_ino) == segments.segment_of_fd(fd)
        assert seg.offset == 4096 and seg.nbytes == 2 * 4096 and "memfd:pd-test-pool" in seg.path
        private = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        assert segments.segment_of(torch.frombuffer(private, dtype=torch.uint8).data_ptr(), 8) is None
        emulated = pd.alloc_registered(4096, DEV)  # the library's own memfd: no segment
        assert segments.segment_of(emulated.host_va.value, 8) is None
        with pd.register_host_tensor(torch.frombuffer(private, dtype=torch.uint8), DEV) as mem:
            assert mem.segment is None and not list(ledger.iterdir())
        emulated.close()
        with pytest.raises(errors.InvalidArgumentError):
            segments.segment_of(tensor.data_ptr(), 0)
    finally:
        del tensor
        mapping.close()
        os.close(fd)


_CHILD = textwrap.dedent(
    """
    import json, mmap, os, sys, torch
    import pointerdomain as pd
    from pointerdomain.registration import segments
    fd, nbytes = int(sys.argv[1]), int(sys.argv[2])
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    seen = bytes(tensor[:16].tolist())  # the parent's bytes, through this process's own mapping
    with pd.register_host_tensor(tensor, "emulated:0") as mem:
        print(json.dumps({"va": mem.host_va.value, "seen": seen.hex(), "segment": str(mem.segment.key),
                          "entries": len(segments.ledger_entries(mem.segment.key))}), flush=True)
        sys.stdin.readline()  # hold the registration until the parent has looked
    print(json.dumps({"after": len(segments.ledger_entries(mem.segment.key))}), flush=True)
    """
)


def test_two_processes_one_memfd_counted_once(ledger: Path) -> None:
    nbytes = 4 * MIB
    fd, mapping, tensor = _memfd(nbytes)
    tensor[:16].copy_(torch.arange(16, dtype=torch.uint8))
    environ = dict(os.environ, PYTHONPATH=pythonpath())
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(fd), str(nbytes)], pass_fds=(fd,), env=environ,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else ""
        got = json.loads(line)
        key = segments.segment_of_fd(fd)
        assert got["seen"] == bytes(range(16)).hex() and got["segment"] == str(key) and got["entries"] == 1
        assert segments.segment_bytes(key) == nbytes
        base = budget.budget_for(DEV).pinned_bytes  # other tests' registrations (quarantined ones stay)
        with budget.simulated_host(wsl2=True, mem_total=16 * MIB + 2 * base, pins=True):
            before = budget.budget_for(DEV)
            assert before.shared_bytes == nbytes  # the child's registration, host-wide
            with pd.register_host_tensor(tensor, DEV) as mem:
                assert mem.host_va.value == tensor.data_ptr()  # each process keeps its own HostVA
                assert mem.segment is not None and mem.segment.key == key
                assert sorted(p for p, _o, _n in segments.ledger_entries(key)) == sorted([os.getpid(), child.pid])
                assert segments.segment_bytes(key) == nbytes  # two registrations, one pool
                assert any(f"shared segment {key}" in note for note in pd.explain(mem.host_va.value).notes)
                after = budget.budget_for(DEV)
                wddm = {lim.name: lim for lim in after.limits}["wddm"]
                # charged once: 8 MiB pool less the one 4 MiB segment, not 8 MiB
                assert wddm.room == 8 * MIB - nbytes and after.pinned_bytes == base + nbytes
                assert after.shared_bytes == 0
                # a second, private 4 MiB still fits once; the segment is not charged twice
                with pd.alloc_registered(3 * MIB, DEV):
                    with pytest.raises(errors.BudgetExceededError) as info:
                        pd.alloc_registered(2 * MIB, DEV)
                    assert info.value.limit == "wddm" and info.value.room == MIB
            assert [p for p, _o, _n in segments.ledger_entries(key)] == [child.pid]
        child.stdin.write("\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline()) == {"after": 0}
        assert child.wait(timeout=60) == 0
        assert segments.ledger_entries(key) == [] and not list(ledger.iterdir())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        del tensor
        mapping.close()
        os.close(fd)


def test_entries_of_a_dead_process_are_dropped(ledger: Path) -> None:
    key = segments.SegmentKey(1, 2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (ledger / str(key)).write_text(f"{int(dead.stdout)} 0 4096\n{os.getpid()} 4096 4096\n")
    assert segments.ledger_entries(key) == [(os.getpid(), 4096, 4096)]
    assert segments.segment_bytes(key) == 4096
