"""Coordinators on one PostgreSQL database: exactly one leads, the standbys
refuse with NOT_LEADER naming it, a takeover keeps every acknowledged write and
every live lease, and a deposed leader commits nothing and exits 3.

Real ``fencepost serve`` processes over a real PostgreSQL (pgcluster), killed
with SIGKILL and paused with SIGSTOP."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from _proc import ServerProc, call_status, reason
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencepost.v1 import (
    engine_store_pb2,
    engine_store_pb2_grpc,
    ledger_pb2,
    ledger_pb2_grpc,
    record_pb2,
)
from fencepost_devtools.pgcluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LEASE = "2s"  # the leader lease: short, so the tests see takeovers quickly
RENEW = "300ms"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def cluster(pg_cluster: Cluster) -> Cluster:
    """The session's PostgreSQL (tests/conftest.py); each test gets its own database."""
    return pg_cluster


@pytest.fixture
def db_url(cluster: Cluster) -> str:
    return cluster.create_database(f"fo_{uuid.uuid4().hex[:10]}")


class Coordinators:
    """N ``fencepost serve`` processes on one database, stopped at the end."""

    def __init__(self, url: str, tmp: Path, n: int, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        args = ("--leader-lease", LEASE, "--leader-renew", RENEW, "--http-listen", "off", *extra)
        self.procs = [
            ServerProc(url, tmp / f"coordinator-{i}.log", args=args, env=env)  # type: ignore[arg-type]
            for i in range(n)
        ]

    def start_all(self) -> Coordinators:
        for p in self.procs:  # at (nearly) the same moment: nobody waits for anybody
            p.start(serving=False)
        return self

    def health(self, p: ServerProc) -> Any:
        with p.channel() as ch:
            try:
                return health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError as exc:
                return exc.code()

    def leaders(self) -> list[ServerProc]:
        return [p for p in self.procs if p.proc is not None and p.proc.poll() is None
                and self.health(p) == SERVING]

    def wait_leader(self, timeout: float = 15.0, among: list[ServerProc] | None = None
                    ) -> ServerProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p for p in self.leaders() if among is None or p in among]
            if len(found) == 1:
                return found[0]
            assert len(found) < 2, "two coordinators say SERVING at once"
            time.sleep(0.05)
        raise AssertionError("no leader within the timeout:\n" + "\n".join(
            p.log_tail(1500) for p in self.procs))

    def close(self) -> None:
        for p in self.procs:
            if p.proc is not None and p.proc.poll() is None:
                try:
                    p.proc.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
            p.kill()


@pytest.fixture
def coordinators(db_url: str, tmp_path: Path) -> Iterator[Any]:
    made: list[Coordinators] = []

    def make(n: int, *extra: str, env: dict[str, str] | None = None) -> Coordinators:
        c = Coordinators(db_url, tmp_path, n, *extra, env=env)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = call_status(err)
    assert status is not None, err
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    raise AssertionError(f"no ErrorInfo in {status}")


def _ledger(p: ServerProc) -> tuple[grpc.Channel, Any]:
    ch = p.channel()
    return ch, ledger_pb2_grpc.LedgerStub(ch)


def _acquire(p: ServerProc, run_id: str, owner: str, ttl_ms: int, request_id: str = ""
             ) -> Any:
    ch, stub = _ledger(p)
    with ch:
        return stub.Acquire(ledger_pb2.AcquireRequest(
            run_id=run_id, owner=owner, lease_ttl_ms=ttl_ms, request_id=request_id),
            timeout=10).run


def _get(p: ServerProc, run_id: str) -> Any:
    ch, stub = _ledger(p)
    with ch:
        return stub.GetRun(ledger_pb2.GetRunRequest(run_id=run_id), timeout=10).run


