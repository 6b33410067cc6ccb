"""A database that already holds a run whose counters no client can represent
(past 2^53 - 1, or past int64 as the unbounded server once wrote) starts and
serves everything else, on SQLite and PostgreSQL: the record is refused on
access (RUN_INTEGRITY_ERROR) and to every command but a delete, left out of
ListRuns pages and watch replays, and copied into the runs table with its
integer columns clamped, so no batch and no restart dies on it."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from _db import Databases, raw
from service._wire import wire_error

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc, run_store_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

T0 = 1_700_000_000_000
MAX_INT64 = 2**63 - 1

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True,
                                     scope="session")


def _edit(db: str, run_id: str, **fields: Any) -> None:
    """Rewrite a run's stored record (and its columns) behind the server's back."""
    with raw(db, write=True) as conn:
        (text,) = conn.rows("SELECT record FROM runs WHERE run_id = ?", (run_id,))[0]
        rec = json.loads(text)
        rec.update(fields)
        conn.run("UPDATE runs SET record = ?, fencing_token = ?, version = ? WHERE run_id = ?",
                 (json.dumps(rec), min(rec["fencing_token"], MAX_INT64),
                  min(rec["version"], MAX_INT64), run_id))


def _append_change(db: str, run_id: str, **fields: Any) -> int:
    """What the unbounded server committed for an Acquire of a token at
    2^63 - 1: a change above the materialized mark holding 2^63."""
    with raw(db, write=True) as conn:
        (text,) = conn.rows("SELECT record FROM runs WHERE run_id = ?", (run_id,))[0]
        (rev,) = conn.rows("SELECT value FROM meta WHERE key = 'revision'")[0]
        rec = json.loads(text)
        rec.update(fields, version=rec["version"] + 1, revision=int(rev) + 1)
        conn.run("INSERT INTO changes (revision, run_id, kind, record, committed_at) "
                 "VALUES (?, ?, 1, ?, ?)", (int(rev) + 1, run_id, json.dumps(rec), T0))
        conn.run("UPDATE meta SET value = ? WHERE key = 'revision'", (int(rev) + 1,))
        return int(rev) + 1


@pytest.fixture
def poisoned(databases: Databases) -> Iterator[tuple[ServerThread, str]]:
    """A database with good runs and three bad ones: ``hot`` (running, token
    2^63 - 1 in the runs table), ``replayed`` (token 2^63 in a change not yet
    copied into runs) and ``cold`` (completed, attempt 2^60)."""
    db = databases.get()
    srv = databases.server(clock=ManualClock(T0))
    try:
        srv.start()
        with grpc.insecure_channel(srv.address) as ch:
            led = ledger_pb2_grpc.LedgerStub(ch)
            for run_id in ("a", "hot", "replayed", "cold", "z"):
                led.Acquire(pb.AcquireRequest(run_id=run_id, owner="w", lease_ttl_ms=60_000))
            led.Finish(pb.FinishRequest(run_id="cold", owner="w", fencing_token=1,
                                        status=rpb.RUN_STATUS_COMPLETED))
        srv.stop()  # a clean stop copies every run into the runs table
        _edit(db, "hot", fencing_token=MAX_INT64)
        _edit(db, "cold", attempt=2**60)
        _append_change(db, "replayed", fencing_token=MAX_INT64 + 1)
        srv.start()
        yield srv, db
    finally:
        srv.close()


def _refused(call: Any, request: Any, field: str) -> None:
    with pytest.raises(grpc.RpcError) as ei:
        call(request)
    e = wire_error(ei.value)
    assert (e.code, e.reason, e.metadata.get("field")) == (
        grpc.StatusCode.DATA_LOSS, "RUN_INTEGRITY_ERROR", field), e
    assert e.record is None, "a record past the bound is never served"


def test_a_start_on_it_serves_every_other_run_and_refuses_the_bad_ones(
    poisoned: tuple[ServerThread, str],
) -> None:
    srv, db = poisoned
    with grpc.insecure_channel(srv.address) as ch:
        led = ledger_pb2_grpc.LedgerStub(ch)
        store = run_store_pb2_grpc.RunStoreStub(ch)
        for run_id, field in (("hot", "fencing_token"), ("replayed", "fencing_token"),
                              ("cold", "attempt")):
            _refused(led.GetRun, pb.GetRunRequest(run_id=run_id), field)
            _refused(store.Get, spb.GetRequest(run_id=run_id), field)
            _refused(led.ValidateFence,
                     pb.ValidateFenceRequest(run_id=run_id, fencing_token=1), field)
            _refused(led.Acquire, pb.AcquireRequest(run_id=run_id, owner="x"), field)
            _refused(led.Cancel, pb.CancelRequest(run_id=run_id), field)
        # the good runs are served and move as ever
        got = led.Renew(pb.RenewRequest(run_id="a", owner="w", fencing_token=1))
        assert got.run.fencing_token == 1 and got.run.lease.owner == "w"
        assert led.Acquire(pb.AcquireRequest(run_id="new", owner="w")).run.fencing_token == 1
        # every page of every listing answers, without the bad runs
        seen: list[str] = []
        token = ""
        while True:
            page = led.ListRuns(pb.ListRunsRequest(page_size=1, page_token=token))
            seen += [r.run_id for r in page.runs]
            token = page.next_page_token
            if not token:
                break
        assert seen == ["a", "new", "z"]
        # a KeepAlive tracking one hears it is lost, without the record
        hello = pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w"))
        track = pb.KeepAliveRequest(track=pb.KeepAliveTrack(run_id="hot", fencing_token=1))
        sent: queue.Queue[pb.KeepAliveRequest | None] = queue.Queue()
        sent.put(hello)
        sent.put(track)
        stream = led.KeepAlive(iter(sent.get, None), timeout=30)  # open until read
        first = next(stream)
        sent.put(None)
        stream.cancel()
        assert first.lost.run_id == "hot" and not first.lost.HasField("record"), first
        # the change the unbounded server wrote is in the runs table now, its
        # token column clamped (the record's text keeps it exactly)
        with raw(db) as conn:
            assert conn.rows("SELECT fencing_token FROM runs WHERE run_id = 'replayed'") == [
                (MAX_INT64,)]


def test_a_watch_replay_leaves_the_bad_change_out_and_goes_live(
    poisoned: tuple[ServerThread, str],
) -> None:
    srv, _ = poisoned
    with grpc.insecure_channel(srv.address) as ch:
        led = ledger_pb2_grpc.LedgerStub(ch)
        last = led.Acquire(pb.AcquireRequest(run_id="before", owner="w")).run.revision
        stream = led.WatchRuns(pb.WatchRunsRequest(from_revision=1), timeout=30)
        seen: list[tuple[int, str]] = []
        for ev in stream:
            seen.append((ev.revision, ev.run_id))
            if ev.revision == last:
                break
        # live: a change after the replay arrives on the same stream
        led.Acquire(pb.AcquireRequest(run_id="after", owner="w"))
        live = next(stream)
        stream.cancel()
    assert live.run_id == "after" and live.record.fencing_token == 1
    runs = [r for _, r in seen]
    assert runs.count("replayed") == 1, seen  # its acquire; not the change past int64
    assert runs.count("cold") == 2  # its acquire and finish, as written then
    assert seen[-1] == (last, "before") and len({rev for rev, _ in seen}) == len(seen)


def test_it_can_be_deleted_its_id_stays_spent_and_restarts_succeed(
    poisoned: tuple[ServerThread, str],
) -> None:
    srv, _ = poisoned
    srv.restart()  # a clean stop and a start on the same database
    with grpc.insecure_channel(srv.address) as ch:
        led = ledger_pb2_grpc.LedgerStub(ch)
        gone = led.DeleteRun(pb.DeleteRunRequest(run_id="replayed"))
        assert gone.fencing_token == MAX_INT64  # its token as the tombstone holds it
        with pytest.raises(grpc.RpcError) as ei:
            led.Acquire(pb.AcquireRequest(run_id="replayed", owner="w"))
        e = wire_error(ei.value)
        assert (e.code, e.reason, e.metadata.get("field")) == (
            grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR", "fencing_token"), e
        led.DeleteRun(pb.DeleteRunRequest(run_id="hot"))
    srv.restart()
    with grpc.insecure_channel(srv.address) as ch:
        led = ledger_pb2_grpc.LedgerStub(ch)
        assert led.Acquire(pb.AcquireRequest(run_id="b", owner="w")).run.fencing_token == 1
        _refused(led.GetRun, pb.GetRunRequest(run_id="cold"), "attempt")
        with pytest.raises(grpc.RpcError) as ei:
            led.GetRun(pb.GetRunRequest(run_id="hot"))
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
