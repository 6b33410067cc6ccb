"""The flush of expiries renewed from memory (writer/DESIGN.md, "Renewals from
memory") edits only the lease's expiry in a run's stored row, on SQLite and
PostgreSQL: the row is then the record as a fresh encoding gives it, what
else the row held is left as it was, a row that lags other changes still gets
the whole record, and restarts after a clean stop or a crash read back what
the restart rule says (docs/SPEC.md §4)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from _db import crash_writer, raw

from fencepost_server.core import ledger as L
from fencepost_server.core.records import Record, record_to_dict
from fencepost_server.storage import SqliteStorage, is_url
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Writer

T0 = 1_700_000_000_000
TTL = 10_000


def _storage(db: str) -> Any:
    return PostgresStorage(db) if is_url(db) else SqliteStorage(db)


def _row(db: str, run_id: str) -> str:
    with raw(db) as conn:
        (text,) = conn.rows("SELECT record FROM runs WHERE run_id = ?", (run_id,))[0]
        return str(text)


def _add_note(db: str, run_id: str, note: str) -> None:
    """Write a key into the stored row that the record does not have (as a
    later release, or a hand, might): only a re-encoding drops it."""
    doc = json.loads(_row(db, run_id))
    doc["note"] = note
    with raw(db, write=True) as conn:
        conn.run("UPDATE runs SET record = ? WHERE run_id = ?", (json.dumps(doc), run_id))


def _fresh(rec: Record) -> dict[str, Any]:
    return json.loads(orjson.dumps(record_to_dict(rec)))


async def _renewed_and_flushed(db: str, clock: ManualClock) -> tuple[Writer, dict[str, Record]]:
    """Runs a, b, c copied into the runs table; a and b given a key of their
    own in the row; a, b, c renewed from memory, then b changed (not yet copied);
    then a flush cycle that copies all three."""
    w = Writer(_storage(db), clock, materialize_after_ms=0, lease_flush_ms=1_000)
    await w.start()
    got = {k: await w.submit(L.Acquire(k, "A", ttl_ms=TTL)) for k in "abc"}
    await w.submit(L.Acquire("tick", "A"))  # a batch after them: they are copied
    await w.wait_idle()
    w._apply.materialize_after_ms = 10**9  # from now on changes stay pending
    _add_note(db, "a", "kept")
    _add_note(db, "b", "dropped")
    clock.advance(4_000)
    for k in "abc":
        got[k] = await w.submit(L.Renew(k, "A", got[k].fencing_token))
    batches = w.stats.batches
    assert w.stats.batches == batches and w.stats.memory_renewals == 3  # no commit
    got["b"] = await w.submit(L.RecordCheckpoint("b", "A", got["b"].fencing_token, "k", 1))
    clock.advance(TTL - 4_000 + 1_000)  # the stored expiries pass the next floor
    await w.submit(L.Acquire("tick2", "A"))  # a batch: the cycle starts and ends
    await w.wait_idle()
    assert w.stats.leases_flushed == 3 and w.stats.failed_commits == 0
    return w, got


async def test_a_flush_writes_only_the_expiry_into_a_current_row(db: str) -> None:
    clock = ManualClock(T0)
    w, got = await _renewed_and_flushed(db, clock)
    try:
        row_a = json.loads(_row(db, "a"))
        assert row_a.pop("note") == "kept"  # the row was edited, not written anew
        assert row_a == _fresh(got["a"]) and row_a["lease"][2] == T0 + 4_000 + TTL
        assert json.loads(_row(db, "c")) == _fresh(got["c"])
        if not is_url(db):  # SQLite's JSON edit gives the encoder's very text
            assert _row(db, "c") == orjson.dumps(record_to_dict(got["c"])).decode()
        # b's row lagged its checkpoint: the whole record went in, the key with it
        assert json.loads(_row(db, "b")) == _fresh(got["b"])
    finally:
        await w.close()
    w2 = Writer(_storage(db), clock)  # after a clean stop: exact, nothing extended
    await w2.start()
    try:
        for k in "abc":
            assert w2.state.runs[k] == got[k]
    finally:
        await w2.close()


async def test_after_a_crash_the_edited_rows_follow_the_restart_rule(db: str) -> None:
    clock = ManualClock(T0)
    w, got = await _renewed_and_flushed(db, clock)
    floor = clock.now_ms()
    await crash_writer(w)
    clock.advance(500)
    w2 = Writer(_storage(db), clock)
    await w2.start()
    try:
        for k in "abc":
            rec, was = w2.state.runs[k], got[k]
            assert rec.lease is not None and was.lease is not None
            assert was.lease.expires_at > floor  # stored as live past the floor:
            assert rec.lease.expires_at == clock.now_ms() + TTL  # renewed at the start
            assert (rec.version, rec.revision, rec.fencing_token) == (
                was.version, was.revision, was.fencing_token)
    finally:
        await w2.close()


async def test_a_row_the_database_cannot_edit_gets_its_whole_record(db: str) -> None:
    """A row PostgreSQL's jsonb refuses (a NUL escape, only written by hand):
    the flush writes the whole record instead and the batch commits."""
    if not is_url(db):
        pytest.skip("SQLite's JSON edit takes every row the server reads")
    clock = ManualClock(T0)
    w = Writer(_storage(db), clock, materialize_after_ms=0, lease_flush_ms=1_000)
    await w.start()
    try:
        a = await w.submit(L.Acquire("a", "A", ttl_ms=TTL))
        await w.submit(L.Acquire("tick", "A"))
        await w.wait_idle()
        _add_note(db, "a", "\x00")
        clock.advance(4_000)
        r = await w.submit(L.Renew("a", "A", a.fencing_token))
        clock.advance(TTL)
        x = await w.submit(L.Acquire("x", "A"))  # shares the batch with the flush
        await w.wait_idle()
        assert x.lease is not None and w.stats.failed_commits == 0
        assert w.stats.leases_flushed == 1
        assert json.loads(_row(db, "a")) == _fresh(r)
    finally:
        await w.close()
