"""The ``watch`` checker (torture/watching.py) on small hand-written watcher
logs against a hand-written change log: a clean watch across a restart
passes; a change missed, delivered twice, out of order, invented, altered or
under the wrong shard, an error other than an outage, and a catch-up that
fell short are each reported, naming the run and the revision."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _hist import rec

from fencepost_server.core.shards import shard_of
from torture.checkers import check_all
from torture.watching import Watched, check_watch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))
from _history import Change, Snapshot

SHARDS = 8
A, B = "a", "c"  # two runs in different shards
SA, SB = shard_of(A, SHARDS), shard_of(B, SHARDS)
assert SA != SB


def changes() -> list[Change]:
    """a: created at 1, renewed at 3; c: created at 2, deleted at 4; a again at 5."""
    return [
        Change(1, A, 1, rec(1, run=A, rev=1), 0),
        Change(2, B, 1, rec(1, tok=4, owner="B", run=B, rev=2), 0),
        Change(3, A, 1, rec(2, run=A, rev=3), 0),
        Change(4, B, 2, None, 0),
        Change(5, A, 1, rec(3, tok=2, owner=None, status=1, run=A, rev=5), 0),
    ]


def ev(c: Change, n: int = 1, **over: Any) -> dict[str, Any]:
    """The watcher's line for change ``c`` as delivered faithfully (``over``: not)."""
    e: dict[str, Any] = {"k": "ev", "n": n, "rev": c.revision, "shard": shard_of(c.run_id, SHARDS),
                         "run": c.run_id, "kind": "delete" if c.kind == 2 else "put"}
    if c.rec is not None:
        lease = c.rec.get("lease")
        e.update(ver=c.rec["version"], tok=c.rec["fencing_token"],
                 st={1: "queued", 2: "running"}[c.rec["status"]],
                 own=lease[0] if lease else None)
    e.update(over)
    return e


def cursor(revs: dict[int, int]) -> str:
    return "fpw1:" + ",".join(f"{s}={r}" for s, r in sorted(revs.items()))


ZERO = cursor(dict.fromkeys(range(SHARDS), 0))


def watched(tmp_path: Path, events: list[dict[str, Any]], *, start: str = ZERO,
            target: dict[int, int] | None = None, end: str = "caught-up",
            extra: list[dict[str, Any]] = ()) -> Watched:  # type: ignore[assignment]
    """watch.jsonl with a first watch, ready at ``start``, then ``events``, a
    target (every shard's last change by default) and how the catch-up ended."""
    top = {SA: 5, SB: 4} if target is None else target
    lines = [{"k": "start", "n": 1, "cursor": "fpw1:"},
             {"k": "ready", "count": SHARDS, "cursor": start},
             *events, *extra,
             {"k": "target", "upto": {str(s): r for s, r in top.items()}},
             {"k": end, "cursor": cursor({**dict.fromkeys(range(SHARDS), 0), **top}),
              "seconds": 0.1}]
    path = tmp_path / "watch.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    w = Watched.load(path)
    assert w is not None
    return w


def found(w: Watched) -> list[str]:
    return [v.message for v in check_watch(w, Snapshot(changes(), {}, 5, ["ok"]))]


def test_every_change_delivered_once_across_a_restart_is_clean(tmp_path: Path) -> None:
    c = changes()
    restart = [{"k": "restart", "n": 1, "cursor": cursor({SA: 3, SB: 2})},
               {"k": "start", "n": 2, "cursor": cursor({SA: 3, SB: 2})}]
    # shards are in no defined order against each other: c's delete before a's write
    w = watched(tmp_path, [ev(c[0]), ev(c[1]), ev(c[2])],
                extra=[*restart, {"k": "error", "n": 2, "type": "UnavailableError",
                                  "msg": "no coordinator for 10 s", "cursor": "fpw1:"},
                       ev(c[3], n=3), ev(c[4], n=3)])
    assert found(w) == []
    assert w.summary()["restarts"] == 1 and w.summary()["errors"] == {"UnavailableError": 1}


def test_a_change_never_delivered_is_named_with_where_the_watch_was(tmp_path: Path) -> None:
    c = changes()
    msgs = found(watched(tmp_path, [ev(c[0]), ev(c[1]), ev(c[3]), ev(c[4], n=2)]))
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith(f"{A} rev 3 (shard {SA}): {A} v2 token 1 running held by 'A' "
                              "was committed but never delivered"), msgs
    assert "after revision 1 (watch #1), before revision 5 (watch #2)" in msgs[0]


