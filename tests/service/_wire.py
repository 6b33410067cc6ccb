"""Helpers for wire tests: read the rich error of a failed call; run Execute."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from fencepost.v1 import ledger_pb2, record_pb2


@dataclass
class WireError:
    code: grpc.StatusCode
    message: str
    reason: str
    domain: str
    metadata: dict[str, str]
    record: record_pb2.Run | None


def wire_error(err: grpc.RpcError) -> WireError:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, f"no rich status on {err}"
    info = error_details_pb2.ErrorInfo()
    run: record_pb2.Run | None = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(record_pb2.Run.DESCRIPTOR):
            run = record_pb2.Run()
            detail.Unpack(run)
    return WireError(
        err.code(),
        err.details() or "",
        info.reason,
        info.domain,  # type: ignore[attr-defined]
        dict(info.metadata),
        run,
    )


def expect(
    call: Callable[..., Any],
    request: Any,
    code: grpc.StatusCode,
    reason: str,
    *,
    field: str | None = None,
    has_record: bool | None = None,
) -> WireError:
    with pytest.raises(grpc.RpcError) as ei:
        call(request)
    e = wire_error(ei.value)
    assert (e.code, e.reason, e.domain) == (code, reason, "fencepost"), e
    if field is not None:
        assert e.metadata.get("field") == field, e
        assert field in e.message, e
    if has_record is True:
        assert e.record is not None, e
    if has_record is False:
        assert e.record is None, e
    return e


async def run_all(ledger: Any, *messages: ledger_pb2.ExecuteRequest) -> dict[int, Any]:
    """Send every message on one Execute stream, half-close, collect the
    results by command id (each id answered once)."""

    async def feed() -> AsyncIterator[ledger_pb2.ExecuteRequest]:
        for m in messages:
            yield m

    results: dict[int, Any] = {}
    async for resp in ledger.Execute(feed()):
        for r in resp.results:
            assert r.id not in results
            results[r.id] = r
    return results
