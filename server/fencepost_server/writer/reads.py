"""Committed reads (GetRun, ListRuns, the dashboard, retention): from the
writer's committed state in memory, and for finished runs memory no longer
holds, from the runs table on a read-only connection in a thread of its own
(the event loop never waits on the database). Never writes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core.records import Record, Status
from ..storage.sql import SqlStorage, broken
from .state import LedgerState


class Reads:
    """Reads over ``storage`` and the committed state ``state()`` returns (the
    writer's, read-only: the writer replaces it when it loads)."""

    def __init__(self, storage: SqlStorage, state: Callable[[], LedgerState]) -> None:
        self.storage = storage
        self._state = state
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencepost-reader")
        self._reader_db: Any = None

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
        return await loop.run_in_executor(
            self._reader,
            lambda: self.storage.finished_before(self._read_only(), cutoff_ms, limit, after),
        )

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
