"""The worker's view: acquire, the lease handle and its fenced calls, over a
real server whose clock the test drives."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

import fencepost
from fencepost import LeaseLostError, RunStatus
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

BOTH_TRANSPORTS = True  # tests using `transport` run over the Execute stream and unary

T0 = datetime.fromtimestamp(1_700_000_000, tz=UTC)  # tests/conftest.py's ManualClock start


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


async def test_acquire_is_awaitable_and_returns_a_lease(client: fencepost.Client) -> None:
    lease = await client.acquire("run-1", ttl_ms=30_000)
    assert isinstance(lease, fencepost.Lease)
    assert (lease.run_id, lease.owner, lease.fencing_token) == ("run-1", "worker-a", 1)
    rec = lease.record
    assert rec.status is RunStatus.RUNNING
    assert rec.version == 1 and rec.attempt == 1
    assert rec.lease is not None and rec.lease.owner == "worker-a"
    assert rec.lease.acquired_at == T0 and rec.lease.expires_at == at(30_000)
    assert rec.lease.ttl_ms == 30_000
    assert rec.created_at.tzinfo is not None and rec.created_at == T0
    assert lease.is_active and not lease.is_lost and not lease.lost.is_set()
    await lease.release()


async def test_context_manager_releases_an_unfinished_lease(
    client: fencepost.Client, rival: fencepost.Client
) -> None:
    async with client.acquire("run-1") as lease:
        assert (await client.get("run-1")).status is RunStatus.RUNNING
    assert not lease.is_active
    rec = await client.get("run-1")
    assert rec.status is RunStatus.QUEUED and rec.lease is None
    # released, so another owner gets it at once, keeping the attempt
    other = await rival.acquire("run-1")
    assert other.fencing_token == 2 and other.record.attempt == 1


async def test_context_manager_leaves_a_finished_run_alone(client: fencepost.Client) -> None:
    async with client.acquire("run-1") as lease:
        done = await lease.finish("completed")
    assert done.status is RunStatus.COMPLETED
    rec = await client.get("run-1")
    assert rec.status is RunStatus.COMPLETED and rec.version == done.version


async def test_exception_in_block_releases_and_propagates(client: fencepost.Client) -> None:
    with pytest.raises(ZeroDivisionError):
        async with client.acquire("run-1"):
            1 / 0  # noqa: B018
    assert (await client.get("run-1")).status is RunStatus.QUEUED


async def test_failed_release_never_masks_the_blocks_exception(
    client: fencepost.Client,
) -> None:
    with pytest.raises(KeyError):
        async with client.acquire("run-1") as lease:
            await client.cancel("run-1")  # the fence moves under the worker
            with pytest.raises(LeaseLostError):
                await lease.renew()
            raise KeyError("boom")
    assert lease.is_lost
    assert (await client.get("run-1")).status is RunStatus.CANCELLED


async def test_clean_exit_after_an_unnoticed_loss_does_not_raise(
    client: fencepost.Client,
) -> None:
    async with client.acquire("run-1") as lease:
        await client.cancel("run-1", message="operator says stop")
    # the exit's release found the fence moved: nothing of ours to release
    assert lease.is_lost
    assert lease.record.status is RunStatus.CANCELLED


async def test_cancelled_block_still_releases(client: fencepost.Client) -> None:
    entered = asyncio.Event()

    async def worker() -> None:
        async with client.acquire("run-1"):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(worker())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await client.get("run-1")).status is RunStatus.QUEUED


async def test_renew_extends_from_server_now(client: fencepost.Client, clock: ManualClock) -> None:
    lease = await client.acquire("run-1", ttl_ms=10_000)
    clock.advance(4_000)
    rec = await lease.renew()
    assert rec.lease is not None
    assert rec.lease.expires_at == at(14_000) and rec.lease.acquired_at == T0
    clock.advance(1_000)
    rec = await lease.renew(ttl_ms=120_000)
    assert rec.lease is not None and rec.lease.expires_at == at(125_000)
    assert lease.ttl_ms == 120_000
    assert lease.record == rec
    await lease.release()


async def test_record_checkpoint(client: fencepost.Client, clock: ManualClock) -> None:
    lease = await client.acquire("run-1", ttl_ms=10_000)
    clock.advance(2_500)
    rec = await lease.record_checkpoint("ckpt/run-1/7", snapshot_version=7)
    assert rec.checkpoint_ref == fencepost.CheckpointRef("ckpt/run-1/7", 7, at(2_500))
    assert rec.lease is not None and rec.lease.expires_at == at(12_500)  # renewed too
    assert (await client.get("run-1")).checkpoint_ref == rec.checkpoint_ref
    await lease.release()


async def test_suspend_then_resume_then_acquire(client: fencepost.Client) -> None:
    lease = await client.acquire("run-1")
    rec = await lease.suspend(["approval-2", "approval-1"])
    assert rec.status is RunStatus.SUSPENDED and rec.lease is None
    assert rec.suspension is not None
    assert rec.suspension.pending_approval_ids == ("approval-2", "approval-1")
    assert not lease.is_active and not lease.is_lost
    with pytest.raises(fencepost.RunSuspendedError) as info:
        await client.acquire("run-1")
    assert info.value.record is not None
    assert info.value.record.status is RunStatus.SUSPENDED
    resumed = await client.request_resume("run-1")
    assert resumed.status is RunStatus.QUEUED and resumed.suspension is None
    again = await client.acquire("run-1")
    assert again.fencing_token == 2 and again.record.attempt == 1
    await again.release()


@pytest.mark.parametrize(
    ("status", "code", "message", "want_code"),
    [
        ("completed", None, None, "ok"),
        (RunStatus.COMPLETED, None, "all good", "ok"),
        ("cancelled", None, None, "cancelled"),
        ("FAILED", "boom", "disk on fire", "boom"),
    ],
)
async def test_finish(
    client: fencepost.Client,
    status: RunStatus | str,
    code: str | None,
    message: str | None,
    want_code: str,
) -> None:
    lease = await client.acquire("run-1")
    rec = await lease.finish(status, code, message)
    assert rec.status is fencepost._records.parse_status(status)
    assert rec.outcome == fencepost.Outcome(want_code, message)
    assert rec.lease is None and not lease.is_active
    # a retry by the same handle converges on the same record
    again = await lease.finish(status, code, message)
    assert again == rec


async def test_finish_refused_keeps_the_lease(client: fencepost.Client) -> None:
    lease = await client.acquire("run-1")
    with pytest.raises(fencepost.ValidationError) as info:
        await lease.finish("failed")  # a failed run needs an outcome
    assert info.value.field == "outcome"
    with pytest.raises(fencepost.ValidationError) as info:
        await lease.finish("running")
    assert info.value.field == "status"
    with pytest.raises(ValueError, match="unknown run status"):
        await lease.finish("done")
    assert lease.is_active
    assert (await lease.renew()).status is RunStatus.RUNNING
    await lease.finish("failed", "crashed")


async def test_takeover_makes_the_next_fenced_call_raise_lease_lost(
    server: ServerThread, rival: fencepost.Client, clock: ManualClock, transport: str
) -> None:
    # unary renewal: nothing pushes the loss, the server's refusal is mapped
    async with fencepost.Client(server.address, owner="worker-a", renewal="unary",
                                transport=transport) as client:  # type: ignore[arg-type]
        await _takeover_then_fenced_call(client, rival, clock)


async def _takeover_then_fenced_call(
    client: fencepost.Client, rival: fencepost.Client, clock: ManualClock
) -> None:
    lease = await client.acquire("run-1", ttl_ms=60_000)
    clock.advance(60_000)  # expired at exactly acquired_at + ttl
    theirs = await rival.acquire("run-1")
    assert theirs.fencing_token == lease.fencing_token + 1
    assert theirs.record.attempt == 2
    assert not lease.lost.is_set()
    with pytest.raises(LeaseLostError) as info:
        await lease.record_checkpoint("ckpt", 1)
    err = info.value
    assert err.code == "RUN_LEASE_LOST"
    assert err.record is not None and err.record.fencing_token == theirs.fencing_token
    assert err.record.lease is not None and err.record.lease.owner == "worker-b"
    assert lease.lost.is_set() and lease.is_lost and not lease.is_active
    assert lease.record == err.record
    assert err.reason is fencepost.LostReason.TAKEN_OVER
    assert lease.lost_reason is fencepost.LostReason.TAKEN_OVER
    for call in (lease.renew(), lease.suspend(), lease.finish(), lease.release()):
        with pytest.raises(LeaseLostError):
            await call
    await theirs.finish()


async def test_background_renewal_notices_an_operator_cancel(
    server: ServerThread, transport: str
) -> None:
    # ttl 300 ms: the renewer renews every 100 ms of real time
    async with fencepost.Client(server.address, owner="worker-a",
                                transport=transport) as client:  # type: ignore[arg-type]
        lease = await client.acquire("run-1", ttl_ms=300)
        await client.cancel("run-1")
        await asyncio.wait_for(lease.lost.wait(), timeout=5)
        assert lease.is_lost
        assert lease.record.status is RunStatus.CANCELLED


async def test_validate_fence(
    client: fencepost.Client, rival: fencepost.Client, clock: ManualClock
) -> None:
    lease = await client.acquire("run-1", ttl_ms=60_000)
    fence = await client.validate_fence("run-1", lease.fencing_token)
    assert fence == fencepost.FenceStatus(True, True, 1, RunStatus.RUNNING, fence.revision)
    clock.advance(60_000)
    await rival.acquire("run-1")
    fence = await client.validate_fence("run-1", lease.fencing_token)
    assert (fence.current, fence.found, fence.fencing_token) == (False, True, 2)
    missing = await client.validate_fence("nope", 1)
    assert (missing.current, missing.found, missing.status) == (False, False, None)


async def test_delete_keeps_the_token_moving(client: fencepost.Client) -> None:
    lease = await client.acquire("run-1")
    await lease.renew()
    deleted = await client.delete("run-1")
    assert deleted.fencing_token == 1 and deleted.revision > 0
    with pytest.raises(fencepost.RunNotFoundError):
        await client.get("run-1")
    with pytest.raises(LeaseLostError):
        await lease.renew()
    again = await client.acquire("run-1")
    assert again.fencing_token == 2


async def test_list_pages_and_filters(client: fencepost.Client, rival: fencepost.Client) -> None:
    for i in range(5):
        await client.acquire(f"run-{i}")
    theirs = await rival.acquire("run-9")
    await theirs.suspend()
    ids = [r.run_id async for r in client.list(page_size=2)]
    assert ids == ["run-0", "run-1", "run-2", "run-3", "run-4", "run-9"]
    suspended = [r.run_id async for r in client.list(statuses=["suspended"])]
    assert suspended == ["run-9"]
    mine = [r.run_id async for r in client.list(owner="worker-a", page_size=1)]
    assert mine == ["run-0", "run-1", "run-2", "run-3", "run-4"]
    both = [r.run_id async for r in client.list(statuses=[RunStatus.SUSPENDED, "queued"])]
    assert both == ["run-9"]


async def test_closing_the_client_stops_renewals(server: ServerThread, transport: str) -> None:
    client = fencepost.Client(server.address, owner="worker-a",
                              transport=transport)  # type: ignore[arg-type]
    lease = await client.acquire("run-1", ttl_ms=300)
    await client.aclose()
    before = await _get_version(server, "run-1")
    await asyncio.sleep(0.35)  # > 3 renewal intervals
    assert await _get_version(server, "run-1") == before
    assert lease.is_active  # closing does not release: the lease lives out its ttl
    with pytest.raises(fencepost.ClientClosedError, match="closed"):
        await client.get("run-1")


async def _get_version(server: ServerThread, run_id: str) -> int:
    async with fencepost.Client(server.address) as c:
        return (await c.get(run_id)).version


def test_wire_times_convert_exactly_and_their_cache_stays_bounded() -> None:
    """Converted times are remembered (a run's records repeat most of theirs),
    exactly to the millisecond, and the memory of them is bounded."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from fencepost._records import _TIMES, _TIMES_MAX, time_from_pb

    base = 1_764_650_000_123
    for i in range(3 * _TIMES_MAX):
        ms = base + i * 997
        ts = Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000 + 456_789)
        want = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
        assert time_from_pb(ts) == want and time_from_pb(ts) == want
        assert len(_TIMES) <= _TIMES_MAX
    early = Timestamp(seconds=-1, nanos=999_000_000)  # 1969-12-31T23:59:59.999Z
    assert time_from_pb(early) == datetime(1969, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC)


