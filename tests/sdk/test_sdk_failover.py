"""A client given several endpoints follows the leader.

The standbys are real gRPC servers (``_standby.Standby``) that refuse every
fencepost call exactly as a standby coordinator does (UNAVAILABLE + ErrorInfo
NOT_LEADER naming the leader, or nobody); the leaders are real coordinators
(``ServerThread``). A "takeover" is played by stopping the leader and
starting another coordinator on the same SQLite file: it has every record,
request id and revision the old one committed, as a new leader has.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from _proxy import Proxy
from _standby import Standby

import fencepost
from fencepost import LostReason, NotLeaderError, RetryPolicy, UnavailableError
from fencepost._endpoints import CONNECT_WAIT_S, parse_endpoints
from fencepost.v1 import ledger_pb2, ledger_pb2_grpc
from fencepost_devtools.ports import free_port
from fencepost_server.testing.server import ServerThread

BOTH_TRANSPORTS = True  # tests using `transport` run over the Execute stream and unary

WAIT_S = 10.0  # upper bound for a reconnect; normally well under a second
FAST = RetryPolicy(total_timeout_s=1.5, attempt_timeout_s=1.0, max_backoff_s=0.2)
# no attempt starts after total_timeout_s, and one takes at most attempt_timeout_s
# (plus slack for a busy machine)
GIVES_UP_S = FAST.total_timeout_s + (FAST.attempt_timeout_s or 0) + 1.0


def free_address() -> str:
    return f"127.0.0.1:{free_port()}"


async def until(predicate: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Blackhole:
    """An address where connections are never completed: a listening socket
    whose one-slot backlog is taken and never accepted, so the kernel drops
    every further SYN. A coordinator whose machine died looks like this."""

    def __enter__(self) -> Blackhole:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._slot = socket.create_connection(self._listener.getsockname(), timeout=2)
        return self

    def __exit__(self, *exc: object) -> None:
        self._slot.close()
        self._listener.close()


class Coordinators:
    """Leaders over one SQLite file, one at a time (see the module docs)."""

    def __init__(self, db: Path, stack: contextlib.ExitStack) -> None:
        self.db = db
        self._stack = stack
        self.leader: ServerThread | None = None

    def start(self, listen: str = "127.0.0.1:0") -> ServerThread:
        assert self.leader is None, "one coordinator per SQLite file"
        srv = ServerThread(self.db, listen=listen)
        self._stack.callback(srv.close)
        self.leader = srv.start()
        return srv

    def stop(self) -> None:
        assert self.leader is not None
        self.leader.stop()
        self.leader = None


@pytest.fixture
def coordinators(tmp_path: Path) -> Iterator[Coordinators]:
    with contextlib.ExitStack() as stack:
        yield Coordinators(tmp_path / "fencepost.db", stack)


@pytest.fixture
def standby() -> Iterator[Standby]:
    with Standby() as s:
        yield s


async def raw_acquire(address: str, run_id: str, owner: str,
                      request_id: str) -> ledger_pb2.AcquireResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        req = ledger_pb2.AcquireRequest(run_id=run_id, owner=owner, lease_ttl_ms=60_000,
                                        request_id=request_id)
        return await stub.Acquire(req)  # type: ignore[no-any-return]


async def holding_over_the_stream(
    client: fencepost.Client, run_id: str = "run-1", *, streamed: bool = True
) -> fencepost.Lease:
    """A lease on ``run_id``, once the client's Execute stream is open
    (``streamed=False``: a client with transport="unary" opens none)."""
    lease = await client.acquire(run_id, ttl_ms=60_000)
    if streamed:
        await until(lambda: client.statistics().execute_stream_open, "the Execute stream")
    return lease


# -- endpoints ---------------------------------------------------------------------------


def test_endpoints_are_a_list_one_string_or_a_comma_separated_one() -> None:
    assert parse_endpoints("a:1") == ("a:1",)
    assert parse_endpoints("a:1, b:2,a:1") == ("a:1", "b:2")
    assert parse_endpoints(["a:1", "b:2"]) == ("a:1", "b:2")
    client = fencepost.Client("10.0.0.1:50051,10.0.0.2:50051")
    assert client.endpoints == ("10.0.0.1:50051", "10.0.0.2:50051")
    assert client.address == "10.0.0.1:50051"  # the first, until told otherwise
    for bad in ("", "a:1,,b:2", [], ["a:1", " "], "a :1"):
        with pytest.raises(ValueError, match="address"):
            fencepost.Client(bad)
    with pytest.raises(ValueError, match="address"):
        fencepost.Client([b"a:1"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="plaintext"):  # each endpoint is checked
        fencepost.Client(["127.0.0.1:1", "10.0.0.2:50051"], token="t")


# -- unary calls -------------------------------------------------------------------------


async def test_a_mutation_refused_by_a_standby_goes_to_the_leader_it_names_with_its_request_id(
    server: ServerThread, standby: Standby, transport: str
) -> None:
    standby.leader = server.address
    async with fencepost.Client([standby.address, server.address], owner="w",
                                transport=transport) as client:  # type: ignore[arg-type]
        lease = await client.acquire("run-1", ttl_ms=60_000)
        assert client.address == server.address
        assert client.statistics().endpoints == (standby.address, server.address)  # mapped
        sent = [r for r in standby.refused if r.method == "Acquire"]
        assert len(sent) == 1 and sent[0].request_id
        # the leader holds the answer under that very request id: applied once
        again = await raw_acquire(server.address, "run-1", "w", sent[0].request_id)
        assert again.run.fencing_token == lease.fencing_token == 1
        assert again.run.version == lease.record.version
        await lease.finish()
        # later calls go straight to the leader
        before = len(standby.refused)
        assert (await client.get("run-1")).status is fencepost.RunStatus.COMPLETED
        assert len(standby.refused) == before


async def test_a_leader_named_by_a_standby_is_followed_even_when_not_listed(
    server: ServerThread, standby: Standby
) -> None:
    standby.leader = server.address
    async with fencepost.Client(standby.address, owner="w") as client:
        await client.acquire("run-1")
        assert client.endpoints == (standby.address,)
        assert client.address == server.address
        assert client.statistics().endpoints == (standby.address, server.address)


async def test_no_leader_known_moves_to_the_next_endpoint(
    server: ServerThread, standby: Standby
) -> None:
    async with fencepost.Client([standby.address, server.address], owner="w") as client:
        with pytest.raises(fencepost.RunNotFoundError):
            await client.get("nothing")
        assert client.address == server.address
        assert standby.methods() == ["GetRun"]


async def test_an_unreachable_endpoint_moves_to_the_next(server: ServerThread) -> None:
    async with fencepost.Client([free_address(), server.address], owner="w") as client:
        lease = await client.acquire("run-1")  # nothing sent to the dead one: not unknown
        assert client.address == server.address and lease.fencing_token == 1


async def test_every_endpoint_down_raises_unavailable_within_the_deadline() -> None:
    dead = [free_address(), free_address()]
    async with fencepost.Client(dead, retry=FAST) as client:
        for call in (client.get("r"), client.acquire("r")):
            started = time.monotonic()
            with pytest.raises(UnavailableError) as info:
                await call
            assert time.monotonic() - started < GIVES_UP_S
            assert not isinstance(info.value, fencepost.OutcomeUnknownError)  # never sent
            assert all(address in str(info.value) for address in dead)


async def test_standbys_that_keep_refusing_raise_not_leader_naming_them() -> None:
    with Standby() as one, Standby() as two:
        async with fencepost.Client([one.address, two.address], retry=FAST) as client:
            started = time.monotonic()
            with pytest.raises(NotLeaderError) as info:
                await client.acquire("r")
            assert time.monotonic() - started < GIVES_UP_S
            err = info.value
            assert isinstance(err, UnavailableError)
            assert not isinstance(err, fencepost.OutcomeUnknownError)  # refused: not applied
            assert one.address in str(err) and two.address in str(err)
            assert "last leader hint: none" in str(err)
            # both were asked, with backoff in between (no tight loop)
            asked = len(one.refused) + len(two.refused)
            assert one.refused and two.refused and asked < 50, (one.refused, two.refused)


async def test_standbys_naming_each_other_do_not_spin() -> None:
    with Standby() as one, Standby() as two:
        one.leader, two.leader = two.address, one.address
        async with fencepost.Client(one.address, retry=FAST) as client:
            with pytest.raises(NotLeaderError) as info:
                await client.get("r")
            assert info.value.leader in (one.address, two.address)
            assert f"last leader hint: {info.value.leader}" in str(info.value)
            asked = len(one.refused) + len(two.refused)
            assert asked < 60, (one.refused, two.refused)


def test_sync_client_and_store_follow_the_leader(server: ServerThread) -> None:
    with Standby(leader=server.address) as standby:
        with fencepost.SyncClient([standby.address, server.address], owner="w") as client:
            with client.acquire("run-1") as lease:
                lease.finish()
            assert client.address == server.address
            assert client.store.create_run("e-1", agent="a").created
            assert client.store.get_run("e-1") is not None


async def test_a_store_of_its_own_follows_the_leader(server: ServerThread) -> None:
    with Standby(leader=server.address) as standby:
        async with fencepost.AsyncStore.connect([standby.address, server.address]) as store:
            assert (await store.create_run("e-1", agent="a")).created
            assert (await store.list_runs(agent="a")).total == 1
        assert {r.method for r in standby.refused} == {"CreateRun"}


# -- a takeover during a call ------------------------------------------------------------


async def test_a_command_whose_answer_was_lost_in_a_takeover_is_applied_once(
    coordinators: Coordinators, standby: Standby, transport: str
) -> None:
    """The leader commits an acquire, dies before its answer arrives; the
    client retries with the same request id, via a standby, on the new leader,
    which answers from the database: one acquire, token 1."""
    first = coordinators.start()
    with Proxy(first.address) as proxy:
        async with fencepost.Client([proxy.address, standby.address], owner="w",
                                    transport=transport) as client:  # type: ignore[arg-type]
            warm = await holding_over_the_stream(client, "warm",
                                                 streamed=transport == "stream")
            await warm.release()
            proxy.hold_replies()
            call = asyncio.ensure_future(client.acquire("run-1", ttl_ms=60_000))
            async with fencepost.Client(first.address) as direct:
                async def committed() -> fencepost.RunRecord:
                    while True:
                        with contextlib.suppress(fencepost.RunNotFoundError):
                            return await direct.get("run-1")
                        await asyncio.sleep(0.01)

                applied = await asyncio.wait_for(committed(), WAIT_S)
            assert not call.done()  # committed, answer held back
            coordinators.stop()
            proxy.cut()
            second = coordinators.start()
            standby.leader = second.address
            lease = await asyncio.wait_for(call, WAIT_S)
            assert client.address == second.address
            assert lease.fencing_token == applied.fencing_token == 1
            now = await client.get("run-1")
            assert (now.fencing_token, now.version, now.attempt) == (1, applied.version, 1)
            # the way to the new leader went through the standby's hint; a unary
            # retry it refused carried the request id the new leader answers
            # from the database (over the stream, the retry went on the new
            # leader's Execute stream once the standby had named it)
            assert standby.refused
            retried = [r for r in standby.refused if r.method == "Acquire"]
            if retried:
                again = await raw_acquire(second.address, "run-1", "w", retried[-1].request_id)
                assert again.run.fencing_token == 1 and again.run.version == applied.version
            await lease.finish()


# -- streams -----------------------------------------------------------------------------


@pytest.fixture
async def two_endpoints(coordinators: Coordinators) -> AsyncIterator[tuple[str, str]]:
    """The first endpoint is the leader; the second is where the next one will listen."""
    first = coordinators.start()
    yield first.address, free_address()


async def test_keepalive_moves_to_the_next_endpoint_and_retracks_its_leases(
    coordinators: Coordinators, two_endpoints: tuple[str, str]
) -> None:
    losses: list[LostReason] = []
    # unary mutations: no Execute stream that could move to the new leader first
    async with fencepost.Client(list(two_endpoints), owner="w", transport="unary",
                                on_lost=lambda lease, why: losses.append(why)) as client:
        lease = await client.acquire("run-1", ttl_ms=60_000)
        kept = await client.acquire("run-2", ttl_ms=60_000)
        first = coordinators.leader
        assert first is not None
        await until(lambda: {"run-1", "run-2"} <= set(first.app.hub.by_run),  # type: ignore[union-attr]
                    "tracked on the first leader")
        sessions = client.statistics().keepalive_streams_opened
        coordinators.stop()
        second = coordinators.start(two_endpoints[1])
        await until(lambda: {"run-1", "run-2"} <= set(second.app.hub.by_run),  # type: ignore[union-attr]
                    "re-tracked on the new leader")
        assert client.statistics().keepalive_streams_opened > sessions
        assert client.address == two_endpoints[1]
        assert lease.is_active and not lease.at_risk and kept.is_active
        # the new leader pushes a fence move on the new stream
        async with fencepost.Client(second.address, owner="operator") as operator:
            await operator.cancel("run-1")
        await asyncio.wait_for(lease.lost.wait(), WAIT_S)
        assert lease.lost_reason is LostReason.CANCELLED and losses == [LostReason.CANCELLED]
        assert kept.is_active
        await kept.renew()  # a fenced call on the new leader
        await kept.finish()


async def test_unary_renewals_follow_the_leader(
    coordinators: Coordinators, two_endpoints: tuple[str, str]
) -> None:
    async with fencepost.Client(list(two_endpoints), owner="w", renewal="unary",
                                transport="unary") as client:
        lease = await client.acquire("run-1", ttl_ms=3_000)
        coordinators.stop()
        stopped_at = time.monotonic()
        coordinators.start(two_endpoints[1])
        await until(lambda: lease.safe_until > stopped_at + 3.0, "a renewal on the new leader")
        assert lease.is_active and client.address == two_endpoints[1]


async def test_the_execute_stream_reconnects_to_the_new_leader(
    coordinators: Coordinators, two_endpoints: tuple[str, str]
) -> None:
    async with fencepost.Client(list(two_endpoints), owner="w") as client:
        lease = await holding_over_the_stream(client)
        opened = client.statistics().execute_streams_opened
        coordinators.stop()
        coordinators.start(two_endpoints[1])
        await lease.record_checkpoint("ckpt/1", 1)  # retried until the new leader answers
        await until(lambda: (s := client.statistics()).execute_stream_open
                    and s.execute_streams_opened > opened, "an Execute stream to the new leader")
        sent = client.statistics().execute_commands_sent
        await lease.finish()
        await until(lambda: client.statistics().execute_commands_sent > sent,
                    "the finish sent on the new stream")
        assert (await client.get("run-1")).checkpoint_ref is not None


async def test_watch_resumes_on_the_new_leader_with_no_gap_and_no_duplicate(
    coordinators: Coordinators, two_endpoints: tuple[str, str]
) -> None:
    seen: list[int] = []
    async with fencepost.Client(list(two_endpoints), owner="w") as client:
        async def watch() -> None:
            async for ev in client.watch(from_revision=1):
                seen.append(ev.revision)

        task = asyncio.create_task(watch())
        try:
            lease = await client.acquire("run-1", ttl_ms=60_000)
            await lease.record_checkpoint("ckpt/1", 1)
            await until(lambda: len(seen) >= 2, "the first leader's changes")
            coordinators.stop()
            second = coordinators.start(two_endpoints[1])
            async with fencepost.Client(second.address, owner="other") as other:
                await other.acquire("run-2")
                await lease.finish()
                last = (await other.list_all()).revision
            await until(lambda: seen and seen[-1] >= last, "the new leader's changes")
            assert seen == list(range(1, last + 1))
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- a coordinator that stops answering without closing its connections -----------------


async def test_a_keepalive_stream_that_stops_answering_moves_to_another_endpoint(
    server: ServerThread,
) -> None:
    """Behind the proxy the coordinator looks frozen (requests go in, nothing
    comes back). A renewal unanswered for a third of the ttl ends the stream;
    the next one goes to the standby, which names the leader's own address."""
    with Proxy(server.address) as proxy, Standby(leader=server.address) as standby:
        async with fencepost.Client([proxy.address, standby.address], owner="w",
                                    transport="unary") as client:
            lease = await client.acquire("run-1", ttl_ms=3_000)
            hub = server.app.hub  # type: ignore[union-attr]
            await until(lambda: "run-1" in hub.by_run, "tracked through the proxy")
            frozen_at = time.monotonic()
            proxy.hold_replies()
            await until(lambda: client.address == server.address, "the stream moving")
            assert "KeepAlive" in standby.methods()
            await until(lambda: lease.safe_until > frozen_at + 3.0, "a renewal answered")
            assert lease.is_active


