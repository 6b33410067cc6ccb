"""docs/SPEC.md §5.5: a repeated request id gets the original answer, also after a restart."""

from __future__ import annotations

import grpc
from _records import bump, raw_run
from _wire import expect

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb

OK = grpc.StatusCode


def test_cas_retry_answers_swapped_true_again_and_changes_nothing(server, store) -> None:  # type: ignore[no-untyped-def]
    v1 = store.Create(spb.CreateRequest(run=raw_run())).run
    req = spb.CompareAndSetRequest(
        run_id="s1", expected_version=1, next=bump(v1, attempt=5), request_id="cas-1"
    )
    first = store.CompareAndSet(req)
    assert first.swapped
    again = store.CompareAndSet(req)
    assert again == first
    server.restart()
    after = store.CompareAndSet(req)
    assert after == first
    stored = store.Get(spb.GetRequest(run_id="s1")).run
    assert stored.version == 2 and stored.revision == first.run.revision
    # without the id the same request is a lost race
    req.request_id = ""
    assert not store.CompareAndSet(req).swapped


def test_acquire_retry_does_not_acquire_twice(server, ledger) -> None:  # type: ignore[no-untyped-def]
    req = pb.AcquireRequest(run_id="r", owner="w", request_id="acq-1")
    first = ledger.Acquire(req).run
    assert ledger.Acquire(req).run == first
    server.restart()
    assert ledger.Acquire(req).run == first
    assert ledger.GetRun(pb.GetRunRequest(run_id="r")).run.fencing_token == first.fencing_token


def test_finish_retry_returns_the_original(server, ledger) -> None:  # type: ignore[no-untyped-def]
    run = ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w")).run
    req = pb.FinishRequest(
        run_id="r",
        owner="w",
        fencing_token=run.fencing_token,
        status=rpb.RUN_STATUS_COMPLETED,
        request_id="fin-1",
    )
    first = ledger.Finish(req).run
    server.restart()
    assert ledger.Finish(req).run == first
    assert ledger.GetRun(pb.GetRunRequest(run_id="r")).run.version == first.version


def test_cancel_retry_moves_the_token_once(server, ledger) -> None:  # type: ignore[no-untyped-def]
    run = ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w")).run
    req = pb.CancelRequest(run_id="r", message="m", request_id="can-1")
    first = ledger.Cancel(req).run
    assert first.fencing_token == run.fencing_token + 1
    server.restart()
    assert ledger.Cancel(req).run == first
    assert ledger.GetRun(pb.GetRunRequest(run_id="r")).run.fencing_token == first.fencing_token


def test_refusals_are_remembered_too(server, ledger) -> None:  # type: ignore[no-untyped-def]
    ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w1"))
    req = pb.AcquireRequest(run_id="r", owner="w2", request_id="acq-2")
    expect(ledger.Acquire, req, OK.FAILED_PRECONDITION, "RUN_LEASE_HELD", has_record=True)
    server.clock.advance(60_000)  # now it could succeed, but the id was answered
    server.restart()
    expect(ledger.Acquire, req, OK.FAILED_PRECONDITION, "RUN_LEASE_HELD", has_record=True)


def test_reused_id_for_a_different_request_is_refused(ledger) -> None:  # type: ignore[no-untyped-def]
    ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w", request_id="same"))
    expect(
        ledger.Acquire,
        pb.AcquireRequest(run_id="other", owner="w", request_id="same"),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="request_id",
    )
    expect(ledger.GetRun, pb.GetRunRequest(run_id="other"), OK.NOT_FOUND, "RUN_NOT_FOUND")


def test_request_ids_expire_after_retention(server, ledger) -> None:  # type: ignore[no-untyped-def]
    req = pb.AcquireRequest(run_id="r", owner="w", request_id="old")
    first = ledger.Acquire(req).run
    server.clock.advance(10 * 60_000 - 1)  # still remembered at 10 minutes
    assert ledger.Acquire(req).run == first
    server.clock.advance(20 * 60_000)  # retention is 15 min; pruning runs with the next batch
    ledger.Acquire(pb.AcquireRequest(run_id="tick", owner="w"))
    assert ledger.Acquire(req).run.fencing_token == first.fencing_token + 1
