"""The ``watch`` checker: what the run's watcher (torture/watcher.py) was
given through the SDK's ``Client.watch(cursor=...)``, against the committed
change log (the server's own file, or the copy out of PostgreSQL).

Which changes count. The runner starts the workers only once the watcher's
first watch has a cursor for every shard (its ``ready`` line), so it had
begun before any client wrote; at the end it tells the watcher each shard's
last committed revision (its ``target``), and the watcher reads on until it
has reached them. So every committed change above the ``ready`` cursor of
its shard and at or below the ``target`` of its shard must be delivered. A
change committed after the target was read (none is, with every run
finished and no fault left) is not required, but if delivered it is checked
like the others.

* every change that counts is delivered, exactly once (none missed, none
  twice), across every fault, resume and restart from a saved cursor;
* every change delivered is committed, at that revision, with the same run,
  kind, version, fencing token, status and lease owner (nothing invented),
  and carries its run's shard (SPEC §13);
* within each shard, changes are delivered in increasing revision order;
* the watch never raised anything but ``UnavailableError`` (a long outage:
  the watcher then resumes from its cursor). The torture servers keep every
  revision (``--history-revisions`` 10^12, no age limit), so
  ``RevisionCompactedError`` cannot be right here: it is a violation.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fencepost_server.core.shards import shard_of

from .checkers import Violation
from .history import CANCELLED, COMPLETED, FAILED, QUEUED, RUNNING, SUSPENDED

STATUS_NAMES = {QUEUED: "queued", RUNNING: "running", SUSPENDED: "suspended",
                COMPLETED: "completed", FAILED: "failed", CANCELLED: "cancelled"}
PUT, DELETE = 1, 2
MAX = 1 << 62
TOLERATED = ("UnavailableError",)  # the SDK gave up after a long outage: resumed
# the SDK's log line (watch.log) when one of its streams ends and it resumes those shards
STREAM_ENDED = re.compile(r"watch of shards .* ended \((\w+)")


def _cursor(text: str) -> dict[int, int]:
    body = text.split(":", 1)[1] if ":" in text else ""
    return {int(s): int(r) for s, r in (p.split("=") for p in body.split(",") if p)}


@dataclass
class Watched:
    """watch.jsonl, read back."""

    count: int = 0
    start: dict[int, int] | None = None  # per shard: the cursor once every shard had one
    events: list[dict[str, Any]] = field(default_factory=list)
    target: dict[int, int] | None = None
    end: dict[str, Any] | None = None  # the caught-up / behind / abandoned line
    watches: int = 0
    restarts: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    # how the SDK's streams ended, by code, each resumed by the SDK (watch.log)
    stream_ends: dict[str, int] = field(default_factory=dict)
    expected: int = 0  # the changes that count (check_watch)

    @classmethod
    def load(cls, path: Path) -> Watched | None:
        """None when the run had no watcher (recorded before there was one)."""
        if not path.exists():
            return None
        w = cls()
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            e = json.loads(line)
            k = e["k"]
            if k == "ev":
                w.events.append(e)
            elif k == "start":
                w.watches += 1
            elif k == "ready":
                w.count, w.start = int(e["count"]), _cursor(e["cursor"])
            elif k == "restart":
                w.restarts += 1
            elif k == "error":
                w.errors.append(e)
            elif k == "target":
                w.target = {int(s): int(r) for s, r in e["upto"].items()}
            elif k in ("caught-up", "behind", "abandoned"):
                w.end = e
        log = path.with_name("watch.log")
        if log.exists():
            ends = Counter(m[1] for m in STREAM_ENDED.finditer(log.read_text(errors="replace")))
            w.stream_ends = dict(ends.most_common())
        return w

    def summary(self) -> dict[str, Any]:
        return {
            "delivered": len(self.events),
            "expected": self.expected,
            "stream_ends": self.stream_ends,
            "watches": self.watches,
            "restarts": self.restarts,
            "errors": dict(Counter(e["type"] for e in self.errors)),
            "shards": self.count,
            "ended": None if self.end is None else self.end["k"],
            "catch_up_s": None if self.end is None else self.end.get("seconds"),
        }


def _describe(c: Any) -> str:
    if c.kind == DELETE or c.rec is None:
        return f"a delete of {c.run_id}"
    r = c.rec
    lease = r.get("lease")
    return (f"{c.run_id} v{r['version']} token {r['fencing_token']} "
            f"{STATUS_NAMES.get(r['status'], r['status'])}"
            + (f" held by {lease[0]!r}" if lease else ""))


def _delivered(e: dict[str, Any]) -> str:
    if e["kind"] == "delete":
        return f"a delete of {e['run']}"
    return (f"{e['run']} v{e['ver']} token {e['tok']} {e['st']}"
            + (f" held by {e['own']!r}" if e.get("own") else ""))


def _differs(e: dict[str, Any], c: Any) -> bool:
    if e["run"] != c.run_id or (e["kind"] == "delete") != (c.kind == DELETE):
        return True
    if c.kind == DELETE or c.rec is None:
        return False
    r = c.rec
    lease = r.get("lease")
    return (e["ver"], e["tok"], e["st"], e.get("own")) != (
        r["version"], r["fencing_token"], STATUS_NAMES.get(r["status"]),
        lease[0] if lease else None)


def check_watch(w: Watched, snap: Any) -> list[Violation]:
    bad: list[Violation] = []

    def v(msg: str) -> None:
        bad.append(Violation("watch", msg))

    if w.start is None:
        v(f"the watcher never had a cursor for every shard ({w.watches} watches started); "
          "no change could be checked")
        return bad
    n = w.count
    by_rev = {c.revision: c for c in snap.changes}
    w.expected = sum(1 for c in snap.changes
                     if w.start.get(shard_of(c.run_id, n), 0) < c.revision <= (
                         MAX if w.target is None else w.target.get(shard_of(c.run_id, n), 0)))
    seen: dict[int, dict[str, Any]] = {}
    last: dict[int, dict[str, Any]] = {}  # shard -> the last event delivered in it
    got: dict[int, list[int]] = defaultdict(list)  # shard -> revisions delivered, in order
    for e in w.events:
        rev, shard = e["rev"], e["shard"]
        where = f"{e['run']} rev {rev} (shard {shard}, watch #{e['n']})"
        if shard != shard_of(e["run"], n):
            v(f"{where}: delivered as shard {shard}, but {e['run']} is in shard "
              f"{shard_of(e['run'], n)}")
            shard = shard_of(e["run"], n)
        if rev in seen:
            v(f"{where}: delivered twice (first by watch #{seen[rev]['n']})")
            continue
        c = by_rev.get(rev)
        if c is None:
            v(f"{where}: delivered {_delivered(e)}, but the committed history has nothing at "
              "that revision (invented)")
        elif _differs(e, c):
            v(f"{where}: delivered {_delivered(e)}, but the committed history has "
              f"{_describe(c)} at that revision")
        seen[rev] = e
        prev = last.get(shard)
        if prev is not None and prev["rev"] >= rev:
            v(f"{where}: delivered after revision {prev['rev']} of the same shard "
              f"({prev['run']}, watch #{prev['n']}): out of order")
        last[shard] = e
        got[shard].append(rev)
    for shard in got:
        got[shard].sort()
    for c in snap.changes:
        shard = shard_of(c.run_id, n)
        if c.revision <= w.start.get(shard, 0) or c.revision in seen:
            continue
        if w.target is not None and c.revision > w.target.get(shard, 0):
            continue  # committed after the last revisions were read: not required
        revs = got.get(shard, [])
        i = bisect.bisect_left(revs, c.revision)
        before = seen[revs[i - 1]] if i else None
        after = seen[revs[i]] if i < len(revs) else None
        context = ", ".join(
            [f"after revision {before['rev']} (watch #{before['n']})" if before else
             "before any change of the shard"]
            + ([f"before revision {after['rev']} (watch #{after['n']})"] if after else
               ["and nothing later in the shard"]))
        v(f"{c.run_id} rev {c.revision} (shard {shard}): {_describe(c)} was committed but "
          f"never delivered; the watcher got the shard {context}")
    for e in w.errors:
        if e["type"] in TOLERATED:
            continue
        why = (" (the torture servers keep every revision: nothing could be pruned)"
               if e["type"] == "RevisionCompactedError" else "")
        v(f"watch #{e['n']} raised {e['type']}: {e['msg'][:300]}{why}; resumed from "
          f"{e['cursor'][:200]}")
    if w.end is None:
        v("the watcher recorded no end: it did not finish catching up")
    elif w.end["k"] == "behind":
        behind = {s: top for s, top in (w.target or {}).items()
                  if _cursor(w.end["cursor"]).get(s, 0) < top}
        v(f"the watcher did not reach the last committed revision of shards "
          f"{sorted(behind)[:10]} within {w.end['seconds']} s of being asked")
    return bad
