"""TEST-ONLY broken builds (``--test-hooks --fault NAME``), wired from above by
the composition root: the torture run proves its checkers catch a server that
breaks a guarantee. The pure core and the storage hold no switch for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..core import ledger

FAULTS = ("ack-before-commit", "fence-ignores-owner", "no-epoch-check")
ACK_DELAY_S = 0.2  # ack-before-commit: how long an answered batch stays uncommitted

_HANDLE_COMMANDS = (ledger.Renew, ledger.RecordCheckpoint, ledger.Suspend, ledger.Finish,
                    ledger.Release)


def fence_ignores_owner() -> Callable[[], None]:
    """Until the returned undo is called, a handle's fence check skips the owner
    comparison: a command carrying the run's current token is decided as if
    the lease's holder had sent it (the owner is read by the fence check alone).
    Process-wide, like the decision function it wraps."""
    decide = ledger.decide

    def decide_ignoring_owner(cmd: Any, current: Any, tombstone: int, now: int,
                              revision: int) -> ledger.Decision:
        lease = current.lease if current is not None else None
        if (isinstance(cmd, _HANDLE_COMMANDS) and lease is not None
                and current.fencing_token == cmd.fencing_token and lease.owner != cmd.owner):
            cmd = dataclasses.replace(cmd, owner=lease.owner)
        return decide(cmd, current, tombstone, now, revision)

    renewed = ledger.renewed_in_memory

    def renewed_ignoring_owner(cmd: Any, current: Any, now: int, floor: int) -> Any:
        # a renewal answered from memory checks the fence without decide()
        lease = current.lease if current is not None else None
        if (lease is not None and current.fencing_token == cmd.fencing_token
                and lease.owner != cmd.owner):
            cmd = dataclasses.replace(cmd, owner=lease.owner)
        return renewed(cmd, current, now, floor)

    ledger.decide = decide_ignoring_owner  # type: ignore[assignment]
    ledger.renewed_in_memory = renewed_ignoring_owner  # type: ignore[assignment]

    def undo() -> None:
        if ledger.decide is decide_ignoring_owner:
            ledger.decide = decide  # type: ignore[assignment]
        if ledger.renewed_in_memory is renewed_ignoring_owner:
            ledger.renewed_in_memory = renewed  # type: ignore[assignment]

    return undo


def is_active() -> bool:
    """Whether ``fence_ignores_owner`` is switched on in this process."""
    return getattr(ledger.decide, "__name__", "") == "decide_ignoring_owner"
