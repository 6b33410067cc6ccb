"""Who leads each shard of a PostgreSQL database (ha/shards.py), on a real
PostgreSQL: the shard rows the schema keeps; members taking every shard,
converging to a balanced share, waiting out a stopped member's lease, taking
a released shard at once, finding a taken shard lost, ending an expired
holder's batch that keeps a row locked, racing without ever both holding a
shard, and refusing to lead with a clock that is off."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from fencepost_devtools.pgcluster import Cluster
from fencepost_server.core import shards as shards_core
from fencepost_server.ha.leadership import Takeover, process_proof, writer_name
from fencepost_server.ha.shards import Owner, Round, ShardLeases
from fencepost_server.storage import postgres
from fencepost_server.testing.clock import ManualClock

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def url(pg_cluster: Cluster) -> str:
    """The session's PostgreSQL (tests/conftest.py); each test gets its own database."""
    return pg_cluster.create_database(f"sl_{uuid.uuid4().hex[:10]}")


def _migrate(url: str, shards: int | None = None) -> int:
    db = postgres.connect(url, "test-migrate")
    try:
        return postgres.migrate(db, url, shards)
    finally:
        db.close()


def _rows(url: str) -> list[tuple[int, int, str, str, int, int, str]]:
    with psycopg.connect(url) as db:
        return [tuple(r) for r in db.execute(  # type: ignore[misc]
            "SELECT shard, epoch, holder, address, renewed_at, expires_at, process "
            "FROM fencepost.fencepost_shards ORDER BY shard").fetchall()]


@pytest.mark.parametrize("shards", [None, 1, 5, 100])
def test_a_new_database_has_one_unheld_row_per_stored_shard(url: str, shards: int | None) -> None:
    stored = _migrate(url, shards)
    assert stored == (shards or 64)
    assert _rows(url) == [(i, 0, "", "", 0, 0, "") for i in range(stored)]
    assert _migrate(url) == stored  # a later start keeps them as they are
    assert len(_rows(url)) == stored


# -- taking, renewing, moving and losing shards -----------------------------------


def _member(url: str, name: str, shards: int, *, lease_ms: int = 600, clock: Any = None,
            max_skew_ms: int = 0, address: str | None = None) -> ShardLeases:
    _migrate(url, shards)
    return ShardLeases(url, clock or ManualClock(), address=address or f"{name}:1",
                       identity=name, shards=shards, lease_ms=lease_ms, renew_ms=100,
                       max_skew_ms=max_skew_ms)


async def _tick(sl: ShardLeases) -> Round:
    return await asyncio.to_thread(sl.tick)


def _db_now(url: str) -> int:
    with psycopg.connect(url) as db:
        row = db.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
                         ).fetchone()
        assert row is not None
        return int(row[0])


async def _until_expired(url: str, holder: str) -> None:
    """Until every row ``holder`` holds has expired by the database's clock."""
    deadline = time.monotonic() + 10
    while True:
        last = max((r[5] for r in _rows(url) if r[2] == holder), default=0)
        if last < _db_now(url):
            return
        assert time.monotonic() < deadline, f"{holder}'s rows never expired"
        await asyncio.sleep(0.05)


async def _converge(members: list[ShardLeases], rounds: int = 20) -> dict[int, list[Takeover]]:
    """Rounds of every member ticking and releasing what it holds but is not
    assigned, until each holds exactly what the assignment gives it; every
    takeover seen, by shard."""
    takes: dict[int, list[Takeover]] = {}
    everyone = sorted(m.identity for m in members)
    for _ in range(rounds):
        for m in members:
            got = await _tick(m)
            for shard, took in got.taken.items():
                takes.setdefault(shard, []).append(took)
            if got.surplus:
                await m.release(got.surplus)
        want = shards_core.assign(everyone, members[0].shards)
        if all(set(m.held) == {s for s, w in enumerate(want) if w == m.identity}
               for m in members):
            return takes
    raise AssertionError(f"no convergence in {rounds} rounds: {[m.held for m in members]}")


