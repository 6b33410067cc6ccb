"""The run record (docs/SPEC.md §2) and its lifecycle (docs/SPEC.md §3), as plain immutable values.

Times are integers: milliseconds since the Unix epoch, read from the server's
clock. This module is pure: no I/O, no asyncio, no grpc, no sqlite3.

Records are values: nothing ever mutates one after it is built (a change is a
new record). They are plain slotted dataclasses rather than ``frozen=True``
ones because frozen construction costs ~5x more, and the writer builds
several per command; tests/unit/test_decision_properties.py checks that
decisions never mutate their input.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

SCHEMA = 1

# The largest integer every client can represent exactly: JavaScript's
# Number.MAX_SAFE_INTEGER (TypeScript clients read int64 fields as numbers).
# A run's version, attempt and fencing token never go past it (docs/SPEC.md §10).
MAX_SAFE = 2**53 - 1
MAX_INT64 = 2**63 - 1  # what the database's integer columns and int64 fields hold


class Status(IntEnum):
    """Run status; the numbers are the proto enum's (fencepost.v1.RunStatus)."""

    QUEUED = 1
    RUNNING = 2
    SUSPENDED = 3
    COMPLETED = 4
    FAILED = 5
    CANCELLED = 6


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED})

# What one change of the log did to its run: written, or hard-deleted.
KIND_PUT = 1
KIND_DELETE = 2

TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.QUEUED: frozenset({Status.RUNNING, Status.CANCELLED, Status.FAILED}),
    Status.RUNNING: frozenset(
        {Status.SUSPENDED, Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.QUEUED}
    ),
    Status.SUSPENDED: frozenset({Status.QUEUED, Status.RUNNING, Status.CANCELLED, Status.FAILED}),
    Status.COMPLETED: frozenset(),
    Status.FAILED: frozenset(),
    Status.CANCELLED: frozenset(),
}


def is_terminal(status: Status) -> bool:
    return status in TERMINAL


def can_transition(src: Status, dst: Status) -> bool:
    """True when src -> dst is a legal move. Same to same is not a transition."""
    return dst in TRANSITIONS[src]


@dataclass(slots=True)
class Lease:
    owner: str
    acquired_at: int
    expires_at: int
    ttl_ms: int
    lock_delay_ms: int = 0

    def live(self, now: int) -> bool:
        """Live while now < expires_at; expired at exactly expires_at (docs/SPEC.md §4)."""
        return now < self.expires_at

    def blocks_others(self, now: int) -> bool:
        """Whether another owner (or RequestResume) must still treat it as live:
        until expires_at + lock_delay_ms (docs/SPEC.md §5.6)."""
        return now < self.expires_at + self.lock_delay_ms


@dataclass(slots=True)
class CheckpointRef:
    key: str
    snapshot_version: int
    saved_at: int


@dataclass(slots=True)
class Outcome:
    code: str
    message: str | None = None


@dataclass(slots=True)
class Suspension:
    suspended_at: int
    pending_approval_ids: tuple[str, ...] = ()


@dataclass(slots=True)
class Record:
    run_id: str
    version: int
    status: Status
    attempt: int
    fencing_token: int
    created_at: int
    updated_at: int
    lease: Lease | None = None
    checkpoint_ref: CheckpointRef | None = None
    outcome: Outcome | None = None
    suspension: Suspension | None = None
    revision: int = 0
    schema: int = SCHEMA


def out_of_range(r: Record) -> str | None:
    """The first counter of ``r`` outside 0..MAX_SAFE, or None. Only a record
    written into the database by hand (or by a release without the bound)
    has one; such a record is never served nor changed, only deleted."""
    for name in ("fencing_token", "attempt", "version"):
        v = getattr(r, name)
        if not (isinstance(v, int) and 0 <= v <= MAX_SAFE):
            return name
    return None


# -- plain-data form (JSON-able), used by storage and the request-id cache -------


def record_to_dict(r: Record) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": r.schema,
        "run_id": r.run_id,
        "version": r.version,
        "status": int(r.status),
        "attempt": r.attempt,
        "fencing_token": r.fencing_token,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "revision": r.revision,
    }
    if r.lease is not None:
        lease = r.lease
        d["lease"] = [
            lease.owner,
            lease.acquired_at,
            lease.expires_at,
            lease.ttl_ms,
            lease.lock_delay_ms,
        ]
    if r.checkpoint_ref is not None:
        c = r.checkpoint_ref
        d["checkpoint_ref"] = [c.key, c.snapshot_version, c.saved_at]
    if r.outcome is not None:
        d["outcome"] = [r.outcome.code, r.outcome.message]
    if r.suspension is not None:
        s = r.suspension
        d["suspension"] = [s.suspended_at, list(s.pending_approval_ids)]
    return d


def record_from_dict(d: dict[str, Any]) -> Record:
    lease = d.get("lease")
    ckpt = d.get("checkpoint_ref")
    outcome = d.get("outcome")
    susp = d.get("suspension")
    return Record(
        run_id=d["run_id"],
        version=d["version"],
        status=Status(d["status"]),
        attempt=d["attempt"],
        fencing_token=d["fencing_token"],
        created_at=d["created_at"],
        updated_at=d["updated_at"],
        lease=Lease(*lease) if lease is not None else None,
        checkpoint_ref=CheckpointRef(*ckpt) if ckpt is not None else None,
        outcome=Outcome(*outcome) if outcome is not None else None,
        suspension=Suspension(susp[0], tuple(susp[1])) if susp is not None else None,
        revision=d.get("revision", 0),
        schema=d.get("schema", SCHEMA),
    )
