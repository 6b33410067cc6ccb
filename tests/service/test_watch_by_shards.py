"""WatchRuns by shards (docs/SPEC.md §6.2, §13) on one coordinator, which
leads every shard: each shard resumed after its own revision, its first
message saying where each starts, bad cursors refused naming the field,
pruned history refused as compacted; and the SDK's ``WatchCursor`` over it.
Across coordinators that lead shards apart: tests/system/test_lead_shards.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _wire import wire_error

import fencepost
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_server.core.shards import shard_of
from fencepost_server.testing.server import ServerThread

SHARDS = 64


@pytest.fixture
async def ledger(server: ServerThread) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ledger_pb2_grpc.LedgerStub(ch)


async def _acquire(ledger: Any, run_id: str) -> int:
    """The revision of the acquire's change."""
    await ledger.Acquire(pb.AcquireRequest(run_id=run_id, owner="w"))
    return int((await ledger.GetRun(pb.GetRunRequest(run_id=run_id))).revision)


def _cursors(*pairs: tuple[int, int | None]) -> list[pb.ShardCursor]:
    return [pb.ShardCursor(shard=s, after_revision=r) for s, r in pairs]


async def _read(call: Any, n: int) -> list[pb.WatchRunsResponse]:
    async def take() -> list[pb.WatchRunsResponse]:
        return [await call.read() for _ in range(n)]

    return await asyncio.wait_for(take(), 5)


async def test_each_shard_resumes_after_its_own_revision(ledger: Any) -> None:
    runs = [f"by-shard-{i}" for i in range(40)]
    revs = {r: await _acquire(ledger, r) for r in runs}
    one, two = shard_of(runs[0], SHARDS), shard_of(runs[30], SHARDS)
    assert one != two
    mid = revs[runs[20]]
    # shard one from its start, shard two from the middle of the writes
    call = ledger.WatchRuns(pb.WatchRunsRequest(shards=_cursors((one, None), (two, mid))))
    first = await call.read()
    now = max(revs.values())
    assert first.run_id == "" and first.kind == pb.CHANGE_KIND_UNSPECIFIED
    assert {(c.shard, c.after_revision) for c in first.cursors} == {(one, now), (two, mid)}
    want = [(revs[r], r) for r in runs if shard_of(r, SHARDS) == two and revs[r] > mid]
    replayed = await _read(call, len(want))
    assert want and [(m.revision, m.run_id) for m in replayed] == want
    assert {m.shard for m in replayed} == {two}
    # then live, only the shards asked for
    later = [f"later-{i}" for i in range(60)]
    for r in later:
        await _acquire(ledger, r)
    live_want = [r for r in later if shard_of(r, SHARDS) in (one, two)]
    live = await _read(call, len(live_want))
    assert [m.run_id for m in live] == live_want
    assert all(m.shard == shard_of(m.run_id, SHARDS) for m in live)
    call.cancel()


@pytest.mark.parametrize(("request_kw", "field"), [
    ({"shards": _cursors((0, None), (0, 3))}, "shards[1].shard"),
    ({"shards": _cursors((SHARDS, None))}, "shards[0].shard"),
    ({"shards": _cursors((-1, 0))}, "shards[0].shard"),
    ({"shards": _cursors((2, -5))}, "shards[0].after_revision"),
    ({"shards": _cursors((2, None)), "from_revision": 4}, "from_revision"),
])
async def test_a_bad_cursor_is_refused_naming_its_field(
        ledger: Any, request_kw: dict[str, Any], field: str) -> None:
    call = ledger.WatchRuns(pb.WatchRunsRequest(**request_kw))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wire_error(err.value).reason == "RUN_VALIDATION_ERROR"
    assert (err.value.details() or "").startswith(field), err.value.details()
    await _acquire(ledger, "still-serving")  # nothing broke


async def test_a_shard_whose_history_after_its_cursor_was_pruned_is_refused(
        make_server: Any) -> None:
    with make_server(history_revisions=10, prune_every_s=0) as srv:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            revs = {f"p{i}": await _acquire(ledger, f"p{i}") for i in range(40)}
            oldest = min(revs.values())
            shard = shard_of("p0", SHARDS)
            call = ledger.WatchRuns(pb.WatchRunsRequest(shards=_cursors((shard, oldest))))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert wire_error(err.value).reason == "RUN_REVISION_COMPACTED"
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
            # after a revision still retained: replayed
            recent = max(revs.values()) - 3
            ok = ledger.WatchRuns(pb.WatchRunsRequest(shards=_cursors(
                *((s, recent) for s in range(SHARDS)))))
            got = await _read(ok, 4)
            assert [m.revision for m in got[1:]] == [recent + 1, recent + 2, recent + 3]
            ok.cancel()