def test_changes_before_the_start_or_after_the_target_are_not_required(tmp_path: Path) -> None:
    c = changes()
    # a's watch began after revision 1; c's target was read before its delete
    w = watched(tmp_path, [ev(c[1]), ev(c[2]), ev(c[4])], start=cursor({SA: 1, SB: 0}),
                target={SA: 5, SB: 2})
    assert found(w) == []
    # ... but a change delivered there is still checked
    bad = ev(c[3], tok=9)
    bad.pop("tok")
    w = watched(tmp_path, [ev(c[1]), ev(c[2]), ev(c[4]), ev(c[3], kind="put", ver=1, tok=4,
                                                            st="running", own="B")],
                start=cursor({SA: 1, SB: 0}), target={SA: 5, SB: 2})
    assert found(w) == [f"{B} rev 4 (shard {SB}, watch #1): delivered {B} v1 token 4 running "
                        f"held by 'B', but the committed history has a delete of {B} at that "
                        "revision"]


def test_a_change_delivered_twice_is_caught(tmp_path: Path) -> None:
    c = changes()
    msgs = found(watched(tmp_path, [ev(c[0]), ev(c[1]), ev(c[2]), ev(c[2], n=2), ev(c[3], n=2),
                                    ev(c[4], n=2)]))
    assert msgs == [f"{A} rev 3 (shard {SA}, watch #2): delivered twice (first by watch #1)"]


def test_changes_out_of_order_within_a_shard_are_caught(tmp_path: Path) -> None:
    c = changes()
    msgs = found(watched(tmp_path, [ev(c[0]), ev(c[2]), ev(c[1]), ev(c[4]), ev(c[3])]))
    assert msgs == []  # across shards no order is promised
    msgs = found(watched(tmp_path, [ev(c[2]), ev(c[0]), ev(c[1]), ev(c[3]), ev(c[4])]))
    assert msgs == [f"{A} rev 1 (shard {SA}, watch #1): delivered after revision 3 of the same "
                    f"shard ({A}, watch #1): out of order"]


def test_an_invented_or_altered_change_is_caught(tmp_path: Path) -> None:
    c = changes()
    ok = [ev(x) for x in c]
    invented = ev(c[4], rev=6, ver=4)
    msgs = found(watched(tmp_path, [*ok, invented]))
    assert msgs == [f"{A} rev 6 (shard {SA}, watch #1): delivered {A} v4 token 2 queued, but "
                    "the committed history has nothing at that revision (invented)"]
    for field, value in (("ver", 7), ("tok", 3), ("st", "suspended"), ("own", "X"),
                         ("run", "z")):
        altered = [*ok[:2], ev(c[2], **{field: value}), *ok[3:]]
        if field == "run":
            altered[2]["shard"] = shard_of("z", SHARDS)
        msgs = found(watched(tmp_path, altered))
        said = f"rev 3 (shard {altered[2]['shard']}, watch #1): delivered "
        assert any(said in m and f"but the committed history has {A} v2 token 1 running held "
                   "by 'A' at that revision" in m for m in msgs), (field, msgs)


def test_a_change_under_another_shard_is_caught(tmp_path: Path) -> None:
    c = changes()
    wrong = (SA + 1) % SHARDS
    msgs = found(watched(tmp_path, [ev(c[0], shard=wrong), *(ev(x) for x in c[1:])]))
    assert msgs == [f"{A} rev 1 (shard {wrong}, watch #1): delivered as shard {wrong}, but {A} "
                    f"is in shard {SA}"]


def test_errors_other_than_an_outage_and_a_short_catch_up_are_violations(
        tmp_path: Path) -> None:
    c = changes()
    error = {"k": "error", "n": 1, "type": "RevisionCompactedError",
             "msg": "shards[3]: changes after revision 2 were pruned", "cursor": cursor({SA: 1})}
    msgs = found(watched(tmp_path, [*(ev(x) for x in c)], extra=[error], end="behind"))
    assert len(msgs) == 2, msgs
    assert msgs[0].startswith("watch #1 raised RevisionCompactedError: shards[3]")
    assert "nothing could be pruned" in msgs[0]
    assert msgs[1].startswith("the watcher did not reach the last committed revision of shards")


def test_no_ready_watch_and_no_watcher(tmp_path: Path) -> None:
    path = tmp_path / "watch.jsonl"
    path.write_text(json.dumps({"k": "start", "n": 1, "cursor": "fpw1:"}) + "\n")
    w = Watched.load(path)
    assert w is not None
    assert found(w)[0].startswith("the watcher never had a cursor for every shard")
    assert Watched.load(tmp_path / "none.jsonl") is None


def test_check_all_reports_the_watch_with_the_others(tmp_path: Path) -> None:
    c = changes()
    snap = Snapshot(changes(), {}, 5, ["ok"])
    checked = check_all([], runs=[], snap=snap, watched=watched(tmp_path, [ev(c[0])]))
    assert checked.counts.get("watch") == 4, checked.counts  # revisions 2-5 missed
    assert "watch" in checked.timings
    assert [v.check for v in checked.violations if v.check == "watch"] == ["watch"] * 4
