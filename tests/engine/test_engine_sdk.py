"""The SDK's engine store (``fencepost._store``): Python values in and out,
copies, ABSENT vs None, datetimes, typed errors, artifacts from bytes and
(async) iterables, and the blocking twin with the same API.

The store is a client's (``Client.store``, ``SyncClient.store``), and every
test runs over both of the client's transports: "stream", where the store's
mutations ride the client's ``Ledger.Execute`` stream, and
"unary". Over "stream" the stream is opened before the test, and after it no
store mutation may have gone unary: the tests really ran on the stream."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest

import fencepost
from fencepost import (
    InvalidRunStateError,
    LockLostError,
    RunNotFoundError,
    SyncStore,
    ValidationError,
)
from fencepost._store import (
    ABSENT,
    AsyncStore,
    InvalidRunState,
    Lookup,
    RunNotFound,
)
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

START = datetime.fromtimestamp(ManualClock().now_ms() / 1000, tz=UTC)  # tests/conftest.py T0
ENGINE_STORE = "/fencepost.v1.EngineStore/"
# The EngineStore RPCs that Ledger.Execute carries (Command fields 20-32).
MUTATIONS = {"CreateRun", "UpdateRun", "ClaimRun", "RenewClaim", "AppendStep", "SaveCheckpoint",
             "ClaimKey", "AcquireLock", "ReleaseLock", "PutEffect", "KvSet", "DocUpsert",
             "DocDelete"}


class UnaryCalls(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Records the method of every unary call a client makes."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method
        self.methods.append(method.decode() if isinstance(method, bytes) else str(method))
        return await continuation(details, request)

    def store_mutations(self) -> list[str]:
        return [m for m in self.methods
                if m.startswith(ENGINE_STORE) and m[len(ENGINE_STORE):] in MUTATIONS]


@pytest.fixture(params=["stream", "unary"])
def transport(request: pytest.FixtureRequest) -> str:
    """The client's transport: "stream" (Execute, the default) or "unary"."""
    return str(request.param)


def _stream_is_open(client: fencepost.Client | fencepost.SyncClient) -> bool:
    return client.statistics().execute_stream_open


@pytest.fixture
async def astore(server: ServerThread, transport: str) -> AsyncIterator[AsyncStore]:
    calls = UnaryCalls()
    async with fencepost.Client(server.address, owner="w", interceptors=[calls],
                                transport=transport) as client:  # type: ignore[arg-type]
        if transport == "stream":
            # the stream opens in the background on a first mutation (a
            # ledger one here: the store stays empty), which goes unary
            with pytest.raises(RunNotFoundError):
                await client.delete("warm-up")
            deadline = time.monotonic() + 5
            while not _stream_is_open(client):
                assert time.monotonic() < deadline, "the Execute stream did not open"
                await asyncio.sleep(0.005)
        yield client.store
        assert _stream_is_open(client) == (transport == "stream")  # it never broke
    if transport == "stream":
        assert calls.store_mutations() == []
    else:
        assert client.statistics().execute_streams_opened == 0


@pytest.fixture
def sstore(server: ServerThread, transport: str) -> Iterator[SyncStore]:
    calls = UnaryCalls()
    with fencepost.SyncClient(server.address, owner="w", interceptors=[calls],
                              transport=transport) as client:  # type: ignore[arg-type]
        if transport == "stream":
            with pytest.raises(RunNotFoundError):
                client.delete("warm-up")
            deadline = time.monotonic() + 5
            while not _stream_is_open(client):
                assert time.monotonic() < deadline, "the Execute stream did not open"
                time.sleep(0.005)
        yield client.store
        assert _stream_is_open(client) == (transport == "stream")
    if transport == "stream":
        assert calls.store_mutations() == []


async def test_runs_take_and_give_python_values(astore: AsyncStore, clock: ManualClock) -> None:
    value = {"big": 2**70, "uni": "日本 🎉", "nested": [1, {"x": None}], "f": 1.25}
    made = await astore.create_run("r1", agent="billing", input=value, output=None)
    assert made.created and made.run.input == value
    assert made.run.output is None and made.run.error is ABSENT and made.run.metadata is ABSENT
    assert made.run.created_at == START and made.run.created_at.tzinfo is UTC
    value["big"] = 0  # a copy was taken at the call
    again = await astore.create_run("r1", agent="other", input={"other": True})
    assert not again.created and again.run.input["big"] == 2**70
    got = await astore.get_run("r1")
    assert got is not None
    got.input["nested"].append("mutated")  # the answer is the caller's own copy
    assert (await astore.get_run("r1")).input["nested"] == [1, {"x": None}]  # type: ignore[union-attr]
    assert await astore.get_run("missing") is None
    clock.advance(1500)
    upd = await astore.update_run("r1", status="done", output={"ok": True}, clear=["input"])
    assert upd.status == "done" and upd.output == {"ok": True} and upd.input is ABSENT
    assert (upd.updated_at - upd.created_at).total_seconds() == 1.5