async def test_one_member_takes_every_shard_and_keeps_renewing_them(url: str) -> None:
    a = _member(url, "a", 8)
    try:
        first = await _tick(a)
        assert first.taken == {s: Takeover(1, "", 0) for s in range(8)}
        assert first.lost == [] and first.surplus == []
        assert all(a.leads(s) for s in range(8)) and not a.leads(8)
        assert a.owners() == {s: Owner("a", "a:1", 1) for s in range(8)}
        before = {r[0]: r[5] for r in _rows(url)}
        second = await _tick(a)
        assert second.taken == {} and second.lost == []
        after = _rows(url)
        assert all(r[1] == 1 and r[2] == "a" and r[5] > before[r[0]] for r in after), after
    finally:
        await a.close()


async def test_three_members_converge_to_balanced_ownership(url: str) -> None:
    n = 10
    members = [_member(url, name, n) for name in ("a", "b", "c")]
    try:
        takes = await _converge(members)
        held = [set(m.held) for m in members]
        assert sorted(len(h) for h in held) == [3, 3, 4]
        assert set().union(*held) == set(range(n)) and sum(map(len, held)) == n
        for shard, epoch, holder, *_ in _rows(url):
            # one bump per take, in order, and the row names the last taker
            assert [t.epoch for t in takes[shard]] == list(range(1, epoch + 1)), shard
            assert holder == next(m.identity for m in members if shard in m.held)
            assert epoch <= 2  # taken once, moved at most once
    finally:
        for m in members:
            await m.close()


async def test_a_stopped_member_keeps_its_shards_until_they_expire(url: str) -> None:
    a, b = _member(url, "a", 6), _member(url, "b", 6)
    try:
        await _converge([a, b])
        of_b = dict(b.held)
        assert of_b
        # b stops ticking; a goes on until it has taken every shard of b's ...
        taken: dict[int, Takeover] = {}
        deadline = time.monotonic() + 10
        while set(taken) != set(of_b):
            assert time.monotonic() < deadline, "a never took b's shards"
            got = await _tick(a)
            assert set(got.taken) <= set(of_b)
            taken.update(got.taken)
            await asyncio.sleep(0.05)
        # ... each only once a whole lease had passed since b's last renewal
        # (the gap, by the database's clock), with the epoch bumped
        for shard, epoch in of_b.items():
            assert taken[shard].epoch == epoch + 1 and taken[shard].previous == "b"
            assert taken[shard].gap_ms >= 600, taken[shard]
        assert set(a.held) == set(range(6))
        # b, back, finds them lost and leads none of them
        assert not any(b.leads(s) for s in of_b)
        back = await _tick(b)
        assert [s for lost, _ in back.lost for s in lost] == sorted(of_b)
        assert not any(b.leads(s) for s in of_b)
    finally:
        await a.close()
        await b.close()


async def test_a_released_shard_is_taken_at_once_without_waiting_for_its_lease(url: str) -> None:
    # a minute's lease: a take that waited for the expiry would time the test out
    a, b = _member(url, "a", 4, lease_ms=60_000), _member(url, "b", 4, lease_ms=60_000)
    try:
        await _tick(a)
        assert (await _tick(b)).taken == {}  # assigned some, but a holds them
        surplus = (await _tick(a)).surplus
        assert surplus and a.surplus == surplus
        assert (await _tick(b)).taken == {}  # reported, not released: still a's
        await a.release(surplus)
        assert not any(a.leads(s) for s in surplus)
        started = time.monotonic()
        got = await _tick(b)
        assert set(got.taken) == set(surplus)
        assert all(t.epoch == 2 and t.previous == "a" and t.gap_ms < 60_000
                   for t in got.taken.values())
        assert time.monotonic() - started < 30
        assert all(b.leads(s) for s in surplus)
        assert (await _tick(a)).lost == []  # given up, not lost
    finally:
        await a.close()
        await b.close()


async def test_a_holder_finds_a_shard_taken_from_it_lost_on_its_next_tick(url: str) -> None:
    a = _member(url, "a", 3, lease_ms=60_000)
    try:
        await _tick(a)
        with psycopg.connect(url, autocommit=True) as other:  # another coordinator's take
            other.execute("UPDATE fencepost.fencepost_shards SET epoch = epoch + 1, "
                          "holder = 'x', expires_at = expires_at + 60000 WHERE shard = 1")
        assert a.leads(1)  # it cannot know before its next round
        got = await _tick(a)
        assert got.lost == [([1], "another coordinator took these shards over")]
        assert not a.leads(1) and a.leads(0) and a.leads(2)
        assert a.owners()[1] == Owner("x", "a:1", 2)
        assert (await _tick(a)).lost == []  # reported once
    finally:
        await a.close()


