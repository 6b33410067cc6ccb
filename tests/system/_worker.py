"""A worker process for test_many_workers: acquires random runs with short
ttls, makes fenced writes, sometimes stalls past its ttl, then finishes or
releases. Every answer it gets is appended to a JSON-lines log:

    {"t": "ack", op, run_id, owner, sent_token, token, version, revision, status}
    {"t": "err", op, run_id, owner, sent_token, reason, seen (the observed record)}
    {"t": "done", ...counters}

Run as a script: python _worker.py '<json config>'.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).parent))

from _proc import CHANNEL_OPTIONS, error_record, reason

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb

TIMEOUT = 10.0


class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.owner: str = cfg["owner"]
        self.rng = random.Random(cfg["seed"])
        self.cfg = cfg
        self.run_ids = [f"run-{i:03d}" for i in range(cfg["runs"])]
        self.hot = self.run_ids[: cfg["hot"]]
        self.out = open(cfg["out"], "w", buffering=1)  # closed in main()
        self.channel = grpc.insecure_channel(cfg["addr"], options=CHANNEL_OPTIONS)
        self.stub = ledger_pb2_grpc.LedgerStub(self.channel)
        self.counts: dict[str, int] = {}

    def log(self, **entry: Any) -> None:
        self.out.write(json.dumps(entry) + "\n")
        kind = entry["t"] + ":" + entry.get("reason", entry["op"])
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def call(self, op: str, run_id: str, sent: int | None, fn: Any, req: Any) -> Any:
        """One RPC; returns the returned Run, or the error reason (str)."""
        try:
            resp = fn(req, timeout=TIMEOUT)
        except grpc.RpcError as err:
            why = reason(err)
            seen = error_record(err)  # the record the server decided on
            self.log(t="err", op=op, run_id=run_id, owner=self.owner, sent_token=sent,
                     reason=why,
                     seen=None if seen is None else {
                         "revision": seen.revision, "token": seen.fencing_token,
                         "version": seen.version,
                         "owner": seen.lease.owner if seen.HasField("lease") else None,
                     })
            return why
        run: rpb.Run = resp.run
        self.log(t="ack", op=op, run_id=run_id, owner=self.owner, sent_token=sent,
                 token=run.fencing_token, version=run.version, revision=run.revision,
                 status=int(run.status))
        return run

    def acquire(self, run_id: str, ttl: int) -> rpb.Run | str:
        return self.call("acquire", run_id, None, self.stub.Acquire,
                         pb.AcquireRequest(run_id=run_id, owner=self.owner, lease_ttl_ms=ttl))

    def fenced_write(self, run_id: str, token: int, n: int, prefix: str = "") -> rpb.Run | str:
        if self.rng.random() < 0.5:
            return self.call(prefix + "renew", run_id, token, self.stub.Renew,
                             pb.RenewRequest(run_id=run_id, owner=self.owner,
                                             fencing_token=token))
        return self.call(prefix + "checkpoint", run_id, token, self.stub.RecordCheckpoint,
                         pb.RecordCheckpointRequest(run_id=run_id, owner=self.owner,
                                                    fencing_token=token,
                                                    key=f"{self.owner}/{n}",
                                                    snapshot_version=n))

    def end(self, run_id: str, token: int, finish: bool) -> rpb.Run | str:
        if finish:
            return self.call("finish", run_id, token, self.stub.Finish,
                             pb.FinishRequest(run_id=run_id, owner=self.owner,
                                              fencing_token=token,
                                              status=rpb.RUN_STATUS_COMPLETED))
        return self.call("release", run_id, token, self.stub.Release,
                         pb.ReleaseRequest(run_id=run_id, owner=self.owner,
                                           fencing_token=token))

    def pause(self, ttl: int) -> None:
        """Mostly a short think; sometimes a stall well past the ttl."""
        if self.rng.random() < self.cfg["stall_p"]:
            self.counts["stall"] = self.counts.get("stall", 0) + 1
            time.sleep(ttl / 1000 + self.rng.uniform(0.1, 0.4))
        else:
            time.sleep(self.rng.uniform(0, 0.02))

    def sweep(self) -> None:
        """Touch this worker's own slice of the id space once, so the run
        covers every id; no stalls here."""
        for run_id in self.run_ids[self.cfg["index"]:: self.cfg["workers"]]:
            got = self.acquire(run_id, 500)
            if isinstance(got, str):
                continue
            got2 = self.fenced_write(run_id, got.fencing_token, 0)
            if isinstance(got2, str):
                continue
            self.end(run_id, got.fencing_token,
                     finish=run_id not in self.hot and self.rng.random() < 0.3)

    def cycle(self, n: int) -> None:
        hot = self.rng.random() < self.cfg["hot_p"]
        run_id = self.rng.choice(self.hot if hot else self.run_ids)
        ttl = self.rng.randint(300, 500)
        got = self.acquire(run_id, ttl)
        tries = 0
        while got == "RUN_LEASE_HELD" and tries < 2:
            # Wait for the holder's lease to run out and try to take over.
            tries += 1
            time.sleep(self.rng.uniform(0.15, 0.5))
            got = self.acquire(run_id, ttl)
        if isinstance(got, str):
            time.sleep(0.005)
            return
        token = got.fencing_token
        if self.rng.random() < 0.2:
            # Re-acquire our own live lease: a new token that fences our old
            # handle, whose next write must be refused (docs/SPEC.md §5.1).
            again = self.acquire(run_id, ttl)
            if isinstance(again, str):
                return
            self.fenced_write(run_id, token, n * 10, "stale-")  # expected: RUN_LEASE_LOST
            token = again.fencing_token
        for i in range(self.rng.randint(1, 4)):
            self.pause(ttl)
            w = self.fenced_write(run_id, token, n * 10 + i + 1)
            if isinstance(w, str):
                return  # the handle is dead (lease lost): abandon it
        self.pause(ttl)
        finish_p = 0.02 if run_id in self.hot else 0.35
        self.end(run_id, token, finish=self.rng.random() < finish_p)

    def main(self) -> None:
        deadline = time.monotonic() + self.cfg["duration"]
        self.sweep()
        n = 0
        while time.monotonic() < deadline:
            n += 1
            self.cycle(n)
        self.log(t="done", op="done", cycles=n, counts=self.counts)
        self.out.close()
        self.channel.close()


if __name__ == "__main__":
    Worker(json.loads(sys.argv[1])).main()
