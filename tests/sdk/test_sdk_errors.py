"""Errors: one typed exception per reason with .code/.record/.field, the
single mapping from gRPC, retries of UNAVAILABLE with one request id per
logical call, and outcome-unknown mutations."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import grpc
import pytest

import fencepost
from fencepost import RunStatus
from fencepost import _errors as _errors_module
from fencepost._errors import from_rpc_error, from_status
from fencepost.v1 import ledger_pb2, record_pb2, run_store_pb2
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.records import Record, Status
from fencepost_server.rpc.status import status_proto, to_status
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

BOTH_TRANSPORTS = True  # tests using `transport` run over the Execute stream and unary

# Retries bounded tightly so "server down" tests finish fast.
FAST_RETRY = fencepost.RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.1,
                                   total_timeout_s=0.5, attempt_timeout_s=2.0)

EXPECTED_CLASS = {
    "RUN_VALIDATION_ERROR": fencepost.ValidationError,
    "RUN_NOT_FOUND": fencepost.RunNotFoundError,
    "RUN_LEASE_HELD": fencepost.LeaseHeldError,
    "RUN_LEASE_LOST": fencepost.LeaseLostError,
    "RUN_ALREADY_TERMINAL": fencepost.AlreadyTerminalError,
    "RUN_SUSPENDED": fencepost.RunSuspendedError,
    "RUN_INVALID_TRANSITION": fencepost.InvalidTransitionError,
    "RUN_CONFLICT": fencepost.ConflictError,
    "RUN_INTEGRITY_ERROR": fencepost.IntegrityError,
    "RUN_STORE_ATOMIC_REQUIRED": fencepost.AtomicStoreRequiredError,
    "INVALID_RUN_STATE": fencepost.InvalidRunStateError,
    "LOCK_LOST": fencepost.LockLostError,
    "STORAGE_FULL": fencepost.StorageFullError,
    "STORAGE_UNAVAILABLE": fencepost.StorageUnavailableError,
    "RUN_REVISION_COMPACTED": fencepost.RevisionCompactedError,
    "STREAM_TOO_SLOW": fencepost.StreamTooSlowError,
    "SHUTTING_DOWN": fencepost.ShuttingDownError,
    "UNAUTHENTICATED": fencepost.UnauthenticatedError,
    "PERMISSION_DENIED": fencepost.PermissionDeniedError,
    "OWNER_NOT_PERMITTED": fencepost.OwnerNotPermittedError,
    "NOT_LEADER": fencepost.NotLeaderError,
    "NOT_OWNER": fencepost.NotOwnerError,
}


def test_every_ledger_code_has_its_own_class() -> None:
    assert set(EXPECTED_CLASS) <= {c.value for c in Code}
    assert len(set(EXPECTED_CLASS.values())) == len(EXPECTED_CLASS)
    for cls in EXPECTED_CLASS.values():
        assert issubclass(cls, fencepost.FencepostError)
        assert cls.__name__.endswith("Error")


def _drawn_tree() -> dict[str, str]:
    """Each class drawn in ``fencepost._errors``'s docstring, and the class it
    is drawn under ("" for a root)."""
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in (_errors_module.__doc__ or "").splitlines():
        found = re.match(r"([ │]*)([├└]── )?([A-Z]\w+Error)\b", line)
        if not found or not (found.group(2) or found.group(1) == "    "):
            continue  # a description, not a class
        column, name = found.start(3), found.group(3)
        while stack and stack[-1][0] >= column:
            stack.pop()
        parents[name] = stack[-1][1] if stack else ""
        stack.append((column, name))
    return parents


def test_the_drawn_tree_is_the_class_tree() -> None:
    """The docstring's drawing is the hierarchy itself: every exception the
    package exports is drawn once, under its real base."""
    drawn = _drawn_tree()
    exported = {name for name in fencepost.__all__
                if isinstance(getattr(fencepost, name), type)
                and issubclass(getattr(fencepost, name), Exception)}
    aliases = {"InvalidRunState", "RunNotFound"}  # the store's old names for two classes
    assert set(drawn) == exported - aliases
    for name, parent in drawn.items():
        cls = getattr(fencepost, name)
        base = cls.__bases__[0].__name__
        assert base == (parent or base), f"{name} is drawn under {parent}, derives {base}"
        if not parent:
            assert name in {"FencepostError", "UsageError"}, name


def test_the_middle_layers_say_what_a_caller_can_do() -> None:
    assert issubclass(fencepost.ValidationError, fencepost.InvalidInputError)
    for cls in (fencepost.LeaseHeldError, fencepost.LeaseLostError, fencepost.LockLostError,
                fencepost.RunNotFoundError, fencepost.OwnerNotPermittedError):
        assert issubclass(cls, fencepost.RefusedError), cls
    for cls in (fencepost.NotLeaderError, fencepost.NotOwnerError, fencepost.ShuttingDownError,
                fencepost.OutcomeUnknownError):
        assert issubclass(cls, fencepost.UnavailableError), cls
    # at risk is beside lost: a handler for a loss does not swallow a doubt
    assert not issubclass(fencepost.LeaseAtRiskError, fencepost.LeaseLostError)
    assert not issubclass(fencepost.LeaseLostError, fencepost.LeaseAtRiskError)
    assert not issubclass(fencepost.LeaseAtRiskError, fencepost.RefusedError)
    at_risk = fencepost.LeaseAtRiskError("at risk")
    assert at_risk.reason is fencepost.LostReason.AT_RISK and at_risk.code == "LEASE_AT_RISK"
    # misuse is a RuntimeError, as before it had a class, and not a failed call
    for cls in (fencepost.ClientClosedError, fencepost.EventLoopError):
        assert issubclass(cls, fencepost.UsageError) and issubclass(cls, RuntimeError)
        assert not issubclass(cls, fencepost.FencepostError)


def _rpc_error(status: grpc.Status) -> grpc.aio.AioRpcError:
    """The error a client sees for a status the server's own builder made."""
    return grpc.aio.AioRpcError(
        status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata),
        status.details, None,
    )


