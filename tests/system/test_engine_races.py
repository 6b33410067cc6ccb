"""The engine store's atomic operations hold across processes (docs/SPEC.md §11): 8
real processes race ClaimKey, ClaimRun and AcquireLock against one
``fencepost serve`` process. Every process connects first, then all start on
one signal (a file appearing), so their calls land together."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fencepost.v1 import engine_store_pb2 as pb
from fencepost.v1 import engine_store_pb2_grpc

pytestmark = pytest.mark.slow

PROCS = 8
FENCEPOST = Path(sys.executable).parent / "fencepost"

WORKER = r"""
import json, os, sys, time
import grpc
from fencepost.v1 import engine_store_pb2 as pb, engine_store_pb2_grpc

mode, address, go, idx = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
owner = f"worker-{idx}"
channel = grpc.insecure_channel(address)
store = engine_store_pb2_grpc.EngineStoreStub(channel)
store.GetRun(pb.EngineGetRunRequest(id="warm-up"))  # connected before the start
open(f"{go}.ready{idx}", "w").close()
while not os.path.exists(go):
    time.sleep(0.0005)
if mode == "key":
    r = store.ClaimKey(pb.EngineClaimKeyRequest(
        scope="race", key="order-1", run_id=f"run-{idx}", ttl_ms=60_000))
    out = {"created": r.created, "run_id": r.run_id, "mine": f"run-{idx}"}
elif mode == "claim":
    r = store.ClaimRun(pb.EngineClaimRunRequest(id="contested", owner=owner, ttl_ms=60_000))
    out = {"claimed": r.claimed, "owner": r.run.claim.owner}
else:  # lock: take it `rounds` times; while holding, prove no one else holds it
    rounds, marker, log = int(sys.argv[5]), sys.argv[6], sys.argv[7]
    tokens = []
    while len(tokens) < rounds:
        r = store.AcquireLock(pb.EngineAcquireLockRequest(key="race", owner=owner, ttl_ms=60_000))
        if not r.acquired:
            time.sleep(0.001)
            continue
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if another holds it
        with open(log, "a") as f:
            f.write(f"{r.fencing_token} {owner}\n")
        time.sleep(0.002)
        os.close(fd)
        os.unlink(marker)
        tokens.append(r.fencing_token)
        released = store.ReleaseLock(pb.EngineReleaseLockRequest(key="race", owner=owner))
        assert released.released
    out = {"tokens": tokens}
print(json.dumps(out))
"""


@pytest.fixture
def address(tmp_path: Path) -> Iterator[str]:
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(FENCEPOST), "serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "fp.db")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while not (m := re.search(r"serving on (\S+)", log_path.read_text(errors="replace"))):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.05)
        yield m.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def race(tmp_path: Path, mode: str, address: str, *extra: str) -> list[dict[str, Any]]:
    go = tmp_path / f"go-{mode}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, mode, address, str(go), str(i), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(PROCS)
    ]
    try:
        deadline = time.monotonic() + 60
        while sum(Path(f"{go}.ready{i}").exists() for i in range(PROCS)) < PROCS:
            assert all(p.poll() is None for p in procs), [
                p.stderr.read() for p in procs if p.stderr
            ]
            assert time.monotonic() < deadline, "workers did not get ready"
            time.sleep(0.01)
        go.touch()
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=60)
            assert p.returncode == 0, stderr.decode()
            outs.append(json.loads(stdout))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)


def test_claim_key_race_has_exactly_one_winner(tmp_path: Path, address: str) -> None:
    outs = race(tmp_path, "key", address)
    winners = [o for o in outs if o["created"]]
    assert len(winners) == 1
    winner = winners[0]["mine"]
    assert all(o["run_id"] == winner for o in outs), outs


def test_claim_run_race_has_exactly_one_winner(tmp_path: Path, address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        store = engine_store_pb2_grpc.EngineStoreStub(ch)
        store.CreateRun(
            pb.EngineCreateRunRequest(run=pb.EngineRun(id="contested", agent="a", status="queued"))
        )
        outs = race(tmp_path, "claim", address)
        assert sum(o["claimed"] for o in outs) == 1
        holder = {o["owner"] for o in outs}
        assert len(holder) == 1, outs
        run = store.GetRun(pb.EngineGetRunRequest(id="contested")).run
        assert run.claim.owner == holder.pop()


def test_lock_race_one_holder_at_a_time_and_tokens_increase(tmp_path: Path, address: str) -> None:
    rounds = 5
    log = tmp_path / "holders.log"
    outs = race(tmp_path, "lock", address, str(rounds), str(tmp_path / "held"), str(log))
    lines = log.read_text().split()
    tokens = [int(t) for t in lines[0::2]]
    assert len(tokens) == PROCS * rounds
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    assert sorted(t for o in outs for t in o["tokens"]) == tokens
