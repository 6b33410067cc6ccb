"""The SQL both backends share: loading the ledger, reads, one batch's write path.
Why the log, the runs table and the saved index are as they are: storage/DESIGN.md."""

from __future__ import annotations

import array
import contextlib
import itertools
import json
import logging
import sqlite3
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from ..core import codec
from ..core.errors import Code, LedgerError
from ..core.records import (
    KIND_DELETE,  # noqa: F401  (re-exported with KIND_PUT: the log's kinds)
    KIND_PUT,
    MAX_INT64,
    MAX_SAFE,
    Record,
    out_of_range,
    record_from_dict,
    record_to_dict,
)

# Statuses whose runs are held in memory ("hot"); the terminal ones are read
# from the runs table on demand once it reflects them.
HOT_STATUSES = (1, 2, 3)  # queued, running, suspended
COLD_STATUSES = (4, 5, 6)  # completed, failed, cancelled

T = TypeVar("T")

log = logging.getLogger("fencepost.storage")

# Run ids per saved_index row (about 2 MB of text for UUIDs)
SAVED_CHUNK = 65_536
# what start-up logs after "<n> finished runs' ids" when it used the saved
# index entries (the torture harness and the tests look for it)
SAVED_INDEX_READ = "read from the index saved at the last shutdown"
SAVED_INDEX_WRITTEN = "saved for the next start"  # logged by a clean shutdown

# New rows of runs per block (the first part of its key). The migrations that
# made the column numbered existing rows the same way.
BLOCK_RUNS = 256


def read_errors() -> tuple[type[BaseException], ...]:
    """What a read the database could not answer raises (PostgreSQL
    restarting, a session it ended): callers answer STORAGE_UNAVAILABLE,
    retryable. psycopg's errors count once the PostgreSQL store has loaded it
    (a server on SQLite never imports psycopg)."""
    pg = sys.modules.get("psycopg")
    return (sqlite3.Error,) if pg is None else (sqlite3.Error, pg.Error)


def unavailable(exc: BaseException) -> LedgerError:
    """The refusal of a read the database could not answer (one of
    ``read_errors``): STORAGE_UNAVAILABLE, retryable, naming the cause."""
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    log.warning("the database could not answer: %s", why)
    return LedgerError(Code.STORAGE_UNAVAILABLE,
                       f"the database could not answer; nothing changed: {why}")


@contextlib.contextmanager
def answering() -> Iterator[None]:
    """Around a committed read: what the database could not answer leaves as
    ``unavailable``'s LedgerError, so callers need not know the drivers."""
    try:
        yield
    except read_errors() as exc:
        raise unavailable(exc) from exc


@dataclass
class LoadedState:
    # the runs held in memory: unfinished ones, and any the change log
    # replayed; ``cold`` names the rest, grouped: (status, lease owner, run ids)
    runs: dict[str, Record] = field(default_factory=dict)
    cold: list[tuple[int, str | None, list[str]]] = field(default_factory=list)
    tombstones: dict[str, int] = field(default_factory=dict)
    revision: int = 0
    compacted: int = 0
    replayed: int = 0  # changes above the materialized mark, replayed (and materialized)
    saved: int = 0  # finished runs whose ids came from the index saved at shutdown


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
    # The lease floor to store once this commits (docs/SPEC.md §4): every
    # expiry renewed from memory before it is in runs; LEASES_EXACT: all are.
    lease_floor: int | None = None
    # Runs whose row is their record but for the lease's expiry (renewed from
    # memory since): only the expiry is written into the row.
    expiries: list[tuple[str, Record]] = field(default_factory=list)


# meta.lease_floor when every stored lease expiry is exact (a clean stop, or a
# database written before renewals were answered from memory: no row)
LEASES_EXACT = -1

# Rows one batch prunes from each of changes and requests, at most. Pruning
# everything due in one statement every prune_every_ms (150 000 rows at 5 000
# renewals/s and 30 s) stalled that batch and every caller queued behind it;
# in chunks the backlog goes in a few batches of a few milliseconds each.
PRUNE_CHUNK = 8192


