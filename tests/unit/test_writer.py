"""The writer without gRPC: group commit, isolation of refusals, executors."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fencepost_server.clock import ManualClock
from fencepost_server.core import codec
from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.storage import SqliteStorage
from fencepost_server.writer import Writer


@dataclass(frozen=True)
class Bump:
    key: str
    refuse: bool = False
    request_id: str = ""


@dataclass(frozen=True)
class Bumped:
    key: str
    value: int


codec.register(
    "test.bumped", Bumped, lambda b: {"k": b.key, "v": b.value}, lambda d: Bumped(d["k"], d["v"])
)


def bump(db: sqlite3.Connection, cmd: Bump, now: int) -> Bumped:
    db.execute("CREATE TABLE IF NOT EXISTS counters (k TEXT PRIMARY KEY, v INTEGER)")
    db.execute(
        "INSERT INTO counters VALUES (?, 1) ON CONFLICT (k) DO UPDATE SET v = v + 1", (cmd.key,)
    )
    if cmd.refuse:  # refused after writing: the savepoint must undo it
        raise LedgerError(Code.INVALID_RUN_STATE, "refused")
    (v,) = db.execute("SELECT v FROM counters WHERE k = ?", (cmd.key,)).fetchone()
    return Bumped(cmd.key, v)


@pytest.fixture
async def writer(tmp_path: Path) -> Any:
    w = Writer(SqliteStorage(tmp_path / "w.db"), ManualClock())
    w.register(Bump, bump)
    await w.start()
    yield w
    await w.close()


async def test_a_batch_commits_many_commands_at_once(writer: Writer) -> None:
    results = await asyncio.gather(*(writer.submit(L.Acquire(f"r{i}", "w")) for i in range(300)))
    assert [r.fencing_token for r in results] == [1] * 300  # type: ignore[union-attr]
    assert sorted(r.revision for r in results) == list(range(1, 301))  # type: ignore[union-attr]
    assert writer.stats.commands == 300 and writer.stats.batches < 300
    assert writer.stats.max_batch > 1


async def test_refusals_do_not_disturb_neighbours(writer: Writer) -> None:
    await writer.submit(L.Acquire("held", "a"))
    out = await asyncio.gather(
        writer.submit(L.Acquire("x", "w")),
        writer.submit(L.Acquire("held", "b")),  # refused: RUN_LEASE_HELD
        writer.submit(L.Acquire("y", "w")),
        return_exceptions=True,
    )
    assert isinstance(out[1], LedgerError) and out[1].code is Code.RUN_LEASE_HELD
    assert {"x", "y", "held"} <= set(writer.state.runs)


async def test_executor_refusal_rolls_back_only_its_own_writes(writer: Writer) -> None:
    out = await asyncio.gather(
        writer.submit(Bump("k")),  # type: ignore[arg-type]
        writer.submit(Bump("k", refuse=True)),  # type: ignore[arg-type]
        writer.submit(Bump("k")),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    assert out[0] == Bumped("k", 1)
    assert isinstance(out[1], LedgerError) and out[1].code is Code.INVALID_RUN_STATE
    assert out[2] == Bumped("k", 2)


async def test_executor_answers_are_replayed_for_request_ids(tmp_path: Path) -> None:
    clock = ManualClock()
    for attempt in range(2):  # the second time after a restart
        w = Writer(SqliteStorage(tmp_path / "w.db"), clock)
        w.register(Bump, bump)
        await w.start()
        first = await w.submit(Bump("k", request_id="once"))  # type: ignore[arg-type]
        assert first == Bumped("k", 1)
        again = await w.submit(Bump("k"))  # type: ignore[arg-type]
        assert again == Bumped("k", 2 + attempt)
        await w.close()


async def test_commit_failure_fails_the_batch_and_moves_nothing(writer: Writer) -> None:
    await writer.submit(L.Acquire("a", "w"))
    rev = writer.state.revision
    loop = asyncio.get_running_loop()
    db = writer.storage.db
    pages = await loop.run_in_executor(
        writer._executor, lambda: db.execute("PRAGMA page_count").fetchone()[0]
    )
    await loop.run_in_executor(
        writer._executor, lambda: db.execute(f"PRAGMA max_page_count={pages}")
    )
    with pytest.raises(LedgerError) as ei:
        await asyncio.gather(
            *(writer.submit(L.Acquire("x" * 400 + str(i), "w")) for i in range(100))
        )
    assert ei.value.code is Code.STORAGE_FULL
    assert writer.state.revision == rev and set(writer.state.runs) == {"a"}


async def test_a_cancelled_caller_abandons_its_reply_not_its_write(writer: Writer) -> None:
    task = asyncio.create_task(writer.submit(L.Acquire("c", "w")))
    await asyncio.sleep(0)  # the command is queued
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await writer.wait_idle()
    assert writer.state.runs["c"].lease is not None  # committed all the same
    assert writer.state.runs["c"].lease.owner == "w"  # type: ignore[union-attr]
