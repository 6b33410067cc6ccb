"""Retention of finished runs (``--retain-terminal``): a background task that
deletes runs finished longer ago than the retention through the ordinary write
path, so each deletion is one committed change with its revision, its WatchRuns
event and its tombstone (the run id's last fencing token is kept forever, so a
token is never reused for it).

Each pass walks the finished runs past the cutoff, oldest first, ``chunk``
at a time, from the runs table (its ``runs_finished_at`` index, on the writer's read-only
connection), and submits one ``Retire(run_id, version)`` each: the writer
deletes a run only if it is still finished and at that version, so a run
reopened or changed since the read is kept. Passes repeat at once while they
find a full chunk, then every ``interval_s``. The cutoff follows the server's
clock.
"""

from __future__ import annotations

import asyncio
import logging

from ..clock import Clock
from ..core import ledger as L
from ..core.errors import LedgerError
from ..writer import Reads, Writer, WriterClosed

log = logging.getLogger("fencepost.retention")

class Retention:
    def __init__(
        self,
        writer: Writer,
        reads: Reads,
        clock: Clock,
        retain_ms: int,
        *,
        interval_s: float | None = None,
        chunk: int = 500,
    ) -> None:
        if retain_ms <= 0:
            raise ValueError("retain_ms must be positive")
        self.writer = writer
        self.reads = reads
        self.clock = clock
        self.retain_ms = retain_ms
        # a tenth of the retention, between 1 s and 60 s
        self.interval_s = interval_s if interval_s is not None else min(
            60.0, max(1.0, retain_ms / 10_000)
        )
        self.chunk = chunk
        self.retired = 0  # runs deleted, for metrics and tests
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> int:
        """One pass over what is due now; the number of runs it deleted."""
        cutoff = self.clock.now_ms() - self.retain_ms
        done = 0
        after: tuple[int, str] | None = None  # a retired run's row stays until reflected
        while True:
            due = await self.reads.finished_before(cutoff, self.chunk, after)
            if not due:
                return done
            after = (due[-1][2], due[-1][0])
            owned = self.writer.ownership  # leading shards apart: each retires its own
            mine = due if owned is None else [
                d for d in due if owned.refusal_for_key(d[0]) is None]
            results = await asyncio.gather(
                *(self.writer.submit(L.Retire(run_id, version)) for run_id, version, _ in mine),
                return_exceptions=True,
            )
            deleted = 0
            for res in results:
                if isinstance(res, L.Deleted) and res.deleted:
                    deleted += 1
                elif isinstance(res, BaseException):
                    raise res
            done += deleted
            self.retired += deleted
            if len(due) < self.chunk:
                return done

    def start(self, tasks: asyncio.TaskGroup) -> None:
        self._task = tasks.create_task(self._loop(), name="fencepost-retention")

    async def _loop(self) -> None:
        while True:
            try:
                n = await self.run_once()
                if n:
                    log.info("retention: deleted %d runs finished more than %d ms ago",
                             n, self.retain_ms)
            except WriterClosed:
                return
            except LedgerError as exc:  # storage trouble: try again next time
                log.warning("retention pass failed: %s", exc.message)
            except Exception:
                log.exception("retention pass failed")
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
