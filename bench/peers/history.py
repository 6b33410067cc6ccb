"""The contention checker: what must never happen, on any backend.

Inputs, all on the machine's wall clock (servers and clients share it):

* grants ``(run_id, owner, token, sent, ack, held_until)``: an acquire that
  succeeded. The owner relies on the lease from ``ack`` until ``held_until``:
  the earliest of (its last successful acquire/renew's send time, floored to
  the millisecond, + ttl) and the moment it sent finish or release. A server
  that honours the lease can grant the run to someone else only after that.
* writes ``(run_id, owner, token, sent, ack, kind)``: fenced writes (renew,
  checkpoint, finish, release) that were accepted;
* finishes ``(run_id, owner, token, sent, ack)``.

Violations counted:

* **double grant**: two grants of one run whose holding intervals
  ``[ack, held_until)`` overlap and whose owners differ, or two grants of one
  run with the same token. (An owner that acquires a run again fences its own
  earlier handle, so that handle's interval ends when the new acquire is sent.);
* **double finish**: a run finished successfully more than once;
* **stale write**: a fenced write accepted with a token older than a grant of
  the same run acknowledged before the write was sent.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

Grant = tuple[str, str, int, float, float, float]
Write = tuple[str, str, int, float, float, str]
Finish = tuple[str, str, int, float, float]


def check(grants: list[Grant], writes: list[Write], finishes: list[Finish]) -> dict[str, Any]:
    by_run: dict[str, list[Grant]] = defaultdict(list)
    for g in grants:
        by_run[g[0]].append(g)
    double_grants = 0
    samples: list[str] = []
    for run_id, gs in by_run.items():
        # An owner that acquires the run again fences its own earlier handle:
        # it stops relying on that one when it sends the new acquire.
        by_owner: dict[str, list[int]] = defaultdict(list)
        for i, g in enumerate(sorted(gs, key=lambda g: g[3])):
            by_owner[g[1]].append(i)
        ordered = sorted(gs, key=lambda g: g[3])
        for idxs in by_owner.values():
            for i, j in itertools.pairwise(idxs):
                a, b = ordered[i], ordered[j]
                ordered[i] = (*a[:5], min(a[5], b[3]))
        gs[:] = sorted(ordered, key=lambda g: g[4])
        tokens: dict[int, int] = defaultdict(int)
        for g in gs:
            tokens[g[2]] += 1
        for token, n in tokens.items():
            if n > 1:
                double_grants += n - 1
                if len(samples) < 5:
                    samples.append(f"{run_id}: token {token} granted {n} times")
        for i, a in enumerate(gs):
            for b in gs[i + 1:]:
                if b[4] >= a[5]:
                    continue  # b acknowledged after a stopped holding: fine
                if a[1] != b[1] and a[2] != b[2]:
                    double_grants += 1
                    if len(samples) < 5:
                        samples.append(
                            f"{run_id}: {a[1]} token {a[2]} held until {a[5]:.6f}, "
                            f"{b[1]} token {b[2]} granted at {b[4]:.6f} "
                            f"({(a[5] - b[4]) * 1000:.3f} ms overlap)"
                        )
    finish_count: dict[str, int] = defaultdict(int)
    for f in finishes:
        finish_count[f[0]] += 1
    double_finishes = sum(n - 1 for n in finish_count.values() if n > 1)
    stale_writes = 0
    for w in writes:
        run_id, _, token, sent = w[0], w[1], w[2], w[3]
        if any(g[2] > token and g[4] < sent for g in by_run.get(run_id, ())):
            stale_writes += 1
            if len(samples) < 5:
                samples.append(f"{run_id}: {w[5]} with token {token} accepted after a newer "
                               "grant was acknowledged")
    takeovers = 0
    for gs in by_run.values():
        takeovers += sum(1 for g in gs if g[2] > 1)
    return {
        "runs": len(by_run),
        "grants": len(grants),
        "grants_above_token_1": takeovers,
        "accepted_writes": len(writes),
        "finishes": len(finishes),
        "double_grants": double_grants,
        "double_finishes": double_finishes,
        "stale_writes": stale_writes,
        "samples": samples,
        "ok": double_grants == 0 and double_finishes == 0 and stale_writes == 0,
    }
