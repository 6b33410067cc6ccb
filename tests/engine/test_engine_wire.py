"""EngineStore over a real loopback port with the generated stubs: what the
contract suite does not pin for every backend — byte-exact JSON text, the
exact fields errors name, request ids across a restart, storage that holds
nothing after a failed upload, the start-up sweep, the schema migration and
where reads run."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _db import count_rows, raw
from _stream_store import engine_client
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from fencepost.v1 import engine_store_pb2 as pb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2_grpc
from fencepost.v1 import ledger_pb2 as lpb
from fencepost_server.storage import engine_sql
from fencepost_server.storage.sqlite import MIGRATIONS, SCHEMA_VERSION, open_read_only
from fencepost_server.testing.server import ServerThread

ENGINE_TABLES = (
    "engine_runs",
    "engine_steps",
    "engine_checkpoints",
    "engine_keys",
    "engine_locks",
    "engine_effects",
    "engine_kv",
    "engine_docs",
    "engine_artifacts",
    "engine_chunks",
    "engine_uploads",
)


@pytest.fixture(params=["unary", "stream"])
def es(request: pytest.FixtureRequest, channel: grpc.Channel) -> Iterator[Any]:
    """The EngineStore client; with "stream", its mutations go over
    Ledger.Execute instead (same messages, same errors), so these tests hold
    for both transports."""
    with engine_client(channel, request.param) as client:
        yield client


@pytest.fixture
def es_unary(channel: grpc.Channel) -> engine_store_pb2_grpc.EngineStoreStub:
    """The plain stub, for tests of what stays off the stream (artifacts, reads)."""
    return engine_store_pb2_grpc.EngineStoreStub(channel)


def settle(server: ServerThread) -> None:
    """Wait until background discards ran and the writer is idle."""
    assert server.app is not None and server.app.engine_store is not None
    server.call(server.app.engine_store.drain)
    server.call(server.writer.wait_idle)


def counts(server: ServerThread) -> dict[str, int]:
    return count_rows(server.db_path, ENGINE_TABLES)


def error_of(err: grpc.RpcError) -> tuple[grpc.StatusCode, str, str, str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return err.code(), info.reason, info.domain, info.metadata.get("field", "")  # type: ignore[attr-defined]


def refused(call: Any, *args: Any) -> tuple[grpc.StatusCode, str, str, str]:
    with pytest.raises(grpc.RpcError) as ei:
        call(*args)
    return error_of(ei.value)


def header(art_id: str, size: int, **kw: Any) -> pb.EnginePutArtifactRequest:
    return pb.EnginePutArtifactRequest(
        header=pb.EngineArtifactHeader(id=art_id, run_id="r", size_bytes=size, **kw)
    )


def chunks(data: bytes, size: int = 64 * 1024) -> Iterator[pb.EnginePutArtifactRequest]:
    for i in range(0, len(data), size):
        yield pb.EnginePutArtifactRequest(chunk=data[i : i + size])


# -- JSON text --------------------------------------------------------------------------------


def test_json_text_is_stored_and_returned_byte_for_byte(es: Any) -> None:
    texts = [
        '{ "b" : 1,\n  "a" : [ 1.50 , 2e10 ] }',
        "123456789012345678901234567890.000000000000000000001",
        '"\\u00e9 é \\ud83c\\udf89 🎉"',
        '{"dup": 1, "dup": 2}',
        "  null  ",
        "-0",
    ]
    for i, text in enumerate(texts):
        v = pb.JsonValue(json=text)
        run = es.CreateRun(
            pb.EngineCreateRunRequest(run=pb.EngineRun(id=f"r{i}", agent="a", status="q", input=v))
        ).run
        assert run.input.json == text
        assert es.GetRun(pb.EngineGetRunRequest(id=f"r{i}")).run.input.json == text
        es.KvSet(pb.EngineKvSetRequest(agent="a", key=f"k{i}", value=v))
        assert es.KvGet(pb.EngineKvGetRequest(agent="a", key=f"k{i}")).value.json == text
        es.PutEffect(pb.EnginePutEffectRequest(key=f"e{i}", result=v))
        assert es.GetEffect(pb.EngineGetEffectRequest(key=f"e{i}")).result.json == text


# -- errors ------------------------------------------------------------------------------------


def test_errors_carry_code_reason_domain_and_the_exact_field(es: Any) -> None:
    bad = pb.JsonValue(json="{")
    cases: list[tuple[Any, Any, str]] = [
        (es.CreateRun, pb.EngineCreateRunRequest(), "run"),
        (
            es.CreateRun,
            pb.EngineCreateRunRequest(run=pb.EngineRun(id="r", agent="a", status="q", input=bad)),
            "run.input",
        ),
        (
            es.CreateRun,
            pb.EngineCreateRunRequest(
                run=pb.EngineRun(id="r", agent="a", status="q", claim=pb.EngineRunClaim(owner="w"))
            ),
            "run.claim",
        ),
        (
            es.CreateRun,
            pb.EngineCreateRunRequest(run=pb.EngineRun(id="r", agent="a", status="s" * 65)),
            "run.status",
        ),
        (
            es.UpdateRun,
            pb.EngineUpdateRunRequest(id="r", patch=pb.EngineRunPatch(clear=["x"])),
            "patch.clear[0]",
        ),
        (
            es.UpdateRun,
            pb.EngineUpdateRunRequest(
                id="r", patch=pb.EngineRunPatch(output=pb.JsonValue(json="1"), clear=["output"])
            ),
            "patch.output",
        ),
        (
            es.UpdateRun,
            pb.EngineUpdateRunRequest(id="r", expect_status=["ok", ""]),
            "expect_status[1]",
        ),
        (es.ClaimRun, pb.EngineClaimRunRequest(id="r", owner="w", ttl_ms=-5), "ttl_ms"),
        (
            es.ClaimKey,
            pb.EngineClaimKeyRequest(scope="s" * 1025, key="k", run_id="r", ttl_ms=1),
            "scope",
        ),
        (es.AcquireLock, pb.EngineAcquireLockRequest(key="k", owner="o" * 257, ttl_ms=1), "owner"),
        (
            es.AppendStep,
            pb.EngineAppendStepRequest(step=pb.EngineStep(run_id="r", name="n", seq=3)),
            "step.seq",
        ),
        (
            es.SaveCheckpoint,
            pb.EngineSaveCheckpointRequest(
                checkpoint=pb.EngineCheckpoint(run_id="r", step_index=1)
            ),
            "checkpoint.state",
        ),
        (es.PutEffect, pb.EnginePutEffectRequest(key="k"), "result"),
        (
            es.KvSet,
            pb.EngineKvSetRequest(agent="a", key="k", value=pb.JsonValue(json="NaN")),
            "value",
        ),
        (
            es.DocUpsert,
            pb.EngineDocUpsertRequest(
                agent="a", collection="c", id="d", doc=pb.JsonValue(json="[]")
            ),
            "doc",
        ),
        (
            es.CreateRun,
            pb.EngineCreateRunRequest(
                run=pb.EngineRun(id="r", agent="a", status="q"), request_id="x" * 129
            ),
            "request_id",
        ),
    ]
    for call, req, field in cases:
        got = refused(call, req)
        assert got == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "RUN_VALIDATION_ERROR",
            "fencepost",
            field,
        ), (req, got)
    where = pb.EngineDocListRequest(agent="a", collection="c", where=pb.JsonValue(json='{"a.b":1}'))
    assert refused(lambda: list(es.DocList(where)))[3] == "where.a.b"
    assert (
        refused(lambda: list(es.ListRuns(pb.EngineListRunsRequest(statuses=["x"] * 101))))[3]
        == "statuses"
    )
    assert es.GetRun(pb.EngineGetRunRequest(id="r")).found is False


def test_guard_and_not_found_reasons_on_the_wire(es: Any) -> None:
    es.CreateRun(pb.EngineCreateRunRequest(run=pb.EngineRun(id="r", agent="a", status="queued")))
    got = refused(es.UpdateRun, pb.EngineUpdateRunRequest(id="r", expect_status=["running"]))
    assert got == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "INVALID_RUN_STATE",
        "fencepost",
        "expect_status",
    )
    got = refused(es.UpdateRun, pb.EngineUpdateRunRequest(id="r", expect_owner="w"))
    assert got[:3] == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_RUN_STATE", "fencepost")
    got = refused(es.UpdateRun, pb.EngineUpdateRunRequest(id="nope"))
    assert got == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND", "fencepost", "id")
    got = refused(lambda: list(es.ReadArtifact(pb.EngineReadArtifactRequest(id="nope"))))
    assert got == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND", "fencepost", "id")


def test_undecodable_requests_are_invalid_argument(channel: grpc.Channel) -> None:
    raw = channel.unary_unary(
        "/fencepost.v1.EngineStore/KvGet",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as ei:
        raw(b"\x0a\x02\xff\xfe")  # field 1 (string) holding invalid UTF-8
    assert error_of(ei.value)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR")
    assert error_of(ei.value)[3] == pb.EngineKvGetRequest.DESCRIPTOR.fields_by_number[1].name
    put = channel.stream_unary(
        "/fencepost.v1.EngineStore/PutArtifact",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as ei:
        put(iter([b"\x0a\x03\x0a\x01\xff"]))  # header (1) { id (1): invalid UTF-8 }
    assert error_of(ei.value) == (
        grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR", "fencepost", "header.id"
    )


# -- request ids ---------------------------------------------------------------------------------


def test_request_ids_are_answered_after_a_restart(server: ServerThread, es: Any) -> None:
    claim = pb.EngineClaimKeyRequest(
        scope="s", key="k", run_id="r1", ttl_ms=60_000, request_id="ck-1"
    )
    first = es.ClaimKey(claim)
    assert first.created
    lock = pb.EngineAcquireLockRequest(key="l", owner="a", ttl_ms=60_000, request_id="al-1")
    grant = es.AcquireLock(lock)
    server.restart()
    assert es.ClaimKey(claim) == first
    assert es.AcquireLock(lock) == grant
    claim.request_id = ""
    again = es.ClaimKey(claim)
    assert not again.created and again.run_id == "r1"


# -- artifacts: nothing left behind --------------------------------------------------------------


def test_failed_uploads_leave_no_chunks(server: ServerThread, es_unary: Any) -> None:
    data = b"z" * 300_000
    bad_streams = [
        [header("a1", len(data) + 1), *chunks(data)],  # ends early
        [header("a2", len(data) - 1), *chunks(data)],  # too long
        [header("a3", len(data), sha256="f" * 64), *chunks(data)],  # wrong digest
        [header("a4", len(data)), *chunks(data), header("a4", 1)],  # a second header
        [*chunks(data), header("a5", len(data))],  # bytes before the header
    ]
    for stream in bad_streams:
        with pytest.raises(grpc.RpcError) as ei:
            es_unary.PutArtifact(iter(stream))
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    settle(server)
    assert counts(server)["engine_chunks"] == 0 and counts(server)["engine_uploads"] == 0
    assert counts(server)["engine_artifacts"] == 0


def test_lost_race_and_retries_drop_their_upload(server: ServerThread, es_unary: Any) -> None:
    data = b"a" * 200_000
    first = es_unary.PutArtifact(iter([header("x", len(data), request_id="p1"), *chunks(data)]))
    assert first.created
    settle(server)
    kept = counts(server)["engine_chunks"]
    assert kept == 4
    # a retry (same request id) and a lost race (another upload of the same id)
    again = es_unary.PutArtifact(iter([header("x", len(data), request_id="p1"), *chunks(data)]))
    assert again.created, "the retry is answered with the original answer"
    other = es_unary.PutArtifact(
        iter([header("x", 5), pb.EnginePutArtifactRequest(chunk=b"12345")])
    )
    assert not other.created
    settle(server)
    assert counts(server)["engine_chunks"] == kept and counts(server)["engine_uploads"] == 0


def test_a_cancelled_upload_leaves_nothing(server: ServerThread, es_unary: Any) -> None:
    sent = threading.Event()
    release = threading.Event()

    def stream() -> Iterator[pb.EnginePutArtifactRequest]:
        yield header("c", 10 * 1024 * 1024)
        yield from chunks(b"q" * (3 * 1024 * 1024), 1024 * 1024)
        sent.set()
        release.wait(10)  # hold the stream open until the test cancels it

    fut = es_unary.PutArtifact.future(stream())
    assert sent.wait(10)
    deadline = time.monotonic() + 10
    while counts(server)["engine_chunks"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert counts(server)["engine_chunks"] == 3, "chunks are staged as they arrive"
    fut.cancel()
    release.set()
    deadline = time.monotonic() + 10
    while counts(server)["engine_chunks"] and time.monotonic() < deadline:
        time.sleep(0.02)
    settle(server)
    assert counts(server)["engine_chunks"] == 0 and counts(server)["engine_uploads"] == 0
    assert not es_unary.GetArtifact(pb.EngineGetArtifactRequest(id="c")).found


def test_uploads_a_crash_left_behind_are_swept_at_start(make_server: Any) -> None:
    srv = make_server()
    srv.start()
    with grpc.insecure_channel(srv.address) as ch:
        es = engine_store_pb2_grpc.EngineStoreStub(ch)
        assert es.PutArtifact(iter([header("kept", 3), pb.EnginePutArtifactRequest(chunk=b"abc")]))
    srv.close()
    with raw(srv.db_path, write=True) as db:  # what a kill -9 mid-upload leaves
        db.run("INSERT INTO engine_uploads VALUES ('orphan', 0)")
        for i in range(5):
            db.run("INSERT INTO engine_chunks VALUES ('orphan', ?, 1, ?)", (i, b"\x00"))
    with make_server() as srv2:
        c = counts(srv2)
        assert c["engine_uploads"] == 0 and c["engine_chunks"] == 1
        with grpc.insecure_channel(srv2.address) as ch:
            es = engine_store_pb2_grpc.EngineStoreStub(ch)
            assert (
                b"".join(m.chunk for m in es.ReadArtifact(pb.EngineReadArtifactRequest(id="kept")))
                == b"abc"
            )


# -- artifacts: deleting ----------------------------------------------------------------------


def read_all(es: Any, art_id: str) -> bytes:
    return b"".join(m.chunk for m in es.ReadArtifact(pb.EngineReadArtifactRequest(id=art_id)))


def test_delete_artifact_removes_its_metadata_and_every_chunk(
    server: ServerThread, es_unary: Any
) -> None:
    old, kept = b"o" * 300_000, b"k" * 100_000
    assert es_unary.PutArtifact(iter([header("x", len(old)), *chunks(old)])).created
    assert es_unary.PutArtifact(iter([header("y", len(kept)), *chunks(kept)])).created
    settle(server)
    assert counts(server)["engine_chunks"] == 5 + 2
    delete = pb.EngineDeleteArtifactRequest(id="x")
    assert es_unary.DeleteArtifact(delete).deleted
    assert counts(server)["engine_chunks"] == 2 and counts(server)["engine_artifacts"] == 1
    assert not es_unary.GetArtifact(pb.EngineGetArtifactRequest(id="x")).found
    got = refused(lambda: read_all(es_unary, "x"))
    assert got == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND", "fencepost", "id")
    listed = list(es_unary.ListArtifacts(pb.EngineListArtifactsRequest(run_id="r")))
    assert [a.id for page in listed for a in page.artifacts] == ["y"]
    # idempotent: a second delete and an unknown id change nothing
    assert not es_unary.DeleteArtifact(delete).deleted
    assert not es_unary.DeleteArtifact(pb.EngineDeleteArtifactRequest(id="never")).deleted
    assert read_all(es_unary, "y") == kept
    # the id is free again: a new upload creates a new artifact
    new = b"n" * 70_000
    assert es_unary.PutArtifact(iter([header("x", len(new)), *chunks(new)])).created
    assert read_all(es_unary, "x") == new
    settle(server)
    assert counts(server)["engine_chunks"] == 2 + 2 and counts(server)["engine_uploads"] == 0


def test_delete_artifact_retries_and_bad_input(server: ServerThread, es_unary: Any) -> None:
    assert es_unary.PutArtifact(iter([header("x", 3), pb.EnginePutArtifactRequest(chunk=b"abc")]))
    first = pb.EngineDeleteArtifactRequest(id="x", request_id="d1")
    assert es_unary.DeleteArtifact(first).deleted
    assert es_unary.DeleteArtifact(first).deleted, "a retry gets the original answer"
    reuse = pb.EngineDeleteArtifactRequest(id="other", request_id="d1")
    got = refused(es_unary.DeleteArtifact, reuse)
    assert got == (grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR", "fencepost",
                   "request_id")
    assert es_unary.PutArtifact(iter([header("z", 1), pb.EnginePutArtifactRequest(chunk=b"z")]))
    for bad in (pb.EngineDeleteArtifactRequest(id=""),
                pb.EngineDeleteArtifactRequest(id="z\x00"),
                pb.EngineDeleteArtifactRequest(id="z" * 513)):
        got = refused(es_unary.DeleteArtifact, bad)
        assert got == (grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR", "fencepost",
                       "id"), bad
    fence = pb.Fence(run_id="no-such-run", fencing_token=1)
    got = refused(es_unary.DeleteArtifact, pb.EngineDeleteArtifactRequest(id="z", fence=fence))
    assert got == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND", "fencepost", "fence.run_id")
    assert read_all(es_unary, "z") == b"z"


def test_a_read_that_meets_a_delete_fails_cleanly_and_never_mixes(
    server: ServerThread, es_unary: Any
) -> None:
    """The reader walks the chunks one read at a time; the artifact is deleted
    and stored again under its id with other bytes part way through. No
    receive window to speak of (no BDP probing), so the server cannot have
    read ahead to the end: the read fails with RUN_NOT_FOUND, and what it
    sent before is the old artifact's beginning."""
    size = 4 * 1024 * 1024
    old, new = b"\x01" * size, b"\x02" * size
    assert es_unary.PutArtifact(iter([header("x", size), *chunks(old, 16 * 1024)])).created
    opts = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 * 1024)]
    with grpc.insecure_channel(server.address, options=opts) as ch:
        stub = engine_store_pb2_grpc.EngineStoreStub(ch)
        call = stub.ReadArtifact(pb.EngineReadArtifactRequest(id="x"))
        got = bytearray(next(call).chunk)
        assert es_unary.DeleteArtifact(pb.EngineDeleteArtifactRequest(id="x")).deleted
        assert es_unary.PutArtifact(iter([header("x", size), *chunks(new, 16 * 1024)])).created
        with pytest.raises(grpc.RpcError) as ei:
            for msg in call:
                got += msg.chunk
    assert error_of(ei.value) == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND", "fencepost", "id")
    assert 0 < len(got) < size and bytes(got) == old[: len(got)]
    assert read_all(es_unary, "x") == new


