"""The servers: find (or install) the peers, start each on 127.0.0.1 in a temp
dir with durable settings, measure its CPU, stop it and everything it forked.

Durable settings (every acknowledgement survives power loss):

* fencepost: ``fencepost serve --durability full`` (SQLite WAL, synchronous=FULL);
  the ``fencepost-pg-*`` backends: the same with ``--db postgresql://...``, one
  coordinator on a throwaway cluster set up as the PostgreSQL peer's (below),
  each acknowledged batch committed with ``synchronous_commit=on``;
* etcd: defaults (the WAL is fsynced before a write is acknowledged);
* PostgreSQL: a throwaway cluster (``fencepost_devtools.pgcluster``): ``fsync=on``,
  ``synchronous_commit=on`` (the defaults, spelled out);
* Redis: ``appendonly yes``, ``appendfsync always``, no RDB snapshots.

Every process started here is a child of this process, stopped by its pid:
SIGTERM (SIGINT for PostgreSQL: fast shutdown), SIGKILL after a bounded wait,
then any of its descendants still alive, by pid.
"""

from __future__ import annotations

import os
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
from benchlib import BIN, HOST, REPO, ServerProcess, free_port, start_server, terminate

from fencepost_devtools.pgcluster import Cluster, find_binary

from .backends import ECHO_BACKENDS, PG_BACKENDS
from .semantics import PG_SCHEMA, PG_USER

# both PostgreSQL servers (the peer's, and fencepost-pg-*'s store) run with these
PG_SETTINGS = {"shared_buffers": "128MB"}
APT_PACKAGES = {"etcd": "etcd-server", "postgres": "postgresql", "redis": "redis-server"}
PY_MODULES = {"postgres": "asyncpg", "redis": "redis"}


# -- binaries ----------------------------------------------------------------------