def _dumps(obj: Any) -> str:
    """Compact JSON text, UTF-8 unescaped (orjson: about 5x the stdlib encoder,
    which was a fifth of the writer thread's time)."""
    try:
        return orjson.dumps(obj).decode()
    except TypeError:  # an integer past 64 bits (a record written by hand)
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _int64(v: Any) -> int:
    """A value for an integer column: a record's counter written by hand past
    what the column holds is kept there as the nearest int64 (the record's
    text keeps it exactly; such a record is never served: rpc/convert.py)."""
    if type(v) is int and -MAX_INT64 - 1 <= v <= MAX_INT64:
        return v
    return MAX_INT64 if v > 0 else -MAX_INT64 - 1


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


def settle_shards(db: Any, where: str, requested: int | None, *, fresh: bool = False) -> int:
    """The database's shard count (meta.shards, docs/SPEC.md §13). A database
    just created (``fresh``, inside its creating transaction) stores
    ``requested``; an existing one keeps its own, and a start that asks for
    another count is refused (RuntimeError: the server does not start)."""
    if fresh and requested is not None:
        db.execute("UPDATE meta SET value = ? WHERE key = 'shards'", (requested,))
    row = db.execute("SELECT value FROM meta WHERE key = 'shards'").fetchone()
    if row is None:
        raise RuntimeError(f"{where}: the stored shard count is missing (the fencepost "
                           "schema is damaged); refusing to start")
    stored = int(row[0])
    refuse_another_count(where, stored, requested)
    return stored


# The count of every database created before shards were stored.
COUNT_BEFORE_SHARDS = 64


def refuse_another_count(where: str, stored: int, requested: int | None) -> None:
    """RuntimeError (the server does not start) when ``requested`` is given
    and is not the database's ``stored`` count."""
    if requested is not None and requested != stored:
        raise RuntimeError(
            f"{where} has {stored} shards, fixed when it was created; --shards {requested} "
            f"cannot change that. Start without --shards (the stored {stored} is used) or "
            f"with --shards {stored}; refusing to start"
        )


