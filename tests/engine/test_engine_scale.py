"""Scale: ListRuns without a limit over 100 000 runs returns all of them (the
answer is far beyond the 4 MiB message limit, so it streams in pages), and a
64 MiB artifact goes up and back byte-exact while the server's RSS grows by
less than three quarters of it (bench/artifact_rss.py measures 256 MiB)."""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from fencepost._store import AsyncStore
from fencepost_server.core import engine as E
from fencepost_server.testing.server import ServerThread

MIB = 1024 * 1024
FENCEPOST = Path(sys.executable).parent / "fencepost"


def test_list_runs_without_limit_returns_100_000_runs(server: ServerThread) -> None:
    n = 100_000

    async def seed() -> None:  # through the writer, in large batches (no RPC per run)
        w = server.writer
        for start in range(0, n, 10_000):
            await asyncio.gather(
                *(
                    w.submit_nowait(
                        E.CreateRun(f"run-{i:06d}", f"agent-{i % 3}", "queued", input=f"[{i}]")
                    )
                    for i in range(start, start + 10_000)
                )
            )

    server.call(seed, timeout=120)

    async def read() -> None:
        async with AsyncStore.connect(server.address) as store:
            everything = await store.list_runs()
            assert everything.total == n and len(everything.runs) == n
            ids = [r.id for r in everything.runs]
            assert ids == [f"run-{i:06d}" for i in range(n)]  # same created_at: by id
            assert everything.runs[-1].input == [n - 1]
            some = await store.list_runs(agent="agent-1", offset=10, limit=5)
            assert some.total == n // 3 and [r.id for r in some.runs] == [
                f"run-{i:06d}" for i in range(31, 46, 3)
            ]

    asyncio.run(read())


@pytest.fixture
def server_proc(tmp_path: Path, db: str) -> Iterator[tuple[str, int]]:
    """``fencepost serve`` in a child process (its RSS is the server's alone)."""
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(FENCEPOST), "serve", "--listen", "127.0.0.1:0", "--db", db],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            # SQLite: "fencepost serving on ADDR"; PostgreSQL: "leading (epoch N) on ADDR"
            m = re.search(r"(?:fencepost serving|leading \(epoch \d+\)) on (\S+)",
                          log_path.read_text(errors="replace"))
            if m:
                break
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.05)
        yield m.group(1), proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class PeakRss:
    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_64_mib_artifact_streams_with_bounded_server_memory(
    server_proc: tuple[str, int],
) -> None:
    address, pid = server_proc
    size = 64 * MIB  # twice the buffers' ~25-33 MiB, so holding it whole stands out

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(size // MIB):
            yield random.Random(i).randbytes(MIB)

    expected = hashlib.sha256(b"".join(random.Random(i).randbytes(MIB) for i in range(size // MIB)))

    async def run() -> int:
        async with AsyncStore.connect(address) as store:
            warm = b"w" * MIB  # first use: imports, connections, caches
            await store.put_artifact("warm", warm, run_id="r")
            assert await store.read_artifact("warm") == warm
            await asyncio.sleep(0.2)
            before = psutil.Process(pid).memory_info().rss
            with PeakRss(pid) as rss:
                put = await store.put_artifact("big", pieces(), run_id="r", size_bytes=size)
                assert put.created and put.artifact.sha256 == expected.hexdigest()
                got = hashlib.sha256()
                n = 0
                async for chunk in store.iter_artifact("big"):
                    got.update(chunk)
                    n += len(chunk)
                assert n == size and got.hexdigest() == expected.hexdigest()
            return rss.peak - before

    growth = asyncio.run(run())
    # holding the artifact whole would cost 64 MiB on top of the buffers
    assert growth < 48 * MIB, f"server RSS grew by {growth / MIB:.1f} MiB"
