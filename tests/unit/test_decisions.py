"""Table tests for the pure decisions (docs/SPEC.md §5.1-§5.3, §5.6, §7)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.records import Lease, Outcome, Record, Status, Suspension

NOW = 1_000_000
TTL = 10_000


def rec(
    status: Status = Status.RUNNING,
    *,
    owner: str | None = "w1",
    token: int = 3,
    attempt: int = 2,
    version: int = 5,
    expires: int = NOW + TTL,
    delay: int = 0,
    **kw: object,
) -> Record:
    lease = Lease(owner, NOW - 1000, expires, TTL, delay) if owner is not None else None
    return Record(
        "r", version, status, attempt, token, NOW - 5000, NOW - 1000, lease=lease, revision=7, **kw
    )  # type: ignore[arg-type]


def ok(cmd: L.Command, cur: Record | None, tomb: int = 0, now: int = NOW) -> L.Decision:
    return L.decide(cmd, cur, tomb, now, 100)


def refused(cmd: L.Command, cur: Record | None, code: Code, now: int = NOW) -> LedgerError:
    with pytest.raises(LedgerError) as ei:
        L.decide(cmd, cur, 0, now, 100)
    assert ei.value.code is code, ei.value
    return ei.value


def written(d: L.Decision, cur: Record | None) -> Record:
    assert isinstance(d.change, L.Put)
    new = d.change.record
    assert d.result == new
    assert new.revision == 100
    assert new.updated_at >= NOW
    if cur is not None:
        assert new.created_at == cur.created_at
    assert new.version == (cur.version + 1 if cur else 1)
    return new


# -- Acquire (§5.1) -------------------------------------------------------------------


def test_acquire_creates_a_new_run() -> None:
    new = written(ok(L.Acquire("r", "w1", TTL), None), None)
    assert (new.status, new.attempt, new.fencing_token, new.version) == (Status.RUNNING, 1, 1, 1)
    assert new.lease == Lease("w1", NOW, NOW + TTL, TTL, 0)
    assert new.created_at == NOW


def test_acquire_new_run_continues_above_a_tombstone() -> None:
    new = written(ok(L.Acquire("r", "w1", TTL), None, tomb=41), None)
    assert new.fencing_token == 42


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.FAILED, Status.CANCELLED])
def test_acquire_terminal_refused(status: Status) -> None:
    e = refused(L.Acquire("r", "w2", TTL), rec(status, owner=None), Code.RUN_ALREADY_TERMINAL)
    assert e.record is not None and e.record.status is status


def test_acquire_suspended_refused() -> None:
    refused(L.Acquire("r", "w2", TTL), rec(Status.SUSPENDED, owner=None), Code.RUN_SUSPENDED)


def test_acquire_live_lease_of_another_owner_refused() -> None:
    refused(L.Acquire("r", "w2", TTL), rec(), Code.RUN_LEASE_HELD)
    refused(L.Acquire("r", "w2", TTL), rec(), Code.RUN_LEASE_HELD, now=NOW + TTL - 1)


def test_acquire_takes_over_at_exactly_expiry_with_attempt_plus_one() -> None:
    cur = rec()
    new = written(ok(L.Acquire("r", "w2", TTL), cur, now=NOW + TTL), cur)
    assert new.fencing_token == cur.fencing_token + 1
    assert new.attempt == cur.attempt + 1
    assert new.lease is not None and new.lease.owner == "w2"


def test_acquire_same_owner_own_live_lease_new_token_same_attempt() -> None:
    cur = rec()
    new = written(ok(L.Acquire("r", "w1", TTL), cur), cur)
    assert (new.fencing_token, new.attempt) == (cur.fencing_token + 1, cur.attempt)


def test_acquire_same_owner_expired_lease_counts_as_takeover() -> None:
    cur = rec()
    new = written(ok(L.Acquire("r", "w1", TTL), cur, now=NOW + TTL), cur)
    assert new.attempt == cur.attempt + 1


def test_acquire_queued_without_lease_keeps_attempt() -> None:
    cur = rec(Status.QUEUED, owner=None)
    new = written(ok(L.Acquire("r", "w2", TTL), cur), cur)
    assert (new.status, new.attempt, new.fencing_token) == (Status.RUNNING, cur.attempt, 4)


# -- lock-delay (§5.6) ------------------------------------------------------------------


def test_lock_delay_blocks_others_until_expiry_plus_delay() -> None:
    cur = rec(delay=5000)
    refused(L.Acquire("r", "w2", TTL), cur, Code.RUN_LEASE_HELD, now=NOW + TTL)
    refused(L.Acquire("r", "w2", TTL), cur, Code.RUN_LEASE_HELD, now=NOW + TTL + 4999)
    new = written(ok(L.Acquire("r", "w2", TTL), cur, now=NOW + TTL + 5000), cur)
    assert new.lease is not None and new.lease.owner == "w2"


def test_lock_delay_counts_for_request_resume() -> None:
    cur = rec(delay=5000)
    refused(L.RequestResume("r"), cur, Code.RUN_LEASE_HELD, now=NOW + TTL + 10)
    assert ok(L.RequestResume("r"), cur, now=NOW + TTL + 5000).result.status is Status.QUEUED  # type: ignore[union-attr]


def test_lock_delay_is_stored_on_the_lease() -> None:
    new = written(ok(L.Acquire("r", "w1", TTL, lock_delay_ms=777), None), None)
    assert new.lease is not None and new.lease.lock_delay_ms == 777


def test_release_frees_a_lock_delayed_run_at_once() -> None:
    cur = rec(delay=5000)
    released = written(ok(L.Release("r", "w1", 3), cur), cur)
    new = written(ok(L.Acquire("r", "w2", TTL), released), released)
    assert new.lease is not None and new.lease.owner == "w2"


# -- fence check (§5.2) -----------------------------------------------------------------

HANDLE_CMDS = [
    lambda tok, owner="w1": L.Renew("r", owner, tok),
    lambda tok, owner="w1": L.RecordCheckpoint("r", owner, tok, "k", 1),
    lambda tok, owner="w1": L.Suspend("r", owner, tok, ("a",)),
    lambda tok, owner="w1": L.Finish("r", owner, tok, Status.COMPLETED),
    lambda tok, owner="w1": L.Release("r", owner, tok),
]


@pytest.mark.parametrize("make", HANDLE_CMDS)
def test_fence_stale_token_is_lease_lost(make) -> None:  # type: ignore[no-untyped-def]
    e = refused(make(2), rec(), Code.RUN_LEASE_LOST)
    assert e.record is not None and e.record.fencing_token == 3


@pytest.mark.parametrize("make", HANDLE_CMDS)
def test_fence_other_owner_is_lease_lost(make) -> None:  # type: ignore[no-untyped-def]
    refused(make(3, "w2"), rec(), Code.RUN_LEASE_LOST)


@pytest.mark.parametrize("make", HANDLE_CMDS)
def test_fence_missing_record_is_lease_lost(make) -> None:  # type: ignore[no-untyped-def]
    refused(make(3), None, Code.RUN_LEASE_LOST)


@pytest.mark.parametrize("make", HANDLE_CMDS)
def test_fence_does_not_check_expiry(make) -> None:  # type: ignore[no-untyped-def]
    cur = rec()
    written(ok(make(3), cur, now=NOW + 10 * TTL), cur)


def test_renew_extends_from_now_keeping_acquired_at() -> None:
    cur = rec()
    new = written(ok(L.Renew("r", "w1", 3), cur, now=NOW), cur)
    assert new.lease == replace(cur.lease, expires_at=NOW + TTL)  # type: ignore[type-var]
    new2 = written(ok(L.Renew("r", "w1", 3, ttl_ms=500), cur), cur)
    assert new2.lease is not None and new2.lease.expires_at == NOW + 500
    assert new2.lease.acquired_at == cur.lease.acquired_at  # type: ignore[union-attr]
    assert new2.fencing_token == cur.fencing_token


def test_record_checkpoint_sets_ref_and_renews() -> None:
    cur = rec(expires=NOW + 5)
    new = written(ok(L.RecordCheckpoint("r", "w1", 3, "ck/1", 9), cur), cur)
    assert new.checkpoint_ref is not None
    assert (
        new.checkpoint_ref.key,
        new.checkpoint_ref.snapshot_version,
        new.checkpoint_ref.saved_at,
    ) == ("ck/1", 9, NOW)
    assert new.lease is not None and new.lease.expires_at == NOW + TTL


def test_suspend() -> None:
    cur = rec()
    new = written(ok(L.Suspend("r", "w1", 3, ("a", "b")), cur), cur)
    assert new.status is Status.SUSPENDED and new.lease is None
    assert new.suspension == Suspension(NOW, ("a", "b"))
    assert new.fencing_token == cur.fencing_token


@pytest.mark.parametrize("status,code", [(Status.COMPLETED, "ok"), (Status.CANCELLED, "cancelled")])
def test_finish_default_outcomes(status: Status, code: str) -> None:
    cur = rec()
    new = written(ok(L.Finish("r", "w1", 3, status), cur), cur)
    assert new.status is status and new.lease is None
    assert new.outcome == Outcome(code)
    assert new.fencing_token == cur.fencing_token


def test_finish_failed_requires_outcome() -> None:
    e = refused(L.Finish("r", "w1", 3, Status.FAILED), rec(), Code.RUN_VALIDATION_ERROR)
    assert e.field == "outcome"
    cur = rec()
    new = written(ok(L.Finish("r", "w1", 3, Status.FAILED, Outcome("boom", "m")), cur), cur)
    assert new.outcome == Outcome("boom", "m")


@pytest.mark.parametrize("status", [Status.QUEUED, Status.RUNNING, Status.SUSPENDED])
def test_finish_status_must_be_terminal(status: Status) -> None:
    refused(L.Finish("r", "w1", 3, status), rec(), Code.RUN_VALIDATION_ERROR)


def test_release() -> None:
    cur = rec()
    new = written(ok(L.Release("r", "w1", 3), cur), cur)
    assert new.status is Status.QUEUED and new.lease is None
    assert (new.attempt, new.fencing_token) == (cur.attempt, cur.fencing_token)


# -- convergence of lease-dropping commands -----------------------------------------------


@pytest.mark.parametrize(
    "cmd",
    [
        L.Suspend("r", "w1", 3, ("a",)),
        L.Finish("r", "w1", 3, Status.COMPLETED),
        L.Finish("r", "w1", 3, Status.FAILED, Outcome("x")),
        L.Release("r", "w1", 3),
    ],
)
def test_retry_by_same_handle_converges_then_is_lost_after_token_moved(cmd: L.Command) -> None:
    cur = rec()
    first = written(ok(cmd, cur), cur)
    again = ok(cmd, first)
    assert again.change is None and again.result == first
    # the token moved on (operator cancel would be terminal; use a raw bump)
    moved = replace(first, fencing_token=4, version=first.version + 1)
    refused(cmd, moved, Code.RUN_LEASE_LOST)


def test_release_retry_after_another_acquire_is_lost() -> None:
    cur = rec()
    released = written(ok(L.Release("r", "w1", 3), cur), cur)
    taken = written(ok(L.Acquire("r", "w2", TTL), released), released)
    refused(L.Release("r", "w1", 3), taken, Code.RUN_LEASE_LOST)


def test_finish_retry_with_other_status_does_not_converge() -> None:
    cur = rec()
    done = written(ok(L.Finish("r", "w1", 3, Status.COMPLETED), cur), cur)
    refused(L.Finish("r", "w1", 3, Status.CANCELLED), done, Code.RUN_LEASE_LOST)


# -- operator commands (§5.3) --------------------------------------------------------------


def test_cancel_not_found() -> None:
    refused(L.Cancel("r"), None, Code.RUN_NOT_FOUND)


@pytest.mark.parametrize("status", [Status.QUEUED, Status.RUNNING, Status.SUSPENDED])
def test_cancel_moves_token_drops_lease(status: Status) -> None:
    cur = rec(status, owner="w1" if status is Status.RUNNING else None)
    new = written(ok(L.Cancel("r", "stop"), cur), cur)
    assert new.status is Status.CANCELLED and new.lease is None
    assert new.fencing_token == cur.fencing_token + 1
    assert new.outcome == Outcome("cancelled", "stop")


def test_cancel_already_cancelled_is_unchanged() -> None:
    cur = rec(Status.CANCELLED, owner=None)
    d = ok(L.Cancel("r"), cur)
    assert d.change is None and d.result == cur


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.FAILED])
def test_cancel_other_terminal_refused(status: Status) -> None:
    refused(L.Cancel("r"), rec(status, owner=None), Code.RUN_ALREADY_TERMINAL)


def test_request_resume_branches() -> None:
    refused(L.RequestResume("r"), None, Code.RUN_NOT_FOUND)
    queued = rec(Status.QUEUED, owner=None)
    d = ok(L.RequestResume("r"), queued)
    assert d.change is None and d.result == queued
    for t in (Status.COMPLETED, Status.FAILED, Status.CANCELLED):
        refused(L.RequestResume("r"), rec(t, owner=None), Code.RUN_ALREADY_TERMINAL)
    refused(L.RequestResume("r"), rec(), Code.RUN_LEASE_HELD)
    susp = rec(Status.SUSPENDED, owner=None, suspension=Suspension(NOW, ("a",)))
    new = written(ok(L.RequestResume("r"), susp), susp)
    assert (new.status, new.lease, new.suspension) == (Status.QUEUED, None, None)
    assert new.fencing_token == susp.fencing_token
    expired = rec()
    new = written(ok(L.RequestResume("r"), expired, now=NOW + TTL), expired)
    assert new.status is Status.QUEUED and new.lease is None
    assert new.fencing_token == expired.fencing_token


def test_delete_run() -> None:
    refused(L.DeleteRun("r"), None, Code.RUN_NOT_FOUND)
    d = ok(L.DeleteRun("r"), rec())
    assert d.change == L.Delete("r", 3, 100)
    assert d.result == L.Deleted(True, 100, 3)


# -- raw seam (§7) --------------------------------------------------------------------------


def test_raw_create() -> None:
    fresh = replace(rec(), version=1)
    d = ok(L.RawCreate(fresh), None)
    assert d.result == L.Created(True, replace(fresh, revision=100))
    existing = rec()
    d = ok(L.RawCreate(fresh), existing)
    assert d.change is None and d.result == L.Created(False, existing)
    refused(L.RawCreate(replace(fresh, version=2)), None, Code.RUN_VALIDATION_ERROR)


def test_raw_create_cannot_reuse_a_deleted_token() -> None:
    fresh = replace(rec(), version=1, fencing_token=5)
    with pytest.raises(LedgerError) as ei:
        L.decide(L.RawCreate(fresh), None, 5, NOW, 1)
    assert ei.value.field == "run.fencing_token"
    assert L.decide(L.RawCreate(fresh), None, 4, NOW, 1).change is not None


def test_raw_cas() -> None:
    cur = rec()
    nxt = replace(cur, version=6, attempt=9)
    d = ok(L.RawCompareAndSet("r", 5, nxt), cur)
    assert d.result == L.Swapped(True, replace(nxt, revision=100))
    d = ok(L.RawCompareAndSet("r", 4, replace(nxt, version=5)), cur)
    assert d.change is None and d.result == L.Swapped(False, cur)
    d = ok(L.RawCompareAndSet("r", 5, nxt), None)
    assert d.change is None and d.result == L.Swapped(False, None)
    e = refused(L.RawCompareAndSet("r", 5, replace(nxt, version=7)), cur, Code.RUN_VALIDATION_ERROR)
    assert e.field == "next.version"
    e = refused(
        L.RawCompareAndSet("r", 5, replace(nxt, run_id="q")), cur, Code.RUN_VALIDATION_ERROR
    )
    assert e.field == "next.run_id"
    e = refused(
        L.RawCompareAndSet("r", 5, replace(nxt, fencing_token=2)), cur, Code.RUN_VALIDATION_ERROR
    )
    assert e.field == "next.fencing_token"


def test_raw_delete() -> None:
    d = ok(L.RawDelete("r"), None)
    assert d.change is None and d.result == L.Deleted(False)
    d = ok(L.RawDelete("r"), rec())
    assert d.change == L.Delete("r", 3, 100)


def test_raw_cas_granting_a_lease_to_a_new_holder_must_move_the_token() -> None:
    cur = rec()  # running, w1, token 3
    stolen = replace(cur, version=6, lease=replace(cur.lease, owner="thief"))  # type: ignore[type-var]
    e = refused(L.RawCompareAndSet("r", 5, stolen), cur, Code.RUN_VALIDATION_ERROR)
    assert e.field == "next.fencing_token"
    ok(L.RawCompareAndSet("r", 5, replace(stolen, fencing_token=4)), cur)
    released = replace(cur, status=Status.QUEUED, lease=None)
    regrant = replace(cur, version=released.version + 1)  # w1 again, same token: also new
    refused(L.RawCompareAndSet("r", released.version, regrant), released,
            Code.RUN_VALIDATION_ERROR)
    renewed = replace(cur, version=6, lease=replace(cur.lease, expires_at=NOW + 99))  # type: ignore[type-var]
    ok(L.RawCompareAndSet("r", 5, renewed), cur)  # same holder: no move needed
