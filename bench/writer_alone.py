"""The writer alone: group commit in process, without gRPC.

Many concurrent submitters (default 256 asyncio tasks) each loop the worker
lifecycle on fresh run ids — Acquire -> Renew x3 -> RecordCheckpoint -> Finish,
one ``Writer.submit`` per command, awaited until durable — against a
``fencepost_server.writer.Writer`` on a fresh SQLite file at durability FULL.
After a warm-up the measured window counts commands committed (durable) per
second and the mean batch size, from the writer's own statistics.

The in-run baseline is the same workload with ``max_batch=1``: one transaction,
so one fsync, per command. Each round measures both (order alternating) and
the ratio grouped/baseline is printed; the figures reported are medians of the
rounds.

    .venv/bin/python bench/writer_alone.py [--submitters 256] [--duration 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib import ArgumentAdder, fmt_rate, median

from fencepost_server.clock import SystemClock
from fencepost_server.core.errors import LedgerError
from fencepost_server.core.ledger import Acquire, Finish, RecordCheckpoint, Renew
from fencepost_server.core.records import Record, Status
from fencepost_server.storage import Durability, SqliteStorage
from fencepost_server.writer import Writer

TARGET_COMMANDS_PER_S = 15_000


@dataclass
class WriterRun:
    label: str  # "group" or "baseline"
    round: int
    max_batch: int
    submitters: int
    duration_s: float
    commands: int
    commands_per_s: float
    batches: int
    mean_batch: float
    refused: int
    cpu_us_per_command: float  # this process's CPU time (all threads) per durable command


class _Counters:
    def __init__(self) -> None:
        self.refused = 0
        self.stop = False


async def _submitter(writer: Writer, counters: _Counters, prefix: str) -> None:
    owner = prefix
    i = 0
    while not counters.stop:
        run_id = f"{prefix}-{i:07d}"
        i += 1
        try:
            rec = await writer.submit(Acquire(run_id, owner))
            assert isinstance(rec, Record)
            token = rec.fencing_token
            for _ in range(3):
                await writer.submit(Renew(run_id, owner, token))
            await writer.submit(RecordCheckpoint(run_id, owner, token, f"ckpt/{run_id}", 1))
            await writer.submit(Finish(run_id, owner, token, Status.COMPLETED))
        except LedgerError:
            counters.refused += 1


def _snapshot(writer: Writer, counters: _Counters) -> tuple[int, int, int, float, float]:
    return (writer.stats.commands, writer.stats.batches, counters.refused, time.monotonic(),
            time.process_time())


async def measure(
    path: Path, *, label: str, round_no: int, max_batch: int, submitters: int,
    warmup_s: float, duration_s: float,
) -> WriterRun:
    storage = SqliteStorage(path, Durability.FULL)
    writer = Writer(storage, SystemClock(), max_batch=max_batch)
    await writer.start()
    counters = _Counters()
    try:
        tasks = [
            asyncio.create_task(_submitter(writer, counters, f"{label}-r{round_no}-s{i:03d}"))
            for i in range(submitters)
        ]
        await asyncio.sleep(warmup_s)
        c0, b0, r0, t0, cpu0 = _snapshot(writer, counters)
        await asyncio.sleep(duration_s)
        c1, b1, r1, t1, cpu1 = _snapshot(writer, counters)
        counters.stop = True
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    finally:
        counters.stop = True
        await writer.close()
    elapsed = t1 - t0
    commands, batches = c1 - c0, b1 - b0
    return WriterRun(
        label=label, round=round_no, max_batch=max_batch, submitters=submitters,
        duration_s=elapsed, commands=commands, commands_per_s=commands / elapsed,
        batches=batches, mean_batch=commands / batches if batches else 0.0, refused=r1 - r0,
        cpu_us_per_command=(cpu1 - cpu0) / commands * 1e6 if commands else 0.0,
    )


def disk_commits_per_s(path: Path, seconds: float) -> float:
    """The disk's own ceiling for one fsync per command: one-row transactions
    in a loop on a WAL database at synchronous=FULL, as the writer opens it."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v INTEGER NOT NULL)")
        db.execute("INSERT INTO t VALUES (1, 0)")
        n = 0
        t0 = time.monotonic()
        end = t0 + seconds
        while time.monotonic() < end:
            db.execute("BEGIN IMMEDIATE")
            db.execute("UPDATE t SET v = ? WHERE k = 1", (n,))
            db.execute("COMMIT")
            n += 1
        return n / (time.monotonic() - t0)
    finally:
        db.close()


@dataclass
class WriterConfig:
    submitters: int = 256
    warmup_s: float = 1.0
    duration_s: float = 5.0
    rounds: int = 3
    max_batch: int = 1024
    disk_probe_s: float = 2.0


