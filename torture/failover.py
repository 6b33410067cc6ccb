"""One history across failovers: what the PostgreSQL mode adds to the checkers.

The coordinators' timeline (``cluster.jsonl``, torture/coordinators.py) says
which process ran in which slot when, which epoch each took over, the
revision it loaded and how many leases its takeover extended, and when the
leader row's epoch moved (a watcher polls it). With it:

* **Lease extensions.** A new leader extends every lease that was live when
  the coordinator became unavailable by the time it was unavailable
  (``core.ledger.ExtendLeases``): one write per such run that no client made,
  at the revisions right above the one the new leader loaded. They are read
  from the committed history and given to the linearizability search as
  ``extend`` operations (torture/linearizability.py), each from exactly the
  record before it to exactly the record after it, within the window the
  takeover happened in: after the last poll of the leader row that still
  showed an older epoch was sent, before the harness read the line the new
  leader logs once the extension is committed.
* **epochs** (``check_epochs``): no batch was committed by a deposed leader.
  (1) The revisions between what a new leader loaded and its first own batch
  are its lease extensions and nothing else: a batch of the old leader
  committed after the takeover loaded would sit there; and every change
  above what a leader loaded began after its takeover (``check_tenures``:
  the database's clock at the takeover against the change's committed_at). (2) Every write a
  coordinator acknowledged has a revision at or below the one the next
  leader loaded: it was committed before the takeover. (3) No coordinator
  answered a request sent after the leader row showed a newer epoch than its
  own, and none that never took over answered anything. An answer is tied to
  the process that gave it by the coordinator address it came from and the
  processes that ran there while the call was out; a call that spans a
  restart in that slot is not judged.
* **deposed** (``check_deposed``): a leader SIGSTOPped for longer than the
  leader lease exits with code 3 soon after SIGCONT, and so does one whose
  database sessions stalled mid-batch, its renewals included (it can renew
  no more); a leader whose clock was
  jumped past ``--max-clock-skew`` steps down (exits 3); every SIGKILL of the
  leader is followed by a takeover; no coordinator exits in any other way
  (other than exit 1 — refusing to start — while PostgreSQL is down).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkers import Violation, _effect_revision, _v
from .history import EXTEND, Op

DEPOSED_BOUND_S = 10.0  # after SIGCONT (or a clock jump), a deposed leader exits within this
TAKEOVER_BOUND_S = 30.0  # the nemesis waits this long for a new leader after a kill
TENURE_MARGIN_MS = 10  # the watcher's clock reading may run that much after the takeover
PG_START_GRACE_S = 15.0  # exit 1 (cannot reach the database) allowed this long after a PG fault


@dataclass
class Proc:
    """One coordinator process."""

    slot: int
    pid: int
    spawn: int
    exit: int | None = None  # when the supervisor saw it exit
    code: int | None = None
    epoch: int | None = None  # the epoch it took over (its "taking over" line)


@dataclass
class Epoch:
    n: int
    pid: int = 0
    slot: int = -1
    loaded: int | None = None  # the revision it loaded ("taking over" line)
    taking_t: int | None = None
    extended: int | None = None  # ledger leases its takeover extended
    gap: int | None = None  # by how many ms
    extended_t: int | None = None  # when the harness read the "extended" line
    leading_t: int | None = None  # when the harness read the "leading" line (it serves)
    proc: Proc | None = None  # the process that took it over


@dataclass
class Timeline:
    # every process, in spawn order (pids are reused over a long run: a
    # process is its slot and pid at a time, see ``find``)
    procs: list[Proc] = field(default_factory=list)
    by_slot: dict[int, list[Proc]] = field(default_factory=lambda: defaultdict(list))
    epochs: dict[int, Epoch] = field(default_factory=dict)
    watched: list[dict[str, Any]] = field(default_factory=list)  # the watcher's epoch moves
    end: int = 0  # the last event

    @classmethod
    def load(cls, path: Path) -> Timeline:
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return cls.of(events)

    @classmethod
    def of(cls, events: list[dict[str, Any]]) -> Timeline:
        tl = cls()
        for e in events:
            tl.end = max(tl.end, int(e.get("t", 0)))
            kind = e["kind"]
            if kind == "spawn":
                p = Proc(e["slot"], e["pid"], e["t"])
                tl.procs.append(p)
                tl.by_slot[p.slot].append(p)
            elif kind == "exit" and (p := tl.find(e["slot"], e["pid"], e["t"])) is not None:
                p.exit, p.code = e["t"], e["code"]
            elif kind == "epoch":
                tl.watched.append(e)
            elif kind == "line":
                what = e["what"]
                if what not in ("taking", "extended", "leading"):
                    continue
                ep = tl.epochs.setdefault(e["epoch"], Epoch(e["epoch"]))
                ep.pid, ep.slot = e["pid"], e["slot"]
                ep.proc = tl.find(e["slot"], e["pid"], e["t"])
                if what == "taking":
                    ep.loaded, ep.taking_t = e["loaded"], e["t"]
                    if ep.proc is not None:
                        ep.proc.epoch = e["epoch"]
                elif what == "extended":
                    ep.extended, ep.gap, ep.extended_t = e["leases"], e["gap"], e["t"]
                else:
                    ep.leading_t = e["t"]
        tl.watched.sort(key=lambda w: w["seen"])
        return tl

    # -- queries ------------------------------------------------------------------------

    def find(self, slot: int, pid: int, t: int) -> Proc | None:
        """The process with this slot and pid that was spawned last before ``t``."""
        found = None
        for p in self.by_slot.get(slot, []):
            if p.pid == pid and p.spawn <= t:
                found = p
        return found

    def after(self, n: int) -> Epoch | None:
        """The first epoch above ``n`` whose leader loaded the state."""
        later = [e for k, e in self.epochs.items() if k > n and e.loaded is not None]
        return min(later, key=lambda e: e.n) if later else None

    def before(self, n: int) -> int:
        """A time before epoch ``n``'s takeover committed: the send time of the
        last poll that still showed an older epoch, or the spawn of the
        process that took it over (the later of the two)."""
        low = 0
        for w in self.watched:
            if w["epoch"] >= n:
                low = int(w["before"])
                break
        ep = self.epochs.get(n)
        if ep is not None and ep.proc is not None:
            low = max(low, ep.proc.spawn)
        return low

    def before_db(self, n: int) -> int:
        """The database's clock (ms) as the last poll that still showed an
        epoch below ``n`` ran: at or before epoch ``n``'s takeover (0: unknown)."""
        for w in self.watched:
            if w["epoch"] >= n:
                return int(w.get("before_db") or 0)
        return 0

    def visible(self, n: int) -> int | None:
        """When the watcher first saw an epoch of at least ``n`` (None: never)."""
        for w in self.watched:
            if w["epoch"] >= n:
                return int(w["seen"])
        return None

    def answered_by(self, op: Op) -> list[Proc]:
        """The processes that ran in the slot ``op``'s final answer came from
        while that attempt was out."""
        start, end = op.at or op.inv, op.cmp
        if end is None:
            return []
        return [p for p in self.by_slot.get(op.ep, [])
                if p.spawn <= end and (p.exit is None or p.exit >= start)]

    @property
    def failovers(self) -> int:
        """Changes of leader: epochs that served, less the first."""
        return max(0, sum(1 for e in self.epochs.values() if e.leading_t is not None) - 1)


