"""One server per SQLite file: a second ``fencepost serve`` on a file another
server holds refuses to start, naming the file, and leaves it untouched; once
the holder is gone (even by ``kill -9``) the file can be served again."""

from __future__ import annotations

import hashlib
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from _proc import CHANNEL_OPTIONS, FENCEPOST, ServerProc, free_port

from fencepost.v1 import ledger_pb2, ledger_pb2_grpc


def _second_server(db: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FENCEPOST), "serve", "--listen", f"127.0.0.1:{free_port()}", "--db", str(db)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
    )


def _settled_hash(db: Path, quiet_s: float = 2.5, limit_s: float = 20.0) -> str:
    """The file's hash once it has not changed for ``quiet_s``."""
    deadline = time.monotonic() + limit_s
    digest, since = hashlib.sha256(db.read_bytes()).hexdigest(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the first server kept writing its file"
        time.sleep(0.1)
        now = hashlib.sha256(db.read_bytes()).hexdigest()
        if now != digest:
            digest, since = now, time.monotonic()
    return digest


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_second_server_on_the_same_file_refuses_to_start(tmp_path: Path) -> None:
    db = tmp_path / "fencepost.db"
    first = ServerProc(db, tmp_path / "first.log").start()
    try:
        with grpc.insecure_channel(first.address, options=CHANNEL_OPTIONS) as ch:
            ledger_pb2_grpc.LedgerStub(ch).Acquire(
                ledger_pb2.AcquireRequest(run_id="r1", owner="w1", lease_ttl_ms=60_000),
                timeout=10,
            )
        # the first server is done with its own writing: its runs table caught
        # up and its checkpoints (beside the writer) copied the WAL
        before = _settled_hash(db)
        second = _second_server(db)
        assert second.returncode == 1, second.stderr
        assert str(db) in second.stderr and "in use by another fencepost server" in second.stderr
        assert "Traceback" not in second.stderr, second.stderr
        assert hashlib.sha256(db.read_bytes()).hexdigest() == before, "the file was modified"
        # The first server is unharmed: it still serves its run and takes writes.
        with grpc.insecure_channel(first.address, options=CHANNEL_OPTIONS) as ch:
            stub = ledger_pb2_grpc.LedgerStub(ch)
            run = stub.GetRun(ledger_pb2.GetRunRequest(run_id="r1"), timeout=10).run
            assert run.lease.owner == "w1"
            stub.Acquire(ledger_pb2.AcquireRequest(run_id="r2", owner="w1", lease_ttl_ms=60_000),
                         timeout=10)
    finally:
        first.kill()  # SIGKILL: the kernel drops the lock with the process
    again = ServerProc(db, tmp_path / "again.log").start()
    try:
        with grpc.insecure_channel(again.address, options=CHANNEL_OPTIONS) as ch:
            run = ledger_pb2_grpc.LedgerStub(ch).GetRun(ledger_pb2.GetRunRequest(run_id="r2"),
                                                         timeout=10).run
            assert run.lease.owner == "w1"
    finally:
        again.kill()
