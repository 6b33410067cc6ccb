"""A client that grows the server through its streams: what it may hold is
bounded per stream, per connection and, with identities on, per principal;
past a bound it gets a clear refusal naming the limit, and what it held is
let go when it goes (docs/SECURITY.md "Limits").

Every count here is read from the server's own ``/metrics`` families; one
test runs a real ``fencepost serve`` process and watches its RSS."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_devtools.ports import free_port
from fencepost_server.testing.server import ServerThread

TESTS = Path(__file__).resolve().parents[1]
for sub in ("service", "system"):
    if str(TESTS / sub) not in sys.path:
        sys.path.insert(0, str(TESTS / sub))

from _proc import ServerProc  # noqa: E402
from _tls import make_certs  # noqa: E402

# A connection of its own per channel (gRPC shares one between channels to
# the same target by default), and no BDP probing: the HTTP/2 window stays at
# 64 KiB, as for a client that stalled.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
RE = grpc.StatusCode.RESOURCE_EXHAUSTED


def metrics(srv: ServerThread) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the server's /metrics, rendered on its own loop."""
    assert srv.app is not None and srv.app.metrics is not None
    text = srv.call(srv.app.metrics.render_async).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(srv: ServerThread, name: str, **labels: str) -> float:
    return metrics(srv)[(name, frozenset(labels.items()))]


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def refusal(err: grpc.RpcError) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    info = error_details_pb2.ErrorInfo()
    for d in status.details if status is not None else ():
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            d.Unpack(info)
    return err.code(), info.reason, dict(info.metadata)  # type: ignore[attr-defined]


def acquires(first: int, n: int, prefix: str = "r", *, ids: bool = False) -> pb.ExecuteRequest:
    """Acquires of runs prefix+first.. (with request ids q-prefix+i: ``ids``)."""
    return pb.ExecuteRequest(commands=[
        pb.Command(id=i + 1, acquire=pb.AcquireRequest(
            run_id=f"{prefix}{i}", owner="w", lease_ttl_ms=600_000,
            request_id=f"q-{prefix}{i}" if ids else ""))
        for i in range(first, first + n)])


class Unread:
    """An Execute stream whose client sends ``messages`` and never reads;
    ``outcome()`` then reads it to its end, bounded in time."""

    def __init__(self, ch: grpc.Channel, messages: list[pb.ExecuteRequest]) -> None:
        self.done = threading.Event()

        def feed() -> Iterator[pb.ExecuteRequest]:
            yield from messages
            self.done.wait(60)  # keep the request side open: the client is just slow

        self.call = ledger_pb2_grpc.LedgerStub(ch).Execute(feed(), timeout=60)

    def outcome(self) -> tuple[grpc.StatusCode, str, dict[str, str], int]:
        """Half-close, read to the end: (code, reason, metadata, results read)."""
        self.done.set()
        n = 0
        try:
            for msg in self.call:
                n += len(msg.results)
        except grpc.RpcError as err:
            return (*refusal(err), n)
        return grpc.StatusCode.OK, "", {}, n


def test_an_execute_stream_whose_results_are_never_read_is_dropped(make_server: Any) -> None:
    """Results queued for a reader are bounded per stream: past the bound the
    stream ends with STREAM_TOO_SLOW naming the limit, its queue is let go,
    and the commands it took still commit (a retry by request id is answered
    with the original grant, never a second one)."""
    with make_server(stream_queue_limit=2_000) as srv, \
            grpc.insecure_channel(srv.address, options=OWN_CONNECTION) as ch:
        slow = Unread(ch, [acquires(m * 500, 500, ids=True) for m in range(20)])
        wait_for("the stream to be dropped", lambda: sample(
            srv, "fencepost_stream_limit_refusals_total", limit="max_queued_per_stream") == 1)
        code, reason, md, read = slow.outcome()
        assert (code, reason, md) == (RE, "STREAM_TOO_SLOW", {
            "limit": "max_queued_per_stream", "value": "2000"}), (code, reason, md)
        assert read < 10_000  # what was in flight, not the backlog
        wait_for("its queue to be let go", lambda: (
            sample(srv, "fencepost_stream_queued"),
            sample(srv, "fencepost_stream_clients", kind="connection")) == (0, 0))
        taken = srv.writer.state.revision
        assert taken > 2_000  # the server kept taking commands until the drop
        led = ledger_pb2_grpc.LedgerStub(ch)
        for i in range(0, 10_000, 97):
            run = led.Acquire(pb.AcquireRequest(run_id=f"r{i}", owner="w",
                                                lease_ttl_ms=600_000, request_id=f"q-r{i}")).run
            assert (run.fencing_token, run.version) == (1, 1), run


