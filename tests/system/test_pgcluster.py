"""The throwaway PostgreSQL server the tests, torture runs and benchmarks use
(``fencepost_devtools.pgcluster``): it starts, serves fresh databases, keeps
committed data across a restart and a SIGKILL, freezes and thaws, cuts the
sessions it is told to, names what failed, and leaves nothing running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from fencepost_devtools import pgcluster
from fencepost_devtools.pgcluster import Cluster, ClusterError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def pg() -> Iterator[Cluster]:
    with Cluster.start() as cluster:
        yield cluster


def _alive(pid: int) -> bool:
    """A live (not zombie) process with this pid."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def _gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def _rows(url: str) -> list[int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT a FROM t ORDER BY a")]


def test_a_fresh_cluster_serves_a_fresh_database_with_durable_settings(pg: Cluster) -> None:
    assert pg.running and pg.pid is not None and pg.port > 0
    url = pg.create_database("app")
    assert url == f"postgresql://postgres@127.0.0.1:{pg.port}/app"
    with psycopg.connect(url, autocommit=True) as conn:
        settings = dict(conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('fsync', 'synchronous_commit', 'full_page_writes', 'max_connections', "
            "'listen_addresses', 'server_encoding')").fetchall())
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
                            ).fetchone() == (0,)
        conn.execute("CREATE TABLE t (a int)")
    assert settings == {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
                        "max_connections": "200", "listen_addresses": "127.0.0.1",
                        "server_encoding": "UTF8"}
    if os.geteuid() == 0:  # PostgreSQL refuses root: it runs as the postgres user
        uid = int(Path(f"/proc/{pg.pid}/status").read_text().split("Uid:")[1].split()[0])
        assert uid == pgcluster._ids(pgcluster.OS_USER)[0] != 0
    # a second database is separate; dropping one leaves the other
    other = pg.create_database("other")
    with psycopg.connect(other, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('t')").fetchone() == (None,)
    pg.drop_database("app")
    with pytest.raises(psycopg.OperationalError, match='"app" does not exist'):
        psycopg.connect(url, connect_timeout=5).close()
    pg.drop_database("app")  # already gone: fine


def test_stop_and_close_leave_nothing_running() -> None:
    given = Path(tempfile.mkdtemp(prefix="fencepost-test-pg-"))  # pytest's tmp_path is private
    try:
        given.chmod(0o755)
        workdir = given / "pg"
        with Cluster.start(workdir) as pg:
            procs = pg.processes()
            assert pg.pid is not None and procs[0] == pg.pid
            assert len(set(procs) & set(_children(pg.pid))) >= 3  # its workers
            pg.stop()
            assert not pg.running and pg.pid is None and pg.processes() == []
            assert _gone(procs, 0)
            assert (workdir / "data" / "PG_VERSION").exists()  # stop keeps the data
        assert workdir.exists()  # a directory we were given is left in place
        with Cluster.start() as own:
            made = own.workdir
        assert not made.exists()  # one it made itself is removed
    finally:
        shutil.rmtree(given, ignore_errors=True)


def test_restart_keeps_data_and_port(pg: Cluster) -> None:
    url = pg.create_database("r")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (a int)")
        conn.execute("INSERT INTO t VALUES (1), (2)")
    port, pid = pg.port, pg.pid
    pg.restart()
    assert pg.port == port and pg.pid != pid
    assert _rows(url) == [1, 2]


def test_kill_then_restart_keeps_every_commit_and_nothing_else(pg: Cluster) -> None:
    url = pg.create_database("k")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (a int)")
        for i in range(1, 51):
            conn.execute("INSERT INTO t VALUES (%s)", (i,))  # 50 separate commits
    open_tx = psycopg.connect(url)
    open_tx.execute("INSERT INTO t VALUES (999)")  # never committed
    procs = pg.processes()
    assert len(procs) >= 4  # the postmaster, its workers and our two sessions
    pg.kill()
    assert not pg.running and _gone(procs, 0), "SIGKILL reaches every backend at once"
    open_tx.close()
    pg.restart()  # crash recovery from the WAL
    assert _rows(url) == list(range(1, 51))
    assert "database system was interrupted" in pg.log_tail(200)


def test_pause_freezes_the_server_and_resume_thaws_it(pg: Cluster) -> None:
    url = pg.create_database("p")
    held = psycopg.connect(url, autocommit=True)
    try:
        pg.pause()
        t0 = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(url, connect_timeout=1).close()
        assert time.monotonic() - t0 >= 0.9, "a paused server answers nothing"
        procs = pg.processes()
        assert len(procs) >= 4 and all(_state(p) == "T" for p in procs), \
            "every process of the server (the held session's backend too) is stopped"
        pg.resume()
        assert held.execute("SELECT 1").fetchone() == (1,)  # the session survived
        with psycopg.connect(url, connect_timeout=5) as conn:
            assert conn.execute("SELECT 2").fetchone() == (2,)
        pg.pause()
    finally:
        held.close()
    pg.stop()  # a paused server stops too (it is thawed first)
    assert not pg.running


def test_terminate_connections_cuts_the_matching_sessions_only(pg: Cluster) -> None:
    url = pg.create_database("c")
    other_db = pg.create_database("c2")
    coord = psycopg.connect(url, autocommit=True, application_name="fencepost-coord-1")
    bystander = psycopg.connect(url, autocommit=True, application_name="worker")
    elsewhere = psycopg.connect(other_db, autocommit=True, application_name="fencepost-coord-2")
    try:
        assert sorted(name for _, name in pg.sessions("c")) == ["fencepost-coord-1", "worker"]
        assert [name for _, name in pg.sessions("c", "fencepost-%")] == ["fencepost-coord-1"]
        assert pg.terminate_connections("c", "fencepost-%") == 1
        with pytest.raises(psycopg.OperationalError):
            coord.execute("SELECT 1")
        assert bystander.execute("SELECT 1").fetchone() == (1,)
        assert elsewhere.execute("SELECT 1").fetchone() == (1,)
        assert pg.terminate_connections("c", "fencepost-%") == 0
        # a new session is welcome again at once
        with psycopg.connect(url, application_name="fencepost-coord-1") as again:
            assert again.execute("SELECT 1").fetchone() == (1,)
        assert pg.terminate_connections("c") == 1  # default: every session on it
    finally:
        for conn in (coord, bystander, elsewhere):
            conn.close()


def test_errors_name_what_failed(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"(?s)exited with code 1.*max_connections"):
        Cluster.start(settings={"max_connections": "lots"})
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    if os.geteuid() == 0:
        with pytest.raises(ClusterError, match=f"cannot enter {private}"):
            Cluster.start(private / "pg")


def test_nothing_is_left_running_when_the_owner_dies(tmp_path: Path) -> None:
    """At interpreter exit without close(), and even after a SIGKILL of the
    process that started it, the server goes too; at exit its directories go
    as well (a SIGKILLed owner cannot remove them: the test does, as it gave
    that process a temp directory of its own)."""
    script = textwrap.dedent("""
        import os, signal, sys
        from fencepost_devtools.pgcluster import Cluster
        pg = Cluster.start()
        print(*pg.processes(), flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    for how in ("exit", "kill"):
        # not tmp_path: the server's OS user must be able to walk into it
        scratch = Path(tempfile.mkdtemp(prefix="fencepost-pg-owner-"))
        scratch.chmod(0o755)
        try:
            proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True,
                                  text=True, timeout=60,
                                  env=dict(os.environ, TMPDIR=str(scratch)))
            assert proc.returncode == (-signal.SIGKILL if how == "kill" else 0), proc.stderr
            procs = [int(p) for p in proc.stdout.split()]
            assert len(procs) >= 4, proc.stdout
            assert _gone(procs), f"{how}: postgres {procs} outlived its owner"
            if how == "exit":
                assert not list(scratch.iterdir()), list(scratch.iterdir())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
