"""The group-commit hold (DESIGN.md, "The commit delay"): under concurrent
load a batch is held open a little so more commands share its transaction,
its fsync and its thread hop; never while idle or lightly loaded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

COMMIT_SIBLINGS = 4  # hold only after a batch of at least this many commands
COMMIT_GATHER = 32  # a hold ends once this many commands are queued, at most
COMMIT_GATHER_DECAY = 63 / 64  # per batch, of the largest recent batch size
COMMIT_HOLD_BUSY = 0.5  # hold only while the loop's thread uses this CPU share
COMMIT_BUSY_SAMPLE_S = 0.25
# The CPU seconds of the calling thread (the writer task runs on the loop's).
loop_cpu_time = time.thread_time


def wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


class CommitDelay:
    """When to hold a batch open for more commands, and the hold itself.
    Loop thread only."""

    def __init__(self, delay_ms: float) -> None:
        # PostgreSQL's commit_delay, MySQL's binlog_group_commit_sync_delay
        if not 0 <= delay_ms <= 100:
            raise ValueError("commit_delay_ms must be between 0 and 100")
        self.delay_s = delay_ms / 1000
        self.last_batch = 0
        self.gather = 0.0  # the largest recent batch, decaying
        self.loop_busy = 0.0  # the loop thread's CPU share, last measured
        self._busy_since = 0.0  # loop.time() and thread CPU time of that measure
        self._busy_cpu = 0.0
        self._wake: asyncio.Future[None] | None = None  # while a batch is held
        self._target = 0  # commands queued (with the held one) that end the hold

    def took(self, commands: int) -> None:
        """A batch of ``commands`` was taken off the queue."""
        self.last_batch = commands
        self.gather = max(float(commands), self.gather * COMMIT_GATHER_DECAY)

    def holds(self, queued: int) -> bool:
        """Whether to hold this batch (of ``queued`` so far) open for more."""
        return not (
            not self.delay_s
            or self.last_batch < COMMIT_SIBLINGS
            or self.loop_busy < COMMIT_HOLD_BUSY
            or queued >= self.target()
        )

    def target(self) -> int:
        """How many commands (the held one included) end a hold."""
        return min(COMMIT_GATHER, int(self.gather))

    def measure_busy(self, now: float) -> None:
        """The loop thread's share of CPU since the last measure, at most every
        COMMIT_BUSY_SAMPLE_S (the writer task runs on the loop's thread)."""
        since = now - self._busy_since
        if since < COMMIT_BUSY_SAMPLE_S:
            return
        cpu = loop_cpu_time()
        self.loop_busy = (cpu - self._busy_cpu) / since
        self._busy_since, self._busy_cpu = now, cpu

    async def hold(self, queued: Callable[[], int]) -> tuple[bool, bool]:
        """Hold the batch open until as many commands are queued as the
        largest recent batch had (at most COMMIT_GATHER), or the window ends;
        (it gathered nothing, the window ended it)."""
        loop = asyncio.get_running_loop()
        first = queued()
        woken = self._wake = loop.create_future()
        self._target = self.target()
        ran_out: list[bool] = []

        def window_ends() -> None:
            ran_out.append(True)
            wake(woken)

        timer = loop.call_later(self.delay_s, window_ends)
        try:
            await woken
        finally:
            timer.cancel()
            self._wake = None
        return queued() == first, bool(ran_out)

    def arrived(self, queued: int) -> None:
        """A command was queued (``queued`` now): a held batch ends once the
        target is queued."""
        if self._wake is not None and queued + 1 >= self._target:
            wake(self._wake)

    def cancel(self) -> None:
        """End a hold now (the writer is closing)."""
        wake(self._wake)
