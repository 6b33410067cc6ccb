"""Pure decisions for the ledger and the raw seam (docs/SPEC.md §3-§5, §7).

``decide(cmd, current, tombstone, now, revision)`` returns a ``Decision``: the
change to write (a new record, a delete, or nothing) and the caller's result,
or raises ``LedgerError``. No I/O, no clock reads, no asyncio/grpc/sqlite3:
the writer supplies the committed state, the time and the next revision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from .errors import (
    Code,
    LedgerError,
    owner_bound_ok,
    owner_not_permitted,
    unrepresentable,
    validation,
)
from .fence import Fence, fences_writes
from .records import (
    MAX_INT64,
    MAX_SAFE,
    CheckpointRef,
    Lease,
    Outcome,
    Record,
    Status,
    Suspension,
    can_transition,
    is_terminal,
    out_of_range,
)

DEFAULT_TTL_MS = 60_000
MIN_TTL_MS = 100
MAX_TTL_MS = 24 * 60 * 60 * 1000


# -- commands ---------------------------------------------------------------------


@dataclass(slots=True)
class Acquire:
    run_id: str
    owner: str
    ttl_ms: int = DEFAULT_TTL_MS
    lock_delay_ms: int = 0
    request_id: str = ""


@dataclass(slots=True)
class Renew:
    run_id: str
    owner: str
    fencing_token: int
    ttl_ms: int | None = None
    request_id: str = ""


@dataclass(slots=True)
class RecordCheckpoint:
    run_id: str
    owner: str
    fencing_token: int
    key: str
    snapshot_version: int
    request_id: str = ""
    fence: Fence | None = None  # a second precondition, checked by the writer


@dataclass(slots=True)
class Suspend:
    run_id: str
    owner: str
    fencing_token: int
    pending_approval_ids: tuple[str, ...] = ()
    request_id: str = ""


@dataclass(slots=True)
class Finish:
    run_id: str
    owner: str
    fencing_token: int
    status: Status
    outcome: Outcome | None = None
    request_id: str = ""


@dataclass(slots=True)
class Release:
    run_id: str
    owner: str
    fencing_token: int
    request_id: str = ""


@dataclass(slots=True)
class Cancel:
    run_id: str
    message: str | None = None
    request_id: str = ""


@dataclass(slots=True)
class RequestResume:
    run_id: str
    request_id: str = ""


@dataclass(slots=True)
class DeleteRun:
    run_id: str
    request_id: str = ""


@dataclass(slots=True)
class Retire:
    """Retention: delete a finished run, but only while it is still finished
    and unchanged since the retention pass read it (``version``). Its
    tombstone keeps the token guarantee, as for DeleteRun."""

    run_id: str
    version: int
    request_id: str = ""


@dataclass(slots=True)
class RawCreate:
    record: Record
    request_id: str = ""

    @property
    def run_id(self) -> str:
        return self.record.run_id


@dataclass(slots=True)
class RawCompareAndSet:
    run_id: str
    expected_version: int
    next: Record
    request_id: str = ""
    # The caller's name when its owners are bound (docs/SECURITY.md), else
    # None: giving the lease to an owner it may not use is refused, keeping
    # the replaced version's holder is not.
    bound_to: str | None = None


@dataclass(slots=True)
class RawDelete:
    run_id: str
    request_id: str = ""
    # As RawCompareAndSet's: a bound caller may not delete a run another
    # principal's owner holds under a live lease.
    bound_to: str | None = None


@dataclass(slots=True)
class Transaction:
    """Several commands (ledger and engine store) applied as one all-or-nothing
    step of the writer, each after the shared ``fence`` is checked against the
    state the earlier ones left. Its result is a ``TransactionDone``."""

    commands: tuple[Any, ...]
    fence: Fence | None = None
    request_id: str = ""


@dataclass(slots=True)
class TransactionDone:
    results: tuple[Any, ...]


MAX_TRANSACTION_COMMANDS = 100


@dataclass(slots=True)
class ExtendLeases:
    """A new leader's first command (ha/leadership.py): every lease that had not
    expired at ``alive_at`` (when the coordinator became unavailable) is
    extended by ``by_ms`` (how long it was unavailable), so no holder loses a
    lease because the coordinator changed: a change of leader only ever
    extends leases. The engine store's claims and keyed locks likewise."""

    by_ms: int
    alive_at: int
    request_id: str = ""


