"""Costs as runs pile up: new-run cost, restart time, memory and filtered listing.

For each id order (``--ids random,sorted``: UUID-like ids, or ids that sort in
creation order), on a fresh SQLite file at durability FULL:

1. **Fill** through the writer in process (no gRPC, so the figure is the
   server's own cost): ``--submitters`` concurrent tasks create runs, each an
   Acquire then a Finish (a terminal run, as finished work piles up), up to
   ``--runs`` in all. At every checkpoint (``--checkpoints``, default 10k,
   100k, 300k and 1M) the next ``--slice`` runs (default 50,000) are timed:
   wall µs per new run, and the CPU µs the process spent per run (all its
   threads; steadier than wall time where the hypervisor steals time, which
   is reported beside it). Slices of 10,000 runs (about a second) swung 2-4 times
   from run to run with the writer's periodic work (copying runs into the
   runs table, pruning, checkpoints); 50,000 average over it.
   The ratio of the last checkpoint to the first is the growth. Full garbage
   collections follow the schedule ``fencepost serve`` gives them (upkeep/gcpolicy.py).
2. **Live work**: ``--live`` more runs are acquired and left running.
   Then ``--rounds`` interleaved rounds (default 3; 0: none), each a slice
   on the big store (its writer still the fill's) and, right after, the
   first checkpoint's slice on a fresh small store (filled to that
   checkpoint first, then timed the same way). The ratio of the two medians
   is the growth measured side by side: the first and last checkpoints are a
   minute apart, and this machine's speed drifts by 20-30 % over a minute
   (the same slice on a fresh store took 30-43 µs per run in runs of one
   day), which a single pair of slices takes for growth, or hides.
3. **Restart**: a real ``fencepost serve`` on that file, ``--restarts`` times
   (default 3; the median is reported): the time from spawn to gRPC health
   SERVING, and its RSS then. The server's modules are compiled first, as an
   installed package has them. Each round is two starts: one after a clean
   stop (SIGTERM: the finished runs' index entries were saved, and are read
   back), then one after a crash (a block of new runs copied into the runs
   table, one more write, then kill -9: the saved entries are read, and the
   changed block gathered again), then one after a crash with no entries
   saved (they are deleted first, as if every run had been written since the
   last clean stop: every id is gathered from the table). One start before
   them is not measured (a reused file's schema may need upgrading).
4. **Listing**: ListRuns filtered to RUNNING (the live runs, among all) and the
   first unfiltered page of 100, medians of 5 calls each.

With ``--store postgres`` the same is done on the PostgreSQL store: a
throwaway cluster (``fencepost_devtools.pgcluster``, fsync on) with a database
per id order, filled through the same writer over ``PostgresStorage``, and
``fencepost serve --db postgresql://...`` restarted on it. The PostgreSQL
server's CPU is not in the fill's CPU figure (it is another process). A
coordinator on PostgreSQL holds a leader lease (``--leader-lease``, default
5 s): after a clean stop it resigns and the next start leads at once; after a
kill -9 the next start, on the same address and machine, finds the killed
process gone and takes over without waiting for that lease (a standby
elsewhere would wait for it).

Every process started is stopped; the temp directory is removed. With
``--keep DIR`` (SQLite only) the filled files stay in DIR
(``random-1000000-1000.db`` and its fill figures beside it) and a later run
with the same sizes reuses them, skipping the fill: restart and listing can
be measured again in a minute.

    .venv/bin/python bench/scale.py [--runs 1000000] [--ids random,sorted] [--live 1000]
                                    [--store sqlite|postgres] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psutil
from benchlib import BIN, REPO, free_port, machine, median, start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencepost.v1 import ledger_pb2, ledger_pb2_grpc, record_pb2
from fencepost_server.clock import SystemClock
from fencepost_server.core.ledger import Acquire, Finish
from fencepost_server.core.records import Record, Status
from fencepost_server.storage import Durability, SqliteStorage
from fencepost_server.storage.postgres import SCHEMA
from fencepost_server.storage.sql import BLOCK_RUNS
from fencepost_server.upkeep.gcpolicy import FullCollections
from fencepost_server.writer import Writer

# where a filled store lives: a SQLite file, or a PostgreSQL database's URL
Store = Path | str


def _ids(order: str) -> Any:
    n = 0  # sorted ids of one store follow one another: one generator per store
    while True:
        n += 1
        yield uuid.uuid4().hex if order == "random" else f"run-{n:010d}"


def _storage(store: Store) -> Any:
    if isinstance(store, str):
        from fencepost_server.storage.postgres import PostgresStorage

        return PostgresStorage(store)
    return SqliteStorage(store, Durability.FULL)


def _store_mib(store: Store) -> float:
    """The file's size, or the database's."""
    if isinstance(store, str):
        import psycopg

        with psycopg.connect(store) as conn:
            row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
        assert row is not None
        return round(row[0] / 2**20, 1)
    return round(store.stat().st_size / 2**20, 1)


class _Filler:
    """Creates terminal runs through a writer: ``submitters`` concurrent tasks,
    each an Acquire then a Finish per run."""

    def __init__(self, writer: Writer, order: str, submitters: int) -> None:
        self.writer = writer
        self.ids = _ids(order)
        self.submitters = submitters
        self.made = 0

    async def _one(self, owner: str) -> None:
        run_id = next(self.ids)
        rec = await self.writer.submit(Acquire(run_id, owner, ttl_ms=60_000))
        assert isinstance(rec, Record)
        await self.writer.submit(Finish(run_id, owner, rec.fencing_token, Status.COMPLETED))
        self.made += 1

    async def make(self, count: int) -> tuple[float, float, float]:
        """Create ``count`` terminal runs: seconds taken, CPU seconds this
        process used meanwhile (every thread), and the cores the hypervisor
        gave to other machines meanwhile (steal)."""
        target = self.made + count
        t0, c0, s0 = time.perf_counter(), time.process_time(), _steal()

        async def loop(k: int) -> None:
            while self.made < target:
                await self._one(f"w{k}")

        await asyncio.gather(*(loop(k) for k in range(self.submitters)))
        took = time.perf_counter() - t0
        return took, time.process_time() - c0, (_steal() - s0) / took

    async def timed_slice(self, at_runs: int, size: int, label: str) -> dict[str, Any]:
        took, cpu, steal = await self.make(size)
        us, cpu_us = took / size * 1e6, cpu / size * 1e6
        print(f"  {label:<6} at {at_runs:>9,} runs: {us:7.1f} us per new run, {cpu_us:6.1f} us "
              f"of CPU (steal {steal:.2f} cores)", flush=True)
        return {"at_runs": at_runs, "us_per_run": round(us, 1),
                "cpu_us_per_run": round(cpu_us, 1), "steal_cores": round(steal, 2)}


@contextlib.asynccontextmanager
async def _filling(store: Store, order: str, args: argparse.Namespace) -> Any:
    """A ``_Filler`` on a writer over ``store``, with the full-collection
    schedule `fencepost serve` runs with; both stopped on the way out."""
    writer = Writer(_storage(store), SystemClock(), commit_delay_ms=8)
    await writer.start()
    collections = FullCollections()
    try:
        async with asyncio.TaskGroup() as tasks:
            collections.start(tasks)
            try:
                yield _Filler(writer, order, args.submitters)
            finally:
                await collections.stop()
    finally:
        await writer.close()


async def _fill(store: Store, order: str, args: argparse.Namespace,
                small_store: Callable[[int], Store]) -> dict[str, Any]:
    slices: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    async with _filling(store, order, args) as filler:
        for cp in sorted(args.checkpoints):
            if cp > args.runs:
                break
            if filler.made < cp:
                await filler.make(cp - filler.made)
            slices.append(await filler.timed_slice(cp, args.slice, order))
        if filler.made < args.runs:
            await filler.make(args.runs - filler.made)
        for k in range(args.live):
            await filler.writer.submit(
                Acquire(f"live-{k:06d}", f"live-w{k % 16}", ttl_ms=3_600_000))
        first = min(args.checkpoints)
        for r in range(args.rounds if slices else 0):
            big = await filler.timed_slice(filler.made + args.live, args.slice, f"{order}*")
            async with _filling(small_store(r), order, args) as small:
                await small.make(first)
                rounds.append({"big": big, "small": await small.timed_slice(
                    first, args.slice, f"{order}'")})
    return {"slices": slices, "rounds": rounds, "runs": filler.made + args.live}


def _side_by_side(rounds: list[dict[str, Any]], key: str) -> float:
    """The interleaved rounds' growth: the big store's median slice over the
    small store's."""
    return round(median([r["big"][key] for r in rounds])
                 / median([r["small"][key] for r in rounds]), 3)


