"""Shards (docs/SPEC.md §13) on a real server, on SQLite and PostgreSQL: the
count is stored at a database's first start and a later start with another
count is refused before serving."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from _db import raw
from _wire import expect

import fencepost
from fencepost import SyncClient
from fencepost.v1 import ledger_pb2, ledger_pb2_grpc
from fencepost_server.cli.common import EXIT_REFUSED, EXIT_USAGE
from fencepost_server.cli.main import main
from fencepost_server.config import Settings, SettingsError
from fencepost_server.core.shards import DEFAULT_SHARDS
from fencepost_server.storage import sqlite
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread
from fencepost_server.writer import reads


@pytest.fixture
def new_db(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database no server has opened yet (the pool's are already migrated)."""
    if backend == "sqlite":
        yield str(tmp_path / "new.db")
        return
    cluster = request.getfixturevalue("pg_cluster")
    name = f"shards_{uuid.uuid4().hex[:10]}"
    url = cluster.create_database(name)
    try:
        yield url
    finally:
        cluster.drop_database(name)


def stored_shards(location: str) -> int:
    with raw(location) as conn:
        return int(conn.rows("SELECT value FROM meta WHERE key = 'shards'")[0][0])


def started_shards(location: str, **settings: object) -> int:
    with ServerThread(location, **settings) as srv:
        return int(srv.writer.storage.shards)


def test_a_new_database_stores_the_count_it_was_started_with(new_db: str) -> None:
    assert started_shards(new_db, shards=16) == 16
    assert stored_shards(new_db) == 16
    assert started_shards(new_db) == 16  # without --shards: the stored count
    assert started_shards(new_db, shards=16) == 16


def test_a_new_database_started_without_a_count_gets_the_default(new_db: str) -> None:
    assert started_shards(new_db) == DEFAULT_SHARDS == 64
    assert stored_shards(new_db) == 64


def test_a_start_with_another_count_is_refused_naming_both_and_the_flag(new_db: str) -> None:
    started_shards(new_db, shards=16)
    srv = ServerThread(new_db, shards=32)
    try:
        with pytest.raises(RuntimeError) as refused:
            srv.start()
    finally:
        srv.close()
    message = str(refused.value)
    assert "has 16 shards" in message and "--shards 32" in message
    assert "--shards 16" in message and "refusing to start" in message
    assert stored_shards(new_db) == 16
    assert started_shards(new_db) == 16


def test_a_database_of_the_previous_schema_gets_the_default_count(new_db: str) -> None:
    started_shards(new_db)
    is_pg = new_db.startswith("postgresql://")
    # the last schema before the shard count (PostgreSQL 5: then came the
    # count and the shard rows, ha/shards.py)
    previous = 5 if is_pg else sqlite.SCHEMA_VERSION - 1
    with raw(new_db, write=True) as conn:
        if is_pg:
            conn.run("DROP TABLE fencepost_shards, fencepost_members")
            conn.run("DROP SEQUENCE fencepost_revision_blocks")
            conn.run("DROP INDEX changes_by_time")
            conn.run("ALTER TABLE engine_uploads DROP COLUMN started_by")
            conn.run("DROP FUNCTION fencepost_shard")
            conn.run("DELETE FROM meta WHERE key = 'lead_shards'")
            conn.run("DROP TABLE changes_pruned")
        conn.run("DELETE FROM meta WHERE key = 'shards'")
        conn.run(f"UPDATE fencepost_schema SET version = {previous}" if is_pg
                 else f"PRAGMA user_version={previous}")
    # an existing database is never given another count, whatever the flag says
    srv = ServerThread(new_db, shards=16)
    try:
        with pytest.raises(RuntimeError, match="has 64 shards"):
            srv.start()
    finally:
        srv.close()
    with raw(new_db) as conn:  # refused before any change: still the previous schema
        assert conn.rows("SELECT value FROM meta WHERE key = 'shards'") == []
        assert conn.rows("SELECT version FROM fencepost_schema" if is_pg
                         else "PRAGMA user_version") == [(previous,)]
    assert started_shards(new_db) == 64
    assert stored_shards(new_db) == 64


