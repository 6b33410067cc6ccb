"""Lifecycle ops/s of the TypeScript client against the Python SDK, on the
same server (one fresh server per client, same flags): each op is an acquire
of a new run followed by its finish, CONCURRENCY in flight, for SECONDS.

    .venv/bin/python bench/ts_lifecycle.py [--seconds 10] [--concurrency 32]

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

from benchlib import BIN, HOST, REPO, free_port, machine, percentile, start_server

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
    args = ap.parse_args()
    print(json.dumps(machine()))
    for which in ("typescript", "python-unary", "python-stream"):
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
                if which == "typescript":
                    out = subprocess.run(
                        ["node", str(REPO / "bench" / "ts_lifecycle.mjs"), address,
                         str(args.seconds), str(args.concurrency)],
                        check=True, capture_output=True, text=True,
                    ).stdout
                    result = json.loads(out.strip().splitlines()[-1])
                else:
                    transport: Literal["stream", "unary"] = (
                        "unary" if which == "python-unary" else "stream"
                    )
                    result = asyncio.run(python_lifecycle(
                        address, args.seconds, args.concurrency, transport))
            finally:
                server.stop()
        print(json.dumps(result))
        print(f"{result['client']:>22}: {result['ops_per_s']:8.0f} lifecycle ops/s  "
              f"p50 {result['p50_ms']:.2f} ms  p99 {result['p99_ms']:.2f} ms")


if __name__ == "__main__":
    main()