def test_an_upload_of_an_id_deleted_meanwhile_stores_nothing(
    server: ServerThread, es_unary: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload of an existing id keeps none of its bytes; when that artifact
    is deleted before the stream ends, the upload is refused, not committed
    as an artifact without bytes."""
    assert es_unary.PutArtifact(iter([header("x", 3), pb.EnginePutArtifactRequest(chunk=b"abc")]))
    checked = threading.Event()
    real_exists = engine_sql.artifact_exists

    def artifact_exists(db: Any, art_id: str) -> bool:
        found = real_exists(db, art_id)
        checked.set()
        return found

    monkeypatch.setattr(engine_sql, "artifact_exists", artifact_exists)

    def stream() -> Iterator[pb.EnginePutArtifactRequest]:
        yield header("x", 3)
        assert checked.wait(10)
        assert es_unary.DeleteArtifact(pb.EngineDeleteArtifactRequest(id="x")).deleted
        yield pb.EnginePutArtifactRequest(chunk=b"xyz")

    got = refused(es_unary.PutArtifact, stream())
    assert got == (grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR", "fencepost",
                   "header.id")
    assert not es_unary.GetArtifact(pb.EngineGetArtifactRequest(id="x")).found
    settle(server)
    assert counts(server)["engine_chunks"] == 0 and counts(server)["engine_artifacts"] == 0


# -- schema and threads ------------------------------------------------------------------------


@pytest.mark.sqlite_only  # SQLite's own migrations
def test_a_schema_1_database_is_migrated_and_keeps_its_runs(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    for stmt in MIGRATIONS[0]:
        db.execute(stmt)
    db.execute("PRAGMA user_version=1")
    db.close()
    with ServerThread(path) as srv, grpc.insecure_channel(srv.address) as ch:
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        ledger.Acquire(lpb.AcquireRequest(run_id="legacy", owner="w"))
        es = engine_store_pb2_grpc.EngineStoreStub(ch)
        assert es.CreateRun(
            pb.EngineCreateRunRequest(run=pb.EngineRun(id="e", agent="a", status="q"))
        ).created
    ro = open_read_only(path)
    assert ro.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    ro.close()


def test_reads_run_on_reader_threads_not_the_loop_or_the_writer(
    server: ServerThread, es_unary: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    real_get, real_list = engine_sql.get_run, engine_sql.list_runs

    def get_run(db: Any, run_id: str) -> Any:
        seen.append(threading.current_thread().name)
        return real_get(db, run_id)

    def list_runs(db: Any, *a: Any, **kw: Any) -> Any:
        seen.append(threading.current_thread().name)
        return real_list(db, *a, **kw)

    monkeypatch.setattr(engine_sql, "get_run", get_run)
    monkeypatch.setattr(engine_sql, "list_runs", list_runs)
    es_unary.GetRun(pb.EngineGetRunRequest(id="r"))
    list(es_unary.ListRuns(pb.EngineListRunsRequest()))
    assert len(seen) == 2 and all(n.startswith("fencepost-engine-read") for n in seen), seen


def test_big_listings_stream_in_pages_under_the_message_limit(es: Any) -> None:
    fat = pb.JsonValue(json='"' + "x" * 4000 + '"')
    for i in range(700):
        es.CreateRun(
            pb.EngineCreateRunRequest(
                run=pb.EngineRun(id=f"r{i:04d}", agent="a", status="q", input=fat)
            )
        )
    pages = list(es.ListRuns(pb.EngineListRunsRequest()))
    assert len(pages) > 2 and sum(len(p.runs) for p in pages) == 700
    assert all(p.total == 700 for p in pages)
    assert max(p.ByteSize() for p in pages) < 2 * 1024 * 1024
    empty = list(es.ListRuns(pb.EngineListRunsRequest(agent="none")))
    assert len(empty) == 1 and empty[0].total == 0 and not empty[0].runs


@pytest.mark.sqlite_only  # proven by a WAL checkpoint that no reader blocks
def test_a_listing_abandoned_mid_stream_ends_its_read_transaction(
    server: ServerThread, es: Any
) -> None:
    fat = pb.JsonValue(json='"' + "x" * 16_000 + '"')
    for i in range(250):
        es.CreateRun(
            pb.EngineCreateRunRequest(
                run=pb.EngineRun(id=f"r{i:04d}", agent="a", status="q", input=fat)
            )
        )
    call = es.ListRuns(pb.EngineListRunsRequest())
    first = next(call)
    assert 0 < len(first.runs) < 250
    call.cancel()
    reader = server.app._engine_reader  # type: ignore[union-attr]

    async def checkpoint() -> Any:
        w = server.writer

        def truncate() -> Any:
            # the background checkpointer's turn: a checkpoint that meets
            # another one in progress answers busy at once, whatever the readers
            with w.storage._checkpointer._turn:
                return w.storage.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

        return await asyncio.get_running_loop().run_in_executor(w._executor, truncate)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with reader._lock:
            idle = list(reader._idle)
        if idle and not any(c.in_transaction for c in idle):
            break
        time.sleep(0.02)
    assert idle and not any(c.in_transaction for c in idle), "the connection came back"
    busy, _, _ = server.call(checkpoint)
    assert busy == 0, "no read transaction holds the WAL"


def test_health_and_reflection_list_the_engine_store(channel: grpc.Channel) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="fencepost.v1.EngineStore"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    listed = next(iter(stub.ServerReflectionInfo(iter([req]))))
    assert "fencepost.v1.EngineStore" in {s.name for s in listed.list_services_response.service}
