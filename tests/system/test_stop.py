"""A SIGTERM with workers connected: the SDK keeps an Execute stream and a
KeepAlive stream open for as long as its client lives, and the server ends
both as it stops (after answering what it took) instead of waiting out its
grace period for them. After the restart the same client carries on: its
lease renews and finishes on the new process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from _proc import ServerProc

import fencepost


def test_sigterm_with_a_worker_connected_stops_at_once_and_the_worker_carries_on(
    tmp_path: Path,
) -> None:
    srv = ServerProc(tmp_path / "f.db", tmp_path / "server.log",
                     args=("--shutdown-grace", "30"))
    srv.start()

    async def scenario() -> float:
        async with fencepost.Client(srv.address, owner="w") as client:
            lease = await client.acquire("r", ttl_ms=60_000)
            await lease.renew()  # both streams are open and in use
            started = time.monotonic()
            rc = await asyncio.to_thread(srv.stop, 25.0)
            took = time.monotonic() - started
            assert rc == 0
            await asyncio.to_thread(srv.start)
            await lease.renew()  # reconnects to the new process
            done = await lease.finish("completed")
            assert done.status == "completed" and done.fencing_token == lease.fencing_token
            return took

    try:
        took = asyncio.run(scenario())
    finally:
        srv.stop()
    assert took < 10, f"the stop took {took:.1f} s: it waited for the client's streams"