# -- clocks ----------------------------------------------------------------------------


def clock_ahead(tl: Timeline, faults: list[dict[str, Any]]) -> Callable[[Op, bool], int]:
    """For the renewals check: how far ahead of the true time (ms) the clock of
    the coordinator process that answered ``op`` ran — by every jump begun
    before the answer (``True``: the most it can have been), or every jump
    done before the invocation (the least); 0 when the answer is not tied to
    one process. A process starts on the true clock; its jumps add up."""
    jumps: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for f in faults:
        if f["kind"] == "clock":
            jumps[(f["slot"], f["pid"])].append((int(f["t"]), int(f["at"]), int(f["offset"])))

    def ahead(op: Op, most: bool) -> int:
        procs = tl.answered_by(op)
        if len(procs) != 1:
            return 0
        p = procs[0]
        until = op.cmp if most else (op.at or op.inv)
        assert until is not None
        return max((off for begun, done, off in jumps.get((p.slot, p.pid), ())
                    if p.spawn <= begun and (begun if most else done) <= until), default=0)

    return ahead


# -- lease extensions ------------------------------------------------------------------


def _is_extension(prev: dict[str, Any] | None, rec: dict[str, Any] | None,
                  gap: int | None) -> bool:
    """``rec`` is ``prev`` with its lease's expiry pushed later (by at least
    ``gap`` ms when known: the restart rule may have renewed it at the load
    first, docs/SPEC.md §4) and nothing else changed but the version (+1),
    revision and updated_at."""
    if prev is None or rec is None or not prev.get("lease") or not rec.get("lease"):
        return False
    skip = ("version", "revision", "updated_at", "lease")
    if {k: v for k, v in prev.items() if k not in skip} != \
            {k: v for k, v in rec.items() if k not in skip}:
        return False
    (o0, a0, e0, t0, d0), (o1, a1, e1, t1, d1) = prev["lease"], rec["lease"]
    if (o0, a0, t0, d0) != (o1, a1, t1, d1) or e1 <= e0:
        return False
    return rec["version"] == prev["version"] + 1 and (gap is None or e1 >= e0 + gap)


