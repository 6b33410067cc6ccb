"""A watch by shards (docs/SPEC.md §6.2, §13): where coordinators lead shards
apart, revisions order changes only within a shard, so a watch over the
cluster keeps one revision per shard (``WatchCursor``), opens one WatchRuns
stream per owner for the shards it leads, merges them, and reopens a shard's
stream at its new owner, after the shard's cursor, when it moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import grpc

from ._connection import Connection, Line
from ._errors import (
    FencepostError,
    NotOwnerError,
    StreamTooSlowError,
    UnavailableError,
    from_rpc_error,
)
from ._records import WatchEvent, watch_event_from_pb
from .v1 import ledger_pb2, ledger_pb2_grpc

log = logging.getLogger("fencepost.client")

PREFIX = "fpw1:"
_ENTRY = re.compile(r"(0|[1-9][0-9]*)=(0|[1-9][0-9]*)")
# how soon a shard whose stream ended is asked for again: a hand-over
# takes milliseconds, a crashed owner's shards a lease
_FIRST_RETRY_S = 0.025
_MAX_RETRY_S = 1.0
_QUEUED = 256  # messages read ahead of the caller (then the streams' flow control holds)
# How a stream may end and be watched again after its cursor: UNAVAILABLE (the
# server gone or stopping, a shard moved), STREAM_TOO_SLOW, and CANCELLED,
# which gRPC gives the calls that reached a stopping server before a handler.
_RESUMED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def resumable(exc: FencepostError) -> bool:
    """Whether a watch stream that ended with ``exc`` is opened again."""
    return exc.grpc_code in _RESUMED or isinstance(exc, StreamTooSlowError)


class WatchCursor:
    """Where a watch by shards stands: per shard, the revision of the last
    change delivered (``revisions``). ``Client.watch(cursor=...)`` resumes
    each shard right after it and keeps the cursor current as it yields, so
    a cursor saved (``encode()``) after handling an event resumes after that
    event. A shard absent starts from the watch's start."""

    __slots__ = ("revisions",)

    def __init__(self, revisions: Mapping[int, int] | None = None) -> None:
        self.revisions: dict[int, int] = dict(revisions or {})
        for shard, rev in self.revisions.items():
            if shard < 0 or rev < 0:
                raise ValueError(f"cursor: shard {shard} at revision {rev}: both must be >= 0")

    def encode(self) -> str:
        """The cursor as text (``fpw1:0=17,3=16777230``), for ``decode``
        in any SDK."""
        return PREFIX + ",".join(f"{s}={r}" for s, r in sorted(self.revisions.items()))

    @classmethod
    def decode(cls, text: str) -> WatchCursor:
        """A cursor from ``encode()``'s text; ``ValueError`` naming ``cursor``."""
        if not text.startswith(PREFIX):
            raise ValueError(f"cursor: must start with {PREFIX!r} (got {text[:20]!r})")
        revisions: dict[int, int] = {}
        body = text[len(PREFIX):]
        for part in body.split(",") if body else ():
            m = _ENTRY.fullmatch(part)
            if m is None:
                raise ValueError(f"cursor: {part!r} is not SHARD=REVISION")
            shard = int(m.group(1))
            if shard in revisions:
                raise ValueError(f"cursor: shard {shard} appears twice")
            revisions[shard] = int(m.group(2))
        return cls(revisions)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WatchCursor) and other.revisions == self.revisions

    def __repr__(self) -> str:
        return f"WatchCursor({self.encode()!r})"


