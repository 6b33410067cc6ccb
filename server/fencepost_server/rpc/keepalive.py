"""Ledger.KeepAlive (docs/SPEC.md §6): renewals in, and out what the hub
tells each session (renewed, lost, expiring) as KeepAliveResponse messages.

A renewal is built by the command registry (``commands.stream_renew``),
handed to the writer, and answered by callback in the commit's own loop turn
(no future per renewal); the hub learns the lease's new expiry from the
writer's publication, as it does for every renewal.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc

from fencepost.v1 import ledger_pb2 as pb

from .. import auth
from ..core import validate
from ..core.errors import Code, LedgerError, validation
from ..core.records import Record, out_of_range
from ..hub import FenceHub, LostReason, Session, lost_reason
from ..writer import Writer
from .commands import stream_renew
from .convert import _set_ts, _ts, record_to_pb
from .decode import Malformed
from .pump import enter, headers_first, run_until_stopped
from .status import keepalive_error, undecodable

log = logging.getLogger("fencepost.streams")

MAX_BATCH = 4096  # KeepAlive answers coalesced into one message
LOST_REASON = {reason: pb.LostReason.Value(f"LOST_REASON_{reason.name}") for reason in LostReason}


@dataclass(eq=False)
class KeepAliveSession(Session):
    """A hub session whose events go to its client as KeepAliveResponse
    messages, through a queue counted against the stream's limits."""

    outbox: asyncio.Queue[pb.KeepAliveResponse] = field(default_factory=asyncio.Queue)
    # this loop turn's `renewed` answers, written in place into one `batch`
    # message (no message, copy and queue entry per renewal); queued at the
    # turn's end, or before any other event, so the order is kept
    pending: pb.KeepAliveResponse | None = None

    def send(self, msg: pb.KeepAliveResponse) -> None:
        if self.pending is not None:
            self.flush()
        if self.charge(1):
            self.outbox.put_nowait(msg)

    def flush(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None and self.stop.reason is None:
            self.outbox.put_nowait(pending)

    def clear(self) -> None:
        self.pending = None
        while not self.outbox.empty():
            self.outbox.get_nowait()

    def renewed(self, run_id: str, token: int, expires_at: int, ttl_remaining_ms: int) -> None:
        if not self.charge(1):
            return
        pending = self.pending
        if pending is None or len(pending.batch) >= MAX_BATCH:
            if pending is None:
                asyncio.get_running_loop().call_soon(self.flush)
            else:
                self.flush()
            pending = self.pending = pb.KeepAliveResponse()
        r = pending.batch.add().renewed
        r.run_id = run_id
        r.fencing_token = token
        _set_ts(r.expires_at, expires_at)
        r.ttl_remaining_ms = ttl_remaining_ms

    def lost(self, run_id: str, token: int, reason: LostReason, record: Record | None) -> None:
        lost = pb.KeepAliveLost(run_id=run_id, fencing_token=token, reason=LOST_REASON[reason])
        if record is not None and out_of_range(record) is None:  # past the bound: never served
            lost.record.CopyFrom(record_to_pb(record))
        self.send(pb.KeepAliveResponse(lost=lost))

    def expiring(self, run_id: str, token: int, expires_at: int) -> None:
        self.send(pb.KeepAliveResponse(expiring=pb.KeepAliveExpiring(
            run_id=run_id, fencing_token=token, expires_at=_ts(expires_at))))


def _add(out: pb.KeepAliveResponse, msg: pb.KeepAliveResponse) -> None:
    """Add ``msg``'s events to the batch ``out``."""
    if msg.batch:
        out.batch.extend(msg.batch)
    else:
        out.batch.append(msg)


class KeepAliveHandler:
    def __init__(self, writer: Writer, hub: FenceHub, *, max_tracked_per_stream: int) -> None:
        self.writer = writer
        self.hub = hub
        self.max_tracked_per_stream = max_tracked_per_stream

    async def __call__(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        requests = aiter(requests)
        first = await anext(requests, None)
        if first is None:
            return
        if isinstance(first, Malformed):
            raise undecodable(first)
        if first.WhichOneof("kind") != "hello":
            raise validation("hello", "the first message must be hello{owner}")
        owner = validate.owner(first.hello.owner, "hello.owner")
        auth.check_owner(auth.current(), owner, "hello.owner")
        name = validate.stream_name(first.hello.stream_name, "hello.stream_name")
        session = KeepAliveSession(owner, limit=self.hub.queue_limit)
        enter(self.hub, session, context)
        self.hub.add(session, name)
        try:
            await headers_first(context)
            reader = asyncio.create_task(self._reader(session, requests))
            pump = asyncio.create_task(self._pump(session, context))
            await run_until_stopped(session.stop, reader, pump)
        finally:
            self.hub.drop(session)
            self.hub.leave(session)

    async def _pump(self, session: KeepAliveSession, context: grpc.aio.ServicerContext) -> None:
        """Write the outbox; messages already waiting go out as one `batch`."""
        outbox = session.outbox
        while True:
            msg = await outbox.get()
            n = len(msg.batch) or 1  # a turn's renewals come as one `batch` already
            if not outbox.empty():
                out = pb.KeepAliveResponse()
                _add(out, msg)
                while not outbox.empty() and n < MAX_BATCH:
                    more = outbox.get_nowait()
                    n += len(more.batch) or 1
                    _add(out, more)
                msg = out
            session.uncharge(n)
            if n == 1 and msg.batch:
                msg = msg.batch[0]  # a lone event goes out as itself, as ever
            await context.write(msg)

    async def _reader(self, session: KeepAliveSession, requests: AsyncIterator[Any]) -> None:
        async for msg in requests:
            run_id = ""
            try:
                if isinstance(msg, Malformed):
                    raise undecodable(msg)
                kind = msg.WhichOneof("kind")
                if kind == "renew":
                    run_id = msg.renew.run_id
                    full = self._renew(session, msg.renew)
                    if full is not None:
                        await full
                elif kind == "track":
                    run_id = msg.track.run_id
                    validate.run_id(run_id, "track.run_id")
                    token = validate.fencing_token(msg.track.fencing_token, "track.fencing_token")
                    self.writer.check_led(run_id)  # NOT_OWNER: its owner tracks it
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
                session.send(keepalive_error(run_id, err))
            for r in msg.renews if not isinstance(msg, Malformed) else ():
                try:
                    full = self._renew(session, r)
                except LedgerError as err:
                    session.send(keepalive_error(r.run_id, err))
                    continue
                if full is not None:
                    await full
        # the client half-closed: it is done with this stream

    def _renew(self, session: KeepAliveSession, r: Any) -> Awaitable[None] | None:
        """Validate a renewal and hand it to the writer; answered by callback in
        the commit's own loop turn (no future per renewal). When the writer's
        queue is full, returns what to await before reading on: the stream
        stops reading (back-pressure) instead of refusing a renewal."""
        cmd = stream_renew(r, session.owner)
        if r.run_id not in session.tracked:
            self._check_room(session, r.run_id)
            session.start_renewing(r.run_id)
        answer = functools.partial(self._renewal_answered, session, r.run_id, r.fencing_token)
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

    def _renewal_answered(
        self, session: KeepAliveSession, run_id: str, token: int, result: Any
    ) -> None:
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
            session.send(keepalive_error(run_id, result))
        else:
            log.error("renew failed unexpectedly: %r", result)
            session.send(keepalive_error(
                run_id, LedgerError(Code.STORAGE_UNAVAILABLE, "internal error")))
