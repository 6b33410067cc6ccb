"""TEST-ONLY broken builds (``--test-hooks --fault NAME``), wired from above by
the composition root: the torture run proves its checkers catch a server that
breaks a guarantee. The pure core, the storage and the writer hold no switch
for them: the writer is built with the broken rules instead (``writer_faults``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..core import ledger
from ..core.placement import Ownership

FAULTS = ("ack-before-commit", "fence-ignores-owner", "no-epoch-check", "watch-drops-change")
ACK_DELAY_S = 0.2  # ack-before-commit: how long an answered batch stays uncommitted
DROP_EVERY = 100  # watch-drops-change: one revision in this many is never sent to a watch

_HANDLE_COMMANDS = (ledger.Renew, ledger.RecordCheckpoint, ledger.Suspend, ledger.Finish,
                    ledger.Release)


def decide_ignoring_owner(cmd: Any, current: Any, tombstone: int, now: int,
                          revision: int) -> ledger.Decision:
    """fence-ignores-owner: a handle's fence check skips the owner comparison:
    a command carrying the run's current token is decided as if the lease's
    holder had sent it (the owner is read by the fence check alone)."""
    lease = current.lease if current is not None else None
    if (isinstance(cmd, _HANDLE_COMMANDS) and lease is not None
            and current.fencing_token == cmd.fencing_token and lease.owner != cmd.owner):
        cmd = dataclasses.replace(cmd, owner=lease.owner)
    return ledger.decide(cmd, current, tombstone, now, revision)


def renewed_ignoring_owner(cmd: Any, current: Any, now: int, floor: int) -> Any:
    """fence-ignores-owner for a renewal answered from memory, which checks
    the fence without ``decide``."""
    lease = current.lease if current is not None else None
    if (lease is not None and current.fencing_token == cmd.fencing_token
            and lease.owner != cmd.owner):
        cmd = dataclasses.replace(cmd, owner=lease.owner)
    return ledger.renewed_in_memory(cmd, current, now, floor)


def ack_before_commit(answer_now: Callable[[], None]) -> None:
    """ack-before-commit: answer a batch's callers, then hold its COMMIT back,
    so a SIGKILL in between loses acknowledged writes. Writer thread."""
    answer_now()
    time.sleep(ACK_DELAY_S)


def drops_change(revision: int) -> bool:
    """watch-drops-change: WatchRuns never sends the change at this revision,
    replayed or live, so a watcher misses it for good."""
    return revision % DROP_EVERY == DROP_EVERY // 2


def watch_drops(fault: str) -> Callable[[int], bool] | None:
    """The revisions WatchRuns leaves out with ``fault`` (None: none)."""
    return drops_change if fault == "watch-drops-change" else None


def static_ownership(spec: str, shards: int, address: str) -> Ownership:
    """``--test-hooks`` with FENCEPOST_TEST_SHARD_MAP "ADDR=0-31;ADDR=32-63":
    servers that each lead the shards mapped to their own address, so the
    clients' routing (NOT_OWNER, the map) meets real servers before several
    coordinators share one database. Every shard must be named exactly once."""
    owners: dict[int, tuple[str, int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        addr, _, ranges = part.rpartition("=")
        for piece in ranges.split(","):
            first, _, last = piece.partition("-")
            if not (first.isdigit() and (last or first).isdigit()):
                raise RuntimeError(f"FENCEPOST_TEST_SHARD_MAP: {piece!r} is not N or N-M")
            for shard in range(int(first), int(last or first) + 1):
                if shard in owners or not 0 <= shard < shards:
                    raise RuntimeError(f"FENCEPOST_TEST_SHARD_MAP: shard {shard} is named "
                                       f"twice or is not one of the {shards}")
                owners[shard] = (addr, 1)
    if len(owners) != shards or address not in {a for a, _ in owners.values()}:
        raise RuntimeError(f"FENCEPOST_TEST_SHARD_MAP must name each of the {shards} shards "
                           f"once, some of them led at this server's address {address}")
    return Ownership(shards, (s for s, (a, _) in owners.items() if a == address), owners)


def writer_faults(fault: str) -> dict[str, Any]:
    """The ``Writer`` keyword arguments that build ``fault`` into it (none for
    a fault the writer has no part in)."""
    if fault == "fence-ignores-owner":
        return {"decide": decide_ignoring_owner, "renewed_in_memory": renewed_ignoring_owner}
    if fault == "ack-before-commit":
        return {"ack_before_commit": ack_before_commit}
    return {}


def is_active(writer: Any) -> bool:
    """Whether ``writer`` was built with fence-ignores-owner."""
    return writer.decide is decide_ignoring_owner
