"""A real coordinator stopped with SIGTERM saves the finished runs' index
entries, and its next start reads them; after a kill -9 that followed more
writes the saved entries are stale, and the start-up gathers the ids from
the table instead. Either way every listing and read answers as before."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from _proc import ServerProc

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost_server.storage.sql import SAVED_INDEX_READ


def _listing(ledger: Any, *statuses: int) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    token = ""
    while True:
        page = ledger.ListRuns(pb.ListRunsRequest(statuses=statuses, page_size=1000,
                                                  page_token=token))
        out += [(r.run_id, r.status) for r in page.runs]
        token = page.next_page_token
        if not token:
            return out


def _start(srv: ServerProc) -> str:
    """Start; the log of this start alone."""
    before = len(srv.log_path.read_bytes()) if srv.log_path.exists() else 0
    srv.start()
    return srv.log_path.read_bytes()[before:].decode(errors="replace")


def test_sigterm_saves_the_index_and_a_crash_after_more_writes_does_not_reuse_it(
    tmp_path: Path,
) -> None:
    srv = ServerProc(tmp_path / "f.db", tmp_path / "server.log")
    try:
        assert SAVED_INDEX_READ not in _start(srv)
        with srv.channel() as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            live: dict[str, rpb.Run] = {}
            for i in range(300):
                run_id = uuid.uuid4().hex
                run = ledger.Acquire(pb.AcquireRequest(run_id=run_id, owner=f"w{i % 4}")).run
                if i % 3:
                    status = rpb.RUN_STATUS_COMPLETED if i % 3 == 1 else rpb.RUN_STATUS_FAILED
                    run = ledger.Finish(pb.FinishRequest(
                        run_id=run_id, owner=f"w{i % 4}", fencing_token=run.fencing_token,
                        status=status, outcome=rpb.Outcome(code="x") if i % 3 == 2 else None,
                    )).run
                live[run_id] = run
            everything = _listing(ledger)
            completed = _listing(ledger, rpb.RUN_STATUS_COMPLETED)
        assert srv.stop() == 0
        assert f"200 finished runs' ids {SAVED_INDEX_READ}" in _start(srv)
        with srv.channel() as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            assert _listing(ledger) == everything
            assert _listing(ledger, rpb.RUN_STATUS_COMPLETED) == completed
            for run_id, run in live.items():
                assert ledger.GetRun(pb.GetRunRequest(run_id=run_id)).run == run
            # more writes, then a crash: the saved entries no longer describe the table
            gone = completed[0][0]
            ledger.DeleteRun(pb.DeleteRunRequest(run_id=gone))
            runner = next(r for r in live.values() if r.status == rpb.RUN_STATUS_RUNNING)
            ledger.Finish(pb.FinishRequest(
                run_id=runner.run_id, owner=runner.lease.owner,
                fencing_token=runner.fencing_token, status=rpb.RUN_STATUS_COMPLETED))
            everything = _listing(ledger)
            completed = _listing(ledger, rpb.RUN_STATUS_COMPLETED)
        srv.kill()
        assert SAVED_INDEX_READ not in _start(srv)
        with srv.channel() as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            assert _listing(ledger) == everything
            assert _listing(ledger, rpb.RUN_STATUS_COMPLETED) == completed
            assert (runner.run_id, rpb.RUN_STATUS_COMPLETED) in completed
            assert gone not in dict(everything)
    finally:
        srv.kill()
