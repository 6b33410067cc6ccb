"""Every integer the server increments has room to grow (docs/SPEC.md §10):
a version, attempt or fencing token a client writes must leave room for one
increment below 2^53 - 1, a token a client names is at most 2^53 - 1, and a
command that would move a counter past it anyway is refused and writes
nothing. Over the unary RPCs, Execute, Transact, KeepAlive and the raw seam."""

from __future__ import annotations

import queue
from typing import Any

import grpc
import pytest
from _db import snapshot
from service._records import bump, raw_run
from service._wire import expect, wire_error

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2_grpc
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

MAX_SAFE = 2**53 - 1
INT64 = 2**63 - 1
T0 = 1_700_000_000_000
YEAR_10000_S = 253_402_300_800  # the first second a Timestamp cannot hold
INVALID = grpc.StatusCode.INVALID_ARGUMENT
VALIDATION = "RUN_VALIDATION_ERROR"


def _history(db: str) -> Any:
    """Every change and tombstone written (a batch may still copy earlier
    changes into the runs table: that is no write of the refused command)."""
    rows = snapshot(db)
    return rows["changes"], rows["tombstones"]


def _create(store: Any, run: rpb.Run) -> spb.CreateResponse:
    return store.Create(spb.CreateRequest(run=run))


def _leased(run_id: str, owner: str, token: int = 1, attempt: int = 1) -> rpb.Run:
    run = raw_run(run_id, token=token, status=rpb.RUN_STATUS_RUNNING, owner=owner)
    run.attempt = attempt
    return run


def test_a_token_at_int64s_edge_is_refused_and_the_server_goes_on(
    server: ServerThread, store: Any, ledger: Any, db: str
) -> None:
    """The unbounded server took it, and the next Acquire moved the token
    past int64: INTERNAL, then every batch and every restart failed."""
    before = snapshot(db)
    for token in (INT64, MAX_SAFE, MAX_SAFE + 1):
        expect(store.Create, spb.CreateRequest(run=raw_run("big", token=token)), INVALID,
               VALIDATION, field="run.fencing_token")
    assert snapshot(db) == before
    # the next step, an Acquire of that id, now meets no such record
    assert ledger.Acquire(pb.AcquireRequest(run_id="big", owner="w")).run.fencing_token == 1
    assert ledger.Acquire(pb.AcquireRequest(run_id="other", owner="w")).run.fencing_token == 1
    server.restart()
    with grpc.insecure_channel(server.address) as ch:
        got = ledger_pb2_grpc.LedgerStub(ch).Acquire(pb.AcquireRequest(run_id="after", owner="w"))
    assert got.run.fencing_token == 1


def test_the_last_token_is_granted_and_the_next_move_refused_writing_nothing(
    server: ServerThread, clock: ManualClock, store: Any, ledger: Any, db: str
) -> None:
    assert _create(store, raw_run("edge", token=MAX_SAFE - 1)).created
    got = ledger.Acquire(pb.AcquireRequest(run_id="edge", owner="a", lease_ttl_ms=1000))
    assert got.run.fencing_token == MAX_SAFE  # representable: granted and served
    clock.advance(1000)
    before = _history(db)
    e = expect(ledger.Acquire, pb.AcquireRequest(run_id="edge", owner="b"), INVALID, VALIDATION,
               field="fencing_token", has_record=True)
    assert e.record is not None and e.record.fencing_token == MAX_SAFE
    e = expect(ledger.Cancel, pb.CancelRequest(run_id="edge"), INVALID, VALIDATION,
               field="fencing_token")
    assert _history(db) == before  # refused: nothing written
    # the holder's own commands still work under the last token
    renewed = ledger.Renew(pb.RenewRequest(run_id="edge", owner="a", fencing_token=MAX_SAFE))
    assert renewed.run.fencing_token == MAX_SAFE
    server.restart()


def test_an_attempt_at_its_limit_cannot_be_taken_over(
    clock: ManualClock, store: Any, ledger: Any, db: str
) -> None:
    assert _create(store, _leased("tired", "a", attempt=MAX_SAFE - 1)).created
    clock.advance(10_000)  # the raw lease expires: a takeover counts an attempt
    got = ledger.Acquire(pb.AcquireRequest(run_id="tired", owner="b", lease_ttl_ms=1000))
    assert got.run.attempt == MAX_SAFE
    clock.advance(1000)
    before = _history(db)
    expect(ledger.Acquire, pb.AcquireRequest(run_id="tired", owner="c"), INVALID, VALIDATION,
           field="attempt", has_record=True)
    assert _history(db) == before


MAX_TIME_MS = 253_402_300_799_999


def _far(run: rpb.Run, path: str, seconds: int) -> rpb.Run:
    msg: Any = run
    *parents, last = path.split(".")
    for p in parents:
        msg = getattr(msg, p)
    getattr(msg, last).seconds = seconds
    return run


