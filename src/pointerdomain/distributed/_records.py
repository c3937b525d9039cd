"""What each rank says about its registration, and what the group concluded: plain data
(ints and strings only), so it travels through ``all_gather_object`` and into JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pointerdomain.registration.ladder import Rung

__all__ = ["GroupOutcome", "OnMismatch", "RankRecord", "level", "rung_of_level"]

#: What the group does when its ranks registered on different rungs.
OnMismatch = Literal["refuse", "match"]

#: How far down the ladder a rung is, for comparing ranks: ``foreign`` memory is pinned by
#: another owner and as fast as ``single``; ``chunked`` differs from ``single`` in its cuts
#: only; ``pinned_copy`` is other memory; ``unpinned`` is readable by the copy engine only.
_LEVEL = {Rung.SINGLE: 0, Rung.FOREIGN: 0, Rung.CHUNKED: 1, Rung.PINNED_COPY: 2, Rung.UNPINNED: 3}
_BY_LEVEL = {0: Rung.SINGLE, 1: Rung.CHUNKED, 2: Rung.PINNED_COPY, 3: Rung.UNPINNED}


def level(rung: Rung) -> int:
    """0 (single, foreign) to 3 (unpinned): how far down the ladder ``rung`` is."""
    return _LEVEL[rung]


def rung_of_level(n: int) -> Rung:
    """The rung a rank re-registers on to reach level ``n``."""
    return _BY_LEVEL[n]


@dataclass(frozen=True, slots=True)
class RankRecord:
    """One rank's registration, as the other ranks see it.

    Attributes:
        rank: the rank in the default group (``torch.distributed.get_rank()``).
        host: the rank's host name.
        device: the device it registered for (``"cuda:1"``), "" when it made none.
        rung: the rung it took (:class:`~pointerdomain.Rung` value), "" when it failed.
        nbytes: bytes registered (0 when it failed).
        chunks: registration calls (chunks) it holds.
        ladder_record: why each rung above ``rung`` failed on this rank.
        error: ``"TypeName: message"`` of its failure, "" when it registered.
        on_mismatch: the ``on_mismatch`` it was called with (``repr`` when not a str).
        policy: ``repr`` of its :class:`~pointerdomain.RegistrationPolicy`.
        rematched: it re-registered to reach the group's rung.
    """

    rank: int
    host: str
    device: str = ""
    rung: str = ""
    nbytes: int = 0
    chunks: int = 0
    ladder_record: tuple[str, ...] = ()
    error: str = ""
    on_mismatch: str = ""
    policy: str = ""
    rematched: bool = False

    def describe(self) -> str:
        """``rank 1 (host a, emulated:0): chunked`` and the first cause, for messages."""
        where = f"rank {self.rank} ({self.host}{', ' + self.device if self.device else ''})"
        if self.error:
            return f"{where} failed: {self.error}"
        why = f" because {self.ladder_record[-1]}" if self.ladder_record else ""
        return f"{where}: {self.rung}{why}"


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """What the ranks of a group agreed on (every rank holds the same one).

    Attributes:
        ok: every rank holds a registration on ``rung``.
        rung: the common rung (a :class:`~pointerdomain.Rung` value; ``single`` also
            covers ranks whose range was ``foreign``), "" when not ok.
        on_mismatch: ``"refuse"`` or ``"match"``.
        records: one :class:`RankRecord` per rank, in group order (after any re-registration).
        rematched: the ranks that re-registered down to ``rung`` (``on_mismatch="match"``).
        error: the :class:`~pointerdomain.errors.GroupRegistrationError` text, "" when ok.
        backend: the process group's backend (``"gloo"``, ``"nccl"``).
    """

    ok: bool
    rung: str
    on_mismatch: str
    records: tuple[RankRecord, ...]
    rematched: tuple[int, ...] = ()
    error: str = ""
    backend: str = ""
    world_size: int = field(default=0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``pointerdomain doctor --json``)."""
        return asdict(self)
