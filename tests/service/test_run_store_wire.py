"""The raw seam (docs/SPEC.md §7) on the wire."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from _records import bump, raw_run
from _wire import expect

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb
from fencepost.v1 import run_store_pb2_grpc

OK = grpc.StatusCode


def test_describe(store, backend: str) -> None:  # type: ignore[no-untyped-def]
    d = store.Describe(spb.DescribeRequest())
    name = {"sqlite": "sqlite", "postgres": "postgresql"}[backend]
    assert d.atomicity == spb.ATOMICITY_CROSS_PROCESS and d.backend == name and d.schema == 1


def test_create_once_and_get(store) -> None:  # type: ignore[no-untyped-def]
    assert store.Get(spb.GetRequest(run_id="s1")).found is False
    first = store.Create(spb.CreateRequest(run=raw_run()))
    assert first.created and first.run.revision > 0
    loser = store.Create(spb.CreateRequest(run=raw_run(token=9)))
    assert not loser.created and loser.run.fencing_token == 1  # the stored one
    got = store.Get(spb.GetRequest(run_id="s1"))
    assert got.found and got.run == first.run


def test_create_race_has_exactly_one_winner(server) -> None:  # type: ignore[no-untyped-def]
    def create(i: int) -> bool:
        with grpc.insecure_channel(server.address) as ch:
            stub = run_store_pb2_grpc.RunStoreStub(ch)
            return stub.Create(spb.CreateRequest(run=raw_run("race", token=i + 1))).created

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(create, range(16)))
    assert results.count(True) == 1


def test_create_rejects_other_versions(store) -> None:  # type: ignore[no-untyped-def]
    expect(
        store.Create,
        spb.CreateRequest(run=raw_run(version=2)),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="run.version",
    )
    assert not store.Get(spb.GetRequest(run_id="s1")).found


def test_compare_and_set(store) -> None:  # type: ignore[no-untyped-def]
    v1 = store.Create(spb.CreateRequest(run=raw_run())).run
    ok = store.CompareAndSet(
        spb.CompareAndSetRequest(run_id="s1", expected_version=1, next=bump(v1, attempt=2))
    )
    assert ok.swapped and ok.run.version == 2 and ok.run.attempt == 2
    assert ok.run.revision > v1.revision
    for _ in range(2):  # the same stale expectation loses, twice
        stale = store.CompareAndSet(
            spb.CompareAndSetRequest(run_id="s1", expected_version=1, next=bump(v1, attempt=3))
        )
        assert not stale.swapped and stale.run.version == 2 and stale.run.attempt == 2


def test_cas_on_missing_run_creates_nothing(store) -> None:  # type: ignore[no-untyped-def]
    res = store.CompareAndSet(
        spb.CompareAndSetRequest(run_id="ghost", expected_version=1, next=bump(raw_run("ghost")))
    )
    assert not res.swapped and not res.HasField("run")
    assert not store.Get(spb.GetRequest(run_id="ghost")).found


def test_cas_validation(store) -> None:  # type: ignore[no-untyped-def]
    v1 = store.Create(spb.CreateRequest(run=raw_run())).run
    bad = bump(v1)
    bad.version = 3
    expect(
        store.CompareAndSet,
        spb.CompareAndSetRequest(run_id="s1", expected_version=1, next=bad),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="next.version",
    )
    other = bump(v1, run_id="s2")
    expect(
        store.CompareAndSet,
        spb.CompareAndSetRequest(run_id="s1", expected_version=1, next=other),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="next.run_id",
    )
    assert store.Get(spb.GetRequest(run_id="s1")).run == v1


def test_fifty_concurrent_swaps_one_winner(server, store) -> None:  # type: ignore[no-untyped-def]
    v1 = store.Create(spb.CreateRequest(run=raw_run("hot"))).run

    def swap(i: int) -> bool:
        with grpc.insecure_channel(server.address) as ch:
            stub = run_store_pb2_grpc.RunStoreStub(ch)
            nxt = bump(v1, attempt=i + 2)
            return stub.CompareAndSet(
                spb.CompareAndSetRequest(run_id="hot", expected_version=1, next=nxt)
            ).swapped

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(swap, range(50)))
    assert results.count(True) == 1
    final = store.Get(spb.GetRequest(run_id="hot")).run
    assert final.version == 2 and final.attempt == results.index(True) + 2


def test_delete_and_token_memory(store, ledger) -> None:  # type: ignore[no-untyped-def]
    store.Create(spb.CreateRequest(run=raw_run("d", token=7, status=rpb.RUN_STATUS_QUEUED)))
    res = store.Delete(spb.DeleteRequest(run_id="d"))
    assert res.deleted and res.revision > 0
    assert not store.Delete(spb.DeleteRequest(run_id="d")).deleted
    # a raw create may not reuse a deleted token; the ledger continues above it
    expect(
        store.Create,
        spb.CreateRequest(run=raw_run("d", token=7)),
        OK.INVALID_ARGUMENT,
        "RUN_VALIDATION_ERROR",
        field="run.fencing_token",
    )
    run = ledger.Acquire(pb.AcquireRequest(run_id="d", owner="w")).run
    assert run.fencing_token == 8


def test_raw_writes_share_the_revision_sequence(store, ledger) -> None:  # type: ignore[no-untyped-def]
    a = ledger.Acquire(pb.AcquireRequest(run_id="l", owner="w")).run
    b = store.Create(spb.CreateRequest(run=raw_run("s"))).run
    c = ledger.Acquire(pb.AcquireRequest(run_id="l2", owner="w")).run
    assert (a.revision, b.revision, c.revision) == (1, 2, 3)
