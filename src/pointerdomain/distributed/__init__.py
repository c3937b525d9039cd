"""One registration outcome across the ranks of a ``torch.distributed`` process group.

Tensor-parallel ranks each register their host pool. When one rank's driver refuses and
its registration goes down the ladder (:mod:`pointerdomain.ladder`: ``chunked``,
``pinned_copy``, ``unpinned``) while the others do not, the group runs at the slowest
rank's speed and no rank is told. :func:`register_group` registers on every rank,
exchanges a record of what each rank got, and ends with one outcome on every rank: the
same rung, or the same :class:`~pointerdomain.errors.GroupRegistrationError` naming the
ranks and the causes. ``on_mismatch`` chooses between refusing a difference and
re-registering every rank down to the lowest rung.

Example (every rank, after ``torch.distributed.init_process_group``)::

    import pointerdomain as pd
    from pointerdomain.distributed import register_group

    reg = register_group(lambda p: pd.HostKVPool(layout, device, policy=p),
                         policy=pd.RegistrationPolicy(on_failure="degrade"), on_mismatch="match")
    host_pool = reg.value                     # this rank's pool, on reg.outcome.rung
    reg.outcome.rung                          # "single" on every rank, or "chunked" on every rank, ...

``pointerdomain doctor --json`` run inside a rank (:func:`pointerdomain.tools.doctor.collect`)
reports the group and :func:`last_outcome` under ``"distributed"``.
"""

from __future__ import annotations

from typing import Any

from pointerdomain.distributed._agree import GroupRegistration, last_outcome, register_group
from pointerdomain.distributed._records import GroupOutcome, OnMismatch, RankRecord
from pointerdomain.errors import GroupRegistrationError

__all__ = [
    "GroupOutcome",
    "GroupRegistration",
    "GroupRegistrationError",
    "OnMismatch",
    "RankRecord",
    "group_report",
    "last_outcome",
    "register_group",
]


def group_report() -> dict[str, Any] | None:
    """The process group as ``pointerdomain doctor`` shows it, or None when
    torch.distributed has no initialised group: ``rank``, ``world_size``, ``backend`` and
    ``registration`` (:meth:`GroupOutcome.as_dict` of :func:`last_outcome`, None before
    any :func:`register_group`). Makes no collective call."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    outcome = last_outcome()
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": str(dist.get_backend()),
            "registration": None if outcome is None else outcome.as_dict()}
