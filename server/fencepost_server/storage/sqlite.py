"""SQLite storage: schema, migrations, rows <-> records.

One write connection, opened by the writer in its own thread (``open``), so
per-connection pragmas stick. Every batch is one ``BEGIN IMMEDIATE ... COMMIT``
in WAL mode with ``synchronous=FULL`` unless told otherwise: COMMIT returns
only after the WAL is fsynced, and only then does the writer answer anyone.
The WAL is copied into the database file by a checkpointer on a connection
and thread of its own (``_Checkpointer``), not inside the writer's commits.

The statements both backends share (load, the batch's write path) are in
storage/sql.py; this module opens the file, holds its lock, migrates it
(``PRAGMA user_version``) and names SQLite's dialect.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import logging
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from ..core.errors import Code, LedgerError
from .sql import (  # noqa: F401  (re-exported: the writer, tests and benchmarks use them)
    COLD_STATUSES,
    COUNT_BEFORE_SHARDS,
    HOT_STATUSES,
    KIND_DELETE,
    KIND_PUT,
    PRUNE_CHUNK,
    Batch,
    LoadedState,
    SqlStorage,
    refuse_another_count,
    settle_shards,
)

log = logging.getLogger("fencepost.storage")

SCHEMA_VERSION = 8
# The first schema that stores the shard count (meta.shards).
SHARDS_STORED_SINCE = 8

# Each entry migrates user_version i -> i + 1. Append; never edit a shipped one.
MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE meta (
               key   TEXT PRIMARY KEY,
               value INTEGER NOT NULL
           ) WITHOUT ROWID""",
        "INSERT INTO meta (key, value) VALUES ('revision', 0)",
        # The current record per run; `record` is the full JSON form, the other
        # columns are for operators and indexes.
        """CREATE TABLE runs (
               run_id        TEXT PRIMARY KEY,
               version       INTEGER NOT NULL,
               status        INTEGER NOT NULL,
               fencing_token INTEGER NOT NULL,
               owner         TEXT,
               revision      INTEGER NOT NULL,
               record        TEXT NOT NULL
           ) WITHOUT ROWID""",
        # The last fencing token of deleted runs: tokens are never reused.
        """CREATE TABLE tombstones (
               run_id        TEXT PRIMARY KEY,
               fencing_token INTEGER NOT NULL,
               deleted_at    INTEGER NOT NULL
           ) WITHOUT ROWID""",
        # Retained change history (one row per committed change) for watches.
        """CREATE TABLE changes (
               revision     INTEGER PRIMARY KEY,
               run_id       TEXT NOT NULL,
               kind         INTEGER NOT NULL,
               record       TEXT,
               committed_at INTEGER NOT NULL
           )""",
        # Answers to recent request ids (docs/SPEC.md §5.5).
        """CREATE TABLE requests (
               request_id  TEXT PRIMARY KEY,
               fingerprint TEXT NOT NULL,
               answer      TEXT NOT NULL,
               created_at  INTEGER NOT NULL
           ) WITHOUT ROWID""",
        "CREATE INDEX requests_by_age ON requests (created_at)",
    ],
    # 1 -> 2: the engine store (docs/SPEC.md §11; storage/engine_sql.py reads and writes it).
    [
        """CREATE TABLE engine_runs (
               id               TEXT PRIMARY KEY,
               agent            TEXT NOT NULL,
               status           TEXT NOT NULL,
               concurrency_key  TEXT,
               input            TEXT,
               output           TEXT,
               error            TEXT,
               metadata         TEXT,
               claim_owner      TEXT,
               claim_expires_at INTEGER,
               created_at       INTEGER NOT NULL,
               updated_at       INTEGER NOT NULL
           )""",
        "CREATE INDEX engine_runs_by_created ON engine_runs (created_at, id)",
        "CREATE INDEX engine_runs_by_agent ON engine_runs (agent, created_at, id)",
        "CREATE INDEX engine_runs_by_status ON engine_runs (status, created_at, id)",
        """CREATE INDEX engine_runs_by_concurrency_key ON engine_runs
               (concurrency_key, created_at, id) WHERE concurrency_key IS NOT NULL""",
        """CREATE TABLE engine_steps (
               run_id     TEXT NOT NULL,
               seq        INTEGER NOT NULL,
               name       TEXT NOT NULL,
               status     TEXT,
               input      TEXT,
               output     TEXT,
               error      TEXT,
               metadata   TEXT,
               created_at INTEGER NOT NULL,
               PRIMARY KEY (run_id, seq)
           )""",
        """CREATE TABLE engine_checkpoints (
               run_id     TEXT PRIMARY KEY,
               step_index INTEGER NOT NULL,
               state      TEXT NOT NULL,
               saved_at   INTEGER NOT NULL
           )""",
        """CREATE TABLE engine_keys (
               scope      TEXT NOT NULL,
               key        TEXT NOT NULL,
               run_id     TEXT NOT NULL,
               expires_at INTEGER NOT NULL,
               PRIMARY KEY (scope, key)
           ) WITHOUT ROWID""",
        # A lock row is kept after release (owner NULL) so its token never repeats.
        """CREATE TABLE engine_locks (
               key           TEXT PRIMARY KEY,
               owner         TEXT,
               fencing_token INTEGER NOT NULL,
               expires_at    INTEGER NOT NULL
           ) WITHOUT ROWID""",
        """CREATE TABLE engine_effects (
               key         TEXT PRIMARY KEY,
               result      TEXT NOT NULL,
               recorded_at INTEGER NOT NULL
           )""",
        """CREATE TABLE engine_kv (
               agent      TEXT NOT NULL,
               key        TEXT NOT NULL,
               value      TEXT NOT NULL,
               updated_at INTEGER NOT NULL,
               PRIMARY KEY (agent, key)
           )""",
        """CREATE TABLE engine_docs (
               agent      TEXT NOT NULL,
               collection TEXT NOT NULL,
               id         TEXT NOT NULL,
               doc        TEXT NOT NULL,
               updated_at INTEGER NOT NULL,
               PRIMARY KEY (agent, collection, id)
           )""",
        """CREATE TABLE engine_artifacts (
               id           TEXT PRIMARY KEY,
               run_id       TEXT NOT NULL,
               name         TEXT NOT NULL,
               content_type TEXT NOT NULL,
               size_bytes   INTEGER NOT NULL,
               sha256       TEXT NOT NULL,
               metadata     TEXT,
               upload_id    TEXT NOT NULL,
               chunks       INTEGER NOT NULL,
               created_at   INTEGER NOT NULL
           )""",
        "CREATE INDEX engine_artifacts_by_run ON engine_artifacts (run_id, created_at, id)",
        "CREATE INDEX engine_artifacts_by_upload ON engine_artifacts (upload_id)",
        """CREATE TABLE engine_chunks (
               upload_id TEXT NOT NULL,
               seq       INTEGER NOT NULL,
               size      INTEGER NOT NULL,
               data      BLOB NOT NULL,
               PRIMARY KEY (upload_id, seq)
           )""",
        # Uploads not adopted by an artifact (in progress, or abandoned by a crash).
        """CREATE TABLE engine_uploads (
               upload_id  TEXT PRIMARY KEY,
               started_at INTEGER NOT NULL
           ) WITHOUT ROWID""",
    ],
    # 2 -> 3: `runs` becomes a checkpoint of the change log; every change at or
    # below meta.materialized is reflected in it (up to 2, runs was current).
    [
        "INSERT INTO meta (key, value) SELECT 'materialized', value FROM meta "
        "WHERE key = 'revision'",
    ],
    # 3 -> 4: finished runs are no longer held in memory (they are read from
    # `runs` on demand); start-up loads the unfinished ones by status, and the
    # ids, statuses and owners of the rest from this index alone.
    [
        "CREATE INDEX runs_by_status ON runs (status, owner)",
        # retention (--retain-terminal): finished runs by the time they finished
        "CREATE INDEX runs_finished_at ON runs (json_extract(record, '$.updated_at')) "
        "WHERE status IN (4, 5, 6)",
    ],
    # 4 -> 5: `runs` is keyed by (block, run id), block counting up by one for
    # every 256 runs first written (BLOCK_RUNS): rows keyed by (random) run ids
    # alone put every new run on a page of its own. The server finds a run's
    # block through a map in memory.
    [
        """CREATE TABLE runs_by_block (
               block         INTEGER NOT NULL,
               run_id        TEXT NOT NULL,
               version       INTEGER NOT NULL,
               status        INTEGER NOT NULL,
               fencing_token INTEGER NOT NULL,
               owner         TEXT,
               revision      INTEGER NOT NULL,
               record        TEXT NOT NULL,
               PRIMARY KEY (block, run_id)
           ) WITHOUT ROWID""",
        "INSERT INTO runs_by_block (block, run_id, version, status, fencing_token, owner, "
        "revision, record) SELECT (row_number() OVER (ORDER BY revision, run_id) - 1) / 256, "
        "run_id, version, status, fencing_token, owner, revision, record FROM runs",
        "DROP TABLE runs",
        "ALTER TABLE runs_by_block RENAME TO runs",
        # start-up reads the finished runs' ids and blocks from this index alone
        # (its entries end with the primary key)
        "CREATE INDEX runs_by_status ON runs (status, owner, block)",
        "CREATE INDEX runs_finished_at ON runs (json_extract(record, '$.updated_at'), run_id) "
        "WHERE status IN (4, 5, 6)",
    ],
    # 5 -> 6: the finished runs' index entries as a clean shutdown left them
    # (storage/sql.py, "saved_index"), so the next start need not sort them.
    # A migration that changes `runs` must empty this table.
    [
        """CREATE TABLE saved_index (
               seq      INTEGER PRIMARY KEY,
               revision INTEGER NOT NULL,
               status   INTEGER NOT NULL,
               owner    TEXT,
               n        INTEGER NOT NULL,
               ids      TEXT NOT NULL,
               blocks   BLOB NOT NULL
           )""",
    ],
    # 6 -> 7: the blocks of `runs` changed since the saved index was written
    # (storage/sql.py, "touched_blocks"): a start after a crash reads the saved
    # entries and gathers only those blocks again. Saved entries that do not
    # describe the table as it is now were written before any block was
    # recorded: they go.
    [
        "CREATE TABLE touched_blocks (block INTEGER PRIMARY KEY)",
        "DELETE FROM saved_index WHERE revision <> (SELECT value FROM meta WHERE "
        "key = 'revision') OR revision <> (SELECT value FROM meta WHERE key = 'materialized')",
    ],
    # 7 -> 8: the shard count (docs/SPEC.md §13). A database from before has
    # 64, the default then; a new one stores --shards in the same transaction.
    [
        "INSERT INTO meta (key, value) VALUES ('shards', 64)",
    ],
]

