"""The load generator: client processes driving one backend, as bench/e2e.py.

N clients (default 64) in P processes (default 2, multiprocessing ``spawn``);
each process opens ONE backend client (one gRPC channel, one asyncpg pool,
one redis-py pool) shared by its N/P asyncio clients. Two workloads, the
second (when asked) right after the first, by the same processes:

* **throughput**: each client loops acquire -> renew x3 -> record_checkpoint ->
  finish on fresh run ids; every command is one op. The processes start at one
  instant, warm up (not counted), then measure for a fixed window; an op counts
  when it completes inside it. Meanwhile the parent reads the server's process
  tree CPU, the machine's CPU and the load average at the window's edges.
* **contention**: the clients race for 16 runs at a time (fresh ids every
  ``epoch_s``, shared by all processes): acquire with a short ttl, 1-3 fenced
  writes with pauses (one in ten longer than the ttl: a stalled worker whose
  next write must be refused if the run was taken over), then finish (60 %),
  release (20 %) or walk away and let the lease expire (20 %). Every grant
  (token, owner, send/ack times, the time the owner stops relying on it), every
  accepted fenced write and every finish is recorded for the checker
  (peers/history.py).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import random
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field, replace
from multiprocessing.context import SpawnProcess
from typing import Any

from benchlib import percentile, scrape_counters
from e2e import WRITER_COUNTERS, _CpuSnapshot, _sleep_until, _Stop, _stop_processes
from e2e import _Window as _E2EWindow

from .backends import CONNECT_TIMEOUT_S, RPC_TIMEOUT_S, open_backend
from .semantics import Refused
from .servers import Running, ShardedCoordinators, cpu_delta, trees_cpu

THROUGHPUT_TTL_MS = 60_000  # fencepost's default; nothing expires during a run
RACE_GAP_S = 0.3  # between the throughput window and the contention run


@dataclass(frozen=True)
class ClientSpec:
    backend: str
    address: str
    proc_index: int
    clients: int
    run_prefix: str
    warmup_s: float = 2.0
    duration_s: float = 8.0  # the throughput window; 0: none
    options: tuple[tuple[str, Any], ...] = ()
    # the contention run, right after the throughput window; 0: none
    contention_s: float = 0.0
    runs: int = 16
    ttl_ms: int = 200
    epoch_s: float = 1.0
    seed: int = 1


@dataclass
class ClientResult:
    proc_index: int
    ops: int = 0
    lifecycles: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    latencies: bytes = b""
    cpu_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    # contention
    grants: list[tuple[str, str, int, float, float, float]] = field(default_factory=list)
    writes: list[tuple[str, str, int, float, float, str]] = field(default_factory=list)
    finishes: list[tuple[str, str, int, float, float]] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    race_errors: int = 0
    race_error_samples: list[str] = field(default_factory=list)
    race_stats: dict[str, float] = field(default_factory=dict)


class _Window(_E2EWindow):
    """e2e's window, for any backend: calls take a coroutine function and its
    arguments, any exception is an error, and the backend's counters are read
    at the window's edges."""

    def __init__(self, start_mono: float, warmup_s: float, duration_s: float) -> None:
        super().__init__(start_mono, warmup_s, duration_s)
        self.stats_begin: dict[str, float] = {}
        self.stats_end: dict[str, float] = {}

    async def call(self, fn: Any, *args: Any) -> Any:  # type: ignore[override]
        t0 = time.monotonic()
        if t0 >= self.end:
            raise _Stop
        try:
            result = await fn(*args)
        except Exception as exc:
            t1 = time.monotonic()
            if self.begin <= t1 < self.end:
                self.errors += 1
                if len(self.error_samples) < 5:
                    self.error_samples.append(f"{type(exc).__name__}: {exc}"[:300])
            raise
        t1 = time.monotonic()
        if self.begin <= t1 < self.end:
            self.ops += 1
            self.latencies.append(t1 - t0)
        return result

    async def watch(self, backend: Any) -> None:
        await asyncio.sleep(max(0.0, self.begin - time.monotonic()))
        self.cpu_begin = time.process_time()
        self.stats_begin = dict(backend.stats())
        await asyncio.sleep(max(0.0, self.end - time.monotonic()))
        self.cpu_end = time.process_time()
        self.stats_end = dict(backend.stats())


