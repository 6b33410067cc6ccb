"""Coordinators that lead shards apart (``fencepost serve --lead-shards``) on
one PostgreSQL database: throughput by coordinator count, shard-move
unavailability, crash failover, all through the public Python SDK.

One throwaway PostgreSQL cluster (``fencepost_devtools.pgcluster``, set up as
bench/peers sets up its own) serves every part; each configuration gets a
fresh database. Coordinators run as real ``fencepost serve --lead-shards``
processes with ``--shards`` shards and a short shard lease (``--lease`` /
``--renew``, 2s/300ms by default, as the system tests), started and stopped
by bench/peers/servers.py (``ShardedCoordinators``).

1. **Scaling**: for each of ``--rounds`` rounds, for each coordinator count
   (1, 2, 3, then doubling up to the machine's cores) and each SDK shape
   (bench/peers: ``fencepost-pg-fleet``, one Client per worker;
   ``fencepost-pg-engine``, one Client per process), a fresh database, the
   coordinators started and balanced, then bench/peers' throughput load
   (acquire -> renew x3 -> record_checkpoint -> finish, warm-up then a
   measured window). Client process i is given ONE address, coordinator
   i mod k's: the SDK finds the other shards' owners on its first NOT_OWNER
   and routes from then on. Reports ops/s (median of rounds), the ratio to 1
   coordinator, and CPU per command of the coordinators (sum of their process
   trees), PostgreSQL (its whole tree) and the client processes.
2. **Planned moves**: 2 coordinators under the fleet load (here every client
   process, and the prober, is given every coordinator's address); a prober
   process (one SDK Client) holds, in every shard, one lease it renews every
   ``--probe-interval-ms`` and ``--held`` leases kept only by the SDK's
   KeepAlive stream (ttl ``--held-ttl-ms``). A 3rd coordinator joins (shards
   are handed to it), then it is SIGTERMed (it hands its shards back and
   exits), then the first one is (the prober's first address). Per moved shard, the
   unavailability is the longest gap between two answered renewals around
   the move, less the probe's own pause (so within one probe interval of the
   truth); unmoved shards over the same windows give the noise floor.
3. **Crash failover**: 3 coordinators under the fleet load, the same prober;
   ``--kills`` times a coordinator is SIGKILLed (in turn the prober's first
   address and the newest one, reported apart), the time until every
   shard it held answers a renewal sent after the kill is taken (the shard
   rows' lease must run out first: ``--lease``), then a fresh coordinator is
   started and the shards rebalanced before the next kill.

Leases lost: every ``on_lost`` the prober's Client reports, every held
lease found lost at the end, and every held lease whose final renewal is
refused (all must be 0).

Sizes come from ``nproc``: client processes max(2, nproc), 32 clients each,
coordinator counts up to max(3, nproc). The machine's other work shares the
cores: its CPU is reported per run (``others``), never subtracted.

    .venv/bin/python bench/shards.py [--smoke] [--rounds 3] [--duration 8] ...

Prints a table and writes bench/results/shards.json (git-ignored). Exit
status 1 when a lease was lost or a part could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchlib import REPO, fmt_rate, machine, median, percentile
from peers import servers
from peers.cli import _git
from peers.load import RunResult, drive

from fencepost_devtools import pgcluster

SHAPES = {"fleet": "fencepost-pg-fleet", "engine": "fencepost-pg-engine"}
CLIENTS_PER_PROC = 32


def default_counts(cores: int) -> list[int]:
    """1, 2, 3, then doubling, up to max(3, cores) (which is always in)."""
    top = max(3, cores)
    counts = {1, 2, 3, top}
    n = 4
    while n < top:
        counts.add(n)
        n *= 2
    return sorted(counts)


def parse_duration_s(text: str) -> float:
    for unit, scale in (("ms", 0.001), ("s", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


# -- the prober: one SDK Client, a renewed lease and held leases in every shard -----------


@dataclass(frozen=True)
class ProbeSpec:
    address: str
    shards: int
    interval_s: float
    held: int
    held_ttl_ms: int
    prefix: str


@dataclass
class ProbeResult:
    # per shard: successful renewals as (sent, answered) monotonic pairs, flat
    answers: dict[int, bytes] = field(default_factory=dict)
    failures: int = 0
    failure_samples: list[str] = field(default_factory=list)
    lost_reported: list[str] = field(default_factory=list)
    held: int = 0
    held_lost: int = 0
    held_refused: int = 0
    held_samples: list[str] = field(default_factory=list)


def run_ids_by_shard(prefix: str, shards: int, per_shard: int) -> dict[int, list[str]]:
    """``per_shard`` run ids in each shard, as the server places them."""
    from fencepost import shard_of

    out: dict[int, list[str]] = {s: [] for s in range(shards)}
    i = 0
    while any(len(v) < per_shard for v in out.values()):
        run_id = f"{prefix}-{i}"
        i += 1
        got = out[shard_of(run_id, shards)]
        if len(got) < per_shard:
            got.append(run_id)
    return out


async def _probe_main(spec: ProbeSpec, ready: Any, stop: Any) -> ProbeResult:
    import fencepost

    logging.getLogger("fencepost").setLevel(logging.ERROR)
    res = ProbeResult()

    def on_lost(lease: Any, reason: Any) -> None:
        res.lost_reported.append(f"{lease.run_id}: {reason}")

    ids = run_ids_by_shard(spec.prefix, spec.shards, 1 + spec.held)
    async with fencepost.Client(spec.address, owner=f"prober-{os.getpid()}",
                                on_lost=on_lost) as client:
        probes = {s: await client.acquire(v[0], ttl_ms=30_000) for s, v in ids.items()}
        held = [await client.acquire(r, ttl_ms=spec.held_ttl_ms)
                for v in ids.values() for r in v[1:]]
        res.held = len(held)
        times: dict[int, array[float]] = {s: array("d") for s in ids}
        done = asyncio.Event()

        async def probe(shard: int) -> None:
            lease = probes[shard]
            while not done.is_set():
                sent = time.monotonic()
                try:
                    await lease.renew()
                except Exception as exc:
                    res.failures += 1
                    if len(res.failure_samples) < 5:
                        res.failure_samples.append(f"shard {shard}: {type(exc).__name__}: "
                                                   f"{exc}"[:300])
                else:
                    times[shard].extend((sent, time.monotonic()))
                try:
                    await asyncio.wait_for(done.wait(), spec.interval_s)
                except TimeoutError:
                    pass

        tasks = [asyncio.create_task(probe(s)) for s in ids]
        ready.put("ready")
        await asyncio.to_thread(stop.wait)
        done.set()
        await asyncio.gather(*tasks)

        async def check(lease: Any) -> None:
            if lease.is_lost:
                res.held_lost += 1
                return
            try:
                await lease.renew()  # still ours: the fenced renewal is accepted
                await lease.release()
            except Exception as exc:
                res.held_refused += 1
                if len(res.held_samples) < 5:
                    res.held_samples.append(f"{lease.run_id}: {type(exc).__name__}: {exc}"[:300])

        await asyncio.gather(*(check(lease) for lease in held))
        for lease in probes.values():
            try:
                await lease.release()
            except Exception:
                pass  # counted as a failure of its last renewal already
        res.answers = {s: t.tobytes() for s, t in times.items()}
    return res


def probe_process(spec: ProbeSpec, ready: Any, stop: Any, out: Any) -> None:
    try:
        out.put(asyncio.run(_probe_main(spec, ready, stop)))
    except BaseException as exc:
        failure = RuntimeError(f"prober failed: {exc!r}")
        ready.put(failure)
        out.put(failure)
        raise


class Prober:
    """The prober process: started, stopped, its answers by shard."""

    def __init__(self, spec: ProbeSpec) -> None:
        ctx = mp.get_context("spawn")
        self._ready, self._out, self._stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self._proc = ctx.Process(target=probe_process, args=(spec, self._ready, self._stop,
                                                             self._out),
                                 name="shards-prober", daemon=True)
        self._proc.start()
        try:
            got = self._ready.get(timeout=120)
        except queue.Empty:
            self.kill()
            raise RuntimeError("the prober did not start in time") from None
        if isinstance(got, BaseException):
            self.kill()
            raise got

    def finish(self, timeout: float = 300.0) -> ProbeResult:
        self._stop.set()
        try:
            got = self._out.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError("the prober did not report in time") from None
        finally:
            self.kill()
        if isinstance(got, BaseException):
            raise got
        assert isinstance(got, ProbeResult)
        return got

    def kill(self) -> None:
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def answers(res: ProbeResult) -> dict[int, list[tuple[float, float]]]:
    out: dict[int, list[tuple[float, float]]] = {}
    for s, raw in res.answers.items():
        a: array[float] = array("d")
        a.frombytes(raw)
        out[s] = list(zip(a[0::2], a[1::2], strict=True))
    return out


def longest_gap(pairs: list[tuple[float, float]], start: float, end: float) -> float | None:
    """The longest time between consecutive answers over [start, end], from
    the last answer before ``start`` to the first after ``end``; None when
    there is no answer before, or none after ``start``."""
    got = [a for _, a in pairs]
    before = [a for a in got if a < start]
    inside = [a for a in got if start <= a <= end]
    after = [a for a in got if a > end]
    seq = before[-1:] + inside + after[:1]
    if not before:
        return None
    if len(seq) < 2:
        return None
    return max(b - a for a, b in itertools.pairwise(seq))


def lost_count(res: ProbeResult) -> int:
    return len(res.lost_reported) + res.held_lost + res.held_refused


def pcts(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99),
            "max": v[-1] if v else 0.0}


# -- the parts ---------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = servers.make_workdir()
        self.cluster: pgcluster.Cluster | None = None
        self.dbs = 0
        self.failures: list[str] = []

    def start(self) -> None:
        self.cluster = pgcluster.Cluster.start(self.workdir / "pg", settings=servers.PG_SETTINGS)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        servers.remove_workdir(self.workdir)

    def fleet(self, backend: str, k: int) -> servers.ShardedCoordinators:
        """A fresh database and k coordinators leading its shards, balanced."""
        assert self.cluster is not None
        self.dbs += 1
        a = self.args
        f = servers.ShardedCoordinators(backend, self.cluster, f"shards_{self.dbs}",
                                        self.workdir, shards=a.shards, lease=a.lease,
                                        renew=a.renew)
        try:
            for _ in range(k):
                f.add()
            f.wait_balanced()
        except BaseException:
            f.stop()
            raise
        return f

    def _drive(self, f: servers.ShardedCoordinators, backend: str, rnd: int,
               duration: float, clients: int = 0) -> RunResult:
        a = self.args
        clients = clients or a.clients
        run, _ = drive(f, rnd, clients=clients, procs=min(a.procs, clients), warmup_s=a.warmup,
                       duration_s=duration, options={})
        return run

    # 1. scaling

    def scaling(self) -> list[dict[str, Any]]:
        a = self.args
        rows: list[dict[str, Any]] = []
        for rnd in range(a.rounds):
            order = a.counts[rnd % len(a.counts):] + a.counts[:rnd % len(a.counts)]
            for k in order:
                for shape in a.shapes:
                    backend = SHAPES[shape]
                    try:
                        f = self.fleet(backend, k)
                    except Exception as exc:
                        self.failures.append(f"{shape} x{k} round {rnd}: could not start: {exc}")
                        print(f"  {shape} x{k}: could not start: {exc}", flush=True)
                        continue
                    try:
                        r = self._drive(f, backend, rnd, a.duration)
                    except Exception as exc:
                        self.failures.append(f"{shape} x{k} round {rnd}: {exc!r}")
                        traceback.print_exc()
                        continue
                    finally:
                        f.stop()
                    row = {"shape": shape, "coordinators": k, **asdict(r)}
                    rows.append(row)
                    _print_row(row)
        return rows

    # 2. planned moves

    def _prober(self, f: servers.ShardedCoordinators, tag: str) -> Prober:
        a = self.args
        return Prober(ProbeSpec(address=",".join(f.addresses), shards=a.shards,
                                interval_s=a.probe_interval_ms / 1000.0, held=a.held,
                                held_ttl_ms=a.held_ttl_ms, prefix=f"probe-{tag}"))

    def _under_load(self, f: servers.ShardedCoordinators, duration: float,
                    tag: str) -> tuple[threading.Thread, dict[str, Any]]:
        """The fleet load in the background for warm-up + ``duration``."""
        box: dict[str, Any] = {}

        def go() -> None:
            try:
                box["run"] = self._drive(f, SHAPES["fleet"], 0, duration,
                                         self.args.event_clients)
            except BaseException as exc:
                box["error"] = exc

        box["clients"] = self.args.event_clients or self.args.clients
        t = threading.Thread(target=go, name=f"load-{tag}", daemon=True)
        t.start()
        box["begin"] = time.monotonic() + 0.2 + self.args.warmup
        box["end"] = box["begin"] + duration
        return t, box

    def moves(self) -> dict[str, Any]:
        a = self.args
        f = self.fleet(SHAPES["fleet"], 2)
        f.give_all = True
        events: list[dict[str, Any]] = []
        try:
            prober = self._prober(f, "moves")
            given = f.address
            try:
                budget = 3 * (a.settle + parse_duration_s(a.lease) + 2.0)
                thread, box = self._under_load(f, budget, "moves")
                time.sleep(max(0.0, box["begin"] - time.monotonic()))
                before = f.owners()
                t0 = time.monotonic()
                joined = f.add()
                after = f.wait_balanced()
                events.append(_event("join", t0, time.monotonic(), before, after,
                                     {s for s in after if after[s] == joined.address},
                                     prober_was_given_it=False))
                time.sleep(a.settle)
                # an operator moves single shards, each out and back (the pins then
                # match the assignment), with the CLI, which waits until it is led there
                for i in range(a.operator_moves):
                    src, dst = f.live[i % len(f.live)], f.live[(i + 1) % len(f.live)]
                    shard = next(s for s, addr in sorted(after.items()) if addr == src.address)
                    for there, back in ((src, dst), (dst, src)):
                        before = f.owners()
                        t0 = time.monotonic()
                        cli_s = _operator_move(shard, back.address, there.address)
                        after = f.owners()
                        events.append(_event("move", t0, time.monotonic(), before, after,
                                             {shard}, prober_was_given_it=False, cli_s=cli_s))
                        time.sleep(a.settle / 2)
                # the newest one leaves, then the one the prober was given
                for leaving in (joined, f.live[0]):
                    before = after
                    t0 = time.monotonic()
                    code = f.leave(leaving)
                    after = f.wait_balanced()
                    events.append(_event("leave", t0, time.monotonic(), before, after,
                                         {s for s in before if before[s] == leaving.address},
                                         exit_code=code,
                                         prober_was_given_it=leaving.address == given))
                    time.sleep(a.settle)
                thread.join(budget + 120)
            finally:
                res = prober.finish()
        finally:
            f.stop()
        return _moves_summary(events, res, box, a)

    # 3. crash failover

    def kills(self) -> dict[str, Any]:
        a = self.args
        lease_s = parse_duration_s(a.lease)
        f = self.fleet(SHAPES["fleet"], a.kill_coordinators)
        f.give_all = True
        events: list[dict[str, Any]] = []
        try:
            prober = self._prober(f, "kills")
            given = f.address
            try:
                budget = a.kills * (lease_s + a.settle + 4.0)
                thread, box = self._under_load(f, budget, "kills")
                time.sleep(max(0.0, box["begin"] - time.monotonic()))
                for i in range(a.kills):
                    before = f.owners()
                    # in turn the coordinator the prober was given (it must find the
                    # new owners from the map of another) and the newest one
                    victim = f.live[0] if i % 2 == 0 else f.live[-1]
                    t0 = time.monotonic()
                    f.crash(victim)
                    after = f.wait_balanced(timeout=lease_s + 60)
                    events.append(_event("kill", t0, time.monotonic(), before, after,
                                         {s for s in before if before[s] == victim.address},
                                         prober_was_given_it=victim.address == given))
                    f.add()
                    f.wait_balanced()
                    time.sleep(a.settle)
                thread.join(budget + 120)
            finally:
                res = prober.finish()
        finally:
            f.stop()
        return _kills_summary(events, res, box, a)


def _operator_move(shard: int, to: str, at: str) -> float:
    """``fencepost shards move`` (it returns once the shard is led there): its seconds."""
    out = subprocess.run([str(servers.BIN / "fencepost"), "shards", "move", str(shard), "--to", to,
                          "--addr", at, "--json"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"shards move {shard} --to {to}: {out.stderr or out.stdout}")
    return float(json.loads(out.stdout)["seconds"])


def _event(kind: str, t0: float, balanced: float, before: dict[int, str],
           after: dict[int, str], moved: set[int], **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "t0": t0, "balanced_s": balanced - t0, "moved": sorted(moved),
            "owners_before": len(set(before.values())), "owners_after": len(set(after.values())),
            **extra}


def _load_info(box: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"window_s": box["end"] - box["begin"], "clients": box["clients"]}
    if "error" in box:
        out["error"] = repr(box["error"])
    run: RunResult | None = box.get("run")
    if run is not None:
        out.update(ops_per_s=run.ops_per_s, errors=run.errors, error_samples=run.error_samples)
    out["events_outside_load"] = sum(1 for e in events
                                     if not box["begin"] <= e["t0"] <= box["end"])
    return out


def _lost_info(res: ProbeResult) -> dict[str, Any]:
    return {"leases_lost": lost_count(res), "lost_reported": res.lost_reported[:5],
            "held": res.held, "held_lost": res.held_lost, "held_refused": res.held_refused,
            "held_samples": res.held_samples, "probe_failures": res.failures,
            "probe_failure_samples": res.failure_samples}


def _moves_summary(events: list[dict[str, Any]], res: ProbeResult, box: dict[str, Any],
                   a: argparse.Namespace) -> dict[str, Any]:
    by_shard = answers(res)
    pause = a.probe_interval_ms / 1000.0
    moved_ms: list[float] = []
    still_ms: list[float] = []
    missing = 0
    for e in events:
        # the window: from the signal until settled after the rows balanced
        start, end = e["t0"], e["t0"] + e["balanced_s"] + a.settle
        per: dict[int, float] = {}
        for s, pairs in by_shard.items():
            g = longest_gap(pairs, start, end)
            if g is None:
                if s in e["moved"]:
                    missing += 1
                continue
            ms = max(0.0, g - pause) * 1000
            (moved_ms if s in e["moved"] else still_ms).append(ms)
            per[s] = round(ms, 1)
        e["unavailable_ms"] = {s: per[s] for s in e["moved"] if s in per}
        e["moved_pcts_ms"] = pcts([per[s] for s in e["moved"] if s in per])
    kinds: dict[str, list[float]] = {}
    for e in events:
        kinds.setdefault(e["kind"], []).extend(e["unavailable_ms"].values())
    return {"events": events, "by_kind_ms": {k: pcts(v) for k, v in kinds.items()},
            "moved_shards": len(moved_ms),
            "moved_never_answered": missing,
            "unavailable_ms": pcts(moved_ms), "unmoved_baseline_ms": pcts(still_ms),
            "load": _load_info(box, events), **_lost_info(res)}


def _kills_summary(events: list[dict[str, Any]], res: ProbeResult, box: dict[str, Any],
                   a: argparse.Namespace) -> dict[str, Any]:
    by_shard = answers(res)
    per_kill: list[float] = []
    per_shard: list[float] = []
    missing = 0
    for e in events:
        t0 = e["t0"]
        mine: dict[int, float] = {}
        for s in e["moved"]:
            after = [ans for sent, ans in by_shard.get(s, []) if sent >= t0]
            if not after:
                missing += 1
                continue
            mine[s] = after[0] - t0
        e["answered_again_s"] = {s: round(v, 3) for s, v in mine.items()}
        if mine:
            per_kill.append(max(mine.values()))
            per_shard.extend(mine.values())
            e["all_answered_s"] = max(mine.values())
    lease_s = parse_duration_s(a.lease)
    by_kind = {kind: pcts([e["all_answered_s"] for e in events if "all_answered_s" in e
                           and e["prober_was_given_it"] == given])
               for kind, given in (("victim_given_to_prober", True),
                                   ("victim_not_given_to_prober", False))}
    return {"events": events, "lease_s": lease_s, "kills": len(events),
            "all_shards_answered_s": pcts(per_kill), "per_shard_answered_s": pcts(per_shard),
            **by_kind,
            "after_lease_s": pcts([x - lease_s for x in per_kill]),
            "shards_never_answered": missing, "load": _load_info(box, events),
            **_lost_info(res)}


# -- summary and printing ----------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    shapes = sorted({r["shape"] for r in rows})
    for shape in shapes:
        base: float | None = None
        for k in sorted({r["coordinators"] for r in rows if r["shape"] == shape}):
            mine = [r for r in rows if r["shape"] == shape and r["coordinators"] == k]
            ops = median([r["ops_per_s"] for r in mine])
            if k == 1:
                base = ops
            parts = [r["parts_us_per_op"] for r in mine]
            out.append({
                "shape": shape, "coordinators": k, "rounds": len(mine), "ops_per_s": ops,
                "ratio_to_1": ops / base if base else None,
                "p50_ms": median([r["p50_ms"] for r in mine]),
                "p99_ms": median([r["p99_ms"] for r in mine]),
                "coordinators_us_per_op": median([p.get("coordinators", 0.0) for p in parts]),
                "postgres_us_per_op": median([p.get("postgres", 0.0) for p in parts]),
                "clients_us_per_op": median([r["clients_us_per_op"] for r in mine]),
                "server_cores": median([r["server_cpu"] for r in mine]),
                "clients_cores": median([r["clients_cpu"] for r in mine]),
                "machine_cores": median([r["machine_cpu"] for r in mine]),
                "others_cores": median([r["other_cpu"] for r in mine]),
                "writer_mean_batch": median([r["writer_mean_batch"] for r in mine
                                             if r["writer_mean_batch"] is not None]),
                "errors": sum(r["errors"] for r in mine),
                "per_round_ops_per_s": [round(r["ops_per_s"]) for r in
                                        sorted(mine, key=lambda r: r["round"])],
            })
    return out


def _print_row(r: dict[str, Any]) -> None:
    p = r["parts_us_per_op"]
    print(f"  round {r['round']}  {r['shape']:<6} x{r['coordinators']}  "
          f"{fmt_rate(r['ops_per_s']):>6} ops/s  p50 {r['p50_ms']:6.2f} ms  "
          f"p99 {r['p99_ms']:7.2f} ms  coordinators {p.get('coordinators', 0):5.0f} us/op  "
          f"postgres {p.get('postgres', 0):4.0f} us/op  clients {r['clients_us_per_op']:4.0f} "
          f"us/op  machine {r['machine_cpu']:4.2f} cores  others {r['other_cpu']:4.2f}  "
          f"errors {r['errors']}", flush=True)
    for s in r["error_samples"]:
        print(f"      error: {s}", flush=True)


def print_summary(s: list[dict[str, Any]], rounds: int) -> None:
    print(f"\nscaling, medians of {rounds} round(s):\n")
    print("| shape | coordinators | ops/s | vs 1 coordinator | p50 | p99 | coordinators CPU/op "
          "| PostgreSQL CPU/op | clients CPU/op | machine cores | others' cores | writer batch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in s:
        ratio = f"{m['ratio_to_1']:.2f}" if m["ratio_to_1"] is not None else "n/a"
        print(f"| {m['shape']} | {m['coordinators']} | {fmt_rate(m['ops_per_s'])} | {ratio} "
              f"| {m['p50_ms']:.1f} ms | {m['p99_ms']:.1f} ms "
              f"| {m['coordinators_us_per_op']:.0f} µs | {m['postgres_us_per_op']:.0f} µs "
              f"| {m['clients_us_per_op']:.0f} µs | {m['machine_cores']:.2f} "
              f"| {m['others_cores']:.2f} | {m['writer_mean_batch']:.1f} |")


def print_moves(m: dict[str, Any]) -> None:
    u, b = m["unavailable_ms"], m["unmoved_baseline_ms"]
    print(f"\nplanned moves (2 -> 3 join; operator moves, out and back; SIGTERM: 3 -> 2, "
          f"then 2 -> 1), fleet load "
          f"{fmt_rate(m['load'].get('ops_per_s', 0))} ops/s from {m['load'].get('clients')} "
          f"clients, {m['load'].get('errors', '?')} load errors:")
    for e in m["events"]:
        pm = e["moved_pcts_ms"]
        if not pm["n"]:
            print(f"  {e['kind']:<5} {len(e['moved'])} shards moved: none answered again")
            continue
        who = " (the prober's address)" if e["prober_was_given_it"] else ""
        cli = f" (the CLI waited {e['cli_s'] * 1000:.0f} ms)" if "cli_s" in e else ""
        print(f"  {e['kind']}{who}: {len(e['moved'])} shards moved, rows balanced in "
              f"{e['balanced_s']:.2f} s{cli}; unavailable p50 {pm['p50']:.0f} ms, p99 "
              f"{pm['p99']:.0f} ms, max {pm['max']:.0f} ms")
    for kind, pk in m.get("by_kind_ms", {}).items():
        print(f"  all {kind}s: {pk['n']} shards, unavailable p50 {pk['p50']:.0f} ms, "
              f"p99 {pk['p99']:.0f} ms")
    print(f"  moved shards: {u['n']}, unavailable p50 {u['p50']:.0f} ms, p99 {u['p99']:.0f} ms "
          f"(unmoved shards, same windows: p50 {b['p50']:.0f} ms, p99 {b['p99']:.0f} ms); "
          f"never answered {m['moved_never_answered']}; leases lost {m['leases_lost']} "
          f"(of {m['held']} held + the probes)")


def print_kills(k: dict[str, Any]) -> None:
    a, p = k["all_shards_answered_s"], k["per_shard_answered_s"]
    print(f"\ncrash failover ({k['kills']} SIGKILLs, shard lease {k['lease_s']:g} s), fleet "
          f"load {fmt_rate(k['load'].get('ops_per_s', 0))} ops/s, "
          f"{k['load'].get('errors', '?')} load errors:")
    for e in k["events"]:
        given = "the prober's address" if e["prober_was_given_it"] else "not the prober's"
        print(f"  kill ({given}): {len(e['moved'])} shards, all answered again after "
              f"{e.get('all_answered_s', float('nan')):.2f} s (rows balanced after "
              f"{e['balanced_s']:.2f} s)")
    print(f"  every shard of the killed one answered again: p50 {a['p50']:.2f} s, p99 "
          f"{a['p99']:.2f} s from the kill (p50 {a['p50'] - k['lease_s']:.2f} s after the "
          f"lease); per shard p50 {p['p50']:.2f} s, p99 {p['p99']:.2f} s; never answered "
          f"{k['shards_never_answered']}; leases lost {k['leases_lost']}")
    for kind in ("victim_given_to_prober", "victim_not_given_to_prober"):
        m = k[kind]
        if m["n"]:
            print(f"  {kind.replace('_', ' ')}: {m['n']} kill(s), all answered p50 "
                  f"{m['p50']:.2f} s, max {m['max']:.2f} s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "work_tree_changes": _git("status", "--porcelain", "--", "server").splitlines(),
        "machine": machine(),
        "versions": servers.versions(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "client_addresses": "scaling: client process i is given coordinator i mod k's "
                            "address only, the SDK routes to each shard's owner after its "
                            "first NOT_OWNER; moves and kills: every client process and "
                            "the prober are given every coordinator's address",
        "load_before": os.getloadavg(),
    }
    print(f"bench-shards: {args.shards} shards, coordinators {args.counts}, shapes "
          f"{', '.join(args.shapes)}; {args.clients} clients in {args.procs} processes; "
          f"{args.rounds} round(s) of {args.warmup:g} s warm-up + {args.duration:g} s; shard "
          f"lease {args.lease}/{args.renew}; load average {os.getloadavg()[0]:.1f}", flush=True)
    b = Bench(args)
    result["workdir"] = str(b.workdir)
    rows: list[dict[str, Any]] = []
    moves: dict[str, Any] | None = None
    kills: dict[str, Any] | None = None
    try:
        b.start()
        rows = b.scaling()
        if args.moves:
            try:
                moves = b.moves()
            except Exception as exc:
                b.failures.append(f"moves: {exc!r}")
                traceback.print_exc()
        if args.kills:
            try:
                kills = b.kills()
            except Exception as exc:
                b.failures.append(f"kills: {exc!r}")
                traceback.print_exc()
    finally:
        b.close()
    summary = summarize(rows)
    print_summary(summary, args.rounds)
    if moves is not None:
        print_moves(moves)
    if kills is not None:
        print_kills(kills)
    result.update({
        "runs": rows, "summary": summary, "moves": moves, "kills": kills,
        "failures": b.failures, "load_after": os.getloadavg(),
        "elapsed_s": round(time.monotonic() - started, 1),
    })
    print(f"\n  load average {result['load_before'][0]:.1f} before, "
          f"{result['load_after'][0]:.1f} after; took {result['elapsed_s']:.0f} s", flush=True)
    for f in b.failures:
        print(f"  FAILED: {f}", flush=True)
    return result


def parser() -> argparse.ArgumentParser:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(prog="bench/shards.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="a quick check: 8 shards, 1 and 2 coordinators, 1 round of 1 s, "
                   "16 clients, 1 kill")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=float, default=2.0, help="seconds, not counted")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    p.add_argument("--coordinators", default="",
                   help="comma-separated counts (default: 1, 2, 3, doubling up to "
                   f"max(3, nproc) = {default_counts(cores)})")
    p.add_argument("--shapes", default="fleet,engine", help="from fleet, engine")
    p.add_argument("--procs", type=int, default=max(2, cores), help="client processes")
    p.add_argument("--clients", type=int, default=0,
                   help=f"clients in all (default {CLIENTS_PER_PROC} per process)")
    p.add_argument("--shards", type=int, default=64, help="the database's shard count")
    p.add_argument("--lease", default="2s", help="each shard's lease (--leader-lease)")
    p.add_argument("--renew", default="300ms", help="shard lease renewal (--leader-renew)")
    p.add_argument("--no-moves", dest="moves", action="store_false",
                   help="skip the planned-move part")
    p.add_argument("--event-clients", type=int, default=0,
                   help="load clients during the moves and kills (default: --clients, which "
                   "fills the machine; fewer leave room to see the move itself)")
    p.add_argument("--operator-moves", type=int, default=3,
                   help="single shards an operator moves (each out and back) in the moves part")
    p.add_argument("--kills", type=int, default=4, help="SIGKILLs in the failover part (0: none)")
    p.add_argument("--kill-coordinators", type=int, default=3,
                   help="coordinators running when one is killed")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds after the shards balance before the next move or kill")
    p.add_argument("--probe-interval-ms", type=float, default=50.0,
                   help="the prober's pause between renewals of each shard's probe lease "
                   "(much shorter: the prober itself fills a core)")
    p.add_argument("--held", type=int, default=2, help="leases held per shard by the prober")
    p.add_argument("--held-ttl-ms", type=int, default=4000,
                   help="their ttl: kept alive only by the SDK's KeepAlive stream")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "shards.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.rounds, args.warmup, args.duration = 1, 0.5, 1.0
        args.shards, args.kills, args.settle = 8, 2, 0.5
        args.operator_moves = min(args.operator_moves, 1)
        args.coordinators = args.coordinators or "1,2"
        args.clients = args.clients or 16
        args.procs = min(args.procs, 2)
    args.counts = ([int(x) for x in args.coordinators.split(",") if x.strip()]
                   or default_counts(os.cpu_count() or 1))
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.clients = args.clients or CLIENTS_PER_PROC * args.procs
    if any(s not in SHAPES for s in args.shapes) or not args.shapes:
        raise SystemExit(f"--shapes: pick from {', '.join(SHAPES)}")
    if args.rounds < 1 or args.duration <= 0 or args.procs < 1 or args.clients < args.procs \
            or min(args.counts) < 1 or args.kill_coordinators < 2:
        raise SystemExit("need rounds >= 1, duration > 0, procs >= 1, clients >= procs, "
                         "coordinator counts >= 1, kill-coordinators >= 2")
    if not pgcluster.available():
        raise SystemExit("PostgreSQL's server binaries are missing (make postgres installs them)")
    result = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  results in {args.json}", flush=True)
    lost = sum(p["leases_lost"] for p in (result["moves"], result["kills"]) if p)
    if lost:
        print(f"  LEASES LOST: {lost}", flush=True)
    return 1 if lost or result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