def extensions(tl: Timeline, snap: Any) -> tuple[list[Op], list[Violation]]:
    """The takeovers' lease extensions as ``extend`` operations, and a
    violation for every revision in a takeover's extension block that is not
    one (check 1 of ``check_epochs``)."""
    by_rev = snap.by_revision()
    prev_of = snap.previous()
    top = snap.changes[-1].revision if snap.changes else 0
    ops: list[Op] = []
    bad: list[Violation] = []
    for n, ep in sorted(tl.epochs.items()):
        if ep.loaded is None:
            continue
        nxt = tl.after(n)
        if ep.extended is not None:  # committed and logged: exactly these revisions
            block = range(ep.loaded + 1, ep.loaded + ep.extended + 1)
            upto = ep.extended_t
            gap: int | None = ep.gap
        elif ep.leading_t is not None:  # served without extending (nothing was live)
            continue
        else:  # the takeover failed (maybe mid-extension): up to what the next leader loaded
            end = nxt.loaded if nxt is not None and nxt.loaded is not None else top
            block = range(ep.loaded + 1, end + 1)
            upto = nxt.taking_t if nxt is not None else tl.end
            gap = None
        for rev in block:
            c = by_rev.get(rev)
            p = prev_of.get(rev)
            if c is None or c.kind != 1 or p is None or not _is_extension(p.rec, c.rec, gap):
                what = "nothing" if c is None else f"{'a delete' if c.kind != 1 else 'a write'}" \
                    f" of {c.run_id}"
                bad.append(Violation(
                    "epochs",
                    f"revision {rev} ({what}) lies between what epoch {n}'s leader loaded "
                    f"(revision {ep.loaded}) and its first own batch, but is not a lease "
                    "extension of its takeover: a batch a deposed leader committed after "
                    "the takeover had loaded"))
                continue
            ops.append(Op(
                id=f"epoch{n}:{rev}", client=f"coordinator-{ep.slot}", run=c.run_id, f=EXTEND,
                inv=tl.before(n), cmp=upto or tl.end, st="ok", rec=c.rec,
                a={"epoch": n, "by_ms": gap, "pre": p.rec}, ep=ep.slot,
            ))
    return ops, bad


