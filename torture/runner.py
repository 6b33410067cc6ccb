"""One torture run: a ``--test-hooks`` server, a proxy, worker processes, the
nemesis, then the liveness phase, a graceful stop, and the checkers.

Everything runs on loopback, is bounded in time, and every process started is
stopped on the way out, failure or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import REPO
from .checkers import MAX_PER_CHECK, Checked, check_all
from .client import Client
from .history import LEDGER_WRITES, SUSPENDED, TERMINAL, Op, read_ops
from .nemesis import KINDS, Nemesis, Proxy, schedule
from .snapshots import check_snapshots
from .worker import LOCK_DELAY_MS, MAX_TTL_MS

COMPLETED = 4


@dataclass
class Config:
    duration_s: float = 60.0
    seed: int = 1
    out: Path = field(default_factory=lambda: REPO / "build" / "torture" / "last")
    workers: int = 4
    threads: int = 3
    runs: int = 6
    profile: str = "default"  # workload mix (worker.PROFILES)
    nemesis: str = "default"  # fault mix (nemesis.NEMESIS_PROFILES)
    fault: str = ""  # a deliberately broken server build (--fault)
    transport: str = "mixed"  # ledger mutations: unary, stream, mixed (torture/client.py)
    liveness_bound_s: float = 20.0
    drain_s: float = 20.0  # after the deadline: workers finish retries within this
    budget: int = 5_000_000  # linearizability search configurations per run
    # every checkpoint also writes the run's snapshot (torture/snapshots.py):
    # "fenced" (under the handle's fence), "unfenced" (the window left open:
    # the run then finds stale snapshots), or "" (no snapshots)
    snapshots: str = "fenced"


@dataclass
class Outcome:
    config: dict[str, Any]
    ops: int
    ops_by_function: dict[str, dict[str, int]]
    ops_by_transport: dict[str, dict[str, int]]
    unknown: dict[str, Any]
    faults: dict[str, Any]
    checker_seconds: dict[str, float]
    linearizability: dict[str, Any]
    liveness: list[dict[str, Any]]
    violations: dict[str, int]
    violation_details: list[str]
    wall_seconds: float
    server_starts: int
    snapshots: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        c = self.config
        lines = [
            f"torture seed={c['seed']} duration={c['duration_s']:.0f}s workers={c['workers']}x"
            f"{c['threads']} runs={c['runs']} profile={c['profile']} nemesis={c['nemesis']}"
            f" transport={c.get('transport', 'unary')}"
            + (f" FAULT={c['fault']}" if c["fault"] else ""),
            f"  operations: {self.ops} "
            f"({', '.join(f'{k} {sum(v.values())}' for k, v in self.ops_by_function.items())})",
            "  transports: " + "; ".join(
                f"{tp} {t['ops']} ops ({t['ledger_writes']} ledger mutations from "
                f"{t['clients']} clients; {t['transport_failures']} lost their connection or "
                f"timed out, {t['left_unknown']} stayed unknown)"
                for tp, t in self.ops_by_transport.items()),
            f"  unknown outcome: {self.unknown['calls']} calls lost their connection or timed "
            f"out; {self.unknown['resolved']} were resolved by a retry with the same request "
            f"id, {self.unknown['left']} stayed unknown",
            f"  faults: {', '.join(f'{k} {v}' for k, v in self.faults['by_kind'].items())}; "
            f"{self.faults['cut_connections']} connections cut; server started "
            f"{self.server_starts} times",
            f"  checkers: {sum(self.checker_seconds.values()):.1f} s ("
            + ", ".join(f"{k} {v:.2f}" for k, v in self.checker_seconds.items()) + ")",
            f"  linearizability: {self.linearizability['ops']} ops in "
            f"{self.linearizability['segments']} segments over {self.linearizability['runs']} "
            f"runs, {self.linearizability['configurations']} configurations searched",
            f"  liveness: {len(self.liveness)} runs acquired and finished, slowest "
            f"{max((r['seconds'] for r in self.liveness), default=0):.2f} s",
            *([self._snapshot_line()] if self.snapshots else []),
            f"  violations: {sum(self.violations.values())} "
            + (str(self.violations) if self.violations else ""),
        ]
        lines += ["  " + d.replace("\n", "\n  ") for d in self.violation_details[:20]]
        return "\n".join(lines)


    def _snapshot_line(self) -> str:
        s = self.snapshots
        return (f"  snapshots ({s['mode']}): {s['writes']} written ({s['accepted']} accepted, "
                f"{s['refused']} refused RUN_LEASE_LOST, {s['refused_stale']} of them sent "
                f"after the takeover); stale snapshots visible after a takeover: "
                f"{s['stale_accepted']} ({s['stale_read']} read back by a holder); "
                f"{s['reads']} snapshot reads")


def run(cfg: Config) -> Outcome:
    from _proc import ServerProc

    started = time.monotonic()
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    for old in (*out.glob("ops-*.jsonl"), *out.glob("snapshots-*.jsonl"), out / "faults.jsonl",
                out / "fencepost.db", out / "fencepost.db-wal", out / "fencepost.db-shm",
                out / "server.log"):
        old.unlink(missing_ok=True)
    runs = [f"t{i}" for i in range(cfg.runs)]
    args: tuple[str, ...] = ("--test-hooks",)
    if cfg.fault:
        args += ("--fault", cfg.fault)
    srv = ServerProc(out / "fencepost.db", out / "server.log", args=args,
                     env={"FENCEPOST_HISTORY_REVISIONS": str(10**12),
                          "FENCEPOST_TEST_CLOCK_OFFSET_MS": "0"})
    proxy: Proxy | None = None
    procs: list[subprocess.Popen[bytes]] = []
    files: list[Any] = []
    stop = threading.Event()
    nemesis: Nemesis | None = None
    nem_thread: threading.Thread | None = None
    liveness: list[dict[str, Any]] = []
    worker_problems: list[str] = []
    try:
        srv.start(timeout=60)
        proxy = Proxy(srv.port).start()
        now = time.monotonic_ns()
        deadline = now + int(cfg.duration_s * 1e9)
        hard_stop = deadline + int(cfg.drain_s * 1e9)
        for i in range(cfg.workers):
            wcfg = {"index": i, "threads": cfg.threads, "addr": proxy.address,
                    "seed": cfg.seed * 100 + i, "runs": runs, "deadline_ns": deadline,
                    "hard_stop_ns": hard_stop, "out_dir": str(out), "profile": cfg.profile,
                    "transport": cfg.transport, "snapshots": cfg.snapshots}
            files.append(open(out / f"worker-{i}.log", "wb"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torture.worker", json.dumps(wcfg)],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=files[-1], stderr=files[-1],
                env=dict(os.environ, PYTHONPATH=str(REPO)),
            ))
        faults_log = open(out / "faults.jsonl", "w")
        files.append(faults_log)
        probe_out = open(out / "ops-probes.jsonl", "w", buffering=1)
        files.append(probe_out)

        def probe(n: int, killed: int) -> None:
            c = Client(f"probe{n}", srv.address, probe_out, seed=n,
                       hard_stop_ns=time.monotonic_ns() + int(30e9), transport=cfg.transport)
            try:
                for r in runs:
                    c.get_run(r)
            finally:
                c.close()

        nemesis = Nemesis(srv, proxy, procs, faults_log, probe)
        plan = schedule(cfg.seed, cfg.duration_s, cfg.nemesis, cfg.workers, MAX_TTL_MS)
        (out / "schedule.json").write_text(json.dumps([asdict(f) for f in plan], indent=0))
        nem_failure: list[BaseException] = []

        def nemesis_body() -> None:
            assert nemesis is not None
            try:
                nemesis.run(plan, now / 1e9, stop)
            except BaseException as exc:
                nem_failure.append(exc)
                stop.set()

        nem_thread = threading.Thread(target=nemesis_body, name="nemesis", daemon=True)
        nem_thread.start()
        while time.monotonic_ns() < deadline and not stop.is_set():
            time.sleep(0.1)
        stop.set()
        nem_thread.join(120)
        nemesis.resume_all()
        if nem_failure:
            raise RuntimeError(f"the nemesis failed: {nem_failure[0]!r}") from nem_failure[0]
        if srv.proc is None or srv.proc.poll() is not None:
            raise RuntimeError("the server is not running after the nemesis:\n"
                               + srv.log_tail())
        for i, p in enumerate(procs):
            try:
                rc = p.wait(max(1.0, (hard_stop - time.monotonic_ns()) / 1e9 + 15))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
                rc = -9
            if rc != 0:
                worker_problems.append(f"worker {i} exited {rc}:\n"
                                       + (out / f"worker-{i}.log").read_text()[-3000:])
        live_out = open(out / "ops-live.jsonl", "w", buffering=1)
        files.append(live_out)
        liveness = drive_to_completion(srv.address, runs, cfg.liveness_bound_s, live_out,
                                       cfg.transport)
        if cfg.snapshots:  # what a holder resuming now would read
            snap_final = open(out / "snapshots-final.jsonl", "w", buffering=1)
            files.append(snap_final)
            reader = Client("final", srv.address, live_out, seed=0, snap_out=snap_final,
                            hard_stop_ns=time.monotonic_ns() + int(30e9))
            try:
                for r in runs:
                    reader.read_snapshot(r)
            finally:
                reader.close()
        stopped = srv.stop()
        if stopped != 0:
            worker_problems.append(f"graceful stop of the server exited {stopped}")
    finally:
        stop.set()
        if nemesis is not None:
            nemesis.resume_all()
        for p in procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(Exception):
                p.wait(10)
        if proxy is not None:
            proxy.stop()
        srv.kill()
        for f in files:
            f.close()
    if worker_problems:
        raise RuntimeError("harness failure: " + "\n".join(worker_problems))

    (out / "liveness.json").write_text(json.dumps(liveness))
    (out / "config.json").write_text(json.dumps(_config(cfg)))
    return check_dir(out, cfg, wall=time.monotonic() - started)


def check_dir(out: Path, cfg: Config | None = None, wall: float = 0.0) -> Outcome:
    """Check a recorded run (its output directory) and write its report.
    ``python -m torture --check-only DIR`` re-checks a run after the fact."""
    from _history import load

    if cfg is None:
        saved = json.loads((out / "config.json").read_text())
        saved["out"] = out
        saved.setdefault("transport", "unary")  # recorded before there was a choice
        saved.setdefault("snapshots", "")  # recorded before snapshots
        cfg = Config(**saved)
    runs = [f"t{i}" for i in range(cfg.runs)]
    ops = read_ops(sorted(out.glob("ops-*.jsonl")))
    faults = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()
              if line.strip()]
    kills = [f for f in faults if f["kind"] == "kill"]
    liveness = json.loads((out / "liveness.json").read_text())
    snap = load(out / "fencepost.db")
    checked = check_all(ops, runs=runs, kills=kills, snap=snap, liveness=liveness,
                        liveness_bound_s=cfg.liveness_bound_s,
                        server_log=(out / "server.log").read_text(errors="replace"),
                        budget=cfg.budget)
    if cfg.snapshots:
        snap_ops = read_ops(sorted(out.glob("snapshots-*.jsonl")))
        t = time.perf_counter()
        stale, stats = check_snapshots(ops, snap_ops)
        checked.timings["stale-snapshot"] = time.perf_counter() - t
        checked.violations.extend(stale[:MAX_PER_CHECK])
        if stale:
            checked.counts["stale-snapshot"] = len(stale)
    outcome = _outcome(cfg, ops, faults, checked, liveness, wall)
    if cfg.snapshots:
        outcome.snapshots = {"mode": cfg.snapshots, **stats.as_dict()}
    (out / "report.json").write_text(json.dumps(asdict(outcome), indent=1, default=str))
    (out / "report.txt").write_text(outcome.summary() + "\n")
    return outcome


def _config(cfg: Config) -> dict[str, Any]:
    conf = asdict(cfg)
    conf["out"] = str(cfg.out)
    return conf


def drive_to_completion(addr: str, runs: list[str], bound_s: float, out: Any,
                        transport: str = "unary") -> list[dict[str, Any]]:
    """Liveness: with the nemesis stopped, every run can be acquired and
    finished within ``bound_s`` (a finished run is deleted and started again, so
    every run id is acquired and finished)."""
    c = Client("live", addr, out, seed=0, hard_stop_ns=time.monotonic_ns()
               + int(bound_s * 1e9 * (len(runs) + 1)), transport=transport)
    results: list[dict[str, Any]] = []
    try:
        for run in runs:
            t0 = time.monotonic()
            why = ""
            ok = False
            while time.monotonic() - t0 < bound_s:
                g = c.get_run(run)
                rec = g["rec"] if g["st"] == "ok" else None
                if rec is not None and rec["status"] in TERMINAL:
                    c.delete_run(run)
                    continue
                if rec is not None and rec["status"] == SUSPENDED:
                    c.resume(run)
                    continue
                a = c.acquire(run, "live", 30_000)
                if a["st"] == "ok":
                    tok, ver = a["rec"]["fencing_token"], a["rec"]["version"]
                    fin = c.fenced("finish", run, "live", tok, ver, status=COMPLETED)
                    if fin["st"] == "ok":
                        ok = True
                        break
                    why = f"finish: {fin['code']}"
                else:
                    why = f"acquire: {a['code']}"
                    time.sleep(0.05)
            results.append({"run": run, "ok": ok, "seconds": round(time.monotonic() - t0, 3),
                            "why": why})
    finally:
        c.close()
    return results


def _outcome(cfg: Config, ops: list[Op], faults: list[dict[str, Any]], checked: Checked,
             liveness: list[dict[str, Any]], wall: float) -> Outcome:
    by_f: dict[str, dict[str, int]] = {}
    for o in ops:
        key = o.st if o.st != "fail" else f"fail:{o.code}"
        d = by_f.setdefault(o.f, {})
        d[key] = d.get(key, 0) + 1
    saw = [o for o in ops if o.tf > 0]
    left: dict[str, int] = {}
    for o in ops:
        if o.st == "unknown":
            left[o.f] = left.get(o.f, 0) + 1
    unknown = {"calls": len(saw), "resolved": sum(1 for o in saw if o.st != "unknown"),
               "left": sum(left.values()), "left_by_function": left}
    by_tp: dict[str, dict[str, int]] = {}
    writers: dict[str, set[str]] = {}
    for o in ops:
        t = by_tp.setdefault(o.tp, {"ops": 0, "ledger_writes": 0, "clients": 0,
                                    "transport_failures": 0, "left_unknown": 0})
        t["ops"] += 1
        t["transport_failures"] += o.tf > 0
        t["left_unknown"] += o.st == "unknown"
        if o.f in LEDGER_WRITES:
            t["ledger_writes"] += 1
            writers.setdefault(o.tp, set()).add(o.client)
    for tp, t in by_tp.items():
        t["clients"] = len(writers.get(tp, ()))
    by_kind = {k: sum(1 for f in faults if f["kind"] == k) for k in KINDS}
    clocks = [f for f in faults if f["kind"] == "clock"]
    return Outcome(
        config=_config(cfg),
        ops=len(ops),
        ops_by_function=dict(sorted(by_f.items())),
        ops_by_transport=dict(sorted(by_tp.items(), key=lambda kv: (kv[0] != "stream", kv[0]))),
        unknown=unknown,
        faults={"by_kind": by_kind,
                "cut_connections": sum(f.get("connections", 0) for f in faults),
                "restarts": by_kind["kill"],
                "clock_offset_ms": clocks[-1]["offset"] if clocks else 0,
                "lock_delay_ms": LOCK_DELAY_MS},
        checker_seconds={k: round(v, 3) for k, v in checked.timings.items()},
        linearizability=checked.lin,
        liveness=liveness,
        violations=checked.counts,
        violation_details=[str(v) for v in checked.violations],
        wall_seconds=round(wall, 1),
        server_starts=by_kind["kill"] + 1,
    )