@pytest.mark.sqlite_only  # the flag and its checks, before any database opens
def test_a_count_out_of_bounds_names_the_flag_or_the_variable(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "never.db")
    for bad in ("0", "4097", "-3"):
        assert main(["serve", "--db", db, "--shards", bad]) == EXIT_USAGE
        assert f"--shards={int(bad)}: must be between 1 and 4096" in capsys.readouterr().err
    assert main(["serve", "--db", db, "--shards", "many"]) == EXIT_USAGE
    assert "--shards" in capsys.readouterr().err
    with pytest.raises(SettingsError, match="FENCEPOST_SHARDS=5000: must be between"):
        Settings.from_env({"FENCEPOST_SHARDS": "5000"})
    with pytest.raises(SettingsError, match="FENCEPOST_SHARDS='x'"):
        Settings.from_env({"FENCEPOST_SHARDS": "x"})
    assert Settings.from_env({"FENCEPOST_SHARDS": "16"}).shards == 16
    assert Settings.from_env({"FENCEPOST_SHARDS": "16"}, shards=8).shards == 8
    assert not Path(db).exists()


@pytest.mark.sqlite_only
def test_fencepost_serve_refuses_another_count_with_exit_1(backend: str, tmp_path: Path) -> None:
    db = str(tmp_path / "f.db")
    started_shards(db, shards=16)
    fencepost_bin = Path(sys.executable).parent / "fencepost"
    done = subprocess.run(
        [str(fencepost_bin), "serve", "--db", db, "--shards", "32", "--listen", "127.0.0.1:0",
         "--http-listen", "off"], capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL)
    assert done.returncode == EXIT_REFUSED, done.stderr
    assert "has 16 shards" in done.stderr and "--shards 32" in done.stderr
    assert stored_shards(db) == 16


# -- the Shards RPC -------------------------------------------------------------------


def expected_counts(run_ids: list[str], n: int) -> list[int]:
    counts = [0] * n
    for run_id in run_ids:
        counts[fencepost.shard_of(run_id, n)] += 1
    return counts


def test_the_map_counts_each_run_and_live_lease_in_its_shard(
    server: ServerThread, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "SHARD_SCAN_CHUNK", 7)  # many chunks, and a short last one
    monkeypatch.setattr(reads, "SHARD_COUNT_REUSE_MS", 0)  # every call counts afresh
    run_ids = [f"shard-run-{i}" for i in range(200)]
    with SyncClient(server.address, owner="w-shards", renewal="off") as client:
        leases = [client.acquire(r, ttl_ms=60_000) for r in run_ids]
        got = client.shards()
        assert got.shard_count == len(got.shards) == 64
        assert [s.index for s in got.shards] == list(range(64))
        assert [s.runs for s in got.shards] == expected_counts(run_ids, 64)
        assert [s.leases for s in got.shards] == expected_counts(run_ids, 64)
        assert sum(s.runs for s in got.shards) == 200
        assert got.revision >= 200
        for run_id in run_ids[:5]:
            assert client.shard_of(run_id) == fencepost.shard_of(run_id, 64)
            assert got.shard_of(run_id) == fencepost.shard_of(run_id, 64)

        for lease in leases[:50]:  # finished: still runs, no longer leases
            lease.finish("completed")
        client.acquire("shard-late", ttl_ms=1_000)
        got = client.shards()
        assert [s.runs for s in got.shards] == expected_counts([*run_ids, "shard-late"], 64)
        assert [s.leases for s in got.shards] == expected_counts(
            [*run_ids[50:], "shard-late"], 64)

        clock.advance(1_000)  # expired exactly at T + D: not live
        got = client.shards()
        assert [s.leases for s in got.shards] == expected_counts(run_ids[50:], 64)
        clock.advance(60_000)
        assert sum(s.leases for s in client.shards().shards) == 0
        assert sum(s.runs for s in client.shards().shards) == 201


def test_callers_within_a_second_share_one_count(
    server: ServerThread, clock: ManualClock
) -> None:
    """However often a worker asks, the run ids are hashed at most once a
    second: a count is answered again until a second has passed."""
    with SyncClient(server.address, owner="w-shards", renewal="off") as client:
        client.acquire("shared-a", ttl_ms=60_000)
        first = client.shards()
        client.acquire("shared-b", ttl_ms=60_000)
        again = client.shards()
        assert again.revision == first.revision
        assert sum(s.runs for s in again.shards) == sum(s.runs for s in first.shards)
        clock.advance(1_000)
        later = client.shards()
        assert later.revision > first.revision
        assert sum(s.runs for s in later.shards) == sum(s.runs for s in first.shards) + 1