def check_tenures(tl: Timeline, snap: Any) -> list[Violation]:
    """Check 1b: every change above the revision an epoch's leader loaded (and
    at or below what the next one loaded) is that leader's, so its batch
    began after the takeover: its ``committed_at`` (the coordinator's clock
    when the batch began, never behind the database's on one machine: the
    test clock only jumps ahead) is not before the database's clock at the
    last poll that still showed an older epoch. A batch of a deposed leader
    began before it stopped leading, which is before its row expired: at
    least the leader lease's margin before the takeover."""
    loads = sorted((e.loaded, e.n) for e in tl.epochs.values() if e.loaded is not None)
    bad: list[Violation] = []
    for c in snap.changes:
        tenure = None
        for loaded, n in loads:
            if loaded < c.revision:
                tenure = n
            else:
                break
        if tenure is None:
            continue
        low = tl.before_db(tenure)
        if low and c.committed_at < low - TENURE_MARGIN_MS:
            bad.append(Violation(
                "epochs",
                f"revision {c.revision} ({c.run_id}) sits above revision "
                f"{tl.epochs[tenure].loaded} that epoch {tenure}'s leader loaded, but its batch "
                f"began {low - c.committed_at} ms before that takeover: a batch a deposed "
                "leader committed after the takeover"))
    return bad


# -- epochs ----------------------------------------------------------------------------


def check_epochs(ops: list[Op], tl: Timeline) -> tuple[list[Violation], dict[str, int]]:
    """Checks 2 and 3 of the module docstring (check 1 is ``extensions``).
    Also returns how many answers were tied to a process, and how many not."""
    bad: list[Violation] = []
    stats = {"attributed": 0, "unattributed": 0}
    for o in ops:
        if not o.ok or o.f == EXTEND:
            continue
        procs = tl.answered_by(o)
        if len(procs) != 1:
            stats["unattributed"] += 1
            continue
        stats["attributed"] += 1
        p = procs[0]
        if p.epoch is None:
            bad.append(_v("epochs", f"coordinator {p.slot} (pid {p.pid}) answered, but it "
                          "never took over: a standby served", o))
            continue
        rev = _effect_revision(o)
        nxt = tl.after(p.epoch)
        if rev is not None and nxt is not None and nxt.loaded is not None and rev > nxt.loaded:
            bad.append(_v("epochs", f"coordinator {p.slot} (pid {p.pid}, epoch {p.epoch}) "
                          f"acknowledged a write at revision {rev}, above revision "
                          f"{nxt.loaded} that epoch {nxt.n}'s leader loaded when it took over: "
                          "a deposed leader committed", o))
            continue
        newer = tl.visible(p.epoch + 1)
        sent = o.at or o.inv
        if newer is not None and sent > newer:
            bad.append(_v("epochs", f"coordinator {p.slot} (pid {p.pid}, epoch {p.epoch}) "
                          f"answered a request sent {(sent - newer) / 1e6:.0f} ms after the "
                          "leader row showed a newer epoch: a deposed leader served", o))
    return bad, stats


# -- deposed leaders and exits -------------------------------------------------------------