def _steal() -> float:
    """CPU seconds the hypervisor has given to others (0 on bare metal)."""
    return float(getattr(psutil.cpu_times(), "steal", 0.0))


def _compile() -> None:
    """Compile the server's and the SDK's modules first, as an installed
    package has them (pip compiles at install time): a checkout run with
    PYTHONDONTWRITEBYTECODE set would otherwise compile every module at every
    start, half a second that no deployment pays."""
    for package in (REPO / "server", REPO / "clients" / "python"):
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True,
                       stdout=subprocess.DEVNULL)


def _restart(store: Store, workdir: Path, order: str, port: int, then_crash: bool
             ) -> dict[str, Any]:
    """Start a server on ``store``, listening on ``port`` (the same one every
    time, as a supervisor restarts a coordinator), and measure it; then stop
    it with SIGTERM, or (``then_crash``) make one write and kill -9 it."""
    t0 = time.perf_counter()
    srv = start_server(f"fencepost-{order}", [
        str(BIN / "fencepost"), "serve", "--listen", f"127.0.0.1:{port}", "--db", str(store),
        "--metrics-port", "0",
    ], workdir / f"serve-{order}.log")
    try:
        address = f"127.0.0.1:{port}"
        # Until the server listens, every connection attempt is refused, and a
        # channel waits out gRPC's reconnect backoff (1 s, then 1.6 s...) before
        # the next: the figure would be that backoff, not the server's start.
        # Retry every 10 ms instead (a readiness probe connects afresh each time).
        retry = [(f"grpc.{k}_reconnect_backoff_ms", 10) for k in ("initial", "min", "max")]
        with grpc.insecure_channel(address, options=retry) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                if srv.proc.poll() is not None:
                    raise RuntimeError(f"server exited:\n{srv.log_tail()}")
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.01)
            serving_s = time.perf_counter() - t0
            rss = psutil.Process(srv.proc.pid).memory_info().rss
            # PostgreSQL: how long its load took, of the wait (the rest is the
            # leader lease it waited for, and the process's own start)
            took = re.search(r"taking over \(epoch \d+\): loaded revision \d+, \d+ runs in "
                             r"([\d.]+) s", srv.log_path.read_text(errors="replace"))
            stub = ledger_pb2_grpc.LedgerStub(ch)

            def timed(req: ledger_pb2.ListRunsRequest) -> tuple[float, int]:
                times, got = [], 0
                for _ in range(5):
                    t = time.perf_counter()
                    got = len(stub.ListRuns(req, timeout=60).runs)
                    times.append(time.perf_counter() - t)
                return median(times), got

            running, n_running = timed(ledger_pb2.ListRunsRequest(
                statuses=[record_pb2.RUN_STATUS_RUNNING], page_size=1000))
            first, n_first = timed(ledger_pb2.ListRunsRequest(page_size=100))
            if then_crash:
                # a block of runs created and finished, copied into the runs
                # table (a later batch does, about a second after), then one
                # more write that only the change log holds, and kill -9
                for _ in range(BLOCK_RUNS):
                    run = stub.Acquire(ledger_pb2.AcquireRequest(
                        run_id=f"crash-{uuid.uuid4().hex}", owner="scale"), timeout=60).run
                    stub.Finish(ledger_pb2.FinishRequest(
                        run_id=run.run_id, owner="scale", fencing_token=run.fencing_token,
                        status=record_pb2.RUN_STATUS_COMPLETED), timeout=60)
                time.sleep(1.5)
                stub.Acquire(ledger_pb2.AcquireRequest(run_id=f"crash-{uuid.uuid4().hex}",
                                                       owner="scale"),
                             timeout=60)
                srv.proc.kill()
    finally:
        srv.stop()
    return {
        "serving_s": round(serving_s, 3), "rss_mib": round(rss / 2**20, 1),
        "load_s": float(took.group(1)) if took else None,
        "list_running_ms": round(running * 1000, 2), "list_running_count": n_running,
        "list_first_page_ms": round(first * 1000, 2), "list_first_page_count": n_first,
    }


