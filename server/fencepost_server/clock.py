"""The server's clock. Only the server's clock decides expiry (docs/SPEC.md §4).

``SystemClock`` reads the system wall clock (never the database's). Tests inject
``fencepost_server.testing.clock.ManualClock`` and move it explicitly; they
never sleep waiting for an expiry.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class OffsetClock:
    """The system clock plus an offset that only grows (the torture hook that
    jumps the server's clock forward in a real process)."""

    def __init__(self) -> None:
        self._offset = 0
        self._system = SystemClock()

    def now_ms(self) -> int:
        return self._system.now_ms() + self._offset

    def jump(self, ms: int) -> int:
        if ms < 0:
            raise ValueError("a clock does not go backwards")
        self._offset += ms
        return self.now_ms()
