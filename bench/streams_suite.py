"""The three stream benchmarks together, for ``bench/run_all.py --only streams``.

1. Many leases (bench/streams_leases.py): 10 000 leases over 10 KeepAlive
   streams, ttl 3 s, 60 s; one run (the issue asks for 60 s).
2. Revocation latency (bench/streams_revoke.py): Cancel answer -> `lost`,
   1 000 Cancels per run, ``--rounds`` runs; medians of p50/p99.
3. Slow watcher (bench/streams_watcher.py): e2e load with and without a
   WatchRuns subscriber that never reads, ``--rounds`` interleaved rounds, then
   the watcher's eventual status.

With the defaults this takes 5-6.5 minutes, so ``make bench`` (run_all
without ``--only``) leaves it out; each program also runs on its own.

    .venv/bin/python bench/streams_suite.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import streams_leases
import streams_revoke
import streams_watcher
from benchlib import ArgumentAdder, fmt_rate


def add_arguments(p: ArgumentAdder, prefix: str = "") -> None:
    streams_leases.add_arguments(p, prefix=f"{prefix}leases-")
    streams_revoke.add_arguments(p, prefix=f"{prefix}revoke-")
    streams_watcher.add_arguments(p, prefix=f"{prefix}watcher-")


def run_streams(args: argparse.Namespace, rounds: int, prefix: str = "") -> dict[str, Any]:
    lcfg = streams_leases.config_from(args, prefix=f"{prefix}leases-")
    rcfg = streams_revoke.config_from(args, rounds, prefix=f"{prefix}revoke-")
    wcfg = streams_watcher.config_from(args, rounds, prefix=f"{prefix}watcher-")
    result: dict[str, Any] = {}
    result["leases"] = streams_leases.run_leases(lcfg)
    print()
    result["revoke"] = streams_revoke.run_revoke(rcfg)
    print()
    result["watcher"] = streams_watcher.run_watcher(wcfg)
    return result


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    if "leases" in result:
        s = result["leases"]["summary"]
        rss = s["rss_mib"]
        lines.append(
            f"  many leases    {s['leases']:,} leases: {fmt_rate(s['renewals_per_s'])} renewals/s "
            f"of {fmt_rate(s['target_renewals_per_s'])}/s needed; lost {s['lost']}, expiring "
            f"{s['expiring']:,}; server {s['server_cpu']:.2f} cores, RSS {rss['start']:.0f}/"
            f"{rss['peak']:.0f}/{rss['end']:.0f} MiB; writer mean batch "
            f"{s['writer_mean_batch']:.1f}: {'PASS' if s['passed'] else 'FAIL'} (one 60 s run)")
    if "revoke" in result:
        s = result["revoke"]["summary"]
        lines.append(
            f"  revocation     Cancel answer -> lost p50 {s['p50_ms']:.2f} ms, p99 "
            f"{s['p99_ms']:.2f} ms; target p99 < {s['target_p99_ms']:g} ms: "
            f"{streams_revoke.verdict(s)}")
    if "watcher" in result:
        s = result["watcher"]["summary"]
        st = result["watcher"]["status"]
        ratio = s["ratio"] if s["ratio"] is not None else 0.0
        lines.append(
            f"  slow watcher   {fmt_rate(s['with']['ops_per_s'])} ops/s with, "
            f"{fmt_rate(s['without']['ops_per_s'])} without: {ratio:.2f}; target >= "
            f"{s['target_ratio']:.2f}: {streams_watcher.verdict(s)}; watcher ended "
            f"{st.get('code')} {st.get('reason') or ''}".rstrip())
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3, help="runs/rounds of 2 and 3")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run_streams(args, args.rounds)
    print("\nsummary")
    for line in summary_lines(result):
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
