"""Ledger.Execute specifics: many commands per message, per-command errors,
results grouped per commit, half-close answers everything accepted."""

from __future__ import annotations

import asyncio
import threading
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


def _acquires(*ids: int) -> pb.ExecuteRequest:
    return pb.ExecuteRequest(commands=[
        pb.Command(id=i, acquire=pb.AcquireRequest(run_id=f"d{i}", owner="w")) for i in ids])


async def _read_until_end(call: Any) -> tuple[dict[int, Any], grpc.aio.AioRpcError]:
    results: dict[int, Any] = {}
    while True:
        try:
            msg = await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as err:
            return results, err
        assert msg is not grpc.aio.EOF, "the stream ended without a status"
        results.update((r.id, r) for r in msg.results)


async def test_a_stop_ends_an_idle_stream_at_once(aio_ledger, server) -> None:  # type: ignore[no-untyped-def]
    """An open Execute stream (the SDK keeps one per process) does not hold a
    stop for its grace period: it ends with SHUTTING_DOWN, so the client
    reconnects."""
    from _wire import wire_error

    call = aio_ledger.Execute()
    await call.write(_acquires(1))
    assert (await call.read()).results[0].WhichOneof("kind") == "acquire"
    loop = asyncio.get_running_loop()
    started = loop.time()
    await loop.run_in_executor(None, server.stop, 30.0)
    assert loop.time() - started < 10  # not the 30 s grace
    results, err = await _read_until_end(call)
    assert results == {}
    e = wire_error(err)
    assert (e.code, e.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    server.start()


async def test_a_stop_answers_the_commands_taken_and_looks_at_no_new_one(
    aio_ledger, server,  # type: ignore[no-untyped-def]
) -> None:
    """Commands the server took before the stop are answered before the stream
    ends; a message that arrives while it stops is not looked at (the client
    gets SHUTTING_DOWN for it and may retry it elsewhere)."""
    from _wire import wire_error

    call = aio_ledger.Execute()
    await call.write(_acquires(0))
    await call.read()
    gate = threading.Event()
    server.writer._executor.submit(gate.wait)  # the writer thread waits: commands stay in flight
    try:
        await call.write(_acquires(*range(1, 11)))
        assert server.app is not None and server.app.hub is not None
        from fencepost_server.rpc.execute import ExecuteSession

        (session,) = [s for s in server.app.hub.streams if isinstance(s, ExecuteSession)]
        for _ in range(500):
            if session.unanswered == 10:
                break
            await asyncio.sleep(0.01)
        assert session.unanswered == 10
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, server.stop, 30.0)
        for _ in range(500):
            if session.draining:
                break
            await asyncio.sleep(0.01)
        assert session.draining
        await call.write(_acquires(11, 12))  # while draining: not looked at
        await asyncio.sleep(0.2)
    finally:
        gate.set()
    results, err = await _read_until_end(call)
    await stopping
    assert sorted(results) == list(range(1, 11))
    assert all(r.acquire.run.fencing_token == 1 for r in results.values())
    e = wire_error(err)
    assert (e.code, e.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    server.start()
    async with grpc.aio.insecure_channel(server.address) as ch:
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        for i in (11, 12):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await ledger.GetRun(pb.GetRunRequest(run_id=f"d{i}"))
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await ledger.GetRun(pb.GetRunRequest(run_id="d10"))).run.fencing_token == 1
