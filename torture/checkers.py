"""Checkers over a recorded history. Each returns a list of ``Violation``s, each
naming the operations involved; an empty list means the guarantee held.

=====================  ==============================================================
check                  what it proves (docs/SPEC.md §9 and friends)
=====================  ==============================================================
linearizability        each run's record behaves as one atomic versioned register with
                       compare-and-set (linearizability.py)
fencing                at its linearization point, every accepted fenced write carried
                       the run's current token and lease owner, on a RUNNING record
handles                no handle completed a write invoked after the run's fence had
                       visibly moved to another handle (real time; no search needed)
durability-restart     after every SIGKILL (or clean stop) + restart, every write
                       acknowledged before it is visible (probe reads before any
                       worker reconnects)
clean-stop             one server: every clean stop (SIGTERM) exits 0 (runner.py)
index-restart          after every restart, ListRuns of each status lists exactly the
                       runs GetRun finds in it (runner.py: index_problems)
durability-final       every value any client observed or was acknowledged is in the
                       server's committed history, at its revision, byte for byte
tokens                 tokens never go backwards or repeat (committed history, and every
                       acquisition above every token observed before it, in real time)
liveness               after the nemesis stops, every run is acquired and finished
                       within a bound
history                PRAGMA integrity_check, gap-free revisions, the runs table is the
                       history's last word, versions +1, ledger acquisitions honour the
                       previous lease's expiry (+ lock-delay), no ledger write reopens a
                       terminal run
renewals               a renewal acknowledged until T (+ lock-delay): no acquisition by
                       another owner takes that lease over before T, across kills, pauses,
                       clock jumps and takeovers (renewals are answered from memory, so
                       the history alone does not hold T)
answers                every answer is a valid status and says what was asked
watch                  the SDK's watch by shards, running through every fault and
                       restarted from saved cursors, delivered every committed change
                       exactly once, as committed, in revision order per shard
                       (watching.py)
=====================  ==============================================================
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .history import (
    FENCED,
    RUNNING,
    TERMINAL,
    WRITES,
    Op,
    canon,
    content,
    owner_of,
)
from .linearizability import WRITE, Model, RunResult, check_run, describe

MAX_PER_CHECK = 50  # violations kept per check (the count is exact)


@dataclass
class Violation:
    check: str
    message: str
    ops: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        more = "".join(f"\n      {o}" for o in self.ops)
        return f"[{self.check}] {self.message}{more}"


def _v(check: str, message: str, *ops: Op) -> Violation:
    return Violation(check, message, [o.brief() for o in ops])


def ops_of_run(ops: list[Op], run: str) -> list[Op]:
    return [o for o in ops if o.run == run or o.f == "list"]


def runs_in(ops: list[Op]) -> list[str]:
    runs = {o.run for o in ops if o.run != "*"}
    for o in ops:
        if o.f == "list":
            runs.update(o.x.get("runs", {}))
    return sorted(runs)


# -- linearizability and fencing at the linearization point ---------------------------


def check_linearizability(
    ops: list[Op], runs: list[str] | None = None, budget: int = 2_000_000
) -> tuple[list[Violation], dict[str, RunResult]]:
    results: dict[str, RunResult] = {}
    bad: list[Violation] = []
    for run in runs if runs is not None else runs_in(ops):
        res = check_run(ops_of_run(ops, run), run, budget)
        results[run] = res
        if not res.ok:
            bad.append(Violation("linearizability", res.message))
    return bad, results


def _written(results: dict[str, RunResult]) -> dict[str, set[str]]:
    """Per run, the ids of operations the linearization applied as writes."""
    out: dict[str, set[str]] = {}
    for run, res in results.items():
        if res.ok:
            out[run] = {c.op.id for c, pre, post in res.steps if pre != post}
    return out


def check_fencing(results: dict[str, RunResult]) -> list[Violation]:
    """At its linearization point, an accepted fenced write found the record at
    its handle's token, lease owner and RUNNING; acquisitions moved the token by
    one; no write moved it backwards."""
    bad: list[Violation] = []
    for run, res in results.items():
        if not res.ok:
            continue
        m: Model = res.model
        writer: Op | None = None
        for c, pre, post in res.steps:
            if pre == post:
                continue
            op = c.op
            if c.kind == WRITE and op.f in FENCED:
                a = op.a
                if pre[0] == "A":
                    bad.append(_v("fencing", f"{run}: fenced {op.f} accepted on an absent run",
                                  op))
                else:
                    tok = m.token(pre)
                    status, own = m.shape(pre)
                    if (tok is not None and tok != a["token"]) or own != a["owner"] or (
                        status is not None and status != RUNNING
                    ):
                        wrote = f" (written by {writer.id})" if writer is not None else ""
                        bad.append(_v(
                            "fencing",
                            f"{run}: {op.f} by handle ({a['owner']}, token {a['token']}) was "
                            f"accepted while the record was {describe(m, pre)}{wrote}",
                            op, *([writer] if writer is not None else []),
                        ))
            if pre[0] != "A" and post[0] != "A":
                t0, t1 = m.token(pre), m.token(post)
                if t0 is not None and t1 is not None:
                    if t1 < t0:
                        bad.append(_v("tokens", f"{run}: {op.f} moved the token back "
                                      f"{t0} -> {t1}", op))
                    if c.kind == WRITE and op.f == "acquire" and t1 != t0 + 1:
                        bad.append(_v("tokens", f"{run}: acquire moved the token {t0} -> {t1}",
                                      op))
            writer = op
    return bad


# -- real-time fencing: handles ----------------------------------------------------------


@dataclass
class _Obs:
    inv: int
    cmp: int
    token: int | None  # None: the run was absent
    version: int
    owner: str | None
    op: Op
    val: str = ""


def observations(ops: list[Op]) -> dict[str, list[_Obs]]:
    """Per run, every record value (or absence) an operation saw and when."""
    out: dict[str, list[_Obs]] = defaultdict(list)
    for o in ops:
        if o.cmp is None:
            continue
        recs: list[tuple[str, dict[str, Any] | None]] = []
        if o.f == "list" and o.ok:
            for run, rec in o.x.get("runs", {}).items():
                recs.append((run, rec))
        elif o.rec is not None:
            recs.append((o.run, o.rec))
        elif o.ok and (o.f == "raw_get" or (o.f == "raw_cas" and not o.x.get("swapped"))):
            recs.append((o.run, None))
        elif o.ok and o.f in ("delete_run", "raw_delete"):
            recs.append((o.run, None))
        elif o.st == "fail" and o.code == "RUN_NOT_FOUND":
            recs.append((o.run, None))
        for run, rec in recs:
            if rec is None:
                out[run].append(_Obs(o.inv, o.cmp, None, 0, None, o))
            else:
                out[run].append(_Obs(o.inv, o.cmp, rec["fencing_token"], rec["version"],
                                     owner_of(rec), o, canon(rec)))
    for lst in out.values():
        lst.sort(key=lambda ob: ob.cmp)
    return out


class _Index:
    """One run's observations, indexed for "what had been seen before time t"."""

    def __init__(self, lst: list[_Obs]) -> None:
        self.cmps = [ob.cmp for ob in lst]
        self.top: list[_Obs | None] = []  # prefix: the observation with the highest token
        best: _Obs | None = None
        for ob in lst:
            if ob.token is not None and (best is None or ob.token > (best.token or 0)):
                best = ob
            self.top.append(best)
        # per token, by completion: prefix bests (the highest version seen, and the highest
        # version seen under any other lease owner than that one's)
        self.by_token: dict[int, tuple[list[int], list[tuple[_Obs, _Obs | None]]]] = {}
        self.gone: list[_Obs] = []  # absences, by completion
        self.gone_cmps: list[int] = []
        self.gone_top: list[_Obs] = []  # prefix: the absence invoked last
        self.first_seen: dict[str, int] = {}
        for ob in lst:
            if ob.token is None:
                self.gone.append(ob)
                self.gone_cmps.append(ob.cmp)
                last = self.gone_top[-1] if self.gone_top else ob
                self.gone_top.append(ob if ob.inv >= last.inv else last)
            else:
                cmps, bests = self.by_token.setdefault(ob.token, ([], []))
                b1, b2 = bests[-1] if bests else (ob, None)
                if ob.owner == b1.owner:
                    b1 = ob if ob.version > b1.version else b1
                elif ob.version > b1.version:
                    b1, b2 = ob, b1
                elif b2 is None or ob.version > b2.version:
                    b2 = ob
                cmps.append(ob.cmp)
                bests.append((b1, b2))
                self.first_seen.setdefault(ob.val, ob.cmp)

    def highest_before(self, t: int) -> _Obs | None:
        i = bisect.bisect_left(self.cmps, t)
        return self.top[i - 1] if i else None

    def same_token_moved(self, t: int, tok: int, since: int, own: str) -> _Obs | None:
        """An observation before ``t`` of this token under another owner (or none)
        at a version above ``since``."""
        entry = self.by_token.get(tok)
        if entry is None:
            return None
        i = bisect.bisect_left(entry[0], t)
        if not i:
            return None
        b1, b2 = entry[1][i - 1]
        ob = b1 if b1.owner != own else b2
        return ob if ob is not None and ob.version > since else None

    def deleted_between(self, born: int, t: int) -> _Obs | None:
        i = bisect.bisect_left(self.gone_cmps, t)
        ob = self.gone_top[i - 1] if i else None
        return ob if ob is not None and ob.inv > born else None

    def seen_before(self, val: str, t: int) -> bool:
        return self.first_seen.get(val, t) < t