def binaries() -> dict[str, dict[str, str | None]]:
    return {
        "etcd": {"etcd": shutil.which("etcd")},
        "postgres": {"postgres": find_binary("postgres"), "initdb": find_binary("initdb")},
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
                       ("postgres", [find_binary("postgres") or "postgres", "--version"]),
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


def trees_cpu(pids: list[int]) -> dict[int, float]:
    """``tree_cpu`` of several roots (separate trees), the reaped children's
    totals added up under key -1."""
    out: dict[int, float] = {}
    for pid in pids:
        for k, v in tree_cpu(pid).items():
            out[k] = out.get(k, 0.0) + v if k == -1 else v
    return out


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
    """A started server: a child process, or (PostgreSQL) a throwaway cluster."""

    backend: str
    address: str
    server: ServerProcess | None = None
    stop_signal: int = signal.SIGTERM
    info: dict[str, Any] = field(default_factory=dict)
    metrics_port: int | None = None
    cluster: Cluster | None = None
    # fencepost on PostgreSQL: the coordinator runs in ``server``, its store in
    # ``cluster``; both are the server whose CPU is counted
    coordinator_store: bool = False

    @property
    def addresses(self) -> list[str]:
        """Where client processes connect (one each, in turn)."""
        return [self.address]

    @property
    def cpu_parts(self) -> dict[str, list[int]]:
        """The process trees whose CPU is also reported apart, by name."""
        if self.coordinator_store:
            assert self.server is not None and self.cluster is not None
            return {"coordinators": [self.server.proc.pid], "postgres": [self.cluster.pid or 0]}
        return {}

    @property
    def metrics_ports(self) -> list[int]:
        return [self.metrics_port] if self.metrics_port is not None else []

    @property
    def pids(self) -> list[int]:
        """The roots of the process trees that serve this backend."""
        if self.coordinator_store:
            assert self.server is not None and self.cluster is not None
            return [self.server.proc.pid, self.cluster.pid or 0]
        return [self.pid]

    @property
    def pid(self) -> int:
        if self.cluster is not None and not self.coordinator_store:
            return self.cluster.pid or 0
        assert self.server is not None
        return self.server.proc.pid

    def log_tail(self) -> str:
        if self.cluster is not None and not self.coordinator_store:
            return self.cluster.log_tail()
        assert self.server is not None
        return self.server.log_tail()

    def stop(self, timeout: float = 15.0) -> int | None:
        """Stop the server and then any descendant it left behind (by pid)."""
        if self.cluster is not None and not self.coordinator_store:
            code = self.cluster.stop(timeout)
            self.cluster.close()
            return code
        try:
            return self._stop_server(timeout)
        finally:
            if self.cluster is not None:
                self.cluster.close()

    def _stop_server(self, timeout: float) -> int | None:
        assert self.server is not None
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        proc = self.server.proc
        terminate(proc, self.stop_signal, timeout)
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


def _fencepost_argv(db: str, metrics_port: int) -> list[str]:
    return [
        str(BIN / "fencepost"), "serve",
        "--listen", f"{HOST}:0",
        "--db", db,
        "--durability", "full",
        "--metrics-port", str(metrics_port),
        "--log-level", "INFO",
    ]


def start_fencepost(backend: str, workdir: Path, tag: str) -> Running:
    metrics_port = free_port()
    argv = _fencepost_argv(str(workdir / f"{backend}-{tag}.db"), metrics_port)
    srv = start_server(backend, argv, workdir / f"{backend}-{tag}.log")
    address = srv.wait_ready(r"fencepost serving on (\S+)")
    return Running(backend, address, srv, metrics_port=metrics_port)


def start_fencepost_pg(backend: str, workdir: Path, tag: str) -> Running:
    """One coordinator (it leads at once) on a fresh PostgreSQL set up as the peer's."""
    cluster = Cluster.start(workdir / f"{backend}-pg-{tag}", settings=PG_SETTINGS)
    try:
        metrics_port = free_port()
        argv = _fencepost_argv(cluster.create_database("fencepost"), metrics_port)
        srv = start_server(backend, argv, workdir / f"{backend}-{tag}.log")
    except BaseException:
        cluster.close()
        raise
    running = Running(backend, "", srv, metrics_port=metrics_port, cluster=cluster,
                      coordinator_store=True)
    try:
        running.address = srv.wait_ready(r"leading \(epoch \d+\) on (\S+)")
    except BaseException:
        running.stop()
        raise
    return running


class ShardedCoordinators:
    """k coordinators with ``--lead-shards`` on one PostgreSQL database: each
    leads its share of the database's shards at once. Coordinators join
    (``add``), leave (``leave``: SIGTERM, a planned hand-over) or crash
    (``crash``: SIGKILL) while it runs; the cluster is the caller's."""

    def __init__(self, backend: str, cluster: Cluster, dbname: str, workdir: Path, *,
                 shards: int, lease: str, renew: str) -> None:
        self.backend = backend
        self.cluster = cluster
        self.url = cluster.create_database(dbname)
        self.workdir, self.dbname = workdir, dbname
        self.shards, self.lease, self.renew = shards, lease, renew
        self.live: list[Running] = []
        self.started = 0
        # client processes are given one coordinator's address each (False)
        # or every live one's (True): the SDK routes either way
        self.give_all = False

    def add(self) -> Running:
        """Start one more coordinator; returns once it serves (it may lead nothing yet)."""
        metrics_port = free_port()
        argv = [*_fencepost_argv(self.url, metrics_port), "--lead-shards",
                "--shards", str(self.shards), "--leader-lease", self.lease,
                "--leader-renew", self.renew, "--http-listen", "off"]
        name = f"{self.backend}-{self.dbname}-c{self.started}"
        self.started += 1
        srv = start_server(name, argv, self.workdir / f"{name}.log")
        one = Running(self.backend, "", srv, metrics_port=metrics_port)
        try:
            one.address = srv.wait_ready(r"leading the shards assigned to it "
                                         r"\(advertised as (\S+)\)")
        except BaseException:
            one.stop()
            raise
        self.live.append(one)
        return one

    def leave(self, one: Running, timeout: float = 30.0) -> int | None:
        """SIGTERM: it hands its shards over, then exits."""
        self.live.remove(one)
        return one.stop(timeout)

    def crash(self, one: Running) -> None:
        """SIGKILL: its shards are taken once their leases run out."""
        self.live.remove(one)
        assert one.server is not None
        one.server.proc.kill()
        one.server.proc.wait(10)
        one.stop()

    def owners(self) -> dict[int, str]:
        """shard -> advertised address of its live holder, as the rows say."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as db:
            rows = db.execute(
                "SELECT shard, address FROM fencepost.fencepost_shards WHERE holder <> '' "
                "AND expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
            ).fetchall()
        return {int(s): str(a) for s, a in rows}

    def wait_balanced(self, timeout: float = 60.0) -> dict[int, str]:
        """Until every shard is held by a live coordinator, each holding its share."""
        want = {c.address for c in self.live}
        low, high = self.shards // len(want), -(-self.shards // len(want))
        deadline = time.monotonic() + timeout
        owners: dict[int, str] = {}
        while time.monotonic() < deadline:
            owners = self.owners()
            held = list(owners.values())
            if len(owners) == self.shards and set(held) == want \
                    and all(low <= held.count(a) <= high for a in want):
                return owners
            time.sleep(0.05)
        raise RuntimeError(f"shards not balanced over {sorted(want)} after {timeout}s: "
                           f"{owners}\n" + "\n".join(c.log_tail() for c in self.live))

    # what drive() (load.py) reads, as of a Running

    @property
    def address(self) -> str:
        return self.live[0].address

    @property
    def addresses(self) -> list[str]:
        every = [c.address for c in self.live]
        return [",".join(every)] if self.give_all else every

    @property
    def cpu_parts(self) -> dict[str, list[int]]:
        return {"coordinators": [c.pid for c in self.live], "postgres": [self.cluster.pid or 0]}

    @property
    def pids(self) -> list[int]:
        return [*(c.pid for c in self.live), self.cluster.pid or 0]

    @property
    def metrics_ports(self) -> list[int]:
        return [c.metrics_port for c in self.live if c.metrics_port is not None]

    def stop(self) -> list[int | None]:
        """Stop every coordinator (SIGTERM) and drop the database."""
        codes = [c.stop() for c in self.live]
        self.live = []
        try:
            self.cluster.drop_database(self.dbname)
        except Exception:
            pass  # the cluster is going away with the workdir anyway
        return codes


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


def start_postgres(workdir: Path, tag: str) -> Running:
    cluster = Cluster.start(workdir / f"pg-{tag}", role=PG_USER, settings=PG_SETTINGS)
    running = Running("postgres", f"{HOST}:{cluster.port}", stop_signal=signal.SIGINT,
                      cluster=cluster)
    try:
        with cluster.connect() as conn:
            conn.execute(PG_SCHEMA)
            info = conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('fsync', 'synchronous_commit', 'wal_sync_method', 'server_version')"
            ).fetchall()
        running.info.update(dict(info))
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


def start_echo(backend: str, workdir: Path, tag: str) -> Running:
    argv = [str(BIN / "python"), str(REPO / "bench" / "echo_server.py"), "--listen", f"{HOST}:0"]
    srv = start_server(backend, argv, workdir / f"{backend}-{tag}.log")
    return Running(backend, srv.wait_ready(r"echo serving on (\S+)"), srv)


def start(backend: str, workdir: Path, tag: str) -> Running:
    if backend in ECHO_BACKENDS:
        return start_echo(backend, workdir, tag)
    if backend in PG_BACKENDS:
        return start_fencepost_pg(backend, workdir, tag)
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

