"""What every Ledger stream (KeepAlive, WatchRuns, Execute) runs the same way.

Each stream's handler runs a *pump* task (messages out) and, for KeepAlive
and Execute, a *reader* task (messages in), and waits for the first of: the
pump ending, the reader ending, or the stream's Stop (overflow, shutdown).
The pump is cancelled from outside, so a client that stopped reading cannot
pin a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

from .. import auth
from ..core.errors import Code, LedgerError
from ..hub import Buffered, FenceHub, Stop


def stop_error(reason: str | None, limit: tuple[str, int] | None = None) -> LedgerError:
    """Why a stream ends (a ``Stop`` reason) as its refusal; an overflow names
    the limit it passed in the message and the metadata."""
    if reason == Stop.OVERFLOW:
        name, value = limit or ("max_queued_per_stream", 0)
        return LedgerError(
            Code.STREAM_TOO_SLOW,
            f"the stream fell too far behind reading and was dropped: more than {value} "
            f"answers queued unread (--{name.replace('_', '-')}); reconnect "
            "(WatchRuns: resume from the last revision received + 1)",
            metadata={"limit": name, "value": str(value)},
        )
    if reason == Stop.MOVED:
        shard = limit[1] if limit else 0
        return LedgerError(
            Code.NOT_OWNER,
            f"shard {shard} moved away from this coordinator: ask the shard map and watch it "
            "at its owner, after the last revision received in it",
            metadata={"shard": str(shard), "owner": "", "epoch": "0"})
    return LedgerError(Code.SHUTTING_DOWN, "the server is shutting down; reconnect")


def enter(hub: FenceHub, stream: Buffered, context: grpc.aio.ServicerContext) -> None:
    """Charge a new stream to its connection and, with identities on, its principal."""
    hub.enter(stream, context.peer() or "", auth.current().name)


async def headers_first(context: grpc.aio.ServicerContext) -> None:
    """Send the response headers before any message: when a pump is cancelled
    in the write that carries them (a first message larger than the client's
    window), gRPC never sends the status and the client hangs to its deadline."""
    await context.send_initial_metadata(())


async def run_until_stopped(stop: Stop, *tasks: asyncio.Task[Any]) -> None:
    """Wait for the first task to end or the stop signal; cancel the rest.
    Re-raises a task's error; raises the stop's LedgerError."""
    stopper = asyncio.create_task(stop.event.wait())
    try:
        done, _ = await asyncio.wait({stopper, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (stopper, *tasks):
            t.cancel()
        for t in (stopper, *tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    for t in tasks:
        if t in done and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    if stop.reason is not None:
        raise stop_error(stop.reason, stop.limit)
