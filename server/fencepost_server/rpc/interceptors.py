"""What the registry wraps around every servicer method, outermost last: the
auth guard, the leader gate, and the metrics instrument. A refusal is
answered with its status (status.py), before anything is read or done."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import grpc

from ..auth import Authenticator, Guard
from ..core.errors import LedgerError
from ..metrics import STREAM_KINDS, Metrics
from .status import refuse

Method = Callable[..., Any]


def guarded(authn: Authenticator, method: str, fn: Method, *, unary_request: bool) -> Method:
    """``fn`` behind auth.py's checks (identity, role, owners)."""
    guard = Guard(authn, method, unary_request=unary_request)

    @functools.wraps(fn)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            guard.admit(request, context)
        except LedgerError as err:
            await refuse(context, err)
            return None
        return await fn(request, context)

    return wrapper


def gated(gate: Callable[[], LedgerError | None], fn: Method) -> Method:
    """``fn``, refused with ``gate()``'s error while it returns one (unary
    calls and streams alike, before anything is read or done)."""

    @functools.wraps(fn)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        refusal = gate()
        if refusal is not None:
            await refuse(context, refusal)
            return None
        return await fn(request, context)

    return wrapper


def code_name(code: Any) -> str:
    """A status as its name (OK, NOT_FOUND...), from grpc.StatusCode or an int."""
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return c.name
    return "UNKNOWN"


def _failed_code(exc: BaseException, context: Any) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    set_code = context.code()
    return code_name(set_code) if set_code is not None else "UNKNOWN"


def instrumented(metrics: Metrics) -> Callable[[str, str, Method], Method]:
    """``instrument(service, method, fn)``: ``fn`` timed into
    fencepost_rpc_duration_seconds, and counted in fencepost_open_streams
    while open when it is a stream."""

    def instrument(service: str, method: str, fn: Method) -> Method:
        short = service.rsplit(".", 1)[-1]
        kind = STREAM_KINDS.get(method)
        gauge = metrics.open_streams.labels(kind) if kind else None
        hist = metrics.rpc_seconds

        async def call(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            code = "OK"
            if gauge is not None:
                gauge.inc()
            try:
                return await fn(request, context)
            except BaseException as exc:
                code = _failed_code(exc, context)
                raise
            finally:
                if gauge is not None:
                    gauge.dec()
                if code == "OK":
                    set_code = context.code()
                    if set_code not in (None, 0, grpc.StatusCode.OK):
                        code = code_name(set_code)
                hist.labels(short, method, code).observe(time.perf_counter() - started)

        return call

    return instrument
