"""Ledger.Execute: every ledger command, and the engine store's unary
mutations, multiplexed on one stream.

Each incoming message's commands are converted and validated exactly as the
unary handlers do (same ``convert`` functions; for the engine store, the same
``engine_store.MUTATIONS`` functions), then handed to the writer
together without awaiting (``Writer.submit_with_answer``: no future per
command); each answer is written in place into the response message being
assembled — the unary response message, or the unary error status. Results
completed in the same event-loop turn (one group commit, typically) are sent
as one message, so a batch of commands costs about one message each way. When
the writer's queue is full the stream stops reading (back-pressure), as a
unary call waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from fencepost.v1 import ledger_pb2 as pb

from .. import auth
from ..core import ledger as L
from ..core import validate
from ..core.errors import LedgerError, in_transaction, validation
from ..hub import Buffered, Stop
from . import convert
from .decode import Malformed
from .engine_store import MUTATIONS
from .keepalive import _run_until_stopped, _stop_error, enter, headers_first
from .status import internal_status_proto, status_proto

log = logging.getLogger("fencepost.execute")


# Fill a CommandResult's response field (an empty message of the unary RPC's
# response type) from the writer's result, in place.
Fill = Callable[[Any, Any], None]


def _fill_record(response: Any, record: Any) -> None:
    convert.fill_record_pb(response.run, record)


def _fill_deleted(response: Any, deleted: Any) -> None:
    response.revision = deleted.revision
    response.fencing_token = deleted.fencing_token


def _fill_from(to_response: Callable[[Any], Any]) -> Fill:
    return lambda response, result: response.CopyFrom(to_response(result))


# kind -> (request -> command, fill the response from the result)
KINDS: dict[str, tuple[Callable[[Any], L.Command], Fill]] = {
    "acquire": (convert.acquire, _fill_record),
    "renew": (convert.renew, _fill_record),
    "record_checkpoint": (convert.record_checkpoint, _fill_record),
    "suspend": (convert.suspend, _fill_record),
    "finish": (convert.finish, _fill_record),
    "release": (convert.release, _fill_record),
    "cancel": (convert.cancel, _fill_record),
    "request_resume": (convert.request_resume, _fill_record),
    "delete_run": (convert.delete_run, _fill_deleted),
    # the engine store's: create_run, update_run, ... doc_delete
    **{kind: (to_cmd, _fill_from(to_resp)) for kind, (to_cmd, to_resp) in MUTATIONS.items()},
}


def transaction_cmd(req: pb.TransactionRequest) -> L.Transaction:
    """A TransactionRequest as one writer command: each of its commands
    converted and validated as on its own (errors name ``commands[i]``)."""
    if not req.commands:
        raise validation("commands", "a transaction needs at least one command")
    if len(req.commands) > L.MAX_TRANSACTION_COMMANDS:
        raise validation(
            "commands",
            f"at most {L.MAX_TRANSACTION_COMMANDS} commands (got {len(req.commands)})",
        )
    commands = []
    for i, sub in enumerate(req.commands):
        try:
            kind = sub.WhichOneof("kind")
            if kind is None:
                raise validation("kind", "empty command")
            if kind == "transaction":
                raise validation("transaction", "a transaction cannot contain a transaction")
            inner = getattr(sub, kind)
            if inner.request_id:
                raise validation(
                    "request_id", "commands of a transaction take the transaction's request_id"
                )
            commands.append(KINDS[kind][0](inner))
        except LedgerError as exc:
            raise in_transaction(exc, i) from None
    return L.Transaction(
        tuple(commands), convert.fence_from_pb(req), validate.request_id(req.request_id)
    )


def fill_transaction(
    response: pb.TransactionResponse, done: L.TransactionDone, request: pb.TransactionRequest
) -> None:
    """Each command's answer into a CommandResult with the command's id."""
    for sub, result in zip(request.commands, done.results, strict=True):
        kind = str(sub.WhichOneof("kind"))
        KINDS[kind][1](getattr(response.results.add(id=sub.id), kind), result)


def _no_fill(response: Any, result: Any) -> None:
    raise AssertionError("a transaction's answer is filled by fill_transaction")


KINDS["transaction"] = (transaction_cmd, _no_fill)


class _Session(Buffered):
    """One Execute stream: results are written straight into the response
    message being assembled; the first result of an event-loop turn schedules
    the flush that queues it for the pump. Its queue is counted in results
    (a message holds a commit's worth), against --max-queued-per-stream."""

    def __init__(self, limit: int) -> None:
        self.pending = pb.ExecuteResponse()
        self.outbox: asyncio.Queue[pb.ExecuteResponse | None] = asyncio.Queue()
        self.stop = Stop()
        self.limit = limit
        self.flush_scheduled = False
        self.unanswered = 0
        self.all_answered = asyncio.Event()
        self.all_answered.set()
        self.room = asyncio.Event()  # set when fewer than the in-flight limit are unanswered
        self.room.set()
        self.reading = False  # the reader waits for the client's next message
        self.draining = False  # the server is stopping: read nothing more
        self.ended = False  # the end marker is queued for the pump

    def end(self) -> None:
        """Queue what is pending and then the end marker (once)."""
        if not self.ended:
            self.ended = True
            self.flush()
            self.outbox.put_nowait(None)

    def drain(self) -> None:
        """The server is stopping: take no further command, answer those taken,
        then end the stream (``SHUTTING_DOWN``; the client reconnects). A stream
        left open would hold the server's stop for its whole grace period."""
        self.draining = True
        self.idle_drained()

    def idle_drained(self) -> None:
        """End the stream now if it drains, waits for a message and owes no
        answer (otherwise the reader, or the last answer, ends it)."""
        if self.draining and self.reading and not self.unanswered:
            self.end()

    def result(self, cid: int) -> pb.CommandResult:
        """A new result in the pending message (flushed this loop turn)."""
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)
        return self.pending.results.add(id=cid)

    def error(self, cid: int, err: LedgerError) -> None:
        self.result(cid).error.CopyFrom(status_proto(err))

    def flush(self) -> None:
        self.flush_scheduled = False
        if not self.pending.results or self.stop.reason is not None:
            return
        if self.charge(len(self.pending.results)):
            self.outbox.put_nowait(self.pending)
            self.pending = pb.ExecuteResponse()

    def clear(self) -> None:
        self.pending = pb.ExecuteResponse()
        while not self.outbox.empty():
            self.outbox.get_nowait()


