"""A SIGTERM with workers connected: the SDK keeps an Execute stream and a
KeepAlive stream open for as long as its client lives, and the server ends
both as it stops (after answering what it took) instead of waiting out its
grace period for them. After the restart the same client carries on: its
lease renews and finishes on the new process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from _proc import ServerProc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import fencepost
from fencepost_devtools.ports import free_port


def test_sigterm_with_a_worker_connected_stops_at_once_and_the_worker_carries_on(
    tmp_path: Path,
) -> None:
    srv = ServerProc(tmp_path / "f.db", tmp_path / "server.log",
                     args=("--shutdown-grace", "30"))
    srv.start()

    async def scenario() -> float:
        async with fencepost.Client(srv.address, owner="w") as client:
            lease = await client.acquire("r", ttl_ms=60_000)
            await lease.renew()  # both streams are open and in use
            started = time.monotonic()
            rc = await asyncio.to_thread(srv.stop, 25.0)
            took = time.monotonic() - started
            assert rc == 0
            await asyncio.to_thread(srv.start)
            await lease.renew()  # reconnects to the new process
            done = await lease.finish("completed")
            assert done.status == "completed" and done.fencing_token == lease.fencing_token
            return took

    try:
        took = asyncio.run(scenario())
    finally:
        srv.stop()
    assert took < 10, f"the stop took {took:.1f} s: it waited for the client's streams"


# `fencepost serve` with its start wrapped so that a SIGTERM arrives while the
# server is still starting (as a supervisor's quick restart can send it)
_SIGTERM_WHILE_STARTING = """
import asyncio, os, signal, sys
from fencepost_server import app
from fencepost_server.cli import main

started = app.App.start

async def start(self):
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(0.2)  # the signal is handled (or kills) meanwhile
    return await started(self)

app.App.start = start
sys.exit(main(sys.argv[1:]))
"""


def test_a_sigterm_while_the_server_starts_stops_it_cleanly_once_started(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_WHILE_STARTING, "serve", "--listen",
         f"127.0.0.1:{free_port()}", "--db", str(tmp_path / "f.db"), "--metrics-port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "signal received; draining" in proc.stderr and "fencepost stopped" in proc.stderr


# `fencepost serve` whose HTTP listeners take a second to start
_SLOW_HTTP = """
import asyncio, sys
from fencepost_server import app
from fencepost_server.cli import main

started = app.App._start_http

async def start_http(self):
    await asyncio.sleep(1.0)
    return await started(self)

app.App._start_http = start_http
sys.exit(main(sys.argv[1:]))
"""


def test_health_says_serving_only_once_every_listener_is_up(tmp_path: Path) -> None:
    """gRPC's health servicer starts out SERVING; the server says NOT_SERVING
    until its state is loaded and its HTTP listeners (dashboard, /metrics,
    /healthz) answer, so a probe of either that follows SERVING finds them."""
    port, metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_HTTP, "serve", "--listen", f"127.0.0.1:{port}",
         "--db", str(tmp_path / "f.db"), "--metrics-listen", f"127.0.0.1:{metrics}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    seen: list[int] = []
    try:
        retry = [(f"grpc.{k}_reconnect_backoff_ms", 20) for k in ("initial", "min", "max")]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=retry) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
                except grpc.RpcError:
                    time.sleep(0.02)
                    continue
                if not seen or seen[-1] != status:
                    seen.append(status)
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.02)
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/healthz", timeout=5) as r:
                assert r.read() == b"SERVING\n"
    finally:
        proc.terminate()
        proc.wait(30)
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING,
                    health_pb2.HealthCheckResponse.SERVING], seen
