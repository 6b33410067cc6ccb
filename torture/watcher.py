"""The torture run's watcher: one process that watches every run through the
Python SDK, ``fencepost.Client(<the workers' addresses>).watch(cursor=...)``,
for the whole run, and records every change it is given (``watch.jsonl``),
for the ``watch`` checker (torture/watching.py).

It is a user of the SDK, nothing more: it survives the faults by the SDK's
own resuming; when the SDK gives up (``UnavailableError`` after a long
outage) it starts a new watch from its cursor, and records that it did.
Every 7-13 s (seeded) it restarts as a client process would: it ends its
watch and closes its client, saves ``cursor.encode()``, and resumes with a
new client from ``WatchCursor.decode(saved)``.

Protocol with the runner: once the watch covers every shard (each has a
cursor, so every change committed from then on must be delivered) it prints
``ready COUNT`` on stdout, and the runner starts the workers. At the end the
runner writes ``{"upto": {SHARD: REVISION}}`` on stdin, each shard's last
committed revision: the watcher reads on until its cursor reaches all of
them (at most ``CATCH_UP_S``), records how that went and exits 0. End of
stdin without it: the run was abandoned, it exits at once.

``watch.jsonl``, one JSON object a line, ``t`` in CLOCK_MONOTONIC ns:

* ``start`` (``n``: the watch's number, ``cursor``: where it resumes),
  ``ready`` (``count``, ``cursor``: where each shard began),
  ``ev`` (``n``, ``rev``, ``shard``, ``run``, ``kind`` put/delete, and for a
  put ``ver``, ``tok``, ``st`` (status), ``own`` (lease owner or null)),
  ``restart`` (``cursor`` as saved), ``error`` (``type``, ``msg``,
  ``cursor``: the watch raised, a new one starts from the cursor),
  ``target`` (``upto``), ``caught-up`` / ``behind`` (``seconds``,
  ``cursor``), ``abandoned``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import fencepost
from fencepost import FencepostError, WatchCursor

RESTART_EVERY_S = (7.0, 13.0)  # a planned restart from a saved cursor, about every 10 s
CATCH_UP_S = 30.0  # at the end: the bound on reading every committed change
RESUME_PAUSE_S = 0.2  # after a watch raised, before the next one starts
TICK_S = 0.05


class Recorder:
    def __init__(self, f: IO[str]) -> None:
        self._f = f

    def write(self, **entry: Any) -> None:
        entry.setdefault("t", time.monotonic_ns())
        self._f.write(json.dumps(entry) + "\n")


def event_entry(n: int, ev: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"k": "ev", "n": n, "rev": ev.revision, "shard": ev.shard,
                         "run": ev.run_id, "kind": str(ev.kind)}
    rec = ev.record
    if rec is not None:
        e.update(ver=rec.version, tok=rec.fencing_token, st=str(rec.status),
                 own=rec.lease.owner if rec.lease is not None else None)
    return e


class Watcher:
    def __init__(self, cfg: dict[str, Any], rec: Recorder) -> None:
        self.addrs = cfg["addr"]
        self.rng = random.Random(f"watch-{cfg['seed']}")
        certs = cfg.get("certs")
        self.tls = None if not certs else fencepost.TLS(
            ca=Path(certs) / "ca.pem", cert=Path(certs) / f"{cfg['name']}.pem",
            key=Path(certs) / f"{cfg['name']}-key.pem")
        self.rec = rec
        self.cursor = WatchCursor()
        self.count = 0
        self.ready = False
        self.n = 0
        self.target: dict[int, int] | None = None
        self.target_at = 0.0
        self.abandoned = False

    # -- the runner's orders (stdin, read by a thread) ----------------------------------

    def listen(self, loop: asyncio.AbstractEventLoop) -> None:
        def read() -> None:
            for line in sys.stdin:
                if line.strip():
                    upto = {int(s): int(r) for s, r in json.loads(line)["upto"].items()}
                    loop.call_soon_threadsafe(self._aim, upto)
                    return
            loop.call_soon_threadsafe(self._abandon)

        threading.Thread(target=read, name="watcher-stdin", daemon=True).start()

    def _aim(self, upto: dict[int, int]) -> None:
        self.target, self.target_at = upto, time.monotonic()
        self.rec.write(k="target", upto=upto)

    def _abandon(self) -> None:
        self.abandoned = True

    def caught_up(self) -> bool:
        revs = self.cursor.revisions
        return self.target is not None and all(
            revs.get(s, 0) >= top for s, top in self.target.items())

    def late(self) -> bool:
        return self.target is not None and time.monotonic() - self.target_at > CATCH_UP_S

    # -- watching -------------------------------------------------------------------------

    async def run(self) -> None:
        self.listen(asyncio.get_running_loop())
        while not self.abandoned:
            if self.caught_up() or self.late():
                break
            self.n += 1
            self.rec.write(k="start", n=self.n, cursor=self.cursor.encode())
            planned = False
            async with fencepost.Client(self.addrs, tls=self.tls) as client:
                try:
                    if not self.count:
                        self.count = (await client.shards()).shard_count
                    planned = await self.watch(client)
                except FencepostError as exc:
                    self.rec.write(k="error", n=self.n, type=type(exc).__name__, msg=str(exc),
                                   cursor=self.cursor.encode())
                except Exception as exc:  # not the SDK's: recorded; the checker reports it
                    self.rec.write(k="error", n=self.n, type=type(exc).__name__,
                                   msg=repr(exc), cursor=self.cursor.encode(), bug=True)
            if planned:  # a client process restarting: all it keeps is the saved text
                saved = self.cursor.encode()
                self.rec.write(k="restart", n=self.n, cursor=saved)
                self.cursor = WatchCursor.decode(saved)
            elif not (self.caught_up() or self.late() or self.abandoned):
                await asyncio.sleep(RESUME_PAUSE_S)
        if self.abandoned:
            self.rec.write(k="abandoned", cursor=self.cursor.encode())
        elif self.caught_up():
            self.rec.write(k="caught-up", cursor=self.cursor.encode(),
                           seconds=round(time.monotonic() - self.target_at, 3))
        else:
            self.rec.write(k="behind", cursor=self.cursor.encode(),
                           seconds=round(time.monotonic() - self.target_at, 3))

    async def watch(self, client: fencepost.Client) -> bool:
        """One watch, until it is time for a planned restart (True), the
        catch-up is over, or the run is abandoned (False); raises what the
        watch raised."""
        n = self.n
        loop = asyncio.get_running_loop()
        restart_at = (loop.time() + self.rng.uniform(*RESTART_EVERY_S)
                      if self.ready and self.target is None else None)
        events = client.watch(cursor=self.cursor)

        async def consume() -> None:
            async for ev in events:
                self.rec.write(**event_entry(n, ev))
                if self.caught_up():
                    return

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait([task], timeout=TICK_S)
                if not self.ready and len(self.cursor.revisions) == self.count:
                    self.ready = True
                    self.rec.write(k="ready", count=self.count, cursor=self.cursor.encode())
                    print("ready", self.count, flush=True)
                    restart_at = loop.time() + self.rng.uniform(*RESTART_EVERY_S)
                if self.abandoned or self.caught_up() or self.late():
                    return False
                if self.target is not None:
                    restart_at = None  # catching up: no more planned restarts
                if restart_at is not None and loop.time() >= restart_at:
                    return True
            task.result()  # what ended it (the SDK raised, or the catch-up is done)
            return False
        finally:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            await events.aclose()


def main(cfg: dict[str, Any]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with open(Path(cfg["out_dir"]) / "watch.jsonl", "w", buffering=1) as f:
        asyncio.run(Watcher(cfg, Recorder(f)).run())
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