@pytest.mark.parametrize("code", list(Code))
def test_mapping_of_every_reason(code: Code) -> None:
    rec = Record("run-1", 3, Status.RUNNING, 1, 7, 1_000, 2_000)
    err = from_rpc_error(
        _rpc_error(to_status(LedgerError(code, "refused", rec, field="some.field"))),
        mutation=True,
    )
    # reasons without a class yet (the streams' codes) still keep their code
    assert type(err) is EXPECTED_CLASS.get(code.value, fencepost.RpcError)
    assert err.code == code.value and err.message == "refused"
    assert err.field == "some.field"
    assert err.record is not None
    assert (err.record.run_id, err.record.version, err.record.fencing_token) == ("run-1", 3, 7)
    assert err.record.status is RunStatus.RUNNING


@pytest.mark.parametrize("code", list(Code))
def test_a_status_carried_in_a_message_maps_the_same(code: Code) -> None:
    """An Execute result's error is the status the unary call would end with;
    ``from_status`` maps it to the same exception, field for field."""
    rec = Record("run-1", 3, Status.RUNNING, 1, 7, 1_000, 2_000)
    refusal = LedgerError(code, "refused", rec, field="some.field")
    for mutation in (True, False):
        unary = from_rpc_error(_rpc_error(to_status(refusal)), mutation=mutation)
        carried = from_status(status_proto(refusal), mutation=mutation)
        assert type(carried) is type(unary)
        assert (carried.code, carried.message, carried.field, carried.grpc_code,
                carried.record) == (unary.code, unary.message, unary.field, unary.grpc_code,
                                    unary.record)


