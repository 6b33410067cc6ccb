"""A worker process for the dashboard tests: acquires one run, prints
``acquired TOKEN``, keeps the lease renewed, and prints ``lost REASON`` when
the server fences it. Run as: python _worker.py ADDR RUN_ID OWNER [TTL_MS]."""

from __future__ import annotations

import asyncio
import sys

import fencepost


async def main(addr: str, run_id: str, owner: str, ttl_ms: int) -> None:
    async with fencepost.Client(addr, owner=owner) as client:
        lease = await client.acquire(run_id, ttl_ms=ttl_ms)
        print("acquired", lease.fencing_token, flush=True)
        await lease.lost.wait()
        print("lost", lease.lost_reason, flush=True)


if __name__ == "__main__":
    ttl = int(sys.argv[4]) if len(sys.argv) > 4 else 30_000
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], ttl))