@dataclass(slots=True)
class TakeShards:
    """A coordinator's first command for shards it has just taken from
    another (storage/shared.py): each lease of ``run_ids`` (the shards' runs)
    is extended as ``take_lease`` says, with its shard's lease floor and the
    time the shard went unled (``gaps``); the engine store's claims and keyed
    locks of those shards by their gap, as ExtendLeases; then the shards'
    lease floors become this coordinator's (``floor``)."""

    shards: frozenset[int]
    run_ids: tuple[str, ...]
    floors: dict[int, int]  # shard -> the floor its row held
    gaps: dict[int, int]  # shard -> ms nobody led it
    floor: int
    request_id: str = ""


@dataclass(slots=True)
class LeasesExtended:
    runs: int  # ledger leases extended
    others: int  # engine-store claims and keyed locks extended
    # a take's extensions are revisions first_revision.. +runs-1 (0: none
    # or not known): a checker tells them from the clients' writes by it
    first_revision: int = 0


def extend_lease(cur: Record, cmd: ExtendLeases, now: int, rev: int) -> Record | None:
    """The record with its lease extended as ``cmd`` says, or None when it has
    no lease that was live at ``cmd.alive_at``."""
    lease = cur.lease
    if lease is None or lease.expires_at <= cmd.alive_at or is_terminal(cur.status):
        return None
    if out_of_range(cur) is not None or cur.version >= MAX_SAFE:
        return None  # never served nor changed (``decide``)
    return _write(cur, now, rev, lease=_extend(lease, lease.expires_at + cmd.by_ms))


Command = (
    Acquire
    | Renew
    | RecordCheckpoint
    | Suspend
    | Finish
    | Release
    | Cancel
    | RequestResume
    | DeleteRun
    | Retire
    | RawCreate
    | RawCompareAndSet
    | RawDelete
    | Transaction
    | ExtendLeases
    | TakeShards
)
HandleCommand = Renew | RecordCheckpoint | Suspend | Finish | Release


# -- results and changes --------------------------------------------------------


@dataclass(slots=True)
class Created:
    created: bool
    record: Record


@dataclass(slots=True)
class Swapped:
    swapped: bool
    record: Record | None


@dataclass(slots=True)
class Deleted:
    deleted: bool
    revision: int = 0
    fencing_token: int = 0


Result = Record | Created | Swapped | Deleted


@dataclass(slots=True)
class Put:
    record: Record


@dataclass(slots=True)
class Delete:
    run_id: str
    fencing_token: int
    revision: int


Change = Put | Delete


@dataclass(slots=True)
class Decision:
    change: Change | None
    result: Result


def decide(
    cmd: Command, current: Record | None, tombstone: int, now: int, revision: int
) -> Decision:
    """Decide one command against the committed record (or None when absent).

    ``tombstone`` is the last fencing token of a deleted run with this id (0 if
    none); ``revision`` is the revision a change made by this command gets.

    No record leaves 0..MAX_SAFE: a command that would move a counter past it
    is refused, and a stored record already outside it (written by hand) is
    refused every command but a delete.
    """
    if current is not None and not (
        0 <= current.fencing_token <= MAX_SAFE
        and 0 <= current.attempt <= MAX_SAFE
        and 0 <= current.version <= MAX_SAFE
    ) and type(cmd) not in _REMOVES:
        field = out_of_range(current) or "fencing_token"
        raise unrepresentable(current.run_id, field, getattr(current, field))
    decision = _DECIDERS[type(cmd)](cmd, current, tombstone, now, revision)
    change = decision.change
    if type(change) is Put:
        rec = change.record
        if rec.fencing_token > MAX_SAFE or rec.attempt > MAX_SAFE or rec.version > MAX_SAFE:
            raise _no_room(rec, current)
    return decision


def _no_room(rec: Record, current: Record | None) -> LedgerError:
    field = next(f for f in ("fencing_token", "attempt", "version") if getattr(rec, f) > MAX_SAFE)
    return LedgerError(
        Code.RUN_VALIDATION_ERROR,
        f"{field}: run {rec.run_id!r} would move to {field} {getattr(rec, field)}, past "
        f"{MAX_SAFE} (2^53 - 1, the largest integer every client can represent exactly); "
        "nothing was written",
        current,
        field=field,
    )


