"""Engine-store JSON a client sends is refused as a validation error, never
INTERNAL, and at write time: numbers whose exponent is 10^18 or more in
magnitude (Decimal's InvalidOperation escaped as INTERNAL), values nested
deeper than 100 (so nothing stored is too deep for a later DocList), and a
DocList ``where`` nested 400-900 deep (RecursionError). Offsets and limits
at the ends of their range answer, empty, rather than fail."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from _db import snapshot
from engine._stream_store import engine_client
from service._wire import expect

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2_grpc
from fencepost.v1 import ledger_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT
VALIDATION = "RUN_VALIDATION_ERROR"
HUGE = ["1e99999999999999999999", "-1e99999999999999999999", "1e-99999999999999999999",
        "1e1000000000000000000", "[0.5e-1000000000000000001]"]


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


@pytest.fixture
def es(channel: grpc.Channel) -> engine_store_pb2_grpc.EngineStoreStub:
    return engine_store_pb2_grpc.EngineStoreStub(channel)


@pytest.fixture(params=["unary", "stream"])
def writes(request: pytest.FixtureRequest, channel: grpc.Channel) -> Iterator[Any]:
    """Where engine-store writes go: the EngineStore stub, or Ledger.Execute."""
    with engine_client(channel, request.param) as client:
        yield client


def _json_writes(text: str) -> list[tuple[str, Any, str]]:
    j = epb.JsonValue(json=text)
    return [
        ("KvSet", epb.EngineKvSetRequest(agent="a", key="k", value=j), "value"),
        ("PutEffect", epb.EnginePutEffectRequest(key="k", result=j), "result"),
        ("CreateRun", epb.EngineCreateRunRequest(
            run=epb.EngineRun(id="r", agent="a", status="new", input=j)), "run.input"),
        ("SaveCheckpoint", epb.EngineSaveCheckpointRequest(
            checkpoint=epb.EngineCheckpoint(run_id="r", step_index=1, state=j)),
         "checkpoint.state"),
        ("AppendStep", epb.EngineAppendStepRequest(
            step=epb.EngineStep(run_id="r", name="s", output=j)), "step.output"),
    ]


@pytest.mark.parametrize("text", HUGE)
def test_numbers_with_huge_exponents_are_validation_errors(
    writes: Any, db: str, text: str
) -> None:
    before = snapshot(db)
    for method, request, field in _json_writes(text):
        e = expect(getattr(writes, method), request, INVALID, VALIDATION, field=field)
        assert "exponent" in e.message
    assert snapshot(db) == before


def test_a_large_but_holdable_exponent_is_stored_byte_for_byte(es: Any) -> None:
    text = "[1e999999999999999999, -2.5E-999999999999999999]"
    es.KvSet(epb.EngineKvSetRequest(agent="a", key="k", value=epb.JsonValue(json=text)))
    assert es.KvGet(epb.EngineKvGetRequest(agent="a", key="k")).value.json == text


def test_nesting_past_100_is_refused_at_write_time(writes: Any, es: Any, db: str) -> None:
    for method, request, _ in _json_writes(_nested(100)):
        getattr(writes, method)(request)  # 100 deep: taken
    before = snapshot(db)
    for depth in (101, 450, 5000):
        for method, request, field in _json_writes(_nested(depth)):
            e = expect(getattr(writes, method), request, INVALID, VALIDATION, field=field)
            assert "deeper than 100" in e.message
        doc = '{"a": ' + _nested(depth - 1) + "}"
        expect(writes.DocUpsert, epb.EngineDocUpsertRequest(
            agent="a", collection="c", id="d", doc=epb.JsonValue(json=doc)),
            INVALID, VALIDATION, field="doc")
    assert snapshot(db) == before


def test_brackets_inside_strings_are_not_nesting(es: Any) -> None:
    text = '["' + "[{" * 500 + '", {"k": "]]]"}]'
    es.KvSet(epb.EngineKvSetRequest(agent="a", key="k", value=epb.JsonValue(json=text)))
    assert es.KvGet(epb.EngineKvGetRequest(agent="a", key="k")).value.json == text


@pytest.mark.parametrize("depth", [400, 650, 900])
def test_a_deep_where_filter_is_a_validation_error(es: Any, depth: int) -> None:
    doc = '{"a": ' + _nested(99) + "}"
    es.DocUpsert(epb.EngineDocUpsertRequest(agent="a", collection="c", id="d",
                                            doc=epb.JsonValue(json=doc)))
    where = '{"a": ' + _nested(depth) + "}"
    req = epb.EngineDocListRequest(agent="a", collection="c", where=epb.JsonValue(json=where))
    with pytest.raises(grpc.RpcError) as ei:
        list(es.DocList(req))
    assert ei.value.code() == INVALID
    assert "where" in (ei.value.details() or "")
    # the deepest filter allowed still compares
    ok = epb.EngineDocListRequest(agent="a", collection="c", where=epb.JsonValue(json=doc))
    assert [d.id for page in es.DocList(ok) for d in page.docs] == ["d"]


def test_offsets_and_limits_at_the_ends_of_their_range_answer(
    es: Any, channel: grpc.Channel
) -> None:
    es.CreateRun(epb.EngineCreateRunRequest(run=epb.EngineRun(id="r", agent="a", status="s")))
    top = 2**63 - 1
    pages = list(es.ListRuns(epb.EngineListRunsRequest(offset=top, limit=top)))
    assert [len(p.runs) for p in pages] == [0] and pages[0].total == 1
    assert [len(p.runs) for p in es.ListRuns(epb.EngineListRunsRequest(limit=top))] == [1]
    docs = list(es.DocList(epb.EngineDocListRequest(agent="a", collection="c", limit=top)))
    assert [len(p.docs) for p in docs] == [0]
    for bad, field in ((epb.EngineListRunsRequest(offset=-1), "offset"),
                       (epb.EngineListRunsRequest(limit=-(2**63)), "limit")):
        with pytest.raises(grpc.RpcError) as ei:
            list(es.ListRuns(bad))
        assert ei.value.code() == INVALID and field in (ei.value.details() or "")
    led = ledger_pb2_grpc.LedgerStub(channel)
    for page_size in (-1, 1001, 2**31 - 1, -(2**31)):
        expect(led.ListRuns, pb.ListRunsRequest(page_size=page_size), INVALID, VALIDATION,
               field="page_size")
    for token in ("x", "A" * 10_000, "eyJhIjogMX0"):
        expect(led.ListRuns, pb.ListRunsRequest(page_token=token), INVALID, VALIDATION,
               field="page_token")