class Durability(StrEnum):
    # synchronous=FULL: an acknowledged write survives a crash and a power cut.
    FULL = "full"
    # synchronous=NORMAL: survives a process crash; a power cut may lose the
    # last commits that were acknowledged.
    NORMAL = "normal"


def _lock_exclusively(path: str) -> int:
    """Hold an exclusive ``flock`` on the database file for the server's lifetime.

    Two servers on one file would each keep their own in-memory state (stale
    reads, and revisions that collide on the next write), so the second one is
    refused before it reads anything. ``flock`` is independent of the POSIX
    record locks SQLite takes, so it never blocks SQLite itself or read-only
    inspection; the kernel drops it when the process dies, ``kill -9`` included.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"{path} is in use by another fencepost server (it holds the file's lock); "
            "one server per database file: stop the other one, or give this one its "
            "own --db"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


class SqliteStorage(SqlStorage):
    """The embedded backend. Not thread-safe: the writer thread owns it."""

    backend = "sqlite"
    STATUS_INDEX = "INDEXED BY runs_by_status"
    ERRORS = (sqlite3.Error,)

    def __init__(self, path: str | Path, durability: Durability = Durability.FULL,
                 *, shards: int | None = None) -> None:
        """``shards``: the shard count this start asks for (None: the stored one)."""
        super().__init__()
        self.path = str(path)
        self.requested_shards = shards
        self.durability = Durability(durability)
        self._db = None
        self._lock_fd: int | None = None
        self._check: _QuickCheck | None = None
        self._checkpointer: _Checkpointer | None = None

    # -- lifecycle -------------------------------------------------------------

    def open(self) -> None:
        """Open the single write connection and migrate. Refuses files that are
        not fencepost databases or were written by a newer release."""
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock_exclusively(self.path)
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                 factory=_WriteConnection)
        except BaseException:
            self._unlock()
            raise
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if self.path != ":memory:" and mode.lower() != "wal":
                raise RuntimeError(f"{self.path}: could not enable WAL (got {mode})")
            sync = "FULL" if self.durability is Durability.FULL else "NORMAL"
            db.execute(f"PRAGMA synchronous={sync}")
            db.execute("PRAGMA busy_timeout=5000")
            db.execute("PRAGMA foreign_keys=ON")
            if self.path != ":memory:":
                # SQLite's own checkpoint runs inside the COMMIT that crosses
                # its threshold, holding that batch (and every caller queued
                # behind it) for the copy and the database file's fsync
                db.execute("PRAGMA wal_autocheckpoint=0")
                self._checkpointer = _Checkpointer(self.path, sync)
            # A damaged page anywhere (not only in what load() reads) refuses the file,
            # untouched, instead of serving from it (found by tests/system/test_disk_faults.py).
            # The check reads the whole file, so it runs on a connection and a
            # thread of its own while load() reads (SQLite releases the GIL),
            # and every write — a migration, load's catch-up, any batch —
            # waits for its verdict first (``_verified``).
            self._check = _QuickCheck(self.path) if self.path != ":memory:" else None
            if self._check is None:
                self._raise_if_corrupt(_quick_check(db))
            self._db = db
            if self._needs_migration(db):
                self._verified()
                self._migrate(db)
            self.shards = settle_shards(db, self.path, self.requested_shards)
        except sqlite3.DatabaseError as exc:
            self._abandon(db)
            raise self._verdict(RuntimeError(
                f"{self.path} is not a usable fencepost database ({exc}); refusing to start"
            )) from exc
        except BaseException as exc:
            self._abandon(db)
            raise self._verdict(exc) from None

    def _abandon(self, db: sqlite3.Connection) -> None:
        self._db = None
        self._stop_checkpointer()
        db.close()
        self._unlock()

    def _stop_checkpointer(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.close()

    def _verdict(self, exc: BaseException) -> BaseException:
        """The error to report for a failed start: the integrity check's when
        it found damage (a damaged file fails in many ways; that says why)."""
        try:
            self._verified()
        except RuntimeError as corrupt:
            return corrupt
        return exc

    def _verified(self) -> None:
        """Wait for the start-up integrity check; RuntimeError if it failed."""
        check, self._check = self._check, None
        if check is not None:
            self._raise_if_corrupt(check.result())

    def _raise_if_corrupt(self, problems: list[str]) -> None:
        if problems != ["ok"]:
            raise RuntimeError(
                f"{self.path} is corrupt (PRAGMA quick_check: {'; '.join(problems)}); "
                "refusing to start and leaving the file untouched: restore it from a "
                "backup, or salvage it with the sqlite3 shell's .recover"
            )

    def load(self, prepare: Callable[[LoadedState], None] | None = None) -> LoadedState:
        try:
            state = super().load(prepare)
        except sqlite3.DatabaseError as exc:
            raise self._verdict(RuntimeError(
                f"{self.path} is not a usable fencepost database ({exc}); refusing to start"
            )) from exc
        except BaseException as exc:
            raise self._verdict(exc) from None
        self._verified()  # nothing is served from a file that failed it
        return state

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    @staticmethod
    def _needs_migration(db: sqlite3.Connection) -> bool:
        return bool(db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION)

    def _migrate(self, db: sqlite3.Connection) -> None:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema {version}; this fencepost knows up to "
                f"{SCHEMA_VERSION}. Refusing to start (upgrade fencepost)."
            )
        if version == 0:
            tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if tables:
                raise RuntimeError(
                    f"{self.path} holds tables but no fencepost schema; refusing to start"
                )
        if version and version < SHARDS_STORED_SINCE:  # refused before any step commits
            refuse_another_count(self.path, COUNT_BEFORE_SHARDS, self.requested_shards)
        for target in range(version + 1, SCHEMA_VERSION + 1):
            db.execute("BEGIN IMMEDIATE")
            try:
                for stmt in MIGRATIONS[target - 1]:
                    db.execute(stmt)
                if version == 0 and target == SCHEMA_VERSION:  # created by this start
                    settle_shards(db, self.path, self.requested_shards, fresh=True)
                db.execute(f"PRAGMA user_version={target}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        self._stop_checkpointer()
        if self._db is not None:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self._db.close()
            self._db = None
        self._unlock()

    def _begin(self, db: sqlite3.Connection) -> None:
        self._verified()  # never write to a file the start-up check has not passed
        if self._checkpointer is not None:
            self._checkpointer.finish(db)
        db.execute("BEGIN IMMEDIATE")

    def _commit(self, db: sqlite3.Connection) -> None:
        db.execute("COMMIT")
        if self._checkpointer is not None:
            self._checkpointer.due()

    def _batch_ended(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.release()

    def loop_can_prepare(self) -> bool:
        """A local file: BEGIN and the statements wait on no server, and on no
        lock unless the checkpointer asked this batch to copy what it left."""
        return self._check is None and (
            self._checkpointer is None or not self._checkpointer.finish_wanted)

    def _storage_error(self, exc: BaseException) -> LedgerError:
        code = getattr(exc, "sqlite_errorcode", None)
        why = f"write not made durable, nothing changed: {exc}"
        if code == sqlite3.SQLITE_FULL:
            return LedgerError(Code.STORAGE_FULL, why)
        return LedgerError(Code.STORAGE_UNAVAILABLE, why)

    def reader(self) -> sqlite3.Connection:
        return open_read_only(self.path)

    def finished_before(
        self, db: Any, cutoff_ms: int, limit: int, after: tuple[int, str] | None = None
    ) -> list[tuple[str, int, int]]:
        return finished_before(db, cutoff_ms, limit, after)


def _quick_check(db: sqlite3.Connection) -> list[str]:
    return [row[0] for row in db.execute("PRAGMA quick_check(5)")]


class _QuickCheck:
    """``PRAGMA quick_check`` of a file on a read-only connection in a thread
    of its own; ``result()`` waits for its findings (["ok"]: none)."""

    def __init__(self, path: str) -> None:
        self._done = threading.Event()
        self._found: list[str] = []
        threading.Thread(target=self._run, args=(path,), name="fencepost-quick-check",
                         daemon=True).start()

    def _run(self, path: str) -> None:
        try:
            db = open_read_only(path)
            try:
                self._found = _quick_check(db)
            finally:
                db.close()
        except sqlite3.Error as exc:
            self._found = [f"unreadable: {exc}"]
        finally:
            self._done.set()

    def result(self) -> list[str]:
        self._done.wait()
        return self._found


# "INSERT INTO t (a, b) VALUES (?, ?) [ON CONFLICT ...]": one row's statement
_ROW_INSERT = re.compile(r"(INSERT INTO \w+ \([^)]*\) VALUES )(\(\?(?:, ?\?)*\))(.*)",
                         re.DOTALL)
# the rows per statement _WriteConnection.executemany uses (largest first)
_CHUNKS = (256, 64, 16, 4, 1)


@functools.lru_cache(maxsize=64)
def _multi_row(head: str, row: str, tail: str, rows: int) -> str:
    return head + ",".join(itertools.repeat(row, rows)) + tail


class _WriteConnection(sqlite3.Connection):
    """The writer's connection: ``executemany`` of a one-row ``INSERT ...
    VALUES (?, ...)`` runs as a few multi-row INSERTs (chunks of ``_CHUNKS``
    rows, each chunk size one cached statement) instead of one statement step
    per row. The sqlite3 module lets go of the GIL around every step and must
    take it back after; while another thread runs Python each take-back can
    wait a whole switch interval (5 ms): 80 rows beside a spinning thread took
    86-93 ms stepped one by one and 11-16 ms as one statement (the measurement
    is in notes/PERFORMANCE_LOG.md). Rows are inserted in order, so an
    upsert's conflicts resolve as they would one row at a time
    (storage/DESIGN.md)."""

    def executemany(  # type: ignore[override]
        self, sql: str, rows: Iterable[Sequence[Any]], /
    ) -> sqlite3.Cursor:
        insert = _ROW_INSERT.fullmatch(sql)
        if insert is None:
            return super().executemany(sql, rows)
        head, row, tail = insert.groups()
        rows = rows if isinstance(rows, list) else list(rows)
        cursor, at = self.cursor(), 0
        for size in _CHUNKS:
            while len(rows) - at >= size:
                chunk = rows[at:at + size]
                cursor.execute(_multi_row(head, row, tail, size),
                               list(itertools.chain.from_iterable(chunk)))
                at += size
        return cursor


class _Checkpointer:
    """Copies committed WAL frames into the database file with ``PRAGMA
    wal_checkpoint(PASSIVE)`` on a connection (``query_only``: it changes no
    row) and a thread of its own, at most every ``PAUSE_S`` while commits come.
    A passive checkpoint never blocks the writer, so no commit waits for a
    checkpoint's copying or for the database file's fsync.

    The WAL starts over from its beginning only at a commit that finds every
    frame copied and no other connection in the WAL's read locks, which a
    checkpoint racing the commits on another thread seldom leaves behind. So
    once the WAL holds ``RESET_FRAMES`` frames the checkpointer copies back to
    back (up to ``CLOSING_PASSES`` times) until at most ``CLOSE_FRAMES`` are
    left and hands over: before its next batch the writer takes the turn
    (the checkpointer waits), copies that remainder itself (``finish``), and
    gives the turn back when the batch ends (``release``); that batch's
    commit starts the WAL over, and the writer's share of the copying stays
    small. Checkpoint failures (a full disk, say) are logged once and
    retried; the WAL keeps every commit until a checkpoint succeeds.
    """

    PAUSE_S = 0.2
    RESET_FRAMES = 4096  # 16 MiB of 4 KiB pages
    CLOSE_FRAMES = 256
    CLOSING_PASSES = 8

    def __init__(self, path: str, synchronous: str) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA query_only=1")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._due = threading.Event()
        self._closing = threading.Event()
        self._turn = threading.Lock()  # one of the two checkpoints at a time
        self._finish_wanted = False
        self._writer_holds = False
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="fencepost-checkpoint",
                                        daemon=True)
        self._thread.start()

    def due(self) -> None:
        """A commit added frames (called by the writer after each COMMIT)."""
        self._due.set()

    @property
    def finish_wanted(self) -> bool:
        return self._finish_wanted and not self._writer_holds

    def finish(self, db: sqlite3.Connection) -> None:
        """In the writer, before a batch: when the checkpointer asked, take
        the turn and copy what it left, so that this batch restarts the WAL."""
        if not self._finish_wanted or self._writer_holds:
            return
        self._finish_wanted = False
        self._turn.acquire()
        self._writer_holds = True
        try:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            log.warning("WAL checkpoint by the writer failed (retried later): %s", exc)

    def release(self) -> None:
        """In the writer, when a batch ended (committed or not)."""
        if self._writer_holds:
            self._writer_holds = False
            self._turn.release()

    def _checkpoint(self) -> tuple[int, int] | None:
        """(frames in the WAL, frames copied), or None if it failed."""
        try:
            with self._turn:
                # fetchall: a statement left unfinished would hold a read lock
                # that keeps the WAL from starting over
                ((_busy, frames, copied),) = self._db.execute(
                    "PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            if not self._failing:
                log.warning("WAL checkpoint failed (retried while commits come): %s", exc)
            self._failing = True
            return None
        if self._failing:
            log.info("WAL checkpoint succeeded again")
        self._failing = False
        return frames, copied

    def _run(self) -> None:
        try:
            while True:
                self._due.wait()
                if self._closing.is_set():
                    return
                self._due.clear()
                done = self._checkpoint()
                for _ in range(self.CLOSING_PASSES):  # bounded: a reader may pin frames
                    if (done is None or done[0] < self.RESET_FRAMES
                            or done[0] - done[1] <= self.CLOSE_FRAMES
                            or self._closing.is_set()):
                        break
                    done = self._checkpoint()
                if done is not None and done[0] >= self.RESET_FRAMES:
                    # the WAL has not started over for a while: the writer's turn
                    self._finish_wanted = True
                if self._closing.wait(self.PAUSE_S):
                    return
        finally:
            self._db.close()

    def close(self) -> None:
        self._closing.set()
        self._due.set()
        self._thread.join()


def finished_before(
    db: sqlite3.Connection, cutoff_ms: int, limit: int, after: tuple[int, str] | None = None
) -> list[tuple[str, int, int]]:
    """(run id, version, finished at) of finished runs of the runs table last
    changed before ``cutoff_ms``, oldest first, past ``after`` (the last
    (finished at, run id) a previous call returned): the runs_finished_at index."""
    at, run_id = after if after is not None else (-(2**62), "")
    return db.execute(
        "SELECT run_id, version, json_extract(record, '$.updated_at') FROM runs "
        "INDEXED BY runs_finished_at "
        "WHERE status IN (4, 5, 6) AND json_extract(record, '$.updated_at') < ? "
        "AND (json_extract(record, '$.updated_at'), run_id) > (?, ?) "
        "ORDER BY json_extract(record, '$.updated_at'), run_id LIMIT ?",
        (cutoff_ms, at, run_id, limit),
    ).fetchall()


def open_read_only(path: str | Path) -> sqlite3.Connection:
    """A read-only connection for inspection and tests (cannot write)."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)


