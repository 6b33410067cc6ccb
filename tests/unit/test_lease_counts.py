"""``/metrics``' lease counts follow the writer's committed state
(metrics.py, ``LeaseCounts``): after acquires, renewals from memory (alone
and queued behind a checkpoint), releases, finishes, cancels, deletes and the
clock passing expiries and lock delays, a scrape's counts equal a walk of
every record, and its expiry counter equals the leases ever seen expired;
after its first count a scrape never walks the records. The writer on a
real SQLite file, a clock the test moves, fixed seeds."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from fencepost_server.core import ledger as L
from fencepost_server.core.errors import LedgerError
from fencepost_server.core.records import TERMINAL, Record, Status
from fencepost_server.hub import FenceHub
from fencepost_server.metrics import Metrics
from fencepost_server.storage import SqliteStorage
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Reads, Writer

RUNS = [f"r{i}" for i in range(8)]
STEPS = 400


class Unwalkable(dict[str, Record]):
    """The committed records, refusing to be walked while ``closed``: what a
    scrape reads must be what changed, not every record."""

    closed = False

    def _refuse(self) -> None:
        if self.closed:
            raise AssertionError("the scrape walked every record")

    def values(self) -> Any:
        self._refuse()
        return super().values()

    def items(self) -> Any:
        self._refuse()
        return super().items()

    def keys(self) -> Any:
        self._refuse()
        return super().keys()

    def __iter__(self) -> Iterator[str]:
        self._refuse()
        return super().__iter__()


def _walk(runs: dict[str, Record], now: int) -> dict[str, int]:
    """The counts by their definition: every unfinished run's lease by state."""
    out = {"live": 0, "lock_delay": 0, "expired": 0}
    for rec in dict.values(runs):
        lease = rec.lease
        if lease is None or rec.status in TERMINAL:
            continue
        if now < lease.expires_at:
            out["live"] += 1
        elif now < lease.expires_at + lease.lock_delay_ms:
            out["lock_delay"] += 1
        else:
            out["expired"] += 1
    return out


def _expired_keys(runs: dict[str, Record], now: int) -> set[tuple[str, int, int]]:
    return {(rec.run_id, rec.fencing_token, rec.lease.expires_at)
            for rec in dict.values(runs) if rec.lease is not None
            and rec.status not in TERMINAL and rec.lease.expires_at <= now}


async def _step(w: Writer, clock: ManualClock, rng: random.Random) -> None:
    run_id = rng.choice(RUNS)
    cur = w.state.runs.get(run_id)
    lease = cur.lease if cur is not None else None
    holder = (lease.owner, cur.fencing_token) if cur is not None and lease else ("A", 0)
    kind = rng.choice(["acquire", "acquire", "renew", "renew", "renew", "renew", "renew",
                       "behind", "release",
                       "finish", "cancel", "delete", "time", "time", "time"])
    try:
        if kind == "acquire":
            await w.submit(L.Acquire(run_id, rng.choice("AB"), ttl_ms=rng.choice((500, 1000, 3000)),
                                     lock_delay_ms=rng.choice((0, 0, 700))))
        elif kind == "renew":
            await w.submit(L.Renew(run_id, *holder))
        elif kind == "behind":  # queued behind a checkpoint: renewed in the batch
            ck = w.submit_nowait(L.RecordCheckpoint(run_id, *holder, "k", 1))
            try:
                await w.submit(L.Renew(run_id, *holder))
            finally:
                try:
                    await ck
                except LedgerError:
                    pass
        elif kind == "release":
            await w.submit(L.Release(run_id, *holder))
        elif kind == "finish":
            await w.submit(L.Finish(run_id, *holder, Status.COMPLETED))
        elif kind == "cancel":
            await w.submit(L.Cancel(run_id))
        elif kind == "delete":
            await w.submit(L.DeleteRun(run_id))
        else:
            clock.advance(rng.choice((100, 256, 400, 700, 1500)))
    except LedgerError:
        pass  # refused: held by another, lost, finished...


