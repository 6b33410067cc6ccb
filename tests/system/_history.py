"""Audit the server's committed history (the ``changes`` table) and the current
``runs`` table of a fencepost SQLite file against docs/SPEC.md §5 and §9, and match the
writes clients saw acknowledged against it.

Every check returns a list of human-readable violations; the tests assert the
list is empty (and print the first few when it is not).
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _proc import connect_ro

PUT, DELETE = 1, 2
RUNNING = 2
TERMINAL = {4, 5, 6}
CANCELLED = 6


@dataclass(frozen=True)
class Change:
    revision: int
    run_id: str
    kind: int
    rec: dict[str, Any] | None
    committed_at: int


@dataclass
class Snapshot:
    changes: list[Change]
    # run_id -> the row (columns + parsed record) as the server loads it: the
    # runs table (a checkpoint of the log) with the changes above its
    # materialized mark replayed on top, as storage.load() does.
    runs: dict[str, dict[str, Any]]
    meta_revision: int
    integrity: list[str]
    table_runs: dict[str, dict[str, Any]] | None = None  # the runs table itself
    materialized: int = 0  # meta.materialized

    def by_revision(self) -> dict[int, Change]:
        return {c.revision: c for c in self.changes}

    def previous(self) -> dict[int, Change | None]:
        """Each change's revision -> the change of its run just before it."""
        out: dict[int, Change | None] = {}
        last: dict[str, Change] = {}
        for c in self.changes:
            out[c.revision] = last.get(c.run_id)
            last[c.run_id] = c
        return out

    def per_run(self) -> dict[str, list[Change]]:
        out: dict[str, list[Change]] = defaultdict(list)
        for c in self.changes:
            out[c.run_id].append(c)
        return out


def load(db_path: Path) -> Snapshot:
    db = connect_ro(db_path)
    try:
        integrity = [r[0] for r in db.execute("PRAGMA integrity_check")]
        changes = [
            Change(rev, run_id, kind, json.loads(text) if text is not None else None, at)
            for rev, run_id, kind, text, at in db.execute(
                "SELECT revision, run_id, kind, record, committed_at FROM changes "
                "ORDER BY revision"
            )
        ]
        table: dict[str, dict[str, Any]] = {}
        for run_id, version, status, token, owner, revision, text in db.execute(
            "SELECT run_id, version, status, fencing_token, owner, revision, record FROM runs"
        ):
            table[run_id] = {
                "version": version, "status": status, "fencing_token": token,
                "owner": owner, "revision": revision, "record": json.loads(text),
            }
        row = db.execute("SELECT value FROM meta WHERE key = 'revision'").fetchone()
        meta_revision = int(row[0]) if row else -1
        row = db.execute("SELECT value FROM meta WHERE key = 'materialized'").fetchone()
        materialized = int(row[0]) if row else -1
    except sqlite3.Error as exc:  # a corrupt file must fail the test, not crash it
        return Snapshot([], {}, -1, [f"cannot read the database: {exc!r}"])
    finally:
        db.close()
    runs = dict(table)
    for c in changes:  # replay what the runs table does not reflect yet
        if c.revision <= materialized:
            continue
        if c.kind == DELETE or c.rec is None:
            runs.pop(c.run_id, None)
        else:
            r = c.rec
            runs[c.run_id] = {
                "version": r["version"], "status": r["status"],
                "fencing_token": r["fencing_token"], "owner": _owner(r),
                "revision": c.revision, "record": r,
            }
    return Snapshot(changes, runs, meta_revision, integrity, table, materialized)


def _owner(rec: dict[str, Any] | None) -> str | None:
    lease = None if rec is None else rec.get("lease")
    return None if lease is None else lease[0]


