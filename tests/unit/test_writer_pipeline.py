"""The pipelined sync on SQLite (writer/DESIGN.md, "Pipelined sync"): a batch
is answered, published and uncounted only after the fsync that follows its
COMMIT, while the next batch is decided over it; a failed fsync takes no
more writes. The storage is the real one on a real file; its ``sync`` is
held on an event, as a slow disk would hold it."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.storage import SqliteStorage
from fencepost_server.storage.sqlite import Durability
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Writer


class SlowDisk(SqliteStorage):
    """The real storage whose fsync waits until the test lets it go."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.go = threading.Event()
        self.go.set()
        self.entered = threading.Semaphore(0)
        self.commits = 0
        self.fail: OSError | None = None

    def hold(self) -> None:
        """Hold every fsync from now on; ``_entered`` waits for the next."""
        self.entered = threading.Semaphore(0)
        self.go.clear()

    def _commit(self, db: sqlite3.Connection) -> None:
        super()._commit(db)
        self.commits += 1

    def sync(self) -> None:
        self.entered.release()
        self.go.wait(10)
        if self.fail is not None:
            raise self.fail
        super().sync()


async def _entered(disk: SlowDisk) -> None:
    assert await asyncio.to_thread(disk.entered.acquire, True, 10), "no sync started"


@pytest.fixture
async def slow(tmp_path: Path) -> Any:
    disk = SlowDisk(tmp_path / "p.db")
    w = Writer(disk, ManualClock())
    await w.start()
    yield w, disk
    disk.go.set()
    await w.close()


def test_full_durability_on_a_file_defers_the_sync(tmp_path: Path) -> None:
    assert SqliteStorage(tmp_path / "a.db").deferred_sync
    assert not SqliteStorage(tmp_path / "b.db", Durability.NORMAL).deferred_sync
    assert not SqliteStorage(":memory:").deferred_sync
    assert not SqliteStorage(tmp_path / "c.db", pipelined=False).deferred_sync


async def test_a_batch_is_answered_and_published_only_after_its_sync(slow: Any) -> None:
    w, disk = slow
    disk.hold()
    answer = asyncio.ensure_future(w.submit(L.Acquire("a", "w1")))
    await _entered(disk)
    assert disk.commits >= 1  # committed: only the fsync is missing
    await asyncio.sleep(0.05)
    assert not answer.done()
    assert "a" not in w.state.runs  # readers see nothing not yet durable
    assert w.state.revision == 0
    disk.go.set()
    rec = await asyncio.wait_for(answer, 10)
    assert rec.fencing_token == 1 and w.state.runs["a"] is rec


async def test_the_next_batch_is_decided_over_the_one_syncing(slow: Any) -> None:
    w, disk = slow
    disk.hold()
    first = asyncio.ensure_future(w.submit(L.Acquire("a", "w1")))
    await _entered(disk)
    second = asyncio.ensure_future(w.submit(L.Acquire("a", "w2")))
    third = asyncio.ensure_future(w.submit(L.Acquire("b", "w2")))
    # both decided and committed while the first batch's fsync is held
    for _ in range(200):
        if disk.commits >= 3:
            break
        await asyncio.sleep(0.01)
    assert disk.commits >= 3
    assert not (first.done() or second.done() or third.done())
    disk.go.set()
    got = await asyncio.wait_for(asyncio.gather(first, second, third,
                                                return_exceptions=True), 10)
    assert got[0].lease.owner == "w1"
    # decided over the unsynced acquire: the lease is held, not granted twice
    assert isinstance(got[1], LedgerError) and got[1].code is Code.RUN_LEASE_HELD
    assert got[2].revision == got[0].revision + 1
    assert w.state.revision == got[2].revision


async def test_a_renewal_waits_for_the_acquire_it_renews_to_be_durable(slow: Any) -> None:
    w, disk = slow
    disk.hold()
    acquire = asyncio.ensure_future(w.submit(L.Acquire("a", "w1", ttl_ms=60_000)))
    await _entered(disk)
    # the token it will be granted is known; memory must not answer over it
    renew = asyncio.ensure_future(w.submit(L.Renew("a", "w1", 1)))
    await asyncio.sleep(0.05)
    assert not renew.done() and w.stats.memory_renewals == 0
    disk.go.set()
    rec = await asyncio.wait_for(renew, 10)
    assert (await acquire).fencing_token == rec.fencing_token == 1


async def test_a_renewal_waits_for_a_write_on_its_run_that_is_syncing(slow: Any) -> None:
    w, disk = slow
    await w.submit(L.Acquire("a", "w1", ttl_ms=60_000))
    disk.hold()
    # a checkpoint (which also renews) committed at t, syncing
    checkpoint = asyncio.ensure_future(w.submit(L.RecordCheckpoint("a", "w1", 1, "k", 1)))
    await _entered(disk)
    w.clock.advance(5_000)
    renew = asyncio.ensure_future(w.submit(L.Renew("a", "w1", 1)))
    await asyncio.sleep(0.05)
    # answered from memory now, publishing the checkpoint would take it back
    assert not renew.done()
    disk.go.set()
    renewed = await asyncio.wait_for(renew, 10)
    await checkpoint
    assert renewed.lease.expires_at == w.clock.now_ms() + 60_000
    assert w.state.runs["a"].lease.expires_at == renewed.lease.expires_at


async def test_a_failed_sync_fails_its_batches_and_takes_no_more_writes(
    slow: Any, tmp_path: Path
) -> None:
    w, disk = slow
    await w.submit(L.Acquire("before", "w1"))
    disk.hold()
    disk.fail = OSError(5, "Input/output error")
    first = asyncio.ensure_future(w.submit(L.Acquire("a", "w1")))
    await _entered(disk)
    second = asyncio.ensure_future(w.submit(L.Acquire("b", "w1")))
    for _ in range(200):
        if disk.commits >= 3:
            break
        await asyncio.sleep(0.01)
    disk.go.set()
    got = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 10)
    for exc in got:
        assert isinstance(exc, LedgerError) and exc.code is Code.STORAGE_UNAVAILABLE
        assert "could not be synced" in exc.message and "restart" in exc.message
    assert "a" not in w.state.runs and "b" not in w.state.runs
    with pytest.raises(LedgerError) as later:
        await w.submit(L.Acquire("c", "w1"))
    assert later.value.code is Code.STORAGE_UNAVAILABLE
    assert w.stats.failed_commits == 1


async def test_a_clean_stop_waits_for_the_last_sync(tmp_path: Path) -> None:
    disk = SlowDisk(tmp_path / "s.db")
    w = Writer(disk, ManualClock())
    await w.start()
    disk.hold()
    answer = asyncio.ensure_future(w.submit(L.Acquire("a", "w1")))
    await _entered(disk)
    closing = asyncio.ensure_future(w.close())
    await asyncio.sleep(0.05)
    assert not closing.done()
    disk.go.set()
    await asyncio.wait_for(closing, 10)
    assert (await answer).fencing_token == 1
    again = Writer(SqliteStorage(tmp_path / "s.db"), ManualClock())
    await again.start()
    try:
        assert again.state.runs["a"].fencing_token == 1
    finally:
        await again.close()
