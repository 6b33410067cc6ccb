"""`make serve` alone starts a server that answers the gRPC health check."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_make_serve_answers_health_serving_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = _free_port()
    db = tmp_path / "serve.db"
    proc = subprocess.Popen(
        ["make", "-s", "serve", f"ADDR=127.0.0.1:{port}", f"DB={db}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        status = None
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    break
                except grpc.RpcError:
                    time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.SERVING, proc.poll()
        assert db.exists()
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert b"fencepost stopped" in out, out.decode(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
