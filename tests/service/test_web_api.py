"""The dashboard's JSON API and event stream over a real HTTP port: paging,
filters, timelines, actions, bad input, and paging speed at 100 000 runs."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest

import fencepost
from fencepost import SyncClient
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_server.core import ledger as L
from fencepost_server.testing.server import ServerThread


def get(server: ServerThread, path: str) -> Any:
    with urllib.request.urlopen(server.http_url + path, timeout=30) as resp:
        return json.loads(resp.read())


def refused(server: ServerThread, path: str, body: bytes | None = None,
            content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(server.http_url + path, data=body,
                                 headers={"content-type": content_type})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    return e.value.code, json.loads(e.value.read())["error"]


def post(server: ServerThread, path: str, doc: dict[str, Any]) -> Any:
    req = urllib.request.Request(server.http_url + path, data=json.dumps(doc).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture
def seeded(server: ServerThread) -> ServerThread:
    with SyncClient(server.address, owner="w1") as c:
        for i in range(30):
            lease = c.acquire(f"r-{i:02d}")
            if i % 3 == 0:
                lease.finish("failed", "boom")
            elif i % 3 == 1:
                lease.release()
        c.acquire("other-1")
    return server


def ids(doc: dict[str, Any]) -> list[str]:
    return [r["run_id"] for r in doc["runs"]]


def test_paging_forward_and_back_with_filters(seeded: ServerThread) -> None:
    every = [f"r-{i:02d}" for i in range(30)]
    first = get(seeded, "/api/runs?prefix=r-&limit=12")
    assert ids(first) == every[:12] and first["has_next"] and not first["has_prev"]
    second = get(seeded, "/api/runs?prefix=r-&limit=12&after=r-11")
    assert ids(second) == every[12:24] and second["has_prev"] and second["has_next"]
    third = get(seeded, "/api/runs?prefix=r-&limit=12&after=r-23")
    assert ids(third) == every[24:] and not third["has_next"]
    back = get(seeded, "/api/runs?prefix=r-&limit=12&before=r-24")
    assert ids(back) == every[12:24] and back["has_prev"]
    assert ids(get(seeded, "/api/runs?prefix=r-&limit=12&before=r-12")) == every[:12]
    failed = get(seeded, "/api/runs?status=failed")
    assert ids(failed) == [f"r-{i:02d}" for i in range(0, 30, 3)]
    both = get(seeded, "/api/runs?status=failed&status=queued&limit=500")
    assert len(ids(both)) == 20
    owned = get(seeded, "/api/runs?owner=w1")  # only live holders
    assert ids(owned) == [f"r-{i:02d}" for i in range(2, 30, 3)] + ["other-1"] or ids(
        owned) == sorted([f"r-{i:02d}" for i in range(2, 30, 3)] + ["other-1"])
    assert all(r["lease"]["owner"] == "w1" for r in owned["runs"])
    assert get(seeded, "/api/runs?prefix=zzz")["runs"] == []
    doc = get(seeded, "/api/runs?limit=1")
    assert doc["total"] == 31 and doc["revision"] > 0 and doc["now"] > 0


def test_bad_input_names_the_field_and_changes_nothing(seeded: ServerThread) -> None:
    before = seeded.writer.state.revision
    assert refused(seeded, "/api/runs?status=finished") == (400, {
        "code": "RUN_VALIDATION_ERROR", "field": "status",
        "message": refused(seeded, "/api/runs?status=finished")[1]["message"]})
    assert refused(seeded, "/api/runs?limit=0")[1]["field"] == "limit"
    assert refused(seeded, "/api/runs?limit=x")[1]["field"] == "limit"
    code, err = refused(seeded, "/api/runs/nope")
    assert (code, err["code"]) == (404, "RUN_NOT_FOUND")
    code, err = refused(seeded, "/api/cancel", b"run_id=r-02", "application/x-www-form-urlencoded")
    assert (code, err["field"]) == (400, "content-type")
    assert refused(seeded, "/api/cancel", b"{not json")[1]["field"] == "request"
    assert refused(seeded, "/api/cancel", b"[1]")[1]["field"] == "request"
    assert refused(seeded, "/api/cancel", b'{"run_id": 3}')[1]["field"] == "run_id"
    assert refused(seeded, "/api/cancel", b'{"run_id": ""}')[1]["field"] == "run_id"
    assert refused(seeded, "/api/cancel", b'{"run_id": "r-02", "message": 5}')[1][
        "field"] == "message"
    code, err = refused(seeded, "/api/cancel", b'{"run_id": "r-00"}')
    assert (code, err["code"], err["run"]["status"]) == (409, "RUN_ALREADY_TERMINAL", "failed")
    code, err = refused(seeded, "/api/resume", b'{"run_id": "ghost"}')
    assert (code, err["code"]) == (404, "RUN_NOT_FOUND")
    assert seeded.writer.state.revision == before
    with pytest.raises(urllib.error.HTTPError) as e:  # GET on an action
        urllib.request.urlopen(seeded.http_url + "/api/cancel", timeout=10)
    assert e.value.code in (404, 405)


def test_shards_name_each_shards_leader_and_its_counts(seeded: ServerThread) -> None:
    doc = get(seeded, "/api/shards")
    n = doc["shard_count"]
    assert n == 64 and [s["index"] for s in doc["shards"]] == list(range(n))
    assert seeded.app is not None  # every shard is this coordinator's, under its epoch
    assert {(s["owner"], s["address"], s["epoch"]) for s in doc["shards"]} == {
        seeded.app.shard_owner()}
    assert seeded.app.shard_owner()[:2] == (seeded.app.identity, seeded.address)
    assert sum(s["runs"] for s in doc["shards"]) == 31  # every run of the seed, in its shard
    home = doc["shards"][fencepost.shard_of("other-1", n)]
    assert home["leases"] >= 1
    assert sum(s["leases"] for s in doc["shards"]) == 11  # other-1 and the ten still running
    assert doc["revision"] == seeded.writer.state.revision


def test_cancel_and_resume(seeded: ServerThread) -> None:
    doc = post(seeded, "/api/cancel", {"run_id": "r-02", "message": "ops"})
    assert doc["run"]["status"] == "cancelled" and doc["run"]["outcome"]["message"] == "ops"
    with SyncClient(seeded.address) as c:
        c.acquire("s-1").suspend(["a-1"])
    assert post(seeded, "/api/resume", {"run_id": "s-1"})["run"]["status"] == "queued"


def test_timeline_tells_who_did_what(server: ServerThread, channel: grpc.Channel) -> None:
    stub = ledger_pb2_grpc.LedgerStub(channel)
    stub.Acquire(pb.AcquireRequest(run_id="t", owner="alice", lease_ttl_ms=1000))
    for _ in range(3):
        stub.Renew(pb.RenewRequest(run_id="t", owner="alice", fencing_token=1))
    server.clock.advance(5000)
    stub.Acquire(pb.AcquireRequest(run_id="t", owner="bob"))
    stub.Release(pb.ReleaseRequest(run_id="t", owner="bob", fencing_token=2))
    stub.Acquire(pb.AcquireRequest(run_id="t", owner="carol"))
    stub.Cancel(pb.CancelRequest(run_id="t", message="enough"))
    stub.DeleteRun(pb.DeleteRunRequest(run_id="t"))
    doc = get(server, "/api/runs/t")
    assert doc["run"] is None
    got = [(t["event"], t["who"], t["count"]) for t in doc["timeline"]]
    # renewals are answered from memory: no change of the record's history
    assert got == [("acquired", "alice", 1), ("taken over", "bob", 1),
                   ("released", "bob", 1), ("acquired", "carol", 1),
                   ("cancelled", "carol", 1), ("deleted", None, 1)]
    takeover = doc["timeline"][1]
    assert "from alice" in takeover["detail"] and takeover["fencing_token"] == 2
    assert doc["timeline"][4]["detail"] == "enough"


def test_timeline_after_compaction(make_server: Any) -> None:
    with make_server(history_revisions=3, prune_every_s=0) as srv:
        with SyncClient(srv.address, owner="w") as c:
            lease = c.acquire("old")
            for i in range(8):
                lease.record_checkpoint("k", i)
            c.acquire("later").release()  # pruning runs in later batches
        deadline = time.monotonic() + 5
        while True:
            first = get(srv, "/api/runs/old")["timeline"][0]
            if first["event"] == "earlier history compacted" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert first["event"] == "earlier history compacted"


def test_engine_runs(server: ServerThread) -> None:
    with SyncClient(server.address) as c:
        for i in range(5):
            c.store.create_run(f"e-{i}", agent="a" if i % 2 else "b", status="pending")
        assert c.store.claim_run("e-1", "w", 30_000)
    doc = get(server, "/api/engine/runs?limit=2&offset=1")
    assert [r["id"] for r in doc["runs"]] == ["e-1", "e-2"] and doc["total"] == 5
    assert doc["runs"][0]["claim"]["owner"] == "w"
    assert [r["id"] for r in get(server, "/api/engine/runs?agent=a")["runs"]] == ["e-1", "e-3"]
    assert refused(server, "/api/engine/runs?limit=0")[0] == 400


async def _read_events(url: str, want: int, limit_s: float) -> list[tuple[str, Any]]:
    import aiohttp

    events: list[tuple[str, Any]] = []
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        name = ""
        async with asyncio.timeout(limit_s):
            async for raw in resp.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[6:])))
                    if len(events) >= want:
                        return events
    return events


async def test_event_stream_carries_changes_within_a_second(server: ServerThread) -> None:
    reader = asyncio.create_task(_read_events(server.http_url + "/api/events", 2, 10))
    await asyncio.sleep(0.3)  # connected
    async with fencepost.Client(server.address, owner="w") as c:
        t0 = time.monotonic()
        await c.acquire("sse-1")
        events = await reader
    assert events[0][0] == "hello"
    name, doc = events[1]
    assert name == "changes" and time.monotonic() - t0 < 1.0
    (change,) = doc["changes"]
    assert change["run_id"] == "sse-1" and change["run"]["lease"]["owner"] == "w"

    one = asyncio.create_task(_read_events(server.http_url + "/api/events?run=sse-2", 2, 10))
    await asyncio.sleep(0.3)
    async with fencepost.Client(server.address, owner="w") as c:
        await c.acquire("sse-noise")
        await c.acquire("sse-2")
    events = await one
    assert [c["run_id"] for c in events[1][1]["changes"]] == ["sse-2"]


@pytest.mark.slow
@pytest.mark.sqlite_only  # in-memory index paging, the same on both stores
def test_paging_stays_fast_at_100_000_runs(make_server: Any) -> None:
    n = 100_000
    with make_server() as srv:

        async def seed() -> None:  # through the writer, in large batches (no RPC per run)
            w = srv.writer
            for start in range(0, n, 10_000):
                await asyncio.gather(*(w.submit_nowait(L.Acquire(f"job-{i:06d}", "bulk", 600_000))
                                       for i in range(start, start + 10_000)))
            await asyncio.gather(*(w.submit_nowait(L.Release(f"job-{i:06d}", "bulk", 1))
                                   for i in range(0, n, 1000)))  # 100 queued among them

        t0 = time.monotonic()
        srv.call(seed, timeout=120)
        seeded_s = time.monotonic() - t0

        def timed(path: str) -> tuple[float, Any]:
            samples = []
            doc = None
            for _ in range(5):
                t = time.perf_counter()
                doc = get(srv, path)
                samples.append(time.perf_counter() - t)
            return statistics.median(samples), doc

        first_s, first = timed("/api/runs?limit=50")
        middle_s, middle = timed("/api/runs?limit=50&after=job-050000")
        back_s, back = timed("/api/runs?limit=50&before=job-090000")
        prefix_s, pre = timed("/api/runs?limit=50&prefix=job-07")
        rare_s, rare = timed("/api/runs?limit=50&status=queued")  # 100 matches, a full scan
    print(f"\n100k runs seeded in {seeded_s:.1f}s; median page: first {first_s * 1000:.1f} ms, "
          f"middle {middle_s * 1000:.1f} ms, before {back_s * 1000:.1f} ms, "
          f"prefix {prefix_s * 1000:.1f} ms, rare status (scan) {rare_s * 1000:.1f} ms")
    assert first["total"] == n and ids(first)[0] == "job-000000"
    assert ids(middle)[0] == "job-050001" and ids(back)[-1] == "job-089999"
    assert ids(pre)[0] == "job-070000"
    assert len(rare["runs"]) == 50 and all(r["status"] == "queued" for r in rare["runs"])
    for took in (first_s, middle_s, back_s, prefix_s):
        assert took < 0.1, took  # a page costs O(page), not O(runs)
    assert rare_s < 1.0, rare_s
