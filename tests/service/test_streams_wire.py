"""KeepAlive and WatchRuns on the wire (docs/SPEC.md §6), with generated async stubs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from _records import bump
from _wire import run_all

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc, run_store_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

COMPLETED = rpb.RUN_STATUS_COMPLETED


class Stream:
    """A KeepAlive stream driven from a test. A background task reads into a
    queue: cancelling a pending read() would cancel the whole call."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                for one in msg.batch or [msg]:  # the server may coalesce messages
                    self.inbox.put_nowait(one)
        except BaseException as exc:  # surfaced by recv()
            self.inbox.put_nowait(exc)
        else:
            self.inbox.put_nowait(grpc.aio.EOF)

    async def send(self, **kind: Any) -> None:
        await self.call.write(pb.KeepAliveRequest(**kind))

    async def recv(self, wait_s: float = 3.0) -> pb.KeepAliveResponse:
        msg = await asyncio.wait_for(self.inbox.get(), wait_s)
        if isinstance(msg, BaseException):
            raise msg
        assert msg is not grpc.aio.EOF, "stream ended"
        return msg  # type: ignore[no-any-return]

    async def nothing(self, within: float = 0.3) -> None:
        await asyncio.sleep(within)
        assert self.inbox.empty(), f"unexpected message {self.inbox.get_nowait()}"


@pytest.fixture
async def aio(server: ServerThread) -> AsyncIterator[tuple[Any, Any]]:
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ledger_pb2_grpc.LedgerStub(ch), run_store_pb2_grpc.RunStoreStub(ch)


async def open_stream(ledger: Any, owner: str) -> Stream:
    s = Stream(ledger.KeepAlive())
    await s.send(hello=pb.KeepAliveHello(owner=owner))
    return s


async def acquire(ledger: Any, run_id: str, owner: str, **kw: Any) -> rpb.Run:
    return (await ledger.Acquire(pb.AcquireRequest(run_id=run_id, owner=owner, **kw))).run


async def test_renew_answers_renewed_with_remaining_ttl(aio, clock) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    run = await acquire(ledger, "r", "w", lease_ttl_ms=2_000)
    s = await open_stream(ledger, "w")
    clock.advance(500)
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token))
    msg = await s.recv()
    assert msg.WhichOneof("kind") == "renewed"
    assert msg.renewed.ttl_remaining_ms == 2_000
    assert msg.renewed.expires_at.ToMilliseconds() == clock.now_ms() + 2_000
    await s.send(
        renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token, lease_ttl_ms=5_000)
    )
    assert (await s.recv()).renewed.ttl_remaining_ms == 5_000


async def test_first_message_must_be_hello(aio) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    call = ledger.KeepAlive()
    await call.write(pb.KeepAliveRequest(track=pb.KeepAliveTrack(run_id="r", fencing_token=1)))
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call.read()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello" in (ei.value.details() or "")


async def test_per_run_errors_do_not_close_the_stream(aio) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    run = await acquire(ledger, "r", "w")
    s = await open_stream(ledger, "w")
    await s.send(renew=pb.KeepAliveRenew(run_id="", fencing_token=1))
    err = (await s.recv()).error
    assert err.code == "RUN_VALIDATION_ERROR" and "run_id" in err.message
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=1, lease_ttl_ms=1))
    assert (await s.recv()).error.code == "RUN_VALIDATION_ERROR"
    await s.send(hello=pb.KeepAliveHello(owner="again"))
    assert (await s.recv()).error.code == "RUN_VALIDATION_ERROR"
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token))
    assert (await s.recv()).WhichOneof("kind") == "renewed"


