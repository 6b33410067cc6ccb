"""The batch of a coordinator leading shards apart (storage/shared.py), on a
real PostgreSQL: it commits only while every shard it touches still holds
the epoch it was taken under; revisions come in blocks above every block
before a take; a taker extends the leases its floor says; the database is
converted once and refused to a coordinator that would lead alone."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from fencepost_devtools.pgcluster import Cluster
from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.placement import Ownership
from fencepost_server.core.records import Record
from fencepost_server.core.shards import shard_of
from fencepost_server.storage import postgres
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.storage.shared import BLOCK
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Writer

pytestmark = [pytest.mark.timeout(60)]

SHARDS = 4


@pytest.fixture
def url(pg_cluster: Cluster) -> str:
    url = pg_cluster.create_database(f"sb_{uuid.uuid4().hex[:10]}")
    db = postgres.connect(url, "test")
    try:
        postgres.migrate(db, url, SHARDS)
    finally:
        db.close()
    return url


def _run_in(shard: int, prefix: str = "r") -> str:
    return next(f"{prefix}-{i}" for i in range(1000) if shard_of(f"{prefix}-{i}", SHARDS) == shard)


def _bump(url: str, shard: int, holder: str = "other") -> int:
    """What a coordinator taking ``shard`` does to its row; the new epoch."""
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute(
            "UPDATE fencepost.fencepost_shards SET epoch = epoch + 1, holder = %s "
            "WHERE shard = %s RETURNING epoch", (holder, shard)).fetchone()
    assert row is not None
    return int(row[0])


async def _writer(url: str, clock: ManualClock, shards: dict[int, int]) -> Writer:
    """A writer leading ``shards`` (shard -> epoch) of the database."""
    storage = PostgresStorage(url, name=f"w-{uuid.uuid4().hex[:6]}", shards=SHARDS)
    storage.lead_shards()
    writer = Writer(storage, clock)
    await writer.start()
    storage.sharing_state.epochs = dict(shards)
    writer.lead_only(Ownership(SHARDS, shards, {}))
    got = await writer.take(frozenset(shards), {})
    assert isinstance(got, L.LeasesExtended)
    return writer


def _stored(url: str, run_id: str) -> Any:
    with psycopg.connect(url, autocommit=True) as db:
        return db.execute("SELECT record FROM fencepost.runs WHERE run_id = %s",
                          (run_id,)).fetchone()


async def test_a_batch_touching_a_shard_taken_since_commits_nothing(url: str) -> None:
    clock = ManualClock(1_000_000)
    epochs = {s: _bump(url, s, "me") for s in range(SHARDS)}
    writer = await _writer(url, clock, epochs)
    try:
        mine, taken = _run_in(0), _run_in(1)
        await writer.submit(L.Acquire(mine, "w", ttl_ms=60_000))
        _bump(url, 1)  # another coordinator took shard 1; this one has not noticed
        with pytest.raises(LedgerError) as err:
            await writer.submit(L.Acquire(taken, "w", ttl_ms=60_000))
        assert err.value.code is Code.STORAGE_UNAVAILABLE
        assert err.value.metadata == {"moved": "1"}
        assert _stored(url, taken) is None
        # shards still held go on committing
        await writer.submit(L.Acquire(_run_in(2), "w", ttl_ms=60_000))
        assert _stored(url, _run_in(2)) is not None
    finally:
        await writer.close()


async def test_revisions_after_a_take_are_above_every_earlier_block(url: str) -> None:
    clock = ManualClock(1_000_000)
    first = await _writer(url, clock, {0: _bump(url, 0, "a")})
    second = await _writer(url, clock, {1: _bump(url, 1, "b")})
    try:
        a = await first.submit(L.Acquire(_run_in(0), "w", ttl_ms=60_000))
        b = await second.submit(L.Acquire(_run_in(1), "w", ttl_ms=60_000))
        assert isinstance(a, Record) and isinstance(b, Record)
        assert a.revision // BLOCK != b.revision // BLOCK  # blocks of their own
        # shard 0 moves to the second: its next change is above the first's
        first.lead_only(Ownership(SHARDS, (), {}))
        await first.drop(frozenset({0}))
        epoch = _bump(url, 0, "b")
        second.storage.sharing_state.epochs = {  # type: ignore[attr-defined]
            **second.storage.sharing_state.epochs, 0: epoch}  # type: ignore[attr-defined]
        await second.take(frozenset({0}), {})
        second.lead_only(Ownership(SHARDS, {0, 1}, {}))
        again = await second.submit(L.Renew(_run_in(0), "w", a.fencing_token, ttl_ms=90_000))
        assert isinstance(again, Record) and again.revision > a.revision
    finally:
        await first.close()
        await second.close()


async def test_a_taker_treats_leases_stored_past_the_floor_as_renewed(url: str) -> None:
    clock = ManualClock(1_000_000)
    run = _run_in(2)
    first = await _writer(url, clock, {2: _bump(url, 2, "a")})
    acquired = await first.submit(L.Acquire(run, "w", ttl_ms=10_000))
    assert isinstance(acquired, Record)
    for _ in range(5):  # renewed from memory: the row keeps the first expiry
        clock.advance(4_000)
        await first.submit(L.Renew(run, "w", acquired.fencing_token))
    acknowledged = first.state.runs[run].lease.expires_at  # type: ignore[union-attr]
    first.storage.close()  # a crash: nothing flushed
    clock.advance(1_000)
    second = await _writer(url, clock, {2: _bump(url, 2, "b")})
    try:
        rec = second.state.runs[run]
        assert rec.lease is not None and rec.lease.expires_at >= acknowledged
        assert rec.lease.expires_at == clock.now_ms() + 10_000
        with pytest.raises(LedgerError) as err:
            await second.submit(L.Acquire(run, "thief", ttl_ms=1_000))
        assert err.value.code is Code.RUN_LEASE_HELD
    finally:
        await second.close()


async def test_a_take_names_the_revisions_of_its_extensions(url: str) -> None:
    """Writes no client made: the revisions a take extended leases at are
    reported (the torture harness tells them from the clients' writes by it)."""
    clock = ManualClock(1_000_000)
    runs = [_run_in(3, p) for p in ("a", "b")]
    first = await _writer(url, clock, {3: _bump(url, 3, "a")})
    for run in runs:
        await first.submit(L.Acquire(run, "w", ttl_ms=10_000))
    first.storage.close()  # a crash
    clock.advance(1_000)
    second = Writer(PostgresStorage(url, name="taker", shards=SHARDS), clock)
    second.storage.lead_shards()  # type: ignore[attr-defined]
    await second.start()
    try:
        second.storage.sharing_state.epochs = {3: _bump(url, 3, "b")}  # type: ignore[attr-defined]
        done = await second.take(frozenset({3}), {3: 500})
        assert done.runs == 2
        with psycopg.connect(url, autocommit=True) as db:
            got = db.execute("SELECT revision FROM fencepost.changes WHERE revision >= %s "
                             "ORDER BY revision", (done.first_revision,)).fetchall()
        assert [r[0] for r in got] == [done.first_revision, done.first_revision + 1]
        assert {second.state.runs[r].revision for r in runs} == {r[0] for r in got}
    finally:
        await second.close()


async def test_a_shard_given_up_is_not_checked_by_the_next_flushes(url: str) -> None:
    """Expiries renewed from memory on a shard since given up are not
    flushed by its old owner: its batches go on committing on the shards it
    still holds (they had all failed, the epoch of the shard given up moved)."""
    clock = ManualClock(1_000_000)
    storage = PostgresStorage(url, name="flusher", shards=SHARDS)
    storage.lead_shards()
    writer = Writer(storage, clock, lease_flush_ms=1_000)
    await writer.start()
    try:
        storage.sharing_state.epochs = {0: _bump(url, 0, "me"), 1: _bump(url, 1, "me")}
        writer.lead_only(Ownership(SHARDS, {0, 1}, {}))
        await writer.take(frozenset({0, 1}), {})
        run = _run_in(0)
        got = await writer.submit(L.Acquire(run, "w", ttl_ms=2_000))
        assert isinstance(got, Record)
        clock.advance(500)
        await writer.submit(L.Renew(run, "w", got.fencing_token))  # from memory
        writer.lead_only(Ownership(SHARDS, {1}, {}))
        await writer.drop(frozenset({0}))
        storage.sharing_state.epochs = {1: storage.sharing_state.epochs[1]}
        _bump(url, 0, "other")  # taken by another coordinator
        clock.advance(5_000)  # a flush is due
        for i in range(3):
            done = await writer.submit(L.Acquire(_run_in(1, f"s{i}"), "w", ttl_ms=60_000))
            assert isinstance(done, Record)
    finally:
        await writer.close()


def test_a_database_led_by_shards_is_refused_to_a_single_leader(url: str) -> None:
    storage = PostgresStorage(url, shards=SHARDS)
    storage.lead_shards()
    storage.open()
    storage.close()
    alone = PostgresStorage(url, shards=SHARDS)
    with pytest.raises(RuntimeError, match="--lead-shards"):
        postgres.prepare(alone)
    with psycopg.connect(url, autocommit=True) as db:
        holder, expires = db.execute(
            "SELECT holder, expires_at FROM fencepost.fencepost_leader").fetchone()  # type: ignore[misc]
    assert holder and expires > 1 << 60  # no single leader can take the row over


def test_a_database_led_alone_right_now_is_not_converted(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE fencepost.fencepost_leader SET holder = 'solo', address = 'x:1', "
                   "expires_at = (extract(epoch FROM clock_timestamp()) * 1000)::bigint + 60000")
    storage = PostgresStorage(url, shards=SHARDS)
    storage.lead_shards()
    with pytest.raises(RuntimeError, match="led by one coordinator"):
        storage.open()
    with psycopg.connect(url, autocommit=True) as db:
        assert db.execute("SELECT value FROM fencepost.meta WHERE key = 'lead_shards'"
                          ).fetchone() == (0,)