def _forget_saved_index(store: Store) -> None:
    """Drop the finished runs' index entries a clean stop saved, as if every
    run had been written since the last one (the next start gathers them all)."""
    if isinstance(store, Path):
        with contextlib.closing(sqlite3.connect(store)) as db:
            db.execute("DELETE FROM saved_index")
            db.commit()
        return
    import psycopg

    with psycopg.connect(store, autocommit=True) as db:
        db.execute(f"DELETE FROM {SCHEMA}.saved_index")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/scale.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1_000_000, help="terminal runs to fill")
    p.add_argument("--ids", default="random,sorted", help="id orders to measure")
    p.add_argument("--live", type=int, default=1000, help="running runs among them")
    p.add_argument("--slice", type=int, default=50_000, help="runs timed per checkpoint")
    p.add_argument("--checkpoints", type=lambda s: [int(x) for x in s.split(",")],
                   default=[10_000, 100_000, 300_000, 1_000_000])
    p.add_argument("--submitters", type=int, default=256)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "scale.json")
    p.add_argument("--restarts", type=int, default=3,
                   help="restarts on each file (the median is reported)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep the filled files in DIR, and reuse those already there")
    p.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite",
                   help="the store measured (postgres: a throwaway cluster)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds after the fill: a slice on the big store, then "
                        "the first checkpoint's slice on a fresh store (0: none)")
    args = p.parse_args(argv)
    if args.restarts < 1:
        p.error("--restarts must be at least 1")
    if args.rounds < 0:
        p.error("--rounds must be 0 or more")
    if args.keep is not None and args.store == "postgres":
        p.error("--keep keeps SQLite files only")
    workdir = Path(tempfile.mkdtemp(prefix="fencepost-scale-"))
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                 capture_output=True, text=True).stdout.strip(),
        "machine": machine(), "config": {k: str(v) for k, v in vars(args).items()},
        "orders": {},
    }
    print(f"bench/scale: {args.runs:,} terminal runs + {args.live:,} live, ids "
          f"{args.ids}, {args.store} store", flush=True)
    _compile()
    cluster = None
    try:
        if args.store == "postgres":
            from fencepost_devtools import pgcluster

            cluster = pgcluster.Cluster.start()  # a private directory it can reach
        for order in args.ids.split(","):
            name = f"{order}-{args.runs}-{args.live}"
            path = (args.keep or workdir) / f"{name}.db"
            kept = path.with_suffix(".fill.json")
            store: Store = path
            if cluster is not None:
                store = cluster.create_database(name.replace("-", "_"))
            if args.keep is not None and path.exists() and kept.exists():
                fill = json.loads(kept.read_text())
                fill["reused"] = str(path)
                print(f"  {order:<6} reusing {path} (filled {fill['filled_at']})", flush=True)
            else:
                path.unlink(missing_ok=True)

                def small_store(r: int, name: str = name) -> Store:
                    if cluster is not None:
                        return cluster.create_database(f"{name.replace('-', '_')}_small_{r}")
                    return workdir / f"{name}-small-{r}.db"

                t0 = time.perf_counter()
                fill = asyncio.run(_fill(store, order, args, small_store))
                fill["fill_s"] = round(time.perf_counter() - t0, 1)
                fill["filled_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
                if args.keep is not None:
                    kept.write_text(json.dumps(fill, indent=2) + "\n")
            slices = fill["slices"]
            if len(slices) >= 2:
                fill["growth"] = round(slices[-1]["us_per_run"] / slices[0]["us_per_run"], 3)
                if "cpu_us_per_run" in slices[0]:
                    fill["cpu_growth"] = round(
                        slices[-1]["cpu_us_per_run"] / slices[0]["cpu_us_per_run"], 3)
            if fill.get("rounds"):
                fill["growth_side_by_side"] = _side_by_side(fill["rounds"], "us_per_run")
                fill["cpu_growth_side_by_side"] = _side_by_side(fill["rounds"], "cpu_us_per_run")
            # unmeasured: brings a reused file's schema up to date and saves its index
            port = free_port()
            _restart(store, workdir, order, port, then_crash=False)
            # starts after a clean stop; after a crash (the index saved at the
            # clean stop before, and the blocks changed since); after a crash
            # with no index saved (every id gathered from the table)
            restarts, crashes, unsaved = [], [], []
            for _ in range(args.restarts):
                restarts.append(_restart(store, workdir, order, port, then_crash=True))
                crashes.append(_restart(store, workdir, order, port, then_crash=True))
                _forget_saved_index(store)
                unsaved.append(_restart(store, workdir, order, port, then_crash=False))
            restarts.sort(key=lambda r: r["serving_s"])
            fill.update(restarts[len(restarts) // 2])  # the median start
            fill["serving_s_all"] = [r["serving_s"] for r in restarts]
            fill["after_crash_serving_s"] = median([r["serving_s"] for r in crashes])
            fill["after_crash_serving_s_all"] = [r["serving_s"] for r in crashes]
            fill["unsaved_serving_s"] = median([r["serving_s"] for r in unsaved])
            fill["unsaved_serving_s_all"] = [r["serving_s"] for r in unsaved]
            fill["unsaved_rss_mib"] = median([r["rss_mib"] for r in unsaved])
            if restarts[0]["load_s"] is not None:
                fill["load_s_all"] = [r["load_s"] for r in restarts]
                fill["after_crash_load_s_all"] = [r["load_s"] for r in crashes]
                fill["unsaved_load_s_all"] = [r["load_s"] for r in unsaved]
            fill["db_mib"] = _store_mib(store)
            result["orders"][order] = fill
            print(f"  {order:<6} {fill['runs']:,} runs ({fill['db_mib']} MiB, {args.store}; "
                  f"filled in {fill['fill_s']} s): new-run cost x{fill.get('growth', 0):.2f} "
                  f"(CPU x{fill.get('cpu_growth', 0):.2f}) from "
                  f"{slices[0]['at_runs']:,} to {slices[-1]['at_runs']:,} runs"
                  + (f"; side by side x{fill['growth_side_by_side']:.2f} (CPU "
                     f"x{fill['cpu_growth_side_by_side']:.2f}): the median of "
                     f"{len(fill['rounds'])} slices at {fill['rounds'][-1]['big']['at_runs']:,} "
                     f"runs over that of {len(fill['rounds'])} at "
                     f"{fill['rounds'][0]['small']['at_runs']:,}, interleaved"
                     if "growth_side_by_side" in fill else "")
                  + "; restart to "
                  f"SERVING {fill['serving_s']:.2f} s (of {fill['serving_s_all']}) at "
                  f"{fill['rss_mib']} MiB RSS, after a crash "
                  f"{fill['after_crash_serving_s']:.2f} s (of "
                  f"{fill['after_crash_serving_s_all']}), after a crash with no index "
                  f"saved {fill['unsaved_serving_s']:.2f} s (of {fill['unsaved_serving_s_all']}"
                  + (f"; the state loaded in {fill['load_s_all']} s, after a crash in "
                     f"{fill['after_crash_load_s_all']} s, with no index saved in "
                     f"{fill['unsaved_load_s_all']} s" if "load_s_all" in fill else "")
                  + "); ListRuns "
                  f"RUNNING ({fill['list_running_count']}) {fill['list_running_ms']} ms, "
                  f"first page {fill['list_first_page_ms']} ms", flush=True)
            if args.keep is None:
                path.unlink(missing_ok=True)
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  results in {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
