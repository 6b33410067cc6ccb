"""A committed read the database cannot answer leaves its reader as
STORAGE_UNAVAILABLE (the wire's UNAVAILABLE, retryable), naming the cause:
the servicers that call the readers know no SQL driver's errors.

The database here is a path where no file is: opening it read-only fails in
SQLite itself, as a read does while PostgreSQL restarts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.storage.engine_sql import EngineReader
from fencepost_server.storage.sqlite import SqliteStorage
from fencepost_server.writer import History, LedgerState, Reads

CAUSE = "the database could not answer; nothing changed: unable to open database file"


async def _refusal(read: Any) -> LedgerError:
    with pytest.raises(LedgerError) as got:
        if isinstance(read, AsyncIterator):
            async for _ in read:
                pass
        else:
            await read
    return got.value


async def test_every_reader_refuses_with_storage_unavailable(tmp_path: Path) -> None:
    storage = SqliteStorage(tmp_path / "absent" / "f.db")
    history = History(storage.reader)
    engine = EngineReader(storage.reader)
    reads = Reads(storage, LedgerState)
    try:
        refusals = [
            await _refusal(history.read(1, 10, 100)),
            await _refusal(history.run_history("r", 10)),
            await _refusal(engine.get_run("r")),
            await _refusal(engine.list_runs(lambda items, total: items, agent=None, statuses=(),
                                            concurrency_key=None, limit=None, offset=0)),
            await _refusal(reads.finished_before(0, 10)),
        ]
    finally:
        await history.close()
        engine.close()
        await reads.close()
    assert [(e.code, e.message) for e in refusals] == [(Code.STORAGE_UNAVAILABLE, CAUSE)] * 5
