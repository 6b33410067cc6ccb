"""One async client per backend, all with the same five commands.

``acquire(run_id, owner, ttl_ms) -> token``; ``renew``, ``checkpoint``,
``finish`` and ``release`` take the handle ``(run_id, owner, token)``. A lease
refusal raises :class:`~peers.semantics.Refused`; anything else that fails
raises the client library's own error. Each client process opens one backend
object and shares it among its asyncio clients, as e2e.py shares one channel.

Round trips per command (no contention):

=================  =======  ========================================================
backend            trips    how
=================  =======  ========================================================
fencepost-unary    1        one unary RPC (``LedgerStub``) per command
fencepost-stream   1 / n    raw protocol: one hand-written Execute dispatcher per client
                            process, so commands of *different owners* share messages
                            (no SDK user can do this: an SDK Client has one owner)
fencepost-fleet    1        the public SDK as a fleet uses it: one ``fencepost.Client``
                            per worker (owner), so each Execute message carries that
                            worker's one command; leases tracked on its KeepAlive stream
fencepost-engine   1 / n    the public SDK as an engine process uses it: one
                            ``fencepost.Client`` per process for all its runs, so the
                            SDK coalesces the process's commands into shared messages
fencepost-pg-*     as       the two SDK shapes above (``fencepost-pg-fleet``,
                   above    ``fencepost-pg-engine``) against one coordinator whose store
                            is PostgreSQL (``--db postgresql://...``), not a SQLite file
etcd               2        Range, then Txn(compare mod_revision == read, put);
                            a lost compare returns the current value in the Txn's
                            failure branch and the command re-decides (1 more trip)
postgres           1        one statement (INSERT .. ON CONFLICT / UPDATE .. WHERE
                            token, owner); a refusal costs a SELECT to say why
redis              1        one EVALSHA of the command's Lua script
echo-fleet,        as       the two SDK shapes against bench/echo_server.py: a Python
echo-engine        above    gRPC Ledger that answers every command at once with a fixed
                            record and stores nothing (no writer, no disk); not a peer
                            but the ceiling any Python gRPC server has for these shapes
                            on this machine (no contention run: it grants everything)
=================  =======  ========================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from google.rpc import error_details_pb2, status_pb2

from fencepost._ids import new_request_id
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb

from . import semantics as S
from .semantics import Refused

RPC_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 20.0

BACKENDS = ("fencepost-unary", "fencepost-stream", "fencepost-fleet", "fencepost-engine",
            "fencepost-pg-fleet", "fencepost-pg-engine", "etcd", "postgres", "redis",
            "echo-fleet", "echo-engine")
# the SDK's two shapes against bench/echo_server.py, a Ledger that answers at
# once and stores nothing: the ceiling of any Python gRPC server for them
ECHO_BACKENDS = ("echo-fleet", "echo-engine")
SDK_BACKENDS = ("fencepost-fleet", "fencepost-engine", "fencepost-pg-fleet",
                "fencepost-pg-engine", *ECHO_BACKENDS)
# fencepost with its PostgreSQL store: they need PostgreSQL's binaries, like the peer
PG_BACKENDS = ("fencepost-pg-fleet", "fencepost-pg-engine")
PEERS = ("etcd", "postgres", "redis")
ROUND_TRIPS = {
    "fencepost-unary": "1",
    "fencepost-stream": "1 shared (raw)",
    "fencepost-fleet": "1 (SDK)",
    "fencepost-engine": "1 shared (SDK)",
    "fencepost-pg-fleet": "1 (SDK)",
    "fencepost-pg-engine": "1 shared (SDK)",
    "etcd": "2",
    "postgres": "1",
    "redis": "1",
    "echo-fleet": "1 (SDK; no server work)",
    "echo-engine": "1 shared (SDK; no server work)",
}


class Backend(Protocol):
    async def acquire(self, run_id: str, owner: str, ttl_ms: int) -> int: ...
    async def renew(self, run_id: str, owner: str, token: int) -> None: ...
    async def checkpoint(
        self, run_id: str, owner: str, token: int, key: str, snapshot: int
    ) -> None: ...
    async def finish(self, run_id: str, owner: str, token: int) -> None: ...
    async def release(self, run_id: str, owner: str, token: int) -> None: ...
    async def close(self) -> None: ...
    def stats(self) -> dict[str, float]: ...


# -- fencepost -------------------------------------------------------------------

_REFUSING = {
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED,
}
_CODE_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


_REASONS = {
    "RUN_LEASE_HELD": "held",
    "RUN_LEASE_LOST": "lost",
    "RUN_ALREADY_TERMINAL": "terminal",
    "RUN_SUSPENDED": "suspended",
    "RUN_NOT_FOUND": "not_found",
}


def _reason(status: status_pb2.Status) -> str:
    """The ErrorInfo reason fencepost attaches to every refusal, shortened."""
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return _REASONS.get(info.reason, info.reason.lower())
    return "refused"


def _unary_status(exc: grpc.aio.AioRpcError) -> status_pb2.Status:
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            return status_pb2.Status.FromString(value)
    return status_pb2.Status()


def _fencepost_request(kind: str, run_id: str, owner: str, token: int, **kw: Any) -> Any:
    if kind == "renew":
        return pb.RenewRequest(run_id=run_id, owner=owner, fencing_token=token)
    if kind == "record_checkpoint":
        return pb.RecordCheckpointRequest(
            run_id=run_id, owner=owner, fencing_token=token,
            key=kw["key"], snapshot_version=kw["snapshot"],
        )
    if kind == "finish":
        return pb.FinishRequest(
            run_id=run_id, owner=owner, fencing_token=token, status=rpb.RUN_STATUS_COMPLETED
        )
    if kind == "release":
        return pb.ReleaseRequest(run_id=run_id, owner=owner, fencing_token=token)
    raise ValueError(kind)


class FencepostUnary:
    """One grpc.aio channel per client process; one unary RPC per command."""

    def __init__(self, address: str, channels: int = 1) -> None:
        self._channels = [grpc.aio.insecure_channel(address) for _ in range(channels)]
        self._stubs = [ledger_pb2_grpc.LedgerStub(ch) for ch in self._channels]
        self._next = itertools.cycle(self._stubs)

    async def connect(self) -> None:
        for ch in self._channels:
            await asyncio.wait_for(ch.channel_ready(), CONNECT_TIMEOUT_S)

    async def _call(self, method: str, request: Any) -> Any:
        stub = next(self._next)
        try:
            return await getattr(stub, method)(request, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSING:
                raise Refused(_reason(_unary_status(exc))) from None
            raise

    async def acquire(self, run_id: str, owner: str, ttl_ms: int) -> int:
        r = await self._call(
            "Acquire", pb.AcquireRequest(run_id=run_id, owner=owner, lease_ttl_ms=ttl_ms)
        )
        return int(r.run.fencing_token)

    async def renew(self, run_id: str, owner: str, token: int) -> None:
        await self._call("Renew", _fencepost_request("renew", run_id, owner, token))

    async def checkpoint(
        self, run_id: str, owner: str, token: int, key: str, snapshot: int
    ) -> None:
        await self._call(
            "RecordCheckpoint",
            _fencepost_request("record_checkpoint", run_id, owner, token,
                               key=key, snapshot=snapshot),
        )

    async def finish(self, run_id: str, owner: str, token: int) -> None:
        await self._call("Finish", _fencepost_request("finish", run_id, owner, token))

    async def release(self, run_id: str, owner: str, token: int) -> None:
        await self._call("Release", _fencepost_request("release", run_id, owner, token))

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close(None)

    def stats(self) -> dict[str, float]:
        return {}


class StreamBroken(Exception):
    """The Execute stream ended: its unanswered commands have unknown outcome."""


class ExecuteDispatcher:
    """Commands multiplexed on one ``Ledger.Execute`` stream (the SDK batching).

    ``submit`` appends the command to a buffer and returns a future; a writer
    task sends everything buffered as ONE ExecuteRequest. It runs one
    event-loop turn after the first submit, so every command issued in the
    same turn (and all those issued while the previous write was in flight)
    goes in one message. A reader task routes each result by its id to the
    command's future. No timer, no added delay.
    """

    def __init__(self, stub: ledger_pb2_grpc.LedgerStub) -> None:
        self._call = stub.Execute()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[pb.CommandResult]] = {}
        self._buffer: list[pb.Command] = []
        self._wake = asyncio.Event()
        self._broken: BaseException | None = None
        self.messages_sent = 0
        self.commands_sent = 0
        self.messages_received = 0
        self._writer = asyncio.create_task(self._write_loop())
        self._reader = asyncio.create_task(self._read_loop())

    def submit(self, command: pb.Command) -> asyncio.Future[pb.CommandResult]:
        """Queue ``command`` (its id is set here); the future gets its result."""
        if self._broken is not None:
            raise StreamBroken(repr(self._broken))
        cid = next(self._ids)
        command.id = cid
        fut: asyncio.Future[pb.CommandResult] = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        self._buffer.append(command)
        self._wake.set()
        return fut

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self._buffer = self._buffer, []
                if batch:
                    self.messages_sent += 1
                    self.commands_sent += len(batch)
                    await self._call.write(pb.ExecuteRequest(commands=batch))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    self._fail(StreamBroken("the server ended the stream"))
                    return
                self.messages_received += 1
                for result in msg.results:
                    fut = self._pending.pop(result.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(result)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._broken is None:
            self._broken = exc
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(StreamBroken(repr(exc)))

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._call.done_writing()
        for task in (self._writer, self._reader):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._call.cancel()


class FencepostStream:
    """One channel and ``streams`` Execute streams per client process."""

    def __init__(self, address: str, streams: int = 1, request_ids: bool = False) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = ledger_pb2_grpc.LedgerStub(self._channel)
        self._n = streams
        self._request_ids = request_ids  # as the SDK sends: a retry is then safe
        self._dispatchers: list[ExecuteDispatcher] = []
        self._next: Any = None

    async def connect(self) -> None:
        await asyncio.wait_for(self._channel.channel_ready(), CONNECT_TIMEOUT_S)
        self._dispatchers = [ExecuteDispatcher(self._stub) for _ in range(self._n)]
        self._next = itertools.cycle(self._dispatchers)

    async def _run(self, kind: str, request: Any) -> Any:
        if self._request_ids:
            request.request_id = new_request_id()
        result = await next(self._next).submit(pb.Command(**{kind: request}))
        which = result.WhichOneof("kind")
        if which == "error":
            code = _CODE_BY_NUMBER.get(result.error.code)
            if code in _REFUSING:
                raise Refused(_reason(result.error))
            raise RuntimeError(f"{code.name if code else result.error.code}: "
                               f"{result.error.message}")
        return getattr(result, kind)

    async def acquire(self, run_id: str, owner: str, ttl_ms: int) -> int:
        r = await self._run(
            "acquire", pb.AcquireRequest(run_id=run_id, owner=owner, lease_ttl_ms=ttl_ms)
        )
        return int(r.run.fencing_token)

    async def renew(self, run_id: str, owner: str, token: int) -> None:
        await self._run("renew", _fencepost_request("renew", run_id, owner, token))

    async def checkpoint(
        self, run_id: str, owner: str, token: int, key: str, snapshot: int
    ) -> None:
        await self._run(
            "record_checkpoint",
            _fencepost_request("record_checkpoint", run_id, owner, token,
                               key=key, snapshot=snapshot),
        )

    async def finish(self, run_id: str, owner: str, token: int) -> None:
        await self._run("finish", _fencepost_request("finish", run_id, owner, token))

    async def release(self, run_id: str, owner: str, token: int) -> None:
        await self._run("release", _fencepost_request("release", run_id, owner, token))

    async def close(self) -> None:
        for d in self._dispatchers:
            await d.close()
        await self._channel.close(None)

    def stats(self) -> dict[str, float]:
        return {
            "messages_sent": sum(d.messages_sent for d in self._dispatchers),
            "commands_sent": sum(d.commands_sent for d in self._dispatchers),
            "messages_received": sum(d.messages_received for d in self._dispatchers),
        }


class FencepostSdk:
    """The public Python SDK, in one of two shapes.

    ``fleet``: one ``fencepost.Client`` per owner, created on the owner's first
    acquire (during the warm-up) — every worker process of a fleet holds its
    own client. ``engine``: one ``fencepost.Client`` for the whole process
    (one engine process running many runs); its owner is the process's, so
    this shape runs the throughput workload only (the contention run's
    clients are distinct owners by design). Leases are the SDK's ``Lease``
    objects; refusals are the SDK's typed errors, mapped to ``Refused``.
    """

    def __init__(self, address: str, shape: str) -> None:
        if shape not in ("fleet", "engine"):
            raise ValueError(shape)
        self._address = address
        self._shape = shape
        self._clients: dict[str, Any] = {}
        self._leases: dict[tuple[str, int], Any] = {}
        self._stack = contextlib.AsyncExitStack()

    async def connect(self) -> None:
        import logging

        # the contention run's paused holders lose leases on purpose: the SDK's
        # warning for each is not news here
        logging.getLogger("fencepost").setLevel(logging.ERROR)
        if self._shape == "engine":
            await self._client(f"engine-{os.getpid()}")

    async def _client(self, owner: str) -> Any:
        import fencepost

        key = owner if self._shape == "fleet" else ""
        client = self._clients.get(key)
        if client is None:
            client = fencepost.Client(self._address, owner=owner)
            self._clients[key] = client
            await self._stack.enter_async_context(client)
        return client

    @staticmethod
    async def _refusing(call: Any) -> Any:
        import fencepost

        try:
            return await call
        except (fencepost.LeaseHeldError, fencepost.LeaseLostError,
                fencepost.AlreadyTerminalError, fencepost.RunSuspendedError,
                fencepost.RunNotFoundError, fencepost.ConflictError) as exc:
            raise Refused(_REASONS.get(exc.code, exc.code.lower())) from None

    async def acquire(self, run_id: str, owner: str, ttl_ms: int) -> int:
        client = await self._client(owner)
        lease = await self._refusing(client.acquire(run_id, ttl_ms=ttl_ms))
        self._leases[(run_id, lease.fencing_token)] = lease
        return int(lease.fencing_token)

    def _lease(self, run_id: str, token: int) -> Any:
        return self._leases[(run_id, token)]

    async def renew(self, run_id: str, owner: str, token: int) -> None:
        await self._refusing(self._lease(run_id, token).renew())

    async def checkpoint(
        self, run_id: str, owner: str, token: int, key: str, snapshot: int
    ) -> None:
        await self._refusing(self._lease(run_id, token).record_checkpoint(key, snapshot))

    async def finish(self, run_id: str, owner: str, token: int) -> None:
        lease = self._leases.pop((run_id, token))
        await self._refusing(lease.finish("completed"))

    async def release(self, run_id: str, owner: str, token: int) -> None:
        lease = self._leases.pop((run_id, token))
        await self._refusing(lease.release())

    async def close(self) -> None:
        await self._stack.aclose()

    def stats(self) -> dict[str, float]:
        return {"clients": float(len(self._clients))}


# -- etcd: Range, then Txn(compare mod_revision, put) -----------------------------


def _etcd_proto() -> tuple[Any, Any]:
    """etcd's KV messages, compiled at run time from bench/peers/etcd_kv.proto."""
    return grpc.protos_and_services("peers/etcd_kv.proto")  # type: ignore[attr-defined,no-any-return]