def test_mapping_without_fencepost_details() -> None:
    def bare(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x", None)

    unavailable = bare(grpc.StatusCode.UNAVAILABLE)
    assert type(from_rpc_error(unavailable, mutation=True)) is fencepost.OutcomeUnknownError
    assert type(from_rpc_error(unavailable, mutation=False)) is fencepost.UnavailableError
    deadline = bare(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert type(from_rpc_error(deadline, mutation=True)) is fencepost.OutcomeUnknownError
    internal = from_rpc_error(bare(grpc.StatusCode.INTERNAL), mutation=False)
    assert type(internal) is fencepost.RpcError and internal.code == "INTERNAL"
    denied = from_rpc_error(bare(grpc.StatusCode.PERMISSION_DENIED), mutation=False)
    assert type(denied) is fencepost.PermissionDeniedError


# -- each reason over the wire --------------------------------------------------------


async def test_validation_error_names_the_field(client: fencepost.Client) -> None:
    with pytest.raises(fencepost.ValidationError) as info:
        await client.acquire("run-1", ttl_ms=5)
    assert info.value.field == "lease_ttl_ms" and info.value.record is None
    assert info.value.code == "RUN_VALIDATION_ERROR"
    assert info.value.grpc_code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(fencepost.ValidationError) as info:
        await client.get("bad\x00id")
    assert info.value.field == "run_id"


async def test_not_found(client: fencepost.Client) -> None:
    for call in (client.get("nope"), client.cancel("nope"), client.request_resume("nope"),
                 client.delete("nope")):
        with pytest.raises(fencepost.RunNotFoundError) as info:
            await call
        assert info.value.code == "RUN_NOT_FOUND" and info.value.record is None


async def test_lease_held_carries_the_holders_record(
    client: fencepost.Client, rival: fencepost.Client
) -> None:
    await client.acquire("run-1", ttl_ms=60_000)
    with pytest.raises(fencepost.LeaseHeldError) as info:
        await rival.acquire("run-1")
    rec = info.value.record
    assert rec is not None and rec.lease is not None and rec.lease.owner == "worker-a"
    with pytest.raises(fencepost.LeaseHeldError):
        await rival.request_resume("run-1")


async def test_already_terminal(client: fencepost.Client) -> None:
    lease = await client.acquire("run-1")
    await lease.finish("failed", "boom")
    with pytest.raises(fencepost.AlreadyTerminalError) as info:
        await client.acquire("run-1")
    assert info.value.record is not None and info.value.record.status is RunStatus.FAILED
    assert info.value.record.outcome == fencepost.Outcome("boom")
    with pytest.raises(fencepost.AlreadyTerminalError):
        await client.cancel("run-1")


async def test_fenced_calls_on_a_record_changed_under_the_handle(
    server: ServerThread, transport: str
) -> None:
    """Token and owner still match but the status moved (through the raw
    seam): terminal -> AlreadyTerminalError, not running -> InvalidTransition.
    (Unary renewal: the KeepAlive stream reports such a record as lost,
    FENCE_MOVED, and the SDK then fails fast locally.)"""
    async with fencepost.Client(server.address, owner="worker-a", renewal="unary",
                                transport=transport) as client:  # type: ignore[arg-type]
        await _status_moved_under_the_handle(client)


async def _status_moved_under_the_handle(client: fencepost.Client) -> None:
    lease = await client.acquire("run-1")
    store = client.stubs.run_store
    for status, cls in (
        (record_pb2.RUN_STATUS_QUEUED, fencepost.InvalidTransitionError),
        (record_pb2.RUN_STATUS_COMPLETED, fencepost.AlreadyTerminalError),
    ):
        cur = (await store.Get(run_store_pb2.GetRequest(run_id="run-1"))).run
        nxt = record_pb2.Run()
        nxt.CopyFrom(cur)
        nxt.version = cur.version + 1
        nxt.status = status
        if status == record_pb2.RUN_STATUS_COMPLETED:
            nxt.outcome.code = "ok"
        resp = await store.CompareAndSet(run_store_pb2.CompareAndSetRequest(
            run_id="run-1", expected_version=cur.version, next=nxt))
        assert resp.swapped
        with pytest.raises(cls) as info:
            await lease.renew()
        assert info.value.record is not None and info.value.record.version == nxt.version
        assert not lease.is_lost


# -- request ids and retries ----------------------------------------------------------


class DropFirstAnswer(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Lets the first call reach the server and commit, then reports
    UNAVAILABLE instead of its answer: a response lost on the way back."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls.append((method.rsplit("/", 1)[-1], getattr(request, "request_id", "")))
        call = await continuation(details, request)
        if len(self.calls) == 1:
            await call  # the server has committed it
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "answer lost", None)
        return call


async def test_a_retry_reuses_the_request_id_so_nothing_applies_twice(
    server: ServerThread,
) -> None:
    # unary: the interceptor sees unary calls (test_sdk_execute.py proves the
    # same over the Execute stream, cutting it mid-flight)
    drop = DropFirstAnswer()
    async with fencepost.Client(server.address, owner="worker-a", interceptors=[drop],
                                transport="unary") as client:
        lease = await client.acquire("run-1")
        # Two attempts, one id. Had the retry carried a new id, the same owner
        # re-acquiring would have been applied again: token 2, version 2.
        assert len(drop.calls) == 2
        (m1, id1), (m2, id2) = drop.calls
        assert m1 == m2 == "Acquire" and id1 == id2 and len(id1) == 32
        assert lease.fencing_token == 1
        rec = await client.get("run-1")
        assert (rec.version, rec.fencing_token) == (1, 1)
        # every new logical call gets a fresh id
        await lease.renew()
        await lease.renew()
        renew_ids = [rid for m, rid in drop.calls if m == "Renew"]
        assert len(renew_ids) == 2 and renew_ids[0] != renew_ids[1] and id1 not in renew_ids


async def test_explicit_request_id_through_the_internal_call_path(
    client: fencepost.Client,
) -> None:
    def request(ttl_ms: int) -> ledger_pb2.AcquireRequest:
        return ledger_pb2.AcquireRequest(run_id="run-1", owner="worker-a", lease_ttl_ms=ttl_ms,
                                         request_id="my-request-1")

    first = await client._call("Acquire", request(10_000), mutation=True)
    again = await client._call("Acquire", request(10_000), mutation=True)
    assert again == first and again.run.fencing_token == 1
    with pytest.raises(fencepost.ValidationError) as info:
        await client._call("Acquire", request(20_000), mutation=True)
    assert info.value.field == "request_id"


async def test_unavailable_is_retried_across_a_restart(
    client: fencepost.Client, server: ServerThread, clock: ManualClock
) -> None:
    lease = await client.acquire("run-1")
    await asyncio.to_thread(server.stop)

    def start_later() -> None:
        time.sleep(0.4)
        server.start()

    starter = threading.Thread(target=start_later)
    starter.start()
    try:
        rec = await lease.record_checkpoint("ckpt/1", 1)  # retried until the server is back
    finally:
        await asyncio.to_thread(starter.join)
    assert rec.checkpoint_ref is not None and rec.checkpoint_ref.key == "ckpt/1"
    assert rec.fencing_token == lease.fencing_token == 1


async def test_no_answer_from_a_stopped_server_is_unavailable_for_reads_and_writes(
    server: ServerThread, transport: str
) -> None:
    """With the server gone the channel cannot connect, so no write can have
    left: UnavailableError, not OutcomeUnknownError (which needs a call that
    was sent; tests/sdk/test_sdk_edges.py)."""
    async with fencepost.Client(server.address, owner="worker-a", retry=FAST_RETRY,
                                transport=transport) as client:  # type: ignore[arg-type]
        lease = await client.acquire("run-1")
        await asyncio.to_thread(server.stop)
        try:
            started = time.monotonic()
            with pytest.raises(fencepost.UnavailableError) as read:
                await client.get("run-1")
            assert type(read.value) is fencepost.UnavailableError
            assert time.monotonic() - started < 3  # bounded by the policy
            for write in (client.cancel("run-1"), lease.finish()):
                with pytest.raises(fencepost.UnavailableError) as info:
                    await write
                assert type(info.value) is fencepost.UnavailableError
            assert not lease.is_lost
        finally:
            await asyncio.to_thread(server.start)
        # the lease was not lost: a fresh finish (new request id) converges once the
        # channel has reconnected
        for _ in range(50):
            try:
                rec = await lease.finish()
                break
            except fencepost.UnavailableError:
                await asyncio.sleep(0.1)
        assert rec.status is RunStatus.COMPLETED and not lease.is_lost
