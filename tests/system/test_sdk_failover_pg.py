"""The SDK across a real failover: two ``fencepost serve`` coordinators on
one real PostgreSQL (pgcluster), the leader SIGKILLed while a client given
both endpoints holds a lease, watches, and has commands in flight.

The client keeps its lease (renewed on the new leader), its next call
succeeds there, every command in flight is applied exactly once, and the
watch goes on with no gap and no duplicate."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import pytest
from test_failover import Coordinators

import fencepost
from fencepost_devtools.pgcluster import Cluster
from fencepost_server.cli import main
from fencepost_server.cli.common import EXIT_OK

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FENCEPOST = Path(sys.executable).parent / "fencepost"
TTL_MS = 6_000  # the lease must be renewed on the new leader to survive
BURST = 20  # acquires in flight when the leader dies


@pytest.fixture
def group(pg_cluster: Cluster, tmp_path: Path) -> Iterator[Coordinators]:
    url = pg_cluster.create_database(f"sdk_{uuid.uuid4().hex[:10]}")
    coordinators = Coordinators(url, tmp_path, 2)
    try:
        yield coordinators.start_all()
    finally:
        coordinators.close()


async def test_a_client_with_both_endpoints_keeps_its_lease_when_the_leader_is_killed(
    group: Coordinators, capsys: pytest.CaptureFixture[str]
) -> None:
    leader = group.wait_leader()
    standby = next(p for p in group.procs if p is not leader)
    endpoints = [p.address for p in group.procs]
    retry = fencepost.RetryPolicy(total_timeout_s=20.0)
    seen: list[int] = []
    async with fencepost.Client(endpoints, owner="worker", retry=retry) as client:
        lease = await client.acquire("held", ttl_ms=TTL_MS)
        assert client.address == leader.address

        async def watch() -> None:
            async for ev in client.watch(from_revision=1):
                seen.append(ev.revision)

        watcher = asyncio.create_task(watch())
        try:
            renewed = lease.safe_until
            await until(lambda: lease.safe_until > renewed, "a renewal on the old leader", 10)
            burst = [asyncio.ensure_future(client.acquire(f"burst-{i}", ttl_ms=60_000))
                     for i in range(BURST)]
            await asyncio.sleep(0)  # on their way
            killed_at = time.monotonic()
            leader.kill()

            # the next call succeeds, on the new leader
            rec = await lease.record_checkpoint("ckpt/held/1", 1)
            took = time.monotonic() - killed_at
            assert client.address == standby.address
            assert rec.fencing_token == lease.fencing_token == 1
            assert took < 2.0 + 5.0, f"the call waited {took:.1f} s for a 2 s leader lease"

            # every acquire in flight was applied once: token 1, first attempt
            leases = await asyncio.gather(*burst)
            assert [(x.fencing_token, x.record.attempt) for x in leases] == [(1, 1)] * BURST

            # the lease lives on: renewed by the new leader past its old ttl
            await until(lambda: lease.safe_until > killed_at + TTL_MS / 1000,
                        "a renewal on the new leader", 15)
            assert lease.is_active and not lease.is_lost
            now = await client.get("held")
            assert now.lease is not None and now.lease.owner == "worker"
            assert now.fencing_token == 1 and now.checkpoint_ref is not None

            # the watch went on across the takeover: every revision once, in order
            last = (await client.list_all()).revision
            await until(lambda: bool(seen) and seen[-1] >= last, "the watch to catch up", 10)
            assert seen == list(range(1, last + 1))
            await lease.finish()
            for x in leases:
                await x.release()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    # an operator sees who leads now
    assert main(["health", "--endpoints", ",".join(endpoints)]) == EXIT_OK
    report = dict(line.split() for line in capsys.readouterr().out.splitlines())
    assert report == {standby.address: "SERVING", leader.address: "UNREACHABLE"}


async def until(predicate: Callable[[], bool], what: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_fencepost_hold_with_both_endpoints_survives_the_leader_killed(
    group: Coordinators, tmp_path: Path
) -> None:
    """docs/OPERATIONS.md's walk-through: ``hold`` keeps its lease (and its
    command running) across a SIGKILL of the leader, and finishes the run on
    the new leader when the command ends."""
    leader = group.wait_leader()
    standby = next(p for p in group.procs if p is not leader)
    endpoints = ",".join(p.address for p in group.procs)
    started = tmp_path / "started"
    script = (f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); "
              "time.sleep(6)")  # two 3 s ttls: renewed on the new leader, or lost
    hold = subprocess.Popen(
        [str(FENCEPOST), "hold", "demo-run", "--endpoints", endpoints, "--ttl", "3s", "--",
         sys.executable, "-c", script],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while not started.exists():
            assert hold.poll() is None and time.monotonic() < deadline, hold.communicate()
            time.sleep(0.05)
        leader.kill()
        _, err = hold.communicate(timeout=60)
    finally:
        if hold.poll() is None:
            hold.kill()
    assert hold.returncode == 0, err.decode()
    with fencepost.SyncClient(standby.address) as client:
        rec = client.get("demo-run")
    assert rec.status is fencepost.RunStatus.COMPLETED
    assert (rec.fencing_token, rec.attempt) == (1, 1)  # one holder throughout


async def test_a_client_keeps_its_lease_when_the_leader_is_frozen(group: Coordinators) -> None:
    """SIGSTOP: the leader's connections stay open and nothing comes back. The
    KeepAlive stream gives up on it a third of a ttl after an unanswered
    renewal, and renews on the standby once that has taken over."""
    leader = group.wait_leader()
    standby = next(p for p in group.procs if p is not leader)
    ttl_ms = 9_000
    async with fencepost.Client([p.address for p in group.procs], owner="worker",
                                transport="unary") as client:
        lease = await client.acquire("held", ttl_ms=ttl_ms)
        renewed = lease.safe_until
        await until(lambda: lease.safe_until > renewed, "a renewal on the old leader", 10)
        assert leader.proc is not None
        leader.proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            await until(lambda: lease.safe_until > frozen_at + ttl_ms / 1000,
                        "a renewal on the new leader", 20)
            assert lease.is_active and not lease.at_risk
            assert client.address == standby.address
            rec = await lease.record_checkpoint("ckpt/held/1", 1)
            assert rec.fencing_token == 1
        finally:
            leader.proc.send_signal(signal.SIGCONT)  # it finds itself deposed and exits 3
        assert leader.proc.wait(15) == 3
        await lease.finish()


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_calls_in_flight_at_a_frozen_leader_are_answered_by_the_new_one(
    group: Coordinators, transport: Literal["stream", "unary"]
) -> None:
    """SIGSTOP with commands in flight: the frozen leader's connection stays
    open and its calls get no answer. The client's keepalive pings go
    unanswered, so it drops that connection within seconds, and the commands
    are retried (same request ids) on the standby once it has taken over:
    each applied once, long before their 30 s attempt deadline (which is what
    they would otherwise wait, to end with OutcomeUnknownError)."""
    leader = group.wait_leader()
    standby = next(p for p in group.procs if p is not leader)
    retry = fencepost.RetryPolicy(total_timeout_s=30.0, attempt_timeout_s=30.0)
    async with fencepost.Client([p.address for p in group.procs], owner="worker",
                                retry=retry, transport=transport) as client:
        first = await client.acquire("before", ttl_ms=60_000)
        assert client.address == leader.address
        assert leader.proc is not None
        leader.proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            burst = [asyncio.ensure_future(client.acquire(f"frozen-{i}", ttl_ms=60_000))
                     for i in range(BURST)]
            leases = await asyncio.gather(*burst)
            took = time.monotonic() - frozen_at
            assert [(x.fencing_token, x.record.attempt) for x in leases] == [(1, 1)] * BURST
            assert client.address == standby.address
            # the 2 s leader lease runs out, a standby takes over; keepalive
            # gives up on the frozen one after 2 s + 2 s
            assert took < 15.0, f"the calls waited {took:.1f} s"
            rec = await first.record_checkpoint("ckpt/before/1", 1)
            assert rec.fencing_token == 1
        finally:
            leader.proc.send_signal(signal.SIGCONT)  # it finds itself deposed and exits 3
        assert leader.proc.wait(15) == 3
        listed = await client.list_all()
        assert sorted(r.run_id for r in listed.runs) == sorted(
            ["before", *(f"frozen-{i}" for i in range(BURST))])
