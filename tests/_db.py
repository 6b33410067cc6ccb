"""A test's databases on either backend (``Databases``, behind the fixtures
in tests/conftest.py), and looking into one from a test: a SQLite file
(read-only unless asked) or a PostgreSQL URL. SQL uses ``?`` placeholders on
both (turned into ``%s`` for PostgreSQL)."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from fencepost_devtools import pgcluster
from fencepost_server.clock import Clock
from fencepost_server.storage import is_url, postgres
from fencepost_server.storage.postgres import SCHEMA
from fencepost_server.testing.server import ServerThread
from fencepost_server.writer import Writer

# rows that change while nothing happens (the leader's renewals)
VOLATILE_TABLES = ("fencepost_leader",)


class PgPool:
    """Empty fencepost databases on the session's cluster, reused.

    ``take()`` is a database no server uses: a new one (CREATE DATABASE; its
    first server migrates it from nothing) or one given back. ``give_back()``
    empties it in one transaction: TRUNCATE every fencepost table, then the
    rows a fresh migration writes (the schema version, the revision counter,
    the vacant leader row). That takes a few ms where a new database and its
    migration take a few hundred. A database still in use (a server the test
    left running) or whose tables differ from a fresh migration's is dropped
    instead.
    """

    def __init__(self, cluster: pgcluster.Cluster) -> None:
        self.cluster = cluster
        self._free: list[str] = []
        self._serial = itertools.count(1)
        self._fresh: dict[str, list[tuple[Any, ...]]] | None = None  # table -> rows

    def take(self) -> str:
        if self._free:
            return self.cluster.url(self._free.pop())
        return self.cluster.create_database(f"fp_{next(self._serial)}")

    def _fresh_tables(self) -> dict[str, list[tuple[Any, ...]]]:
        if self._fresh is None:
            url = self.cluster.create_database("fp_fresh")
            try:
                db = postgres.connect(url, "fencepost-tests")
                try:
                    postgres.migrate(db, url)
                finally:
                    db.close()
                with raw(url) as conn:
                    self._fresh = {t: conn.rows(f"SELECT * FROM {t}") for t in conn.tables()}
            finally:
                self.cluster.drop_database("fp_fresh")
        return self._fresh

    def _sessions_left(self, name: str, wait_s: float = 2.0) -> list[tuple[int, str]]:
        """The sessions still on ``name`` once those closing have had time to go
        (a backend outlives its client's close by a moment)."""
        deadline = time.monotonic() + wait_s
        while (left := self.cluster.sessions(name)) and time.monotonic() < deadline:
            time.sleep(0.02)
        return left

    def give_back(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        fresh = self._fresh_tables()
        left = self._sessions_left(name)
        if left:
            # a server the test left running: it would reconnect to the next test's
            # database (and run for its leadership), so this one is not reused
            warnings.warn(f"sessions still on {name} after the test: {left}", stacklevel=1)
            self.cluster.drop_database(name)
            return
        with raw(url) as conn:
            tables = conn.tables()
            if tables and tables != sorted(fresh):
                conn.close()
                self.cluster.drop_database(name)  # not what a migration makes: start over
                return
            if tables:
                conn.reset(fresh)
        self._free.append(name)


class Databases:
    """The databases one test (or module) gives its servers, on one backend.

    ``get(name)`` is a SQLite file ``name.db`` in ``directory``, or an empty
    PostgreSQL database from the session's pool; the same name again is the
    same database. ``server(name, clock, **settings)`` is a ``ServerThread``
    (not started) over ``get(name)``. ``close()`` gives the PostgreSQL ones back.
    """

    def __init__(self, directory: Path, pool: PgPool | None) -> None:
        self.backend = "sqlite" if pool is None else "postgres"
        self.directory = directory
        self._pool = pool
        self._made: dict[str, str] = {}

    def get(self, name: str = "fencepost") -> str:
        if name not in self._made:
            self._made[name] = (str(self.directory / f"{name}.db") if self._pool is None
                                else self._pool.take())
        return self._made[name]

    def server(self, name: str = "fencepost", clock: Clock | None = None,
               **settings: Any) -> ServerThread:
        return ServerThread(self.get(name), clock=clock, **settings)

    def close(self) -> None:
        if self._pool is not None and self._pool.cluster.running:
            for url in self._made.values():
                self._pool.give_back(url)
        self._made.clear()


class Raw:
    """One connection, autocommit: ``rows(sql, params)``, ``run(sql, params)``."""

    def __init__(self, location: str, write: bool = False) -> None:
        self.postgres = is_url(location)
        self._db: Any
        if self.postgres:
            self._db = psycopg.connect(location, autocommit=True, connect_timeout=10,
                                       application_name="fencepost-tests",
                                       options=f"-c search_path={SCHEMA}")
        elif write:
            self._db = sqlite3.connect(location, isolation_level=None)
        else:
            self._db = sqlite3.connect(f"file:{location}?mode=ro", uri=True)

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.postgres else sql

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self._db.execute(self._sql(sql), params).fetchall()]

    def run(self, sql: str, params: Sequence[Any] = ()) -> None:
        self._db.execute(self._sql(sql), params)

    def tables(self) -> list[str]:
        if self.postgres:
            sql = ("SELECT table_name FROM information_schema.tables "
                   "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'")
        else:
            sql = "SELECT name FROM sqlite_master WHERE type = 'table'"
        return sorted(r[0] for r in self.rows(sql))

    def reset(self, contents: dict[str, list[tuple[Any, ...]]]) -> None:
        """PostgreSQL: every table emptied and given ``contents``, atomically."""
        with self._db.transaction(), self._db.cursor() as cur:
            cur.execute(f"TRUNCATE {', '.join(contents)}")
            for table, rows in contents.items():
                if rows:
                    marks = ", ".join(["%s"] * len(rows[0]))
                    cur.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)

    def close(self) -> None:
        self._db.close()


@contextmanager
def raw(location: str, write: bool = False) -> Iterator[Raw]:
    db = Raw(location, write)
    try:
        yield db
    finally:
        db.close()


def snapshot(location: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every stored row, by table (the leader's renewals left out)."""
    with raw(location) as db:
        return {t: sorted(db.rows(f"SELECT * FROM {t}"), key=repr)
                for t in db.tables() if t not in VOLATILE_TABLES}


def count_rows(location: str, tables: Sequence[str]) -> dict[str, int]:
    with raw(location) as db:
        return {t: int(db.rows(f"SELECT count(*) FROM {t}")[0][0]) for t in tables}


async def crash_writer(w: Writer) -> None:
    """What kill -9 leaves of a writer in this process: nothing flushed,
    nothing closed cleanly (the file lock released so the next writer may
    open it)."""
    assert w._task is not None and w._flush_timer is not None
    w._task.cancel()
    w._flush_timer.cancel()
    for task in (w._task, w._flush_timer):
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError(f"{task!r} ended before it was cancelled")
    await asyncio.get_running_loop().run_in_executor(w._executor, w.storage.close)
    w._executor.shutdown()
