"""A throwaway PostgreSQL server on 127.0.0.1, for tests, torture runs and
benchmarks of the PostgreSQL store (and of PostgreSQL itself).

    with Cluster.start() as pg:               # initdb (once per process) + postgres
        url = pg.create_database("t1")        # postgresql://postgres@127.0.0.1:PORT/t1
        pg.kill(); pg.restart()               # crash and recover: commits survive
        pg.pause(); pg.resume()               # SIGSTOP / SIGCONT the whole server
        pg.terminate_connections("t1", "fencepost%")  # cut matching sessions

The binaries are Debian's (``/usr/lib/postgresql/N/bin``, the newest N;
``make postgres`` installs them), else ``postgres``/``initdb`` on PATH. The
data directory is a copy of one ``initdb`` per process (trust authentication
on 127.0.0.1 only, UTF8, C locale), so starting a cluster costs a copy and a
boot. The server runs with ``fsync=on``, ``synchronous_commit=on`` and
``full_page_writes=on``: an acknowledged commit survives a SIGKILL (and a
power cut). As root it runs as the ``postgres`` OS user (created when
missing), since PostgreSQL refuses to run as root.

Every server started here is stopped here, by pid (the postmaster and its
children): on
``stop()``/``close()``, on leaving the ``with`` block, at interpreter exit,
and (when started from the main thread, via ``setpriv --pdeathsig``) even if
this process is SIGKILLed.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg import sql

from .ports import free_port

HOST = "127.0.0.1"
DEFAULT_ROLE = "postgres"
OS_USER = "postgres"  # who the server runs as when we are root
APP_NAME = "fencepost-pgcluster"  # application_name of this module's own sessions

# Durable, and roomy enough for a test session's coordinators and their pools.
SETTINGS: dict[str, str] = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "max_connections": "200",
    "logging_collector": "off",
}


class ClusterError(RuntimeError):
    """A throwaway cluster could not be set up, started or stopped; the
    message names the step and ends with the relevant log lines."""


# -- binaries and the OS user ------------------------------------------------------------


def _version_key(path: str) -> int:
    part = Path(path).parts[-3]  # /usr/lib/postgresql/<N>/bin/<name>
    return int(part) if part.isdigit() else 0


def find_binary(name: str) -> str | None:
    """``name`` (postgres, initdb, ...) from the newest Debian PostgreSQL, or PATH."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version_key)
    return found[-1] if found else shutil.which(name)


def _binary(name: str) -> str:
    path = find_binary(name)
    if path is None:
        raise ClusterError(
            f"PostgreSQL's {name!r} was not found under /usr/lib/postgresql/*/bin or on "
            "PATH: install Debian's postgresql package (`make postgres` does)"
        )
    return path


def available() -> bool:
    """Whether a throwaway cluster can be started here (the binaries are there)."""
    return find_binary("postgres") is not None and find_binary("initdb") is not None


def os_user() -> str | None:
    """The OS user the server runs as: None (ourselves) unless we are root, then
    ``postgres``, created as a system user when missing."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        try:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 OS_USER],
                check=True, capture_output=True, text=True, timeout=60,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            raise ClusterError(
                f"PostgreSQL refuses to run as root and the OS user {OS_USER!r} is missing; "
                f"creating it with useradd failed: {detail}"
            ) from exc
    return OS_USER


def _ids(user: str | None) -> tuple[int, int]:
    if user is None:
        return os.geteuid(), os.getegid()
    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


def _as_user(argv: list[str], user: str | None, *, die_with_us: bool = False
             ) -> tuple[list[str], dict[str, Any]]:
    """``argv`` to run as ``user`` (None: ourselves), and the Popen arguments for it.

    The identity change goes through ``setpriv`` so that Popen need not change
    it: that keeps subprocess on vfork(), where a plain fork() of a process
    running gRPC now and then aborts the child before exec (gRPC's fork
    handlers). ``die_with_us``: SIGKILL the child when this thread ends, e.g.
    when this process is SIGKILLed.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:  # util-linux is essential on Debian; elsewhere: fork() it is
        if user is None:
            return argv, {}
        uid, gid = _ids(user)
        return argv, {"user": uid, "group": gid, "extra_groups": []}
    prefix = [setpriv]
    if user is not None:
        uid, gid = _ids(user)
        prefix += [f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    if die_with_us:
        prefix += ["--pdeathsig", "KILL"]
    return ([*prefix, "--", *argv] if len(prefix) > 1 else argv), {}


def _give(path: Path, user: str | None) -> None:
    if user is not None:
        uid, gid = _ids(user)
        os.chown(path, uid, gid)


def _check_reachable(path: Path, user: str | None) -> None:
    """The server's OS user must be able to traverse every directory above its own."""
    if user is None:
        return
    uid, gid = _ids(user)
    for d in [path, *path.parents]:
        st = d.stat()
        if st.st_uid == uid:
            ok = bool(st.st_mode & 0o100)
        elif st.st_gid == gid:
            ok = bool(st.st_mode & 0o010)
        else:
            ok = bool(st.st_mode & 0o001)
        if not ok:
            raise ClusterError(
                f"PostgreSQL runs as the OS user {user!r}, which cannot enter {d} "
                f"(mode {st.st_mode & 0o777:o}): give Cluster.start a directory it can reach, "
                "or none (a private temporary directory)"
            )


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# -- the initdb template (once per process and role) ------------------------------------

_templates: dict[str, Path] = {}
_template_lock = threading.Lock()


def _private_dir(prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix))
    d.chmod(0o755)  # the server's OS user walks through it to its own subdirectory
    return d