def test_a_reader_that_keeps_up_is_not_dropped_for_one_commits_answers(
        make_server: Any) -> None:
    """The per-stream bound counts results, but an empty queue always takes
    one message: 500 results of one commit, read at once, are not an overflow
    even with the bound at 10."""
    with make_server(stream_queue_limit=10) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        got = Unread(ch, [acquires(0, 500)]).outcome()
        assert got == (grpc.StatusCode.OK, "", {}, 500), got


def test_execute_results_are_bounded_per_connection(make_server: Any) -> None:
    """Three unread Execute streams on one connection, each under the
    per-stream bound, together over the connection's: its slowest stream is
    dropped with STREAM_TOO_SLOW naming the connection limit; another
    connection is not touched."""
    with make_server(stream_queue_limit=100_000, max_queued_per_connection=1_000) as srv, \
            grpc.insecure_channel(srv.address, options=OWN_CONNECTION) as ch, \
            grpc.insecure_channel(srv.address, options=OWN_CONNECTION) as other:
        # about 1,200 results of each fit in the HTTP/2 windows; the rest queue
        slow = [Unread(ch, [acquires(s * 10_000 + m * 500, 500) for m in range(6)])
                for s in range(3)]
        wait_for("a stream of the connection to be dropped", lambda: sample(
            srv, "fencepost_stream_limit_refusals_total", limit="max_queued_per_connection") >= 1)
        assert sample(srv, "fencepost_stream_queued") <= 1_000
        # another connection's stream works as ever
        ok = Unread(other, [acquires(0, 50, prefix="o")])
        ended = [s.outcome() for s in slow]
        dropped = [e for e in ended if e[1] == "STREAM_TOO_SLOW"]
        assert dropped and all(e[:3] == (RE, "STREAM_TOO_SLOW", {
            "limit": "max_queued_per_connection", "value": "1000"}) for e in dropped), ended
        assert ok.outcome() == (grpc.StatusCode.OK, "", {}, 50)
        wait_for("every budget to go with its streams", lambda: (
            sample(srv, "fencepost_stream_queued"),
            sample(srv, "fencepost_stream_clients", kind="connection")) == (0, 0))


class KeepAlive:
    """A KeepAlive stream read by a background task (answers, unbatched)."""

    def __init__(self, ledger: Any, owner: str) -> None:
        self.call = ledger.KeepAlive()
        self.owner = owner
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                for one in msg.batch or [msg]:
                    self.inbox.put_nowait(one)
        except BaseException as exc:
            self.inbox.put_nowait(exc)

    async def hello(self) -> KeepAlive:
        await self.call.write(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner=self.owner)))
        return self

    async def track(self, runs: list[pb.AcquireResponse]) -> list[Any]:
        """Track each run; the answers to the tracks that were refused."""
        await self.call.write(pb.KeepAliveRequest(renews=[
            pb.KeepAliveRenew(run_id=r.run.run_id, fencing_token=r.run.fencing_token)
            for r in runs]))
        answers = [await asyncio.wait_for(self.inbox.get(), 10) for _ in runs]
        return [a for a in answers if a.WhichOneof("kind") != "renewed"]

    async def close(self) -> None:
        self.call.cancel()
        self._task.cancel()


@pytest.fixture
async def leased(make_server: Any) -> AsyncIterator[Any]:
    """A server limited to 50 tracked leases per connection, and a helper
    that acquires runs."""
    with make_server(max_tracked_per_connection=50) as srv:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            led = ledger_pb2_grpc.LedgerStub(ch)

            async def acquire(prefix: str, n: int, owner: str = "w") -> list[Any]:
                return [await led.Acquire(pb.AcquireRequest(run_id=f"{prefix}{i}", owner=owner))
                        for i in range(n)]

            yield srv, acquire


