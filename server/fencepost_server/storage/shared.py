"""A PostgreSQL database whose shards several coordinators lead at once
(``fencepost serve --lead-shards``; ha/DESIGN.md says why each piece is so).

What changes against one leader, for the writer of one coordinator:

- **The check before COMMIT.** Each batch locks the rows of the shards its
  commands touched ``FOR KEY SHARE`` and commits only if each still holds
  the epoch this coordinator took it under. A coordinator taking a shard
  locks its row ``FOR UPDATE`` before it bumps the epoch, so a batch of the
  old owner either commits first (and the new owner loads it) or finds the
  epoch moved and commits nothing. Checked last, the lock is held only for
  the COMMIT.
- **Revisions in blocks** from a sequence: unique across coordinators, and
  increasing within each shard, because a coordinator takes a new block
  after it takes a shard. No row every batch updates, so the coordinators'
  commits do not queue behind one another.
- **No lag of the runs table**: each batch writes its changed runs' rows, so
  a coordinator taking a shard reads that shard's rows and replays nothing.
- **Lease floors per shard**, in the shard rows: a shard taken from a
  coordinator that may have renewed leases from memory has every lease
  stored as live past its floor treated as renewed at the take.

A database becomes led this way once (``convert``): the first such
coordinator copies whatever the last single leader left in the change log
into the runs table, and closes the leader row to single leaders for good.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import Code, LedgerError
from ..core.records import Record
from .sql import COLD_STATUSES, HOT_STATUSES, LEASES_EXACT, SqlStorage

log = logging.getLogger("fencepost.storage")

# Revisions per block (a block number times this is its first revision): a
# batch takes a new block when fewer than BLOCK_SLACK are left in its own.
BLOCK = 1 << 24
BLOCK_SLACK = 1 << 22
# the leader row's holder once the database is led by shards: no single
# leader can take it over (its lease never runs out)
SHARDS_HOLDER = "(shards led by --lead-shards coordinators)"
NEVER = 1 << 62
_CONVERT_LOCK = 0x66656E64  # pg_advisory_lock key: one coordinator converts


class ShardsMoved(LedgerError):
    """A batch touched shards whose epoch moved: nothing was done; the
    client retries (its command goes to the shard's new owner)."""

    def __init__(self, moved: list[int]) -> None:
        shown = ", ".join(map(str, moved))
        super().__init__(
            Code.STORAGE_UNAVAILABLE,
            f"shards {shown} moved to another coordinator during this batch; nothing was "
            "done: retry",
            metadata={"moved": ",".join(map(str, moved))},
        )
        self.moved = moved


@dataclass
class Sharing:
    """The shards this coordinator's writer holds, and its revision block.
    ``epochs`` is replaced whole by the loop and read by the writer thread."""

    epochs: dict[int, int] = field(default_factory=dict)
    touched: set[int] = field(default_factory=set)  # this batch's shards
    block_start: int = 0  # the block's first revision (0: none taken yet)
    limit: int = 0  # the block's end
    new_block: bool = True  # a shard was taken since the block was

    def first_revision(self, db: Any, current: int) -> int:
        """The revision a batch counts up from: ``current`` (never below the
        block's start), or the start of a new block when a shard was taken
        since or the block runs low. A batch that fails leaves the new block
        taken: nothing ever counts from the older one again."""
        start = max(current, self.block_start)
        if self.new_block or self.limit - start < BLOCK_SLACK:
            block = _value(db.execute("SELECT nextval('fencepost_revision_blocks')"))
            self.block_start = start = block * BLOCK
            self.limit = start + BLOCK
            self.new_block = False
        return start

    def check(self, db: Any) -> None:
        """Raise ShardsMoved unless every shard this batch touched still holds
        this coordinator's epoch; the rows stay locked to COMMIT."""
        touched, epochs = sorted(self.touched), self.epochs
        self.touched = set()
        if not touched:
            return
        rows = dict(db.execute(
            "SELECT shard, epoch FROM fencepost_shards WHERE shard = ANY(?) ORDER BY shard "
            "FOR KEY SHARE", (touched,)).fetchall())
        moved = [s for s in touched if s not in epochs or rows.get(s) != epochs[s]]
        if moved:
            raise ShardsMoved(moved)


def convert(storage: SqlStorage) -> None:
    """Make the database one whose shards are led apart, once: refused while
    a single leader leads it; the change log's tail copied into the runs
    table; the leader row closed to single leaders; each shard's lease floor
    the one the last leader stored. Coordinators starting together convert
    once (an advisory lock)."""
    db = storage.db
    db.execute("SELECT pg_advisory_lock(?)", (_CONVERT_LOCK,))
    try:
        if _lead_shards(db):
            return
        db.execute("BEGIN")
        try:
            row = db.execute(
                "SELECT holder, address, expires_at, (extract(epoch FROM clock_timestamp()) "
                "* 1000)::bigint FROM fencepost_leader WHERE id = 1 FOR UPDATE").fetchone()
            holder, address, expires_at, now = row
            if holder and expires_at > now:
                raise RuntimeError(
                    f"{storage.path} is led by one coordinator ({holder} at {address}); stop it "
                    "(SIGTERM) before starting coordinators with --lead-shards")
            # its epoch moves: a paused single leader commits nothing from now on
            db.execute("UPDATE fencepost_leader SET epoch = epoch + 1, holder = ?, address = '', "
                       "expires_at = ? WHERE id = 1", (SHARDS_HOLDER, NEVER))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        loaded = storage.load()  # replays and copies the tail the last leader left
        # (outside the transaction: a large table is indexed once, before serving)
        db.execute("CREATE INDEX IF NOT EXISTS runs_by_shard ON runs "
                   f"({_shard_of('run_id', storage.shards)})")
        db.execute("BEGIN")
        try:
            floor = storage.lease_floor()
            db.execute("UPDATE fencepost_shards SET lease_floor = ?", (floor,))
            # what the last leader pruned, it pruned from every shard
            db.execute("INSERT INTO changes_pruned SELECT shard, ? FROM fencepost_shards "
                       "ON CONFLICT (shard) DO NOTHING",
                       (storage._compacted(db, loaded.revision),))
            db.execute("SELECT setval('fencepost_revision_blocks', ?)",
                       (loaded.revision // BLOCK + 1,))
            db.execute("UPDATE meta SET value = 1 WHERE key = 'lead_shards'")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        log.info("%s: now led by shards (revision %d, %d runs held by the last leader)",
                 storage.path, loaded.revision, len(loaded.runs))
    finally:
        db.execute("SELECT pg_advisory_unlock(?)", (_CONVERT_LOCK,))


def _lead_shards(db: Any) -> bool:
    return bool(_value(db.execute("SELECT value FROM meta WHERE key = 'lead_shards'")))


def _value(cur: Any) -> Any:
    row = cur.fetchone()
    if row is None:
        raise RuntimeError("the fencepost schema is damaged (a row it keeps is missing)")
    return row[0]


def refuse_single_leader(db: Any, where: str) -> None:
    """A coordinator that would lead alone refuses a database led by shards."""
    if _lead_shards(db):
        raise RuntimeError(
            f"{where} is led by shards (coordinators started with --lead-shards); start this "
            "coordinator with --lead-shards too")


@dataclass
class LoadedShards:
    """What a coordinator taking shards reads: their unfinished runs, the
    finished ones' index entries (status, owner, ids), their tombstones, and
    each shard's lease floor."""

    runs: dict[str, Record] = field(default_factory=dict)
    cold: list[tuple[int, str | None, list[str]]] = field(default_factory=list)
    tombstones: dict[str, int] = field(default_factory=dict)
    floors: dict[int, int] = field(default_factory=dict)


def load_shards(storage: SqlStorage, shards: frozenset[int]) -> LoadedShards:
    """The runs of ``shards`` as the runs table holds them; their blocks join
    the storage's ``rows``. Writer thread, between batches, after the shards
    were taken (nobody else writes them any more)."""
    db, n = storage.db, storage.shards
    out = LoadedShards()
    rows = storage.rows
    cold: dict[tuple[int, str | None], list[str]] = {}
    hot = ",".join(map(str, HOT_STATUSES))
    wanted = sorted(shards)
    for block, run_id, status, owner, text in db.execute(
        f"SELECT block, run_id, status, owner, CASE WHEN status IN ({hot}) THEN record END "
        f"FROM runs WHERE {_shard_of('run_id', n)} = ANY(?)", (wanted,)
    ):
        rows[run_id] = block
        if text is not None:
            out.runs[run_id] = storage._readable(text, f"the stored record of run {run_id!r}")
        elif status in COLD_STATUSES:
            cold.setdefault((int(status), owner), []).append(run_id)
    out.cold = [(st, owner, sorted(ids)) for (st, owner), ids in cold.items()]
    out.tombstones = dict(db.execute(
        f"SELECT run_id, fencing_token FROM tombstones WHERE {_shard_of('run_id', n)} = ANY(?)",
        (wanted,)).fetchall())
    out.floors = dict(db.execute(
        "SELECT shard, lease_floor FROM fencepost_shards WHERE shard = ANY(?)",
        (sorted(shards),)).fetchall())
    return out


def _shard_of(column: str, shards: int) -> str:
    """The shard of ``column`` in SQL, as the index ``runs_by_shard`` has it
    (the count a literal: the index is for this database's count alone)."""
    return f"fencepost_shard({column}, {int(shards)})"


def set_floors(db: Any, epochs: dict[int, int], floor: int) -> None:
    """Store ``floor`` as the lease floor of the shards of ``epochs`` that
    still hold those epochs (inside a batch): never a shard taken since."""
    shards = sorted(epochs)
    if shards:
        db.execute(
            "UPDATE fencepost_shards SET lease_floor = ? FROM unnest(?::integer[], "
            "?::bigint[]) AS h (shard, epoch) WHERE fencepost_shards.shard = h.shard AND "
            "fencepost_shards.epoch = h.epoch", (floor, shards, [epochs[s] for s in shards]))


def exact(floor: int) -> bool:
    return floor == LEASES_EXACT
