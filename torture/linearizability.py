"""Linearizability of each run's record as a versioned register with
compare-and-set: a Wing-Gong / Lowe search with memoisation, as Knossos and
Porcupine do it.

The model. The state of one run is *absent* or one record value (every field,
revision included). Every recorded operation becomes one of:

* The lease's expiry is not part of a value (history.canon): a renewal is
  answered from memory with the version unchanged, so an acknowledged Renew
  either *converges* (the same value) or, when written, is a write.
* **read** (GetRun, raw Get, a ListRuns entry, and every refusal that carries
  the record the server decided on: it changed nothing and observed that
  value): legal when the state is exactly that value (or absent).
* **validate** (ValidateFence): a partial read of (found, token, status).
* **write** (an acknowledged ledger command or raw CAS/Create): the result is
  version v+1, so it is a compare-and-set from version v to the returned value.
  Every commit has a revision of its own, above those before it, so a write
  (or a delete whose revision was answered) also follows only a record of a
  lower revision: a record re-created at version 1 is not mistaken for an
  earlier one of the same version.
  Suspend/Finish/Release/Cancel/RequestResume may also *converge* (return the
  record unchanged): then they are a read of the returned value.
* **delete** (DeleteRun, raw Delete): present -> absent; DeleteRun's answered
  token must be the deleted record's.
* **extend** (a new leader's lease extension at its takeover, read from the
  committed history: torture/failover.py): a compare-and-set from exactly the
  record before it to exactly the extended one. The expiry itself is not
  part of the model (acquisitions are checked against the previous lease's
  expiry in the committed history, extensions included: checkers.py); the
  extension is one more write of the register, made by no client, within
  the window the harness saw the takeover in.
* **unknown** (the client never learned the outcome): may take effect at any
  point after its invocation, or never. If it does, the new value is not known;
  the state becomes a *placeholder* for "the value this op wrote" that carries
  what that op necessarily wrote (status, owner, token; the exact record for a
  raw CAS) and is refined by the next read of it. A fenced unknown op may only
  take effect while the record is at its token, owner and RUNNING (the fence).

The search. Per run, operations are split into segments at instants no known
operation spans; each segment is searched Porcupine-style (DFS over minimal
operations, a cache of (linearized set, state, pending unknown ops)) and the
configurations it can end in feed the next segment, lazily, with backtracking
across segments. Reads that fit the current state are linearized greedily (an
identity op can always move to the earliest point of its window). Unknown ops
not yet applied are carried to later segments and dropped once the record's
token has passed the one they need (tokens never go backwards: checked
separately), so the search stays close to linear in the history length.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .history import (
    CONVERGING,
    EXTEND,
    FENCED,
    NO_EFFECT_CODES,
    QUEUED,
    RUNNING,
    SUSPENDED,
    TERMINAL,
    Op,
    canon,
    content,
    owner_of,
)

State = tuple[Any, ...]
ABSENT: State = ("A",)

READ, VALIDATE, WRITE, DELETE, UNKNOWN = "read", "validate", "write", "delete", "unknown"
EXTENDS = "extends"  # a takeover's lease extension: exact record -> exact record


class BudgetExceeded(Exception):
    pass


@dataclass(slots=True)
class COp:
    """One operation as the model sees it (a ListRuns op yields one per run)."""

    i: int
    op: Op
    kind: str
    inv: int
    ret: int | None  # None: unknown outcome (never returns)
    val: str | None = None  # canon of the record read/written; None: absent
    version: int = 0
    converge: bool = False
    token: int | None = None
    found: bool = True
    vstatus: int = 0
    current: bool | None = None
    pre: str | None = None  # extends: the exact record it replaced
    rev: int | None = None  # a write's or delete's commit revision, when known


def normalize(ops: list[Op], run: str) -> list[COp]:
    """The model operations of one run, from its recorded operations."""
    out: list[COp] = []

    def add(op: Op, kind: str, **kw: Any) -> None:
        out.append(COp(len(out), op, kind, op.inv, op.cmp if kind != UNKNOWN else None, **kw))

    for op in ops:
        f = op.f
        if op.st == "unknown":
            if op.is_write:
                add(op, UNKNOWN)
            continue
        rec = op.rec
        if f == EXTEND:
            assert rec is not None, op
            add(op, EXTENDS, val=canon(rec), version=rec["version"], pre=canon(op.a["pre"]))
            continue
        if op.st == "fail":
            if op.code in NO_EFFECT_CODES and rec is None:
                continue
            if rec is not None:
                add(op, READ, val=canon(rec))
            elif op.code in ("RUN_NOT_FOUND", "RUN_LEASE_LOST"):
                add(op, READ, val=None)
            continue
        # ok
        if f == "list":
            entry = op.x.get("runs", {}).get(run)
            if entry is None and op.x.get("partial"):
                continue  # a coordinator leading some shards lists only theirs
            add(op, READ, val=canon(entry) if entry is not None else None)
        elif f == "get_run":
            add(op, READ, val=canon(rec))
        elif f == "raw_get":
            add(op, READ, val=canon(rec) if op.x.get("found") else None)
        elif f == "validate":
            add(op, VALIDATE, found=bool(op.x.get("found")), token=op.x.get("token"),
                vstatus=op.x.get("status", 0), current=op.x.get("current"))
        elif f in ("delete_run", "raw_delete"):
            if f == "raw_delete" and not op.x.get("deleted"):
                add(op, READ, val=None)
            else:
                add(op, DELETE, token=op.x.get("token"), rev=op.x.get("revision"))
        elif f == "raw_create" and not op.x.get("created"):
            add(op, READ, val=canon(rec))
        elif f == "raw_cas" and not op.x.get("swapped"):
            add(op, READ, val=canon(rec) if rec is not None else None)
        else:
            assert rec is not None, op
            # a renewal answered from memory keeps the version: it converges
            add(op, WRITE, val=canon(rec), version=rec["version"],
                converge=f in CONVERGING or f == "renew", rev=rec.get("revision"))
    return out


def segments(cops: list[COp]) -> list[list[COp]]:
    """Split at instants that no known operation spans (unknown ops join the
    segment they were invoked in and are carried on from there)."""
    segs: list[list[COp]] = []
    cur: list[COp] = []
    end = -1
    for c in sorted(cops, key=lambda c: c.inv):
        if cur and c.inv > end:
            segs.append(cur)
            cur = []
        cur.append(c)
        if c.ret is not None:
            end = max(end, c.ret)
    if cur:
        segs.append(cur)
    return segs


# -- the model ----------------------------------------------------------------------


@dataclass
class Model:
    recs: dict[str, dict[str, Any]] = field(default_factory=dict)
    cops: list[COp] = field(default_factory=list)

    def rec(self, val: str) -> dict[str, Any]:
        r = self.recs.get(val)
        if r is None:
            import json

            r = self.recs[val] = json.loads(val)
        return r

    # facts about a state
    def version(self, s: State) -> int:
        if s[0] == "A":
            return 0
        if s[0] == "R":
            return int(self.rec(s[1])["version"])
        return int(s[1])

    def token(self, s: State) -> int | None:
        if s[0] == "A":
            return None
        if s[0] == "R":
            return int(self.rec(s[1])["fencing_token"])
        return s[2]  # type: ignore[no-any-return]

    def shape(self, s: State) -> tuple[int | None, str | None]:
        """(status, lease owner) of a present state; status None when unknown."""
        if s[0] == "R":
            r = self.rec(s[1])
            return r["status"], owner_of(r)
        return self.wrote(self.cops[s[3]])

    def wrote(self, u: COp) -> tuple[int | None, str | None]:
        """(status, owner) of the record an unknown op writes when it takes effect."""
        f, a = u.op.f, u.op.a
        if f == "acquire":
            return RUNNING, a["owner"]
        if f in ("renew", "checkpoint"):
            return RUNNING, a["owner"]
        if f == "suspend":
            return SUSPENDED, None
        if f == "finish":
            return a["status"], None
        if f in ("release", "resume"):
            return QUEUED, None
        if f == "cancel":
            return 6, None
        if f in ("raw_cas", "raw_create"):
            nx = a["next"] if f == "raw_cas" else a["record"]
            return nx["status"], owner_of(nx)
        return None, None

    def compat(self, u: COp, r: dict[str, Any], s: State) -> bool:
        """Could unknown op ``u`` have written record ``r`` (placeholder ``s``)?"""
        if r["version"] != s[1] or (s[2] is not None and r["fencing_token"] != s[2]):
            return False
        f, a = u.op.f, u.op.a
        if f in ("raw_cas", "raw_create"):
            nx = a["next"] if f == "raw_cas" else a["record"]
            return content(r) == content(nx)
        status, own = self.wrote(u)
        if r["status"] != status or owner_of(r) != own:
            return False
        if f == "checkpoint":
            ck = r.get("checkpoint_ref")
            return ck is not None and ck[0] == a["key"] and ck[1] == a["snapshot_version"]
        return True

    # transitions
    def identity(self, s: State, c: COp) -> State | None:
        """Apply an op that does not change the record (read, validate, a
        converged write); may refine a placeholder. None: illegal here."""
        if c.kind == READ or (c.kind == WRITE and c.converge):
            if c.val is None:
                return s if s[0] == "A" else None
            if s[0] == "R":
                return s if s[1] == c.val else None
            if s[0] == "W":
                return ("R", c.val) if self.compat(self.cops[s[3]], self.rec(c.val), s) else None
            return None
        if c.kind == VALIDATE:
            if not c.found:
                return s if s[0] == "A" else None
            if s[0] == "A":
                return None
            tok = self.token(s)
            status, own = self.shape(s)
            if tok is not None and tok != c.token:
                return None
            if status is not None and status != c.vstatus:
                return None
            if c.current is not None and tok is not None and status is not None:
                presented = c.op.a.get("token")
                want = status == RUNNING and own is not None and presented == tok
                if c.current != want:
                    return None
            return s
        return None

    def later(self, s: State, c: COp) -> bool:
        """Whether ``c``'s commit can follow state ``s`` (known revisions only)."""
        return s[0] != "R" or c.rev is None or int(self.rec(s[1])["revision"]) < c.rev

    def apply(self, s: State, c: COp) -> State | None:
        """Apply a known write, delete or extension. None: illegal here."""
        if c.kind == WRITE:
            if c.version == 1:
                return ("R", c.val) if s[0] == "A" else None
            if s[0] == "A" or self.version(s) != c.version - 1 or not self.later(s, c):
                return None
            return ("R", c.val)
        if c.kind == EXTENDS:
            if s[0] == "R":
                return ("R", c.val) if s[1] == c.pre else None
            if s[0] == "W" and c.pre is not None:
                compat = self.compat(self.cops[s[3]], self.rec(c.pre), s)
                return ("R", c.val) if compat else None
            return None
        if c.kind == DELETE:
            if s[0] == "A" or not self.later(s, c):
                return None
            tok = self.token(s)
            if c.token is not None and tok is not None and tok != c.token:
                return None
            return ABSENT
        return None

    def apply_unknown(self, s: State, u: COp) -> State | None:
        """Let an unknown-outcome op take effect now. None: it could not have."""
        f, a = u.op.f, u.op.a
        if s[0] == "A":
            if f == "acquire":
                return ("W", 1, None, u.i)
            if f == "raw_create":
                return ("W", 1, a["record"]["fencing_token"], u.i)
            return None
        v, tok = self.version(s), self.token(s)
        status, own = self.shape(s)
        if f == "acquire":
            if status in TERMINAL or status == SUSPENDED:
                return None
            return ("W", v + 1, None if tok is None else tok + 1, u.i)
        if f in FENCED:
            if (tok is not None and tok != a["token"]) or own != a["owner"]:
                return None
            if status is not None and status != RUNNING:
                return None
            return ("W", v + 1, a["token"], u.i)
        if f == "cancel":
            if status in TERMINAL:
                return None
            return ("W", v + 1, None if tok is None else tok + 1, u.i)
        if f == "resume":
            if status in TERMINAL or status == QUEUED:
                return None
            return ("W", v + 1, tok, u.i)
        if f in ("delete_run", "raw_delete"):
            return ABSENT
        if f == "raw_cas":
            nt = a["next"]["fencing_token"]
            if v != a["expected"] or (tok is not None and nt < tok):
                return None
            return ("W", v + 1, nt, u.i)
        return None

    def retired(self, s: State, u: COp) -> bool:
        """True when ``u`` can no longer take effect (the token moved past it)."""
        tok = self.token(s)
        if tok is None:
            return False
        f, a = u.op.f, u.op.a
        if f in FENCED:
            return bool(tok > a["token"])
        if f == "raw_cas":
            return bool(tok > a["next"]["fencing_token"])
        if f == "raw_create":
            return bool(tok >= a["record"]["fencing_token"])
        return False