async def watch_by_shards(
    connection: Connection,
    count: int,
    run_ids: list[str],
    cursor: WatchCursor,
    total_timeout_s: float,
) -> AsyncGenerator[WatchEvent, None]:
    """Every change to ``run_ids`` (empty: every run) in each of the
    ``count`` shards after ``cursor``'s revision for it, from their owners'
    streams merged, updating ``cursor`` as each is yielded. Raises what ends a
    stream other than a move or an outage, and ``UnavailableError`` when some
    shard finds no owner to stream from for ``total_timeout_s``."""
    loop = asyncio.get_running_loop()
    revisions = cursor.revisions
    queue: asyncio.Queue[tuple[frozenset[int], Any, FencepostError | None]] = (
        asyncio.Queue(_QUEUED))
    streams: set[asyncio.Task[None]] = set()
    pending = set(range(count))
    stuck_since: float | None = loop.time()
    retry_at = 0.0
    wait = _FIRST_RETRY_S
    fresh = False  # the next placement fetches the map first
    last_failure: FencepostError | None = None

    def start(line: Line, shards: frozenset[int]) -> None:
        request = ledger_pb2.WatchRunsRequest(run_ids=run_ids, shards=[
            ledger_pb2.ShardCursor(shard=s, after_revision=revisions.get(s))
            for s in sorted(shards)])
        task = asyncio.create_task(_stream(line, request, shards, queue.put))
        streams.add(task)
        task.add_done_callback(streams.discard)

    try:
        while True:
            now = loop.time()
            if pending and now >= retry_at:
                placed = await _place(connection, pending, fresh)
                for line, shards in placed:
                    start(line, shards)
                    pending -= shards
                fresh = bool(pending)  # the shards no owner was known for: a new map next time
                if pending:
                    retry_at, wait = loop.time() + wait, min(wait * 2, _MAX_RETRY_S)
            if pending and stuck_since is not None and now - stuck_since > total_timeout_s:
                raise last_failure or UnavailableError(
                    f"shards {sorted(pending)[:8]} found no coordinator to watch them at "
                    f"for {total_timeout_s:.0f} s")
            try:
                shards, msg, failed = await asyncio.wait_for(
                    queue.get(), max(0.0, retry_at - loop.time()) if pending else None)
            except TimeoutError:
                continue
            if failed is None and msg is not None:
                if msg.cursors:  # a stream's start: where each of its shards stands
                    for c in msg.cursors:
                        revisions.setdefault(c.shard, c.after_revision)
                    if not pending:
                        stuck_since, wait = None, _FIRST_RETRY_S
                    continue
                if msg.revision <= revisions.get(msg.shard, 0):
                    continue  # never yield a change twice
                revisions[msg.shard] = msg.revision
                yield watch_event_from_pb(msg, shard=msg.shard)
                continue
            # a stream ended: its shards are watched again where they are led now
            if failed is not None and not resumable(failed):
                raise failed
            if isinstance(failed, NotOwnerError):
                await connection.learn(failed)
            log.info("watch of shards %s ended (%s); resuming each after its revision",
                     sorted(shards)[:8], failed or "closed by the server")
            last_failure = failed
            if stuck_since is None:  # the first to end since all streamed: asked again shortly
                retry_at, wait = loop.time() + _FIRST_RETRY_S, 2 * _FIRST_RETRY_S
            elif not pending:  # ended before it streamed: asked again after the backoff
                retry_at, wait = loop.time() + wait, min(wait * 2, _MAX_RETRY_S)
            pending |= shards
            fresh = True
            if stuck_since is None:
                stuck_since = loop.time()
    finally:
        for task in list(streams):
            task.cancel()
        for task in list(streams):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _place(connection: Connection, shards: set[int],
                 fresh: bool) -> list[tuple[Line, frozenset[int]]]:
    """The shards grouped by the line to their owner now (shards whose owner
    is not known yet are left out)."""
    lines = await connection.shard_lines(fresh)
    groups: dict[int, tuple[Line, set[int]]] = {}
    for shard in shards:
        line = connection.line if lines is None else lines[shard]
        if line is not None:
            groups.setdefault(id(line), (line, set()))[1].add(shard)
    return [(line, frozenset(group)) for line, group in groups.values()]


async def _stream(line: Line, request: ledger_pb2.WatchRunsRequest, shards: frozenset[int],
                  put: Callable[[tuple[frozenset[int], Any, FencepostError | None]], Any]
                  ) -> None:
    """One owner's stream of some shards: each message queued, then how it ended."""
    endpoint = line.endpoints.current
    call = endpoint.stub(ledger_pb2_grpc.LedgerStub).WatchRuns(request)
    try:
        async for msg in call:
            await put((shards, msg, None))
    except grpc.RpcError as err:
        exc = from_rpc_error(err, mutation=False)
        line.endpoints.after_failure(endpoint, exc)
        await put((shards, None, exc))
    else:
        await put((shards, None, None))
    finally:
        call.cancel()
