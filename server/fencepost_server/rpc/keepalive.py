"""The streaming Ledger RPCs: KeepAlive and WatchRuns (docs/SPEC.md §6).

Each stream's handler runs a *pump* task (messages out) and, for KeepAlive, a
*reader* task (messages in), and waits for the first of: the pump ending, the
reader ending, or the stream's Stop (overflow, shutdown). The pump is
cancelled from outside, so a client that stopped reading cannot pin a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from fencepost.v1 import ledger_pb2 as pb

from .. import auth
from ..core import ledger as L
from ..core import validate
from ..core.errors import Code, LedgerError, validation
from ..core.records import MAX_SAFE, out_of_range
from ..hub import Buffered, FenceHub, Session, Stop, Watch, lost_reason, watch_message
from ..storage.sqlite import HistoryReader
from .decode import Malformed

log = logging.getLogger("fencepost.streams")

MAX_WATCH_IDS = 1000
MAX_BATCH = 4096  # KeepAlive answers coalesced into one message
REPLAY_PAGE = 1000


def _error(run_id: str, err: LedgerError) -> pb.KeepAliveResponse:
    metadata = dict(err.metadata) if err.metadata else {}
    if err.field is not None:
        metadata["field"] = err.field
    return pb.KeepAliveResponse(
        error=pb.KeepAliveError(
            run_id=run_id, code=err.code.value, message=err.message, metadata=metadata
        )
    )


def _stop_error(reason: str | None, limit: tuple[str, int] | None = None) -> LedgerError:
    """Why a stream ends (a ``Stop`` reason) as its status; an overflow names
    the limit it passed in the message and the metadata."""
    if reason == Stop.OVERFLOW:
        name, value = limit or ("max_queued_per_stream", 0)
        return LedgerError(
            Code.STREAM_TOO_SLOW,
            f"the stream fell too far behind reading and was dropped: more than {value} "
            f"answers queued unread (--{name.replace('_', '-')}); reconnect "
            "(WatchRuns: resume from the last revision received + 1)",
            metadata={"limit": name, "value": str(value)},
        )
    return LedgerError(Code.SHUTTING_DOWN, "the server is shutting down; reconnect")


def enter(hub: FenceHub, stream: Buffered, context: grpc.aio.ServicerContext) -> None:
    """Charge a new stream to its connection and, with identities on, its principal."""
    hub.enter(stream, context.peer() or "", auth.current().name)


async def headers_first(context: grpc.aio.ServicerContext) -> None:
    """Send the response headers before any message: when a pump is cancelled
    in the write that carries them (a first message larger than the client's
    window), gRPC never sends the status and the client hangs to its deadline."""
    await context.send_initial_metadata(())


async def _run_until_stopped(stop: Stop, *tasks: asyncio.Task[Any]) -> None:
    """Wait for the first task to end or the stop signal; cancel the rest.
    Re-raises a task's error; raises the stop's LedgerError."""
    stopper = asyncio.create_task(stop.event.wait())
    try:
        done, _ = await asyncio.wait({stopper, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (stopper, *tasks):
            t.cancel()
        for t in (stopper, *tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    for t in tasks:
        if t in done and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    if stop.reason is not None:
        raise _stop_error(stop.reason, stop.limit)


class StreamHandlers:
    """Mixed into LedgerService: needs self.writer, self.hub, self.history."""

    writer: Any
    hub: FenceHub
    history: HistoryReader
    history_executor: ThreadPoolExecutor
    max_tracked_per_stream: int

    # -- KeepAlive -------------------------------------------------------------------

    async def _keepalive(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        requests = aiter(requests)
        first = await anext(requests, None)
        if first is None:
            return
        if isinstance(first, Malformed):
            raise validation(first.field, f"undecodable {first.type_name}: {first.error}")
        if first.WhichOneof("kind") != "hello":
            raise validation("hello", "the first message must be hello{owner}")
        owner = validate.owner(first.hello.owner, "hello.owner")
        auth.check_owner(auth.current(), owner, "hello.owner")
        name = validate.stream_name(first.hello.stream_name, "hello.stream_name")
        session = Session(owner, limit=self.hub.queue_limit)
        enter(self.hub, session, context)
        self.hub.add(session, name)
        try:
            await headers_first(context)
            reader = asyncio.create_task(self._keepalive_reader(session, requests))
            pump = asyncio.create_task(self._keepalive_pump(session, context))
            await _run_until_stopped(session.stop, reader, pump)
        finally:
            self.hub.drop(session)
            self.hub.leave(session)

    async def _keepalive_pump(self, session: Session, context: grpc.aio.ServicerContext) -> None:
        """Write the outbox; messages already waiting go out as one `batch`."""
        outbox = session.outbox
        while True:
            msg = await outbox.get()
            if not outbox.empty():
                batch = [msg]
                while not outbox.empty() and len(batch) < MAX_BATCH:
                    batch.append(outbox.get_nowait())
                msg = pb.KeepAliveResponse(batch=batch)
                session.uncharge(len(batch))
            else:
                session.uncharge(1)
            await context.write(msg)

    async def _keepalive_reader(self, session: Session, requests: AsyncIterator[Any]) -> None:
        async for msg in requests:
            run_id = ""
            try:
                if isinstance(msg, Malformed):
                    raise validation(msg.field, f"undecodable {msg.type_name}: {msg.error}")
                kind = msg.WhichOneof("kind")
                if kind == "renew":
                    run_id = msg.renew.run_id
                    full = self._stream_renew(session, msg.renew)
                    if full is not None:
                        await full
                elif kind == "track":
                    run_id = msg.track.run_id
                    validate.run_id(run_id, "track.run_id")
                    token = validate.fencing_token(msg.track.fencing_token, "track.fencing_token")
                    self._check_room(session, run_id)
                    self.hub.track(session, run_id, token)
                elif kind == "untrack":
                    run_id = msg.untrack.run_id
                    validate.run_id(run_id, "untrack.run_id")
                    self.hub.untrack(session, run_id)
                elif kind == "hello":
                    raise validation("hello", "may be sent only once, first")
                elif not msg.renews:
                    raise validation("kind", "empty message: set renew(s), track or untrack")
            except LedgerError as err:
                session.send(_error(run_id, err))
            for r in msg.renews if not isinstance(msg, Malformed) else ():
                try:
                    full = self._stream_renew(session, r)
                except LedgerError as err:
                    session.send(_error(r.run_id, err))
                    continue
                if full is not None:
                    await full
        # the client half-closed: it is done with this stream

    def _stream_renew(self, session: Session, r: Any) -> Awaitable[None] | None:
        """Validate a renewal and hand it to the writer; answered by callback in
        the commit's own loop turn (no future per renewal). When the writer's
        queue is full, returns what to await before reading on: the stream
        stops reading (back-pressure) instead of refusing a renewal."""
        ttl = r.lease_ttl_ms if r.HasField("lease_ttl_ms") else None
        cmd = validate.command(L.Renew(r.run_id, session.owner, r.fencing_token, ttl))
        if r.run_id not in session.tracked:
            self._check_room(session, r.run_id)
            session.start_renewing(r.run_id)
        answer = functools.partial(self._renew_done, session, r.run_id, r.fencing_token)
        if self.writer.submit_with_answer(cmd, answer):
            return None
        return self.writer.submit_with_answer_waiting(cmd, answer)

    def track_acquired(self, name: str, owner: str, run_id: str, token: int) -> bool:
        """An acquire's ``track_on``: track the granted (run, token) on the open
        KeepAlive stream of ``owner`` named ``name``, as its `track` would.
        False when there is none or it has no room (the client sends `track`)."""
        session = self.hub.named.get(name)
        if session is None or session.owner != owner or session.stop.reason is not None:
            return False
        try:
            self._check_room(session, run_id)
        except LedgerError:
            return False
        self.hub.track(session, run_id, token)
        return True

    def _check_room(self, session: Session, run_id: str) -> None:
        """Refuse to track one more run past --max-tracked-per-stream, or past
        its connection's (or principal's) limit over all of its streams."""
        if run_id in session.tracked or run_id in session.renewing:
            return
        limit = self.max_tracked_per_stream
        if len(session.tracked) + len(session.renewing) >= limit:
            raise self._limit_reached("stream", limit, "untrack some or open another stream")
        for b in session.budgets:
            if b.tracked >= b.max_tracked:
                raise self._limit_reached(
                    b.kind, b.max_tracked,
                    "untrack some" if b.kind == "principal" else
                    "untrack some or use another connection",
                    b.key if b.kind == "principal" else None)

    def _limit_reached(
        self, per: str, limit: int, advice: str, principal: str | None = None
    ) -> LedgerError:
        name = f"max_tracked_per_{per}"
        self.hub.limit_hits[name] += 1
        whose = {"stream": "this stream already tracks",
                 "connection": "this connection's streams already track",
                 "principal": f"the streams of principal {principal!r} already track"}[per]
        metadata = {"limit": name, "value": str(limit)}
        if principal is not None:
            metadata["principal"] = principal
        return LedgerError(
            Code.STREAM_LIMIT_EXCEEDED,
            f"{whose} {limit} leases (--{name.replace('_', '-')}); {advice}",
            metadata=metadata,
        )

    def _renew_done(self, session: Session, run_id: str, token: int, result: Any) -> None:
        session.done_renewing(run_id)
        if session not in self.hub.sessions:
            return
        if not isinstance(result, BaseException):
            self.hub.renewed(session, run_id, token)
        elif isinstance(result, LedgerError) and result.code is Code.RUN_LEASE_LOST:
            self.hub.untrack(session, run_id)
            self.hub.push_lost(
                session, run_id, token, lost_reason(result.record, token), result.record
            )
        elif isinstance(result, LedgerError):
            session.send(_error(run_id, result))
        else:
            log.error("renew failed unexpectedly: %r", result)
            session.send(_error(run_id, LedgerError(Code.STORAGE_UNAVAILABLE, "internal error")))

    # -- WatchRuns -------------------------------------------------------------------

    async def _watch(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        if len(request.run_ids) > MAX_WATCH_IDS:
            raise validation("run_ids", f"at most {MAX_WATCH_IDS} ids")
        for i, rid in enumerate(request.run_ids):
            validate.run_id(rid, f"run_ids[{i}]")
        start = validate.int_range("from_revision", request.from_revision, 0, MAX_SAFE)
        watch = Watch(frozenset(request.run_ids), limit=self.hub.queue_limit)
        enter(self.hub, watch, context)
        self.hub.watchers.add(watch)  # subscribe first ...
        self.hub.opened(watch)
        upto = self.writer.state.revision  # ... then read the revision: no gap, no dup
        try:
            if start and start <= self.writer.state.compacted:
                raise LedgerError(
                    Code.RUN_REVISION_COMPACTED,
                    f"from_revision {start} is older than the retained history "
                    f"(oldest kept: {self.writer.state.compacted + 1}); re-list and watch "
                    "from the current revision",
                )
            await headers_first(context)
            pump = asyncio.create_task(self._watch_pump(watch, start, upto, context))
            await _run_until_stopped(watch.stop, pump)
        finally:
            self.hub.watchers.discard(watch)
            self.hub.leave(watch)

    def _in_executor(self, fn: Any, *args: Any) -> Awaitable[Any]:
        return asyncio.get_running_loop().run_in_executor(self.history_executor, fn, *args)

    async def _watch_pump(
        self, watch: Watch, start: int, upto: int, context: grpc.aio.ServicerContext
    ) -> None:
        if start:
            nxt = start
            while nxt <= upto:
                rows = await self._in_executor(self.history.read, nxt, upto, REPLAY_PAGE)
                if not rows or rows[0][0] != nxt:
                    raise LedgerError(
                        Code.RUN_REVISION_COMPACTED,
                        f"revision {nxt} was compacted during replay; re-list and watch again",
                    )
                for rev, run_id, kind, rec in rows:
                    if rec is not None and out_of_range(rec) is not None:
                        continue  # stored past the bound (by hand): never served
                    if not watch.run_ids or run_id in watch.run_ids:
                        await context.write(watch_message(rev, kind, run_id, rec))
                nxt = rows[-1][0] + 1
        queue = watch.queue
        while True:
            ev = await queue.get()
            watch.uncharge(1)
            if ev.revision < start:  # from_revision in the future: not there yet
                continue
            await context.write(watch_message(ev.revision, ev.kind, ev.run_id, ev.record))
