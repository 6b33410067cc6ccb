"""A clean shutdown saves the finished runs' index entries, and the next start
reads them instead of gathering and sorting the ids: on either backend the
index and the block map it builds equal those the full gathering builds. A
saved index is used only while it describes the database exactly: any write
after it, a row added or removed behind the server's back, a damaged row, or
a shutdown that could not bring the runs table up to date leaves it unused
(and the start-up gathers the ids as before)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _db import raw

from fencepost_server.core import ledger as L
from fencepost_server.core.records import Lease, Outcome, Status
from fencepost_server.storage import SqliteStorage, is_url, sql
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.storage.sql import COLD_STATUSES, SAVED_CHUNK
from fencepost_server.storage.sqlite import MIGRATIONS
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Reads, Writer
from fencepost_server.writer.index import RunIndex


def _storage(db: str) -> Any:
    return PostgresStorage(db) if is_url(db) else SqliteStorage(db)


async def _started(db: str) -> Writer:
    w = Writer(_storage(db), ManualClock(1_700_000_000_000), materialize_after_ms=0)
    await w.start()
    return w


async def _fill(w: Writer, count: int, prefix: str = "") -> None:
    """Runs of every status, random ids, three owners: a fifth left running."""
    for i in range(count):
        run_id = prefix + uuid.uuid4().hex
        rec = await w.submit(L.Acquire(run_id, f"w{i % 3}"))
        if i % 5 == 1:
            await w.submit(L.Cancel(run_id))
        elif i % 5 == 2:
            await w.submit(L.Finish(run_id, f"w{i % 3}", rec.fencing_token, Status.FAILED,
                                    Outcome("boom")))
        elif i % 5 != 0:
            await w.submit(L.Finish(run_id, f"w{i % 3}", rec.fencing_token, Status.COMPLETED))
    await w.wait_idle()


def _entries(index: RunIndex) -> tuple[Any, ...]:
    return (list(index), dict(index.status_of), dict(index.owner_of),
            {k: list(v) for k, v in index.by_status.items()},
            {k: list(v) for k, v in index.by_owner.items()})


def _load(db: str) -> tuple[Any, RunIndex, dict[str, int]]:
    """What a start-up loads: the state, its index, and the block map."""
    st = _storage(db)
    st.open()
    try:
        state = st.load()
        return state, RunIndex(state.runs.values(), cold=state.cold), dict(st.rows)
    finally:
        st.close()


def _forget_saved(db: str) -> None:
    with raw(db, write=True) as conn:
        conn.run("DELETE FROM saved_index")


def _touched_rows(db: str) -> set[int]:
    with raw(db) as conn:
        return {int(r[0]) for r in conn.rows("SELECT block FROM touched_blocks")}


@contextlib.asynccontextmanager
async def _storage_after_fill(db: str, runs: int) -> AsyncIterator[tuple[Any, Any]]:
    """A server fills ``runs`` and stops cleanly; then the storage alone is
    opened on the database and loaded: (storage, loaded state)."""
    w = await _started(db)
    await _fill(w, runs)
    await w.close()
    st = _storage(db)
    st.open()
    try:
        yield st, st.load()
    finally:
        st.close()


def _saved_revisions(db: str) -> set[int]:
    with raw(db) as conn:
        return {int(r[0]) for r in conn.rows("SELECT revision FROM saved_index")}


async def test_a_clean_shutdown_saves_the_index_the_next_start_reads(db: str) -> None:
    w = await _started(db)
    for odd in ['q"uote', "back\\slash", "ünï", "\U0001f600-emoji", "\uff61-wide", "[a,b]"]:
        rec = await w.submit(L.Acquire(odd, "w"))
        await w.submit(L.Finish(odd, "w", rec.fencing_token, Status.COMPLETED))
    await _fill(w, 150)
    live = _entries(w.state.index)
    blocks = dict(w.storage.rows)
    revision = w.state.revision
    await w.close()
    assert _saved_revisions(db) == {revision}

    state, index, rows = _load(db)
    finished = sum(1 for s in live[1].values() if s in COLD_STATUSES)
    assert state.saved == finished == 126 and not state.replayed
    assert _entries(index) == live  # as the server held it ...
    assert rows == blocks
    # a server that writes nothing leaves the saved entries as they are
    idle = await _started(db)
    saves = 0
    real_save = idle.storage.save_index

    def counted(*args: Any) -> int:
        nonlocal saves
        saves += 1
        return real_save(*args)

    idle.storage.save_index = counted  # type: ignore[method-assign]
    await idle.close()
    assert saves == 0 and _saved_revisions(db) == {revision}
    _forget_saved(db)
    state2, index2, rows2 = _load(db)
    assert state2.saved == 0
    assert _entries(index2) == live and rows2 == blocks  # ... and as the full gathering builds it
    # a block's runs share one number object, as the gathering leaves them
    by_block: dict[int, set[int]] = {}
    for run_id, block in rows.items():
        by_block.setdefault(block, set()).add(id(rows[run_id]))
    assert all(len(objects) == 1 for objects in by_block.values())


async def _crash_after_writes(db: str, late: int) -> tuple[Any, dict[str, int], str, str, str]:
    """A clean stop, then a server that changes the table every way it can —
    new runs (new blocks), a run left running at the stop finished in its old
    block, a finished run deleted, one deleted and created again, one changed
    in place by the raw seam (another finished status and lease owner) — and
    stops without saving (as a crash would): what it held, its block map, and
    the ids of the finished, the deleted and the changed run."""
    w = await _started(db)
    await _fill(w, 150)
    await w.close()
    w2 = await _started(db)
    reads = Reads(w2.storage, lambda: w2.state)
    cold = [k for k in w2.state.index if reads.is_cold(k)]
    victim, again = cold[0], cold[1]
    changed = next(k for k in cold[2:] if w2.state.index.status_of[k] is not Status.CANCELLED)
    await w2.submit(L.DeleteRun(victim))
    await w2.submit(L.DeleteRun(again))
    await w2.submit(L.Acquire(again, "w-new"))
    runner = next(iter(w2.state.runs.values()))
    assert runner.lease is not None
    await w2.submit(L.Finish(runner.run_id, runner.lease.owner, runner.fencing_token,
                             Status.COMPLETED))
    cur = await reads.read_run(changed)
    await reads.close()
    assert cur is not None and cur.status is not Status.CANCELLED
    await w2.submit(L.RawCompareAndSet(changed, cur.version, dataclasses.replace(
        cur, version=cur.version + 1, fencing_token=cur.fencing_token + 1,
        status=Status.CANCELLED, outcome=Outcome("cancelled"),
        lease=Lease("w-raw", cur.created_at, cur.updated_at, 1000))))
    await _fill(w2, late, prefix="late-")
    await w2.wait_idle()
    live = _entries(w2.state.index)
    w2.evict_finished = False  # skips the save; the runs table is still brought up to date
    await w2.close()
    return live, dict(w2.storage.rows), runner.run_id, victim, changed


@pytest.mark.parametrize(("block_runs", "late", "read_by"), [
    (1, 6, "key"),  # a few blocks changed: their rows read by their key
    (8, 20, "status index"),  # more: read from the status index
    (8, 300, "nothing saved"),  # most of the table: every id gathered
])
async def test_a_start_after_a_crash_reads_the_saved_index_and_the_blocks_changed_since(
    db: str, block_runs: int, late: int, read_by: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(sql, "BLOCK_RUNS", block_runs)  # more blocks for fewer runs
    live, blocks, finished, victim, changed = await _crash_after_writes(db, late)
    saved_at = _saved_revisions(db)
    touched = _touched_rows(db)
    assert len(saved_at) == 1 and touched
    in_table = max(blocks.values()) + 1
    assert (len(touched) * 8 <= in_table, len(touched) * 2 <= in_table) == {
        "key": (True, True), "status index": (False, True), "nothing saved": (False, False),
    }[read_by]
    with caplog.at_level(logging.INFO, "fencepost.storage"):
        state, index, rows = _load(db)
    if read_by == "nothing saved":
        assert state.saved == 0 and "gathering the finished runs' ids" in caplog.text
    else:
        assert 0 < state.saved == sum(1 for s in live[1].values() if s in COLD_STATUSES)
        assert f"from the {len(touched)} blocks changed since" in caplog.text
    assert _entries(index) == live and rows == blocks
    assert victim not in index
    assert index.status_of[finished] is Status.COMPLETED
    assert index.status_of[changed] is Status.CANCELLED and index.owner_of[changed] == "w-raw"
    # the full gathering builds the same
    _forget_saved(db)
    state2, index2, rows2 = _load(db)
    assert state2.saved == 0 and _entries(index2) == live and rows2 == blocks


async def test_a_saved_index_from_before_blocks_were_recorded_is_used_only_if_exact(
    tmp_path: Path,
) -> None:
    """Upgrading a SQLite file: the migration that adds the record of changed
    blocks keeps saved entries only if they describe the table as it is (the
    PostgreSQL migration's statement is the same)."""
    for stale in (False, True):
        path = str(tmp_path / f"{stale}.db")
        w = await _started(path)
        await _fill(w, 30)
        await w.close()
        with raw(path, write=True) as conn:
            conn.run("DROP TABLE touched_blocks")
            conn.run("PRAGMA user_version=6")
            if stale:  # written after the save by a release that recorded no blocks
                conn.run("UPDATE meta SET value = value + 1")
        with raw(path, write=True) as conn:
            for stmt in MIGRATIONS[6]:
                conn.run(stmt)
            conn.run("PRAGMA user_version=7")
        assert bool(_saved_revisions(path)) is not stale


@pytest.mark.parametrize("change", ["row added", "row removed", "damaged"])
async def test_a_saved_index_that_does_not_match_the_database_is_ignored(
    db: str, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = await _started(db)
    await _fill(w, 40)
    live = _entries(w.state.index)
    await w.close()
    with raw(db, write=True) as conn:
        if change == "row added":  # a finished run the saved index does not know
            conn.run("INSERT INTO runs (block, run_id, version, status, fencing_token, owner, "
                     "revision, record) SELECT block, 'zz-extra', version, status, "
                     "fencing_token, owner, revision, record FROM runs WHERE status = 4 "
                     "ORDER BY run_id LIMIT 1")
        elif change == "row removed":
            conn.run("DELETE FROM runs WHERE run_id IN (SELECT run_id FROM runs "
                     "WHERE status = 5 ORDER BY run_id LIMIT 1)")
        else:  # an id cut off: the row no longer holds n ids
            conn.run("UPDATE saved_index SET ids = substr(ids, 1, 40) WHERE seq = 0")
    with caplog.at_level(logging.WARNING, "fencepost.storage"):
        state, index, _ = _load(db)
    assert state.saved == 0
    if change == "row added":
        assert "zz-extra" in index and len(index) == len(live[0]) + 1
        assert "does not match the runs table" in caplog.text
    elif change == "row removed":
        assert len(index) == len(live[0]) - 1
    else:
        assert _entries(index) == live


async def test_a_shutdown_that_leaves_changes_unmaterialized_saves_nothing_new(db: str) -> None:
    w = await _started(db)
    await _fill(w, 20)
    await w.close()
    w2 = await _started(db)
    w2._apply.materialize_after_ms = 3_600_000
    await _fill(w2, 20, prefix="late-")
    live = _entries(w2.state.index)
    w2._apply.pending.clear()  # as if the copy into runs had failed: only the change log has them
    await w2.close()
    state, index, _ = _load(db)
    # the saved entries still describe the table; the change log adds the rest
    assert state.saved > 0 and state.replayed > 0
    assert _entries(index) == live


async def test_groups_over_many_rows_round_trip(db: str) -> None:
    """A status with more ids than one saved row holds spans several rows."""
    async with _storage_after_fill(db, 5) as (st, state):
        rows = dict(st.rows)
        block = next(iter(rows.values()))
        many = sorted(f"bulk-{i:07d}" for i in range(SAVED_CHUNK + 10))
        st.rows.update(dict.fromkeys(many, block))
        groups = [(4, None, many), (5, "w1", ["x-1", "x-2"])]
        st.rows.update({"x-1": block, "x-2": block})
        with st.transaction():
            assert st.save_index(groups, state.revision) == len(many) + 2
        with raw(db) as conn:
            assert [int(r[0]) for r in conn.rows("SELECT n FROM saved_index ORDER BY seq")] == [
                SAVED_CHUNK, 10, 2]
        # the table does not hold those runs: the saved index is refused
        st.rows = {}
        assert st._saved_groups(st.db, len(state.runs), {}) is None
        # an id the block map does not know is not saved, and nothing stale is kept
        with st.transaction():
            assert st.save_index([(4, None, ["not-a-row"])], state.revision) == 0
        assert _saved_revisions(db) == set()


async def test_the_blocks_held_as_recorded_follow_the_table(db: str) -> None:
    """The storage records a changed block once (renewals of many leases touch
    the same blocks in every copy into the runs table), so what it holds as
    recorded must be what the table holds: after a copy, after a transaction
    that failed, and after a save that emptied it."""
    async with _storage_after_fill(db, 30) as (st, state):
        assert st._touched == set() == _touched_rows(db)
        rec = next(iter(state.runs.values()))
        block = st.rows[rec.run_id]
        newer = dataclasses.replace(rec, version=rec.version + 1)

        def copy(*records: Any) -> None:
            st._materialize(st.db, [(r.run_id, r) for r in records], state.revision,
                            state.revision)

        with pytest.raises(RuntimeError), st.transaction():
            copy(newer)
            raise RuntimeError("the batch failed")
        assert st._touched == set() == _touched_rows(db)
        with st.transaction():
            copy(newer)
        assert st._touched == {block} == _touched_rows(db)
        with raw(db, write=True) as conn:  # were it recorded again, the row would be back
            conn.run("DELETE FROM touched_blocks")
        with st.transaction():
            copy(newer)
        assert _touched_rows(db) == set()
        with raw(db, write=True) as conn:
            conn.run("INSERT INTO touched_blocks (block) VALUES (?)", (block,))
        # a save empties both, and a copy in the same transaction after it counts
        with st.transaction():
            st.save_index([], state.revision)
            copy(newer)
        assert st._touched == {block} == _touched_rows(db)
        with st.transaction():
            copy(newer)
            st.save_index([], state.revision)
        assert st._touched == set() == _touched_rows(db)
        with st.transaction():
            copy(newer)
        with pytest.raises(RuntimeError), st.transaction():
            st.save_index([], state.revision)
            raise RuntimeError("the batch failed")
        assert st._touched == {block} == _touched_rows(db)