@contextlib.asynccontextmanager
async def _served(tmp_path: Path, clock: ManualClock) -> AsyncIterator[tuple[Writer, Metrics]]:
    """A writer on a real file, its hub and its metrics, closed after."""
    w = Writer(SqliteStorage(tmp_path / "m.db"), clock)
    await w.start()
    hub = FenceHub(w, clock, reads=Reads(w.storage, lambda: w.state))
    hub.start()
    m = Metrics(w, hub, clock, "test")
    try:
        yield w, m
    finally:
        m.close()
        await hub.close()
        await w.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_counts_equal_a_walk_of_every_record(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    clock = ManualClock()
    async with _served(tmp_path, clock) as (w, m):
        seen: set[tuple[str, int, int]] = set()
        scrapes = 0
        states: set[str] = set()  # the states some scrape counted a lease in
        for i in range(STEPS):
            await _step(w, clock, rng)
            seen |= _expired_keys(w.state.runs, clock.now_ms())
            if i == 20:  # from the first count on, the records are never walked again
                await m.render_async()
                runs = w.state.runs = Unwalkable(w.state.runs)
            if i > 20 and rng.random() < 0.3:
                runs.closed = True
                try:
                    await m.render_async()
                finally:
                    runs.closed = False
                scrapes += 1
                counts = m.lease_counts()
                assert counts == _walk(w.state.runs, clock.now_ms()), f"step {i}"
                states |= {state for state, n in counts.items() if n}
                assert m.expiries == len(seen), f"step {i}"
        assert scrapes > 50 and m.expiries > 10 and w.stats.memory_renewals > 20
        assert states == {"live", "lock_delay", "expired"}


class BackClock(ManualClock):
    """A clock the test may move back (a wall clock stepped by its operator)."""

    def back(self, ms: int) -> None:
        with self._lock:
            self._now -= ms


async def test_a_replaced_state_and_a_clock_gone_back_are_counted_again(tmp_path: Path) -> None:
    """Built before the writer loads (a standby's metrics, before it leads),
    the counts follow the state it loads; a clock gone back makes expired
    leases live again, and counts them afresh without counting their
    expiries twice."""
    clock = BackClock()
    w = Writer(SqliteStorage(tmp_path / "m.db"), clock)
    hub = FenceHub(w, clock, reads=Reads(w.storage, lambda: w.state))
    m = Metrics(w, hub, clock, "test")
    assert m.lease_counts() == {"live": 0, "lock_delay": 0, "expired": 0}
    await w.start()
    try:
        await w.submit(L.Acquire("a", "A", ttl_ms=1_000))
        await w.submit(L.Acquire("b", "A", ttl_ms=5_000))
        assert m.lease_counts() == {"live": 2, "lock_delay": 0, "expired": 0}
        clock.advance(2_000)
        assert m.lease_counts() == {"live": 1, "lock_delay": 0, "expired": 1}
        assert m.expiries == 1
        clock.back(1_500)
        assert m.lease_counts() == {"live": 2, "lock_delay": 0, "expired": 0}
        clock.advance(1_500)
        assert m.lease_counts() == {"live": 1, "lock_delay": 0, "expired": 1}
        assert m.expiries == 1
    finally:
        m.close()
        await w.close()


async def test_a_renewal_released_in_its_own_batch_is_answered_and_counted(
    tmp_path: Path,
) -> None:
    """A renewal decided in a batch that then releases the run: the renewal
    listeners hear of a record without a lease, every caller is answered."""
    clock = ManualClock()
    async with _served(tmp_path, clock) as (w, m):
        await w.submit(L.Acquire("a", "A", ttl_ms=60_000))
        await m.render_async()
        one_batch = [w.submit_nowait(L.RecordCheckpoint("a", "A", 1, "k", 1)),
                     w.submit_nowait(L.Renew("a", "A", 1)),
                     w.submit_nowait(L.Release("a", "A", 1))]
        got = await asyncio.wait_for(asyncio.gather(*one_batch), 10)
        assert got[2].lease is None and w.stats.batches == 2
        assert m.lease_counts() == _walk(w.state.runs, clock.now_ms()) == {
            "live": 0, "lock_delay": 0, "expired": 0}
