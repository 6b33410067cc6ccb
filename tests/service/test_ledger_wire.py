"""Every Ledger RPC over a real loopback port, every error reason on the wire."""

from __future__ import annotations

import grpc
import pytest
from _wire import expect

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb

OK = grpc.StatusCode
RUNNING, QUEUED, SUSPENDED = rpb.RUN_STATUS_RUNNING, rpb.RUN_STATUS_QUEUED, rpb.RUN_STATUS_SUSPENDED
COMPLETED, FAILED, CANCELLED = (
    rpb.RUN_STATUS_COMPLETED,
    rpb.RUN_STATUS_FAILED,
    rpb.RUN_STATUS_CANCELLED,
)


def acquire(ledger, run_id="r1", owner="w1", **kw) -> rpb.Run:  # type: ignore[no-untyped-def]
    return ledger.Acquire(pb.AcquireRequest(run_id=run_id, owner=owner, **kw)).run


def h(run: rpb.Run) -> dict:  # type: ignore[type-arg]
    return {"run_id": run.run_id, "owner": run.lease.owner, "fencing_token": run.fencing_token}


def test_acquire_creates_with_default_ttl_of_exactly_60s(ledger, clock) -> None:  # type: ignore[no-untyped-def]
    run = acquire(ledger)
    assert (run.version, run.status, run.attempt, run.fencing_token) == (1, RUNNING, 1, 1)
    assert run.lease.owner == "w1"
    assert run.lease.ttl_ms == 60_000
    acquired = run.lease.acquired_at.ToMilliseconds()
    assert acquired == clock.now_ms()
    assert run.lease.expires_at.ToMilliseconds() - acquired == 60_000
    assert not run.HasField("checkpoint_ref") and not run.HasField("outcome")
    assert not run.HasField("suspension")
    assert run.revision == 1 and run.schema == 1


def test_single_active_owner_and_takeover_after_expiry(ledger, clock) -> None:  # type: ignore[no-untyped-def]
    first = acquire(ledger, lease_ttl_ms=5_000)
    e = expect(
        ledger.Acquire,
        pb.AcquireRequest(run_id="r1", owner="w2"),
        OK.FAILED_PRECONDITION,
        "RUN_LEASE_HELD",
        has_record=True,
    )
    assert e.record is not None and e.record.lease.owner == "w1"
    clock.advance(4_999)
    expect(
        ledger.Acquire,
        pb.AcquireRequest(run_id="r1", owner="w2"),
        OK.FAILED_PRECONDITION,
        "RUN_LEASE_HELD",
    )
    clock.advance(1)  # exactly T + ttl: expired
    second = acquire(ledger, owner="w2")
    assert second.fencing_token > first.fencing_token
    assert second.attempt == first.attempt + 1
    # the first handle is fenced: Renew and Finish fail, the record stays running
    e = expect(
        ledger.Renew,
        pb.RenewRequest(**h(first)),
        OK.FAILED_PRECONDITION,
        "RUN_LEASE_LOST",
        has_record=True,
    )
    assert e.record is not None and e.record.fencing_token == second.fencing_token
    expect(
        ledger.Finish,
        pb.FinishRequest(**h(first), status=COMPLETED),
        OK.FAILED_PRECONDITION,
        "RUN_LEASE_LOST",
    )
    now = ledger.GetRun(pb.GetRunRequest(run_id="r1")).run
    assert now.status == RUNNING and now.lease.owner == "w2"
    done = ledger.Finish(pb.FinishRequest(**h(second), status=COMPLETED)).run
    assert done.status == COMPLETED and done.outcome.code == "ok" and not done.HasField("lease")


