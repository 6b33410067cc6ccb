"""Renewals answered from memory (docs/SPEC.md §4, §5.2; writer/DESIGN.md): the
writer alone, on a real SQLite file, with a clock the test moves."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from _db import crash_writer

from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.records import Record, Status
from fencepost_server.storage import SqliteStorage
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Writer


async def _writer(path: Path, clock: ManualClock, **kw: int) -> Writer:
    w = Writer(SqliteStorage(path), clock, **kw)
    await w.start()
    return w


def _stored(path: Path) -> tuple[dict[str, int], int | None]:
    """The runs table's lease expiries, and meta.lease_floor."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        runs = {k: json.loads(t)["lease"][2] for k, t in db.execute(
            "SELECT run_id, record FROM runs") if json.loads(t).get("lease")}
        row = db.execute("SELECT value FROM meta WHERE key = 'lease_floor'").fetchone()
        return runs, None if row is None else row[0]
    finally:
        db.close()


def _until(rec: Record) -> int:
    assert rec.lease is not None
    return rec.lease.expires_at


async def test_a_renewal_moves_the_expiry_and_nothing_else_without_a_commit(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    w = await _writer(tmp_path / "m.db", clock)
    try:
        a = await w.submit(L.Acquire("r", "A", ttl_ms=10_000))
        batches = w.stats.batches
        clock.advance(4_000)
        r = await w.submit(L.Renew("r", "A", a.fencing_token))
        assert _until(r) == clock.now_ms() + 10_000
        assert (r.version, r.revision, r.updated_at) == (a.version, a.revision, a.updated_at)
        assert w.state.runs["r"] == r and w.state.revision == a.revision
        assert w.stats.batches == batches and w.stats.memory_renewals == 1
        with pytest.raises(LedgerError) as lost:  # the fence check as ever
            await w.submit(L.Renew("r", "B", a.fencing_token))
        assert lost.value.code is Code.RUN_LEASE_LOST
    finally:
        await w.close()


async def test_a_failing_renewal_listener_keeps_no_renewal_unanswered(tmp_path: Path) -> None:
    """From memory and decided in a batch alike: the listener's error is
    logged, the callers are answered."""
    w = await _writer(tmp_path / "m.db", ManualClock())
    heard: list[str] = []

    def broken(run_id: str, rec: Record) -> None:
        heard.append(run_id)
        raise RuntimeError("a listener's bug")

    w.subscribe_renewals(broken)
    try:
        a = await w.submit(L.Acquire("r", "A", ttl_ms=10_000))
        await asyncio.wait_for(w.submit(L.Renew("r", "A", a.fencing_token)), 5)
        behind = [w.submit_nowait(L.RecordCheckpoint("r", "A", a.fencing_token, "k", 1)),
                  w.submit_nowait(L.Renew("r", "A", a.fencing_token))]
        await asyncio.wait_for(asyncio.gather(*behind), 5)
        assert heard == ["r", "r"]
        assert (await w.submit(L.Acquire("s", "A"))).fencing_token == 1  # still writing
    finally:
        await w.close()


async def test_a_renewal_queued_behind_a_takeover_is_decided_after_it(tmp_path: Path) -> None:
    """An expired lease: a rival's Acquire is queued first, so the holder's
    renewal may not be answered from the state the Acquire has not seen."""
    clock = ManualClock()
    w = await _writer(tmp_path / "m.db", clock)
    try:
        a = await w.submit(L.Acquire("r", "A", ttl_ms=1_000))
        clock.advance(1_000)
        taking = w.submit_nowait(L.Acquire("r", "B"))
        with pytest.raises(LedgerError) as lost:
            await w.submit(L.Renew("r", "A", a.fencing_token))
        assert lost.value.code is Code.RUN_LEASE_LOST
        b = await taking
        assert b.lease.owner == "B" and b.fencing_token == a.fencing_token + 1
    finally:
        await w.close()


async def test_a_renewal_behind_a_queued_finish_of_its_run_is_refused(tmp_path: Path) -> None:
    """A client's Finish, then its Renew (one Execute message): the renewal
    does not overtake the Finish it was sent after."""
    w = await _writer(tmp_path / "m.db", ManualClock())
    try:
        a = await w.submit(L.Acquire("r", "A"))
        finishing = w.submit_nowait(L.Finish("r", "A", a.fencing_token, Status.COMPLETED))
        with pytest.raises(LedgerError) as lost:
            await w.submit(L.Renew("r", "A", a.fencing_token))
        assert lost.value.code is Code.RUN_LEASE_LOST
        assert (await finishing).status is Status.COMPLETED
        # queued behind a checkpoint instead, it is decided in the batch, as from memory
        b = await w.submit(L.Acquire("s", "A"))
        ck = w.submit_nowait(L.RecordCheckpoint("s", "A", b.fencing_token, "k", 1))
        r = await w.submit(L.Renew("s", "A", b.fencing_token))
        assert r.version == (await ck).version == 2 and r.revision == (await ck).revision
    finally:
        await w.close()


async def test_an_acknowledged_renewal_holds_off_a_takeover(tmp_path: Path) -> None:
    clock = ManualClock()
    w = await _writer(tmp_path / "m.db", clock)
    try:
        a = await w.submit(L.Acquire("r", "A", ttl_ms=1_000))
        clock.advance(1_000)  # expired, not taken over: the holder may still renew
        r = await w.submit(L.Renew("r", "A", a.fencing_token))
        clock.advance(999)
        with pytest.raises(LedgerError) as held:
            await w.submit(L.Acquire("r", "B"))
        assert held.value.code is Code.RUN_LEASE_HELD and held.value.record == r
        clock.advance(1)
        assert (await w.submit(L.Acquire("r", "B"))).lease.owner == "B"
    finally:
        await w.close()


async def test_after_a_crash_every_lease_stored_live_is_renewed_at_the_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.db"
    clock = ManualClock()
    w = await _writer(path, clock)
    a = await w.submit(L.Acquire("r", "A", ttl_ms=10_000, lock_delay_ms=500))
    clock.advance(6_000)
    r = await w.submit(L.Renew("r", "A", a.fencing_token))  # until t0 + 16 s
    await crash_writer(w)
    assert _stored(path)[0] == {} or _stored(path)[0]["r"] == _until(a)
    clock.advance(2_000)  # the restart
    w2 = await _writer(path, clock)
    try:
        got = w2.state.runs["r"]
        assert _until(got) == clock.now_ms() + 10_000 > _until(r)  # start + its ttl
        assert (got.version, got.revision) == (r.version, r.revision)  # nothing moved back
        clock.advance(10_000 + 499)
        with pytest.raises(LedgerError) as held:  # its lock-delay on top
            await w2.submit(L.Acquire("r", "B"))
        assert held.value.code is Code.RUN_LEASE_HELD
        clock.advance(1)
        assert (await w2.submit(L.Acquire("r", "B"))).attempt == 2
    finally:
        await w2.close()


async def test_a_lease_expired_before_the_last_flush_is_not_extended(tmp_path: Path) -> None:
    """The flush of expiries moves the lease floor: a lease stored as expired
    at or before it cannot have been renewed from memory since (that renewal
    is written instead), so a crash does not give it another ttl."""
    path = tmp_path / "m.db"
    clock = ManualClock()
    w = await _writer(path, clock, lease_flush_ms=1_000)
    dead = await w.submit(L.Acquire("dead", "A", ttl_ms=1_000))
    live = await w.submit(L.Acquire("live", "A", ttl_ms=10_000))
    clock.advance(2_000)  # "dead" expired; its holder is gone
    r = await w.submit(L.Renew("live", "A", live.fencing_token))
    clock.advance(1_000)
    await w.submit(L.Acquire("other", "A"))  # a batch: the flush cycle starts and ends
    runs, floor = _stored(path)
    assert runs["live"] == _until(r) and floor == clock.now_ms()
    await crash_writer(w)
    clock.advance(500)
    w2 = await _writer(path, clock)
    try:
        assert _until(w2.state.runs["live"]) == clock.now_ms() + 10_000  # live past the floor
        assert w2.state.runs["dead"] == dead  # expired before the floor: not extended
        # and its renewal now is written, not remembered
        late = await w2.submit(L.Renew("dead", "A", dead.fencing_token))
        assert late.version == dead.version + 1 and late.revision > dead.revision
    finally:
        await w2.close()


async def test_a_flush_copies_only_the_expiries_its_floor_would_pass(tmp_path: Path) -> None:
    """A lease whose stored expiry is past the new floor is extended by the
    restart rule as it is: the cycle leaves it for a later one, and a crash
    after the floor is stored still gives it its acknowledged expiry."""
    path = tmp_path / "m.db"
    clock = ManualClock()
    w = await _writer(path, clock, lease_flush_ms=2_000)
    a = await w.submit(L.Acquire("a", "A", ttl_ms=3_000))
    b = await w.submit(L.Acquire("b", "A", ttl_ms=20_000))
    clock.advance(1_100)
    await w.submit(L.Acquire("x1", "A"))  # a batch: "a" and "b" copied into runs
    assert _stored(path)[0] == {"a": _until(a), "b": _until(b)}
    ra = await w.submit(L.Renew("a", "A", a.fencing_token))
    rb = await w.submit(L.Renew("b", "A", b.fencing_token))
    clock.advance(2_400)
    await w.submit(L.Acquire("x2", "A"))  # a batch: the flush cycle starts and ends
    runs, floor = _stored(path)
    assert floor == clock.now_ms()
    assert runs["a"] == _until(ra)  # stored until before the floor: copied
    assert runs["b"] == _until(b) > floor  # stored live past it: left as it is
    clock.advance(2_000)  # a cycle with nothing to copy: an idle writer stores its floor
    for _ in range(500):
        if _stored(path)[1] == clock.now_ms():
            break
        await asyncio.sleep(0.01)
    runs, floor = _stored(path)
    assert floor == clock.now_ms() and runs["b"] == _until(b)
    await crash_writer(w)
    clock.advance(500)
    w2 = await _writer(path, clock)
    try:
        assert w2.state.runs["a"] == ra  # expired before the floor: not extended
        assert _until(w2.state.runs["b"]) == clock.now_ms() + 20_000 > _until(rb)
        with pytest.raises(LedgerError) as held:
            await w2.submit(L.Acquire("b", "B"))
        assert held.value.code is Code.RUN_LEASE_HELD
    finally:
        await w2.close()


async def test_a_clean_stop_leaves_every_expiry_exact(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    clock = ManualClock()
    w = await _writer(path, clock)
    a = await w.submit(L.Acquire("r", "A", ttl_ms=10_000))
    clock.advance(3_000)
    r = await w.submit(L.Renew("r", "A", a.fencing_token))
    await w.close()
    runs, floor = _stored(path)
    assert runs["r"] == _until(r) and floor == -1  # -1: exact
    clock.advance(5_000)
    w2 = await _writer(path, clock)
    try:
        assert w2.state.runs["r"] == r  # as acknowledged: no extension
        assert _stored(path)[1] == clock.now_ms()  # stored before anything is renewed
    finally:
        await w2.close()


async def test_a_closed_hub_hears_no_more_renewals(tmp_path: Path) -> None:
    """The hub subscribes to the change feed and to renewals from memory at its
    start, and drops both at its close: a closed hub is never called again."""
    from fencepost_server.hub import FenceHub
    from fencepost_server.writer import Reads

    clock = ManualClock()
    w = await _writer(tmp_path / "h.db", clock)
    hub = FenceHub(w, clock, reads=Reads(w.storage, lambda: w.state))
    try:
        hub.start()
        assert w.renewals._listeners == [hub.on_renewed] and len(w._listeners) == 1
        await hub.close()
        assert w.renewals._listeners == [] and w._listeners == []
    finally:
        await w.close()
