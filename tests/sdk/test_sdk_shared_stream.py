"""Clients of one event loop that name the same coordinator with the same
settings share one Execute stream: many workers in one process, each a
Client of its own owner, send their commands in shared messages. Each command
is still its own owner's (fenced and refused as such), a Client's close
leaves the stream to the others, and Clients that differ keep their own."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import fencepost
from fencepost._execute import SharedDispatcher, share_key
from fencepost_server.testing.server import ServerThread


def _execute_streams(server: ServerThread) -> float:
    """Execute streams open on the server, from its /metrics."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "fencepost_open_streams" and s.labels.get("kind") == "execute":
                return float(s.value)
    raise AssertionError("no fencepost_open_streams{kind=execute}")


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def _streams_become(server: ServerThread, n: int) -> None:
    deadline = time.monotonic() + 5
    while (seen := await asyncio.to_thread(_execute_streams, server)) != n:
        assert time.monotonic() < deadline, f"{seen} Execute streams open, not {n}"
        await asyncio.sleep(0.02)


def _shared(client: fencepost.Client) -> Any:
    dispatcher = client._connection.dispatcher
    assert isinstance(dispatcher, SharedDispatcher)
    return dispatcher._shared


async def _open(clients: list[fencepost.Client]) -> None:
    """A mutation from each (the first opens the stream in the background,
    going unary meanwhile), then wait until the stream carries commands."""
    for c in clients:
        with pytest.raises(fencepost.RunNotFoundError):
            await c.delete("warm-up")
    dispatcher = clients[0]._connection.dispatcher
    assert dispatcher is not None
    await _until(lambda: dispatcher.is_open, "the Execute stream to open")


async def test_workers_of_one_process_send_their_commands_in_shared_messages(
    server: ServerThread,
) -> None:
    clients = [fencepost.Client(server.address, owner=f"worker-{i}") for i in range(16)]
    try:
        await _open(clients)
        shared = _shared(clients[0])
        assert all(_shared(c) is shared for c in clients)
        await _streams_become(server, 1)
        session = shared.dispatcher._session
        messages, commands = session.messages_sent, session.commands_sent

        leases = await asyncio.gather(*(c.acquire(f"w-{i}") for i, c in enumerate(clients)))

        assert session.commands_sent - commands == 16
        assert session.messages_sent - messages == 1  # issued in one turn: one message
        for i, lease in enumerate(leases):
            record = await clients[0].get(f"w-{i}")
            assert record.lease is not None and record.lease.owner == f"worker-{i}"
            assert lease.owner == f"worker-{i}" and lease.fencing_token == 1
        await asyncio.gather(*(lease.finish() for lease in leases))
        assert session.messages_sent - messages == 2
        assert shared.dispatcher.streams_opened == 1
        await _streams_become(server, 1)
    finally:
        for c in clients:
            await c.aclose()
    await _streams_become(server, 0)  # the last close ended it


async def test_each_command_on_a_shared_stream_is_fenced_as_its_owners(
    server: ServerThread,
) -> None:
    async with fencepost.Client(server.address, owner="alice") as a, \
            fencepost.Client(server.address, owner="bob") as b:
        await _open([a, b])
        assert _shared(a) is _shared(b)
        lease = await a.acquire("f-1", ttl_ms=5_000)
        with pytest.raises(fencepost.LeaseHeldError):
            await b.acquire("f-1")
        server.clock.advance(6_000)  # alice's lease expires: bob takes over
        taken = await b.acquire("f-1")
        assert taken.fencing_token == 2
        with pytest.raises(fencepost.LeaseLostError):
            await lease.record_checkpoint("stale", 1)  # alice's token 1 is refused
        done = await taken.finish()
        assert done.status is fencepost.RunStatus.COMPLETED
        record = await a.get("f-1")
        assert record.checkpoint_ref is None and record.fencing_token == 2
        assert _shared(a).dispatcher.streams_opened == 1


async def test_a_client_closing_leaves_the_shared_stream_to_the_others(
    server: ServerThread,
) -> None:
    b = fencepost.Client(server.address, owner="stays")
    try:
        async with fencepost.Client(server.address, owner="leaves") as a:
            await _open([a, b])
            shared = _shared(a)
            lease = await a.acquire("c-a")
            await lease.finish()
        await _streams_become(server, 1)
        assert shared.users == 1 and b.statistics().execute_stream_open
        session = shared.dispatcher._session
        sent = session.commands_sent
        other = await b.acquire("c-b")
        await other.finish()
        assert session.commands_sent == sent + 2  # still on the stream, not unary
        assert shared.dispatcher.streams_opened == 1
        # a Client made after the first closed joins the same stream
        async with fencepost.Client(server.address, owner="joins") as c:
            await (await c.acquire("c-c")).finish()
            assert _shared(c) is shared
    finally:
        await b.aclose()
    await _streams_become(server, 0)


