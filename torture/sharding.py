"""One history across shard moves: what the mode with coordinators leading
shards apart (``--lead-shards``) adds to the checkers, in place of the
single leader's epoch checks of torture/failover.py.

The coordinators' timeline (``cluster.jsonl``, torture/coordinators.py)
says which process ran in which slot when, which shards each admitted
("leading shards"), the leases each take extended and the revision of the
first (logged as committed: "shards [..] taken"), which it gave up, handed
over or lost, and when each shard row's epoch moved and to whom (a watcher
polls the rows). With it:

* **Lease extensions.** A take extends leases (SPEC §13) in writes no
  client made: revisions ``first .. first + leases - 1`` of the line. They
  go to the linearizability search as ``extend`` operations, within the
  window the take happened in (after the last poll that still showed the
  shard's older epoch, before the harness read the line); a revision there
  that is not a lease extension of a run in the shards taken is a
  ``shard-epochs`` violation. A take whose line never came (its process
  was killed, or its load failed, after the extension committed) is found
  by its revision block (each take starts one, SPEC §13): lease
  extensions at the start of a block no line named, each of a run in a
  shard such a take took, between that take and the shard's next move.
* **shard-epochs** (``check_shard_epochs``): no coordinator answered a
  request about a run sent after that run's shard row showed the shard
  taken under a newer epoch by another coordinator (unless it took the
  shard back before answering): a coordinator whose shard moved away
  commits and serves nothing there. An answer is tied to its process as in
  failover.py; a call that spans a restart in its slot is not judged.
* **exits** (``check_exits``): a coordinator exits only when the nemesis
  SIGKILLed it (-9), when it was sent SIGTERM (0: it handed its shards
  over; -15 just after a start, before its handlers were set), at the final
  stop, or with 1 (cannot reach the database) while PostgreSQL was down.
* **shard-faults** (``check_struck``): a coordinator whose clock was jumped
  more than ``CLOCK_SLACK_MS`` past ``--max-clock-skew`` gives up every
  shard it held (another process takes each) within ``GIVE_UP_BOUND_S`` and
  takes none afterwards while it runs (its clock never comes back); one
  whose database sessions, its shard renewals included, were stalled past
  the shard lease finds every shard it held taken (a new epoch) within
  ``GIVE_UP_BOUND_S`` of the stall's end. That nothing it committed or
  answered came after the take is what shard-epochs, history and the
  checkers of what clients saw hold already.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from fencepost_server.core.shards import shard_of

from .checkers import Violation, _v
from .failover import PG_START_GRACE_S, Proc, Timeline, _is_extension
from .history import EXTEND, Op

# The skew check runs every round (--leader-renew, 400 ms here) and a row runs
# out within the shard lease (2 s); the rest is a round that waits on a lock
# or a PostgreSQL restart, on a loaded machine: the leader mode's bound.
GIVE_UP_BOUND_S = 10.0
# a round already past its skew check when the clock jumped may still take
ROUND_BOUND_S = 5.0


class ShardTimeline:
    """The processes (failover.Timeline) plus the shard lines and epoch moves."""

    def __init__(self, events: list[dict[str, Any]], shards: int) -> None:
        self.shards = shards
        self.tl = Timeline.of(events)
        self.lines = [e for e in events if e["kind"] == "line"]
        self.moves: dict[int, list[dict[str, Any]]] = defaultdict(list)  # shard -> epoch moves
        for e in events:
            if e["kind"] == "shard":
                self.moves[e["shard"]].append(e)
        for lst in self.moves.values():
            lst.sort(key=lambda e: e["seen"])
        self._seen = {s: [e["seen"] for e in lst] for s, lst in self.moves.items()}

    @classmethod
    def load(cls, path: Path, shards: int) -> ShardTimeline:
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return cls(events, shards)

    def of(self, what: str) -> list[dict[str, Any]]:
        return [e for e in self.lines if e["what"] == what]

    def shown_before(self, shard: int, t: int) -> dict[str, Any] | None:
        """The shard's last epoch move the watcher had seen by ``t``."""
        i = bisect.bisect_left(self._seen.get(shard, []), t) - 1
        return self.moves[shard][i] if i >= 0 else None


# -- lease extensions ------------------------------------------------------------------