async def _lifecycle_client(b: Any, win: _Window, prefix: str, index: int) -> None:
    owner = f"{prefix}-c{index:03d}"
    i = 0
    while True:
        run_id = f"{owner}-{i:07d}"
        i += 1
        try:
            token = await win.call(b.acquire, run_id, owner, THROUGHPUT_TTL_MS)
            for _ in range(3):
                await win.call(b.renew, run_id, owner, token)
            await win.call(b.checkpoint, run_id, owner, token, f"ckpt/{run_id}", 1)
            await win.call(b.finish, run_id, owner, token)
        except _Stop:
            return
        except Exception:
            await asyncio.sleep(0.001)  # counted; go on with a fresh run
            continue
        if win.begin <= time.monotonic() < win.end:
            win.lifecycles += 1


def _floor_ms(t: float) -> float:
    """A conservative client's clock reading: servers keep milliseconds."""
    return int(t * 1000) / 1000.0


class _History:
    def __init__(self) -> None:
        self.grants: list[tuple[str, str, int, float, float, float]] = []
        self.writes: list[tuple[str, str, int, float, float, str]] = []
        self.finishes: list[tuple[str, str, int, float, float]] = []
        self.refused: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.errors = 0
        self.error_samples: list[str] = []

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(f"{type(exc).__name__}: {exc}"[:300])


async def _contender(
    b: Any, h: _History, spec: ClientSpec, index: int, start: float, end: float,
    rng: random.Random,
) -> None:
    owner = f"{spec.run_prefix}-p{spec.proc_index}-c{index:03d}"
    ttl = spec.ttl_ms
    ttl_s = ttl / 1000.0
    while (now := time.time()) < end:
        epoch = int((now - start) / spec.epoch_s)
        run_id = f"{spec.run_prefix}-e{epoch:04d}-k{rng.randrange(spec.runs):02d}"
        sent = time.time()
        try:
            token = await b.acquire(run_id, owner, ttl)
        except Refused as exc:
            h.refused[f"acquire:{exc.reason}"] += 1
            await asyncio.sleep(rng.uniform(0.0, 0.004))
            continue
        except Exception as exc:
            h.error(exc)
            await asyncio.sleep(0.01)
            continue
        ack = time.time()
        safe_until = _floor_ms(sent) + ttl_s
        lost = False
        for step in range(rng.randint(1, 3)):
            # now and then a holder stalls past its ttl (a paused worker): its
            # next write must then be refused if someone took the run over
            pause = ttl_s * rng.uniform(1.0, 1.5) if rng.random() < 0.1 else 0.0
            await asyncio.sleep(pause or rng.uniform(0.0, ttl_s * 0.3))
            s = time.time()
            kind = "checkpoint" if step == 1 else "renew"
            try:
                if kind == "checkpoint":
                    await b.checkpoint(run_id, owner, token, f"ckpt/{run_id}", step)
                else:
                    await b.renew(run_id, owner, token)
            except Refused as exc:
                h.refused[f"{kind}:{exc.reason}"] += 1
                lost = True
                break
            except Exception as exc:
                h.error(exc)
                lost = True
                break
            h.writes.append((run_id, owner, token, s, time.time(), kind))
            safe_until = max(safe_until, _floor_ms(s) + ttl_s)
        held_until = safe_until
        if lost:
            h.outcomes["lost"] += 1
        else:
            r = rng.random()
            kind = "finish" if r < 0.6 else "release" if r < 0.8 else "abandon"
            h.outcomes[kind] += 1
            if kind != "abandon":
                s = time.time()
                held_until = min(safe_until, s)
                try:
                    if kind == "finish":
                        await b.finish(run_id, owner, token)
                    else:
                        await b.release(run_id, owner, token)
                except Refused as exc:
                    h.refused[f"{kind}:{exc.reason}"] += 1
                except Exception as exc:
                    h.error(exc)
                else:
                    t = time.time()
                    h.writes.append((run_id, owner, token, s, t, kind))
                    if kind == "finish":
                        h.finishes.append((run_id, owner, token, s, t))
        h.grants.append((run_id, owner, token, sent, ack, held_until))