def test_renew_and_checkpoint(ledger, clock) -> None:  # type: ignore[no-untyped-def]
    run = acquire(ledger, lease_ttl_ms=1_000)
    clock.advance(700)
    renewed = ledger.Renew(pb.RenewRequest(**h(run))).run
    assert renewed.lease.expires_at.ToMilliseconds() == clock.now_ms() + 1_000
    assert renewed.lease.acquired_at == run.lease.acquired_at
    # answered from memory: the expiry moves, the version and revision do not
    assert (renewed.version, renewed.revision) == (run.version, run.revision)
    assert ledger.GetRun(pb.GetRunRequest(run_id=run.run_id)).run == renewed
    longer = ledger.Renew(pb.RenewRequest(**h(run), lease_ttl_ms=5_000)).run
    assert longer.lease.expires_at.ToMilliseconds() == clock.now_ms() + 5_000
    # a longer ttl than the stored lease's is written: the restart rule extends by that
    assert longer.version == run.version + 1 and longer.revision > run.revision
    clock.advance(10)
    ck = ledger.RecordCheckpoint(
        pb.RecordCheckpointRequest(**h(run), key="ck/1", snapshot_version=3)
    ).run
    assert (ck.checkpoint_ref.key, ck.checkpoint_ref.snapshot_version) == ("ck/1", 3)
    assert ck.checkpoint_ref.saved_at.ToMilliseconds() == clock.now_ms()
    assert ck.lease.expires_at.ToMilliseconds() == clock.now_ms() + 1_000


def test_suspend_resume_acquire(ledger) -> None:  # type: ignore[no-untyped-def]
    run = acquire(ledger)
    s = ledger.Suspend(pb.SuspendRequest(**h(run), pending_approval_ids=["b", "a", "c"])).run
    assert s.status == SUSPENDED and not s.HasField("lease")
    assert list(s.suspension.pending_approval_ids) == ["b", "a", "c"]
    again = ledger.Suspend(pb.SuspendRequest(**h(run), pending_approval_ids=["b", "a", "c"])).run
    assert again == s  # convergence: the same handle already did it
    e = expect(
        ledger.Acquire,
        pb.AcquireRequest(run_id="r1", owner="w2"),
        OK.FAILED_PRECONDITION,
        "RUN_SUSPENDED",
        has_record=True,
    )
    assert e.record is not None and e.record.status == SUSPENDED
    r1 = ledger.RequestResume(pb.RequestResumeRequest(run_id="r1")).run
    r2 = ledger.RequestResume(pb.RequestResumeRequest(run_id="r1")).run
    assert r1.status == QUEUED and r1 == r2  # two resumes converge
    assert not r1.HasField("suspension") and r1.fencing_token == run.fencing_token
    back = acquire(ledger, owner="w2")
    assert back.fencing_token == run.fencing_token + 1 and back.attempt == run.attempt


def test_completed_run_refuses_acquire_resume_cancel(ledger) -> None:  # type: ignore[no-untyped-def]
    run = acquire(ledger)
    ledger.Finish(pb.FinishRequest(**h(run), status=COMPLETED))
    for call, req in [
        (ledger.Acquire, pb.AcquireRequest(run_id="r1", owner="w1")),
        (ledger.RequestResume, pb.RequestResumeRequest(run_id="r1")),
        (ledger.Cancel, pb.CancelRequest(run_id="r1")),
    ]:
        e = expect(call, req, OK.FAILED_PRECONDITION, "RUN_ALREADY_TERMINAL", has_record=True)
        assert e.record is not None and e.record.status == COMPLETED


def test_operator_cancel_fences_the_running_worker(ledger) -> None:  # type: ignore[no-untyped-def]
    run = acquire(ledger)
    c = ledger.Cancel(pb.CancelRequest(run_id="r1", message="operator said so")).run
    assert c.status == CANCELLED and c.fencing_token == run.fencing_token + 1
    assert (c.outcome.code, c.outcome.message) == ("cancelled", "operator said so")
    expect(
        ledger.RecordCheckpoint,
        pb.RecordCheckpointRequest(**h(run), key="k"),
        OK.FAILED_PRECONDITION,
        "RUN_LEASE_LOST",
        has_record=True,
    )
    assert ledger.Cancel(pb.CancelRequest(run_id="r1")).run == c  # already cancelled: unchanged
    expect(
        ledger.Cancel,
        pb.CancelRequest(run_id="nope"),
        OK.NOT_FOUND,
        "RUN_NOT_FOUND",
        has_record=False,
    )