async def test_a_shard_row_locked_by_an_expired_holders_batch_is_unblocked(url: str) -> None:
    a, b = _member(url, "a", 2), _member(url, "b", 2)
    await _tick(a)
    # a's writer is paused inside a batch: it holds shard 0's row
    stuck = psycopg.connect(url, autocommit=True, application_name=writer_name("a"))
    stuck.execute("BEGIN")
    stuck.execute("SELECT epoch FROM fencepost.fencepost_shards WHERE shard = 0 FOR KEY SHARE")
    try:
        await _until_expired(url, "a")
        deadline = time.monotonic() + 10
        while not b.leads(0) or not b.leads(1):
            assert time.monotonic() < deadline, b.held
            await _tick(b)
        assert b.held == {0: 2, 1: 2}
        with pytest.raises(psycopg.OperationalError):
            stuck.execute("COMMIT")  # its session was ended: the batch rolled back
    finally:
        stuck.close()
        await a.close()
        await b.close()


def test_members_racing_from_threads_never_both_hold_a_shard(url: str) -> None:
    """Three members tick at once from their own threads for many rounds,
    giving surplus shards up and one leaving and coming back, so shards move
    while the others take. Every (shard, epoch) is taken by one member, and
    no member still counted a shard its own (``leads``: until its
    ``valid_until``, or until it gave it up) once another had taken it."""
    n, rounds = 12, 40
    members = [_member(url, name, n, lease_ms=400) for name in ("a", "b", "c")]
    takes: list[tuple[int, int, str, float]] = []  # shard, epoch, taker, round's end
    until: dict[tuple[int, int], float] = {}  # (shard, epoch): the holder's last valid_until
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(len(members))

    def served(sl: ShardLeases, given_up: list[int] | None = None) -> None:
        """Until when ``sl`` may use what it holds: its valid_until, or now
        for the shards it gives up now."""
        now = time.monotonic()
        with lock:
            for shard, epoch in sl.held.items():
                if given_up is None:
                    until[shard, epoch] = max(until.get((shard, epoch), 0.0), sl.valid_until)
                elif shard in given_up:
                    until[shard, epoch] = min(until.get((shard, epoch), now), now)

    def work(sl: ShardLeases, leaves: bool) -> None:
        try:
            start.wait(10)
            for i in range(rounds):
                if leaves and i % 10 == 9:
                    served(sl, list(sl.held))
                    asyncio.run(sl.resign())
                    continue
                got = sl.tick()
                ended = time.monotonic()
                served(sl)
                with lock:
                    takes.extend((s, t.epoch, sl.identity, ended) for s, t in got.taken.items())
                if got.surplus:
                    served(sl, got.surplus)
                    asyncio.run(sl.release(got.surplus))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(m, m.identity == "c")) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not any(t.is_alive() for t in threads), "a racing member never finished"
        assert not errors, errors
        assert len(takes) > n, "no shard moved after the first takes"
        keys = [(s, e) for s, e, _, _ in takes]
        assert len(keys) == len(set(keys)), "a (shard, epoch) was taken twice"
        for shard, epoch, taker, ended in takes:
            before = until.get((shard, epoch - 1))
            assert before is None or before <= ended, \
                f"shard {shard}: epoch {epoch - 1} still led {before - ended:.3f} s after " \
                f"{taker} took epoch {epoch}"
        rows = {r[0]: (r[1], r[2]) for r in _rows(url)}
        for m in members:  # what each believes it holds is what the rows say
            for shard, epoch in m.held.items():
                assert rows[shard] == (epoch, m.identity)
        for shard, (epoch, holder) in rows.items():
            if epoch:
                assert any(t[:3] == (shard, epoch, holder) for t in takes)
    finally:
        async def close() -> None:
            for m in members:
                await m.close()
        asyncio.run(close())


