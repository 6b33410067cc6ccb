"""One recording client: every call it makes becomes one line of the history
(torture/history.py), with its invocation and completion times and its
result: ok, failed with a code, or unknown because the connection dropped.

Mutations carry a request id (docs/SPEC.md §5.5). When a call's outcome is unknown
(transport failure, timeout) the client either retries it with the *same*
request id until it gets an answer (one operation spanning all attempts), or
abandons it (the operation stays unknown), as a real worker would.

Two transports (docs/STREAMS.md): ``unary`` calls every RPC; ``stream`` sends
every ledger mutation as a command on one long-lived ``Ledger.Execute`` stream
per client, one at a time (reads and the raw RunStore seam stay unary).
``mixed`` picks one of the two per client, by its seed. A stream command with
no answer within the call timeout, or on a stream that broke, is a transport
failure exactly like a unary UNAVAILABLE/DEADLINE_EXCEEDED (retried with the
same request id on a new stream); a result's ``error`` is the unary call's
status, read by the same helpers. Entries are the same either way, plus
``tp``, the transport the call went over.

Several coordinators (the PostgreSQL mode): a client is given every
coordinator's address and follows the leader. A refusal ``NOT_LEADER`` (a
standby, or a deposed leader: nothing was done) sends the call on to the
address its ``leader`` metadata names, or to the next coordinator when it
names none; a transport failure moves on to the next coordinator too. Either
way the call is retried with the *same* request id, so it stays one
operation, and a call whose outcome is unknown stays unknown. An entry also
records ``ep`` (the index of the coordinator address that gave the final
answer), ``at`` (when that attempt was sent) and ``nl`` (NOT_LEADER
redirects on the way).

Coordinators leading shards apart (``--lead-shards``): a refusal
``NOT_OWNER`` (the coordinator asked does not lead the shard: nothing was
done) is followed the same way, to the ``owner`` its metadata names, or
after a backoff to the next coordinator when it names none (``nl`` counts
these too). A ListRuns answer then covers the answering coordinator's
shards only: its entry says ``partial`` (a run it leaves out is not read
as absent).

A refusal that promises no effect (STORAGE_UNAVAILABLE: the database could
not commit) says so of its own attempt only: after an attempt whose outcome
is unknown, the call is retried (or abandoned) as after a transport failure.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import grpc
from _proc import CHANNEL_OPTIONS, call_status, status_reason, status_record
from google.rpc import error_details_pb2, status_pb2

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2_grpc, run_store_pb2_grpc
from fencepost.v1 import ledger_pb2 as lpb
from fencepost.v1 import run_store_pb2 as spb

from .history import LEDGER_WRITES, NO_EFFECT_CODES, WRITES, dict_to_run, run_to_dict

CALL_TIMEOUT_S = 4.0

TRANSPORTS = ("unary", "stream", "mixed")
# a ledger mutation's function name -> its Execute Command field (docs/STREAMS.md)
COMMAND_KINDS = {"acquire": "acquire", "renew": "renew", "checkpoint": "record_checkpoint",
                 "suspend": "suspend", "finish": "finish", "release": "release",
                 "cancel": "cancel", "resume": "request_resume", "delete_run": "delete_run"}
assert set(COMMAND_KINDS) == set(LEDGER_WRITES)
# Snapshot writes (the engine store's checkpoint, torture/snapshots.py) and
# their Execute Command fields. Recorded in a history of their own (the
# ledger's checkers never see them).
SNAPSHOT_KINDS = {"snapshot": "save_checkpoint", "snapshot_tx": "transaction"}
SNAPSHOT_FUNCS = (*SNAPSHOT_KINDS, "read_snapshot")
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def pick_transport(transport: str, seed: int) -> str:
    """The transport of one client: ``mixed`` picks unary or stream by its seed
    (from a generator of its own, so the workload's draws are unchanged)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    if transport == "mixed":
        return random.Random(f"transport-{seed}").choice(("unary", "stream"))
    return transport


@dataclass
class Attempt:
    """One attempt's result: the response, a definite refusal (a status with a
    fencepost reason), or a transport failure (its gRPC code's name)."""

    resp: Any = None
    refusal: status_pb2.Status | None = None
    failure: str = ""
    detail: str = ""  # what a protocol anomaly was (the stream answered out of turn...)


REDIRECTS = {"NOT_LEADER": "leader", "NOT_OWNER": "owner"}  # reason -> metadata naming where


def leader_hint(status: status_pb2.Status | None) -> str:
    """Where a NOT_LEADER (``leader``) or NOT_OWNER (``owner``) refusal sends
    the call ("" when none is known)."""
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == "fencepost" and info.reason in REDIRECTS:
                return str(info.metadata.get(REDIRECTS[info.reason], ""))
    return ""


def _status_attempt(status: status_pb2.Status) -> Attempt:
    if status_reason(status) is not None:
        return Attempt(refusal=status)
    return Attempt(failure=_CODE_NAMES.get(status.code, "UNKNOWN"), detail=status.message)


class _Ended:
    """The stream ended with OK (put on the results queue by the reader)."""


class ExecuteStream:
    """One ``Ledger.Execute`` stream used one command at a time. gRPC's thread
    sends what ``execute`` queues; a reader thread hands each result (or how the
    stream ended) back. A timeout or an ending leaves it ``broken``: the client
    then opens a new one."""

    def __init__(self, ledger: ledger_pb2_grpc.LedgerStub, name: str) -> None:
        self._out: queue.Queue[lpb.ExecuteRequest | None] = queue.Queue()
        self._in: queue.Queue[Any] = queue.Queue()
        self.ended = threading.Event()
        self.broken = False
        self._next_id = 0
        self._call = ledger.Execute(iter(self._out.get, None))
        threading.Thread(target=self._read, name=f"{name}-execute", daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self._call:
                for result in msg.results:
                    self._in.put(result)
            self._in.put(_Ended())
        except grpc.RpcError as err:
            self._in.put(err)
        except Exception as exc:  # pragma: no cover - surfaced as a failure of the command
            self._in.put(exc)
        finally:
            self.ended.set()

    @property
    def usable(self) -> bool:
        return not self.broken and not self.ended.is_set()

    def execute(self, kind: str, req: Any, timeout: float) -> Attempt:
        self._next_id += 1
        cid = self._next_id
        cmd = lpb.Command(id=cid)
        getattr(cmd, kind).CopyFrom(req)
        self._out.put(lpb.ExecuteRequest(commands=[cmd]))
        deadline = time.monotonic() + timeout
        try:
            got = self._in.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.broken = True
            return Attempt(failure="DEADLINE_EXCEEDED", detail="no answer on the stream")
        if isinstance(got, grpc.RpcError):
            self.broken = True
            status = call_status(got)
            if status_reason(status) in REDIRECTS:  # refused at stream start: nothing done
                assert status is not None
                return Attempt(refusal=status)
            code = got.code()  # type: ignore[attr-defined]
            return Attempt(failure=code.name if code is not None else "UNKNOWN",
                           detail="the stream broke")
        self.broken = True  # unless the answer is the one expected
        if isinstance(got, _Ended):
            return Attempt(failure="INTERNAL", detail="the stream ended OK, command unanswered")
        if isinstance(got, BaseException):
            return Attempt(failure="UNKNOWN", detail=f"reading the stream: {got!r}")
        answered = got.WhichOneof("kind")
        if got.id != cid:
            return Attempt(failure="INTERNAL", detail=f"result for id {got.id}, sent id {cid}")
        if answered == "error":
            self.broken = False
            return _status_attempt(got.error)
        if answered != kind:
            return Attempt(failure="INTERNAL", detail=f"a {answered} result for a {kind}")
        self.broken = False
        return Attempt(resp=getattr(got, kind))

    def close(self) -> None:
        self._out.put(None)  # half-close, then drop whatever is still on it
        self._call.cancel()


class _Endpoint:
    """One coordinator address: a channel and the three stubs on it."""

    def __init__(self, addr: str, credentials: grpc.ChannelCredentials | None) -> None:
        if credentials is not None:
            self.channel = grpc.secure_channel(addr, credentials, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.ledger = ledger_pb2_grpc.LedgerStub(self.channel)
        self.store = run_store_pb2_grpc.RunStoreStub(self.channel)
        self.engine = engine_store_pb2_grpc.EngineStoreStub(self.channel)


class Client:
    """A sequential client with its own channel per coordinator; thread-confined.

    ``addr`` is one address or every coordinator's (the client follows the
    leader); ``aliases`` maps an address a NOT_LEADER names to the one to dial
    (the harness's own probes skip the proxies)."""

    def __init__(
        self,
        name: str,
        addr: str | Sequence[str],
        out: IO[str],
        *,
        seed: int,
        hard_stop_ns: int,
        abandon_p: float = 0.3,
        lock: threading.Lock | None = None,
        transport: str = "unary",
        snap_out: IO[str] | None = None,
        certs: str | None = None,
        aliases: dict[str, str] | None = None,
        shards: int = 0,
    ) -> None:
        self.name = name
        self.shards = shards  # coordinators leading shards apart: the database's count
        self.snap_out = snap_out  # where snapshot operations are recorded
        self.transport = pick_transport(transport, seed)
        self._stream: ExecuteStream | None = None
        self.streams_opened = 0
        self.rng = random.Random(seed)
        self.out = out
        self.lock = lock
        self.hard_stop_ns = hard_stop_ns
        self.abandon_p = abandon_p
        self._credentials: grpc.ChannelCredentials | None = None
        if certs:  # mutual TLS: this client's certificate names it (CN = name)
            from .certs import client_credentials

            self._credentials = client_credentials(certs, name)
        self.endpoints = [addr] if isinstance(addr, str) else list(addr)
        self.aliases = dict(aliases or {})
        self._conns: dict[int, _Endpoint] = {}
        # where to start (a generator of its own: the workload's draws are unchanged)
        self.ep = random.Random(f"endpoint-{seed}").randrange(len(self.endpoints))
        self.redirects = 0
        self.seq = 0
        self.counts: dict[str, int] = {}

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        for conn in self._conns.values():
            conn.channel.close()
        self._conns.clear()

    # -- coordinators -----------------------------------------------------------

    def _conn(self) -> _Endpoint:
        conn = self._conns.get(self.ep)
        if conn is None:
            conn = self._conns[self.ep] = _Endpoint(self.endpoints[self.ep], self._credentials)
        return conn

    def _switch(self, ep: int) -> None:
        if ep != self.ep and self._stream is not None:  # the stream was to the old one
            self._stream.close()
            self._stream = None
        self.ep = ep

    def follow(self, leader: str) -> bool:
        """After NOT_LEADER or NOT_OWNER: go to ``leader`` (the address it
        named), else to the next coordinator. True when one was named."""
        self.redirects += 1
        addr = self.aliases.get(leader, leader)
        if not addr:
            self._switch((self.ep + 1) % len(self.endpoints))
            return False
        if addr not in self.endpoints:
            self.endpoints.append(addr)
        self._switch(self.endpoints.index(addr))
        return True

    # -- the two transports -----------------------------------------------------

    @staticmethod
    def _unary(method: Any, req: Any) -> Attempt:
        try:
            return Attempt(resp=method(req, timeout=CALL_TIMEOUT_S))
        except grpc.RpcError as err:
            status = call_status(err)
            if status_reason(status) is not None:  # a definite refusal
                return Attempt(refusal=status)
            code = err.code()  # type: ignore[attr-defined]
            return Attempt(failure=code.name if code is not None else "UNKNOWN")

    def _execute(self, f: str, req: Any) -> Attempt:
        """One attempt over the client's Execute stream (a new one when the last
        broke, timed out or ended)."""
        if self._stream is not None and not self._stream.usable:
            self._stream.close()
            self._stream = None
        if self._stream is None:
            self._stream = ExecuteStream(self._conn().ledger, self.name)
            self.streams_opened += 1
        kind = COMMAND_KINDS.get(f) or SNAPSHOT_KINDS[f]
        return self._stream.execute(kind, req, CALL_TIMEOUT_S)

    # -- the one call path ------------------------------------------------------

    def call(
        self, f: str, run: str, method: str, req: Any, args: dict[str, Any],
        *, may_abandon: bool = False,
    ) -> dict[str, Any]:
        """Make one logical call and record it; ``method`` is "service.Method"
        (ledger, store or engine), resolved on the coordinator each attempt
        goes to. Returns the recorded entry."""
        self.seq += 1
        write = f in WRITES or f in SNAPSHOT_KINDS
        rid = uuid.uuid4().hex if write else ""
        if write:
            req.request_id = rid
        streamed = self.transport == "stream" and (f in COMMAND_KINDS or f in SNAPSHOT_KINDS)
        entry: dict[str, Any] = {"id": f"{self.name}:{self.seq}", "c": self.name, "run": run,
                                 "f": f, "a": args, "rid": rid, "rec": None, "x": {},
                                 "code": "", "tf": 0, "tp": "stream" if streamed else "unary",
                                 "nl": 0}
        service, name = method.split(".")
        entry["inv"] = time.monotonic_ns()
        tries = 0
        while True:
            tries += 1
            entry["ep"], entry["at"] = self.ep, time.monotonic_ns()
            got = (self._execute(f, req) if streamed
                   else self._unary(getattr(getattr(self._conn(), service), name), req))
            if got.refusal is not None and status_reason(got.refusal) in REDIRECTS:
                # nothing was done here: on to the leader (owner), same request id
                entry["nl"] += 1
                named = self.follow(leader_hint(got.refusal))
                if time.monotonic_ns() > self.hard_stop_ns:
                    entry["st"] = "unknown" if entry["tf"] else "fail"
                    if not entry["tf"]:
                        entry["code"] = status_reason(got.refusal)
                    break
                time.sleep(self.rng.uniform(0, 0.01) if named else self.rng.uniform(0.05, 0.15))
                continue
            if (got.refusal is not None and entry["tf"] and write
                    and status_reason(got.refusal) in NO_EFFECT_CODES):
                # this attempt changed nothing, but an earlier one may have: the
                # operation's outcome is still unknown, as after a transport failure
                got = Attempt(failure=str(status_reason(got.refusal)),
                              detail="refused with no effect after an unknown attempt")
            if got.refusal is not None:  # a definite refusal, with the record it saw
                entry.update(st="fail", code=status_reason(got.refusal))
                seen = status_record(got.refusal)
                if seen is not None:
                    entry["rec"] = run_to_dict(seen)
                break
            if got.failure:
                entry["tf"] += 1
                entry["code"] = got.failure
                if got.detail:
                    entry["err"] = got.detail
                give_up = (
                    not write
                    or entry["code"] in ("INTERNAL", "UNKNOWN", "UNIMPLEMENTED")
                    or time.monotonic_ns() > self.hard_stop_ns
                    or (may_abandon and entry["tf"] == 1 and self.rng.random() < self.abandon_p)
                )
                if give_up:
                    entry["st"] = "unknown"
                    break
                if len(self.endpoints) > 1:  # it may be down: try the next coordinator
                    self._switch((self.ep + 1) % len(self.endpoints))
                time.sleep(self.rng.uniform(0.03, 0.15))
                continue
            entry["st"] = "ok"
            self._result(f, got.resp, entry)
            if f == "list" and self.shards:
                entry["x"]["partial"] = True
            break
        entry["cmp"] = None if entry["st"] == "unknown" else time.monotonic_ns()
        entry["tries"] = tries
        line = json.dumps(entry) + "\n"
        out = self.out if f not in SNAPSHOT_FUNCS else self.snap_out
        assert out is not None, "snapshot operations need a snap_out"
        if self.lock is not None:
            with self.lock:
                out.write(line)
        else:
            out.write(line)
        key = f"{f}:{entry['st']}:{entry['code']}"
        self.counts[key] = self.counts.get(key, 0) + 1
        return entry

    @staticmethod
    def _result(f: str, resp: Any, entry: dict[str, Any]) -> None:
        x = entry["x"]
        if f == "snapshot":
            x["saved"] = resp.saved
            return
        if f == "snapshot_tx":
            x["saved"] = resp.results[0].save_checkpoint.saved
            return
        if f == "read_snapshot":
            x["found"] = resp.found
            if resp.found:
                x.update(json.loads(resp.checkpoint.state.json))
            return
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
        return self.call("acquire", run, "ledger.Acquire",
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
            method = "ledger.Renew"
        elif f == "checkpoint":
            args.update(key=kw["key"], snapshot_version=kw["snapshot_version"])
            req = lpb.RecordCheckpointRequest(**base, key=kw["key"],
                                              snapshot_version=kw["snapshot_version"])
            method = "ledger.RecordCheckpoint"
        elif f == "suspend":
            args["approvals"] = kw.get("approvals", [])
            req = lpb.SuspendRequest(**base, pending_approval_ids=args["approvals"])
            method = "ledger.Suspend"
        elif f == "finish":
            args["status"] = kw["status"]
            req = lpb.FinishRequest(**base, status=kw["status"])
            if kw.get("outcome"):
                args["outcome"] = kw["outcome"]
                req.outcome.code = kw["outcome"]
            method = "ledger.Finish"
        elif f == "release":
            req = lpb.ReleaseRequest(**base)
            method = "ledger.Release"
        else:  # pragma: no cover
            raise ValueError(f)
        return self.call(f, run, method, req, args, may_abandon=True)

    def cancel(self, run: str) -> dict[str, Any]:
        return self.call("cancel", run, "ledger.Cancel",
                         lpb.CancelRequest(run_id=run, message=f"by {self.name}"), {})

    def resume(self, run: str) -> dict[str, Any]:
        return self.call("resume", run, "ledger.RequestResume",
                         lpb.RequestResumeRequest(run_id=run), {})

    def delete_run(self, run: str) -> dict[str, Any]:
        return self.call("delete_run", run, "ledger.DeleteRun",
                         lpb.DeleteRunRequest(run_id=run), {})

    def get_run(self, run: str) -> dict[str, Any]:
        return self.call("get_run", run, "ledger.GetRun", lpb.GetRunRequest(run_id=run), {})

    def validate(self, run: str, token: int) -> dict[str, Any]:
        return self.call("validate", run, "ledger.ValidateFence",
                         lpb.ValidateFenceRequest(run_id=run, fencing_token=token),
                         {"token": token})

    def list_runs(self) -> dict[str, Any]:
        return self.call("list", "*", "ledger.ListRuns", lpb.ListRunsRequest(page_size=1000),
                         {})

    def raw_get(self, run: str) -> dict[str, Any]:
        return self.call("raw_get", run, "store.Get", spb.GetRequest(run_id=run), {})

    def raw_create(self, record: dict[str, Any]) -> dict[str, Any]:
        return self.call("raw_create", record["run_id"], "store.Create",
                         spb.CreateRequest(run=dict_to_run(record)), {"record": record})

    def raw_cas(self, run: str, expected: int, nxt: dict[str, Any]) -> dict[str, Any]:
        return self.call("raw_cas", run, "store.CompareAndSet",
                         spb.CompareAndSetRequest(run_id=run, expected_version=expected,
                                                  next=dict_to_run(nxt)),
                         {"expected": expected, "next": nxt}, may_abandon=True)

    def raw_delete(self, run: str) -> dict[str, Any]:
        return self.call("raw_delete", run, "store.Delete", spb.DeleteRequest(run_id=run), {})

    # -- snapshots (the engine store's checkpoint of a run) ------------------------

    def snapshot(self, run: str, owner: str, token: int, sid: str, *, fenced: bool,
                 tx: bool) -> dict[str, Any]:
        """Write the run's snapshot (one engine checkpoint per run, step 0: the
        last write wins, as a plain snapshot key does) tagged with the writer's
        handle. ``fenced``: under the handle's fence; ``tx``: as a transaction
        with an effect result (``snapshot_tx``), else a single SaveCheckpoint."""
        state = json.dumps({"sid": sid, "owner": owner, "token": token})
        save = epb.EngineSaveCheckpointRequest(checkpoint=epb.EngineCheckpoint(
            run_id=run, step_index=0, state=epb.JsonValue(json=state)))
        fence = epb.Fence(run_id=run, fencing_token=token)
        args = {"owner": owner, "token": token, "sid": sid, "fenced": fenced}
        if tx:
            req = lpb.TransactionRequest(commands=[
                lpb.Command(id=1, save_checkpoint=save),
                lpb.Command(id=2, put_effect=epb.EnginePutEffectRequest(
                    key=self._effect_key(run, sid), result=epb.JsonValue(json=state))),
            ])
            if fenced:
                req.fence.CopyFrom(fence)
            return self.call("snapshot_tx", run, "ledger.Transact", req, args,
                             may_abandon=True)
        if fenced:
            save.fence.CopyFrom(fence)
        return self.call("snapshot", run, "engine.SaveCheckpoint", save, args,
                         may_abandon=True)

    def _effect_key(self, run: str, sid: str) -> str:
        """The transaction's effect key: in the run's shard when shards are
        led apart (a transaction across two owners is refused, SPEC §13)."""
        key = f"snapshot/{sid}"
        if self.shards:
            from fencepost_server.core.shards import shard_of

            want, i = shard_of(run, self.shards), 0
            while shard_of(key, self.shards) != want:
                i += 1
                key = f"snapshot/{sid}/{i}"
        return key

    def read_snapshot(self, run: str) -> dict[str, Any]:
        return self.call("read_snapshot", run, "engine.LatestCheckpoint",
                         epb.EngineLatestCheckpointRequest(run_id=run), {})
