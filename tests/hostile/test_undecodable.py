"""Bytes that are no valid encoding of the request are refused on every
streaming method as on the unary ones: INVALID_ARGUMENT naming ``request``
(Execute: a result with id 0, as docs/SPEC.md §6.3 says; KeepAlive: an error
and the stream goes on after its hello). The case here is a varint carrying
bits past 64, which the protobuf decoder in use accepts and truncates: the
watch below read as ``from_revision`` 0 and waited for its deadline, and an
Execute command ran with a number the client never sent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fuzz._protofuzz import key, length_delimited, varint
from service._wire import wire_error

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_server.testing.server import ServerThread

OVERLONG = b"\x80" * 9 + b"\x02"  # ten bytes: the last one carries bits 63 and up
DEADLINE_S = 10


def _field(message: Any, name: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[name].number)


def _raw(channel: grpc.Channel, kind: str, method: str) -> Any:
    return getattr(channel, kind)(method, request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)


def _refused_request(err: grpc.RpcError) -> None:
    e = wire_error(err)
    assert (e.code, e.reason, e.metadata.get("field")) == (
        grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR", "request"), e


@pytest.fixture
def raw_channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


WATCH = key(_field(pb.WatchRunsRequest, "from_revision"), 0) + OVERLONG


def test_watch_runs_refuses_at_once_instead_of_waiting(raw_channel: grpc.Channel) -> None:
    call = _raw(raw_channel, "unary_stream", "/fencepost.v1.Ledger/WatchRuns")
    with pytest.raises(grpc.RpcError) as ei:
        next(call(WATCH, timeout=DEADLINE_S))
    _refused_request(ei.value)


def _acquire_with(lock_delay: bytes) -> bytes:
    acquire = (length_delimited(_field(pb.AcquireRequest, "run_id"), b"r")
               + length_delimited(_field(pb.AcquireRequest, "owner"), b"w")
               + key(_field(pb.AcquireRequest, "lock_delay_ms"), 0) + lock_delay)
    command = (key(_field(pb.Command, "id"), 0) + varint(7)
               + length_delimited(_field(pb.Command, "acquire"), acquire))
    return length_delimited(_field(pb.ExecuteRequest, "commands"), command)


def test_execute_answers_id_0_and_runs_nothing(raw_channel: grpc.Channel) -> None:
    call = _raw(raw_channel, "stream_stream", "/fencepost.v1.Ledger/Execute")
    unknown = key(99, 0) + OVERLONG
    out = [pb.ExecuteResponse.FromString(m)
           for m in call(iter([_acquire_with(OVERLONG), unknown, _acquire_with(varint(5))]),
                         timeout=DEADLINE_S)]
    results = [r for m in out for r in m.results]
    assert [r.id for r in results] == [0, 0, 7]
    for r in results[:2]:
        assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "request" in r.error.message
    assert results[2].acquire.run.lease.lock_delay_ms == 5  # the well-formed one ran once
    assert results[2].acquire.run.version == 1


def test_keepalive_names_request_first_and_later_and_goes_on(
    raw_channel: grpc.Channel,
) -> None:
    call = _raw(raw_channel, "stream_stream", "/fencepost.v1.Ledger/KeepAlive")
    bad = key(_field(pb.KeepAliveRequest, "hello"), 2) + varint(len(b"\x10" + OVERLONG)) \
        + b"\x10" + OVERLONG  # hello with an unknown varint field past 64 bits
    with pytest.raises(grpc.RpcError) as ei:
        list(call(iter([bad]), timeout=DEADLINE_S))
    _refused_request(ei.value)

    hello = pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w")).SerializeToString()
    untrack = pb.KeepAliveRequest(untrack=pb.KeepAliveUntrack(run_id="r")).SerializeToString()
    stream = call(iter([hello, bad, untrack]), timeout=DEADLINE_S)
    first = pb.KeepAliveResponse.FromString(next(stream))
    stream.cancel()
    errors = list(first.batch) or [first]
    assert errors[0].error.metadata["field"] == "request", first


def test_transact_refuses_it(raw_channel: grpc.Channel) -> None:
    call = _raw(raw_channel, "unary_unary", "/fencepost.v1.Ledger/Transact")
    commands = _acquire_with(OVERLONG)  # same field layout: commands = 1
    with pytest.raises(grpc.RpcError) as ei:
        call(commands, timeout=DEADLINE_S)
    _refused_request(ei.value)
    assert ledger_pb2_grpc.LedgerStub(raw_channel).ListRuns(pb.ListRunsRequest()).runs == []


@pytest.mark.parametrize("method", ["ListRuns", "DocList", "ListSteps", "ReadArtifact",
                                    "ListArtifacts"])
def test_the_engine_stores_streams_refuse_it(raw_channel: grpc.Channel, method: str) -> None:
    call = _raw(raw_channel, "unary_stream", f"/fencepost.v1.EngineStore/{method}")
    with pytest.raises(grpc.RpcError) as ei:
        next(call(key(90, 0) + OVERLONG, timeout=DEADLINE_S))
    _refused_request(ei.value)


def test_put_artifact_refuses_it(raw_channel: grpc.Channel) -> None:
    call = _raw(raw_channel, "stream_unary", "/fencepost.v1.EngineStore/PutArtifact")
    header = (length_delimited(_field(epb.EngineArtifactHeader, "id"), b"a")
              + length_delimited(_field(epb.EngineArtifactHeader, "run_id"), b"r")
              + key(_field(epb.EngineArtifactHeader, "size_bytes"), 0) + OVERLONG)
    first = length_delimited(_field(epb.EnginePutArtifactRequest, "header"), header)
    with pytest.raises(grpc.RpcError) as ei:
        call(iter([first]), timeout=DEADLINE_S)
    _refused_request(ei.value)


def test_the_largest_valid_varint_still_decodes(raw_channel: grpc.Channel) -> None:
    """Ten bytes ending in 0x01 is 2^64 - 1: valid, and -1 for an int64."""
    call = _raw(raw_channel, "unary_stream", "/fencepost.v1.Ledger/WatchRuns")
    with pytest.raises(grpc.RpcError) as ei:
        next(call(key(_field(pb.WatchRunsRequest, "from_revision"), 0) + varint(-1),
                  timeout=DEADLINE_S))
    e = wire_error(ei.value)
    assert e.metadata.get("field") == "from_revision", e


def test_an_id_past_64_bits_that_reads_as_a_valid_uint64_is_refused_too(
    raw_channel: grpc.Channel,
) -> None:
    """Its tenth byte odd: truncated, it is a fine uint64 command id."""
    call = _raw(raw_channel, "stream_stream", "/fencepost.v1.Ledger/Execute")
    acquire = (length_delimited(_field(pb.AcquireRequest, "run_id"), b"r")
               + length_delimited(_field(pb.AcquireRequest, "owner"), b"w"))
    command = (key(_field(pb.Command, "id"), 0) + b"\xff" * 9 + b"\x03"
               + length_delimited(_field(pb.Command, "acquire"), acquire))
    message = length_delimited(_field(pb.ExecuteRequest, "commands"), command)
    out = [pb.ExecuteResponse.FromString(m) for m in call(iter([message]), timeout=DEADLINE_S)]
    results = [r for m in out for r in m.results]
    assert [(r.id, r.WhichOneof("kind")) for r in results] == [(0, "error")]
    assert ledger_pb2_grpc.LedgerStub(raw_channel).ListRuns(pb.ListRunsRequest()).runs == []


def test_text_that_looks_like_a_long_varint_is_taken(raw_channel: grpc.Channel) -> None:
    """Nine bytes of CJK text then a byte above 1, in ids, owners and JSON."""
    led = ledger_pb2_grpc.LedgerStub(raw_channel)
    for run_id, owner in (("運行運行運行a", "作業者作業者"), ("運行運行運行b", "作業者"),
                          ("ключключк1", "w")):
        got = led.Acquire(pb.AcquireRequest(run_id=run_id, owner=owner))
        assert (got.run.run_id, got.run.lease.owner) == (run_id, owner)
    stream = led.Execute(iter([pb.ExecuteRequest(commands=[pb.Command(
        id=2**63 + 5, acquire=pb.AcquireRequest(run_id="運行運行運行c", owner="作業者a"))])]),
        timeout=DEADLINE_S)
    results = [r for m in stream for r in m.results]
    assert [(r.id, r.acquire.run.run_id) for r in results] == [(2**63 + 5, "運行運行運行c")]
