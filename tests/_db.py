"""A test's databases on either backend (``Databases``, behind the fixtures
in tests/conftest.py), and looking into one from a test: a SQLite file
(read-only unless asked) or a PostgreSQL URL. SQL uses ``?`` placeholders on
both (turned into ``%s`` for PostgreSQL)."""

from __future__ import annotations

import itertools
import re
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from fencepost_server import pgcluster
from fencepost_server.clock import Clock
from fencepost_server.harness import ServerThread

# rows that change while nothing happens (the leader's renewals)
VOLATILE_TABLES = ("fencepost_leader",)


def is_postgres(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))


_db_serial = itertools.count(1)


class Databases:
    """The databases one test (or module) gives its servers, on one backend.

    ``get(name)`` is a SQLite file ``name.db`` in ``directory``, or a fresh
    PostgreSQL database on the session's cluster; the same name again is the
    same database. ``server(name, clock, **settings)`` is a ``ServerThread``
    (not started) over ``get(name)``. ``close()`` drops the PostgreSQL ones.
    """

    def __init__(self, directory: Path, cluster: pgcluster.Cluster | None, label: str) -> None:
        self.backend = "sqlite" if cluster is None else "postgres"
        self.directory = directory
        self._cluster = cluster
        self._label = re.sub(r"\W+", "_", label).strip("_")[:40].lower()
        self._made: dict[str, str] = {}

    def get(self, name: str = "fencepost") -> str:
        if name not in self._made:
            if self._cluster is None:
                self._made[name] = str(self.directory / f"{name}.db")
            else:
                self._made[name] = self._cluster.create_database(
                    f"{self._label}_{next(_db_serial)}")
        return self._made[name]

    def server(self, name: str = "fencepost", clock: Clock | None = None,
               **settings: Any) -> ServerThread:
        return ServerThread(self.get(name), clock=clock, **settings)

    def close(self) -> None:
        if self._cluster is not None and self._cluster.running:
            for url in self._made.values():
                self._cluster.drop_database(url.rsplit("/", 1)[1])
        self._made.clear()


class Raw:
    """One connection, autocommit: ``rows(sql, params)``, ``run(sql, params)``."""

    def __init__(self, location: str, write: bool = False) -> None:
        self.postgres = is_postgres(location)
        self._db: Any
        if self.postgres:
            self._db = psycopg.connect(location, autocommit=True, connect_timeout=10,
                                       application_name="fencepost-tests")
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
