"""The runs table is keyed by (block, run id), blocks counting up as runs are
first copied there, and the server finds a run's block through a map held in
memory (``SqlStorage.rows``), on either backend: new runs go in the last
block whatever their ids, a block's runs share one block number object, the
map always says where each run's one row is (after deletes, re-creations, a
failed commit and a restart), a table with two rows for one run is refused,
and databases written with the table keyed by run id alone are migrated with
every run kept."""

from __future__ import annotations

import dataclasses
import sqlite3
import uuid
from typing import Any

import pytest
from _db import raw, snapshot

from fencepost_server.core import ledger as L
from fencepost_server.core.records import Record, Status
from fencepost_server.storage import SqliteStorage, is_url, postgres
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.storage.sql import BLOCK_RUNS
from fencepost_server.storage.sqlite import MIGRATIONS
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Reads, Writer


def _storage(db: str) -> Any:
    return PostgresStorage(db) if is_url(db) else SqliteStorage(db)


def _table(db: str) -> list[tuple[int, str]]:
    """(block, run id) of every row, in key order."""
    with raw(db) as conn:
        return [(int(block), run_id) for block, run_id in conn.rows(
            "SELECT block, run_id FROM runs ORDER BY block, run_id")]


def _map(rows: dict[str, int]) -> list[tuple[int, str]]:
    return sorted((block, run_id) for run_id, block in rows.items())


async def _started(storage: Any) -> Writer:
    """A writer on ``storage`` that copies runs into the runs table in the
    batch after their change (no delay)."""
    w = Writer(storage, ManualClock(1_700_000_000_000), materialize_after_ms=0)
    await w.start()
    return w


async def _read(w: Writer, ids: list[str]) -> dict[str, Record]:
    """The committed records of ``ids``, as GetRun reads them."""
    reads = Reads(w.storage, lambda: w.state)
    try:
        return await reads.read_runs(ids)
    finally:
        await reads.close()


async def _make(w: Writer, run_id: str, finish: bool) -> Record:
    rec = await w.submit(L.Acquire(run_id, "w"))
    if finish:
        rec = await w.submit(L.Finish(run_id, "w", rec.fencing_token, Status.COMPLETED))
    assert isinstance(rec, Record)
    return rec


async def _a_new_run_goes_after(w: Writer, table: list[tuple[int, str]]) -> None:
    """The first run made after a restart goes in a block after every row the
    table held."""
    w._apply.materialize_after_ms = 0
    await _make(w, "after-restart", finish=True)
    await _make(w, "tick", finish=False)  # a batch after it: it copies the run
    await w.wait_idle()
    assert w.storage.rows["after-restart"] > max(block for block, _ in table)


async def test_new_rows_follow_every_older_one_and_the_map_finds_each(db: str) -> None:
    w = await _started(_storage(db))
    try:
        first = [uuid.uuid4().hex for _ in range(40)]
        for i, run_id in enumerate(first):
            await _make(w, run_id, finish=i % 4 != 0)
        await w.wait_idle()
        before = _table(db)
        assert sorted(run_id for _, run_id in before) == sorted(first)
        # deleted runs lose their rows; a deleted id made again gets a new one, last
        gone = [run_id for i, run_id in enumerate(first) if i % 4 == 1][:5]
        for run_id in gone:
            await w.submit(L.DeleteRun(run_id))
        await w.wait_idle()
        again = await _make(w, gone[0], finish=True)
        later = [uuid.uuid4().hex for _ in range(10)]
        for run_id in later:
            await _make(w, run_id, finish=True)
        await w.wait_idle()
        after = _table(db)
        ids = [run_id for _, run_id in after]
        assert len(ids) == len(set(ids)) == 40 - 5 + 1 + 10
        # the runs first written after ``before`` are in its last block or later
        top = max(block for block, _ in before)
        assert {k for block, k in after if block >= top} >= {gone[0], *later}
        assert {k for block, k in after if block < top} <= set(first)
        assert not set(gone[1:]) & set(ids)
        assert _map(w.storage.rows) == after
        records = await _read(w, ids)
        assert records[gone[0]] == again and len(records) == len(ids)
    finally:
        await w.close()
    # a restart builds the same map from the table, and reads every run back
    w2 = Writer(_storage(db), w.clock)
    await w2.start()
    try:
        assert _map(w2.storage.rows) == after
        assert await _read(w2, ids) == records
        assert all(k not in w2.state.runs and k in w2.state.index
                   for k in ids if records[k].status is Status.COMPLETED)
        await _a_new_run_goes_after(w2, after)
    finally:
        await w2.close()


async def test_a_failed_commit_leaves_the_map_as_the_table_is(db: str) -> None:
    w = await _started(_storage(db))
    try:
        done = await _make(w, "done", finish=True)
        await _make(w, "live", finish=False)
        await w.wait_idle()
    finally:
        await w.close()
    st = _storage(db)
    st.open()
    try:
        state = st.load()
        rows, table = dict(st.rows), _table(db)
        mark = st.materialized_mark()
        new = dataclasses.replace(done, run_id="new")
        with pytest.raises(RuntimeError, match="lost power"), st.transaction():
            st._materialize(st.db, [("new", new), ("done", None)], mark, state.revision)
            raise RuntimeError("lost power before COMMIT")
        assert st.rows == rows and _table(db) == table
        assert st.read_runs(["new", "done"]) == {"done": done}
        with st.transaction():
            st._materialize(st.db, [("new", new)], mark, state.revision)
        assert st.rows["new"] > max(rows.values()) and st.rows.items() >= rows.items()
        assert st.read_runs(["new", "done"]) == {"new": new, "done": done}
        assert _table(db) == _map(st.rows)
    finally:
        st.close()