def check_handles(ops: list[Op], results: dict[str, RunResult] | None = None) -> list[Violation]:
    """No two handles both completed writes under overlapping ownership: a
    fenced write invoked after some operation had *completed* showing the run's
    fence moved on from the writer's handle (a higher token; the same token under
    another owner, or with the lease dropped, at a later version; or the run
    deleted) must not succeed. Handles never come back once displaced (tokens
    never go backwards; raw lease steals use fresh owner identities)."""
    written = _written(results or {})
    index = {run: _Index(lst) for run, lst in observations(ops).items()}
    bad: list[Violation] = []
    est: dict[tuple[str, str, int, int], int] = {}  # (run, owner, token, version) -> cmp
    for o in ops:
        if o.ok and o.rec is not None and o.cmp is not None and o.f in ("acquire", "raw_cas",
                                                                         "raw_create"):
            r = o.rec
            est.setdefault((o.run, owner_of(r) or "", r["fencing_token"], r["version"]), o.cmp)
    for w in ops:
        if not (w.ok and w.f in FENCED and w.rec is not None):
            continue
        run, a = w.run, w.a
        tok, own, since = a["token"], a["owner"], a.get("since", 0)
        ix = index.get(run)
        if ix is None:
            continue
        if run in written:
            if w.id not in written[run]:
                continue  # converged: answered the record unchanged, wrote nothing
        elif w.f in ("suspend", "finish", "release") and ix.seen_before(canon(w.rec), w.inv):
            continue  # (no linearization) the same value was seen before: converged
        moved = ""
        ob = ix.highest_before(w.inv)
        if ob is not None and ob.token is not None and ob.token > tok:
            moved = f"the token had moved to {ob.token}"
        else:
            ob = ix.same_token_moved(w.inv, tok, since, own)
            if ob is not None:
                moved = (f"the lease was {'dropped' if ob.owner is None else 'given to'}"
                         f"{'' if ob.owner is None else ' ' + repr(ob.owner)} at version "
                         f"{ob.version}")
            else:
                born = est.get((run, own, tok, since), 0)
                ob = ix.deleted_between(born, w.inv) if born else None
                if ob is not None:
                    moved = "the run was deleted"
        if moved and ob is not None:
            bad.append(_v(
                "handles",
                f"{run}: handle ({own}, token {tok}) completed a {w.f} invoked after "
                f"{moved} (seen by {ob.op.id}, completed before the write began)",
                w, ob.op,
            ))
    return bad


