""":func:`register_group`: register on every rank, gather what each got, agree on one outcome."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pointerdomain.arguments import describe
from pointerdomain._platform import backend_for, scoped_backend
from pointerdomain.distributed._cap import RungCap
from pointerdomain.distributed._records import GroupOutcome, OnMismatch, RankRecord, level, rung_of_level
from pointerdomain.errors import (
    GroupRegistrationError,
    InvalidArgumentError,
    InvalidTypeError,
    PointerDomainError,
)
from pointerdomain.registration.ladder import RegistrationPolicy, Rung, resolve_policy
from pointerdomain.registration.memory import RegisteredHostMemory

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["GroupRegistration", "last_outcome", "register_group"]

T = TypeVar("T")

_lock = threading.Lock()
_last: GroupOutcome | None = None


@dataclass(frozen=True, slots=True)
class GroupRegistration(Generic[T]):
    """This rank's registration and the outcome the group agreed on.

    Attributes:
        value: what ``register`` returned on this rank (after any re-registration).
        memory: its :class:`~pointerdomain.RegisteredHostMemory`.
        outcome: the group's :class:`GroupOutcome` (``ok`` is True here).
    """

    value: T
    memory: RegisteredHostMemory
    outcome: GroupOutcome


def last_outcome() -> GroupOutcome | None:
    """The outcome of the latest :func:`register_group` in this process (refusals included),
    or None before the first (what ``pointerdomain doctor`` reports)."""
    return _last


def _set_last(outcome: GroupOutcome) -> None:
    global _last
    with _lock:
        _last = outcome


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(
            "register_group: torch.distributed has no process group (found none initialised, expected one). Fix: "
            "call torch.distributed.init_process_group(...) on every rank first"
        )
    return dist


def _memory_of(value: object) -> RegisteredHostMemory:
    memory = value if isinstance(value, RegisteredHostMemory) else getattr(value, "memory", None)
    if isinstance(memory, RegisteredHostMemory):
        # a closed registration has no rung to agree on: reported as a failure of this rank
        memory.check_open()
        return memory
    raise InvalidTypeError(
        f"register: returned a {type(value).__name__}, expected a RegisteredHostMemory or an object whose .memory "
        "is one (HostKVPool). Fix: return what alloc_registered / register_host_tensor / HostKVPool gave"
    )


def _close(value: object) -> str:
    """Close ``value`` (a registration or a pool): "" or why it could not be closed."""
    close = getattr(value, "close", None)
    if close is None:
        return ""
    try:
        close()
    except PointerDomainError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _record(rank: int, memory: RegisteredHostMemory | None, error: BaseException | None, on_mismatch: object,
            policy: object) -> RankRecord:
    base = RankRecord(rank=rank, host=socket.gethostname(),
                      on_mismatch=on_mismatch if isinstance(on_mismatch, str) else repr(on_mismatch),
                      policy=repr(policy))
    if error is not None or memory is None:
        text = f"{type(error).__name__}: {error}" if error is not None else "no registration"
        return replace(base, error=text[:2000])
    return replace(base, device=str(memory.device), rung=memory.rung.value, nbytes=memory.nbytes,
                   chunks=len(memory.chunks), ladder_record=memory.ladder_record)


def _gather(dist: Any, record: RankRecord, group: ProcessGroup | None) -> tuple[RankRecord, ...]:
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, record, group=group)
    return tuple(r for r in out if isinstance(r, RankRecord))


def _disagreement(records: tuple[RankRecord, ...]) -> tuple[str, tuple[int, ...], dict[int, str]] | None:
    """Why the group cannot be accepted as it is, apart from a rung mismatch: (message,
    ranks, causes), or None."""
    failed = [r for r in records if r.error]
    if failed:
        causes = {r.rank: r.error for r in failed}
        return ("could not register on " + "; ".join(r.describe() for r in failed), tuple(causes), causes)
    first = records[0]
    odd = [r for r in records if (r.on_mismatch, r.policy) != (first.on_mismatch, first.policy)]
    if odd:
        causes = {r.rank: f"on_mismatch={r.on_mismatch}, policy={r.policy}" for r in odd}
        return (f"the ranks were called with different arguments: rank {first.rank} on_mismatch={first.on_mismatch}, "
                f"policy={first.policy}; " + "; ".join(f"rank {k}: {v}" for k, v in causes.items()),
                tuple(causes), causes)
    return None


def _fail(dist: Any, records: tuple[RankRecord, ...], message: str, ranks: tuple[int, ...], causes: dict[int, str],
          on_mismatch: str, group: ProcessGroup | None, value: object) -> GroupRegistrationError:
    """Close this rank's registration and build the error every rank raises (every rank
    calls this at the same point, so the ranks exchange how their closes went)."""
    why = _close(value) if value is not None else ""
    closes: list[object] = [None] * len(records)
    dist.all_gather_object(closes, (dist.get_rank(group), why), group=group)
    kept = {rank: reason for rank, reason in (c for c in closes if isinstance(c, tuple)) if reason}
    if kept:
        # a close that failed (an engine kept the memory: quarantined) leaves that memory registered
        held = "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(kept.items()))
        stays = (f"Every rank closed its registration, except where the close failed and the memory stays "
                 f"registered (quarantined, `pointerdomain doctor` lists it): {held}")
        causes = {**causes, **{rank: f"{causes[rank]}; close failed: {reason}" if rank in causes
                               else f"close failed: {reason}" for rank, reason in kept.items()}}
        ranks = tuple(sorted({*ranks, *kept}))
    else:
        stays = "Nothing stays registered on any rank"
    text = (f"register_group: the {len(records)} ranks reached no common registration outcome: {message}. {stays}. "
            "Fix: see the ranks' causes above (pointerdomain doctor on those hosts), or pass on_mismatch='match' to "
            "re-register every rank down to the lowest rung")
    _set_last(GroupOutcome(ok=False, rung="", on_mismatch=on_mismatch, records=records, error=text,
                           backend=str(dist.get_backend(group)), world_size=len(records)))
    return GroupRegistrationError(text, tuple(sorted(ranks)), causes)


def register_group(
    register: Callable[[RegistrationPolicy], T],
    *,
    policy: RegistrationPolicy | None = None,
    on_mismatch: OnMismatch = "refuse",
    group: ProcessGroup | None = None,
) -> GroupRegistration[T]:
    """Register on every rank of ``group`` and agree on one outcome: every rank on the
    same rung of the registration ladder, or the same typed error on every rank.

    Collective: every rank of ``group`` must call it, with the same ``policy`` and
    ``on_mismatch``. Each rank calls ``register(policy)``, then the ranks exchange what
    they got (``all_gather_object``: a record of ints and strings per rank). Then:

    * a rank failed to register (or was called with other arguments): every rank closes
      its registration and raises :class:`~pointerdomain.errors.GroupRegistrationError`
      naming the failed ranks and their causes;
    * every rank is on the same rung (``single`` and ``foreign`` count as one): done;
    * ranks differ and ``on_mismatch="refuse"``: every rank closes and raises, naming
      the ranks below the best rung and why their ladder went down;
    * ranks differ and ``on_mismatch="match"``: each rank above the lowest rung closes its
      registration and calls ``register(policy)`` again with the calls of the higher rungs
      refused (in this thread only), so it lands on the lowest rung; the ranks exchange
      records again and raise as above if any still differs.

    A group whose ranks run on different rungs runs at its slowest rank's speed (an
    ``unpinned`` rank goes through the copy engine only); this makes that a decision.

    Args:
        register: ``policy -> registration``: returns an open
            :class:`~pointerdomain.RegisteredHostMemory` or an object whose ``.memory`` is one
            (:class:`~pointerdomain.HostKVPool`; a closed one fails the rank), e.g. ``lambda p: pd.HostKVPool(layout,
            device, policy=p)``. Called once, or twice on a rank that re-registers (it must
            allocate anew; its first result is closed first).
        policy: passed to ``register``; None: the process default
            (:func:`pointerdomain.ladder.default_policy`). With the default
            ``on_failure="fail"`` no rank degrades, so a refusal fails the group.
        on_mismatch: ``"refuse"`` (the default) or ``"match"``.
        group: the process group (None: the default group). Any backend: the records
            are Python objects (gloo on CPU; with NCCL the current CUDA device carries them).

    Returns:
        :class:`GroupRegistration`: this rank's registration and the group's
        :class:`GroupOutcome` (also kept for :func:`last_outcome`).

    Raises:
        GroupRegistrationError: (a ``RegistrationError``, a ``RuntimeError``) on every rank
            when the ranks reach no common outcome; ``ranks`` and ``causes`` say which and why.
        InvalidArgumentError: torch.distributed has no process group, or this rank is not in
            ``group`` (on this rank, before any collective).
        InvalidTypeError: ``register`` is not callable or ``group`` not a ProcessGroup
            (before any collective). A bad ``policy`` or ``on_mismatch`` on one rank is
            sent to the others first (they raise GroupRegistrationError, so none waits
            forever), then raised on that rank: InvalidTypeError for a policy that is not a
            RegistrationPolicy, InvalidArgumentError for an ``on_mismatch`` other than
            "refuse" or "match".
    """
    dist = _dist()
    if not callable(register):
        raise InvalidTypeError(f"register: found a {type(register).__name__}, expected a callable policy -> "
                               "registration. Fix: pass lambda p: pointerdomain.HostKVPool(layout, device, policy=p)")
    if group is not None and (group is dist.GroupMember.NON_GROUP_MEMBER or (
            isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0)):
        raise InvalidArgumentError(f"group: this rank ({dist.get_rank()}) is not a member of it, expected a group "
                                   "this rank belongs to. Fix: call register_group on the group's ranks only")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InvalidTypeError(f"group: found a {type(group).__name__}, expected a torch.distributed ProcessGroup "
                               "or None (the default group)")
    rank = dist.get_rank()
    received: object = on_mismatch  # checked at run time: a caller need not be type-checked
    mode = received if isinstance(received, str) else repr(received)
    argument_error: PointerDomainError | None = None
    resolved: RegistrationPolicy | None = None
    try:
        resolved = resolve_policy(policy)
        if on_mismatch not in ("refuse", "match"):
            raise InvalidArgumentError(f"on_mismatch: found {describe(on_mismatch)}, expected 'refuse' or 'match'")
    except PointerDomainError as exc:
        argument_error = exc
    value: T | None = None
    memory: RegisteredHostMemory | None = None
    error: BaseException | None = argument_error
    if resolved is not None and argument_error is None:
        try:
            value = register(resolved)
            memory = _memory_of(value)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, or they wait forever
            error = exc
    records = _gather(dist, _record(rank, memory, error, on_mismatch, policy), group)
    problem = _disagreement(records)
    if problem is not None:
        failure = _fail(dist, records, *problem, mode, group, value)
        if argument_error is not None:
            raise argument_error from failure
        raise failure from error
    assert memory is not None and value is not None and resolved is not None
    lowest = max(level(Rung(r.rung)) for r in records)
    rematched: tuple[int, ...] = ()
    if any(level(Rung(r.rung)) != lowest for r in records):
        best = min(level(Rung(r.rung)) for r in records)
        below = [r for r in records if level(Rung(r.rung)) != best]
        if on_mismatch == "refuse":
            causes = {r.rank: r.describe() for r in below}
            message = ("the ranks registered on different rungs of the ladder (on_mismatch='refuse'): "
                       + "; ".join(r.describe() for r in records))
            raise _fail(dist, records, message, tuple(causes), causes, mode, group, value)
        value, memory, error, again = _rematch(register, resolved, value, memory, rung_of_level(lowest))
        records = _gather(dist, replace(_record(rank, memory, error, on_mismatch, policy), rematched=again), group)
        rematched = tuple(r.rank for r in records if r.rematched)
        problem = _disagreement(records)
        if problem is None and len({level(Rung(r.rung)) for r in records}) != 1:
            causes = {r.rank: r.describe() for r in records if level(Rung(r.rung)) != lowest}
            problem = ("after re-registering (on_mismatch='match') the ranks are still on different rungs: "
                       + "; ".join(r.describe() for r in records), tuple(causes), causes)
        if problem is not None:
            raise _fail(dist, records, *problem, mode, group, value) from error
    assert memory is not None and value is not None
    outcome = GroupOutcome(ok=True, rung=rung_of_level(lowest).value, on_mismatch=mode, records=records,
                           rematched=rematched, backend=str(dist.get_backend(group)), world_size=len(records))
    _set_last(outcome)
    return GroupRegistration(value, memory, outcome)


def _rematch(register: Callable[[RegistrationPolicy], T], policy: RegistrationPolicy, value: T,
             memory: RegisteredHostMemory, target: Rung,
             ) -> tuple[T | None, RegisteredHostMemory | None, BaseException | None, bool]:
    """Re-register on ``target`` when this rank is above it: (value, memory, error, whether
    it re-registered)."""
    if level(memory.rung) == level(target):
        return value, memory, None, False
    device = memory.device
    why = _close(value)
    if why:
        return None, None, InvalidArgumentError(f"could not close the first registration to re-register: {why}"), True
    cap = RungCap(backend_for(device), target, policy.chunk_bytes)
    try:
        with scoped_backend(device.type, cap):
            again = register(policy)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
        return None, None, exc, True
    try:
        return again, _memory_of(again), None, True
    except PointerDomainError as exc:
        return again, None, exc, True
