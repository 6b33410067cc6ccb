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

**K writers on one PostgreSQL** (``--writers K[,K2,...]``): how much durable
writer traffic one PostgreSQL takes when K coordinators commit at once. Each
K starts K writer *processes* (a coordinator is one process, bound by its
GIL), each with a database of its own in the one cluster, its own leader
epoch checked in every batch, and the same load as above (``--submitters``
tasks per process, so K=1 is the writer-alone figure and every process sees
the same load whatever K). They start together and are measured over one
window. Per K it prints the aggregate durable commands/s and commits
(batches)/s, the mean batch and commit time, the writer processes' CPU per
command and cores, PostgreSQL's CPU per command and cores, and the machine's
idle share (on a shared machine the rest is other work: ``other cores``).
Results go to bench/results/store_writers.json.

``--writers`` alone means 1, 2, ..., nproc+1, capped at 4: one writer more
than there are cores shows what oversubscription does (the writers and
PostgreSQL then fight for cores), and the cap keeps the run bounded (each K
costs rounds x (warm-up + duration) plus a second of setup). On a bigger
machine give the list to reach PostgreSQL's ceiling, e.g. ``--writers
1,2,4,8,16``.

The model printed at the end, with r1 the commands/s of one writer process
alone (K=1), w and p the writers' and PostgreSQL's CPU microseconds per
command, and C the machine's cores (``nproc``):

    predicted(N writers, C cores) = min(N x r1,  C x 1e6 / (w + p)[,  ceiling])

N x r1 is the writer bound (each process is at most as fast as alone);
C x 1e6 / (w + p) is the rate at which PostgreSQL's CPU per command fills the
cores the writers leave (writers and PostgreSQL on the same C cores; put
PostgreSQL elsewhere and it is C_pg x 1e6 / p); ``ceiling`` is PostgreSQL's
own commit ceiling, counted only when a K was held back by none of the bounds
below. Per measured K the output gives the prediction with C = the cores that
other work left (the machine may be shared) and that K's CPU per command, and
says which bound binds, from what the machine showed: the cores (idle under
10 %), a writer's one core (0.9 core or more), the load (each batch holds about
all of a process's submitters: the closed loop, not the writer, sets the
rate), else PostgreSQL's commit path. With K >= nproc the cores are full by
construction, and it says so.

    .venv/bin/python bench/store_writer.py --writers [1,2,3] [--rounds 3] [--duration 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import psutil
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


# -- K writer processes on one PostgreSQL -------------------------------------------------

READY_TIMEOUT_S = 120.0  # setup of one writer process: spawn, schema, campaign, load
STOP_TIMEOUT_S = 60.0  # after the window: submitters drain, the writer closes
CORE_FULL = 0.9  # a writer process using this much of a core is bound by it (its GIL)
IDLE_FULL = 0.10  # below this idle share the machine's cores are full
LOAD_FULL = 0.95  # a mean batch this close to the submitters: each batch takes them all


def default_writers(cpus: int) -> list[int]:
    return list(range(1, min(cpus + 1, 4) + 1))


def parse_writers(text: str) -> list[int]:
    """``--writers``: 'auto' or a comma list of positive counts."""
    if text == "auto":
        return default_writers(os.cpu_count() or 1)
    try:
        ks = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--writers: expected counts like 1,2,3, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"--writers: counts must be >= 1, got {text!r}")
    return ks


@dataclass
class WriterWindow:
    """One writer process over the common window, as it measured itself."""

    commands: int
    batches: int
    seconds: float
    cpu_s: float  # this process, all threads
    commit_s: float  # the writer's time from a batch's start to durable, summed
    refused: int


