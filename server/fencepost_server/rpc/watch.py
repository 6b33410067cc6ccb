"""Ledger.WatchRuns (docs/SPEC.md §6): replay from the history, then the
changes the hub offers the watch, each as a WatchRunsResponse."""

from __future__ import annotations

import asyncio
from typing import Protocol

import grpc

from fencepost.v1 import ledger_pb2 as pb

from ..core import validate
from ..core.errors import Code, LedgerError, validation
from ..core.records import KIND_DELETE, MAX_SAFE, Record, out_of_range
from ..hub import FenceHub, Watch
from ..writer import Writer
from .convert import record_to_pb
from .pump import enter, headers_first, run_until_stopped

MAX_WATCH_IDS = 1000
REPLAY_PAGE = 1000


class History(Protocol):
    """What replay needs: the retained changes in a revision range, oldest
    first (a read the database could not answer raises STORAGE_UNAVAILABLE)."""

    async def read(
        self, from_revision: int, to_revision: int, limit: int
    ) -> list[tuple[int, str, int, Record | None]]: ...


def watch_message(
    revision: int, kind: int, run_id: str, rec: Record | None
) -> pb.WatchRunsResponse:
    msg = pb.WatchRunsResponse(
        revision=revision,
        kind=pb.CHANGE_KIND_DELETE if kind == KIND_DELETE else pb.CHANGE_KIND_PUT,
        run_id=run_id,
    )
    if rec is not None:
        msg.record.CopyFrom(record_to_pb(rec))
    return msg


class WatchHandler:
    def __init__(self, writer: Writer, hub: FenceHub, history: History) -> None:
        self.writer = writer
        self.hub = hub
        self.history = history

    async def __call__(
        self, request: pb.WatchRunsRequest, context: grpc.aio.ServicerContext
    ) -> None:
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
            if start and start <= upto and self.writer.storage.sharing:
                raise LedgerError(
                    Code.RUN_REVISION_COMPACTED,
                    f"from_revision {start}: a watch resumes from a revision only where one "
                    "coordinator leads every shard (not with --lead-shards); re-list and watch "
                    "from the current revision",
                )
            if start and start <= self.writer.state.compacted:
                raise LedgerError(
                    Code.RUN_REVISION_COMPACTED,
                    f"from_revision {start} is older than the retained history "
                    f"(oldest kept: {self.writer.state.compacted + 1}); re-list and watch "
                    "from the current revision",
                )
            await headers_first(context)
            pump = asyncio.create_task(self._pump(watch, start, upto, context))
            await run_until_stopped(watch.stop, pump)
        finally:
            self.hub.watchers.discard(watch)
            self.hub.leave(watch)

    async def _pump(
        self, watch: Watch, start: int, upto: int, context: grpc.aio.ServicerContext
    ) -> None:
        if start:
            nxt = start
            while nxt <= upto:
                rows = await self.history.read(nxt, upto, REPLAY_PAGE)
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
