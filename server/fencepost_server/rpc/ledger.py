"""fencepost.v1.Ledger: thin handlers over the writer and the committed state."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

from ..core import validate
from ..core.errors import Code, LedgerError, unrepresentable, validation
from ..core.fence import fences_writes
from ..core.records import Record, Status, out_of_range
from ..hub import FenceHub
from ..writer import Reads, Writer
from . import convert
from .commands import KINDS, filler
from .execute import ExecuteHandler
from .keepalive import KeepAliveHandler
from .status import handler
from .watch import History, WatchHandler

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def _filter_key(statuses: frozenset[Status], owner: str) -> str:
    raw = repr((sorted(int(s) for s in statuses), owner)).encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def encode_page_token(after: str, fkey: str) -> str:
    raw = json.dumps({"a": after, "f": fkey}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str, fkey: str) -> str:
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        after, got = data["a"], data["f"]
        if not isinstance(after, str):
            raise TypeError
    except Exception:
        raise validation("page_token", "is not a token this server issued") from None
    if got != fkey:
        raise validation("page_token", "was issued for different filters")
    return after


async def list_page(
    reads: Reads, statuses: frozenset[Status], owner: str, page_size: int, page_token: str
) -> tuple[list[Record], str]:
    """One page of runs ordered by run_id from the committed state, from the
    token's position (``Reads.page_runs``: a page costs what it matches)."""
    fkey = _filter_key(statuses, owner)
    after = decode_page_token(page_token, fkey) if page_token else None
    out, more = await reads.page_runs(statuses, owner, page_size, after=after)
    return out, encode_page_token(out[-1].run_id, fkey) if more else ""