def test_coordinators_started_together_elect_exactly_one_and_standbys_name_it(
    coordinators: Any,
) -> None:
    group = coordinators(3).start_all()
    leader = group.wait_leader()
    standbys = [p for p in group.procs if p is not leader]
    assert [group.health(p) for p in standbys] == [NOT_SERVING, NOT_SERVING]
    for p in standbys:
        # unary, a stream and another service: every RPC is refused, naming the leader
        ch, stub = _ledger(p)
        with ch:
            with pytest.raises(grpc.RpcError) as unary:
                stub.GetRun(ledger_pb2.GetRunRequest(run_id="x"), timeout=5)
            with pytest.raises(grpc.RpcError) as stream:
                list(stub.WatchRuns(ledger_pb2.WatchRunsRequest(), timeout=5))
            es = engine_store_pb2_grpc.EngineStoreStub(ch)
            with pytest.raises(grpc.RpcError) as engine:
                es.GetRun(engine_store_pb2.EngineGetRunRequest(id="x"), timeout=5)
        for err in (unary.value, stream.value, engine.value):
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            info = _error_info(err)
            assert info.reason == "NOT_LEADER"
            assert info.metadata["leader"] == leader.address
    # and the leader serves
    rec = _acquire(leader, "r1", "w1", 30_000)
    assert rec.fencing_token == 1


def test_the_leader_killed_a_standby_takes_over_with_every_write_and_lease(
    coordinators: Any,
) -> None:
    group = coordinators(2).start_all()
    leader = group.wait_leader()
    standby = next(p for p in group.procs if p is not leader)
    held = _acquire(leader, "held", "w1", 20_000, request_id="acquire-held")
    done = _acquire(leader, "done", "w2", 20_000)
    ch, stub = _ledger(leader)
    with ch:
        stub.Finish(ledger_pb2.FinishRequest(
            run_id="done", owner="w2", fencing_token=done.fencing_token,
            status=record_pb2.RUN_STATUS_COMPLETED), timeout=10)
    killed_at = time.monotonic()
    leader.kill()
    new = group.wait_leader(among=[standby])
    took = time.monotonic() - killed_at
    assert took < 2.0 + 3.0, f"takeover took {took:.1f} s with a 2 s leader lease"
    # a standby at another address cannot prove the leader dead: it waits for
    # the row to expire (at least the lease less one 300 ms renewal interval)
    assert took >= 1.5, f"a standby took over {took:.2f} s after the kill, before the lease"
    # every acknowledged write is there
    assert _get(new, "done").status == record_pb2.RUN_STATUS_COMPLETED
    now = _get(new, "held")
    assert now.status == record_pb2.RUN_STATUS_RUNNING
    assert now.fencing_token == held.fencing_token
    assert now.lease.owner == "w1"
    # the lease was extended by the time the coordinator was unavailable, never shortened
    before = held.lease.expires_at.ToMilliseconds()
    after = now.lease.expires_at.ToMilliseconds()
    assert after >= before + 1500, (before, after)
    # the holder renews on the new leader with its token; a retried request id
    # gets its stored answer instead of acquiring twice
    ch, stub = _ledger(new)
    with ch:
        renewed = stub.Renew(ledger_pb2.RenewRequest(
            run_id="held", owner="w1", fencing_token=held.fencing_token), timeout=10).run
    assert renewed.fencing_token == held.fencing_token
    again = _acquire(new, "held", "w1", 20_000, request_id="acquire-held")
    assert again.version == held.version and again.fencing_token == held.fencing_token
    # the killed coordinator comes back as a standby
    leader.start(serving=False)
    assert group.health(leader) == NOT_SERVING