class _ShiftedClock:
    """The system clock, moved by ``shift_ms``."""

    shift_ms = 0

    def now_ms(self) -> int:
        return int(time.time() * 1000) + self.shift_ms


async def test_a_coordinator_whose_clock_is_off_takes_nothing_and_gives_its_shards_up(
    url: str
) -> None:
    clock = _ShiftedClock()  # the machine's clock, which the database's also is
    a = _member(url, "a", 4, clock=clock, max_skew_ms=500)
    try:
        assert set((await _tick(a)).taken) == set(range(4))
        clock.shift_ms = 5_000
        got = await _tick(a)
        assert len(got.lost) == 1 and got.lost[0][0] == [0, 1, 2, 3]
        assert "differs from the database's by" in got.lost[0][1]
        assert "--max-clock-skew 500 ms" in got.lost[0][1]
        assert not any(a.leads(s) for s in range(4))
        with psycopg.connect(url) as db:  # no longer a member: the others reassign
            assert db.execute("SELECT count(*) FROM fencepost.fencepost_members"
                              ).fetchone() == (0,)
        assert (await _tick(a)).taken == {}
        assert all(r[1] == 1 for r in _rows(url))  # refused: no epoch moved
    finally:
        await a.close()


async def test_run_reports_takes_and_losses_on_the_loop(url: str) -> None:
    a = _member(url, "a", 3, lease_ms=60_000)
    taken: list[dict[int, Takeover]] = []
    lost: list[tuple[list[int], str]] = []
    loop_thread = threading.get_ident()
    news = asyncio.Event()

    def on_taken(got: dict[int, Takeover]) -> None:
        assert threading.get_ident() == loop_thread
        taken.append(got)
        news.set()

    def on_lost(shards: list[int], why: str) -> None:
        assert threading.get_ident() == loop_thread
        lost.append((shards, why))
        news.set()

    runner = asyncio.create_task(a.run(on_taken, on_lost))
    try:
        await asyncio.wait_for(news.wait(), 10)
        assert taken == [{s: Takeover(1, "", 0) for s in range(3)}]
        news.clear()
        with psycopg.connect(url, autocommit=True) as other:
            other.execute("UPDATE fencepost.fencepost_shards SET epoch = epoch + 1, "
                          "holder = 'x' WHERE shard = 2")
        await asyncio.wait_for(news.wait(), 10)
        assert lost == [([2], "another coordinator took these shards over")]
    finally:
        await a.close()
        await asyncio.wait_for(runner, 10)


def _killed_holder(url: str, shards: int) -> None:
    """A coordinator at me:1, in its own process, takes every shard under a
    minute's lease and is killed (-9) and reaped."""
    _migrate(url, shards)
    old = subprocess.Popen(
        [sys.executable, "-c", (
            "import time\n"
            "from fencepost_server.clock import SystemClock\n"
            "from fencepost_server.ha.shards import ShardLeases\n"
            f"sl = ShardLeases({url!r}, SystemClock(), address='me:1', identity='old', "
            f"shards={shards}, lease_ms=60000, renew_ms=1000, max_skew_ms=0)\n"
            "print(len(sl.tick().taken), flush=True)\n"
            "time.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert old.stdout is not None and old.stdout.readline().strip() == str(shards)
    finally:
        old.kill()
        old.wait()
        if old.stdout is not None:
            old.stdout.close()


@pytest.mark.skipif(not process_proof(), reason="needs Linux /proc")
async def test_a_restart_in_place_takes_its_killed_predecessors_shards_at_once(
    url: str
) -> None:
    """The predecessor at this coordinator's address holds every shard under
    a minute's lease and is killed (-9): a coordinator at another address
    waits for the lease; the restart at the same address takes them now."""
    _killed_holder(url, 4)
    other = _member(url, "other", 4, lease_ms=60_000)
    try:
        assert (await _tick(other)).taken == {}  # it cannot prove the holder gone
        await other.resign()
    finally:
        await other.close()
    new = _member(url, "new", 4, lease_ms=60_000, address="me:1")
    try:
        got = await _tick(new)
        assert got.taken == {s: Takeover(2, "old", got.taken[s].gap_ms) for s in range(4)}
        assert all(new.leads(s) for s in range(4))
    finally:
        await new.close()
