"""Takeover with many runs stored: how long a standby takes to lead when the
database holds 100 000 or 1 000 000 runs.

On a throwaway PostgreSQL (``fencepost_devtools.pgcluster``), two coordinators
(``fencepost serve --db postgresql://...``, the default 5 s leader lease and
1 s renewal) share one database. ``--live`` runs (default 1 000) are acquired
with a 1 h ttl and stay running; then the database is filled, through the
leader's ``Execute`` stream (``--streams`` streams, ``--chunk`` commands per
message: an Acquire then a Finish per run, so every row is the server's own
write), with finished runs up to each size of ``--stored``. At each size,
``--rounds`` times: with a client looping the worker lifecycle through the
leader (bench/coordinators.py ``Follower``), the leader is SIGKILLed, and

* **takeover**: the time from the SIGKILL to the first command the other
  coordinator acknowledges;
* **load**: the new leader's own figure, its log line "leading (epoch N) ...
  K runs in S s" (from winning the leader row to serving: loading the state and
  extending the live leases);
* the new leader's RSS once it serves.

The killed coordinator is restarted as a standby before the next round. The
first size (default 1 000: only the live runs) is the baseline measured in the
same run. The workers' own runs add a few thousand to each size. The fill
time is reported too (it is not the figure). Results go to
bench/results/takeover.json.

    .venv/bin/python bench/takeover.py [--stored 1000,100000,1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import psutil
from benchlib import REPO, machine, median
from coordinators import (
    LEADING,
    STANDBY,
    Acks,
    Follower,
    Group,
    Leading,
    WorkerStats,
    health,
    request_id,
    worker,
)
from peers.backends import ExecuteDispatcher

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb

LIVE_TTL_MS = 3_600_000


async def _fill(address: str, count: int, streams: int, chunk: int) -> float:
    """``count`` finished runs (random ids) through the leader; seconds taken."""
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        left = count

        async def one_stream() -> None:
            nonlocal left
            d = ExecuteDispatcher(stub)
            try:
                while left > 0:
                    n = min(chunk, left)
                    left -= n
                    ids = [uuid.uuid4().hex for _ in range(n)]
                    got = await asyncio.gather(*(d.submit(pb.Command(acquire=pb.AcquireRequest(
                        run_id=r, owner="fill", lease_ttl_ms=60_000))) for r in ids))
                    tokens = [_ok(g, "acquire").run.fencing_token for g in got]
                    done = await asyncio.gather(*(d.submit(pb.Command(finish=pb.FinishRequest(
                        run_id=r, owner="fill", fencing_token=t,
                        status=rpb.RUN_STATUS_COMPLETED))) for r, t in zip(ids, tokens,
                                                                          strict=True)))
                    for g in done:
                        _ok(g, "finish")
            finally:
                await d.close()

        await asyncio.gather(*(one_stream() for _ in range(streams)))
    return time.perf_counter() - t0


def _ok(result: pb.CommandResult, kind: str) -> Any:
    if result.WhichOneof("kind") != kind:
        raise RuntimeError(f"fill: {kind} answered {result}")
    return getattr(result, kind)


async def _acquire_live(f: Follower, n: int) -> None:
    async def one(k: int) -> None:
        await f.call("Acquire", pb.AcquireRequest(
            run_id=f"live-{k:05d}", owner=f"live-owner-{k % 16}", lease_ttl_ms=LIVE_TTL_MS,
            request_id=request_id()))

    for i in range(0, n, 64):
        await asyncio.gather(*(one(k) for k in range(i, min(n, i + 64))))


async def _takeover_round(group: Group, f: Follower, acks: Acks) -> dict[str, Any]:
    leader, _ = await asyncio.to_thread(group.wait_leader, 5)
    new = group.other(leader)
    await asyncio.sleep(2.0)  # the load runs on the leader; its runs table catches up
    t0 = time.monotonic()
    leader.send(signal.SIGKILL)
    while True:
        t1, _ = acks.first_after(t0, new.address)
        if t1 is not None:
            break
        if time.monotonic() - t0 > 300:
            raise RuntimeError(f"no takeover within 300 s:\n{new.log_tail()}")
        await asyncio.sleep(0.005)
    lead = Leading.parse(await asyncio.to_thread(new.wait_for, LEADING, 30))
    rss = psutil.Process(new.pid).memory_info().rss / 2**20
    await asyncio.to_thread(leader.wait_exit, 10)
    r0 = time.monotonic()
    leader.start()
    await asyncio.to_thread(leader.wait_for, STANDBY, 120)
    while (status := await asyncio.to_thread(health, leader.address)) != "NOT_SERVING":
        if time.monotonic() - r0 > 120:
            raise RuntimeError(f"restarted coordinator {leader.index}: health {status}")
        await asyncio.sleep(0.05)
    return {"takeover_s": round(t1 - t0, 3), "load_s": lead.load_s, "runs_loaded": lead.runs,
            "gap_ms": lead.gap_ms, "epoch": lead.epoch, "rss_mib": round(rss, 1),
            "standby_back_s": round(time.monotonic() - r0, 2)}


def _db_size(group: Group) -> tuple[float, int]:
    with group.cluster.connect("fencepost") as conn:
        size = conn.execute("SELECT pg_database_size(current_database())").fetchone()
        rows = conn.execute("SELECT count(*) FROM fencepost.runs").fetchone()
    assert size is not None and rows is not None
    return round(size[0] / 2**20, 1), int(rows[0])


async def amain(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    group = Group.start(workdir / "takeover", 2)
    sizes: list[dict[str, Any]] = []
    result: dict[str, Any] = {"sizes": sizes}
    f: Follower | None = None
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        leader, _ = await asyncio.to_thread(group.wait_leader, 60)
        await asyncio.to_thread(group.other(leader).wait_for, STANDBY, 60)
        f = Follower(group.addresses)
        await _acquire_live(f, args.live)
        acks, stats = Acks(), WorkerStats()
        tasks = [asyncio.create_task(worker(f, acks, stats, f"w{i}", stop))
                 for i in range(args.workers)]
        filled = 0
        for size in args.stored:
            want = max(0, size - args.live)
            fill_s, added = 0.0, max(0, want - filled)
            if added:
                stop.set()  # the fill alone (its time is not the figure)
                await asyncio.gather(*tasks)
                leader, _ = await asyncio.to_thread(group.wait_leader, 5)
                print(f"  filling {added:,} finished runs through the leader ...", flush=True)
                fill_s = await _fill(leader.address, added, args.streams, args.chunk)
                filled = want
                stop = asyncio.Event()
                tasks = [asyncio.create_task(worker(f, acks, stats, f"w{i}-{size}", stop))
                         for i in range(args.workers)]
            rounds = []
            for r in range(args.rounds):
                got = await _takeover_round(group, f, acks)
                rounds.append(got)
                print(f"  {size:>9,} runs stored, round {r + 1}: takeover {got['takeover_s']:.2f} "
                      f"s after the SIGKILL; load {got['load_s']:.2f} s ({got['runs_loaded']:,} "
                      f"runs known), gap {got['gap_ms']} ms, RSS {got['rss_mib']} MiB; "
                      f"standby back in {got['standby_back_s']:.1f} s", flush=True)
            db_mib, rows = await asyncio.to_thread(_db_size, group)
            entry = {
                "stored": size, "finished": filled, "live": args.live, "fill_s": round(fill_s, 1),
                "filled_now": added,
                "fill_runs_per_s": round(added / fill_s, 1) if fill_s else None,
                "db_mib": db_mib, "runs_rows": rows, "rounds": rounds,
                "takeover_s": median([x["takeover_s"] for x in rounds]),
                "load_s": median([x["load_s"] for x in rounds]),
                "rss_mib": round(median([x["rss_mib"] for x in rounds]), 1),
            }
            sizes.append(entry)
            print(f"  {size:,} runs stored ({db_mib} MiB database; filled in {fill_s:.0f} s): "
                  f"takeover median {entry['takeover_s']:.2f} s, load median "
                  f"{entry['load_s']:.2f} s, RSS {entry['rss_mib']} MiB", flush=True)
        stop.set()
        await asyncio.gather(*tasks)
        result["workers"] = {"ops": stats.ops, "refused": stats.refused,
                             "timeouts": stats.timeouts, "samples": stats.samples}
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if f is not None:
            await f.close()
        await asyncio.to_thread(group.stop)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/takeover.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--stored", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1_000, 100_000, 1_000_000],
                   help="runs stored at each measurement (the live ones included), ascending "
                   "(default 1000,100000,1000000: the first is the baseline, live runs only)")
    p.add_argument("--live", type=int, default=1000, help="running runs among them")
    p.add_argument("--rounds", type=int, default=3, help="takeovers at each size")
    p.add_argument("--workers", type=int, default=2, help="lifecycle workers during takeovers")
    p.add_argument("--streams", type=int, default=4, help="Execute streams filling")
    p.add_argument("--chunk", type=int, default=500, help="commands per fill message")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "takeover.json")
    args = p.parse_args(argv)
    if args.stored != sorted(args.stored):
        p.error("--stored must be ascending")
    print(f"bench/takeover: {args.stored} runs stored ({args.live:,} live), {args.rounds} "
          f"takeovers each; load average {os.getloadavg()[0]:.1f}", flush=True)
    started = time.monotonic()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": head,
        "machine": machine(), "load_before": os.getloadavg(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    workdir = Path(tempfile.mkdtemp(prefix="fencepost-takeover-"))
    workdir.chmod(0o755)  # PostgreSQL's OS user walks through it
    try:
        result = {**meta, **asyncio.run(amain(args, workdir))}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    print("\n| runs stored | takeover (SIGKILL -> first ack), median | load | RSS | fill |")
    print("|---|---|---|---|---|")
    for e in result["sizes"]:
        print(f"| {e['stored']:,} | {e['takeover_s']:.2f} s | {e['load_s']:.2f} s "
              f"| {e['rss_mib']} MiB | {e['fill_s']:.0f} s |")
    w = result.get("workers", {})
    print(f"\n  workers: {w.get('ops', 0):,} commands, refused {w.get('refused')}, timeouts "
          f"{w.get('timeouts')}; took {result['elapsed_s']:.0f} s", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  results in {args.json}", flush=True)
    return 1 if w.get("refused") or w.get("timeouts") else 0


if __name__ == "__main__":
    sys.exit(main())
