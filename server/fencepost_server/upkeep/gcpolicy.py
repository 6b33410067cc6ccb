"""When a serving process runs CPython's full garbage collections.

A full collection walks every object the collector tracks while holding the
GIL, so it stalls the event loop and the writer thread together. A server
holding many leases keeps two such objects per lease (its ``Record`` and
``Lease``); with 100 000 leases a full collection takes 100-200 ms, and more
on a busy machine. CPython's own rule runs one whenever the objects that
survived the young generations since the last one exceed a quarter of all
long-lived objects, and every renewal replaces a lease's two objects with
two new survivors: at 5 000 renewals/s that is a full collection every few
seconds, and every renewal in flight during one waits it out (measured: a
renewal p99 of several hundred milliseconds).

``serve`` therefore leaves the young generations to CPython (they are cheap
and collect most cyclic garbage) and runs the full collection itself, once
every ``FULL_EVERY_S``. Reference counting still frees everything that is not
part of a cycle at once; the cost is that cyclic garbage which outlived two
young collections waits up to that long to be freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

log = logging.getLogger("fencepost.gc")

FULL_EVERY_S = 300.0
# gc.set_threshold's third value: young-generation-1 collections between two
# automatic full collections; this many never comes (a C int's largest value)
NEVER = 2**31 - 1


class FullCollections:
    """Owns the process's full-collection schedule while started."""

    def __init__(self, every_s: float = FULL_EVERY_S) -> None:
        if every_s <= 0:
            raise ValueError("every_s must be positive")
        self.every_s = every_s
        self.collections = 0
        self._saved: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, tasks: asyncio.TaskGroup) -> None:
        """Stop CPython's automatic full collections; run one every ``every_s``
        in ``tasks`` instead."""
        young, middle, _ = self._saved = gc.get_threshold()
        gc.set_threshold(young, middle, NEVER)
        self._task = tasks.create_task(self._run(), name="fencepost-gc")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.collect()

    def collect(self) -> int:
        """One full collection now; returns the objects it freed."""
        started = time.perf_counter()
        freed = gc.collect()
        self.collections += 1
        log.debug("full garbage collection: %d objects freed in %.0f ms",
                  freed, (time.perf_counter() - started) * 1000)
        return freed

    async def stop(self) -> None:
        """Cancel the schedule and give CPython back its own rule."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
