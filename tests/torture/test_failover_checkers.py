"""What the torture's PostgreSQL mode adds to the checkers, on small
hand-written histories and timelines: a takeover's lease extension is a write
of the register no client made, and the checks that no deposed leader
committed or served, and that deposed leaders exit; a renewal answered on a
clock that ran ahead is held to in true time — each with a good and a bad
variant."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _hist import op, rec

from torture.checkers import check_committed
from torture.failover import (
    Timeline,
    check_deposed,
    check_epochs,
    check_tenures,
    clock_ahead,
    extensions,
)
from torture.history import EXTEND, Op
from torture.linearizability import check_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))
from _history import Change, Snapshot

MS = 1_000_000  # ns


def leased(v: int, expires: int, rev: int | None = None, **kw: Any) -> dict[str, Any]:
    r = rec(v, rev=rev, **kw)
    r["lease"] = ["A", 0, expires, 1000, 0]
    return r


def extend(pre: dict[str, Any], post: dict[str, Any], inv: float, cmp: float) -> Op:
    return Op(id=f"x{post['revision']}", client="coordinator-1", run="r", f=EXTEND,
              inv=int(inv * MS), cmp=int(cmp * MS), st="ok", rec=post,
              a={"epoch": 2, "by_ms": 500, "pre": pre})


# -- the extension in the linearizability model -------------------------------------------


def test_a_takeovers_extension_explains_a_version_no_client_wrote() -> None:
    v1, v2 = leased(1, 1000), leased(2, 1500)
    history = [
        op("acquire", 0, 1, r=v1, owner="A", ttl=1000),
        op("get_run", 10, 11, r=v2),  # version 2, and nobody asked for it
    ]
    assert not check_run(history, "r").ok
    assert check_run(sorted([*history, extend(v1, v2, 2, 9)], key=lambda o: o.inv), "r").ok


def test_an_extension_is_exactly_the_record_before_it_to_the_record_after_it() -> None:
    v1, v2 = leased(1, 1000), leased(2, 1000, owner="A")
    other = leased(2, 1500)  # what was extended is not what the client holds at v2
    assert not check_run(sorted([
        op("acquire", 0, 1, r=v1, owner="A", ttl=1000),
        op("renew", 2, 3, r=v2, owner="A", token=1),
        extend(v1, other, 4, 9),
        op("get_run", 10, 11, r=other),
    ], key=lambda o: o.inv), "r").ok


def test_a_read_of_the_old_value_after_the_takeover_is_stale() -> None:
    v1, v2 = leased(1, 1000), leased(2, 1500)
    assert not check_run(sorted([
        op("acquire", 0, 1, r=v1, owner="A", ttl=1000),
        extend(v1, v2, 2, 3),
        op("get_run", 10, 11, r=v1),  # the takeover had extended it before this began
    ], key=lambda o: o.inv), "r").ok


# -- timelines ---------------------------------------------------------------------------------


def _timeline(*extra: dict[str, Any]) -> Timeline:
    """Coordinator 0 leads epoch 1 (loaded 0) from t=1 ms; coordinator 1 takes
    epoch 2 over at t=100 ms (the watcher's last poll of epoch 1 at 90 ms, the
    database's clock then 10_090), loads revision 2 and extends one lease."""
    events: list[dict[str, Any]] = [
        {"kind": "spawn", "slot": 0, "pid": 10, "t": 0},
        {"kind": "spawn", "slot": 1, "pid": 11, "t": 0},
        {"kind": "epoch", "epoch": 1, "prev": 0, "before": 0, "before_db": 10_000,
         "seen": 1 * MS, "t": 1 * MS},
        {"kind": "line", "slot": 0, "pid": 10, "what": "taking", "epoch": 1, "loaded": 0,
         "t": 1 * MS},
        {"kind": "line", "slot": 0, "pid": 10, "what": "leading", "epoch": 1, "t": 1 * MS},
        {"kind": "epoch", "epoch": 2, "prev": 1, "before": 90 * MS, "before_db": 10_090,
         "seen": 101 * MS, "t": 101 * MS},
        {"kind": "line", "slot": 1, "pid": 11, "what": "taking", "epoch": 2, "loaded": 2,
         "t": 102 * MS},
        {"kind": "line", "slot": 1, "pid": 11, "what": "extended", "epoch": 2, "leases": 1,
         "others": 0, "gap": 500, "t": 103 * MS},
        {"kind": "line", "slot": 1, "pid": 11, "what": "leading", "epoch": 2, "t": 104 * MS},
        *extra,
    ]
    return Timeline.of(sorted(events, key=lambda e: e["t"]))


def _snap(*changes: tuple[int, dict[str, Any] | None, int]) -> Snapshot:
    return Snapshot([Change(rev, "r", 1 if r is not None else 2, r, at)
                     for rev, r, at in changes], {}, changes[-1][0], ["ok"])


def test_extensions_become_operations_in_the_takeovers_window() -> None:
    v1, v2 = leased(1, 1000, rev=1), leased(2, 1000, rev=2)
    v3 = leased(3, 1500, rev=3)
    ops, bad = extensions(_timeline(), _snap((1, v1, 10_000), (2, v2, 10_050), (3, v3, 10_100)))
    assert bad == []
    assert [(o.f, o.rec, o.a["pre"], o.inv, o.cmp) for o in ops] == [
        (EXTEND, v3, v2, 90 * MS, 103 * MS)]


def test_a_deposed_leaders_batch_in_the_extension_block_is_caught() -> None:
    v1, v2 = leased(1, 1000, rev=1), leased(2, 1000, rev=2)
    renewed = leased(3, 1100, rev=3)  # not v2's lease pushed on by the 500 ms gap
    _, bad = extensions(_timeline(), _snap((1, v1, 10_000), (2, v2, 10_050),
                                           (3, renewed, 10_060)))
    assert [v.check for v in bad] == ["epochs"] and "not a lease extension" in bad[0].message


def test_a_change_above_a_takeovers_load_must_have_begun_after_it() -> None:
    v1, v2 = leased(1, 1000, rev=1), leased(2, 1000, rev=2)
    v3, v4 = leased(3, 1500, rev=3), leased(4, 1600, rev=4)
    tl = _timeline()
    fine = _snap((1, v1, 10_000), (2, v2, 10_050), (3, v3, 10_100), (4, v4, 10_120))
    assert check_tenures(tl, fine) == []
    late = _snap((1, v1, 10_000), (2, v2, 10_050), (3, v3, 10_100), (4, v4, 10_060))
    bad = check_tenures(tl, late)
    assert len(bad) == 1 and "revision 4" in bad[0].message and "deposed" in bad[0].message


def _answered(f: str, inv: float, cmp: float, slot: int, r: dict[str, Any] | None) -> Op:
    o = op(f, inv, cmp, r=r, owner="A", token=1, ttl=1000)
    o.ep, o.at = slot, o.inv
    return o


def test_answers_are_checked_against_the_epoch_of_the_coordinator_that_gave_them() -> None:
    tl = _timeline()
    good = [
        _answered("renew", 50, 60, 0, leased(2, 1000, rev=2)),  # epoch 1, before the takeover
        _answered("renew", 110, 120, 1, leased(4, 1600, rev=4)),  # epoch 2
        _answered("get_run", 80, 95, 0, leased(2, 1000, rev=2)),
    ]
    bad, stats = check_epochs(good, tl)
    assert bad == [] and stats == {"attributed": 3, "unattributed": 0}
    late_ack = _answered("renew", 50, 150, 0, leased(3, 1000, rev=3))  # above epoch 2's load
    after = _answered("get_run", 120, 130, 0, leased(2, 1000, rev=2))  # sent after epoch 2
    bad, _ = check_epochs([late_ack, after], tl)
    assert [("committed" in v.message, "served" in v.message) for v in bad] == [
        (True, False), (False, True)]


def test_an_answer_from_a_coordinator_that_never_took_over_is_caught() -> None:
    tl = _timeline({"kind": "spawn", "slot": 2, "pid": 12, "t": 0})
    bad, _ = check_epochs([_answered("get_run", 50, 60, 2, leased(1, 1000, rev=1))], tl)
    assert len(bad) == 1 and "standby" in bad[0].message


def test_deposed_leaders_must_exit_3() -> None:
    stop = {"kind": "stop", "t": 200 * MS, "slot": 1, "pid": 11, "seconds": 2.5}
    cont = {"kind": "cont", "t": 2700 * MS, "slot": 1, "pid": 11}
    end = {"kind": "stop-all", "t": 60_000 * MS}
    exited = _timeline({"kind": "exit", "slot": 1, "pid": 11, "code": 3, "t": 2800 * MS})
    assert check_deposed([stop, cont, end], exited, skew_ms=500, clock_slack_ms=250) == []
    kept = _timeline()
    bad = check_deposed([stop, cont, end], kept, skew_ms=500, clock_slack_ms=250)
    assert len(bad) == 1 and "did not exit 3" in bad[0].message
    jumped = {"kind": "clock", "t": 200 * MS, "slot": 1, "pid": 11, "ms": 2000, "offset": 2000}
    bad = check_deposed([jumped, end], kept, skew_ms=500, clock_slack_ms=250)
    assert len(bad) == 1 and "clock 2000 ms ahead" in bad[0].message
    small = {**jumped, "ms": 200, "offset": 200}  # within the bound: it may keep leading
    assert check_deposed([small, end], kept, skew_ms=500, clock_slack_ms=250) == []
    crashed = _timeline({"kind": "exit", "slot": 1, "pid": 11, "code": 1, "t": 900 * MS})
    bad = check_deposed([end], crashed, skew_ms=500, clock_slack_ms=250)
    assert len(bad) == 1 and "code 1" in bad[0].message


def test_a_fault_is_held_against_the_process_it_struck_not_the_one_alive_when_it_began() -> None:
    """The nemesis takes a fault's time, then waits for a leader: a coordinator
    spawned meanwhile (pid 12, at 300 ms) may be the one it SIGKILLs (at
    400 ms) or SIGSTOPs. The fault is held against that process."""
    end = {"kind": "stop-all", "t": 60_000 * MS}
    spawned = [{"kind": "spawn", "slot": 0, "pid": 12, "t": 300 * MS}]
    killed = _timeline(*spawned, {"kind": "exit", "slot": 0, "pid": 12, "code": -9,
                                   "t": 401 * MS})
    kill = {"kind": "kill", "t": 250 * MS, "slot": 0, "pid": 12, "killed": 400 * MS,
            "up": 2000 * MS}
    assert check_deposed([kill, end], killed, skew_ms=500, clock_slack_ms=250) == []
    bad = check_deposed([{**kill, "pid": 13}, end], killed, skew_ms=500, clock_slack_ms=250)
    assert len(bad) == 1 and "pid 12) exited with code -9" in bad[0].message
    # SIGSTOPped after the wait, continued, and never exiting 3: caught
    stop = {"kind": "stop", "t": 250 * MS, "at": 400 * MS, "slot": 0, "pid": 12,
            "seconds": 2.5}
    cont = {"kind": "cont", "t": 2900 * MS, "slot": 0, "pid": 12}
    bad = check_deposed([stop, cont, end], _timeline(*spawned), skew_ms=500,
                        clock_slack_ms=250)
    assert len(bad) == 1 and "pid 12) was SIGSTOPped" in bad[0].message


def test_a_renewal_from_a_clock_running_ahead_is_held_to_in_true_time() -> None:
    """Coordinator 0's clock jumped 3000 ms ahead (at 5 ms); it acknowledged a
    renewal until 6000 on that clock, i.e. 3000 true. Coordinator 1, on the
    true clock, granted the run to B at 3100 after the shard moved."""
    tl = _timeline()
    jump = {"kind": "clock", "t": 4 * MS, "at": 5 * MS, "slot": 0, "pid": 10, "ms": 3000,
            "offset": 3000}
    renewed = leased(1, 6000, rev=1)  # from memory: the history keeps the acquire's 1000
    ack = _answered("renew", 10, 11, 0, renewed)

    def verdict(at: int, faults: list[dict[str, Any]]) -> list[str]:
        took = dict(rec(2, tok=2, owner="B", rev=2), attempt=2,
                    lease=["B", at, at + 1000, 1000, 0])
        grant = _answered("acquire", 150, 160, 1, took)
        snap = _snap((1, leased(1, 1000, rev=1), 1), (2, took, 2))
        return [v.check for v in check_committed(snap, [ack, grant],
                                                 clock=clock_ahead(tl, faults))
                if v.check == "renewals"]

    assert verdict(3100, []) == ["renewals"]  # read on one clock: 3100 is before 6000
    assert verdict(3100, [jump]) == []  # 3000 true: met
    assert verdict(2900, [jump]) == ["renewals"]  # before it in true time too
    # coordinator 1's own clock 2000 ms ahead: it had to wait for 5000 on it
    ahead = {**jump, "slot": 1, "pid": 11, "offset": 2000}
    assert verdict(3100, [jump, ahead]) == ["renewals"]
    assert verdict(5000, [jump, ahead]) == []
