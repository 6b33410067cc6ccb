"""The stale-snapshot checker: no snapshot from a fenced-out holder is
visible after the takeover.

Workers write each run's snapshot at every checkpoint boundary the way the
run-store design does (torture/worker.py ``Actor.checkpoint``): point the
ledger record at it under the handle's token, then write the snapshot, with
stalls in between. The design admits the window: a takeover landing between
the two leaves the old holder's snapshot behind, over the new holder's. With
fenced snapshot writes the server refuses a snapshot whose handle is no
longer current, so the window is closed; unfenced, it stays open.

The snapshot history (``snapshots-*.jsonl``: ``snapshot``, ``snapshot_tx``
and ``read_snapshot`` operations) is checked against the ledger history. A
snapshot write with token ``t`` is **stale** when, before it was even sent,
some completed operation had already observed the run at a token above
``t`` (a takeover, cancel, delete or raw steal had committed): the write
cannot have committed while ``t`` was current. A stale write the server
accepted was in the store after the takeover, where the new holder reads its
snapshot from -- a violation. ``read`` counts how many of those a reader
actually got back. Writes whose order against the takeover is not known from
real time (they overlap it) are not judged: sound, not complete.

``refused_stale``: stale writes the server refused (RUN_LEASE_LOST), the
window exercised and closed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .checkers import Violation, _v
from .history import Op

WRITES = ("snapshot", "snapshot_tx")


@dataclass
class SnapshotStats:
    writes: int = 0  # snapshot writes answered (accepted or refused)
    accepted: int = 0
    stale_accepted: int = 0  # accepted although a higher token was observed before sending
    stale_read: int = 0  # of those, how many a reader got back
    refused_stale: int = 0  # refused RUN_LEASE_LOST although sent after the takeover
    refused: int = 0  # every RUN_LEASE_LOST refusal
    reads: int = 0
    by_run: dict[str, int] = field(default_factory=dict)  # stale accepted per run

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _token_timeline(ledger_ops: Iterable[Op]) -> dict[str, tuple[list[int], list[int]]]:
    """Per run: completion times of every operation that observed a record,
    and the highest token observed by each time (a running maximum)."""
    seen: dict[str, list[tuple[int, int]]] = {}
    for op in ledger_ops:
        if op.cmp is None:
            continue
        recs: list[dict[str, Any]] = []
        if op.rec is not None:
            recs.append(op.rec)
        if op.f == "list":
            recs.extend(op.x.get("runs", {}).values())
        elif op.f == "delete_run" and op.ok:
            seen.setdefault(op.run, []).append((op.cmp, int(op.x.get("token", 0)) + 1))
        for rec in recs:
            seen.setdefault(rec["run_id"], []).append((op.cmp, rec["fencing_token"]))
    out: dict[str, tuple[list[int], list[int]]] = {}
    for run, pts in seen.items():
        pts.sort()
        times, tops, top = [], [], 0
        for t, tok in pts:
            top = max(top, tok)
            times.append(t)
            tops.append(top)
        out[run] = (times, tops)
    return out


def _top_before(timeline: dict[str, tuple[list[int], list[int]]], run: str, t: int) -> int:
    """The highest token some operation completed before ``t`` had observed."""
    if run not in timeline:
        return 0
    times, tops = timeline[run]
    i = bisect.bisect_left(times, t)
    return tops[i - 1] if i else 0


def check_snapshots(
    ledger_ops: list[Op], snap_ops: list[Op]
) -> tuple[list[Violation], SnapshotStats]:
    """See the module docstring. A deleted run's tombstone makes the next
    acquisition continue above its last token, so a delete counts as moving
    the token past it."""
    timeline = _token_timeline(ledger_ops)
    stats = SnapshotStats()
    stale: dict[str, Op] = {}  # sid -> the stale write the server accepted
    bad: list[Violation] = []
    for op in snap_ops:
        if op.f == "read_snapshot" and op.ok:
            stats.reads += 1
        if op.f not in WRITES or op.st == "unknown":
            continue
        stats.writes += 1
        token = op.a["token"]
        above = _top_before(timeline, op.run, op.inv)
        if op.ok:
            stats.accepted += 1
            if above > token:
                stats.stale_accepted += 1
                stats.by_run[op.run] = stats.by_run.get(op.run, 0) + 1
                stale[op.a["sid"]] = op
        elif op.code == "RUN_LEASE_LOST":
            stats.refused += 1
            stats.refused_stale += above > token
    read_back: dict[str, Op] = {}
    for op in snap_ops:
        if op.f == "read_snapshot" and op.ok and op.x.get("sid") in stale:
            read_back.setdefault(op.x["sid"], op)
    stats.stale_read = len(read_back)
    for sid, op in stale.items():
        seen = read_back.get(sid)
        bad.append(_v(
            "stale-snapshot",
            f"{op.run}: the snapshot {sid} of handle ({op.a['owner']}, token {op.a['token']}) "
            f"was accepted after the run's token had moved to "
            f"{_top_before(timeline, op.run, op.inv)}"
            + (f"; a reader got it back ({seen.id})" if seen is not None else ""),
            op, *([seen] if seen is not None else []),
        ))
    return bad, stats
