"""Slow watcher: a WatchRuns subscriber that never reads must not hold up the writer.

The issue: "A slow watcher (one that never reads) does not hold up the writer:
bench shows ledger throughput with it attached within 10% of without, and the
watcher is eventually dropped with a clear status."

The load is bench/e2e.py's, unchanged (``e2e.drive``: 64 clients in 2
processes looping Acquire -> Renew x3 -> RecordCheckpoint -> Finish, 2 s
warm-up, 10 s measured), against ``fencepost serve --durability full`` on a
fresh database per run, **without** and **with** a slow watcher, interleaved
(without/with, then with/without, ...), ``--rounds`` rounds (default 3).

The slow watcher is a separate process with its own channel, opened with
``("grpc.http2.bdp_probe", 0)`` so its HTTP/2 window stays at the default
instead of growing. It calls ``WatchRuns(from_revision=0)`` (every run), makes
one change of its own (an Acquire of a probe run) and waits for the call's
initial metadata, which the server sends with the first event: the watch is
live before the load starts. Then it never reads.

Figures: ops/s with and without (medians), the ratio with/without (target
>= 0.90) and the per-round ratios, p50/p99, server CPU per op, others' CPU.

**Eventual status.** After the last run *with* the watcher is measured, its
server keeps the same watcher and the same load (more ``e2e.drive`` calls)
until the server has committed more changes since the watcher attached than
the server's per-stream limit (65 536 queued messages, a constant
``stream_queue_limit`` in the server's Settings with no flag or environment
variable) plus ``--slack`` (default 2 000, for the messages already in the
HTTP/2 windows). Only then does the watcher read: it gets the events the
transport had buffered and then the call's status, which should be
``RESOURCE_EXHAUSTED`` with ErrorInfo reason ``STREAM_TOO_SLOW``. A
never-reading client cannot see the status earlier: it comes after the
buffered events.

    .venv/bin/python bench/streams_watcher.py [--rounds 3] [--duration 10] [--clients 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

import e2e
import grpc
import psutil
from benchlib import ArgumentAdder, fmt_rate, median
from e2e import _stop_processes
from streams_common import aio_error_reason, fmt_load, scrape_gauge, start_fencepost

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

SERVER_STREAM_LIMIT = 65_536  # fencepost's default Settings.stream_queue_limit
TARGET_RATIO = 0.90
CONNECT_TIMEOUT_S = 20.0
READ_IDLE_S = 3.0  # the read phase: stop when nothing arrived for this long ...
READ_MAX_S = 60.0  # ... or after this long


# -- the watcher process --------------------------------------------------------------


async def _watcher_main(address: str, probe_run_id: str, cmd: Any, out: Any) -> None:
    channel = grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
        stub = ledger_pb2_grpc.LedgerStub(channel)
        call = stub.WatchRuns(pb.WatchRunsRequest(from_revision=0))
        probe = await stub.Acquire(pb.AcquireRequest(run_id=probe_run_id, owner="watch-probe"),
                                   timeout=CONNECT_TIMEOUT_S)
        await asyncio.wait_for(call.initial_metadata(), CONNECT_TIMEOUT_S)
        out.put(("attached", probe.run.revision))
        what = await asyncio.to_thread(cmd.get, True, 3600)
        if what != "read":
            call.cancel()
            out.put(("closed", None))
            return
        out.put(("read", await _read(call)))
    finally:
        await channel.close(None)


async def _read(call: Any) -> dict[str, Any]:
    got = {"messages": 0, "first_revision": 0, "last_revision": 0, "gaps": 0}

    async def reader() -> None:
        async for msg in call:
            if got["messages"] == 0:
                got["first_revision"] = msg.revision
            elif msg.revision != got["last_revision"] + 1:
                got["gaps"] += 1
            got["messages"] += 1
            got["last_revision"] = msg.revision

    t0 = time.monotonic()
    task = asyncio.create_task(reader())
    seen = -1
    while not task.done() and time.monotonic() - t0 < READ_MAX_S:
        if got["messages"] == seen:
            break  # nothing new for READ_IDLE_S: the stream is still open
        seen = got["messages"]
        await asyncio.wait({task}, timeout=READ_IDLE_S)
    result: dict[str, Any] = {**got, "read_s": time.monotonic() - t0}
    if task.done():
        exc = task.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            result.update(ended=True, code=exc.code().name, details=exc.details(),
                          reason=await aio_error_reason(call))
        else:
            result.update(ended=True, code=(await call.code()).name,
                          details=await call.details(), reason=await aio_error_reason(call),
                          error=repr(exc) if exc else None)
    else:
        call.cancel()
        result.update(ended=False, code=None, details="still open: not dropped", reason="")
    return result


def watcher_process(address: str, probe_run_id: str, cmd: Any, out: Any) -> None:
    try:
        asyncio.run(_watcher_main(address, probe_run_id, cmd, out))
    except BaseException as exc:
        out.put(("failed", repr(exc)))
        raise


class _Watcher:
    """The parent's handle on the watcher process."""

    def __init__(self, ctx: Any, address: str, tag: str) -> None:
        self.cmd, self.out = ctx.Queue(), ctx.Queue()
        self.proc: SpawnProcess = ctx.Process(
            target=watcher_process, args=(address, f"watch-probe-{tag}", self.cmd, self.out),
            name="bench-slow-watcher", daemon=True)
        self.proc.start()
        try:
            self.attached_revision = int(self._expect("attached", CONNECT_TIMEOUT_S + 30))
        except BaseException:
            _stop_processes([self.proc])
            raise

    def _expect(self, what: str, timeout: float) -> Any:
        try:
            kind, value = self.out.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the watcher process did not report {what!r}") from None
        if kind != what:
            raise RuntimeError(f"the watcher process: {kind} {value}")
        return value

    def read(self) -> dict[str, Any]:
        self.cmd.put("read")
        return dict(self._expect("read", READ_MAX_S + 30))

    def close(self) -> None:
        if self.proc.is_alive():
            self.cmd.put("close")
            try:
                self._expect("closed", 10)
            except RuntimeError:
                pass
        _stop_processes([self.proc])


