"""The nemesis: a fault schedule derived from the seed, and the means to
inflict it — SIGKILL + restart of the server (every other one a clean stop,
SIGTERM, instead: its start reads the index entries the stop saved), SIGSTOP/SIGCONT of worker
processes past their ttl, cut client connections (through a loopback TCP proxy
every worker talks through), and forward jumps of the server's clock (the
TestHooks service of a ``--test-hooks`` server).

With coordinators on PostgreSQL (``--store postgres``, torture/coordinators.py)
the faults aim at the leader and at the database instead: SIGKILL the leader
(a standby takes over; the supervisor restarts the killed one, which comes
back as a standby), SIGSTOP the leader for longer than the leader lease and
then SIGCONT it (it must find itself deposed and exit 3), jump the leader's
clock (past ``--max-clock-skew`` it must step down; within it, leases expire
early on its clock as with one server), kill -9 PostgreSQL and restart it,
restart it cleanly, and end a coordinator's database sessions
(``pg_terminate_backend``: the leader's write connection, its leadership
connection, all of its sessions, or every coordinator's write connection).
Worker pauses and client connection cuts stay as they are.

With coordinators leading shards apart (``--lead-shards``) there is no
leader to aim at: each coordinator fault strikes one coordinator picked by
the schedule — SIGKILL (its shards are taken once their leases run out; the
probes read every run once every shard is held by a live coordinator),
SIGSTOP past the shard lease then SIGCONT (it must find its shards taken),
SIGTERM, a planned hand-over (it gives its shards up at once and exits
0; the supervisor starts it again and the others hand its share back), a
jump of its clock (past ``--max-clock-skew`` it must give its shards up and
take none; it is restarted on the true clock ``SKEWED_HOLD_S`` later), and
a stall of its database sessions past the shard lease (it must find its
shards taken) — besides PostgreSQL kills, restarts and session cuts
(``SHARD_CUTS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from fencepost_server.storage.sql import SAVED_INDEX_READ, SAVED_INDEX_WRITTEN

# what the schedule draws; every other "kill" drawn becomes a "term" (a clean
# stop with SIGTERM; the PostgreSQL mode's "stop" is a SIGSTOP of the leader)
_DRAWN = ("kill", "pause", "cut", "clock")
KINDS = (*_DRAWN, "term")

# fault weights per profile (kill, pause, cut, clock) and the mean gap between faults
NEMESIS_PROFILES: dict[str, tuple[tuple[float, float, float, float], float]] = {
    "default": ((0.25, 0.25, 0.25, 0.25), 2.0),
    "kills": ((0.80, 0.05, 0.10, 0.05), 1.5),
    "none": ((0.0, 0.0, 0.0, 0.0), 0.0),
}


# the PostgreSQL mode's faults (see the module docstring)
PG_KINDS = ("kill", "stop", "pause", "cut", "clock", "pg-kill", "pg-restart", "pg-cut",
            "pg-stall")
ALL_KINDS = (*KINDS, *(k for k in PG_KINDS if k not in KINDS))
PG_PROFILES: dict[str, tuple[dict[str, float], float]] = {
    "default": ({"kill": 0.14, "stop": 0.14, "pause": 0.10, "cut": 0.08, "clock": 0.10,
                 "pg-kill": 0.08, "pg-restart": 0.08, "pg-cut": 0.16, "pg-stall": 0.12}, 3.0),
    "kills": ({"kill": 0.6, "stop": 0.2, "pg-kill": 0.2}, 3.0),
    # a leader deposed mid-batch, paused or with its database sessions stalled
    # (the self-test of the build without the epoch check)
    "deposed": ({"stop": 0.4, "pg-stall": 0.6}, 3.0),
    "none": ({}, 0.0),
}
# pg-cut: whose sessions end (LIKE patterns over application_name; {id}: the
# leader row's holder, i.e. the leader's identity)
PG_CUTS = ("fencepost-writer {id}", "fencepost-leadership {id}", "fencepost-%{id}",
           "fencepost-writer %")
# leading shards apart: the shard leases' session instead of the leader's
SHARD_CUTS = ("fencepost-writer {id}", "fencepost-shards {id}", "fencepost-%{id}",
              "fencepost-writer %")
SHARD_KINDS = ("kill", "stop", "term", "pause", "cut", "clock", "pg-kill", "pg-restart",
               "pg-cut", "pg-stall")
SHARD_PROFILES: dict[str, tuple[dict[str, float], float]] = {
    "default": ({"kill": 0.15, "stop": 0.13, "term": 0.15, "pause": 0.07, "cut": 0.07,
                 "clock": 0.10, "pg-kill": 0.07, "pg-restart": 0.07, "pg-cut": 0.12,
                 "pg-stall": 0.07}, 3.0),
    "kills": ({"kill": 0.5, "stop": 0.2, "term": 0.3}, 3.0),
    "none": ({}, 0.0),
}
CLOCK_SLACK_MS = 250  # past the skew bound by this much, a leader must step down
# leading shards apart, a coordinator whose clock left the bound stays up holding
# nothing (its clock never goes back): after this long it is restarted on the true
# clock, as an operator would once the clock is fixed
SKEWED_HOLD_S = 12.0


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
    restarts = 0
    t = rng.uniform(0.5, 1.5)
    while t < duration_s - 1.0:
        kind = rng.choices(_DRAWN, weights)[0]
        if kind == "kill":
            param = rng.uniform(0.05, 0.8)
            restarts += 1
            if restarts % 2 == 0:  # drawn the same way: the rest of the schedule is unchanged
                kind = "term"
        elif kind == "pause":
            param = max_ttl_ms / 1000 + rng.uniform(0.2, 1.5)
        elif kind == "clock":
            param = float(int(rng.uniform(0.5, 3.0) * max_ttl_ms))
        else:
            param = 0.0
        out.append(Fault(round(t, 3), kind, round(param, 3), rng.randrange(max(workers, 1))))
        t += rng.uniform(0.3, 2 * gap - 0.3)
    return out


def schedule_pg(seed: int, duration_s: float, profile: str, workers: int, max_ttl_ms: int,
                lease_s: float, skew_ms: int, shards: bool = False) -> list[Fault]:
    """The PostgreSQL mode's schedule, a pure function of the seed like ``schedule``.
    ``param``: kill and pg-kill: downtime s; stop and pg-stall: s (longer
    than the leader lease); pause: s; clock: ms (half of the jumps within the skew bound, half
    past it); ``target``: pause: worker index; pg-cut: which sessions (PG_CUTS);
    stop: odd = while the leader's writer has a transaction open (mid-batch);
    pg-stall: odd = mid-batch, even = mid-COMMIT. ``shards``: coordinators
    leading shards apart (SHARD_PROFILES; term: downtime s; kill, stop,
    term, clock and pg-stall strike the coordinator ``target`` modulo their
    number)."""
    weights, gap = (SHARD_PROFILES if shards else PG_PROFILES)[profile]
    if gap <= 0:
        return []
    kinds = list(weights)
    rng = random.Random(f"nemesis-pg-{seed}")
    out: list[Fault] = []
    t = rng.uniform(1.0, 2.0)
    while t < duration_s - 1.0:
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        target = rng.randrange(max(workers, 1))
        if kind in ("kill", "term"):
            param = rng.uniform(0.05, 0.8)
        elif kind == "stop":
            param = lease_s + rng.uniform(0.3, 2.0)
        elif kind == "pause":
            param = max_ttl_ms / 1000 + rng.uniform(0.2, 1.5)
        elif kind == "clock":
            bound = skew_ms or max_ttl_ms
            if rng.random() < 0.5:
                param = float(int(rng.uniform(0.1, 0.6) * bound))
            else:
                param = float(int(rng.uniform(1.5 * bound, max(2 * bound, 3 * max_ttl_ms))))
        elif kind == "pg-kill":
            param = rng.uniform(0.05, 1.5)
        elif kind == "pg-cut":
            param, target = 0.0, rng.randrange(len(PG_CUTS))
        elif kind == "pg-stall":
            param = lease_s + rng.uniform(0.3, 2.0)
        else:
            param = 0.0
        if kind in ("stop", "pg-stall") and profile == "deposed":
            target = 1  # the self-test: always mid-batch
        out.append(Fault(round(t, 3), kind, round(param, 3), target))
        t += rng.uniform(0.5, 2 * gap - 0.5)
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
    proxy: Proxy | None
    workers: list[Any]  # subprocess.Popen
    log: IO[str]
    # (restart number, kill time ns) -> what the probe found wrong in the index
    after_restart: Callable[[int, int], list[str]]
    clock_offset_ms: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ALL_KINDS, 0))
    cut_connections: int = 0
    paused: dict[int, float] = field(default_factory=dict)  # worker index -> resume at
    restarts: int = 0
    # the PostgreSQL mode: the coordinators (torture/coordinators.PgCluster)
    # instead of ``server``, and the SIGSTOPped ones: slot -> (resume at, pid)
    cluster: Any = None
    stopped: dict[int, tuple[float, int]] = field(default_factory=dict)
    stalled: list[tuple[float, list[int]]] = field(default_factory=list)  # (resume at, backends)
    # leading shards apart: the clock bound (ms), and the coordinators whose
    # clock left it: slot -> (restart at, pid)
    skew_ms: int = 0
    skewed: dict[int, tuple[float, int]] = field(default_factory=dict)

    @property
    def proxies(self) -> list[Proxy]:
        if self.cluster is not None:
            return list(self.cluster.proxies)
        return [self.proxy] if self.proxy is not None else []

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
        if self.cluster is not None and fault.kind != "pause":
            self.inflict_pg(fault, t)
            return
        if fault.kind in ("kill", "term"):
            self.kill_restart(fault.param, clean=fault.kind == "term")
        elif fault.kind == "pause":
            proc = self.workers[fault.target]
            if proc.poll() is None and fault.target not in self.paused:
                os.kill(proc.pid, signal.SIGSTOP)
                self.paused[fault.target] = time.monotonic() + fault.param
                self.record(kind="pause", t=t, worker=fault.target, seconds=fault.param)
            else:
                self.counts["pause"] -= 1
        elif fault.kind == "cut":
            n = sum(p.cut() for p in self.proxies)
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

    def kill_restart(self, downtime_s: float, clean: bool = False) -> None:
        """SIGKILL the server (``clean``: SIGTERM, a clean stop, SIGKILL only
        if it hangs), and start it again after ``downtime_s``."""
        t = time.monotonic_ns()
        assert self.proxy is not None
        self.proxy.held = True  # workers stay away until the probes have read
        extra: dict[str, Any] = {}
        if clean:
            stopping = self._log_size()
            extra["exit"] = self.server.stop(timeout=30)  # reaped
            # how many finished runs' ids the stop saved
            wrote = re.search(rf"(\d+) finished runs' ids {SAVED_INDEX_WRITTEN}",
                              self._log_since(stopping))
            extra["saved"] = int(wrote.group(1)) if wrote else None
        else:
            self.server.kill()  # SIGKILL, reaped
        killed = time.monotonic_ns()
        time.sleep(downtime_s)
        self.server.env["FENCEPOST_TEST_CLOCK_OFFSET_MS"] = str(self.clock_offset_ms)
        logged = self._log_size()
        self.server.start(timeout=60)
        up = time.monotonic_ns()
        # did this start read the saved index entries (after a kill -9: the
        # last ones saved, with the blocks changed since)?
        extra["saved_index"] = SAVED_INDEX_READ in self._log_since(logged)
        self.restarts += 1
        try:
            if found := self.after_restart(self.restarts, killed):
                extra["index"] = found
        finally:
            self.proxy.held = False
        self.record(kind="term" if clean else "kill", t=t, killed=killed, up=up,
                    restart=self.restarts, downtime_s=downtime_s, **extra)

    def _log_size(self) -> int:
        return self.server.log_path.stat().st_size if self.server.log_path.exists() else 0

    def _log_since(self, offset: int) -> str:
        """What the server logged past ``offset`` bytes."""
        with open(self.server.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

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

    # -- the PostgreSQL mode ---------------------------------------------------------

    def inflict_pg(self, fault: Fault, t: int) -> None:
        cl = self.cluster
        kind = fault.kind
        if cl.shards and kind in ("kill", "stop", "term", "pg-cut", "clock", "pg-stall"):
            self.inflict_shards(fault, t)
            return
        if kind == "cut":
            n = sum(p.cut() for p in self.proxies)
            self.cut_connections += n
            self.record(kind="cut", t=t, connections=n)
        elif kind == "pg-kill":
            self._unstall_all()  # their backends die with it
            cl.pg.kill()
            killed = time.monotonic_ns()
            time.sleep(fault.param)
            cl.pg.restart()
            self.record(kind="pg-kill", t=t, killed=killed, up=time.monotonic_ns(),
                        downtime_s=fault.param)
        elif kind == "pg-restart":
            self._unstall_all()  # a clean shutdown waits for every backend
            cl.pg.restart()
            self.record(kind="pg-restart", t=t, up=time.monotonic_ns())
        elif kind == "pg-cut":
            holder = cl.holder
            pattern = PG_CUTS[fault.target % len(PG_CUTS)]
            if "{id}" in pattern and not holder:
                self.skip(fault, t, "no leader has been elected yet")
                return
            like = pattern.format(id=holder)[:63]
            try:
                n = cl.cut_database(like)
            except Exception as exc:  # PostgreSQL is down or restarting: nothing was cut
                self.skip(fault, t, f"PostgreSQL did not answer: {exc!r}")
                return
            self.record(kind="pg-cut", t=t, pattern=like, holder=holder, connections=n)
        elif kind == "pg-stall":
            c = self._wait_leader(10.0)
            for _ in range(20):  # the watcher has read the leader row since it took over
                if c is None or f"/{c.pid}/" in cl.holder:
                    break
                time.sleep(0.05)
            if c is None or f"/{c.pid}/" not in cl.holder:
                self.skip(fault, t, "no coordinator was leading")
                return
            mid_commit = fault.target % 2 == 0
            backends = cl.stall(cl.holder, mid_commit=mid_commit, within_s=2.0)
            if not backends:
                self.skip(fault, t, "the leader wrote nothing within 2 s")
                return
            self.stalled.append((time.monotonic() + fault.param, backends))
            self.record(kind="pg-stall", t=t, at=time.monotonic_ns(), slot=c.slot, pid=c.pid,
                        backends=backends,
                        seconds=fault.param, mid_commit=mid_commit,
                        renewals=len(backends) > 1)
        else:  # kill, stop, clock: aimed at the leader
            c = self._wait_leader(10.0)
            if c is None:
                self.skip(fault, t, "no coordinator was leading")
                return
            if kind == "kill":
                self.kill_leader(c, fault.param, t)
            elif kind == "stop":
                pid = c.pid
                mid = bool(fault.target % 2) and f"/{pid}/" in cl.holder
                if not (mid and cl.stop_mid_batch(c, cl.holder, 2.0)):
                    mid = False
                    cl.stop(c)
                self.stopped[c.slot] = (time.monotonic() + fault.param, pid)
                self.record(kind="stop", t=t, at=time.monotonic_ns(), slot=c.slot, pid=pid,
                            seconds=fault.param, mid_batch=mid)
            elif kind == "clock":
                try:
                    now = cl.jump_clock(c, int(fault.param))
                except Exception as exc:  # it may or may not have moved: no expectation
                    self.record(kind="clock-failed", t=t, slot=c.slot, pid=c.pid,
                                ms=int(fault.param), error=repr(exc))
                    return
                self.record(kind="clock", t=t, at=time.monotonic_ns(), slot=c.slot, pid=c.pid,
                            ms=int(fault.param), offset=c.offset_ms, server_now=now)

    def kill_leader(self, c: Any, downtime_s: float, t: int) -> None:
        """SIGKILL the leader; once another serves, the probes read every run
        through it before any worker may reconnect (as ``kill_restart``: the
        proxies refuse new connections and drop the open ones meanwhile)."""
        self._kill_then_probe(c, downtime_s, t, lambda: self._wait_leader(30.0),
                              lambda new: {"leader": None if new is None else new.slot})

    def _kill_then_probe(self, c: Any, downtime_s: float, t: int, back: Callable[[], Any],
                         extra: Callable[[Any], dict[str, Any]] = lambda _: {}) -> None:
        """SIGKILL ``c`` with every proxy holding (and none still connected,
        to a coordinator that takes over); once ``back()`` says the cluster
        serves again, the probes read every run; record the kill."""
        cl = self.cluster
        for p in self.proxies:
            p.held = True
        dropped = sum(p.cut() for p in self.proxies)
        try:
            pid = cl.kill(c, downtime_s)
            killed = time.monotonic_ns()
            came = back()
            up = time.monotonic_ns()
            self.restarts += 1
            found = self.after_restart(self.restarts, killed) if came else []
        finally:
            for p in self.proxies:
                p.held = False
        self.record(kind="kill", t=t, slot=c.slot, pid=pid, killed=killed,
                    up=up if came else None, restart=self.restarts, downtime_s=downtime_s,
                    **extra(came), dropped=dropped, **({"index": found} if found else {}))

    # -- coordinators leading shards apart ---------------------------------------------

    def inflict_shards(self, fault: Fault, t: int) -> None:
        cl = self.cluster
        kind = fault.kind
        if kind == "pg-cut":
            c = self._running(fault.at_s)
            pattern = SHARD_CUTS[fault.target % len(SHARD_CUTS)]
            like = pattern.format(id=f"%/{c.pid if c is not None else 0}/%")[:63]
            try:
                n = cl.cut_database(like)
            except Exception as exc:  # PostgreSQL is down or restarting: nothing was cut
                self.skip(fault, t, f"PostgreSQL did not answer: {exc!r}")
                return
            self.record(kind="pg-cut", t=t, pattern=like, connections=n)
            return
        # a stall needs a coordinator with shards to write for
        c = self._running(fault.target, holding=kind == "pg-stall")
        if c is None:
            self.skip(fault, t, "no coordinator was running" + (
                " with shards" if kind == "pg-stall" else ""))
            return
        pid = c.pid
        # the shards it holds now, as the watcher last read the rows
        held = sorted(s for s, (_, h) in cl.owners.items() if f"/{pid}/" in h)
        if kind == "kill":
            self.kill_coordinator(c, fault.param, t)
        elif kind == "clock":
            try:
                now = cl.jump_clock(c, int(fault.param))
            except Exception as exc:  # it may or may not have moved: no expectation
                self.record(kind="clock-failed", t=t, slot=c.slot, pid=pid,
                            ms=int(fault.param), error=repr(exc))
                return
            if self.skew_ms and c.offset_ms > self.skew_ms and c.slot not in self.skewed:
                self.skewed[c.slot] = (time.monotonic() + SKEWED_HOLD_S, pid)
            self.record(kind="clock", t=t, at=time.monotonic_ns(), slot=c.slot, pid=pid,
                        ms=int(fault.param), offset=c.offset_ms, server_now=now, held=held)
        elif kind == "pg-stall":
            identity = next((h for _, h in cl.owners.values() if f"/{pid}/" in h), "")
            mid_commit = fault.target % 2 == 0
            backends = cl.stall(identity, mid_commit=mid_commit, within_s=2.0,
                                renewals="fencepost-shards")
            if not backends:
                self.skip(fault, t, "the coordinator wrote nothing within 2 s")
                return
            self.stalled.append((time.monotonic() + fault.param, backends))
            self.record(kind="pg-stall", t=t, at=time.monotonic_ns(), slot=c.slot, pid=pid,
                        backends=backends, seconds=fault.param, mid_commit=mid_commit,
                        renewals=len(backends) > 1, held=held)
        elif kind == "stop":
            identity = next((h for _, h in cl.owners.values() if f"/{pid}/" in h), "")
            mid = bool(fault.target % 2) and bool(identity)
            if not (mid and cl.stop_mid_batch(c, identity, 2.0)):
                mid = False
                cl.stop(c)
            self.stopped[c.slot] = (time.monotonic() + fault.param, pid)
            self.record(kind="stop", t=t, at=time.monotonic_ns(), slot=c.slot, pid=pid,
                        seconds=fault.param, mid_batch=mid)
        else:  # term: a planned hand-over; the supervisor starts it again
            c.down_until = time.monotonic() + fault.param
            c.signal(signal.SIGTERM)
            code = None
            if c.proc is not None:
                with contextlib.suppress(Exception):
                    code = c.proc.wait(30)
            self.record(kind="term", t=t, at=time.monotonic_ns(), slot=c.slot, pid=pid,
                        exit=code, downtime_s=fault.param)

    def _running(self, pick: float, holding: bool = False) -> Any:
        """A coordinator running now and not stopped (``holding``: and holding
        a shard): the ``pick``-th (modulo), or the next one after it; None
        when there is none."""
        cs = self.cluster.coordinators
        for i in range(len(cs)):
            c = cs[(int(pick) + i) % len(cs)]
            if c.running and not c.stopped and (not holding or any(
                    f"/{c.pid}/" in h for _, h in self.cluster.owners.values())):
                return c
        return None

    def kill_coordinator(self, c: Any, downtime_s: float, t: int) -> None:
        """SIGKILL one coordinator; once every shard is held by a live one,
        the probes read every run through them before any worker may
        reconnect (as ``kill_leader``)."""
        self._kill_then_probe(c, downtime_s, t, lambda: self._wait_settled(30.0))

    def _wait_settled(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.cluster.settled(0.0):
            self._resume_due()
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _wait_leader(self, timeout: float) -> Any:
        """The coordinator serving now, waiting up to ``timeout`` s (resuming
        paused processes on time meanwhile); None if none came."""
        deadline = time.monotonic() + timeout
        while True:
            self._resume_due()
            c = self.cluster.leader(0.0)
            if c is not None or time.monotonic() >= deadline:
                return c
            time.sleep(0.05)

    def skip(self, fault: Fault, t: int, why: str) -> None:
        self.counts[fault.kind] -= 1
        self.record(kind="skipped", t=t, fault=fault.kind, why=why)

    def _resume_due(self) -> None:
        now = time.monotonic()
        for idx, at in list(self.paused.items()):
            if now >= at:
                self._cont(idx)
        for slot, (at, pid) in list(self.stopped.items()):
            if now >= at:
                self._cont_coordinator(slot, pid)
        for stall in list(self.stalled):
            if now >= stall[0]:
                self._unstall(stall)
        for slot, (at, pid) in list(self.skewed.items()):
            if now >= at:
                self._restore_clock(slot, pid)

    def _restore_clock(self, slot: int, pid: int) -> None:
        """Restart a coordinator whose clock left the bound (SIGTERM: it holds
        nothing to hand over); the supervisor starts it on the true clock."""
        c = self.cluster.coordinators[slot]
        if c.pid == pid and c.stopped:
            return  # once it is resumed
        self.skewed.pop(slot, None)
        if c.pid != pid or not c.running:
            return  # restarted meanwhile
        t = time.monotonic_ns()
        c.signal(signal.SIGTERM)
        code = None
        if c.proc is not None:
            with contextlib.suppress(Exception):
                code = c.proc.wait(30)
        self.record(kind="clock-restart", t=t, slot=slot, pid=pid, exit=code)

    def _unstall_all(self) -> None:
        for stall in list(self.stalled):
            self._unstall(stall)

    def _unstall(self, stall: tuple[float, list[int]]) -> None:
        self.cluster.unstall(stall[1])
        self.stalled.remove(stall)
        self.record(kind="pg-unstall", t=time.monotonic_ns(), backends=stall[1])

    def _cont_coordinator(self, slot: int, pid: int) -> None:
        c = self.cluster.coordinators[slot]
        if c.pid == pid:
            self.cluster.cont(c)
        self.stopped.pop(slot, None)
        self.record(kind="cont", t=time.monotonic_ns(), slot=slot, pid=pid)

    def _cont(self, idx: int) -> None:
        proc = self.workers[idx]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        self.paused.pop(idx, None)
        self.record(kind="resume", t=time.monotonic_ns(), worker=idx)

    def resume_all(self) -> None:
        for idx in list(self.paused):
            self._cont(idx)
        for slot, (_, pid) in list(self.stopped.items()):
            self._cont_coordinator(slot, pid)
        self._unstall_all()
        for slot, (_, pid) in list(self.skewed.items()):  # a live cluster for the end
            self._restore_clock(slot, pid)
        for proc in self.workers:  # belt and braces: nobody stays stopped
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
