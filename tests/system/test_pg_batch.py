"""The PostgreSQL store's batch path writes a batch's change rows with one COPY
(``PgConnection.executemany`` on a plain INSERT): what it stores reads back
exactly (text that COPY must escape included, through a restart that replays
the change log and through the watch history), a COPY that fails fails its
whole batch and leaves nothing, and upserts still go statement by statement."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import psycopg
import pytest

from fencepost_devtools.pgcluster import Cluster
from fencepost_server.clock import SystemClock
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.ledger import Acquire, RecordCheckpoint
from fencepost_server.core.records import Record
from fencepost_server.storage import postgres
from fencepost_server.storage.history import HistoryReader
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.writer import Writer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# what COPY's text format escapes (backslash, tab, newline, CR), a literal \N,
# quotes, and text beyond ASCII
AWKWARD = ["back\\slash", "tab\there", "new\nline", "cr\rhere", "\\N", "quo\"te's",
           "ünïcødé ✓ 𝄞", ""]


@pytest.fixture(scope="module")
def pg() -> Iterator[Cluster]:
    with Cluster.start() as cluster:
        yield cluster


@pytest.fixture
def url(pg: Cluster, request: pytest.FixtureRequest) -> str:
    return pg.create_database(request.node.name.replace("[", "_").replace("]", "")[:60])


def _connection(url: str) -> postgres.PgConnection:
    db = postgres.connect(url, "fencepost-test")  # its search_path: the fencepost schema
    db.execute(f"CREATE SCHEMA IF NOT EXISTS {postgres.SCHEMA}")
    return db


def test_plain_insert_goes_by_copy_and_reads_back_exactly(url: str) -> None:
    db = _connection(url)
    try:
        db.execute("CREATE TABLE t (k BIGINT PRIMARY KEY, s TEXT, n INTEGER)")
        rows = [(i, text, i * 7) for i, text in enumerate(AWKWARD)] + [(99, None, None)]
        copies: list[str] = []
        real_copy = psycopg.Cursor.copy

        def spy(self: psycopg.Cursor, statement: object, *a: object, **kw: object) -> object:
            copies.append(str(statement))
            return real_copy(self, statement, *a, **kw)  # type: ignore[arg-type]

        psycopg.Cursor.copy = spy  # type: ignore[assignment,method-assign]
        try:
            db.execute("BEGIN")
            db.executemany("INSERT INTO t (k, s, n) VALUES (?,?,?)", rows)
            db.execute("COMMIT")
        finally:
            psycopg.Cursor.copy = real_copy  # type: ignore[method-assign]
        assert copies == ["COPY t (k, s, n) FROM STDIN"]
        got = db.execute("SELECT k, s, n FROM t ORDER BY k").fetchall()
        assert got == sorted(rows)
    finally:
        db.close()


def test_a_failed_copy_leaves_nothing(url: str) -> None:
    db = _connection(url)
    try:
        db.execute("CREATE TABLE t (k BIGINT PRIMARY KEY, s TEXT)")
        db.execute("INSERT INTO t VALUES (2, 'there before')")
        db.execute("BEGIN")
        db.execute("INSERT INTO t VALUES (10, 'same transaction')")
        with pytest.raises(psycopg.errors.UniqueViolation):
            db.executemany("INSERT INTO t (k, s) VALUES (?,?)", [(1, "a"), (2, "b"), (3, "c")])
        db.rollback()
        assert not db.in_transaction
        assert db.execute("SELECT k, s FROM t").fetchall() == [(2, "there before")]
    finally:
        db.close()


def test_upserts_still_run_statement_by_statement(url: str) -> None:
    """ON CONFLICT is not a plain INSERT: a repeated key updates, as before."""
    db = _connection(url)
    try:
        db.execute("CREATE TABLE t (k BIGINT PRIMARY KEY, s TEXT)")
        db.execute("BEGIN")
        db.executemany("INSERT INTO t (k, s) VALUES (?,?) ON CONFLICT (k) DO UPDATE SET "
                       "s = excluded.s", [(1, "first"), (1, "second"), (2, "x")])
        db.execute("COMMIT")
        assert db.execute("SELECT k, s FROM t ORDER BY k").fetchall() == [(1, "second"),
                                                                           (2, "x")]
    finally:
        db.close()


async def _write(url: str) -> tuple[dict[str, Record], int]:
    # the runs table is not written before the restart: load replays the change log
    writer = Writer(PostgresStorage(url), SystemClock(), materialize_after_ms=3_600_000)
    await writer.start()
    written: dict[str, Record] = {}
    try:
        for i, text in enumerate(t for t in AWKWARD if t and "\n" not in t and "\t" not in t
                                 and "\r" not in t):
            run_id = f"run {i} {text}"
            rec = await writer.submit(Acquire(run_id, f"owner {text}", ttl_ms=60_000))
            assert isinstance(rec, Record)
            for tail in AWKWARD:
                rec = await writer.submit(RecordCheckpoint(
                    run_id, f"owner {text}", rec.fencing_token, f"key {tail}", 1))
                assert isinstance(rec, Record), rec
            written[run_id] = rec
        return written, writer.state.revision
    finally:
        await writer.close()


def test_a_batch_reads_back_through_a_restart_and_the_history(url: str) -> None:
    written, revision = asyncio.run(_write(url))
    assert len(written) == 4

    async def reload() -> dict[str, Record]:
        writer = Writer(PostgresStorage(url), SystemClock())
        await writer.start()
        try:
            return {k: writer.state.runs[k] for k in written}
        finally:
            await writer.close()

    assert asyncio.run(reload()) == written
    storage = PostgresStorage(url)
    history = HistoryReader(storage.reader)
    try:
        latest: dict[str, Record] = {}
        for _, run_id, _, rec in history.read(1, revision, limit=10_000):
            assert rec is not None
            latest[run_id] = rec
    finally:
        history.close()
    assert latest == written


def test_a_batch_whose_copy_fails_commits_nothing(url: str) -> None:
    """A change row that cannot be stored (its revision is taken) fails the
    whole batch with STORAGE_UNAVAILABLE; nothing of it is stored or answered."""

    async def go() -> None:
        writer = Writer(PostgresStorage(url), SystemClock())
        await writer.start()
        try:
            await writer.submit(Acquire("before", "w", ttl_ms=60_000))
            taken = writer.state.revision + 1
            db = _connection(url)
            try:  # another writer took the next revision behind this one's back
                db.execute("INSERT INTO changes (revision, run_id, kind, record, committed_at) "
                           "VALUES (?, 'intruder', 2, NULL, 0)", (taken,))
            finally:
                db.close()
            with pytest.raises(LedgerError) as err:
                await writer.submit(Acquire("after", "w", ttl_ms=60_000))
            assert err.value.code is Code.STORAGE_UNAVAILABLE
            assert "after" not in writer.state.runs
        finally:
            await writer.close()
        db = _connection(url)
        try:
            rows = db.execute("SELECT run_id FROM changes ORDER BY revision").fetchall()
        finally:
            db.close()
        assert rows == [("before",), ("intruder",)]

    asyncio.run(go())
