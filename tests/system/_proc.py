"""Real processes for the system tests: a ``fencepost serve`` server that can be
SIGKILLed and restarted on the same file and port, plus small gRPC helpers.

Nothing here imports the server's code, apart from its free-port helper: the
tests talk to the process over the wire only, and read its SQLite file
read-only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from fencepost_devtools.ports import free_port

VENV_BIN = Path(sys.executable).parent
FENCEPOST = VENV_BIN / "fencepost"

# Reconnect quickly after the server comes back (the default backoff grows to
# minutes; a client would then sit out the rest of the test).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.enable_retries", 0),
]


def now_ms() -> int:
    """The same wall clock the server uses (SystemClock)."""
    return time.time_ns() // 1_000_000


def call_status(err: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status a failed unary call ended with (None: none attached)."""
    try:
        return rpc_status.from_call(err)  # type: ignore[arg-type]
    except Exception:
        return None


def status_reason(status: status_pb2.Status | None) -> str | None:
    """The fencepost ErrorInfo reason of a refusal's status (a unary call's, or
    an Execute result's ``error``), or None (a transport failure)."""
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == "fencepost":
                return str(info.reason)
    return None


def status_record(status: status_pb2.Status | None) -> Any:
    """The record the server attached to a refusal's status (a fencepost.v1.Run), or None."""
    from fencepost.v1 import record_pb2

    for detail in status.details if status is not None else ():
        if detail.Is(record_pb2.Run.DESCRIPTOR):
            run = record_pb2.Run()
            detail.Unpack(run)
            return run
    return None


def reason(err: grpc.RpcError) -> str:
    """The ErrorInfo reason of a failed call, or the gRPC code name when the
    status carries none (UNAVAILABLE from the transport, DEADLINE_EXCEEDED)."""
    why = status_reason(call_status(err))
    if why is not None:
        return why
    code = err.code()  # type: ignore[attr-defined]
    return code.name if code is not None else "UNKNOWN"


def ts_ms(ts: Any) -> int:
    return int(ts.seconds) * 1000 + int(ts.nanos) // 1_000_000


class ServerProc:
    """One ``fencepost serve`` process at a time, on a fixed port and file."""

    def __init__(
        self,
        db_path: Path | str,  # a SQLite file or a postgresql:// URL
        log_path: Path,
        port: int | None = None,
        *,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        prelude: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        exe: Path = FENCEPOST,
    ) -> None:
        self.exe = exe  # another install's `fencepost` (the artifacts as a user installs them)
        self.db_path = db_path
        self.log_path = log_path
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.starts = 0
        # extra `serve` flags, environment, and Python run in the child before it
        # execs the server (disk faults: a file-size limit). Not a preexec_fn:
        # that makes subprocess fork() this process, which runs gRPC; gRPC's
        # fork handlers restart its event engine in the child, close_fds then
        # closes the new epoll fd under a poller thread, and the child aborts
        # before exec now and then (see tests/sdk/test_sdk_cli.py::_spawn_cli).
        self.args = args
        self.env = env or {}
        self.prelude = prelude
        self.credentials = credentials  # TLS servers: how this harness connects

    def channel(self) -> grpc.Channel:
        """A channel to the server for the harness itself (health, hooks)."""
        if self.credentials is None:
            return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(self.address, self.credentials, options=CHANNEL_OPTIONS)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0, *, serving: bool = True) -> ServerProc:
        """Start and wait until health says SERVING (``serving=False``: until it
        answers at all, e.g. a standby coordinator's NOT_SERVING)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self._log = open(self.log_path, "ab")  # closed in _reap
        self._log.write(f"\n=== start #{self.starts + 1} ===\n".encode())
        self._log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        cmd = [str(self.exe), "serve", "--listen", self.address, "--db", str(self.db_path),
               *self.args]
        if self.prelude:  # a fresh interpreter sets the child up, then execs the server
            code = f"{self.prelude}\nimport os, sys\nos.execv(sys.argv[1], sys.argv[1:])"
            cmd = [sys.executable, "-S", "-c", code, *cmd]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env=env,
        )
        self.starts += 1
        self._wait_serving(timeout, serving)
        return self

    def _wait_serving(self, timeout: float, serving: bool = True) -> None:
        deadline = time.monotonic() + timeout
        with self.channel() as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode} during startup:\n"
                        + self.log_tail()
                    )
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING or not serving:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError("server did not become SERVING:\n" + self.log_tail())
                time.sleep(0.03)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed or closed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self._reap(10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (graceful), falling back to SIGKILL. Returns the exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self._reap(10)

    def _reap(self, timeout: float) -> int | None:
        rc = None
        if self.proc is not None:
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not hang
                self.proc.kill()
                rc = self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def restart(self) -> None:
        self.start()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def running_server(tmp_path: Path) -> Iterator[ServerProc]:
    """A started server that is always gone when the block exits."""
    srv = ServerProc(tmp_path / "fencepost.db", tmp_path / "server.log")
    try:
        srv.start()
        yield srv
    finally:
        srv.kill()


# -- reading the committed state ----------------------------------------------------


def connect_ro(db_path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)


def error_record(err: grpc.RpcError) -> Any:
    """The record the server attached to a refusal (a fencepost.v1.Run), or None."""
    return status_record(call_status(err))


def execute_all(stub: Any, commands: list[Any], *, window: int = 4096, chunk: int = 512,
                timeout: float = 120.0) -> dict[int, Any]:
    """Run ``commands`` (fencepost.v1.Command, unique ids) over one Ledger.Execute
    stream, at most ``window`` unanswered at once (the server's per-stream
    limit); returns each command's CommandResult by id."""
    from fencepost.v1 import ledger_pb2 as pb

    results: dict[int, Any] = {}
    cond = threading.Condition()
    over = [False]  # the reader is gone: stop feeding

    def requests() -> Iterator[Any]:
        for i in range(0, len(commands), chunk):
            part = commands[i:i + chunk]
            ceiling = i + len(part) - window  # answered before `part` may go
            with cond:
                cond.wait_for(lambda c=ceiling: over[0] or len(results) >= c)
            if over[0]:
                return
            yield pb.ExecuteRequest(commands=part)
        with cond:  # half-closing would end the stream before the last answers
            cond.wait_for(lambda: over[0] or len(results) >= len(commands))

    call = stub.Execute(requests(), timeout=timeout)
    try:
        for resp in call:
            with cond:
                for r in resp.results:
                    results[r.id] = r
                cond.notify()
            if len(results) >= len(commands):
                break
    finally:
        with cond:
            over[0] = True
            cond.notify()
        call.cancel()
    return results