class Etcd:
    """Each record a JSON value under ``runs/<run_id>``; the rules run client-side
    between a linearizable Range and a Txn guarded by the mod revision read."""

    def __init__(self, address: str) -> None:
        self._pb, services = _etcd_proto()
        self._channel = grpc.aio.insecure_channel(address)
        self._kv = services.KVStub(self._channel)
        self.conflicts = 0
        self.round_trips = 0

    async def connect(self) -> None:
        await asyncio.wait_for(self._channel.channel_ready(), CONNECT_TIMEOUT_S)

    def _kv_of(self, resp: Any) -> tuple[S.Record | None, int]:
        if not resp.kvs:
            return None, 0
        kv = resp.kvs[0]
        return json.loads(kv.value), int(kv.mod_revision)

    async def _update(self, run_id: str, decide: Callable[[S.Record | None, int], Any]) -> Any:
        p = self._pb
        key = f"runs/{run_id}".encode()
        self.round_trips += 1
        rec, rev = self._kv_of(await self._kv.Range(p.RangeRequest(key=key),
                                                   timeout=RPC_TIMEOUT_S))
        for _ in range(64):
            new = decide(rec, S.now_ms())  # raises Refused
            if new is None:
                return rec  # converged: nothing to write
            txn = p.TxnRequest(
                compare=[p.Compare(result=p.Compare.EQUAL, target=p.Compare.MOD,
                                   key=key, mod_revision=rev)],
                success=[p.RequestOp(request_put=p.PutRequest(
                    key=key, value=json.dumps(new, separators=(",", ":")).encode()))],
                failure=[p.RequestOp(request_range=p.RangeRequest(key=key))],
            )
            self.round_trips += 1
            resp = await self._kv.Txn(txn, timeout=RPC_TIMEOUT_S)
            if resp.succeeded:
                return new
            self.conflicts += 1
            rec, rev = self._kv_of(resp.responses[0].response_range)
        raise Refused("conflict")

    async def acquire(self, run_id: str, owner: str, ttl_ms: int) -> int:
        rec = await self._update(run_id, lambda r, now: S.decide_acquire(r, now, owner, ttl_ms))
        return int(rec["token"])

    async def renew(self, run_id: str, owner: str, token: int) -> None:
        await self._update(run_id, lambda r, now: S.decide_renew(r, now, owner, token))

    async def checkpoint(
        self, run_id: str, owner: str, token: int, key: str, snapshot: int
    ) -> None:
        await self._update(
            run_id, lambda r, now: S.decide_checkpoint(r, now, owner, token, key, snapshot)
        )

    async def finish(self, run_id: str, owner: str, token: int) -> None:
        await self._update(run_id, lambda r, now: S.decide_finish(r, now, owner, token))

    async def release(self, run_id: str, owner: str, token: int) -> None:
        await self._update(run_id, lambda r, now: S.decide_release(r, now, owner, token))

    async def close(self) -> None:
        await self._channel.close(None)

    def stats(self) -> dict[str, float]:
        return {"cas_conflicts": self.conflicts, "round_trips": self.round_trips}


