"""Ledger.WatchRuns (docs/SPEC.md §6): replay from the history, then the
changes the hub offers the watch, each as a WatchRunsResponse."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import grpc

from fencepost.v1 import ledger_pb2 as pb

from ..core import validate
from ..core.errors import Code, LedgerError, validation
from ..core.records import KIND_DELETE, MAX_SAFE, Record, out_of_range
from ..core.shards import shard_of
from ..hub import FenceHub, Watch
from ..writer import Writer
from .convert import record_to_pb
from .pump import enter, headers_first, run_until_stopped

MAX_WATCH_IDS = 1000
REPLAY_PAGE = 1000


class History(Protocol):
    """What replay needs: the retained changes in a revision range, oldest
    first, and (leading shards apart) each shard's highest pruned revision (a
    read the database could not answer raises STORAGE_UNAVAILABLE)."""

    async def read(
        self, from_revision: int, to_revision: int, limit: int
    ) -> list[tuple[int, str, int, Record | None]]: ...

    async def pruned_by_shard(self) -> dict[int, int]: ...


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
        # TEST-ONLY broken build (--fault watch-drops-change): revisions never sent
        self.drops: Callable[[int], bool] | None = None

    async def __call__(
        self, request: pb.WatchRunsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        if len(request.run_ids) > MAX_WATCH_IDS:
            raise validation("run_ids", f"at most {MAX_WATCH_IDS} ids")
        for i, rid in enumerate(request.run_ids):
            validate.run_id(rid, f"run_ids[{i}]")
        start = validate.int_range("from_revision", request.from_revision, 0, MAX_SAFE)
        count = self.writer.storage.shards
        after = self._shards(request, count)
        if after is not None:
            if start:
                raise validation("from_revision", "must be 0 in a watch by shards (each shard "
                                 "resumes after its own revision)")
            self.writer.check_led_shards(sorted(after))
        watch = Watch(frozenset(request.run_ids), limit=self.hub.queue_limit,
                      shards=None if after is None else frozenset(after), count=count)
        enter(self.hub, watch, context)
        self.hub.watchers.add(watch)  # subscribe first ...
        self.hub.opened(watch)
        upto = self.writer.state.revision  # ... then read the revision: no gap, no dup
        try:
            if after is not None:
                await self._by_shards(watch, after, upto, context)
                return
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

    @staticmethod
    def _shards(request: pb.WatchRunsRequest, count: int) -> dict[int, int | None] | None:
        """A watch by shards' ``{shard: after_revision}`` (None: from now), or
        None for a watch by revision."""
        if not request.shards:
            return None
        after: dict[int, int | None] = {}
        for i, c in enumerate(request.shards):
            shard = validate.int_range(f"shards[{i}].shard", c.shard, 0, count - 1)
            if shard in after:
                raise validation(f"shards[{i}].shard", f"shard {shard} is listed twice")
            after[shard] = validate.int_range(
                f"shards[{i}].after_revision", c.after_revision, 0, MAX_SAFE
            ) if c.HasField("after_revision") else None
        return after

    async def _by_shards(self, watch: Watch, after: dict[int, int | None], upto: int,
                         context: grpc.aio.ServicerContext) -> None:
        """A watch by shards: each shard from its own revision (None: from
        ``upto``, now), refused RUN_REVISION_COMPACTED where its history after
        that revision is no longer whole."""
        cursors = {s: upto if rev is None else rev for s, rev in after.items()}
        await self._check_retained(cursors)
        await headers_first(context)
        await context.write(pb.WatchRunsResponse(cursors=[
            pb.ShardCursor(shard=s, after_revision=rev) for s, rev in sorted(cursors.items())]))
        pump = asyncio.create_task(self._pump_shards(watch, cursors, upto, context))
        await run_until_stopped(watch.stop, pump)

    async def _check_retained(self, cursors: dict[int, int], during: str = "") -> None:
        """RUN_REVISION_COMPACTED unless every shard's changes after its cursor
        are all retained (one leader: below ``compacted`` every change is gone;
        shards led apart: each shard's highest pruned revision)."""
        if self.writer.storage.sharing:
            pruned = await self.history.pruned_by_shard()
        else:
            pruned = dict.fromkeys(cursors, self.writer.state.compacted)
        gone = sorted(s for s, rev in cursors.items() if pruned.get(s, 0) > rev)
        if gone:
            s = gone[0]
            raise LedgerError(
                Code.RUN_REVISION_COMPACTED,
                f"shards[{s}]: changes after revision {cursors[s]} were pruned from the "
                f"retained history{during} (pruned up to {pruned[s]}"
                f"{f', and {len(gone) - 1} other shards' if len(gone) > 1 else ''}); "
                "re-list and watch from now",
                metadata={"shard": str(s)})

    async def _pump_shards(self, watch: Watch, cursors: dict[int, int], upto: int,
                           context: grpc.aio.ServicerContext) -> None:
        count = watch.count
        nxt = min(cursors.values()) + 1
        contiguous = not self.writer.storage.sharing  # shards led apart leave gaps
        while nxt <= upto:
            rows = await self.history.read(nxt, upto, REPLAY_PAGE)
            if contiguous and (not rows or rows[0][0] != nxt):
                raise LedgerError(
                    Code.RUN_REVISION_COMPACTED,
                    f"revision {nxt} was compacted during replay; re-list and watch again")
            for rev, run_id, kind, rec in rows:
                shard = shard_of(run_id, count)
                if rev <= cursors.get(shard, MAX_SAFE):
                    continue
                if rec is not None and out_of_range(rec) is not None:
                    continue  # stored past the bound (by hand): never served
                if self.drops is not None and self.drops(rev):
                    continue
                if not watch.run_ids or run_id in watch.run_ids:
                    msg = watch_message(rev, kind, run_id, rec)
                    msg.shard = shard
                    await context.write(msg)
            if not rows:
                break
            nxt = rows[-1][0] + 1
        if not contiguous:  # what was read is whole only if nothing past a cursor went since
            await self._check_retained(cursors, " during the replay")
        queue = watch.queue
        while True:
            ev = await queue.get()
            watch.uncharge(1)
            shard = watch.shard_of.popleft()  # (computed once, when it was offered)
            if ev.revision <= cursors[shard]:  # a cursor from the future: not there yet
                continue
            if self.drops is not None and self.drops(ev.revision):
                continue
            msg = watch_message(ev.revision, ev.kind, ev.run_id, ev.record)
            msg.shard = shard
            await context.write(msg)

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
                    if self.drops is not None and self.drops(rev):
                        continue
                    if not watch.run_ids or run_id in watch.run_ids:
                        await context.write(watch_message(rev, kind, run_id, rec))
                nxt = rows[-1][0] + 1
        queue = watch.queue
        while True:
            ev = await queue.get()
            watch.uncharge(1)
            if ev.revision < start:  # from_revision in the future: not there yet
                continue
            if self.drops is not None and self.drops(ev.revision):
                continue
            await context.write(watch_message(ev.revision, ev.kind, ev.run_id, ev.record))
