"""docs/SPEC.md §10: bad input gets INVALID_ARGUMENT naming the field and changes nothing."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from _db import snapshot
from _records import bump, raw_run
from _wire import expect, wire_error

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc, run_store_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb

LONG_ID = "x" * 513
LONG_OWNER = "o" * 257
H = {"run_id": "live", "owner": "w", "fencing_token": 1}


def _run(**kw: Any) -> rpb.Run:
    run = raw_run("new")
    for k, v in kw.items():
        setattr(run, k, v)
    return run


def _with_lease(owner: str) -> rpb.Run:
    run = raw_run("new")
    run.lease.owner = owner
    return run


def _cas(next_run: rpb.Run, expected: int = 1, run_id: str = "raw") -> spb.CompareAndSetRequest:
    return spb.CompareAndSetRequest(run_id=run_id, expected_version=expected, next=next_run)


RAW = raw_run("raw")

LEDGER_CASES: list[tuple[str, str, Any, str]] = [
    ("empty run id", "Acquire", pb.AcquireRequest(run_id="", owner="w"), "run_id"),
    ("oversized run id", "Acquire", pb.AcquireRequest(run_id=LONG_ID, owner="w"), "run_id"),
    ("control char run id", "Acquire", pb.AcquireRequest(run_id="a\x00b", owner="w"), "run_id"),
    ("newline run id", "Acquire", pb.AcquireRequest(run_id="a\nb", owner="w"), "run_id"),
    ("DEL in run id", "GetRun", pb.GetRunRequest(run_id="a\x7f"), "run_id"),
    ("empty owner", "Acquire", pb.AcquireRequest(run_id="r", owner=""), "owner"),
    ("oversized owner", "Acquire", pb.AcquireRequest(run_id="r", owner=LONG_OWNER), "owner"),
    ("control char owner", "Acquire", pb.AcquireRequest(run_id="r", owner="w\x1b"), "owner"),
    (
        "ttl too small",
        "Acquire",
        pb.AcquireRequest(run_id="r", owner="w", lease_ttl_ms=99),
        "lease_ttl_ms",
    ),
    (
        "ttl too big",
        "Acquire",
        pb.AcquireRequest(run_id="r", owner="w", lease_ttl_ms=86_400_001),
        "lease_ttl_ms",
    ),
    (
        "negative lock delay",
        "Acquire",
        pb.AcquireRequest(run_id="r", owner="w", lock_delay_ms=-1),
        "lock_delay_ms",
    ),
    ("renew ttl out of range", "Renew", pb.RenewRequest(**H, lease_ttl_ms=5), "lease_ttl_ms"),
    (
        "zero token",
        "Renew",
        pb.RenewRequest(run_id="live", owner="w", fencing_token=0),
        "fencing_token",
    ),
    (
        "negative token",
        "Release",
        pb.ReleaseRequest(run_id="live", owner="w", fencing_token=-3),
        "fencing_token",
    ),
    ("empty checkpoint key", "RecordCheckpoint", pb.RecordCheckpointRequest(**H, key=""), "key"),
    (
        "negative snapshot",
        "RecordCheckpoint",
        pb.RecordCheckpointRequest(**H, key="k", snapshot_version=-1),
        "snapshot_version",
    ),
    (
        "too many approvals",
        "Suspend",
        pb.SuspendRequest(**H, pending_approval_ids=[f"a{i}" for i in range(1001)]),
        "pending_approval_ids",
    ),
    (
        "empty approval id",
        "Suspend",
        pb.SuspendRequest(**H, pending_approval_ids=["a", ""]),
        "pending_approval_ids[1]",
    ),
    ("unknown finish status", "Finish", pb.FinishRequest(**H, status=42), "status"),  # type: ignore[arg-type]
    (
        "non-terminal finish status",
        "Finish",
        pb.FinishRequest(**H, status=rpb.RUN_STATUS_RUNNING),
        "status",
    ),
    ("unspecified finish status", "Finish", pb.FinishRequest(**H), "status"),
    (
        "failed without outcome",
        "Finish",
        pb.FinishRequest(**H, status=rpb.RUN_STATUS_FAILED),
        "outcome",
    ),
    (
        "empty outcome code",
        "Finish",
        pb.FinishRequest(**H, status=rpb.RUN_STATUS_FAILED, outcome=rpb.Outcome(code="")),
        "outcome.code",
    ),
    (
        "oversized cancel message",
        "Cancel",
        pb.CancelRequest(run_id="live", message="m" * 4097),
        "message",
    ),
    (
        "oversized request id",
        "Cancel",
        pb.CancelRequest(run_id="live", request_id="r" * 129),
        "request_id",
    ),
    ("empty resume id", "RequestResume", pb.RequestResumeRequest(run_id=""), "run_id"),
    ("empty delete id", "DeleteRun", pb.DeleteRunRequest(run_id=""), "run_id"),
    ("unknown list status", "ListRuns", pb.ListRunsRequest(statuses=[7]), "statuses[0]"),  # type: ignore[list-item]
    ("negative page size", "ListRuns", pb.ListRunsRequest(page_size=-1), "page_size"),
    ("fence zero token", "ValidateFence", pb.ValidateFenceRequest(run_id="live"), "fencing_token"),
]

STORE_CASES: list[tuple[str, str, Any, str]] = [
    ("create without record", "Create", spb.CreateRequest(), "run"),
    ("create at version 2", "Create", spb.CreateRequest(run=_run(version=2)), "run.version"),
    ("create at version 0", "Create", spb.CreateRequest(run=_run(version=0)), "run.version"),
    ("create schema 2", "Create", spb.CreateRequest(run=_run(schema=2)), "run.schema"),
    ("create empty id", "Create", spb.CreateRequest(run=_run(run_id="")), "run.run_id"),
    ("create unknown status", "Create", spb.CreateRequest(run=_run(status=77)), "run.status"),
    ("create unspecified status", "Create", spb.CreateRequest(run=_run(status=0)), "run.status"),
    ("create zero attempt", "Create", spb.CreateRequest(run=_run(attempt=0)), "run.attempt"),
    (
        "create zero token",
        "Create",
        spb.CreateRequest(run=_run(fencing_token=0)),
        "run.fencing_token",
    ),
    (
        "create empty lease owner",
        "Create",
        spb.CreateRequest(run=_with_lease("")),
        "run.lease.owner",
    ),
    (
        "create control lease owner",
        "Create",
        spb.CreateRequest(run=_with_lease("a\tb")),
        "run.lease.owner",
    ),
    (
        "cas without next",
        "CompareAndSet",
        spb.CompareAndSetRequest(run_id="raw", expected_version=1),
        "next",
    ),
    ("cas non-following version", "CompareAndSet", _cas(bump(bump(RAW))), "next.version"),
    ("cas negative expected", "CompareAndSet", _cas(bump(RAW), expected=-1), "expected_version"),
    ("cas mismatched id", "CompareAndSet", _cas(bump(RAW), run_id="other"), "next.run_id"),
    ("cas malformed next", "CompareAndSet", _cas(bump(RAW, attempt=0)), "next.attempt"),
    ("get oversized id", "Get", spb.GetRequest(run_id=LONG_ID), "run_id"),
    ("delete empty id", "Delete", spb.DeleteRequest(run_id=""), "run_id"),
]


@pytest.fixture
def seeded(server, ledger, store):  # type: ignore[no-untyped-def]
    ledger.Acquire(pb.AcquireRequest(run_id="live", owner="w", request_id="seed"))
    store.Create(spb.CreateRequest(run=RAW))
    return server


@pytest.mark.parametrize(
    "name,method,request_msg,field",
    LEDGER_CASES + STORE_CASES,
    ids=[c[0] for c in LEDGER_CASES + STORE_CASES],
)
def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    seeded,
    channel,
    name: str,
    method: str,
    request_msg: Any,
    field: str,  # type: ignore[no-untyped-def]
) -> None:
    before = snapshot(seeded.db_path)
    stub: Any = (
        ledger_pb2_grpc.LedgerStub(channel)
        if (name, method, request_msg, field) in LEDGER_CASES
        else run_store_pb2_grpc.RunStoreStub(channel)
    )
    expect(
        getattr(stub, method),
        request_msg,
        grpc.StatusCode.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field=field,
    )
    assert seeded.writer.state.revision > 0  # still serving
    assert snapshot(seeded.db_path) == before


def test_oversized_message_is_refused_and_server_keeps_serving(server, channel) -> None:  # type: ignore[no-untyped-def]
    # (over Execute: tests/service/test_limits_wire.py, where the stream goes on)
    ledger = ledger_pb2_grpc.LedgerStub(channel)
    # over --max-message-bytes (4 MiB): a validation error naming `request`
    with pytest.raises(grpc.RpcError) as ei:
        ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w" * (5 * 1024 * 1024)))
    e = wire_error(ei.value)
    assert (e.code, e.reason, e.metadata["field"]) == (
        grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR", "request",
    )
    assert "over the server's limit" in e.message
    # far over it (gRPC's own receive limit, 16 MiB): the transport refuses
    with pytest.raises(grpc.RpcError) as ei:
        ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w" * (17 * 1024 * 1024)))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert ledger.Acquire(pb.AcquireRequest(run_id="r", owner="w")).run.fencing_token == 1


def test_invalid_utf8_on_the_wire_does_not_crash_the_server(server, channel, ledger) -> None:  # type: ignore[no-untyped-def]
    raw = channel.unary_unary(
        "/fencepost.v1.Ledger/Acquire",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    for payload, field in (
        (b"\x0a\x02\xff\xfe\x12\x01w", "run_id"),  # field 1 (run_id): 2 bytes, not UTF-8
        (b"\x0a\x01r\x12\x02\xc3\x28", "owner"),  # field 2 (owner): a broken 2-byte sequence
        (b"\x0a\x7f", "request"),  # truncated: no field to name
        (b"\xff\xff\xff", "request"),
    ):
        with pytest.raises(grpc.RpcError) as ei:
            raw(payload)
        e = wire_error(ei.value)
        assert (e.code, e.reason, e.metadata["field"]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "RUN_VALIDATION_ERROR",
            field,
        )
    assert ledger.Acquire(pb.AcquireRequest(run_id="ok", owner="w")).run.fencing_token == 1
