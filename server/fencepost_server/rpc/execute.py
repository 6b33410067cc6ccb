"""Ledger.Execute: every ledger command, and the engine store's unary
mutations, multiplexed on one stream.

Each incoming message's commands are converted and validated exactly as the
unary handlers do (the one command registry, ``commands.KINDS``), then handed
to the writer
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
from ..core.errors import LedgerError, validation
from ..hub import Buffered, FenceHub, Stop
from ..writer import Writer
from .commands import KINDS, filler
from .decode import Malformed
from .pump import enter, headers_first, run_until_stopped, stop_error
from .status import internal_status_proto, status_proto, undecodable

log = logging.getLogger("fencepost.execute")


class ExecuteSession(Buffered):
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


# An acquire's ``track_on``: (stream name, owner, run id, token) -> tracked
# (KeepAliveHandler.track_acquired).
TrackAcquired = Callable[[str, str, str, int], bool]


class ExecuteHandler:
    def __init__(
        self, writer: Writer, hub: FenceHub, track_acquired: TrackAcquired, *,
        max_inflight_per_stream: int,
    ) -> None:
        self.writer = writer
        self.hub = hub
        self.track_acquired = track_acquired
        self.max_inflight_per_stream = max_inflight_per_stream

    async def __call__(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        session = ExecuteSession(self.hub.queue_limit)
        enter(self.hub, session, context)
        reader = asyncio.create_task(self._reader(session, requests))
        self.hub.opened(session)
        try:
            await headers_first(context)
            pump = asyncio.create_task(self._pump(session, context))
            await run_until_stopped(session.stop, pump)
        finally:
            self.hub.leave(session)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        if session.draining:  # every answer written: tell the client why it ends
            raise stop_error(Stop.SHUTDOWN)

    async def _pump(self, session: ExecuteSession, context: grpc.aio.ServicerContext) -> None:
        """Write results until the reader's end marker (None)."""
        while (msg := await session.outbox.get()) is not None:
            session.uncharge(len(msg.results))
            await context.write(msg)

    async def _reader(self, session: ExecuteSession, requests: AsyncIterator[Any]) -> None:
        if not session.draining:  # one opened as the server stops reads nothing
            await self._messages(session, requests)
        # half-closed or draining: answer everything accepted, then mark the end
        await session.all_answered.wait()
        session.end()

    async def _messages(self, session: ExecuteSession, requests: AsyncIterator[Any]) -> None:
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
                session.error(0, undecodable(msg))
                continue
            for cmd in msg.commands:
                while session.unanswered >= limit:  # --max-inflight-per-stream: stop reading
                    session.room.clear()
                    await session.room.wait()
                queued = self._one(session, cmd)
                if queued is not None:  # the writer is full: stop reading until it has room
                    await writer.submit_with_answer_waiting(*queued)

    def _fill_tracked(self, response: Any, record: Any, *, request: pb.AcquireRequest) -> None:
        """An acquire with ``track_on``: its record, and whether the lease is
        now tracked on the KeepAlive stream it names."""
        KINDS["acquire"].fill(response, record)
        response.tracked = self.track_acquired(
            request.track_on, request.owner, record.run_id, record.fencing_token)

    def _one(
        self, session: ExecuteSession, cmd: pb.Command
    ) -> tuple[L.Command, Callable[[Any], None]] | None:
        """Validate one command and queue it (the answer fills its result in
        place); returns it instead when the writer's queue is full."""
        kind = cmd.WhichOneof("kind")
        cid = cmd.id
        try:
            if kind is None:
                raise validation("kind", "empty command")
            request = getattr(cmd, kind)
            auth.check_command(kind, request)
            command = KINDS[kind].to_command(request)
            fill = filler(kind, request)
            if kind == "acquire" and request.track_on:
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
