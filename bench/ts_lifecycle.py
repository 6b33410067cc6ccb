"""Lifecycle ops/s of the TypeScript client against the Python SDK, on the
same server (one fresh server per client, same flags): each op is an acquire
of a new run followed by its finish, CONCURRENCY in flight, for SECONDS.

    .venv/bin/python bench/ts_lifecycle.py [--seconds 10] [--concurrency 32] [--rounds 3]

The clients take turns, round after round, and the median of the rounds is
reported per client, so that a busy machine slows all of them alike.

Needs the TypeScript client built (`cd clients/typescript && npm ci && npm
run build`). A benchmark, not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from benchlib import BIN, HOST, REPO, free_port, machine, median, percentile, start_server

import fencepost


async def python_lifecycle(
    address: str, seconds: float, concurrency: int, transport: Literal["stream", "unary"]
) -> dict[str, Any]:
    latencies: list[float] = []
    owner = f"bench-py-{transport}"
    async with fencepost.Client(address, owner=owner, transport=transport) as client:
        warm = await client.acquire(f"py-{transport}-warm", ttl_ms=60_000)
        await warm.finish()
        deadline = time.monotonic() + seconds
        seq = 0

        async def worker(w: int) -> None:
            nonlocal seq
            while time.monotonic() < deadline:
                t = time.perf_counter()
                seq += 1
                lease = await client.acquire(f"py-{transport}-{w}-{seq}", ttl_ms=60_000)
                await lease.finish()
                latencies.append((time.perf_counter() - t) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "client": f"python ({transport})",
        "ops": len(latencies),
        "seconds": elapsed,
        "ops_per_s": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(json.dumps(machine()))
    rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for which in ("typescript-stream", "typescript-unary", "python-stream", "python-unary"):
            result = one_run(which, args.seconds, args.concurrency)
            rates.setdefault(result["client"], []).append(result["ops_per_s"])
            print(json.dumps(result))
    print(f"median of {args.rounds} rounds, {args.concurrency} in flight, {args.seconds:g} s each:")
    for name, values in rates.items():
        print(f"{name:>22}: {median(values):8.0f} lifecycle ops/s  "
              f"(rounds: {', '.join(f'{v:.0f}' for v in values)})")


def one_run(which: str, seconds: float, concurrency: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"{HOST}:{free_port()}"
        server = start_server(
            "fencepost",
            [str(BIN / "fencepost"), "serve", "--listen", address,
             "--db", str(Path(tmp) / "db")],
            Path(tmp) / "server.log",
        )
        try:
            server.wait_ready(r"fencepost serving on (\S+)")
            transport: Literal["stream", "unary"] = (
                "unary" if which.endswith("unary") else "stream"
            )
            if which.startswith("typescript"):
                out = subprocess.run(
                    ["node", str(REPO / "bench" / "ts_lifecycle.mjs"), address,
                     str(seconds), str(concurrency), transport],
                    check=True, capture_output=True, text=True,
                ).stdout
                result = json.loads(out.strip().splitlines()[-1])
            else:
                result = asyncio.run(python_lifecycle(address, seconds, concurrency, transport))
        finally:
            server.stop()
    return result


if __name__ == "__main__":
    main()