async def test_renewal_off_leaves_renewing_to_the_caller(
    server: ServerThread, clock: ManualClock, rival: fencepost.Client
) -> None:
    """``renewal="off"`` keeps nothing alive: no KeepAlive stream, no lease
    kept, and the lease expires at its ttl unless the caller renews it."""
    async with (
        fencepost.Client(server.address, owner="worker-a", renewal="off") as client,
        fencepost.Client(server.address, owner="worker-b") as renewing,
    ):
        assert client.renewal == "off"
        lease = await client.acquire("run-1", ttl_ms=10_000)
        await renewing.acquire("control", ttl_ms=10_000)
        assert renewing.statistics().leases_kept == 1  # what the default does
        stats = client.statistics()
        assert stats.leases_kept == 0 and stats.keepalive_streams_opened == 0
        clock.advance(6_000)
        await lease.renew()  # the caller's own renewal: to server-now + 10 s
        clock.advance(6_000)
        with pytest.raises(fencepost.LeaseHeldError):
            await rival.acquire("run-1")  # renewed: still held
        clock.advance(10_001)
        taken = await rival.acquire("run-1")  # nobody renewed it since: expired
        assert taken.fencing_token == lease.fencing_token + 1
        after = client.statistics()
        assert after.keepalive_streams_opened == 0 and after.keepalive_messages_sent == 0
    with pytest.raises(ValueError, match="renewal"):
        fencepost.Client(server.address, renewal="sometimes")  # type: ignore[arg-type]


