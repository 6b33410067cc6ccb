"""Finished runs leave memory once the runs table reflects them, and every read
and write still sees them exactly: GetRun, ValidateFence, the raw seam's Get,
ListRuns (filtered and paged, hot and cold mixed), KeepAlive's lost reason,
and commands on a cold run (refused, deleted, compare-and-set)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from _wire import expect

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc, run_store_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

RUNNING, COMPLETED, FAILED = (
    rpb.RUN_STATUS_RUNNING, rpb.RUN_STATUS_COMPLETED, rpb.RUN_STATUS_FAILED,
)


def _finish(ledger: Any, run_id: str, status: int = COMPLETED) -> rpb.Run:
    run = ledger.Acquire(pb.AcquireRequest(run_id=run_id, owner="w")).run
    outcome = rpb.Outcome(code="boom") if status == FAILED else None
    return ledger.Finish(pb.FinishRequest(
        run_id=run_id, owner="w", fencing_token=run.fencing_token, status=status,
        outcome=outcome,
    )).run


def _go_cold(server: ServerThread, clock: ManualClock, ledger: Any) -> None:
    """Let the runs table catch up (a batch past the materialization delay)."""
    clock.advance(2_000)
    ledger.Acquire(pb.AcquireRequest(run_id="zz-tick", owner="ticker", lease_ttl_ms=600_000))
    server.call(server.app.writer.wait_idle)


@pytest.fixture
def stubs(channel: grpc.Channel) -> tuple[Any, Any]:
    return ledger_pb2_grpc.LedgerStub(channel), run_store_pb2_grpc.RunStoreStub(channel)


def test_finished_runs_leave_memory_and_read_back_exactly(
    server: ServerThread, clock: ManualClock, stubs: tuple[Any, Any]
) -> None:
    ledger, store = stubs
    done = {f"d{i}": _finish(ledger, f"d{i}", COMPLETED if i % 2 else FAILED) for i in range(6)}
    live = ledger.Acquire(pb.AcquireRequest(run_id="live", owner="w")).run
    _go_cold(server, clock, ledger)
    writer = server.app.writer
    assert set(writer.state.runs) == {"live", "zz-tick"}  # only unfinished runs stay
    assert len(writer.state.index) == 8
    for run_id, run in done.items():
        got = ledger.GetRun(pb.GetRunRequest(run_id=run_id))
        assert got.run == run and got.revision >= run.revision
        fence = ledger.ValidateFence(pb.ValidateFenceRequest(
            run_id=run_id, fencing_token=run.fencing_token))
        assert fence.found and not fence.current and fence.status == run.status
        raw = store.Get(spb.GetRequest(run_id=run_id))
        assert raw.found and raw.run == run
    assert ledger.GetRun(pb.GetRunRequest(run_id="live")).run == live
    expect(ledger.GetRun, pb.GetRunRequest(run_id="nope"), grpc.StatusCode.NOT_FOUND,
           "RUN_NOT_FOUND")


def test_list_runs_pages_through_hot_and_cold_runs(
    server: ServerThread, clock: ManualClock, stubs: tuple[Any, Any]
) -> None:
    ledger, _ = stubs
    for i in range(0, 30, 2):
        _finish(ledger, f"r{i:02d}")
    for i in range(1, 30, 2):
        ledger.Acquire(pb.AcquireRequest(run_id=f"r{i:02d}", owner=f"o{i % 3}"))
    _go_cold(server, clock, ledger)
    assert not any(k.startswith("r") and int(k[1:]) % 2 == 0 for k in server.app.writer.state.runs)

    def pages(**kw: Any) -> list[str]:
        ids, token = [], ""
        while True:
            resp = ledger.ListRuns(pb.ListRunsRequest(page_size=4, page_token=token, **kw))
            ids += [r.run_id for r in resp.runs]
            token = resp.next_page_token
            if not token:
                return ids

    everything = [f"r{i:02d}" for i in range(30)] + ["zz-tick"]
    assert pages() == everything
    assert pages(statuses=[COMPLETED]) == [f"r{i:02d}" for i in range(0, 30, 2)]
    assert pages(statuses=[RUNNING, COMPLETED]) == everything
    assert pages(owner="o1") == [f"r{i:02d}" for i in range(1, 30, 2) if i % 3 == 1]
    assert pages(statuses=[COMPLETED], owner="o1") == []
    listed = ledger.ListRuns(pb.ListRunsRequest(statuses=[COMPLETED], page_size=100)).runs
    assert all(r.status == COMPLETED and r.version == 2 for r in listed)


def test_commands_on_a_cold_run_see_its_stored_record(
    server: ServerThread, clock: ManualClock, stubs: tuple[Any, Any]
) -> None:
    ledger, store = stubs
    done = _finish(ledger, "c1")
    _finish(ledger, "c2")
    _go_cold(server, clock, ledger)
    writer, reads = server.app.writer, server.app.reads
    assert reads.is_cold("c1") and reads.is_cold("c2")
    e = expect(ledger.Acquire, pb.AcquireRequest(run_id="c1", owner="x"),
               grpc.StatusCode.FAILED_PRECONDITION, "RUN_ALREADY_TERMINAL", has_record=True)
    assert e.record == done
    # a compare-and-set on the cold run brings it back into memory, once
    nxt = rpb.Run()
    nxt.CopyFrom(done)
    nxt.version += 1
    nxt.outcome.code = "relabelled"
    swapped = store.CompareAndSet(spb.CompareAndSetRequest(
        run_id="c1", expected_version=done.version, next=nxt))
    assert swapped.swapped and swapped.run.outcome.code == "relabelled"
    assert not reads.is_cold("c1") and list(writer.state.index).count("c1") == 1
    assert ledger.GetRun(pb.GetRunRequest(run_id="c1")).run.outcome.code == "relabelled"
    # deleting a cold run leaves its tombstone: the token never repeats
    deleted = ledger.DeleteRun(pb.DeleteRunRequest(run_id="c2"))
    assert "c2" not in writer.state.index
    expect(ledger.GetRun, pb.GetRunRequest(run_id="c2"), grpc.StatusCode.NOT_FOUND,
           "RUN_NOT_FOUND")
    again = ledger.Acquire(pb.AcquireRequest(run_id="c2", owner="w")).run
    assert again.fencing_token > deleted.fencing_token
    _go_cold(server, clock, ledger)
    assert reads.is_cold("c1")
    assert ledger.GetRun(pb.GetRunRequest(run_id="c1")).run.outcome.code == "relabelled"


async def test_tracking_a_cold_run_reports_it_finished(
    server: ServerThread, clock: ManualClock, stubs: tuple[Any, Any]
) -> None:
    ledger, _ = stubs
    done = _finish(ledger, "k1")
    _go_cold(server, clock, ledger)
    assert server.app.reads.is_cold("k1")
    async with grpc.aio.insecure_channel(server.address) as ch:
        call = ledger_pb2_grpc.LedgerStub(ch).KeepAlive()
        await call.write(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")))
        await call.write(pb.KeepAliveRequest(
            track=pb.KeepAliveTrack(run_id="k1", fencing_token=done.fencing_token)))
        msg = await asyncio.wait_for(call.read(), 5)
        lost = (msg.batch[0] if msg.batch else msg).lost
        assert lost.run_id == "k1" and lost.reason == pb.LOST_REASON_FINISHED
        call.cancel()


def test_a_restart_loads_only_unfinished_runs(make_server: Any) -> None:
    clock = ManualClock(1_700_000_000_000)
    with make_server(clock=clock) as srv, grpc.insecure_channel(srv.address) as ch:
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        finished = {f"f{i}": _finish(ledger, f"f{i}") for i in range(5)}
        ledger.Acquire(pb.AcquireRequest(run_id="u1", owner="w"))
    with make_server(clock=clock) as srv, grpc.insecure_channel(srv.address) as ch:
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        assert set(srv.app.writer.state.runs) == {"u1"}
        assert len(srv.app.writer.state.index) == 6
        for run_id, run in finished.items():
            assert ledger.GetRun(pb.GetRunRequest(run_id=run_id)).run == run


def test_a_fence_on_a_cold_run_is_checked_against_its_stored_record(
    server: ServerThread, clock: ManualClock, stubs: tuple[Any, Any]
) -> None:
    """A write fenced by a finished run's token is refused as lost (with the
    record), not as an unknown run, once memory no longer holds the run."""
    from fencepost.v1 import engine_store_pb2 as epb
    from fencepost.v1 import engine_store_pb2_grpc

    ledger, _ = stubs
    done = _finish(ledger, "f1")
    _go_cold(server, clock, ledger)
    assert server.app.reads.is_cold("f1")
    es = engine_store_pb2_grpc.EngineStoreStub(grpc.insecure_channel(server.address))
    e = expect(
        es.SaveCheckpoint,
        epb.EngineSaveCheckpointRequest(
            checkpoint=epb.EngineCheckpoint(run_id="f1", step_index=1,
                                            state=epb.JsonValue(json="{}")),
            fence=epb.Fence(run_id="f1", fencing_token=done.fencing_token),
        ),
        grpc.StatusCode.FAILED_PRECONDITION, "RUN_LEASE_LOST", has_record=True,
    )
    assert e.record == done
    assert not es.LatestCheckpoint(epb.EngineLatestCheckpointRequest(run_id="f1")).found


@pytest.mark.parametrize("ids", ["random", "sorted"])
async def test_a_restart_builds_the_same_index_as_inserts_one_at_a_time(
    db: str, ids: str
) -> None:
    """Start-up builds the index in bulk from the status index's groups (in
    the database's order) and the change log's replayed runs; it must equal
    the index of the same runs inserted one at a time, on either backend and
    for random (UUID) or sorted ids."""
    import uuid

    from fencepost_server.core import ledger as L
    from fencepost_server.core.records import Outcome, Status
    from fencepost_server.storage import SqliteStorage, is_url
    from fencepost_server.storage.postgres import PostgresStorage
    from fencepost_server.writer import Reads, Writer
    from fencepost_server.writer.index import RunIndex

    def storage() -> Any:
        return PostgresStorage(db) if is_url(db) else SqliteStorage(db)

    serial = iter(range(10**6))

    def new_id() -> str:
        return uuid.uuid4().hex if ids == "random" else f"run-{next(serial):06d}"

    async def fill(w: Writer, count: int) -> None:
        for i in range(count):
            run_id = new_id()
            rec = await w.submit(L.Acquire(run_id, f"w{i % 3}"))
            if i % 5 == 0:
                continue  # stays running, with its owner
            if i % 5 == 1:
                await w.submit(L.Cancel(run_id))
            elif i % 5 == 2:
                await w.submit(L.Finish(run_id, f"w{i % 3}", rec.fencing_token, Status.FAILED,
                                        Outcome("boom")))
            else:
                await w.submit(L.Finish(run_id, f"w{i % 3}", rec.fencing_token,
                                        Status.COMPLETED))

    clock = ManualClock(1_700_000_000_000)
    w = Writer(storage(), clock, materialize_after_ms=0)
    await w.start()
    # ids that JSON escapes, or that sort apart in UTF-16 and in code points
    for odd in ['q"uote', "back\\slash", "ünï", "\U0001f600-emoji", "\uff61-wide", "[a,b]"]:
        rec = await w.submit(L.Acquire(odd, "w"))
        await w.submit(L.Finish(odd, "w", rec.fencing_token, Status.COMPLETED))
    await fill(w, 114)  # reach the runs table
    await w.wait_idle()
    w._apply.materialize_after_ms = 3_600_000
    await fill(w, 40)  # only in the change log: "dies" before copying them
    w._apply.pending.clear()
    await w.close()

    def entries(index: RunIndex) -> tuple[Any, ...]:
        return (list(index), {k: list(v) for k, v in index.by_status.items()},
                {k: list(v) for k, v in index.by_owner.items()})

    def one_at_a_time(records: dict[str, Any]) -> RunIndex:
        index = RunIndex()
        for rec in sorted(records.values(), key=lambda r: r.revision):
            index.update(rec.run_id, rec)
        return index

    # the first start replays the change log (and copies it to runs) ...
    first = storage()
    first.open()
    try:
        state = first.load()
        assert state.replayed > 0 and state.cold
        cold_ids = [k for _, _, group in state.cold for k in group]
        records = {**first.read_runs(cold_ids), **state.runs}
        assert len(records) == len(cold_ids) + len(state.runs) == 160
        built = RunIndex(state.runs.values(), cold=state.cold)
        assert entries(built) == entries(one_at_a_time(records))
        assert list(built) == sorted(records) and len(built.by_status) == 4
    finally:
        first.close()
    # ... the next one reads the runs table alone
    w2 = Writer(storage(), clock)
    await w2.start()
    try:
        reads = Reads(w2.storage, lambda: w2.state)
        cold = [k for k in w2.state.index if reads.is_cold(k)]
        assert {**await reads.read_runs(cold), **w2.state.runs} == records
        await reads.close()
        assert entries(w2.state.index) == entries(one_at_a_time(records))
    finally:
        await w2.close()
