"""``Client.watch`` / ``SyncClient.watch``: replay then live, filters,
resuming after a restart or a STREAM_TOO_SLOW drop with no gap and no
duplicate, and the typed error for a compacted revision."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _proxy import Proxy

import fencepost
from fencepost import ChangeKind, RevisionCompactedError, RunStatus, SyncClient, WatchEvent
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

WAIT_S = 5.0


async def watching(server: ServerThread, count: int = 1) -> None:
    """Wait until ``count`` WatchRuns subscribers are registered on the server
    (a watch "from now" has resolved what "now" is)."""
    hub = server.app.hub  # type: ignore[union-attr]
    deadline = time.monotonic() + WAIT_S
    while len(hub.watchers) < count:
        assert time.monotonic() < deadline, "the watch did not start"
        await asyncio.sleep(0.005)


class Collector:
    """Consumes a watch in a task, keeping every event."""

    def __init__(self, agen: AsyncGenerator[WatchEvent, None]) -> None:
        self.agen = agen
        self.events: list[WatchEvent] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for ev in self.agen:
            self.events.append(ev)

    async def wait_for(self, n: int) -> list[WatchEvent]:
        deadline = time.monotonic() + WAIT_S
        while len(self.events) < n:
            if self.task.done():
                self.task.result()  # raise what ended it
            assert time.monotonic() < deadline, f"{len(self.events)} of {n} events"
            await asyncio.sleep(0.01)
        return self.events

    async def close(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
        await self.agen.aclose()


def revisions(events: list[WatchEvent]) -> list[int]:
    return [e.revision for e in events]


async def test_replay_from_a_revision_then_live(
    client: fencepost.Client, rival: fencepost.Client
) -> None:
    lease = await client.acquire("run-a")  # revision 1
    await lease.record_checkpoint("ckpt/a", 1)  # 2
    await rival.acquire("run-b")  # 3
    agen = client.watch(from_revision=2)
    ev = await anext(agen)
    assert ev == WatchEvent(2, ChangeKind.PUT, "run-a", ev.record)
    assert ev.record is not None and ev.record.checkpoint_ref is not None
    assert ev.record.revision == 2 and ev.record.version == 2
    ev = await anext(agen)
    assert (ev.revision, ev.kind, ev.run_id) == (3, ChangeKind.PUT, "run-b")
    await client.delete("run-a")  # 4, live
    ev = await anext(agen)
    assert (ev.revision, ev.kind, ev.run_id, ev.record) == (4, ChangeKind.DELETE, "run-a", None)
    assert ev.to_dict() == {"revision": 4, "kind": "delete", "run_id": "run-a"}
    await agen.aclose()


async def test_from_now_and_filtered(
    server: ServerThread, client: fencepost.Client, rival: fencepost.Client
) -> None:
    await rival.acquire("run-a")  # before the watch: not seen
    watch = Collector(client.watch(run_ids=["run-a", "run-c"]))
    await watching(server)
    theirs = await rival.acquire("run-b")
    await rival.cancel("run-a")
    await theirs.finish()
    await rival.acquire("run-c")
    events = await watch.wait_for(2)
    await asyncio.sleep(0.05)
    assert [(e.run_id, e.record.status if e.record else None) for e in events] == [
        ("run-a", RunStatus.CANCELLED), ("run-c", RunStatus.RUNNING)]
    assert revisions(events) == [3, 5]
    await watch.close()


async def test_list_all_then_watch_from_its_revision_misses_nothing(
    client: fencepost.Client, rival: fencepost.Client
) -> None:
    for i in range(5):
        await rival.acquire(f"run-{i}")  # revisions 1..5
    await rival.cancel("run-1")  # 6
    listing = await client.list_all(page_size=2)  # three pages, one revision
    assert [r.run_id for r in listing.runs] == [f"run-{i}" for i in range(5)]
    assert listing.revision == 6
    assert listing.runs[1].status is RunStatus.CANCELLED
    only = await client.list_all(statuses=["cancelled"])
    assert [r.run_id for r in only.runs] == ["run-1"] and only.revision == 6
    await rival.acquire("run-9")  # 7: after the listing, before the watch
    await client.delete("run-0")  # 8
    agen = client.watch(from_revision=listing.revision + 1)
    got = [await anext(agen), await anext(agen)]
    assert [(e.revision, e.kind, e.run_id) for e in got] == [
        (7, ChangeKind.PUT, "run-9"), (8, ChangeKind.DELETE, "run-0")]
    await agen.aclose()


async def test_resumes_after_a_server_restart_without_gap_or_duplicate(
    server: ServerThread, client: fencepost.Client, rival: fencepost.Client
) -> None:
    watch = Collector(client.watch(from_revision=1))
    for i in range(3):
        await rival.acquire(f"run-{i}")
    await watch.wait_for(3)
    await asyncio.to_thread(server.restart)
    for i in range(3, 6):  # likely before the watch is back: replayed on resume
        await rival.acquire(f"run-{i}")
    await rival.delete("run-0")
    deadline = time.monotonic() + WAIT_S
    while not any(e.kind is ChangeKind.DELETE for e in watch.events):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    events = watch.events
    # every revision once, in order (the watch covers all runs; the rival's
    # stream renewing its leases after the restart makes changes too)
    assert revisions(events) == list(range(1, len(events) + 1))
    acquired = [e.run_id for e in events if e.record is not None and e.record.version == 1]
    assert acquired == [f"run-{i}" for i in range(6)]
    deletes = [(e.run_id, e.record) for e in events if e.kind is ChangeKind.DELETE]
    assert deletes == [("run-0", None)]
    await watch.close()


async def test_resumes_after_stream_too_slow(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A watcher that stops reading while a burst is committed is dropped by
    the server (its queue holds 5); the SDK resumes from its last revision."""
    caplog.set_level(logging.INFO, logger="fencepost")
    with make_server(clock=ManualClock(), stream_queue_limit=5) as srv:
        async with (
            fencepost.Client(srv.address, owner="watcher") as client,
            fencepost.Client(srv.address, owner="writer") as writer,
        ):
            agen = client.watch(from_revision=1)
            await writer.acquire("seed")
            got = [await anext(agen)]
            await asyncio.gather(*(writer.acquire(f"run-{i}") for i in range(100)))
            while len(got) < 101:
                got.append(await asyncio.wait_for(anext(agen), WAIT_S))
            await agen.aclose()
    assert revisions(got) == list(range(1, 102))
    assert "STREAM_TOO_SLOW" in caplog.text  # it did drop, and the watch went on