# -- the search ---------------------------------------------------------------------

Step = tuple[COp, State, State]  # (op, state before, state after)


@dataclass
class Stuck:
    """Where a segment's search got furthest before failing."""

    done: int = -1
    total: int = 0
    state: State = ABSENT
    blocking: list[COp] = field(default_factory=list)
    last: list[Step] = field(default_factory=list)


@dataclass
class RunResult:
    run: str
    ops: int
    segments: int
    ok: bool
    steps: list[Step] = field(default_factory=list)  # the linearization found
    message: str = ""
    involved: list[Op] = field(default_factory=list)
    expansions: int = 0
    seconds: float = 0.0
    inconclusive: bool = False
    model: Any = None


class _Search:
    def __init__(self, model: Model, budget: int) -> None:
        self.m = model
        self.budget = budget
        self.expansions = 0

    def segment(
        self, seg: list[COp], state0: State, pool0: frozenset[int], stucks: dict[int, Stuck],
        k: int,
    ) -> Iterator[tuple[State, frozenset[int], list[Step]]]:
        m = self.m
        finite = sorted((c for c in seg if c.ret is not None), key=lambda c: c.inv)
        pool_new = frozenset(c.i for c in seg if c.ret is None)
        n = len(finite)
        full = (1 << n) - 1
        rets = [c.ret for c in finite]
        by_ret = sorted(range(n), key=lambda j: rets[j])  # type: ignore[arg-type, return-value]
        seen: set[tuple[int, State, frozenset[int]]] = set()
        path: list[Step] = []
        stack: list[list[Any]] = []

        def min_ret(mask: int) -> float:
            for j in by_ret:
                if not mask >> j & 1:
                    return rets[j]  # type: ignore[return-value]
            return float("inf")

        def candidates(mask: int) -> Iterator[int]:
            mr = min_ret(mask)
            for j in range(n):
                if finite[j].inv >= mr:
                    return
                if not mask >> j & 1:
                    yield j

        def prune(pool: frozenset[int], s: State) -> frozenset[int]:
            gone = [i for i in pool if m.retired(s, m.cops[i])]
            return pool.difference(gone) if gone else pool

        def note_stuck(mask: int, s: State) -> None:
            stuck = stucks.get(k) or stucks.setdefault(k, Stuck())
            done = bin(mask).count("1")
            if done > stuck.done:
                stuck.done, stuck.total, stuck.state = done, n, s
                stuck.blocking = [finite[j] for j in candidates(mask)]
                mr = min_ret(mask)
                stuck.blocking += [m.cops[i] for i in sorted(pool0 | pool_new)
                                   if m.cops[i].inv < mr][:10]
                stuck.last = path[-6:]

        def enter(mask: int, s: State, pool: frozenset[int]) -> Any:
            base = len(path)
            moved = True
            while moved:  # greedy: identity ops that fit the current state
                moved = False
                for j in candidates(mask):
                    c = finite[j]
                    if c.kind in (READ, VALIDATE) or c.converge:
                        s2 = m.identity(s, c)
                        if s2 is not None:
                            path.append((c, s, s2))
                            mask |= 1 << j
                            s = s2
                            moved = True
                            break
            if mask == full:
                out = (s, prune(pool, s), list(path))
                del path[base:]
                return out
            key = (mask, s, pool)
            if key in seen:
                del path[base:]
                return None
            seen.add(key)
            self.expansions += 1
            if self.expansions > self.budget:
                raise BudgetExceeded
            note_stuck(mask, s)
            choices: list[tuple[int, State, frozenset[int], Step]] = []
            mr = min_ret(mask)
            for j in candidates(mask):
                c = finite[j]
                if c.kind in (WRITE, DELETE, EXTENDS):
                    s2 = m.apply(s, c)
                    if s2 is not None:
                        choices.append((mask | 1 << j, s2, prune(pool, s2), (c, s, s2)))
            for i in sorted(pool):
                u = m.cops[i]
                if u.inv >= mr:
                    continue
                s2 = m.apply_unknown(s, u)
                if s2 is not None:
                    rest = pool - {i}
                    choices.append((mask, s2, prune(rest, s2), (u, s, s2)))
            stack.append([choices, 0, base, len(path)])
            return None

        res = enter(0, state0, pool0 | pool_new)
        if res is not None:
            yield res
        while stack:
            frame = stack[-1]
            choices, k, base, after = frame
            if k >= len(choices):
                stack.pop()
                del path[base:]
                continue
            frame[1] = k + 1
            mask2, s2, pool2, step = choices[k]
            del path[after:]
            path.append(step)
            res = enter(mask2, s2, pool2)
            if res is not None:
                yield res