class ExecuteHandler:
    """Mixed into LedgerService: needs self.writer, self.hub (for limits) and
    self.track_acquired (StreamHandlers)."""

    writer: Any
    hub: Any
    max_inflight_per_stream: int
    track_acquired: Callable[[str, str, str, int], bool]

    async def _execute(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        session = _Session(self.hub.queue_limit)
        enter(self.hub, session, context)
        reader = asyncio.create_task(self._execute_reader(session, requests))
        self.hub.executes.add(session)
        self.hub.opened(session)
        try:
            await headers_first(context)
            pump = asyncio.create_task(self._execute_pump(session, context))
            await _run_until_stopped(session.stop, pump)
        finally:
            self.hub.executes.discard(session)
            self.hub.leave(session)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        if session.draining:  # every answer written: tell the client why it ends
            raise _stop_error(Stop.SHUTDOWN)

    async def _execute_pump(self, session: _Session, context: grpc.aio.ServicerContext) -> None:
        """Write results until the reader's end marker (None)."""
        while (msg := await session.outbox.get()) is not None:
            session.uncharge(len(msg.results))
            await context.write(msg)

    async def _execute_reader(self, session: _Session, requests: AsyncIterator[Any]) -> None:
        if not session.draining:  # one opened as the server stops reads nothing
            await self._execute_messages(session, requests)
        # half-closed or draining: answer everything accepted, then mark the end
        await session.all_answered.wait()
        session.end()

    async def _execute_messages(self, session: _Session, requests: AsyncIterator[Any]) -> None:
        """Take each message's commands until the client half-closes or the
        server stops."""
        writer = self.writer
        limit = self.max_inflight_per_stream
        messages = aiter(requests)
        while not session.draining:
            session.reading = True  # a stop now ends the stream once nothing is owed
            try:
                msg = await anext(messages)
            except StopAsyncIteration:
                break
            finally:
                session.reading = False
            if session.draining:  # arrived as the server stops: not looked at
                break
            if isinstance(msg, Malformed):
                session.error(
                    0, validation(msg.field, f"undecodable {msg.type_name}: {msg.error}")
                )
                continue
            for cmd in msg.commands:
                while session.unanswered >= limit:  # --max-inflight-per-stream: stop reading
                    session.room.clear()
                    await session.room.wait()
                queued = self._execute_one(session, cmd)
                if queued is not None:  # the writer is full: stop reading until it has room
                    await writer.submit_with_answer_waiting(*queued)

    def _fill_tracked(self, response: Any, record: Any, *, request: pb.AcquireRequest) -> None:
        """An acquire with ``track_on``: its record, and whether the lease is
        now tracked on the KeepAlive stream it names."""
        _fill_record(response, record)
        response.tracked = self.track_acquired(
            request.track_on, request.owner, record.run_id, record.fencing_token)

    def _execute_one(
        self, session: _Session, cmd: pb.Command
    ) -> tuple[L.Command, Callable[[Any], None]] | None:
        """Validate one command and queue it (the answer fills its result in
        place); returns it instead when the writer's queue is full."""
        kind = cmd.WhichOneof("kind")
        cid = cmd.id
        try:
            if kind is None:
                raise validation("kind", "empty command")
            to_command, fill = KINDS[kind]
            request = getattr(cmd, kind)
            auth.check_command(kind, request)
            command = to_command(request)
            if kind == "transaction":
                fill = functools.partial(fill_transaction, request=request)
            elif kind == "acquire" and request.track_on:
                fill = functools.partial(self._fill_tracked, request=request)
        except LedgerError as err:
            session.error(cid, err)
            return None
        except Exception as exc:  # a bug: answer as the unary call would (INTERNAL)
            log.exception("converting a %s command failed", kind)
            session.result(cid).error.CopyFrom(internal_status_proto(exc))
            return None
        session.unanswered += 1
        session.all_answered.clear()

        limit = self.max_inflight_per_stream

        def answer(result: Any) -> None:
            session.unanswered -= 1
            if not session.unanswered:
                session.all_answered.set()
            if session.unanswered < limit:
                session.room.set()
            if session.stop.reason is not None:
                return
            if isinstance(result, LedgerError):
                session.error(cid, result)
            elif isinstance(result, BaseException):
                log.error("command failed unexpectedly: %r", result)
                session.result(cid).error.CopyFrom(internal_status_proto(result))
            else:
                fill(getattr(session.result(cid), kind), result)
            if session.draining:
                session.idle_drained()

        if self.writer.submit_with_answer(command, answer):
            return None
        return command, answer
