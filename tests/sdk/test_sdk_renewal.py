"""Background renewal in real time, against a server on the system clock."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import fencepost
from fencepost.v1 import ledger_pb2
from fencepost_server.testing.server import ServerThread

pytestmark = pytest.mark.slow

TTL_MS = 300


@pytest.fixture
def live_server(make_server: Any) -> Iterator[ServerThread]:
    with make_server(listen="127.0.0.1:0") as srv:  # SystemClock
        yield srv


async def test_background_renewal_keeps_a_lease_past_its_ttl(live_server: ServerThread) -> None:
    async with (
        fencepost.Client(live_server.address, owner="worker-a") as client,
        fencepost.Client(live_server.address, owner="worker-b") as rival,
    ):
        lease = await client.acquire("renewed", ttl_ms=TTL_MS)
        # control: the same ttl through the raw stub, which nobody renews
        await client.stubs.ledger.Acquire(ledger_pb2.AcquireRequest(
            run_id="control", owner="worker-a", lease_ttl_ms=TTL_MS))

        await asyncio.sleep(4 * TTL_MS / 1000)  # 1.2 s: four ttls

        taken = await rival.acquire("control")  # expired long ago: taken over
        assert taken.record.attempt == 2
        with pytest.raises(fencepost.LeaseHeldError):
            await rival.acquire("renewed")  # renewed every ~100 ms: still held
        assert lease.is_active and not lease.lost.is_set()
        rec = await client.get("renewed")
        assert rec.fencing_token == lease.fencing_token == 1
        assert rec.version == 1  # renewed from memory: the expiry moves, the version does not
        assert rec.lease is not None and rec.lease.expires_at > rec.lease.acquired_at
        lifetime = (rec.lease.expires_at - rec.lease.acquired_at).total_seconds()
        assert lifetime > 3 * TTL_MS / 1000
        await lease.finish()
        version = (await client.get("renewed")).version
        assert live_server.app is not None
        renewals = live_server.app.writer.stats.memory_renewals
        await asyncio.sleep(2 * TTL_MS / 1000)
        assert (await client.get("renewed")).version == version
        assert live_server.app.writer.stats.memory_renewals == renewals  # stopped on finish