def _template(role: str) -> Path:
    """A data directory made by initdb, copied by every cluster of this process."""
    with _template_lock:
        if role in _templates and _templates[role].is_dir():
            return _templates[role]
        user = os_user()
        root = _private_dir("fencepost-pg-template-")
        atexit.register(shutil.rmtree, root, True)
        data = root / "data"
        data.mkdir(mode=0o700)
        _give(data, user)
        log = root / "initdb.log"
        argv = [_binary("initdb"), "-D", str(data), "-U", role, "-A", "trust", "-E", "UTF8",
                "--no-locale", "--no-instructions", "--no-sync"]
        argv, identity = _as_user(argv, user)
        try:
            with open(log, "wb") as out:
                rc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd="/", timeout=300,
                                    **identity).returncode
        except (OSError, subprocess.SubprocessError) as exc:
            raise ClusterError(f"initdb could not run ({exc}):\n{_tail(log)}") from exc
        if rc != 0:
            raise ClusterError(f"initdb -D {data} failed with exit code {rc}:\n{_tail(log)}")
        _templates[role] = data
        return data


# -- a running cluster -------------------------------------------------------------------

_live: set[Cluster] = set()
_live_lock = threading.Lock()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process from /proc, None if there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (PostgreSQL's backends and workers:
    each is a session leader of its own, so no process group holds them all)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] == pid and st[0] != "Z":
                out.append(int(entry))
    return out


def _signal(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _all_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if (st := _stat(p)) is not None and st[0] != "Z"]
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


