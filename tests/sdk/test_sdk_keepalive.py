"""The KeepAlive stream as the worker sees it: one stream per client, loss
pushed for every cause without a call of the worker's own, safe-until and
at-risk, ``guard()``, reconnects, and closing that revokes nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from _proxy import Proxy

import fencepost
from fencepost import LeaseAtRiskError, LeaseLostError, LostReason, RunStatus
from fencepost.v1 import record_pb2, run_store_pb2, run_store_pb2_grpc
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

WAIT_S = 5.0  # upper bound for anything pushed; normally milliseconds
SLACK_S = 0.25  # event-loop latency allowed on a busy machine


async def tracked(server: ServerThread, run_id: str, present: bool = True) -> None:
    """Wait until the server tracks ``run_id`` on some KeepAlive stream (or no
    longer does): then a fence move is pushed, not learned after the fact."""
    hub = server.app.hub  # type: ignore[union-attr]
    deadline = time.monotonic() + WAIT_S
    while (run_id in hub.by_run) != present:
        assert time.monotonic() < deadline, f"{run_id!r} tracked={not present} on the server"
        await asyncio.sleep(0.005)


class Losses:
    """An ``on_lost`` callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[fencepost.Lease, LostReason]] = []

    def __call__(self, lease: fencepost.Lease, reason: LostReason) -> None:
        assert not lease.is_active and lease.lost.is_set()  # the state is already set
        self.calls.append((lease, reason))


@pytest.fixture
def losses() -> Losses:
    return Losses()


@pytest.fixture
async def holder(server: ServerThread, losses: Losses) -> AsyncIterator[fencepost.Client]:
    """The worker under test, told of losses through ``on_lost``."""
    async with fencepost.Client(server.address, owner="worker-a", on_lost=losses) as c:
        yield c


async def _version(client: fencepost.Client, run_id: str) -> int:
    return (await client.get(run_id)).version


# -- loss, for each cause, with no call of the holder's own ------------------------------


async def _raw_cas(rival: fencepost.Client, run_id: str, **changes: Any) -> None:
    store: run_store_pb2_grpc.RunStoreStub = rival.stubs.run_store  # type: ignore[assignment]
    cur = (await store.Get(run_store_pb2.GetRequest(run_id=run_id))).run  # type: ignore[misc]
    nxt = record_pb2.Run()
    nxt.CopyFrom(cur)
    nxt.version = cur.version + 1
    nxt.revision = 0
    for path, value in changes.items():
        obj: Any = nxt
        *parents, leaf = path.split("__")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    resp = await store.CompareAndSet(run_store_pb2.CompareAndSetRequest(  # type: ignore[misc]
        run_id=run_id, expected_version=cur.version, next=nxt))
    assert resp.swapped


@pytest.mark.parametrize(
    ("cause", "reason"),
    [
        ("takeover", LostReason.TAKEN_OVER),
        ("cancel", LostReason.CANCELLED),
        ("delete", LostReason.DELETED),
        ("raw_cas_token", LostReason.FENCE_MOVED),
        ("raw_cas_owner", LostReason.FENCE_MOVED),
    ],
)
async def test_loss_is_pushed_with_its_reason(
    server: ServerThread,
    clock: ManualClock,
    holder: fencepost.Client,
    rival: fencepost.Client,
    losses: Losses,
    cause: str,
    reason: LostReason,
) -> None:
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    await tracked(server, "run-1")
    if cause == "takeover":
        clock.advance(60_000)
        await rival.acquire("run-1")
    elif cause == "cancel":
        await rival.cancel("run-1", "operator says stop")
    elif cause == "delete":
        await rival.delete("run-1")
    elif cause == "raw_cas_token":
        await _raw_cas(rival, "run-1", fencing_token=lease.fencing_token + 1)
    else:
        await _raw_cas(rival, "run-1", lease__owner="intruder",
                       fencing_token=lease.fencing_token + 1)

    # the holder makes no call: the stream tells it
    await asyncio.wait_for(lease.lost.wait(), WAIT_S)
    assert lease.lost_reason is reason
    assert lease.is_lost and not lease.is_active and lease.at_risk
    assert lease.at_risk_event.is_set()
    assert losses.calls == [(lease, reason)]
    if cause == "delete":
        assert lease.record.fencing_token == lease.fencing_token  # no record after a delete
    else:
        assert lease.record.version > 1  # the record after the change came with the push

    # the next fenced call fails at once, locally, with the same reason
    before = None if cause == "delete" else await _version(rival, "run-1")
    with pytest.raises(LeaseLostError) as info:
        await lease.record_checkpoint("ckpt", 1)
    assert info.value.reason is reason and not isinstance(info.value, LeaseAtRiskError)
    with pytest.raises(LeaseLostError):
        lease.check()
    if before is not None:
        assert await _version(rival, "run-1") == before  # nothing reached the server
    assert losses.calls == [(lease, reason)]  # told once


