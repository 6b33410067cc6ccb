"""The stale-snapshot checker (torture/snapshots.py) on hand-written
histories: a snapshot accepted after a takeover is caught (and whether a
holder read it back), a refused one is counted as the window closed, and a
write that overlaps the takeover is not judged."""

from __future__ import annotations

from _hist import op, rec

from torture.snapshots import check_snapshots

# A holds token 1; B takes over (token 2) and completes at t=11
LEDGER = [
    op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
    op("checkpoint", 2, 3, r=rec(2), owner="A", token=1, since=1, key="k", snapshot_version=0),
    op("acquire", 10, 11, r=rec(3, tok=2, owner="B"), owner="B", ttl=1000),
]


def snap(inv: float, cmp: float, st: str = "ok", *, token: int, sid: str,
         code: str = "") -> object:
    return op("snapshot", inv, cmp, st, code=code, owner="X", token=token, sid=sid,
              fenced=False, x={"saved": st == "ok"})


def test_a_snapshot_before_the_takeover_is_fine() -> None:
    bad, stats = check_snapshots(LEDGER, [snap(4, 5, token=1, sid="a1")])  # type: ignore[list-item]
    assert bad == [] and stats.accepted == 1 and stats.stale_accepted == 0


def test_a_snapshot_accepted_after_the_takeover_is_a_violation() -> None:
    ops = [
        snap(12, 13, token=1, sid="a1"),
        op("read_snapshot", 14, 15, x={"found": True, "sid": "a1", "token": 1}),
    ]
    bad, stats = check_snapshots(LEDGER, ops)  # type: ignore[arg-type]
    assert [v.check for v in bad] == ["stale-snapshot"]
    assert "token had moved to 2" in bad[0].message and "got it back" in bad[0].message
    assert (stats.stale_accepted, stats.stale_read, stats.reads) == (1, 1, 1)


def test_a_refused_stale_snapshot_is_the_window_closed() -> None:
    ops = [snap(12, 13, "fail", token=1, sid="a1", code="RUN_LEASE_LOST"),
           snap(12, 13, token=2, sid="b1")]
    bad, stats = check_snapshots(LEDGER, ops)  # type: ignore[arg-type]
    assert bad == [] and (stats.refused, stats.refused_stale, stats.accepted) == (1, 1, 1)


def test_a_write_overlapping_the_takeover_is_not_judged() -> None:
    # sent at 9, before B's acquire completed at 11: it may have committed first
    bad, stats = check_snapshots(LEDGER, [snap(9, 12, token=1, sid="a1")])  # type: ignore[list-item]
    assert bad == [] and stats.stale_accepted == 0


def test_a_delete_moves_the_token_past_its_holder() -> None:
    ledger = [*LEDGER[:2], op("delete_run", 5, 6, x={"deleted": True, "token": 1})]
    bad, _ = check_snapshots(ledger, [snap(7, 8, token=1, sid="a1")])  # type: ignore[list-item]
    assert [v.check for v in bad] == ["stale-snapshot"]
