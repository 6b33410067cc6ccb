"""python -m torture [--duration S] [--seed N] [--transport T] [--out DIR] [--fault F] ...

Exit code 0: zero violations; 1: violations found; 2: the harness itself failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import REPO
from .client import TRANSPORTS
from .runner import Config, check_dir, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torture", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of faults (60)")
    p.add_argument("--seed", type=int, default=1, help="seeds the workload and the nemesis")
    p.add_argument("--transport", choices=TRANSPORTS, default="mixed",
                   help="ledger mutations as unary RPCs, as commands on one Ledger.Execute "
                   "stream per client, or mixed: each client picks one by its seed (mixed)")
    p.add_argument("--out", type=Path,
                   help="output directory (build/torture/seed-N-Ds-TRANSPORT)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (4)")
    p.add_argument("--threads", type=int, default=3, help="client threads per worker (3)")
    p.add_argument("--runs", type=int, default=6, help="run ids everybody contends on (6)")
    p.add_argument("--profile", default="default", help="workload mix: default, fencing")
    p.add_argument("--nemesis", default="default",
                   help="fault mix: default, kills, none (postgres: also stops)")
    p.add_argument("--fault", default="", help="TEST ONLY: run a deliberately broken server "
                   "(ack-before-commit, fence-ignores-owner, watch-drops-change; postgres: "
                   "no-epoch-check); the run must then FAIL")
    p.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite",
                   help="sqlite: one server on a file (default); postgres: several "
                   "coordinators on a throwaway PostgreSQL, one leading, the workers "
                   "following it, the nemesis killing, pausing and cutting off the leader "
                   "and the database")
    p.add_argument("--coordinators", type=int, default=3,
                   help="coordinators with --store postgres (3)")
    p.add_argument("--leader-lease", default="2s", help="with --store postgres (2s)")
    p.add_argument("--leader-renew", default="400ms", help="with --store postgres (400ms)")
    p.add_argument("--max-clock-skew", default="500ms", help="with --store postgres (500ms)")
    p.add_argument("--lead-shards", action="store_true",
                   help="with --store postgres: every coordinator leads a share of the shards "
                   "at once (--lead-shards), the workers follow each call to its shard's owner, "
                   "the nemesis kills, pauses and stops (SIGTERM) any coordinator")
    p.add_argument("--shards", type=int, default=8,
                   help="with --lead-shards: the database's shard count (8: moves are frequent)")
    p.add_argument("--snapshots", choices=("fenced", "unfenced", "off"), default="fenced",
                   help="every checkpoint also writes the run's snapshot, under the handle's "
                   "fence or unfenced (the residual window left open: stale snapshots are "
                   "then found and reported as violations); off: none (fenced)")
    p.add_argument("--tls", action="store_true",
                   help="mutual TLS: a certificate per client, owners bound to it")
    p.add_argument("--check-only", type=Path, metavar="DIR",
                   help="re-run the checkers on a recorded run's directory")
    a = p.parse_args(argv)
    if a.check_only:
        outcome = check_dir(a.check_only)
        print(outcome.summary())
        return 0 if outcome.ok else 1
    pg = a.store == "postgres"
    if pg and not 1 <= a.coordinators <= 5:
        p.error("--coordinators must be 1..5")
    if a.lead_shards and not pg:
        p.error("--lead-shards needs --store postgres")
    if not 1 <= a.shards <= 4096:
        p.error("--shards must be 1..4096")
    out = a.out or REPO / "build" / "torture" / (
        f"seed-{a.seed}-{a.duration:g}s-{a.transport}"
        + ("" if a.snapshots == "fenced" else f"-{a.snapshots}")
        + (f"-pg{a.coordinators}" if pg else "")
        + (f"-shards{a.shards}" if a.lead_shards else ""))
    cfg = Config(duration_s=a.duration, seed=a.seed, out=out, workers=a.workers,
                 threads=a.threads, runs=a.runs, profile=a.profile, nemesis=a.nemesis,
                 fault=a.fault, transport=a.transport, tls=a.tls,
                 snapshots="" if a.snapshots == "off" else a.snapshots, store=a.store,
                 coordinators=a.coordinators if pg else 1, leader_lease=a.leader_lease,
                 leader_renew=a.leader_renew, max_clock_skew=a.max_clock_skew,
                 lead_shards=a.lead_shards, shards=a.shards)
    try:
        outcome = run(cfg)
    except Exception as exc:
        print(f"torture harness failure: {exc}", file=sys.stderr)
        return 2
    print(outcome.summary())
    print(f"  report: {out / 'report.json'}")
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
