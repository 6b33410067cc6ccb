"""``--retain-terminal``: finished runs older than the retention are deleted
through the ordinary write path (a committed change each, a WatchRuns event,
a tombstone that keeps the token guarantee); unfinished runs, young finished
runs and runs changed since the pass read them are kept."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from _wire import expect

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost_server.config import parse_duration_ms
from fencepost_server.core import ledger as L
from fencepost_server.core.records import Status
from fencepost_server.testing.clock import ManualClock

COMPLETED = rpb.RUN_STATUS_COMPLETED


def _finish(ledger: ledger_pb2_grpc.LedgerStub, run_id: str) -> rpb.Run:
    run = ledger.Acquire(pb.AcquireRequest(run_id=run_id, owner="w")).run
    return ledger.Finish(pb.FinishRequest(
        run_id=run_id, owner="w", fencing_token=run.fencing_token, status=COMPLETED)).run


def test_finished_runs_past_the_retention_are_deleted_with_their_tombstones(
    make_server: Any,
) -> None:
    clock = ManualClock(1_700_000_000_000)
    with make_server(clock=clock, retain_terminal="60s") as srv, \
            grpc.insecure_channel(srv.address) as ch:
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        assert srv.app.retention is not None and srv.app.retention.retain_ms == 60_000
        old = {f"old{i}": _finish(ledger, f"old{i}") for i in range(7)}
        live = ledger.Acquire(pb.AcquireRequest(run_id="live", owner="w",
                                                lease_ttl_ms=3_600_000)).run
        clock.advance(45_000)
        young = _finish(ledger, "young")
        clock.advance(20_000)  # old*: 65 s finished; young: 20 s
        ledger.Acquire(pb.AcquireRequest(run_id="tick", owner="t", lease_ttl_ms=3_600_000))
        srv.call(srv.app.writer.wait_idle)  # the runs table now reflects them all
        retention = srv.app.retention
        retention.chunk = 3  # several chunks in one pass
        assert srv.call(retention.run_once) == 7
        for run_id, run in old.items():
            expect(ledger.GetRun, pb.GetRunRequest(run_id=run_id), grpc.StatusCode.NOT_FOUND,
                   "RUN_NOT_FOUND")
            again = ledger.Acquire(pb.AcquireRequest(run_id=run_id, owner="w2")).run
            assert again.fencing_token > run.fencing_token  # the tombstone held
        assert ledger.GetRun(pb.GetRunRequest(run_id="young")).run == young
        assert ledger.GetRun(pb.GetRunRequest(run_id="live")).run.fencing_token == \
            live.fencing_token
        assert srv.call(retention.run_once) == 0


def test_a_run_changed_since_the_pass_read_it_is_kept(make_server: Any) -> None:
    """Retire deletes only a run still finished at the version read."""
    clock = ManualClock(1_700_000_000_000)
    with make_server(clock=clock) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        done = _finish(ledger, "r")
        writer = srv.app.writer

        async def retire(version: int) -> L.Deleted:
            return await writer.submit(L.Retire("r", version))  # type: ignore[return-value]

        assert not srv.call(lambda: retire(done.version - 1)).deleted  # changed since
        assert writer.state.runs["r"].status is Status.COMPLETED
        assert srv.call(lambda: retire(done.version)).deleted
        running = ledger.Acquire(pb.AcquireRequest(run_id="u", owner="w")).run
        assert not srv.call(
            lambda: writer.submit(L.Retire("u", running.version))).deleted  # not finished


@pytest.mark.parametrize(("text", "ms"), [
    ("90s", 90_000), ("30m", 1_800_000), ("12h", 43_200_000), ("7d", 604_800_000),
    ("500ms", 500), ("3600", 3_600_000),
])
def test_durations(text: str, ms: int) -> None:
    assert parse_duration_ms(text, "--retain-terminal") == ms


@pytest.mark.parametrize("text", ["", "0", "-5s", "soon", "5w", "1.5h"])
def test_bad_durations_name_the_flag(text: str) -> None:
    with pytest.raises(RuntimeError, match="--retain-terminal"):
        parse_duration_ms(text, "--retain-terminal")