def test_finish_failed_and_release(ledger) -> None:  # type: ignore[no-untyped-def]
    run = acquire(ledger)
    expect(
        ledger.Finish,
        pb.FinishRequest(**h(run), status=FAILED),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="outcome",
    )
    rel = ledger.Release(pb.ReleaseRequest(**h(run))).run
    assert rel.status == QUEUED and not rel.HasField("lease")
    assert ledger.Release(pb.ReleaseRequest(**h(run))).run == rel  # converges
    run2 = acquire(ledger, owner="w2")
    assert run2.attempt == run.attempt  # released, not taken over
    expect(ledger.Release, pb.ReleaseRequest(**h(run)), OK.FAILED_PRECONDITION, "RUN_LEASE_LOST")
    f = ledger.Finish(
        pb.FinishRequest(**h(run2), status=FAILED, outcome=rpb.Outcome(code="boom", message="m"))
    ).run
    assert (f.status, f.outcome.code, f.outcome.message) == (FAILED, "boom", "m")


def test_invalid_transition_reason(ledger, store, clock) -> None:  # type: ignore[no-untyped-def]
    # Only the raw seam can build a queued record that still carries a lease.
    now = clock.now_ms()
    odd = rpb.Run(
        schema=1,
        run_id="odd",
        version=1,
        status=QUEUED,
        attempt=1,
        fencing_token=1,
        lease=rpb.Lease(owner="w1", ttl_ms=1000),
    )
    odd.created_at.FromMilliseconds(now)
    odd.updated_at.FromMilliseconds(now)
    odd.lease.acquired_at.FromMilliseconds(now)
    odd.lease.expires_at.FromMilliseconds(now + 1000)
    assert store.Create(spb.CreateRequest(run=odd)).created
    expect(
        ledger.Renew,
        pb.RenewRequest(run_id="odd", owner="w1", fencing_token=1),
        OK.FAILED_PRECONDITION,
        "RUN_INVALID_TRANSITION",
        has_record=True,
    )


def test_get_list_and_pagination(ledger) -> None:  # type: ignore[no-untyped-def]
    expect(ledger.GetRun, pb.GetRunRequest(run_id="none"), OK.NOT_FOUND, "RUN_NOT_FOUND")
    ids = [f"run-{i:03d}" for i in range(25)]
    for i, rid in enumerate(reversed(ids)):
        run = acquire(ledger, run_id=rid, owner="a" if i % 2 else "b")
        if i % 5 == 0:
            ledger.Finish(pb.FinishRequest(**h(run), status=COMPLETED))
    got = ledger.GetRun(pb.GetRunRequest(run_id="run-003"))
    assert got.run.run_id == "run-003" and got.revision >= got.run.revision
    seen, token = [], ""
    while True:
        page = ledger.ListRuns(pb.ListRunsRequest(page_size=7, page_token=token))
        seen += [r.run_id for r in page.runs]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids
    done = ledger.ListRuns(pb.ListRunsRequest(statuses=[COMPLETED], page_size=100)).runs
    assert len(done) == 5 and all(r.status == COMPLETED for r in done)
    mine = ledger.ListRuns(pb.ListRunsRequest(owner="a", statuses=[RUNNING])).runs
    assert mine and all(r.lease.owner == "a" for r in mine)
    first = ledger.ListRuns(pb.ListRunsRequest(page_size=2))
    expect(
        ledger.ListRuns,
        pb.ListRunsRequest(page_size=2, owner="a", page_token=first.next_page_token),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="page_token",
    )
    expect(
        ledger.ListRuns,
        pb.ListRunsRequest(page_token="garbage!"),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="page_token",
    )
    expect(
        ledger.ListRuns,
        pb.ListRunsRequest(page_size=1001),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="page_size",
    )
    expect(
        ledger.ListRuns,
        pb.ListRunsRequest(statuses=[99]),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="statuses[0]",
    )


