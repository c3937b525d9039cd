"""One rank of the register_group tests (tests/distributed/test_register_group.py):
started with ``torch.multiprocessing`` (spawn), joins a gloo group of 4 through a
FileStore, makes subgroups of its first 2 and 3 ranks, runs the planned scenarios in
order (each on a group of the planned size; the ranks outside it wait) and writes what
it saw to ``<out>/<rank>.json``.

A scenario injects driver refusals on one rank (pointerdomain.testing.DriverFaults on
that rank's emulated backend), calls register_group over a HostKVPool on every rank,
and records the outcome. A rank that got a pool copies random device pages into it and
back through its aliases (or the copy engine for ``unpinned``) and compares the bytes
with the torch reference (tests/reference.py)."""

from __future__ import annotations

import datetime
import json
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.distributed import last_outcome, register_group
from pointerdomain.registration.memory import open_registrations
from pointerdomain.testing import NOT_SUPPORTED, DriverFaults, backend_for, install_backend
from tests.reference import fill_pool, fill_random, model_layout, pool_bytes, reference_transfer

LAYOUT = model_layout("page_first", 16)
BLOCK = LAYOUT.page_block_bytes()
DEGRADE = {"on_failure": "degrade", "chunk_bytes": 4 * BLOCK}

CAP = {"per_call_cap": 4 * BLOCK}  # one registration call of the whole pool is refused: the chunked rung
REFUSE = {"refuse_all": NOT_SUPPORTED}  # every registration call is refused: pinned_copy

#: name -> ({rank with faults (-1: the last): DriverFaults arguments}, RegistrationPolicy arguments, on_mismatch)
SCENARIOS: dict[str, tuple[dict[int, dict[str, Any]], dict[str, Any] | None, str]] = {
    "agree": ({}, None, "refuse"),
    "chunked_refuse": ({1: CAP}, DEGRADE, "refuse"),
    "chunked_match": ({-1: CAP}, DEGRADE, "match"),
    "pinned_copy_match": ({0: REFUSE}, DEGRADE, "match"),
    "unpinned_match": ({1: dict(REFUSE, refuse_pinned_alloc=2)}, dict(DEGRADE, allow_unpinned=True), "match"),
    "fail": ({-1: REFUSE}, None, "match"),
    "bad_argument": ({1: {}}, None, "degrade"),  # rank 1 alone passes an invalid on_mismatch
    "different_modes": ({0: {}}, None, "match"),  # rank 0 alone says "match", the others "refuse"
    "two_rungs_refuse": ({1: CAP, -1: REFUSE}, DEGRADE, "refuse"),
    "two_rungs_match": ({1: CAP, -1: REFUSE}, DEGRADE, "match"),
    # rank 1 chunked, so the group is refused; rank 0's pool has an engine hook that fails at close
    "quarantine_refuse": ({1: CAP}, DEGRADE, "refuse"),
}


def _failing_engine_hook() -> None:
    raise RuntimeError("the engine kept the memory")


def _pool(name: str, rank: int, device: pd.Device) -> Any:
    """The rank's register function: a host pool (rank 0's with a failing close hook in
    the quarantine scenario)."""
    def register(policy: Any) -> pd.HostKVPool:
        pool = pd.HostKVPool(LAYOUT, device, policy=policy)
        if name == "quarantine_refuse" and rank == 0:
            pool.add_close_hook(_failing_engine_hook)
        return pool

    return register


