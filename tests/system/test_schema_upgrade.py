"""Upgrading across a storage schema version: a database as the previous
schema left it is migrated by `fencepost serve` on start and keeps every run
(docs/OPERATIONS.md, "Upgrading"). The previous schema is made from this
release's database by undoing the last migration step, which this test pins:
a new step must be undone here too."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from _db import raw
from _proc import ServerProc

import fencepost
from fencepost_devtools import pgcluster
from fencepost_server.storage import postgres, sqlite

# each store's last migration step, undone: the database its previous schema wrote
PREVIOUS = {
    "sqlite": (sqlite.SCHEMA_VERSION - 1, ["DELETE FROM meta WHERE key = 'shards'",
                                           f"PRAGMA user_version={sqlite.SCHEMA_VERSION - 1}"]),
    "postgres": (postgres.SCHEMA_VERSION - 1, [
        "DROP TABLE changes_pruned",
        f"UPDATE fencepost_schema SET version = {postgres.SCHEMA_VERSION - 1}"]),
}
LAST_STEP = {"sqlite": ["INSERT INTO meta (key, value) VALUES ('shards', 64)"],
             "postgres": ["CREATE TABLE changes_pruned"]}
# the first start's flags, and the shard count the upgraded database then has
# (PostgreSQL: a count other than the default, which its new shard rows follow)
START = {"sqlite": ((), 64), "postgres": (("--shards", "8"), 8)}


def _schema(location: str, store: str) -> int:
    with raw(location) as conn:
        sql = "PRAGMA user_version" if store == "sqlite" else "SELECT version FROM fencepost_schema"
        return int(conn.rows(sql)[0][0])


async def _write(address: str) -> dict[str, tuple[str, int]]:
    tag = uuid.uuid4().hex[:6]
    async with fencepost.Client(address, owner="w-old") as client:
        for i in range(6):
            lease = await client.acquire(f"up-{tag}-{i}", ttl_ms=120_000)
            if i % 3 == 0:
                await lease.finish("completed")
            elif i % 3 == 1:
                await client.cancel(lease.run_id, "operator")
        return {r: ((rec := await client.get(r)).status, rec.fencing_token)
                for r in (f"up-{tag}-{i}" for i in range(6))}


async def _read(address: str, runs: dict[str, tuple[str, int]]) -> None:
    async with fencepost.Client(address, owner="w-new") as client:
        for run_id, (status, token) in runs.items():
            rec = await client.get(run_id)
            assert (rec.status, rec.fencing_token) == (status, token), run_id
        async with client.acquire(f"after-{uuid.uuid4().hex[:6]}", ttl_ms=10_000) as lease:
            await lease.finish("completed")


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_a_database_of_the_previous_schema_is_migrated_and_keeps_its_runs(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    previous, undo = PREVIOUS[store]
    if store == "sqlite":
        location = str(tmp_path / "fencepost.db")
        assert sqlite.MIGRATIONS[-1][0].startswith(LAST_STEP[store][0])
    else:
        cluster: pgcluster.Cluster = request.getfixturevalue("pg_cluster")
        location = cluster.create_database(f"upgrade_{uuid.uuid4().hex[:10]}")
        assert postgres.MIGRATIONS[-1][0].startswith(LAST_STEP[store][0])
    flags, shards = START[store]
    server = ServerProc(location, tmp_path / "server.log", args=("--http-listen", "off", *flags))
    server.start(timeout=60)
    try:
        runs = asyncio.run(_write(server.address))
    finally:
        assert server.stop() == 0, server.log_tail()
    with raw(location, write=True) as conn:
        for stmt in undo:
            conn.run(stmt)
    assert _schema(location, store) == previous

    server.start(timeout=60)
    try:
        assert _schema(location, store) == previous + 1
        with raw(location) as conn:
            assert conn.rows("SELECT value FROM meta WHERE key = 'shards'") == [(shards,)]
            if store == "postgres":  # one shard row per stored shard, none held yet
                assert conn.rows("SELECT shard, epoch, holder, lease_floor FROM "
                                 "fencepost_shards ORDER BY shard") == [
                    (i, 0, "", 0) for i in range(shards)]
                assert conn.rows("SELECT value FROM meta WHERE key = 'lead_shards'") == [(0,)]
        asyncio.run(_read(server.address, runs))
    finally:
        assert server.stop() == 0, server.log_tail()