async def test_a_compacted_revision_raises_a_typed_error(make_server: Any) -> None:
    with make_server(clock=ManualClock(), history_revisions=10, prune_every_s=0) as srv:
        async with fencepost.Client(srv.address, owner="w") as client:
            lease = await client.acquire("run-1")
            for i in range(14):
                await lease.record_checkpoint("ckpt", i)  # revisions 2..15
            agen = client.watch(from_revision=1)
            with pytest.raises(RevisionCompactedError) as info:
                await anext(agen)
            assert info.value.code == "RUN_REVISION_COMPACTED"
            assert isinstance(info.value, fencepost.FencepostError)
            # a retained one replays
            recent = client.watch(from_revision=13)
            assert [(await anext(recent)).revision for _ in range(3)] == [13, 14, 15]
            await recent.aclose()
            with pytest.raises(ValueError):
                await anext(client.watch(from_revision=-1))


async def test_watch_of_an_unreachable_server_gives_up_with_unavailable() -> None:
    retry = fencepost.RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.05,
                                  total_timeout_s=0.3)
    async with fencepost.Client("127.0.0.1:1", retry=retry) as client:
        with pytest.raises(fencepost.UnavailableError):
            await anext(client.watch())


async def _stop_with_calls_waiting(srv: ServerThread, during: Callable[[], Awaitable[None]],
                                   ) -> None:
    """gRPC ends with CANCELLED, not UNAVAILABLE, the calls that reached a
    server but no handler yet when it stops. Hold the server's loop; send a
    call that takes the one call gRPC had ready for a handler; run ``during``
    (the calls it makes now wait in gRPC); stop the gRPC server (they end
    CANCELLED, the first UNAVAILABLE); start the server again on its port."""
    held = threading.Event()

    async def hold_then_stop() -> None:  # on the server's loop
        held.set()
        time.sleep(1.5)  # noqa: ASYNC251 - the loop held: what arrives waits in gRPC
        await srv.app.server.stop(0)  # type: ignore[union-attr]

    stopping = threading.Thread(target=srv.call, args=(hold_then_stop,))
    stopping.start()
    await asyncio.to_thread(held.wait, WAIT_S)
    async with grpc.aio.insecure_channel(srv.address) as ch:
        first = ledger_pb2_grpc.LedgerStub(ch).WatchRuns(pb.WatchRunsRequest())
        await asyncio.sleep(0.2)
        await during()
        await asyncio.to_thread(stopping.join, 30)
        assert await first.code() == grpc.StatusCode.UNAVAILABLE  # it had the handler's place
    srv.stop()  # (the App: what the gRPC server's stop left)
    srv.start()  # the same port


