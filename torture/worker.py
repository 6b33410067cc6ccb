"""A torture worker process: a few client threads, each a worker identity of
its own, issue randomized ledger commands and raw compare-and-sets on a small
set of runs (so contention is high) until the deadline, recording every call.

Run as ``python -m torture.worker '<json config>'`` (the runner does this).
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import REPO  # noqa: F401  (puts tests/system on sys.path)
from .client import Client
from .history import QUEUED, RUNNING, TERMINAL, owner_of

COMPLETED, FAILED, CANCELLED = 4, 5, 6

# action mix per profile: (ledger session, raw CAS session, read, operator)
PROFILES: dict[str, tuple[float, float, float, float]] = {
    "default": (0.50, 0.20, 0.20, 0.10),
    "fencing": (0.45, 0.40, 0.05, 0.10),  # raw lease steals under live handles
}
TTLS = (300, 500, 800, 1200)
MAX_TTL_MS = max(TTLS)
LOCK_DELAY_MS = 200


class Actor:
    """One client thread's workload."""

    def __init__(self, client: Client, runs: list[str], profile: str, deadline_ns: int,
                 snapshots: str = "") -> None:
        self.c = client
        # "fenced" / "unfenced": every checkpoint also writes the run's snapshot
        # (torture/snapshots.py), under the handle's fence or without one
        self.snapshots = snapshots
        self.rng = client.rng
        self.owner = client.name
        self.runs = runs
        self.mix = PROFILES[profile]
        self.deadline_ns = deadline_ns
        self.tokens: dict[str, int] = {}
        self.raw_n = 0

    def run(self) -> None:
        while time.monotonic_ns() < self.deadline_ns:
            self.step()

    def note(self, e: dict[str, Any]) -> dict[str, Any] | None:
        rec = e.get("rec")
        if rec is not None:
            run = rec["run_id"]
            self.tokens[run] = max(self.tokens.get(run, 0), rec["fencing_token"])
        return rec if e["st"] == "ok" else None

    def step(self) -> None:
        run = self.rng.choice(self.runs)
        r = self.rng.random()
        session, raw, read, _ = self.mix
        if r < session:
            self.session(run)
        elif r < session + raw:
            self.raw(run)
        elif r < session + raw + read:
            self.read(run)
        else:
            self.operator(run)

    def think(self, ttl: int) -> None:
        if self.rng.random() < 0.05:  # a stall past the ttl: someone may take over
            time.sleep(ttl / 1000 + self.rng.uniform(0.05, 0.3))
        else:
            time.sleep(self.rng.uniform(0, 0.02))

    # -- ledger ------------------------------------------------------------------

    def session(self, run: str) -> None:
        ttl = self.rng.choice(TTLS)
        delay = LOCK_DELAY_MS if self.rng.random() < 0.1 else 0
        e = self.c.acquire(run, self.owner, ttl, delay)
        rec = self.note(e)
        if rec is None:
            if e["code"] == "RUN_ALREADY_TERMINAL" and self.rng.random() < 0.6:
                self.note(self.c.delete_run(run))
            elif e["code"] == "RUN_SUSPENDED" and self.rng.random() < 0.6:
                self.note(self.c.resume(run))
            elif e["code"] == "RUN_LEASE_HELD":
                time.sleep(self.rng.uniform(0.01, 0.1))
            return
        if self.snapshots:
            self.c.read_snapshot(run)  # a new holder resumes from the run's snapshot
        self.hold(run, self.owner, rec["fencing_token"], rec["version"], ttl)

    def hold(self, run: str, owner: str, tok: int, since: int, ttl: int) -> None:
        """Fenced writes with a handle, then release / finish / suspend / walk away."""
        for k in range(self.rng.randint(1, 4)):
            self.think(ttl)
            if owner == self.owner and self.rng.random() < 0.08:
                # re-acquire our own live lease: a new token that fences the old handle
                again = self.note(self.c.acquire(run, owner, ttl))
                if again is None:
                    return
                old = (tok, since)
                tok, since = again["fencing_token"], again["version"]
                self.note(self.c.fenced("renew", run, owner, old[0], old[1]))  # must be refused
            if self.rng.random() < 0.5:
                e = self.c.fenced("renew", run, owner, tok, since)
            else:
                e = self.checkpoint(run, owner, tok, since, k, ttl)
            if self.note(e) is None:
                return  # lost (or unknown): give the handle up
        self.think(ttl)
        r = self.rng.random()
        if r < 0.45:
            self.note(self.c.fenced("release", run, owner, tok, since))
        elif r < 0.58:
            self.note(self.c.fenced("finish", run, owner, tok, since, status=COMPLETED))
        elif r < 0.63:
            self.note(self.c.fenced("finish", run, owner, tok, since, status=FAILED,
                                    outcome="boom"))
        elif r < 0.66:
            self.note(self.c.fenced("finish", run, owner, tok, since, status=CANCELLED))
        elif r < 0.78:
            self.note(self.c.fenced("suspend", run, owner, tok, since, approvals=["ok-1"]))
        # else: walk away; the lease runs out

    def checkpoint(self, run: str, owner: str, tok: int, since: int, k: int,
                   ttl: int) -> dict[str, Any]:
        """A checkpoint boundary as the run-store design does it: point the
        record at the snapshot (RecordCheckpoint, fenced by the handle), then
        write the snapshot. A stall in between is the design's residual
        window: a takeover can land there. With snapshots "fenced" the snapshot
        write carries the handle's fence (alone, or in a transaction with an
        effect result) and is refused once the handle is stale; "unfenced"
        writes it regardless, as a store that knows nothing of the lease."""
        self.raw_n += 1
        key = f"{self.owner}/{self.raw_n}"
        e = self.c.fenced("checkpoint", run, owner, tok, since, key=key, snapshot_version=k)
        if not self.snapshots or e["st"] != "ok":
            return e
        if self.rng.random() < 0.2:  # stalled between the fence and the snapshot write
            time.sleep(ttl / 1000 + self.rng.uniform(0.05, 0.3))
        else:
            time.sleep(self.rng.uniform(0, 0.01))
        s = self.c.snapshot(run, owner, tok, f"{self.c.name}:{self.raw_n}",
                            fenced=self.snapshots == "fenced", tx=self.rng.random() < 0.3)
        return e if s["st"] == "ok" else s  # refused or unknown: give the handle up

    # -- the raw seam ----------------------------------------------------------------

    def raw(self, run: str) -> None:
        g = self.c.raw_get(run)
        self.note(g)
        if g["st"] != "ok":
            return
        self.raw_n += 1
        marker = f"raw:{self.owner}:{self.raw_n}"
        now = int(time.time() * 1000)
        if not g["x"].get("found"):
            if self.rng.random() < 0.5:
                rec = {"schema": 1, "run_id": run, "version": 1, "status": QUEUED, "attempt": 1,
                       "fencing_token": self.tokens.get(run, 0) + self.rng.randint(1, 3),
                       "created_at": now, "updated_at": now, "revision": 0,
                       "checkpoint_ref": [marker, 0, now]}
                self.note(self.c.raw_create(rec))
            return
        cur = g["rec"]
        nxt = copy.deepcopy(cur)
        nxt["version"] = cur["version"] + 1
        nxt["revision"] = 0
        nxt["checkpoint_ref"] = [marker, self.raw_n, cur["updated_at"]]
        # a fresh owner name (under this client's principal, which mutual TLS
        # binds owners to): its handles never come back
        thief = f"{self.owner}/~{self.raw_n}"
        ttl = self.rng.choice(TTLS)
        r = self.rng.random()
        if cur["status"] == RUNNING and cur.get("lease"):
            if r < 0.45:  # steal the lease: a new holder, so a new token (docs/SPEC.md §1)
                nxt["lease"][0] = thief
                nxt["fencing_token"] += 1
            elif r < 0.65:  # take over with a new token
                nxt["fencing_token"] += 1
                nxt["attempt"] += 1
                nxt["lease"] = [thief, cur["updated_at"], cur["updated_at"] + ttl, ttl, 0]
            elif r < 0.85:
                pass  # touch
            else:  # drop the lease
                nxt["status"] = QUEUED
                nxt.pop("lease", None)
        elif cur["status"] == QUEUED and r < 0.5:
            nxt["status"] = RUNNING
            nxt["fencing_token"] += 1
            nxt["lease"] = [thief, cur["updated_at"], cur["updated_at"] + ttl, ttl, 0]
        e = self.c.raw_cas(run, cur["version"], nxt)
        got = self.note(e)
        if got is None or not e["x"].get("swapped"):
            return
        if owner_of(got) == thief and got["status"] == RUNNING and got["status"] not in TERMINAL:
            # act as the handle the raw write installed
            self.hold(run, thief, got["fencing_token"], got["version"], ttl)

    # -- reads and operators -----------------------------------------------------------

    def read(self, run: str) -> None:
        r = self.rng.random()
        if r < 0.4:
            self.note(self.c.get_run(run))
        elif r < 0.7:
            self.note(self.c.raw_get(run))
        elif r < 0.9:
            tok = self.tokens.get(run, 1) - self.rng.randint(0, 1)
            self.c.validate(run, max(1, tok))
        else:
            self.c.list_runs()

    def operator(self, run: str) -> None:
        r = self.rng.random()
        if r < 0.2:
            self.note(self.c.cancel(run))
        elif r < 0.55:
            self.note(self.c.resume(run))
        elif r < 0.85:
            self.note(self.c.delete_run(run))
        else:
            self.note(self.c.raw_delete(run))


