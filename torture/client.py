"""One recording client: every call it makes becomes one line of the history
(torture/history.py), with its invocation and completion times and its
result: ok, failed with a code, or unknown because the connection dropped.

Mutations carry a request id (SPEC §5.5). When a call's outcome is unknown
(transport failure, timeout) the client either retries it with the *same*
request id until it gets an answer (one operation spanning all attempts), or
abandons it (the operation stays unknown), as a real worker would.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from typing import IO, Any

import grpc
from _proc import CHANNEL_OPTIONS, error_record
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from fencepost.v1 import ledger_pb2 as lpb
from fencepost.v1 import ledger_pb2_grpc, run_store_pb2_grpc
from fencepost.v1 import run_store_pb2 as spb

from .history import WRITES, dict_to_run, run_to_dict

CALL_TIMEOUT_S = 4.0


def error_reason(err: grpc.RpcError) -> str | None:
    """The fencepost ErrorInfo reason of a refusal, or None (transport failure)."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except Exception:
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == "fencepost":
                return str(info.reason)
    return None


class Client:
    """A sequential client with its own channel; thread-confined."""

    def __init__(
        self,
        name: str,
        addr: str,
        out: IO[str],
        *,
        seed: int,
        hard_stop_ns: int,
        abandon_p: float = 0.3,
        lock: threading.Lock | None = None,
    ) -> None:
        self.name = name
        self.rng = random.Random(seed)
        self.out = out
        self.lock = lock
        self.hard_stop_ns = hard_stop_ns
        self.abandon_p = abandon_p
        self.channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.ledger = ledger_pb2_grpc.LedgerStub(self.channel)
        self.store = run_store_pb2_grpc.RunStoreStub(self.channel)
        self.seq = 0
        self.counts: dict[str, int] = {}

    def close(self) -> None:
        self.channel.close()

    # -- the one call path ------------------------------------------------------

    def call(
        self, f: str, run: str, method: Any, req: Any, args: dict[str, Any],
        *, may_abandon: bool = False,
    ) -> dict[str, Any]:
        """Make one logical call and record it. Returns the recorded entry."""
        self.seq += 1
        write = f in WRITES
        rid = uuid.uuid4().hex if write else ""
        if write:
            req.request_id = rid
        entry: dict[str, Any] = {"id": f"{self.name}:{self.seq}", "c": self.name, "run": run,
                                 "f": f, "a": args, "rid": rid, "rec": None, "x": {},
                                 "code": "", "tf": 0}
        entry["inv"] = time.monotonic_ns()
        tries = 0
        while True:
            tries += 1
            try:
                resp = method(req, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as err:
                why = error_reason(err)
                if why is not None:  # a definite refusal, with the record it saw
                    entry.update(st="fail", code=why)
                    seen = error_record(err)
                    if seen is not None:
                        entry["rec"] = run_to_dict(seen)
                    break
                code = err.code()  # type: ignore[attr-defined]
                entry["tf"] += 1
                entry["code"] = code.name if code is not None else "UNKNOWN"
                give_up = (
                    not write
                    or entry["code"] in ("INTERNAL", "UNKNOWN", "UNIMPLEMENTED")
                    or time.monotonic_ns() > self.hard_stop_ns
                    or (may_abandon and entry["tf"] == 1 and self.rng.random() < self.abandon_p)
                )
                if give_up:
                    entry["st"] = "unknown"
                    break
                time.sleep(self.rng.uniform(0.03, 0.15))
                continue
            entry["st"] = "ok"
            self._result(f, resp, entry)
            break
        entry["cmp"] = None if entry["st"] == "unknown" else time.monotonic_ns()
        entry["tries"] = tries
        line = json.dumps(entry) + "\n"
        if self.lock is not None:
            with self.lock:
                self.out.write(line)
        else:
            self.out.write(line)
        key = f"{f}:{entry['st']}:{entry['code']}"
        self.counts[key] = self.counts.get(key, 0) + 1
        return entry

    @staticmethod
    def _result(f: str, resp: Any, entry: dict[str, Any]) -> None:
        x = entry["x"]
        if f == "list":
            x["runs"] = {r.run_id: run_to_dict(r) for r in resp.runs}
            x["revision"] = resp.revision
        elif f == "validate":
            x.update(current=resp.current, found=resp.found, token=resp.fencing_token,
                     status=int(resp.status), revision=resp.revision)
        elif f == "delete_run":
            x.update(deleted=True, revision=resp.revision, token=resp.fencing_token)
        elif f == "raw_delete":
            x.update(deleted=resp.deleted, revision=resp.revision)
        elif f == "raw_get":
            x.update(found=resp.found, revision=resp.revision)
            if resp.found:
                entry["rec"] = run_to_dict(resp.run)
        elif f == "raw_create":
            x["created"] = resp.created
            entry["rec"] = run_to_dict(resp.run)
        elif f == "raw_cas":
            x["swapped"] = resp.swapped
            if resp.HasField("run"):
                entry["rec"] = run_to_dict(resp.run)
        else:
            entry["rec"] = run_to_dict(resp.run)
            if f == "get_run":
                x["revision"] = resp.revision

    # -- typed helpers ------------------------------------------------------------

    def acquire(self, run: str, owner: str, ttl: int, delay: int = 0) -> dict[str, Any]:
        return self.call("acquire", run, self.ledger.Acquire,
                         lpb.AcquireRequest(run_id=run, owner=owner, lease_ttl_ms=ttl,
                                            lock_delay_ms=delay),
                         {"owner": owner, "ttl": ttl, "delay": delay})

    def fenced(self, f: str, run: str, owner: str, token: int, since: int,
               **kw: Any) -> dict[str, Any]:
        """A handle command; ``since`` is the version at which the handle was
        established (its acquisition or the raw write that installed it)."""
        args: dict[str, Any] = {"owner": owner, "token": token, "since": since}
        base = {"run_id": run, "owner": owner, "fencing_token": token}
        if f == "renew":
            req: Any = lpb.RenewRequest(**base)
            method = self.ledger.Renew
        elif f == "checkpoint":
            args.update(key=kw["key"], snapshot_version=kw["snapshot_version"])
            req = lpb.RecordCheckpointRequest(**base, key=kw["key"],
                                              snapshot_version=kw["snapshot_version"])
            method = self.ledger.RecordCheckpoint
        elif f == "suspend":
            args["approvals"] = kw.get("approvals", [])
            req = lpb.SuspendRequest(**base, pending_approval_ids=args["approvals"])
            method = self.ledger.Suspend
        elif f == "finish":
            args["status"] = kw["status"]
            req = lpb.FinishRequest(**base, status=kw["status"])
            if kw.get("outcome"):
                args["outcome"] = kw["outcome"]
                req.outcome.code = kw["outcome"]
            method = self.ledger.Finish
        elif f == "release":
            req = lpb.ReleaseRequest(**base)
            method = self.ledger.Release
        else:  # pragma: no cover
            raise ValueError(f)
        return self.call(f, run, method, req, args, may_abandon=True)

    def cancel(self, run: str) -> dict[str, Any]:
        return self.call("cancel", run, self.ledger.Cancel,
                         lpb.CancelRequest(run_id=run, message=f"by {self.name}"), {})

    def resume(self, run: str) -> dict[str, Any]:
        return self.call("resume", run, self.ledger.RequestResume,
                         lpb.RequestResumeRequest(run_id=run), {})

    def delete_run(self, run: str) -> dict[str, Any]:
        return self.call("delete_run", run, self.ledger.DeleteRun,
                         lpb.DeleteRunRequest(run_id=run), {})

    def get_run(self, run: str) -> dict[str, Any]:
        return self.call("get_run", run, self.ledger.GetRun, lpb.GetRunRequest(run_id=run), {})

    def validate(self, run: str, token: int) -> dict[str, Any]:
        return self.call("validate", run, self.ledger.ValidateFence,
                         lpb.ValidateFenceRequest(run_id=run, fencing_token=token),
                         {"token": token})

    def list_runs(self) -> dict[str, Any]:
        return self.call("list", "*", self.ledger.ListRuns, lpb.ListRunsRequest(page_size=1000),
                         {})

    def raw_get(self, run: str) -> dict[str, Any]:
        return self.call("raw_get", run, self.store.Get, spb.GetRequest(run_id=run), {})

    def raw_create(self, record: dict[str, Any]) -> dict[str, Any]:
        return self.call("raw_create", record["run_id"], self.store.Create,
                         spb.CreateRequest(run=dict_to_run(record)), {"record": record})

    def raw_cas(self, run: str, expected: int, nxt: dict[str, Any]) -> dict[str, Any]:
        return self.call("raw_cas", run, self.store.CompareAndSet,
                         spb.CompareAndSetRequest(run_id=run, expected_version=expected,
                                                  next=dict_to_run(nxt)),
                         {"expected": expected, "next": nxt}, may_abandon=True)

    def raw_delete(self, run: str) -> dict[str, Any]:
        return self.call("raw_delete", run, self.store.Delete, spb.DeleteRequest(run_id=run), {})
