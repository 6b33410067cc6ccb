"""A server clock that only moves when a test moves it (the tests never sleep
for an expiry)."""

from __future__ import annotations

import threading


class ManualClock:
    """A clock that only moves when told to (thread-safe)."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> int:
        if ms < 0:
            raise ValueError("a clock does not go backwards")
        with self._lock:
            self._now += ms
            return self._now

    def set(self, now_ms: int) -> None:
        with self._lock:
            if now_ms < self._now:
                raise ValueError("a clock does not go backwards")
            self._now = now_ms
