"""Fenced writes: a precondition a write commits under, checked by the writer
in the same step that applies it. Pure.

A ``Fence`` names a ledger run and the fencing token its writer holds, or a
keyed lock and its token (``validate.fence`` builds one from a request).
``fences`` is THE predicate "does this token still fence the run", which
the ledger's checks, ValidateFence and the KeepAlive hub all ask
(``fences_writes`` adds that the run is running);
``check_run_fence`` is the run half (the lock half, which needs the lock's
row, is ``core.engine.check_lock_fence``); the writer calls them against its
authoritative state, inside the step that writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import Code, LedgerError
from .records import Record, Status


@dataclass(frozen=True, slots=True)
class Fence:
    """Exactly one of ``run_id`` and ``lock_key`` is non-empty."""

    fencing_token: int
    run_id: str = ""
    lock_key: str = ""


def fences(record: Record | None, token: int, owner: str | None = None) -> bool:
    """``token`` (held by ``owner``, when given) is still the run's fence: the
    run exists under a lease (of that owner) and ``token`` is its token
    (docs/SPEC.md §5.2). A KeepAlive stream never calls such a handle lost."""
    return (
        record is not None
        and record.fencing_token == token
        and record.lease is not None
        and (owner is None or record.lease.owner == owner)
    )


def fences_writes(record: Record | None, token: int, owner: str | None = None) -> bool:
    """``fences``, and the run is RUNNING: a write fenced by ``token`` commits
    (Ledger.ValidateFence's ``current``). Only the raw seam can store a lease
    on a run that is not running."""
    return record is not None and record.status is Status.RUNNING and fences(record, token, owner)


def check_run_fence(fence: Fence, cur: Record | None, tombstone: int) -> None:
    """The run fence holds: the run exists, is RUNNING under a lease, and its
    token is the fence's (Ledger.ValidateFence's ``current``). Raises
    RUN_LEASE_LOST with the observed record otherwise; RUN_NOT_FOUND naming
    ``fence.run_id`` for a run that never existed (no tombstone either)."""
    if fences_writes(cur, fence.fencing_token):
        return
    if cur is None:
        if tombstone:
            raise LedgerError(
                Code.RUN_LEASE_LOST,
                f"fence.run_id: run {fence.run_id!r} was deleted (its last token was {tombstone})",
                field="fence.run_id",
            )
        raise LedgerError(
            Code.RUN_NOT_FOUND,
            f"fence.run_id: run {fence.run_id!r} does not exist",
            field="fence.run_id",
        )
    if cur.fencing_token != fence.fencing_token:
        raise LedgerError(
            Code.RUN_LEASE_LOST,
            f"fence: fencing token {fence.fencing_token} is stale; run {fence.run_id!r} "
            f"is at {cur.fencing_token}",
            cur,
        )
    raise LedgerError(
        Code.RUN_LEASE_LOST,
        f"fence: run {fence.run_id!r} is {cur.status.name.lower()} with no lease; "
        f"token {fence.fencing_token} no longer fences writes",
        cur,
    )
