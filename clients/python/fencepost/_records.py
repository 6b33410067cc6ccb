"""The run record as Python values, the lifecycle table (docs/SPEC.md §2-§3) and the
conversions from the wire. I/O-free: shared by the async and the sync client.

Times are timezone-aware ``datetime`` objects in UTC with millisecond
precision (the server's clock); durations are ``int`` milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from .v1 import ledger_pb2, record_pb2

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class RunStatus(StrEnum):
    """Lifecycle status of a run. The value is the lower-case name on the CLI
    and in JSON; ``str(RunStatus.RUNNING) == "running"``."""

    QUEUED = "queued"
    RUNNING = "running"
    SUSPENDED = "suspended"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


_TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})

_TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.FAILED}),
    RunStatus.RUNNING: frozenset(
        {
            RunStatus.SUSPENDED,
            RunStatus.COMPLETED,
            RunStatus.FAILED,
            RunStatus.CANCELLED,
            RunStatus.QUEUED,
        }
    ),
    RunStatus.SUSPENDED: frozenset(
        {RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.FAILED}
    ),
    RunStatus.COMPLETED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.CANCELLED: frozenset(),
}

# RunStatus <-> fencepost.v1.RunStatus numbers (0, UNSPECIFIED, is never stored).
_TO_PB: dict[RunStatus, int] = {
    RunStatus.QUEUED: record_pb2.RUN_STATUS_QUEUED,
    RunStatus.RUNNING: record_pb2.RUN_STATUS_RUNNING,
    RunStatus.SUSPENDED: record_pb2.RUN_STATUS_SUSPENDED,
    RunStatus.COMPLETED: record_pb2.RUN_STATUS_COMPLETED,
    RunStatus.FAILED: record_pb2.RUN_STATUS_FAILED,
    RunStatus.CANCELLED: record_pb2.RUN_STATUS_CANCELLED,
}
_FROM_PB: dict[int, RunStatus] = {v: k for k, v in _TO_PB.items()}


def parse_status(status: RunStatus | str) -> RunStatus:
    """A ``RunStatus`` from the enum or its string ("running", case-insensitive).
    Raises ``ValueError`` for anything else."""
    if isinstance(status, RunStatus):
        return status
    try:
        return RunStatus(str(status).lower())
    except ValueError:
        names = ", ".join(s.value for s in RunStatus)
        raise ValueError(f"unknown run status {status!r} (expected one of {names})") from None


def is_terminal(status: RunStatus | str) -> bool:
    """True for ``completed``, ``failed`` and ``cancelled``: nothing leaves them."""
    return parse_status(status) in _TERMINAL


def can_transition(src: RunStatus | str, dst: RunStatus | str) -> bool:
    """True when ``src -> dst`` is a legal lifecycle move (docs/SPEC.md §3).
    Same status to same status is not a transition (False)."""
    return parse_status(dst) in _TRANSITIONS[parse_status(src)]


def status_to_pb(status: RunStatus | str) -> int:
    return _TO_PB[parse_status(status)]


def status_from_pb(value: int) -> RunStatus | None:
    """The status for a wire number; None for UNSPECIFIED or a number this SDK
    does not know."""
    return _FROM_PB.get(value)


# -- the record -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """The lease written on a record: who may advance the run, and until when
    (server time). Not to be confused with ``Lease``, the handle a worker holds."""

    owner: str
    acquired_at: datetime
    expires_at: datetime
    ttl_ms: int
    lock_delay_ms: int = 0


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    """Pointer to the worker's latest durable checkpoint."""

    key: str
    snapshot_version: int
    saved_at: datetime


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a run ended."""

    code: str
    message: str | None = None


@dataclass(frozen=True, slots=True)
class Suspension:
    """Why and since when a run is suspended."""

    suspended_at: datetime
    pending_approval_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RunRecord:
    """The authoritative record of one run (docs/SPEC.md §2), as the server last wrote it."""

    run_id: str
    version: int
    status: RunStatus
    attempt: int
    fencing_token: int
    created_at: datetime
    updated_at: datetime
    lease: LeaseInfo | None = None
    checkpoint_ref: CheckpointRef | None = None
    outcome: Outcome | None = None
    suspension: Suspension | None = None
    revision: int = 0
    schema: int = 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: status as its string, times as ISO 8601 UTC strings
        with milliseconds; absent sub-records are absent keys."""
        d: dict[str, Any] = {
            "run_id": self.run_id,
            "status": self.status.value,
            "version": self.version,
            "attempt": self.attempt,
            "fencing_token": self.fencing_token,
        }
        if self.lease is not None:
            d["lease"] = {
                "owner": self.lease.owner,
                "acquired_at": format_time(self.lease.acquired_at),
                "expires_at": format_time(self.lease.expires_at),
                "ttl_ms": self.lease.ttl_ms,
                "lock_delay_ms": self.lease.lock_delay_ms,
            }
        if self.checkpoint_ref is not None:
            d["checkpoint_ref"] = {
                "key": self.checkpoint_ref.key,
                "snapshot_version": self.checkpoint_ref.snapshot_version,
                "saved_at": format_time(self.checkpoint_ref.saved_at),
            }
        if self.outcome is not None:
            d["outcome"] = {"code": self.outcome.code}
            if self.outcome.message is not None:
                d["outcome"]["message"] = self.outcome.message
        if self.suspension is not None:
            d["suspension"] = {
                "suspended_at": format_time(self.suspension.suspended_at),
                "pending_approval_ids": list(self.suspension.pending_approval_ids),
            }
        d["created_at"] = format_time(self.created_at)
        d["updated_at"] = format_time(self.updated_at)
        d["revision"] = self.revision
        return d


