"""End to end: fencepost over gRPC against a do-nothing echo server (the ceiling).

N concurrent clients (default 64) in P client processes (default 2, started
with multiprocessing's ``spawn``) each loop the worker lifecycle on fresh run
ids: Acquire -> Renew x3 -> RecordCheckpoint -> Finish. Every RPC is one op.
Each client process opens ONE grpc.aio channel (one HTTP/2 connection) shared
by its N/P asyncio clients (``--channels`` changes that).

The same client program runs, in one invocation, against

* ``echo``: bench/echo_server.py, which answers each of those RPCs with a
  prebuilt response holding a small fixed Run — the cost of Python gRPC alone;
* ``fencepost``: ``fencepost serve`` on a fresh database in a temp dir at
  ``--durability full``, with ``--metrics-port`` so the writer's mean batch
  size over the measured window can be read (delta of the
  ``fencepost_writer_commands`` and ``fencepost_writer_batches`` counters);
* ``fencepost-mtls``: the same with mutual TLS (certificates made for the run:
  a CA, the server's, one client certificate; every owner under its
  principal), for the cost of TLS: the ratio fencepost-mtls/fencepost.

Each run: the client processes connect, then all start at one instant, warm up
(default 2 s, not counted), and measure for a fixed time (default 10 s); an op
counts when it completes inside the window. Rounds are interleaved (echo then
fencepost, then the other order, ...) and the medians and the ratio
fencepost/echo are printed. Everything listens on 127.0.0.1 and every process
started is stopped before this returns.

    .venv/bin/python bench/e2e.py [--clients 64] [--procs 2] [--duration 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any, TypeVar

import grpc
import psutil
from benchlib import (
    BIN,
    HOST,
    REPO,
    ArgumentAdder,
    ServerProcess,
    fmt_ms,
    fmt_rate,
    free_port,
    median,
    percentile,
    scrape_counters,
    start_server,
)

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb

RPC_TIMEOUT_S = 30.0
NOISY_OTHERS_CORES = 0.3  # others' CPU during a measured window that voids a verdict
CONNECT_TIMEOUT_S = 20.0

Resp = TypeVar("Resp")


# -- the client processes ------------------------------------------------------


@dataclass(frozen=True)
class ClientConfig:
    address: str
    proc_index: int
    clients: int
    channels: int
    warmup_s: float
    duration_s: float
    run_prefix: str
    certs: str | None = None  # mutual TLS: the directory of bench_certs()


@dataclass
class ClientResult:
    proc_index: int
    ops: int = 0
    lifecycles: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    latencies: bytes = b""  # array('d') of seconds, ops completed inside the window
    cpu_s: float = 0.0  # this process's CPU time (user + system) inside the window


class _Stop(Exception):
    """The measured window is over: stop issuing RPCs."""


class _Window:
    """Shared by a process's clients: the clock, the counters, the latencies."""

    def __init__(self, start_mono: float, warmup_s: float, duration_s: float) -> None:
        self.begin = start_mono + warmup_s
        self.end = self.begin + duration_s
        self.latencies: array[float] = array("d")
        self.ops = 0
        self.lifecycles = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.cpu_begin: float | None = None
        self.cpu_end: float | None = None

    async def call(self, rpc: Callable[..., Awaitable[Resp]], request: Any) -> Resp:
        t0 = time.monotonic()
        if t0 >= self.end:
            raise _Stop
        try:
            response = await rpc(request, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            t1 = time.monotonic()
            if self.begin <= t1 < self.end:
                self.errors += 1
                if len(self.error_samples) < 5:
                    self.error_samples.append(f"{exc.code().name}: {exc.details()}")
            raise
        t1 = time.monotonic()
        if self.begin <= t1 < self.end:
            self.ops += 1
            self.latencies.append(t1 - t0)
        return response

    async def watch_cpu(self) -> None:
        """Read this process's CPU time at the window's start and end."""
        await asyncio.sleep(max(0.0, self.begin - time.monotonic()))
        self.cpu_begin = time.process_time()
        await asyncio.sleep(max(0.0, self.end - time.monotonic()))
        self.cpu_end = time.process_time()


async def _client(
    stub: ledger_pb2_grpc.LedgerStub, win: _Window, prefix: str, index: int
) -> None:
    owner = f"{prefix}-c{index:03d}"  # under mutual TLS, prefix starts with the principal
    i = 0
    while True:
        run_id = f"{owner}-{i:07d}"
        i += 1
        try:
            r = await win.call(stub.Acquire, pb.AcquireRequest(run_id=run_id, owner=owner))
            token = r.run.fencing_token
            for _ in range(3):
                await win.call(
                    stub.Renew, pb.RenewRequest(run_id=run_id, owner=owner, fencing_token=token)
                )
            await win.call(
                stub.RecordCheckpoint,
                pb.RecordCheckpointRequest(
                    run_id=run_id, owner=owner, fencing_token=token,
                    key=f"ckpt/{run_id}", snapshot_version=1,
                ),
            )
            await win.call(
                stub.Finish,
                pb.FinishRequest(
                    run_id=run_id, owner=owner, fencing_token=token,
                    status=rpb.RUN_STATUS_COMPLETED,
                ),
            )
        except _Stop:
            return
        except grpc.aio.AioRpcError:
            continue  # counted; go on with a fresh run
        if win.begin <= time.monotonic() < win.end:
            win.lifecycles += 1


async def _client_main(cfg: ClientConfig, go: MpEvent, start_at: Any, ready: Any) -> ClientResult:
    if cfg.certs:
        d = Path(cfg.certs)
        creds = grpc.ssl_channel_credentials((d / "ca.pem").read_bytes(),
                                             (d / f"{BENCH_PRINCIPAL}-key.pem").read_bytes(),
                                             (d / f"{BENCH_PRINCIPAL}.pem").read_bytes())
        channels = [grpc.aio.secure_channel(cfg.address, creds) for _ in range(cfg.channels)]
    else:
        channels = [grpc.aio.insecure_channel(cfg.address) for _ in range(cfg.channels)]
    try:
        for ch in channels:
            await asyncio.wait_for(ch.channel_ready(), CONNECT_TIMEOUT_S)
        ready.put(cfg.proc_index)
        if not await asyncio.to_thread(go.wait, CONNECT_TIMEOUT_S * 2):
            raise RuntimeError("never told to start")
        # start_at is wall time, shared by all processes; run on monotonic time.
        start_mono = time.monotonic() + (start_at.value - time.time())
        win = _Window(start_mono, cfg.warmup_s, cfg.duration_s)
        await asyncio.sleep(max(0.0, start_mono - time.monotonic()))
        stubs = [ledger_pb2_grpc.LedgerStub(ch) for ch in channels]
        prefix = f"{cfg.run_prefix}-p{cfg.proc_index}"
        if cfg.certs:
            prefix = f"{BENCH_PRINCIPAL}/{prefix}"
        async with asyncio.TaskGroup() as tg:
            tg.create_task(win.watch_cpu())
            for c in range(cfg.clients):
                tg.create_task(_client(stubs[c % len(stubs)], win, prefix, c))
    finally:
        for ch in channels:
            await ch.close(None)
    return ClientResult(
        proc_index=cfg.proc_index,
        ops=win.ops,
        lifecycles=win.lifecycles,
        errors=win.errors,
        error_samples=win.error_samples,
        latencies=win.latencies.tobytes(),
        cpu_s=(win.cpu_end or 0.0) - (win.cpu_begin or 0.0),
    )


def client_process(cfg: ClientConfig, go: MpEvent, start_at: Any, ready: Any, out: Any) -> None:
    """Entry point of one client process: run the clients, put a ClientResult."""
    try:
        out.put(asyncio.run(_client_main(cfg, go, start_at, ready)))
    except BaseException as exc:
        failure = RuntimeError(f"client process {cfg.proc_index} failed: {exc!r}")
        ready.put(failure)  # in case the parent still waits for "connected"
        out.put(failure)
        raise


# -- one measured run ------------------------------------------------------------


@dataclass
class RunResult:
    target: str
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
    # CPU in the window, in cores (CPU seconds per wall second; the machine has 2).
    server_cpu: float
    server_cpu_sys: float  # the kernel part of server_cpu
    clients_cpu: float  # all client processes together
    machine_cpu: float  # everything on the machine, ours included
    kernel_cpu: float  # kernel threads (journal, writeback, ...) and interrupts
    writer_mean_batch: float | None = None
    writer_commands_per_s: float | None = None
    writer_batch_ms: float | None = None  # mean wall time of one batch (decide + write + commit)

    @property
    def other_cpu(self) -> float:
        """Other user processes: the noise of a shared machine."""
        return max(0.0, self.machine_cpu - self.server_cpu - self.clients_cpu - self.kernel_cpu)


def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


@dataclass(frozen=True)
class _CpuSnapshot:
    busy: float  # all CPUs, seconds not idle
    irq: float  # seconds in hard and soft interrupts
    kthreads: dict[int, float]  # kernel thread pid -> CPU seconds

    @staticmethod
    def take() -> _CpuSnapshot:
        t = psutil.cpu_times()
        busy = float(sum(t) - t.idle - getattr(t, "iowait", 0.0))
        irq = float(getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))
        kthreads: dict[int, float] = {}
        for p in psutil.process_iter(["pid", "ppid", "cpu_times"]):
            if p.info["ppid"] == 2 and p.info["cpu_times"] is not None:  # kthreadd's children
                ct = p.info["cpu_times"]
                kthreads[p.info["pid"]] = ct.user + ct.system
        return _CpuSnapshot(busy, irq, kthreads)

    def kernel_since(self, before: _CpuSnapshot) -> float:
        threads = sum(v - before.kthreads.get(pid, 0.0) for pid, v in self.kthreads.items())
        return threads + self.irq - before.irq


