"""Committed reads (GetRun, ListRuns, the dashboard, retention, WatchRuns
replay): from the writer's committed state in memory, and for finished runs
memory no longer holds, and the retained history, from read-only connections
in threads of their own (the event loop never waits on the database). Never
writes. A read the database could not answer raises STORAGE_UNAVAILABLE."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..core.placement import Ownership
from ..core.records import Record, Status
from ..core.shards import tally
from ..storage.history import HistoryReader
from ..storage.sql import SqlStorage, answering, broken
from .state import LedgerState

T = TypeVar("T")

# Run ids a shard count hashes between two yields to the event loop (about
# 2 ms of work), and the pause after each: a real pause, not sleep(0), so the
# loop blocks in epoll and the writer thread gets the GIL (metrics.py's lease
# scan measured why).
SHARD_SCAN_CHUNK = 4096
SHARD_SCAN_PAUSE_S = 0.001
# A count is answered again for this long: however many callers ask, the loop
# hashes every run id at most once a second.
SHARD_COUNT_REUSE_MS = 1000


class ShardCounts:
    """Ledger runs and live leases per shard, the revision they reflect, and
    the server time the count began at (a lease live then is counted)."""

    __slots__ = ("began", "leases", "revision", "runs", "shards")

    def __init__(self, began: int, revision: int, runs: list[int], leases: list[int]) -> None:
        self.began, self.revision, self.runs, self.leases = began, revision, runs, leases
        self.shards = len(runs)


@dataclass(frozen=True, slots=True)
class ShardRow:
    """One shard of the map (Ledger.Shards, the dashboard): who leads it,
    and, where this coordinator leads it, its runs and live leases (0 for a
    shard led elsewhere)."""

    index: int
    owner: str
    address: str
    epoch: int
    runs: int
    leases: int


class Reads:
    """Reads over ``storage`` and the committed state ``state()`` returns (the
    writer's, read-only: the writer replaces it when it loads)."""

    def __init__(self, storage: SqlStorage, state: Callable[[], LedgerState],
                 leads: Callable[[str], bool] | None = None) -> None:
        """``leads(run_id)``: False for a run this coordinator does not lead
        right now (leading shards apart): listings leave it out, even while
        memory still holds it (a shard being given up)."""
        self.storage = storage
        self._state = state
        self._leads = leads
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencepost-reader")
        self._reader_db: Any = None
        # the last count per shard, and the one in flight (callers share it)
        self._shard_counts: ShardCounts | None = None
        self._shard_scan: asyncio.Future[ShardCounts] | None = None

    @property
    def state(self) -> LedgerState:
        return self._state()

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._reader, self._close_reader)
        self._reader.shutdown(wait=True)

    def _close_reader(self) -> None:
        if self._reader_db is not None:
            self._reader_db.close()
            self._reader_db = None

    def is_cold(self, run_id: str) -> bool:
        """A finished run that memory no longer holds (``read_runs`` reads it)."""
        st = self.state
        return run_id not in st.runs and run_id in st.index

    async def read_run(self, run_id: str) -> Record | None:
        """The run's committed record (None: no such run), as ``read_runs``."""
        st = self.state
        rec = st.runs.get(run_id)
        if rec is not None or run_id not in st.index:
            return rec
        return (await self.read_runs([run_id])).get(run_id)

    async def read_runs(self, run_ids: list[str]) -> dict[str, Record]:
        """Committed records by id: from memory, and for finished runs memory
        no longer holds, from the runs table. A run leaves memory only once
        the table reflects its last change, and any later change brings it
        back before it is published, so a record read there is never older
        than the state when this call began."""
        st = self.state
        out: dict[str, Record] = {}
        missing: list[str] = []
        for run_id in run_ids:
            rec = st.runs.get(run_id)
            if rec is not None:
                out[run_id] = rec
            elif run_id in st.index:
                missing.append(run_id)
        if missing:
            loop = asyncio.get_running_loop()
            with answering():
                got = await loop.run_in_executor(self._reader, self._read_cold, missing)
            for run_id in missing:
                # the writer may have changed it meanwhile: memory is newer
                rec = st.runs.get(run_id) or got.get(run_id)
                if rec is not None:
                    out[run_id] = rec
        return out

    async def page_runs(
        self,
        statuses: frozenset[Status],
        owner: str,
        limit: int,
        *,
        prefix: str = "",
        after: str | None = None,
        before: str | None = None,
    ) -> tuple[list[Record], bool]:
        """Up to ``limit`` committed records with one of ``statuses`` (any:
        empty) and lease ``owner`` (any: ""), in run-id order past ``after``
        (or, backwards, below ``before``) among the ids starting with
        ``prefix``; and whether another match lies beyond them. Walks the
        narrowest index the filters allow (index.py), a chunk at a time,
        reading finished runs memory no longer holds in bulk, so a page costs
        its matches plus what that index holds that the other filter refuses,
        not the size of the table. Each chunk walks afresh from the last id
        seen: the index may move while a read is awaited."""
        page: list[Record] = []
        while True:
            walk = self.state.index.walk(statuses, owner, prefix=prefix, after=after,
                                         before=before, reverse=before is not None)
            chunk = list(itertools.islice(walk, limit + 1 - len(page)))
            if not chunk:
                return page, False
            if before is not None:
                before = chunk[-1]
            else:
                after = chunk[-1]
            if self._leads is not None:
                chunk = [k for k in chunk if self._leads(k)]
            records = await self.read_runs(chunk)
            for k in chunk:
                rec = records.get(k)  # None: deleted meanwhile
                if rec is None or (statuses and rec.status not in statuses):
                    continue
                if owner and (rec.lease is None or rec.lease.owner != owner):
                    continue
                if len(page) == limit:
                    return page, True
                page.append(rec)

    async def finished_before(
        self, cutoff_ms: int, limit: int, after: tuple[int, str] | None = None
    ) -> list[tuple[str, int, int]]:
        """(run id, version, finished at) of finished runs the runs table holds,
        last changed before ``cutoff_ms``, oldest first from ``after`` (for
        retention)."""
        loop = asyncio.get_running_loop()
        with answering():
            return await loop.run_in_executor(
                self._reader,
                lambda: self.storage.finished_before(self._read_only(), cutoff_ms, limit, after),
            )

    async def shard_counts(self, shards: int, now: int) -> ShardCounts:
        """Ledger runs (every status) and leases live at the count's start per
        shard, over the committed state as it was when the count began (a
        snapshot), hashed a chunk at a time with the loop free in between. A
        count begun within SHARD_COUNT_REUSE_MS, or in flight, is shared."""
        got = self._shard_counts
        if got is None or got.shards != shards or not (
                0 <= now - got.began < SHARD_COUNT_REUSE_MS):
            if self._shard_scan is None or self._shard_scan.done():
                self._shard_scan = asyncio.ensure_future(self._count(shards, now))
            got = await asyncio.shield(self._shard_scan)
            if got.shards != shards:  # another count's scan was in flight
                got = await self._count(shards, now)
        return got

    async def shard_map(
        self, shards: int, now: int, me: tuple[str, str, int], ownership: Ownership | None,
        *, count: bool = True,
    ) -> tuple[int, list[ShardRow]]:
        """(the revision the counts reflect, every shard's row): ``me`` (identity,
        address, epoch) leads the shards ``ownership`` gives it (every one when
        None). Without ``count``, only who leads each (no pass over the runs)."""
        if count:
            counts = await self.shard_counts(shards, now)
        else:
            counts = ShardCounts(now, self.state.revision, [0] * shards, [0] * shards)
        rows = []
        for i in range(shards):
            if ownership is None or i in ownership.led:
                identity, address, epoch = me
                if ownership is not None and i in ownership.owners:  # each its own epoch
                    epoch = ownership.owners[i][1]
                rows.append(ShardRow(i, identity, address, epoch, counts.runs[i],
                                     counts.leases[i]))
            else:  # led elsewhere: its owner knows what is in it
                rows.append(ShardRow(i, "", *ownership.owners.get(i, ("", 0)), 0, 0))
        return counts.revision, rows

    async def _count(self, shards: int, now: int) -> ShardCounts:
        st = self.state
        # both replaced by the writer, never changed in place
        revision, ids, records = st.revision, list(st.index.status_of), list(st.runs.values())
        runs, leases = [0] * shards, [0] * shards
        await _tally_in_chunks(ids, shards, runs)
        for i in range(0, len(records), SHARD_SCAN_CHUNK):
            await asyncio.sleep(SHARD_SCAN_PAUSE_S)
            tally([rec.run_id for rec in records[i:i + SHARD_SCAN_CHUNK]
                   if rec.lease is not None and now < rec.lease.expires_at], shards, leases)
        self._shard_counts = ShardCounts(now, revision, runs, leases)
        return self._shard_counts

    def _read_cold(self, run_ids: list[str]) -> dict[str, Record]:
        return self.storage.read_runs(run_ids, self._read_only())

    def _read_only(self) -> Any:
        if self._reader_db is not None and broken(self._reader_db):
            with contextlib.suppress(Exception):
                self._reader_db.close()
            self._reader_db = None
        if self._reader_db is None:
            self._reader_db = self.storage.reader()
        return self._reader_db


