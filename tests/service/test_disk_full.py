"""docs/SPEC.md §9: a write that cannot be made durable fails with a clear error and
changes nothing; reads keep working; writing recovers when the cause clears."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from _wire import expect

from fencepost.v1 import ledger_pb2 as pb
from fencepost_server.testing.server import ServerThread


def _on_writer(server: ServerThread, sql: str) -> Any:
    w = server.writer

    async def run() -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(w._executor, lambda: w.storage.db.execute(sql).fetchone())

    return server.call(run)


@pytest.mark.sqlite_only  # fills the file by shrinking SQLite's max_page_count
def test_disk_full_fails_cleanly_and_recovers(server, ledger) -> None:  # type: ignore[no-untyped-def]
    held = ledger.Acquire(pb.AcquireRequest(run_id="held", owner="w")).run
    pages = _on_writer(server, "PRAGMA page_count")[0]
    _on_writer(server, f"PRAGMA max_page_count = {pages}")
    big = "x" * 500
    failures = 0
    for i in range(200):  # grow until the file cannot
        try:
            ledger.Acquire(pb.AcquireRequest(run_id=f"{big}{i}", owner="w"))
        except grpc.RpcError:
            failures += 1
            break
    assert failures == 1, "the database never filled up"
    rev = server.writer.state.revision
    runs = dict(server.writer.state.runs)
    e = expect(ledger.Acquire, pb.AcquireRequest(run_id=f"{big}-next", owner="w"),
               grpc.StatusCode.RESOURCE_EXHAUSTED, "STORAGE_FULL")
    assert "nothing changed" in e.message
    # nothing moved, reads still work, fenced writes to existing rows may still fail
    assert server.writer.state.revision == rev and server.writer.state.runs == runs
    assert ledger.GetRun(pb.GetRunRequest(run_id="held")).run == held
    assert server.writer.stats.failed_commits >= 1
    # the cause clears: writing resumes, and the refused run was never created
    _on_writer(server, "PRAGMA max_page_count = 1073741823")
    ok = ledger.Acquire(pb.AcquireRequest(run_id=f"{big}-next", owner="w")).run
    assert ok.version == 1 and ok.revision == rev + 1
    server.restart()
    assert ledger.GetRun(pb.GetRunRequest(run_id=f"{big}-next")).run.revision == rev + 1