async def test_a_call_that_a_frozen_leader_never_answers_moves_the_next_call(
    server: ServerThread,
) -> None:
    """The stream's coordinator takes a command and never answers: the call
    ends at its attempt deadline with an unknown outcome (as with one
    endpoint); the next call goes elsewhere, and the Execute stream moves."""
    policy = RetryPolicy(total_timeout_s=5.0, attempt_timeout_s=1.0, max_backoff_s=0.2)
    with Proxy(server.address) as proxy, Standby(leader=server.address) as standby:
        async with fencepost.Client([proxy.address, standby.address], owner="w",
                                    retry=policy) as client:
            lease = await holding_over_the_stream(client)
            opened = client.statistics().execute_streams_opened
            proxy.hold_replies()
            with pytest.raises(fencepost.OutcomeUnknownError):
                await lease.record_checkpoint("ckpt/1", 1)
            await lease.renew()  # the standby names the leader's own address
            assert client.address == server.address
            await until(lambda: (s := client.statistics()).execute_stream_open
                        and s.execute_streams_opened > opened, "the Execute stream to the leader")
            rec = await lease.finish()
            # the checkpoint whose answer was lost was applied, once
            assert rec.checkpoint_ref is not None and rec.checkpoint_ref.key == "ckpt/1"
            assert rec.fencing_token == 1


