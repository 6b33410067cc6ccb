"""A leader's renewal loop ends when cancelled, even when the cancellation lands
in the very loop turn its renewal completes (a stop then never hangs).

No database: the renewal is a future the test completes itself."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fencepost_server.clock import SystemClock
from fencepost_server.ha.leadership import Leadership


async def test_a_cancel_as_the_renewal_completes_ends_the_keeper() -> None:
    loop = asyncio.get_running_loop()
    leadership = Leadership("postgresql://unused", SystemClock(), address="127.0.0.1:1",
                            lease_ms=60_000, renew_ms=1)
    leadership.valid_until = time.monotonic() + 60
    renewals: list[asyncio.Future[str]] = []
    asked = asyncio.Event()

    def run_in_executor(executor: Any, fn: Any, *args: Any) -> asyncio.Future[str]:
        fut: asyncio.Future[str] = loop.create_future()
        renewals.append(fut)
        asked.set()
        return fut

    loop.run_in_executor = run_in_executor  # type: ignore[method-assign,assignment]
    try:
        keeper = asyncio.create_task(leadership.keep())
        await asyncio.wait_for(asked.wait(), 2)
        await asyncio.sleep(0)  # the keeper now waits on its renewal
        renewals[0].set_result("")  # renewed ...
        keeper.cancel()  # ... and stopped, in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(keeper), 2)
        assert len(renewals) == 1  # it did not go on renewing
    finally:
        del loop.run_in_executor  # type: ignore[attr-defined]
        leadership._thread.shutdown(wait=False)