class LedgerService(ledger_pb2_grpc.LedgerServicer):
    """The unary calls here; the streams delegated to the handlers it holds
    (keepalive, watch, execute), which share nothing but the hub."""

    def __init__(
        self,
        writer: Writer,
        hub: FenceHub,
        history: History,
        *,
        reads: Reads,
        max_tracked_per_stream: int = 100_000,
        max_inflight_per_stream: int = 4096,
        shard_owner: Callable[[], tuple[str, str, int]] = lambda: ("", "", 0),
        move_shard: Callable[[int, str], Awaitable[tuple[str, str, int]]] | None = None,
    ) -> None:
        self.writer = writer
        self.reads = reads
        # (identity, advertised address, epoch) of the coordinator leading every shard
        self.shard_owner = shard_owner
        # --lead-shards: pin a shard to a coordinator; returns who led it (None: one leads all)
        self.move_shard = move_shard
        self.keepalive = KeepAliveHandler(
            writer, hub, max_tracked_per_stream=max_tracked_per_stream)
        self.watch = WatchHandler(writer, hub, history)
        self.execute = ExecuteHandler(
            writer, hub, self.keepalive.track_acquired,
            max_inflight_per_stream=max_inflight_per_stream)

    @handler
    async def KeepAlive(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        await self.keepalive(request_iterator, context)

    @handler
    async def Execute(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        await self.execute(request_iterator, context)

    @handler
    async def WatchRuns(  # type: ignore[override]
        self, request: pb.WatchRunsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self.watch(request, context)

    async def _answer(self, kind: str, request: Any, response: Any) -> Any:
        """Submit the request's command (the command registry, as Execute
        does); fill its answer into the empty response in place."""
        entry = KINDS[kind]
        result = await self.writer.submit(entry.to_command(request))
        filler(kind, request)(response, result)
        return response

    @handler
    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquireResponse:
        response = await self._answer("acquire", request, pb.AcquireResponse())
        if request.track_on:
            response.tracked = self.keepalive.track_acquired(
                request.track_on, request.owner, response.run.run_id, response.run.fencing_token)
        return response

    @handler
    async def Renew(
        self, request: pb.RenewRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewResponse:
        return await self._answer("renew", request, pb.RenewResponse())

    @handler
    async def RecordCheckpoint(
        self, request: pb.RecordCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordCheckpointResponse:
        return await self._answer("record_checkpoint", request, pb.RecordCheckpointResponse())

    @handler
    async def Transact(
        self, request: pb.TransactionRequest, context: grpc.aio.ServicerContext
    ) -> pb.TransactionResponse:
        return await self._answer("transaction", request, pb.TransactionResponse())

    @handler
    async def Suspend(
        self, request: pb.SuspendRequest, context: grpc.aio.ServicerContext
    ) -> pb.SuspendResponse:
        return await self._answer("suspend", request, pb.SuspendResponse())

    @handler
    async def Finish(
        self, request: pb.FinishRequest, context: grpc.aio.ServicerContext
    ) -> pb.FinishResponse:
        return await self._answer("finish", request, pb.FinishResponse())

    @handler
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        return await self._answer("release", request, pb.ReleaseResponse())

    @handler
    async def Cancel(
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelResponse:
        return await self._answer("cancel", request, pb.CancelResponse())

    @handler
    async def RequestResume(
        self, request: pb.RequestResumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RequestResumeResponse:
        return await self._answer("request_resume", request, pb.RequestResumeResponse())

    @handler
    async def GetRun(
        self, request: pb.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetRunResponse:
        validate.run_id(request.run_id)
        self.writer.check_led(request.run_id)
        st = self.writer.state
        revision = st.revision
        rec = await self.reads.read_run(request.run_id)
        if rec is None:
            raise LedgerError(Code.RUN_NOT_FOUND, f"run {request.run_id!r} not found")
        return pb.GetRunResponse(
            run=convert.record_to_pb(rec), revision=max(revision, rec.revision)
        )

    @handler
    async def ListRuns(
        self, request: pb.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRunsResponse:
        statuses = frozenset(
            convert.status_from_pb(s, f"statuses[{i}]") for i, s in enumerate(request.statuses)
        )
        if request.owner:
            validate.owner(request.owner)
        size = (
            validate.int_range("page_size", request.page_size, 0, MAX_PAGE_SIZE)
            or DEFAULT_PAGE_SIZE
        )
        revision = self.writer.state.revision
        runs, token = await list_page(
            self.reads, statuses, request.owner, size, request.page_token
        )
        # a record stored past the bound is left out: it is never served
        return pb.ListRunsResponse(
            runs=[convert.record_to_pb(r) for r in runs if out_of_range(r) is None],
            next_page_token=token,
            revision=revision,
        )

    @handler
    async def DeleteRun(
        self, request: pb.DeleteRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteRunResponse:
        return await self._answer("delete_run", request, pb.DeleteRunResponse())

    @handler
    async def ValidateFence(
        self, request: pb.ValidateFenceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ValidateFenceResponse:
        validate.run_id(request.run_id)
        validate.fencing_token(request.fencing_token)
        self.writer.check_led(request.run_id)
        st = self.writer.state
        revision = st.revision
        rec = await self.reads.read_run(request.run_id)
        if rec is None:
            return pb.ValidateFenceResponse(current=False, found=False, revision=revision)
        if (field := out_of_range(rec)) is not None:
            raise unrepresentable(rec.run_id, field, getattr(rec, field))
        revision = max(revision, rec.revision)
        return pb.ValidateFenceResponse(
            current=fences_writes(rec, request.fencing_token),
            found=True,
            fencing_token=rec.fencing_token,
            status=int(rec.status),  # type: ignore[arg-type]
            revision=revision,
        )

    @handler
    async def Shards(
        self, request: pb.ShardsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ShardsResponse:
        w = self.writer
        n = w.storage.shards
        revision, rows = await self.reads.shard_map(
            n, w.clock.now_ms(), self.shard_owner(), w.ownership, count=not request.owners_only)
        return pb.ShardsResponse(shard_count=n, revision=revision, shards=[
            pb.ShardInfo(index=r.index, owner=r.owner, address=r.address, epoch=r.epoch,
                         runs=r.runs, leases=r.leases) for r in rows])

    @handler
    async def MoveShard(
        self, request: pb.MoveShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.MoveShardResponse:
        if self.move_shard is None:
            raise validation("shard", "every shard is led by this one coordinator; moving "
                             "shards needs coordinators started with --lead-shards")
        if not request.to:
            raise validation("to", "required: the address of the coordinator to move it to")
        try:
            owner, address, epoch = await self.move_shard(request.shard, request.to)
        except ValueError as exc:
            field, _, why = str(exc).partition(": ")
            raise validation(field, why) from None
        return pb.MoveShardResponse(before=pb.ShardInfo(
            index=request.shard, owner=owner, address=address, epoch=epoch))
