"""Ledger.Execute: every ledger command, and the engine store's unary
mutations, multiplexed on one stream.

Each incoming message's commands are converted and validated exactly as the
unary handlers do (same ``convert`` functions; for the engine store, the same
``engine_store.MUTATIONS`` functions), then handed to the writer
together without awaiting (``submit_nowait``); each future's callback turns
the result into the unary response message, or the unary error status. Results
completed in the same event-loop turn (one group commit, typically) are sent
as one message, so a batch of commands costs about one message each way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from fencepost.v1 import ledger_pb2 as pb

from .. import convert
from ..core import ledger as L
from ..core.errors import Code, LedgerError, validation
from ..streams import Stop
from ._errors import status_proto
from ._registry import Malformed
from .engine_store import MUTATIONS

log = logging.getLogger("fencepost.execute")


def _record_response(cls: Any) -> Callable[[Any], Any]:
    return lambda result: cls(run=convert.record_to_pb(result))


# kind -> (request -> command, result -> response message)
KINDS: dict[str, tuple[Callable[[Any], L.Command], Callable[[Any], Any]]] = {
    "acquire": (convert.acquire, _record_response(pb.AcquireResponse)),
    "renew": (convert.renew, _record_response(pb.RenewResponse)),
    "record_checkpoint": (convert.record_checkpoint, _record_response(pb.RecordCheckpointResponse)),
    "suspend": (convert.suspend, _record_response(pb.SuspendResponse)),
    "finish": (convert.finish, _record_response(pb.FinishResponse)),
    "release": (convert.release, _record_response(pb.ReleaseResponse)),
    "cancel": (convert.cancel, _record_response(pb.CancelResponse)),
    "request_resume": (convert.request_resume, _record_response(pb.RequestResumeResponse)),
    "delete_run": (
        convert.delete_run,
        lambda d: pb.DeleteRunResponse(revision=d.revision, fencing_token=d.fencing_token),
    ),
    **MUTATIONS,  # the engine store's: create_run, update_run, ... doc_delete
}


class _Session:
    def __init__(self, limit: int) -> None:
        self.pending: list[pb.CommandResult] = []
        self.outbox: asyncio.Queue[pb.ExecuteResponse | None] = asyncio.Queue()
        self.stop = Stop()
        self.limit = limit
        self.flush_scheduled = False
        self.unanswered = 0
        self.all_answered = asyncio.Event()
        self.all_answered.set()

    def add(self, result: pb.CommandResult) -> None:
        self.pending.append(result)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if not self.pending or self.stop.reason is not None:
            return
        if self.outbox.qsize() >= self.limit:
            self.stop.set(Stop.OVERFLOW)
            return
        self.outbox.put_nowait(pb.ExecuteResponse(results=self.pending))
        self.pending = []


def _error_result(cid: int, err: LedgerError) -> pb.CommandResult:
    return pb.CommandResult(id=cid, error=status_proto(err))


class ExecuteHandler:
    """Mixed into LedgerService: needs self.writer and self.hub (for limits)."""

    writer: Any
    hub: Any

    async def _execute(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        from .streams import _run_until_stopped

        session = _Session(self.hub.queue_limit)
        reader = asyncio.create_task(self._execute_reader(session, requests))
        try:
            pump = asyncio.create_task(self._execute_pump(session, context))
            await _run_until_stopped(session.stop, pump)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def _execute_pump(self, session: _Session, context: grpc.aio.ServicerContext) -> None:
        """Write results until the reader's end marker (None)."""
        while (msg := await session.outbox.get()) is not None:
            await context.write(msg)

    async def _execute_reader(self, session: _Session, requests: AsyncIterator[Any]) -> None:
        async for msg in requests:
            if isinstance(msg, Malformed):
                session.add(
                    _error_result(
                        0, validation("request", f"undecodable {msg.type_name}: {msg.error}")
                    )
                )
                continue
            for cmd in msg.commands:
                self._execute_one(session, cmd)
        # half-closed: answer everything accepted, then mark the end for the pump
        await session.all_answered.wait()
        session.flush()
        session.outbox.put_nowait(None)

    def _execute_one(self, session: _Session, cmd: pb.Command) -> None:
        kind = cmd.WhichOneof("kind")
        cid = cmd.id
        try:
            if kind is None:
                raise validation("kind", "empty command")
            to_command, to_response = KINDS[kind]
            fut = self.writer.submit_nowait(to_command(getattr(cmd, kind)))
        except LedgerError as err:
            session.add(_error_result(cid, err))
            return
        session.unanswered += 1
        session.all_answered.clear()

        def done(f: asyncio.Future[Any]) -> None:
            session.unanswered -= 1
            if not session.unanswered:
                session.all_answered.set()
            if f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                session.add(pb.CommandResult(id=cid, **{kind: to_response(f.result())}))
            elif isinstance(exc, LedgerError):
                session.add(_error_result(cid, exc))
            else:
                log.error("command failed unexpectedly: %r", exc)
                session.add(
                    _error_result(cid, LedgerError(Code.STORAGE_UNAVAILABLE, "internal error"))
                )

        fut.add_done_callback(done)