async def test_statistics_count_what_the_client_sent(server: ServerThread) -> None:
    async with fencepost.Client(server.address, owner="worker-a") as client:
        first = client.statistics()
        assert first == fencepost.ClientStatistics(
            endpoints=(server.address,), leases_kept=0, keepalive_streams_opened=0,
            keepalive_messages_sent=0, keepalive_stream_name="", renewal_passes=0,
            execute_stream_open=False, execute_streams_opened=0, execute_messages_sent=0,
            execute_commands_sent=0,
        )
        with pytest.raises(dataclasses.FrozenInstanceError):
            first.leases_kept = 3  # type: ignore[misc]
        lease = await client.acquire("run-1", ttl_ms=60_000)  # unary: the stream opens
        deadline = asyncio.get_running_loop().time() + 5
        while not (stats := client.statistics()).execute_stream_open or (
                not stats.keepalive_stream_name):
            assert asyncio.get_running_loop().time() < deadline, stats
            await asyncio.sleep(0.005)
        assert stats.leases_kept == 1 and stats.keepalive_streams_opened == 1
        assert stats.execute_streams_opened == 1
        await lease.finish()  # one command on the Execute stream
        done = client.statistics()
        assert done.leases_kept == 0
        assert done.execute_commands_sent == stats.execute_commands_sent + 1
        assert done.execute_messages_sent == stats.execute_messages_sent + 1