# -- PostgreSQL: one conditional statement per command ------------------------------


class Postgres:
    """asyncpg, a pool of ``connections`` per client process (prepared statements)."""

    def __init__(self, address: str, connections: int) -> None:
        self._address = address
        self._size = connections
        self._pool: Any = None
        self.refusal_reads = 0

    async def connect(self) -> None:
        import asyncpg

        host, port = self._address.rsplit(":", 1)
        self._pool = await asyncpg.create_pool(
            host=host, port=int(port), user=S.PG_USER, database="postgres",
            min_size=self._size, max_size=self._size, timeout=CONNECT_TIMEOUT_S,
        )

    async def _why(self, run_id: str, token: int, converge_to: str | None) -> None:
        """After no row was updated: refused (raise), or converged (return)."""
        self.refusal_reads += 1
        row = await self._pool.fetchrow(S.PG_WHY, run_id)
        if row is None:
            raise Refused("not_found")
        if converge_to is not None and row["status"] == converge_to and row["token"] == token:
            return
        raise Refused("lost")

    async def acquire(self, run_id: str, owner: str, ttl_ms: int) -> int:
        token = await self._pool.fetchval(S.PG_ACQUIRE, run_id, owner, ttl_ms)
        if token is None:
            self.refusal_reads += 1
            row = await self._pool.fetchrow(S.PG_WHY, run_id)
            if row is None:
                raise Refused("conflict")
            status = row["status"]
            raise Refused("terminal" if status in S.TERMINAL
                          else "suspended" if status == "suspended" else "held")
        return int(token)

    async def renew(self, run_id: str, owner: str, token: int) -> None:
        if await self._pool.fetchval(S.PG_RENEW, run_id, token, owner) is None:
            await self._why(run_id, token, None)

    async def checkpoint(
        self, run_id: str, owner: str, token: int, key: str, snapshot: int
    ) -> None:
        if await self._pool.fetchval(S.PG_CHECKPOINT, run_id, token, owner, key, snapshot) is None:
            await self._why(run_id, token, None)

    async def finish(self, run_id: str, owner: str, token: int) -> None:
        if await self._pool.fetchval(S.PG_FINISH, run_id, token, owner) is None:
            await self._why(run_id, token, "completed")

    async def release(self, run_id: str, owner: str, token: int) -> None:
        if await self._pool.fetchval(S.PG_RELEASE, run_id, token, owner) is None:
            await self._why(run_id, token, "queued")

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    def stats(self) -> dict[str, float]:
        return {"refusal_reads": self.refusal_reads}


