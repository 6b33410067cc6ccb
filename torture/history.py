"""The recorded history: one JSON line per logical operation, written by the
client that issued it (workers, the nemesis's post-restart probes, the
liveness phase), and its normalisation into per-run register operations.

An operation line::

    {"id": "w2.1:57", "c": "w2.1", "run": "t3", "f": "renew",
     "a": {...arguments...}, "rid": "<request id>",
     "inv": <monotonic ns>, "cmp": <monotonic ns> | null,
     "st": "ok" | "fail" | "unknown", "code": "<ErrorInfo reason or gRPC code>",
     "rec": <record, core.records.record_to_dict layout> | null,
     "x": {...other result fields...}, "tries": n, "tf": <transport failures>,
     "tp": "unary" | "stream"}

``inv``/``cmp`` are CLOCK_MONOTONIC readings (comparable across processes of one
machine). ``st == "unknown"`` means the client never learned the outcome (the
connection dropped or the call timed out, and it did not, or could not, retry
with the same request id until answered); a retried call that was finally
answered is one operation spanning from its first invocation to that answer.
``tp`` is the transport the call went over: a unary RPC, or a command on a
``Ledger.Execute`` stream (torture/client.py); the checkers do not look at it.
A line may also carry ``err``, what the last transport failure was.

With several coordinators (the PostgreSQL mode) a line also carries ``ep``,
the index of the coordinator address that gave the final answer, ``at``, when
that final attempt was sent, and ``nl``, how many NOT_LEADER refusals sent the
call on to another coordinator (torture/client.py). The harness adds one more
kind of operation, ``extend``: a new leader's extension of a live lease at its
takeover, a write no client asked for (read from the committed history,
torture/failover.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# function names
LEDGER_WRITES = ("acquire", "renew", "checkpoint", "suspend", "finish", "release", "cancel",
                 "resume", "delete_run")
RAW_WRITES = ("raw_create", "raw_cas", "raw_delete")
READS = ("get_run", "raw_get", "validate", "list")
FENCED = ("renew", "checkpoint", "suspend", "finish", "release")
CONVERGING = ("suspend", "finish", "release", "cancel", "resume")
WRITES = LEDGER_WRITES + RAW_WRITES
EXTEND = "extend"  # a new leader's lease extension (no client's operation)

# statuses (fencepost.v1.RunStatus)
QUEUED, RUNNING, SUSPENDED, COMPLETED, FAILED, CANCELLED = 1, 2, 3, 4, 5, 6
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})

# refusals the server promises change nothing, with no record attached
NO_EFFECT_CODES = frozenset({"STORAGE_FULL", "STORAGE_UNAVAILABLE", "RUN_VALIDATION_ERROR",
                             "NOT_LEADER"})


def canon(rec: dict[str, Any] | None) -> str:
    """The identity of a record value: every field, revision included, but
    the lease's expiry, which a renewal moves from memory without a new
    version (docs/SPEC.md §5.2); the renewals check holds expiries to account."""
    if rec is None:
        return ""
    lease = rec.get("lease")
    if lease is not None:
        rec = {**rec, "lease": [*lease[:2], None, *lease[3:]]}
    return json.dumps(rec, sort_keys=True, separators=(",", ":"))


def content(rec: dict[str, Any]) -> str:
    """A record's identity without its server-assigned revision (raw writes)."""
    return canon({k: v for k, v in rec.items() if k != "revision"})


def owner_of(rec: dict[str, Any] | None) -> str | None:
    lease = None if rec is None else rec.get("lease")
    return None if lease is None else lease[0]


def run_to_dict(run: Any) -> dict[str, Any]:
    """A fencepost.v1.Run as core.records.record_to_dict lays it out, so client
    observations compare directly with the server's committed ``changes`` rows."""

    def ms(ts: Any) -> int:
        return int(ts.seconds) * 1000 + int(ts.nanos) // 1_000_000

    d: dict[str, Any] = {
        "schema": run.schema,
        "run_id": run.run_id,
        "version": run.version,
        "status": int(run.status),
        "attempt": run.attempt,
        "fencing_token": run.fencing_token,
        "created_at": ms(run.created_at),
        "updated_at": ms(run.updated_at),
        "revision": run.revision,
    }
    if run.HasField("lease"):
        le = run.lease
        d["lease"] = [le.owner, ms(le.acquired_at), ms(le.expires_at), le.ttl_ms,
                      le.lock_delay_ms]
    if run.HasField("checkpoint_ref"):
        c = run.checkpoint_ref
        d["checkpoint_ref"] = [c.key, c.snapshot_version, ms(c.saved_at)]
    if run.HasField("outcome"):
        o = run.outcome
        d["outcome"] = [o.code, o.message if o.HasField("message") else None]
    if run.HasField("suspension"):
        s = run.suspension
        d["suspension"] = [ms(s.suspended_at), list(s.pending_approval_ids)]
    return d