def check_history(snap: Snapshot, *, allow_cancel: bool = False) -> list[str]:
    """Invariants of the committed history itself (no client knowledge)."""
    bad: list[str] = []
    if snap.integrity != ["ok"]:
        bad.append(f"PRAGMA integrity_check: {snap.integrity[:5]}")
    revs = [c.revision for c in snap.changes]
    if revs:
        if revs[0] != 1:
            bad.append(f"history starts at revision {revs[0]}, expected 1 (nothing pruned)")
        if revs != list(range(revs[0], revs[0] + len(revs))):
            gaps = [(a, b) for a, b in itertools.pairwise(revs) if b != a + 1]
            bad.append(f"revisions not gap-free/strictly increasing: first gaps {gaps[:5]}")
        if snap.meta_revision != revs[-1]:
            bad.append(f"meta.revision {snap.meta_revision} != last change {revs[-1]}")
    for c in snap.changes:
        if c.kind == PUT:
            if c.rec is None or c.rec.get("revision") != c.revision or c.rec["run_id"] != c.run_id:
                bad.append(f"rev {c.revision}: record does not carry its revision/run_id")
        elif c.kind == DELETE:
            if c.rec is not None:
                bad.append(f"rev {c.revision}: DELETE with a record")
        else:
            bad.append(f"rev {c.revision}: unknown kind {c.kind}")

    for run_id, seq in snap.per_run().items():
        bad.extend(_check_run(run_id, seq, allow_cancel))

    # The runs table is exactly the last PUT of every run.
    last: dict[str, Change] = {}
    for c in snap.changes:
        last[c.run_id] = c
    for run_id, c in last.items():
        row = snap.runs.get(run_id)
        if c.kind == DELETE:
            if row is not None:
                bad.append(f"{run_id}: deleted in history but present in runs")
            continue
        if row is None:
            bad.append(f"{run_id}: rev {c.revision} in history but missing from runs")
            continue
        rec = c.rec
        assert rec is not None
        if row["record"] != rec:
            bad.append(f"{run_id}: runs.record != last change (rev {c.revision}): "
                       f"{row['record']} vs {rec}")
        cols = (row["version"], row["status"], row["fencing_token"], row["owner"],
                row["revision"])
        want = (rec["version"], rec["status"], rec["fencing_token"], _owner(rec), c.revision)
        if cols != want:
            bad.append(f"{run_id}: runs columns {cols} != record {want}")
    for run_id in snap.runs.keys() - last.keys():
        bad.append(f"{run_id}: in runs but never in the history")
    bad.extend(check_runs_table(snap))
    return bad


def check_runs_table(snap: Snapshot) -> list[str]:
    """The runs table is a checkpoint of the log: the mark is within the
    history, nothing above it was pruned, and every row is exactly the record
    some retained change wrote, no older than the mark allows."""
    if snap.table_runs is None:
        return []
    bad: list[str] = []
    if not 0 <= snap.materialized <= snap.meta_revision:
        bad.append(f"meta.materialized {snap.materialized} outside 0..{snap.meta_revision}")
    revs = snap.by_revision()
    low = min(revs) if revs else snap.meta_revision + 1
    if low > snap.materialized + 1:
        bad.append(f"changes above the materialized mark {snap.materialized} were pruned "
                   f"(history starts at {low})")
    last_at_mark: dict[str, Change] = {}
    for c in snap.changes:
        if c.revision <= snap.materialized:
            last_at_mark[c.run_id] = c
    for run_id, row in snap.table_runs.items():
        wrote = revs.get(row["revision"])
        if wrote is not None and (wrote.run_id != run_id
                                  or _sans_expiry(wrote.rec) != _sans_expiry(row["record"])):
            bad.append(f"{run_id}: runs row is not the record written at rev {row['revision']}")
        at_mark = last_at_mark.get(run_id)
        if at_mark is not None and row["revision"] < at_mark.revision:
            bad.append(f"{run_id}: runs row (rev {row['revision']}) is older than the mark "
                       f"allows (rev {at_mark.revision})")
    for run_id, c in last_at_mark.items():
        if c.kind == PUT and run_id not in snap.table_runs:
            bad.append(f"{run_id}: rev {c.revision} is below the mark but not in runs")
    return bad


def _check_run(run_id: str, seq: list[Change], allow_cancel: bool) -> list[str]:
    bad: list[str] = []
    prev: dict[str, Any] | None = None
    closed_tokens: set[int] = set()  # tokens whose lease was dropped (release/finish)
    token_owner: dict[int, str] = {}
    terminal_at: int | None = None
    for c in seq:
        where = f"{run_id} rev {c.revision}"
        if terminal_at is not None:
            bad.append(f"{where}: a change after the terminal write at rev {terminal_at}")
        if c.kind == DELETE:
            prev = None
            continue
        rec = c.rec
        assert rec is not None
        tok, owner, status = rec["fencing_token"], _owner(rec), rec["status"]
        if prev is None:
            if rec["version"] != 1:
                bad.append(f"{where}: first version is {rec['version']}")
        else:
            ptok = prev["fencing_token"]
            if rec["version"] != prev["version"] + 1:
                bad.append(f"{where}: version {prev['version']} -> {rec['version']}")
            if tok < ptok:
                bad.append(f"{where}: fencing token went backwards {ptok} -> {tok}")
            elif tok == ptok:
                if rec["attempt"] != prev["attempt"]:
                    bad.append(f"{where}: attempt moved without a token move")
                if owner is not None and _owner(prev) is None:
                    bad.append(f"{where}: a lease appeared under token {tok} without an "
                               "acquisition (token did not move)")
            else:
                if tok != ptok + 1:
                    bad.append(f"{where}: token jumped {ptok} -> {tok}")
                if status == CANCELLED and owner is None and allow_cancel:
                    pass
                elif status != RUNNING or owner is None:
                    bad.append(f"{where}: token moved {ptok} -> {tok} by a write that is not "
                               f"an acquisition (status {status}, owner {owner})")
                else:
                    bad.extend(_check_acquisition(where, prev, rec))
        if owner is not None:
            if tok in closed_tokens:
                bad.append(f"{where}: token {tok} writes again after its lease was dropped")
            first = token_owner.setdefault(tok, owner)
            if first != owner:
                bad.append(f"{where}: token {tok} held by two owners: {first!r} and {owner!r}")
        elif status != CANCELLED or not allow_cancel:
            closed_tokens.add(tok)
        if status in TERMINAL:
            terminal_at = c.revision
        prev = rec
    return bad


