"""The servers: find (or install) the peers, start each on 127.0.0.1 in a temp
dir with durable settings, measure its CPU, stop it and everything it forked.

Durable settings (every acknowledgement survives power loss):

* fencepost: ``fencepost serve --durability full`` (SQLite WAL, synchronous=FULL);
* etcd: defaults (the WAL is fsynced before a write is acknowledged);
* PostgreSQL: ``fsync=on``, ``synchronous_commit=on`` (the defaults, spelled out);
* Redis: ``appendonly yes``, ``appendfsync always``, no RDB snapshots.

Every process started here is a child of this process, stopped by its pid:
SIGTERM (SIGINT for PostgreSQL: fast shutdown), SIGKILL after a bounded wait,
then any of its descendants still alive, by pid.
"""

from __future__ import annotations

import asyncio
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from benchlib import BIN, HOST, ServerProcess, free_port, start_server

from .semantics import PG_SCHEMA, PG_USER

APT_PACKAGES = {"etcd": "etcd-server", "postgres": "postgresql", "redis": "redis-server"}
PY_MODULES = {"postgres": "asyncpg", "redis": "redis"}


# -- binaries ----------------------------------------------------------------------


def _pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return found[-1] if found else shutil.which(name)


def binaries() -> dict[str, dict[str, str | None]]:
    return {
        "etcd": {"etcd": shutil.which("etcd")},
        "postgres": {"postgres": _pg_bin("postgres"), "initdb": _pg_bin("initdb")},
        "redis": {"redis-server": shutil.which("redis-server")},
    }


def missing_peers() -> list[str]:
    """Peers whose server binary or Python client is not there."""
    out = []
    for peer, bins in binaries().items():
        if any(v is None for v in bins.values()):
            out.append(peer)
            continue
        mod = PY_MODULES.get(peer)
        if mod is not None:
            try:
                __import__(mod)
            except ImportError:
                out.append(peer)
    return out


def install(peers: list[str]) -> None:
    """apt-get the missing peers' server packages (as root), once."""
    need = [APT_PACKAGES[p] for p, bins in binaries().items()
            if p in peers and any(v is None for v in bins.values())]
    if not need:
        return
    if os.geteuid() != 0:
        print(f"note: not root, cannot install {' '.join(need)}; those peers are skipped",
              flush=True)
        return
    print(f"installing {' '.join(need)} (apt-get) ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *need],
                   check=True, env=env, stdout=subprocess.DEVNULL)


def versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for peer, argv in (("etcd", ["etcd", "--version"]),
                       ("postgres", [_pg_bin("postgres") or "postgres", "--version"]),
                       ("redis", ["redis-server", "--version"])):
        try:
            text = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        out[peer] = text.splitlines()[0].strip() if text else "?"
    from importlib import metadata

    for dist in ("grpcio", "protobuf", "asyncpg", "redis", "hiredis"):
        try:
            out[f"py:{dist}"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


# -- CPU of a process tree -------------------------------------------------------------


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of ``pid`` and every descendant, by pid; key -1
    holds the reaped children's total (PostgreSQL backends that exited)."""
    out: dict[int, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        t = root.cpu_times()
        out[-1] = t.children_user + t.children_system
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[p.pid] = t.user + t.system
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


# -- a running backend server ----------------------------------------------------------


@dataclass
class Running:
    backend: str
    address: str
    server: ServerProcess
    stop_signal: int = signal.SIGTERM
    info: dict[str, Any] = field(default_factory=dict)
    metrics_port: int | None = None

    @property
    def pid(self) -> int:
        return self.server.proc.pid

    def stop(self, timeout: float = 15.0) -> int:
        """Stop the server and then any descendant it left behind (by pid)."""
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        proc = self.server.proc
        if proc.poll() is None:
            proc.send_signal(self.stop_signal)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.server.log_file.close()
        _, alive = psutil.wait_procs(kids, timeout=5)
        for k in alive:
            try:
                k.kill()
            except psutil.NoSuchProcess:
                pass
        return proc.returncode


def _wait_log(srv: ServerProcess, pattern: str, timeout: float = 60.0) -> None:
    srv.wait_ready(f"({pattern})", timeout)


def _wait_until(srv: ServerProcess, probe: Callable[[], bool], what: str,
                timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} exited with {srv.proc.returncode}:\n"
                               f"{srv.log_tail()}")
        try:
            if probe():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{srv.name}: {what} not ready after {timeout}s:\n{srv.log_tail()}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def start_fencepost(backend: str, workdir: Path, tag: str) -> Running:
    metrics_port = free_port()
    argv = [
        str(BIN / "fencepost"), "serve",
        "--listen", f"{HOST}:0",
        "--db", str(workdir / f"{backend}-{tag}.db"),
        "--durability", "full",
        "--metrics-port", str(metrics_port),
        "--log-level", "INFO",
    ]
    srv = start_server(backend, argv, workdir / f"{backend}-{tag}.log")
    address = srv.wait_ready(r"fencepost serving on (\S+)")
    return Running(backend, address, srv, metrics_port=metrics_port)


def start_etcd(workdir: Path, tag: str) -> Running:
    client, peer = free_port(), free_port()
    data = workdir / f"etcd-{tag}"
    argv = [
        str(binaries()["etcd"]["etcd"]),
        "--name", "bench", "--data-dir", str(data),
        "--listen-client-urls", f"http://{HOST}:{client}",
        "--advertise-client-urls", f"http://{HOST}:{client}",
        "--listen-peer-urls", f"http://{HOST}:{peer}",
        "--initial-advertise-peer-urls", f"http://{HOST}:{peer}",
        "--initial-cluster", f"bench=http://{HOST}:{peer}",
        "--initial-cluster-state", "new",
        "--logger", "zap", "--log-level", "warn",
    ]
    srv = start_server("etcd", argv, workdir / f"etcd-{tag}.log")
    address = f"{HOST}:{client}"

    def probe() -> bool:
        import grpc

        from .backends import _etcd_proto

        p, services = _etcd_proto()
        with grpc.insecure_channel(address) as ch:
            services.KVStub(ch).Range(p.RangeRequest(key=b"probe"), timeout=2)
        return True

    _wait_until(srv, probe, "etcd Range")
    return Running("etcd", address, srv)


def _pg_os_user() -> str | None:
    """The OS user PostgreSQL runs as: ourselves, or (as root) ``postgres``."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", "postgres"], check=True)
    return "postgres"


def _chown(path: Path, user: str | None) -> None:
    if user is not None:
        subprocess.run(["chown", "-R", f"{user}:", str(path)], check=True)


def pg_template(workdir: Path) -> Path:
    """initdb once per invocation; each run copies it (a fresh cluster each time)."""
    tpl = workdir / "pg-template"
    if tpl.exists():
        return tpl
    user = _pg_os_user()
    tpl.mkdir()
    _chown(tpl, user)
    initdb = binaries()["postgres"]["initdb"]
    log = workdir / "pg-initdb.log"
    with open(log, "wb") as f:
        rc = subprocess.run(
            [str(initdb), "-D", str(tpl), "-U", PG_USER, "-A", "trust", "-E", "UTF8",
             "--no-instructions", "--no-sync"],
            stdout=f, stderr=subprocess.STDOUT, user=user, cwd="/", timeout=300,
        ).returncode
    if rc != 0:
        raise RuntimeError(f"initdb failed ({rc}):\n{log.read_text(errors='replace')[-2000:]}")
    return tpl


def start_postgres(workdir: Path, tag: str) -> Running:
    user = _pg_os_user()
    tpl = pg_template(workdir)
    data = workdir / f"pg-{tag}"
    subprocess.run(["cp", "-a", str(tpl), str(data)], check=True)
    sock = workdir / f"pg-{tag}-sock"
    sock.mkdir()
    _chown(sock, user)
    port = free_port()
    argv = [
        str(binaries()["postgres"]["postgres"]), "-D", str(data),
        "-h", HOST, "-p", str(port), "-k", str(sock),
        "-c", "fsync=on", "-c", "synchronous_commit=on", "-c", "full_page_writes=on",
        "-c", "max_connections=200", "-c", "shared_buffers=128MB",
        "-c", "logging_collector=off",
    ]
    log_path = workdir / f"pg-{tag}.log"
    log_file = open(log_path, "wb")  # closed by Running.stop
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                            stderr=subprocess.STDOUT, user=user, cwd="/")
    srv = ServerProcess("postgres", proc, log_path, log_file)
    _wait_log(srv, r"database system is ready to accept connections")
    address = f"{HOST}:{port}"

    async def schema() -> None:
        import asyncpg

        con = await asyncpg.connect(host=HOST, port=port, user=PG_USER, database="postgres")
        try:
            await con.execute(PG_SCHEMA)
            info = await con.fetch(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('fsync', 'synchronous_commit', 'wal_sync_method', 'server_version')"
            )
        finally:
            await con.close()
        running.info.update({r["name"]: r["setting"] for r in info})

    running = Running("postgres", address, srv, stop_signal=signal.SIGINT)
    try:
        asyncio.run(schema())
    except BaseException:
        running.stop()
        raise
    return running


def start_redis(workdir: Path, tag: str) -> Running:
    data = workdir / f"redis-{tag}"
    data.mkdir()
    port = free_port()
    argv = [
        str(binaries()["redis"]["redis-server"]),
        "--bind", HOST, "--port", str(port), "--dir", str(data),
        "--appendonly", "yes", "--appendfsync", "always", "--save", "",
        "--daemonize", "no", "--protected-mode", "no", "--loglevel", "notice",
        "--maxclients", "1000",
    ]
    srv = start_server("redis", argv, workdir / f"redis-{tag}.log")
    _wait_log(srv, r"Ready to accept connections")
    _wait_until(srv, lambda: _port_open(port), "redis port")
    return Running("redis", f"{HOST}:{port}", srv)


def start(backend: str, workdir: Path, tag: str) -> Running:
    if backend.startswith("fencepost"):
        return start_fencepost(backend, workdir, tag)
    if backend == "etcd":
        return start_etcd(workdir, tag)
    if backend == "postgres":
        return start_postgres(workdir, tag)
    if backend == "redis":
        return start_redis(workdir, tag)
    raise ValueError(backend)


def make_workdir() -> Path:
    """A temp dir the PostgreSQL user can traverse (its subdirs are its own)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="fencepost-peers-"))
    d.chmod(0o755)
    return d


def remove_workdir(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)