async def test_the_sdk_resumes_a_watch_from_a_saved_cursor(server: ServerThread) -> None:
    async with fencepost.Client(server.address, owner="w", renewal="off") as client:
        cursor = fencepost.WatchCursor()
        seen: list[fencepost.WatchEvent] = []

        async def watch(until: int, cursor: fencepost.WatchCursor) -> None:
            async for ev in client.watch(cursor=cursor):
                seen.append(ev)
                if len(seen) == until:
                    return

        task = asyncio.create_task(watch(10, cursor))
        for _ in range(500):  # until every shard's stream started
            if len(cursor.revisions) == SHARDS:
                break
            await asyncio.sleep(0.01)
        first = [f"sdk-{i}" for i in range(10)]
        for r in first:
            await client.acquire(r)
        await asyncio.wait_for(task, 10)
        assert [e.run_id for e in seen] == first
        assert all(e.shard == shard_of(e.run_id, SHARDS) for e in seen)
        saved = cursor.encode()
        # written while nobody watched: exactly these, from the saved cursor
        missed = [f"sdk-missed-{i}" for i in range(10)]
        for r in missed:
            lease = await client.acquire(r)
            await lease.finish()
        seen.clear()
        resumed = fencepost.WatchCursor.decode(saved)
        await asyncio.wait_for(watch(20, resumed), 10)
        assert [(e.run_id, e.record.status.value if e.record else None) for e in seen] == [
            (r, s) for r in missed for s in ("running", "completed")]
        assert resumed.revisions[shard_of(missed[-1], SHARDS)] == seen[-1].revision
        with pytest.raises(ValueError, match="from_revision"):
            async for _ in client.watch(from_revision=3, cursor=resumed):
                pass


async def test_a_watch_backs_off_while_its_coordinator_is_gone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A watch by shards whose coordinator went away asks again after a
    growing wait (25 ms, doubling up to 1 s), not every 25 ms, until its
    retry policy gives up with UnavailableError."""
    srv = ServerThread(tmp_path / "gone.db").start()
    try:
        policy = fencepost.RetryPolicy(total_timeout_s=3.0)
        async with fencepost.Client(srv.address, renewal="off", retry=policy) as client:
            cursor = fencepost.WatchCursor()

            async def watch() -> None:
                async for _ in client.watch(cursor=cursor):
                    pass

            task = asyncio.create_task(watch())
            for _ in range(500):  # until every shard's stream started
                if len(cursor.revisions) == SHARDS or task.done():
                    break
                await asyncio.sleep(0.01)
            assert len(cursor.revisions) == SHARDS
            caplog.set_level(logging.INFO, "fencepost.client")
            srv.stop()
            with pytest.raises(fencepost.UnavailableError):
                await asyncio.wait_for(task, 30)
    finally:
        srv.close()
    ended = [r for r in caplog.records if r.getMessage().startswith("watch of shards")]
    # 3 s of 25, 50, 100 ... 1000 ms waits: 9 tries at most (every 25 ms: over 100)
    assert 1 <= len(ended) <= 12, [r.getMessage() for r in ended[:3]]


@pytest.mark.parametrize("text", ["", "fpw2:0=1", "fpw1:0=1,0=2", "fpw1:a=1", "fpw1:1=-2",
                                  "fpw1:01=2", "fpw1:1=2,"])
def test_a_cursor_text_is_checked(text: str) -> None:
    with pytest.raises(ValueError, match=r"^cursor"):
        fencepost.WatchCursor.decode(text)


def test_the_cursor_text_vector() -> None:
    c = fencepost.WatchCursor.decode("fpw1:0=17,3=16777230")
    assert c.revisions == {0: 17, 3: 16777230}
    assert c.encode() == "fpw1:0=17,3=16777230"
    assert fencepost.WatchCursor.decode("fpw1:").revisions == {}