async def _client_main(spec: ClientSpec, go: Any, start_at: Any, ready: Any) -> ClientResult:
    b = await open_backend(spec.backend, spec.address, spec.clients, dict(spec.options))
    try:
        ready.put(spec.proc_index)
        if not await asyncio.to_thread(go.wait, CONNECT_TIMEOUT_S * 3):
            raise RuntimeError("never told to start")
        res = ClientResult(proc_index=spec.proc_index)
        race_start = start_at.value
        if spec.duration_s > 0:
            start_mono = time.monotonic() + (start_at.value - time.time())
            win = _Window(start_mono, spec.warmup_s, spec.duration_s)
            await asyncio.sleep(max(0.0, start_mono - time.monotonic()))
            prefix = f"{spec.run_prefix}-p{spec.proc_index}"
            async with asyncio.TaskGroup() as tg:
                tg.create_task(win.watch(b))
                for c in range(spec.clients):
                    tg.create_task(_lifecycle_client(b, win, prefix, c))
            res.ops, res.lifecycles = win.ops, win.lifecycles
            res.errors, res.error_samples = win.errors, win.error_samples
            res.latencies = win.latencies.tobytes()
            res.cpu_s = (win.cpu_end or 0.0) - (win.cpu_begin or 0.0)
            res.stats = {k: v - win.stats_begin.get(k, 0.0) for k, v in win.stats_end.items()}
            race_start += spec.warmup_s + spec.duration_s + RACE_GAP_S
        if spec.contention_s > 0:
            await _race(b, spec, res, race_start)
        return res
    finally:
        await b.close()


async def _race(b: Any, spec: ClientSpec, res: ClientResult, start: float) -> None:
    """The contention run: all processes start at ``start`` (wall clock)."""
    await asyncio.sleep(max(0.0, start - time.time()))
    h = _History()
    rng = random.Random(spec.seed * 1000 + spec.proc_index)
    end = start + spec.contention_s
    before = dict(b.stats())
    async with asyncio.TaskGroup() as tg:
        for c in range(spec.clients):
            tg.create_task(_contender(b, h, spec, c, start, end, random.Random(rng.random())))
    res.grants, res.writes, res.finishes = h.grants, h.writes, h.finishes
    res.refused, res.outcomes = dict(h.refused), dict(h.outcomes)
    res.race_errors, res.race_error_samples = h.errors, h.error_samples
    res.race_stats = {k: v - before.get(k, 0.0) for k, v in b.stats().items()}


def client_process(spec: ClientSpec, go: Any, start_at: Any, ready: Any, out: Any) -> None:
    try:
        out.put(asyncio.run(_client_main(spec, go, start_at, ready)))
    except BaseException as exc:
        failure = RuntimeError(f"{spec.backend} client process {spec.proc_index} failed: "
                               f"{exc!r}")
        ready.put(failure)
        out.put(failure)
        raise


# -- the parent side ---------------------------------------------------------------------


@dataclass
class RunResult:
    backend: str
    round: int
    clients: int
    procs: int
    duration_s: float
    ops: int
    ops_per_s: float
    lifecycles_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    error_samples: list[str]
    server_cpu: float  # cores: CPU seconds per wall second, the whole server tree
    server_us_per_op: float
    clients_cpu: float
    clients_us_per_op: float  # the client libraries' cost: they share the 2 cores
    machine_cpu: float
    kernel_cpu: float
    other_cpu: float  # unrelated processes: the noise
    load_before: float
    load_after: float
    stats: dict[str, float] = field(default_factory=dict)
    writer_mean_batch: float | None = None
    # the server's parts apart (coordinators, PostgreSQL): CPU us per op
    parts_us_per_op: dict[str, float] = field(default_factory=dict)