# -- Redis: one EVALSHA per command --------------------------------------------------


class Redis:
    """redis-py asyncio (hiredis parser when installed); each record a hash."""

    def __init__(self, address: str, connections: int) -> None:
        import redis.asyncio as aioredis

        host, port = address.rsplit(":", 1)
        self._r = aioredis.Redis(
            host=host, port=int(port), max_connections=connections,
            socket_timeout=RPC_TIMEOUT_S, decode_responses=False,
        )
        self._scripts = {
            name: self._r.register_script(src)
            for name, src in (("acquire", S.LUA_ACQUIRE), ("renew", S.LUA_RENEW),
                              ("checkpoint", S.LUA_CHECKPOINT), ("finish", S.LUA_FINISH),
                              ("release", S.LUA_RELEASE))
        }

    async def connect(self) -> None:
        await self._r.ping()
        for s in self._scripts.values():  # load once, so every call is one EVALSHA
            s.sha = await self._r.script_load(s.script)

    async def _eval(self, name: str, run_id: str, *args: Any) -> Any:
        from redis.exceptions import ResponseError

        try:
            return await self._scripts[name](keys=[f"run:{run_id}"], args=args)
        except ResponseError as exc:
            msg = str(exc)
            if msg.startswith("REFUSED "):
                raise Refused(msg.split(" ", 1)[1]) from None
            raise

    async def acquire(self, run_id: str, owner: str, ttl_ms: int) -> int:
        return int(await self._eval("acquire", run_id, owner, ttl_ms))

    async def renew(self, run_id: str, owner: str, token: int) -> None:
        await self._eval("renew", run_id, owner, token)

    async def checkpoint(
        self, run_id: str, owner: str, token: int, key: str, snapshot: int
    ) -> None:
        await self._eval("checkpoint", run_id, owner, token, key, snapshot)

    async def finish(self, run_id: str, owner: str, token: int) -> None:
        await self._eval("finish", run_id, owner, token)

    async def release(self, run_id: str, owner: str, token: int) -> None:
        await self._eval("release", run_id, owner, token)

    async def close(self) -> None:
        await self._r.aclose()

    def stats(self) -> dict[str, float]:
        return {}


async def open_backend(name: str, address: str, clients: int, options: dict[str, Any]) -> Any:
    """Connect one backend client for a process running ``clients`` clients."""
    b: Any
    if name == "fencepost-unary":
        b = FencepostUnary(address, channels=int(options.get("channels", 1)))
    elif name == "fencepost-stream":
        b = FencepostStream(address, streams=int(options.get("streams", 1)),
                            request_ids=bool(options.get("request_ids")))
    elif name in SDK_BACKENDS:
        b = FencepostSdk(address, shape=name.rsplit("-", 1)[1])
    elif name == "etcd":
        b = Etcd(address)
    elif name == "postgres":
        b = Postgres(address, connections=int(options.get("pg_conns") or clients))
    elif name == "redis":
        b = Redis(address, connections=int(options.get("redis_conns") or clients))
    else:
        raise ValueError(f"unknown backend {name}")
    await b.connect()
    return b
