"""SQLite storage: schema, migrations, rows <-> records.

One write connection, opened by the writer in its own thread (``open``), so
per-connection pragmas stick. Every batch is one ``BEGIN IMMEDIATE ... COMMIT``
in WAL mode with ``synchronous=FULL`` unless told otherwise: COMMIT returns
only after the WAL is fsynced, and only then does the writer answer anyone.

The change log is the source of truth for the ledger; the ``runs`` table is a
checkpoint of it. A batch appends its changes (sequential pages) and does not
touch ``runs``; the writer copies each changed run's latest record into
``runs`` about a second later (``Batch.materialize``, in some later batch's
transaction) and moves ``meta.materialized``: every change at or below it is
reflected in ``runs``. Changes above the mark are never pruned, and ``load``
replays them. Updating ``runs`` in every batch wrote one 4 KiB page per
command (concurrently active runs rarely share a page), which doubled the
commit time and its fsync.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import orjson

from ..core import codec
from ..core.errors import Code, LedgerError
from ..core.records import Record, record_from_dict, record_to_dict

SCHEMA_VERSION = 4

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
]

# Statuses whose runs are held in memory ("hot"); the terminal ones are read
# from the runs table on demand once it reflects them.
HOT_STATUSES = (1, 2, 3)  # queued, running, suspended
COLD_STATUSES = (4, 5, 6)  # completed, failed, cancelled

KIND_PUT = 1
KIND_DELETE = 2


class Durability(StrEnum):
    # synchronous=FULL: an acknowledged write survives a crash and a power cut.
    FULL = "full"
    # synchronous=NORMAL: survives a process crash; a power cut may lose the
    # last commits that were acknowledged.
    NORMAL = "normal"


@dataclass
class LoadedState:
    # the runs held in memory: unfinished ones, and any the change log
    # replayed; ``cold`` names the rest (id, status, lease owner)
    runs: dict[str, Record] = field(default_factory=dict)
    cold: list[tuple[str, int, str | None]] = field(default_factory=list)
    tombstones: dict[str, int] = field(default_factory=dict)
    revision: int = 0
    compacted: int = 0
    replayed: int = 0  # changes above the materialized mark, replayed (and materialized)


@dataclass
class Batch:
    """Everything one group commit writes."""

    deletes: dict[str, tuple[int, int]] = field(default_factory=dict)  # run_id -> (token, at)
    changes: list[tuple[int, str, int, Record | None]] = field(default_factory=list)
    # (request id, fingerprint, answer: a result or LedgerError, created at)
    requests: list[tuple[str, str, Any, int]] = field(default_factory=list)
    revision: int = 0
    now: int = 0
    # Runs to copy into the runs table (None: deleted), and the new mark: once
    # this commits, every change at or below it is reflected in runs.
    materialize: list[tuple[str, Record | None]] = field(default_factory=list)
    materialized: int | None = None
    # (request cutoff ms, keep changes from revision, optional change age cutoff ms,
    # the materialized mark): no change above the mark is ever dropped.
    prune: tuple[int, int, int | None, int] | None = None
    compacted: int | None = None  # set by write() when it pruned
    # set by write(): the prune stopped at PRUNE_CHUNK rows of a table and more
    # is due (the writer prunes again in its next batch, not in prune_every_ms)
    prune_more: bool = False


# Rows one batch prunes from each of changes and requests, at most. Pruning
# everything due in one statement every prune_every_ms (150 000 rows at 5 000
# renewals/s and 30 s) stalled that batch and every caller queued behind it;
# in chunks the backlog goes in a few batches of a few milliseconds each.
PRUNE_CHUNK = 8192


def _dumps(obj: Any) -> str:
    """Compact JSON text, UTF-8 unescaped (orjson: about 5x the stdlib encoder,
    which was a fifth of the writer thread's time)."""
    return orjson.dumps(obj).decode()


_loads = orjson.loads


def _answer_text(answer: Any, encoded: dict[int, str]) -> str:
    """A request id's stored answer. A record this batch wrote is already JSON
    (its runs row): splice that text into ``codec.encode``'s record form
    instead of encoding the record a second time."""
    if type(answer) is Record:
        text = encoded.get(id(answer))
        if text is not None:
            return '{"t":"record","r":' + text + "}"
    return _dumps(codec.encode(answer))


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


def _storage_error(exc: sqlite3.Error) -> LedgerError:
    code = getattr(exc, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL:
        return LedgerError(Code.STORAGE_FULL, f"write not made durable, nothing changed: {exc}")
    return LedgerError(Code.STORAGE_UNAVAILABLE, f"write not made durable, nothing changed: {exc}")


class SqliteStorage:
    """The embedded backend. Not thread-safe: the writer thread owns it."""

    backend = "sqlite"

    def __init__(self, path: str | Path, durability: Durability = Durability.FULL) -> None:
        self.path = str(path)
        self.durability = Durability(durability)
        self._db: sqlite3.Connection | None = None
        self._lock_fd: int | None = None

    # -- lifecycle -------------------------------------------------------------

    def open(self) -> None:
        """Open the single write connection and migrate. Refuses files that are
        not fencepost databases or were written by a newer release."""
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock_exclusively(self.path)
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
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
            # A damaged page anywhere (not only in what load() reads) refuses the file,
            # untouched, instead of serving from it (found by tests/system/test_disk_faults.py).
            problems = [row[0] for row in db.execute("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise RuntimeError(
                    f"{self.path} is corrupt (PRAGMA quick_check: {'; '.join(problems)}); "
                    "refusing to start and leaving the file untouched: restore it from a "
                    "backup, or salvage it with the sqlite3 shell's .recover"
                )
            self._migrate(db)
        except sqlite3.DatabaseError as exc:
            db.close()
            self._unlock()
            raise RuntimeError(
                f"{self.path} is not a usable fencepost database ({exc}); refusing to start"
            ) from exc
        except BaseException:
            db.close()
            self._unlock()
            raise
        self._db = db

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

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
        for target in range(version + 1, SCHEMA_VERSION + 1):
            db.execute("BEGIN IMMEDIATE")
            try:
                for stmt in MIGRATIONS[target - 1]:
                    db.execute(stmt)
                db.execute(f"PRAGMA user_version={target}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        if self._db is not None:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self._db.close()
            self._db = None
        self._unlock()

    @property
    def is_open(self) -> bool:
        return self._db is not None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("storage is not open")
        return self._db

    # -- reads (writer thread) --------------------------------------------------

    def load(self) -> LoadedState:
        """The committed ledger: the unfinished runs of the runs table, plus the
        changes above its materialized mark replayed in order — which are then
        written to runs (one transaction), so the writer starts with nothing
        pending. Finished runs are not read: ``cold`` lists their ids (from
        the status index alone); ``read_runs`` reads them when asked."""
        db = self.db
        state = LoadedState()
        marks = ",".join("?" * len(HOT_STATUSES))
        for run_id, text in db.execute(
            f"SELECT run_id, record FROM runs WHERE status IN ({marks})", HOT_STATUSES
        ):
            state.runs[run_id] = self._readable(text, f"the stored record of run {run_id!r}")
        state.tombstones = dict(db.execute("SELECT run_id, fencing_token FROM tombstones"))
        state.revision = db.execute("SELECT value FROM meta WHERE key='revision'").fetchone()[0]
        mark = self.materialized_mark()
        replay: dict[str, Record | None] = {}
        for rev, run_id, kind, text in db.execute(
            "SELECT revision, run_id, kind, record FROM changes WHERE revision > ? "
            "ORDER BY revision",
            (mark,),
        ):
            if kind == KIND_PUT:
                replay[run_id] = self._readable(text, f"the change at revision {rev}")
            else:
                replay[run_id] = None
            state.replayed += 1
        for run_id, rec in replay.items():
            if rec is None:
                state.runs.pop(run_id, None)
            else:
                state.runs[run_id] = rec
        marks = ",".join("?" * len(COLD_STATUSES))
        state.cold = [
            row for row in db.execute(
                f"SELECT run_id, status, owner FROM runs INDEXED BY runs_by_status "
                f"WHERE status IN ({marks})", COLD_STATUSES,
            )
            if row[0] not in replay
        ]
        if mark != state.revision:
            with self.transaction():
                self._materialize(db, list(replay.items()), state.revision, state.revision)
        for run_id, rec in replay.items():  # now reflected in runs: finished ones go cold
            if rec is not None and rec.status in COLD_STATUSES:
                del state.runs[run_id]
                state.cold.append((run_id, int(rec.status), rec.lease.owner if rec.lease else None))
        state.compacted = self._compacted(db, state.revision)
        return state

    def read_runs(self, run_ids: list[str]) -> dict[str, Record]:
        """The runs table's records of those ids that have one (writer thread:
        inside a batch it sees what earlier batches committed)."""
        return read_runs(self.db, run_ids)

    def _readable(self, text: Any, what: str) -> Record:
        try:
            return record_from_dict(_loads(text))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise RuntimeError(
                f"{self.path}: {what} is unreadable ({exc!r}); refusing to start and "
                "leaving the file untouched"
            ) from exc

    def materialized_mark(self) -> int:
        return int(
            self.db.execute("SELECT value FROM meta WHERE key='materialized'").fetchone()[0]
        )

    @staticmethod
    def _materialize(
        db: sqlite3.Connection, runs: list[tuple[str, Record | None]], mark: int, revision: int
    ) -> None:
        """Copy runs into the runs table and set the mark (and the revision: one
        statement for both meta rows)."""
        puts = [rec for _, rec in runs if rec is not None]
        if puts:
            db.executemany(
                "INSERT INTO runs (run_id, version, status, fencing_token, owner, "
                "revision, record) VALUES (?,?,?,?,?,?,?) ON CONFLICT (run_id) DO "
                "UPDATE SET version=excluded.version, status=excluded.status, "
                "fencing_token=excluded.fencing_token, owner=excluded.owner, "
                "revision=excluded.revision, record=excluded.record",
                [
                    (
                        r.run_id,
                        r.version,
                        int(r.status),
                        r.fencing_token,
                        r.lease.owner if r.lease else None,
                        r.revision,
                        _dumps(record_to_dict(r)),
                    )
                    for r in puts
                ],
            )
        gone = [(run_id,) for run_id, rec in runs if rec is None]
        if gone:
            db.executemany("DELETE FROM runs WHERE run_id = ?", gone)
        db.execute(
            "UPDATE meta SET value = CASE key WHEN 'revision' THEN ? ELSE ? END "
            "WHERE key IN ('revision', 'materialized')",
            (revision, mark),
        )

    @staticmethod
    def _compacted(db: sqlite3.Connection, revision: int) -> int:
        """Everything at or below this revision is gone from the history."""
        low = db.execute("SELECT min(revision) FROM changes").fetchone()[0]
        return revision if low is None else low - 1

    def lookup_requests(self, request_ids: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
        """The stored (fingerprint, answer) of those of ``request_ids``
        answered before: one query per 500 ids, not one per command."""
        found: dict[str, tuple[str, dict[str, Any]]] = {}
        for i in range(0, len(request_ids), 500):
            chunk = request_ids[i : i + 500]
            rows = self.db.execute(
                "SELECT request_id, fingerprint, answer FROM requests WHERE request_id IN "
                f"({','.join('?' * len(chunk))})",
                chunk,
            )
            for rid, fp, answer in rows:
                found[rid] = (fp, _loads(answer))
        return found

    # -- the one write path ------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One batch: BEGIN IMMEDIATE ... COMMIT (durable at FULL). On any
        failure rolls back and raises LedgerError(STORAGE_*) for SQLite errors."""
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise _storage_error(exc) from exc

    def run_isolated(self, executor: Any, cmd: Any, now: int) -> Any:
        """Run an executor inside a savepoint: its refusal (LedgerError) rolls
        back its own writes and becomes its answer; SQLite errors fail the batch."""
        db = self.db
        db.execute("SAVEPOINT cmd")
        try:
            result = executor(db, cmd, now)
        except LedgerError as exc:
            db.execute("ROLLBACK TO cmd")
            db.execute("RELEASE cmd")
            return exc
        except BaseException:
            db.execute("ROLLBACK TO cmd")
            db.execute("RELEASE cmd")
            raise
        db.execute("RELEASE cmd")
        return result

    def write(self, batch: Batch) -> None:
        """Write the ledger part of a batch; call inside ``transaction()``."""
        db = self.db
        # encode each record once: its history row and a request's answer share it
        encoded = {
            id(rec): _dumps(record_to_dict(rec))
            for _, _, _, rec in batch.changes
            if rec is not None
        }
        if batch.deletes:  # tombstones at once: a deleted run's tokens are never reused
            db.executemany(
                "INSERT INTO tombstones (run_id, fencing_token, deleted_at) "
                "VALUES (?,?,?) ON CONFLICT (run_id) DO UPDATE SET "
                "fencing_token=max(fencing_token, excluded.fencing_token), "
                "deleted_at=excluded.deleted_at",
                [(k, tok, at) for k, (tok, at) in batch.deletes.items()],
            )
        if batch.changes:
            db.executemany(
                "INSERT INTO changes (revision, run_id, kind, record, committed_at) "
                "VALUES (?,?,?,?,?)",
                [
                    (
                        rev,
                        run_id,
                        kind,
                        encoded[id(rec)] if rec is not None else None,
                        batch.now,
                    )
                    for rev, run_id, kind, rec in batch.changes
                ],
            )
        if batch.materialized is not None:
            self._materialize(db, batch.materialize, batch.materialized, batch.revision)
        elif batch.changes:
            db.execute("UPDATE meta SET value = ? WHERE key = 'revision'", (batch.revision,))
        if batch.requests:
            db.executemany(
                "INSERT OR REPLACE INTO requests (request_id, fingerprint, answer, "
                "created_at) VALUES (?,?,?,?)",
                [
                    (rid, fp, _answer_text(ans, encoded), at)
                    for rid, fp, ans, at in batch.requests
                ],
            )
        if batch.prune is not None:
            request_cutoff, keep_from, age_cutoff, mark = batch.prune
            more = db.execute(
                "DELETE FROM requests WHERE request_id IN (SELECT request_id FROM requests "
                "WHERE created_at < ? ORDER BY created_at LIMIT ?)",
                (request_cutoff, PRUNE_CHUNK),
            ).rowcount >= PRUNE_CHUNK
            # changes are deleted oldest first and never above the mark: the
            # history stays one contiguous range of revisions
            floor = db.execute("SELECT min(revision) FROM changes").fetchone()[0]
            if floor is not None:
                ceiling = mark + 1  # never a change above the mark
                limit = min(floor + PRUNE_CHUNK, ceiling)
                below = min(keep_from, ceiling)  # what the count limit prunes
                old_window = False
                if age_cutoff is not None:
                    # the age limit prunes up to the first change (within this
                    # chunk) committed at or after the cutoff
                    young = db.execute(
                        "SELECT min(revision) FROM changes WHERE revision >= ? AND "
                        "revision < ? AND committed_at >= ?",
                        (floor, limit, age_cutoff),
                    ).fetchone()[0]
                    old_window = young is None
                    below = max(below, limit if young is None else young)
                stop = min(below, limit)
                if stop > floor:
                    db.execute("DELETE FROM changes WHERE revision < ?", (stop,))
                more = more or (stop == limit < ceiling and (stop < below or old_window))
            batch.prune_more = more
            batch.compacted = self._compacted(db, batch.revision)


def read_runs(db: sqlite3.Connection, run_ids: list[str]) -> dict[str, Record]:
    """Records of the runs table by id, in chunks the statement can bind."""
    out: dict[str, Record] = {}
    for i in range(0, len(run_ids), 500):
        chunk = run_ids[i:i + 500]
        for run_id, text in db.execute(
            f"SELECT run_id, record FROM runs WHERE run_id IN ({','.join('?' * len(chunk))})",
            chunk,
        ):
            out[run_id] = record_from_dict(_loads(text))
    return out


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


class HistoryReader:
    """Reads the retained change history on its own read-only connection (for
    WatchRuns replay), so replay never runs on the writer's connection. WAL
    lets it read committed history while the writer commits."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._db: sqlite3.Connection | None = None

    def read(
        self, from_revision: int, to_revision: int, limit: int = 1000
    ) -> list[tuple[int, str, int, Record | None]]:
        if self._db is None:
            self._db = open_read_only(self.path)
        rows = self._db.execute(
            "SELECT revision, run_id, kind, record FROM changes "
            "WHERE revision >= ? AND revision <= ? ORDER BY revision LIMIT ?",
            (from_revision, to_revision, limit),
        ).fetchall()
        return [
            (rev, run_id, kind, record_from_dict(_loads(text)) if text else None)
            for rev, run_id, kind, text in rows
        ]

    def run_history(self, run_id: str, limit: int) -> list[tuple[int, int, Record | None]]:
        """The last ``limit`` retained changes of one run, oldest first:
        (revision, kind, record or None)."""
        if self._db is None:
            self._db = open_read_only(self.path)
        rows = self._db.execute(
            "SELECT revision, kind, record FROM changes WHERE run_id = ? "
            "ORDER BY revision DESC LIMIT ?",
            (run_id, limit),
        ).fetchall()
        return [
            (rev, kind, record_from_dict(_loads(text)) if text else None)
            for rev, kind, text in reversed(rows)
        ]

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