def _spawn(specs: list[ClientSpec]) -> tuple[list[SpawnProcess], Any, Any, Any]:
    ctx = mp.get_context("spawn")
    go, start_at, ready, out = ctx.Event(), ctx.Value("d", 0.0), ctx.Queue(), ctx.Queue()
    workers: list[SpawnProcess] = []
    try:
        for spec in specs:
            w = ctx.Process(target=client_process, args=(spec, go, start_at, ready, out),
                            name=f"peers-client-{spec.proc_index}", daemon=True)
            w.start()
            workers.append(w)
        for _ in workers:
            try:
                got = ready.get(timeout=CONNECT_TIMEOUT_S + 60)
            except queue.Empty:
                raise RuntimeError("client processes did not connect in time") from None
            if isinstance(got, BaseException):
                raise got
    except BaseException:
        _stop_processes(workers)
        raise
    return workers, go, start_at, out


def _collect(workers: list[SpawnProcess], out: Any, timeout: float) -> list[ClientResult]:
    results: list[ClientResult] = []
    for _ in workers:
        try:
            got = out.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError("client processes did not report in time") from None
        if isinstance(got, BaseException):
            raise got
        results.append(got)
    return results


def specs_for(backend: str, address: str, *, clients: int, procs: int, run_prefix: str,
              **kw: Any) -> list[ClientSpec]:
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    return [ClientSpec(backend=backend, address=address, proc_index=i, clients=n,
                       run_prefix=run_prefix, **kw) for i, n in enumerate(per)]


@dataclass
class ContentionResult:
    backend: str
    duration_s: float
    grants: list[tuple[str, str, int, float, float, float]]
    writes: list[tuple[str, str, int, float, float, str]]
    finishes: list[tuple[str, str, int, float, float]]
    refused: dict[str, int]
    outcomes: dict[str, int]
    errors: int
    error_samples: list[str]
    stats: dict[str, float]


@dataclass(frozen=True)
class RaceConfig:
    duration_s: float
    runs: int = 16
    ttl_ms: int = 200
    epoch_s: float = 1.0
    seed: int = 1


def _scrape(ports: list[int]) -> dict[str, float] | None:
    """The writer counters summed over every coordinator's metrics."""
    if not ports:
        return None
    total: dict[str, float] = {}
    for port in ports:
        for k, v in scrape_counters(port, WRITER_COUNTERS).items():
            total[k] = total.get(k, 0.0) + v
    return total