def check_run(ops: list[Op], run: str, budget: int = 2_000_000) -> RunResult:
    """Search for a linearization of one run's history (starting absent)."""
    started = time.perf_counter()
    cops = normalize(ops, run)
    model = Model(cops=cops)
    segs = segments(cops)
    search = _Search(model, budget)
    result = RunResult(run, len(cops), len(segs), ok=True, model=model)
    if not segs:
        return result
    failed: set[tuple[int, State, frozenset[int]]] = set()
    stucks: dict[int, Stuck] = {}  # created when a segment's search has to branch
    tails: dict[int, list[Step]] = {}  # segment -> the end of the linearization leading to it
    # level k: (iterator over segment k's end configs, its start config, the path yielded)
    levels: list[list[Any]] = []
    start = (ABSENT, frozenset[int]())
    levels.append([search.segment(segs[0], *start, stucks, 0), start, []])
    deepest = 0
    try:
        while levels:
            k = len(levels) - 1
            deepest = max(deepest, k)
            it, cfg, _ = levels[-1]
            nxt = next(it, None)
            if nxt is None:
                failed.add((k, *cfg))
                levels.pop()
                continue
            s_end, pool_end, steps = nxt
            levels[-1][2] = steps
            if k + 1 == len(segs):
                result.steps = [st for lv in levels for st in lv[2]]
                break
            ncfg = (s_end, pool_end)
            if (k + 1, *ncfg) in failed:
                continue
            tails[k + 1] = steps[-4:] or tails.get(k, [])
            levels.append([search.segment(segs[k + 1], *ncfg, stucks, k + 1), ncfg, []])
        else:
            result.ok = False
    except BudgetExceeded:
        result.ok = False
        result.inconclusive = True
    result.expansions = search.expansions
    result.seconds = time.perf_counter() - started
    if not result.ok:
        stuck = stucks.get(deepest) or Stuck()
        _explain(result, model, segs, deepest, stuck, tails.get(deepest, []))
    return result