async def _tally_in_chunks(keys: list[str], shards: int, counts: list[int]) -> None:
    for i in range(0, len(keys), SHARD_SCAN_CHUNK):
        if i:
            await asyncio.sleep(SHARD_SCAN_PAUSE_S)
        tally(keys[i:i + SHARD_SCAN_CHUNK], shards, counts)


class History:
    """The retained change history (storage/history.py) read in a thread of
    its own: WatchRuns replay and the dashboard's run history."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._history = HistoryReader(connect)  # a storage's ``reader``
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fencepost-history")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        with answering():
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def read(
        self, from_revision: int, to_revision: int, limit: int
    ) -> list[tuple[int, str, int, Record | None]]:
        """Changes ``from_revision``..``to_revision``, oldest first, at most ``limit``."""
        return await self._call(self._history.read, from_revision, to_revision, limit)

    async def stored_runs(self, statuses: frozenset[Status], owner: str, limit: int, *,
                          prefix: str = "", after: str | None = None,
                          before: str | None = None) -> tuple[list[Record], bool]:
        """``page_runs`` over the runs table: where coordinators lead shards
        apart, every shard's runs as last committed (a lease renewed from
        memory elsewhere shows its stored expiry)."""
        got = await self._call(self._history.stored_runs, sorted(int(s) for s in statuses),
                               owner, limit + 1, prefix, after, before)
        return got[:limit], len(got) > limit

    async def stored_run(self, run_id: str) -> Record | None:
        return await self._call(self._history.stored_run, run_id)

    async def stored_count(self) -> int:
        return await self._call(self._history.stored_count)

    async def pruned_by_shard(self) -> dict[int, int]:
        """Where coordinators lead shards apart: each shard's highest pruned revision."""
        return await self._call(self._history.pruned_by_shard)

    async def run_history(self, run_id: str, limit: int) -> list[tuple[int, int, Record | None]]:
        """One run's last ``limit`` retained changes, oldest first."""
        return await self._call(self._history.run_history, run_id, limit)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._history.close)
        self._thread.shutdown(wait=True)