async def test_two_rows_for_one_run_refuse_to_start_and_change_nothing(db: str) -> None:
    w = await _started(_storage(db))
    try:
        await _make(w, "a", finish=True)
        await _make(w, "b", finish=False)
        await w.wait_idle()
    finally:
        await w.close()
    with raw(db, write=True) as conn:
        conn.run("INSERT INTO runs (block, run_id, version, status, fencing_token, owner, "
                 "revision, record) SELECT block + 100, run_id, version, status, fencing_token, "
                 "owner, revision, record FROM runs WHERE run_id = 'a'")
    before = snapshot(db)
    st = _storage(db)
    st.open()
    try:
        with pytest.raises(RuntimeError, match="two rows for one run"):
            st.load()
    finally:
        st.close()
    assert snapshot(db) == before


_OLD_COLUMNS = "run_id, version, status, fencing_token, owner, revision, record"


def _keyed_by_run_id(db: str) -> None:
    """Make ``db`` a database as the release before ``seq`` wrote it: the runs
    table keyed by run id (SQLite schema 4, PostgreSQL schema 1)."""
    if is_url(db):
        with raw(db, write=True) as conn:
            conn.run(f"DROP SCHEMA IF EXISTS {postgres.SCHEMA} CASCADE")
            conn.run(f"CREATE SCHEMA {postgres.SCHEMA}")
            conn.run("CREATE TABLE fencepost_schema (version INTEGER NOT NULL)")
            conn.run("INSERT INTO fencepost_schema VALUES (1)")
            for stmt in postgres.MIGRATIONS[0]:
                conn.run(stmt)
        return
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        for stmts in MIGRATIONS[:4]:
            for stmt in stmts:
                conn.execute(stmt)
        conn.execute("PRAGMA user_version=4")
    finally:
        conn.close()


async def test_a_table_keyed_by_run_id_is_migrated_with_every_run(db: str, tmp_path: Any) -> None:
    # the runs, made by this release on a database of their own ...
    source = str(tmp_path / "source.db")
    w = await _started(SqliteStorage(source))
    try:
        ids = [uuid.uuid4().hex for _ in range(30)]
        for i, run_id in enumerate(ids):
            await _make(w, run_id, finish=i % 3 != 0)
        await w.wait_idle()
        records = await _read(w, ids)
        revision = w.state.revision
    finally:
        await w.close()
    with raw(source) as conn:
        rows = conn.rows(f"SELECT {_OLD_COLUMNS} FROM runs")
    # ... written into a table keyed by run id, as the previous schema had it
    _keyed_by_run_id(db)
    with raw(db, write=True) as conn:
        for row in rows:
            conn.run(f"INSERT INTO runs ({_OLD_COLUMNS}) VALUES (?,?,?,?,?,?,?)", row)
        conn.run("UPDATE meta SET value = ? WHERE key IN ('revision', 'materialized')",
                 (revision,))
    w2 = Writer(_storage(db), w.clock)
    await w2.start()
    try:
        assert await _read(w2, ids) == records
        assert sorted(w2.state.index) == sorted(ids)
        assert set(w2.state.runs) == {k for k, r in records.items() if r.status is Status.RUNNING}
        table = _table(db)
        assert sorted(k for _, k in table) == sorted(ids)
        assert _map(w2.storage.rows) == table
        await _a_new_run_goes_after(w2, table)
    finally:
        await w2.close()


async def test_a_block_holds_its_share_of_runs_and_they_share_its_number(db: str) -> None:
    """Every BLOCK_RUNS new rows start the next block, and the map holds one
    int object per block (what keeps it at the cost of its entries), before
    and after a restart."""
    w = await _started(_storage(db))
    count = 2 * BLOCK_RUNS + 10
    try:
        for i in range(count):
            await _make(w, uuid.uuid4().hex, finish=i % 2 == 0)
        await w.wait_idle()
        await _make(w, "tick", finish=False)  # a batch after the last: it copies them
        await w.wait_idle()
        live = dict(w.storage.rows)
        assert len(live) == count
        assert len({id(block) for block in live.values()}) == len(set(live.values())) == 3
    finally:
        await w.close()
    per_block: dict[int, int] = {}
    for block, _ in _table(db):
        per_block[block] = per_block.get(block, 0) + 1
    assert sorted(per_block.values(), reverse=True) == [BLOCK_RUNS, BLOCK_RUNS, 11]
    w2 = Writer(_storage(db), w.clock)
    await w2.start()
    try:
        loaded = w2.storage.rows
        assert loaded.items() >= live.items() and len(loaded) == count + 1
        # one object per block and group (status, owner) at most
        assert len({id(block) for block in loaded.values()}) <= 3 * 2
    finally:
        await w2.close()
