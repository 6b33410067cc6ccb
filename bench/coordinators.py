"""Coordinators on a throwaway PostgreSQL, and a client that follows the leader
(shared by bench/failover.py and bench/takeover.py; not a test utility).

``Group.start(workdir, n, lease, renew)`` starts a PostgreSQL
(``fencepost_devtools.pgcluster.Cluster``), creates one database, and starts ``n``
coordinators as real ``fencepost serve --db postgresql://...`` processes, each
on a fixed loopback port so that a restarted coordinator comes back at the
same address. Each start of a coordinator logs to a file of its own. Every
process started here is stopped here, by pid.

``Follower`` is a client of the raw protocol (generated stubs, unary calls,
request ids) that follows the leader the way a multi-endpoint client does: an
``UNAVAILABLE`` answer (``NOT_LEADER`` from a standby, or no connection) or an
attempt deadline moves it to the leader the standby names, or to the next
endpoint, and it retries the same request (the same request id) after a short
pause, until an answer or its total timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from benchlib import BIN, HOST, REPO, free_port, terminate
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencepost._ids import new_request_id
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost_devtools.pgcluster import Cluster

# "leading (epoch N) on ADDR after WHO; loaded revision R, K runs in S s; leases extended by G ms"
LEADING = re.compile(
    r"leading \(epoch (?P<epoch>\d+)\) on (?P<address>\S+) after (?P<previous>.+?); "
    r"loaded revision (?P<revision>\d+), (?P<runs>\d+) runs in (?P<load_s>[\d.]+) s; "
    r"leases extended by (?P<gap_ms>\d+) ms"
)
STANDBY = re.compile(r"fencepost standby on (?P<address>\S+)")
DATABASE = "fencepost"
WORKER_TTL_MS = 60_000


def request_id() -> str:
    """A time-ordered request id, as the SDK makes them."""
    return new_request_id()


@dataclass
class Leading:
    """What a coordinator's "leading" log line says."""

    epoch: int
    address: str
    previous: str
    revision: int
    runs: int
    load_s: float
    gap_ms: int

    @staticmethod
    def parse(m: re.Match[str]) -> Leading:
        return Leading(int(m["epoch"]), m["address"], m["previous"], int(m["revision"]),
                       int(m["runs"]), float(m["load_s"]), int(m["gap_ms"]))


