"""Shards (docs/SPEC.md §13) on a real server, on SQLite and PostgreSQL: the
count is stored at a database's first start and a later start with another
count is refused before serving."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _db import raw

from fencepost_server.cli.common import EXIT_REFUSED, EXIT_USAGE
from fencepost_server.cli.main import main
from fencepost_server.config import Settings, SettingsError
from fencepost_server.core.shards import DEFAULT_SHARDS
from fencepost_server.storage import postgres, sqlite
from fencepost_server.testing.server import ServerThread


@pytest.fixture
def new_db(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database no server has opened yet (the pool's are already migrated)."""
    if backend == "sqlite":
        yield str(tmp_path / "new.db")
        return
    cluster = request.getfixturevalue("pg_cluster")
    name = f"shards_{uuid.uuid4().hex[:10]}"
    url = cluster.create_database(name)
    try:
        yield url
    finally:
        cluster.drop_database(name)


def stored_shards(location: str) -> int:
    with raw(location) as conn:
        return int(conn.rows("SELECT value FROM meta WHERE key = 'shards'")[0][0])


def started_shards(location: str, **settings: object) -> int:
    with ServerThread(location, **settings) as srv:
        return int(srv.writer.storage.shards)


def test_a_new_database_stores_the_count_it_was_started_with(new_db: str) -> None:
    assert started_shards(new_db, shards=16) == 16
    assert stored_shards(new_db) == 16
    assert started_shards(new_db) == 16  # without --shards: the stored count
    assert started_shards(new_db, shards=16) == 16


def test_a_new_database_started_without_a_count_gets_the_default(new_db: str) -> None:
    assert started_shards(new_db) == DEFAULT_SHARDS == 64
    assert stored_shards(new_db) == 64


def test_a_start_with_another_count_is_refused_naming_both_and_the_flag(new_db: str) -> None:
    started_shards(new_db, shards=16)
    srv = ServerThread(new_db, shards=32)
    try:
        with pytest.raises(RuntimeError) as refused:
            srv.start()
    finally:
        srv.close()
    message = str(refused.value)
    assert "has 16 shards" in message and "--shards 32" in message
    assert "--shards 16" in message and "refusing to start" in message
    assert stored_shards(new_db) == 16
    assert started_shards(new_db) == 16


def test_a_database_of_the_previous_schema_gets_the_default_count(new_db: str) -> None:
    started_shards(new_db)
    is_pg = new_db.startswith("postgresql://")
    previous = (postgres if is_pg else sqlite).SCHEMA_VERSION - 1
    with raw(new_db, write=True) as conn:
        conn.run("DELETE FROM meta WHERE key = 'shards'")
        conn.run(f"UPDATE fencepost_schema SET version = {previous}" if is_pg
                 else f"PRAGMA user_version={previous}")
    # an existing database is never given another count, whatever the flag says
    srv = ServerThread(new_db, shards=16)
    try:
        with pytest.raises(RuntimeError, match="has 64 shards"):
            srv.start()
    finally:
        srv.close()
    assert started_shards(new_db) == 64
    assert stored_shards(new_db) == 64


@pytest.mark.sqlite_only  # the flag and its checks, before any database opens
def test_a_count_out_of_bounds_names_the_flag_or_the_variable(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "never.db")
    for bad in ("0", "4097", "-3"):
        assert main(["serve", "--db", db, "--shards", bad]) == EXIT_USAGE
        assert f"--shards={int(bad)}: must be between 1 and 4096" in capsys.readouterr().err
    assert main(["serve", "--db", db, "--shards", "many"]) == EXIT_USAGE
    assert "--shards" in capsys.readouterr().err
    with pytest.raises(SettingsError, match="FENCEPOST_SHARDS=5000: must be between"):
        Settings.from_env({"FENCEPOST_SHARDS": "5000"})
    with pytest.raises(SettingsError, match="FENCEPOST_SHARDS='x'"):
        Settings.from_env({"FENCEPOST_SHARDS": "x"})
    assert Settings.from_env({"FENCEPOST_SHARDS": "16"}).shards == 16
    assert Settings.from_env({"FENCEPOST_SHARDS": "16"}, shards=8).shards == 8
    assert not Path(db).exists()


@pytest.mark.sqlite_only
def test_fencepost_serve_refuses_another_count_with_exit_1(backend: str, tmp_path: Path) -> None:
    db = str(tmp_path / "f.db")
    started_shards(db, shards=16)
    fencepost_bin = Path(sys.executable).parent / "fencepost"
    done = subprocess.run(
        [str(fencepost_bin), "serve", "--db", db, "--shards", "32", "--listen", "127.0.0.1:0",
         "--http-listen", "off"], capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL)
    assert done.returncode == EXIT_REFUSED, done.stderr
    assert "has 16 shards" in done.stderr and "--shards 32" in done.stderr
    assert stored_shards(db) == 16
