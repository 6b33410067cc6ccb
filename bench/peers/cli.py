"""fencepost against etcd, PostgreSQL and Redis: one load generator, the same
run-lease semantics, durable acknowledgements everywhere.

fencepost is measured four ways (backends.py): through the public SDK as a
fleet connects (``fencepost-fleet``: one Client per worker) and as an engine
process does (``fencepost-engine``: one Client per process), and over the raw
protocol (``fencepost-unary``; ``fencepost-stream``, one Execute stream shared
by all of a process's owners, which no SDK user can do); and with its
PostgreSQL store (one coordinator, ``--db postgresql://...``) through the same
two SDK shapes (``fencepost-pg-fleet``, ``fencepost-pg-engine``). The same two
shapes also drive bench/echo_server.py (``echo-fleet``, ``echo-engine``), a
Python gRPC Ledger that answers at once and stores nothing: the ceiling any
Python server has for them here, so a gap to a peer can be split into what the
SDK and gRPC cost and what fencepost's own server work costs.

For each of ``--rounds`` rounds (default 3), every backend in a rotated order
gets a fresh server on fresh data, a warm-up (default 2 s) and a measured
window (default 8 s) of the acquire -> renew x3 -> record_checkpoint -> finish
workload, 64 clients in 2 processes. In the last round the same clients then
race for 16 runs at a time on the same server (the contention run), which is
checked for double grants, double finishes and stale fenced writes. Prints
ops/s, p50/p99, server CPU per op and the machine's load for each run, the
medians, and writes everything to bench/results/peers.json (git-ignored).
Every process started is stopped.

    .venv/bin/python bench/peers [--install] [--smoke] [--rounds 3] [--duration 8] ...

Exit status: 0, or 1 when the contention check found a violation (or a
backend could not be run at all).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchlib import REPO, fmt_rate, machine, median

from fencepost_devtools import pgcluster

from . import servers
from .backends import BACKENDS, ECHO_BACKENDS, PEERS, PG_BACKENDS, ROUND_TRIPS
from .history import check
from .load import ContentionResult, RaceConfig, RunResult, drive

STREAM_CPU_TARGET_US = 100.0
SDK_FLEET_RATIO = 1.5


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {"channels": args.channels, "streams": args.streams,
            "request_ids": args.stream_request_ids,
            "pg_conns": args.pg_conns, "redis_conns": args.redis_conns}


def _print_run(r: RunResult) -> None:
    extra = ""
    if r.writer_mean_batch is not None:
        extra += f"  writer batch {r.writer_mean_batch:.1f}"
    if r.stats.get("messages_sent"):
        extra += f"  cmds/msg {r.stats['commands_sent'] / r.stats['messages_sent']:.1f}"
    if r.stats.get("cas_conflicts"):
        extra += f"  cas conflicts {r.stats['cas_conflicts']:.0f}"
    print(f"  round {r.round}  {r.backend:<16} {fmt_rate(r.ops_per_s):>6} ops/s  "
          f"p50 {r.p50_ms:7.2f} ms  p99 {r.p99_ms:7.2f} ms  server {r.server_us_per_op:5.0f} us/op "
          f"({r.server_cpu:4.2f} cores)  clients {r.clients_us_per_op:4.0f} us/op "
          f"({r.clients_cpu:4.2f})  kernel "
          f"{r.kernel_cpu:4.2f}  others {r.other_cpu:4.2f}  load {r.load_before:4.1f}"
          f"  errors {r.errors}{extra}", flush=True)
    for s in r.error_samples:
        print(f"      error: {s}", flush=True)


def summarize(runs: list[RunResult], backends: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in backends:
        mine = [r for r in runs if r.backend == b]
        if not mine:
            continue
        out[b] = {
            "rounds": len(mine),
            "ops_per_s": median([r.ops_per_s for r in mine]),
            "p50_ms": median([r.p50_ms for r in mine]),
            "p99_ms": median([r.p99_ms for r in mine]),
            "server_us_per_op": median([r.server_us_per_op for r in mine]),
            "server_cpu": median([r.server_cpu for r in mine]),
            "clients_cpu": median([r.clients_cpu for r in mine]),
            "clients_us_per_op": median([r.clients_us_per_op for r in mine]),
            "other_cpu": median([r.other_cpu for r in mine]),
            "load": median([r.load_before for r in mine]),
            "errors": sum(r.errors for r in mine),
            "per_round_ops_per_s": [round(r.ops_per_s) for r in sorted(mine,
                                                                       key=lambda r: r.round)],
        }
        batches = [r.writer_mean_batch for r in mine if r.writer_mean_batch is not None]
        if batches:
            out[b]["writer_mean_batch"] = median(batches)
        msgs = [r.stats["commands_sent"] / r.stats["messages_sent"]
                for r in mine if r.stats.get("messages_sent")]
        if msgs:
            out[b]["commands_per_message"] = median(msgs)
    return out


def verdicts(s: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    def ops(b: str) -> float | None:
        return s[b]["ops_per_s"] if b in s else None

    out: list[tuple[str, bool | None, str]] = []
    fu, fs = ops("fencepost-unary"), ops("fencepost-stream")
    for peer in ("etcd", "postgres"):
        p = ops(peer)
        ok = None if fu is None or p is None else fu >= p
        out.append((f"fencepost unary >= {peer}", ok,
                    f"{fmt_rate(fu or 0)} vs {fmt_rate(p or 0)} ops/s" if ok is not None
                    else "not measured"))
    r = ops("redis")
    ok = None if fs is None or r is None else fs >= r
    out.append(("fencepost stream (raw protocol) >= redis", ok,
                f"{fmt_rate(fs or 0)} vs {fmt_rate(r or 0)} ops/s" if ok is not None
                else "not measured"))
    fleet, engine = ops("fencepost-fleet"), ops("fencepost-engine")
    for peer in ("etcd", "postgres"):
        p = ops(peer)
        ok = None if fleet is None or p is None else fleet >= SDK_FLEET_RATIO * p
        out.append((f"SDK fleet >= {SDK_FLEET_RATIO:g}x {peer}", ok,
                    f"{fmt_rate(fleet or 0)} vs {fmt_rate(p or 0)} ops/s "
                    f"({(fleet or 0) / p:.2f}x)" if ok is not None and p else "not measured"))
    ok = None if engine is None or r is None else engine >= r
    out.append(("SDK engine >= redis", ok,
                f"{fmt_rate(engine or 0)} vs {fmt_rate(r or 0)} ops/s "
                f"({(engine or 0) / r:.2f}x)" if ok is not None and r else "not measured"))
    if "fencepost-stream" in s:
        us = s["fencepost-stream"]["server_us_per_op"]
        out.append((f"fencepost stream <= {STREAM_CPU_TARGET_US:.0f} us server CPU/command",
                    us <= STREAM_CPU_TARGET_US, f"{us:.0f} us"))
    return out


def print_summary(s: dict[str, Any], rounds: int) -> None:
    print(f"\nmedians of {rounds} interleaved round(s):\n")
    print("| backend | round trips/op | ops/s | p50 | p99 | server CPU/op | server cores "
          "| clients' CPU/op | others' cores |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, m in s.items():
        print(f"| {b} | {ROUND_TRIPS[b]} | {fmt_rate(m['ops_per_s'])} | {m['p50_ms']:.1f} ms "
              f"| {m['p99_ms']:.1f} ms | {m['server_us_per_op']:.0f} µs "
              f"| {m['server_cpu']:.2f} | {m['clients_us_per_op']:.0f} µs "
              f"| {m['other_cpu']:.2f} |")
    print()
    for b, m in s.items():
        extra = []
        if "writer_mean_batch" in m:
            extra.append(f"writer mean batch {m['writer_mean_batch']:.1f}")
        if "commands_per_message" in m:
            extra.append(f"{m['commands_per_message']:.1f} commands per Execute message")
        if m["errors"]:
            extra.append(f"{m['errors']} FAILED ops")
        rounds_txt = ", ".join(fmt_rate(x) for x in m["per_round_ops_per_s"])
        print(f"  {b:<16} per round: {rounds_txt} ops/s" + (f"; {'; '.join(extra)}"
                                                            if extra else ""))
    print()
    for name, ok, detail in verdicts(s):
        mark = "n/a" if ok is None else "met" if ok else "MISSED"
        print(f"  target {name}: {mark} ({detail})")


def print_contention(results: dict[str, dict[str, Any]]) -> None:
    print("\ncontention:\n")
    print("| backend | grants | grants with token > 1 | accepted fenced writes "
          "| fenced writes refused | finishes | acquires refused | double grants "
          "| double finishes | stale writes accepted | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, c in results.items():
        refused_writes = sum(n for k, n in c["refused"].items() if not k.startswith("acquire"))
        refused_acquires = sum(n for k, n in c["refused"].items() if k.startswith("acquire"))
        print(f"| {b} | {c['grants']} | {c['grants_above_token_1']} | {c['accepted_writes']} "
              f"| {refused_writes} | {c['finishes']} | {refused_acquires} "
              f"| {c['double_grants']} | {c['double_finishes']} | {c['stale_writes']} "
              f"| {c['errors']} |")
    for b, c in results.items():
        for s in c["samples"]:
            print(f"  {b}: {s}")
        for s in c["error_samples"]:
            print(f"  {b} error: {s}")


def _choose_backends(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in wanted if b not in BACKENDS]
    if unknown or not wanted:
        raise SystemExit(f"--backends: pick from {', '.join(BACKENDS)}")
    peers = [b for b in wanted if b in PEERS]
    # fencepost on PostgreSQL needs PostgreSQL's server binaries (not the peer's client)
    pg_store = any(b in PG_BACKENDS for b in wanted)
    missing = [p for p in servers.missing_peers() if p in peers]
    if (missing or (pg_store and not pgcluster.available())) and args.install:
        servers.install([*missing, *(["postgres"] if pg_store else [])])
        missing = [p for p in servers.missing_peers() if p in peers]
    skipped = [b for b in wanted
               if b in missing or (b in PG_BACKENDS and not pgcluster.available())]
    for b in skipped:
        why = servers.PY_MODULES.get(b)
        print(f"note: skipping {b}: "
              + ("PostgreSQL's server binaries are" if b in PG_BACKENDS else
                 "its server binary" + (f" or the Python module {why}" if why else "") + " is")
              + " missing (make bench-peers installs them)", flush=True)
    return [b for b in wanted if b not in skipped], skipped


def run(args: argparse.Namespace) -> dict[str, Any]:
    backends, skipped = _choose_backends(args)
    opts = _options(args)
    started = time.monotonic()
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "work_tree_changes": _git("status", "--porcelain", "--", "server").splitlines(),
        "machine": machine(),
        "versions": servers.versions(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "backends": backends,
        "skipped": skipped,
        "load_before": os.getloadavg(),
    }
    print(f"bench-peers: {', '.join(backends)}; {args.clients} clients in {args.procs} "
          f"processes; {args.rounds} round(s) of {args.warmup:g} s warm-up + "
          f"{args.duration:g} s measured; load average {os.getloadavg()[0]:.1f}", flush=True)
    runs: list[RunResult] = []
    contention: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    race = None
    if args.contention_duration > 0:
        race = RaceConfig(duration_s=args.contention_duration, runs=args.contention_runs,
                          ttl_ms=args.contention_ttl, epoch_s=args.contention_epoch,
                          seed=args.seed)
        print(f"contention, after the last round's window, same server and clients: "
              f"{args.clients} clients racing for {race.runs} runs (fresh ids every "
              f"{race.epoch_s:g} s), ttl {race.ttl_ms} ms, {race.duration_s:g} s", flush=True)
    discarded: list[RunResult] = []
    workdir = servers.make_workdir()
    result["workdir"] = str(workdir)
    try:
        for rnd in range(args.rounds):
            k = rnd % len(backends)
            last = rnd == args.rounds - 1
            for b in backends[k:] + backends[:k]:
                tries: list[RunResult] = []
                for attempt in range(1 + args.retry_noisy):
                    tag = f"r{rnd}" + (f"-{attempt}" if attempt else "")
                    # the engine shape has one owner per process, and the echo
                    # server grants everything: no contention run for them
                    contend = (race if last and not b.endswith("-engine")
                               and b not in ECHO_BACKENDS else None)
                    got = _one_run(b, rnd, tag, workdir, args, opts, contend, failures)
                    if got is None:
                        break
                    r, c = got
                    tries.append(r)
                    _print_run(r)
                    if c is not None:
                        v = _contention_summary(c)
                        contention[b] = _merge_contention(contention.get(b), v)
                        print(f"           {b:<16} contention: grants {v['grants']}, finishes "
                              f"{v['finishes']}, double grants {v['double_grants']}, double "
                              f"finishes {v['double_finishes']}, stale writes accepted "
                              f"{v['stale_writes']}, errors {v['errors']}", flush=True)
                    if r.other_cpu <= args.noisy_cores:
                        break
                    if attempt < args.retry_noisy:
                        print(f"           (other processes used {r.other_cpu:.2f} cores > "
                              f"{args.noisy_cores:g}: running it again, keeping the quieter)",
                              flush=True)
                if tries:
                    keep = min(tries, key=lambda r: r.other_cpu)
                    runs.append(keep)
                    discarded.extend(r for r in tries if r is not keep)
    finally:
        servers.remove_workdir(workdir)
    summary = summarize(runs, backends)
    print_summary(summary, args.rounds)
    if discarded:
        print(f"  {len(discarded)} noisy run(s) (others > {args.noisy_cores:g} cores) were run "
              "again; the quieter of each pair is in the medians, all are in the JSON")
    if contention:
        print_contention(contention)
    result.update({
        "runs": [asdict(r) for r in runs],
        "discarded_noisy_runs": [asdict(r) for r in discarded],
        "summary": summary,
        "verdicts": [{"target": n, "met": ok, "detail": d} for n, ok, d in verdicts(summary)],
        "contention": contention,
        "failures": failures,
        "load_after": os.getloadavg(),
        "elapsed_s": round(time.monotonic() - started, 1),
    })
    print(f"\n  load average {result['load_before'][0]:.1f} before, "
          f"{result['load_after'][0]:.1f} after; took {result['elapsed_s']:.0f} s", flush=True)
    for f in failures:
        print(f"  FAILED: {f}", flush=True)
    return result


def _one_run(
    b: str, rnd: int, tag: str, workdir: Path, args: argparse.Namespace, opts: dict[str, Any],
    race: RaceConfig | None, failures: list[str],
) -> tuple[RunResult, ContentionResult | None] | None:
    """Start ``b`` fresh, drive it once, stop it; None (and a failure noted) if it broke."""
    try:
        srv = servers.start(b, workdir, tag)
    except Exception as exc:
        failures.append(f"{b} round {rnd}: could not start: {exc}")
        print(f"  {b}: could not start: {exc}", flush=True)
        return None
    try:
        return drive(srv, rnd, clients=args.clients, procs=args.procs, warmup_s=args.warmup,
                     duration_s=args.duration, options=opts, race=race)
    except Exception as exc:
        failures.append(f"{b} round {rnd}: {exc!r}")
        print(f"  {b} round {rnd} failed: {exc!r}", flush=True)
        traceback.print_exc()
        return None
    finally:
        code = srv.stop()
        if code not in (0, None, -srv.stop_signal):  # etcd dies by the signal it is sent
            print(f"  note: {b} exited with {code}; its log ends:\n{srv.log_tail()}",
                  flush=True)


def _merge_contention(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two contention runs of one backend (a noisy run repeated): counts add up."""
    if a is None:
        return b
    out = dict(b)
    for k, v in a.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k in b:
            out[k] = v + b[k]
        elif isinstance(v, dict):
            out[k] = {x: v.get(x, 0) + b[k].get(x, 0) for x in {*v, *b[k]}}
        elif isinstance(v, list):
            out[k] = (v + b[k])[:5]
    out["ok"] = a["ok"] and b["ok"]
    return out