# -- durability -------------------------------------------------------------------------


def _effect_revision(o: Op) -> int | None:
    """The revision an acknowledged operation's write has (None: not a write)."""
    if not o.ok or o.f not in WRITES:
        return None
    if o.f in ("delete_run", "raw_delete"):
        return int(o.x["revision"]) if o.x.get("revision") else None
    if o.f == "raw_cas" and not o.x.get("swapped"):
        return None
    if o.f == "raw_create" and not o.x.get("created"):
        return None
    return None if o.rec is None else int(o.rec["revision"])


def check_durability_restarts(ops: list[Op], kills: list[dict[str, Any]],
                              sharded: bool = False) -> list[Violation]:
    """After every restart, a probe (GetRun of every run, before any worker can
    reconnect) shows every write acknowledged before the kill. ``sharded``:
    revisions are ordered within each shard only (SPEC §13), so a server's
    revision is compared with no other shard's write."""
    bad: list[Violation] = []
    acked = sorted((o for o in ops if _effect_revision(o) is not None),
                   key=lambda o: o.cmp or 0)
    cmps = [o.cmp or 0 for o in acked]
    deletes: dict[str, list[Op]] = defaultdict(list)
    probes_of: dict[str, dict[str, Op]] = defaultdict(dict)
    # probe clients' names are reused past runner.MAX_PROBES restarts: a probe
    # belongs to the last restart killed before it was invoked
    order = sorted(kills, key=lambda k: k["killed"])
    killed_at = [k["killed"] for k in order]
    for o in ops:
        if o.f in ("delete_run", "raw_delete") and o.st != "fail":
            deletes[o.run].append(o)
        if o.client.startswith("probe") and o.f == "get_run":
            i = bisect.bisect_right(killed_at, o.inv) - 1
            n = order[i]["restart"] if i >= 0 else None
            probes_of[o.client if n is None else f"probe{n}"][o.run] = o
    last: dict[str, Op] = {}
    top: Op | None = None
    done = 0
    for k in sorted(kills, key=lambda k: k["killed"]):
        n, killed = k["restart"], k["killed"]
        probes = probes_of.get(f"probe{n}", {})
        upto = bisect.bisect_left(cmps, killed)
        for o in acked[done:upto]:  # every write acknowledged before this kill
            rev = _effect_revision(o)
            assert rev is not None
            cur = last.get(o.run)
            if cur is None or rev > (_effect_revision(cur) or 0):
                last[o.run] = o
            if top is None or rev > (_effect_revision(top) or 0):
                top = o
        done = max(done, upto)
        server_rev = max((p.x.get("revision", 0) for p in probes.values() if p.ok), default=None)
        if not sharded and top is not None and server_rev is not None and server_rev < (
            _effect_revision(top) or 0
        ):
            bad.append(_v("durability-restart",
                          f"restart #{n}: the server came back at revision {server_rev}, below "
                          f"revision {_effect_revision(top)} acknowledged before the kill", top))
        for run, w in sorted(last.items()):
            p = probes.get(run)
            if p is None or p.st == "unknown":
                continue
            if sharded and not p.ok and p.code != "RUN_NOT_FOUND":
                continue  # not read (its shard still moving: NOT_OWNER), not found gone
            rev = _effect_revision(w) or 0
            seen = p.rec if p.ok else None
            if seen is None:
                if w.f in ("delete_run", "raw_delete"):
                    continue
                if any(d.inv < killed and (d.st == "unknown" or (_effect_revision(d) or 0) > rev)
                       for d in deletes.get(run, ())):
                    continue
                bad.append(_v("durability-restart",
                              f"restart #{n}: {run} is gone after the restart, but {w.f} at "
                              f"revision {rev} was acknowledged before the kill", w, p))
            elif seen["revision"] < rev or (
                seen["revision"] == rev and w.rec is not None and canon(seen) != canon(w.rec)
            ):
                bad.append(_v("durability-restart",
                              f"restart #{n}: acknowledged {w.f} of {run} at revision {rev} "
                              f"(version {w.rec['version'] if w.rec else '-'}) lost: after the "
                              f"restart the run is at revision {seen['revision']} (version "
                              f"{seen['version']})", w, p))
    return bad