def extensions(st: ShardTimeline, snap: Any) -> tuple[list[Op], list[Violation]]:
    """The takes' lease extensions as ``extend`` operations, and a violation
    for every revision a take names that is not one."""
    by_rev = snap.by_revision()
    prev_of = snap.previous()
    ops: list[Op] = []
    bad: list[Violation] = []
    for e in st.of("extended-shards"):  # as committed (a take may never lead them)
        if not e["leases"]:
            continue
        taken = set(e["shards"])
        proc = st.tl.find(e["slot"], e["pid"], e["t"])
        inv = proc.spawn if proc is not None else 0
        for s in taken:  # after the last poll that still showed the epoch before the take
            for m in st.moves.get(s, []):  # (sent before the take committed: seen may be later)
                if m["pid"] == e["pid"] and m["before"] <= e["t"]:
                    inv = max(inv, int(m["before"]))
        for rev in range(e["first"], e["first"] + e["leases"]):
            c = by_rev.get(rev)
            p = prev_of.get(rev)
            if (c is None or c.kind != 1 or p is None or shard_of(c.run_id, st.shards) not in taken
                    or not _is_extension(p.rec, c.rec, None)):
                what = "nothing" if c is None else f"a {'write' if c.kind == 1 else 'delete'} " \
                    f"of {c.run_id}"
                bad.append(Violation(
                    "shard-epochs",
                    f"revision {rev} ({what}) is one coordinator {e['slot']} (pid {e['pid']}) "
                    f"named as a lease extension of its take of shards {sorted(taken)}, but is "
                    "not one"))
                continue
            ops.append(Op(
                id=f"take{e['slot']}.{e['pid']}:{rev}", client=f"coordinator-{e['slot']}",
                run=c.run_id, f=EXTEND, inv=inv, cmp=e["t"], st="ok", rec=c.rec,
                a={"shards": sorted(taken), "by_ms": None, "pre": p.rec}, ep=e["slot"],
            ))
    more, worse = _unlogged(st, snap)
    return ops + more, bad + worse


BLOCK_BITS = 24  # a block of revisions (storage/shared.py)


def _unlogged(st: ShardTimeline, snap: Any) -> tuple[list[Op], list[Violation]]:
    """The extensions of takes whose "taken" line never came (see the module
    docstring), as ``extend`` operations between the take (the last poll
    that still showed the shard's older epoch) and the shard's next move."""
    named = {e["first"] >> BLOCK_BITS for e in st.of("extended-shards") if e["leases"]}
    prev_of = snap.previous()
    # takes not followed by their "taken" line from the same process
    logged = [(e["pid"], set(e["shards"]), e["t"]) for e in st.of("extended-shards")]
    unlogged: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in st.of("took"):
        for s in e["shards"]:
            if not any(pid == e["pid"] and s in shards and t >= e["t"]
                       for pid, shards, t in logged):
                unlogged[s].append(e)
    ops: list[Op] = []
    bad: list[Violation] = []
    block, expect = -1, 0
    for c in snap.changes:  # in revision order
        b, offset = c.revision >> BLOCK_BITS, c.revision & ((1 << BLOCK_BITS) - 1)
        if b != block:
            block, expect = b, 1
        if b in named or offset != expect:
            continue
        p = prev_of.get(c.revision)
        if c.kind != 1 or p is None or not _is_extension(p.rec, c.rec, None):
            expect = 0  # the block's extensions, if any, end here
            continue
        expect += 1
        shard = shard_of(c.run_id, st.shards)
        windows = []
        for e in unlogged.get(shard, []):
            proc = st.tl.find(e["slot"], e["pid"], e["t"])
            inv = proc.spawn if proc is not None else 0
            cmp = st.tl.end
            for m in st.moves.get(shard, []):
                if m["pid"] == e["pid"] and m["before"] <= e["t"]:
                    inv = max(inv, int(m["before"]))
                elif m["seen"] > e["t"]:
                    cmp = min(cmp, int(m["seen"]))
            windows.append((inv, cmp, e))
        if not windows:
            bad.append(Violation(
                "shard-epochs", f"revision {c.revision} (a lease extension of {c.run_id}, "
                f"shard {shard}) starts a revision block no take named, and no take of "
                "that shard went without its line"))
            continue
        inv, cmp = min(w[0] for w in windows), max(w[1] for w in windows)
        e = windows[-1][2]
        ops.append(Op(
            id=f"take{e['slot']}.{e['pid']}:{c.revision}", client=f"coordinator-{e['slot']}",
            run=c.run_id, f=EXTEND, inv=inv, cmp=cmp, st="ok", rec=c.rec,
            a={"shards": [shard], "by_ms": None, "pre": p.rec, "unlogged": True},
            ep=e["slot"],
        ))
    return ops, bad


