"""Coordinators that lead shards apart (``fencepost serve --lead-shards``) on
one PostgreSQL database: each leads about its share, the SDK given one of
them sends every call to its shard's owner, a SIGKILLed coordinator's shards
are taken by the others with every lease still held, a paused one serves
nothing of its shards once it wakes (they are taken: it finds its shard
lease lapsed), and one that joins gets its share handed over with every
lease kept. The check each batch makes is tested apart
(tests/service/test_shared_batches.py): a paused process finds its lease
lapsed before any batch could reach it.

Real ``fencepost serve`` processes over a real PostgreSQL (pgcluster)."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _proc import FENCEPOST, ServerProc, reason

import fencepost
from fencepost_devtools.pgcluster import Cluster
from fencepost_devtools.ports import free_port
from fencepost_server.core.shards import shard_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SHARDS = 8
LEASE, RENEW = "2s", "300ms"  # each shard's lease: short, so takeovers come quickly


@pytest.fixture
def db_url(pg_cluster: Cluster) -> str:
    return pg_cluster.create_database(f"ls_{uuid.uuid4().hex[:10]}")


class Coordinators:
    def __init__(self, url: str, tmp: Path, n: int) -> None:
        self.url, self.tmp = url, tmp
        self.procs: list[ServerProc] = []
        self.metrics: dict[str, int] = {}  # address -> its /metrics port
        for _ in range(n):
            self.add()

    def add(self) -> ServerProc:
        metrics = free_port()
        p = ServerProc(self.url, self.tmp / f"coordinator-{len(self.procs)}.log", args=(
            "--lead-shards", "--shards", str(SHARDS), "--leader-lease", LEASE,
            "--leader-renew", RENEW, "--http-listen", "off",
            "--metrics-listen", f"127.0.0.1:{metrics}"))
        self.metrics[p.address] = metrics
        self.procs.append(p)
        return p

    def scrape(self, p: ServerProc) -> dict[str, float]:
        """``name{labels}`` -> value of the coordinator's /metrics."""
        url = f"http://127.0.0.1:{self.metrics[p.address]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        return {k: float(v) for k, _, v in (ln.rpartition(" ") for ln in text.splitlines()
                                             if ln and not ln.startswith("#"))}

    def owners(self) -> dict[int, str]:
        """shard -> holder's advertised address, as the rows say."""
        with psycopg.connect(self.url, autocommit=True) as db:
            return dict(db.execute(  # type: ignore[arg-type]
                "SELECT shard, address FROM fencepost.fencepost_shards WHERE holder <> '' "
                "AND expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
            ).fetchall())

    def wait_balanced(self, alive: list[ServerProc], timeout: float = 20.0) -> dict[int, str]:
        """Until every shard is held by one of ``alive``, each holding its share,
        and each of them admits its shards (a routed call there succeeds)."""
        want = {p.address for p in alive}
        low, high = SHARDS // len(alive), -(-SHARDS // len(alive))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            owners = self.owners()
            counts = {a: list(owners.values()).count(a) for a in want}
            if len(owners) == SHARDS and set(owners.values()) == want \
                    and all(low <= c <= high for c in counts.values()):
                return owners
            time.sleep(0.1)
        raise AssertionError(f"not balanced: {self.owners()}\n" + "\n".join(
            p.log_tail(2000) for p in self.procs))

    def close(self) -> None:
        for p in self.procs:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
            p.kill()


@pytest.fixture
def coordinators(db_url: str, tmp_path: Path) -> Iterator[Coordinators]:
    c = Coordinators(db_url, tmp_path, 2)
    try:
        for p in c.procs:
            p.start()
        yield c
    finally:
        c.close()