async def test_typed_errors(astore: AsyncStore) -> None:
    assert InvalidRunState is InvalidRunStateError and RunNotFound is RunNotFoundError
    await astore.create_run("r", agent="a", status="queued")
    with pytest.raises(InvalidRunState) as ei:
        await astore.update_run("r", status="x", expect_status="running")
    assert ei.value.code == "INVALID_RUN_STATE"
    with pytest.raises(InvalidRunState):
        await astore.update_run("r", status="x", expect_owner="w")
    with pytest.raises(RunNotFound):
        await astore.update_run("nope", status="x")
    with pytest.raises(RunNotFound):
        await astore.read_artifact("nope")
    for bad in ({1, 2}, float("nan"), object(), {"x": float("inf")}):
        with pytest.raises(ValidationError) as vi:
            await astore.create_run("bad", agent="a", input=bad)
        assert vi.value.field == "input"
    assert await astore.get_run("bad") is None
    with pytest.raises(ValidationError) as vi:
        await astore.claim_run("r", "w", -1)
    assert vi.value.field == "ttl_ms"
    assert (await astore.get_run("r")).status == "queued"  # type: ignore[union-attr]


async def test_lists_claims_keys_locks(astore: AsyncStore, clock: ManualClock) -> None:
    for i in range(5):
        await astore.create_run(f"r{i}", agent="a", status="odd" if i % 2 else "even")
    listed = await astore.list_runs(agent="a", statuses="even", limit=2, offset=1)
    assert [r.id for r in listed.runs] == ["r2", "r4"] and listed.total == 3
    assert (await astore.list_runs(agent="a")).total == 5
    assert await astore.claim_run("r0", "w1", 1000)
    assert not await astore.claim_run("r0", "w2", 1000)
    assert await astore.renew_claim("r0", "w1", 1000)
    clock.advance(1000)
    assert not await astore.renew_claim("r0", "w1", 1000)
    assert await astore.claim_run("r0", "w2", 1000)
    run = await astore.get_run("r0")
    assert run is not None and run.claim is not None and run.claim.owner == "w2"
    key = await astore.claim_key("orders", "o-1", "r0", 60_000)
    assert key.created and key.run_id == "r0"
    assert (await astore.claim_key("orders", "o-1", "r1", 60_000)).run_id == "r0"
    a = await astore.acquire_lock("lk", "a", 60_000)
    assert a.acquired and a.owner == "a" and a.expires_at > START
    assert not (await astore.acquire_lock("lk", "b", 60_000)).acquired
    assert not await astore.release_lock("lk", "b")
    assert await astore.release_lock("lk", "a")
    b = await astore.acquire_lock("lk", "b", 60_000)
    assert b.acquired and b.fencing_token > a.fencing_token


async def test_steps_checkpoints_effects_state(astore: AsyncStore) -> None:
    s1 = await astore.append_step("r", "fetch", status="ok", input={"u": 1}, output=None)
    s2 = await astore.append_step("r", "parse")
    assert (s1.seq, s2.seq) == (1, 2) and s1.output is None and s2.output is ABSENT
    assert [s.name for s in await astore.list_steps("r")] == ["fetch", "parse"]
    assert await astore.latest_checkpoint("r") is None
    assert await astore.save_checkpoint("r", 2, {"state": [1, 2]})
    assert not await astore.save_checkpoint("r", 1, {"older": True})
    cp = await astore.latest_checkpoint("r")
    assert cp is not None and cp.step_index == 2 and cp.state == {"state": [1, 2]}
    assert await astore.get_effect("e") == Lookup(False)
    await astore.put_effect("e", None)
    found = await astore.get_effect("e")
    assert found.found and found.value is None and found.at == START
    assert not (await astore.kv_get("agent", "k")).found
    await astore.kv_set("agent", "k", [1, "two", {"3": 3}])
    assert (await astore.kv_get("agent", "k")).value == [1, "two", {"3": 3}]
    assert await astore.doc_upsert("agent", "c", "b", {"kind": "x", "n": 1})
    assert await astore.doc_upsert("agent", "c", "a", {"kind": "x", "n": 2})
    assert not await astore.doc_upsert("agent", "c", "a", {"kind": "y"})
    docs = await astore.doc_list("agent", "c", where={"kind": "x"})
    assert [(d.id, d.doc) for d in docs] == [("b", {"kind": "x", "n": 1})]
    assert [d.id for d in await astore.doc_list("agent", "c")] == ["a", "b"]
    assert await astore.doc_delete("agent", "c", "a")
    assert [d.id for d in await astore.doc_list("agent", "c", limit=5)] == ["b"]