def drive(
    server: Running | ShardedCoordinators, round_no: int, *, clients: int, procs: int,
    warmup_s: float, duration_s: float, options: dict[str, Any], race: RaceConfig | None = None,
) -> tuple[RunResult, ContentionResult | None]:
    """One throughput run on ``server``, then (with ``race``) a contention run
    by the same client processes. Client process i connects to the server's
    address i mod its addresses."""
    race_kw: dict[str, Any] = {}
    if race is not None:
        race_kw = {"contention_s": race.duration_s, "runs": race.runs, "ttl_ms": race.ttl_ms,
                   "epoch_s": race.epoch_s, "seed": race.seed}
    specs = specs_for(server.backend, server.address, clients=clients, procs=procs,
                      run_prefix=f"{server.backend}-r{round_no}", warmup_s=warmup_s,
                      duration_s=duration_s, options=tuple(sorted(options.items())),
                      **race_kw)
    addresses = server.addresses
    specs = [replace(s, address=addresses[s.proc_index % len(addresses)]) for s in specs]
    parts = server.cpu_parts
    workers, go, start_at, out = _spawn(specs)
    try:
        t0 = time.time() + 0.2
        start_at.value = t0
        go.set()
        begin, end = t0 + warmup_s, t0 + warmup_s + duration_s
        _sleep_until(begin)
        load0 = os.getloadavg()[0]
        cpu0, snap0 = trees_cpu(server.pids), _CpuSnapshot.take()
        part0 = {k: trees_cpu(v) for k, v in parts.items()}
        m0 = _scrape(server.metrics_ports)
        _sleep_until(end)
        cpu1, snap1 = trees_cpu(server.pids), _CpuSnapshot.take()
        part1 = {k: trees_cpu(v) for k, v in parts.items()}
        m1 = _scrape(server.metrics_ports)
        load1 = os.getloadavg()[0]
        wait = RPC_TIMEOUT_S + 30 + (race.duration_s + RACE_GAP_S if race else 0.0)
        results = _collect(workers, out, wait)
    finally:
        _stop_processes(workers)
    run = _merge(server.backend, round_no, results, clients=clients, procs=procs,
                 duration_s=duration_s, server_cpu_s=cpu_delta(cpu0, cpu1),
                 snaps=(snap0, snap1), loads=(load0, load1), metrics=(m0, m1))
    if run.ops:
        run.parts_us_per_op = {k: cpu_delta(part0[k], part1[k]) / run.ops * 1e6 for k in parts}
    if race is None:
        return run, None
    refused: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    for r in results:
        refused.update(r.refused)
        outcomes.update(r.outcomes)
        stats.update(r.race_stats)
    return run, ContentionResult(
        backend=server.backend, duration_s=race.duration_s,
        grants=[g for r in results for g in r.grants],
        writes=[w for r in results for w in r.writes],
        finishes=[f for r in results for f in r.finishes],
        refused=dict(refused), outcomes=dict(outcomes),
        errors=sum(r.race_errors for r in results),
        error_samples=[s for r in results for s in r.race_error_samples][:5],
        stats=dict(stats),
    )


def _merge(
    backend: str, round_no: int, results: list[ClientResult], *, clients: int, procs: int,
    duration_s: float, server_cpu_s: float,
    snaps: tuple[_CpuSnapshot, _CpuSnapshot], loads: tuple[float, float],
    metrics: tuple[dict[str, float] | None, dict[str, float] | None],
) -> RunResult:
    lat: array[float] = array("d")
    for r in results:
        lat.frombytes(r.latencies)
    ordered = sorted(lat)
    ops = sum(r.ops for r in results)
    stats: Counter[str] = Counter()
    for r in results:
        stats.update(r.stats)
    snap0, snap1 = snaps
    server_cpu = server_cpu_s / duration_s
    clients_cpu = sum(r.cpu_s for r in results) / duration_s
    machine_cpu = (snap1.busy - snap0.busy) / duration_s
    kernel_cpu = snap1.kernel_since(snap0) / duration_s
    run = RunResult(
        backend=backend, round=round_no, clients=clients, procs=procs, duration_s=duration_s,
        ops=ops, ops_per_s=ops / duration_s,
        lifecycles_per_s=sum(r.lifecycles for r in results) / duration_s,
        p50_ms=percentile(ordered, 50) * 1000, p99_ms=percentile(ordered, 99) * 1000,
        errors=sum(r.errors for r in results),
        error_samples=[s for r in results for s in r.error_samples][:5],
        server_cpu=server_cpu,
        server_us_per_op=server_cpu_s / ops * 1e6 if ops else 0.0,
        clients_cpu=clients_cpu, clients_us_per_op=clients_cpu * duration_s / ops * 1e6
        if ops else 0.0, machine_cpu=machine_cpu, kernel_cpu=kernel_cpu,
        other_cpu=max(0.0, machine_cpu - server_cpu - clients_cpu - kernel_cpu),
        load_before=loads[0], load_after=loads[1], stats=dict(stats),
    )
    m0, m1 = metrics
    if m0 is not None and m1 is not None:
        d_cmd = m1["fencepost_writer_commands"] - m0["fencepost_writer_commands"]
        d_bat = m1["fencepost_writer_batches"] - m0["fencepost_writer_batches"]
        run.writer_mean_batch = d_cmd / d_bat if d_bat else 0.0
    return run