async def test_a_clients_close_waits_for_its_own_commands_on_the_shared_stream(
    server: ServerThread,
) -> None:
    async with fencepost.Client(server.address, owner="stays") as b:
        a = fencepost.Client(server.address, owner="closes")
        await _open([a, b])
        session = _shared(a).dispatcher._session

        async def hold_server_loop() -> None:
            time.sleep(0.5)  # noqa: ASYNC251 - blocking that loop is the point

        holder = threading.Thread(target=server.call, args=(hold_server_loop,))
        holder.start()
        try:
            await asyncio.sleep(0.05)  # the server answers nothing for a while
            sent = session.commands_sent
            tasks = [asyncio.ensure_future(a.acquire(f"h-{i}")) for i in range(5)]
            await _until(lambda: session.commands_sent == sent + 5, "the commands to be written")
            await a.aclose()
            assert all(t.done() for t in tasks)  # answered before the close returned
            assert [t.result().fencing_token for t in tasks] == [1] * 5
        finally:
            await asyncio.to_thread(holder.join)
        assert b.statistics().execute_stream_open
        await (await b.acquire("h-b")).finish()


async def test_a_shared_stream_that_breaks_is_reopened_for_all_and_applies_each_command_once(
    server: ServerThread,
) -> None:
    clients = [fencepost.Client(server.address, owner=f"r-{i}") for i in range(8)]
    try:
        await _open(clients)
        shared = _shared(clients[0])
        acquires = [asyncio.ensure_future(c.acquire(f"rs-{i}")) for i, c in enumerate(clients)]
        await asyncio.sleep(0)  # submitted: in flight when the server goes away
        await asyncio.to_thread(server.restart)
        leases = await asyncio.gather(*acquires)
        # each granted once: a retry carried its request id and got the first answer
        assert [lease.fencing_token for lease in leases] == [1] * 8
        for i in range(8):
            record = await clients[i].get(f"rs-{i}")
            # (a second acquire by the same owner would have taken over: token 2;
            # the version may have moved: a coordinator starting on PostgreSQL
            # extends the live leases it takes over)
            assert (record.fencing_token, record.attempt) == (1, 1)
            assert record.lease is not None and record.lease.owner == f"r-{i}"
        await _until(lambda: shared.dispatcher.is_open, "the shared stream to reopen")
        assert shared.dispatcher.streams_opened >= 2
        assert all(_shared(c) is shared for c in clients)
        session = shared.dispatcher._session
        sent = session.commands_sent
        await asyncio.gather(*(lease.finish() for lease in leases))
        assert session.commands_sent == sent + 8  # all on the reopened stream
    finally:
        for c in clients:
            await c.aclose()


async def test_clients_that_differ_keep_streams_of_their_own(server: ServerThread) -> None:
    async with fencepost.Client(server.address, owner="plain") as a, \
            fencepost.Client(server.address, owner="windowed", command_window_ms=1.0) as b:
        await _open([a])
        await _open([b])
        assert _shared(a) is not _shared(b)
        await _streams_become(server, 2)


def test_what_clients_must_share_to_share_a_stream() -> None:
    retry = fencepost.RetryPolicy()
    base: dict[str, Any] = dict(tls=None, token=None, options=(), interceptors=(),
                                window_s=0.0, retry=retry)
    key = share_key(("127.0.0.1:1",), **base)
    assert key is not None and key == share_key(("127.0.0.1:1",), **base)
    for change in ({"token": "t"}, {"window_s": 0.001},
                   {"retry": fencepost.RetryPolicy(total_timeout_s=1.0)},
                   {"options": (("grpc.max_send_message_length", 1 << 20),)},
                   {"tls": fencepost.TLS(server_name="x")}):
        assert share_key(("127.0.0.1:1",), **{**base, **change}) != key, change
    assert share_key(("127.0.0.1:2",), **base) != key
    # several endpoints (each Client follows its own leader), interceptors,
    # or settings that cannot be compared: a stream of its own
    assert share_key(("127.0.0.1:1", "127.0.0.1:2"), **base) is None
    assert share_key(("127.0.0.1:1",), **{**base, "interceptors": (object(),)}) is None
    assert share_key(("127.0.0.1:1",), **{**base, "options": (("x", []),)}) is None
    assert fencepost.Client("127.0.0.1:1", transport="unary")._connection.dispatcher is None


def test_clients_on_different_event_loops_do_not_share(server: ServerThread) -> None:
    results: list[object] = []

    async def work(i: int) -> None:
        async with fencepost.Client(server.address, owner=f"loop-{i}") as c:
            for n in range(20):
                await (await c.acquire(f"l-{i}-{n}")).finish()
            results.append(_shared(c))

    threads = [threading.Thread(target=asyncio.run, args=(work(i),)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2 and results[0] is not results[1]
