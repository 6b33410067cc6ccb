"""What the torture's mode with coordinators leading shards apart adds to
the checkers, on small hand-written histories and timelines: a take's lease
extensions are read at the revisions its log line names; no coordinator
answers about a shard after its row showed another owner; a partial
ListRuns says nothing of the runs it leaves out; a coordinator whose clock
left the bound, or whose sessions stalled, loses its shards in time — each
with a good and a bad variant."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _hist import op, rec

from fencepost_server.core.shards import shard_of
from torture.history import EXTEND
from torture.linearizability import check_run
from torture.sharding import (
    ShardTimeline,
    check_exits,
    check_shard_epochs,
    check_struck,
    extensions,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))
from _history import Change, Snapshot

MS = 1_000_000  # ns
SHARDS = 8
S = shard_of("r", SHARDS)


def leased(v: int, expires: int, rev: int) -> dict[str, Any]:
    r = rec(v, rev=rev)
    r["lease"] = ["A", 0, expires, 1000, 0]
    return r


def _timeline(*extra: dict[str, Any]) -> ShardTimeline:
    """Coordinator 0 (pid 10) takes the shard of "r" (epoch 1) at 1 ms;
    coordinator 1 (pid 11) takes it (epoch 2) at 100 ms — the watcher's last
    poll of epoch 1 sent at 90 ms, epoch 2 seen at 101 ms — and logs at 104 ms
    that its take extended one lease, at revision 1 << 24."""
    events: list[dict[str, Any]] = [
        {"kind": "spawn", "slot": 0, "pid": 10, "t": 0},
        {"kind": "spawn", "slot": 1, "pid": 11, "t": 0},
        {"kind": "shard", "shard": S, "epoch": 1, "prev": 0, "pid": 10, "before": 0,
         "seen": 1 * MS, "t": 1 * MS},
        {"kind": "shard", "shard": S, "epoch": 2, "prev": 1, "pid": 11, "before": 90 * MS,
         "seen": 101 * MS, "t": 101 * MS},
        {"kind": "line", "slot": 1, "pid": 11, "what": "extended-shards", "shards": [S],
         "leases": 1, "others": 0, "first": 1 << 24, "t": 104 * MS},
        *extra,
    ]
    return ShardTimeline(sorted(events, key=lambda e: e["t"]), SHARDS)


def _held(*moves: dict[str, Any]) -> ShardTimeline:
    """Coordinators 0 (pid 10) and 1 (pid 11); pid 10 holds the shard of "r"
    (epoch 1) from 1 ms; then ``moves``."""
    return ShardTimeline([{"kind": "spawn", "slot": 0, "pid": 10, "t": 0},
                          {"kind": "spawn", "slot": 1, "pid": 11, "t": 0},
                          _move(1, 10, 0, 0.001), *moves], SHARDS)


def test_a_takes_extension_is_read_at_the_revision_it_names() -> None:
    v1, v2 = leased(1, 1000, 5), leased(2, 1500, 1 << 24)
    snap = Snapshot([Change(5, "r", 1, v1, 0), Change(1 << 24, "r", 1, v2, 0)], {}, 0, ["ok"])
    ops, bad = extensions(_timeline(), snap)
    assert bad == []
    assert [(o.f, o.rec, o.a["pre"], o.inv, o.cmp) for o in ops] == [
        (EXTEND, v2, v1, 90 * MS, 104 * MS)]
    other = rec(2, rev=1 << 24)  # a client's write, not an extension
    _, bad = extensions(_timeline(), Snapshot(
        [Change(5, "r", 1, v1, 0), Change(1 << 24, "r", 1, other, 0)], {}, 0, ["ok"]))
    assert [v.check for v in bad] == ["shard-epochs"]


def test_a_take_killed_before_its_line_is_found_by_its_revision_block() -> None:
    """Pid 12 (coordinator 2) takes the shard at 200 ms (the watcher's last
    poll of epoch 2 sent at 190 ms) and is killed before it logs the take's
    extension, which commits anyway, at the start of block 5; the shard
    moves on at 300 ms."""
    v1, v2 = leased(1, 1000, 5), leased(2, 1500, 1 << 24)
    v3 = leased(3, 2500, (5 << 24) + 1)
    took = [{"kind": "spawn", "slot": 2, "pid": 12, "t": 0},
            {"kind": "line", "slot": 2, "pid": 12, "what": "took", "shards": [S],
             "t": 200 * MS},
            {"kind": "shard", "shard": S, "epoch": 3, "prev": 2, "pid": 12,
             "before": 190 * MS, "seen": 205 * MS, "t": 205 * MS},
            {"kind": "shard", "shard": S, "epoch": 4, "prev": 3, "pid": 11,
             "before": 290 * MS, "seen": 300 * MS, "t": 300 * MS}]
    snap = Snapshot([Change(5, "r", 1, v1, 0), Change(1 << 24, "r", 1, v2, 0),
                     Change((5 << 24) + 1, "r", 1, v3, 0)], {}, 0, ["ok"])
    ops, bad = extensions(_timeline(*took), snap)
    assert bad == []
    assert [(o.rec, o.a["pre"], o.inv, o.cmp) for o in ops[1:]] == [(v3, v2, 190 * MS, 300 * MS)]
    # no take went without its line: nothing explains the write
    ops, bad = extensions(_timeline(), snap)
    assert len(ops) == 1 and [v.check for v in bad] == ["shard-epochs"]


def test_an_answer_about_a_shard_after_it_moved_away_is_caught() -> None:
    before = op("get_run", 50, 60, r=rec(1))
    after = op("get_run", 120, 130, r=rec(1))
    for o in (before, after):
        o.ep, o.at = 0, o.inv  # answered by coordinator 0 (pid 10)
    bad, stats = check_shard_epochs([before, after], _timeline())
    assert stats == {"attributed": 2, "unattributed": 0}
    assert len(bad) == 1 and bad[0].ops == [after.brief()]
    # taken back by pid 10 while the call was out: not a violation
    back = {"kind": "shard", "shard": S, "epoch": 3, "prev": 2, "pid": 10,
            "before": 125 * MS, "seen": 140 * MS, "t": 140 * MS}
    assert check_shard_epochs([after], _timeline(back))[0] == []


def test_a_partial_listing_says_nothing_of_the_runs_it_leaves_out() -> None:
    history = [op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
               op("list", 2, 3, run="*", x={"runs": {}})]
    assert not check_run(history, "r").ok  # a full listing: "r" was absent
    history[1].x["partial"] = True
    assert check_run(history, "r").ok


def test_a_coordinator_exits_only_as_the_nemesis_made_it() -> None:
    tl = _timeline({"kind": "exit", "slot": 0, "pid": 10, "code": 0, "t": 200 * MS},
                   {"kind": "exit", "slot": 1, "pid": 11, "code": 3, "t": 210 * MS})
    term = {"kind": "term", "t": 190 * MS, "at": 190 * MS, "slot": 0, "pid": 10, "exit": 0}
    bad = check_exits([term], tl)
    assert len(bad) == 1 and "pid 11" in bad[0].message and "code 3" in bad[0].message


S_ = 1000 * MS  # a second, in ns


def _move(epoch: int, pid: int, before: float, seen: float) -> dict[str, Any]:
    return {"kind": "shard", "shard": S, "epoch": epoch, "prev": epoch - 1, "pid": pid,
            "before": int(before * S_), "seen": int(seen * S_), "t": int(seen * S_)}


def _jump(at: float, offset: int, pid: int = 10) -> dict[str, Any]:
    return {"kind": "clock", "t": int(at * S_), "at": int(at * S_), "slot": 0, "pid": pid,
            "ms": offset, "offset": offset, "held": [S]}


def test_a_coordinator_whose_clock_left_the_bound_gives_its_shards_up_and_takes_none() -> None:
    """Pid 10 holds the shard (epoch 1, from _timeline's first move); its clock
    jumps 900 ms ahead (bound 500 + slack 250) at 1 s; the run ends at 30 s."""
    end = {"kind": "stop-all", "t": 30 * S_}

    def bad(*moves: dict[str, Any], offset: int = 900) -> list[str]:
        return [v.message for v in check_struck([_jump(1, offset), end], _held(*moves),
                                                skew_ms=500, clock_slack_ms=250)]

    assert bad(_move(2, 11, 3, 3.1)) == []  # taken by pid 11 within the bound
    kept = bad()
    assert len(kept) == 1 and f"still held shard {S}" in kept[0]
    assert len(bad(_move(2, 11, 12, 12.1))) == 1  # taken, but only after 11 s
    # it took the shard back 8 s after the jump, its clock still ahead
    back = bad(_move(2, 11, 3, 3.1), _move(3, 10, 9, 9.1))
    assert len(back) == 1 and "took shard" in back[0] and "8.0 s after the jump" in back[0]
    # a round past its skew check when the clock jumped may still take
    assert bad(_move(2, 11, 3, 3.1), _move(3, 10, 1.2, 1.3), _move(4, 11, 4, 4.1)) == []
    # within the bound (or the slack): nothing is expected
    assert bad(offset=700) == []


def test_a_coordinator_whose_sessions_stalled_past_the_lease_finds_its_shards_taken() -> None:
    """Pid 10's writer and shard renewals stall at 1 s for 3 s (unstalled at 4 s)."""
    stall = {"kind": "pg-stall", "t": 1 * S_, "at": 1 * S_, "slot": 0, "pid": 10,
             "backends": [7, 8], "seconds": 3.0, "mid_commit": True, "renewals": True,
             "held": [S]}
    unstall = {"kind": "pg-unstall", "t": 4 * S_, "backends": [7, 8]}
    end = {"kind": "stop-all", "t": 30 * S_}

    def bad(*moves: dict[str, Any], faults: tuple[dict[str, Any], ...] = (stall, unstall, end),
            ) -> list[str]:
        return [v.message for v in check_struck(list(faults), _held(*moves), skew_ms=500,
                                                clock_slack_ms=250)]

    assert bad(_move(2, 11, 4.1, 4.2)) == []
    assert bad(_move(2, 10, 5, 5.1)) == []  # a new epoch, even its own after the stall
    assert len(bad()) == 1
    assert len(bad(_move(2, 11, 14.5, 14.6))) == 1  # 10.6 s after the stall's end
    # only the writer stalled: its renewals went on, and so may its shards
    assert bad(faults=(dict(stall, renewals=False), unstall, end)) == []
