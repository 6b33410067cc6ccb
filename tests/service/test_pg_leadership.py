"""The leader's epoch on a real PostgreSQL, in process: a deposed leader's
batch commits nothing, a takeover ends the sessions of an expired leader that
holds the leader row mid-batch, and the takeover's gap extends live leases.

Lost connections too (found by the torture harness's PostgreSQL mode): a
COMMIT whose connection is lost before the answer comes back is asked about
(``txid_status``), so a batch that did commit is answered as committed and one
that did not as "nothing changed"; and after PostgreSQL restarts, reads fail
with STORAGE_UNAVAILABLE (not INTERNAL) while it is down and work again once
it is back, on new connections."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2, ledger_pb2_grpc
from fencepost_devtools.pgcluster import Cluster
from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.ha.leadership import Leadership, writer_name
from fencepost_server.storage import postgres
from fencepost_server.storage.postgres import PgConnection, PostgresStorage
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread
from fencepost_server.writer import Writer

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def cluster(pg_cluster: Cluster) -> Cluster:
    """The session's PostgreSQL (tests/conftest.py); each test gets its own database."""
    return pg_cluster


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
    storage.lead(took.epoch)
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


# -- lost connections ---------------------------------------------------------------


def _revision(url: str) -> int:
    with psycopg.connect(url) as db:
        row = db.execute("SELECT max(revision) FROM fencepost.changes").fetchone()
        return int(row[0] or 0) if row else 0


async def _writer(url: str) -> Writer:
    storage = PostgresStorage(url, name="lost-commit")
    writer = Writer(storage, ManualClock())
    await writer.start()
    return writer


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "not-committed"])
async def test_a_commit_lost_with_its_connection_is_answered_as_it_ended(
    url: str, monkeypatch: pytest.MonkeyPatch, committed: bool
) -> None:
    writer = await _writer(url)
    real = PgConnection.execute

    def lose_the_commit(self: PgConnection, sql: str, params: Any = ()) -> Any:
        if sql != "COMMIT":
            return real(self, sql, params)
        if committed:  # the COMMIT reaches the server; its answer is lost
            real(self, sql, params)
        self.conn.close()  # the connection is gone (before the COMMIT, or after it)
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    try:
        before = _revision(url)
        monkeypatch.setattr(PgConnection, "execute", lose_the_commit)
        if committed:
            got = await writer.submit(L.Acquire("r", "w", 60_000, request_id="rid-1"))
            assert got.fencing_token == 1  # type: ignore[union-attr]
        else:
            with pytest.raises(LedgerError) as refused:
                await writer.submit(L.Acquire("r", "w", 60_000, request_id="rid-1"))
            assert refused.value.code is Code.STORAGE_UNAVAILABLE
        monkeypatch.setattr(PgConnection, "execute", real)
        assert _revision(url) == before + (1 if committed else 0)
        # the writer's state is the database's, so the next batch commits
        again = await writer.submit(L.Acquire("r2", "w", 60_000))
        assert again.revision == before + (2 if committed else 1)  # type: ignore[union-attr]
        assert _revision(url) == again.revision  # type: ignore[union-attr]
    finally:
        monkeypatch.setattr(PgConnection, "execute", real)
        await writer.close()


def _reason(err: grpc.RpcError) -> str:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return ""


def test_reads_during_and_after_a_postgres_restart(cluster: Cluster, url: str) -> None:
    with ServerThread(url, clock=ManualClock(), max_clock_skew="0", leader_lease="60s",
                      leader_renew="1s") as srv, \
            grpc.insecure_channel(srv.address) as ch:
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        engine = engine_store_pb2_grpc.EngineStoreStub(ch)

        def read() -> None:
            engine.LatestCheckpoint(epb.EngineLatestCheckpointRequest(run_id="r"), timeout=10)
            ledger.ListRuns(ledger_pb2.ListRunsRequest(page_size=10), timeout=10)

        read()  # the readers' connections are open
        cluster.kill()
        with pytest.raises(grpc.RpcError) as down:
            engine.LatestCheckpoint(epb.EngineLatestCheckpointRequest(run_id="r"), timeout=10)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE, down.value
        assert _reason(down.value) == "STORAGE_UNAVAILABLE", down.value
        cluster.restart()
        for _ in range(3):  # every pooled connection was broken: each is replaced
            read()


def test_the_lost_commit_probe_treats_a_never_logged_transaction_as_aborted(url: str) -> None:
    storage = PostgresStorage(url, name="probe")
    storage.open()
    try:
        db = postgres.connect(url, "test")
        try:
            row = db.execute("SELECT txid_current()").fetchone()
            assert row is not None
            future = int(row[0]) + 1_000_000
        finally:
            db.close()
        assert storage._committed_after_all(future) is False
    finally:
        storage.close()