@pytest.mark.parametrize("cause", ["takeover", "cancel", "delete", "raw_cas", "raw_cas_owner"])
async def test_lost_is_pushed_for_each_cause(aio, clock, cause: str) -> None:  # type: ignore[no-untyped-def]
    ledger, store = aio
    run = await acquire(ledger, "r", "w1", lease_ttl_ms=1_000)
    s = await open_stream(ledger, "w1")
    await s.send(track=pb.KeepAliveTrack(run_id="r", fencing_token=run.fencing_token))
    await s.nothing(0.1)
    if cause == "takeover":
        clock.advance(1_000)
        await acquire(ledger, "r", "w2")
        want = pb.LOST_REASON_TAKEN_OVER
    elif cause == "cancel":
        await ledger.Cancel(pb.CancelRequest(run_id="r"))
        want = pb.LOST_REASON_CANCELLED
    elif cause == "delete":
        await ledger.DeleteRun(pb.DeleteRunRequest(run_id="r"))
        want = pb.LOST_REASON_DELETED
    else:
        nxt = bump(run)
        if cause == "raw_cas":
            nxt.fencing_token = run.fencing_token + 1
        else:
            nxt.lease.owner = "intruder"  # a new holder: the token must move too
            nxt.fencing_token = run.fencing_token + 1
        assert (
            await store.CompareAndSet(
                spb.CompareAndSetRequest(run_id="r", expected_version=run.version, next=nxt)
            )
        ).swapped
        want = pb.LOST_REASON_FENCE_MOVED
    msg = await s.recv()
    if cause == "takeover" and msg.WhichOneof("kind") == "expiring":
        msg = await s.recv()  # the lease expired before it was taken: both are pushed
    lost = msg.lost
    assert (lost.run_id, lost.fencing_token, lost.reason) == ("r", run.fencing_token, want)
    assert lost.HasField("record") == (cause != "delete")
    await s.nothing(0.1)  # pushed once: no longer tracked


async def test_finish_by_another_handle_is_finished(aio) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    run = await acquire(ledger, "r", "w1")
    observer = await open_stream(ledger, "observer")
    holder = await open_stream(ledger, "w1")
    for s in (observer, holder):
        await s.send(track=pb.KeepAliveTrack(run_id="r", fencing_token=run.fencing_token))
    await ledger.Finish(
        pb.FinishRequest(run_id="r", owner="w1", fencing_token=run.fencing_token, status=COMPLETED)
    )
    lost = (await observer.recv()).lost
    assert lost.reason == pb.LOST_REASON_FINISHED and lost.record.status == COMPLETED
    await holder.nothing(0.3)  # the holder's own finish is not a loss


async def test_track_after_the_fact_reports_at_once(aio, clock) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    old = await acquire(ledger, "r", "w1", lease_ttl_ms=1_000)
    clock.advance(1_000)
    new = await acquire(ledger, "r", "w2")
    await ledger.Finish(
        pb.FinishRequest(run_id="r", owner="w2", fencing_token=new.fencing_token, status=COMPLETED)
    )
    s = await open_stream(ledger, "w1")
    await s.send(track=pb.KeepAliveTrack(run_id="r", fencing_token=old.fencing_token))
    assert (await s.recv()).lost.reason == pb.LOST_REASON_FINISHED
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=old.fencing_token))
    assert (await s.recv()).lost.reason == pb.LOST_REASON_FINISHED


async def test_expiring_when_renewals_stop_and_rearmed_by_renewal(aio, clock) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    run = await acquire(ledger, "r", "w", lease_ttl_ms=1_000)
    s = await open_stream(ledger, "w")
    await s.send(track=pb.KeepAliveTrack(run_id="r", fencing_token=run.fencing_token))
    clock.advance(999)
    await s.nothing(0.15)
    clock.advance(1)
    exp = (await s.recv()).expiring
    assert (exp.run_id, exp.fencing_token) == ("r", run.fencing_token)
    assert exp.expires_at.ToMilliseconds() == clock.now_ms()
    await s.nothing(0.15)  # once per expiry
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token))
    assert (await s.recv()).WhichOneof("kind") == "renewed"  # expired but not taken: renewable
    clock.advance(1_000)
    assert (await s.recv()).WhichOneof("kind") == "expiring"