def main(cfg: dict[str, Any]) -> int:
    out_dir = Path(cfg["out_dir"])
    threads: list[threading.Thread] = []
    clients: list[Client] = []
    files = []
    errors: list[BaseException] = []
    for t in range(cfg["threads"]):
        name = f"w{cfg['index']}.{t}"
        f = open(out_dir / f"ops-{name}.jsonl", "w", buffering=1)
        files.append(f)
        snapshots = cfg.get("snapshots", "")
        snap_out = None
        if snapshots:
            snap_out = open(out_dir / f"snapshots-{name}.jsonl", "w", buffering=1)
            files.append(snap_out)
        client = Client(name, cfg["addr"], f, seed=cfg["seed"] * 1000 + t,
                        hard_stop_ns=cfg["hard_stop_ns"],
                        transport=cfg.get("transport", "unary"), snap_out=snap_out,
                        certs=cfg.get("certs"), shards=cfg.get("shards", 0))
        clients.append(client)
        actor = Actor(client, cfg["runs"], cfg["profile"], cfg["deadline_ns"], snapshots)

        def body(a: Actor = actor) -> None:
            try:
                a.run()
            except BaseException as exc:  # surfaced through the exit code
                errors.append(exc)
                raise

        threads.append(threading.Thread(target=body, name=name))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for c in clients:
        c.close()
    for f in files:
        f.close()
    print(json.dumps({c.name: {"transport": c.transport, "streams_opened": c.streams_opened,
                               "counts": c.counts} for c in clients}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
