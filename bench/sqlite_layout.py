"""What a new run costs SQLite as runs pile up, for three layouts of the runs table.

Bare SQLite, no server: each run is one row with a random (UUID-like) id and
a ~300-byte record, inserted by one commit and updated to finished by the
next (as an Acquire and a Finish would be), 128 runs per commit, WAL mode,
``synchronous=FULL``, a passive checkpoint every 2,000 runs. At 10,000,
100,000, 300,000 and 1,000,000 runs it times 20,000 more.

- ``without-rowid``: the server's layout before ``block``, a ``WITHOUT
  ROWID`` table keyed by the run id, so every row lives in the key's B-tree,
  at a random place;
- ``rowid``: a rowid table (rows appended in creation order) with a unique
  index on the run id (small entries, still at random places);
- ``block``: the server's layout: a ``WITHOUT ROWID`` table keyed by (block,
  run id), the block counting up by one every ``BLOCK_RUNS`` new runs (the
  server's constant), so a new row goes among the last pages; a run's block
  is found through a dict in memory, and the status index is ordered by
  block within each (status, owner).

The first two keep an index on (status, owner), as the server did with them.

    .venv/bin/python bench/sqlite_layout.py --layout block
    .venv/bin/python bench/sqlite_layout.py --layout without-rowid
    .venv/bin/python bench/sqlite_layout.py --layout rowid [--cache-kib 65536]

About 3 minutes per layout on the benchmark machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path

from fencepost_server.storage.sql import BLOCK_RUNS

MARKS = (10_000, 100_000, 300_000, 1_000_000)
PER_COMMIT = 128
MEASURED = 20_000
CHECKPOINT_EVERY = 2_000

_SCHEMAS = {
    "without-rowid": """CREATE TABLE runs (
        run_id TEXT PRIMARY KEY, version INTEGER, status INTEGER, fencing_token INTEGER,
        owner TEXT, revision INTEGER, record TEXT) WITHOUT ROWID""",
    "rowid": """CREATE TABLE runs (
        run_id TEXT NOT NULL UNIQUE, version INTEGER, status INTEGER, fencing_token INTEGER,
        owner TEXT, revision INTEGER, record TEXT)""",
    "block": """CREATE TABLE runs (
        block INTEGER NOT NULL, run_id TEXT NOT NULL, version INTEGER, status INTEGER,
        fencing_token INTEGER, owner TEXT, revision INTEGER, record TEXT,
        PRIMARY KEY (block, run_id)) WITHOUT ROWID""",
}
_STATUS_INDEX = {
    "without-rowid": "(status, owner)",
    "rowid": "(status, owner)",
    "block": "(status, owner, block)",
}
_UPSERT = (
    "INSERT INTO runs VALUES (?, 1, ?, 1, ?, 1, ?) ON CONFLICT(run_id) DO UPDATE SET "
    "status = excluded.status, owner = excluded.owner, record = excluded.record"
)
_UPSERT_BLOCK = (
    "INSERT INTO runs VALUES (?, ?, 1, ?, 1, ?, 1, ?) ON CONFLICT(block, run_id) DO UPDATE SET "
    "status = excluded.status, owner = excluded.owner, record = excluded.record"
)


def run(layout: str, cache_kib: int, directory: Path) -> list[tuple[int, float]]:
    db = sqlite3.connect(directory / "runs.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(f"PRAGMA cache_size=-{cache_kib}")
    db.execute(_SCHEMAS[layout])
    db.execute(f"CREATE INDEX runs_by_status ON runs {_STATUS_INDEX[layout]}")
    record = json.dumps({"pad": "x" * 250})
    done = 0
    rows: dict[str, int] = {}  # block: run id -> its block

    def params(ids: list[str], status: int, owner: str | None) -> list[tuple[object, ...]]:
        if layout != "block":
            return [(i, status, owner, record) for i in ids]
        for i in ids:
            rows.setdefault(i, len(rows) // BLOCK_RUNS)
        return [(rows[i], i, status, owner, record) for i in ids]

    def runs(n: int) -> None:
        nonlocal done
        upsert = _UPSERT_BLOCK if layout == "block" else _UPSERT
        for _ in range(n // PER_COMMIT):
            ids = [os.urandom(16).hex() for _ in range(PER_COMMIT)]
            for status, owner in ((1, "worker"), (4, None)):  # acquired, then finished
                db.execute("BEGIN")
                db.executemany(upsert, params(ids, status, owner))
                db.execute("COMMIT")
            done += PER_COMMIT
            if done % CHECKPOINT_EVERY < PER_COMMIT:
                db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    out = []
    for mark in MARKS:
        runs(max(0, mark - done))
        started = time.perf_counter()
        runs(MEASURED)
        out.append((mark, (time.perf_counter() - started) / MEASURED * 1e6))
        print(f"{layout:14} {mark:>9,} runs: {out[-1][1]:6.1f} µs per new run", flush=True)
    db.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=sorted(_SCHEMAS), default="block")
    p.add_argument("--cache-kib", type=int, default=2000, help="SQLite page cache (default 2000)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fencepost-layout-") as d:
        res = run(args.layout, args.cache_kib, Path(d))
    print(f"{args.layout}: 1M / 10k = {res[-1][1] / res[0][1]:.2f}x")


if __name__ == "__main__":
    main()