async def test_renewals_move_the_expiry_and_the_expiry_heap_keeps_one_entry_per_run(
    aio, clock, server  # type: ignore[no-untyped-def]
) -> None:
    """A renewal that moves the expiry later adds no heap entry (the earlier one
    re-arms when it comes due), so `expiring` comes once, at the latest expiry;
    one that moves it earlier (a shorter ttl) is armed at once."""
    ledger, _ = aio
    hub = server.app.hub
    run = await acquire(ledger, "r", "w", lease_ttl_ms=1_000)
    s = await open_stream(ledger, "w")
    await s.send(track=pb.KeepAliveTrack(run_id="r", fencing_token=run.fencing_token))
    await s.nothing(0.1)
    for _ in range(5):
        clock.advance(600)  # past the first expiry's entry, never the lease's
        await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token))
        renewed = (await s.recv()).renewed
        assert renewed.expires_at.ToMilliseconds() == clock.now_ms() + 1_000
        await s.nothing(0.1)
    assert len(hub._deadlines) == 1  # not one per renewal
    last = renewed.expires_at.ToMilliseconds()
    clock.advance(999)
    await s.nothing(0.15)
    clock.advance(1)
    exp = (await s.recv()).expiring
    assert exp.expires_at.ToMilliseconds() == last == clock.now_ms()
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token,
                                         lease_ttl_ms=60_000))
    assert (await s.recv()).WhichOneof("kind") == "renewed"
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token,
                                         lease_ttl_ms=500))  # earlier than the armed 60 s
    short = (await s.recv()).renewed.expires_at.ToMilliseconds()
    assert short == clock.now_ms() + 500
    clock.advance(500)
    assert (await s.recv()).expiring.expires_at.ToMilliseconds() == short


async def test_two_streams_tracking_one_run_each_get_lost_and_untrack_alone(
    aio, server  # type: ignore[no-untyped-def]
) -> None:
    ledger, _ = aio
    hub = server.app.hub
    run = await acquire(ledger, "r", "w")
    a, b, c = [await open_stream(ledger, "w") for _ in range(3)]
    for s in (a, b, c):
        await s.send(track=pb.KeepAliveTrack(run_id="r", fencing_token=run.fencing_token))
    await a.send(untrack=pb.KeepAliveUntrack(run_id="r"))
    await a.nothing(0.2)
    assert len(hub.by_run["r"]) == 2  # type: ignore[arg-type]
    await b.send(untrack=pb.KeepAliveUntrack(run_id="r"))
    await b.nothing(0.2)
    assert hub.by_run["r"] in hub.sessions  # one session left: held as itself, not a set
    await ledger.Cancel(pb.CancelRequest(run_id="r"))
    assert (await c.recv()).lost.reason == pb.LOST_REASON_CANCELLED
    await a.nothing(0.2)
    await b.nothing(0)
    assert "r" not in hub.by_run


async def test_untrack_stops_pushes(aio) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    run = await acquire(ledger, "r", "w")
    s = await open_stream(ledger, "w")
    await s.send(track=pb.KeepAliveTrack(run_id="r", fencing_token=run.fencing_token))
    await s.send(untrack=pb.KeepAliveUntrack(run_id="r"))
    await asyncio.sleep(0.05)
    await ledger.Cancel(pb.CancelRequest(run_id="r"))
    await s.nothing(0.3)


async def test_closing_the_stream_revokes_nothing(aio, server) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    run = await acquire(ledger, "r", "w", lease_ttl_ms=10_000)
    s = await open_stream(ledger, "w")
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token))
    await s.recv()
    s.call.cancel()
    await asyncio.sleep(0.1)
    rec = server.writer.state.runs["r"]
    assert rec.fencing_token == run.fencing_token and rec.lease.owner == "w"


# -- WatchRuns --------------------------------------------------------------------------


async def collect(call: Any, n: int, wait_s: float = 5.0) -> list[pb.WatchRunsResponse]:
    async def take() -> list[pb.WatchRunsResponse]:
        return [await call.read() for _ in range(n)]

    return await asyncio.wait_for(take(), wait_s)


async def test_watch_live_and_filtered(aio) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    all_ = ledger.WatchRuns(pb.WatchRunsRequest())
    only_b = ledger.WatchRuns(pb.WatchRunsRequest(run_ids=["b"]))
    await asyncio.sleep(0.1)  # let the watches subscribe
    a = await acquire(ledger, "a", "w")
    await acquire(ledger, "b", "w")
    await ledger.DeleteRun(pb.DeleteRunRequest(run_id="a"))
    got = await collect(all_, 3)
    assert [(m.revision, m.run_id, m.kind) for m in got] == [
        (1, "a", pb.CHANGE_KIND_PUT),
        (2, "b", pb.CHANGE_KIND_PUT),
        (3, "a", pb.CHANGE_KIND_DELETE),
    ]
    assert got[0].record == a and not got[2].HasField("record")
    got_b = await collect(only_b, 1)
    assert got_b[0].run_id == "b"
    all_.cancel()
    only_b.cancel()


