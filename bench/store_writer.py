"""The writer alone on each store: SQLite against PostgreSQL, in process.

The same load as bench/writer_alone.py — ``--submitters`` asyncio tasks (default
256) each looping ``Acquire -> Renew x3 -> RecordCheckpoint -> Finish`` on fresh
runs through ``Writer.submit``, awaited until durable, no gRPC — but every
command carries a time-ordered request id, as the SDK's do (so each batch also
stores its answers), and the store is, in turn:

* ``sqlite``: a fresh file, ``synchronous=FULL``;
* ``postgresql``: a fresh database on a throwaway PostgreSQL
  (``fencepost_devtools.pgcluster``: ``fsync=on``, ``synchronous_commit=on``),
  with the leader's epoch checked in every batch, as a leading coordinator does.

Rounds alternate the order; the figures are medians. Per store it prints
durable commands/s, the mean batch, and the CPU of this process per command
(PostgreSQL's own CPU is not in it: the server's backend processes are
measured apart, as ``pg CPU``). Results go to bench/results/store_writer.json.

    .venv/bin/python bench/store_writer.py [--rounds 3] [--duration 5] [--submitters 256]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib import REPO, fmt_rate, machine, median
from peers.servers import cpu_delta, tree_cpu

from fencepost._ids import new_request_id
from fencepost_devtools.pgcluster import Cluster
from fencepost_server.clock import SystemClock
from fencepost_server.core.errors import LedgerError
from fencepost_server.core.ledger import Acquire, Finish, RecordCheckpoint, Renew
from fencepost_server.core.records import Record, Status
from fencepost_server.ha.leadership import Leadership
from fencepost_server.storage import Durability, SqliteStorage
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.storage.sql import SqlStorage
from fencepost_server.writer import Writer

STORES = ("sqlite", "postgresql")


@dataclass
class StoreRun:
    store: str
    round: int
    commands_per_s: float
    mean_batch: float
    cpu_us_per_command: float  # this process, all threads
    pg_cpu_us_per_command: float  # PostgreSQL's processes (0 for SQLite)
    refused: int


async def _submitter(writer: Writer, prefix: str, stop: list[bool], refused: list[int]) -> None:
    i = 0
    while not stop[0]:
        run_id = f"{prefix}-{i:07d}"
        i += 1
        try:
            rec = await writer.submit(Acquire(run_id, prefix, request_id=new_request_id()))
            assert isinstance(rec, Record)
            t = rec.fencing_token
            for _ in range(3):
                await writer.submit(Renew(run_id, prefix, t, request_id=new_request_id()))
            await writer.submit(RecordCheckpoint(run_id, prefix, t, f"ckpt/{run_id}", 1,
                                                 request_id=new_request_id()))
            await writer.submit(Finish(run_id, prefix, t, Status.COMPLETED,
                                       request_id=new_request_id()))
        except LedgerError:
            refused[0] += 1


async def _lead(url: str) -> int:
    """Win the leader row of a fresh database, as a coordinator does: its epoch."""
    ld = Leadership(url, SystemClock(), address="127.0.0.1:0", max_skew_ms=0)
    try:
        takeover = await ld.campaign()
        return takeover.epoch
    finally:
        await ld.close()


async def measure(storage: SqlStorage, store: str, rnd: int, args: argparse.Namespace,
                  pg: Cluster | None) -> StoreRun:
    writer = Writer(storage, SystemClock(), max_batch=1024, commit_delay_ms=8)
    await writer.start()
    stop, refused = [False], [0]
    try:
        tasks = [asyncio.create_task(_submitter(writer, f"{store}-r{rnd}-s{i:03d}", stop,
                                                refused))
                 for i in range(args.submitters)]
        await asyncio.sleep(args.warmup)
        pg0 = tree_cpu(pg.pid or 0) if pg is not None else {}
        c0, b0, t0, cpu0 = (writer.stats.commands, writer.stats.batches, time.monotonic(),
                            time.process_time())
        await asyncio.sleep(args.duration)
        c1, b1, t1, cpu1 = (writer.stats.commands, writer.stats.batches, time.monotonic(),
                            time.process_time())
        pg1 = tree_cpu(pg.pid or 0) if pg is not None else {}
        stop[0] = True
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        stop[0] = True
        await writer.close()
    n, b = c1 - c0, b1 - b0
    return StoreRun(store, rnd, n / (t1 - t0), n / b if b else 0.0,
                    (cpu1 - cpu0) / n * 1e6 if n else 0.0,
                    cpu_delta(pg0, pg1) / n * 1e6 if n else 0.0, refused[0])


async def amain(args: argparse.Namespace, workdir: Path) -> list[StoreRun]:
    runs: list[StoreRun] = []
    with Cluster.start(workdir / "pg") as pg:
        for rnd in range(args.rounds):
            order = list(STORES) if rnd % 2 == 0 else list(reversed(STORES))
            for store in order:
                storage: SqlStorage
                if store == "sqlite":
                    storage = SqliteStorage(workdir / f"r{rnd}.db", Durability.FULL)
                else:
                    url = pg.create_database(f"r{rnd}")
                    pstorage = PostgresStorage(url)
                    await asyncio.to_thread(pstorage.open)  # the schema and the leader row
                    pstorage.close()
                    pstorage.lead(await _lead(url))
                    storage = pstorage
                run = await measure(storage, store, rnd, args, pg if store != "sqlite" else None)
                runs.append(run)
                print(f"  round {rnd}  {store:<10} {fmt_rate(run.commands_per_s):>7} durable "
                      f"commands/s  mean batch {run.mean_batch:6.1f}  CPU "
                      f"{run.cpu_us_per_command:3.0f} us/command  pg CPU "
                      f"{run.pg_cpu_us_per_command:3.0f} us/command  refused {run.refused}",
                      flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/store_writer.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--submitters", type=int, default=256)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "store_writer.json")
    args = p.parse_args(argv)
    print(f"store writer: {args.submitters} submitters with request ids, {args.rounds} rounds "
          f"of {args.warmup:g} s warm-up + {args.duration:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="fencepost-store-writer-") as tmp:
        Path(tmp).chmod(0o755)  # PostgreSQL's OS user walks through it
        runs = asyncio.run(amain(args, Path(tmp)))
    summary: dict[str, Any] = {}
    for store in STORES:
        mine = [r for r in runs if r.store == store]
        summary[store] = {
            "commands_per_s": median([r.commands_per_s for r in mine]),
            "mean_batch": median([r.mean_batch for r in mine]),
            "cpu_us_per_command": median([r.cpu_us_per_command for r in mine]),
            "pg_cpu_us_per_command": median([r.pg_cpu_us_per_command for r in mine]),
            "refused": sum(r.refused for r in mine),
        }
    ratio = (summary["postgresql"]["commands_per_s"] / summary["sqlite"]["commands_per_s"]
             if summary["sqlite"]["commands_per_s"] else 0.0)
    print("\n  medians:")
    for store, s in summary.items():
        print(f"    {store:<10} {fmt_rate(s['commands_per_s']):>7} durable commands/s  mean "
              f"batch {s['mean_batch']:.1f}  CPU {s['cpu_us_per_command']:.0f} us/command  pg "
              f"CPU {s['pg_cpu_us_per_command']:.0f} us/command", flush=True)
    print(f"    postgresql/sqlite = {ratio:.2f}", flush=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()
    out = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": head,
           "machine": machine(), "config": {k: str(v) for k, v in vars(args).items()},
           "runs": [asdict(r) for r in runs], "summary": summary, "ratio": ratio}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"  results in {args.json}", flush=True)
    return 1 if any(r.refused for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