def test_a_paused_leader_is_deposed_commits_nothing_and_exits_3(
    coordinators: Any, db_url: str,
) -> None:
    group = coordinators(2).start_all()
    leader = group.wait_leader()
    standby = next(p for p in group.procs if p is not leader)
    _acquire(leader, "before", "w1", 60_000)
    assert leader.proc is not None
    leader.proc.send_signal(signal.SIGSTOP)
    new = group.wait_leader(among=[standby])
    _acquire(new, "after", "w2", 60_000)
    with psycopg.connect(db_url) as db:
        (revision_before,) = db.execute(
            "SELECT max(revision) FROM fencepost.changes").fetchone()  # type: ignore[misc]
    leader.proc.send_signal(signal.SIGCONT)
    assert leader.proc.wait(15) == 3, leader.log_tail()
    assert "lost leadership" in leader.log_tail()
    with psycopg.connect(db_url) as db:
        (revision_after,) = db.execute(
            "SELECT max(revision) FROM fencepost.changes").fetchone()  # type: ignore[misc]
        (epoch, address) = db.execute(
            "SELECT epoch, address FROM fencepost.fencepost_leader").fetchone()  # type: ignore[misc]
    assert revision_after == revision_before, "the deposed leader committed after the takeover"
    assert epoch == 2 and address == new.address
    assert _get(new, "before").lease.owner == "w1"


def test_a_leader_restarted_in_place_after_a_crash_leads_without_waiting_for_its_lease(
    coordinators: Any,
) -> None:
    """The same coordinator (address, machine) started again after a kill -9:
    its predecessor's process is gone, so it takes over at once instead of
    waiting out the 30 s leader lease, and every acknowledged write and lease
    is there; while a standby elsewhere waits (the test above)."""
    group = coordinators(1, "--leader-lease", "30s", "--leader-renew", "1s").start_all()
    leader = group.wait_leader()
    held = _acquire(leader, "held", "w1", 60_000)
    leader.kill()
    restarted = time.monotonic()
    leader.start(timeout=25)
    took = time.monotonic() - restarted
    assert took < 10, f"the restart led after {took:.1f} s (the lease is 30 s)"
    assert "taking over without waiting" in leader.log_tail(4000)
    now = _get(leader, "held")
    assert (now.status, now.fencing_token, now.lease.owner) == (
        record_pb2.RUN_STATUS_RUNNING, held.fencing_token, "w1")


def test_a_clean_stop_hands_over_at_once(coordinators: Any) -> None:
    group = coordinators(2, "--leader-lease", "10s", "--leader-renew", "1s").start_all()
    leader = group.wait_leader()
    standby = next(p for p in group.procs if p is not leader)
    stopped = time.monotonic()
    assert leader.stop() == 0
    group.wait_leader(among=[standby], timeout=9)
    assert time.monotonic() - stopped < 5, "a clean stop waited for the 10 s leader lease"


def test_a_coordinator_whose_clock_is_off_refuses_to_lead(coordinators: Any) -> None:
    skewed = coordinators(1, "--test-hooks", "--max-clock-skew", "500ms",
                          env={"FENCEPOST_TEST_CLOCK_OFFSET_MS": "60000"})
    skewed.procs[0].start(serving=False)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert skewed.health(skewed.procs[0]) == NOT_SERVING
        time.sleep(0.2)
    assert "refusing to lead" in skewed.procs[0].log_tail()
    honest = coordinators(1).start_all()
    honest.wait_leader()
    assert skewed.health(skewed.procs[0]) == NOT_SERVING


def test_a_cut_database_connection_fails_one_batch_cleanly_and_the_next_reconnects(
    coordinators: Any, cluster: Cluster, db_url: str,
) -> None:
    group = coordinators(1).start_all()
    leader = group.wait_leader()
    _acquire(leader, "a", "w1", 60_000)
    dbname = db_url.rsplit("/", 1)[1]
    assert cluster.terminate_connections(dbname, "fencepost-writer%") >= 1
    outcomes = []
    for i in range(3):
        try:
            outcomes.append(_acquire(leader, f"b{i}", "w1", 60_000).fencing_token)
        except grpc.RpcError as exc:
            outcomes.append(reason(exc))
    assert outcomes[-1] == 1, outcomes  # reconnected: still the leader, writing
    assert set(outcomes[:-1]) <= {1, "STORAGE_UNAVAILABLE"}, outcomes
    assert group.health(leader) == SERVING
