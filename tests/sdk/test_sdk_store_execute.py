"""client.store over the client's Execute stream: the engine store's
13 mutations ride the same dispatcher as the client's ledger mutations —
coalesced per event-loop turn (a ledger command may share their message),
raising exactly the unary call's exception, retried with the same request id
across a cut stream — and never touch Execute with ``transport="unary"``.
Reads and listings stay unary.

The wire is observed, and faults injected, with test_sdk_execute.py's client
interceptors (``Wire``); the server is a real one, reached through the TCP
proxy of _proxy.py where a connection must be cut."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_sdk_execute import (
    Wire,
    _open_stream,
    _same_error,
    _wait_for,
    answer_lost_once,
)

import fencepost
from fencepost._execute import KIND_OF_REQUEST
from fencepost.v1 import engine_store_pb2
from fencepost.v1 import ledger_pb2 as pb
from fencepost_server.testing.server import ServerThread

# The EngineStore RPCs that Ledger.Execute carries (Command fields 20-32).
STORE_MUTATIONS = {"CreateRun", "UpdateRun", "ClaimRun", "RenewClaim", "AppendStep",
                   "SaveCheckpoint", "ClaimKey", "AcquireLock", "ReleaseLock", "PutEffect",
                   "KvSet", "DocUpsert", "DocDelete"}


def _store_unary(wire: Wire) -> list[str]:
    """The store mutations that went as unary calls."""
    return [m for m in wire.unary if m in STORE_MUTATIONS]


# -- the kinds ---------------------------------------------------------------------------


def test_the_dispatcher_carries_exactly_the_store_mutations_with_their_answers() -> None:
    """The dispatcher reads its kinds from Command's oneof: the 13 EngineStore
    mutations are carried (and nothing else of EngineStore), each answered by
    the CommandResult field of its name, which is the unary response type."""
    carried = set()
    result_fields = pb.CommandResult.DESCRIPTOR.fields_by_name
    for method in engine_store_pb2.DESCRIPTOR.services_by_name["EngineStore"].methods:
        request_type = getattr(engine_store_pb2, method.input_type.name)
        kind = KIND_OF_REQUEST.get(request_type)
        if kind is None:
            continue
        carried.add(method.name)
        assert not method.client_streaming and not method.server_streaming
        assert result_fields[kind].message_type is method.output_type, method.name
    assert carried == STORE_MUTATIONS
    assert len(KIND_OF_REQUEST) == 9 + 13 + 1  # and the ledger's nine, and Transact


# -- coalescing --------------------------------------------------------------------------


async def test_store_mutations_issued_in_one_turn_travel_in_one_message(
    server: ServerThread,
) -> None:
    wire = Wire()
    async with fencepost.Client(server.address, owner="worker-a",
                                interceptors=wire.interceptors) as client:
        store = client.store
        await _open_stream(client)
        sent_before = len(wire.requests)

        # one turn: eight store mutations and a ledger acquire, one message
        made, step, kept, key, lock, _, _, new_doc, lease = await asyncio.gather(
            store.create_run("r1", agent="a", input={"n": 2**70}),
            store.append_step("r1", "fetch", status="ok"),
            store.save_checkpoint("r1", 1, {"at": "fetch"}),
            store.claim_key("orders", "o-1", "r1", 60_000),
            store.acquire_lock("lk", "worker-a", 60_000),
            store.put_effect("r1/charge", {"id": "ch_1"}),
            store.kv_set("a", "k", [1, "two"]),
            store.doc_upsert("a", "c", "d1", {"kind": "x"}),
            client.acquire("ledger-run"),
        )
        assert len(wire.requests) == sent_before + 1, [len(m.commands) for m in wire.requests]
        first = wire.requests[-1].commands
        assert [c.WhichOneof("kind") for c in first] == [
            "create_run", "append_step", "save_checkpoint", "claim_key", "acquire_lock",
            "put_effect", "kv_set", "doc_upsert", "acquire"]
        assert len({c.id for c in first}) == len(first)  # one correlation id each
        ids = [getattr(c, c.WhichOneof("kind")).request_id for c in first]
        assert all(len(i) == 32 for i in ids) and len(set(ids)) == len(ids)
        assert made.created and made.run.input == {"n": 2**70}
        assert step.seq == 1 and kept and key.created and key.run_id == "r1"
        assert lock.acquired and new_doc and lease.fencing_token == 1

        # the next turn: the other five, applied in the order issued (the
        # claim before its renewal)
        updated, claimed, renewed, released, deleted = await asyncio.gather(
            store.update_run("r1", status="running", expect_status="queued"),
            store.claim_run("r1", "worker-a", 60_000),
            store.renew_claim("r1", "worker-a", 60_000),
            store.release_lock("lk", "worker-a"),
            store.doc_delete("a", "c", "d1"),
        )
        assert len(wire.requests) == sent_before + 2
        assert [c.WhichOneof("kind") for c in wire.requests[-1].commands] == [
            "update_run", "claim_run", "renew_claim", "release_lock", "doc_delete"]
        assert updated.status == "running" and claimed and renewed and released and deleted

        # every one of the 13 kinds went on the stream, none unary; reads unary
        assert _store_unary(wire) == []
        run = await store.get_run("r1")
        assert run is not None and run.claim is not None and run.claim.owner == "worker-a"
        assert (await store.kv_get("a", "k")).value == [1, "two"]
        assert (await store.get_effect("r1/charge")).value == {"id": "ch_1"}
        assert [s.name for s in await store.list_steps("r1")] == ["fetch"]
        assert await store.doc_list("a", "c") == []
        assert {"GetRun", "KvGet", "GetEffect"} <= set(wire.unary)
        assert {c.WhichOneof("kind") for c in wire.commands()} >= {
            "create_run", "update_run", "claim_run", "renew_claim", "append_step",
            "save_checkpoint", "claim_key", "acquire_lock", "release_lock", "put_effect",
            "kv_set", "doc_upsert", "doc_delete"}
        assert wire.streams == 1


# -- errors ------------------------------------------------------------------------------


async def test_store_errors_over_the_stream_are_the_unary_exceptions(
    server: ServerThread,
) -> None:
    wire = Wire()
    async with (
        fencepost.Client(server.address, owner="w", transport="unary") as unary,
        fencepost.Client(server.address, owner="w", interceptors=wire.interceptors) as streamed,
    ):
        await _open_stream(streamed)
        dispatcher = streamed._connection.dispatcher
        assert dispatcher is not None
        opened = dispatcher.streams_opened
        await unary.store.create_run("queued-run", agent="a")

        async def both(call: Any) -> fencepost.FencepostError:
            errors = []
            for client in (unary, streamed):
                before = len(wire.commands())
                with pytest.raises(fencepost.FencepostError) as info:
                    await call(client.store)
                if client is streamed:
                    assert len(wire.commands()) == before + 1  # it went on the stream
                errors.append(info.value)
            _same_error(*errors)
            return errors[1]

        bad = await both(lambda s: s.claim_run("queued-run", "w", -1))
        assert type(bad) is fencepost.ValidationError and bad.field == "ttl_ms"
        bad = await both(lambda s: s.create_run("x", agent=""))
        assert type(bad) is fencepost.ValidationError and bad.field
        bad = await both(lambda s: s.kv_set("a", "", 1))
        assert type(bad) is fencepost.ValidationError and bad.field
        guard = await both(lambda s: s.update_run("queued-run", status="x",
                                                  expect_status="running"))
        assert type(guard) is fencepost.InvalidRunStateError
        missing = await both(lambda s: s.update_run("nope", status="x"))
        assert type(missing) is fencepost.RunNotFoundError

        # a value that is not JSON is refused before anything is sent
        before = len(wire.requests)
        with pytest.raises(fencepost.ValidationError) as local:
            await streamed.store.kv_set("a", "k", float("nan"))
        assert local.value.field == "value" and len(wire.requests) == before

        # failures and successes in one message: each gets its own answer
        before = len(wire.requests)
        refused, made, guarded = await asyncio.gather(
            streamed.store.claim_run("queued-run", "w", 0),
            streamed.store.create_run("fresh", agent="a"),
            streamed.store.update_run("fresh", status="done", expect_owner="someone"),
            return_exceptions=True,
        )
        assert len(wire.requests) == before + 1
        assert type(refused) is fencepost.ValidationError
        assert not isinstance(made, BaseException) and made.created
        assert type(guarded) is fencepost.InvalidRunStateError
        # and the stream is still the same one, still up
        assert dispatcher.is_open and dispatcher.streams_opened == opened
        assert _store_unary(wire) == []


# -- transport="unary" ---------------------------------------------------------------------


async def test_unary_transport_never_puts_store_mutations_on_execute(
    server: ServerThread,
) -> None:
    wire = Wire()
    async with fencepost.Client(server.address, owner="w", transport="unary",
                                interceptors=wire.interceptors) as client:
        store = client.store
        assert store._connection.dispatcher is None
        await asyncio.gather(
            store.create_run("r1", agent="a"),
            store.append_step("r1", "s"),
            store.save_checkpoint("r1", 1, {}),
            store.claim_key("s", "k", "r1", 1000),
            store.acquire_lock("lk", "w", 1000),
            store.put_effect("e", None),
            store.kv_set("a", "k", 1),
            store.doc_upsert("a", "c", "d", {}),
        )
        await store.update_run("r1", status="running")
        await store.claim_run("r1", "w", 1000)
        await store.renew_claim("r1", "w", 1000)
        await store.release_lock("lk", "w")
        await store.doc_delete("a", "c", "d")
    assert wire.streams == 0 and wire.requests == []
    assert sorted(_store_unary(wire)) == sorted(STORE_MUTATIONS)


# -- a stream cut mid-flight -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["create_run", "append_step"])
async def test_a_store_mutation_cut_off_mid_flight_applies_once(
    server: ServerThread, kind: str
) -> None:
    """The mutation commits and is answered, but the connection is cut before
    the answer reaches the client: it retries with the same request id (over
    unary or the re-opened stream) and gets the original answer. With a new
    id the retry would have applied again: create_run would answer
    ``created=False`` (the run existed), append_step would append a second
    step."""
    async with answer_lost_once(server, "w", lambda r: r.HasField(kind)) as (
        client, wire, dispatcher
    ):
        if kind == "create_run":
            made = await client.store.create_run("run-cut", agent="a")
            assert made.created  # the original answer
            unary_name = "CreateRun"
        else:
            step = await client.store.append_step("run-cut", "only")
            assert step.seq == 1
            unary_name = "AppendStep"
        assert wire.lose is None  # the answer was lost on the way, once

        first = [getattr(c, kind) for c in wire.commands() if c.HasField(kind)]
        retried = [r for m, r in wire.unary_requests if m == unary_name]
        attempts = first + retried
        assert len(attempts) >= 2  # the command on the stream, then its retry
        assert len({a.request_id for a in attempts}) == 1
        assert len(attempts[0].request_id) == 32
        # applied once
        if kind == "create_run":
            runs = await client.store.list_runs()
            assert [r.id for r in runs.runs] == ["run-cut"]
        else:
            assert [s.seq for s in await client.store.list_steps("run-cut")] == [1]
        # and the client is whole: the stream comes back and carries the store's commands
        await _wait_for(lambda: dispatcher.is_open, "the stream to reopen")
        assert dispatcher.streams_opened >= 2
        await client.store.kv_set("a", "after", True)
        assert wire.commands()[-1].WhichOneof("kind") == "kv_set"