def _last_token(cur: Record) -> int:
    """A removed run's token for its tombstone: a hand-written one past what the
    database holds is kept as int64's largest (still past MAX_SAFE: never reused)."""
    t = cur.fencing_token
    return t if type(t) is int and t <= MAX_INT64 else MAX_INT64


# -- helpers ----------------------------------------------------------------------


_KEEP: Any = object()


def _write(
    cur: Record,
    now: int,
    revision: int,
    *,
    status: Status = _KEEP,
    attempt: int = _KEEP,
    fencing_token: int = _KEEP,
    lease: Lease | None = _KEEP,
    checkpoint_ref: CheckpointRef | None = _KEEP,
    outcome: Outcome | None = _KEEP,
    suspension: Suspension | None = _KEEP,
) -> Record:
    """The next version of a record (version + 1, updated_at, revision) with the
    given fields changed. Spelled out instead of dataclasses.replace: this is
    the writer's hottest function."""
    return Record(
        cur.run_id,
        cur.version + 1,
        cur.status if status is _KEEP else status,
        cur.attempt if attempt is _KEEP else attempt,
        cur.fencing_token if fencing_token is _KEEP else fencing_token,
        cur.created_at,
        now,
        cur.lease if lease is _KEEP else lease,
        cur.checkpoint_ref if checkpoint_ref is _KEEP else checkpoint_ref,
        cur.outcome if outcome is _KEEP else outcome,
        cur.suspension if suspension is _KEEP else suspension,
        revision,
        cur.schema,
    )


def _extend(lease: Lease, expires_at: int) -> Lease:
    return Lease(lease.owner, lease.acquired_at, expires_at, lease.ttl_ms, lease.lock_delay_ms)


def _unchanged(cur: Record) -> Decision:
    return Decision(None, cur)


def _put(rec: Record) -> Decision:
    return Decision(Put(rec), rec)


def _check_transition(cur: Record, dst: Status) -> None:
    if is_terminal(cur.status):
        raise LedgerError(
            Code.RUN_ALREADY_TERMINAL,
            f"run {cur.run_id!r} is {cur.status.name.lower()}",
            cur,
        )
    if not can_transition(cur.status, dst):
        raise LedgerError(
            Code.RUN_INVALID_TRANSITION,
            f"run {cur.run_id!r} cannot move from {cur.status.name.lower()} to {dst.name.lower()}",
            cur,
        )


def _fence(cmd: HandleCommand, cur: Record | None) -> Record:
    """docs/SPEC.md §5.2 fence check: exists, same token, same lease owner;
    past ``fences``, the first that fails says why."""
    if fences_writes(cur, cmd.fencing_token, cmd.owner):
        assert cur is not None
        return cur
    if cur is None:
        raise LedgerError(Code.RUN_LEASE_LOST, f"run {cmd.run_id!r} no longer exists")
    if cur.fencing_token != cmd.fencing_token:
        raise LedgerError(
            Code.RUN_LEASE_LOST,
            f"fencing token {cmd.fencing_token} is stale; run {cmd.run_id!r} "
            f"is at {cur.fencing_token}",
            cur,
        )
    if cur.lease is None or cur.lease.owner != cmd.owner:
        raise LedgerError(
            Code.RUN_LEASE_LOST,
            f"owner {cmd.owner!r} does not hold the lease of run {cmd.run_id!r}",
            cur,
        )
    if cur.status is not Status.RUNNING:
        _check_transition(cur, Status.RUNNING)  # raises: terminal or not running
    raise LedgerError(Code.RUN_INVALID_TRANSITION, f"run {cmd.run_id!r} is not running", cur)


def _converged(cmd: HandleCommand, cur: Record | None, target: Status) -> bool:
    """Convergence for lease-dropping commands retried by the same handle."""
    return cur is not None and cur.status is target and cur.fencing_token == cmd.fencing_token


# -- ledger commands ----------------------------------------------------------------


