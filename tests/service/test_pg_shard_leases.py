"""Who leads each shard of a PostgreSQL database (ha/shards.py), on a real
PostgreSQL: the shard rows the schema keeps."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from fencepost_devtools.pgcluster import Cluster
from fencepost_server.storage import postgres

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def url(pg_cluster: Cluster) -> str:
    """The session's PostgreSQL (tests/conftest.py); each test gets its own database."""
    return pg_cluster.create_database(f"sl_{uuid.uuid4().hex[:10]}")


def _migrate(url: str, shards: int | None = None) -> int:
    db = postgres.connect(url, "test-migrate")
    try:
        return postgres.migrate(db, url, shards)
    finally:
        db.close()


def _rows(url: str) -> list[tuple[int, int, str, str, int, int, str]]:
    with psycopg.connect(url) as db:
        return [tuple(r) for r in db.execute(  # type: ignore[misc]
            "SELECT shard, epoch, holder, address, renewed_at, expires_at, process "
            "FROM fencepost.fencepost_shards ORDER BY shard").fetchall()]


@pytest.mark.parametrize("shards", [None, 1, 5, 100])
def test_a_new_database_has_one_unheld_row_per_stored_shard(url: str, shards: int | None) -> None:
    stored = _migrate(url, shards)
    assert stored == (shards or 64)
    assert _rows(url) == [(i, 0, "", "", 0, 0, "") for i in range(stored)]
    assert _migrate(url) == stored  # a later start keeps them as they are
    assert len(_rows(url)) == stored
