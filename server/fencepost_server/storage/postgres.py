"""PostgreSQL storage: connections, schema, migrations, and the leader's epoch.

The writer thread owns one connection (psycopg 3, synchronous: the writer
already decides and writes a whole batch in its own thread, so a blocking
driver keeps the event loop free without a second scheduler). Every batch is
one ``BEGIN ... COMMIT`` with ``synchronous_commit=on``: COMMIT returns once
the commit record is flushed to disk (and to synchronous standbys, if the
cluster has any), and only then does the writer answer anyone. A broken
connection fails its batch (STORAGE_UNAVAILABLE, nothing changed) and the next
batch reconnects.

Leadership (ha/leadership.py): while this storage serves a leader, every batch
first reads the leader row FOR KEY SHARE and checks that it still holds this
coordinator's epoch. That lock is held until COMMIT, and a takeover locks the
row FOR UPDATE (which waits for it) before it bumps the epoch, so a batch
either commits before the takeover (and the new leader loads it) or finds the
epoch moved and commits nothing: a deposed leader — paused, partitioned or
just slow — never commits one batch after another coordinator took over. The
leader's renewals only update non-key columns, which FOR KEY SHARE allows, so
a long batch never holds a renewal up.

Tables live in their own schema (``fencepost``) of the database the URL
names, so one database may hold other applications' tables; the schema
version is ``fencepost_schema.version``, migrated under an advisory lock, so
coordinators starting at the same moment migrate once.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from ..core.errors import Code, LedgerError
from . import shared
from .shared import Sharing
from .sql import SqlStorage, settle_shards

log = logging.getLogger("fencepost.storage")

RESOLVE_COMMIT_S = 60.0  # how long a COMMIT lost with its connection is asked about
SCHEMA = "fencepost"
SCHEMA_VERSION = 9
_MIGRATE_LOCK = 0x66656E63  # pg_advisory_xact_lock key: "fenc"

_TEXT = 'TEXT COLLATE "C"'  # byte order, as SQLite and the in-memory index sort

# Each entry migrates fencepost_schema.version i -> i + 1. Append; never edit a shipped one.
MIGRATIONS: list[list[str]] = [
    [
        f"CREATE TABLE meta (key {_TEXT} PRIMARY KEY, value BIGINT NOT NULL)",
        "INSERT INTO meta (key, value) VALUES ('revision', 0), ('materialized', 0)",
        f"""CREATE TABLE runs (
               run_id        {_TEXT} PRIMARY KEY,
               version       BIGINT NOT NULL,
               status        INTEGER NOT NULL,
               fencing_token BIGINT NOT NULL,
               owner         {_TEXT},
               revision      BIGINT NOT NULL,
               record        TEXT NOT NULL
           )""",
        "CREATE INDEX runs_by_status ON runs (status, owner)",
        "CREATE INDEX runs_finished_at ON runs (((record::jsonb ->> 'updated_at')::bigint), "
        "run_id) WHERE status IN (4, 5, 6)",
        f"""CREATE TABLE tombstones (
               run_id        {_TEXT} PRIMARY KEY,
               fencing_token BIGINT NOT NULL,
               deleted_at    BIGINT NOT NULL
           )""",
        f"""CREATE TABLE changes (
               revision     BIGINT PRIMARY KEY,
               run_id       {_TEXT} NOT NULL,
               kind         INTEGER NOT NULL,
               record       TEXT,
               committed_at BIGINT NOT NULL
           )""",
        f"""CREATE TABLE requests (
               request_id  {_TEXT} PRIMARY KEY,
               fingerprint TEXT NOT NULL,
               answer      TEXT NOT NULL,
               created_at  BIGINT NOT NULL
           )""",
        "CREATE INDEX requests_by_age ON requests (created_at)",
        f"""CREATE TABLE engine_runs (
               id               {_TEXT} PRIMARY KEY,
               agent            {_TEXT} NOT NULL,
               status           {_TEXT} NOT NULL,
               concurrency_key  {_TEXT},
               input            TEXT,
               output           TEXT,
               error            TEXT,
               metadata         TEXT,
               claim_owner      {_TEXT},
               claim_expires_at BIGINT,
               created_at       BIGINT NOT NULL,
               updated_at       BIGINT NOT NULL
           )""",
        "CREATE INDEX engine_runs_by_created ON engine_runs (created_at, id)",
        "CREATE INDEX engine_runs_by_agent ON engine_runs (agent, created_at, id)",
        "CREATE INDEX engine_runs_by_status ON engine_runs (status, created_at, id)",
        """CREATE INDEX engine_runs_by_concurrency_key ON engine_runs
               (concurrency_key, created_at, id) WHERE concurrency_key IS NOT NULL""",
        f"""CREATE TABLE engine_steps (
               run_id     {_TEXT} NOT NULL,
               seq        BIGINT NOT NULL,
               name       TEXT NOT NULL,
               status     TEXT,
               input      TEXT,
               output     TEXT,
               error      TEXT,
               metadata   TEXT,
               created_at BIGINT NOT NULL,
               PRIMARY KEY (run_id, seq)
           )""",
        f"""CREATE TABLE engine_checkpoints (
               run_id     {_TEXT} PRIMARY KEY,
               step_index BIGINT NOT NULL,
               state      TEXT NOT NULL,
               saved_at   BIGINT NOT NULL
           )""",
        f"""CREATE TABLE engine_keys (
               scope      {_TEXT} NOT NULL,
               key        {_TEXT} NOT NULL,
               run_id     {_TEXT} NOT NULL,
               expires_at BIGINT NOT NULL,
               PRIMARY KEY (scope, key)
           )""",
        f"""CREATE TABLE engine_locks (
               key           {_TEXT} PRIMARY KEY,
               owner         {_TEXT},
               fencing_token BIGINT NOT NULL,
               expires_at    BIGINT NOT NULL
           )""",
        f"""CREATE TABLE engine_effects (
               key         {_TEXT} PRIMARY KEY,
               result      TEXT NOT NULL,
               recorded_at BIGINT NOT NULL
           )""",
        f"""CREATE TABLE engine_kv (
               agent      {_TEXT} NOT NULL,
               key        {_TEXT} NOT NULL,
               value      TEXT NOT NULL,
               updated_at BIGINT NOT NULL,
               PRIMARY KEY (agent, key)
           )""",
        f"""CREATE TABLE engine_docs (
               agent      {_TEXT} NOT NULL,
               collection {_TEXT} NOT NULL,
               id         {_TEXT} NOT NULL,
               doc        TEXT NOT NULL,
               updated_at BIGINT NOT NULL,
               PRIMARY KEY (agent, collection, id)
           )""",
        f"""CREATE TABLE engine_artifacts (
               id           {_TEXT} PRIMARY KEY,
               run_id       {_TEXT} NOT NULL,
               name         TEXT NOT NULL,
               content_type TEXT NOT NULL,
               size_bytes   BIGINT NOT NULL,
               sha256       TEXT NOT NULL,
               metadata     TEXT,
               upload_id    {_TEXT} NOT NULL,
               chunks       BIGINT NOT NULL,
               created_at   BIGINT NOT NULL
           )""",
        "CREATE INDEX engine_artifacts_by_run ON engine_artifacts (run_id, created_at, id)",
        "CREATE INDEX engine_artifacts_by_upload ON engine_artifacts (upload_id)",
        f"""CREATE TABLE engine_chunks (
               upload_id {_TEXT} NOT NULL,
               seq       BIGINT NOT NULL,
               size      BIGINT NOT NULL,
               data      BYTEA NOT NULL,
               PRIMARY KEY (upload_id, seq)
           )""",
        f"""CREATE TABLE engine_uploads (
               upload_id  {_TEXT} PRIMARY KEY,
               started_at BIGINT NOT NULL
           )""",
        # Leadership (ha/leadership.py): one row. The epoch increases on every
        # change of leader; times are the database's clock, in ms.
        """CREATE TABLE fencepost_leader (
               id         INTEGER PRIMARY KEY CHECK (id = 1),
               epoch      BIGINT NOT NULL,
               holder     TEXT NOT NULL,
               address    TEXT NOT NULL,
               renewed_at BIGINT NOT NULL,
               expires_at BIGINT NOT NULL
           )""",
        "INSERT INTO fencepost_leader VALUES (1, 0, '', '', 0, 0)",
    ],
    # 1 -> 2: `runs` is keyed by (block, run id), as on SQLite (block counts up
    # by one for every 256 runs first written); the server finds a run's block
    # through a map in memory.
    [
        f"""CREATE TABLE runs_by_block (
               block         BIGINT NOT NULL,
               run_id        {_TEXT} NOT NULL,
               version       BIGINT NOT NULL,
               status        INTEGER NOT NULL,
               fencing_token BIGINT NOT NULL,
               owner         {_TEXT},
               revision      BIGINT NOT NULL,
               record        TEXT NOT NULL,
               PRIMARY KEY (block, run_id)
           )""",
        "INSERT INTO runs_by_block SELECT (row_number() OVER (ORDER BY revision, run_id) - 1) "
        "/ 256, run_id, version, status, fencing_token, owner, revision, record FROM runs",
        "DROP TABLE runs",
        "ALTER TABLE runs_by_block RENAME TO runs",
        "ALTER INDEX runs_by_block_pkey RENAME TO runs_pkey",
        "CREATE INDEX runs_by_status ON runs (status, owner, block) INCLUDE (run_id)",
        "CREATE INDEX runs_finished_at ON runs (((record::jsonb ->> 'updated_at')::bigint), "
        "run_id) WHERE status IN (4, 5, 6)",
    ],
    # 2 -> 3: the finished runs' index entries as a clean shutdown left them
    # (storage/sql.py, "saved_index"); stored uncompressed (compressing a few
    # megabytes of ids costs more than writing them). A migration that changes
    # `runs` must empty this table.
    [
        f"""CREATE TABLE saved_index (
               seq      BIGINT PRIMARY KEY,
               revision BIGINT NOT NULL,
               status   INTEGER NOT NULL,
               owner    {_TEXT},
               n        BIGINT NOT NULL,
               ids      TEXT NOT NULL,
               blocks   BYTEA NOT NULL
           )""",
        "ALTER TABLE saved_index ALTER COLUMN ids SET STORAGE EXTERNAL, "
        "ALTER COLUMN blocks SET STORAGE EXTERNAL",
    ],
    # 3 -> 4: the blocks of `runs` changed since the saved index was written
    # (storage/sql.py, "touched_blocks"); saved entries older than the table go.
    [
        "CREATE TABLE touched_blocks (block BIGINT PRIMARY KEY)",
        "DELETE FROM saved_index WHERE revision <> (SELECT value FROM meta WHERE "
        "key = 'revision') OR revision <> (SELECT value FROM meta WHERE key = 'materialized')",
    ],
    # 4 -> 5: the leader's process (ha/leadership.py, process_proof), so that a
    # coordinator restarted in place after a crash need not wait for the lease.
    [
        "ALTER TABLE fencepost_leader ADD COLUMN process TEXT NOT NULL DEFAULT ''",
    ],
    # 5 -> 6: the shard count (docs/SPEC.md §13). A database from before has
    # 64, the default then; a new one stores --shards in the same transaction.
    [
        "INSERT INTO meta (key, value) VALUES ('shards', 64)",
    ],
    # 6 -> 7: who leads each shard (ha/shards.py): a row per shard, with its
    # own epoch, and the coordinators taking part. A new database's rows
    # follow the --shards it stores (``migrate``, ``_shard_rows``).
    [
        """CREATE TABLE fencepost_shards (
               shard      INTEGER PRIMARY KEY,
               epoch      BIGINT NOT NULL,
               holder     TEXT NOT NULL,
               address    TEXT NOT NULL,
               renewed_at BIGINT NOT NULL,
               expires_at BIGINT NOT NULL,
               process    TEXT NOT NULL
           )""",
        """CREATE TABLE fencepost_members (
               identity   TEXT PRIMARY KEY,
               address    TEXT NOT NULL,
               renewed_at BIGINT NOT NULL,
               expires_at BIGINT NOT NULL
           )""",
        "INSERT INTO fencepost_shards SELECT generate_series(0, value - 1), 0, '', '', 0, 0, '' "
        "FROM meta WHERE key = 'shards'",
    ],
    # 7 -> 8: coordinators that lead shards apart (storage/shared.py): each
    # shard's lease floor, revisions in blocks from a sequence, and whether
    # the database is led that way (set once, by the first such coordinator).
    [
        "ALTER TABLE fencepost_shards ADD COLUMN lease_floor BIGINT NOT NULL DEFAULT 0",
        # the coordinator (advertised address) an operator moved the shard to
        "ALTER TABLE fencepost_shards ADD COLUMN pinned TEXT NOT NULL DEFAULT ''",
        # pruning by commit time (revisions are not in commit order across coordinators)
        "CREATE INDEX changes_by_time ON changes (committed_at)",
        # which coordinator staged an upload (its writer's application_name): with
        # --lead-shards only a gone coordinator's are swept (engine_sql.sweep_uploads)
        "ALTER TABLE engine_uploads ADD COLUMN started_by TEXT NOT NULL "
        "DEFAULT current_setting('application_name')",
        # the shard rule (core/shards.py) in SQL, for the index a coordinator
        # taking shards reads them by (storage/shared.py); the keys are UTF-8
        """CREATE FUNCTION fencepost_shard(k TEXT, n INTEGER) RETURNS INTEGER
           LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT
           (('x' || left(encode(sha256(convert_to(k, 'UTF8')), 'hex'), 8))::bit(32)::bigint
            % n)::integer $$""",
        "CREATE SEQUENCE fencepost_revision_blocks",
        "INSERT INTO meta (key, value) VALUES ('lead_shards', 0)",
    ],
    # 8 -> 9: a watch by shards resumes each shard after its own revision
    # (rpc/watch.py): with --lead-shards, each shard's highest pruned revision
    # (revisions are not in commit order across coordinators).
    [
        "CREATE TABLE changes_pruned (shard INTEGER PRIMARY KEY, revision BIGINT NOT NULL)",
    ],
]


def redact(url: str) -> str:
    """The URL without its password (for logs and messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


@functools.lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    """``?`` placeholders as psycopg's ``%s`` (a literal ``%`` doubled)."""
    return sql.replace("%", "%%").replace("?", "%s")


# INSERT INTO t (a, b) VALUES (?,?): no ON CONFLICT, no RETURNING
_PLAIN_INSERT = re.compile(r"INSERT INTO (\w+) \(([\w, ]+)\) VALUES \(\?(?:, ?\?)*\)")

_IN_TX = (TransactionStatus.INTRANS, TransactionStatus.INERROR, TransactionStatus.ACTIVE)


class PgConnection:
    """The ``sqlite3.Connection`` methods the shared SQL uses, over a psycopg
    connection in autocommit mode (transactions are the statements' own
    ``BEGIN``/``COMMIT``). ``snapshot``: a reader's ``BEGIN`` opens a
    repeatable-read snapshot (a listing reads one state from first page to last)."""

    def __init__(self, conn: psycopg.Connection[Any], *, snapshot: bool = False) -> None:
        self.conn = conn
        self._begin = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if snapshot else "BEGIN"

    def execute(self, sql: str, params: Any = ()) -> psycopg.Cursor[Any]:
        cur = self.conn.cursor()
        if sql == "BEGIN":
            sql = self._begin
        if params:
            cur.execute(_pg_sql(sql), tuple(params))  # type: ignore[arg-type]
        else:
            cur.execute(sql)  # type: ignore[arg-type]
        return cur

    def executemany(self, sql: str, rows: Any) -> psycopg.Cursor[Any]:
        cur = self.conn.cursor()
        plain = _PLAIN_INSERT.fullmatch(sql)
        if plain is not None:
            # a plain INSERT (a batch's change rows): one COPY, about 5x faster
            # than a statement per row, even pipelined as executemany sends them
            with cur.copy(f"COPY {plain[1]} ({plain[2]}) FROM STDIN") as copy:  # type: ignore[arg-type]
                for row in rows:
                    copy.write_row(row)
            return cur
        cur.executemany(_pg_sql(sql), list(rows))  # type: ignore[arg-type]
        return cur

    @property
    def in_transaction(self) -> bool:
        return self.conn.info.transaction_status in _IN_TX

    @property
    def broken(self) -> bool:
        return self.conn.closed or self.conn.broken

    def rollback(self) -> None:
        if self.in_transaction:
            self.execute("ROLLBACK")

    def close(self) -> None:
        """Close; a connection that is already broken closes quietly."""
        try:
            self.conn.close()
        except psycopg.Error:
            pass


def connect(url: str, role: str, *, read_only: bool = False, snapshot: bool = False,
            synchronous_commit: str = "on") -> PgConnection:
    """A connection with the session settings fencepost relies on; ``role``
    goes into ``application_name`` (fencepost-writer, fencepost-reader...), so
    an operator sees who holds which connection."""
    options = [
        f"-c search_path={SCHEMA}",
        f"-c synchronous_commit={synchronous_commit}",
        "-c TimeZone=UTC",
    ]
    if read_only:
        options.append("-c default_transaction_read_only=on")
    conn = psycopg.connect(
        url,
        autocommit=True,
        application_name=role[:63],  # PostgreSQL keeps 63 bytes
        options=" ".join(options),
        connect_timeout=5,
        keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
    )
    return PgConnection(conn, snapshot=snapshot)


def listener(url: str, channel: str, role: str) -> psycopg.Connection[Any]:
    """A connection LISTENing on ``channel``: its ``notifies()`` yields each
    NOTIFY sent there (ha/shards.py wakes on them)."""
    conn = psycopg.connect(url, autocommit=True, connect_timeout=5, application_name=role[:63])
    conn.execute(f"LISTEN {channel}")
    return conn


def storage_error(exc: BaseException) -> LedgerError:
    why = f"write not made durable, nothing changed: {first_line(exc)}"
    if isinstance(exc, pg_errors.DiskFull | pg_errors.OutOfMemory):
        return LedgerError(Code.STORAGE_FULL, why)
    return LedgerError(Code.STORAGE_UNAVAILABLE, why)


def first_line(exc: BaseException) -> str:
    """The first line of a driver error (psycopg's messages run on)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# What a call on a PgConnection raises, and the one error callers outside
# storage/ tell apart (a ``lock_timeout`` ran out): they need no driver import.
DRIVER_ERRORS: tuple[type[Exception], ...] = (psycopg.Error,)
LockNotAvailable = pg_errors.LockNotAvailable


class NotLeader(LedgerError):
    def __init__(self, leader: str) -> None:
        where = f"the leader is at {leader}" if leader else "no leader is known yet"
        super().__init__(
            Code.NOT_LEADER,
            f"this coordinator is a standby; {where}: nothing was done",
            metadata={"leader": leader},
        )


class PostgresStorage(SqlStorage):
    """The PostgreSQL backend. Not thread-safe: the writer thread owns it.

    ``epoch``: given by ``lead`` once this coordinator leads; every batch
    then checks it inside its own transaction (None: no check, a coordinator
    that does not lead never writes)."""

    backend = "postgresql"
    GREATEST = "GREATEST"
    SET_EXPIRY = "jsonb_set(record::jsonb, '{lease,2}', to_jsonb(?::bigint))::text"
    ID_ARRAY = "json_agg(run_id ORDER BY run_id)::text"
    ERRORS = (psycopg.Error,)

    def __init__(self, url: str, *, durable: bool = True, name: str = "fencepost",
                 unsafe_skip_epoch_check: bool = False, shards: int | None = None) -> None:
        super().__init__()
        self.url = url
        self.requested_shards = shards
        self.path = redact(url)
        self.name = name
        self.synchronous_commit = "on" if durable else "off"
        self.epoch: int | None = None
        self._db: PgConnection | None = None
        # TEST-ONLY broken build (--fault no-epoch-check, with --test-hooks):
        # batches skip the epoch check, so a deposed leader can commit
        self.unsafe_skip_epoch_check = unsafe_skip_epoch_check
        self._xid: int | None = None  # the open batch's transaction id
        # --lead-shards (storage/shared.py): the shards held, the revision block
        self.sharing_state = Sharing()

    # -- lifecycle ---------------------------------------------------------------

    def lead(self, epoch: int) -> None:
        """This coordinator leads under ``epoch``: every batch from now on
        commits only while the leader row still holds it."""
        self.epoch = epoch

    def lead_shards(self) -> None:
        """Lead only the shards taken (``sharing_state``), with every other
        coordinator of the database started the same way (storage/shared.py)."""
        self.sharing = True

    def open(self) -> None:
        """Connect and migrate (the schema only: no leader check here); a
        coordinator leading shards makes the database one led that way."""
        try:
            self._db = self._connect_writer()
            self.shards = migrate(self._db, self.path, self.requested_shards)
            if self.sharing:
                shared.convert(self)
        except psycopg.Error as exc:
            self.close()
            raise RuntimeError(f"{self.path}: {first_line(exc)}") from exc
        except BaseException:
            self.close()
            raise

    def _connect_writer(self) -> PgConnection:
        return connect(self.url, f"fencepost-writer {self.name}",
                       synchronous_commit=self.synchronous_commit)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def reader(self) -> PgConnection:
        return connect(self.url, f"fencepost-reader {self.name}", read_only=True, snapshot=True)

    # -- the batch ---------------------------------------------------------------

    def _connection(self) -> PgConnection:
        db = self.db
        if db.broken:  # the last batch lost it: this one reconnects (or fails)
            log.warning("reconnecting to %s", self.path)
            db.close()
            self._db = db = self._connect_writer()
        return db

    def _begin(self, db: PgConnection) -> None:
        db.execute("BEGIN")
        if self.epoch is None or self.sharing or self.unsafe_skip_epoch_check:
            got: Any = db.execute("SELECT txid_current()").fetchone()
            self._xid = got[0]
            return
        # FOR KEY SHARE: held to COMMIT, it makes a takeover's FOR UPDATE wait
        # for this batch, yet lets the leader's own renewals (non-key updates
        # of the row) through, however long the batch.
        row = db.execute(
            "SELECT epoch, address, txid_current() FROM fencepost_leader WHERE id = 1 "
            "FOR KEY SHARE"
        ).fetchone()
        if row is None or row[0] != self.epoch:
            raise NotLeader(row[1] if row else "")
        self._xid = row[2]

    def _commit(self, db: PgConnection) -> None:
        """COMMIT. When the connection is lost while the COMMIT is out (the
        server crashed, restarted or ended the session), the batch may have
        committed or not: ask the database what became of its transaction
        (``txid_status``) on a new connection, and go on as committed if it
        did, so nobody is told "nothing changed" about a write that is there."""
        if self.sharing and not self.unsafe_skip_epoch_check:
            self.sharing_state.check(db)
        try:
            db.execute("COMMIT")
        except psycopg.Error:
            if not db.broken or self._xid is None:
                raise  # the server answered: the transaction is rolled back
            if not self._committed_after_all(self._xid):
                raise
            log.warning("the connection was lost during COMMIT, but transaction %s committed",
                        self._xid)

    def _committed_after_all(self, xid: int) -> bool:
        """Whether transaction ``xid`` committed, asked until the database can
        say (a leader that cannot reach it meanwhile loses its leadership and
        exits, leaving the callers without an answer, not a wrong one). Raises
        STORAGE_UNAVAILABLE (outcome unknown) after RESOLVE_COMMIT_S."""
        deadline = time.monotonic() + RESOLVE_COMMIT_S
        while True:
            try:
                probe = connect(self.url, f"fencepost-writer {self.name}")
                try:
                    row: Any = probe.execute("SELECT txid_status(?)", (xid,)).fetchone()
                    status = row[0]
                finally:
                    probe.close()
                if status == "committed":
                    return True
                if status in ("aborted", None):
                    return False
            except pg_errors.InvalidParameterValue:  # "in the future": never logged, aborted
                return False
            except psycopg.Error:
                pass  # not reachable yet (restarting): ask again
            if time.monotonic() >= deadline:
                raise LedgerError(Code.STORAGE_UNAVAILABLE,
                                  f"the outcome of transaction {xid} is unknown: the database "
                                  f"could not be asked for {RESOLVE_COMMIT_S:.0f} s")
            time.sleep(0.1)

    def _storage_error(self, exc: BaseException) -> LedgerError:
        return storage_error(exc)

    # -- leading shards (storage/shared.py) -------------------------------------

    def first_revision(self, current: int) -> int:
        return self.sharing_state.first_revision(self.db, current) if self.sharing else current

    def load_shards(self, shards: frozenset[int]) -> shared.LoadedShards:
        self.sharing_state.new_block = True  # the shards' next revisions are above their last
        return shared.load_shards(self, shards)

    def touch_shards(self, shards: Iterable[int]) -> None:
        self.sharing_state.touched.update(shards)

    def set_lease_floor(self, value: int, shards: Iterable[int] | None = None) -> None:
        if not self.sharing:
            super().set_lease_floor(value)
            return
        epochs = self.sharing_state.epochs
        if shards is not None:
            epochs = {s: epochs[s] for s in shards if s in epochs}
        shared.set_floors(self.db, epochs, value)

    def finished_before(
        self, db: Any, cutoff_ms: int, limit: int, after: tuple[int, str] | None = None
    ) -> list[tuple[str, int, int]]:
        at, run_id = after if after is not None else (-(2**62), "")
        expr = "((record::jsonb ->> 'updated_at')::bigint)"
        rows = db.execute(
            f"SELECT run_id, version, {expr} FROM runs WHERE status IN (4, 5, 6) "
            f"AND {expr} < ? AND ({expr}, run_id) > (?, ?) ORDER BY {expr}, run_id LIMIT ?",
            (cutoff_ms, at, run_id, limit),
        ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]


def prepare(storage: PostgresStorage) -> None:
    """Create or upgrade the schema on a short-lived connection; RuntimeError
    (the server refuses to start) when the database cannot be reached or used,
    or is led by shards and this coordinator would lead alone."""
    try:
        db = connect(storage.url, f"fencepost-migrate {storage.name}")
        try:
            storage.shards = migrate(db, storage.path, storage.requested_shards)
            if not storage.sharing:
                shared.refuse_single_leader(db, storage.path)
        finally:
            db.close()
    except psycopg.Error as exc:  # unreachable, no such database, no permission...
        raise RuntimeError(f"{storage.path}: {first_line(exc)}; refusing to start") from None


def migrate(db: PgConnection, where: str, shards: int | None = None) -> int:
    """Create or upgrade the schema, in one transaction, under an advisory
    lock (coordinators starting together migrate once); the stored shard
    count (a new database stores ``shards``). Refuses a schema written by a
    newer release, a ``fencepost`` schema holding tables that are not ours,
    and a ``shards`` other than the stored count."""
    db.execute("BEGIN")
    try:
        db.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATE_LOCK,))
        db.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        has_version = _one(db.execute(
            "SELECT to_regclass(?) IS NOT NULL", (f"{SCHEMA}.fencepost_schema",)
        ))
        if has_version:
            version = _one(db.execute("SELECT version FROM fencepost_schema"))
        else:
            tables = _one(db.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = ?", (SCHEMA,)
            ))
            if tables:
                raise RuntimeError(
                    f"{where}: schema {SCHEMA!r} holds tables but no fencepost schema "
                    "version; refusing to start"
                )
            db.execute("CREATE TABLE fencepost_schema (version INTEGER NOT NULL)")
            db.execute("INSERT INTO fencepost_schema VALUES (0)")
            version = 0
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{where} has schema {version}; this fencepost knows up to "
                f"{SCHEMA_VERSION}. Refusing to start (upgrade fencepost)."
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for stmt in MIGRATIONS[target - 1]:
                db.execute(stmt)
            db.execute("UPDATE fencepost_schema SET version = ?", (target,))
            log.info("%s: schema migrated to version %d", where, target)
        stored = settle_shards(db, where, shards, fresh=version == 0)
        if version < 7:
            _shard_rows(db, stored)
        db.execute("COMMIT")
        return stored
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _shard_rows(db: PgConnection, shards: int) -> None:
    """One row per shard 0 .. shards - 1, in the transaction that created
    the table: a new database stored its --shards after the migration
    wrote rows for the default count."""
    db.execute("DELETE FROM fencepost_shards WHERE shard >= ?", (shards,))
    db.execute("INSERT INTO fencepost_shards SELECT generate_series(0, ?::integer - 1), 0, '', "
               "'', 0, 0, '' ON CONFLICT (shard) DO NOTHING", (shards,))


def _one(cur: psycopg.Cursor[Any]) -> Any:
    """The single value of a one-row, one-column result."""
    row = cur.fetchone()
    if row is None:
        raise RuntimeError("the fencepost schema is damaged (a row it keeps is missing); "
                           "refusing to start")
    return row[0]