# -- the parent ----------------------------------------------------------------------------


@dataclass
class WatcherConfig:
    clients: int = 64
    procs: int = 2
    warmup_s: float = 2.0
    duration_s: float = 10.0
    rounds: int = 3
    slack: int = 2_000
    fill_max_s: float = 240.0


@dataclass
class Run:
    label: str  # "without" | "with"
    round: int
    result: dict[str, Any]  # e2e.RunResult as a dict, other_cpu included
    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float]
    server_rss_mib: float


def _drive(label: str, rnd: int, srv: Any, mport: int, cfg: WatcherConfig,
           warmup_s: float, duration_s: float) -> e2e.RunResult:
    return e2e.drive(label, rnd, srv, clients=cfg.clients, procs=cfg.procs, channels=1,
                     warmup_s=warmup_s, duration_s=duration_s, metrics_port=mport)


def _fill_and_read(srv: Any, mport: int, watcher: _Watcher, cfg: WatcherConfig,
                   rate: float) -> dict[str, Any]:
    """Keep the load on until the watcher must have overflowed, then read it."""
    threshold = SERVER_STREAM_LIMIT + cfg.slack
    ps = psutil.Process(srv.proc.pid)
    t0 = time.monotonic()
    fill_runs: list[e2e.RunResult] = []
    k = 100
    while True:
        changes = scrape_gauge(mport, "fencepost_revision") - watcher.attached_revision
        left_s = cfg.fill_max_s - (time.monotonic() - t0)
        if changes >= threshold or left_s <= 3:
            break
        dur = min(left_s - 2, max(3.0, (threshold - changes) / max(rate, 50.0) * 1.1))
        run = _drive("fill", k, srv, mport, cfg, 0.0, dur)
        fill_runs.append(run)
        rate = run.ops_per_s or rate
        k += 1
    rss_before = ps.memory_info().rss / 2**20
    read = watcher.read()
    rss_after = ps.memory_info().rss / 2**20
    result = {
        "changes_since_attach": changes,
        "threshold": threshold,
        "fill_s": time.monotonic() - t0,
        "fill_ops_per_s": [r.ops_per_s for r in fill_runs],
        "fill_errors": sum(r.errors for r in fill_runs),
        "server_rss_mib_before_read": rss_before,
        "server_rss_mib_after_read": rss_after,
        **read,
    }
    result["dropped_as_expected"] = (result["code"] == "RESOURCE_EXHAUSTED"
                                     and result["reason"] == "STREAM_TOO_SLOW")
    return result


