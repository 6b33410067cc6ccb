"""Many worker processes against one server process (docs/SPEC.md §5.1-5.2, §9).

Eight worker processes, each with its own owner, loop for ~8 s over 120 run ids
(a few of them hot) with 300-500 ms ttls, make fenced writes, and randomly
stall well past their ttl so other workers take the run over. Afterwards the
server's committed history (the ``changes`` table) must show, for every run,
strictly increasing fencing tokens on every acquisition, one owner per token,
no fenced write accepted from a superseded token, no run finished twice, and
every write a worker saw acknowledged exactly as acknowledged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _history import check_acks, check_history, fmt, load
from _proc import running_server

WORKERS = 8
RUNS = 120
HOT = 5
DURATION_S = 8.0
MIN_TAKEOVERS = 8  # token moves past a stalled holder that then saw RUN_LEASE_LOST

WORKER_SCRIPT = Path(__file__).with_name("_worker.py")


def _read_log(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_many_workers_fencing_history(tmp_path: Path) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    err_files: list[Any] = []
    logs = [tmp_path / f"worker-{i}.jsonl" for i in range(WORKERS)]
    with running_server(tmp_path) as srv:
        try:
            for i in range(WORKERS):
                cfg = {
                    "addr": srv.address, "owner": f"worker-{i}", "seed": 1000 + i,
                    "runs": RUNS, "hot": HOT, "hot_p": 0.6, "stall_p": 0.3,
                    "duration": DURATION_S, "index": i, "workers": WORKERS,
                    "out": str(logs[i]),
                }
                err_files.append(open(tmp_path / f"worker-{i}.err", "wb"))
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER_SCRIPT), json.dumps(cfg)],
                    stdin=subprocess.DEVNULL,
                    stderr=err_files[-1],
                ))
            deadline = time.monotonic() + DURATION_S + 30
            for i, p in enumerate(procs):
                rc = p.wait(max(0.1, deadline - time.monotonic()))
                err = (tmp_path / f"worker-{i}.err").read_text(errors="replace")
                assert rc == 0, f"worker {i} exited {rc}:\n{err[-3000:]}"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
            for f in err_files:
                f.close()
        assert srv.proc is not None and srv.proc.poll() is None, "server died:\n" + srv.log_tail()
        rc = srv.stop()
        assert rc == 0, f"graceful stop exited {rc}:\n{srv.log_tail()}"

    entries = [e for log in logs for e in _read_log(log)]
    done = [e for e in entries if e["t"] == "done"]
    assert len(done) == WORKERS, "a worker did not finish its log"
    acks = [e for e in entries if e["t"] == "ack"]
    errs = [e for e in entries if e["t"] == "err"]
    reasons = Counter(e["reason"] for e in errs)
    # Only refusals the scenario can produce; no transport errors, no INTERNAL.
    unexpected = set(reasons) - {"RUN_LEASE_HELD", "RUN_LEASE_LOST", "RUN_ALREADY_TERMINAL"}
    assert not unexpected, f"unexpected errors: {reasons}"

    snap = load(srv.db_path)
    problems = check_history(snap)
    problems += check_acks(snap, acks)

    # Every committed change was acknowledged to exactly one worker (nothing
    # happened that nobody asked for, and no write was answered twice).
    # (a renewal answered from memory carries the revision of the write it
    # renewed: it is no change of its own)
    acked_revs = Counter(a["revision"] for a in acks if a["op"] != "renew")
    acked_revs.update({a["revision"] for a in acks if a["op"] == "renew"} - acked_revs.keys())
    for c in snap.changes:
        if acked_revs.get(c.revision, 0) != 1:
            problems.append(f"rev {c.revision} ({c.run_id}) acknowledged "
                            f"{acked_revs.get(c.revision, 0)} times")

    # A fenced write acknowledged under token t must come before any change
    # that moved the run past t. A RUN_LEASE_LOST must be justified by the
    # committed record the server decided on (attached to the refusal): a
    # different token, or the lease gone or held by someone else.
    per_run = snap.per_run()
    by_rev = snap.by_revision()
    moved_at: dict[tuple[str, int], int] = {}  # (run, token) -> first rev past it
    token_owner: dict[tuple[str, int], str] = {}
    for run_id, seq in per_run.items():
        for c in seq:
            assert c.rec is not None
            tok = c.rec["fencing_token"]
            for t in range(1, tok):
                moved_at.setdefault((run_id, t), c.revision)
            if c.rec.get("lease") is not None:
                token_owner.setdefault((run_id, tok), c.rec["lease"][0])
    for a in acks:
        if a["sent_token"] is None:
            continue
        m = moved_at.get((a["run_id"], a["sent_token"]))
        if m is not None and m < a["revision"]:
            problems.append(f"{a['op']} by {a['owner']} on {a['run_id']} with token "
                            f"{a['sent_token']} accepted at rev {a['revision']}, after the "
                            f"token was superseded at rev {m}")
    lost = [e for e in errs if e["reason"] == "RUN_LEASE_LOST"]
    for e in lost:
        seen = e.get("seen")
        c = by_rev.get(seen["revision"]) if seen else None
        if seen is None or c is None or c.rec is None or c.run_id != e["run_id"]:
            problems.append(f"RUN_LEASE_LOST without a committed observed record: {e}")
            continue
        lease = c.rec.get("lease")
        if (c.rec["fencing_token"], None if lease is None else lease[0]) != (
            seen["token"], seen["owner"]
        ):
            problems.append(f"RUN_LEASE_LOST observed a record the history does not have: {e}")
        if seen["token"] == e["sent_token"] and seen["owner"] == e["owner"]:
            problems.append(f"unjustified RUN_LEASE_LOST (the handle was current): {e}")
        if token_owner.get((e["run_id"], e["sent_token"])) != e["owner"]:
            problems.append(f"RUN_LEASE_LOST for a token the worker never held: {e}")

    # A worker that re-acquired its own live lease got a new token; its write
    # with the old token must have been refused.
    stale = [e for e in entries if e.get("op", "").startswith("stale-")]
    problems += [f"stale handle's write accepted: {e}" for e in stale if e["t"] == "ack"]
    problems += [f"stale handle's write refused with {e['reason']}" for e in stale
                 if e["t"] == "err" and e["reason"] != "RUN_LEASE_LOST"]

    assert not problems, fmt(problems)

    # Not vacuous: many runs, many fenced writes, and real takeovers of stalled
    # holders that were then refused.
    assert len(per_run) >= 100, f"only {len(per_run)} runs were touched"
    fenced = [a for a in acks if a["op"] in ("renew", "checkpoint")]
    assert len(fenced) >= 150, f"only {len(fenced)} fenced writes were acknowledged"
    lost_keys = {(e["run_id"], e["sent_token"], e["owner"]) for e in lost}
    takeovers = moves_to_other_owner = 0
    for run_id, seq in per_run.items():
        prev: dict[str, Any] | None = None
        for c in seq:
            rec = c.rec
            assert rec is not None
            if prev is not None and rec["fencing_token"] > prev["fencing_token"]:
                plea = prev.get("lease")
                if plea is not None and plea[0] != rec["lease"][0]:
                    moves_to_other_owner += 1
                    if (run_id, prev["fencing_token"], plea[0]) in lost_keys:
                        takeovers += 1
            prev = rec
    finished = sum(1 for seq in per_run.values() if seq[-1].rec and seq[-1].rec["status"] == 4)
    print(f"\nruns={len(per_run)} revisions={len(snap.changes)} acks={len(acks)} "
          f"fenced={len(fenced)} errors={dict(reasons)} "
          f"takeovers={moves_to_other_owner} "
          f"takeovers_then_lost={takeovers} finished={finished} "
          f"stalls={sum(d['counts'].get('stall', 0) for d in done)} stale={len(stale)}")
    assert takeovers >= MIN_TAKEOVERS, (
        f"only {takeovers} takeovers of a stalled holder that then got RUN_LEASE_LOST"
    )
    assert reasons["RUN_LEASE_HELD"] > 0 and finished > 0 and len(stale) >= 5