def check_durability_final(ops: list[Op], snap: Any) -> list[Violation]:
    """Every record value a client observed or was acknowledged, and every
    acknowledged delete, is in the committed history at its revision."""
    by_rev = snap.by_revision()
    bad: list[Violation] = []
    reported: set[int] = set()
    for o in ops:
        recs: list[dict[str, Any]] = []
        if o.f == "list" and o.ok:
            recs = list(o.x.get("runs", {}).values())
        elif o.rec is not None:
            recs = [o.rec]
        for rec in recs:
            rev = rec["revision"]
            c = by_rev.get(rev)
            if rev in reported:
                continue
            if c is None or canon(c.rec) != canon(rec):  # an expiry renewed from memory
                reported.add(rev)
                what = "acknowledged" if o.ok and o.f in WRITES else "observed"
                got = "nothing" if c is None else (
                    f"{c.run_id} v{c.rec['version']} tok{c.rec['fencing_token']}" if c.rec
                    else f"a delete of {c.run_id}")
                bad.append(_v("durability-final",
                              f"{what} value of {rec['run_id']} at revision {rev} (version "
                              f"{rec['version']}) is not in the committed history (it has "
                              f"{got} at that revision)", o))
        if o.ok and o.f in ("delete_run", "raw_delete") and o.x.get("revision"):
            rev = o.x["revision"]
            c = by_rev.get(rev)
            if (c is None or c.kind != 2 or c.run_id != o.run) and rev not in reported:
                reported.add(rev)
                bad.append(_v("durability-final",
                              f"acknowledged delete of {o.run} at revision {rev} is not in the "
                              "committed history", o))
    return bad