async def test_leases_tracked_are_bounded_per_connection_not_only_per_stream(leased: Any) -> None:
    srv, acquire = leased
    runs = await acquire("k", 100)
    opts = OWN_CONNECTION
    async with grpc.aio.insecure_channel(srv.address, options=opts) as ch, \
            grpc.aio.insecure_channel(srv.address, options=opts) as other_ch:
        led, other = ledger_pb2_grpc.LedgerStub(ch), ledger_pb2_grpc.LedgerStub(other_ch)
        streams = [await KeepAlive(led, "w").hello() for _ in range(4)]
        assert await streams[0].track(runs[0:20]) == []
        assert await streams[1].track(runs[20:40]) == []
        refused = await streams[2].track(runs[40:60])  # 10 more fit, then the limit
        refused += await streams[3].track(runs[60:70])
        assert [r.error.run_id for r in refused] == [r.run.run_id for r in runs[50:70]]
        for r in refused:
            assert r.error.code == "STREAM_LIMIT_EXCEEDED", r
            assert dict(r.error.metadata) == {"limit": "max_tracked_per_connection",
                                              "value": "50"}, r
            assert "--max-tracked-per-connection" in r.error.message
        # another connection has its own
        side = await KeepAlive(other, "w").hello()
        assert await side.track(runs[70:100]) == []
        assert sample(srv, "fencepost_stream_tracked") == 80
        assert sample(srv, "fencepost_stream_limit_refusals_total",
                      limit="max_tracked_per_connection") == 20
        # a stream that ends makes room on its connection
        await streams[0].close()
        wait = lambda: sample(srv, "fencepost_stream_tracked") == 60  # noqa: E731
        await asyncio.to_thread(wait_for, "the closed stream's leases to be let go", wait)
        assert await streams[3].track(runs[60:70]) == []
        for s in (*streams[1:], side):
            await s.close()
    await asyncio.to_thread(wait_for, "every tracked lease to be let go", lambda: (
        sample(srv, "fencepost_stream_tracked"),
        sample(srv, "fencepost_stream_clients", kind="connection")) == (0, 0))
    hub = srv.app.hub
    assert not hub.by_run and not hub.sessions and not hub.budgets


def test_watch_buffers_are_bounded_per_connection(make_server: Any) -> None:
    """Three watchers on one connection that never read, each under the
    per-stream bound: past the connection's bound they are dropped, slowest
    first; a watcher on another connection that reads sees every change."""
    with make_server(stream_queue_limit=100_000, max_queued_per_connection=500) as srv, \
            grpc.insecure_channel(srv.address, options=OWN_CONNECTION) as ch, \
            grpc.insecure_channel(srv.address, options=OWN_CONNECTION) as reader_ch:
        slow = [ledger_pb2_grpc.LedgerStub(ch).WatchRuns(pb.WatchRunsRequest(), timeout=60)
                for _ in range(3)]
        seen: list[int] = []

        def read() -> None:
            call = ledger_pb2_grpc.LedgerStub(reader_ch).WatchRuns(
                pb.WatchRunsRequest(), timeout=60)
            for ev in call:
                seen.append(ev.revision)
                if len(seen) == 1_500:
                    break
            call.cancel()

        reader = threading.Thread(target=read)
        reader.start()
        wait_for("four watchers", lambda: sample(
            srv, "fencepost_open_streams", kind="watch") == 4)
        led = ledger_pb2_grpc.LedgerStub(reader_ch)
        big = "x" * 400  # fill the HTTP/2 windows quickly
        for m in range(15):
            for _ in led.Execute(iter([acquires(m * 100, 100, prefix=big)])):
                pass
            want = (m + 1) * 100
            wait_for("the reading watcher to keep up", lambda: len(seen) >= want)  # noqa: B023
        wait_for("a watcher of the connection to be dropped", lambda: sample(
            srv, "fencepost_stream_limit_refusals_total", limit="max_queued_per_connection") >= 1)
        assert sample(srv, "fencepost_stream_queued") <= 500
        reader.join(30)
        assert seen == list(range(1, 1_501))
        outcomes = []
        for call in slow:  # a dropped watcher ends once read; the others are cancelled
            timer = threading.Timer(5, call.cancel)
            timer.start()
            try:
                for _ in call:
                    pass
            except grpc.RpcError as err:
                outcomes.append(refusal(err))
            timer.cancel()
        assert (RE, "STREAM_TOO_SLOW", {"limit": "max_queued_per_connection",
                                        "value": "500"}) in outcomes, outcomes