def test_delete_then_acquire_continues_token_sequence(ledger, server) -> None:  # type: ignore[no-untyped-def]
    run = acquire(ledger)
    run = acquire(ledger)  # same owner again: token 2
    assert run.fencing_token == 2
    d = ledger.DeleteRun(pb.DeleteRunRequest(run_id="r1"))
    assert d.fencing_token == 2 and d.revision > run.revision
    expect(ledger.GetRun, pb.GetRunRequest(run_id="r1"), OK.NOT_FOUND, "RUN_NOT_FOUND")
    expect(ledger.Renew, pb.RenewRequest(**h(run)), OK.FAILED_PRECONDITION, "RUN_LEASE_LOST")
    expect(ledger.DeleteRun, pb.DeleteRunRequest(run_id="r1"), OK.NOT_FOUND, "RUN_NOT_FOUND")
    server.restart()  # the tombstone is durable
    again = acquire(ledger, owner="w9")
    assert again.fencing_token == 3 and again.version == 1 and again.attempt == 1


def test_validate_fence(ledger, clock) -> None:  # type: ignore[no-untyped-def]
    run = acquire(ledger, lease_ttl_ms=1_000)
    v = ledger.ValidateFence(pb.ValidateFenceRequest(run_id="r1", fencing_token=1))
    assert (v.current, v.found, v.fencing_token, v.status) == (True, True, 1, RUNNING)
    clock.advance(1_000)
    acquire(ledger, owner="w2")
    v = ledger.ValidateFence(pb.ValidateFenceRequest(run_id="r1", fencing_token=run.fencing_token))
    assert (v.current, v.found, v.fencing_token) == (False, True, 2)
    v = ledger.ValidateFence(pb.ValidateFenceRequest(run_id="nope", fencing_token=1))
    assert (v.current, v.found) == (False, False)
    expect(
        ledger.ValidateFence,
        pb.ValidateFenceRequest(run_id="r1", fencing_token=0),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="fencing_token",
    )


def test_lock_delay_on_the_wire(ledger, clock) -> None:  # type: ignore[no-untyped-def]
    acquire(ledger, run_id="d", lease_ttl_ms=1_000, lock_delay_ms=2_000)
    clock.advance(1_000)  # expired, but inside the lock-delay
    expect(
        ledger.Acquire,
        pb.AcquireRequest(run_id="d", owner="w2"),
        OK.FAILED_PRECONDITION,
        "RUN_LEASE_HELD",
    )
    expect(
        ledger.RequestResume,
        pb.RequestResumeRequest(run_id="d"),
        OK.FAILED_PRECONDITION,
        "RUN_LEASE_HELD",
    )
    clock.advance(1_999)
    expect(
        ledger.Acquire,
        pb.AcquireRequest(run_id="d", owner="w2"),
        OK.FAILED_PRECONDITION,
        "RUN_LEASE_HELD",
    )
    clock.advance(1)  # expires_at + lock_delay: free
    assert acquire(ledger, run_id="d", owner="w2").lease.owner == "w2"
    # a released run is free at once
    r = acquire(ledger, run_id="e", lease_ttl_ms=1_000, lock_delay_ms=60_000)
    ledger.Release(pb.ReleaseRequest(**h(r)))
    assert acquire(ledger, run_id="e", owner="w3").lease.owner == "w3"


@pytest.mark.parametrize("ttl", [99, 86_400_001, 0, -5])
def test_ttl_out_of_range(ledger, ttl: int) -> None:  # type: ignore[no-untyped-def]
    expect(
        ledger.Acquire,
        pb.AcquireRequest(run_id="r", owner="w", lease_ttl_ms=ttl),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="lease_ttl_ms",
    )


def test_ttl_bounds_accepted(ledger) -> None:  # type: ignore[no-untyped-def]
    assert acquire(ledger, run_id="lo", lease_ttl_ms=100).lease.ttl_ms == 100
    assert acquire(ledger, run_id="hi", lease_ttl_ms=86_400_000).lease.ttl_ms == 86_400_000
