"""The SQLite store's write connection: multi-row inserts, and checkpoints
that run beside the writer rather than inside its commits."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from fencepost_server.storage import sqlite as sqlite_storage
from fencepost_server.storage.sqlite import SqliteStorage

UPSERT = (
    "INSERT INTO t (k, v) VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET v = max(t.v, excluded.v)"
)


def _table(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS t (k TEXT PRIMARY KEY, v INTEGER) WITHOUT ROWID")


@pytest.mark.parametrize("rows", [0, 1, 3, 255, 256, 257, 341, 1000])
def test_executemany_of_an_insert_gives_what_one_row_at_a_time_gives(
    tmp_path: Path, rows: int
) -> None:
    st = SqliteStorage(tmp_path / "x.db")
    st.open()
    try:
        db = st.db
        _table(db)
        # keys repeat within one call: conflicts resolve in row order
        data = [(f"k{i % 97}", (i * 7919) % 1000) for i in range(rows)]
        statements: list[str] = []
        db.set_trace_callback(statements.append)
        db.executemany(UPSERT, data)
        db.set_trace_callback(None)
        got = db.execute("SELECT k, v FROM t ORDER BY k").fetchall()
    finally:
        st.close()
    plain = sqlite3.connect(":memory:")
    _table(plain)
    plain.executemany(UPSERT, data)
    assert got == plain.execute("SELECT k, v FROM t ORDER BY k").fetchall()
    # chunks of 256, 64, 16, 4 and 1 rows: at most 3 statements per size
    assert len(statements) <= 4 * 3 + 3 + (1 if rows >= 256 else 0) + rows // 256
    # exactly: as many of each size as fit in what the larger ones left
    expected, left = 0, rows
    for size in (256, 64, 16, 4, 1):
        expected, left = expected + left // size, left % size
    assert len(statements) == expected
    if rows >= 16:
        assert len(statements) < rows / 4


def test_executemany_of_other_statements_runs_row_by_row(tmp_path: Path) -> None:
    st = SqliteStorage(tmp_path / "x.db")
    st.open()
    try:
        db = st.db
        _table(db)
        db.executemany(UPSERT, [(f"k{i}", i) for i in range(10)])
        statements: list[str] = []
        db.set_trace_callback(statements.append)
        db.executemany("DELETE FROM t WHERE k = ?", [(f"k{i}",) for i in range(0, 10, 2)])
        db.set_trace_callback(None)
        assert [k for (k,) in db.execute("SELECT k FROM t ORDER BY k")] == [
            "k1", "k3", "k5", "k7", "k9"
        ]
        assert len(statements) == 5
    finally:
        st.close()


def _wal_frames(path: Path) -> int:
    size = (path.parent / (path.name + "-wal")).stat().st_size
    return max(0, size - 32) // (4096 + 24)


def test_the_wal_is_copied_by_the_checkpointer_not_by_the_writer_and_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_storage._Checkpointer, "RESET_FRAMES", 64)
    monkeypatch.setattr(sqlite_storage._Checkpointer, "CLOSE_FRAMES", 8)
    monkeypatch.setattr(sqlite_storage._Checkpointer, "PAUSE_S", 0.01)
    path = tmp_path / "x.db"
    st = SqliteStorage(path)
    st.open()
    try:
        db = st.db
        # the writer's commits never checkpoint (SQLite's automatic one is off)
        assert db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        with st.transaction():
            _table(db)
        start = path.stat().st_size
        blob = "x" * 3000
        # 3,000 commits of about two pages each, back to back: ten times the
        # frames the WAL would hold if it never started over
        for i in range(3000):
            with st.transaction():
                db.execute("INSERT INTO t (k, v) VALUES (?, ?)", (f"{i:05d}{blob}", i))
        assert _wal_frames(path) < 10 * 64 + 256  # it started over, again and again
        deadline = time.monotonic() + 10
        while path.stat().st_size <= start and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path.stat().st_size > start  # pages reached the database file
        # the checkpointer's connection writes no rows
        ck = st._checkpointer
        assert ck is not None
        with pytest.raises(sqlite3.OperationalError):
            ck._db.execute("INSERT INTO t (k, v) VALUES ('no', 1)")
    finally:
        st.close()
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    assert ro.execute("SELECT count(*) FROM t").fetchone()[0] == 3000
    ro.close()
    assert not os.path.exists(f"{path}-wal") or _wal_frames(path) == 0


class _Failing:
    """Stands in for the checkpointer's connection: refuses while ``failing``."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.failing = True
        self.calls = 0

    def execute(self, sql: str) -> sqlite3.Cursor:
        self.calls += 1
        if self.failing:
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql)

    def close(self) -> None:
        self.db.close()


def test_a_failing_checkpoint_is_logged_once_retried_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sqlite_storage._Checkpointer, "PAUSE_S", 0.01)
    caplog.set_level("INFO", logger="fencepost.storage")
    path = tmp_path / "x.db"
    st = SqliteStorage(path)
    st.open()
    try:
        db = st.db
        ck = st._checkpointer
        assert ck is not None
        stand_in = _Failing(ck._db)
        ck._db = stand_in  # type: ignore[assignment]
        with st.transaction():
            _table(db)
        for i in range(50):
            with st.transaction():
                db.execute("INSERT INTO t (k, v) VALUES (?, ?)", (f"k{i}", i))
            time.sleep(0.002)
        assert stand_in.calls > 1
        failed = [r for r in caplog.records if "WAL checkpoint failed" in r.getMessage()]
        assert len(failed) == 1  # logged once, not once per attempt
        stand_in.failing = False
        with st.transaction():
            db.execute("INSERT INTO t (k, v) VALUES ('last', 1)")
        deadline = time.monotonic() + 10
        while ck._failing and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ck._failing
        assert any("succeeded again" in r.getMessage() for r in caplog.records)
    finally:
        st.close()
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    assert ro.execute("SELECT count(*) FROM t").fetchone()[0] == 51
    ro.close()


def test_a_failed_statement_in_a_transaction_is_a_storage_error_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """What a batch's statements raise reaches the writer as STORAGE_*, as a
    failed COMMIT does, and the transaction is rolled back."""
    from fencepost_server.core.errors import Code, LedgerError

    st = SqliteStorage(tmp_path / "e.db")
    st.open()
    try:
        db = st.db
        with st.transaction():
            _table(db)
        with pytest.raises(LedgerError) as ei, st.transaction():
            db.execute("INSERT INTO t (k, v) VALUES ('kept?', 1)")
            db.execute("INSERT INTO no_such_table VALUES (1)")
        assert ei.value.code is Code.STORAGE_UNAVAILABLE
        assert not db.in_transaction
        assert db.execute("SELECT count(*) FROM t").fetchone()[0] == 0
        with st.transaction():  # the next batch goes on
            db.execute("INSERT INTO t (k, v) VALUES ('next', 1)")
        assert db.execute("SELECT count(*) FROM t").fetchone()[0] == 1
    finally:
        st.close()