def test_tracked_leases_are_bounded_per_principal_over_its_connections(
        make_server: Any, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    with make_server(tls_cert=str(certs.server.cert), tls_key=str(certs.server.key),
                     client_ca=str(certs.ca.cert), max_tracked_per_principal=30) as srv:

        async def main() -> None:
            chans = [grpc.aio.secure_channel(srv.address, certs.creds(who), options=OWN_CONNECTION)
                     for who in ("w1", "w1", "w2")]
            try:
                a, b, c = (ledger_pb2_grpc.LedgerStub(ch) for ch in chans)
                runs = {who: [await led.Acquire(pb.AcquireRequest(run_id=f"{who}-{i}", owner=who))
                              for i in range(40)] for who, led in (("w1", a), ("w2", c))}
                first = await KeepAlive(a, "w1").hello()
                second = await KeepAlive(b, "w1").hello()  # the same principal, another connection
                assert await first.track(runs["w1"][:20]) == []
                refused = await second.track(runs["w1"][20:40])
                assert [r.error.run_id for r in refused] == [
                    r.run.run_id for r in runs["w1"][30:40]]
                assert dict(refused[0].error.metadata) == {
                    "limit": "max_tracked_per_principal", "value": "30", "principal": "w1"}
                assert refused[0].error.code == "STREAM_LIMIT_EXCEEDED"
                other = await KeepAlive(c, "w2").hello()  # another principal has its own
                assert await other.track(runs["w2"][:30]) == []
                assert sample(srv, "fencepost_stream_clients", kind="principal") == 2
                for s in (first, second, other):
                    await s.close()
            finally:
                for ch in chans:
                    await ch.close()

        asyncio.run(main())
        wait_for("the budgets to go", lambda: (
            sample(srv, "fencepost_stream_tracked"),
            sample(srv, "fencepost_stream_clients", kind="principal")) == (0, 0))


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.slow
def test_a_real_server_stays_bounded_under_an_unread_execute_flood(tmp_path: Path) -> None:
    """``fencepost serve`` in a process of its own: 300,000 renewals of one
    run on an Execute stream whose client never reads. The stream is dropped
    with STREAM_TOO_SLOW, the server's RSS stays within a bound (before, it
    grew by 108 MiB and kept the stream), and nothing stays queued once the
    client has gone."""
    http = free_port()
    srv = ServerProc(tmp_path / "fp.db", tmp_path / "server.log",
                     args=("--http-listen", f"127.0.0.1:{http}", "--max-queued-per-stream",
                           "10000"))
    srv.start()
    dropped = ("fencepost_stream_limit_refusals_total",
               frozenset({("limit", "max_queued_per_stream")}))
    try:
        proc = psutil.Process(srv.proc.pid)  # type: ignore[union-attr]
        with grpc.insecure_channel(srv.address, options=OWN_CONNECTION) as ch:
            led = ledger_pb2_grpc.LedgerStub(ch)
            run = led.Acquire(pb.AcquireRequest(run_id="r", owner="w",
                                                lease_ttl_ms=600_000)).run
            before = peak = proc.memory_info().rss
            renew = pb.RenewRequest(run_id="r", owner="w", fencing_token=run.fencing_token)
            slow = Unread(ch, [pb.ExecuteRequest(commands=[
                pb.Command(id=m * 1000 + i + 1, renew=renew) for i in range(1000)])
                for m in range(300)])

            def dropped_yet() -> bool:
                nonlocal peak
                peak = max(peak, proc.memory_info().rss)
                return scrape(http).get(dropped) == 1

            wait_for("the unread stream to be dropped", dropped_yet, timeout=60)
            code, reason, md, _ = slow.outcome()
        assert (code, reason, md) == (RE, "STREAM_TOO_SLOW", {
            "limit": "max_queued_per_stream", "value": "10000"})
        grown = peak - before
        assert grown < 48 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
        gone = {("fencepost_stream_queued", frozenset()): 0.0,
                ("fencepost_stream_clients", frozenset({("kind", "connection")})): 0.0}
        wait_for("nothing queued once the client has gone",
                 lambda: {k: v for k, v in scrape(http).items() if k in gone} == gone)
    finally:
        srv.kill()
