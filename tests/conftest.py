"""Shared fixtures: a real server on a real loopback port over a real SQLite
file or a real PostgreSQL database.

Backends. The ledger, stream, engine-store and SDK suites (``tests/service``,
``tests/engine``, ``tests/sdk``) run on both: a test there whose fixtures
reach ``backend`` (through ``server``, ``db``, ``make_server``, ``databases``
or ``module_databases``) runs as ``test_x[sqlite]`` and ``test_x[postgres]``.
One PostgreSQL cluster serves the whole session (started when the first test
asks for it, from Debian's binaries: ``make postgres``); every test gets empty
databases on it (emptied for reuse after a test: ``PgPool``). A test about the
SQLite file itself (its bytes, pragmas, WAL, locking) is marked
``@pytest.mark.sqlite_only`` and runs as ``[sqlite]`` alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _db import Databases, PgPool

from fencepost.v1 import ledger_pb2_grpc, run_store_pb2_grpc
from fencepost_devtools import pgcluster
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

T0 = 1_700_000_000_000  # the ManualClock's start, ms since the epoch

TESTS = Path(__file__).resolve().parent
BACKENDS = ("sqlite", "postgres")
BOTH_BACKENDS = ("service", "engine", "sdk")  # the suites that run on every backend


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-postgres", action="store_true",
                     help="the SQLite runs only; a test that needs PostgreSQL is skipped "
                          "(make check)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    path = Path(metafunc.definition.path).resolve()
    if not path.is_relative_to(TESTS) or path.relative_to(TESTS).parts[0] not in BOTH_BACKENDS:
        return
    sqlite_only = (metafunc.definition.get_closest_marker("sqlite_only") is not None
                   or metafunc.config.getoption("no_postgres"))
    metafunc.parametrize("backend", ["sqlite"] if sqlite_only else list(BACKENDS),
                         indirect=True, scope="session")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """Where this test's servers keep their data: "sqlite" or "postgres"."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture(scope="session")
def pg_cluster(request: pytest.FixtureRequest) -> Iterator[pgcluster.Cluster]:
    """One throwaway PostgreSQL server for the session (fsync and synchronous
    commit on), started on first use."""
    if request.config.getoption("no_postgres"):
        pytest.skip("needs PostgreSQL (--no-postgres)")
    if not pgcluster.available():
        pytest.fail("PostgreSQL is not installed here: `make postgres` installs Debian's "
                    "postgresql, whose binaries the PostgreSQL tests start")
    with pgcluster.Cluster.start() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def pg_pool(pg_cluster: pgcluster.Cluster) -> PgPool:
    """Empty fencepost databases on the session's cluster, reused (see ``PgPool``)."""
    return PgPool(pg_cluster)


def _pool(backend: str, request: pytest.FixtureRequest) -> PgPool | None:
    return request.getfixturevalue("pg_pool") if backend == "postgres" else None


@pytest.fixture
def databases(backend: str, tmp_path: Path, request: pytest.FixtureRequest
              ) -> Iterator[Databases]:
    """This test's databases on its backend (see ``Databases``)."""
    dbs = Databases(tmp_path, _pool(backend, request))
    yield dbs
    dbs.close()


@pytest.fixture(scope="module")
def module_databases(backend: str, tmp_path_factory: pytest.TempPathFactory,
                     request: pytest.FixtureRequest) -> Iterator[Databases]:
    """Databases for a module's shared servers, on the module's backend."""
    dbs = Databases(tmp_path_factory.mktemp("module"), _pool(backend, request))
    yield dbs
    dbs.close()


@pytest.fixture
def db(databases: Databases) -> str:
    """The test's main database: ``tmp_path/fencepost.db`` or a PostgreSQL URL."""
    return databases.get()


@pytest.fixture
def make_server(databases: Databases) -> Any:
    """``make_server(name="fencepost", clock=None, **settings)``: a ServerThread
    (not started) over the test's database ``name`` on its backend."""
    return databases.server


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def server(databases: Databases, clock: ManualClock) -> Iterator[ServerThread]:
    """An in-process server (own loop thread) driven by a ManualClock."""
    with databases.server(clock=clock) as srv:
        yield srv


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(params=["unary", "stream"])
def ledger(request: pytest.FixtureRequest, channel: grpc.Channel) -> Iterator[Any]:
    """The Ledger stub; with "stream", every command goes over Ledger.Execute
    instead (same messages, same errors), so behaviour tests cover both."""
    if request.param == "unary":
        yield ledger_pb2_grpc.LedgerStub(channel)
        return
    from service._transport import StreamLedger

    stream = StreamLedger(channel)
    yield stream
    stream.close()


@pytest.fixture
def store(channel: grpc.Channel) -> run_store_pb2_grpc.RunStoreStub:
    return run_store_pb2_grpc.RunStoreStub(channel)