def _sans_expiry(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A record but its lease's expiry, which renewals from memory move into
    the runs row later than the change that wrote the record."""
    if rec is None or not rec.get("lease"):
        return rec
    return {**rec, "lease": [*rec["lease"][:2], None, *rec["lease"][3:]]}


def _check_acquisition(where: str, prev: dict[str, Any], rec: dict[str, Any]) -> list[str]:
    """An acquisition (token move) against the record it replaced."""
    bad: list[str] = []
    lease = rec["lease"]
    owner, acquired_at = lease[0], lease[1]
    plea = prev.get("lease")
    if prev["status"] in TERMINAL:
        bad.append(f"{where}: acquired a terminal run")
    if plea is None:
        if rec["attempt"] != prev["attempt"]:
            bad.append(f"{where}: attempt {prev['attempt']} -> {rec['attempt']} acquiring a "
                       "run without a lease (docs/SPEC.md §5.1: unchanged)")
        return bad
    powner, p_expires, p_delay = plea[0], plea[2], plea[4]
    if powner != owner and acquired_at < p_expires + p_delay:
        bad.append(f"{where}: {owner!r} granted at {acquired_at} a lease {powner!r} held "
                   f"until {p_expires + p_delay}")
    live_same = powner == owner and acquired_at < p_expires
    want = prev["attempt"] + (0 if live_same else 1)
    # the same owner's lease may have been renewed from memory past the stored
    # expiry (docs/SPEC.md §5.2): then the attempt stays too
    renewable = powner == owner and rec["attempt"] == prev["attempt"]
    if rec["attempt"] != want and not renewable:
        bad.append(f"{where}: attempt {prev['attempt']} -> {rec['attempt']}, expected {want}")
    return bad


def check_acks(snap: Snapshot, acks: list[dict[str, Any]]) -> list[str]:
    """Every write a client saw acknowledged is in the committed history, as
    acknowledged, and the final runs table is not behind it.

    An ack is ``{op, run_id, owner, sent_token (handle commands), token,
    version, revision, status}`` taken from the returned record."""
    bad: list[str] = []
    by_rev = snap.by_revision()
    seen: dict[int, dict[str, Any]] = {}
    for a in acks:
        where = f"ack {a['op']} {a['run_id']} by {a['owner']} rev {a['revision']}"
        c = by_rev.get(a["revision"])
        if c is None or c.rec is None or c.run_id != a["run_id"]:
            bad.append(f"{where}: not in the committed history (lost acknowledged write)")
            continue
        rec = c.rec
        got = (rec["version"], rec["fencing_token"], rec["status"])
        want = (a["version"], a["token"], a["status"])
        if got != want:
            bad.append(f"{where}: history has (version, token, status) {got}, ack said {want}")
        if a.get("sent_token") is not None and rec["fencing_token"] != a["sent_token"]:
            bad.append(f"{where}: fenced write with token {a['sent_token']} produced a record "
                       f"at token {rec['fencing_token']}")
        if a["op"] in ("acquire", "renew", "checkpoint") and _owner(rec) != a["owner"]:
            bad.append(f"{where}: record's lease owner is {_owner(rec)!r}")
        other = seen.get(a["revision"])
        if a["op"] == "renew" and other is not None and other["owner"] == a["owner"]:
            continue  # renewed from memory: the revision of the write it renewed
        if other is not None and (other["owner"], other["op"]) != (a["owner"], a["op"]):
            bad.append(f"{where}: the same revision was acknowledged to {other['owner']} "
                       f"({other['op']}) too")
        seen[a["revision"]] = a
        row = snap.runs.get(a["run_id"])
        if row is None:
            bad.append(f"{where}: run missing from the final runs table")
        elif row["fencing_token"] < a["token"] or row["version"] < a["version"]:
            bad.append(f"{where}: final run (token {row['fencing_token']}, version "
                       f"{row['version']}) is behind the ack (token {a['token']}, version "
                       f"{a['version']})")
    return bad


def fmt(problems: list[str], n: int = 25) -> str:
    more = f"\n... and {len(problems) - n} more" if len(problems) > n else ""
    return f"{len(problems)} violation(s):\n" + "\n".join(problems[:n]) + more