async def test_finish_by_a_newer_handle_is_learned_on_reconnect(
    server: ServerThread, clock: ManualClock, rival: fencepost.Client, losses: Losses
) -> None:
    """The holder is cut off while its run is taken over and finished by
    another worker; when its stream reconnects, it learns it lost the run."""
    with Proxy(server.address) as proxy:
        async with fencepost.Client(proxy.address, owner="worker-a", on_lost=losses) as holder:
            lease = await holder.acquire("run-1", ttl_ms=1_000)
            await tracked(server, "run-1")
            sessions = holder.statistics().keepalive_streams_opened
            proxy.cut()
            await tracked(server, "run-1", present=False)  # the server saw the stream go
            clock.advance(1_000)
            theirs = await rival.acquire("run-1")
            await theirs.finish("completed")
            assert not lease.lost.is_set()  # nobody could tell the holder
            proxy.mend()
            await asyncio.wait_for(lease.lost.wait(), WAIT_S)
            assert lease.lost_reason is LostReason.FINISHED
            assert lease.record.status is RunStatus.COMPLETED
            assert losses.calls == [(lease, LostReason.FINISHED)]
            assert holder.statistics().keepalive_streams_opened > sessions


async def test_a_release_of_its_own_is_not_a_loss(
    server: ServerThread, holder: fencepost.Client, losses: Losses
) -> None:
    a = await holder.acquire("run-1", ttl_ms=300)  # renewed every 100 ms over the stream
    b = await holder.acquire("run-2", ttl_ms=300)
    await tracked(server, "run-1")
    await tracked(server, "run-2")
    await asyncio.sleep(0.35)
    await a.release()
    await b.finish()
    await asyncio.sleep(0.2)  # a renewal in flight would come back refused: ignored
    assert losses.calls == [] and not a.is_lost and not b.is_lost
    assert not a.at_risk and not b.at_risk
    assert holder.statistics().keepalive_streams_opened == 1


async def _stream_named(server: ServerThread, client: fencepost.Client) -> None:
    """Wait until the server knows the name of the client's open KeepAlive stream."""
    hub = server.app.hub  # type: ignore[union-attr]
    deadline = time.monotonic() + WAIT_S
    while not ((name := client.statistics().keepalive_stream_name) and name in hub.named):
        assert time.monotonic() < deadline, "the KeepAlive stream never named itself"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("drop", ["finish", "release", "suspend"])
async def test_a_lease_is_tracked_and_dropped_with_no_message_on_the_stream(
    server: ServerThread, holder: fencepost.Client, rival: fencepost.Client,
    losses: Losses, drop: str,
) -> None:
    """The acquire's commit tracks the lease on the client's stream, and the
    holder's own finish, release or suspend ends the tracking in its commit:
    a worker's lifecycle sends nothing on the KeepAlive stream, yet a fence
    moved in between is still pushed."""
    await holder.acquire("warm-up", ttl_ms=60_000)  # opens and names the stream
    await _stream_named(server, holder)
    sent = holder.statistics().keepalive_messages_sent
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    await tracked(server, "run-1")
    await getattr(lease, drop)()
    await tracked(server, "run-1", present=False)
    watched = await holder.acquire("run-2", ttl_ms=60_000)
    await rival.cancel("run-2", "operator says stop")
    await asyncio.wait_for(watched.lost.wait(), WAIT_S)
    assert watched.lost_reason is LostReason.CANCELLED
    assert losses.calls == [(watched, LostReason.CANCELLED)]
    assert holder.statistics().keepalive_messages_sent == sent