def dict_to_run(d: dict[str, Any]) -> Any:
    """The inverse of ``run_to_dict`` (raw-seam requests)."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from fencepost.v1 import record_pb2 as rpb

    def ts(ms: int) -> Timestamp:
        s, m = divmod(ms, 1000)
        return Timestamp(seconds=s, nanos=m * 1_000_000)

    run = rpb.Run(
        schema=d["schema"], run_id=d["run_id"], version=d["version"], status=d["status"],
        attempt=d["attempt"], fencing_token=d["fencing_token"],
        created_at=ts(d["created_at"]), updated_at=ts(d["updated_at"]),
        revision=d.get("revision", 0),
    )
    if d.get("lease") is not None:
        o, acq, exp, ttl, delay = d["lease"]
        run.lease.CopyFrom(rpb.Lease(owner=o, acquired_at=ts(acq), expires_at=ts(exp),
                                     ttl_ms=ttl, lock_delay_ms=delay))
    if d.get("checkpoint_ref") is not None:
        k, sv, at = d["checkpoint_ref"]
        run.checkpoint_ref.CopyFrom(rpb.CheckpointRef(key=k, snapshot_version=sv,
                                                      saved_at=ts(at)))
    if d.get("outcome") is not None:
        code, msg = d["outcome"]
        run.outcome.CopyFrom(rpb.Outcome(code=code, message=msg))
    if d.get("suspension") is not None:
        at, ids = d["suspension"]
        run.suspension.CopyFrom(rpb.Suspension(suspended_at=ts(at), pending_approval_ids=ids))
    return run


@dataclass
class Op:
    """One recorded logical operation (see the module docstring)."""

    id: str
    client: str
    run: str
    f: str
    inv: int
    cmp: int | None
    st: str
    code: str = ""
    a: dict[str, Any] = field(default_factory=dict)
    rec: dict[str, Any] | None = None
    x: dict[str, Any] = field(default_factory=dict)
    rid: str = ""
    tries: int = 1
    tf: int = 0
    tp: str = "unary"  # the transport: "unary" or "stream" (recordings before it: unary)
    ep: int = 0  # which coordinator address gave the final answer
    at: int = 0  # when the final attempt was sent (0: not recorded, use inv)
    nl: int = 0  # NOT_LEADER redirects

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Op:
        return cls(
            id=d["id"], client=d["c"], run=d["run"], f=d["f"], inv=d["inv"], cmp=d.get("cmp"),
            st=d["st"], code=d.get("code") or "", a=d.get("a") or {}, rec=d.get("rec"),
            x=d.get("x") or {}, rid=d.get("rid") or "", tries=d.get("tries", 1),
            tf=d.get("tf", 0), tp=d.get("tp") or "unary", ep=d.get("ep", 0),
            at=d.get("at", 0), nl=d.get("nl", 0),
        )

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "c": self.client, "run": self.run, "f": self.f, "inv": self.inv,
                "cmp": self.cmp, "st": self.st, "code": self.code, "a": self.a,
                "rec": self.rec, "x": self.x, "rid": self.rid, "tries": self.tries,
                "tf": self.tf, "tp": self.tp, "ep": self.ep, "at": self.at, "nl": self.nl}

    @property
    def ok(self) -> bool:
        return self.st == "ok"

    @property
    def is_write(self) -> bool:
        return self.f in WRITES

    def handle(self) -> tuple[str, int] | None:
        if self.f in FENCED:
            return (self.a["owner"], self.a["token"])
        return None

    def brief(self) -> str:
        """A one-line description for violation reports."""
        args = ",".join(f"{k}={v}" for k, v in self.a.items()
                        if k not in ("next", "record", "pre"))
        if "next" in self.a:
            nx = self.a["next"]
            args += (f",next=(v{nx['version']},tok{nx['fencing_token']},"
                     f"owner={owner_of(nx)},st{nx['status']})")
        res = self.st if self.st != "fail" else f"fail:{self.code}"
        if self.st == "unknown":
            res = f"unknown({self.code})"
        r = self.rec
        if r is not None:
            res += (f" -> v{r['version']} tok{r['fencing_token']} st{r['status']} "
                    f"owner={owner_of(r)} rev{r['revision']}")
        elif self.x:
            res += f" {self.x}"
        cmp = "inf" if self.cmp is None else f"{self.cmp / 1e9:.3f}"
        return (f"[{self.id} {self.f}({self.run}; {args}) @{self.inv / 1e9:.3f}..{cmp} "
                f"{res}]")


def write_ops(path: Path, ops: Iterable[Op]) -> None:
    with open(path, "a") as f:
        for op in ops:
            f.write(json.dumps(op.to_json()) + "\n")


def read_ops(paths: Iterable[Path]) -> list[Op]:
    out: list[Op] = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    out.append(Op.from_json(json.loads(line)))
    out.sort(key=lambda o: o.inv)
    return out


def per_run(ops: Iterable[Op]) -> Iterator[tuple[str, list[Op]]]:
    by: dict[str, list[Op]] = {}
    for op in ops:
        by.setdefault(op.run, []).append(op)
    yield from sorted(by.items())