def _roundtrip(host: pd.HostKVPool, device: pd.Device, seed: int) -> bool:
    """Device pages -> host pool -> another device pool, compared with the reference."""
    dev_layout = LAYOUT.replace(kind="layer_first")
    src = pd.DeviceKVPool(dev_layout, device)
    fill_pool(src, seed)
    fill_random(host.buffer, seed + 100)
    before = host.buffer.view(torch.uint8).reshape(-1).clone()
    s = torch.tensor([0, 5, 17, 63, 30], device=device.torch_device)
    d = torch.tensor([9, 62, 1, 40, 33], device=device.torch_device)
    expected = reference_transfer(pool_bytes(src), dev_layout, before, LAYOUT, s, d)
    host.backup(src, s, d)
    back = pd.DeviceKVPool(dev_layout, device)
    fill_pool(back, seed + 200)
    back_before = pool_bytes(back).clone()
    back_expected = reference_transfer(expected, LAYOUT, back_before, dev_layout, d, s)
    host.load(back, d, s)
    return bool(torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)
                and torch.equal(pool_bytes(back), back_expected))


def _scenario(name: str, rank: int, world: int, device: pd.Device, group: Any) -> dict[str, Any]:
    faulty, policy_args, mode = SCENARIOS[name]
    mine = {r % world: args for r, args in faulty.items()}.get(rank)
    if name in ("bad_argument", "different_modes") and mine is None:
        mode = "refuse"
    policy = None if policy_args is None else pd.RegistrationPolicy(**policy_args)
    faults = DriverFaults(backend_for(device), **mine) if mine else None
    open_before = len(open_registrations())
    seen: dict[str, Any] = {"rank": rank}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if faults is not None:
                with install_backend(faults, device.type):
                    reg = register_group(_pool(name, rank, device), policy=policy, on_mismatch=mode,
                                         group=group)  # type: ignore[arg-type]
            else:
                reg = register_group(_pool(name, rank, device), policy=policy, on_mismatch=mode,
                                     group=group)  # type: ignore[arg-type]
        except errors.PointerDomainError as exc:
            seen.update(error=type(exc).__name__, message=str(exc), runtime_error=isinstance(exc, RuntimeError),
                        ranks=list(getattr(exc, "ranks", [])), causes={str(k): v for k, v in getattr(exc, "causes", {}).items()},
                        cause=type(exc.__cause__).__name__ if exc.__cause__ else "",
                        left_open=len(open_registrations()) - open_before,
                        pinned_left=faults.pinned_bytes() if faults is not None else 0)
            last = last_outcome()
            seen["last_ok"] = None if last is None else last.ok
            return seen
        with reg.value as host:
            seen.update(rung=host.memory.rung.value, outcome_rung=reg.outcome.rung, ok=reg.outcome.ok,
                        rematched=list(reg.outcome.rematched), record_rungs=[r.rung for r in reg.outcome.records],
                        record_ranks=[r.rank for r in reg.outcome.records], chunks=[c.nbytes for c in host.memory.chunks],
                        ladder_record=list(host.memory.ladder_record), backend=reg.outcome.backend,
                        same_memory=reg.memory is host.memory, bytes_ok=_roundtrip(host, device, 10 * rank + 1))
        seen["left_open"] = len(open_registrations()) - open_before
        seen["pinned_left"] = faults.pinned_bytes() if faults is not None else 0
    return seen


def main(rank: int, world: int, store: str, plan: list[tuple[int, str]], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    groups = {n: dist.new_group(list(range(n))) for n in range(2, world)}  # collective: every rank makes each
    groups[world] = None  # the default group
    device = pd.Device("emulated", rank % 2)
    results: dict[str, Any] = {}
    try:
        for size, name in plan:
            if rank < size:
                results[f"{size}:{name}"] = _scenario(name, rank, size, device, groups[size])
            dist.barrier()
        if rank == world - 1:  # not a member of the group of 2: refused here, before any collective
            try:
                register_group(lambda p: pd.HostKVPool(LAYOUT, device, policy=p), group=groups[2])
            except errors.PointerDomainError as exc:
                results["non_member"] = f"{type(exc).__name__}: {exc}"
        if rank == 0:
            from pointerdomain.tools.doctor import collect

            results["doctor"] = collect([device]).get("distributed")
    finally:
        dist.destroy_process_group()
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(results, f)