def run_watcher(cfg: WatcherConfig) -> dict[str, Any]:
    print(f"slow watcher: e2e load ({cfg.clients} clients in {cfg.procs} processes, warm-up "
          f"{cfg.warmup_s:g} s, measured {cfg.duration_s:g} s) without and with a WatchRuns "
          f"subscriber that never reads, {cfg.rounds} interleaved rounds", flush=True)
    ctx = mp.get_context("spawn")
    schedule = [(rnd, label) for rnd in range(cfg.rounds)
                for label in (("without", "with") if rnd % 2 == 0 else ("with", "without"))]
    last_with = max(i for i, (_, label) in enumerate(schedule) if label == "with")
    runs: list[Run] = []
    status: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fencepost-bench-") as tmp:
        for i, (rnd, label) in enumerate(schedule):
            srv, mport = start_fencepost(Path(tmp), i)
            watcher: _Watcher | None = None
            try:
                if label == "with":
                    watcher = _Watcher(ctx, srv.address, f"{i}")
                load0 = os.getloadavg()
                res = _drive(label, rnd, srv, mport, cfg, cfg.warmup_s, cfg.duration_s)
                rss = psutil.Process(srv.proc.pid).memory_info().rss / 2**20
                run = Run(label, rnd, {**asdict(res), "other_cpu": res.other_cpu}, load0,
                          os.getloadavg(), rss)
                runs.append(run)
                _print_run(run)
                if watcher is not None and i == last_with:
                    status = _fill_and_read(srv, mport, watcher, cfg, res.ops_per_s)
                    _print_status(status)
            finally:
                if watcher is not None:
                    watcher.close()
                code = srv.stop()
            if code != 0:
                print(f"  warning: the server exited with {code}; its log ends:\n"
                      f"{srv.log_tail()}", flush=True)
    summary = summarize(runs, status)
    _print_summary(summary)
    return {"config": asdict(cfg), "runs": [asdict(r) for r in runs], "status": status,
            "summary": summary}


