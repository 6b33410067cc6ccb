"""The batch of a coordinator leading shards apart (storage/shared.py), on a
real PostgreSQL: it commits only while every shard it touches still holds
the epoch it was taken under; revisions come in blocks above every block
before a take; a taker extends the leases its floor says; the database is
converted once and refused to a coordinator that would lead alone."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fencepost_devtools.pgcluster import Cluster
from fencepost_server.core import engine as E
from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.placement import Ownership
from fencepost_server.core.records import Record, Status
from fencepost_server.core.shards import shard_of
from fencepost_server.storage import postgres
from fencepost_server.storage.engine_sql import WriterHooks
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.storage.shared import BLOCK
from fencepost_server.testing.clock import ManualClock
from fencepost_server.upkeep.retention import Retention
from fencepost_server.writer import Reads, Writer

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


async def _writer(url: str, clock: ManualClock, shards: dict[int, int], **kw: Any) -> Writer:
    """A writer leading ``shards`` (shard -> epoch) of the database."""
    storage = PostgresStorage(url, name=f"w-{uuid.uuid4().hex[:6]}", shards=SHARDS)
    storage.lead_shards()
    writer = Writer(storage, clock, **kw)
    writer.attach_engine(WriterHooks())
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


async def test_retention_on_each_coordinator_retires_the_runs_of_its_own_shards(
        url: str) -> None:
    clock = ManualClock(1_000_000)
    first = await _writer(url, clock, {0: _bump(url, 0, "a"), 1: _bump(url, 1, "a")})
    second = await _writer(url, clock, {2: _bump(url, 2, "b"), 3: _bump(url, 3, "b")})
    first.lead_only(Ownership(SHARDS, {0, 1}, {2: ("b:1", 1), 3: ("b:1", 1)}))
    second.lead_only(Ownership(SHARDS, {2, 3}, {0: ("a:1", 1), 1: ("a:1", 1)}))
    runs = {s: [r for r in (f"ret-{i}" for i in range(400)) if shard_of(r, SHARDS) == s][:3]
            for s in range(SHARDS)}
    readers: list[Reads] = []
    try:
        for shard, ids in runs.items():
            w = first if shard < 2 else second
            for run_id in ids:
                rec = await w.submit(L.Acquire(run_id, "w", ttl_ms=60_000))
                assert isinstance(rec, Record)
                await w.submit(L.Finish(run_id, "w", rec.fencing_token, Status.COMPLETED))
        clock.advance(10_000)
        for w in (first, second):
            reads = Reads(w.storage, lambda w=w: w.state)  # type: ignore[misc]
            readers.append(reads)
            retired = await Retention(w, reads, clock, 5_000).run_once()
            assert retired == 6  # its own shards' runs, never another's (NOT_OWNER)
        with psycopg.connect(url, autocommit=True) as db:
            assert db.execute("SELECT count(*) FROM fencepost.runs").fetchone() == (0,)
    finally:
        for reads in readers:
            await reads.close()
        await first.close()
        await second.close()


async def test_the_history_is_pruned_oldest_committed_first_whoever_committed_it(
        url: str) -> None:
    clock = ManualClock(1_000_000)
    other = await _writer(url, clock, {1: _bump(url, 1, "a")})
    pruner = await _writer(url, clock, {0: _bump(url, 0, "b")}, history_revisions=4,
                           prune_every_ms=3_600_000)
    pruner.leads_shard_zero(True)
    try:
        def changes() -> list[tuple[str, int]]:
            with psycopg.connect(url, autocommit=True) as db:
                return db.execute("SELECT run_id, committed_at FROM fencepost.changes "
                                  "ORDER BY committed_at, revision").fetchall()

        for i in range(3):  # the pruner's block is above the other's: revisions say nothing
            clock.advance(10)
            await pruner.submit(L.Acquire(_run_in(0, f"p{i}"), "w"))
        for i in range(3):
            clock.advance(10)
            await other.submit(L.Acquire(_run_in(1, f"o{i}"), "w"))
        assert len(changes()) == 6
        with psycopg.connect(url, autocommit=True) as db:
            revision = dict(db.execute("SELECT run_id, revision FROM fencepost.changes").fetchall())
        clock.advance(10)
        await pruner.submit(L.Acquire(_run_in(0, "last"), "w"))  # prunes (every 4 revisions)
        kept = changes()
        # the newest 4 by commit time: the other's three (lower revisions) and the last;
        # by revision the pruner would have kept its own three and dropped the other's
        assert [r for r, _ in kept] == [_run_in(1, "o0"), _run_in(1, "o1"), _run_in(1, "o2"),
                                        _run_in(0, "last")]
        # each shard's highest pruned revision, for a watch by shards resuming in it
        with psycopg.connect(url, autocommit=True) as db:
            pruned = dict(db.execute(
                "SELECT shard, revision FROM fencepost.changes_pruned").fetchall())
        assert pruned[0] == revision[_run_in(0, "p2")]
        assert pruned.get(1, 0) < revision[_run_in(1, "o0")]
    finally:
        await other.close()
        await pruner.close()


async def test_only_the_uploads_of_coordinators_gone_are_swept(url: str) -> None:
    clock = ManualClock(1_000_000)
    staging = await _writer(url, clock, {0: _bump(url, 0, "a")})
    sweeping = await _writer(url, clock, {1: _bump(url, 1, "b")})
    try:
        await staging.submit(E.StageChunk("live-upload", 0, b"x"))  # type: ignore[arg-type]
        with psycopg.connect(url, autocommit=True) as db:
            db.execute("INSERT INTO fencepost.fencepost_members VALUES (%s, 'a:1', 0, %s)",
                       (staging.storage.name, 1 << 60))  # type: ignore[attr-defined]
            db.execute("INSERT INTO fencepost.engine_uploads VALUES ('gone-upload', 1, "
                       "'fencepost-writer gone')")
        swept = await sweeping.submit(E.SweepUploads(abandoned_only=True))  # type: ignore[arg-type]
        assert isinstance(swept, E.Done) and swept.at == 1
        with psycopg.connect(url, autocommit=True) as db:
            assert db.execute("SELECT upload_id FROM fencepost.engine_uploads").fetchall() == [
                ("live-upload",)]
    finally:
        await staging.close()
        await sweeping.close()


async def test_renewals_of_a_shard_given_up_never_hold_up_a_later_batch(url: str) -> None:
    clock = ManualClock(1_000_000)
    epochs = {0: _bump(url, 0, "me"), 1: _bump(url, 1, "me")}
    writer = await _writer(url, clock, epochs, lease_flush_ms=1_000)
    try:
        moving = _run_in(1, "mv")
        # a short ttl: its stored expiry falls below the next floor, so the flush copies it
        rec = await writer.submit(L.Acquire(moving, "w", ttl_ms=2_000))
        assert isinstance(rec, Record)
        clock.advance(100)
        await writer.submit(L.Renew(moving, "w", rec.fencing_token))  # from memory: to flush
        assert moving in writer.renewals.dirty
        _bump(url, 1)  # another coordinator took shard 1
        writer.lead_only(Ownership(SHARDS, {0}, {1: ("other:1", 9)}))
        await writer.drop(frozenset({1}))
        writer.storage.sharing_state.epochs = {0: epochs[0]}  # type: ignore[attr-defined]
        clock.advance(5_000)  # a flush cycle is due: it rides on the next batch
        for i in range(3):
            got = await writer.submit(L.Acquire(_run_in(0, f"s{i}"), "w", ttl_ms=60_000))
            assert isinstance(got, Record)
        assert writer.stats.failed_commits == 0
    finally:
        await writer.close()


def test_the_databases_shard_function_follows_the_shard_rule(url: str) -> None:
    """fencepost_shard (the index a taker reads a shard's runs by) against
    the shared vectors and core.shards.shard_of."""
    vectors = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "shards.json")
                         .read_text("utf-8"))
    cases = [(v["key"], v["shards"], v["shard"]) for v in vectors["vectors"]]
    cases += [(f"run-{i}", n, shard_of(f"run-{i}", n)) for i in range(300) for n in (7, 64)]
    with psycopg.connect(url, autocommit=True) as db:
        got = [db.execute("SELECT fencepost.fencepost_shard(%s, %s)", (k, n)).fetchone()[0]
               for k, n, _ in cases]
    assert got == [want for _, _, want in cases]


async def test_a_retaken_shard_holds_nothing_stale_from_a_give_up_cut_short(url: str) -> None:
    """A coordinator that lost a shard without forgetting it (its give-up
    failed: the database was down) and later takes it again must decide from
    what the database holds now, not from the runs left in its memory."""
    clock = ManualClock(1_000_000)
    a = await _writer(url, clock, {1: _bump(url, 1, "a")})
    b: Writer | None = None
    try:
        run = _run_in(1, "stale")
        first = await a.submit(L.Acquire(run, "w", ttl_ms=60_000))
        assert isinstance(first, Record) and first.fencing_token == 1
        a.lead_only(Ownership(SHARDS, (), {}))  # lost, and never dropped from memory
        b = await _writer(url, clock, {1: _bump(url, 1, "b")})
        cancelled = await b.submit(L.Cancel(run))
        assert isinstance(cancelled, Record) and cancelled.status is Status.CANCELLED
        await b.drop(frozenset({1}))
        epoch = _bump(url, 1, "a")  # a takes it again
        a.storage.sharing_state.epochs = {1: epoch}  # type: ignore[attr-defined]
        await a.take(frozenset({1}), {})
        a.lead_only(Ownership(SHARDS, {1}, {}))
        assert run not in a.state.runs or a.state.runs[run].status is Status.CANCELLED
        with pytest.raises(LedgerError) as err:
            await a.submit(L.Acquire(run, "w2", ttl_ms=60_000))
        assert err.value.code is not Code.RUN_LEASE_HELD  # refused as finished, not as held
        with psycopg.connect(url, autocommit=True) as db:
            stored = db.execute("SELECT status FROM fencepost.runs WHERE run_id = %s",
                                (run,)).fetchone()
        assert stored == (int(Status.CANCELLED),)
    finally:
        await a.close()
        if b is not None:
            await b.close()


async def test_reads_answer_only_for_shards_led_now(url: str) -> None:
    """Runs memory still holds for a shard being given up are never listed or
    read; nor is anything while the shard rows may have lapsed."""
    clock = ManualClock(1_000_000)
    writer = await _writer(url, clock, {0: _bump(url, 0, "a"), 1: _bump(url, 1, "a")})
    reads = Reads(writer.storage, lambda: writer.state, writer.leads_key)
    try:
        kept, leaving = _run_in(0, "keep"), _run_in(1, "leave")
        for run in (kept, leaving):
            await writer.submit(L.Acquire(run, "w", ttl_ms=60_000))
        writer.lead_only(Ownership(SHARDS, {0}, {1: ("other:1", 9)}))  # not dropped yet
        assert leaving in writer.state.runs
        page, more = await reads.page_runs(frozenset(), "", 100)
        assert [r.run_id for r in page] == [kept] and not more
        with pytest.raises(LedgerError) as err:
            writer.check_led(leaving)
        assert err.value.code is Code.NOT_OWNER
        writer.check_led(kept)
        sure = False
        writer.lead_while(lambda: sure)  # the shard rows not renewed in time
        assert (await reads.page_runs(frozenset(), "", 100))[0] == []
        with pytest.raises(LedgerError) as err:
            writer.check_led(kept)
        assert err.value.code is Code.NOT_OWNER and err.value.metadata["owner"] == ""  # type: ignore[index]
    finally:
        await reads.close()
        await writer.close()
