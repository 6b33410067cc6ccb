"""Artifact streaming with bounded server memory (docs/SPEC.md §11): upload a large
artifact to a ``fencepost serve`` process, read it back, check it byte for
byte, and report the server's resident memory and the throughput.

The server runs alone in a child process (durability full, a fresh database
in a temporary directory), so its RSS is the server's only. A thread samples
it every few milliseconds; the figures are: the baseline (after a 1 MiB
warm-up upload and read), the peak during the upload, the peak during the
read, and the growth (peak - baseline). The bytes are generated on the fly
from a seeded PRNG, one chunk at a time, on both sides: the client never
holds the artifact either.

    .venv/bin/python bench/artifact_rss.py [--size-mib 256] [--chunk-kib 1024] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
from benchlib import BIN, machine, start_server

from fencepost._store import AsyncStore

MIB = 1024 * 1024


def block(i: int, size: int) -> bytes:
    """The i-th chunk of the artifact (deterministic, incompressible)."""
    return random.Random(i).randbytes(size)


async def generate(total: int, chunk: int) -> AsyncIterator[bytes]:
    sent, i = 0, 0
    while sent < total:
        piece = block(i, min(chunk, total - sent))
        sent += len(piece)
        i += 1
        yield piece


class Sampler:
    """Samples a process's RSS in a thread; ``mark()`` starts a new phase."""

    def __init__(self, pid: int, every_s: float = 0.005) -> None:
        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(self.proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.rss())
            except psutil.Error:
                return
            time.sleep(self.every_s)

    def mark(self) -> int:
        """Start a phase; returns the RSS now."""
        now = self.rss()
        self.peak = now
        return now

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def transfer(address: str, pid: int, size: int, chunk: int) -> dict[str, Any]:
    async with AsyncStore.connect(address) as store:
        warm = b"w" * MIB
        await store.put_artifact("warm-up", warm, run_id="bench")
        assert await store.read_artifact("warm-up") == warm
        with Sampler(pid) as sampler:
            await asyncio.sleep(0.2)
            before = sampler.mark()
            t0 = time.perf_counter()
            put = await store.put_artifact(
                "big", generate(size, chunk), run_id="bench", size_bytes=size
            )
            up_s = time.perf_counter() - t0
            peak_up = sampler.peak
            assert put.created and put.artifact.size_bytes == size
            sampler.mark()
            t0 = time.perf_counter()
            expected = generate(size, chunk)
            pending = b""
            received = 0
            digest = hashlib.sha256()
            async for piece in store.iter_artifact("big"):
                received += len(piece)
                digest.update(piece)
                pending += piece
                while len(pending) >= chunk or (pending and received == size):
                    want = await anext(expected)
                    if pending[: len(want)] != want:
                        raise AssertionError(f"mismatch near byte {received - len(pending)}")
                    pending = pending[len(want) :]
            down_s = time.perf_counter() - t0
            peak_down = sampler.peak
            assert received == size and digest.hexdigest() == put.artifact.sha256
            await asyncio.sleep(0.2)
            after = sampler.rss()
    return {
        "size_mib": size / MIB,
        "chunk_kib": chunk / 1024,
        "rss_before_mib": before / MIB,
        "rss_peak_upload_mib": peak_up / MIB,
        "rss_peak_read_mib": peak_down / MIB,
        "rss_after_mib": after / MIB,
        "rss_growth_mib": (max(peak_up, peak_down) - before) / MIB,
        "upload_s": up_s,
        "read_s": down_s,
        "upload_mib_s": size / MIB / up_s,
        "read_mib_s": size / MIB / down_s,
        "byte_exact": True,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, default=1024, help="client chunk size (default 1 MiB)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fencepost-bench-") as tmp:
        srv = start_server(
            "fencepost",
            [str(BIN / "fencepost"), "serve", "--listen", "127.0.0.1:0", "--db", f"{tmp}/fp.db"],
            Path(tmp) / "server.log",
        )
        try:
            address = srv.wait_ready(r"fencepost serving on (\S+)")
            res = asyncio.run(
                transfer(address, srv.proc.pid, args.size_mib * MIB, args.chunk_kib * 1024)
            )
        finally:
            srv.stop()
    res["machine"] = machine()
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"artifact {res['size_mib']:.0f} MiB in {res['chunk_kib']:.0f} KiB chunks, byte-exact")
    print(
        f"server RSS: before {res['rss_before_mib']:.1f} MiB, peak upload "
        f"{res['rss_peak_upload_mib']:.1f} MiB, peak read {res['rss_peak_read_mib']:.1f} MiB, "
        f"after {res['rss_after_mib']:.1f} MiB -> growth {res['rss_growth_mib']:.1f} MiB"
    )
    print(
        f"upload {res['upload_s']:.2f} s ({res['upload_mib_s']:.0f} MiB/s), "
        f"read {res['read_s']:.2f} s ({res['read_mib_s']:.0f} MiB/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
