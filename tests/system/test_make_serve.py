"""`make serve` alone starts a server that answers the gRPC health check."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencepost_devtools.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_make_serve_answers_health_serving_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
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


def _make(*args: str) -> str:
    out = subprocess.run(["make", "-s", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout


def test_make_help_prints_the_real_defaults() -> None:
    text = _make("help")
    assert "$(" not in text
    assert "127.0.0.1:50051" in text and "./fencepost.db" in text
    assert "/x/y.db" in _make("help", "DB=/x/y.db")
    names = {line.split()[0] for line in text.splitlines() if line.strip()}
    assert {"serve", "test", "clean", "clean-data"} <= names


def test_make_clean_leaves_the_database_alone_and_clean_data_removes_it(
    tmp_path: Path,
) -> None:
    plan = _make("-n", "clean")  # only print: running it would delete this .venv
    assert "fencepost.db" not in plan and ".db" not in plan
    db = tmp_path / "data.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").write_bytes(b"x")
    keep = tmp_path / "other.db"
    keep.write_bytes(b"x")
    said = _make("clean-data", f"DB={db}")
    assert str(db) in said and "gone" in said
    assert not any(Path(f"{db}{s}").exists() for s in ("", "-wal", "-shm"))
    assert keep.exists()