def test_every_shard_names_this_coordinator_and_its_epoch(server: ServerThread) -> None:
    app = server.app
    assert app is not None
    with SyncClient(server.address, owner="w-map") as client:
        shards = client.shards().shards
    if app.leadership is None:  # SQLite: this process, no epoch
        owner, address, epoch = f"{socket.gethostname()}/{os.getpid()}", server.address, 0
    else:
        owner, address, epoch = app.leadership.identity, app.leadership.address, \
            app.leadership.epoch
        assert epoch is not None and epoch >= 1 and address == server.address
    assert {(s.owner, s.address, s.epoch) for s in shards} == {(owner, address, epoch)}


def test_the_map_over_the_wire_has_the_stored_count(
    new_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "SHARD_COUNT_REUSE_MS", 0)
    with ServerThread(new_db, shards=5) as srv, grpc.insecure_channel(srv.address) as ch:
        resp = ledger_pb2_grpc.LedgerStub(ch).Shards(ledger_pb2.ShardsRequest(), timeout=10)
        assert resp.shard_count == 5 and [s.index for s in resp.shards] == list(range(5))
        with SyncClient(srv.address, owner="w") as client:
            client.acquire("only-run")
            assert client.shard_of("only-run") == fencepost.shard_of("only-run", 5)
            assert [s.runs for s in client.shards().shards] == expected_counts(["only-run"], 5)


def test_a_standby_answers_not_leader_naming_the_leader(backend: str, db: str) -> None:
    if backend != "postgres":
        pytest.skip("only PostgreSQL has standbys")
    with ServerThread(db, max_clock_skew="0") as leader, \
            ServerThread(db, max_clock_skew="0", wait_leading=0) as standby:
        assert standby.app is not None and standby.app.leadership is not None
        deadline = time.monotonic() + 30
        while standby.app.leadership.leader_address != leader.address:  # its campaign read it
            assert time.monotonic() < deadline, "the standby never saw the leader"
            time.sleep(0.02)
        with grpc.insecure_channel(standby.address) as ch:
            e = expect(ledger_pb2_grpc.LedgerStub(ch).Shards, ledger_pb2.ShardsRequest(),
                       grpc.StatusCode.UNAVAILABLE, "NOT_LEADER")
        assert e.metadata["leader"] == leader.address
        # the SDK follows the leader the standby names, as for every read
        with SyncClient([standby.address, leader.address], owner="w") as client:
            assert {s.address for s in client.shards().shards} == {leader.address}


async def test_the_async_client_fetches_the_count_once_for_shard_of(server: ServerThread) -> None:
    async with fencepost.Client(server.address, owner="w-async") as client:
        async with client.acquire("async-run") as lease:
            assert await client.shard_of("async-run") == fencepost.shard_of("async-run", 64)
            got = await client.shards()
            assert got.shards[got.shard_of("async-run")].leases == 1
            await lease.finish("completed")


def test_owners_only_names_each_leader_without_counting(
    server: ServerThread, channel: grpc.Channel
) -> None:
    """What clients route by: who leads each shard, with no pass over the
    runs (that costs a second a million runs), counts 0."""
    ledger_pb2_grpc.LedgerStub(channel).Acquire(ledger_pb2.AcquireRequest(run_id="oo", owner="w"))
    got = ledger_pb2_grpc.LedgerStub(channel).Shards(ledger_pb2.ShardsRequest(owners_only=True))
    assert server.app is not None and server.app.reads is not None
    assert server.app.reads._shard_counts is None  # nothing was counted
    assert len(got.shards) == got.shard_count
    assert {(s.owner, s.address, s.epoch) for s in got.shards} == {server.app.shard_owner()}
    assert {(s.runs, s.leases) for s in got.shards} == {(0, 0)}
    assert got.revision == server.writer.state.revision


@pytest.mark.sqlite_only
def test_moving_a_shard_where_one_coordinator_leads_all_is_refused(tmp_path: Path) -> None:
    """(The PostgreSQL leader is the same case; tests/system/test_lead_shards.py
    moves shards between coordinators that lead them apart.)"""
    with ServerThread(str(tmp_path / "one.db")) as srv, SyncClient(srv.address) as client:
        with pytest.raises(fencepost.ValidationError) as err:
            client.move_shard(0, srv.address)
        assert err.value.field == "shard" and "--lead-shards" in str(err.value)