async def test_a_refused_finish_leaves_the_lease_tracked(
    server: ServerThread, holder: fencepost.Client, rival: fencepost.Client, losses: Losses
) -> None:
    await holder.acquire("warm-up", ttl_ms=60_000)
    await _stream_named(server, holder)
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    with pytest.raises(fencepost.FencepostError):
        await lease.finish("failed")  # a failed run needs an outcome code: refused
    assert lease.is_active
    await rival.cancel("run-1", "operator says stop")
    await asyncio.wait_for(lease.lost.wait(), WAIT_S)
    assert losses.calls == [(lease, LostReason.CANCELLED)]


async def test_an_acquire_before_the_stream_is_named_is_tracked_by_message(
    server: ServerThread, holder: fencepost.Client, rival: fencepost.Client, losses: Losses
) -> None:
    """The first acquire opens the stream, so it cannot name it: the client
    sends `track` as soon as the stream is up."""
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    await tracked(server, "run-1")
    assert holder.statistics().keepalive_messages_sent == 2  # hello, track
    await rival.cancel("run-1", "operator says stop")
    await asyncio.wait_for(lease.lost.wait(), WAIT_S)
    assert losses.calls == [(lease, LostReason.CANCELLED)]


# -- renewal and safe-until -----------------------------------------------------------


async def test_one_stream_renews_every_lease_and_moves_safe_until(
    server: ServerThread, holder: fencepost.Client
) -> None:
    ttl_s = 0.9  # renewed every 300 ms; at risk only if a commit took 600 ms
    t0 = time.monotonic()
    leases = [await holder.acquire(f"run-{i}", ttl_ms=int(ttl_s * 1000)) for i in range(3)]
    t1 = time.monotonic()
    for lease in leases:
        # from the acquire: its send time + the ttl granted
        assert t0 + ttl_s <= lease.safe_until <= t1 + ttl_s
        assert not lease.at_risk
    first = [lease.safe_until for lease in leases]
    await asyncio.sleep(0.7)  # two renewal intervals
    for lease, before in zip(leases, first, strict=True):
        assert lease.safe_until > before + 0.25
        assert lease.safe_until <= time.monotonic() + ttl_s
        assert not lease.at_risk and not lease.at_risk_event.is_set()
    assert server.app is not None  # renewed from memory: counted there, the version kept
    assert server.app.writer.stats.memory_renewals >= 2 * len(leases)
    assert holder.statistics().keepalive_streams_opened == 1


async def test_a_ttl_shorter_than_the_coalescing_window_is_renewed_at_its_pace(
    server: ServerThread, holder: fencepost.Client
) -> None:
    """A 120 ms lease (renewed every 40 ms, inside the 50 ms window in which
    renewals due together share a message) beside a long one: the acquire
    returns and the event loop keeps running. The scheduler once renewed such
    a lease again and again in one pass and never yielded (a hang)."""
    await holder.acquire("long", ttl_ms=60_000)
    short = await asyncio.wait_for(holder.acquire("short", ttl_ms=120), WAIT_S)
    assert server.app is not None
    stats = server.app.writer.stats  # renewals are answered from memory: count them there
    before = stats.memory_renewals
    ticks = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # the loop is free: this task runs
        await asyncio.sleep(0.01)
        ticks += 1
    renewals = stats.memory_renewals - before
    assert ticks >= 20, ticks
    # about 25 in a second; never a renewal per pass of a spinning scheduler
    assert 5 <= renewals <= 120, renewals
    assert short.is_active and not short.at_risk


