"""A coordinator on a SQLite file never loads psycopg (the PostgreSQL driver
and its libpq): it would cost about 11 MiB of memory and a fifth of a second
of every start for a store the server does not use. Checked in a fresh
interpreter, through a whole lifecycle and the dashboard, since the test
process itself has long imported psycopg."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import psycopg

from fencepost_server.storage.sql import read_errors

SCRIPT = """
import asyncio, sys, urllib.request
import fencepost
from fencepost_server.testing.server import ServerThread

async def lifecycle(address):
    async with fencepost.Client(address, owner="w") as client:
        lease = await client.acquire("r1", ttl_ms=30_000)
        await lease.renew()
        await lease.record_checkpoint("k", 1)
        await lease.finish("completed")
        assert (await client.get("r1")).status.value == "completed"

with ServerThread(sys.argv[1]) as srv:
    asyncio.run(lifecycle(srv.address))
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.app.http_port}/metrics", timeout=10) as r:
        assert r.status == 200
print("psycopg" in sys.modules)
"""


def test_a_server_on_sqlite_never_imports_psycopg(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "f.db")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout


def test_psycopg_errors_count_as_read_errors_once_loaded() -> None:
    """A read PostgreSQL could not answer is STORAGE_UNAVAILABLE (retryable),
    as a SQLite one is; the tuple is built when the error is caught."""
    assert issubclass(psycopg.OperationalError, read_errors())
    assert issubclass(sqlite3.OperationalError, read_errors())
    assert not issubclass(ValueError, read_errors())