def _contention_summary(c: ContentionResult) -> dict[str, Any]:
    v = check(c.grants, c.writes, c.finishes)
    v.update({"refused": c.refused, "outcomes": c.outcomes, "errors": c.errors,
              "error_samples": c.error_samples, "stats": c.stats,
              "duration_s": c.duration_s})
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated, from {', '.join(BACKENDS)} (default: all)")
    p.add_argument("--install", action="store_true",
                   help="apt-get the peers that are missing (root); without it they are skipped")
    p.add_argument("--smoke", action="store_true",
                   help="a quick check: 1 round, 0.3 s warm-up, 1 s measured, "
                   "1 s of contention, 16 clients")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=float, default=2.0, help="seconds, not counted")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--procs", type=int, default=2, help="client processes")
    p.add_argument("--channels", type=int, default=1,
                   help="fencepost-unary: grpc.aio channels per client process")
    p.add_argument("--streams", type=int, default=1,
                   help="fencepost-stream: Execute streams per client process")
    p.add_argument("--stream-request-ids", action="store_true",
                   help="fencepost-stream: a request id on every command, as the SDK "
                   "sends (by default the raw stream sends none)")
    p.add_argument("--pg-conns", type=int, default=0,
                   help="postgres: pool size per client process (default: one per client)")
    p.add_argument("--redis-conns", type=int, default=0,
                   help="redis: pool size per client process (default: one per client)")
    p.add_argument("--contention-duration", type=float, default=6.0,
                   help="seconds of the contention run per backend, after the last "
                   "round's window (0: none)")
    p.add_argument("--contention-runs", type=int, default=16)
    p.add_argument("--contention-ttl", type=int, default=200, help="lease ttl, ms")
    p.add_argument("--contention-epoch", type=float, default=1.0,
                   help="seconds between fresh sets of run ids")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--retry-noisy", type=int, default=1,
                   help="run a backend again (up to this many times) when other processes "
                   "used more than --noisy-cores during its window; the quietest is kept")
    p.add_argument("--noisy-cores", type=float, default=0.5,
                   help="others' CPU (cores) above which a run counts as noisy (default 0.5)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "peers.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.rounds, args.warmup, args.duration = 1, 0.3, 1.0
        args.retry_noisy = 0
        args.contention_duration = min(args.contention_duration, 1.0)
        args.clients = min(args.clients, 16)
    if args.rounds < 1 or args.duration <= 0 or args.procs < 1 or args.clients < args.procs:
        raise SystemExit("need rounds >= 1, duration > 0, procs >= 1, clients >= procs")
    result = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  results in {args.json}", flush=True)
    bad = [b for b, c in result["contention"].items() if not c["ok"]]
    if bad:
        print(f"  CONTENTION VIOLATIONS on {', '.join(bad)}", flush=True)
    return 1 if bad or result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
