"""Health, reflection, graceful restart, and refusing a database that isn't ours."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_server.storage.sqlite import SqliteStorage
from fencepost_server.testing.server import ServerThread


def test_health_serving_for_every_service(channel) -> None:  # type: ignore[no-untyped-def]
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "fencepost.v1.Ledger", "fencepost.v1.RunStore"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel) -> None:  # type: ignore[no-untyped-def]
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    resp = next(iter(stub.ServerReflectionInfo(iter([req]))))
    names = {s.name for s in resp.list_services_response.service}
    assert {"fencepost.v1.Ledger", "fencepost.v1.RunStore", "grpc.health.v1.Health"} <= names


def test_state_survives_a_graceful_restart(server, ledger, backend) -> None:  # type: ignore[no-untyped-def]
    for i in range(20):
        ledger.Acquire(pb.AcquireRequest(run_id=f"r{i}", owner="w"))
    rev = server.writer.state.revision
    before = dict(server.writer.state.runs)
    server.restart()
    after = server.writer.state.runs
    assert set(after) == set(before)
    if backend == "postgres":
        # a restart is a change of leader: the new one extends every live lease
        # by the time the coordinator was away (one change each), never shortens one
        assert server.writer.state.revision in (rev, rev + 20)
        gaps = {after[r].lease.expires_at - before[r].lease.expires_at for r in before}
        assert len(gaps) == 1 and gaps.pop() >= 0
        assert all(after[r].fencing_token == before[r].fencing_token for r in before)
    else:
        assert server.writer.state.revision == rev
        assert after == before
    rev = server.writer.state.revision
    assert ledger.Acquire(pb.AcquireRequest(run_id="next", owner="w")).run.revision == rev + 1


@pytest.mark.sqlite_only
def test_refuses_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    bad = tmp_path / "junk.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(RuntimeError, match="refusing to start"):
        SqliteStorage(bad).open()
    assert bad.read_bytes() == b"this is not sqlite" * 100  # never silently recreated


@pytest.mark.sqlite_only
def test_refuses_a_foreign_database_and_a_newer_schema(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.db"
    db = sqlite3.connect(foreign)
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match="no fencepost schema"):
        SqliteStorage(foreign).open()
    newer = tmp_path / "newer.db"
    st = SqliteStorage(newer)
    st.open()
    st.db.execute("PRAGMA user_version=99")
    st.close()
    with pytest.raises(RuntimeError, match="schema 99"):
        SqliteStorage(newer).open()


@pytest.mark.sqlite_only  # PRAGMA synchronous / journal_mode
def test_server_runs_at_synchronous_full_by_default(server) -> None:  # type: ignore[no-untyped-def]
    sync = server.call(lambda: _pragma(server, "synchronous"))
    mode = server.call(lambda: _pragma(server, "journal_mode"))
    assert (sync, mode) == (2, "wal")  # 2 == FULL


async def _pragma(server: ServerThread, name: str) -> object:
    import asyncio

    w = server.writer
    return await asyncio.get_running_loop().run_in_executor(
        w._executor, lambda: w.storage.db.execute(f"PRAGMA {name}").fetchone()[0]
    )


def test_cancelled_call_with_request_id_acquires_at_most_once(server, channel) -> None:  # type: ignore[no-untyped-def]
    """Over the wire the cancel may or may not beat the request to the server;
    either way a retry with the same id yields exactly one acquisition. (That
    a queued write survives its caller's cancellation is proven at the writer:
    tests/unit/test_writer.py::test_a_cancelled_caller_abandons_its_reply_not_its_write.)"""
    from fencepost.v1 import ledger_pb2_grpc

    ledger = ledger_pb2_grpc.LedgerStub(channel)
    fut = ledger.Acquire.future(pb.AcquireRequest(run_id="c", owner="w", request_id="c1"))
    fut.cancel()
    server.call(lambda: server.writer.wait_idle())
    again = ledger.Acquire(pb.AcquireRequest(run_id="c", owner="w", request_id="c1"))
    # either the first call's write landed (answered from the request cache)
    # or it never reached the server; in both cases exactly one acquisition
    assert again.run.fencing_token == 1
    with pytest.raises(grpc.RpcError):
        ledger.Acquire(pb.AcquireRequest(run_id="c", owner="other"))


@pytest.mark.sqlite_only
def test_refuses_an_unreadable_stored_record(tmp_path: Path) -> None:
    path = tmp_path / "bad-record.db"
    st = SqliteStorage(path)
    st.open()
    st.db.execute(
        "INSERT INTO runs (block, run_id, version, status, fencing_token, owner, revision, "
        "record) VALUES (0, 'r', 1, 2, 1, NULL, 1, '{not json')"
    )
    st.close()
    before = path.read_bytes()
    st = SqliteStorage(path)
    st.open()
    with pytest.raises(RuntimeError, match="unreadable"):
        st.load()
    st.close()
    assert path.read_bytes() == before


def test_a_start_refused_after_the_database_opened_closes_it(tmp_path: Path) -> None:
    """Its port taken, a start fails after it opened the file: the file's
    lock and the writer go with it, so the same process can start on it."""
    db = str(tmp_path / "reused.db")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        srv = ServerThread(db, listen=f"127.0.0.1:{taken.getsockname()[1]}")
        try:
            with pytest.raises(RuntimeError):
                srv.start()
        finally:
            srv.close()
    with ServerThread(db) as again, grpc.insecure_channel(again.address) as ch:
        got = ledger_pb2_grpc.LedgerStub(ch).Acquire(
            pb.AcquireRequest(run_id="after-a-failed-start", owner="w"))
    assert got.run.fencing_token == 1