async def test_leases_given_up_before_their_renewal_wake_nothing(
    server: ServerThread, holder: fencepost.Client
) -> None:
    """A client that runs many short runs: neither an acquire due after what
    the scheduler already waits for, nor a lease finished before its renewal
    was due, wakes the scheduler (a pass of it per run was a task switch per
    client per run)."""
    # ttl 1.5 s: each lease's renewal is due 500 ms after its acquire, well
    # after its finish even when a loaded machine makes a PostgreSQL commit
    # slow (at 600 ms, due after 200, one run in a CI run outlived it)
    first = await holder.acquire("short-0", ttl_ms=1500)
    await asyncio.sleep(0.05)  # the scheduler waits for it now
    stats = holder.statistics()
    before, messages = stats.renewal_passes, stats.keepalive_messages_sent
    started = time.monotonic()
    await first.finish()
    for i in range(1, 100):  # each due later than the one it waits for
        lease = await holder.acquire(f"short-{i}", ttl_ms=1500)
        await lease.finish()
    await asyncio.sleep(0.6)  # past every one's due time
    # a pass when the lease it waited for falls due (about one per 500 ms
    # while runs go on: more when a loaded machine makes the 99 runs slow),
    # never one per run (99 or more)
    allowed = min(4 + (time.monotonic() - started) / 0.5, 60)
    stats = holder.statistics()
    assert stats.renewal_passes - before <= allowed, (stats.renewal_passes - before, allowed)
    assert stats.keepalive_messages_sent == messages  # and none was renewed


async def test_safe_until_follows_a_write_that_shortens_the_lease(
    holder: fencepost.Client, clock: ManualClock
) -> None:
    """A renew may ask for a longer ttl, but a checkpoint extends by the ttl
    of the acquire (docs/SPEC.md §5.2): safe-until must come down with it, not keep
    the longer deadline."""
    lease = await holder.acquire("run-1", ttl_ms=10_000)
    await lease.renew(ttl_ms=120_000)
    assert lease.safe_until > time.monotonic() + 100
    clock.advance(1_000)
    sent = time.monotonic()
    rec = await lease.record_checkpoint("ckpt", 1)
    assert rec.lease is not None
    assert (rec.lease.expires_at - rec.updated_at).total_seconds() == 10  # the acquire's ttl
    assert sent + 10 <= lease.safe_until <= time.monotonic() + 10
    assert not lease.at_risk


async def test_expiring_marks_the_lease_at_risk_until_a_renewal(
    server: ServerThread, clock: ManualClock, holder: fencepost.Client
) -> None:
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    await tracked(server, "run-1")
    assert not lease.at_risk
    clock.advance(60_000)  # past expires_at; the holder's next renewal is 20 s away
    await asyncio.wait_for(lease.at_risk_event.wait(), WAIT_S)
    assert lease.at_risk and not lease.is_lost and lease.is_active
    assert lease.safe_until > time.monotonic()  # the local deadline alone had not passed
    with pytest.raises(LeaseAtRiskError) as info:
        lease.check()
    assert info.value.reason is LostReason.AT_RISK
    with pytest.raises(LeaseAtRiskError):
        async with lease.guard():
            pass
    # nobody took it: a renewal makes it safe again
    await lease.renew()
    assert not lease.at_risk and not lease.at_risk_event.is_set()
    lease.check()


async def test_closing_the_client_revokes_nothing_before_the_ttl(
    server: ServerThread, clock: ManualClock, rival: fencepost.Client
) -> None:
    client = fencepost.Client(server.address, owner="worker-a")
    lease = await client.acquire("run-1", ttl_ms=10_000)
    await tracked(server, "run-1")
    await client.aclose()
    await tracked(server, "run-1", present=False)  # the stream is gone
    rec = await rival.get("run-1")
    assert rec.version == 1 and rec.status is RunStatus.RUNNING
    assert rec.lease is not None and rec.lease.owner == "worker-a"
    with pytest.raises(fencepost.LeaseHeldError):
        await rival.acquire("run-1")
    clock.advance(9_999)
    with pytest.raises(fencepost.LeaseHeldError):
        await rival.acquire("run-1")
    clock.advance(1)
    theirs = await rival.acquire("run-1")
    assert theirs.record.attempt == 2 and not lease.is_lost  # nobody told the closed client


