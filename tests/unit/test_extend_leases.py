"""A new leader's lease extension (core.ledger.extend_lease): only leases that
were live when the coordinator became unavailable are extended, by exactly
the unavailable time, and nothing else about the run changes."""

from __future__ import annotations

from fencepost_server.core import ledger as L
from fencepost_server.core.records import Record, Status

T = 1_000_000


def _running(ttl: int = 10_000) -> Record:
    d = L.decide(L.Acquire("r", "w", ttl), None, 0, T, 1)
    assert isinstance(d.change, L.Put)
    return d.change.record


def test_a_live_lease_is_extended_by_the_gap_and_keeps_its_holder_and_token() -> None:
    rec = _running()
    new = L.extend_lease(rec, L.ExtendLeases(by_ms=3_000, alive_at=T + 5_000),
                         T + 8_000, 7)
    assert new is not None
    assert new.lease is not None and rec.lease is not None
    assert new.lease.expires_at == rec.lease.expires_at + 3_000
    assert new.lease.owner == "w" and new.fencing_token == rec.fencing_token
    assert new.status is Status.RUNNING and new.revision == 7
    assert new.version == rec.version + 1


def test_a_lease_expired_before_the_outage_is_not_extended() -> None:
    rec = _running(ttl=1_000)  # expires at T + 1000
    assert L.extend_lease(rec, L.ExtendLeases(3_000, alive_at=T + 1_000), T + 5_000, 2) is None
    assert L.extend_lease(rec, L.ExtendLeases(3_000, alive_at=T + 999), T + 5_000, 2) is not None


def test_runs_without_a_lease_are_left_alone() -> None:
    rec = _running()
    d = L.decide(L.Release("r", "w", 1), rec, 0, T + 1, 2)
    assert isinstance(d.change, L.Put)
    assert L.extend_lease(d.change.record, L.ExtendLeases(3_000, T), T + 5, 3) is None