def summarize(runs: list[Run], status: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for label in ("without", "with"):
        mine = [r.result for r in runs if r.label == label]
        s[label] = {
            "ops_per_s": median([r["ops_per_s"] for r in mine]),
            "p50_ms": median([r["p50_ms"] for r in mine]),
            "p99_ms": median([r["p99_ms"] for r in mine]),
            "server_cpu_us_per_op": median(
                [r["server_cpu"] / r["ops_per_s"] * 1e6 for r in mine if r["ops_per_s"]]),
            "writer_mean_batch": median([r["writer_mean_batch"] or 0.0 for r in mine]),
            "other_cpu": median([r["other_cpu"] for r in mine]),
            "errors": sum(r["errors"] for r in mine),
        }
    base = s["without"]["ops_per_s"]
    s["ratio"] = s["with"]["ops_per_s"] / base if base else None
    paired = []
    for rnd in sorted({r.round for r in runs}):
        w = [r.result["ops_per_s"] for r in runs if r.round == rnd and r.label == "with"]
        wo = [r.result["ops_per_s"] for r in runs if r.round == rnd and r.label == "without"]
        if w and wo and wo[0]:
            paired.append(w[0] / wo[0])
    s["paired_ratios"] = paired
    s["target_ratio"] = TARGET_RATIO
    s["valid"] = s["with"]["errors"] == 0 and s["without"]["errors"] == 0
    s["ratio_met"] = s["valid"] and s["ratio"] is not None and s["ratio"] >= TARGET_RATIO
    s["dropped_as_expected"] = bool(status.get("dropped_as_expected"))
    return s


def _print_run(r: Run) -> None:
    e = r.result
    print(f"  round {r.round}  {r.label:<8} {fmt_rate(e['ops_per_s']):>6} ops/s  p50 "
          f"{e['p50_ms']:6.1f} ms  p99 {e['p99_ms']:6.1f} ms  cpu server {e['server_cpu']:.2f} "
          f"clients {e['clients_cpu']:.2f} kernel {e['kernel_cpu']:.2f} others "
          f"{e['other_cpu']:.2f}  load {fmt_load(r.loadavg_before)} -> "
          f"{fmt_load(r.loadavg_after)}  server RSS {r.server_rss_mib:.0f} MiB  "
          f"errors {e['errors']}", flush=True)
    for x in e["error_samples"]:
        print(f"      error: {x}", flush=True)


def _print_status(st: dict[str, Any]) -> None:
    fill = ", ".join(fmt_rate(x) for x in st["fill_ops_per_s"])
    print(f"  kept the load on for {st['fill_s']:.0f} s more ({fill} ops/s, errors "
          f"{st['fill_errors']}) until {st['changes_since_attach']:,.0f} changes since the "
          f"watcher attached (threshold {st['threshold']:,}); server RSS "
          f"{st['server_rss_mib_before_read']:.0f} MiB", flush=True)
    print(f"  the watcher then read {st['messages']:,} events (revisions "
          f"{st['first_revision']}..{st['last_revision']}, gaps {st['gaps']}) in "
          f"{st['read_s']:.1f} s, then: {st['code']} reason {st['reason'] or '-'}: "
          f"{st['details']!r}; server RSS after {st['server_rss_mib_after_read']:.0f} MiB",
          flush=True)


def _print_summary(s: dict[str, Any]) -> None:
    for label in ("without", "with"):
        m = s[label]
        print(f"  median {label:<8} {fmt_rate(m['ops_per_s']):>6} ops/s  p50 {m['p50_ms']:.1f} "
              f"ms  p99 {m['p99_ms']:.1f} ms  server CPU {m['server_cpu_us_per_op']:.0f} us/op  "
              f"writer mean batch {m['writer_mean_batch']:.1f}  others' load "
              f"{m['other_cpu']:.2f} cores", flush=True)
    paired = ", ".join(f"{x:.2f}" for x in s["paired_ratios"])
    ratio = s["ratio"] if s["ratio"] is not None else 0.0
    print(f"  with/without = {ratio:.2f} (per round: {paired}); target >= "
          f"{s['target_ratio']:.2f}: {verdict(s)}; dropped with RESOURCE_EXHAUSTED/"
          f"STREAM_TOO_SLOW: {'yes' if s['dropped_as_expected'] else 'NO'}", flush=True)


def verdict(s: dict[str, Any]) -> str:
    if not s["valid"]:
        return "INVALID (RPCs failed)"
    return "met" if s["ratio_met"] else "MISSED"


def add_arguments(p: ArgumentAdder, prefix: str = "") -> None:
    d = WatcherConfig()
    p.add_argument(f"--{prefix}clients", type=int, default=d.clients,
                   help=f"e2e clients in all (default {d.clients})")
    p.add_argument(f"--{prefix}procs", type=int, default=d.procs,
                   help=f"e2e client processes (default {d.procs})")
    p.add_argument(f"--{prefix}warmup", type=float, default=d.warmup_s,
                   help=f"seconds of warm-up per run (default {d.warmup_s:g})")
    p.add_argument(f"--{prefix}duration", type=float, default=d.duration_s,
                   help=f"measured seconds per run (default {d.duration_s:g})")
    p.add_argument(f"--{prefix}slack", type=int, default=d.slack,
                   help=f"changes beyond the server's {SERVER_STREAM_LIMIT:,} before the "
                   f"watcher reads (default {d.slack:,})")
    p.add_argument(f"--{prefix}fill-max", type=float, default=d.fill_max_s,
                   help=f"at most this many seconds of extra load (default {d.fill_max_s:g})")


def config_from(args: argparse.Namespace, rounds: int, prefix: str = "") -> WatcherConfig:
    def get(name: str) -> Any:
        return getattr(args, f"{prefix}{name}".replace("-", "_"))

    cfg = WatcherConfig(clients=get("clients"), procs=get("procs"), warmup_s=get("warmup"),
                        duration_s=get("duration"), rounds=rounds, slack=get("slack"),
                        fill_max_s=get("fill-max"))
    if cfg.procs < 1 or cfg.clients < cfg.procs or cfg.duration_s <= 0 or cfg.rounds < 1:
        raise SystemExit("need procs >= 1, clients >= procs, duration > 0 and rounds >= 1")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run_watcher(config_from(args, args.rounds))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