# -- guard() ---------------------------------------------------------------------------


@pytest.mark.parametrize("cause", ["reacquire", "cancel"])
async def test_guard_cancels_the_block_when_the_fence_moves(
    server: ServerThread,
    clock: ManualClock,
    holder: fencepost.Client,
    rival: fencepost.Client,
    cause: str,
) -> None:
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    await tracked(server, "run-1")
    written: list[int] = []
    attempts = 0
    cancelled_at: list[float] = []
    working = asyncio.Event()

    async def work() -> None:
        nonlocal attempts
        try:
            async with lease.guard():
                for i in range(1, 1_000_000):
                    attempts += 1
                    await lease.record_checkpoint(f"ckpt/{i}", i)
                    written.append(i)
                    if i == 3:
                        working.set()
                    await asyncio.sleep(0.005)
        except LeaseLostError:
            cancelled_at.append(time.monotonic())
            raise

    task = asyncio.create_task(work())
    await working.wait()
    moved_at = time.monotonic()
    # (A takeover after expiry is not possible here: each checkpoint renews.)
    if cause == "reacquire":
        newer = await holder.acquire("run-1")  # the same owner again: a new token
        moved = newer.record
    else:
        moved = await rival.cancel("run-1")
    with pytest.raises(LeaseLostError) as info:
        await asyncio.wait_for(task, WAIT_S)
    want = LostReason.TAKEN_OVER if cause == "reacquire" else LostReason.CANCELLED
    assert info.value.reason is want and lease.lost_reason is want
    assert cancelled_at[0] - moved_at < 1.0
    assert attempts <= len(written) + 1  # at most the one in flight when the fence moved

    # on the server: no write of the old handle after the move
    await asyncio.sleep(0.05)
    rec = await rival.get("run-1")
    assert rec.version == moved.version and rec.fencing_token == moved.fencing_token
    assert rec.checkpoint_ref is not None
    assert rec.checkpoint_ref.snapshot_version == written[-1]
    if cause == "reacquire":
        assert not newer.is_lost and not newer.at_risk  # the new handle is untouched
        await tracked(server, "run-1")
        assert server.app.hub.by_run["run-1"]  # type: ignore[union-attr]
        await newer.finish()


async def test_guard_lets_a_cancellation_from_outside_propagate(
    holder: fencepost.Client,
) -> None:
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    entered = asyncio.Event()

    async def work() -> None:
        async with lease.guard():
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(work())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lease.is_active and not lease._guards  # type: ignore[attr-defined]


async def test_guard_outside_cancellation_wins_over_a_loss(
    server: ServerThread, holder: fencepost.Client, rival: fencepost.Client
) -> None:
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    await tracked(server, "run-1")
    entered = asyncio.Event()

    async def work() -> None:
        async with lease.guard():
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(work())
    await entered.wait()
    task.cancel()  # from outside, and the loss lands before the task runs again
    lease._mark_lost(None, LostReason.DELETED)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_guard_on_a_lost_lease_raises_at_once(
    server: ServerThread, holder: fencepost.Client, rival: fencepost.Client
) -> None:
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    await tracked(server, "run-1")
    await rival.delete("run-1")
    await asyncio.wait_for(lease.lost.wait(), WAIT_S)
    ran = False
    with pytest.raises(LeaseLostError) as info:
        async with lease.guard():
            ran = True
    assert not ran and info.value.reason is LostReason.DELETED