# -- tokens ------------------------------------------------------------------------------


def check_tokens(ops: list[Op], snap: Any | None = None) -> list[Violation]:
    bad: list[Violation] = []
    if snap is not None:
        for run, seq in snap.per_run().items():
            top = 0
            prev: int | None = None
            for c in seq:
                if c.rec is None:
                    prev = None
                    continue
                tok = c.rec["fencing_token"]
                if prev is None and tok <= top:
                    bad.append(Violation("tokens", f"{run} rev {c.revision}: recreated at token "
                                         f"{tok}, not above the deleted run's {top}"))
                elif prev is not None and tok < prev:
                    bad.append(Violation("tokens", f"{run} rev {c.revision}: token went back "
                                         f"{prev} -> {tok}"))
                prev = tok
                top = max(top, tok)
    index = {run: _Index(lst) for run, lst in observations(ops).items()}
    first: dict[tuple[str, int], Op] = {}
    for o in ops:
        if not (o.ok and o.f == "acquire" and o.rec is not None):
            continue
        tok = o.rec["fencing_token"]
        other = first.setdefault((o.run, tok), o)
        if other is not o:
            bad.append(_v("tokens", f"{o.run}: token {tok} granted twice", other, o))
        ob = index[o.run].highest_before(o.inv) if o.run in index else None
        if ob is not None and ob.token is not None and ob.token >= tok:
            bad.append(_v("tokens", f"{o.run}: acquire granted token {tok}, but token "
                          f"{ob.token} had been observed before it was invoked", o, ob.op))
    return bad


# -- liveness ----------------------------------------------------------------------------


def check_liveness(results: list[dict[str, Any]], bound_s: float) -> list[Violation]:
    bad = []
    for r in results:
        if not r["ok"]:
            bad.append(Violation("liveness", f"{r['run']}: could not be acquired and finished "
                                 f"within {bound_s:.0f} s after the nemesis stopped "
                                 f"({r.get('why', '')})"))
        elif r["seconds"] > bound_s:
            bad.append(Violation("liveness", f"{r['run']}: took {r['seconds']:.1f} s "
                                 f"(bound {bound_s:.0f} s)"))
    return bad


# -- the committed history -----------------------------------------------------------------


