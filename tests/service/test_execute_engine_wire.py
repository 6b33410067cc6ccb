"""Ledger.Execute carries the engine store's unary mutations too:
mixed with ledger commands and answered by id, refused with exactly the unary
call's status without ending the stream, and retried through the same
request-id table. (The engine-store behaviour tests run over both transports
as well: tests/engine/test_engine_wire.py, tests/engine/test_contract_embedded.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from _transport import ENGINE_KIND_OF
from _wire import run_all
from google.rpc import error_details_pb2, status_pb2

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2_grpc
from fencepost.v1 import ledger_pb2 as pb
from fencepost_server.rpc.commands import KINDS
from fencepost_server.rpc.engine_convert import MUTATIONS

LEDGER_KINDS = {
    "acquire",
    "renew",
    "record_checkpoint",
    "suspend",
    "finish",
    "release",
    "cancel",
    "request_resume",
    "delete_run",
    "transaction",
}
ENGINE_KINDS = {
    "create_run",
    "update_run",
    "claim_run",
    "renew_claim",
    "append_step",
    "save_checkpoint",
    "claim_key",
    "acquire_lock",
    "release_lock",
    "put_effect",
    "kv_set",
    "doc_upsert",
    "doc_delete",
}


def J(text: str) -> epb.JsonValue:
    return epb.JsonValue(json=text)


@pytest.fixture
async def stubs(server) -> AsyncIterator[tuple[Any, Any]]:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ledger_pb2_grpc.LedgerStub(ch), engine_store_pb2_grpc.EngineStoreStub(ch)


async def unary_status(call: Any, request: Any) -> status_pb2.Status:
    """The google.rpc.Status a failed unary call ended with."""
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call(request)
    trailers = dict(ei.value.trailing_metadata() or ())
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    assert status.code == ei.value.code().value[0] and status.message == ei.value.details()
    return status


def reason_and_field(status: status_pb2.Status) -> tuple[str, str]:
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.domain == "fencepost"
    return info.reason, info.metadata.get("field", "")


def test_every_engine_mutation_is_on_the_stream_and_nothing_else() -> None:
    command = {f.name for f in pb.Command.DESCRIPTOR.oneofs_by_name["kind"].fields}
    result = {f.name for f in pb.CommandResult.DESCRIPTOR.oneofs_by_name["kind"].fields}
    assert set(MUTATIONS) == ENGINE_KINDS
    # the registry's other kinds are the raw seam's (RunStore), unary only
    on_the_stream = {k for k in KINDS if not k.startswith("raw_")}
    assert on_the_stream == command == LEDGER_KINDS | ENGINE_KINDS
    assert result == command | {"error"}
    for kind in ENGINE_KINDS:  # a command and its result hold the unary RPC's messages
        req = pb.Command.DESCRIPTOR.fields_by_name[kind].message_type
        res = pb.CommandResult.DESCRIPTOR.fields_by_name[kind].message_type
        assert req.file.name == res.file.name == "fencepost/v1/engine_store.proto"
        assert req.name.endswith("Request") and res.name == req.name[: -len("Request")] + "Response"
    numbers = {
        f.number for f in pb.Command.DESCRIPTOR.fields if f.name in ENGINE_KINDS
    } | {f.number for f in pb.CommandResult.DESCRIPTOR.fields if f.name in ENGINE_KINDS}
    assert min(numbers) >= 20, "11-19 are kept free for ledger commands"


async def test_a_mixed_message_is_answered_by_id(stubs) -> None:  # type: ignore[no-untyped-def]
    ledger, es = stubs
    commands = [
        pb.Command(id=101, acquire=pb.AcquireRequest(run_id="L", owner="w")),
        pb.Command(
            id=7,
            create_run=epb.EngineCreateRunRequest(
                run=epb.EngineRun(id="E", agent="a", status="queued", input=J('{"n": 1}'))
            ),
        ),
        pb.Command(id=3, claim_run=epb.EngineClaimRunRequest(id="E", owner="w", ttl_ms=60_000)),
        pb.Command(id=40, renew_claim=epb.EngineRenewClaimRequest(id="E", owner="w", ttl_ms=1)),
        pb.Command(id=5, append_step=epb.EngineAppendStepRequest(
            step=epb.EngineStep(run_id="E", name="validate", output=J("true")))),
        pb.Command(id=6, save_checkpoint=epb.EngineSaveCheckpointRequest(
            checkpoint=epb.EngineCheckpoint(run_id="E", step_index=1, state=J("{}")))),
        pb.Command(id=102, renew=pb.RenewRequest(run_id="L", owner="w", fencing_token=1)),
        pb.Command(id=8, claim_key=epb.EngineClaimKeyRequest(
            scope="orders", key="1", run_id="E", ttl_ms=60_000)),
        pb.Command(id=9, acquire_lock=epb.EngineAcquireLockRequest(
            key="acct", owner="w", ttl_ms=60_000)),
        pb.Command(id=10, release_lock=epb.EngineReleaseLockRequest(key="acct", owner="w")),
        pb.Command(id=11, put_effect=epb.EnginePutEffectRequest(key="E/charge", result=J("null"))),
        pb.Command(id=12, kv_set=epb.EngineKvSetRequest(agent="a", key="k", value=J("[1]"))),
        pb.Command(id=13, doc_upsert=epb.EngineDocUpsertRequest(
            agent="a", collection="c", id="d", doc=J('{"x": 1}'))),
        pb.Command(id=14, doc_delete=epb.EngineDocDeleteRequest(agent="a", collection="c", id="d")),
        pb.Command(id=15, update_run=epb.EngineUpdateRunRequest(
            id="E", patch=epb.EngineRunPatch(status="completed", clear=["claim"]),
            expect_owner="w")),
    ]
    r = await run_all(ledger, pb.ExecuteRequest(commands=commands))
    assert sorted(r) == sorted(c.id for c in commands)
    for c in commands:  # each answered with its own kind
        assert r[c.id].WhichOneof("kind") == c.WhichOneof("kind"), r[c.id]
    # applied in order, with the unary answers' content
    assert r[101].acquire.run.fencing_token == 1 and r[102].renew.run.fencing_token == 1
    assert r[7].create_run.created and r[7].create_run.run.input.json == '{"n": 1}'
    assert r[3].claim_run.claimed and r[3].claim_run.run.claim.owner == "w"
    assert r[40].renew_claim.renewed
    assert r[5].append_step.step.seq == 1
    assert r[6].save_checkpoint.saved
    assert r[8].claim_key.created and r[8].claim_key.run_id == "E"
    assert r[9].acquire_lock.acquired and r[9].acquire_lock.fencing_token >= 1
    assert r[10].release_lock.released
    assert r[11].put_effect.HasField("recorded_at")
    assert r[12].kv_set.HasField("updated_at")
    assert r[13].doc_upsert.created and r[14].doc_delete.deleted
    assert r[15].update_run.run.status == "completed"
    assert not r[15].update_run.run.HasField("claim")
    # the unary reads see the stream's writes
    got = await es.GetRun(epb.EngineGetRunRequest(id="E"))
    assert got.run == r[15].update_run.run
    effect = await es.GetEffect(epb.EngineGetEffectRequest(key="E/charge"))
    assert effect.found and effect.result.json == "null"


# (unary method, request, field the error names): refused before the writer
INVALID: list[tuple[str, Any, str]] = [
    ("CreateRun", epb.EngineCreateRunRequest(), "run"),
    ("CreateRun", epb.EngineCreateRunRequest(
        run=epb.EngineRun(id="r", agent="a", status="q", input=J("{"))), "run.input"),
    ("UpdateRun", epb.EngineUpdateRunRequest(
        id="r", patch=epb.EngineRunPatch(clear=["x"])), "patch.clear[0]"),
    ("UpdateRun", epb.EngineUpdateRunRequest(id="r", expect_status=["ok", ""]),
     "expect_status[1]"),
    ("ClaimRun", epb.EngineClaimRunRequest(id="r", owner="w", ttl_ms=-5), "ttl_ms"),
    ("RenewClaim", epb.EngineRenewClaimRequest(id="", owner="w", ttl_ms=5), "id"),
    ("AppendStep", epb.EngineAppendStepRequest(
        step=epb.EngineStep(run_id="r", name="n", seq=3)), "step.seq"),
    ("SaveCheckpoint", epb.EngineSaveCheckpointRequest(
        checkpoint=epb.EngineCheckpoint(run_id="r", step_index=1)), "checkpoint.state"),
    ("ClaimKey", epb.EngineClaimKeyRequest(
        scope="s" * 1025, key="k", run_id="r", ttl_ms=1), "scope"),
    ("AcquireLock", epb.EngineAcquireLockRequest(key="k", owner="o" * 257, ttl_ms=1), "owner"),
    ("ReleaseLock", epb.EngineReleaseLockRequest(key="", owner="o"), "key"),
    ("PutEffect", epb.EnginePutEffectRequest(key="k"), "result"),
    ("KvSet", epb.EngineKvSetRequest(agent="a", key="k", value=J("NaN")), "value"),
    ("DocUpsert", epb.EngineDocUpsertRequest(agent="a", collection="c", id="d"), "doc"),
    ("DocUpsert", epb.EngineDocUpsertRequest(
        agent="a", collection="c", id="d", doc=J("[]")), "doc"),
    ("DocDelete", epb.EngineDocDeleteRequest(agent="a", collection="c\x00", id="d"),
     "collection"),
    ("CreateRun", epb.EngineCreateRunRequest(
        run=epb.EngineRun(id="r", agent="a", status="q"), request_id="x" * 129), "request_id"),
]


async def test_validation_errors_are_per_command_identical_to_unary_and_the_stream_goes_on(
    stubs,  # type: ignore[no-untyped-def]
) -> None:
    ledger, es = stubs
    assert set(ENGINE_KIND_OF.values()) == ENGINE_KINDS
    expected = [await unary_status(getattr(es, m), req) for m, req, _ in INVALID]
    # one stream; each message a bad command followed by a good one
    messages = [
        pb.ExecuteRequest(commands=[
            pb.Command(id=2 * i, **{ENGINE_KIND_OF[m]: req}),
            pb.Command(id=2 * i + 1, kv_set=epb.EngineKvSetRequest(
                agent="a", key=f"after-{i}", value=J(str(i)))),
        ])
        for i, (m, req, _) in enumerate(INVALID)
    ]
    messages.append(pb.ExecuteRequest(commands=[
        pb.Command(id=999, acquire=pb.AcquireRequest(run_id="still", owner="w"))]))
    r = await run_all(ledger, *messages)
    for i, (m, req, field) in enumerate(INVALID):
        got = r[2 * i]
        assert got.WhichOneof("kind") == "error", (m, req, got)
        assert got.error == expected[i], (m, req, got.error, expected[i])
        assert got.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert reason_and_field(got.error) == ("RUN_VALIDATION_ERROR", field), (m, got.error)
        assert field in got.error.message
        assert r[2 * i + 1].WhichOneof("kind") == "kv_set", "the stream went on"
    assert r[999].WhichOneof("kind") == "acquire"
    # nothing of the refused commands was stored
    assert not (await es.GetRun(epb.EngineGetRunRequest(id="r"))).found


async def test_decided_refusals_are_identical_to_unary(stubs) -> None:  # type: ignore[no-untyped-def]
    ledger, es = stubs
    await es.CreateRun(epb.EngineCreateRunRequest(run=epb.EngineRun(id="g", agent="a", status="q")))
    cases = [
        ("UpdateRun", epb.EngineUpdateRunRequest(id="g", expect_status=["running"]),
         ("INVALID_RUN_STATE", "expect_status")),
        ("UpdateRun", epb.EngineUpdateRunRequest(id="g", expect_owner="w"), None),
        ("UpdateRun", epb.EngineUpdateRunRequest(id="nope"), ("RUN_NOT_FOUND", "id")),
    ]
    expected = [await unary_status(getattr(es, m), req) for m, req, _ in cases]
    r = await run_all(ledger, pb.ExecuteRequest(commands=[
        pb.Command(id=i, update_run=req) for i, (_, req, _) in enumerate(cases)]))
    for i, (_, req, want) in enumerate(cases):
        assert r[i].error == expected[i], (req, r[i])
        if want is not None:
            assert reason_and_field(r[i].error) == want
    assert reason_and_field(r[1].error)[0] == "INVALID_RUN_STATE"


async def test_retried_engine_commands_are_answered_from_the_request_id_table(
    stubs,  # type: ignore[no-untyped-def]
) -> None:
    ledger, es = stubs
    grant_req = epb.EngineAcquireLockRequest(key="l", owner="a", ttl_ms=60_000, request_id="al-1")
    r = await run_all(ledger, pb.ExecuteRequest(commands=[
        pb.Command(id=1, acquire_lock=grant_req),
        pb.Command(id=2, release_lock=epb.EngineReleaseLockRequest(key="l", owner="a")),
        pb.Command(id=3, acquire_lock=epb.EngineAcquireLockRequest(
            key="l", owner="b", ttl_ms=60_000)),
        pb.Command(id=4, release_lock=epb.EngineReleaseLockRequest(key="l", owner="b")),
    ]))
    grant = r[1].acquire_lock
    assert grant.acquired and r[3].acquire_lock.fencing_token == grant.fencing_token + 1
    # the retry, on a new stream and twice in one message: the original answer
    again = await run_all(ledger, pb.ExecuteRequest(commands=[
        pb.Command(id=1, acquire_lock=grant_req), pb.Command(id=2, acquire_lock=grant_req)]))
    assert again[1].acquire_lock == grant and again[2].acquire_lock == grant
    assert await es.AcquireLock(grant_req) == grant, "one table for unary and stream"
    fresh = await es.AcquireLock(epb.EngineAcquireLockRequest(key="l", owner="c", ttl_ms=1000))
    assert fresh.fencing_token == grant.fencing_token + 2, "the replays acquired nothing"

    # unary first, then the stream: the replay says created=true again
    create = epb.EngineCreateRunRequest(
        run=epb.EngineRun(id="once", agent="a", status="q"), request_id="cr-1"
    )
    first = await es.CreateRun(create)
    assert first.created
    replay = await run_all(
        ledger, pb.ExecuteRequest(commands=[pb.Command(id=1, create_run=create)])
    )
    assert replay[1].create_run == first
    # the same request id for a different request: refused exactly as unary
    reused = epb.EngineCreateRunRequest(
        run=epb.EngineRun(id="other", agent="a", status="q"), request_id="cr-1"
    )
    expected = await unary_status(es.CreateRun, reused)
    r = await run_all(ledger, pb.ExecuteRequest(commands=[pb.Command(id=1, create_run=reused)]))
    assert r[1].error == expected
    assert reason_and_field(r[1].error) == ("RUN_VALIDATION_ERROR", "request_id")
    assert not (await es.GetRun(epb.EngineGetRunRequest(id="other"))).found