async def test_a_watch_by_shards_resumes_when_a_stopping_server_cancels_its_new_stream(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A watch whose stream is reopened as its server stops (a coordinator
    handing its shards over on SIGTERM, say) resumes when the server is back."""
    srv = ServerThread(tmp_path / "w.db").start()
    try:
        with Proxy(srv.address) as proxy:
            async with fencepost.Client(proxy.address, renewal="off") as client, \
                    fencepost.Client(srv.address, renewal="off") as writer:
                cursor = fencepost.WatchCursor()
                events = Collector(client.watch(cursor=cursor))
                await watching(srv)
                await writer.acquire("before")
                await events.wait_for(1)
                caplog.set_level(logging.INFO, "fencepost.client")

                async def reopen() -> None:  # the watch's stream reopened, on a new connection
                    proxy.cut()
                    proxy.mend()
                    await asyncio.sleep(0.6)

                await _stop_with_calls_waiting(srv, reopen)
                await writer.acquire("after")
                got = await events.wait_for(2)
                assert [e.run_id for e in got] == ["before", "after"]
                await events.close()
    finally:
        srv.close()
    ends = [r.getMessage() for r in caplog.records if r.getMessage().startswith("watch ")]
    assert any("ended (CANCELLED" in m for m in ends), ends


async def test_a_read_sent_as_its_server_stops_is_retried(tmp_path: Path) -> None:
    """A read (here the one a watch starts with) that a stopping server
    ended CANCELLED is retried, as one that found it gone."""
    srv = ServerThread(tmp_path / "r.db").start()
    try:
        async with fencepost.Client(srv.address, renewal="off") as client:
            await client.acquire("r")
            reads: list[asyncio.Task[Any]] = []

            async def read() -> None:
                reads.append(asyncio.create_task(client.get("r")))
                await asyncio.sleep(0.6)

            await _stop_with_calls_waiting(srv, read)
            assert (await asyncio.wait_for(reads[0], 30)).run_id == "r"
    finally:
        srv.close()


# -- sync ---------------------------------------------------------------------------------


@pytest.fixture
def sync_client(server: ServerThread) -> Iterator[SyncClient]:
    with SyncClient(server.address, owner="worker-a") as client:
        yield client


def test_sync_watch_is_a_blocking_iterator(server: ServerThread, sync_client: SyncClient) -> None:
    for i in range(3):
        sync_client.acquire(f"run-{i}")
    events = sync_client.watch(run_ids=["run-0", "run-2"], from_revision=1)
    assert [(e.revision, e.run_id) for e in (next(events), next(events))] == [
        (1, "run-0"), (3, "run-2")]
    sync_client.cancel("run-2")
    ev = next(events)
    assert (ev.revision, ev.kind, ev.run_id) == (4, ChangeKind.PUT, "run-2")
    assert ev.record is not None and ev.record.status is RunStatus.CANCELLED
    events.close()  # ends the stream on the server
    deadline = time.monotonic() + WAIT_S
    while server.app.hub.watchers:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(ValueError):
        sync_client.watch(from_revision=-1)


def test_sync_list_all(sync_client: SyncClient) -> None:
    for i in range(3):
        sync_client.acquire(f"run-{i}")
    listing = sync_client.list_all(page_size=1, owner="worker-a")
    assert [r.run_id for r in listing.runs] == ["run-0", "run-1", "run-2"]
    assert listing.revision == 3 and isinstance(listing, fencepost.RunListing)


def test_sync_watch_ends_when_the_client_closes(server: ServerThread) -> None:
    client = SyncClient(server.address)
    client.acquire("run-0")
    events = client.watch(from_revision=1)
    assert next(events).revision == 1
    client.close()
    with pytest.raises(fencepost.ClientClosedError, match="closed"):
        next(events)
