"""Whether a mutation can have left this process.

gRPC reports UNAVAILABLE both for a call that never reached a server (the
connection was refused, nothing was sent) and for one whose connection broke
after it was sent (the server may have applied it). Only the second is an
unknown outcome. So before each attempt of a mutation the SDK makes sure the
channel is connected (READY), waiting for a connection that is being set up
within the attempt's deadline; when it is not, the attempt fails with
``UnavailableError`` (never ``OutcomeUnknownError``) without sending
anything, and is retried like any UNAVAILABLE. An attempt made on a connected channel may have
been sent, and its UNAVAILABLE stays an unknown outcome. (The check errs on
the safe side: a connection that drops between the check and the send is
reported as unknown, never the other way round.)
"""

from __future__ import annotations

import asyncio

import grpc

from ._errors import UnavailableError

_READY = grpc.ChannelConnectivity.READY
_GIVE_UP = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def connected(channel: grpc.aio.Channel) -> bool:
    """Whether ``channel`` is READY now (asking it to connect when idle)."""
    return channel.get_state(try_to_connect=True) is _READY


async def until_connected(channel: grpc.aio.Channel, timeout_s: float | None) -> None:
    """Return once ``channel`` is READY; raise ``UnavailableError`` when it is in
    TRANSIENT_FAILURE (the last connection attempt failed) or shut down, or is
    still connecting after ``timeout_s``."""
    state = channel.get_state(try_to_connect=True)
    if state is _READY:
        return
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while state is not _READY:
        if state in _GIVE_UP:
            raise _not_sent(f"no connection to the server ({state.name.lower()})")
        try:
            async with asyncio.timeout_at(deadline):
                await channel.wait_for_state_change(state)
        except TimeoutError:
            raise _not_sent(f"still connecting after {timeout_s:g} s") from None
        state = channel.get_state(try_to_connect=True)


def _not_sent(why: str) -> UnavailableError:
    return UnavailableError(f"{why}: the call was not sent", code="UNAVAILABLE",
                        grpc_code=grpc.StatusCode.UNAVAILABLE)