class Cluster:
    """One PostgreSQL server (postmaster and its backends) in a directory of its own.

    ``Cluster.start(workdir)`` makes it and waits until it accepts connections.
    ``workdir`` (created if missing) holds ``data/``, ``sock/`` and ``postgres.log``;
    without one a private temporary directory is used and removed by ``close()``.
    """

    def __init__(self, workdir: Path, *, role: str, settings: dict[str, str],
                 owns_workdir: bool, ready_timeout: float) -> None:
        self.workdir = workdir
        self.role = role
        self.data_dir = workdir / "data"
        self.socket_dir = workdir / "sock"
        self.log_path = workdir / "postgres.log"
        self.host = HOST
        self.port = 0
        self.ready_timeout = ready_timeout
        self._settings = settings
        self._owns_workdir = owns_workdir
        self._user = os_user()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._paused = False
        self._closed = False

    # -- life cycle ----------------------------------------------------------------------

    @classmethod
    def start(cls, workdir: str | Path | None = None, *, role: str = DEFAULT_ROLE,
              settings: dict[str, str] | None = None, ready_timeout: float = 60.0) -> Cluster:
        """A fresh cluster, running. ``role`` is its superuser (trust authentication);
        ``settings`` are extra or overriding ``-c name=value`` server settings."""
        owns = workdir is None
        wd = _private_dir("fencepost-pg-") if workdir is None else Path(workdir).resolve()
        wd.mkdir(parents=True, exist_ok=True)
        cluster = cls(wd, role=role, settings={**SETTINGS, **(settings or {})},
                      owns_workdir=owns, ready_timeout=ready_timeout)
        try:
            _check_reachable(wd, cluster._user)
            if cluster.data_dir.exists():
                raise ClusterError(f"{cluster.data_dir} already exists: give each cluster "
                                   "an empty directory")
            template = _template(role)
            subprocess.run(["cp", "-a", str(template), str(cluster.data_dir)], check=True,
                           capture_output=True, timeout=120)
            cluster.socket_dir.mkdir(mode=0o700)
            _give(cluster.socket_dir, cluster._user)
            with _live_lock:
                _live.add(cluster)
            for attempt in range(5):
                cluster.port = free_port(HOST)
                try:
                    cluster._launch()
                    break
                except ClusterError:
                    # another process took the free port before the server bound it
                    if attempt == 4 or not cluster._bind_failed():
                        raise
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _launch(self) -> None:
        argv = [_binary("postgres"), "-D", str(self.data_dir),
                "-c", f"listen_addresses={HOST}", "-p", str(self.port),
                "-c", f"unix_socket_directories={self.socket_dir}"]
        for name, value in self._settings.items():
            argv += ["-c", f"{name}={value}"]
        # dies with this process even if it is SIGKILLed (the parent is this thread)
        argv, identity = _as_user(
            argv, self._user, die_with_us=threading.current_thread() is threading.main_thread())
        self._log_mark = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                cwd="/", start_new_session=True, **identity)
        except OSError as exc:
            self._log.close()
            raise ClusterError(f"could not run {argv[0]}: {exc}") from exc
        self._paused = False
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._reap()
                raise ClusterError(f"postgres -D {self.data_dir} exited with code {code} "
                                   f"while starting on port {self.port}:\n{self.log_tail()}")
            try:
                with psycopg.connect(self.url(), connect_timeout=2, autocommit=True,
                                     application_name=APP_NAME) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error as exc:
                last = exc
            time.sleep(0.05)
        self._kill_all()
        raise ClusterError(f"postgres on port {self.port} did not accept connections within "
                           f"{self.ready_timeout:g}s ({last}):\n{self.log_tail()}")

    def _bind_failed(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_mark)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return bool(re.search(r"could not (bind|create listen socket)", text))

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The postmaster's pid, None when not running."""
        return self._proc.pid if self.running and self._proc is not None else None

    def stop(self, timeout: float = 30.0) -> int | None:
        """Fast shutdown (SIGINT: sessions are cut, everything committed stays), then
        SIGKILL to the whole server if it has not exited within ``timeout`` seconds.
        The data directory stays: ``restart()`` brings it back. The postmaster's
        exit code (0: a clean shutdown), None if it was not running."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            if self._paused:
                self.resume()
            try:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill_all()
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend at once (a crash: no shutdown
        checkpoint; ``restart()`` recovers from the WAL)."""
        if self._proc is not None:
            self._kill_all()

    def processes(self) -> list[int]:
        """The postmaster's pid and its children's (backends, workers); [] if stopped."""
        pid = self.pid
        return [] if pid is None else [pid, *_children(pid)]

    def _kill_all(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal([proc.pid], signal.SIGSTOP)  # no new backends from here on
        kids = _children(proc.pid)
        _signal([proc.pid, *kids], signal.SIGKILL)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"postgres pid {proc.pid} survived SIGKILL") from exc
        # a restart may reuse the data directory only once every backend is gone
        if not _all_gone(kids, 10):
            raise ClusterError(f"postgres backends {kids} survived SIGKILL")
        self._reap()

    def _reap(self) -> None:
        self._proc = None
        self._paused = False
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, timeout: float = 30.0) -> None:
        """Stop if running (fast shutdown), then start again on the same data
        directory and port (after ``kill()``: crash recovery first)."""
        if self._closed:
            raise ClusterError("restart() after close(): the data directory is gone")
        self.stop(timeout)
        self._launch()

    def pause(self) -> None:
        """SIGSTOP the postmaster and every backend: connections hang, nothing answers."""
        if self._proc is None or not self.running:
            raise ClusterError("pause(): the cluster is not running")
        _signal([self._proc.pid], signal.SIGSTOP)  # first: it forks no backend while stopped
        _signal(_children(self._proc.pid), signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT what ``pause()`` stopped."""
        if self._proc is not None:
            _signal([*_children(self._proc.pid), self._proc.pid], signal.SIGCONT)
        self._paused = False

    def close(self) -> None:
        """Stop, and remove the working directory if this cluster made it."""
        if self._closed:
            return
        self._closed = True
        try:
            self.stop(timeout=10)
        finally:
            with _live_lock:
                _live.discard(self)
            if self._owns_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "paused" if self._paused else "running" if self.running else "stopped"
        return f"<Cluster {self.host}:{self.port} {state} {self.workdir}>"

    # -- SQL -----------------------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        """``postgresql://ROLE@127.0.0.1:PORT/DBNAME`` (trust: no password)."""
        return f"postgresql://{self.role}@{self.host}:{self.port}/{dbname}"

    def connect(self, dbname: str = "postgres", **kwargs: Any) -> psycopg.Connection[Any]:
        """An autocommit connection as the superuser (the caller closes it)."""
        kwargs.setdefault("connect_timeout", 10)
        kwargs.setdefault("application_name", APP_NAME)
        return psycopg.connect(self.url(dbname), autocommit=True, **kwargs)

    def create_database(self, name: str, template: str = "template0") -> str:
        """CREATE DATABASE ``name`` (a copy of ``template``); its URL."""
        with self.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE ``name`` if it exists, cutting any session still on it."""
        with self.connect() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))

    def sessions(self, dbname: str, application_name_like: str = "%") -> list[tuple[int, str]]:
        """(pid, application_name) of every other session on ``dbname`` whose
        application_name matches the LIKE pattern."""
        with self.connect() as conn:
            return [(int(pid), str(name)) for pid, name in conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity WHERE datname = %s "
                "AND application_name LIKE %s AND pid <> pg_backend_pid() ORDER BY pid",
                (dbname, application_name_like),
            )]

    def terminate_connections(self, dbname: str, application_name_like: str = "%") -> int:
        """pg_terminate_backend every session on ``dbname`` whose application_name
        matches the LIKE pattern (waiting up to 5 s for each to end); how many."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) "
                "FROM pg_stat_activity WHERE datname = %s AND application_name LIKE %s "
                "AND pid <> pg_backend_pid()",
                (dbname, application_name_like),
            ).fetchone()
        return int(row[0]) if row else 0

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)


@atexit.register
def _close_all() -> None:
    with _live_lock:
        clusters = list(_live)
    for c in clusters:
        try:
            c.close()
        except Exception:
            pass