def check_committed(snap: Any, ops: list[Op], sharded: bool = False,
                    clock: Callable[[Op, bool], int] | None = None) -> list[Violation]:
    """The server's own history (the ``changes`` table), raw-seam aware.
    ``sharded``: revisions come in blocks, with gaps, and no row holds the
    last (SPEC §13); each run's changes still follow in revision order.
    ``clock``: with several coordinators, how far ahead of the true time the
    clock of the one that answered an op ran (ms; ``True``: at its answer, the
    most; else at its invocation, the least; 0 when not known)."""
    from _history import _check_acquisition

    bad: list[Violation] = []

    def v(msg: str) -> None:
        bad.append(Violation("history", msg))

    if snap.integrity != ["ok"]:
        v(f"PRAGMA integrity_check: {snap.integrity[:5]}")
    revs = [c.revision for c in snap.changes]
    if revs and not sharded:
        if revs[0] != 1:
            v(f"history starts at revision {revs[0]}, expected 1")
        if revs != list(range(revs[0], revs[0] + len(revs))):
            v("revisions are not gap-free")
        if snap.meta_revision != revs[-1]:
            v(f"meta.revision {snap.meta_revision} != last change {revs[-1]}")
    # (run, token, owner) -> the latest expiry (+ lock-delay) a renewal
    # acknowledged, and how far ahead the clock that acknowledged it ran
    renewed: dict[tuple[str, int, str], tuple[int, Op, int]] = {}
    # an acquisition's revision -> how far ahead the clock that granted it ran, at least
    granted: dict[int, int] = {}
    for o in ops:
        lease = o.rec.get("lease") if o.ok and o.f == "renew" and o.rec else None
        if lease:
            key = (o.run, o.rec["fencing_token"], lease[0])  # type: ignore[index]
            until = lease[2] + lease[4]
            if key not in renewed or renewed[key][0] < until:
                renewed[key] = (until, o, clock(o, True) if clock else 0)
        elif clock and o.ok and o.f == "acquire" and o.rec and o.rec.get("revision"):
            granted[o.rec["revision"]] = clock(o, False)
    raw: dict[str, set[str]] = defaultdict(set)
    for o in ops:
        if o.f == "raw_cas":
            raw[o.run].add(content(o.a["next"]))
        elif o.f == "raw_create":
            raw[o.run].add(content(o.a["record"]))
    last: dict[str, Any] = {}
    prev: dict[str, dict[str, Any] | None] = {}
    for c in snap.changes:
        where = f"{c.run_id} rev {c.revision}"
        p = prev.get(c.run_id)
        last[c.run_id] = c
        if c.kind == 2:
            if p is None:
                v(f"{where}: delete of an absent run")
            prev[c.run_id] = None
            continue
        rec = c.rec
        if rec is None or rec.get("revision") != c.revision or rec.get("run_id") != c.run_id:
            v(f"{where}: the record does not carry its revision and run id")
            prev[c.run_id] = rec
            continue
        if p is None:
            if rec["version"] != 1:
                v(f"{where}: created at version {rec['version']}")
        elif rec["version"] != p["version"] + 1:
            v(f"{where}: version {p['version']} -> {rec['version']}")
        if p is not None and content(rec) not in raw[c.run_id]:  # a ledger command
            if p["status"] in TERMINAL:
                v(f"{where}: a ledger command changed a terminal ({p['status']}) run")
            moved = rec["fencing_token"] != p["fencing_token"]
            if moved and rec["status"] == RUNNING and rec.get("lease"):
                bad.extend(Violation("history", m) for m in _check_acquisition(where, p, rec))
                plea = p.get("lease")
                held = renewed.get((c.run_id, p["fencing_token"], plea[0])) if plea else None
                # a promise from a clock running ahead of the one granting is met once
                # it is met in true time (a clock ahead expires leases early: allowed)
                ahead = max(0, held[2] - granted.get(c.revision, 0)) if held else 0
                if held is not None and rec["lease"][0] != plea[0] and (
                    rec["lease"][1] < held[0] - ahead
                ):
                    bad.append(_v("renewals", f"{where}: {rec['lease'][0]!r} granted at "
                                  f"{rec['lease'][1]} the lease a renewal had acknowledged to "
                                  f"{plea[0]!r} until {held[0]}", held[1]))
            elif moved and rec["status"] != 6:
                v(f"{where}: a ledger write moved the token without acquiring or cancelling")
            elif not moved and rec.get("lease") and not p.get("lease"):
                v(f"{where}: a lease appeared under token {rec['fencing_token']} without an "
                  "acquisition")
        prev[c.run_id] = rec
    for run, c in last.items():
        row = snap.runs.get(run)
        if c.kind == 2:
            if row is not None:
                v(f"{run}: deleted in the history but present in the runs table")
        elif row is None or canon(row["record"]) != canon(c.rec):  # expiries flush later
            v(f"{run}: the runs table is not the last change (rev {c.revision})")
    for run in snap.runs.keys() - last.keys():
        v(f"{run}: in the runs table but never in the history")
    return bad


