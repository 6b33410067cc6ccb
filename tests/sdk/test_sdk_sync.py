"""SyncClient over a real server, and the pytest fixtures of fencepost.testing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import fencepost
from fencepost import RunStatus, SyncClient
from fencepost.testing import fencepost_client, fencepost_server  # noqa: F401
from fencepost_server.clock import ManualClock
from fencepost_server.harness import ServerThread


@pytest.fixture
def sync_client(server: ServerThread) -> Iterator[SyncClient]:
    with SyncClient(server.address, owner="worker-a") as client:
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
    with pytest.raises(RuntimeError, match="closed"):
        client.get("run-1")


def test_testing_fixtures(
    fencepost_server: ServerThread,  # noqa: F811
    fencepost_client: SyncClient,  # noqa: F811
) -> None:
    assert isinstance(fencepost_server.clock, ManualClock)
    lease = fencepost_client.acquire("run-1", ttl_ms=60_000)  # no renewal due during the test
    assert lease.owner == "test-worker"
    fencepost_server.clock.advance(60_000)
    with SyncClient(fencepost_server.address, owner="someone-else") as other:
        theirs = other.acquire("run-1")
        assert theirs.fencing_token == 2
    with pytest.raises(fencepost.LeaseLostError):
        lease.record_checkpoint("k", 1)
