"""Fenced writes: a precondition a write commits under, checked by the writer
in the same step that applies it. Pure.

A ``Fence`` names a ledger run and the fencing token its writer holds, or a
keyed lock and its token (``validate.fence`` builds one from a request).
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


def check_run_fence(fence: Fence, cur: Record | None, tombstone: int) -> None:
    """The run fence holds: the run exists, is RUNNING under a lease, and its
    token is the fence's (Ledger.ValidateFence's ``current``). Raises
    RUN_LEASE_LOST with the observed record otherwise; RUN_NOT_FOUND naming
    ``fence.run_id`` for a run that never existed (no tombstone either)."""
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
    if cur.status is not Status.RUNNING or cur.lease is None:
        raise LedgerError(
            Code.RUN_LEASE_LOST,
            f"fence: run {fence.run_id!r} is {cur.status.name.lower()} with no lease; "
            f"token {fence.fencing_token} no longer fences writes",
            cur,
        )
