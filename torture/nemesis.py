"""The nemesis: a fault schedule derived from the seed, and the means to
inflict it — SIGKILL + restart of the server, SIGSTOP/SIGCONT of worker
processes past their ttl, cut client connections (through a loopback TCP proxy
every worker talks through), and forward jumps of the server's clock (the
TestHooks service of a ``--test-hooks`` server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

KINDS = ("kill", "pause", "cut", "clock")

# fault weights per profile (kill, pause, cut, clock) and the mean gap between faults
NEMESIS_PROFILES: dict[str, tuple[tuple[float, float, float, float], float]] = {
    "default": ((0.25, 0.25, 0.25, 0.25), 2.0),
    "kills": ((0.80, 0.05, 0.10, 0.05), 1.5),
    "none": ((0.0, 0.0, 0.0, 0.0), 0.0),
}


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the start
    kind: str
    param: float  # kill: downtime s; pause: duration s; clock: jump ms; cut: -
    target: int = -1  # pause: worker index


def schedule(seed: int, duration_s: float, profile: str, workers: int,
             max_ttl_ms: int) -> list[Fault]:
    """The fault schedule: a pure function of the seed (the interleaving of a
    run is not reproducible, the faults it suffers are)."""
    weights, gap = NEMESIS_PROFILES[profile]
    if gap <= 0:
        return []
    rng = random.Random(f"nemesis-{seed}")
    out: list[Fault] = []
    t = rng.uniform(0.5, 1.5)
    while t < duration_s - 1.0:
        kind = rng.choices(KINDS, weights)[0]
        if kind == "kill":
            param = rng.uniform(0.05, 0.8)
        elif kind == "pause":
            param = max_ttl_ms / 1000 + rng.uniform(0.2, 1.5)
        elif kind == "clock":
            param = float(int(rng.uniform(0.5, 3.0) * max_ttl_ms))
        else:
            param = 0.0
        out.append(Fault(round(t, 3), kind, round(param, 3), rng.randrange(max(workers, 1))))
        t += rng.uniform(0.3, 2 * gap - 0.3)
    return out


# -- the proxy ---------------------------------------------------------------------


class Proxy:
    """A loopback TCP proxy (own thread and loop) in front of the server. ``cut``
    resets every open connection; while ``held`` new connections are refused."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.held = False
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="torture-proxy",
                                        daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> Proxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        sock: socket.socket = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.held:
            _abort(writer)
            return
        try:
            ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            _abort(writer)
            return
        pair = (writer, uwriter)
        self._pairs.add(pair)
        try:
            await asyncio.gather(_pump(reader, uwriter), _pump(ureader, writer))
        finally:
            self._pairs.discard(pair)
            _abort(writer)
            _abort(uwriter)

    def cut(self) -> int:
        """Reset every open connection (both sides); returns how many."""

        async def go() -> int:
            pairs = list(self._pairs)
            for a, b in pairs:
                _abort(a)
                _abort(b)
            return len(pairs)

        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(10)

    def stop(self) -> None:
        async def go() -> None:
            if self._server is not None:
                self._server.close()
            for a, b in list(self._pairs):
                _abort(a)
                _abort(b)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(go(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _abort(w: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        w.transport.abort()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await src.read(65536)
            if not data:
                break
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        _abort(dst)


# -- inflicting faults ---------------------------------------------------------------


@dataclass
class Nemesis:
    """Runs a schedule against a server (a tests/system/_proc.ServerProc), the
    worker processes and the proxy; logs every fault as a JSON line."""

    server: Any
    proxy: Proxy
    workers: list[Any]  # subprocess.Popen
    log: IO[str]
    after_restart: Callable[[int, int], None]  # (restart number, kill time ns)
    clock_offset_ms: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    cut_connections: int = 0
    paused: dict[int, float] = field(default_factory=dict)  # worker index -> resume at
    restarts: int = 0

    def record(self, **entry: Any) -> None:
        self.log.write(json.dumps(entry) + "\n")
        self.log.flush()

    def run(self, faults: list[Fault], t0: float, stop: threading.Event) -> None:
        for fault in faults:
            while not stop.is_set():
                self._resume_due()
                wait = t0 + fault.at_s - time.monotonic()
                if wait <= 0:
                    break
                stop.wait(min(wait, 0.05))
            if stop.is_set():
                break
            self.inflict(fault)
        while not stop.is_set():  # resume paused workers on time
            self._resume_due()
            stop.wait(0.05)

    def inflict(self, fault: Fault) -> None:
        self.counts[fault.kind] += 1
        t = time.monotonic_ns()
        if fault.kind == "kill":
            self.kill_restart(fault.param)
        elif fault.kind == "pause":
            proc = self.workers[fault.target]
            if proc.poll() is None and fault.target not in self.paused:
                os.kill(proc.pid, signal.SIGSTOP)
                self.paused[fault.target] = time.monotonic() + fault.param
                self.record(kind="pause", t=t, worker=fault.target, seconds=fault.param)
            else:
                self.counts["pause"] -= 1
        elif fault.kind == "cut":
            n = self.proxy.cut()
            self.cut_connections += n
            self.record(kind="cut", t=t, connections=n)
        elif fault.kind == "clock":
            try:
                now = self.jump_clock(int(fault.param))
            except Exception as exc:  # the jump may or may not have happened: resync
                self.record(kind="clock-failed", t=t, error=repr(exc))
                now = self.jump_clock(0, resync=True)
            self.record(kind="clock", t=t, ms=int(fault.param), offset=self.clock_offset_ms,
                        server_now=now)

    def kill_restart(self, downtime_s: float) -> None:
        t = time.monotonic_ns()
        self.proxy.held = True  # workers stay away until the probes have read
        self.server.kill()  # SIGKILL, reaped
        killed = time.monotonic_ns()
        time.sleep(downtime_s)
        self.server.env["FENCEPOST_TEST_CLOCK_OFFSET_MS"] = str(self.clock_offset_ms)
        self.server.start(timeout=60)
        up = time.monotonic_ns()
        self.restarts += 1
        try:
            self.after_restart(self.restarts, killed)
        finally:
            self.proxy.held = False
        self.record(kind="kill", t=t, killed=killed, up=up, restart=self.restarts,
                    downtime_s=downtime_s)

    def jump_clock(self, ms: int, resync: bool = False) -> int:
        """Jump the server's clock; remember the offset so a restart keeps it
        (the server's clock never goes back, as a jumped wall clock would not)."""
        from fencepost.v1 import testing_pb2, testing_pb2_grpc

        with self.server.channel() as ch:
            stub = testing_pb2_grpc.TestHooksStub(ch)
            now = stub.JumpClock(testing_pb2.JumpClockRequest(ms=ms), timeout=30).now_ms
        if resync:  # from the server's answer, rounded up: ahead is harmless, behind is not
            self.clock_offset_ms = max(self.clock_offset_ms,
                                       int(now) - time.time_ns() // 1_000_000 + 50)
        else:
            self.clock_offset_ms += ms
        return int(now)

    def _resume_due(self) -> None:
        now = time.monotonic()
        for idx, at in list(self.paused.items()):
            if now >= at:
                self._cont(idx)

    def _cont(self, idx: int) -> None:
        proc = self.workers[idx]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        self.paused.pop(idx, None)
        self.record(kind="resume", t=time.monotonic_ns(), worker=idx)

    def resume_all(self) -> None:
        for idx in list(self.paused):
            self._cont(idx)
        for proc in self.workers:  # belt and braces: nobody stays stopped
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
