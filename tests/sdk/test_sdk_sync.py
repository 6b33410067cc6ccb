"""SyncClient over a real server, and the pytest fixtures of fencepost.testing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import fencepost
from fencepost import RunStatus, SyncClient
from fencepost.testing import fencepost_client, fencepost_server  # noqa: F401
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

BOTH_TRANSPORTS = True  # tests using `transport` run over the Execute stream and unary


@pytest.fixture
def sync_client(server: ServerThread, transport: str) -> Iterator[SyncClient]:
    with SyncClient(server.address, owner="worker-a",
                    transport=transport) as client:  # type: ignore[arg-type]
        yield client


def test_sync_lease_lifecycle(sync_client: SyncClient, clock: ManualClock) -> None:
    with sync_client.acquire("run-1", ttl_ms=10_000) as lease:
        assert isinstance(lease, fencepost.SyncLease)
        assert (lease.run_id, lease.owner, lease.fencing_token) == ("run-1", "worker-a", 1)
        clock.advance(1_000)
        rec = lease.record_checkpoint("ckpt/1", 1)
        assert rec.checkpoint_ref is not None and rec.checkpoint_ref.snapshot_version == 1
        assert lease.renew(ttl_ms=20_000).lease is not None
        assert lease.record.version == 3
    assert not lease.is_active
    assert sync_client.get("run-1").status is RunStatus.QUEUED  # released on exit

    lease = sync_client.acquire("run-1")
    assert lease.suspend(["a"]).status is RunStatus.SUSPENDED
    assert sync_client.request_resume("run-1").status is RunStatus.QUEUED
    lease = sync_client.acquire("run-1")
    assert lease.finish("failed", "boom", "why").outcome == fencepost.Outcome("boom", "why")


def test_sync_exception_in_block_releases(sync_client: SyncClient) -> None:
    with pytest.raises(RuntimeError, match="worker crashed"):
        with sync_client.acquire("run-1"):
            raise RuntimeError("worker crashed")
    assert sync_client.get("run-1").status is RunStatus.QUEUED


def test_sync_lost_is_a_threading_event(sync_client: SyncClient) -> None:
    lease = sync_client.acquire("run-1")
    assert not lease.lost.is_set()
    cancelled = sync_client.cancel("run-1", "stop")
    assert cancelled.outcome == fencepost.Outcome("cancelled", "stop")
    with pytest.raises(fencepost.LeaseLostError) as info:
        lease.renew()
    assert info.value.record is not None and info.value.record.status is RunStatus.CANCELLED
    assert lease.lost.wait(1) and lease.is_lost


def test_sync_operator_calls(sync_client: SyncClient) -> None:
    for i in range(5):
        sync_client.acquire(f"run-{i}").release()
    it = sync_client.list(page_size=2)
    assert next(it).run_id == "run-0"
    assert [r.run_id for r in it] == ["run-1", "run-2", "run-3", "run-4"]
    assert list(sync_client.list(statuses=["running"])) == []
    assert len(list(sync_client.list(statuses=[RunStatus.QUEUED]))) == 5
    fence = sync_client.validate_fence("run-0", 1)
    assert fence.found and not fence.current and fence.status is RunStatus.QUEUED
    assert sync_client.delete("run-0").fencing_token == 1
    with pytest.raises(fencepost.RunNotFoundError):
        sync_client.get("run-0")
    resp = sync_client.stubs.ledger.GetRun(fencepost.v1.ledger_pb2.GetRunRequest(run_id="run-1"))
    assert resp.run.run_id == "run-1"


def test_closed_sync_client_refuses_calls(server: ServerThread) -> None:
    client = SyncClient(server.address)
    client.close()
    client.close()  # idempotent
    assert client.closed
    with pytest.raises(fencepost.ClientClosedError, match="closed"):
        client.get("run-1")


@pytest.fixture
def fencepost_db(db: str) -> str:
    """fencepost.testing's hook: its server runs on this test's backend."""
    return db


def test_testing_fixtures(
    fencepost_db: str,
    fencepost_server: ServerThread,  # noqa: F811
    fencepost_client: SyncClient,  # noqa: F811
) -> None:
    assert fencepost_server.db_path == fencepost_db
    assert isinstance(fencepost_server.clock, ManualClock)
    lease = fencepost_client.acquire("run-1", ttl_ms=60_000)  # no renewal due during the test
    assert lease.owner == "test-worker"
    fencepost_server.clock.advance(60_000)
    with SyncClient(fencepost_server.address, owner="someone-else") as other:
        theirs = other.acquire("run-1")
        assert theirs.fencing_token == 2
    with pytest.raises(fencepost.LeaseLostError):
        lease.record_checkpoint("k", 1)


# -- loss, at-risk and guard() for threaded code -----------------------------------------


def _wait_tracked(server: ServerThread, run_id: str) -> None:
    hub = server.app.hub  # type: ignore[union-attr]
    deadline = time.monotonic() + 5
    while run_id not in hub.by_run:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_sync_on_lost_runs_on_its_own_thread(server: ServerThread, transport: str) -> None:
    calls: list[tuple[fencepost.SyncLease, fencepost.LostReason, str, RunStatus]] = []
    done = threading.Event()

    def on_lost(lease: fencepost.SyncLease, reason: fencepost.LostReason) -> None:
        # not the loop thread: the callback may call the client
        status = client.get(lease.run_id).status
        calls.append((lease, reason, threading.current_thread().name, status))
        done.set()

    with SyncClient(server.address, owner="worker-a", on_lost=on_lost,
                    transport=transport) as client:  # type: ignore[arg-type]
        lease = client.acquire("run-1", ttl_ms=60_000)
        _wait_tracked(server, "run-1")
        with SyncClient(server.address, owner="operator",
                        transport=transport) as op:  # type: ignore[arg-type]
            op.cancel("run-1", "stop")
        assert done.wait(5)
        assert lease.lost.is_set() and lease.at_risk_event.is_set()
        assert lease.lost_reason is fencepost.LostReason.CANCELLED
        (who, reason, thread, status), = calls
        assert who is lease and reason is fencepost.LostReason.CANCELLED
        assert thread.startswith("fencepost-callbacks") and status is RunStatus.CANCELLED
        with pytest.raises(fencepost.LeaseLostError):
            lease.check()
        with pytest.raises(fencepost.LeaseLostError):
            lease.finish()


def test_sync_guard_raises_when_the_block_exits_after_a_loss(
    server: ServerThread, sync_client: SyncClient
) -> None:
    lease = sync_client.acquire("run-1", ttl_ms=60_000)
    _wait_tracked(server, "run-1")
    assert lease.safe_until > time.monotonic() and not lease.at_risk
    steps = 0
    with pytest.raises(fencepost.LeaseLostError) as info:
        with lease.guard():
            sync_client.delete("run-1")  # the fence moves under the worker thread
            while not lease.lost.wait(0.01):
                steps += 1
            # a thread is not cancelled: it sees the event and stops by itself
    assert info.value.reason is fencepost.LostReason.DELETED
    assert lease.is_lost and lease.at_risk
    with pytest.raises(fencepost.LeaseLostError):
        with lease.guard():  # already lost: refuses to start
            pass
    # an exception of the block's own wins
    lease2 = sync_client.acquire("run-2", ttl_ms=60_000)
    with pytest.raises(KeyError):
        with lease2.guard():
            lease2._lease._mark_lost(None, fencepost.LostReason.CANCELLED)
            raise KeyError("boom")


def test_sync_expiring_sets_at_risk_and_guard_reports_it(
    server: ServerThread, clock: ManualClock, sync_client: SyncClient
) -> None:
    lease = sync_client.acquire("run-1", ttl_ms=60_000)
    _wait_tracked(server, "run-1")
    with pytest.raises(fencepost.LeaseAtRiskError):
        with lease.guard():
            clock.advance(60_000)
            assert lease.at_risk_event.wait(5)
            with pytest.raises(fencepost.LeaseAtRiskError):
                lease.check()
            lease.renew()  # nobody took it: safe again ...
            assert not lease.at_risk and not lease.at_risk_event.is_set()
            lease.check()
    # ... but the block ran through a moment at risk, and is told so
    assert not lease.is_lost and lease.is_active
    with lease.guard():
        pass
    lease.finish()
    assert not lease.at_risk


def test_sync_client_renewal_choice(server: ServerThread) -> None:
    with SyncClient(server.address, renewal="unary") as client:
        assert client.renewal == "unary"
        client.acquire("run-1").release()
    with pytest.raises(ValueError, match="renewal"):
        SyncClient(server.address, renewal="carrier-pigeon")  # type: ignore[arg-type]


def test_sync_client_transport_choice(server: ServerThread) -> None:
    with SyncClient(server.address, transport="unary") as client:
        client.acquire("run-1").release()
        assert client.statistics().execute_streams_opened == 0
    with SyncClient(server.address, command_window_ms=0.5) as client:
        client.acquire("run-2").release()
    with pytest.raises(ValueError, match="transport"):
        SyncClient(server.address, transport="carrier-pigeon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="command_window_ms"):
        SyncClient(server.address, command_window_ms=2.0)
