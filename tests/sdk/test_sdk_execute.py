"""The SDK's Execute transport: ledger mutations of a Client over one
Ledger.Execute stream, coalesced per event-loop turn, with unary fallback,
retries with the same request id across a broken stream, and a clean close.

What goes on the wire is observed with client interceptors on the client's own
channel (every ExecuteRequest written, every unary call made), which also
inject the faults (a refused stream, a lost answer); the server is a real one,
reached through the TCP proxy of _proxy.py where a connection must be cut."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from _proxy import Proxy

import fencepost
from fencepost import RunStatus
from fencepost.v1 import ledger_pb2 as pb
from fencepost_server.testing.server import ServerThread

EXECUTE = "/fencepost.v1.Ledger/Execute"
MUTATIONS = {"Acquire", "Renew", "RecordCheckpoint", "Suspend", "Finish", "Release", "Cancel",
             "RequestResume", "DeleteRun"}
FAST_RETRY = fencepost.RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05,
                                   total_timeout_s=10.0, attempt_timeout_s=5.0)


def _method(details: Any) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


class _StreamSide(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        if _method(details) != EXECUTE:
            return await continuation(details, request_iterator)
        wire = self.wire
        wire.streams += 1
        if wire.refuse is not None:
            raise grpc.aio.AioRpcError(wire.refuse, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Execute refused by the test", None)
        if wire.rename is not None:  # a server without Execute answers UNIMPLEMENTED
            method = details.method
            details = details._replace(
                method=wire.rename.encode() if isinstance(method, bytes) else wire.rename)

        async def written() -> AsyncIterator[pb.ExecuteRequest]:
            async for msg in request_iterator:
                wire.requests.append(msg)
                yield msg

        call = await continuation(details, written())

        async def answers() -> AsyncIterator[pb.ExecuteResponse]:
            async for msg in call:
                lost = [r for r in msg.results if wire.lose is not None and wire.lose(r)]
                if lost:
                    wire.lose, lose_then = None, wire.then
                    for result in lost:
                        msg.results.remove(result)
                    if lose_then is not None:
                        lose_then()
                if msg.results:
                    yield msg

        return answers()  # grpc wraps it in the call: a response iterator


class _UnarySide(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = _method(details).rsplit("/", 1)[-1]
        self.wire.unary.append(method)
        self.wire.unary_requests.append((method, request))
        return await continuation(details, request)


class Wire:
    """What a client puts on the wire: ``requests`` (every ExecuteRequest
    written on an Execute stream), ``streams`` (Execute calls started),
    ``unary`` (the method of every unary call; with the request in
    ``unary_requests``). ``refuse`` fails new Execute calls with that code;
    ``rename`` sends them to another method name; ``lose(result)`` picks a
    result that never reaches the client (once), and ``then()`` runs at that
    moment."""

    def __init__(self) -> None:
        self.requests: list[pb.ExecuteRequest] = []
        self.streams = 0
        self.unary: list[str] = []
        self.unary_requests: list[tuple[str, Any]] = []
        self.refuse: grpc.StatusCode | None = None
        self.rename: str | None = None
        self.lose: Callable[[pb.CommandResult], bool] | None = None
        self.then: Callable[[], None] | None = None
        self.interceptors = [_StreamSide(self), _UnarySide(self)]

    def unary_mutations(self) -> list[str]:
        return [m for m in self.unary if m in MUTATIONS]

    def commands(self) -> list[pb.Command]:
        return [cmd for msg in self.requests for cmd in msg.commands]


async def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def _open_stream(client: fencepost.Client) -> None:
    """The stream opens in the background on the first mutation (which goes
    unary meanwhile): make one, and wait until the stream carries commands."""
    with pytest.raises(fencepost.RunNotFoundError):
        await client.delete("warm-up")
    await _wait_for(lambda: client.statistics().execute_stream_open,
                    "the Execute stream to open")


@contextlib.asynccontextmanager
async def answer_lost_once(
    server: ServerThread, owner: str, lose: Callable[[Any], bool]
) -> AsyncIterator[tuple[fencepost.Client, Wire, Any]]:
    """A client whose stream is open, behind a proxy that cuts every
    connection right after the first result matching ``lose`` reaches it —
    so that answer never arrives (the outcome is unknown to the client).
    Yields the client, its Wire and its dispatcher."""
    with Proxy(server.address) as proxy:
        wire = Wire()
        async with fencepost.Client(proxy.address, owner=owner, retry=FAST_RETRY,
                                    interceptors=wire.interceptors) as client:
            await _open_stream(client)
            dispatcher = client._connection.dispatcher
            assert dispatcher is not None

            def cut() -> None:
                proxy.cut()  # resets every connection: the stream breaks
                proxy.mend()  # new connections may come

            wire.lose = lose
            wire.then = cut
            yield client, wire, dispatcher


# -- (a) coalescing ----------------------------------------------------------------------


async def test_mutations_issued_in_one_turn_travel_in_one_message(server: ServerThread) -> None:
    wire = Wire()
    async with fencepost.Client(server.address, owner="worker-a",
                                interceptors=wire.interceptors) as client:
        await _open_stream(client)
        unary_before, sent_before = len(wire.unary_mutations()), len(wire.requests)

        leases = await asyncio.gather(*(client.acquire(f"run-{i}") for i in range(20)))

        msgs = wire.requests[sent_before:]
        assert len(msgs) == 1, [len(m.commands) for m in msgs]
        assert sorted(c.acquire.run_id for c in msgs[0].commands) == sorted(
            f"run-{i}" for i in range(20))
        assert len({c.id for c in msgs[0].commands}) == 20  # one correlation id each
        assert [lease.fencing_token for lease in leases] == [1] * 20
        assert [lease.run_id for lease in leases] == [f"run-{i}" for i in range(20)]

        # the next turn's commands make the next message; mixed kinds share it
        await asyncio.gather(*(lease.record_checkpoint("ckpt", 1) for lease in leases[:10]),
                             *(lease.finish() for lease in leases[10:]))
        last = wire.requests[-1]
        assert len(wire.requests) == sent_before + 2
        assert sorted(c.WhichOneof("kind") for c in last.commands) == (
            ["finish"] * 10 + ["record_checkpoint"] * 10)
        assert (await client.get("run-15")).status is RunStatus.COMPLETED
        assert (await client.get("run-5")).checkpoint_ref is not None
        # none of that went unary; reads did
        assert len(wire.unary_mutations()) == unary_before
        assert "GetRun" in wire.unary
        assert wire.streams == 1


async def test_a_window_still_sends_one_turns_commands_together(server: ServerThread) -> None:
    wire = Wire()
    async with fencepost.Client(server.address, owner="worker-a", command_window_ms=1.0,
                                interceptors=wire.interceptors) as client:
        await _open_stream(client)
        before = len(wire.requests)
        leases = await asyncio.gather(*(client.acquire(f"run-{i}") for i in range(5)))
        assert len(wire.requests) == before + 1 and len(wire.requests[-1].commands) == 5
        assert {lease.fencing_token for lease in leases} == {1}


# -- (b) per-command errors --------------------------------------------------------------


def _same_error(a: fencepost.FencepostError, b: fencepost.FencepostError) -> None:
    assert type(a) is type(b)
    assert (a.code, a.message, a.field, a.grpc_code, a.record) == (
        b.code, b.message, b.field, b.grpc_code, b.record)


async def test_command_errors_are_the_unary_exceptions_and_keep_the_stream(
    server: ServerThread,
) -> None:
    wire = Wire()
    async with (
        fencepost.Client(server.address, owner="worker-a") as holder,
        fencepost.Client(server.address, owner="worker-b", transport="unary") as unary,
        fencepost.Client(server.address, owner="worker-b",
                         interceptors=wire.interceptors) as streamed,
    ):
        await holder.acquire("run-1", ttl_ms=60_000)
        await _open_stream(streamed)
        opened = streamed.statistics().execute_streams_opened

        async def both(call: Callable[[fencepost.Client], Any]) -> list[Any]:
            errors = []
            for client in (unary, streamed):
                with pytest.raises(fencepost.FencepostError) as info:
                    await call(client)
                errors.append(info.value)
            return errors

        u, s = await both(lambda c: c.acquire("run-1"))
        _same_error(u, s)
        assert type(s) is fencepost.LeaseHeldError and s.code == "RUN_LEASE_HELD"
        assert s.record is not None and s.record.lease is not None
        assert s.record.lease.owner == "worker-a"
        u, s = await both(lambda c: c.acquire("run-2", ttl_ms=5))
        _same_error(u, s)
        assert type(s) is fencepost.ValidationError and s.field == "lease_ttl_ms"
        u, s = await both(lambda c: c.cancel("nope"))
        _same_error(u, s)
        assert type(s) is fencepost.RunNotFoundError and s.record is None
        kinds = [c.WhichOneof("kind") for c in wire.commands()]
        assert kinds[-3:] == ["acquire", "acquire", "cancel"]  # those went on the stream

        # failures and successes in one message: each command gets its own answer
        before = len(wire.requests)
        held, bad, won, missing = await asyncio.gather(
            streamed.acquire("run-1"), streamed.acquire("run-2", ttl_ms=5),
            streamed.acquire("run-3"), streamed.request_resume("nope"),
            return_exceptions=True,
        )
        assert len(wire.requests) == before + 1
        assert type(held) is fencepost.LeaseHeldError
        assert type(bad) is fencepost.ValidationError
        assert type(missing) is fencepost.RunNotFoundError
        assert isinstance(won, fencepost.Lease) and won.fencing_token == 1

        # the same stream is still up and carrying commands
        await won.release()
        stats = streamed.statistics()
        assert stats.execute_stream_open and stats.execute_streams_opened == opened
        assert wire.commands()[-1].WhichOneof("kind") == "release"
        assert wire.streams == 1


# -- (c) a stream cut mid-flight ---------------------------------------------------------


async def test_a_command_cut_off_mid_flight_is_retried_with_its_request_id(
    server: ServerThread,
) -> None:
    """The Acquire commits and is answered, but the connection is cut before
    the answer reaches the client: the outcome is unknown to it, so it retries
    with the same request id (over unary or the re-opened stream) and gets the
    original grant. Had the retry carried a new id, it would have been a second
    acquisition by the same owner: token 2, version 2."""
    lost = answer_lost_once(
        server, "worker-a", lambda r: r.HasField("acquire") and r.acquire.run.run_id == "run-cut")
    async with lost as (client, wire, dispatcher):
        lease = await client.acquire("run-cut")

        assert wire.lose is None  # the answer was lost on the way, once
        first = [c.acquire for c in wire.commands() if c.acquire.run_id == "run-cut"]
        retried = [r for m, r in wire.unary_requests
                   if m == "Acquire" and r.run_id == "run-cut"]
        attempts = first + retried
        assert len(attempts) >= 2  # the command on the stream, then its retry
        assert len({a.request_id for a in attempts}) == 1 and len(attempts[0].request_id) == 32
        # exactly one grant: the retry got the original answer
        assert lease.fencing_token == 1
        rec = await client.get("run-cut")
        assert (rec.version, rec.fencing_token, rec.attempt) == (1, 1, 1)
        # and the client is whole: the stream comes back and carries commands
        await _wait_for(lambda: dispatcher.is_open, "the stream to reopen")
        assert dispatcher.streams_opened >= 2
        await lease.finish()
        assert wire.commands()[-1].WhichOneof("kind") == "finish"


# -- (d) fallback ------------------------------------------------------------------------


async def test_while_the_stream_is_refused_mutations_go_unary_then_it_is_used_again(
    server: ServerThread,
) -> None:
    wire = Wire()
    wire.refuse = grpc.StatusCode.UNAVAILABLE
    async with fencepost.Client(server.address, owner="worker-a", retry=FAST_RETRY,
                                interceptors=wire.interceptors) as client:
        lease = await client.acquire("run-1")
        await _wait_for(lambda: wire.streams >= 2, "reconnect attempts")
        await lease.renew()
        await lease.record_checkpoint("ckpt", 1)
        await lease.finish()
        with pytest.raises(fencepost.AlreadyTerminalError):  # refusals come back the same way
            await client.cancel("run-1")
        assert wire.unary_mutations() == ["Acquire", "Renew", "RecordCheckpoint", "Finish",
                                          "Cancel"]
        assert wire.requests == [] and not client.statistics().execute_stream_open
        assert (await client.get("run-1")).status is RunStatus.COMPLETED

        wire.refuse = None  # the stream can be opened again
        await _wait_for(lambda: client.statistics().execute_stream_open,
                        "the stream to reconnect")
        n_unary = len(wire.unary_mutations())
        again = await client.acquire("run-2")
        await again.release()
        assert len(wire.unary_mutations()) == n_unary
        assert [c.WhichOneof("kind") for c in wire.commands()] == ["acquire", "release"]


async def test_a_server_without_execute_is_served_unary(server: ServerThread) -> None:
    """An older server answers the stream UNIMPLEMENTED: nothing on it was
    applied, so the commands caught on it go unary at once, in the same
    attempt (no retry allowed here), and so does everything after (the stream
    is not asked for again soon)."""
    wire = Wire()
    wire.rename = "/fencepost.v1.Ledger/NoSuchMethod"
    async with fencepost.Client(server.address, owner="worker-a",
                                retry=fencepost.RetryPolicy.no_retry(),
                                interceptors=wire.interceptors) as client:
        dispatcher = client._connection.dispatcher
        assert dispatcher is not None
        with pytest.raises(fencepost.RunNotFoundError):
            await client.get("nope")  # the channel is connected

        # Hold the server's loop a moment: the stream's headers go out (it is
        # open for the client) but its UNIMPLEMENTED answer waits, so commands
        # are written on it before the refusal comes back.
        async def hold_server_loop() -> None:
            time.sleep(0.5)  # noqa: ASYNC251 - blocking that loop is the point

        holder = threading.Thread(target=server.call, args=(hold_server_loop,))
        holder.start()
        try:
            await asyncio.sleep(0.05)

            async def on_the_stream() -> list[fencepost.Lease]:
                await _wait_for(lambda: dispatcher.is_open, "the stream to open")
                return await asyncio.gather(*(client.acquire(f"run-{i}") for i in range(3)))

            first, caught = await asyncio.gather(client.acquire("run-first"), on_the_stream())
        finally:
            await asyncio.to_thread(holder.join)
        assert [c.acquire.run_id for c in wire.commands()] == ["run-0", "run-1", "run-2"]
        assert dispatcher.unimplemented and not dispatcher.is_open
        # each applied exactly once, over unary
        assert [lease.fencing_token for lease in (first, *caught)] == [1, 1, 1, 1]
        assert wire.unary_mutations() == ["Acquire"] * 4
        after = await client.acquire("run-after")
        assert after.fencing_token == 1 and wire.unary_mutations() == ["Acquire"] * 5
        assert wire.streams == 1 and len(wire.requests) == 1


# -- (e) transport="unary" ---------------------------------------------------------------


async def test_unary_transport_never_opens_execute(server: ServerThread) -> None:
    wire = Wire()
    async with fencepost.Client(server.address, owner="worker-a", transport="unary",
                                interceptors=wire.interceptors) as client:
        leases = await asyncio.gather(*(client.acquire(f"run-{i}") for i in range(3)))
        await leases[0].renew()
        await leases[1].finish()
        await client.cancel("run-2")
        await client.delete("run-2")
    assert wire.streams == 0 and wire.requests == []
    assert sorted(wire.unary_mutations()) == sorted(
        ["Acquire"] * 3 + ["Renew", "Finish", "Cancel", "DeleteRun"])


# -- (f) options -------------------------------------------------------------------------


@pytest.mark.parametrize("window", [-0.1, 1.5, math.nan, math.inf, "0.5", True])
def test_a_bad_window_names_the_argument(window: Any) -> None:
    with pytest.raises(ValueError, match="command_window_ms"):
        fencepost.Client(command_window_ms=window)


def test_window_bounds_and_transport_choice() -> None:
    fencepost.Client(command_window_ms=0)
    fencepost.Client(command_window_ms=1)
    fencepost.Client(command_window_ms=0.25, transport="unary")
    with pytest.raises(ValueError, match="transport"):
        fencepost.Client(transport="carrier-pigeon")  # type: ignore[arg-type]


# -- cancellation and close --------------------------------------------------------------


async def test_a_cancelled_caller_abandons_the_reply_not_the_command(
    server: ServerThread,
) -> None:
    wire = Wire()
    async with fencepost.Client(server.address, owner="worker-a",
                                interceptors=wire.interceptors) as client:
        await _open_stream(client)
        await client.acquire("run-1")
        task = asyncio.create_task(client.cancel("run-1", "stop"))
        await asyncio.sleep(0)  # the command is buffered, not yet written
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # still sent, still applied; its answer is dropped, the stream stays up
        await _wait_for(lambda: any(c.HasField("cancel") for c in wire.commands()),
                        "the cancel to be written")
        for _ in range(200):
            if (await client.get("run-1")).status is RunStatus.CANCELLED:
                break
            await asyncio.sleep(0.01)
        assert (await client.get("run-1")).status is RunStatus.CANCELLED
        assert (await client.cancel("run-1")).status is RunStatus.CANCELLED
        assert client.statistics().execute_streams_opened == 1
        assert wire.unary_mutations() == ["DeleteRun"]  # the warm-up only


async def test_close_answers_every_command_the_stream_carries(server: ServerThread) -> None:
    wire = Wire()
    client = fencepost.Client(server.address, owner="worker-a", interceptors=wire.interceptors)
    await _open_stream(client)
    tasks = [asyncio.ensure_future(client.acquire(f"run-{i}")) for i in range(10)]
    await asyncio.sleep(0)  # all ten submitted, none answered
    await client.aclose()
    leases = await asyncio.gather(*tasks)
    assert {lease.fencing_token for lease in leases} == {1}
    assert sum(len(m.commands) for m in wire.requests) == 10
    assert not client.statistics().execute_stream_open


async def test_close_fails_what_the_server_never_answers(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command the server has not answered when the close's bounded wait
    ends fails loudly (CANCELLED, as a unary call cut off by the channel's
    close), never hangs and never passes for a success."""
    monkeypatch.setattr("fencepost._execute.CLOSE_WAIT_S", 0.2)
    wire = Wire()
    client = fencepost.Client(server.address, owner="worker-a", interceptors=wire.interceptors)
    await _open_stream(client)

    async def hold_server_loop() -> None:
        time.sleep(1.0)  # noqa: ASYNC251 - blocking that loop is the point

    holder = threading.Thread(target=server.call, args=(hold_server_loop,))
    holder.start()
    try:
        await asyncio.sleep(0.05)  # the server cannot answer anything now
        task = asyncio.ensure_future(client.cancel("run-stuck"))
        await _wait_for(lambda: any(c.HasField("cancel") for c in wire.commands()),
                        "the command to be written")
        started = time.monotonic()
        await client.aclose()
        assert time.monotonic() - started < 0.8  # bounded by the close, not the server
        with pytest.raises(fencepost.RpcError) as info:
            await task
        assert info.value.code == "CANCELLED" and "closed" in info.value.message
    finally:
        await asyncio.to_thread(holder.join)