async def test_artifacts_from_bytes_and_iterables(astore: AsyncStore) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    put = await astore.put_artifact("a1", data, run_id="r", name="blob", metadata={"k": 1})
    assert put.created and put.artifact.size_bytes == len(data)
    assert put.artifact.sha256 == hashlib.sha256(data).hexdigest()
    assert put.artifact.metadata == {"k": 1}
    assert await astore.read_artifact("a1") == data
    assert b"".join([c async for c in astore.iter_artifact("a1")]) == data

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(data), 700_001):
            yield data[i : i + 700_001]

    async def apieces() -> AsyncIterator[bytes]:
        for p in pieces():
            yield p

    assert (await astore.put_artifact("a2", pieces(), run_id="r", size_bytes=len(data))).created
    assert (await astore.put_artifact("a3", apieces(), run_id="r", size_bytes=len(data))).created
    assert (
        await astore.put_artifact("a4", [data[:5], bytearray(data[5:9])], run_id="r", size_bytes=9)
    ).created
    assert await astore.read_artifact("a2") == data == await astore.read_artifact("a3")
    assert await astore.read_artifact("a4") == data[:9]
    assert (await astore.put_artifact("a5", b"", run_id="r")).created
    assert await astore.read_artifact("a5") == b""
    with pytest.raises(ValidationError):
        await astore.put_artifact("a6", pieces(), run_id="r")  # no size_bytes
    with pytest.raises(ValidationError):
        await astore.put_artifact("a6", pieces(), run_id="r", size_bytes=len(data) + 1)
    assert await astore.get_artifact("a6") is None
    kept = await astore.put_artifact("a1", b"other", run_id="r")
    assert not kept.created and kept.artifact == put.artifact
    assert [a.id for a in await astore.list_artifacts("r")] == ["a1", "a2", "a3", "a4", "a5"]


async def test_delete_artifact_frees_it_and_respects_a_fence(astore: AsyncStore) -> None:
    data = os.urandom(600_000)
    assert (await astore.put_artifact("d1", data, run_id="r")).created
    assert (await astore.put_artifact("d2", b"kept", run_id="r")).created
    assert await astore.delete_artifact("d1")
    assert not await astore.delete_artifact("d1") and not await astore.delete_artifact("none")
    assert await astore.get_artifact("d1") is None
    with pytest.raises(RunNotFoundError):
        await astore.read_artifact("d1")
    assert [a.id for a in await astore.list_artifacts("r")] == ["d2"]
    lock = await astore.acquire_lock("gc", "a", 60_000)
    await astore.release_lock("gc", "a")
    stale = astore.fenced(lock_key="gc", fencing_token=lock.fencing_token)
    with pytest.raises(LockLostError):
        await stale.delete_artifact("d2")
    assert await astore.read_artifact("d2") == b"kept"
    with pytest.raises(ValidationError) as vi:
        await astore.delete_artifact("")
    assert vi.value.field == "id"


def test_the_sync_store_has_the_same_api() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {
            n: inspect.signature(f)
            for n, f in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_")
        }

    sync, asyn = public(SyncStore), public(AsyncStore)
    ignored = {"aclose", "connect"}
    assert set(sync) == set(asyn) - ignored
    for name, sig in sync.items():
        assert list(sig.parameters) == list(asyn[name].parameters), name


def test_the_sync_store_works(sstore: SyncStore) -> None:
    made = sstore.create_run("r", agent="a", input={"n": 2**64})
    assert made.created and sstore.get_run("r").input == {"n": 2**64}  # type: ignore[union-attr]
    with pytest.raises(InvalidRunState):
        sstore.update_run("r", status="x", expect_status=["done"])
    with pytest.raises(RunNotFound):
        sstore.update_run("nope", status="x")
    assert sstore.list_runs().total == 1
    data = os.urandom(2 * 1024 * 1024 + 3)
    chunks = (data[i : i + 300_000] for i in range(0, len(data), 300_000))
    assert sstore.put_artifact("x", chunks, run_id="r", size_bytes=len(data)).created
    got = list(sstore.iter_artifact("x"))
    assert len(got) > 1 and b"".join(got) == data
    it = sstore.iter_artifact("x")
    assert next(it)  # leaving early closes the stream
    it.close()  # type: ignore[attr-defined]
    assert sstore.read_artifact("x") == data
    assert sstore.delete_artifact("x") and not sstore.delete_artifact("x")
    lock = sstore.acquire_lock("k", "o", 1000)
    assert lock.acquired and sstore.release_lock("k", "o")
    sstore.kv_set("a", "k", None)
    assert sstore.kv_get("a", "k") == Lookup(True, None, START)
