"""A real coordinator stopped with SIGTERM saves the finished runs' index
entries, and its next start reads them; after a kill -9 that followed more
writes the start reads them too, and gathers again only the blocks of the
runs table changed since. Either way every listing and read answers as
before."""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

from _proc import ServerProc

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost_server.storage.sql import SAVED_INDEX_READ
from fencepost_server.storage.sqlite import open_read_only


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


def _until_copied(path: Path, ledger: Any) -> None:
    """Write until the writer has copied earlier changes into the runs table
    (a later batch does, about a second after them), which records the
    blocks they changed."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ledger.Acquire(pb.AcquireRequest(run_id=uuid.uuid4().hex, owner="ticker"))
        with contextlib.closing(open_read_only(path)) as db:
            if db.execute("SELECT count(*) FROM touched_blocks").fetchone()[0]:
                return
        time.sleep(0.2)
    raise AssertionError("no change reached the runs table within 30 s")


def _start(srv: ServerProc) -> str:
    """Start; the log of this start alone."""
    before = len(srv.log_path.read_bytes()) if srv.log_path.exists() else 0
    srv.start()
    return srv.log_path.read_bytes()[before:].decode(errors="replace")


def test_sigterm_saves_the_index_and_a_crash_after_more_writes_reuses_it_with_the_changes(
    tmp_path: Path,
) -> None:
    srv = ServerProc(tmp_path / "f.db", tmp_path / "server.log")
    try:
        assert SAVED_INDEX_READ not in _start(srv)
        with srv.channel() as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            live: dict[str, rpb.Run] = {}
            # some 5 blocks of the runs table (256 runs each): the writes
            # before the crash below change at most 3, and a start reads the
            # saved entries while at most half the blocks changed
            for i in range(1200):
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
        assert f"800 finished runs' ids {SAVED_INDEX_READ}" in _start(srv)
        with srv.channel() as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            assert _listing(ledger) == everything
            assert _listing(ledger, rpb.RUN_STATUS_COMPLETED) == completed
            for run_id, run in live.items():
                assert ledger.GetRun(pb.GetRunRequest(run_id=run_id)).run == run
            # more writes, then a crash: the saved entries no longer describe the
            # table alone
            gone = completed[0][0]
            ledger.DeleteRun(pb.DeleteRunRequest(run_id=gone))
            runner = next(r for r in live.values() if r.status == rpb.RUN_STATUS_RUNNING)
            ledger.Finish(pb.FinishRequest(
                run_id=runner.run_id, owner=runner.lease.owner,
                fencing_token=runner.fencing_token, status=rpb.RUN_STATUS_COMPLETED))
            _until_copied(tmp_path / "f.db", ledger)  # into the runs table, blocks recorded
            everything = _listing(ledger)
            completed = _listing(ledger, rpb.RUN_STATUS_COMPLETED)
        srv.kill()
        started = _start(srv)
        assert SAVED_INDEX_READ in started and "gathered again from the" in started
        with srv.channel() as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            assert _listing(ledger) == everything
            assert _listing(ledger, rpb.RUN_STATUS_COMPLETED) == completed
            assert (runner.run_id, rpb.RUN_STATUS_COMPLETED) in completed
            assert gone not in dict(everything)
    finally:
        srv.kill()
