"""Transfer-engine results as :class:`~pointerdomain.transfer.outcomes.TransferOutcome`.

An engine call that fails (a nonzero status from Mooncake, an ``ERR`` state or a refused
request from NIXL, a memory registration that was never made) raises a typed error in the
adapters; a caller that drops it would serve a request whose pages were never written.
These functions turn the calls into outcomes instead, so the failure travels with the
request:

* :func:`mooncake_blocks`: block by block (``transfer_sync_read`` / ``_write`` per
  block); the first block that fails and every block after it are the failed spans
  (nothing after a failure is sent), the blocks before it were copied: ``partial``;
* :func:`mooncake_batch`: one batch call, which does not say which blocks landed: a
  failure fails every block;
* :func:`nixl_transfer`: one NIXL request, likewise all or nothing.

Spans index the blocks: ``[start, stop)`` of ``local`` / ``remote``. A
:class:`~pointerdomain.transfer.outcomes.TransferStream` given as ``stream`` latches the
first failure as it does for launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pointerdomain.arguments import describe
from pointerdomain.errors import InvalidArgumentError
from pointerdomain.transfer.outcomes import TransferOutcome, TransferStream, run_spans

if TYPE_CHECKING:
    from pointerdomain.adapters.mooncake import HostTransferEngine
    from pointerdomain.adapters.nixl import HostNixlAgent, NixlDesc
    from pointerdomain.registration.metadata import BufferInfo

__all__ = ["mooncake_batch", "mooncake_blocks", "nixl_transfer"]


def _direction(op: object) -> Literal["read", "write"]:
    if op not in ("read", "write"):
        raise InvalidArgumentError(f"op must be 'read' or 'write', got {describe(op)}")
    return "read" if op == "read" else "write"


def _lengths(local: Sequence[Any], remote: Sequence[Any]) -> int:
    if len(local) != len(remote):
        raise InvalidArgumentError(
            f"remote: found {len(remote)} blocks for {len(local)} local blocks, expected one remote block per "
            "local block"
        )
    return len(local)


def _run(stream: TransferStream | None, total: int, spans: list[tuple[int, int]], work: Any) -> TransferOutcome:
    return run_spans(total, spans, work) if stream is None else stream.run(total, spans, work)


def mooncake_blocks(
    engine: HostTransferEngine, op: Literal["read", "write"], peer: str, local: Sequence[BufferInfo],
    remote: Sequence[BufferInfo], *, stream: TransferStream | None = None,
) -> TransferOutcome:
    """Copy ``remote[i] -> local[i]`` (``"read"``) or ``local[i] -> remote[i]`` (``"write"``)
    one block at a time, in order; see the module docstring.

    Raises:
        InvalidArgumentError: ``op`` is not ``"read"`` / ``"write"``, or the lists differ in length.
        LatchedError: ``stream`` latched an earlier failure.
    """
    direction = _direction(op)
    n = _lengths(local, remote)

    def one(start: int, stop: int) -> None:
        for i in range(start, stop):
            if direction == "read":
                engine.transfer_sync_read(peer, local[i], remote[i])
            else:
                engine.transfer_sync_write(peer, local[i], remote[i])

    return _run(stream, n, [(i, i + 1) for i in range(n)], one)


def mooncake_batch(
    engine: HostTransferEngine, op: Literal["read", "write"], peer: str, local: Sequence[BufferInfo],
    remote: Sequence[BufferInfo], *, stream: TransferStream | None = None,
) -> TransferOutcome:
    """One batch call (``batch_transfer_sync_read`` / ``_write``); a failure fails every block.

    Raises:
        InvalidArgumentError, LatchedError: as :func:`mooncake_blocks`.
    """
    direction = _direction(op)
    n = _lengths(local, remote)

    def batch(start: int, stop: int) -> None:
        if direction == "read":
            engine.batch_transfer_sync_read(peer, local, remote)
        else:
            engine.batch_transfer_sync_write(peer, local, remote)

    return _run(stream, n, [(0, n)], batch)


def nixl_transfer(
    agent: HostNixlAgent, op: Literal["READ", "WRITE"], local: Sequence[NixlDesc], remote: Sequence[NixlDesc],
    peer: str, *, timeout_s: float = 60.0, stream: TransferStream | None = None,
) -> TransferOutcome:
    """:meth:`HostNixlAgent.transfer <pointerdomain.adapters.nixl.HostNixlAgent.transfer>` as
    an outcome: ``done``, or ``failed`` for every block (NIXL does not say which landed).

    Raises:
        LatchedError: ``stream`` latched an earlier failure.
    """
    n = len(local)

    def request(start: int, stop: int) -> None:
        agent.transfer(op, local, remote, peer, timeout_s=timeout_s)

    return _run(stream, n, [(0, n)], request)
