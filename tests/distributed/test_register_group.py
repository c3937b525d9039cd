"""pointerdomain.distributed.register_group on groups of 2, 3 and 4 processes (gloo on CPU,
emulated devices, driver refusals injected on one rank): every rank ends on the same
rung with byte-exact transfers, or every rank raises GroupRegistrationError naming the
rank and the cause with nothing left registered. The ranks run
tests/distributed/rank_worker.py: 4 processes started once (a start costs seconds), the
groups of 2 and 3 are subgroups of their first ranks (the ``group`` argument)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.distributed import GroupRegistrationError, group_report, last_outcome, register_group
from pointerdomain.distributed._cap import RungCap
from pointerdomain.testing import backend_for
from pointerdomain.tools import doctor
from tests.distributed import rank_worker
from tests.reference import DEV

THREE = ["agree", "chunked_refuse", "chunked_match", "pinned_copy_match", "unpinned_match", "fail", "bad_argument",
         "different_modes"]
PLAN = [(3, name) for name in THREE] + [(2, "chunked_match"), (2, "quarantine_refuse"), (4, "pinned_copy_match"),
                                        (4, "two_rungs_refuse"), (4, "two_rungs_match"), (4, "fail")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ranks")
    mp.start_processes(rank_worker.main, args=(4, str(out / "store"), PLAN, str(out)),  # type: ignore[attr-defined,no-untyped-call]
                       nprocs=4, start_method="spawn", join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(4)]


def _group(ranks: list[dict[str, Any]], size: int, name: str) -> list[dict[str, Any]]:
    return [{name: seen[f"{size}:{name}"]} for seen in ranks[:size]]


@pytest.fixture(scope="module")
def three(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{name: seen[f"3:{name}"] for name in THREE} for seen in ranks[:3]]


def _ok(results: list[dict[str, Any]], name: str, rung: str, rematched: list[int]) -> None:
    for seen in results:
        r = seen[name]
        assert "error" not in r, r
        assert r["ok"] and r["rung"] == rung and r["outcome_rung"] == rung, r
        assert r["record_rungs"] == [rung] * len(results) and r["record_ranks"] == list(range(len(results)))
        assert r["rematched"] == rematched and r["same_memory"] and r["backend"] == "gloo"
        assert r["bytes_ok"], f"rank {r['rank']}: the round trip differs from the torch reference"
        assert r["left_open"] == 0 and r["pinned_left"] == 0


def _refused(results: list[dict[str, Any]], name: str, ranks: list[int], *needles: str) -> None:
    messages = set()
    for seen in results:
        r = seen[name]
        assert r.get("error") in ("GroupRegistrationError", "InvalidArgumentError"), r
        assert r["runtime_error"] or r["error"] == "InvalidArgumentError"
        assert r["left_open"] == 0 and r["pinned_left"] == 0, r  # nothing stays registered
        assert r["last_ok"] is False
        if r["error"] == "GroupRegistrationError":
            assert r["ranks"] == ranks and sorted(int(k) for k in r["causes"]) == ranks, r
            messages.add(r["message"])
        for needle in needles:
            assert needle in r["message"] or r["error"] != "GroupRegistrationError", (needle, r["message"])
    assert len(messages) == 1, messages  # every rank says the same


def test_three_ranks_agree_on_single(three: list[dict[str, Any]]) -> None:
    _ok(three, "agree", "single", [])


def test_one_chunked_rank_is_refused_on_every_rank(three: list[dict[str, Any]]) -> None:
    _refused(three, "chunked_refuse", [1], "rank 1 (", ": chunked because single (1 call(s)", "different rungs",
             "on_mismatch='match'")


def test_one_chunked_rank_brings_the_others_down_to_chunked(three: list[dict[str, Any]]) -> None:
    _ok(three, "chunked_match", "chunked", [0, 1])
    chunks = {tuple(seen["chunked_match"]["chunks"]) for seen in three}
    assert len(chunks) == 1, chunks  # the same cuts on every rank
    sizes = chunks.pop()
    assert set(sizes) == {4 * rank_worker.BLOCK} and sum(sizes) == rank_worker.LAYOUT.nbytes
    for rank in (0, 1):
        assert "not tried: the process group registered on the 'chunked' rung" in \
            three[rank]["chunked_match"]["ladder_record"][0]


def test_one_pinned_copy_rank_brings_the_others_to_pinned_copy(three: list[dict[str, Any]]) -> None:
    _ok(three, "pinned_copy_match", "pinned_copy", [1, 2])


def test_one_unpinned_rank_brings_the_others_to_unpinned(three: list[dict[str, Any]]) -> None:
    _ok(three, "unpinned_match", "unpinned", [0, 2])  # bytes through the copy engine


def test_a_failed_rank_fails_every_rank(three: list[dict[str, Any]]) -> None:
    _refused(three, "fail", [2], "rank 2 (", "failed: RegistrationError", "error 801")
    assert three[2]["fail"]["cause"] == "RegistrationError"  # the rank's own error is chained


def test_a_bad_argument_on_one_rank_reaches_the_others(three: list[dict[str, Any]]) -> None:
    assert three[1]["bad_argument"]["error"] == "InvalidArgumentError"
    assert "on_mismatch: found 'degrade'" in three[1]["bad_argument"]["message"]
    for rank in (0, 2):
        assert three[rank]["bad_argument"]["error"] == "GroupRegistrationError"
    _refused(three, "bad_argument", [1], "rank 1 (", "InvalidArgumentError: on_mismatch")


def test_different_modes_are_refused(three: list[dict[str, Any]]) -> None:
    _refused(three, "different_modes", [1, 2], "different arguments", "rank 0 on_mismatch=match")


def test_groups_of_two_and_four(ranks: list[dict[str, Any]]) -> None:
    two = _group(ranks, 2, "chunked_match")
    _ok(two, "chunked_match", "chunked", [0])
    four = _group(ranks, 4, "pinned_copy_match")
    _ok(four, "pinned_copy_match", "pinned_copy", [1, 2, 3])
    _refused(_group(ranks, 4, "fail"), "fail", [3], "rank 3 (", "error 801")


def test_two_ranks_on_two_lower_rungs(ranks: list[dict[str, Any]]) -> None:
    # rank 1 chunked, rank 3 pinned_copy: both named when refused; everyone on pinned_copy when matched
    _refused(_group(ranks, 4, "two_rungs_refuse"), "two_rungs_refuse", [1, 3], "rank 1 (", ": chunked because",
             "rank 3 (", ": pinned_copy because")
    _ok(_group(ranks, 4, "two_rungs_match"), "two_rungs_match", "pinned_copy", [0, 1, 2])


def test_a_close_that_fails_is_named_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """The group is refused; rank 0's close fails (an engine hook: its memory stays
    registered, quarantined): every rank raises the same error naming rank 0's kept memory,
    not "nothing stays registered"."""
    results = _group(ranks, 2, "quarantine_refuse")
    messages = {seen["quarantine_refuse"]["message"] for seen in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "Nothing stays registered" not in message
    assert "rank 0: QuarantinedError" in message and "stays registered" in message
    for seen in results:
        r = seen["quarantine_refuse"]
        assert r["error"] == "GroupRegistrationError" and 0 in r["ranks"] and "close failed" in r["causes"]["0"], r


def test_a_rank_outside_the_group_is_refused_before_any_collective(ranks: list[dict[str, Any]]) -> None:
    assert ranks[3]["non_member"].startswith("InvalidArgumentError: group: this rank (3) is not a member")


def test_doctor_inside_a_rank_reports_the_group(ranks: list[dict[str, Any]]) -> None:
    doctor = ranks[0]["doctor"]  # the last register_group of rank 0: the group of 4 that failed
    assert doctor["rank"] == 0 and doctor["world_size"] == 4 and doctor["backend"] == "gloo"
    outcome = doctor["registration"]
    assert outcome["ok"] is False and outcome["rung"] == "" and "rank 3 (" in outcome["error"]
    assert [r["rank"] for r in outcome["records"]] == [0, 1, 2, 3] and outcome["world_size"] == 4
    assert [bool(r["error"]) for r in outcome["records"]] == [False, False, False, True]


# in this process: no group, a group of one, and the rung cap ---------------------------------
def test_without_a_process_group() -> None:
    assert not dist.is_initialized() and group_report() is None and doctor.group_row() is None
    with pytest.raises(errors.InvalidArgumentError, match="init_process_group"):
        register_group(lambda p: pd.alloc_registered(4096, DEV, policy=p))


@pytest.fixture
def group_of_one(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_group_of_one(group_of_one: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.group_row() == {"rank": 0, "world_size": 1, "backend": "gloo", "registration": None}
    reg = register_group(lambda p: pd.alloc_registered(8192, DEV, policy=p))
    report = doctor.collect([DEV])
    assert report["distributed"]["registration"]["rung"] == "single" and report["ok"]
    doctor.render_text(report)
    text = capsys.readouterr().out
    group = text[text.index("Process group"):]
    assert "this rank" in group and "0 of 1" in group and "backend gloo" in group
    assert "registration" in group and "rank 0" in group and "single" in group
    with reg.value as mem:
        assert reg.memory is mem and mem.rung is pd.Rung.SINGLE and reg.outcome.ok and reg.outcome.world_size == 1
        assert last_outcome() is reg.outcome and group_report() == {
            "rank": 0, "world_size": 1, "backend": "gloo", "registration": reg.outcome.as_dict()}
        json.dumps(group_report())  # JSON-ready
    for bad, kind in ((42, errors.InvalidTypeError),):
        with pytest.raises(kind, match="callable"):
            register_group(bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidTypeError, match="ProcessGroup"):
        register_group(lambda p: pd.alloc_registered(4096, DEV, policy=p), group="world")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidTypeError, match="RegistrationPolicy"):
        register_group(lambda p: pd.alloc_registered(4096, DEV, policy=p), policy="degrade")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="'refuse' or 'match'"):
        register_group(lambda p: pd.alloc_registered(4096, DEV, policy=p), on_mismatch=True)  # type: ignore[arg-type]
    with pytest.raises(GroupRegistrationError, match="expected a RegisteredHostMemory") as info:
        register_group(lambda p: torch.zeros(4))
    assert info.value.ranks == (0,) and isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, errors.InvalidTypeError)


def test_a_closed_registration_fails_the_rank(group_of_one: None) -> None:
    # a registration closed before it is returned is not registered memory: no success
    layout = pd.KVLayout(kind="page_first", num_layers=2, num_pages=4, page_size=4, num_heads=2, head_dim=8)

    def closed_memory(p: pd.RegistrationPolicy) -> pd.RegisteredHostMemory:
        mem = pd.alloc_registered(4096, DEV, policy=p)
        mem.close()
        return mem

    def closed_pool(p: pd.RegistrationPolicy) -> pd.HostKVPool:
        pool = pd.HostKVPool(layout, DEV, policy=p)
        pool.close()
        return pool

    for register in (closed_memory, closed_pool):
        with pytest.raises(GroupRegistrationError, match="ClosedError") as info:
            register_group(register)
        assert info.value.ranks == (0,) and isinstance(info.value.__cause__, errors.ClosedError)
    assert last_outcome() is None or last_outcome().ok is False  # type: ignore[union-attr]


def test_the_rung_cap_refuses_only_the_higher_rungs() -> None:
    inner = backend_for(DEV)
    buf = inner.host_alloc(8 * 4096)
    va = buf.data_ptr()
    chunked = RungCap(inner, pd.Rung.CHUNKED, 2 * 4096)
    assert chunked.register(va, 8 * 4096, DEV) == 801 and "'chunked' rung" in chunked.describe(801)
    assert chunked.register(va, 2 * 4096, DEV) == 0 and chunked.unregister(va, DEV) == 0
    pinned = RungCap(inner, pd.Rung.PINNED_COPY, 2 * 4096)
    assert pinned.register(va, 4096, DEV) == 801
    status, memory = pinned.pinned_alloc(4096, DEV)
    assert status == 0 and memory is not None
    pinned.pinned_release(memory.data_ptr(), DEV)
    unpinned = RungCap(inner, pd.Rung.UNPINNED, 2 * 4096)
    assert unpinned.register(va, 4096, DEV) == 801 and unpinned.pinned_alloc(4096, DEV) == (801, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RungCap(inner, pd.Rung.SINGLE, 1).register(va, 8 * 4096, DEV) == 0
    assert inner.unregister(va, DEV) == 0
