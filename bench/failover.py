"""Failover: how long commands stop when the leading coordinator dies or stalls.

For each leader setting (``--settings``, default the server's own ``5s/1s``
lease/renewal and a shorter ``2s/500ms``), on a throwaway PostgreSQL
(``fencepost_devtools.pgcluster``), two coordinators run as real ``fencepost
serve --db postgresql://...`` processes, each on a fixed loopback port. A
client (bench/coordinators.py ``Follower``: the generated stubs, unary calls,
a request id per command, following ``NOT_LEADER`` and retrying every
``--retry-ms`` with the same request id) keeps ``--workers`` workers looping
``acquire -> renew x3 -> record_checkpoint -> finish`` on fresh runs, and
holds ``--leases`` leases with a 30 s ttl, half of them renewed every 10 s,
half renewed only between failovers (so the extension a takeover gives them
can be checked exactly). With ``--client sdk`` the workers and the renewed
half of the leases use the public SDK instead: one ``fencepost.Client`` given
both endpoints each, which follows the leader itself (its default retry
policy: backoff from 50 ms doubling to 1 s, 10 s in all), the leases kept
alive by its KeepAlive stream.

1. **SIGKILL** (``--kills`` times): the leader is SIGKILLed; the figure is the
   time from the signal to the first command a worker has acknowledged by the
   other coordinator. The killed coordinator is then restarted on its address
   and must come back as a standby (health ``NOT_SERVING``, ``NOT_LEADER``
   naming the new leader).
2. **SIGSTOP** (``--stops`` times): the leader is SIGSTOPped; the figure is
   the time from the signal to the first acknowledgement by the other
   coordinator. Meanwhile a prober keeps sending fresh acquires to the
   stopped leader (they wait in its socket). Once the other one leads, the old
   one is SIGCONTed: it must exit with code 3, and nothing it answers after
   the takeover may be an acknowledgement (no probe acknowledged, no probe run
   in the database, no worker acknowledgement from it after the takeover).
   It is then restarted as a standby.

Throughout, no worker command may be refused (a retried command gets its
stored answer: a refusal would mean a command was lost or done twice) and no
held lease may be lost; after each failover each of the checked leases must
have been extended by exactly the gap the new leader logged. A command the
client gave up on (no answer within its retry policy) ends its lifecycle and
is counted, not hidden. Exit status 1 when any of the checks failed.

Each failover also reports the new leader's own account: ``leases extended by
G ms`` (the database's time from the old leader's last renewal to the
takeover) and ``loaded ... in S s``. Results go to bench/results/failover.json.

    .venv/bin/python bench/failover.py [--kills 20] [--stops 20] [--settings 5s/1s,2s/500ms]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from benchlib import REPO, machine, median, percentile
from coordinators import (
    LEADING,
    STANDBY,
    WORKER_TTL_MS,
    Acks,
    Coordinator,
    Follower,
    Group,
    Leading,
    Refused,
    WorkerStats,
    error_info,
    health,
    request_id,
    worker,
)

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import record_pb2 as rpb
from fencepost_server.config import duration_ms

HOLD_TTL_MS = 30_000


# -- the client side ------------------------------------------------------------------


@dataclass
class Holder:
    """One lease held across failovers (ttl 30 s)."""

    run_id: str
    owner: str
    token: int = 0
    auto_renew: bool = True
    renewals: int = 0
    lost: list[str] = field(default_factory=list)
    sdk_lease: Any = None  # --client sdk: a fencepost.Lease the SDK keeps alive

    async def acquire_sdk(self, client: Any) -> None:
        """Acquire through the SDK, which then renews it (KeepAlive, at ttl/3)."""
        self.sdk_lease = await client.acquire(self.run_id, ttl_ms=HOLD_TTL_MS)
        self.token = self.sdk_lease.fencing_token

    def sdk_lost(self) -> None:
        if self.sdk_lease is not None and self.sdk_lease.is_lost and not self.lost:
            self.lost.append(f"the SDK lost it: {self.sdk_lease.lost_reason}")

    async def acquire(self, f: Follower) -> None:
        r = (await f.call("Acquire", pb.AcquireRequest(
            run_id=self.run_id, owner=self.owner, lease_ttl_ms=HOLD_TTL_MS,
            request_id=request_id()))).response
        self.token = r.run.fencing_token

    async def renew(self, f: Follower) -> None:
        try:
            await f.call("Renew", pb.RenewRequest(
                run_id=self.run_id, owner=self.owner, fencing_token=self.token,
                request_id=request_id()))
            self.renewals += 1
        except (Refused, TimeoutError) as exc:
            self.lost.append(f"renew refused: {exc}")

    async def keep(self, f: Follower, stop: asyncio.Event) -> None:
        """Renew every ttl/3 (what the SDK does), while not lost."""
        while not stop.is_set() and not self.lost:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HOLD_TTL_MS / 3000)
            if not stop.is_set():
                await self.renew(f)

    async def read(self, f: Follower) -> rpb.Run:
        return (await f.call("GetRun", pb.GetRunRequest(run_id=self.run_id))).response.run

    def check(self, run: rpb.Run) -> str | None:
        """Why this lease is lost, judging by the record (None: held)."""
        self.sdk_lost()
        if self.lost:
            return self.lost[0]
        if run.status != rpb.RUN_STATUS_RUNNING or not run.HasField("lease"):
            return f"status {rpb.RunStatus.Name(run.status)}"
        if run.fencing_token != self.token or run.lease.owner != self.owner:
            return f"token {run.fencing_token} owner {run.lease.owner!r}"
        return None


async def sdk_worker(addresses: list[str], acks: Acks, stats: WorkerStats, owner: str,
                     stop: asyncio.Event) -> None:
    """``worker`` through the public SDK: one ``fencepost.Client`` given both
    endpoints (it follows the leader itself), default retry policy. The
    endpoint an acknowledgement is credited to is ``client.address`` (the one
    the SDK believes leads) when it arrives."""
    import fencepost

    async with fencepost.Client(addresses, owner=owner) as client:
        seq = itertools.count()

        async def step(call: Any) -> Any:
            t0 = time.monotonic()
            result = await call
            t1 = time.monotonic()
            acks.add(t1, client.address)
            stats.ops += 1
            stats.longest_s = max(stats.longest_s, t1 - t0)
            return result

        while not stop.is_set():
            run_id = f"{owner}-{next(seq):07d}"
            try:
                lease = await step(client.acquire(run_id, ttl_ms=WORKER_TTL_MS))
                for _ in range(3):
                    await step(lease.renew())
                await step(lease.record_checkpoint("ckpt", 1))
                await step(lease.finish("completed"))
                stats.lifecycles += 1
            except fencepost.UnavailableError as exc:
                stats.timeouts += 1
                stats.note(f"{run_id}: {type(exc).__name__}: {exc}")
            except fencepost.FencepostError as exc:
                stats.refused += 1
                stats.note(f"{run_id}: {type(exc).__name__}: {exc}")


def _expires_ms(run: rpb.Run) -> int:
    return run.lease.expires_at.ToMilliseconds()


# -- one failover ----------------------------------------------------------------------


@dataclass
class Failover:
    kind: str  # "kill" or "stop"
    seconds: float  # signal -> first worker ack by the other coordinator
    epoch: int
    gap_ms: int
    load_s: float
    runs_loaded: int
    standby_back_s: float  # restart -> standby confirmed
    checked_leases: int = 0
    extension_mismatches: list[str] = field(default_factory=list)
    # SIGSTOP only
    exit_code: int | None = None
    exit_after_cont_s: float | None = None
    probes_sent: int = 0
    probes_acked: int = 0
    probe_rows_found: int = 0
    old_acks_after_takeover: int = 0


class Bench:
    def __init__(self, group: Group, args: argparse.Namespace, rng: random.Random,
                 renew_s: float) -> None:
        self.group = group
        self.args = args
        self.rng = rng
        self.renew_s = renew_s
        self.f = Follower(group.addresses, attempt_timeout=args.attempt_timeout,
                          retry_s=args.retry_ms / 1000)
        self.acks = Acks()
        self.stats = WorkerStats()
        self.stop_load = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.holders: list[Holder] = []
        self.scan = 0
        self.sdk_clients: list[Any] = []

    async def start(self, tag: str) -> None:
        sdk = self.args.client == "sdk"
        for i in range(self.args.leases):
            h = Holder(f"hold-{tag}-{i}", f"holder-{tag}-{i}", auto_renew=i % 2 == 0)
            self.holders.append(h)
            if h.auto_renew and sdk:
                import fencepost

                client = fencepost.Client(self.group.addresses, owner=h.owner)
                self.sdk_clients.append(client)
                await h.acquire_sdk(client)
                continue
            await h.acquire(self.f)
            if h.auto_renew:
                self.tasks.append(asyncio.create_task(h.keep(self.f, self.stop_load)))
        for w in range(self.args.workers):
            owner = f"w-{tag}-{w}"
            self.tasks.append(asyncio.create_task(
                sdk_worker(self.group.addresses, self.acks, self.stats, owner, self.stop_load)
                if sdk else worker(self.f, self.acks, self.stats, owner, self.stop_load)))

    async def close(self) -> None:
        self.stop_load.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for h in self.holders:
            h.sdk_lost()
        for client in self.sdk_clients:
            await client.aclose()
        await self.f.close()

    async def wait_first_ack(self, t0: float, address: str, within: float) -> float:
        """When ``address`` first acknowledged a worker command after ``t0``."""
        deadline = time.monotonic() + within
        while True:
            t, self.scan = self.acks.first_after(t0, address, self.scan)
            if t is not None:
                return t
            if time.monotonic() > deadline:
                raise RuntimeError(f"no command acknowledged by {address} within {within:g} s")
            await asyncio.sleep(0.005)

    async def steady(self, leader: Coordinator) -> None:
        """Let the load run on ``leader`` for 1 s plus a random part of a renewal
        interval (the kill lands at any phase of the leader's renewals)."""
        await asyncio.sleep(1.0 + self.rng.uniform(0, self.renew_s))
        t = time.monotonic() - 0.5
        await self.wait_first_ack(t, leader.address, 30)

    async def snapshot(self) -> dict[str, rpb.Run]:
        return {h.run_id: await h.read(self.f) for h in self.holders if not h.lost}

    async def check_leases(self, before: dict[str, rpb.Run], fo: Failover) -> None:
        """After a takeover: every lease held; each lease not renewed since
        ``before`` extended by exactly the logged gap; then renew those."""
        for h in self.holders:
            if h.lost:
                continue
            run = await h.read(self.f)
            why = h.check(run)
            if why is not None:
                h.lost.append(f"after failover (epoch {fo.epoch}): {why}")
                continue
            if h.auto_renew or h.run_id not in before:
                continue
            b = before[h.run_id]
            fo.checked_leases += 1
            delta = _expires_ms(run) - _expires_ms(b)
            if run.version != b.version + 1 or delta != fo.gap_ms:
                fo.extension_mismatches.append(
                    f"{h.run_id}: version {b.version} -> {run.version}, expires +{delta} ms, "
                    f"gap {fo.gap_ms} ms")
            await h.renew(self.f)

    async def restart_as_standby(self, c: Coordinator, leader: Coordinator) -> float:
        """Restart ``c``; seconds until it is confirmed a standby naming ``leader``."""
        t0 = time.monotonic()
        c.start()
        await asyncio.to_thread(c.wait_for, STANDBY, 60)
        deadline = time.monotonic() + 20
        while True:
            status = await asyncio.to_thread(health, c.address)
            named = await _not_leader_names(self.f, c.address)
            if status == "NOT_SERVING" and named == leader.address:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"restarted coordinator {c.index} is not a standby naming "
                                   f"{leader.address}: health {status}, NOT_LEADER names "
                                   f"{named!r}")
            await asyncio.sleep(0.05)
        if c.find(LEADING) is not None:
            raise RuntimeError(f"restarted coordinator {c.index} leads:\n{c.log_tail()}")
        return time.monotonic() - t0

    async def kill(self, leader: Coordinator) -> tuple[Failover, Coordinator]:
        new = self.group.other(leader)
        await self.steady(leader)
        before = await self.snapshot()
        t0 = time.monotonic()
        leader.send(signal.SIGKILL)
        t1 = await self.wait_first_ack(t0, new.address, 120)
        lead = Leading.parse(await asyncio.to_thread(new.wait_for, LEADING, 30))
        await asyncio.to_thread(leader.wait_exit, 10)
        fo = _failover("kill", t1 - t0, lead)
        await self.check_leases(before, fo)
        fo.standby_back_s = await self.restart_as_standby(leader, new)
        return fo, new

    async def stop(self, leader: Coordinator) -> tuple[Failover, Coordinator]:
        new = self.group.other(leader)
        await self.steady(leader)
        before = await self.snapshot()
        probes: list[asyncio.Task[bool]] = []
        probe_ids: list[str] = []
        probing = asyncio.Event()
        t0 = time.monotonic()
        leader.send(signal.SIGSTOP)
        prober = asyncio.create_task(self._probe(leader.address, probing, probes, probe_ids))
        t1 = await self.wait_first_ack(t0, new.address, 120)
        lead = Leading.parse(await asyncio.to_thread(new.wait_for, LEADING, 30))
        await asyncio.sleep(0.5)  # a few more probes queue at the stopped leader
        probing.set()
        await prober
        t_cont = time.monotonic()
        leader.send(signal.SIGCONT)
        code = await asyncio.to_thread(leader.wait_exit, 30)
        exited = time.monotonic() - t_cont
        acked = sum(await asyncio.gather(*probes))
        fo = _failover("stop", t1 - t0, lead)
        fo.exit_code, fo.exit_after_cont_s = code, exited
        fo.probes_sent, fo.probes_acked = len(probes), acked
        fo.old_acks_after_takeover = self.acks.count(leader.address, t1)
        for run_id in probe_ids:
            try:
                await self.f.call("GetRun", pb.GetRunRequest(run_id=run_id))
                fo.probe_rows_found += 1
            except Refused as exc:
                if exc.reason != "RUN_NOT_FOUND":
                    raise
        await self.check_leases(before, fo)
        if code is None:
            leader.stop()
        fo.standby_back_s = await self.restart_as_standby(leader, new)
        return fo, new

    async def _probe(self, address: str, done: asyncio.Event,
                     probes: list[asyncio.Task[bool]], ids: list[str]) -> None:
        """Fresh acquires to the stopped leader every 100 ms, each waiting up to
        60 s for its answer (they are read once it resumes)."""
        stub = self.f.stubs[address]

        async def one(run_id: str) -> bool:
            try:
                await stub.Acquire(pb.AcquireRequest(run_id=run_id, owner="probe",
                                                     request_id=request_id()), timeout=60)
            except grpc.aio.AioRpcError:
                return False
            return True

        while not done.is_set() and len(probes) < 200:
            run_id = f"probe-{request_id()}"
            ids.append(run_id)
            probes.append(asyncio.create_task(one(run_id)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.1)


async def _not_leader_names(f: Follower, address: str) -> str | None:
    """The leader a standby names (its NOT_LEADER metadata), None if it is not one."""
    try:
        await f.stubs[address].GetRun(pb.GetRunRequest(run_id="probe-standby"), timeout=2)
    except grpc.aio.AioRpcError as exc:
        reason, meta = error_info(exc)
        if reason == "NOT_LEADER":
            return meta.get("leader", "")
    return None


def _failover(kind: str, seconds: float, lead: Leading) -> Failover:
    return Failover(kind, round(seconds, 4), lead.epoch, lead.gap_ms, lead.load_s, lead.runs,
                    0.0)


def _dist(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {"n": len(s), "p50": median(s), "p99": percentile(s, 99), "max": s[-1] if s else 0,
            "min": s[0] if s else 0}


async def run_setting(setting: str, args: argparse.Namespace, workdir: Path,
                      rng: random.Random) -> dict[str, Any]:
    lease, renew = setting.split("/")
    tag = setting.replace("/", "-")
    print(f"\nleader lease {lease}, renewal {renew}: PostgreSQL and 2 coordinators", flush=True)
    group = Group.start(workdir / tag, 2, lease=lease, renew=renew)
    bench: Bench | None = None
    out: dict[str, Any] = {"lease": lease, "renew": renew, "failovers": []}
    try:
        leader, _ = await asyncio.to_thread(group.wait_leader, 60)
        await asyncio.to_thread(group.other(leader).wait_for, STANDBY, 60)
        bench = Bench(group, args, rng, duration_ms(renew) / 1000)
        await bench.start(tag)
        for kind, n in (("kill", args.kills), ("stop", args.stops)):
            for i in range(n):
                fo, leader = await (bench.kill(leader) if kind == "kill" else bench.stop(leader))
                out["failovers"].append(asdict(fo))
                extra = ""
                if kind == "stop":
                    extra = (f"; old leader exited {fo.exit_code} {fo.exit_after_cont_s:.2f} s "
                             f"after SIGCONT, probes acked {fo.probes_acked}/{fo.probes_sent}, "
                             f"probe runs stored {fo.probe_rows_found}, its acks after the "
                             f"takeover {fo.old_acks_after_takeover}")
                print(f"  {kind} {i + 1:>2}/{n}: {fo.seconds:6.3f} s to the first ack on the "
                      f"new leader (epoch {fo.epoch}: gap {fo.gap_ms} ms, load "
                      f"{fo.load_s:.2f} s); leases checked {fo.checked_leases}, mismatches "
                      f"{len(fo.extension_mismatches)}; standby back in "
                      f"{fo.standby_back_s:.1f} s{extra}", flush=True)
                for m in fo.extension_mismatches:
                    print(f"      MISMATCH {m}", flush=True)
    except BaseException:
        for c in group.coordinators:  # what the coordinators said, before they go
            print(f"\ncoordinator {c.index} (start {c.starts}, pid "
                  f"{c.proc.pid if c.proc else '-'}, alive {c.alive}) log ends:\n"
                  f"{c.log_tail(40)}", flush=True)
        print(f"\nPostgreSQL log ends:\n{group.cluster.log_tail(20)}", flush=True)
        raise
    finally:
        if bench is not None:
            await bench.close()
        await asyncio.to_thread(group.stop)
    assert bench is not None
    fos = out["failovers"]
    for kind in ("kill", "stop"):
        mine = [f for f in fos if f["kind"] == kind]
        if mine:
            out[kind] = {
                "seconds": _dist([f["seconds"] for f in mine]),
                "gap_ms": _dist([f["gap_ms"] for f in mine]),
                "load_s": _dist([f["load_s"] for f in mine]),
                "after_gap_s": _dist([f["seconds"] - f["gap_ms"] / 1000 for f in mine]),
                "standby_back_s": _dist([f["standby_back_s"] for f in mine]),
            }
    stops = [f for f in fos if f["kind"] == "stop"]
    out["violations"] = {
        "worker_refusals": bench.stats.refused,
        "leases_lost": sum(1 for h in bench.holders if h.lost),
        "extension_mismatches": sum(len(f["extension_mismatches"]) for f in fos),
        "stopped_leader_not_exit_3": sum(1 for f in stops if f["exit_code"] != 3),
        "probes_acked": sum(f["probes_acked"] for f in stops),
        "probe_rows_found": sum(f["probe_rows_found"] for f in stops),
        "old_acks_after_takeover": sum(f["old_acks_after_takeover"] for f in stops),
    }
    out["workers"] = asdict(bench.stats)
    out["leases"] = [{"run_id": h.run_id, "auto_renew": h.auto_renew, "renewals": h.renewals,
                      "lost": h.lost} for h in bench.holders]
    out["checked_leases"] = sum(f["checked_leases"] for f in fos)
    out["failed_attempts"] = bench.f.failed_attempts
    return out


def print_summary(result: dict[str, Any]) -> None:
    print("\nsummary\n")
    print("| leader lease / renewal | failure | failovers | signal -> first ack p50 | p99 "
          "| max | gap (db) p50 | load p50 | first ack - gap p50 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in result["settings"]:
        for kind, what in (("kill", "SIGKILL"), ("stop", "SIGSTOP")):
            d = s.get(kind)
            if d is None:
                continue
            sec = d["seconds"]
            print(f"| {s['lease']} / {s['renew']} | {what} | {sec['n']} | {sec['p50']:.2f} s "
                  f"| {sec['p99']:.2f} s | {sec['max']:.2f} s | {d['gap_ms']['p50'] / 1000:.2f} s "
                  f"| {d['load_s']['p50']:.2f} s | {d['after_gap_s']['p50']:.2f} s |")
    print()
    for s in result["settings"]:
        v = s["violations"]
        w = s["workers"]
        print(f"  {s['lease']}/{s['renew']}: {w['ops']:,} worker commands, {w['lifecycles']:,} "
              f"lifecycles, longest wait {w['longest_s']:.2f} s, {w['timeouts']} lifecycles "
              "ended by a command without an answer; "
              + ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in v.items())
              + f"; leases checked exactly {s['checked_leases']}", flush=True)


async def amain(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _git_head(),
        "machine": machine(),
        "load_before": os.getloadavg(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "client": "the public SDK, fencepost.Client(endpoints), default retry policy"
                  if args.client == "sdk" else
                  "raw stubs (bench/coordinators.py Follower), unary, request ids, retry every "
                  f"{args.retry_ms:g} ms",
        "settings": [],
    }
    started = time.monotonic()
    for setting in args.settings.split(","):
        result["settings"].append(await run_setting(setting.strip(), args, workdir, rng))
    result["load_after"] = os.getloadavg()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    return result


def _git_head() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/failover.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="5s/1s,2s/500ms",
                   help="leader lease/renewal pairs, comma-separated (default 5s/1s,2s/500ms)")
    p.add_argument("--kills", type=int, default=20, help="SIGKILL failovers per setting")
    p.add_argument("--stops", type=int, default=20, help="SIGSTOP failovers per setting")
    p.add_argument("--client", choices=("raw", "sdk"), default="raw",
                   help="the workers' client: raw stubs following the leader (default), or "
                   "the public SDK given both endpoints (one fencepost.Client per worker, its "
                   "default retry policy; half the held leases are then the SDK's too)")
    p.add_argument("--workers", type=int, default=4, help="concurrent lifecycle workers")
    p.add_argument("--leases", type=int, default=8, help="leases held across the failovers")
    p.add_argument("--retry-ms", type=float, default=25.0,
                   help="the client's pause between attempts (default 25)")
    p.add_argument("--attempt-timeout", type=float, default=1.0,
                   help="seconds one attempt waits for its answer (default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "failover.json")
    args = p.parse_args(argv)
    print(f"bench/failover: settings {args.settings}; {args.kills} SIGKILL and {args.stops} "
          f"SIGSTOP failovers each; {args.workers} workers ({args.client} client), {args.leases} "
          f"leases (ttl 30 s); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="fencepost-failover-"))
    workdir.chmod(0o755)  # PostgreSQL's OS user walks through it
    try:
        result = asyncio.run(amain(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_summary(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  took {result['elapsed_s']:.0f} s; results in {args.json}", flush=True)
    bad = {k: n for s in result["settings"] for k, n in s["violations"].items() if n}
    if bad:
        print(f"  VIOLATIONS: {bad}", flush=True)
    for s in result["settings"]:
        for sample in s["workers"]["samples"]:
            print(f"  {s['lease']}/{s['renew']} worker: {sample}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