async def test_watch_replays_then_goes_live_without_gap_or_dup(aio) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    for i in range(30):
        await acquire(ledger, f"r{i}", "w")
    call = ledger.WatchRuns(pb.WatchRunsRequest(from_revision=11))
    writer = asyncio.gather(*(acquire(ledger, f"s{i}", "w") for i in range(30)))
    got = await collect(call, 50)
    await writer
    assert [m.revision for m in got] == list(range(11, 61))
    call.cancel()


async def test_watch_rejects_compacted_revisions(make_server: Any) -> None:
    clock = ManualClock()
    with make_server(clock=clock, history_revisions=10, prune_every_s=0) as srv:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            for i in range(25):
                await acquire(ledger, f"r{i}", "w")
            call = ledger.WatchRuns(pb.WatchRunsRequest(from_revision=3))
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call.read()
            assert ei.value.code() == grpc.StatusCode.OUT_OF_RANGE
            ok = ledger.WatchRuns(pb.WatchRunsRequest(from_revision=16))
            assert [m.revision for m in await collect(ok, 10)] == list(range(16, 26))
            ok.cancel()


async def test_a_watcher_that_never_reads_is_dropped_not_the_writer(make_server: Any) -> None:
    with make_server(stream_queue_limit=200) as srv:
        # no BDP probing: the window stays at 64 KiB, as for a client that stalled
        async with grpc.aio.insecure_channel(
            srv.address, options=[("grpc.http2.bdp_probe", 0)]
        ) as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            slow = ledger.WatchRuns(pb.WatchRunsRequest())
            await asyncio.sleep(0.1)
            big = "x" * 400  # fill the HTTP/2 window quickly
            for i in range(600):
                await ledger.Acquire(pb.AcquireRequest(run_id=f"{big}{i}", owner="w"))
            assert srv.writer.state.revision == 600  # the writer never waited

            async def drain() -> grpc.StatusCode:
                try:
                    async for _ in slow:
                        pass
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return grpc.StatusCode.OK

            assert await asyncio.wait_for(drain(), 20) == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_stream_and_fence_check_agree_on_who_holds(aio) -> None:  # type: ignore[no-untyped-def]
    """A raw write that keeps token and lease owner keeps the fence: the stream
    must not call the handle lost while its fenced writes still pass the fence."""
    ledger, store = aio
    run = await acquire(ledger, "r", "w")
    s = await open_stream(ledger, "w")
    await s.send(track=pb.KeepAliveTrack(run_id="r", fencing_token=run.fencing_token))
    nxt = bump(run)
    nxt.status = rpb.RUN_STATUS_QUEUED  # same token, same lease owner
    assert (await store.CompareAndSet(spb.CompareAndSetRequest(
        run_id="r", expected_version=run.version, next=nxt))).swapped
    await s.nothing(0.3)
    nxt2 = bump(nxt)
    nxt2.lease.owner = "someone-else"
    nxt2.fencing_token = nxt.fencing_token + 1
    assert (await store.CompareAndSet(spb.CompareAndSetRequest(
        run_id="r", expected_version=nxt.version, next=nxt2))).swapped
    assert (await s.recv()).lost.reason == pb.LOST_REASON_FENCE_MOVED


async def test_watch_from_a_future_revision_sends_nothing_before_it(aio) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    await acquire(ledger, "a", "w")  # revision 1
    call = ledger.WatchRuns(pb.WatchRunsRequest(from_revision=4))
    await asyncio.sleep(0.1)
    for i in range(4):
        await acquire(ledger, f"b{i}", "w")  # revisions 2..5
    got = await collect(call, 2)
    assert [m.revision for m in got] == [4, 5]
    call.cancel()