# -- answers -------------------------------------------------------------------------------


INVALID_CODES = ("INTERNAL", "UNKNOWN", "UNIMPLEMENTED", "DATA_LOSS")


def check_answers(ops: list[Op], server_log: str = "") -> list[Violation]:
    bad: list[Violation] = []
    for o in ops:
        if o.st == "unknown" and o.code in INVALID_CODES:
            bad.append(_v("answers", f"{o.f} answered {o.code} without a fencepost error", o))
        if not o.ok:
            continue
        r, a = o.rec, o.a
        if o.f == "raw_cas":
            if o.x.get("swapped"):
                if r is None or content(r) != content(a["next"]):
                    bad.append(_v("answers", "CAS stored something else than asked", o))
            elif r is not None and r["version"] == a["expected"]:
                bad.append(_v("answers", "CAS refused although the version matched", o))
        elif o.f == "raw_create" and o.x.get("created"):
            if r is None or content(r) != content(a["record"]):
                bad.append(_v("answers", "Create stored something else than asked", o))
        elif o.f == "acquire" and r is not None:
            lease = r.get("lease")
            if r["status"] != RUNNING or lease is None or lease[0] != a["owner"] or (
                lease[3] != a["ttl"]
            ):
                bad.append(_v("answers", "Acquire answered a record that is not this lease", o))
        elif o.f in FENCED and r is not None:
            if r["fencing_token"] != a["token"]:
                bad.append(_v("answers", f"{o.f} answered a record at another token", o))
            if o.f in ("renew", "checkpoint") and owner_of(r) != a["owner"]:
                bad.append(_v("answers", f"{o.f} by {a['owner']} succeeded on a lease held by "
                              f"{owner_of(r)!r}", o))
    if "Traceback" in server_log:
        i = server_log.index("Traceback")
        bad.append(Violation("answers", "the server logged a traceback:\n"
                             + server_log[i: i + 1500]))
    return bad


# -- all together ------------------------------------------------------------------------------


@dataclass
class Checked:
    violations: list[Violation]
    timings: dict[str, float]
    lin: dict[str, Any]
    counts: dict[str, int]


def check_all(
    ops: list[Op],
    *,
    runs: list[str] | None = None,
    kills: list[dict[str, Any]] | None = None,
    snap: Any = None,
    liveness: list[dict[str, Any]] | None = None,
    liveness_bound_s: float = 15.0,
    server_log: str = "",
    budget: int = 2_000_000,
    sharded: bool = False,
    watched: Any = None,
    clock: Callable[[Op, bool], int] | None = None,
) -> Checked:
    timings: dict[str, float] = {}
    found: list[Violation] = []

    def timed(name: str, fn: Any, *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        timings[name] = time.perf_counter() - t
        return out

    lin_bad, results = timed("linearizability", check_linearizability, ops, runs, budget)
    found += lin_bad
    found += timed("fencing", check_fencing, results)
    found += timed("handles", check_handles, ops, results)
    found += timed("durability-restart", check_durability_restarts, ops, kills or [], sharded)
    if snap is not None:
        found += timed("durability-final", check_durability_final, ops, snap)
        found += timed("history", check_committed, snap, ops, sharded, clock)
    found += timed("tokens", check_tokens, ops, snap)
    if liveness is not None:
        found += timed("liveness", check_liveness, liveness, liveness_bound_s)
    found += timed("answers", check_answers, ops, server_log)
    if watched is not None and snap is not None:  # (torture/watching.py)
        from .watching import check_watch

        found += timed("watch", check_watch, watched, snap)
    counts = Counter(v.check for v in found)
    kept: list[Violation] = []
    per: Counter[str] = Counter()
    for v in found:
        per[v.check] += 1
        if per[v.check] <= MAX_PER_CHECK:
            kept.append(v)
    lin = {
        "runs": len(results),
        "ops": sum(r.ops for r in results.values()),
        "segments": sum(r.segments for r in results.values()),
        "configurations": sum(r.expansions for r in results.values()),
        "not_linearizable": [r.run for r in results.values() if not r.ok and not r.inconclusive],
        "inconclusive": [r.run for r in results.values() if r.inconclusive],
    }
    return Checked(kept, timings, lin, dict(counts))