@dataclass(frozen=True, slots=True)
class FenceStatus:
    """Answer of ``validate_fence``: ``current`` is True exactly when the run
    exists, is running under a lease and the token presented is its current one."""

    current: bool
    found: bool
    fencing_token: int
    status: RunStatus | None
    revision: int = 0


@dataclass(frozen=True, slots=True)
class DeleteResult:
    """Answer of ``delete``: the run's last fencing token (a later acquire of the
    same id continues above it) and the revision of the delete."""

    fencing_token: int
    revision: int


@dataclass(frozen=True, slots=True)
class RunListing:
    """Answer of ``list_all``: every matching run (ordered by run_id) and the
    server's revision when the listing began. ``watch(from_revision=revision
    + 1)`` then delivers every change committed after it — nothing between the
    list and the watch is missed. A change committed while later pages were
    read can show up in both (the watch's event is the newer: apply events in
    order and it wins)."""

    runs: tuple[RunRecord, ...]
    revision: int


# -- wire -> Python -----------------------------------------------------------------


def format_time(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# Recent conversions: a run's records repeat most of their times (created_at,
# the lease's acquired_at, a checkpoint's saved_at = updated_at), and building
# a datetime costs about three times a lookup. Bounded: cleared when full.
_TIMES: dict[tuple[int, int], datetime] = {}
_TIMES_MAX = 4096


def time_from_pb(ts: Timestamp) -> datetime:
    key = (ts.seconds, ts.nanos)
    t = _TIMES.get(key)
    if t is None:
        if len(_TIMES) >= _TIMES_MAX:
            _TIMES.clear()
        t = _TIMES[key] = _EPOCH + timedelta(0, key[0], key[1] // 1_000_000 * 1000)
    return t


def record_from_pb(m: record_pb2.Run) -> RunRecord:
    status = status_from_pb(m.status)
    if status is None:
        raise ValueError(f"the server sent run {m.run_id!r} with unknown status {m.status}")
    lease = None
    if m.HasField("lease"):
        le = m.lease
        lease = LeaseInfo(
            owner=le.owner,
            acquired_at=time_from_pb(le.acquired_at),
            expires_at=time_from_pb(le.expires_at),
            ttl_ms=le.ttl_ms,
            lock_delay_ms=le.lock_delay_ms,
        )
    ckpt = None
    if m.HasField("checkpoint_ref"):
        c = m.checkpoint_ref
        ckpt = CheckpointRef(c.key, c.snapshot_version, time_from_pb(c.saved_at))
    outcome = None
    if m.HasField("outcome"):
        msg = m.outcome.message if m.outcome.HasField("message") else None
        outcome = Outcome(m.outcome.code, msg)
    susp = None
    if m.HasField("suspension"):
        susp = Suspension(
            time_from_pb(m.suspension.suspended_at), tuple(m.suspension.pending_approval_ids)
        )
    return RunRecord(
        run_id=m.run_id,
        version=m.version,
        status=status,
        attempt=m.attempt,
        fencing_token=m.fencing_token,
        created_at=time_from_pb(m.created_at),
        updated_at=time_from_pb(m.updated_at),
        lease=lease,
        checkpoint_ref=ckpt,
        outcome=outcome,
        suspension=susp,
        revision=m.revision,
        schema=m.schema,
    )


# -- streams --------------------------------------------------------------------------


class LostReason(StrEnum):
    """Why a lease was lost (``Lease.lost_reason``; ``LeaseLostError.reason``).

    The first five are the server's ``LostReason`` (docs/SPEC.md §6.1). ``AT_RISK`` is
    never a lease's ``lost_reason``: it is the reason of the
    ``LeaseAtRiskError`` that ``guard()`` and ``check()`` raise when the lease
    may be gone but nobody has said so (safe-until passed, or ``expiring``).
    """

    TAKEN_OVER = "taken_over"  # another acquire (takeover after expiry, or a newer acquire)
    CANCELLED = "cancelled"  # an operator cancelled the run
    DELETED = "deleted"  # the run was deleted
    FENCE_MOVED = "fence_moved"  # a raw compare-and-set, or the lease dropped by something else
    FINISHED = "finished"  # the run was finished under another handle
    AT_RISK = "at_risk"  # not a loss: the lease may be gone (see the class docs)


_LOST_FROM_PB: dict[int, LostReason] = {
    ledger_pb2.LOST_REASON_TAKEN_OVER: LostReason.TAKEN_OVER,
    ledger_pb2.LOST_REASON_CANCELLED: LostReason.CANCELLED,
    ledger_pb2.LOST_REASON_DELETED: LostReason.DELETED,
    ledger_pb2.LOST_REASON_FENCE_MOVED: LostReason.FENCE_MOVED,
    ledger_pb2.LOST_REASON_FINISHED: LostReason.FINISHED,
}


def lost_reason_from_pb(value: int) -> LostReason:
    """The reason for a wire ``LostReason``; an unknown one is ``FENCE_MOVED``."""
    return _LOST_FROM_PB.get(value, LostReason.FENCE_MOVED)


def derive_lost_reason(record: RunRecord | None, token: int) -> LostReason:
    """Why the fence at ``token`` is gone, judged from the record now (for a
    loss learned from a refused fenced call, which carries no reason). The
    same rule as the server's for a loss learned after the fact."""
    if record is None:
        return LostReason.DELETED
    if record.status is RunStatus.CANCELLED and record.fencing_token > token:
        return LostReason.CANCELLED
    if record.status in _TERMINAL:
        return LostReason.FINISHED
    if record.fencing_token != token and record.lease is not None:
        return LostReason.TAKEN_OVER
    return LostReason.FENCE_MOVED


class ChangeKind(StrEnum):
    """What a committed change did to a record (``WatchEvent.kind``)."""

    PUT = "put"  # created or updated: ``record`` is the new version
    DELETE = "delete"  # deleted: ``record`` is None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One committed change, as ``Client.watch`` yields it. ``revision`` is
    server-wide and strictly increasing along a watch (resume from
    ``revision + 1``); in a watch by shards (``WatchCursor``) it increases
    within ``shard``, the run's shard (None in a watch by revision)."""

    revision: int
    kind: ChangeKind
    run_id: str
    record: RunRecord | None = None
    shard: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{"revision", "kind", "run_id", "record"?, "shard"?}``; ``record``
        is ``RunRecord.to_dict()`` and absent for a delete."""
        d: dict[str, Any] = {"revision": self.revision, "kind": self.kind.value,
                             "run_id": self.run_id}
        if self.record is not None:
            d["record"] = self.record.to_dict()
        if self.shard is not None:
            d["shard"] = self.shard
        return d


def watch_event_from_pb(m: ledger_pb2.WatchRunsResponse, shard: int | None = None) -> WatchEvent:
    """A ``WatchEvent`` from a ``fencepost.v1.WatchRunsResponse``."""
    record = record_from_pb(m.record) if m.HasField("record") else None
    kind = ChangeKind.DELETE if m.kind == ledger_pb2.CHANGE_KIND_DELETE else ChangeKind.PUT
    return WatchEvent(revision=m.revision, kind=kind, run_id=m.run_id, record=record,
                      shard=shard)