async def test_shutdown_ends_streams_with_shutting_down(aio, server) -> None:  # type: ignore[no-untyped-def]
    from _wire import wire_error

    ledger, _ = aio
    run = await acquire(ledger, "r", "w")
    s = await open_stream(ledger, "w")
    await s.send(renew=pb.KeepAliveRenew(run_id="r", fencing_token=run.fencing_token))
    await s.recv()
    await asyncio.get_running_loop().run_in_executor(None, server.stop)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await s.recv()
    e = wire_error(ei.value)
    assert (e.code, e.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    server.start()


async def test_streams_opened_as_the_server_stops_end_at_once(aio, server) -> None:  # type: ignore[no-untyped-def]
    """A stream whose call the server took just as it began to stop (after it
    ended the open ones) ends at once too, rather than holding the stop for
    its grace period."""
    from _wire import wire_error

    ledger, _ = aio
    assert server.app is not None and server.app.hub is not None
    hub = server.app.hub

    async def begin_stop() -> None:
        hub.shutdown()  # what App.stop does before it stops the gRPC server

    await asyncio.get_running_loop().run_in_executor(None, server.call, begin_stop)
    # an Execute stream ends before it reads anything (a command written to
    # it could meet the stream already ended); KeepAlive's ends after hello
    execute, keepalive = ledger.Execute(), ledger.KeepAlive()
    await keepalive.write(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")))
    watch = ledger.WatchRuns(pb.WatchRunsRequest())
    for call in (execute, keepalive, watch):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            msg = await asyncio.wait_for(call.read(), 5)
            assert msg is grpc.aio.EOF, msg  # no answer, and no OK ending
        e = wire_error(ei.value)
        assert (e.code, e.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")


async def test_many_renewals_in_one_message_answered_in_one_batch(aio, clock) -> None:  # type: ignore[no-untyped-def]
    ledger, _ = aio
    runs = [await acquire(ledger, f"r{i}", "w", lease_ttl_ms=2_000) for i in range(50)]
    call = ledger.KeepAlive()
    await call.write(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")))
    clock.advance(100)
    await call.write(pb.KeepAliveRequest(renews=[
        pb.KeepAliveRenew(run_id=r.run_id, fencing_token=r.fencing_token) for r in runs]
        + [pb.KeepAliveRenew(run_id="r0", fencing_token=99)]))  # one stale: lost
    got: list[pb.KeepAliveResponse] = []
    messages = 0
    while len(got) < 51:
        msg = await asyncio.wait_for(call.read(), 5)
        messages += 1
        got.extend(msg.batch or [msg])
    kinds = [m.WhichOneof("kind") for m in got]
    assert kinds.count("renewed") == 50 and kinds.count("lost") == 1
    assert messages < 51  # coalesced
    assert {m.renewed.run_id for m in got if m.renewed.run_id} == {r.run_id for r in runs}
    call.cancel()


async def test_a_full_writer_queue_holds_renewals_back_instead_of_refusing(aio, server) -> None:  # type: ignore[no-untyped-def]
    """More renewals in one KeepAlive message than the writer's queue holds
    (16 384): the stream stops reading until there is room; every renewal is
    answered `renewed`, none refused with STORAGE_UNAVAILABLE."""
    ledger, _ = aio
    n = server.writer._queue.maxsize + 2_000
    acquired = await run_all(ledger, pb.ExecuteRequest(commands=[
        pb.Command(id=i, acquire=pb.AcquireRequest(run_id=f"k{i}", owner="w")) for i in range(n)]))
    assert {r.WhichOneof("kind") for r in acquired.values()} == {"acquire"}
    call = ledger.KeepAlive()
    await call.write(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")))
    await call.write(pb.KeepAliveRequest(renews=[
        pb.KeepAliveRenew(run_id=f"k{i}", fencing_token=acquired[i].acquire.run.fencing_token)
        for i in range(n)]))
    got: list[pb.KeepAliveResponse] = []
    while len(got) < n:
        msg = await asyncio.wait_for(call.read(), 30)
        got.extend(msg.batch or [msg])
    kinds = {m.WhichOneof("kind") for m in got}
    assert kinds == {"renewed"}, [m.error for m in got if m.HasField("error")][:3]
    assert len({m.renewed.run_id for m in got}) == n
    call.cancel()


# -- tracked by the acquire (AcquireRequest.track_on) ------------------------------------


async def named_stream(ledger: Any, owner: str, name: str, hub: Any) -> Stream:
    """A KeepAlive stream whose hello names it; returns once the server knows the name."""
    s = Stream(ledger.KeepAlive())
    await s.send(hello=pb.KeepAliveHello(owner=owner, stream_name=name))
    for _ in range(300):
        if name in hub.named:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"stream {name!r} not registered")


async def execute_acquire(ledger: Any, run_id: str, owner: str, **kw: Any) -> pb.AcquireResponse:
    call = ledger.Execute()
    await call.write(pb.ExecuteRequest(commands=[pb.Command(
        id=1, acquire=pb.AcquireRequest(run_id=run_id, owner=owner, **kw))]))
    result = (await call.read()).results[0]
    await call.done_writing()
    assert result.WhichOneof("kind") == "acquire", result
    return result.acquire


@pytest.mark.parametrize("transport", ["unary", "execute"])
async def test_an_acquire_tracks_its_lease_on_the_stream_it_names(
    aio, server, transport: str  # type: ignore[no-untyped-def]
) -> None:
    ledger, _ = aio
    s = await named_stream(ledger, "w", "stream-1", server.app.hub)
    if transport == "unary":
        resp = await ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w", track_on="stream-1"))
    else:
        resp = await execute_acquire(ledger, "r", "w", track_on="stream-1")
    assert resp.tracked and resp.run.fencing_token == 1
    assert server.app.hub.by_run["r"] is server.app.hub.named["stream-1"]
    await ledger.Cancel(pb.CancelRequest(run_id="r"))  # no track message was sent
    lost = (await s.recv()).lost
    assert (lost.run_id, lost.fencing_token, lost.reason) == ("r", 1, pb.LOST_REASON_CANCELLED)


async def test_an_acquire_is_tracked_only_on_an_open_stream_of_its_owner(
    aio, server  # type: ignore[no-untyped-def]
) -> None:
    ledger, _ = aio
    hub = server.app.hub
    other = await named_stream(ledger, "someone-else", "theirs", hub)
    for i, name in enumerate(["", "no-such-stream", "theirs"]):
        resp = await ledger.Acquire(pb.AcquireRequest(run_id=f"r{i}", owner="w", track_on=name))
        assert not resp.tracked and resp.run.status == rpb.RUN_STATUS_RUNNING
    assert hub.by_run == {}
    await ledger.Cancel(pb.CancelRequest(run_id="r2"))
    await other.nothing(0.2)
    mine = await named_stream(ledger, "w", "mine", hub)
    await mine.call.done_writing()  # the client ends the stream: the name goes with it
    for _ in range(300):
        if "mine" not in hub.named:
            break
        await asyncio.sleep(0.01)
    assert "mine" not in hub.named
    resp = await ledger.Acquire(pb.AcquireRequest(run_id="r9", owner="w", track_on="mine"))
    assert not resp.tracked


async def test_a_full_stream_is_not_tracked_on_by_an_acquire(make_server: Any) -> None:
    with make_server(max_tracked_per_stream=1) as srv:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            await named_stream(ledger, "w", "s", srv.app.hub)
            first = await ledger.Acquire(pb.AcquireRequest(run_id="a", owner="w", track_on="s"))
            second = await ledger.Acquire(pb.AcquireRequest(run_id="b", owner="w", track_on="s"))
            assert first.tracked and not second.tracked
            assert second.run.status == rpb.RUN_STATUS_RUNNING  # acquired all the same
            assert set(srv.app.hub.by_run) == {"a"}


async def test_stream_names_are_validated_and_a_bad_one_changes_nothing(
    aio, server  # type: ignore[no-untyped-def]
) -> None:
    ledger, _ = aio
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w", track_on="x" * 129))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "track_on" in (ei.value.details() or "")
    assert not (await ledger.ListRuns(pb.ListRunsRequest())).runs  # nothing was created
    call = ledger.KeepAlive()
    await call.write(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w", stream_name="a\nb")))
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call.read()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.stream_name" in (ei.value.details() or "")
    assert server.app.hub.named == {}
