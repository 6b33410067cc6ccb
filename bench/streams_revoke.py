"""Revocation latency: operator Cancel -> the holder's `lost` push, over KeepAlive.

The issue: "over at least 1 000 operator cancels of held leases, the time from
the Cancel's answer to the holder's `lost` event, p50/p99. Target: p99 under
20 ms on loopback."

Each run, on a fresh ``fencepost serve --durability full``, in ONE process and
one asyncio loop (so both ends read the same monotonic clock):

1. the *holder* (its own channel, i.e. its own HTTP/2 connection) Acquires
   ``--warmup + --cancels`` runs (owner ``holder``, ttl 120 s so nothing
   expires), opens one KeepAlive stream (``hello{holder}``) and renews every
   lease on it once (a renew also tracks the run); it waits until every
   ``renewed`` has come back, so every run is tracked. A dedicated task reads
   the stream (``async for``) and stamps each ``lost`` with
   ``time.monotonic()`` as it arrives;
2. the *operator* (a second channel) Cancels the runs one after another
   (``--concurrency 1``, the default: the next Cancel is sent when the previous
   answer arrived; with ``--concurrency N``, N callers share the runs), stamping
   the send and the answer. The first ``--warmup`` cancels are not counted;
3. latency = lost_received - cancel_answer_received, per run. It is negative
   when the push reached the holder before the answer reached the operator
   (both leave the server after the same durable commit); the distribution
   and the share of negative values are printed. Also printed:
   lost_received - cancel_sent (the operator's send to the holder knowing) and
   the Cancel RPC's own latency.

Three runs (``--runs``), each on its own server; the medians of the runs'
p50 and p99 are the figures. Target: p99 < 20 ms.

    .venv/bin/python bench/streams_revoke.py [--cancels 1000] [--runs 3] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from benchlib import ArgumentAdder, median
from streams_common import CpuWindow, distribution_ms, fmt_load, start_fencepost

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

TARGET_P99_MS = 20.0
CONNECT_TIMEOUT_S = 20.0
RPC_TIMEOUT_S = 30.0
LOST_WAIT_S = 10.0  # after the last Cancel answered, how long a missing `lost` is awaited


@dataclass
class RevokeConfig:
    cancels: int = 1000
    warmup: int = 50
    runs: int = 3
    concurrency: int = 1
    acquire_concurrency: int = 64


@dataclass
class RunResult:
    run: int
    cancels: int
    concurrency: int
    lost_after_answer: dict[str, float]  # ms distribution
    negative: int  # lost arrived before the Cancel's answer
    lost_after_send: dict[str, float]
    cancel_rpc: dict[str, float]
    missing: int  # no `lost` within LOST_WAIT_S
    wrong_reason: int
    cancel_errors: int
    cancel_phase_s: float
    cpu: dict[str, Any]
    samples: list[str] = field(default_factory=list)


class _Holder:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = ledger_pb2_grpc.LedgerStub(channel)
        self.call: Any = None
        self.renewed: set[str] = set()
        self.all_renewed = asyncio.Event()
        self.expected = 0
        self.lost: dict[str, tuple[float, int]] = {}  # run -> (monotonic, reason)
        self.lost_changed = asyncio.Event()
        self.other: list[str] = []
        self.ended: str | None = None

    async def read(self) -> None:
        try:
            async for msg in self.call:
                now = time.monotonic()
                kind = msg.WhichOneof("kind")
                if kind == "lost":
                    self.lost[msg.lost.run_id] = (now, msg.lost.reason)
                    self.lost_changed.set()
                elif kind == "renewed":
                    self.renewed.add(msg.renewed.run_id)
                    if len(self.renewed) >= self.expected:
                        self.all_renewed.set()
                else:
                    self.other.append(f"{kind}: {msg}")
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.ended = f"{exc.code().name}: {exc.details()}"
            return
        self.ended = "OK (server ended the stream)"


async def _one_run(run_no: int, cfg: RevokeConfig, workdir: Path) -> RunResult:
    srv, _ = start_fencepost(workdir, run_no)
    try:
        holder_ch = grpc.aio.insecure_channel(srv.address)
        op_ch = grpc.aio.insecure_channel(srv.address)
        try:
            return await _measure(run_no, cfg, srv.proc.pid, holder_ch, op_ch)
        finally:
            await holder_ch.close(None)
            await op_ch.close(None)
    finally:
        code = srv.stop()
        if code != 0:
            print(f"  warning: the server exited with {code}; its log ends:\n{srv.log_tail()}")


async def _measure(run_no: int, cfg: RevokeConfig, server_pid: int,
                   holder_ch: grpc.aio.Channel, op_ch: grpc.aio.Channel) -> RunResult:
    for ch in (holder_ch, op_ch):
        await asyncio.wait_for(ch.channel_ready(), CONNECT_TIMEOUT_S)
    holder = _Holder(holder_ch)
    op = ledger_pb2_grpc.LedgerStub(op_ch)
    n = cfg.warmup + cfg.cancels
    run_ids = [f"revoke-r{run_no}-{i:05d}" for i in range(n)]
    tokens: dict[str, int] = {}
    sem = asyncio.Semaphore(cfg.acquire_concurrency)

    async def acquire(run_id: str) -> None:
        async with sem:
            r = await holder.stub.Acquire(
                pb.AcquireRequest(run_id=run_id, owner="holder", lease_ttl_ms=120_000),
                timeout=RPC_TIMEOUT_S)
            tokens[run_id] = r.run.fencing_token

    await asyncio.gather(*(acquire(r) for r in run_ids))
    holder.expected = n
    holder.call = holder.stub.KeepAlive()
    await holder.call.write(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="holder")))
    reader = asyncio.create_task(holder.read())
    try:
        for run_id in run_ids:
            await holder.call.write(pb.KeepAliveRequest(
                renew=pb.KeepAliveRenew(run_id=run_id, fencing_token=tokens[run_id])))
        await asyncio.wait_for(holder.all_renewed.wait(), RPC_TIMEOUT_S)

        sent: dict[str, float] = {}
        answered: dict[str, float] = {}
        errors: list[str] = []
        todo = iter(run_ids)

        async def operator() -> None:
            for run_id in todo:
                t0 = time.monotonic()
                try:
                    await op.Cancel(pb.CancelRequest(run_id=run_id, message="bench"),
                                    timeout=RPC_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    errors.append(f"{run_id}: {exc.code().name} {exc.details()}")
                    continue
                answered[run_id] = time.monotonic()
                sent[run_id] = t0

        # warm-up: the first cancels, not counted
        warm = [next(todo) for _ in range(cfg.warmup)]
        for run_id in warm:
            await op.Cancel(pb.CancelRequest(run_id=run_id, message="bench warm-up"),
                            timeout=RPC_TIMEOUT_S)
        cpu = CpuWindow(server_pid, [os.getpid()])
        t_start = time.monotonic()
        await asyncio.gather(*(operator() for _ in range(cfg.concurrency)))
        phase_s = time.monotonic() - t_start
        use = cpu.stop()
        counted = run_ids[cfg.warmup:]
        deadline = time.monotonic() + LOST_WAIT_S
        while any(r not in holder.lost for r in counted) and time.monotonic() < deadline:
            holder.lost_changed.clear()
            try:
                await asyncio.wait_for(holder.lost_changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
    finally:
        holder.call.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            pass

    after_answer, after_send, rpc = [], [], []
    missing = wrong = 0
    for run_id in counted:
        if run_id not in answered:
            continue
        got = holder.lost.get(run_id)
        if got is None:
            missing += 1
            continue
        t_lost, reason = got
        if reason != pb.LOST_REASON_CANCELLED:
            wrong += 1
        after_answer.append(t_lost - answered[run_id])
        after_send.append(t_lost - sent[run_id])
        rpc.append(answered[run_id] - sent[run_id])
    samples = errors[:5] + holder.other[:5]
    if holder.ended:
        samples.append(f"holder stream ended: {holder.ended}")
    return RunResult(
        run=run_no, cancels=len(counted), concurrency=cfg.concurrency,
        lost_after_answer=distribution_ms(after_answer),
        negative=sum(1 for x in after_answer if x < 0),
        lost_after_send=distribution_ms(after_send),
        cancel_rpc=distribution_ms(rpc),
        missing=missing, wrong_reason=wrong, cancel_errors=len(errors),
        cancel_phase_s=phase_s, cpu=use.as_dict(), samples=samples,
    )


def _print_run(r: RunResult) -> None:
    a, s, c = r.lost_after_answer, r.lost_after_send, r.cancel_rpc
    cpu = r.cpu
    print(f"  run {r.run}: {r.cancels} cancels in {r.cancel_phase_s:.1f} s; answer->lost p50 "
          f"{a.get('p50_ms', 0):.2f} p99 {a.get('p99_ms', 0):.2f} min {a.get('min_ms', 0):.2f} "
          f"max {a.get('max_ms', 0):.2f} ms, negative {r.negative}; send->lost p50 "
          f"{s.get('p50_ms', 0):.2f} p99 {s.get('p99_ms', 0):.2f} ms; Cancel RPC p50 "
          f"{c.get('p50_ms', 0):.2f} p99 {c.get('p99_ms', 0):.2f} ms; missing {r.missing}, "
          f"wrong reason {r.wrong_reason}, cancel errors {r.cancel_errors}", flush=True)
    print(f"         cpu (cores) server {cpu['server']:.2f} this process {cpu['clients']:.2f} "
          f"kernel {cpu['kernel']:.2f} others {cpu['others']:.2f}; load average "
          f"{fmt_load(cpu['loadavg_before'])} -> {fmt_load(cpu['loadavg_after'])}", flush=True)
    for x in r.samples:
        print(f"      {x}", flush=True)


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    def med(attr: str, key: str) -> float:
        return median([getattr(r, attr).get(key, 0.0) for r in runs])

    s: dict[str, Any] = {
        "p50_ms": med("lost_after_answer", "p50_ms"),
        "p99_ms": med("lost_after_answer", "p99_ms"),
        "max_ms": max(r.lost_after_answer.get("max_ms", 0.0) for r in runs),
        "min_ms": min(r.lost_after_answer.get("min_ms", 0.0) for r in runs),
        "negative_share": sum(r.negative for r in runs) / max(1, sum(r.cancels for r in runs)),
        "send_to_lost_p50_ms": med("lost_after_send", "p50_ms"),
        "send_to_lost_p99_ms": med("lost_after_send", "p99_ms"),
        "cancel_rpc_p50_ms": med("cancel_rpc", "p50_ms"),
        "cancel_rpc_p99_ms": med("cancel_rpc", "p99_ms"),
        "missing": sum(r.missing for r in runs),
        "wrong_reason": sum(r.wrong_reason for r in runs),
        "cancel_errors": sum(r.cancel_errors for r in runs),
        "others_cpu": median([r.cpu["others"] for r in runs]),
        "target_p99_ms": TARGET_P99_MS,
    }
    s["valid"] = s["missing"] == 0 and s["wrong_reason"] == 0 and s["cancel_errors"] == 0
    s["target_met"] = s["valid"] and s["p99_ms"] < TARGET_P99_MS
    return s


def verdict(s: dict[str, Any]) -> str:
    if not s["valid"]:
        return "INVALID (missing lost, wrong reasons or failed Cancels; see above)"
    return "met" if s["target_met"] else "MISSED"


def run_revoke(cfg: RevokeConfig) -> dict[str, Any]:
    print(f"revocation latency: {cfg.runs} runs of {cfg.cancels} Cancels ({cfg.warmup} warm-up "
          f"not counted), concurrency {cfg.concurrency}, holder = one KeepAlive stream "
          f"renewing/tracking all the leases", flush=True)
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="fencepost-bench-") as tmp:
        for i in range(cfg.runs):
            r = asyncio.run(_one_run(i, cfg, Path(tmp)))
            _print_run(r)
            runs.append(r)
    s = summarize(runs)
    print(f"  medians of {cfg.runs} runs: answer->lost p50 {s['p50_ms']:.2f} ms, p99 "
          f"{s['p99_ms']:.2f} ms (min {s['min_ms']:.2f}, max {s['max_ms']:.2f} over all runs; "
          f"{s['negative_share']:.0%} negative); send->lost p50 {s['send_to_lost_p50_ms']:.2f} "
          f"p99 {s['send_to_lost_p99_ms']:.2f} ms; target p99 < {TARGET_P99_MS:g} ms: "
          f"{verdict(s)}", flush=True)
    return {"config": asdict(cfg), "runs": [asdict(r) for r in runs], "summary": s}


def add_arguments(p: ArgumentAdder, prefix: str = "") -> None:
    d = RevokeConfig()
    p.add_argument(f"--{prefix}cancels", type=int, default=d.cancels,
                   help=f"counted Cancels per run (default {d.cancels})")
    p.add_argument(f"--{prefix}warmup", type=int, default=d.warmup,
                   help=f"Cancels first, not counted (default {d.warmup})")
    p.add_argument(f"--{prefix}concurrency", type=int, default=d.concurrency,
                   help=f"Cancels in flight at once (default {d.concurrency}: one after another)")


def config_from(args: argparse.Namespace, runs: int, prefix: str = "") -> RevokeConfig:
    def get(name: str) -> Any:
        return getattr(args, f"{prefix}{name}".replace("-", "_"))

    cfg = RevokeConfig(cancels=get("cancels"), warmup=get("warmup"), runs=runs,
                       concurrency=get("concurrency"))
    if cfg.cancels < 1 or cfg.warmup < 0 or cfg.concurrency < 1 or cfg.runs < 1:
        raise SystemExit("need cancels >= 1, warmup >= 0, concurrency >= 1 and runs >= 1")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--runs", type=int, default=3, help="runs, each on a fresh server")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run_revoke(config_from(args, args.runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
