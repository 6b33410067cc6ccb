"""Fenced writes on the wire: every engine-store mutation and RecordCheckpoint
with a `fence` on a ledger run and on a keyed lock, over the unary RPC and
over Ledger.Execute: a current token writes; a stale token (after a takeover),
a finished run, a released lock, a missing token, a run or lock that does not
exist and a malformed fence refuse with the documented reason and write
nothing; no fence at all writes as before."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from _transport import ENGINE_KIND_OF, StreamLedger
from _wire import expect

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2_grpc
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import record_pb2 as rpb
from fencepost_server.testing.clock import ManualClock

FP = grpc.StatusCode.FAILED_PRECONDITION
TTL = 10_000


def J(value: Any) -> epb.JsonValue:
    return epb.JsonValue(json=json.dumps(value))


@dataclass
class World:
    es: Any  # EngineStore stub (reads, setup, PutArtifact)
    ledger: Any  # Ledger stub
    send: Callable[[str, Any], Any]  # (RPC name, request) -> response, over the transport

    def run_token(self) -> int:
        return int(self.ledger.GetRun(pb.GetRunRequest(run_id="R")).run.fencing_token)

    def artifact(self, n: int, fence: epb.Fence | None) -> epb.EnginePutArtifactResponse:
        header = epb.EngineArtifactHeader(id=f"a{n}", run_id="R", size_bytes=3)
        if fence is not None:
            header.fence.CopyFrom(fence)
        msgs = [
            epb.EnginePutArtifactRequest(header=header),
            epb.EnginePutArtifactRequest(chunk=b"abc"),
        ]
        return self.es.PutArtifact(iter(msgs))


@dataclass
class Mutation:
    rpc: str
    prepare: Callable[[World, int], None]  # unfenced set-up for case n
    request: Callable[[int], Any]  # the fenced request of case n (fence added later)
    seen: Callable[[World, int], bool]  # whether case n's write is visible


def _nothing(w: World, n: int) -> None:
    pass


def _make_run(w: World, rid: str) -> None:
    w.es.CreateRun(epb.EngineCreateRunRequest(run=epb.EngineRun(id=rid, agent="ag", status="q")))


def _run(w: World, rid: str) -> epb.EngineRun | None:
    got = w.es.GetRun(epb.EngineGetRunRequest(id=rid))
    return got.run if got.found else None


def _doc_ids(w: World) -> set[str]:
    docs = [d for page in w.es.DocList(epb.EngineDocListRequest(agent="ag", collection="c"))
            for d in page.docs]
    return {d.id for d in docs}


def _lock_taken(w: World, key: str) -> bool:
    """Whether another owner is refused the lock (someone holds it)."""
    got = w.es.AcquireLock(epb.EngineAcquireLockRequest(key=key, owner="probe", ttl_ms=1))
    if got.acquired:
        w.es.ReleaseLock(epb.EngineReleaseLockRequest(key=key, owner="probe"))
    return not got.acquired


def _held_run(w: World, n: int) -> None:
    w.ledger.Acquire(pb.AcquireRequest(run_id=f"H{n}", owner="h", lease_ttl_ms=TTL))


def _record_checkpoint(n: int) -> pb.RecordCheckpointRequest:
    return pb.RecordCheckpointRequest(
        run_id=f"H{n}", owner="h", fencing_token=1, key=f"ck{n}", snapshot_version=n
    )


MUTATIONS = [
    Mutation(
        "CreateRun",
        _nothing,
        lambda n: epb.EngineCreateRunRequest(run=epb.EngineRun(id=f"c{n}", agent="ag", status="q")),
        lambda w, n: _run(w, f"c{n}") is not None,
    ),
    Mutation(
        "UpdateRun",
        lambda w, n: _make_run(w, f"u{n}"),
        lambda n: epb.EngineUpdateRunRequest(id=f"u{n}", patch=epb.EngineRunPatch(status="done")),
        lambda w, n: _run(w, f"u{n}").status == "done",  # type: ignore[union-attr]
    ),
    Mutation(
        "ClaimRun",
        lambda w, n: _make_run(w, f"cl{n}"),
        lambda n: epb.EngineClaimRunRequest(id=f"cl{n}", owner="o", ttl_ms=TTL),
        lambda w, n: _run(w, f"cl{n}").HasField("claim"),  # type: ignore[union-attr]
    ),
    Mutation(
        "RenewClaim",
        lambda w, n: (
            _make_run(w, f"rc{n}"),
            w.es.ClaimRun(epb.EngineClaimRunRequest(id=f"rc{n}", owner="o", ttl_ms=TTL)),
        ),
        lambda n: epb.EngineRenewClaimRequest(id=f"rc{n}", owner="o", ttl_ms=10 * TTL),
        lambda w, n: (
            _run(w, f"rc{n}").claim.expires_at.ToMilliseconds()  # type: ignore[union-attr]
            - _run(w, f"rc{n}").updated_at.ToMilliseconds()  # type: ignore[union-attr]
            == 10 * TTL
        ),
    ),
    Mutation(
        "AppendStep",
        _nothing,
        lambda n: epb.EngineAppendStepRequest(step=epb.EngineStep(run_id=f"s{n}", name="x")),
        lambda w, n: any(
            page.steps for page in w.es.ListSteps(epb.EngineListStepsRequest(run_id=f"s{n}"))
        ),
    ),
    Mutation(
        "SaveCheckpoint",
        _nothing,
        lambda n: epb.EngineSaveCheckpointRequest(
            checkpoint=epb.EngineCheckpoint(run_id=f"k{n}", step_index=1, state=J({"n": n}))
        ),
        lambda w, n: w.es.LatestCheckpoint(epb.EngineLatestCheckpointRequest(run_id=f"k{n}")).found,
    ),
    Mutation(
        "ClaimKey",
        _nothing,
        lambda n: epb.EngineClaimKeyRequest(scope="s", key=f"ik{n}", run_id="mine", ttl_ms=TTL),
        lambda w, n: w.es.ClaimKey(
            epb.EngineClaimKeyRequest(scope="s", key=f"ik{n}", run_id="probe", ttl_ms=TTL)
        ).run_id == "mine",
    ),
    Mutation(
        "AcquireLock",
        _nothing,
        lambda n: epb.EngineAcquireLockRequest(key=f"l{n}", owner="o", ttl_ms=TTL),
        lambda w, n: _lock_taken(w, f"l{n}"),
    ),
    Mutation(
        "ReleaseLock",
        lambda w, n: w.es.AcquireLock(epb.EngineAcquireLockRequest(key=f"rl{n}", owner="o",
                                                                   ttl_ms=TTL)),
        lambda n: epb.EngineReleaseLockRequest(key=f"rl{n}", owner="o"),
        lambda w, n: not _lock_taken(w, f"rl{n}"),
    ),
    Mutation(
        "PutEffect",
        _nothing,
        lambda n: epb.EnginePutEffectRequest(key=f"e{n}", result=J(n)),
        lambda w, n: w.es.GetEffect(epb.EngineGetEffectRequest(key=f"e{n}")).found,
    ),
    Mutation(
        "KvSet",
        _nothing,
        lambda n: epb.EngineKvSetRequest(agent="ag", key=f"kv{n}", value=J(n)),
        lambda w, n: w.es.KvGet(epb.EngineKvGetRequest(agent="ag", key=f"kv{n}")).found,
    ),
    Mutation(
        "DocUpsert",
        _nothing,
        lambda n: epb.EngineDocUpsertRequest(agent="ag", collection="c", id=f"d{n}", doc=J({})),
        lambda w, n: f"d{n}" in _doc_ids(w),
    ),
    Mutation(
        "DocDelete",
        lambda w, n: w.es.DocUpsert(
            epb.EngineDocUpsertRequest(agent="ag", collection="c", id=f"dd{n}", doc=J({}))
        ),
        lambda n: epb.EngineDocDeleteRequest(agent="ag", collection="c", id=f"dd{n}"),
        lambda w, n: f"dd{n}" not in _doc_ids(w),
    ),
    Mutation(
        "PutArtifact",
        _nothing,
        lambda n: n,  # the header is built by World.artifact
        lambda w, n: w.es.GetArtifact(epb.EngineGetArtifactRequest(id=f"a{n}")).found,
    ),
    Mutation(
        "DeleteArtifact",  # unary over either transport: Execute does not carry it
        lambda w, n: w.es.PutArtifact(iter([
            epb.EnginePutArtifactRequest(
                header=epb.EngineArtifactHeader(id=f"da{n}", run_id="R", size_bytes=1)
            ),
            epb.EnginePutArtifactRequest(chunk=b"d"),
        ])),
        lambda n: epb.EngineDeleteArtifactRequest(id=f"da{n}"),
        lambda w, n: not w.es.GetArtifact(epb.EngineGetArtifactRequest(id=f"da{n}")).found,
    ),
    Mutation(
        "RecordCheckpoint",
        _held_run,
        _record_checkpoint,
        lambda w, n: w.ledger.GetRun(pb.GetRunRequest(run_id=f"H{n}")).run.checkpoint_ref.key
        == f"ck{n}",
    ),
]


def test_every_mutation_request_has_a_fence_and_every_one_is_tested() -> None:
    fenced = {
        m.name[len("Engine"):-len("Request")]
        for m in epb.DESCRIPTOR.message_types_by_name.values()
        if "fence" in m.fields_by_name and m.name.endswith("Request")
    }
    unary_only = {"PutArtifact", "DeleteArtifact"}  # not carried by Execute
    assert fenced | {"PutArtifact"} == set(ENGINE_KIND_OF) | unary_only
    assert "fence" in epb.EngineArtifactHeader.DESCRIPTOR.fields_by_name
    assert "fence" in pb.RecordCheckpointRequest.DESCRIPTOR.fields_by_name
    assert {m.rpc for m in MUTATIONS} == set(ENGINE_KIND_OF) | unary_only | {"RecordCheckpoint"}


@pytest.fixture(params=["unary", "stream"])
def world(request: pytest.FixtureRequest, channel: grpc.Channel) -> Iterator[World]:
    es = engine_store_pb2_grpc.EngineStoreStub(channel)
    ledger = ledger_pb2_grpc.LedgerStub(channel)
    if request.param == "unary":

        def send(rpc: str, req: Any) -> Any:
            stub = ledger if rpc == "RecordCheckpoint" else es
            return getattr(stub, rpc)(req)

        yield World(es, ledger, send)
        return
    stream = StreamLedger(channel)
    kinds = {**ENGINE_KIND_OF, "RecordCheckpoint": "record_checkpoint"}
    yield World(es, ledger, lambda rpc, req: stream._call(kinds[rpc], req) if rpc in kinds
                else getattr(es, rpc)(req))
    stream.close()


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.rpc)
def test_a_fenced_mutation_writes_only_under_a_current_token(
    world: World, clock: ManualClock, m: Mutation
) -> None:
    w = world
    counter = iter(range(1000))

    def attempt(fence: epb.Fence | None) -> tuple[int, Any]:
        n = next(counter)
        m.prepare(w, n)
        if m.rpc == "PutArtifact":
            return n, lambda: w.artifact(n, fence)
        req = m.request(n)
        if fence is not None:
            req.fence.CopyFrom(fence)
        return n, lambda: w.send(m.rpc, req)

    def writes(fence: epb.Fence | None) -> None:
        n, call = attempt(fence)
        call()
        assert m.seen(w, n), f"case {n}: a write under {fence} was not applied"

    def refused(fence: epb.Fence, reason: str, field: str | None = None) -> Any:
        if field is not None and m.rpc == "PutArtifact":
            field = f"header.{field}"  # the artifact's fence is its header's
        n, call = attempt(fence)
        err = expect(lambda _: call(), None, _code(reason), reason, field=field)
        assert not m.seen(w, n), f"case {n}: a write refused under {fence} was applied"
        return err

    w.ledger.Acquire(pb.AcquireRequest(run_id="R", owner="a", lease_ttl_ms=TTL))
    lock = w.es.AcquireLock(epb.EngineAcquireLockRequest(key="LK", owner="a", ttl_ms=TTL))
    t1, l1 = w.run_token(), lock.fencing_token

    # current tokens write; no fence at all writes as before
    writes(epb.Fence(run_id="R", fencing_token=t1))
    writes(epb.Fence(lock_key="LK", fencing_token=l1))
    writes(None)

    # missing token, missing target, both targets, unknown run or lock
    refused(epb.Fence(run_id="R"), "RUN_VALIDATION_ERROR", "fence.fencing_token")
    refused(epb.Fence(fencing_token=t1), "RUN_VALIDATION_ERROR", "fence.run_id")
    refused(epb.Fence(run_id="R", lock_key="LK", fencing_token=t1), "RUN_VALIDATION_ERROR",
            "fence.run_id")
    refused(epb.Fence(run_id="nope", fencing_token=1), "RUN_NOT_FOUND", "fence.run_id")
    refused(epb.Fence(lock_key="nope", fencing_token=1), "RUN_NOT_FOUND", "fence.lock_key")

    # the lease and the lock expire: expiry alone does not break the fence
    clock.advance(2 * TTL)
    writes(epb.Fence(run_id="R", fencing_token=t1))
    writes(epb.Fence(lock_key="LK", fencing_token=l1))

    # takeover: the old tokens are stale, the new ones write
    w.ledger.Acquire(pb.AcquireRequest(run_id="R", owner="b", lease_ttl_ms=TTL))
    lock2 = w.es.AcquireLock(epb.EngineAcquireLockRequest(key="LK", owner="b", ttl_ms=TTL))
    t2, l2 = w.run_token(), lock2.fencing_token
    assert t2 > t1 and l2 > l1 and lock2.acquired
    err = refused(epb.Fence(run_id="R", fencing_token=t1), "RUN_LEASE_LOST")
    assert err.record is not None and err.record.fencing_token == t2
    assert err.metadata["fencing_token"] == str(t2)
    err = refused(epb.Fence(lock_key="LK", fencing_token=l1), "LOCK_LOST")
    assert err.metadata == {"lock_key": "LK", "fencing_token": str(l2), "owner": "b"}
    writes(epb.Fence(run_id="R", fencing_token=t2))
    writes(epb.Fence(lock_key="LK", fencing_token=l2))
    refused(epb.Fence(run_id="R", fencing_token=t2 + 1), "RUN_LEASE_LOST")  # a token from nowhere

    # a released lock and a finished run fence nothing any more
    w.es.ReleaseLock(epb.EngineReleaseLockRequest(key="LK", owner="b"))
    err = refused(epb.Fence(lock_key="LK", fencing_token=l2), "LOCK_LOST")
    assert err.metadata["owner"] == ""
    w.ledger.Finish(pb.FinishRequest(run_id="R", owner="b", fencing_token=t2,
                                     status=rpb.RunStatus.RUN_STATUS_COMPLETED))
    err = refused(epb.Fence(run_id="R", fencing_token=t2), "RUN_LEASE_LOST")
    assert err.record is not None and err.record.status == rpb.RunStatus.RUN_STATUS_COMPLETED


def _code(reason: str) -> grpc.StatusCode:
    return {
        "RUN_VALIDATION_ERROR": grpc.StatusCode.INVALID_ARGUMENT,
        "RUN_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
        "RUN_LEASE_LOST": FP,
        "LOCK_LOST": FP,
    }[reason]


def test_a_refused_fenced_write_is_answered_the_same_on_retry(channel: grpc.Channel,
                                                               clock: ManualClock) -> None:
    """The request-id table remembers a fence refusal (with its metadata), so a
    retry after the fence moved back... cannot: it gets the original answer."""
    es = engine_store_pb2_grpc.EngineStoreStub(channel)
    es.AcquireLock(epb.EngineAcquireLockRequest(key="LK", owner="a", ttl_ms=TTL))
    clock.advance(2 * TTL)
    es.AcquireLock(epb.EngineAcquireLockRequest(key="LK", owner="b", ttl_ms=TTL))
    req = epb.EnginePutEffectRequest(key="e", result=J(1), request_id="rid-1",
                                     fence=epb.Fence(lock_key="LK", fencing_token=1))
    first = expect(es.PutEffect, req, FP, "LOCK_LOST")
    again = expect(es.PutEffect, req, FP, "LOCK_LOST")
    assert first.metadata == again.metadata and first.message == again.message
    # the same id with another fence is a different request
    other = epb.EnginePutEffectRequest(key="e", result=J(1), request_id="rid-1",
                                       fence=epb.Fence(lock_key="LK", fencing_token=2))
    expect(es.PutEffect, other, grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR",
           field="request_id")
    assert not es.GetEffect(epb.EngineGetEffectRequest(key="e")).found


def test_a_fence_on_a_deleted_run_is_lease_lost_naming_the_field(channel: grpc.Channel) -> None:
    """A deleted run fences its last holder out (its token is kept as a
    tombstone); a run that never existed is RUN_NOT_FOUND instead."""
    es = engine_store_pb2_grpc.EngineStoreStub(channel)
    ledger = ledger_pb2_grpc.LedgerStub(channel)
    token = ledger.Acquire(pb.AcquireRequest(run_id="D", owner="a")).run.fencing_token
    ledger.DeleteRun(pb.DeleteRunRequest(run_id="D"))
    req = epb.EngineKvSetRequest(agent="ag", key="k", value=J(1),
                                 fence=epb.Fence(run_id="D", fencing_token=token))
    err = expect(es.KvSet, req, FP, "RUN_LEASE_LOST", field="fence.run_id", has_record=False)
    assert "deleted" in err.message
    assert not es.KvGet(epb.EngineKvGetRequest(agent="ag", key="k")).found
