"""fencepost.v1.Ledger: thin handlers over the writer and the committed state."""

from __future__ import annotations

import base64
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

from ..core import validate
from ..core.errors import Code, LedgerError, unrepresentable, validation
from ..core.ledger import Deleted
from ..core.records import Record, Status, out_of_range
from ..hub import FenceHub
from ..storage.sqlite import HistoryReader
from ..writer import Reads, Writer
from . import convert
from .execute import ExecuteHandler, fill_transaction, transaction_cmd
from .keepalive import StreamHandlers
from .status import handler

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


class LedgerService(StreamHandlers, ExecuteHandler, ledger_pb2_grpc.LedgerServicer):
    def __init__(
        self,
        writer: Writer,
        hub: FenceHub,
        history: HistoryReader,
        history_executor: ThreadPoolExecutor,
        *,
        reads: Reads,
        max_tracked_per_stream: int = 100_000,
        max_inflight_per_stream: int = 4096,
    ) -> None:
        self.writer = writer
        self.reads = reads
        self.hub = hub
        self.history = history
        self.history_executor = history_executor
        self.max_tracked_per_stream = max_tracked_per_stream
        self.max_inflight_per_stream = max_inflight_per_stream

    @handler
    async def KeepAlive(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        await self._keepalive(request_iterator, context)

    @handler
    async def Execute(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        await self._execute(request_iterator, context)

    @handler
    async def WatchRuns(  # type: ignore[override]
        self, request: pb.WatchRunsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self._watch(request, context)

    async def _answer(self, cmd: object, response: Any) -> Any:
        """Submit a command whose result is a record; fill it into the empty
        response's ``run`` in place (no intermediate message, no copy)."""
        result = await self.writer.submit(cmd)  # type: ignore[arg-type]
        assert isinstance(result, Record)
        convert.fill_record_pb(response.run, result)
        return response

    @handler
    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquireResponse:
        response = await self._answer(convert.acquire(request), pb.AcquireResponse())
        if request.track_on:
            response.tracked = self.track_acquired(
                request.track_on, request.owner, response.run.run_id, response.run.fencing_token)
        return response

    @handler
    async def Renew(
        self, request: pb.RenewRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewResponse:
        return await self._answer(convert.renew(request), pb.RenewResponse())

    @handler
    async def RecordCheckpoint(
        self, request: pb.RecordCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordCheckpointResponse:
        return await self._answer(convert.record_checkpoint(request), pb.RecordCheckpointResponse())

    @handler
    async def Transact(
        self, request: pb.TransactionRequest, context: grpc.aio.ServicerContext
    ) -> pb.TransactionResponse:
        done = await self.writer.submit(transaction_cmd(request))
        response = pb.TransactionResponse()
        fill_transaction(response, done, request)  # type: ignore[arg-type]
        return response

    @handler
    async def Suspend(
        self, request: pb.SuspendRequest, context: grpc.aio.ServicerContext
    ) -> pb.SuspendResponse:
        return await self._answer(convert.suspend(request), pb.SuspendResponse())

    @handler
    async def Finish(
        self, request: pb.FinishRequest, context: grpc.aio.ServicerContext
    ) -> pb.FinishResponse:
        return await self._answer(convert.finish(request), pb.FinishResponse())

    @handler
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        return await self._answer(convert.release(request), pb.ReleaseResponse())

    @handler
    async def Cancel(
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelResponse:
        return await self._answer(convert.cancel(request), pb.CancelResponse())

    @handler
    async def RequestResume(
        self, request: pb.RequestResumeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RequestResumeResponse:
        return await self._answer(convert.request_resume(request), pb.RequestResumeResponse())

    @handler
    async def GetRun(
        self, request: pb.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetRunResponse:
        validate.run_id(request.run_id)
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
        result = await self.writer.submit(convert.delete_run(request))
        assert isinstance(result, Deleted)
        return pb.DeleteRunResponse(revision=result.revision, fencing_token=result.fencing_token)

    @handler
    async def ValidateFence(
        self, request: pb.ValidateFenceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ValidateFenceResponse:
        validate.run_id(request.run_id)
        validate.fencing_token(request.fencing_token)
        st = self.writer.state
        revision = st.revision
        rec = await self.reads.read_run(request.run_id)
        if rec is None:
            return pb.ValidateFenceResponse(current=False, found=False, revision=revision)
        if (field := out_of_range(rec)) is not None:
            raise unrepresentable(rec.run_id, field, getattr(rec, field))
        revision = max(revision, rec.revision)
        current = (
            rec.fencing_token == request.fencing_token
            and rec.status is Status.RUNNING
            and rec.lease is not None
        )
        return pb.ValidateFenceResponse(
            current=current,
            found=True,
            fencing_token=rec.fencing_token,
            status=int(rec.status),  # type: ignore[arg-type]
            revision=revision,
        )
