"""The leader's epoch on a real PostgreSQL, in process: a deposed leader's
batch commits nothing, a takeover ends the sessions of an expired leader that
holds the leader row mid-batch, and the takeover's gap extends live leases."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from fencepost_server.clock import ManualClock
from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.leadership import Leadership, writer_name
from fencepost_server.pgcluster import Cluster
from fencepost_server.storage import postgres
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.writer import Writer

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster.start() as pg:
        yield pg


@pytest.fixture
def url(cluster: Cluster) -> str:
    return cluster.create_database(f"ld_{uuid.uuid4().hex[:10]}")


def _changes(url: str) -> int:
    with psycopg.connect(url) as db:
        row = db.execute("SELECT count(*) FROM fencepost.changes").fetchone()
        assert row is not None
        return int(row[0])


async def _leader(url: str, name: str, clock: ManualClock) -> tuple[Leadership, Writer]:
    storage = PostgresStorage(url, name=name)
    db = postgres.connect(url, "test-migrate")
    postgres.migrate(db, url)
    db.close()
    ld = Leadership(url, clock, address=f"{name}:1", identity=name, lease_ms=600,
                    renew_ms=100, max_skew_ms=0)
    took = await ld.campaign()
    storage.epoch = took.epoch
    writer = Writer(storage, clock)
    await writer.start()
    return ld, writer


async def test_a_deposed_leaders_batch_commits_nothing(url: str) -> None:
    clock = ManualClock()
    old, writer = await _leader(url, "old", clock)
    try:
        await writer.submit(L.Acquire("r", "w", 60_000))
        before = _changes(url)
        await asyncio.sleep(0.7)  # old stops renewing (no keep()): its row expires
        new = Leadership(url, clock, address="new:1", identity="new", lease_ms=600,
                         renew_ms=100, max_skew_ms=0)
        took = await new.campaign()
        assert took.epoch == 2 and took.previous == "old"
        with pytest.raises(LedgerError) as refused:
            await writer.submit(L.Acquire("r2", "w", 60_000))
        assert refused.value.code is Code.NOT_LEADER
        assert refused.value.metadata == {"leader": "new:1"}
        assert _changes(url) == before, "a deposed leader committed a batch"
        await new.close()
    finally:
        await writer.close()
        await old.close()


async def test_a_takeover_ends_an_expired_leader_holding_the_row_mid_batch(url: str) -> None:
    clock = ManualClock()
    old, writer = await _leader(url, "stuck", clock)
    await writer.close()
    # the old leader's writer is paused inside a batch: it holds the row's lock
    stuck = psycopg.connect(url, autocommit=True, application_name=writer_name("stuck"))
    stuck.execute("BEGIN")
    stuck.execute("SELECT epoch FROM fencepost.fencepost_leader WHERE id = 1 FOR KEY SHARE")
    try:
        await asyncio.sleep(0.7)  # its row expires
        new = Leadership(url, clock, address="new:1", identity="new", lease_ms=600,
                         renew_ms=100, max_skew_ms=0)
        took = await asyncio.wait_for(new.campaign(), 10)
        assert took.epoch == 2
        with pytest.raises(psycopg.OperationalError):
            stuck.execute("COMMIT")  # its session was ended: the batch rolled back
        await new.close()
    finally:
        stuck.close()
        await old.close()


async def test_the_takeovers_gap_extends_live_leases_and_spares_expired_ones(url: str) -> None:
    clock = ManualClock()
    old, writer = await _leader(url, "a", clock)
    live = await writer.submit(L.Acquire("live", "w", 60_000))
    gone = await writer.submit(L.Acquire("gone", "w", 1_000))
    await writer.close()
    await old.close()
    clock.advance(5_000)
    ld, writer = await _leader(url, "b", clock)
    try:
        done = await writer.submit(L.ExtendLeases(by_ms=4_000, alive_at=clock.now_ms() - 4_000))
        assert done == L.LeasesExtended(runs=1, others=0)
        now_live = writer.state.runs["live"]
        assert now_live.lease is not None and live.lease is not None  # type: ignore[union-attr]
        assert now_live.lease.expires_at == live.lease.expires_at + 4_000  # type: ignore[union-attr]
        assert writer.state.runs["gone"].lease == gone.lease  # type: ignore[union-attr]
    finally:
        await writer.close()
        await ld.close()