class SqlStorage:
    """What the writer needs of a database (the storage seam): ``open``,
    ``load``, ``read_runs``, ``lookup_requests``, ``transaction`` /
    ``run_isolated`` / ``write`` for one batch, ``reader`` for read-only
    connections (history, finished runs, the engine store), ``close``. The
    subclass opens the connection and supplies the dialect. Not thread-safe:
    the writer thread owns it."""

    backend = ""
    path = ""  # what to name in messages: the file, or the URL without its password
    # the dialect: the larger of two values, an index hint for the finished
    # runs' ids at start-up (SQLite's planner needs it), and the aggregate
    # that gathers a group's run ids into one JSON array (text)
    GREATEST = "max"
    # the stored record with its lease's expiry replaced (the record's form:
    # "lease": [owner, acquired_at, expires_at, ttl_ms, lock_delay_ms])
    SET_EXPIRY = "json_set(record, '$.lease[2]', ?)"
    STATUS_INDEX = ""
    ID_ARRAY = "json_group_array(run_id)"
    # the driver's error class: a batch that hits one fails as STORAGE_*
    ERRORS: tuple[type[BaseException], ...] = ()
    _db: Any = None
    # run id -> the block of its row in runs, as committed (load() builds it;
    # the writer thread changes it right after each commit; readers on other
    # threads only look ids up in it)
    rows: dict[str, int]
    _staged: dict[str, int | None]  # this transaction's changes to rows (None: row deleted)
    # the blocks touched_blocks holds, as committed, and those this transaction
    # adds; _untouch: this transaction empties the table (save_index)
    _touched: set[int]
    _touching: set[int]
    _untouch = False
    _block = 0  # the block new rows go in, and how many it has been given
    _in_block = 0
    # the shard count a start asks for (None: the stored one), and the
    # database's own once it is open (docs/SPEC.md §13)
    requested_shards: int | None = None
    shards = 0
    # several coordinators lead this database's shards (storage/shared.py):
    # each batch writes its runs' rows, and no meta row
    sharing = False

    def __init__(self) -> None:
        self.rows = {}
        self._staged = {}
        self._touched, self._touching = set(), set()

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def reader(self) -> Any:
        """A new read-only connection (committed state only)."""
        raise NotImplementedError

    def _storage_error(self, exc: BaseException) -> LedgerError:
        raise NotImplementedError

    def _connection(self) -> Any:
        """The write connection for the next batch (PostgreSQL: reconnected
        when the last one broke)."""
        return self.db

    def _begin(self, db: Any) -> None:
        db.execute("BEGIN")

    def _commit(self, db: Any) -> None:
        db.execute("COMMIT")

    def first_revision(self, current: int) -> int:
        """The revision a batch counts up from (storage/shared.py: a block's)."""
        return current

    def load_shards(self, shards: frozenset[int]) -> Any:
        """The runs of shards just taken (storage/shared.py; PostgreSQL only)."""
        raise NotImplementedError

    def touch_shards(self, shards: Iterable[int]) -> None:
        """The shards the open batch touched (checked before its COMMIT when
        several coordinators lead shards apart)."""

    @property
    def is_open(self) -> bool:
        return self._db is not None

    @property
    def db(self) -> Any:
        if self._db is None:
            raise RuntimeError("storage is not open")
        return self._db

    def finished_before(
        self, db: Any, cutoff_ms: int, limit: int, after: tuple[int, str] | None = None
    ) -> list[tuple[str, int, int]]:
        """(run id, version, finished at) of finished runs of the runs table last
        changed before ``cutoff_ms``, oldest first, past ``after`` (the last
        (finished at, run id) a previous call returned), on ``db`` (a reader)."""
        raise NotImplementedError


    def load(self, prepare: Callable[[LoadedState], None] | None = None) -> LoadedState:
        """The committed ledger: the unfinished runs of the runs table, plus the
        changes above its materialized mark replayed in order — which are then
        written to runs (one transaction), so the writer starts with nothing
        pending. Finished runs are not read: ``cold`` lists their ids (from
        the status index alone); ``read_runs`` reads them when asked.
        ``prepare`` is called with the state before load returns (SQLite:
        while the start-up integrity check may still be reading the file; its
        verdict is awaited afterwards and fails the load as before)."""
        db = self.db
        state = LoadedState()
        self.rows, self._staged = {}, {}
        self._touched = {block for (block,) in db.execute("SELECT block FROM touched_blocks")}
        self._touching, self._untouch = set(), False
        rows = self.rows
        read = 0  # rows read: more than ``rows`` holds when two share a run id
        marks = ",".join("?" * len(HOT_STATUSES))
        for block, run_id, text in db.execute(
            f"SELECT block, run_id, record FROM runs WHERE status IN ({marks})", HOT_STATUSES
        ):
            state.runs[run_id] = self._readable(text, f"the stored record of run {run_id!r}")
            rows[run_id] = block
            read += 1
        state.tombstones = dict(db.execute("SELECT run_id, fencing_token FROM tombstones"))
        # never below a change already written: a stale writer's catch-up must not
        # make a new leader reuse a revision (only possible without the epoch check)
        state.revision = db.execute(
            "SELECT max(v) FROM (SELECT value AS v FROM meta WHERE key='revision' "
            "UNION ALL SELECT max(revision) FROM changes) AS r").fetchone()[0]
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
                continue
            row = state.runs.get(run_id)
            if row is not None and row.revision == rec.revision:
                # the same write, its row carrying a lease expiry renewed from
                # memory and flushed since (writer/renewals.py)
                replay[run_id] = rec = row
            state.runs[run_id] = rec
        saved = self._saved_groups(db, read, replay)
        if saved is not None:
            state.cold, cold = saved
            state.saved = cold
        else:
            state.cold, cold = self._cold_groups(db, replay)
        self._check_rows(db, read + cold)
        if mark != state.revision:
            with self.transaction():
                self._materialize(db, list(replay.items()), state.revision, state.revision)
        replayed: dict[tuple[int, str | None], list[str]] = {}
        for run_id, rec in replay.items():  # now reflected in runs: finished ones go cold
            if rec is not None and rec.status in COLD_STATUSES:
                del state.runs[run_id]
                key = (int(rec.status), rec.lease.owner if rec.lease else None)
                replayed.setdefault(key, []).append(run_id)
        state.cold += [(st, owner, ids) for (st, owner), ids in replayed.items()]
        state.compacted = self._compacted(db, state.revision)
        self._flag_out_of_range(state.runs)
        if prepare is not None:
            prepare(state)
        return state

    def _flag_out_of_range(self, runs: dict[str, Record]) -> None:
        """Say loudly which loaded runs hold a counter past 2^53 - 1 (written by
        hand, or by a release without the bound): each is refused on access and
        to every command but a delete, and everything else is served."""
        bad = [run_id for run_id, r in runs.items()
               if not (0 <= r.fencing_token <= MAX_SAFE and 0 <= r.attempt <= MAX_SAFE
                       and 0 <= r.version <= MAX_SAFE)]
        if bad:
            shown = ", ".join(f"{run_id!r} ({out_of_range(runs[run_id])})" for run_id in bad[:10])
            log.warning("%s: %d runs are stored with a counter outside 0..2^53-1 and are not "
                        "served (RUN_INTEGRITY_ERROR) until deleted: %s%s", self.path, len(bad),
                        shown, ", ..." if len(bad) > 10 else "")

    def _cold_groups(
        self, db: Any, replay: dict[str, Record | None]
    ) -> tuple[list[tuple[int, str | None, list[str]]], int]:
        """The finished runs of the runs table as (status, owner, run ids)
        groups, from the status index alone, leaving out the ids ``replay``
        changed. The database gathers the ids of each (status, owner, block)
        into one JSON array, parsed in one call: reading a million (id,
        status, owner) rows one by one, and a Python step per row, took most
        of a start-up. Each array is in run id order (its block's), and
        RunIndex sorts a group's arrays together. The blocks fill ``rows``;
        the count of rows read comes with the groups."""
        marks = ",".join("?" * len(COLD_STATUSES))
        merged: dict[tuple[int, str | None], list[str]] = {}
        read = self._gather(db, f"{self.STATUS_INDEX} WHERE status IN ({marks})", replay,
                            self.rows, merged)
        return [(st, owner, ids) for (st, owner), ids in merged.items()], read

    def _gather(
        self, db: Any, where: str, replay: dict[str, Record | None],
        blocks_of: dict[str, int], merged: dict[tuple[int, str | None], list[str]],
    ) -> int:
        """The finished runs of the rows of ``runs`` that ``where`` (its
        clause after ``FROM runs``, taking COLD_STATUSES) selects, one array
        per (status, owner, block): their blocks into ``blocks_of``, their ids
        onto ``merged``'s (status, owner) groups but for those ``replay``
        changed. Returns how many rows it read."""
        read = 0
        for st, owner, block, text in db.execute(
            f"SELECT status, owner, block, {self.ID_ARRAY} FROM runs {where} "
            "GROUP BY status, owner, block", COLD_STATUSES,
        ):
            ids = _loads(text)
            blocks_of.update(dict.fromkeys(ids, block))
            read += len(ids)
            if replay:
                ids = [run_id for run_id in ids if run_id not in replay]
            merged.setdefault((int(st), owner), []).extend(ids)
        return read

    def _saved_groups(
        self, db: Any, read: int, replay: dict[str, Record | None]
    ) -> tuple[list[tuple[int, str | None, list[str]]], int] | None:
        """The finished runs' groups as the last clean shutdown saved them, with
        the blocks changed since (``touched_blocks``) gathered again from the
        table, and how many rows they account for, leaving out of the groups
        the ids ``replay`` changed (as ``_cold_groups``), if together with the
        ``read`` unfinished runs ``rows`` holds they account for every row of
        the table exactly once. Then ``rows`` takes their blocks; otherwise
        None, and nothing moved."""
        found = db.execute(
            "SELECT revision, status, owner, n, ids, blocks FROM saved_index ORDER BY seq"
        ).fetchall()
        if not found or len({row[0] for row in found}) != 1:
            return None
        touched = self._touched
        blocks_in_table = (db.execute("SELECT max(block) FROM runs").fetchone()[0] or 0) + 1
        if len(touched) * 2 > blocks_in_table:
            # most of the table changed since: gathering it all costs less
            log.info("%s: %d of %d blocks of the runs table changed since the index was "
                     "saved; gathering the finished runs' ids from the table",
                     self.path, len(touched), blocks_in_table)
            return None
        blocks_of: dict[str, int] = {}
        ints: list[int] = []  # one int object per block number, as load() shares them
        merged: dict[tuple[int, str | None], list[str]] = {}
        total = 0
        for _, st, owner, n, text, raw in found:
            ids = text.split("\n")
            blocks = array.array("q")
            blocks.frombytes(raw)
            if sys.byteorder == "big":
                blocks.byteswap()
            if len(ids) != n or len(blocks) != n or min(blocks) < 0:
                return None
            if touched and not touched.isdisjoint(blocks):
                # entries of changed blocks: the table has them as they are now
                keep = [block not in touched for block in blocks]
                ids = list(itertools.compress(ids, keep))
                blocks = array.array("q", itertools.compress(blocks, keep))
                if not ids:
                    continue
            top = max(blocks)
            if top >= len(ints):
                ints.extend(range(len(ints), top + 1))
            blocks_of.update(zip(ids, map(ints.__getitem__, blocks), strict=True))
            total += len(ids)
            if replay:
                ids = [run_id for run_id in ids if run_id not in replay]
            merged.setdefault((int(st), owner), []).extend(ids)
        again = 0
        if touched:
            marks = ",".join("?" * len(COLD_STATUSES))
            # a few blocks: read those rows by their key (``+status``: not
            # through the status index, whose every finished entry SQLite
            # would otherwise visit); many: the status index alone holds what
            # is read, and visiting it all costs less than that many rows
            status = "+status" if len(touched) * 8 <= blocks_in_table else "status"
            again = self._gather(db, "WHERE block IN (SELECT block FROM touched_blocks) "
                                 f"AND {status} IN ({marks})", replay, blocks_of, merged)
        total += again
        blocks_of.update(self.rows)
        table = db.execute("SELECT count(*) FROM runs").fetchone()[0]
        if not len(blocks_of) == read + total == table:
            log.warning(
                "%s: the index saved at the last shutdown, with the %d blocks changed since, "
                "does not match the runs table (%d ids, %d unfinished runs, %d rows); "
                "gathering the finished runs' ids from the table instead",
                self.path, len(touched), total, read, table,
            )
            return None
        self.rows = blocks_of
        log.info("%s: %d finished runs' ids %s%s", self.path, total, SAVED_INDEX_READ,
                 f" ({again} of them gathered again from the {len(touched)} blocks changed "
                 "since)" if touched else "")
        return [(st, owner, ids) for (st, owner), ids in merged.items()], total

    def save_index(self, groups: Iterable[tuple[int, str | None, list[str]]],
                   revision: int) -> int:
        """Replace the saved index with ``groups`` (status, lease owner, run
        ids in order) of the finished runs, as of ``revision``: every change at
        or below it reflected in ``runs``, and none above it. Inside
        ``transaction()``. Returns how many ids were saved: none if a run has
        no row or an id holds a line break (the separator; validation admits
        neither), and nothing stale is left."""
        db = self.db
        db.execute("DELETE FROM saved_index")
        db.execute("DELETE FROM touched_blocks")
        self._touching.clear()
        self._untouch = True
        rows = self.rows
        seq = saved = 0
        for status, owner, ids in groups:
            for i in range(0, len(ids), SAVED_CHUNK):
                chunk = ids[i:i + SAVED_CHUNK]
                text = "\n".join(chunk)
                blocks = [rows.get(run_id) for run_id in chunk]
                if text.count("\n") != len(chunk) - 1 or None in blocks:
                    db.execute("DELETE FROM saved_index")
                    return 0
                packed = array.array("q", blocks)  # type: ignore[type-var, arg-type]
                if sys.byteorder == "big":
                    packed.byteswap()
                db.execute(
                    "INSERT INTO saved_index (seq, revision, status, owner, n, ids, blocks) "
                    "VALUES (?,?,?,?,?,?,?)",
                    (seq, revision, status, owner, len(chunk), text, packed.tobytes()),
                )
                seq += 1
                saved += len(chunk)
        return saved

    def _check_rows(self, db: Any, read: int) -> None:
        """Refuse a runs table with two rows for one run id (``read`` rows were
        read; nothing in the database enforces one row per run, the writer
        does, through ``rows``); new rows start a new block."""
        if read != len(self.rows):
            raise RuntimeError(
                f"{self.path}: the runs table holds {read} rows for {len(self.rows)} run ids "
                "(two rows for one run); refusing to start and leaving the database untouched"
            )
        top = db.execute("SELECT max(block) FROM runs").fetchone()[0]
        self._block, self._in_block = (0 if top is None else top + 1), 0

    def read_runs(self, run_ids: list[str], db: Any = None) -> dict[str, Record]:
        """The runs table's records of those ids that have one, on ``db`` (a
        reader), or the write connection (writer thread: inside a batch it
        sees what earlier batches committed)."""
        db = self.db if db is None else db
        rows = self.rows
        out: dict[str, Record] = {}
        keys = [(block, run_id) for run_id in run_ids if (block := rows.get(run_id)) is not None]
        for i in range(0, len(keys), 250):  # chunks the statement can bind
            chunk = keys[i:i + 250]
            # one primary-key search per term, on SQLite and PostgreSQL alike
            # (SQLite scans the table for a row-value IN list)
            for run_id, text in db.execute(
                "SELECT run_id, record FROM runs WHERE "
                + " OR ".join(["(block = ? AND run_id = ?)"] * len(chunk)),
                [v for key in chunk for v in key],
            ):
                out[run_id] = record_from_dict(_loads(text))
        return out

    def _readable(self, text: Any, what: str) -> Record:
        try:
            return record_from_dict(_loads(text))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise RuntimeError(
                f"{self.path}: {what} is unreadable ({exc!r}); refusing to start and "
                "leaving the file untouched"
            ) from exc

    def lease_floor(self) -> int:
        """The stored lease floor (docs/SPEC.md §4), LEASES_EXACT when none."""
        row = self.db.execute("SELECT value FROM meta WHERE key='lease_floor'").fetchone()
        return LEASES_EXACT if row is None else int(row[0])

    def set_lease_floor(self, value: int, shards: Iterable[int] | None = None) -> None:
        """Store the lease floor; call inside ``transaction()``. (``shards``:
        only theirs, when coordinators lead shards apart: storage/shared.py.)"""
        self.db.execute(
            "INSERT INTO meta (key, value) VALUES ('lease_floor', ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (value,),
        )

    def materialized_mark(self) -> int:
        return int(
            self.db.execute("SELECT value FROM meta WHERE key='materialized'").fetchone()[0]
        )

    def _materialize(
        self, db: Any, runs: list[tuple[str, Record | None]], mark: int, revision: int
    ) -> None:
        """Copy runs into the runs table and set the mark (and the revision: one
        statement for both meta rows)."""
        self._upsert(db, runs)
        db.execute(
            "UPDATE meta SET value = CASE key WHEN 'revision' THEN ? ELSE ? END "
            "WHERE key IN ('revision', 'materialized')",
            (revision, mark),
        )

    def _write_expiries(self, db: Any, runs: list[tuple[str, Record]]) -> None:
        """Write only the lease expiry into the rows of ``runs``, each current
        but for it: an edit of the stored JSON in SQL, no record encoded. A run
        with no row or no lease, or rows the database cannot edit (written by
        hand), get their whole record instead."""
        rows, staged = self.rows, self._staged
        edits: list[tuple[int, int, str]] = []
        edited: list[tuple[str, Record]] = []
        whole: list[tuple[str, Record | None]] = []
        for run_id, r in runs:
            block = rows.get(run_id)
            lease = r.lease
            if block is None or lease is None or run_id in staged or (
                    _int64(lease.expires_at) != lease.expires_at):
                whole.append((run_id, r))
                continue
            edits.append((lease.expires_at, block, run_id))
            edited.append((run_id, r))
        if edits:
            db.execute("SAVEPOINT expiries")
            try:
                edits.sort(key=lambda e: (e[1], e[2]))  # in key order: each page once
                db.executemany(
                    f"UPDATE runs SET record = {self.SET_EXPIRY} WHERE block = ? AND run_id = ?",
                    edits,
                )
            except self.ERRORS:
                db.execute("ROLLBACK TO expiries")
                whole += edited
            db.execute("RELEASE expiries")
        if whole:
            self._upsert(db, whole)

    def _upsert(self, db: Any, runs: list[tuple[str, Record | None]]) -> None:
        """Write each run's whole record into its row (None: delete it). A run
        without a row goes in the current block; ``rows`` learns of it once
        the transaction commits."""
        rows, staged = self.rows, self._staged
        puts = []
        gone = []
        for run_id, r in runs:
            block = rows.get(run_id)
            if r is None:
                if block is not None:
                    gone.append((block, run_id))
                    staged[run_id] = None
                continue
            if block is None:
                block = staged[run_id] = self._next_block()
            puts.append((
                block,
                run_id,
                _int64(r.version),
                int(r.status),
                _int64(r.fencing_token),
                r.lease.owner if r.lease else None,
                r.revision,
                _dumps(record_to_dict(r)),
            ))
        if puts:
            db.executemany(
                "INSERT INTO runs (block, run_id, version, status, fencing_token, owner, "
                "revision, record) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (block, run_id) DO "
                "UPDATE SET version=excluded.version, status=excluded.status, "
                "fencing_token=excluded.fencing_token, owner=excluded.owner, "
                "revision=excluded.revision, record=excluded.record",
                puts,
            )
        if gone:
            db.executemany("DELETE FROM runs WHERE block = ? AND run_id = ?", gone)
        # for the next start's reading of the saved index: the blocks not yet
        # recorded (renewals of many leases touch the same few hundred blocks
        # in every copy)
        if self.sharing:  # (no saved index: the coordinators load shards, not the table)
            return
        changed = {p[0] for p in puts}.union(b for b, _ in gone)
        changed -= self._touching
        if not self._untouch:
            changed -= self._touched
        if changed:
            db.executemany(
                "INSERT INTO touched_blocks (block) VALUES (?) ON CONFLICT (block) DO NOTHING",
                [(b,) for b in sorted(changed)],
            )
            self._touching |= changed

    def _prune_by_time(self, db: Any, batch: Batch) -> None:
        """Pruning where coordinators lead shards apart (storage/shared.py):
        revisions are not in commit order across coordinators, so the oldest
        committed changes go first, keeping the newest ``history_revisions``
        (and none older than the age limit), whoever committed them."""
        assert batch.prune is not None
        request_cutoff, keep_from, age_cutoff, _ = batch.prune
        more = db.execute(
            "DELETE FROM requests WHERE request_id IN (SELECT request_id FROM requests "
            "WHERE created_at < ? ORDER BY created_at LIMIT ?)",
            (request_cutoff, PRUNE_CHUNK),
        ).rowcount >= PRUNE_CHUNK
        keep = max(1, batch.revision - keep_from + 1)
        row = db.execute("SELECT committed_at FROM changes ORDER BY committed_at DESC "
                         "LIMIT 1 OFFSET ?", (keep,)).fetchone()
        cutoff = max(row[0] + 1 if row else -1, age_cutoff if age_cutoff is not None else -1)
        if cutoff >= 0:
            # each shard's highest pruned revision goes with it (a watch by
            # shards resumes only where its shard's history is whole)
            deleted = db.execute(
                "WITH gone AS (DELETE FROM changes WHERE revision IN (SELECT revision "
                "FROM changes WHERE committed_at < ? ORDER BY committed_at LIMIT ?) "
                "RETURNING revision, fencepost_shard(run_id, ?::integer) AS shard), "
                "top AS (INSERT INTO changes_pruned SELECT shard, max(revision) FROM gone "
                "GROUP BY shard ORDER BY shard ON CONFLICT (shard) DO UPDATE SET revision = "
                "greatest(changes_pruned.revision, excluded.revision)) "
                "SELECT count(*) FROM gone", (cutoff, PRUNE_CHUNK, self.shards),
            ).fetchone()[0]
            more = deleted >= PRUNE_CHUNK or more
        batch.prune_more = more

    @staticmethod
    def _compacted(db: Any, revision: int) -> int:
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
        """One batch: BEGIN ... COMMIT, durable when COMMIT returns. On any
        failure rolls back and raises LedgerError(STORAGE_*) for driver errors."""
        self.prepare(lambda: None)
        try:
            yield
        except BaseException as exc:
            self.abort()
            if isinstance(exc, self.ERRORS):
                raise self._storage_error(exc) from exc
            raise
        self.commit_prepared()

    def prepare(self, body: Callable[[], T]) -> T:
        """BEGIN and run ``body`` in the new transaction, left open for
        ``commit_prepared`` (or ``abort``). On any failure rolls back and
        raises, as ``transaction`` does."""
        try:
            db = self._connection()
            try:
                self._begin(db)
                return body()
            except BaseException:
                try:
                    self._rollback(db)
                finally:
                    self._batch_ended()
                raise
        except self.ERRORS as exc:
            raise self._storage_error(exc) from exc

    def commit_prepared(self) -> None:
        """COMMIT the transaction ``prepare`` opened: durable when it returns."""
        try:
            db = self.db
            try:
                self._commit(db)
            except BaseException:
                self._rollback(db)
                raise
            self._settle_rows()
        except self.ERRORS as exc:
            raise self._storage_error(exc) from exc
        finally:
            self._batch_ended()

    def abort(self) -> None:
        """Roll back the transaction ``prepare`` opened."""
        try:
            self._rollback(self.db)
        except self.ERRORS as exc:
            raise self._storage_error(exc) from exc
        finally:
            self._batch_ended()

    def _rollback(self, db: Any) -> None:
        self._staged.clear()
        self._touching.clear()
        self._untouch = False
        if db.in_transaction:
            db.execute("ROLLBACK")

    def _batch_ended(self) -> None:
        """A batch's transaction ended, committed or not."""

    def loop_can_prepare(self) -> bool:
        """Whether the next batch may be prepared on the event loop's thread
        (never for a database server: every statement is a round trip)."""
        return False

    def _next_block(self) -> int:
        """The block for a new row: the same int object for ``BLOCK_RUNS`` rows."""
        if self._in_block == BLOCK_RUNS:
            self._block, self._in_block = self._block + 1, 0
        self._in_block += 1
        return self._block

    def _settle_rows(self) -> None:
        """The committed transaction's rows: new ones join ``rows``, deleted ones
        leave it."""
        rows = self.rows
        for run_id, block in self._staged.items():
            if block is None:
                rows.pop(run_id, None)
            else:
                rows[run_id] = block
        self._staged.clear()
        if self._untouch:
            self._touched.clear()
            self._untouch = False
        self._touched |= self._touching
        self._touching.clear()

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
                f"fencing_token={self.GREATEST}(tombstones.fencing_token, "
                "excluded.fencing_token), deleted_at=excluded.deleted_at",
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
        if self.sharing:
            self._upsert(db, batch.materialize)
        elif batch.materialized is not None:
            self._materialize(db, batch.materialize, batch.materialized, batch.revision)
        elif batch.changes:
            db.execute("UPDATE meta SET value = ? WHERE key = 'revision'", (batch.revision,))
        if batch.expiries:
            self._write_expiries(db, batch.expiries)
        if batch.lease_floor is not None:
            self.set_lease_floor(batch.lease_floor)
        if batch.requests:
            db.executemany(
                "INSERT INTO requests (request_id, fingerprint, answer, created_at) "
                "VALUES (?,?,?,?) ON CONFLICT (request_id) DO UPDATE SET "
                "fingerprint=excluded.fingerprint, answer=excluded.answer, "
                "created_at=excluded.created_at",
                [
                    (rid, fp, _answer_text(ans, encoded), at)
                    for rid, fp, ans, at in batch.requests
                ],
            )
        if batch.prune is not None and self.sharing:
            self._prune_by_time(db, batch)
        elif batch.prune is not None:
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




def broken(conn: Any) -> bool:
    """Whether a reader's connection can no longer be used (PostgreSQL: the
    server restarted or ended the session); the reader then opens a new one."""
    return bool(getattr(conn, "broken", False))