@dataclass
class FleetRun:
    writers: int
    round: int
    commands_per_s: float  # all writers together
    commits_per_s: float
    mean_batch: float
    commit_ms: float  # mean time of one batch, start to durable
    writer_cpu_us_per_command: float
    writer_cores: float  # all writer processes together
    busiest_writer_core: float  # the one using the most CPU, in cores
    alone_rate_min: float  # the slowest writer's commands/s
    pg_cpu_us_per_command: float
    pg_cores: float
    idle_share: float  # of the machine, idle and waiting on I/O
    other_cores: float  # busy cores neither the writers' nor PostgreSQL's
    refused: int


async def _writer_window(url: str, name: str, submitters: int, conn: Connection) -> None:
    storage = PostgresStorage(url)
    await asyncio.to_thread(storage.open)  # the schema and the leader row
    storage.close()
    storage.lead(await _lead(url))
    writer = Writer(storage, SystemClock(), max_batch=1024, commit_delay_ms=8)
    await writer.start()
    stop, refused = [False], [0]
    tasks: list[asyncio.Task[None]] = []
    try:
        conn.send(("ready",))
        # the parent answers within its own setup bound; a dead parent closes the pipe
        if not await asyncio.to_thread(conn.poll, READY_TIMEOUT_S * 2):
            raise TimeoutError("no start signal from the parent")
        _, t_start, t0, t1 = conn.recv()
        await asyncio.sleep(max(0.0, t_start - time.monotonic()))
        tasks = [asyncio.create_task(_submitter(writer, f"{name}-s{i:03d}", stop, refused))
                 for i in range(submitters)]
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        s0 = (writer.stats.commands, writer.stats.batches, writer.stats.commit_seconds,
              time.monotonic(), time.process_time())
        await asyncio.sleep(max(0.0, t1 - time.monotonic()))
        s1 = (writer.stats.commands, writer.stats.batches, writer.stats.commit_seconds,
              time.monotonic(), time.process_time())
        stop[0] = True
        await asyncio.wait_for(asyncio.gather(*tasks), STOP_TIMEOUT_S)
    finally:
        stop[0] = True
        for t in tasks:
            t.cancel()
        await writer.close()
    conn.send(("done", WriterWindow(s1[0] - s0[0], s1[1] - s0[1], s1[3] - s0[3],
                                    s1[4] - s0[4], s1[2] - s0[2], refused[0])))


def _writer_process(url: str, name: str, submitters: int, conn: Connection) -> None:
    """One writer process (a coordinator's writer): the entry point of each child."""
    try:
        asyncio.run(_writer_window(url, name, submitters, conn))
    except KeyboardInterrupt:
        pass
    except BaseException:
        with contextlib.suppress(OSError, ValueError):  # the parent may be gone
            conn.send(("error", traceback.format_exc()))
        raise
    finally:
        conn.close()


def _recv(conns: list[Connection], what: str, timeout: float) -> list[Any]:
    """One message from every child, or an error naming the first that failed."""
    deadline = time.monotonic() + timeout
    out: list[Any] = []
    for i, conn in enumerate(conns):
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"writer {i} sent no {what} within {timeout:g} s")
        try:
            msg = conn.recv()
        except EOFError:
            raise RuntimeError(f"writer {i} exited before {what}") from None
        if msg[0] == "error":
            raise RuntimeError(f"writer {i} failed:\n{msg[1]}")
        out.append(msg)
    return out


def _machine_times() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine; waiting on I/O counts as idle."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # already in user
    return sum(t) - guest - idle, idle