RAW_CASES: list[tuple[str, str, Any, str]] = [
    ("create token", "Create", spb.CreateRequest(run=raw_run("n", token=MAX_SAFE)),
     "run.fencing_token"),
    ("create attempt", "Create",
     spb.CreateRequest(run=_leased("n", "a", attempt=MAX_SAFE)), "run.attempt"),
    ("create time", "Create",
     spb.CreateRequest(run=_far(raw_run("n"), "updated_at", YEAR_10000_S)), "run.updated_at"),
    ("lease past 9999", "Create",
     spb.CreateRequest(run=_far(_leased("n", "a"), "lease.expires_at", 2**62 // 1000)),
     "run.lease.expires_at"),
    ("cas expected", "CompareAndSet",
     spb.CompareAndSetRequest(run_id="s1", expected_version=MAX_SAFE,
                              next=raw_run("s1", version=2)), "expected_version"),
    ("cas version", "CompareAndSet",
     spb.CompareAndSetRequest(run_id="s1", expected_version=MAX_SAFE - 1,
                              next=raw_run("s1", version=MAX_SAFE)), "next.version"),
    ("cas token", "CompareAndSet",
     spb.CompareAndSetRequest(run_id="s1", expected_version=1,
                              next=bump(raw_run("s1"), fencing_token=INT64)), "next.fencing_token"),
]


@pytest.mark.parametrize(("name", "method", "request_", "field"), RAW_CASES,
                         ids=[c[0] for c in RAW_CASES])
def test_the_raw_seam_refuses_counters_and_times_without_room(
    store: Any, db: str, name: str, method: str, request_: Any, field: str
) -> None:
    assert _create(store, raw_run("s1")).created
    before = snapshot(db)
    expect(getattr(store, method), request_, INVALID, VALIDATION, field=field)
    assert snapshot(db) == before


def test_the_raw_seam_takes_the_largest_values_with_room(store: Any) -> None:
    run = _leased("top", "a", token=MAX_SAFE - 1, attempt=MAX_SAFE - 1)
    _far(run, "lease.expires_at", YEAR_10000_S - 1)
    assert _create(store, run).created


def test_a_lease_held_into_year_10000_is_refused_with_a_message_not_a_crash(
    store: Any, ledger: Any
) -> None:
    """The unbounded server failed the whole batch formatting the date."""
    run = _far(_leased("late", "a"), "lease.expires_at", YEAR_10000_S - 1)
    run.lease.lock_delay_ms = 86_400_000  # blocks others into year 10000
    assert _create(store, run).created
    e = expect(ledger.Acquire, pb.AcquireRequest(run_id="late", owner="b"),
               grpc.StatusCode.FAILED_PRECONDITION, "RUN_LEASE_HELD")
    assert "after the epoch" in e.message


LEDGER_CASES: list[tuple[str, str, Any, str]] = [
    ("renew", "Renew", pb.RenewRequest(run_id="r", owner="w", fencing_token=MAX_SAFE + 1),
     "fencing_token"),
    ("release", "Release", pb.ReleaseRequest(run_id="r", owner="w", fencing_token=INT64),
     "fencing_token"),
    ("finish", "Finish", pb.FinishRequest(run_id="r", owner="w", fencing_token=INT64,
                                          status=rpb.RUN_STATUS_COMPLETED), "fencing_token"),
    ("checkpoint fence", "RecordCheckpoint",
     pb.RecordCheckpointRequest(run_id="r", owner="w", fencing_token=1, key="k",
                                fence=epb.Fence(run_id="r", fencing_token=MAX_SAFE + 1)),
     "fence.fencing_token"),
    ("transaction", "Transact",
     pb.TransactionRequest(commands=[pb.Command(
         renew=pb.RenewRequest(run_id="r", owner="w", fencing_token=INT64))]),
     "commands[0].fencing_token"),
]


@pytest.mark.parametrize(("name", "method", "request_", "field"), LEDGER_CASES,
                         ids=[c[0] for c in LEDGER_CASES])
def test_a_named_token_past_the_bound_is_refused_on_every_path(
    ledger: Any, db: str, name: str, method: str, request_: Any, field: str
) -> None:
    ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w"))
    before = snapshot(db)
    expect(getattr(ledger, method), request_, INVALID, VALIDATION, field=field)
    assert snapshot(db) == before


def test_validate_fence_and_watch_refuse_values_past_the_bound(channel: grpc.Channel) -> None:
    stub = ledger_pb2_grpc.LedgerStub(channel)
    expect(stub.ValidateFence, pb.ValidateFenceRequest(run_id="r", fencing_token=MAX_SAFE + 1),
           INVALID, VALIDATION, field="fencing_token")
    with pytest.raises(grpc.RpcError) as ei:
        next(stub.WatchRuns(pb.WatchRunsRequest(from_revision=MAX_SAFE + 1), timeout=10))
    e = wire_error(ei.value)
    assert (e.code, e.metadata.get("field")) == (INVALID, "from_revision"), e


def test_an_engine_store_fence_past_the_bound_is_refused(channel: grpc.Channel) -> None:
    es = engine_store_pb2_grpc.EngineStoreStub(channel)
    req = epb.EngineKvSetRequest(agent="a", key="k", value=epb.JsonValue(json="1"),
                                 fence=epb.Fence(lock_key="l", fencing_token=INT64))
    expect(es.KvSet, req, INVALID, VALIDATION, field="fence.fencing_token")


def test_keepalive_refuses_tokens_past_the_bound_and_goes_on(channel: grpc.Channel) -> None:
    stub = ledger_pb2_grpc.LedgerStub(channel)
    stub.Acquire(pb.AcquireRequest(run_id="k", owner="w"))
    out: queue.Queue[Any] = queue.Queue()
    sent: queue.Queue[pb.KeepAliveRequest | None] = queue.Queue()
    for m in (pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")),
              pb.KeepAliveRequest(track=pb.KeepAliveTrack(run_id="k", fencing_token=INT64)),
              pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id="k", fencing_token=INT64)),
              pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id="k", fencing_token=1))):
        sent.put(m)
    call = stub.KeepAlive(iter(sent.get, None), timeout=30)
    for msg in call:
        for one in (msg.batch or [msg]):
            out.put(one)
        if out.qsize() >= 3:
            break
    sent.put(None)
    call.cancel()
    got = [out.get_nowait() for _ in range(out.qsize())]
    errors = [(m.error.run_id, m.error.metadata["field"]) for m in got if m.HasField("error")]
    assert errors == [("k", "track.fencing_token"), ("k", "fencing_token")]
    assert [m.renewed.fencing_token for m in got if m.HasField("renewed")] == [1]