def _stop_processes(procs: list[SpawnProcess]) -> None:
    for p in procs:
        p.join(5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


COMMIT_SECONDS = "fencepost_writer_commit_duration_seconds_sum"  # the histogram's total
WRITER_COUNTERS = (
    "fencepost_writer_commands",
    "fencepost_writer_batches",
    COMMIT_SECONDS,
)


def drive(
    target: str,
    round_no: int,
    server: ServerProcess,
    *,
    clients: int,
    procs: int,
    channels: int,
    warmup_s: float,
    duration_s: float,
    metrics_port: int | None,
    certs: str | None = None,
) -> RunResult:
    """Run the client processes against ``server`` once and merge their results."""
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    start_at = ctx.Value("d", 0.0)
    ready = ctx.Queue()
    out = ctx.Queue()
    per_proc = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    workers: list[SpawnProcess] = []
    try:
        for i, n in enumerate(per_proc):
            cfg = ClientConfig(
                address=server.address, proc_index=i, clients=n, channels=channels,
                warmup_s=warmup_s, duration_s=duration_s, run_prefix=f"{target}-r{round_no}",
                certs=certs,
            )
            w = ctx.Process(target=client_process, args=(cfg, go, start_at, ready, out),
                            name=f"bench-client-{i}", daemon=True)
            w.start()
            workers.append(w)
        for _ in workers:
            try:
                connected = ready.get(timeout=CONNECT_TIMEOUT_S + 30)
            except queue.Empty:
                raise RuntimeError("client processes did not connect in time") from None
            if isinstance(connected, BaseException):
                raise connected
        t0 = time.time() + 0.2
        start_at.value = t0
        go.set()
        begin, end = t0 + warmup_s, t0 + warmup_s + duration_s
        server_ps = psutil.Process(server.proc.pid)
        _sleep_until(begin)
        cpu0, snap0 = server_ps.cpu_times(), _CpuSnapshot.take()
        m0 = scrape_counters(metrics_port, WRITER_COUNTERS) if metrics_port else None
        _sleep_until(end)
        cpu1, snap1 = server_ps.cpu_times(), _CpuSnapshot.take()
        m1 = scrape_counters(metrics_port, WRITER_COUNTERS) if metrics_port else None
        results: list[ClientResult] = []
        for _ in workers:
            try:
                got = out.get(timeout=RPC_TIMEOUT_S + 30)
            except queue.Empty:
                raise RuntimeError("client processes did not report in time") from None
            if isinstance(got, BaseException):
                raise got
            results.append(got)
    finally:
        _stop_processes(workers)

    lat: array[float] = array("d")
    for r in results:
        lat.frombytes(r.latencies)
    ordered = sorted(lat)
    ops = sum(r.ops for r in results)
    run = RunResult(
        target=target,
        round=round_no,
        clients=clients,
        procs=procs,
        duration_s=duration_s,
        ops=ops,
        ops_per_s=ops / duration_s,
        lifecycles_per_s=sum(r.lifecycles for r in results) / duration_s,
        p50_ms=percentile(ordered, 50) * 1000,
        p99_ms=percentile(ordered, 99) * 1000,
        errors=sum(r.errors for r in results),
        error_samples=[s for r in results for s in r.error_samples][:5],
        server_cpu=(cpu1.user + cpu1.system - cpu0.user - cpu0.system) / duration_s,
        server_cpu_sys=(cpu1.system - cpu0.system) / duration_s,
        clients_cpu=sum(r.cpu_s for r in results) / duration_s,
        machine_cpu=(snap1.busy - snap0.busy) / duration_s,
        kernel_cpu=snap1.kernel_since(snap0) / duration_s,
    )
    if m0 is not None and m1 is not None:
        d_cmd = m1["fencepost_writer_commands"] - m0["fencepost_writer_commands"]
        d_bat = m1["fencepost_writer_batches"] - m0["fencepost_writer_batches"]
        d_sec = m1[COMMIT_SECONDS] - m0[COMMIT_SECONDS]
        run.writer_mean_batch = d_cmd / d_bat if d_bat else 0.0
        run.writer_commands_per_s = d_cmd / duration_s
        run.writer_batch_ms = d_sec / d_bat * 1000 if d_bat else 0.0
    return run


# echo: the ceiling. fencepost: the real server at --durability full (what the
# target is about). fencepost-normal: the same at --durability normal, a
# diagnostic (no fsync per commit), off by default.
# fencepost-mtls: fencepost (full) with mutual TLS, for the cost of TLS.
ALL_TARGETS = ("echo", "fencepost", "fencepost-normal", "fencepost-mtls")
DEFAULT_TARGETS = ("echo", "fencepost", "fencepost-mtls")
BENCH_PRINCIPAL = "bench-client"


def bench_certs(workdir: Path) -> Path:
    """A CA, the server's certificate and the clients' (CN bench-client)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from torture.certs import torture_certs

    d = workdir / "certs"
    if not (d / "ca.pem").exists():
        torture_certs(d, [BENCH_PRINCIPAL])
    return d


def start_target(target: str, workdir: Path, round_no: int) -> tuple[ServerProcess, int | None]:
    """Start the echo server, or fencepost on a fresh database, on a free port."""
    log = workdir / f"{target}-r{round_no}.log"
    if target == "echo":
        argv = [sys.executable, str(REPO / "bench" / "echo_server.py"), "--listen", f"{HOST}:0"]
        srv = start_server(target, argv, log)
        srv.wait_ready(r"echo serving on (\S+)")
        return srv, None
    durability = {"fencepost": "full", "fencepost-normal": "normal",
                  "fencepost-mtls": "full"}[target]
    metrics_port = free_port()
    argv = [
        str(BIN / "fencepost"), "serve",
        "--listen", f"{HOST}:0",
        "--db", str(workdir / f"{target}-r{round_no}.db"),
        "--durability", durability,
        "--metrics-port", str(metrics_port),
        "--log-level", "INFO",
    ]
    if target == "fencepost-mtls":
        d = bench_certs(workdir)
        argv += ["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server-key.pem"),
                 "--client-ca", str(d / "ca.pem")]
    srv = start_server(target, argv, log)
    srv.wait_ready(r"fencepost serving on (\S+)")
    return srv, metrics_port


# -- the whole comparison ----------------------------------------------------------

TARGET_RATIO = 0.70


@dataclass
class E2EConfig:
    clients: int = 64
    procs: int = 2
    channels: int = 1
    warmup_s: float = 2.0
    duration_s: float = 10.0
    rounds: int = 3
    targets: tuple[str, ...] = DEFAULT_TARGETS


def summarize(runs: list[RunResult], targets: tuple[str, ...]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for t in targets:
        mine = [r for r in runs if r.target == t]
        m: dict[str, Any] = {
            "ops_per_s": median([r.ops_per_s for r in mine]),
            "p50_ms": median([r.p50_ms for r in mine]),
            "p99_ms": median([r.p99_ms for r in mine]),
            "errors": sum(r.errors for r in mine),
            "server_cpu": median([r.server_cpu for r in mine]),
            "clients_cpu": median([r.clients_cpu for r in mine]),
            "kernel_cpu": median([r.kernel_cpu for r in mine]),
            "other_cpu": median([r.other_cpu for r in mine]),
            "server_cpu_us_per_op": median(
                [r.server_cpu / r.ops_per_s * 1e6 for r in mine if r.ops_per_s]
            ),
        }
        if t != "echo":
            m["writer_mean_batch"] = median(
                [r.writer_mean_batch for r in mine if r.writer_mean_batch is not None]
            )
            m["writer_batch_ms"] = median(
                [r.writer_batch_ms for r in mine if r.writer_batch_ms is not None]
            )
            echo = summary.get("echo", {}).get("ops_per_s", 0.0)
            m["ratio_to_echo"] = m["ops_per_s"] / echo if echo else None
            # Ops per server CPU second, relative to echo's: less sensitive than
            # ops/s to what else the shared machine is running.
            echo_cpu = summary.get("echo", {}).get("server_cpu_us_per_op", 0.0)
            mine_cpu = m["server_cpu_us_per_op"]
            m["cpu_efficiency_to_echo"] = echo_cpu / mine_cpu if echo_cpu and mine_cpu else None
            paired = []
            for rnd in sorted({r.round for r in mine}):
                e = [r for r in runs if r.round == rnd and r.target == "echo"]
                f = [r for r in mine if r.round == rnd]
                if e and f and e[0].ops_per_s:
                    paired.append(f[0].ops_per_s / e[0].ops_per_s)
            m["paired_ratios"] = paired
        summary[t] = m
    fp = summary.get("fencepost", {})
    summary["ratio"] = fp.get("ratio_to_echo")
    # The cost of mutual TLS: its lifecycle ops/s over plaintext's, same run
    # (medians, and per round).
    tls = summary.get("fencepost-mtls")
    if tls is not None and fp.get("ops_per_s"):
        summary["tls_ratio"] = tls["ops_per_s"] / fp["ops_per_s"]
        summary["tls_paired_ratios"] = [
            t.ops_per_s / f.ops_per_s
            for rnd in sorted({r.round for r in runs})
            for t in runs if t.round == rnd and t.target == "fencepost-mtls"
            for f in runs if f.round == rnd and f.target == "fencepost" and f.ops_per_s
        ]
    summary["target_ratio"] = TARGET_RATIO
    # A run with failed RPCs measured something else: no verdict from it.
    summary["valid"] = all(summary[t]["errors"] == 0 for t in targets)
    # Neither is a ratio whose two sides saw different machines: a round in
    # which any run shared the cores with others' load is noisy.
    summary["noisy_rounds"] = sorted(
        {r.round for r in runs if r.other_cpu > NOISY_OTHERS_CORES}
    )
    summary["target_met"] = (
        summary["valid"]
        and not summary["noisy_rounds"]
        and summary["ratio"] is not None
        and summary["ratio"] >= TARGET_RATIO
    )
    return summary


def verdict(summary: dict[str, Any]) -> str:
    if not summary["valid"]:
        return "INVALID (RPCs failed; see the error samples above)"
    if summary.get("noisy_rounds"):
        return (f"NOT VALID (others' load above {NOISY_OTHERS_CORES} cores in round(s) "
                f"{summary['noisy_rounds']}: re-run on a quiet machine)")
    return "met" if summary["target_met"] else "MISSED"


def tls_line(s: dict[str, Any]) -> str | None:
    """The cost of mutual TLS in one line, or None when it was not measured."""
    if s.get("tls_ratio") is None:
        return None
    paired = ", ".join(f"{x:.2f}" for x in s["tls_paired_ratios"])
    return (f"mutual TLS: {fmt_rate(s['fencepost-mtls']['ops_per_s'])} ops/s vs plaintext "
            f"{fmt_rate(s['fencepost']['ops_per_s'])}: {s['tls_ratio']:.2f}x "
            f"(per round: {paired})")


def _print_run(r: RunResult) -> None:
    extra = ""
    if r.writer_mean_batch is not None and r.writer_batch_ms is not None:
        extra = f"  writer batch {r.writer_mean_batch:5.1f} in {r.writer_batch_ms:5.2f} ms"
    print(
        f"  round {r.round}  {r.target:<16} {fmt_rate(r.ops_per_s):>6} ops/s  "
        f"p50 {fmt_ms(r.p50_ms / 1000):>9}  p99 {fmt_ms(r.p99_ms / 1000):>9}  "
        f"cpu server {r.server_cpu:4.2f} clients {r.clients_cpu:4.2f} "
        f"kernel {r.kernel_cpu:4.2f} others {r.other_cpu:4.2f}  errors {r.errors}{extra}",
        flush=True,
    )
    for s in r.error_samples:
        print(f"      error: {s}", flush=True)


def print_summary(s: dict[str, Any], targets: tuple[str, ...]) -> None:
    print("  medians:")
    for t in targets:
        m = s[t]
        line = (f"    {t:<16} {fmt_rate(m['ops_per_s']):>6} ops/s  p50 {m['p50_ms']:.2f} ms  "
                f"p99 {m['p99_ms']:.2f} ms  server CPU {m['server_cpu_us_per_op']:.0f} us/op  "
                f"(others' load {m['other_cpu']:.2f} cores)")
        if t != "echo":
            line += (f"  writer mean batch {m['writer_mean_batch']:.1f} "
                     f"({m['writer_batch_ms']:.2f} ms/batch)")
        print(line)
    for t in targets:
        m = s[t]
        if t == "echo" or m.get("ratio_to_echo") is None:
            continue
        paired = ", ".join(f"{x:.2f}" for x in m["paired_ratios"])
        line = f"    {t}/echo = {m['ratio_to_echo']:.2f} (per round: {paired})"
        if m.get("cpu_efficiency_to_echo") is not None:
            line += f"; per server CPU second {m['cpu_efficiency_to_echo']:.2f}"
        if t == "fencepost":
            line += f"; target >= {s['target_ratio']:.2f}: {verdict(s)}"
        print(line, flush=True)
    tls = tls_line(s)
    if tls is not None:
        print(f"    {tls}", flush=True)


def run_e2e(cfg: E2EConfig) -> dict[str, Any]:
    print(f"end to end: {cfg.clients} clients in {cfg.procs} processes "
          f"({cfg.channels} channel(s) each), warm-up {cfg.warmup_s:g} s, "
          f"measured {cfg.duration_s:g} s, {cfg.rounds} rounds of {', '.join(cfg.targets)}",
          flush=True)
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="fencepost-bench-") as tmp:
        workdir = Path(tmp)
        for rnd in range(cfg.rounds):
            k = rnd % len(cfg.targets)  # rotate the order from round to round
            for target in cfg.targets[k:] + cfg.targets[:k]:
                srv, metrics_port = start_target(target, workdir, rnd)
                try:
                    run = drive(
                        target, rnd, srv, clients=cfg.clients, procs=cfg.procs,
                        channels=cfg.channels, warmup_s=cfg.warmup_s,
                        duration_s=cfg.duration_s, metrics_port=metrics_port,
                        certs=str(bench_certs(workdir)) if target == "fencepost-mtls" else None,
                    )
                finally:
                    code = srv.stop()
                if code != 0 or run.errors:
                    print(f"  warning: {target} exited with {code} after {run.errors} failed "
                          f"RPCs; its log ends:\n{srv.log_tail()}", flush=True)
                runs.append(run)
                _print_run(run)
    summary = summarize(runs, cfg.targets)
    print_summary(summary, cfg.targets)
    return {
        "config": asdict(cfg),
        "runs": [{**asdict(r), "other_cpu": r.other_cpu} for r in runs],
        "summary": summary,
    }


def add_arguments(p: ArgumentAdder, prefix: str = "") -> None:
    d = E2EConfig()
    p.add_argument(f"--{prefix}clients", type=int, default=d.clients,
                   help=f"concurrent clients in all (default {d.clients})")
    p.add_argument(f"--{prefix}procs", type=int, default=d.procs,
                   help=f"client processes (default {d.procs})")
    p.add_argument(f"--{prefix}channels", type=int, default=d.channels,
                   help=f"grpc.aio channels per client process (default {d.channels})")
    p.add_argument(f"--{prefix}warmup", type=float, default=d.warmup_s,
                   help=f"seconds of warm-up, not counted (default {d.warmup_s:g})")
    p.add_argument(f"--{prefix}duration", type=float, default=d.duration_s,
                   help=f"measured seconds per run (default {d.duration_s:g})")
    p.add_argument(f"--{prefix}targets", default=",".join(d.targets),
                   help=f"comma-separated, from {', '.join(ALL_TARGETS)} "
                   f"(default {','.join(d.targets)}); echo is the baseline of the ratios")


def config_from(args: argparse.Namespace, rounds: int, prefix: str = "") -> E2EConfig:
    def get(name: str) -> Any:
        return getattr(args, f"{prefix}{name}".replace("-", "_"))

    targets = tuple(t.strip() for t in get("targets").split(",") if t.strip())
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        raise SystemExit(f"targets: pick distinct names from {', '.join(ALL_TARGETS)}")
    if "echo" in targets:  # the baseline first, so the ratios can be computed
        targets = ("echo", *(t for t in targets if t != "echo"))
    cfg = E2EConfig(
        clients=get("clients"), procs=get("procs"), channels=get("channels"),
        warmup_s=get("warmup"), duration_s=get("duration"), rounds=rounds, targets=targets,
    )
    if cfg.procs < 1 or cfg.clients < cfg.procs or cfg.channels < 1:
        raise SystemExit("need procs >= 1, clients >= procs and channels >= 1")
    if cfg.duration_s <= 0 or cfg.warmup_s < 0 or cfg.rounds < 1:
        raise SystemExit("need duration > 0, warmup >= 0 and rounds >= 1")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run_e2e(config_from(args, args.rounds))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