# -- answers after a shard moved away ---------------------------------------------------


def check_shard_epochs(ops: list[Op], st: ShardTimeline) -> tuple[list[Violation],
                                                                    dict[str, int]]:
    bad: list[Violation] = []
    stats = {"attributed": 0, "unattributed": 0}
    for o in ops:
        if not o.ok or o.f == EXTEND or o.run == "*":
            continue
        procs = st.tl.answered_by(o)
        if len(procs) != 1:
            stats["unattributed"] += 1
            continue
        stats["attributed"] += 1
        p = procs[0]
        shard = shard_of(o.run, st.shards)
        sent = o.at or o.inv
        shown = st.shown_before(shard, sent)
        if shown is None or shown["pid"] == p.pid:
            continue
        assert o.cmp is not None
        if any(m["pid"] == p.pid and m["before"] < o.cmp for m in st.moves[shard]
               if m["seen"] >= shown["seen"]):
            continue  # it took the shard back while the call was out
        bad.append(_v("shard-epochs", f"coordinator {p.slot} (pid {p.pid}) answered {o.f} of "
                      f"{o.run} (shard {shard}) sent {(sent - shown['seen']) / 1e6:.0f} ms after "
                      f"the shard row showed epoch {shown['epoch']} taken by pid "
                      f"{shown['pid']}: a coordinator served a shard that had moved away", o))
    return bad, stats


# -- exits ---------------------------------------------------------------------------------


def check_exits(faults: list[dict[str, Any]], st: ShardTimeline) -> list[Violation]:
    tl = st.tl

    def proc(f: dict[str, Any]) -> Proc | None:
        return tl.find(f["slot"], f["pid"], int(f.get("killed") or f.get("at") or f["t"]))

    killed = {id(p) for f in faults if f["kind"] == "kill" if (p := proc(f)) is not None}
    termed = {id(p) for f in faults if f["kind"] in ("term", "clock-restart")
              if (p := proc(f)) is not None}
    final = next((f["t"] for f in faults if f["kind"] == "stop-all"), tl.end)
    pg = [(f["t"], f.get("up") or f["t"]) for f in faults if f["kind"] in ("pg-kill",
                                                                          "pg-restart")]
    grace = int(PG_START_GRACE_S * 1e9)
    bad: list[Violation] = []
    for p in tl.procs:
        if p.exit is None:
            continue
        if p.code == -9 and id(p) in killed:
            continue
        if p.code in (0, -15) and (id(p) in termed or p.exit >= final):
            continue
        if p.exit >= final and p.code == -9:
            continue  # the final stop's SIGKILL of one that hung: see its log
        if p.code == 1 and any(t0 <= p.exit <= up + grace for t0, up in pg):
            continue
        bad.append(Violation("exits", f"coordinator {p.slot} (pid {p.pid}) exited with code "
                             f"{p.code} (expected only the nemesis's SIGKILL, 0 after SIGTERM, "
                             "or 1 while PostgreSQL was down)"))
    for f in faults:
        if f["kind"] == "term" and f.get("exit") not in (0, -15):
            bad.append(Violation("exits", f"coordinator {f['slot']} (pid {f['pid']}) exited "
                                 f"{f.get('exit')} after SIGTERM, not 0 (a planned hand-over)"))
    for f in faults:
        if f["kind"] == "kill" and f.get("up") is None:
            bad.append(Violation("exits", f"the shards of coordinator {f['slot']} (pid "
                                 f"{f['pid']}, SIGKILLed) were not all held by live "
                                 "coordinators within 30 s"))
    return bad


# -- clock jumps and stalled sessions ----------------------------------------------------


