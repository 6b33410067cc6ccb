"""Many leases: 10 000 leases kept alive over 10 KeepAlive streams (ttl 3 s, 60 s).

The issue: "10 000 leases over 10 streams, ttl 3 s, for 60 s — none lost;
server CPU and RSS recorded". One fencepost server (``--durability full``,
fresh database) and P client processes (default 2, ``spawn``). Each process
runs S/P simulated workers (owners); each owner has its own channel (HTTP/2
connection) and ONE KeepAlive stream (``hello{owner}``), and holds L/S leases.

1. **Ramp (not measured):** every owner opens its stream and Acquires its
   leases (unary, at most ``--acquire-concurrency`` in flight per process;
   ``--ramp execute``: over one Execute stream per owner, 512 commands a
   message, at most 4,096 unanswered), with a long ttl
   (``--acquire-ttl-ms``, default 120 s) so that the ramp
   needs no renewals. (With ttl 3 s from the start the renewals of the leases
   acquired first starve the later Acquires on this machine: the ramp of
   10 000 never finishes.)
2. **Measured window** of ``--duration`` seconds (default 60), started by the
   parent once every process has all its leases. Each lease's first renewal is
   spread evenly over the window's first third of a ttl, and sets the ttl to
   3 s (``KeepAliveRenew.lease_ttl_ms``); every later one is sent a third of
   the ttl after the previous renewal was *sent*, with at most one renewal in
   flight per lease (a late answer delays the next send; nothing piles up).
   Safe-until is kept as docs/STREAMS.md says: ``t_sent + ttl_remaining_ms``.
   Renewals answered inside the window give renewals/s and the latency (send
   to ``renewed``) percentiles.

The client processes freeze and disable CPython's cyclic garbage collector
for the window: each holds L/P leases, and its full collections would stall
its event loop for tens of milliseconds, counted as renewal latency although
the server had answered.

Counted over the window: ``renewed``, ``lost``, ``expiring``, ``error``,
streams that ended. Two margins, the smallest seen: the *commit margin* = the
lease's previous ``expires_at`` minus the server's clock at the renewal's
commit (``expires_at - ttl`` of the answer): how close the lease came to
expiring on the server, negative when it lapsed; the *safe margin* = the
previous safe-until minus the monotonic clock at that answer (how close the
worker came to having to stop). The latency is also split at the commit:
commit to ``renewed`` received (wall clock; server and clients share this
host). Pass = no ``lost``, no ``expiring``, no ``error``, no stream ended.

The parent samples the server's CPU (cores) and RSS, and the writer's queue
depth, once a second, and reads the writer counters at the window's edges
(mean batch). Load average and others' CPU are recorded for the window.

    .venv/bin/python bench/streams_leases.py [--leases 10000] [--streams 10] [--ttl-ms 3000]
        [--duration 60] [--procs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import json
import math
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from array import array
from dataclasses import asdict, dataclass, field
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import grpc
import psutil
from benchlib import ArgumentAdder, fmt_rate, scrape_counters
from e2e import _stop_processes
from streams_common import (
    WRITER_COUNTERS,
    CpuWindow,
    WriterDelta,
    distribution_ms,
    fmt_load,
    scrape_gauge,
    start_fencepost,
    writer_delta,
)

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

CONNECT_TIMEOUT_S = 20.0
RPC_TIMEOUT_S = 30.0
EXECUTE_CHUNK = 512  # --ramp execute: Acquires per message
EXECUTE_WINDOW = 4096  # and unanswered at most (the server's --max-inflight-per-stream)

# -- the client processes ------------------------------------------------------------


@dataclass(frozen=True)
class ClientConfig:
    address: str
    proc_index: int
    owners: list[str]
    leases_per_owner: int
    ttl_ms: int
    renew_every_s: float
    acquire_concurrency: int
    max_ramp_s: float
    acquire_ttl_ms: int
    coalesce_s: float = 0.05  # renewals due within this window share a message; 0: one each
    ramp: str = "unary"  # or "execute": the Acquires over one Execute stream per owner


@dataclass
class ClientResult:
    proc_index: int
    leases: int = 0
    acquired: int = 0
    acquire_errors: int = 0
    ramp_s: float = 0.0
    # up to the window's end (no renewal is sent before the window)
    renewed: int = 0
    lost: int = 0
    expiring: int = 0
    errors: int = 0
    samples: list[str] = field(default_factory=list)
    streams_ended: int = 0
    latencies: bytes = b""  # array('d') of seconds, send to `renewed`
    commit_to_answer: bytes = b""  # array('d') of seconds, the commit to `renewed` arriving
    lapsed: int = 0  # renewals committed after the lease's previous expiry
    min_server_margin_ms: float = float("inf")
    min_safe_margin_s: float = float("inf")
    in_flight_at_end: int = 0
    window_s: float = 0.0
    after_window: dict[str, int] = field(default_factory=dict)  # messages after the window


@dataclass
class _Lease:
    token: int
    expires_ms: float  # server wall clock, ms
    safe_until: float  # monotonic
    sent_at: float = 0.0  # monotonic; 0 when no renewal is in flight


class _Window:
    def __init__(self) -> None:
        self.begin = float("inf")
        self.end = float("inf")


def _ts_ms(ts: Any) -> float:
    return ts.seconds * 1000.0 + ts.nanos / 1e6


class _Owner:
    """One simulated worker: its channel, its KeepAlive stream and its leases."""

    def __init__(self, name: str, address: str, cfg: ClientConfig, res: ClientResult,
                 win: _Window, lat: array[float], commit_to_answer: array[float]) -> None:
        self.name = name
        self.cfg = cfg
        self.res = res
        self.win = win
        self.lat = lat
        self.commit_to_answer = commit_to_answer
        # its own connection: gRPC shares one between a process's channels to
        # one address, and the server bounds the leases tracked per connection
        self.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = ledger_pb2_grpc.LedgerStub(self.channel)
        self.leases: dict[str, _Lease] = {}
        self.due: list[tuple[float, str]] = []
        self.wakeup = asyncio.Event()
        self.call: Any = None
        self.reader: asyncio.Task[None] | None = None

    def sample(self, text: str) -> None:
        if len(self.res.samples) < 10:
            self.res.samples.append(f"{self.name}: {text}")

    async def open(self) -> None:
        self.call = self.stub.KeepAlive()
        await self.call.write(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner=self.name)))
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                for one in msg.batch or [msg]:  # the server coalesces answers
                    self._on_message(one)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.res.streams_ended += 1
                self.sample(f"stream ended {exc.code().name}: {exc.details()}")
            return
        self.res.streams_ended += 1
        self.sample("stream ended by the server (OK)")

    def _on_message(self, msg: Any) -> None:
        now = time.monotonic()
        kind = msg.WhichOneof("kind")
        if now >= self.win.end:
            # after the window no renewal is sent: answers to the last ones are
            # fine, but an `expiring` now says nothing about the bench
            self.res.after_window[kind] = self.res.after_window.get(kind, 0) + 1
            if kind == "renewed":
                lease = self.leases.get(msg.renewed.run_id)
                if lease is not None:
                    lease.sent_at = 0.0
            return
        if kind == "renewed":
            r = msg.renewed
            lease = self.leases.get(r.run_id)
            if lease is None or lease.sent_at == 0.0:
                self.sample(f"unexpected renewed for {r.run_id}")
                return
            wall_ms = time.time() * 1000.0
            new_expires_ms = _ts_ms(r.expires_at)
            # the server sets expires_at = its now + ttl at the commit: when it committed
            commit_ms = new_expires_ms - self.cfg.ttl_ms
            server_margin = lease.expires_ms - commit_ms
            safe_margin = lease.safe_until - now
            res = self.res
            res.renewed += 1
            self.lat.append(now - lease.sent_at)
            self.commit_to_answer.append((wall_ms - commit_ms) / 1000.0)
            res.min_server_margin_ms = min(res.min_server_margin_ms, server_margin)
            res.min_safe_margin_s = min(res.min_safe_margin_s, safe_margin)
            if server_margin < 0:
                res.lapsed += 1
            lease.expires_ms = new_expires_ms
            lease.safe_until = lease.sent_at + r.ttl_remaining_ms / 1000.0
            self._schedule(r.run_id, lease.sent_at + self.cfg.renew_every_s)
            lease.sent_at = 0.0
        elif kind == "lost":
            self.res.lost += 1
            self.sample(f"lost {msg.lost.run_id} reason {pb.LostReason.Name(msg.lost.reason)}")
            self.leases.pop(msg.lost.run_id, None)
        elif kind == "expiring":
            self.res.expiring += 1
            self.sample(f"expiring {msg.expiring.run_id}")
        elif kind == "error":
            e = msg.error
            self.res.errors += 1
            self.sample(f"error {e.run_id} {e.code}: {e.message}")
            lease = self.leases.get(e.run_id)
            if lease is not None and lease.sent_at:
                self._schedule(e.run_id, lease.sent_at + self.cfg.renew_every_s)
                lease.sent_at = 0.0

    def _schedule(self, run_id: str, due: float) -> None:
        heapq.heappush(self.due, (due, run_id))
        if due <= self.due[0][0]:
            self.wakeup.set()

    async def acquire(self, run_id: str, sem: asyncio.Semaphore) -> None:
        async with sem:
            t_sent = time.monotonic()
            try:
                r = await self.stub.Acquire(
                    pb.AcquireRequest(run_id=run_id, owner=self.name,
                                      lease_ttl_ms=self.cfg.acquire_ttl_ms),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                self.res.acquire_errors += 1
                self.sample(f"acquire {run_id}: {exc.code().name} {exc.details()}")
                return
        self.res.acquired += 1
        self.leases[run_id] = _Lease(
            token=r.run.fencing_token,
            expires_ms=_ts_ms(r.run.lease.expires_at),
            safe_until=t_sent + self.cfg.acquire_ttl_ms / 1000.0,
        )

    async def acquire_execute(self, run_ids: list[str]) -> None:
        """Acquire ``run_ids`` over one Execute stream on this owner's channel,
        at most EXECUTE_WINDOW unanswered (the server's per-stream limit)."""
        call = self.stub.Execute()
        sent_at: dict[int, float] = {}
        room = asyncio.Event()

        async def feed() -> None:
            for i in range(0, len(run_ids), EXECUTE_CHUNK):
                while len(sent_at) + EXECUTE_CHUNK > EXECUTE_WINDOW:
                    room.clear()
                    await room.wait()
                part = run_ids[i:i + EXECUTE_CHUNK]
                now = time.monotonic()
                cmds = []
                for j, run_id in enumerate(part, start=i + 1):
                    sent_at[j] = now
                    cmds.append(pb.Command(id=j, acquire=pb.AcquireRequest(
                        run_id=run_id, owner=self.name, lease_ttl_ms=self.cfg.acquire_ttl_ms)))
                await call.write(pb.ExecuteRequest(commands=cmds))

        feeder = asyncio.create_task(feed())
        answered = 0
        try:
            while answered < len(run_ids):
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise RuntimeError(f"{self.name}: the Execute stream ended in the ramp")
                for r in resp.results:
                    t_sent = sent_at.pop(r.id)
                    run_id = run_ids[r.id - 1]
                    answered += 1
                    if r.WhichOneof("kind") != "acquire":
                        self.res.acquire_errors += 1
                        self.sample(f"acquire {run_id}: {r.error.message}")
                        continue
                    run = r.acquire.run
                    self.res.acquired += 1
                    self.leases[run_id] = _Lease(
                        token=run.fencing_token, expires_ms=_ts_ms(run.lease.expires_at),
                        safe_until=t_sent + self.cfg.acquire_ttl_ms / 1000.0)
                room.set()
            await feeder
        finally:
            feeder.cancel()
            call.cancel()

    def schedule_first(self, begin: float) -> None:
        """First renewals spread evenly over [begin, begin + a third of the ttl)."""
        n = len(self.leases)
        for j, run_id in enumerate(self.leases):
            self._schedule(run_id, begin + j * self.cfg.renew_every_s / n)

    async def renew_loop(self, stop_at: list[float]) -> None:
        """Send each lease's renewal when it is due, until ``stop_at[0]``."""
        while True:
            now = time.monotonic()
            if now >= stop_at[0]:
                return
            horizon = now + self.cfg.coalesce_s
            batch: list[Any] = []
            while self.due and self.due[0][0] <= horizon:
                _, run_id = heapq.heappop(self.due)
                lease = self.leases.get(run_id)
                if lease is None or lease.sent_at:
                    continue  # lost, or (cannot happen) already in flight
                lease.sent_at = time.monotonic()
                renew = pb.KeepAliveRenew(run_id=run_id, fencing_token=lease.token,
                                          lease_ttl_ms=self.cfg.ttl_ms)
                if self.cfg.coalesce_s <= 0:  # one message per renewal
                    await self.call.write(pb.KeepAliveRequest(renew=renew))
                else:
                    batch.append(renew)
            if batch:  # everything due within the window: one message
                await self.call.write(pb.KeepAliveRequest(renews=batch))
            now = time.monotonic()
            delay = min(0.05, stop_at[0] - now)
            if self.due:
                delay = min(delay, self.due[0][0] - now)
            self.wakeup.clear()
            if delay > 0:
                try:
                    await asyncio.wait_for(self.wakeup.wait(), delay)
                except TimeoutError:
                    pass

    async def close(self) -> None:
        self.res.in_flight_at_end += sum(1 for x in self.leases.values() if x.sent_at)
        if self.call is not None:
            self.call.cancel()
        if self.reader is not None:
            try:
                await self.reader
            except asyncio.CancelledError:
                pass
        await self.channel.close(None)


async def _client_main(cfg: ClientConfig, go: MpEvent, window_at: Any, window_set: MpEvent,
                       ready: Any, progress: Any) -> ClientResult:
    res = ClientResult(proc_index=cfg.proc_index,
                       leases=len(cfg.owners) * cfg.leases_per_owner)
    win = _Window()
    lat: array[float] = array("d")
    c2a: array[float] = array("d")
    owners = [_Owner(name, cfg.address, cfg, res, win, lat, c2a) for name in cfg.owners]
    try:
        for o in owners:
            await asyncio.wait_for(o.channel.channel_ready(), CONNECT_TIMEOUT_S)
        ready.put(cfg.proc_index)
        if not await asyncio.to_thread(go.wait, CONNECT_TIMEOUT_S * 2):
            raise RuntimeError("never told to start")
        for o in owners:
            await o.open()
        t0 = time.monotonic()
        if cfg.ramp == "execute":
            acquires = [o.acquire_execute([f"{o.name}-l{i:05d}"
                                           for i in range(cfg.leases_per_owner)])
                        for o in owners]
        else:
            sem = asyncio.Semaphore(cfg.acquire_concurrency)
            acquires = [
                o.acquire(f"{o.name}-l{i:05d}", sem)
                for i in range(cfg.leases_per_owner) for o in owners
            ]
        await asyncio.wait_for(asyncio.gather(*acquires), cfg.max_ramp_s)
        res.ramp_s = time.monotonic() - t0
        progress.put(("acquired", cfg.proc_index, res.acquired, res.ramp_s))
        # the parent sets the window (wall clock, shared) once every process has its leases
        if not await asyncio.to_thread(window_set.wait, cfg.max_ramp_s + 60):
            raise RuntimeError("no window was set")
        offset = time.time() - time.monotonic()
        win.begin = window_at[0] - offset
        win.end = window_at[1] - offset
        for o in owners:
            o.schedule_first(win.begin)
        # A load process holds tens of thousands of leases (a fleet spreads them
        # over many processes); its own cyclic collections would stall its
        # loop and be counted as the server's latency. The window is bounded.
        gc.freeze()
        gc.disable()
        stop_at = [win.end]
        renewers = [asyncio.create_task(o.renew_loop(stop_at)) for o in owners]
        try:
            await asyncio.gather(*renewers)
        finally:
            for t in renewers:
                t.cancel()
        res.window_s = win.end - win.begin
        # answers still in flight get up to a ttl to come back (counted, not in the window)
        for _ in range(int(cfg.ttl_ms / 50)):
            if not any(x.sent_at for o in owners for x in o.leases.values()):
                break
            await asyncio.sleep(0.05)
    finally:
        for o in owners:
            await o.close()
    res.latencies = lat.tobytes()
    res.commit_to_answer = c2a.tobytes()
    return res


def client_process(cfg: ClientConfig, go: MpEvent, window_at: Any, window_set: MpEvent,
                   ready: Any, progress: Any, out: Any) -> None:
    try:
        out.put(asyncio.run(_client_main(cfg, go, window_at, window_set, ready, progress)))
    except BaseException as exc:
        failure = RuntimeError(f"client process {cfg.proc_index} failed: {exc!r}")
        ready.put(failure)
        progress.put(failure)
        out.put(failure)
        raise


# -- the parent ---------------------------------------------------------------------------


@dataclass
class LeasesConfig:
    leases: int = 10_000
    streams: int = 10
    procs: int = 2
    ttl_ms: int = 3_000
    duration_s: float = 60.0
    acquire_concurrency: int = 64
    max_ramp_s: float = 120.0
    acquire_ttl_ms: int = 120_000
    coalesce_ms: float = 50.0  # renewals due within this window share one message; 0: one each
    ramp: str = "unary"  # or "execute" (ClientConfig.ramp)
    settle_s: float = 1.0  # from the ramp's end to the window


def _counters(port: int) -> dict[str, float] | None:
    """The writer counters, or None when the server does not answer in 30 s."""
    try:
        return scrape_counters(port, WRITER_COUNTERS, timeout=30.0)
    except OSError as exc:
        print(f"  warning: /metrics did not answer: {exc!r}", flush=True)
        return None


class _Sampler:
    """Once a second: server CPU (cores), RSS, the writer's queue depth."""

    def __init__(self, pid: int, metrics_port: int) -> None:
        self.ps = psutil.Process(pid)
        self.metrics_port = metrics_port
        self.t0 = time.monotonic()
        self.last_t = self.t0
        self.last_cpu = self._cpu()
        self.rows: list[dict[str, float]] = []
        self.next_at = self.t0 + 1.0

    def _cpu(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def maybe_sample(self, phase: str) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + 1.0
        cpu = self._cpu()
        try:
            depth = scrape_gauge(self.metrics_port, "fencepost_writer_queue_depth")
        except (OSError, RuntimeError):
            depth = -1.0
        self.rows.append({
            "t": round(now - self.t0, 2),
            "phase": phase,  # type: ignore[dict-item]
            "cpu": (cpu - self.last_cpu) / (now - self.last_t),
            "rss_mib": self.rss_mib(),
            "queue_depth": depth,
        })
        self.last_t, self.last_cpu = now, cpu

    def sleep_until(self, t_mono: float, phase: str) -> None:
        while True:
            now = time.monotonic()
            if now >= t_mono:
                return
            self.maybe_sample(phase)
            time.sleep(max(0.0, min(self.next_at, t_mono) - time.monotonic()))


def run_leases(cfg: LeasesConfig) -> dict[str, Any]:
    ttl_s = cfg.ttl_ms / 1000
    print(f"many leases: {cfg.leases:,} leases over {cfg.streams} KeepAlive streams in "
          f"{cfg.procs} client processes, ttl {ttl_s:g} s, renewed every {ttl_s / 3:g} s, "
          f"measured {cfg.duration_s:g} s", flush=True)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    window_at = ctx.Array("d", [0.0, 0.0])
    window_set = ctx.Event()
    ready, progress, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    owners = [f"lease-owner-{i:02d}" for i in range(cfg.streams)]
    per_owner = cfg.leases // cfg.streams
    workers: list[SpawnProcess] = []
    results: list[ClientResult] = []
    with tempfile.TemporaryDirectory(prefix="fencepost-bench-") as tmp:
        srv, mport = start_fencepost(Path(tmp), 0)
        try:
            sampler = _Sampler(srv.proc.pid, mport)
            rss_start = sampler.rss_mib()
            for i in range(cfg.procs):
                ccfg = ClientConfig(
                    address=srv.address, proc_index=i, owners=owners[i::cfg.procs],
                    leases_per_owner=per_owner, ttl_ms=cfg.ttl_ms,
                    renew_every_s=ttl_s / 3, acquire_concurrency=cfg.acquire_concurrency,
                    max_ramp_s=cfg.max_ramp_s, acquire_ttl_ms=cfg.acquire_ttl_ms,
                    coalesce_s=cfg.coalesce_ms / 1000, ramp=cfg.ramp,
                )
                w = ctx.Process(target=client_process,
                                args=(ccfg, go, window_at, window_set, ready, progress, out),
                                name=f"bench-leases-{i}", daemon=True)
                w.start()
                workers.append(w)
            for _ in workers:
                got = ready.get(timeout=CONNECT_TIMEOUT_S + 30)
                if isinstance(got, BaseException):
                    raise got
            t_ramp = time.monotonic()
            go.set()
            acquired = 0
            pending = len(workers)
            deadline = time.monotonic() + cfg.max_ramp_s + 10
            while pending:
                sampler.maybe_sample("ramp")
                if time.monotonic() > deadline:
                    raise RuntimeError("the client processes did not acquire their leases")
                try:
                    msg = progress.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(msg, BaseException):
                    raise msg
                acquired += msg[2]
                pending -= 1
            ramp_s = time.monotonic() - t_ramp
            rss_ramp = sampler.rss_mib()
            print(f"  ramp: {acquired:,} leases acquired in {ramp_s:.1f} s; server RSS "
                  f"{rss_ramp:.0f} MiB", flush=True)
            begin = time.time() + cfg.settle_s
            window_at[0], window_at[1] = begin, begin + cfg.duration_s
            window_set.set()
            sampler.sleep_until(time.monotonic() + (begin - time.time()), "ramp")
            cpu = CpuWindow(srv.proc.pid, [w.pid for w in workers if w.pid is not None])
            m0 = _counters(mport)
            n_rows = len(sampler.rows)
            sampler.sleep_until(time.monotonic() + (window_at[1] - time.time()), "window")
            use = cpu.stop()
            m1 = _counters(mport)
            rss_end = sampler.rss_mib()
            window_rows = sampler.rows[n_rows:]
            for _ in workers:
                got = out.get(timeout=RPC_TIMEOUT_S + 30)
                if isinstance(got, BaseException):
                    raise got
                results.append(got)
        finally:
            _stop_processes(workers)
            code = srv.stop()
    if code != 0:
        print(f"  warning: the server exited with {code}; its log ends:\n{srv.log_tail()}")

    lat: array[float] = array("d")
    c2a: array[float] = array("d")
    for r in results:
        lat.frombytes(r.latencies)
        c2a.frombytes(r.commit_to_answer)
    # NaN: a scrape at the window's edge timed out (the server's loop was that busy)
    wd = writer_delta(m0, m1) if m0 and m1 else WriterDelta(math.nan, math.nan, math.nan)
    window_s = use.seconds
    totals = {k: sum(getattr(r, k) for r in results)
              for k in ("leases", "acquired", "acquire_errors", "renewed", "lost", "expiring",
                        "errors", "streams_ended", "in_flight_at_end", "lapsed")}
    after: dict[str, int] = {}
    for r in results:
        for k, v in r.after_window.items():
            after[k] = after.get(k, 0) + v
    all_rows = sampler.rows
    summary: dict[str, Any] = {
        **totals,
        "window_s": window_s,
        "after_window": after,
        "renewals_per_s": totals["renewed"] / window_s,
        "target_renewals_per_s": cfg.leases / (ttl_s / 3),
        "latency": distribution_ms(lat),
        "commit_to_answer": distribution_ms(c2a),
        "min_server_margin_ms": min((r.min_server_margin_ms for r in results), default=0.0),
        "min_safe_margin_ms": min((r.min_safe_margin_s for r in results), default=0.0) * 1000,
        "server_cpu": use.server,
        "server_cpu_max_1s": max((r["cpu"] for r in window_rows), default=0.0),
        "rss_mib": {"start": rss_start, "after_ramp": rss_ramp, "end": rss_end,
                    "peak": max([rss_start, rss_end, *(r["rss_mib"] for r in all_rows)])},
        "queue_depth_max": max((r["queue_depth"] for r in window_rows), default=0.0),
        "writer_mean_batch": wd.mean_batch,
        "writer_batch_ms": wd.batch_ms,
        "writer_commands_per_s": wd.commands / window_s,
        "cpu": use.as_dict(),
        "ramp_s": ramp_s,
        "samples": [s for r in results for s in r.samples][:10],
    }
    summary["passed"] = (summary["lost"] == 0 and summary["expiring"] == 0
                         and summary["errors"] == 0 and summary["streams_ended"] == 0
                         and summary["acquire_errors"] == 0)
    _print(summary)
    return {"config": asdict(cfg), "summary": summary, "per_second": all_rows,
            "per_process": [{k: v for k, v in asdict(r).items() if not isinstance(v, bytes)}
                            for r in results]}


def _print(s: dict[str, Any]) -> None:
    lat = s["latency"]
    rss = s["rss_mib"]
    print(f"  window {s['window_s']:.1f} s: {fmt_rate(s['renewals_per_s'])} renewals/s "
          f"(needed {fmt_rate(s['target_renewals_per_s'])}/s); renewal latency p50 "
          f"{lat.get('p50_ms', 0):.1f} ms p99 {lat.get('p99_ms', 0):.1f} ms max "
          f"{lat.get('max_ms', 0):.1f} ms", flush=True)
    print(f"  renewed {s['renewed']:,}, lost {s['lost']}, expiring {s['expiring']}, "
          f"errors {s['errors']}, streams ended {s['streams_ended']}, acquire errors "
          f"{s['acquire_errors']}; smallest margin: at the commit {s['min_server_margin_ms']:.0f}"
          f" ms, safe-until {s['min_safe_margin_ms']:.0f} ms; renewals committed after the "
          f"lease expired {s['lapsed']:,}; after the window {s['after_window']}", flush=True)
    c2a = s["commit_to_answer"]
    print(f"  of the latency, commit -> `renewed` received: p50 {c2a.get('p50_ms', 0):.1f} ms, "
          f"p99 {c2a.get('p99_ms', 0):.1f} ms (server and client share the wall clock)",
          flush=True)
    print(f"  server CPU {s['server_cpu']:.2f} cores (max 1 s sample {s['server_cpu_max_1s']:.2f}),"
          f" RSS start {rss['start']:.0f} / peak {rss['peak']:.0f} / end {rss['end']:.0f} MiB; "
          f"writer mean batch {s['writer_mean_batch']:.1f} ({s['writer_batch_ms']:.1f} ms/batch),"
          f" {fmt_rate(s['writer_commands_per_s'])} commands/s, queue depth max "
          f"{s['queue_depth_max']:.0f}", flush=True)
    c = s["cpu"]
    print(f"  cpu (cores) server {c['server']:.2f} clients {c['clients']:.2f} kernel "
          f"{c['kernel']:.2f} others {c['others']:.2f}; load average "
          f"{fmt_load(c['loadavg_before'])} -> {fmt_load(c['loadavg_after'])}", flush=True)
    for x in s["samples"]:
        print(f"      {x}", flush=True)
    print(f"  none lost, none expiring: {'PASS' if s['passed'] else 'FAIL'}", flush=True)


def add_arguments(p: ArgumentAdder, prefix: str = "") -> None:
    d = LeasesConfig()
    p.add_argument(f"--{prefix}leases", type=int, default=d.leases,
                   help=f"leases in all (default {d.leases})")
    p.add_argument(f"--{prefix}streams", type=int, default=d.streams,
                   help=f"owners, one KeepAlive stream and channel each (default {d.streams})")
    p.add_argument(f"--{prefix}procs", type=int, default=d.procs,
                   help=f"client processes (default {d.procs})")
    p.add_argument(f"--{prefix}ttl-ms", type=int, default=d.ttl_ms,
                   help=f"lease ttl; renewed every third of it (default {d.ttl_ms})")
    p.add_argument(f"--{prefix}duration", type=float, default=d.duration_s,
                   help=f"measured seconds (default {d.duration_s:g})")
    p.add_argument(f"--{prefix}coalesce-ms", type=float, default=d.coalesce_ms,
                   help="renewals due within this many ms go out as one message's `renews` "
                   "(default 50; 0 sends one message per renewal, the old protocol)")
    p.add_argument(f"--{prefix}acquire-ttl-ms", type=int, default=d.acquire_ttl_ms,
                   help=f"ttl of the Acquires in the ramp (default {d.acquire_ttl_ms})")
    p.add_argument(f"--{prefix}max-ramp-s", type=float, default=d.max_ramp_s,
                   help=f"give up when the ramp takes longer (default {d.max_ramp_s:g}; "
                   "300 000 leases need about 300 unary); keep --acquire-ttl-ms above it")
    p.add_argument(f"--{prefix}settle-s", type=float, default=d.settle_s,
                   help="seconds from the ramp's end to the window, e.g. for the server to "
                   "copy a large ramp's runs into its table; the ramp's leases must outlive "
                   f"it (--acquire-ttl-ms) (default {d.settle_s:g})")
    p.add_argument(f"--{prefix}ramp", choices=("unary", "execute"), default=d.ramp,
                   help="how the ramp Acquires: unary calls, or one Execute stream per owner "
                   f"(default {d.ramp})")


def config_from(args: argparse.Namespace, prefix: str = "") -> LeasesConfig:
    def get(name: str) -> Any:
        return getattr(args, f"{prefix}{name}".replace("-", "_"))

    cfg = LeasesConfig(leases=get("leases"), streams=get("streams"), procs=get("procs"),
                       ttl_ms=get("ttl-ms"), duration_s=get("duration"),
                       acquire_ttl_ms=get("acquire-ttl-ms"), coalesce_ms=get("coalesce-ms"),
                       max_ramp_s=get("max-ramp-s"), ramp=get("ramp"),
                       settle_s=get("settle-s"))
    if cfg.streams < 1 or cfg.procs < 1 or cfg.procs > cfg.streams or cfg.leases < cfg.streams:
        raise SystemExit("need streams >= procs >= 1 and leases >= streams")
    if cfg.leases % cfg.streams:
        raise SystemExit("leases must be a multiple of streams")
    if cfg.ttl_ms < 300 or cfg.duration_s <= 0:
        raise SystemExit("need ttl-ms >= 300 and duration > 0")
    if cfg.settle_s < 0.1:
        raise SystemExit("need settle-s >= 0.1")
    if cfg.max_ramp_s <= 0 or cfg.acquire_ttl_ms < cfg.max_ramp_s * 1000:
        raise SystemExit("need max-ramp-s > 0 and acquire-ttl-ms at least as long as the ramp")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run_leases(config_from(args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
