"""Per-connection limits on the wire: message size (answered, the stream goes
on), leases tracked per KeepAlive stream, concurrent streams per connection,
and in-flight commands per Execute stream (one client flooding Execute cannot
push another client's p99 past a measured bound)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

BIG = 5 * 1024 * 1024  # over the default --max-message-bytes (4 MiB)


class Stream:
    """A bidirectional call fed from a queue (the test decides when to send)."""

    def __init__(self, method: object) -> None:
        self.q: queue.Queue[object] = queue.Queue()
        self.responses = method(iter(self.q.get, None), timeout=30)  # type: ignore[operator]

    def send(self, msg: object) -> None:
        self.q.put(msg)

    def next(self) -> object:
        return next(self.responses)

    def close(self) -> None:
        self.q.put(None)
        self.responses.cancel()


def _keepalive_answers(stream: Stream) -> Iterator[pb.KeepAliveResponse]:
    while True:
        msg = stream.next()
        assert isinstance(msg, pb.KeepAliveResponse)
        yield from (msg.batch if msg.batch else [msg])


def test_an_oversized_keepalive_message_is_answered_and_the_stream_goes_on(server, channel) -> None:  # type: ignore[no-untyped-def]
    led = ledger_pb2_grpc.LedgerStub(channel)
    tok = led.Acquire(pb.AcquireRequest(run_id="r", owner="w")).run.fencing_token
    s = Stream(led.KeepAlive)
    try:
        s.send(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")))
        s.send(pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id="x" * BIG, fencing_token=1)))
        s.send(pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id="r", fencing_token=tok)))
        answers = _keepalive_answers(s)
        err = next(answers)
        assert err.WhichOneof("kind") == "error", err
        assert (err.error.code, err.error.metadata["field"]) == ("RUN_VALIDATION_ERROR", "request")
        assert err.error.message.startswith("request: ") and "over the server's limit" in (
            err.error.message)
        ok = next(answers)
        assert ok.renewed.run_id == "r", ok  # same stream, still renewing
    finally:
        s.close()


def test_an_oversized_execute_message_is_answered_and_the_stream_goes_on(server, channel) -> None:  # type: ignore[no-untyped-def]
    s = Stream(ledger_pb2_grpc.LedgerStub(channel).Execute)
    try:
        s.send(pb.ExecuteRequest(commands=[pb.Command(id=1, acquire=pb.AcquireRequest(
            run_id="big", owner="w" * BIG))]))
        s.send(pb.ExecuteRequest(commands=[pb.Command(id=2, acquire=pb.AcquireRequest(
            run_id="ok", owner="w"))]))
        results: dict[int, pb.CommandResult] = {}
        while len(results) < 2:
            msg = s.next()
            assert isinstance(msg, pb.ExecuteResponse)
            results.update({r.id: r for r in msg.results})
        err = results[0].error
        info = error_details_pb2.ErrorInfo()
        assert err.details[0].Unpack(info)
        assert (err.code, info.reason, info.domain, info.metadata["field"]) == (
            grpc.StatusCode.INVALID_ARGUMENT.value[0], "RUN_VALIDATION_ERROR", "fencepost",
            "request")
        assert results[2].acquire.run.fencing_token == 1
        assert 1 not in results  # the oversized message's commands never ran
    finally:
        s.close()


def test_leases_tracked_per_keepalive_stream_are_limited(make_server: Any) -> None:
    with make_server(max_tracked_per_stream=3) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        led = ledger_pb2_grpc.LedgerStub(ch)
        toks = {f"r{i}": led.Acquire(pb.AcquireRequest(run_id=f"r{i}", owner="w"))
                .run.fencing_token for i in range(5)}
        s = Stream(led.KeepAlive)
        try:
            s.send(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")))
            answers = _keepalive_answers(s)
            for i in range(3):
                s.send(pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id=f"r{i}",
                                                                   fencing_token=toks[f"r{i}"])))
                assert next(answers).renewed.run_id == f"r{i}"
            for how in ("renew", "track"):
                msg = pb.KeepAliveRequest()
                getattr(msg, how).run_id, getattr(msg, how).fencing_token = "r3", toks["r3"]
                s.send(msg)
                err = next(answers)
                assert (err.error.run_id, err.error.code) == ("r3", "STREAM_LIMIT_EXCEEDED"), err
                assert "--max-tracked-per-stream" in err.error.message
                assert dict(err.error.metadata) == {"limit": "max_tracked_per_stream",
                                                    "value": "3"}
            # a tracked run still renews; untracking makes room
            s.send(pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id="r0",
                                                               fencing_token=toks["r0"])))
            assert next(answers).renewed.run_id == "r0"
            s.send(pb.KeepAliveRequest(untrack=pb.KeepAliveUntrack(run_id="r0")))
            s.send(pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id="r3",
                                                               fencing_token=toks["r3"])))
            assert next(answers).renewed.run_id == "r3"
        finally:
            s.close()


def test_concurrent_streams_per_connection_are_limited(make_server: Any) -> None:
    with make_server(max_concurrent_streams=2) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        led = ledger_pb2_grpc.LedgerStub(ch)
        tok = led.Acquire(pb.AcquireRequest(run_id="r", owner="w")).run.fencing_token
        open_streams = []
        for _ in range(2):  # two long-lived streams take both slots
            s = Stream(led.KeepAlive)
            s.send(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")))
            s.send(pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id="r", fencing_token=tok)))
            assert next(_keepalive_answers(s)).renewed.run_id == "r"
            open_streams.append(s)
        third: list[float] = []

        def unary() -> None:
            led.GetRun(pb.GetRunRequest(run_id="r"), timeout=20)
            third.append(time.monotonic())

        t0 = time.monotonic()
        t = threading.Thread(target=unary)
        t.start()
        time.sleep(1.0)
        assert not third, "a third concurrent call on the connection was not held back"
        open_streams.pop().close()
        t.join(20)
        assert third and third[0] - t0 >= 1.0
        for s in open_streams:
            s.close()
        # another connection is not affected by this one's streams
        with grpc.insecure_channel(srv.address) as other:
            ledger_pb2_grpc.LedgerStub(other).GetRun(pb.GetRunRequest(run_id="r"), timeout=5)


# Measured on the shared 2-core development machine (server, flooding client
# and this client in three processes): with --max-inflight-per-stream 256 the
# other client's Renew p99 was 34-66 ms under the flood in three measured runs (38 ms
# before it); with the limit lifted (1 000 000) it was 577 ms. The bound leaves room for a
# loaded CI machine and still fails if the limit stops working.
FAIR_LIMIT = 256
FAIR_P99_BOUND_S = 0.3


@pytest.mark.slow
@pytest.mark.timeout(120)
# The fairness under test is the writer queue's, the same on both stores; on
# PostgreSQL a round of 256 engine commands takes ~10x longer (a savepoint per
# command: network round trips), so its latency bound would measure the store.
@pytest.mark.sqlite_only
def test_one_client_flooding_execute_cannot_starve_another(tmp_path: Path, db: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))
    from _proc import ServerProc

    srv = ServerProc(db, tmp_path / "log",
                     args=("--max-inflight-per-stream", str(FAIR_LIMIT))).start()
    flood = None
    try:
        with grpc.insecure_channel(srv.address) as ch:
            led = ledger_pb2_grpc.LedgerStub(ch)
            tok = led.Acquire(pb.AcquireRequest(run_id="v", owner="victim")).run.fencing_token
            flood = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("_flood.py")), srv.address, "10"],
                stdout=subprocess.PIPE, text=True)
            assert flood.stdout is not None and flood.stdout.readline().strip() == "ready"
            time.sleep(1.5)  # the flood is at full rate
            lat = []
            for _ in range(300):
                t = time.perf_counter()
                led.Renew(pb.RenewRequest(run_id="v", owner="victim", fencing_token=tok),
                          timeout=10)
                lat.append(time.perf_counter() - t)
            lat.sort()
            p99 = lat[int(len(lat) * 0.99)]
            answered = int(flood.communicate(timeout=60)[0].strip())
            print(f"\nvictim Renew p50 {lat[len(lat) // 2] * 1000:.1f} ms, p99 "
                  f"{p99 * 1000:.1f} ms under a flood of {answered} commands")
            assert answered >= 20_000, "the flood did not flood"
            assert p99 < FAIR_P99_BOUND_S, f"p99 {p99 * 1000:.0f} ms"
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.wait()
        srv.stop()