def check_deposed(faults: list[dict[str, Any]], tl: Timeline, *, skew_ms: int,
                  clock_slack_ms: int) -> list[Violation]:
    bad: list[Violation] = []

    def struck(f: dict[str, Any]) -> int:
        # when the fault struck (``killed``, ``at``): after it began (``t``) when
        # the nemesis first waited for a leader and a restarted coordinator took over
        return int(f.get("killed") or f.get("at") or f["t"])

    def proc(f: dict[str, Any]) -> Proc | None:
        """The process the fault struck: the one alive when it struck."""
        return tl.find(f["slot"], f["pid"], struck(f))

    killed = {id(p) for f in faults if f["kind"] == "kill" if (p := proc(f)) is not None}
    conts = {id(p): f["t"] for f in faults if f["kind"] == "cont" if (p := proc(f)) is not None}
    final = next((f["t"] for f in faults if f["kind"] == "stop-all"), tl.end)
    bound = int(DEPOSED_BOUND_S * 1e9)

    def must_exit_3(p: Proc | None, since: int, what: str) -> None:
        if p is None or id(p) in killed:
            return  # SIGKILLed by the nemesis first: nothing to expect
        if p.exit is not None and p.code == 3 and p.exit <= since + bound:
            return
        if p.exit is None or p.exit > final:
            if final < since + bound:
                return  # the run ended first
            bad.append(Violation("deposed", f"coordinator {p.slot} (pid {p.pid}) {what}, but "
                                 f"did not exit 3 within {DEPOSED_BOUND_S:.0f} s"))
        elif p.code != 3 or p.exit > since + bound:
            bad.append(Violation("deposed", f"coordinator {p.slot} (pid {p.pid}) {what}, then "
                                 f"exited with code {p.code} after "
                                 f"{(p.exit - since) / 1e9:.1f} s (expected 3 within "
                                 f"{DEPOSED_BOUND_S:.0f} s)"))

    for f in faults:
        if f["kind"] == "stop":
            p = proc(f)
            cont = conts.get(id(p)) if p is not None else None
            if cont is not None:
                must_exit_3(p, cont, f"was SIGSTOPped for {f['seconds']:.1f} s as leader "
                            "(longer than the leader lease)")
        elif f["kind"] == "pg-stall" and f.get("renewals", True):
            must_exit_3(proc(f), struck(f),
                        f"had its database sessions stalled mid-batch for "
                        f"{f['seconds']:.1f} s as leader")
        elif f["kind"] == "clock" and skew_ms and f["offset"] > skew_ms + clock_slack_ms:
            must_exit_3(proc(f), struck(f),
                        f"led with its clock {f['offset']} ms ahead "
                        f"(--max-clock-skew {skew_ms} ms)")
        elif f["kind"] == "kill" and f.get("up") is None:
            bad.append(Violation("deposed", f"no coordinator took over within "
                                 f"{TAKEOVER_BOUND_S:.0f} s of the leader's SIGKILL "
                                 f"(pid {f['pid']})"))
    pg = [(f["t"], f.get("up") or f["t"]) for f in faults if f["kind"] in ("pg-kill",
                                                                          "pg-restart")]
    grace = int(PG_START_GRACE_S * 1e9)
    for p in tl.procs:
        if p.exit is None or p.code == 3:
            continue
        if p.code == -9 and id(p) in killed:
            continue
        if p.exit >= final and p.code in (0, -9, -15):
            continue  # the final stop (SIGTERM; SIGKILL if it hung: see its log)
        if p.code == 1 and any(t0 <= p.exit <= up + grace for t0, up in pg):
            continue  # could not reach the database while it was down
        bad.append(Violation("deposed", f"coordinator {p.slot} (pid {p.pid}) exited with "
                             f"code {p.code} (expected 3 when deposed, or the nemesis's "
                             "SIGKILL)"))
    return bad


def summary(tl: Timeline, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures for the report."""
    exits: dict[str, int] = defaultdict(int)
    for p in tl.procs:
        if p.code is not None:
            exits[str(p.code)] += 1
    takeovers = sorted((f["up"] - f["killed"]) / 1e9 for f in faults
                       if f["kind"] == "kill" and f.get("up"))
    return {
        "coordinator_starts": len(tl.procs),
        "epochs": len(tl.epochs),
        "failovers": tl.failovers,
        "exits_by_code": dict(sorted(exits.items())),
        "leases_extended": sum(e.extended or 0 for e in tl.epochs.values()),
        "kill_to_serving_s": {
            "n": len(takeovers),
            "median": round(takeovers[len(takeovers) // 2], 2) if takeovers else None,
            "max": round(takeovers[-1], 2) if takeovers else None,
        },
    }
