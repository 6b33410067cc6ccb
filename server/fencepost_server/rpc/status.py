"""The one place a domain error becomes a gRPC status (docs/SPEC.md §8)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from fencepost.v1 import ledger_pb2 as lpb

from ..core.errors import Code, LedgerError, validation
from ..core.records import out_of_range
from .convert import record_to_pb
from .decode import Malformed

DOMAIN = "fencepost"
log = logging.getLogger("fencepost.services")

GRPC_CODE: dict[Code, grpc.StatusCode] = {
    Code.RUN_VALIDATION_ERROR: grpc.StatusCode.INVALID_ARGUMENT,
    Code.RUN_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.RUN_LEASE_HELD: grpc.StatusCode.FAILED_PRECONDITION,
    Code.RUN_LEASE_LOST: grpc.StatusCode.FAILED_PRECONDITION,
    Code.RUN_ALREADY_TERMINAL: grpc.StatusCode.FAILED_PRECONDITION,
    Code.RUN_SUSPENDED: grpc.StatusCode.FAILED_PRECONDITION,
    Code.RUN_INVALID_TRANSITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.RUN_CONFLICT: grpc.StatusCode.ABORTED,
    Code.RUN_INTEGRITY_ERROR: grpc.StatusCode.DATA_LOSS,
    Code.RUN_STORE_ATOMIC_REQUIRED: grpc.StatusCode.FAILED_PRECONDITION,
    Code.INVALID_RUN_STATE: grpc.StatusCode.FAILED_PRECONDITION,
    Code.LOCK_LOST: grpc.StatusCode.FAILED_PRECONDITION,
    Code.STORAGE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.STORAGE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    Code.RUN_REVISION_COMPACTED: grpc.StatusCode.OUT_OF_RANGE,
    Code.STREAM_TOO_SLOW: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Code.OWNER_NOT_PERMITTED: grpc.StatusCode.PERMISSION_DENIED,
    Code.STREAM_LIMIT_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.NOT_LEADER: grpc.StatusCode.UNAVAILABLE,
    Code.NOT_OWNER: grpc.StatusCode.UNAVAILABLE,
}


def to_status(err: LedgerError) -> grpc.Status:
    return rpc_status.to_status(status_proto(err))


async def refuse(context: grpc.aio.ServicerContext, err: LedgerError) -> None:
    """End the call with ``err``'s status."""
    await context.abort_with_status(to_status(err))  # type: ignore[attr-defined]


def _metadata(err: LedgerError) -> dict[str, str]:
    metadata = dict(err.metadata) if err.metadata else {}
    if err.field is not None:
        metadata["field"] = err.field
    return metadata


def undecodable(msg: Malformed) -> LedgerError:
    """The refusal of bytes that did not decode, naming the field."""
    return validation(msg.field, f"undecodable {msg.type_name}: {msg.error}")


def keepalive_error(run_id: str, err: LedgerError) -> lpb.KeepAliveResponse:
    """A refusal on a KeepAlive stream: its code, message and metadata, for
    one run; the stream goes on."""
    return lpb.KeepAliveResponse(error=lpb.KeepAliveError(
        run_id=run_id, code=err.code.value, message=err.message, metadata=_metadata(err)))


def status_proto(err: LedgerError) -> status_pb2.Status:
    """The google.rpc.Status of a refusal: code, message, ErrorInfo, record."""
    code = GRPC_CODE[err.code]
    metadata = _metadata(err)
    record = err.record
    if record is not None and out_of_range(record) is not None:
        record = None  # stored past the bound: never served (convert.fill_record_pb)
    if record is not None:
        metadata["run_id"] = record.run_id
        metadata["fencing_token"] = str(record.fencing_token)
        metadata["version"] = str(record.version)
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=err.code.value, domain=DOMAIN, metadata=metadata))
    details = [info]
    if record is not None:
        rec = any_pb2.Any()
        rec.Pack(record_to_pb(record))
        details.append(rec)
    return status_pb2.Status(code=code.value[0], message=err.message, details=details)


def internal_status_proto(exc: BaseException) -> status_pb2.Status:
    """The status of a bug: INTERNAL, naming only the exception's type."""
    message = f"internal error: {type(exc).__name__}"
    return status_pb2.Status(code=code_pb2.INTERNAL, message=message)


def internal_status(exc: BaseException) -> grpc.Status:
    return rpc_status.to_status(internal_status_proto(exc))


H = TypeVar("H", bound=Callable[..., Awaitable[Any]])


def handler(fn: H) -> H:
    """Wrap a unary servicer method: a LedgerError becomes its status, any
    other exception INTERNAL (logged); nothing escapes to crash the server."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, Malformed):
                raise undecodable(request)
            return await fn(self, request, context)
        except LedgerError as err:
            await refuse(context, err)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:
            log.exception("unexpected error in %s", fn.__name__)
            await context.abort_with_status(internal_status(exc))  # type: ignore[attr-defined]

    return wrapper  # type: ignore[return-value]