@dataclass
class Coordinator:
    """One coordinator: a fixed address, a process per start."""

    index: int
    port: int
    argv: list[str]
    workdir: Path
    starts: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    _log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.alive:
            raise RuntimeError(f"coordinator {self.index} is already running")
        self._close_log()
        self.starts += 1
        self.log_path = self.workdir / f"coordinator{self.index}-start{self.starts:03d}.log"
        self._log = open(self.log_path, "wb")  # closed by _close_log
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=REPO)

    def log_text(self) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def find(self, rx: re.Pattern[str]) -> re.Match[str] | None:
        return rx.search(self.log_text())

    def wait_for(self, rx: re.Pattern[str], timeout: float) -> re.Match[str]:
        """The first match of ``rx`` in this start's log, waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.find(rx)
            if m is not None:
                return m
            if not self.alive:
                code = self.proc.returncode if self.proc is not None else None
                raise RuntimeError(f"coordinator {self.index} exited with {code} before "
                                   f"logging {rx.pattern[:40]!r}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"coordinator {self.index}: no {rx.pattern[:40]!r} after "
                                   f"{timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.02)

    def send(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if it has not exited within ``timeout``."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGCONT (in case it was stopped) and SIGTERM, SIGKILL after ``timeout``."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            terminate(proc, signal.SIGTERM, timeout)
        self._close_log()
        return proc.returncode if proc is not None else None

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class Group:
    """A throwaway PostgreSQL and coordinators on one database in it."""

    cluster: Cluster
    url: str
    coordinators: list[Coordinator] = field(default_factory=list)

    @classmethod
    def start(cls, workdir: Path, n: int = 2, *, lease: str = "5s", renew: str = "1s",
              extra: Sequence[str] = (), pg_settings: dict[str, str] | None = None) -> Group:
        """PostgreSQL and ``n`` coordinators, started together (not yet waited for)."""
        workdir.mkdir(parents=True, exist_ok=True)
        cluster = Cluster.start(workdir / "pg", settings=pg_settings)
        try:
            url = cluster.create_database(DATABASE)
            group = cls(cluster, url)
            for i in range(n):
                port = free_port()
                argv = [
                    str(BIN / "fencepost"), "serve", "--listen", f"{HOST}:{port}",
                    "--db", url, "--durability", "full", "--http-listen", "off",
                    "--log-level", "INFO", "--leader-lease", lease, "--leader-renew", renew,
                    *extra,
                ]
                group.coordinators.append(Coordinator(i, port, argv, workdir))
            for c in group.coordinators:
                c.start()
        except BaseException:
            cluster.close()
            raise
        return group

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self.coordinators]

    def wait_leader(self, timeout: float = 60.0) -> tuple[Coordinator, Leading]:
        """The coordinator whose current start logged "leading" (waits for one)."""
        deadline = time.monotonic() + timeout
        while True:
            for c in self.coordinators:
                if c.alive:
                    m = c.find(LEADING)
                    if m is not None:
                        return c, Leading.parse(m)
            if time.monotonic() >= deadline:
                tails = "\n".join(f"[{c.index}]\n{c.log_tail()}" for c in self.coordinators)
                raise RuntimeError(f"no coordinator leads after {timeout:g} s:\n{tails}")
            time.sleep(0.02)

    def other(self, c: Coordinator) -> Coordinator:
        """The first coordinator that is not ``c``."""
        return next(x for x in self.coordinators if x is not c)

    def stop(self) -> None:
        try:
            for c in self.coordinators:
                c.stop()
        finally:
            self.cluster.close()


# -- the client ------------------------------------------------------------------------


def error_info(exc: grpc.aio.AioRpcError) -> tuple[str, dict[str, str]]:
    """(reason, metadata) of the ErrorInfo fencepost attaches to an error."""
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason, dict(info.metadata)
    return "", {}


class Refused(Exception):
    """The leader refused the command (a fencepost error that is not UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(f"{code.name} {reason}: {message}")
        self.code, self.reason = code, reason


@dataclass
class Ack:
    """One answered call: when (monotonic), by which endpoint, after how many attempts."""

    at: float
    address: str
    attempts: int
    response: Any


class Follower:
    """Unary calls on any of ``addresses``, following the leader.

    A failed attempt (``UNAVAILABLE``, or no answer within ``attempt_timeout``)
    is retried with the same request after ``retry_s``: on the leader a
    standby names (``NOT_LEADER`` metadata), unless that endpoint itself failed
    to answer in the last ``suspect_s`` (a stopped or dead leader is still
    named by the standbys until its leader lease runs out), else on the next
    endpoint, else on the same one.
    """

    def __init__(self, addresses: Sequence[str], *, attempt_timeout: float = 1.0,
                 retry_s: float = 0.025, suspect_s: float = 2.0,
                 total_timeout: float = 120.0) -> None:
        self.addresses = list(addresses)
        self._channels = {a: grpc.aio.insecure_channel(a) for a in self.addresses}
        self.stubs = {a: ledger_pb2_grpc.LedgerStub(ch) for a, ch in self._channels.items()}
        self.current = self.addresses[0]
        self.attempt_timeout = attempt_timeout
        self.retry_s = retry_s
        self.suspect_s = suspect_s
        self.total_timeout = total_timeout
        self._failed_at: dict[str, float] = {}
        self.failed_attempts = 0

    def _next_after_failure(self, address: str, hint: str | None) -> str:
        now = time.monotonic()
        if hint and hint in self.stubs and now - self._failed_at.get(hint, -1e9) > self.suspect_s:
            return hint
        if hint is not None:  # a standby answered: it, or the leader it names, will lead
            return address
        i = self.addresses.index(address)
        return self.addresses[(i + 1) % len(self.addresses)]

    async def call(self, method: str, request: Any, *, pin: str | None = None) -> Ack:
        """``method`` (a Ledger RPC name) until answered; raises ``Refused`` when
        refused, TimeoutError after ``total_timeout``. ``pin``: this endpoint only."""
        deadline = time.monotonic() + self.total_timeout
        attempts = 0
        while True:
            address = pin or self.current
            attempts += 1
            try:
                resp = await getattr(self.stubs[address], method)(
                    request, timeout=self.attempt_timeout)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    reason, _ = error_info(exc)
                    raise Refused(code, reason, exc.details() or "") from None
                self.failed_attempts += 1
                reason, meta = error_info(exc)
                if reason == "NOT_LEADER":
                    hint: str | None = meta.get("leader", "")
                else:
                    hint = None
                    self._failed_at[address] = time.monotonic()
                if pin is None:
                    self.current = self._next_after_failure(address, hint)
                if time.monotonic() + self.retry_s > deadline:
                    raise TimeoutError(f"{method}: no answer after {attempts} attempts "
                                       f"({code.name} {reason})") from None
                await asyncio.sleep(self.retry_s)
                continue
            if pin is None:
                self.current = address
            return Ack(time.monotonic(), address, attempts, resp)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(None)


@dataclass
class Acks:
    """Every acknowledged worker command: (monotonic time, endpoint)."""

    at: list[float] = field(default_factory=list)
    by: list[str] = field(default_factory=list)

    def add(self, t: float, address: str) -> None:
        self.at.append(t)
        self.by.append(address)

    def first_after(self, t0: float, address: str, start: int = 0) -> tuple[float | None, int]:
        """The first ack by ``address`` after ``t0`` (scanning from index ``start``),
        and where the scan stopped."""
        n = len(self.at)
        for i in range(start, n):
            if self.by[i] == address and self.at[i] > t0:
                return self.at[i], i
        return None, n

    def count(self, address: str, after: float) -> int:
        return sum(1 for t, a in zip(self.at, self.by, strict=True) if a == address and t > after)


@dataclass
class WorkerStats:
    ops: int = 0
    lifecycles: int = 0
    refused: int = 0
    timeouts: int = 0
    samples: list[str] = field(default_factory=list)
    longest_s: float = 0.0  # the longest a command waited for its answer (a failover)

    def note(self, what: str) -> None:
        if len(self.samples) < 5:
            self.samples.append(what[:300])


async def worker(f: Follower, acks: Acks, stats: WorkerStats, owner: str,
                 stop: asyncio.Event) -> None:
    """Loop the lifecycle on fresh runs through ``f`` until ``stop``; every
    acknowledged command goes to ``acks``, a refusal or a timeout to ``stats``
    (neither should happen: a retried command gets its stored answer)."""
    seq = itertools.count()
    while not stop.is_set():
        run_id = f"{owner}-{next(seq):07d}"

        async def cmd(method: str, request: Any) -> Any:
            t0 = time.monotonic()
            ack = await f.call(method, request)
            acks.add(ack.at, ack.address)
            stats.ops += 1
            stats.longest_s = max(stats.longest_s, ack.at - t0)
            return ack.response

        try:
            r = await cmd("Acquire", pb.AcquireRequest(
                run_id=run_id, owner=owner, lease_ttl_ms=WORKER_TTL_MS, request_id=request_id()))
            token = r.run.fencing_token
            for _ in range(3):
                await cmd("Renew", pb.RenewRequest(run_id=run_id, owner=owner,
                                                   fencing_token=token, request_id=request_id()))
            await cmd("RecordCheckpoint", pb.RecordCheckpointRequest(
                run_id=run_id, owner=owner, fencing_token=token, key="ckpt", snapshot_version=1,
                request_id=request_id()))
            await cmd("Finish", pb.FinishRequest(
                run_id=run_id, owner=owner, fencing_token=token,
                status=rpb.RUN_STATUS_COMPLETED, request_id=request_id()))
            stats.lifecycles += 1
        except Refused as exc:
            stats.refused += 1
            stats.note(f"{run_id}: {exc}")
        except TimeoutError as exc:
            stats.timeouts += 1
            stats.note(f"{run_id}: {exc}")


def health(address: str, timeout: float = 2.0) -> str:
    """The gRPC health status name of ``address`` ('' service), or the error."""
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
    except grpc.RpcError as exc:
        return f"error {exc.code().name}"  # type: ignore[attr-defined]