def check_struck(faults: list[dict[str, Any]], st: ShardTimeline, *, skew_ms: int,
                 clock_slack_ms: int) -> list[Violation]:
    """See ``shard-faults`` in the module docstring."""
    bad: list[Violation] = []
    final = next((f["t"] for f in faults if f["kind"] == "stop-all"), st.tl.end)
    bound = int(GIVE_UP_BOUND_S * 1e9)
    unstalled = {tuple(f["backends"]): f["t"] for f in faults if f["kind"] == "pg-unstall"}

    def moved(shard: int, since: int, until: int, away_from: int) -> bool:
        """The shard's epoch moved (to a process other than ``away_from``)
        within (since, until], as the watcher saw it."""
        return any(since < m["seen"] <= until and m["pid"] != away_from
                   for m in st.moves.get(shard, []))

    for f in faults:
        if f["kind"] == "clock" and skew_ms and f["offset"] > skew_ms + clock_slack_ms:
            at = int(f["at"])
            p = st.tl.find(f["slot"], f["pid"], at)
            what = (f"coordinator {f['slot']} (pid {f['pid']}), its clock {f['offset']} ms "
                    f"ahead (--max-clock-skew {skew_ms} ms),")
            if final >= at + bound:
                for s in f.get("held", []):
                    if not moved(s, at, at + bound, f["pid"]):
                        bad.append(Violation("shard-faults", f"{what} still held shard {s} "
                                             f"{GIVE_UP_BOUND_S:.0f} s later"))
            gone = p.exit if p is not None and p.exit is not None else final
            late = at + int(ROUND_BOUND_S * 1e9)
            for s, lst in st.moves.items():
                for m in lst:
                    if m["pid"] == f["pid"] and late < m["before"] < gone:
                        bad.append(Violation("shard-faults", f"{what} took shard {s} (epoch "
                                             f"{m['epoch']}) "
                                             f"{(m['before'] - at) / 1e9:.1f} s after the jump"))
        elif f["kind"] == "pg-stall" and f.get("renewals"):
            end = unstalled.get(tuple(f["backends"]), final)
            if final < end + bound:
                continue  # the run ended first
            for s in f.get("held", []):
                if not moved(s, int(f["at"]), end + bound, 0):
                    bad.append(Violation(
                        "shard-faults", f"coordinator {f['slot']} (pid {f['pid']}) had its "
                        f"database sessions stalled for {f['seconds']:.1f} s (past the shard "
                        f"lease), but shard {s} was not taken within "
                        f"{GIVE_UP_BOUND_S:.0f} s of the stall's end"))
    return bad


def summary(st: ShardTimeline, faults: list[dict[str, Any]], skew_ms: int = 0,
            clock_slack_ms: int = 0) -> dict[str, Any]:
    """Figures for the report."""
    tl = st.tl
    exits: dict[str, int] = defaultdict(int)
    for p in tl.procs:
        if p.code is not None:
            exits[str(p.code)] += 1
    settle = sorted((f["up"] - f["killed"]) / 1e9 for f in faults
                    if f["kind"] == "kill" and f.get("up"))
    clocks = [f for f in faults if f["kind"] == "clock"] if skew_ms else []

    def shards_in(what: str) -> int:
        return sum(len(e["shards"]) for e in st.of(what))

    return {
        "coordinator_starts": len(tl.procs),
        "exits_by_code": dict(sorted(exits.items())),
        "shard_epochs": sum(len(v) for v in st.moves.values()),
        "shards_taken": shards_in("leading-shards"),
        "shards_handed_over": shards_in("handed-over"),
        "shards_given_up": shards_in("gave-up"),
        "shards_lost": shards_in("lost-shards"),
        "leases_extended": sum(e["leases"] for e in st.of("extended-shards")),
        # the clock jumps by where they left the coordinator's clock, and the
        # stalls that caught its shard renewals too
        "clock_past_bound": sum(1 for f in clocks if f["offset"] > skew_ms + clock_slack_ms),
        "clock_within_bound": sum(1 for f in clocks if f["offset"] <= skew_ms),
        "pg_stalls_with_renewals": sum(1 for f in faults
                                       if f["kind"] == "pg-stall" and f.get("renewals")),
        "kill_to_settled_s": {
            "n": len(settle),
            "median": round(settle[len(settle) // 2], 2) if settle else None,
            "max": round(settle[-1], 2) if settle else None,
        },
    }
