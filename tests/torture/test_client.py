"""The torture's recording client over both transports: a command on the
Execute stream is recorded exactly like the unary call (refusals with their
reason and observed record), and a stream that breaks is a transport failure
retried with the same request id on a new stream."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from fencepost_server.testing.server import ServerThread
from torture.client import Attempt, Client, ExecuteStream, pick_transport


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with ServerThread(tmp_path_factory.mktemp("srv") / "f.db") as srv:
        yield srv


def _client(server: Any, name: str, transport: str) -> Client:
    return Client(name, server.address, io.StringIO(), seed=1, hard_stop_ns=2**62,
                  transport=transport)


def _shape(e: dict[str, Any]) -> tuple[Any, ...]:
    rec = e["rec"]
    return (e["f"], e["st"], e["code"], e["tf"], e["tries"], sorted(e),
            None if rec is None else (rec["version"], rec["status"], rec["fencing_token"],
                                      rec["attempt"], sorted(rec)))


def _session(server: Any, transport: str) -> list[dict[str, Any]]:
    run = f"r-{transport}"
    a, b = _client(server, "A", transport), _client(server, "B", transport)
    try:
        got = a.acquire(run, "A", 60_000)
        tok, ver = got["rec"]["fencing_token"], got["rec"]["version"]
        return [
            got,
            b.acquire(run, "B", 60_000),  # RUN_LEASE_HELD, with A's record
            a.fenced("renew", run, "A", tok + 1, ver),  # RUN_LEASE_LOST, with the record
            a.fenced("checkpoint", run, "A", tok, ver, key="k", snapshot_version=1),
            b.cancel("no-such-run"),  # RUN_NOT_FOUND, no record
            a.get_run(run),  # a read: unary on either transport
            a.fenced("finish", run, "A", tok, ver, status=4),
            a.delete_run(run),
        ]
    finally:
        a.close()
        b.close()


def test_stream_commands_are_recorded_like_unary_calls(server: Any) -> None:
    unary, stream = _session(server, "unary"), _session(server, "stream")
    assert [_shape(e) for e in stream] == [_shape(e) for e in unary]
    assert [e["code"] for e in stream][1:5] == ["RUN_LEASE_HELD", "RUN_LEASE_LOST", "",
                                                "RUN_NOT_FOUND"]
    held, lost = stream[1]["rec"], stream[2]["rec"]
    assert held == stream[0]["rec"] and lost["version"] == stream[0]["rec"]["version"]
    assert [e["tp"] for e in unary] == ["unary"] * 8
    assert [e["tp"] for e in stream] == ["stream"] * 5 + ["unary"] + ["stream"] * 2
    json.dumps(stream)  # the history line is plain JSON


def test_a_broken_stream_is_retried_with_the_same_request_id(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ExecuteStream.execute
    cut: list[int] = []

    def cut_once(self: ExecuteStream, kind: str, req: Any, timeout: float) -> Attempt:
        got = real(self, kind, req, timeout)  # applied, then the answer is lost
        if not cut:
            cut.append(1)
            self.close()
            self.broken = True
            return Attempt(failure="UNAVAILABLE", detail="the stream broke")
        return got

    monkeypatch.setattr(ExecuteStream, "execute", cut_once)
    c = _client(server, "R", "stream")
    try:
        e = c.acquire("r-retry", "R", 60_000)
        assert (e["st"], e["tf"], e["tries"], e["code"]) == ("ok", 1, 2, "UNAVAILABLE")
        assert c.streams_opened == 2
        # granted once: the retry got the original answer
        assert e["rec"]["fencing_token"] == 1 and e["rec"]["version"] == 1
        assert c.get_run("r-retry")["rec"] == e["rec"]
    finally:
        c.close()


def test_a_stream_that_ended_while_idle_is_replaced_before_the_next_command(
    server: Any,
) -> None:
    c = _client(server, "I", "stream")
    try:
        first = c.acquire("r-idle", "I", 60_000)
        assert c._stream is not None
        c._stream.close()
        assert c._stream.ended.wait(5)
        again = c.fenced("renew", "r-idle", "I", first["rec"]["fencing_token"],
                         first["rec"]["version"])
        assert (again["st"], again["tf"], c.streams_opened) == ("ok", 0, 2)
    finally:
        c.close()


def test_mixed_picks_each_transport_by_the_seed(tmp_path: Path) -> None:
    picks = [pick_transport("mixed", (100 + i) * 1000 + t) for i in range(4) for t in range(3)]
    assert picks == [pick_transport("mixed", (100 + i) * 1000 + t)
                     for i in range(4) for t in range(3)]
    assert set(picks) == {"unary", "stream"}
    assert pick_transport("stream", 7) == "stream" and pick_transport("unary", 7) == "unary"
    with pytest.raises(ValueError):
        pick_transport("carrier-pigeon", 1)


@pytest.fixture(scope="module")
def coordinators(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A leader and a standby on one PostgreSQL database (in process)."""
    from fencepost_devtools.pgcluster import Cluster

    with Cluster.start() as pg:
        url = pg.create_database("follow")
        with ServerThread(url, max_clock_skew="0") as leader, \
                ServerThread(url, max_clock_skew="0", wait_leading=0) as standby:
            yield leader, standby


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_a_call_to_a_standby_follows_the_leader_it_names(coordinators: Any,
                                                        transport: str) -> None:
    leader, standby = coordinators
    out = io.StringIO()
    c = Client("F", [standby.address, leader.address], out, seed=1, hard_stop_ns=2**62,
               transport=transport)
    try:
        c.ep = 0  # the standby first
        e = c.acquire(f"r-follow-{transport}", "F", 60_000)
        assert (e["st"], e["nl"], e["ep"], e["tf"]) == ("ok", 1, 1, 0), e
        assert e["rec"]["fencing_token"] == 1
        c.ep = 0  # a read follows too
        g = c.get_run(f"r-follow-{transport}")
        assert (g["st"], g["nl"], g["ep"], g["rec"]) == ("ok", 1, 1, e["rec"])
        assert e["at"] > e["inv"]  # the answering attempt was the second
    finally:
        c.close()


def test_a_no_effect_refusal_after_an_unknown_attempt_leaves_the_outcome_unknown(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STORAGE_UNAVAILABLE says its own attempt changed nothing; an earlier
    attempt whose answer was lost may still have committed, so the call goes
    on as after a transport failure (retried with the same request id)."""
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="STORAGE_UNAVAILABLE", domain="fencepost"))
    refusal = status_pb2.Status(code=14, message="nothing changed", details=[info])
    real = Client._unary
    script = [Attempt(failure="UNAVAILABLE"), Attempt(refusal=refusal)]

    def scripted(method: Any, req: Any) -> Attempt:
        got = real(method, req)  # the call is made (the first one commits)
        return script.pop(0) if script else got

    monkeypatch.setattr(Client, "_unary", staticmethod(scripted))
    c = _client(server, "U", "unary")
    try:
        e = c.acquire("r-no-effect", "U", 60_000)
        assert (e["st"], e["tf"], e["tries"]) == ("ok", 2, 3), e
        assert e["rec"]["fencing_token"] == 1  # the first attempt's acquisition, answered again
        script[:] = [Attempt(refusal=refusal)]  # with no unknown attempt before it: definite
        f = c.acquire("r-no-effect-2", "U", 60_000)
        assert (f["st"], f["code"], f["tf"]) == ("fail", "STORAGE_UNAVAILABLE", 0), f
    finally:
        c.close()