async def test_guard_when_the_block_ends_before_the_cancellation_lands(
    holder: fencepost.Client,
) -> None:
    """The loss fires while the block runs without awaiting again: the guard
    still raises LeaseLostError, and no stray cancellation is left pending."""
    lease = await holder.acquire("run-1", ttl_ms=60_000)
    with pytest.raises(LeaseLostError):
        async with lease.guard():
            lease._mark_lost(None, LostReason.CANCELLED)  # as a push would, mid-block
    await asyncio.sleep(0)  # would raise CancelledError if one leaked
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_guard_keeps_the_blocks_own_lease_lost_error(
    server: ServerThread, clock: ManualClock, rival: fencepost.Client
) -> None:
    """Unary renewal: the loss is learned from the block's own fenced call;
    that LeaseLostError comes out, with no cancellation left behind."""
    async with fencepost.Client(server.address, owner="worker-a", renewal="unary") as client:
        lease = await client.acquire("run-1", ttl_ms=60_000)
        clock.advance(60_000)
        await rival.acquire("run-1")
        with pytest.raises(LeaseLostError) as info:
            async with lease.guard():
                await lease.record_checkpoint("ckpt", 1)
        assert info.value.code == "RUN_LEASE_LOST" and info.value.reason is LostReason.TAKEN_OVER
        await asyncio.sleep(0)
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


# -- cut off from the coordinator (real time) ------------------------------------------


@pytest.fixture
def live_server(make_server: Any) -> Iterator[ServerThread]:
    with make_server() as srv:  # SystemClock
        yield srv


@pytest.mark.slow
async def test_unreachable_server_puts_the_lease_at_risk_then_reconnect_renews(
    live_server: ServerThread,
) -> None:
    ttl_s = 0.6
    async with fencepost.Client(live_server.address, owner="worker-a") as client:
        long = await client.acquire("long", ttl_ms=8_000)
        t_sent = time.monotonic()
        short = await client.acquire("short", ttl_ms=int(ttl_s * 1000))
        t_acquired = time.monotonic()
        entered = asyncio.Event()
        cancelled_at: list[float] = []

        async def work() -> None:
            try:
                async with short.guard():
                    entered.set()
                    await asyncio.sleep(60)
            except LeaseAtRiskError:
                cancelled_at.append(time.monotonic())
                raise

        task = asyncio.create_task(work())
        await entered.wait()
        await asyncio.to_thread(live_server.stop)  # unreachable from here on
        t_stopped = time.monotonic()

        with pytest.raises(LeaseAtRiskError):
            await asyncio.wait_for(task, 3)
        t_cancelled = cancelled_at[0]
        assert short.at_risk and short.at_risk_event.is_set() and not short.is_lost
        # safe-until: a send time before the server stopped + the ttl, never later
        assert t_sent + ttl_s <= short.safe_until <= t_stopped + ttl_s
        if short.safe_until <= t_acquired + ttl_s:  # no stream renewal got answered
            assert t_cancelled <= t_acquired + ttl_s + SLACK_S
        # cancelled at safe-until: not before, and only loop latency after
        assert short.safe_until <= t_cancelled <= short.safe_until + SLACK_S
        assert not long.at_risk  # 8 s: still safe

        sessions = client.statistics().keepalive_streams_opened
        long_until = long.safe_until
        await asyncio.to_thread(live_server.start)  # same port and file
        deadline = time.monotonic() + 5
        while long.safe_until <= long_until or short.at_risk:
            assert time.monotonic() < deadline, "no renewal after the restart"
            await asyncio.sleep(0.02)
        assert client.statistics().keepalive_streams_opened > sessions
        assert not long.at_risk and long.is_active
        # nobody took the short one while we were away: renewed, safe again
        assert not short.is_lost and not short.at_risk_event.is_set()
        async with fencepost.Client(live_server.address, owner="worker-b") as rival:
            for run_id in ("long", "short"):
                with pytest.raises(fencepost.LeaseHeldError):
                    await rival.acquire(run_id)
        await long.finish()
        await short.finish()
