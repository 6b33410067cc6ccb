"""Ledger.Execute specifics: many commands per message, per-command errors,
results grouped per commit, half-close answers everything accepted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from _wire import run_all
from google.rpc import error_details_pb2

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb


@pytest.fixture
async def aio_ledger(server) -> AsyncIterator[Any]:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ledger_pb2_grpc.LedgerStub(ch)


async def test_many_commands_in_one_message(aio_ledger, server) -> None:  # type: ignore[no-untyped-def]
    n = 200
    msg = pb.ExecuteRequest(commands=[
        pb.Command(id=i, acquire=pb.AcquireRequest(run_id=f"r{i}", owner="w")) for i in range(n)])
    batches_before = server.writer.stats.batches
    results = await run_all(aio_ledger, msg)
    assert sorted(results) == list(range(n))
    assert all(r.acquire.run.fencing_token == 1 for r in results.values())
    assert server.writer.stats.batches - batches_before < n  # group-committed together


async def test_errors_are_per_command_and_match_unary(aio_ledger) -> None:  # type: ignore[no-untyped-def]
    msg = pb.ExecuteRequest(commands=[
        pb.Command(id=1, acquire=pb.AcquireRequest(run_id="a", owner="w1")),
        pb.Command(id=2, acquire=pb.AcquireRequest(run_id="a", owner="w2")),  # held
        pb.Command(id=3, acquire=pb.AcquireRequest(run_id="", owner="w")),  # invalid
        pb.Command(id=4),  # empty
        pb.Command(id=5, acquire=pb.AcquireRequest(run_id="b", owner="w")),
    ])
    r = await run_all(aio_ledger, msg)
    assert r[1].WhichOneof("kind") == "acquire" and r[5].WhichOneof("kind") == "acquire"
    for cid, reason, code, field in [
        (2, "RUN_LEASE_HELD", grpc.StatusCode.FAILED_PRECONDITION, None),
        (3, "RUN_VALIDATION_ERROR", grpc.StatusCode.INVALID_ARGUMENT, "run_id"),
        (4, "RUN_VALIDATION_ERROR", grpc.StatusCode.INVALID_ARGUMENT, "kind"),
    ]:
        err = r[cid].error
        assert err.code == code.value[0]
        info = error_details_pb2.ErrorInfo()
        assert err.details[0].Unpack(info)
        assert (info.reason, info.domain) == (reason, "fencepost")
        if field:
            assert info.metadata["field"] == field
    held = rpb.Run()
    assert r[2].error.details[1].Unpack(held) and held.lease.owner == "w1"


async def test_commands_in_one_message_apply_in_order(aio_ledger) -> None:  # type: ignore[no-untyped-def]
    first = await run_all(aio_ledger, pb.ExecuteRequest(commands=[
        pb.Command(id=1, acquire=pb.AcquireRequest(run_id="x", owner="w"))]))
    tok = first[1].acquire.run.fencing_token
    h = {"run_id": "x", "owner": "w", "fencing_token": tok}
    r = await run_all(aio_ledger, pb.ExecuteRequest(commands=[
        pb.Command(id=1, renew=pb.RenewRequest(**h)),
        pb.Command(id=2, record_checkpoint=pb.RecordCheckpointRequest(**h, key="k")),
        pb.Command(id=3, finish=pb.FinishRequest(**h, status=rpb.RUN_STATUS_COMPLETED)),
        pb.Command(id=4, renew=pb.RenewRequest(**h)),  # after finish: lost
    ]))
    versions = [r[i].WhichOneof("kind") for i in (1, 2, 3)]
    assert versions == ["renew", "record_checkpoint", "finish"]
    assert r[1].renew.run.version < r[2].record_checkpoint.run.version < r[3].finish.run.version
    info = error_details_pb2.ErrorInfo()
    assert r[4].error.details[0].Unpack(info) and info.reason == "RUN_LEASE_LOST"


async def test_request_ids_replay_over_the_stream(aio_ledger) -> None:  # type: ignore[no-untyped-def]
    cmd = pb.Command(id=1, acquire=pb.AcquireRequest(run_id="q", owner="w", request_id="rq"))
    a = await run_all(aio_ledger, pb.ExecuteRequest(commands=[cmd]))
    b = await run_all(aio_ledger, pb.ExecuteRequest(commands=[cmd]))
    assert a[1].acquire.run == b[1].acquire.run
    unary = await aio_ledger.Acquire(pb.AcquireRequest(run_id="q", owner="w", request_id="rq"))
    assert unary.run == a[1].acquire.run


async def test_pipelined_messages_all_answered_on_half_close(aio_ledger) -> None:  # type: ignore[no-untyped-def]
    msgs = [pb.ExecuteRequest(commands=[
        pb.Command(id=m * 50 + i, acquire=pb.AcquireRequest(run_id=f"p{m}-{i}", owner="w"))
        for i in range(50)]) for m in range(10)]
    results = await asyncio.wait_for(run_all(aio_ledger, *msgs), 30)
    assert sorted(results) == list(range(500))


async def test_a_full_writer_queue_pushes_back_instead_of_refusing(aio_ledger, server) -> None:  # type: ignore[no-untyped-def]
    """More commands in one message than the writer's queue holds (16 384): the
    stream stops reading until there is room, as a unary call waits; nothing
    is refused with STORAGE_UNAVAILABLE."""
    n = server.writer._queue.maxsize + 2_000
    msg = pb.ExecuteRequest(commands=[
        pb.Command(id=i, acquire=pb.AcquireRequest(run_id=f"q{i}", owner="w")) for i in range(n)])
    results = await run_all(aio_ledger, msg)
    assert len(results) == n
    kinds = {r.WhichOneof("kind") for r in results.values()}
    assert kinds == {"acquire"}, [r.error for r in results.values() if r.HasField("error")][:3]


async def test_invalid_utf8_in_a_command_names_its_field(server) -> None:  # type: ignore[no-untyped-def]
    """The decoder refuses the whole message; the error names the field."""
    msg = pb.ExecuteRequest(commands=[
        pb.Command(id=1, acquire=pb.AcquireRequest(run_id="a", owner="w")),
        pb.Command(id=2, acquire=pb.AcquireRequest(run_id="b", owner="QQ")),
    ])
    raw = msg.SerializeToString().replace(b"QQ", b"\xff\xfe")
    async with grpc.aio.insecure_channel(server.address) as ch:
        call = ch.stream_stream("/fencepost.v1.Ledger/Execute",
                                request_serializer=lambda b: b,
                                response_deserializer=pb.ExecuteResponse.FromString)(iter([raw]))
        results = [r async for resp in call for r in resp.results]
    assert [r.id for r in results] == [0]
    info = error_details_pb2.ErrorInfo()
    assert results[0].error.details[0].Unpack(info)
    assert (info.reason, info.metadata["field"]) == (
        "RUN_VALIDATION_ERROR", "commands[1].acquire.owner")
