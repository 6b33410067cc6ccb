"""What ``make bench`` runs: both benchmarks, a summary, and a JSON of the results.

1. The writer alone (bench/writer_alone.py): in process, no gRPC, durable
   commands/s at FULL with group commit, against ``max_batch=1`` (one fsync
   per command) measured in the same round.
2. End to end (bench/e2e.py): 64 clients in 2 processes over gRPC against
   fencepost (durability full) and against a do-nothing echo server, rounds
   interleaved.
3. Streams (bench/streams_suite.py), only with ``--only streams`` (it takes
   5-6.5 more minutes): 10 000 leases kept alive over 10 KeepAlive streams,
   Cancel -> `lost` revocation latency, and the e2e load with and without a
   WatchRuns subscriber that never reads.

Each figure is the median of ``--rounds`` (default 3). Absolute numbers drift
on a shared machine; the ratios are against baselines measured in the same
invocation. The results go to bench/results/latest.json (git-ignored). With
the defaults the whole run takes about 2.5 minutes.

    .venv/bin/python bench/run_all.py [--rounds 3] [--only e2e|writer|streams] ...
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import e2e
import streams_suite
import writer_alone
from benchlib import REPO, fmt_rate, machine


def _git(*args: str) -> str:
    """Read-only git queries, to say what code was measured."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def _print_summary(result: dict[str, Any]) -> None:
    print()
    print(f"summary (medians of {result['rounds']} rounds)")
    w = result.get("writer_alone")
    if w is not None:
        s = w["summary"]
        print(f"  writer alone   {fmt_rate(s['group']['commands_per_s'])} durable commands/s at "
              f"FULL, mean batch {s['group']['mean_batch']:.1f}; max_batch=1: "
              f"{fmt_rate(s['baseline']['commands_per_s'])}/s; group/baseline "
              f"{s['ratio']:.1f}x; target >= {s['target_commands_per_s']:,}/s: "
              f"{writer_alone.verdict(s)}")
    e = result.get("e2e")
    if e is not None:
        s = e["summary"]
        if "fencepost" in s:
            fp = s["fencepost"]
            print(f"  end to end     fencepost {fmt_rate(fp['ops_per_s'])} ops/s, "
                  f"p50 {fp['p50_ms']:.1f} ms, p99 {fp['p99_ms']:.1f} ms, writer mean batch "
                  f"{fp['writer_mean_batch']:.1f}")
        if "echo" in s:
            ec = s["echo"]
            print(f"                 echo      {fmt_rate(ec['ops_per_s'])} ops/s, "
                  f"p50 {ec['p50_ms']:.1f} ms, p99 {ec['p99_ms']:.1f} ms")
        if s.get("ratio") is not None:
            print(f"                 fencepost/echo {s['ratio']:.2f}; "
                  f"target >= {s['target_ratio']:.2f}: {e2e.verdict(s)}")
        tls = e2e.tls_line(s)
        if tls is not None:
            print(f"                 {tls}")
    if result.get("streams") is not None:
        for line in streams_suite.summary_lines(result["streams"]):
            print(line)
    print(f"  took {result['elapsed_s']:.0f} s; results in {result['path']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (default 3)")
    parser.add_argument("--only", choices=("e2e", "writer", "streams"),
                        help="run just one of them (streams run only when asked)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "latest.json",
                        help="where to write the JSON (default bench/results/latest.json)")
    e2e_group = parser.add_argument_group("end to end")
    e2e.add_arguments(e2e_group, prefix="e2e-")
    w_group = parser.add_argument_group("writer alone")
    writer_alone.add_arguments(w_group, prefix="writer-")
    s_group = parser.add_argument_group("streams (with --only streams)")
    streams_suite.add_arguments(s_group, prefix="streams-")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    e2e_cfg = e2e.config_from(args, args.rounds, prefix="e2e-")
    w_cfg = writer_alone.config_from(args, args.rounds, prefix="writer-")

    server_changes = _git("status", "--porcelain", "--", "server")
    if server_changes:
        print(f"note: the server code differs from the last commit:\n{server_changes}\n",
              flush=True)
    load = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    if load > cpus / 2:
        print(f"note: load average {load:.1f} on {cpus} CPUs before starting; other work on "
              "this machine makes absolute figures noisy (each run prints the CPU others used)\n",
              flush=True)
    started = time.monotonic()
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        # server code that differs from the commit (the figures measure the work tree)
        "server_changes": server_changes.splitlines(),
        "machine": machine(),
        "load_before": os.getloadavg(),
        "rounds": args.rounds,
    }
    if args.only in (None, "writer"):
        result["writer_alone"] = writer_alone.run_writer_alone(w_cfg)
        print()
    if args.only in (None, "e2e"):
        result["e2e"] = e2e.run_e2e(e2e_cfg)
    if args.only == "streams":
        result["streams"] = streams_suite.run_streams(args, args.rounds, prefix="streams-")
    result["load_after"] = os.getloadavg()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    result["path"] = str(args.out)
    _print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