def _runs(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


async def _until(check: object, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            await check()  # type: ignore[operator]
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_two_coordinators_each_lead_half_and_the_sdk_routes_to_both(
        coordinators: Coordinators) -> None:
    owners = coordinators.wait_balanced(coordinators.procs)
    a, b = coordinators.procs
    runs = _runs("both", 40)

    async def go() -> None:
        async with fencepost.Client(a.address, owner="w", renewal="off") as client:
            leases = [await client.acquire(r, ttl_ms=30_000) for r in runs]
            for lease in leases:
                await lease.renew()
                await lease.record_checkpoint("k", 1)
            for lease in leases[:20]:
                await lease.finish()
            got = await client.shards()
            assert {s.index: s.address for s in got.shards} == owners
            assert sum(s.runs for s in got.shards) == 40
            listed = [r.run_id for r in (await client.list_all()).runs]
            assert sorted(listed) == sorted(runs)

    asyncio.run(go())
    # each run's rows were written by its shard's owner, and exactly once
    with psycopg.connect(coordinators.url, autocommit=True) as db:
        rows = db.execute("SELECT run_id, count(*) FROM fencepost.runs GROUP BY run_id").fetchall()
    assert sorted(r for r, _ in rows) == sorted(runs) and {n for _, n in rows} == {1}
    assert {owners[shard_of(r, SHARDS)] for r in runs} == {a.address, b.address}
    # each coordinator counts the shards it leads and the commands it committed in each
    # (acquire, checkpoint, finish: 100 written; the renewals were answered from memory)
    seen = {p.address: coordinators.scrape(p) for p in coordinators.procs}
    assert sum(m["fencepost_shards_led"] for m in seen.values()) == SHARDS
    counted: dict[int, float] = {}
    for address, m in seen.items():
        for key, v in m.items():
            if key.startswith("fencepost_shard_commands_total{"):
                shard = int(key.split('"')[1])
                assert owners[shard] == address, (shard, address)
                counted[shard] = counted.get(shard, 0) + v
    mine = {s: sum(1 for r in runs if shard_of(r, SHARDS) == s) for s in range(SHARDS)}
    assert counted == {s: 2 * n + sum(1 for r in runs[:20] if shard_of(r, SHARDS) == s)
                       for s, n in mine.items() if n}, counted


@pytest.mark.parametrize("given", ["survivor", "killed"])
def test_a_killed_coordinators_shards_are_taken_with_every_lease_held(
        coordinators: Coordinators, given: str) -> None:
    """``killed``: the client was given only the coordinator that dies; it
    asks the shard map of the other one it has reached."""
    coordinators.wait_balanced(coordinators.procs)
    a, b = coordinators.procs
    runs = _runs("kill", 30)

    async def go() -> None:
        home = a if given == "survivor" else b
        async with fencepost.Client(home.address, owner="w", renewal="off") as client:
            leases = {r: await client.acquire(r, ttl_ms=20_000) for r in runs}
            for lease in leases.values():
                await lease.renew()  # answered from memory on B's shards
            b.kill()
            started = time.monotonic()
            coordinators.wait_balanced([a], timeout=15)
            taken_s = time.monotonic() - started
            assert taken_s < 10, taken_s
            async with fencepost.Client(a.address, owner="thief", renewal="off") as thief:
                for r in runs:  # nobody else may take any of them
                    with pytest.raises(fencepost.LeaseHeldError):
                        await thief.acquire(r, ttl_ms=5_000)
            for lease in leases.values():  # the holder keeps each and finishes it
                await _until(lease.renew, 10)
                await lease.finish()

    asyncio.run(go())


def test_a_paused_coordinator_commits_nothing_once_its_shards_are_taken(
        coordinators: Coordinators) -> None:
    owners = coordinators.wait_balanced(coordinators.procs)
    a, b = coordinators.procs
    on_b = [r for r in _runs("pause", 60) if owners[shard_of(r, SHARDS)] == b.address][:5]

    async def go() -> None:
        async with fencepost.Client(b.address, owner="w", renewal="off") as client:
            leases = [await client.acquire(r, ttl_ms=60_000) for r in on_b]
        assert b.proc is not None
        b.proc.send_signal(signal.SIGSTOP)
        coordinators.wait_balanced([a], timeout=15)
        # a command sent straight to the paused coordinator before it wakes:
        # it must not commit under the shard's old epoch
        import grpc

        from fencepost.v1 import ledger_pb2, ledger_pb2_grpc, record_pb2

        ch = grpc.insecure_channel(b.address)
        stub = ledger_pb2_grpc.LedgerStub(ch)
        fut = stub.Finish.future(ledger_pb2.FinishRequest(
            run_id=on_b[0], owner="w", fencing_token=leases[0].fencing_token,
            status=record_pb2.RUN_STATUS_COMPLETED), timeout=20)
        await asyncio.sleep(0.3)
        b.proc.send_signal(signal.SIGCONT)
        with pytest.raises(grpc.RpcError):
            fut.result()
        ch.close()
        async with fencepost.Client(a.address, owner="w", renewal="off") as client:
            rec = await client.get(on_b[0])
            assert rec.status == fencepost.RunStatus.RUNNING

    asyncio.run(go())


def test_a_joining_coordinator_is_handed_its_share_with_every_lease_kept(
        coordinators: Coordinators) -> None:
    coordinators.wait_balanced(coordinators.procs)
    runs = _runs("join", 30)

    async def go() -> None:
        async with fencepost.Client(coordinators.procs[0].address, owner="w") as client:
            leases = {r: await client.acquire(r, ttl_ms=3_000) for r in runs}
            c = coordinators.add()
            c.start()
            owners = coordinators.wait_balanced(coordinators.procs)
            assert c.address in owners.values()
            await asyncio.sleep(4)  # more than a ttl: kept only by renewals routed to owners
            for r, lease in leases.items():
                assert not lease.is_lost, r
                await lease.finish()

    asyncio.run(go())


def test_sigterm_hands_every_shard_over_without_waiting_for_the_lease(
        coordinators: Coordinators) -> None:
    coordinators.wait_balanced(coordinators.procs)
    a, b = coordinators.procs
    runs = _runs("term", 30)

    async def go() -> None:
        async with fencepost.Client(a.address, owner="w") as client:
            leases = {r: await client.acquire(r, ttl_ms=3_000) for r in runs}
            assert b.stop() == 0, b.log_tail()
            # released, not expired: the survivor leads them before a shard lease could run out
            with psycopg.connect(coordinators.url, autocommit=True) as db:
                expiry = db.execute(
                    "SELECT max(expires_at) - (extract(epoch FROM clock_timestamp()) * 1000)"
                    "::bigint FROM fencepost.fencepost_shards").fetchone()
            owners = coordinators.wait_balanced([a], timeout=1.5)
            assert set(owners.values()) == {a.address}, (owners, expiry)
            await asyncio.sleep(4)  # more than a ttl: kept only by renewals on the survivor
            for r, lease in leases.items():
                assert not lease.is_lost, r
                await lease.finish()
    asyncio.run(go())
    assert "handed over shards" in b.log_tail(20_000)


def test_an_operator_moves_one_shard_with_its_leases_kept(coordinators: Coordinators) -> None:
    owners = coordinators.wait_balanced(coordinators.procs)
    a, b = coordinators.procs
    shard = next(s for s, addr in owners.items() if addr == a.address)
    runs = [r for r in _runs("move", 200) if shard_of(r, SHARDS) == shard][:8]

    async def go() -> None:
        async with fencepost.Client(a.address, owner="w") as client:
            leases = {r: await client.acquire(r, ttl_ms=3_000) for r in runs}
            with pytest.raises(fencepost.ValidationError) as bad:
                await client.move_shard(shard, "127.0.0.1:1")
            assert bad.value.field == "to"
            with pytest.raises(fencepost.ValidationError) as bad:
                await client.move_shard(SHARDS, b.address)
            assert bad.value.field == "shard"
            # calls on the shard go on through the move: each is answered, none refused
            calls = [r for r in _runs("busy", 400) if shard_of(r, SHARDS) == shard][:40]
            moving = asyncio.Event()

            async def busy() -> int:
                done = 0
                for i, run in enumerate(calls):
                    lease = await client.acquire(run, ttl_ms=30_000)
                    await lease.finish()
                    done += 1
                    if i == 3:
                        moving.set()
                return done

            worker = asyncio.create_task(busy())
            await moving.wait()
            # the CLI an operator uses: it waits until the shard is led there
            out = await asyncio.to_thread(
                subprocess.run,
                [str(FENCEPOST), "shards", "move", str(shard), "--to", b.address,
                 "--addr", a.address, "--json"], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            assert doc["from"] == a.address and doc["to"] == b.address, doc
            assert coordinators.owners()[shard] == b.address
            assert await worker == len(calls)
            await asyncio.sleep(4)  # more than a ttl: kept only by renewals on the new owner
            for r, lease in leases.items():
                assert not lease.is_lost, r
                await lease.finish()
            # it stays there, pinned, while the assignment would put it back
            assert (await client.shards()).shards[shard].address == b.address
    asyncio.run(go())


def test_a_watch_resumed_from_a_revision_is_refused_as_compacted(
        coordinators: Coordinators) -> None:
    import grpc

    from fencepost.v1 import ledger_pb2, ledger_pb2_grpc

    coordinators.wait_balanced(coordinators.procs)
    a = coordinators.procs[0]

    async def write() -> None:
        async with fencepost.Client(a.address, owner="w", renewal="off") as client:
            for r in _runs("watch", 6):
                await client.acquire(r, ttl_ms=30_000)
    asyncio.run(write())
    with grpc.insecure_channel(a.address) as ch:
        stream = ledger_pb2_grpc.LedgerStub(ch).WatchRuns(
            ledger_pb2.WatchRunsRequest(from_revision=1), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stream))
    assert reason(err.value) == "RUN_REVISION_COMPACTED", err.value
    assert "--lead-shards" in (err.value.details() or "")


def test_a_watch_across_coordinators_follows_a_moved_shard_and_resumes_from_its_cursor(
        coordinators: Coordinators) -> None:
    owners = coordinators.wait_balanced(coordinators.procs)
    a, b = coordinators.procs
    shard = next(s for s, addr in owners.items() if addr == a.address)
    runs = _runs("cw", 120)
    assert any(shard_of(r, SHARDS) == shard for r in runs[60:])
    assert {owners[shard_of(r, SHARDS)] for r in runs} == {a.address, b.address}

    async def go() -> None:
        async with fencepost.Client(b.address, owner="w", renewal="off") as client:
            cursor = fencepost.WatchCursor()
            seen: list[fencepost.WatchEvent] = []

            async def watch(cursor: fencepost.WatchCursor, done: Any) -> None:
                async for ev in client.watch(cursor=cursor):
                    seen.append(ev)
                    if done():
                        return

            finals: dict[str, int] = {}  # each run's last version, once written

            def all_seen() -> bool:
                got = {(e.run_id, e.record.version) for e in seen if e.record}
                return len(finals) == len(runs) and all((r, v) in got for r, v in finals.items())

            # each run: acquire, checkpoint, finish, while the shard moves (a take
            # extending a run's lease is a change of its own: a version more)
            watcher = asyncio.create_task(watch(cursor, all_seen))
            for _ in range(500):  # until both coordinators' streams started
                if len(cursor.revisions) == SHARDS:
                    break
                await asyncio.sleep(0.02)

            async def work(run: str) -> None:
                lease = await client.acquire(run, ttl_ms=30_000)
                await lease.record_checkpoint("k", 1)
                await lease.finish()

            async def writers(some: list[str]) -> None:
                for i in range(0, len(some), 10):
                    await asyncio.gather(*(work(r) for r in some[i:i + 10]))

            # half while the shard moves, half after (its changes then come from b)
            writing = asyncio.create_task(writers(runs[:60]))
            await asyncio.sleep(0.1)
            await client.move_shard(shard, b.address)
            await _until(lambda: _led_at(coordinators, shard, b.address), 20)
            await writing
            await writers(runs[60:])
            for r in runs:
                finals[r] = (await client.get(r)).version
            if all_seen():  # nothing more to come: the watch waits on
                watcher.cancel()
            else:
                await asyncio.wait_for(watcher, 30)
            got = collections.Counter((e.run_id, e.record.version) for e in seen if e.record)
            assert got == collections.Counter(
                (r, v) for r in runs for v in range(1, finals[r] + 1))
            assert all(e.shard == shard_of(e.run_id, SHARDS) for e in seen)
            # per shard, in revision order
            for s in range(SHARDS):
                revs = [e.revision for e in seen if e.shard == s]
                assert revs == sorted(revs), s
            saved = cursor.encode()
            # written while nobody watched, in shards led by both: exactly these
            missed = _runs("cw-missed", 30)
            for r in missed:
                await client.acquire(r, ttl_ms=30_000)
            seen.clear()
            await asyncio.wait_for(watch(fencepost.WatchCursor.decode(saved),
                                         lambda: len(seen) == len(missed)), 30)
            assert sorted(e.run_id for e in seen) == sorted(missed)
    asyncio.run(go())


async def _led_at(coordinators: Coordinators, shard: int, address: str) -> None:
    assert coordinators.owners().get(shard) == address


def test_the_dashboard_lists_every_shards_runs_in_order_with_paging(
        db_url: str, tmp_path: Path) -> None:
    web = free_port()
    group = Coordinators(db_url, tmp_path, 2)
    a = group.procs[0]
    a.args = tuple(x if x != "off" else f"127.0.0.1:{web}" for x in a.args)
    try:
        for p in group.procs:
            p.start()
        owners = group.wait_balanced(group.procs)
        runs = sorted(_runs("dash", 30))
        assert {owners[shard_of(r, SHARDS)] for r in runs} == {a.address, group.procs[1].address}

        async def write() -> None:
            async with fencepost.Client(a.address, owner="w", renewal="off") as client:
                for r in runs:
                    await client.acquire(r, ttl_ms=60_000)
        asyncio.run(write())

        def get(path: str) -> Any:
            with urllib.request.urlopen(f"http://127.0.0.1:{web}{path}", timeout=10) as resp:
                return json.loads(resp.read())

        listed: list[str] = []
        after = ""
        while True:  # pages of 7, in run-id order, across both coordinators' shards
            page = get(f"/api/runs?prefix=dash-&limit=7{f'&after={after}' if after else ''}")
            ids = [d["run_id"] for d in page["runs"]]
            listed += ids
            if not page["has_next"]:
                break
            after = ids[-1]
        assert listed == runs
        back = get(f"/api/runs?prefix=dash-&limit=3&before={runs[4]}")
        assert [d["run_id"] for d in back["runs"]] == runs[1:4]
        assert get("/api/runs?prefix=dash-&limit=1")["total"] >= len(runs)
        # a run led by the other coordinator opens with its record and history
        elsewhere = next(r for r in runs if owners[shard_of(r, SHARDS)] != a.address)
        doc = get(f"/api/runs/{elsewhere}")
        assert doc["run"]["run_id"] == elsewhere and doc["timeline"]
    finally:
        group.close()


def test_a_transaction_across_two_coordinators_is_refused_naming_both_shards(
        coordinators: Coordinators) -> None:
    import grpc

    from fencepost.v1 import ledger_pb2, ledger_pb2_grpc

    owners = coordinators.wait_balanced(coordinators.procs)
    a, b = coordinators.procs
    here = next(r for r in _runs("tx", 200) if owners[shard_of(r, SHARDS)] == a.address)
    there = next(r for r in _runs("tx", 200) if owners[shard_of(r, SHARDS)] == b.address)
    tx = ledger_pb2.TransactionRequest(commands=[
        ledger_pb2.Command(id=1, acquire=ledger_pb2.AcquireRequest(run_id=here, owner="w")),
        ledger_pb2.Command(id=2, acquire=ledger_pb2.AcquireRequest(run_id=there, owner="w"))])
    for p in (a, b):
        with grpc.insecure_channel(p.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                ledger_pb2_grpc.LedgerStub(ch).Transact(tx, timeout=10)
        assert reason(err.value) == "RUN_VALIDATION_ERROR", err.value
        details = err.value.details() or ""
        other = b if p is a else a
        assert "commands" in details and other.address in details, details
        for run in (here, there):
            assert str(shard_of(run, SHARDS)) in details, details
    with psycopg.connect(coordinators.url, autocommit=True) as db:  # nothing was done
        assert db.execute("SELECT count(*) FROM fencepost.runs WHERE run_id IN (%s, %s)",
                          (here, there)).fetchone() == (0,)
