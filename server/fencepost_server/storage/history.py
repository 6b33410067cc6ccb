"""The retained change history, read on a read-only connection of its own
(WatchRuns replay, the dashboard's run history): never the writer's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ..core.records import Record, record_from_dict
from .sql import _loads, broken


class HistoryReader:
    """Reads the retained change history on its own read-only connection (for
    WatchRuns replay), so replay never runs on the writer's connection; it
    reads committed history while the writer commits."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect  # a storage's ``reader``
        self._db: Any = None

    def _conn(self) -> Any:
        if self._db is not None and broken(self._db):
            self.close()
        if self._db is None:
            self._db = self._connect()
        return self._db

    def read(
        self, from_revision: int, to_revision: int, limit: int = 1000
    ) -> list[tuple[int, str, int, Record | None]]:
        rows = self._conn().execute(
            "SELECT revision, run_id, kind, record FROM changes "
            "WHERE revision >= ? AND revision <= ? ORDER BY revision LIMIT ?",
            (from_revision, to_revision, limit),
        ).fetchall()
        return [
            (rev, run_id, kind, record_from_dict(_loads(text)) if text else None)
            for rev, run_id, kind, text in rows
        ]

    def stored_runs(self, statuses: list[int], owner: str, limit: int, prefix: str,
                    after: str | None, before: str | None) -> list[Record]:
        """Up to ``limit`` records of the runs table (every shard's, where
        coordinators lead shards apart), filtered and paged as ``page_runs``:
        run-id order past ``after``, or backwards below ``before``."""
        sql, args = "SELECT record FROM runs WHERE 1 = 1", list[object]()
        if statuses:
            sql += f" AND status IN ({','.join('?' * len(statuses))})"
            args += statuses
        if owner:
            sql += " AND owner = ?"
            args.append(owner)
        if prefix:
            sql += " AND substr(run_id, 1, ?) = ?"
            args += [len(prefix), prefix]
        if before is not None:
            sql += " AND run_id < ? ORDER BY run_id DESC"
            args.append(before)
        else:
            if after is not None:
                sql += " AND run_id > ?"
                args.append(after)
            sql += " ORDER BY run_id"
        rows = self._conn().execute(sql + " LIMIT ?", (*args, limit)).fetchall()
        return [record_from_dict(_loads(text)) for (text,) in rows]

    def stored_run(self, run_id: str) -> Record | None:
        row = self._conn().execute("SELECT record FROM runs WHERE run_id = ?",
                                   (run_id,)).fetchone()
        return None if row is None else record_from_dict(_loads(row[0]))

    def stored_count(self) -> int:
        return int(self._conn().execute("SELECT count(*) FROM runs").fetchone()[0])

    def pruned_by_shard(self) -> dict[int, int]:
        """Where coordinators lead shards apart (PostgreSQL): per shard, the
        highest revision pruned from its history (absent: none)."""
        return dict(self._conn().execute("SELECT shard, revision FROM changes_pruned").fetchall())

    def run_history(self, run_id: str, limit: int) -> list[tuple[int, int, Record | None]]:
        """The last ``limit`` retained changes of one run, oldest first:
        (revision, kind, record or None)."""
        rows = self._conn().execute(
            "SELECT revision, kind, record FROM changes WHERE run_id = ? "
            "ORDER BY revision DESC LIMIT ?",
            (run_id, limit),
        ).fetchall()
        return [
            (rev, kind, record_from_dict(_loads(text)) if text else None)
            for rev, kind, text in reversed(rows)
        ]

    def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(Exception):
                self._db.close()
            self._db = None