# -- a coordinator whose machine died: connection attempts go unanswered ----------------

# gRPC's own connection timeout (20 s), instead of the SDK's quicker defaults:
# the client must still move on after CONNECT_WAIT_S
GRPC_CONNECT_DEFAULTS = [("grpc.min_reconnect_backoff_ms", 20_000),
                         ("grpc.initial_reconnect_backoff_ms", 1_000),
                         ("grpc.max_reconnect_backoff_ms", 120_000)]


async def test_an_endpoint_that_takes_no_connection_is_passed_over(server: ServerThread) -> None:
    with Blackhole() as dead:
        async with fencepost.Client([dead.address, server.address], owner="w",
                                    channel_options=GRPC_CONNECT_DEFAULTS) as client:
            started = time.monotonic()
            lease = await client.acquire("run-1")
            assert time.monotonic() - started < CONNECT_WAIT_S + 2.0
            assert client.address == server.address and lease.fencing_token == 1
        async with fencepost.Client([dead.address, server.address],
                                    channel_options=GRPC_CONNECT_DEFAULTS) as reader:
            started = time.monotonic()
            assert (await reader.get("run-1")).fencing_token == 1
            assert time.monotonic() - started < CONNECT_WAIT_S + 2.0


async def test_streams_pass_over_an_endpoint_that_takes_no_connection(
    coordinators: Coordinators,
) -> None:
    first = coordinators.start()
    later = free_address()
    seen: list[int] = []
    with Blackhole() as dead:
        async with fencepost.Client([first.address, dead.address, later], owner="w",
                                    transport="unary",
                                    channel_options=GRPC_CONNECT_DEFAULTS) as client:
            lease = await client.acquire("run-1", ttl_ms=6_000)

            async def watch() -> None:
                async for ev in client.watch(from_revision=1):
                    seen.append(ev.revision)

            task = asyncio.create_task(watch())
            try:
                await until(lambda: seen == [1], "the first change")
                coordinators.stop()
                stopped_at = time.monotonic()
                second = coordinators.start(later)
                # renewed on the new leader well within the ttl (gRPC alone
                # would wait 20 s for the dead endpoint's connection)
                await until(lambda: lease.safe_until > stopped_at + 6.0,
                            "a renewal on the new leader")
                assert lease.is_active and client.address == later
                async with fencepost.Client(second.address, owner="other") as other:
                    await other.acquire("run-2")
                    last = (await other.list_all()).revision
                await until(lambda: seen[-1] >= last, "the watch on the new leader")
                assert seen == list(range(1, last + 1))
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
