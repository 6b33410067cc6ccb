"""bench/peers (``make bench-peers``): its contention checker, and a smoke run.

The checker tests drive the real contention clients against an in-memory
backend, a correct one and two broken ones, so a checker that cannot fail is
caught. The smoke run starts real servers: fencepost (unary, stream and the
SDK's two shapes) and the do-nothing echo server always, etcd, PostgreSQL and
Redis when installed (skipped otherwise; ``make bench-peers`` installs them),
for about a second each.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

from peers import history, load  # noqa: E402
from peers import semantics as S  # noqa: E402

from fencepost_devtools import pgcluster  # noqa: E402


class MemoryBackend:
    """The semantics module's rules over a dict; ``bug`` breaks one rule."""

    def __init__(self, bug: str | None = None) -> None:
        self.records: dict[str, S.Record] = {}
        self.bug = bug

    async def _update(self, run_id: str, decide: Any) -> Any:
        await asyncio.sleep(0)
        new = decide(self.records.get(run_id), S.now_ms())
        if new is not None:
            self.records[run_id] = new
        await asyncio.sleep(0)
        return new

    async def acquire(self, run_id: str, owner: str, ttl_ms: int) -> int:
        def decide(rec: S.Record | None, now: int) -> S.Record:
            if self.bug == "ignore-live-lease" and rec is not None and rec["status"] == "running":
                rec = {**rec, "expires": now}  # as if every lease had just expired
            return S.decide_acquire(rec, now, owner, ttl_ms)

        return int((await self._update(run_id, decide))["token"])

    async def _fenced(self, run_id: str, owner: str, token: int, decide: Any) -> None:
        def run(rec: S.Record | None, now: int) -> Any:
            if self.bug == "no-fence" and rec is not None and rec.get("owner"):
                token_now, owner_now = rec["token"], rec["owner"]
                return decide(rec, now, owner_now, token_now)
            return decide(rec, now, owner, token)

        await self._update(run_id, run)

    async def renew(self, run_id: str, owner: str, token: int) -> None:
        await self._fenced(run_id, owner, token, S.decide_renew)

    async def checkpoint(
        self, run_id: str, owner: str, token: int, key: str, snapshot: int
    ) -> None:
        await self._fenced(run_id, owner, token,
                           lambda r, n, o, t: S.decide_checkpoint(r, n, o, t, key, snapshot))

    async def finish(self, run_id: str, owner: str, token: int) -> None:
        await self._fenced(run_id, owner, token, S.decide_finish)

    async def release(self, run_id: str, owner: str, token: int) -> None:
        await self._fenced(run_id, owner, token, S.decide_release)


async def _race(backend: MemoryBackend, seconds: float = 1.0) -> dict[str, Any]:
    spec = load.ClientSpec(backend="memory", address="", proc_index=0, clients=16,
                           run_prefix="mem", contention_s=1.0, runs=4, ttl_ms=100,
                           epoch_s=0.5)
    h = load._History()
    start = time.time()
    rng = random.Random(7)
    await asyncio.gather(*(
        load._contender(backend, h, spec, i, start, start + seconds, random.Random(rng.random()))
        for i in range(spec.clients)
    ))
    return history.check(h.grants, h.writes, h.finishes)


def test_checker_passes_a_correct_backend() -> None:
    v = asyncio.run(_race(MemoryBackend()))
    assert v["ok"], v
    assert v["grants"] > 10 and v["finishes"] > 0 and v["grants_above_token_1"] > 0


def test_checker_catches_double_grants() -> None:
    v = asyncio.run(_race(MemoryBackend(bug="ignore-live-lease")))
    assert v["double_grants"] > 0, v


def test_checker_catches_stale_fenced_writes_and_double_finishes() -> None:
    v = asyncio.run(_race(MemoryBackend(bug="no-fence")))
    assert v["stale_writes"] > 0, v
    assert not v["ok"]


@pytest.mark.slow
def test_bench_peers_smoke(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "peers"), "--smoke", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert {"fencepost-unary", "fencepost-stream", "fencepost-fleet",
            "fencepost-engine", "echo-fleet", "echo-engine"} <= set(summary), log
    if pgcluster.available():  # fencepost on its PostgreSQL store
        assert {"fencepost-pg-fleet", "fencepost-pg-engine"} <= set(summary), log
    for backend in result["backends"]:
        assert summary[backend]["ops_per_s"] > 0, (backend, log)
        assert summary[backend]["errors"] == 0, (backend, log)
        # one owner per process, or a server that grants everything: no contention run
        if backend.endswith("-engine") or backend.startswith("echo-"):
            assert backend not in result["contention"], log
            continue
        race = result["contention"][backend]
        assert race["grants"] > 0, (backend, log)
        assert (race["double_grants"], race["double_finishes"], race["stale_writes"]) == (0, 0, 0)
    # every server the bench started is gone (they all ran inside its workdir)
    assert result["workdir"] not in subprocess.run(
        ["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_the_raw_stream_sends_request_ids_only_when_asked(tmp_path: Path) -> None:
    """``--stream-request-ids``: the raw stream's commands carry request ids
    (the server then keeps one per written command, as for the SDK's: a renewal
    answered from memory keeps none, SPEC §5.2); by default they carry none."""
    import sqlite3

    from peers.backends import FencepostStream

    from fencepost_server.testing.server import ServerThread

    db = tmp_path / "db"

    async def lifecycle(address: str, request_ids: bool) -> None:
        b = FencepostStream(address, request_ids=request_ids)
        await b.connect()
        try:
            run_id = f"run-{request_ids}"
            token = await b.acquire(run_id, "w", 30_000)
            await b.renew(run_id, "w", token)
            await b.finish(run_id, "w", token)
        finally:
            await b.close()

    with ServerThread(db_path=db) as server:
        asyncio.run(lifecycle(server.address, False))
        asyncio.run(lifecycle(server.address, True))
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM requests").fetchone()[0] == 2  # acquire, finish