def summarize(runs: list[WriterRun], disk: list[float]) -> dict[str, Any]:
    group = [r for r in runs if r.label == "group"]
    base = [r for r in runs if r.label == "baseline"]
    g = median([r.commands_per_s for r in group])
    b = median([r.commands_per_s for r in base])
    paired = [
        x.commands_per_s / y.commands_per_s
        for x in group for y in base if x.round == y.round and y.commands_per_s
    ]
    return {
        "group": {
            "commands_per_s": g,
            "mean_batch": median([r.mean_batch for r in group]),
            "refused": sum(r.refused for r in group),
            "cpu_us_per_command": median([r.cpu_us_per_command for r in group]),
        },
        "baseline": {
            "commands_per_s": b,
            "mean_batch": median([r.mean_batch for r in base]),
            "refused": sum(r.refused for r in base),
            "cpu_us_per_command": median([r.cpu_us_per_command for r in base]),
        },
        "disk_commits_per_s": median(disk),
        "ratio": g / b if b else 0.0,
        "paired_ratios": paired,
        "target_commands_per_s": TARGET_COMMANDS_PER_S,
        # Nothing in this workload should be refused: if something was, the
        # writer failed and the figures measure something else.
        "valid": not any(r.refused for r in runs),
        "target_met": g >= TARGET_COMMANDS_PER_S and not any(r.refused for r in runs),
    }


def verdict(summary: dict[str, Any]) -> str:
    if not summary["valid"]:
        return "INVALID (commands were refused)"
    return "met" if summary["target_met"] else "MISSED"


def print_summary(s: dict[str, Any]) -> None:
    g, b = s["group"], s["baseline"]
    print("  medians:")
    print(f"    group commit  {fmt_rate(g['commands_per_s']):>7} durable commands/s  "
          f"mean batch {g['mean_batch']:.1f}  CPU {g['cpu_us_per_command']:.0f} us/command")
    print(f"    max_batch=1   {fmt_rate(b['commands_per_s']):>7} durable commands/s  "
          f"mean batch {b['mean_batch']:.1f}  CPU {b['cpu_us_per_command']:.0f} us/command")
    print(f"    disk alone    {fmt_rate(s['disk_commits_per_s']):>7} one-row FULL commits/s "
          f"(the ceiling for one fsync per command)")
    paired = ", ".join(f"{x:.1f}" for x in s["paired_ratios"])
    print(f"    group/baseline = {s['ratio']:.1f}x (per round: {paired}); "
          f"target >= {s['target_commands_per_s']:,} commands/s: {verdict(s)}", flush=True)


async def run_writer_alone_async(cfg: WriterConfig) -> dict[str, Any]:
    print(f"writer alone: {cfg.submitters} submitters, durability FULL, warm-up "
          f"{cfg.warmup_s:g} s, measured {cfg.duration_s:g} s, {cfg.rounds} rounds", flush=True)
    runs: list[WriterRun] = []
    disk: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fencepost-bench-writer-") as tmp:
        for rnd in range(cfg.rounds):
            if cfg.disk_probe_s > 0:
                rate = await asyncio.to_thread(
                    disk_commits_per_s, Path(tmp) / f"disk-r{rnd}.db", cfg.disk_probe_s
                )
                disk.append(rate)
                print(f"  round {rnd}  disk     one-row commits    {fmt_rate(rate):>7} /s",
                      flush=True)
            plan = [("group", cfg.max_batch), ("baseline", 1)]
            if rnd % 2:
                plan.reverse()
            for label, max_batch in plan:
                run = await measure(
                    Path(tmp) / f"{label}-r{rnd}.db", label=label, round_no=rnd,
                    max_batch=max_batch, submitters=cfg.submitters,
                    warmup_s=cfg.warmup_s, duration_s=cfg.duration_s,
                )
                runs.append(run)
                print(f"  round {rnd}  {label:<8} max_batch={max_batch:<5} "
                      f"{fmt_rate(run.commands_per_s):>7} durable commands/s  "
                      f"mean batch {run.mean_batch:6.1f}  CPU {run.cpu_us_per_command:4.0f} "
                      f"us/command  refused {run.refused}", flush=True)
    summary = summarize(runs, disk)
    print_summary(summary)
    return {
        "config": asdict(cfg),
        "runs": [asdict(r) for r in runs],
        "disk_commits_per_s": disk,
        "summary": summary,
    }


def run_writer_alone(cfg: WriterConfig) -> dict[str, Any]:
    return asyncio.run(run_writer_alone_async(cfg))


def add_arguments(p: ArgumentAdder, prefix: str = "") -> None:
    d = WriterConfig()
    p.add_argument(f"--{prefix}submitters", type=int, default=d.submitters,
                   help=f"concurrent submitter tasks (default {d.submitters})")
    p.add_argument(f"--{prefix}warmup", type=float, default=d.warmup_s,
                   help=f"seconds of warm-up, not counted (default {d.warmup_s:g})")
    p.add_argument(f"--{prefix}duration", type=float, default=d.duration_s,
                   help=f"measured seconds per run (default {d.duration_s:g})")


def config_from(args: argparse.Namespace, rounds: int, prefix: str = "") -> WriterConfig:
    def get(name: str) -> Any:
        return getattr(args, f"{prefix}{name}".replace("-", "_"))

    cfg = WriterConfig(
        submitters=get("submitters"), warmup_s=get("warmup"), duration_s=get("duration"),
        rounds=rounds,
    )
    if cfg.submitters < 1 or cfg.duration_s <= 0 or cfg.warmup_s < 0 or cfg.rounds < 1:
        raise SystemExit("need submitters >= 1, duration > 0, warmup >= 0 and rounds >= 1")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run_writer_alone(config_from(args, args.rounds))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