def _acquire(cmd: Acquire, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    lease = Lease(cmd.owner, now, now + cmd.ttl_ms, cmd.ttl_ms, cmd.lock_delay_ms)
    if cur is None:
        return _put(
            Record(
                run_id=cmd.run_id,
                version=1,
                status=Status.RUNNING,
                attempt=1,
                fencing_token=tombstone + 1,
                created_at=now,
                updated_at=now,
                lease=lease,
                revision=rev,
            )
        )
    if is_terminal(cur.status):
        raise LedgerError(
            Code.RUN_ALREADY_TERMINAL, f"run {cmd.run_id!r} is {cur.status.name.lower()}", cur
        )
    if cur.status is Status.SUSPENDED:
        raise LedgerError(
            Code.RUN_SUSPENDED, f"run {cmd.run_id!r} is suspended; RequestResume first", cur
        )
    held = cur.lease
    attempt = cur.attempt
    if held is not None:
        if held.owner != cmd.owner and held.blocks_others(now):
            raise LedgerError(
                Code.RUN_LEASE_HELD,
                f"run {cmd.run_id!r} is leased by {held.owner!r} until "
                f"{_iso(held.expires_at + held.lock_delay_ms)} "
                f"(in {(held.expires_at + held.lock_delay_ms - now) / 1000:.1f} s)",
                cur,
            )
        if not (held.owner == cmd.owner and held.live(now)):
            attempt += 1  # takes over a lease that existed and expired
    return _put(
        _write(
            cur,
            now,
            rev,
            status=Status.RUNNING,
            attempt=attempt,
            fencing_token=cur.fencing_token + 1,
            lease=lease,
            suspension=None,
        )
    )


def _renew(cmd: Renew, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    cur = _fence(cmd, cur)
    assert cur.lease is not None
    ttl = cmd.ttl_ms if cmd.ttl_ms is not None else cur.lease.ttl_ms
    return _put(_write(cur, now, rev, lease=_extend(cur.lease, now + ttl)))


def renewed_in_memory(cmd: Renew, cur: Record | None, now: int, floor: int) -> Record | None:
    """A renewal answered from memory (docs/SPEC.md §5.2): the record with only
    its lease's expiry moved — version, revision and ``updated_at`` kept — or
    None when it must be written instead: the run is not held in memory, it
    asks for a longer ttl than the stored lease's (the restart rule extends
    by that), or its lease expired at or before ``floor`` (the restart rule
    only extends leases stored as live past the last flush). Raises the fence
    check's LedgerError as ``decide`` would."""
    if cur is None or out_of_range(cur) is not None:
        return None  # (a record past 2^53 - 1: ``decide`` refuses it)
    cur = _fence(cmd, cur)
    lease = cur.lease
    assert lease is not None
    ttl = lease.ttl_ms if cmd.ttl_ms is None else cmd.ttl_ms
    if ttl > lease.ttl_ms or lease.expires_at <= floor:
        return None
    return Record(
        cur.run_id, cur.version, cur.status, cur.attempt, cur.fencing_token, cur.created_at,
        cur.updated_at, _extend(lease, now + ttl), cur.checkpoint_ref, cur.outcome,
        cur.suspension, cur.revision, cur.schema,
    )


def take_lease(cur: Record, now: int, rev: int, floor: int | None, gap_ms: int
               ) -> Record | None:
    """A lease on a shard just taken from another coordinator, written: a
    lease stored as live past ``floor`` (None: every expiry was exact) is
    treated as renewed now (``renewed_at_start``); one live when the shard
    went unled is extended by ``gap_ms`` (``extend_lease``). None: neither."""
    lease = cur.lease
    if lease is None or is_terminal(cur.status):
        return None
    if out_of_range(cur) is not None or cur.version >= MAX_SAFE:
        return None
    until = lease.expires_at
    if floor is not None:
        renewed = renewed_at_start(cur, now, floor)
        if renewed is not None:
            until = renewed.lease.expires_at  # type: ignore[union-attr]
    if until == lease.expires_at and gap_ms > 0 and lease.expires_at > now - gap_ms:
        until = lease.expires_at + gap_ms
    if until == lease.expires_at:
        return None
    return _write(cur, now, rev, lease=_extend(lease, until))


def renewed_at_start(cur: Record, now: int, floor: int) -> Record | None:
    """The restart and takeover rule (docs/SPEC.md §4): a lease stored as live
    past ``floor`` (the last flush of expiries) may have been renewed from
    memory until the previous process stopped, so it is treated as renewed
    now — never before ``now`` + its ttl. None: nothing to extend."""
    lease = cur.lease
    if lease is None or cur.status is not Status.RUNNING or lease.expires_at <= floor:
        return None
    if lease.expires_at >= now + lease.ttl_ms:
        return None
    return replace(cur, lease=_extend(lease, now + lease.ttl_ms))


def _record_checkpoint(
    cmd: RecordCheckpoint, cur: Record | None, tombstone: int, now: int, rev: int
) -> Decision:
    cur = _fence(cmd, cur)
    assert cur.lease is not None
    return _put(
        _write(
            cur,
            now,
            rev,
            checkpoint_ref=CheckpointRef(cmd.key, cmd.snapshot_version, now),
            lease=_extend(cur.lease, now + cur.lease.ttl_ms),
        )
    )


def _suspend(cmd: Suspend, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    if _converged(cmd, cur, Status.SUSPENDED):
        assert cur is not None
        return _unchanged(cur)
    cur = _fence(cmd, cur)
    _check_transition(cur, Status.SUSPENDED)
    return _put(
        _write(
            cur,
            now,
            rev,
            status=Status.SUSPENDED,
            lease=None,
            suspension=Suspension(now, cmd.pending_approval_ids),
        )
    )


_DEFAULT_OUTCOME = {Status.COMPLETED: "ok", Status.CANCELLED: "cancelled"}


def _finish(cmd: Finish, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    if cmd.status not in _DEFAULT_OUTCOME and cmd.status is not Status.FAILED:
        raise validation("status", "must be COMPLETED, FAILED or CANCELLED")
    if cmd.status is Status.FAILED and cmd.outcome is None:
        raise validation("outcome", "is required when status is FAILED")
    if _converged(cmd, cur, cmd.status):
        assert cur is not None
        return _unchanged(cur)
    cur = _fence(cmd, cur)
    _check_transition(cur, cmd.status)
    outcome = cmd.outcome or Outcome(_DEFAULT_OUTCOME[cmd.status])
    return _put(_write(cur, now, rev, status=cmd.status, lease=None, outcome=outcome))


def _release(cmd: Release, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    if _converged(cmd, cur, Status.QUEUED):
        assert cur is not None
        return _unchanged(cur)
    cur = _fence(cmd, cur)
    _check_transition(cur, Status.QUEUED)
    return _put(_write(cur, now, rev, status=Status.QUEUED, lease=None))


def _not_found(run_id: str) -> LedgerError:
    return LedgerError(Code.RUN_NOT_FOUND, f"run {run_id!r} not found")


def _cancel(cmd: Cancel, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    if cur is None:
        raise _not_found(cmd.run_id)
    if cur.status is Status.CANCELLED:
        return _unchanged(cur)
    _check_transition(cur, Status.CANCELLED)
    return _put(
        _write(
            cur,
            now,
            rev,
            status=Status.CANCELLED,
            fencing_token=cur.fencing_token + 1,
            lease=None,
            suspension=None,
            outcome=Outcome("cancelled", cmd.message),
        )
    )


def _request_resume(
    cmd: RequestResume, cur: Record | None, tombstone: int, now: int, rev: int
) -> Decision:
    if cur is None:
        raise _not_found(cmd.run_id)
    if cur.status is Status.QUEUED:
        return _unchanged(cur)
    if is_terminal(cur.status):
        _check_transition(cur, Status.QUEUED)  # raises RUN_ALREADY_TERMINAL
    if cur.status is Status.RUNNING and cur.lease is not None and cur.lease.blocks_others(now):
        raise LedgerError(
            Code.RUN_LEASE_HELD, f"run {cmd.run_id!r} is running under a live lease", cur
        )
    return _put(_write(cur, now, rev, status=Status.QUEUED, lease=None, suspension=None))


def _delete_run(cmd: DeleteRun, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    if cur is None:
        raise _not_found(cmd.run_id)
    token = _last_token(cur)
    return Decision(Delete(cmd.run_id, token, rev), Deleted(True, rev, token))


def _retire(cmd: Retire, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    if cur is None or cur.version != cmd.version or not is_terminal(cur.status):
        return Decision(None, Deleted(False))  # gone, changed or reopened: keep it
    token = _last_token(cur)
    return Decision(Delete(cmd.run_id, token, rev), Deleted(True, rev, token))


# -- raw seam -----------------------------------------------------------------------


def _raw_create(cmd: RawCreate, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    if cmd.record.version != 1:
        raise validation("run.version", "must be 1 on create")
    if cur is not None:
        return Decision(None, Created(False, cur))
    if cmd.record.fencing_token <= tombstone:
        raise validation(
            "run.fencing_token",
            f"must be above {tombstone}, the last token of the deleted run with this id",
        )
    rec = replace(cmd.record, revision=rev)
    return Decision(Put(rec), Created(True, rec))


def _raw_cas(
    cmd: RawCompareAndSet, cur: Record | None, tombstone: int, now: int, rev: int
) -> Decision:
    if cmd.next.run_id != cmd.run_id:
        raise validation("next.run_id", "must equal run_id")
    if cmd.next.version != cmd.expected_version + 1:
        raise validation("next.version", "must be expected_version + 1")
    new_lease = cmd.next.lease
    if cmd.bound_to is not None and new_lease is not None:
        keeps = (cur is not None and cur.version == cmd.expected_version
                 and cur.lease is not None and cur.lease.owner == new_lease.owner)
        if not keeps and not owner_bound_ok(cmd.bound_to, new_lease.owner):
            raise owner_not_permitted(cmd.bound_to, new_lease.owner, "next.lease.owner")
    if cur is None or cur.version != cmd.expected_version:
        return Decision(None, Swapped(False, cur))
    _check_holder(cmd.bound_to, cur, now)
    if cmd.next.fencing_token < cur.fencing_token:
        raise LedgerError(
            Code.RUN_VALIDATION_ERROR,
            f"next.fencing_token: must not go backwards (stored {cur.fencing_token})",
            cur,
            field="next.fencing_token",
        )
    if (
        new_lease is not None
        and (cur.lease is None or cur.lease.owner != new_lease.owner)
        and cmd.next.fencing_token == cur.fencing_token
    ):
        # docs/SPEC.md §1: the token moves whenever ownership changes hands. A lease
        # granted to a new holder under the same token would let two handles
        # share it (and make a stale handle's converging retry look done).
        raise LedgerError(
            Code.RUN_VALIDATION_ERROR,
            "next.fencing_token: must move when the lease is granted to a new holder "
            f"(stored {cur.fencing_token})",
            cur,
            field="next.fencing_token",
        )
    rec = replace(cmd.next, revision=rev)
    return Decision(Put(rec), Swapped(True, rec))


def _check_holder(bound_to: str | None, cur: Record, now: int) -> None:
    """A bound caller (identities on, no admin) may change through the raw
    seam only a run that is free, expired, or held by an owner it may use:
    as an Acquire cannot take another's live lease, a raw write cannot."""
    lease = cur.lease
    if (bound_to is None or lease is None or not lease.blocks_others(now)
            or owner_bound_ok(bound_to, lease.owner)):
        return
    raise LedgerError(
        Code.OWNER_NOT_PERMITTED,
        f"run_id: run {cur.run_id!r} is held under a live lease by {lease.owner!r}, an "
        f"owner {bound_to!r} may not use; without the admin role the raw seam changes "
        "only runs that are free, expired or held by the caller's own owners",
        cur,
        field="run_id",
        metadata={"owner": lease.owner, "principal": bound_to},
    )


def _raw_delete(cmd: RawDelete, cur: Record | None, tombstone: int, now: int, rev: int) -> Decision:
    if cur is None:
        return Decision(None, Deleted(False))
    _check_holder(cmd.bound_to, cur, now)
    token = _last_token(cur)
    return Decision(Delete(cmd.run_id, token, rev), Deleted(True, rev, token))


_DECIDERS: dict[type, Callable[[Any, Record | None, int, int, int], Decision]] = {
    Acquire: _acquire,
    Renew: _renew,
    RecordCheckpoint: _record_checkpoint,
    Suspend: _suspend,
    Finish: _finish,
    Release: _release,
    Cancel: _cancel,
    RequestResume: _request_resume,
    DeleteRun: _delete_run,
    Retire: _retire,
    RawCreate: _raw_create,
    RawCompareAndSet: _raw_cas,
    RawDelete: _raw_delete,
}
_REMOVES = frozenset({DeleteRun, Retire, RawDelete})


def _iso(ms: int) -> str:
    """Milliseconds since the epoch as ISO 8601 UTC (for messages)."""
    try:
        return (datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")[:-6]
                + "Z")
    except (ValueError, OverflowError, OSError):  # past year 9999 (a raw record's lease)
        return f"{ms} ms after the epoch"