def fleet_round(pg: Cluster, k: int, rnd: int, args: argparse.Namespace) -> FleetRun:
    """K writer processes, each on its own database of ``pg``, over one window."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no copied event loop or sockets
    names = [f"k{k}r{rnd}w{i}" for i in range(k)]
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    try:
        for name in names:
            url = pg.create_database(name)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_writer_process, name=f"writer-{name}",
                               args=(url, name, args.submitters, child), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        _recv(conns, "ready", READY_TIMEOUT_S)
        t_start = time.monotonic() + 0.2
        t0 = t_start + args.warmup
        t1 = t0 + args.duration
        for conn in conns:
            conn.send(("go", t_start, t0, t1))
        time.sleep(max(0.0, t0 - time.monotonic()))
        pg0, m0, w0 = tree_cpu(pg.pid or 0), _machine_times(), time.monotonic()
        time.sleep(max(0.0, t1 - time.monotonic()))
        pg1, m1, w1 = tree_cpu(pg.pid or 0), _machine_times(), time.monotonic()
        wins: list[WriterWindow] = [msg[1] for msg in _recv(conns, "results", STOP_TIMEOUT_S
                                                            + 30)]
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:  # each stops by itself; one that did not is killed by pid
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for conn in conns:
            conn.close()
    for name in names:
        pg.drop_database(name)
    span = w1 - w0
    n = sum(w.commands for w in wins)
    b = sum(w.batches for w in wins)
    cpu = sum(w.cpu_s for w in wins)
    pg_cpu = cpu_delta(pg0, pg1)
    busy, idle = m1[0] - m0[0], m1[1] - m0[1]
    writer_cores = sum(w.cpu_s / w.seconds for w in wins if w.seconds)
    return FleetRun(
        writers=k, round=rnd,
        commands_per_s=sum(w.commands / w.seconds for w in wins if w.seconds),
        commits_per_s=sum(w.batches / w.seconds for w in wins if w.seconds),
        mean_batch=n / b if b else 0.0,
        commit_ms=sum(w.commit_s for w in wins) / b * 1e3 if b else 0.0,
        writer_cpu_us_per_command=cpu / n * 1e6 if n else 0.0,
        writer_cores=writer_cores,
        busiest_writer_core=max((w.cpu_s / w.seconds for w in wins if w.seconds), default=0.0),
        alone_rate_min=min((w.commands / w.seconds for w in wins if w.seconds), default=0.0),
        pg_cpu_us_per_command=pg_cpu / n * 1e6 if n else 0.0,
        pg_cores=pg_cpu / span,
        idle_share=idle / (busy + idle) if busy + idle else 0.0,
        other_cores=max(0.0, busy / span - writer_cores - pg_cpu / span),
        refused=sum(w.refused for w in wins),
    )


def fleet(args: argparse.Namespace, workdir: Path) -> list[FleetRun]:
    runs: list[FleetRun] = []
    with Cluster.start(workdir / "pg") as pg:  # stopped by pid on leaving, Ctrl-C included
        for rnd in range(args.rounds):
            for k in (args.writers if rnd % 2 == 0 else list(reversed(args.writers))):
                run = fleet_round(pg, k, rnd, args)
                runs.append(run)
                print(f"  round {rnd}  K={k:<2} {fmt_rate(run.commands_per_s):>7} commands/s  "
                      f"{fmt_rate(run.commits_per_s):>5} commits/s  batch "
                      f"{run.mean_batch:6.1f}  writers {run.writer_cpu_us_per_command:3.0f} "
                      f"us/cmd {run.writer_cores:4.2f} cores  pg "
                      f"{run.pg_cpu_us_per_command:3.0f} us/cmd {run.pg_cores:4.2f} cores  "
                      f"idle {run.idle_share:4.0%}  refused {run.refused}", flush=True)
    return runs


def binding(s: dict[str, float], cpus: int, submitters: int) -> str:
    """Which bound held a measured K back, from what the machine showed."""
    if s["idle_share"] < IDLE_FULL:
        return (f"CPU: the machine's {cpus} cores are full (idle {s['idle_share']:.0%}; "
                f"writers {s['writer_cores']:.2f}, PostgreSQL {s['pg_cores']:.2f}, other "
                f"{s['other_cores']:.2f} cores)")
    if s["busiest_writer_core"] >= CORE_FULL:
        return f"writer: a writer process uses {s['busiest_writer_core']:.2f} of its one core"
    if s["mean_batch"] >= LOAD_FULL * submitters:
        return (f"load: every batch holds about all {submitters} submitters of a process "
                f"(commit {s['commit_ms']:.1f} ms); more submitters would batch more")
    return (f"PostgreSQL's commit path: cores idle {s['idle_share']:.0%}, no writer at a full "
            f"core (commit {s['commit_ms']:.1f} ms per batch)")


def fleet_model(summary: dict[int, dict[str, float]], cpus: int,
                submitters: int) -> dict[str, Any]:
    """The model's inputs from K=1 (or the smallest K), its prediction per measured K and
    which bound binds there; printed, and stored with the results."""
    k1 = min(summary)
    base = summary[k1]
    r1 = base["commands_per_s"] / k1
    w1, p1 = base["writer_cpu_us_per_command"], base["pg_cpu_us_per_command"]
    per_core = 1e6 / w1 if w1 else 0.0
    binds = {k: binding(s, cpus, submitters) for k, s in summary.items()}
    free = [s["commands_per_s"] for k, s in summary.items()
            if binds[k].startswith("PostgreSQL")]
    ceiling = max(free) if free else None

    def predict(n: int, c: float, w: float, p: float) -> tuple[float, str]:
        bounds = {"writers": n * r1, "cores": c * 1e6 / (w + p) if w + p else float("inf")}
        if ceiling is not None:
            bounds["PostgreSQL ceiling"] = ceiling
        which = min(bounds, key=lambda key: bounds[key])
        return bounds[which], which

    per_k = {}
    for k, s in summary.items():
        # on a shared machine the cores others used were not there to be had
        cores = max(0.0, cpus - s["other_cores"])
        pred, which = predict(k, cores, s["writer_cpu_us_per_command"],
                              s["pg_cpu_us_per_command"])
        per_k[k] = {"measured": s["commands_per_s"], "predicted": pred, "model_bound": which,
                    "writer_bound": k * r1, "cores_left_by_others": cores, "binds": binds[k]}
    alone = ("K=1 is the writer alone" if k1 == 1 else
             f"no K=1: r1 is a process's share at K={k1}, a lower bound")
    print(f"\n  model ({cpus} cores here; {alone}):", flush=True)
    print(f"    one writer process alone       r1 = {fmt_rate(r1)} commands/s, using "
          f"{base['writer_cores'] / k1:.2f} core", flush=True)
    print(f"    commands per coordinator-core     {fmt_rate(per_core)} (1e6 / w, w = {w1:.0f} "
          f"us of writer CPU per command)", flush=True)
    print(f"    PostgreSQL CPU per command     p = {p1:.0f} us ({fmt_rate(1e6 / p1 if p1 else 0)} "
          f"commands/s per PostgreSQL core)", flush=True)
    print("    PostgreSQL's own ceiling          "
          + (f"{fmt_rate(ceiling)} commands/s" if ceiling is not None else
             "not reached here: no K was free of the core, writer and load bounds"), flush=True)
    print(f"    predicted(N, C) = min(N x {fmt_rate(r1)}, C x 1e6 / ({w1:.0f} + {p1:.0f})"
          + (f", {fmt_rate(ceiling)}" if ceiling is not None else "") + ")", flush=True)
    for k, m in per_k.items():
        print(f"    K={k:<2} measured {fmt_rate(m['measured']):>7}  predicted "
              f"{fmt_rate(m['predicted']):>7} ({m['model_bound']} bound; C = "
              f"{m['cores_left_by_others']:.2f} cores left by other work, this K's CPU per "
              f"command)", flush=True)
        print(f"          binds: {m['binds']}", flush=True)
    if max(summary) >= cpus:
        print(f"    K >= {cpus} writers on {cpus} cores: CPU-bound by construction; these "
              "figures say what this machine holds, not what PostgreSQL does", flush=True)
    ahead = {n: predict(n, n, w1, p1)[0] for n in (1, 2, 4, 8, 16, 32)}
    print("    N writers on N cores (with PostgreSQL on the same cores): "
          + ", ".join(f"N={n}: {fmt_rate(v)}" for n, v in ahead.items()), flush=True)
    return {"r1_commands_per_s": r1, "commands_per_coordinator_core": per_core,
            "writer_cpu_us_per_command": w1, "pg_cpu_us_per_command": p1,
            "pg_ceiling_commands_per_s": ceiling, "cpus": cpus,
            "formula": "min(N * r1, C * 1e6 / (w + p)[, ceiling])",
            "per_k": per_k, "n_on_n_cores": ahead}


def fleet_main(args: argparse.Namespace) -> int:
    cpus = os.cpu_count() or 1
    print(f"store writers: K = {','.join(map(str, args.writers))} writer processes on one "
          f"PostgreSQL, {args.submitters} submitters each, {args.rounds} rounds of "
          f"{args.warmup:g} s warm-up + {args.duration:g} s; {cpus} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="fencepost-store-writers-") as tmp:
        Path(tmp).chmod(0o755)  # PostgreSQL's OS user walks through it
        runs = fleet(args, Path(tmp))
    fields = [f for f in FleetRun.__dataclass_fields__ if f not in ("writers", "round",
                                                                     "refused")]
    summary: dict[int, dict[str, float]] = {}
    for k in sorted(set(args.writers)):
        mine = [r for r in runs if r.writers == k]
        summary[k] = {f: median([getattr(r, f) for r in mine]) for f in fields}
        summary[k]["refused"] = sum(r.refused for r in mine)
    print("\n  medians:")
    for k, s in summary.items():
        print(f"    K={k:<2} {fmt_rate(s['commands_per_s']):>7} commands/s  "
              f"{fmt_rate(s['commits_per_s']):>5} commits/s  batch {s['mean_batch']:6.1f}  "
              f"commit {s['commit_ms']:5.1f} ms  writers {s['writer_cpu_us_per_command']:3.0f} "
              f"us/cmd  pg {s['pg_cpu_us_per_command']:3.0f} us/cmd {s['pg_cores']:4.2f} cores  "
              f"idle {s['idle_share']:4.0%}", flush=True)
    model = fleet_model(summary, cpus, args.submitters)
    out = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": _head(),
           "machine": machine(), "config": {k: str(v) for k, v in vars(args).items()},
           "runs": [asdict(r) for r in runs], "summary": summary, "model": model}
    path = args.json or REPO / "bench" / "results" / "store_writers.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"  results in {path}", flush=True)
    return 1 if any(r.refused for r in runs) else 0


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/store_writer.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="with --writers, the model printed at the end:\n"
               "  predicted(N writers, C cores) = min(N x r1, C x 1e6 / (w + p)[, ceiling])\n"
               "  r1: commands/s of one writer process alone; w, p: the writers' and "
               "PostgreSQL's\n  CPU us per command; ceiling: PostgreSQL's, when a K was "
               "bound by neither")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the figures are medians")
    p.add_argument("--submitters", type=int, default=256,
                   help="asyncio tasks driving the lifecycle load (per writer process with "
                        "--writers)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before the window")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per round")
    p.add_argument("--writers", type=parse_writers, nargs="?", const="auto", default=None,
                   metavar="K[,K2,...]",
                   help="K writer processes on one PostgreSQL, each on its own database, "
                        "instead of the SQLite/PostgreSQL comparison; alone: 1..nproc+1, at "
                        "most 4")
    p.add_argument("--json", type=Path, default=None,
                   help="results file (default bench/results/store_writer.json, or "
                        "store_writers.json with --writers)")
    args = p.parse_args(argv)
    if args.writers is not None:
        return fleet_main(args)
    args.json = args.json or REPO / "bench" / "results" / "store_writer.json"
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
    out = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": _head(),
           "machine": machine(), "config": {k: str(v) for k, v in vars(args).items()},
           "runs": [asdict(r) for r in runs], "summary": summary, "ratio": ratio}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"  results in {args.json}", flush=True)
    return 1 if any(r.refused for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