def describe(model: Model, s: State) -> str:
    if s[0] == "A":
        return "absent"
    if s[0] == "R":
        r = model.rec(s[1])
        return (f"v{r['version']} tok{r['fencing_token']} status{r['status']} "
                f"owner={owner_of(r)} rev{r['revision']}")
    u = model.cops[s[3]]
    return f"v{s[1]} tok{s[2]} (written by unknown-outcome op {u.op.id}, value not yet read)"


def _explain(result: RunResult, model: Model, segs: list[list[COp]], k: int,
             stuck: Stuck, before: list[Step]) -> None:
    seg = segs[k]
    t0 = min(c.inv for c in seg) / 1e9
    t1 = max((c.ret or c.inv) for c in seg) / 1e9
    if result.inconclusive:
        head = f"search budget exhausted ({result.expansions} configurations)"
    else:
        head = "not linearizable"
    lines = [
        f"run {result.run}: {head}: in segment {k + 1}/{len(segs)} ({len(seg)} ops, "
        f"t={t0:.3f}..{t1:.3f} s) at most {max(stuck.done, 0)} of {stuck.total} ops "
        f"could be linearized; the record was then {describe(model, stuck.state)}, and "
        "none of these could come next:"
    ]
    involved: list[Op] = []
    for c in stuck.blocking[:12]:
        lines.append("    " + c.op.brief())
        involved.append(c.op)
    last = stuck.last or before
    if last:
        lines.append("  linearized just before:")
        for c, _, after in last:
            lines.append(f"    {c.op.brief()}  => {describe(model, after)}")
            involved.append(c.op)
    result.message = "\n".join(lines)
    result.involved = involved
