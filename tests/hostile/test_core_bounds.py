"""The pure core never writes a counter past 2^53 - 1, whatever it is given:
every increment (version, attempt, fencing token, a lock's token, a step's
position) is checked before the write, a record already past the bound is
refused every command but a delete, and a delete of one keeps a tombstone
the database can hold that still spends the id."""

from __future__ import annotations

import dataclasses

import pytest

from fencepost_server.core import engine as E
from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.records import Lease, Record, Status

NOW = 1_700_000_000_000
INT64 = 2**63 - 1
MAX_SAFE = 2**53 - 1


def _rec(**kw: object) -> Record:
    base = Record("r", 1, Status.RUNNING, 1, 1, NOW, NOW,
                  lease=Lease("a", NOW, NOW + 1000, 1000))
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def _refused(cmd: object, cur: Record | None, code: Code, field: str, tomb: int = 0) -> None:
    with pytest.raises(LedgerError) as ei:
        L.decide(cmd, cur, tomb, NOW + 5000, 9)  # type: ignore[arg-type]
    assert (ei.value.code, ei.value.field) == (code, field), ei.value


def test_every_increment_at_the_bound_is_refused() -> None:
    v = Code.RUN_VALIDATION_ERROR
    _refused(L.Acquire("r", "b"), _rec(fencing_token=MAX_SAFE), v, "fencing_token")
    _refused(L.Acquire("r", "b"), _rec(attempt=MAX_SAFE), v, "attempt")
    _refused(L.Renew("r", "a", 1), _rec(version=MAX_SAFE, lease=Lease("a", NOW, NOW * 2, 1000)),
             v, "version")
    _refused(L.Cancel("r"), _rec(fencing_token=MAX_SAFE), v, "fencing_token")
    _refused(L.Acquire("r", "b"), None, v, "fencing_token", tomb=MAX_SAFE)
    raw = L.RawCreate(_rec(fencing_token=MAX_SAFE + 1))
    _refused(raw, None, v, "fencing_token")


def test_the_last_value_is_written() -> None:
    d = L.decide(L.Acquire("r", "b"), _rec(fencing_token=MAX_SAFE - 1, attempt=MAX_SAFE - 1),
                 0, NOW + 5000, 9)
    assert isinstance(d.change, L.Put)
    assert (d.change.record.fencing_token, d.change.record.attempt) == (MAX_SAFE, MAX_SAFE)


@pytest.mark.parametrize("bad", [{"fencing_token": INT64}, {"fencing_token": 2**64},
                                 {"attempt": -1}, {"version": 2.0**70}])
def test_a_record_past_the_bound_is_refused_all_but_a_delete(bad: dict[str, object]) -> None:
    cur = _rec(**bad)
    field = next(iter(bad))
    for cmd in (L.Acquire("r", "a"), L.Renew("r", "a", 1), L.Cancel("r"), L.RequestResume("r"),
                L.RawCreate(_rec()), L.RawCompareAndSet("r", 1, _rec(version=2))):
        _refused(cmd, cur, Code.RUN_INTEGRITY_ERROR, field)
    for cmd in (L.DeleteRun("r"), L.RawDelete("r"), L.Retire("r", cur.version)):
        cur = _rec(status=Status.COMPLETED, lease=None, **bad)
        d = L.decide(cmd, cur, 0, NOW, 9)  # type: ignore[arg-type]
        assert isinstance(d.change, L.Delete)
        token = d.change.fencing_token
        assert type(token) is int and -(2**63) <= token <= INT64  # the database holds it
        if field == "fencing_token":
            assert token > MAX_SAFE  # the id stays spent: no token is reused


def test_a_new_leader_leaves_a_record_past_the_bound_alone() -> None:
    ext = L.ExtendLeases(by_ms=1000, alive_at=NOW)
    assert L.extend_lease(_rec(fencing_token=INT64), ext, NOW, 9) is None
    assert L.extend_lease(_rec(version=MAX_SAFE), ext, NOW, 9) is None
    assert L.extend_lease(_rec(), ext, NOW, 9) is not None


def test_a_lock_and_a_step_log_stop_at_the_bound() -> None:
    lock = E.Lock("k", None, MAX_SAFE, 0)
    with pytest.raises(LedgerError) as ei:
        E.decide_acquire_lock(lock, E.AcquireLock("k", "o", 1000), NOW)
    assert ei.value.field == "key"
    new, answer = E.decide_acquire_lock(dataclasses.replace(lock, fencing_token=MAX_SAFE - 1),
                                        E.AcquireLock("k", "o", 1000), NOW)
    assert new is not None and answer.fencing_token == MAX_SAFE
    with pytest.raises(LedgerError) as ei:
        E.decide_append_step(MAX_SAFE, E.AppendStep("r", "s"), NOW)
    assert ei.value.field == "step.seq"
    assert E.decide_append_step(MAX_SAFE - 1, E.AppendStep("r", "s"), NOW).seq == MAX_SAFE
