"""One torture run: a ``--test-hooks`` server, a proxy, worker processes, the
nemesis, then the liveness phase, a graceful stop, and the checkers.

``store="postgres"``: a throwaway PostgreSQL and several coordinators on it
instead of the one server on SQLite (torture/coordinators.py), each behind a
proxy of its own, a supervisor restarting whichever exits; the workers follow
the leader, the nemesis aims at the leader and at the database, and the
checkers see one history across every failover (torture/failover.py).
``lead_shards``: every coordinator leads a share of ``shards`` shards at
once; the workers follow each call to its shard's owner, the nemesis
strikes any coordinator (SIGKILL, SIGSTOP, SIGTERM) and the database, and
the checkers see one history across every shard move (torture/sharding.py).

In every mode a watcher process (torture/watcher.py) watches every run
through the SDK from before the workers start to after the liveness phase,
for the ``watch`` checker (torture/watching.py).

Everything runs on loopback, is bounded in time, and every process started is
stopped on the way out, failure or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fencepost.v1 import ledger_pb2 as lpb

from . import REPO
from .checkers import MAX_PER_CHECK, Checked, Violation, check_all
from .client import Client
from .history import LEDGER_WRITES, SUSPENDED, TERMINAL, Op, read_ops
from .nemesis import (
    CLOCK_SLACK_MS,
    KINDS,
    PG_KINDS,
    SHARD_KINDS,
    Nemesis,
    Proxy,
    schedule,
    schedule_pg,
)
from .snapshots import check_snapshots
from .watcher import CATCH_UP_S
from .watching import Watched
from .worker import LOCK_DELAY_MS, MAX_TTL_MS

COMPLETED = 4
MAX_PROBES = 64  # probe clients' certificates (mutual TLS); names are reused past it
WATCHER = "watch"  # the watcher's client name (its certificate's CN with mutual TLS)
WATCHER_READY_S = 60.0  # its first watch covers every shard within this


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
    tls: bool = False  # mutual TLS: every client's owners are bound to its certificate
    liveness_bound_s: float = 20.0
    drain_s: float = 20.0  # after the deadline: workers finish retries within this
    budget: int = 5_000_000  # linearizability search configurations per run
    # every checkpoint also writes the run's snapshot (torture/snapshots.py):
    # "fenced" (under the handle's fence), "unfenced" (the window left open:
    # the run then finds stale snapshots), or "" (no snapshots)
    snapshots: str = "fenced"
    # "sqlite": one server on a file; "postgres": ``coordinators`` coordinators
    # on one throwaway PostgreSQL, with a short leader lease so a run sees
    # many failovers
    store: str = "sqlite"
    coordinators: int = 1
    leader_lease: str = "2s"
    leader_renew: str = "400ms"
    max_clock_skew: str = "500ms"
    # with "postgres": every coordinator leads a share of ``shards`` shards
    # (--lead-shards), few so that they move often
    lead_shards: bool = False
    shards: int = 8


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
    cluster: dict[str, Any] = field(default_factory=dict)  # the PostgreSQL mode's figures
    watch: dict[str, Any] = field(default_factory=dict)  # the watcher's (torture/watching.py)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        c = self.config
        lines = [
            f"torture seed={c['seed']} duration={c['duration_s']:.0f}s workers={c['workers']}x"
            f"{c['threads']} runs={c['runs']} profile={c['profile']} nemesis={c['nemesis']}"
            f" transport={c.get('transport', 'unary')}"
            + (f" store=postgres coordinators={c['coordinators']}"
               if c.get("store") == "postgres" else "")
            + (f" lead-shards={c['shards']}" if c.get("lead_shards") else "")
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
            f"{self.server_starts} times"
            + (f" ({self.faults['saved_index_starts']} from the index entries a clean stop "
               f"saved, {self.faults.get('saved_index_crash_starts', 0)} after a kill -9 from "
               "the last saved entries and the blocks changed since)"
               if self.faults.get("saved_index_starts") else ""),
            *([self._cluster_line()] if self.cluster else []),
            f"  checkers: {sum(self.checker_seconds.values()):.1f} s ("
            + ", ".join(f"{k} {v:.2f}" for k, v in self.checker_seconds.items()) + ")",
            f"  linearizability: {self.linearizability['ops']} ops in "
            f"{self.linearizability['segments']} segments over {self.linearizability['runs']} "
            f"runs, {self.linearizability['configurations']} configurations searched",
            f"  liveness: {len(self.liveness)} runs acquired and finished, slowest "
            f"{max((r['seconds'] for r in self.liveness), default=0):.2f} s",
            *([self._snapshot_line()] if self.snapshots else []),
            *([self._watch_line()] if self.watch else []),
            f"  violations: {sum(self.violations.values())} "
            + (str(self.violations) if self.violations else ""),
        ]
        lines += ["  " + d.replace("\n", "\n  ") for d in self.violation_details[:20]]
        return "\n".join(lines)


    def _cluster_line(self) -> str:
        c = self.cluster
        if "shards_taken" in c:
            k = c["kill_to_settled_s"]
            return (f"  shards: {c['shards_taken']} taken, {c['shards_handed_over']} handed "
                    f"over, {c['shards_given_up']} given up ({c['shards_lost']} lost), "
                    f"{c['shard_epochs']} epoch moves seen; {c['coordinator_starts']} processes "
                    f"(exits by code {c['exits_by_code']}); SIGKILL -> every shard held again: "
                    f"median {k['median']} s, max {k['max']} s over {k['n']}; "
                    f"{c['leases_extended']} leases extended at takes; "
                    f"{c['answers_attributed']} answers tied to their coordinator "
                    f"({c['answers_unattributed']} not); clock jumps past the bound "
                    f"{c.get('clock_past_bound', 0)}, within it "
                    f"{c.get('clock_within_bound', 0)}; stalls with the shard renewals "
                    f"{c.get('pg_stalls_with_renewals', 0)}")
        k = c["kill_to_serving_s"]
        return (f"  coordinators: {c['epochs']} epochs, {c['failovers']} failovers, "
                f"{c['coordinator_starts']} processes (exits by code {c['exits_by_code']}); "
                f"leader SIGKILL -> another serving: median {k['median']} s, max {k['max']} s "
                f"over {k['n']}; {c['in_place_takeovers']} restarts in place led at once; "
                f"{c['leases_extended']} leases extended at takeovers; "
                f"{c['answers_attributed']} answers tied to their coordinator "
                f"({c['answers_unattributed']} not)")

    def _watch_line(self) -> str:
        w = self.watch
        errors = ", ".join(f"{n} {k}" for k, n in w["errors"].items()) or "none"
        ends = ", ".join(f"{n} {k}" for k, n in w.get("stream_ends", {}).items()) or "none"
        return (f"  watch: {w['delivered']} changes delivered of {w.get('expected', '?')} "
                f"committed since it began, over {w['watches']} watches ({w['restarts']} "
                f"restarts from a saved cursor; the SDK raised: {errors}; streams the SDK "
                f"resumed: {ends}); {w['shards']} shards; {w['ended'] or 'no end'} "
                f"{w['catch_up_s'] if w['catch_up_s'] is not None else '-'} s after the last "
                "committed revisions were read")

    def _snapshot_line(self) -> str:
        s = self.snapshots
        return (f"  snapshots ({s['mode']}): {s['writes']} written ({s['accepted']} accepted, "
                f"{s['refused']} refused RUN_LEASE_LOST, {s['refused_stale']} of them sent "
                f"after the takeover); stale snapshots visible after a takeover: "
                f"{s['stale_accepted']} ({s['stale_read']} read back by a holder); "
                f"{s['reads']} snapshot reads")


class _Single:
    """The one ``fencepost serve`` on an SQLite file, behind one proxy."""

    def __init__(self, out: Path, args: tuple[str, ...], admin_creds: Any) -> None:
        from _proc import ServerProc

        self.srv = ServerProc(out / "fencepost.db", out / "server.log", args=args,
                              env={"FENCEPOST_HISTORY_REVISIONS": str(10**12),
                                   "FENCEPOST_TEST_CLOCK_OFFSET_MS": "0"},
                              credentials=admin_creds)
        self.proxy: Proxy | None = None

    def start(self) -> None:
        self.srv.start(timeout=60)
        self.proxy = Proxy(self.srv.port).start()

    @property
    def worker_addrs(self) -> str:
        assert self.proxy is not None
        return self.proxy.address

    def probe_addrs(self) -> tuple[str | list[str], dict[str, str], int]:
        return self.srv.address, {}, 0

    def nemesis(self, procs: list[Any], log: Any, probe: Any) -> Nemesis:
        return Nemesis(self.srv, self.proxy, procs, log, probe)

    def committed_tops(self) -> dict[str, int]:
        """Each run's last committed revision (the server's file, read-only)."""
        from _proc import connect_ro

        db = connect_ro(self.srv.db_path)
        try:
            return dict(db.execute("SELECT run_id, max(revision) FROM changes GROUP BY run_id"))
        finally:
            db.close()

    def check_alive(self) -> None:
        if self.srv.proc is None or self.srv.proc.poll() is not None:
            raise RuntimeError("the server is not running after the nemesis:\n"
                               + self.srv.log_tail())

    def stop(self, problems: list[str], faults_log: Any) -> None:
        stopped = self.srv.stop()
        if stopped != 0:
            problems.append(f"graceful stop of the server exited {stopped}")

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.srv.kill()


class _Coordinators:
    """Several coordinators on one throwaway PostgreSQL (torture/coordinators.py)."""

    def __init__(self, cfg: Config, args: tuple[str, ...]) -> None:
        self.cfg = cfg
        self.args = args
        self.cl: Any = None

    def start(self) -> None:
        from .coordinators import PgCluster

        cfg = self.cfg
        self.cl = PgCluster(cfg.out, cfg.coordinators, args=self.args,
                            env={"FENCEPOST_HISTORY_REVISIONS": str(10**12),
                                 "FENCEPOST_TEST_CLOCK_OFFSET_MS": "0"},
                            lease=cfg.leader_lease, renew=cfg.leader_renew,
                            max_clock_skew=cfg.max_clock_skew,
                            shards=cfg.shards if cfg.lead_shards else 0).start()

    @property
    def worker_addrs(self) -> list[str]:
        return list(self.cl.addresses)

    def probe_addrs(self) -> tuple[str | list[str], dict[str, str], int]:
        """The coordinators themselves (the proxies are held while probes read),
        in slot order, and the leader's slot to start at."""
        c = self.cl.leader(5.0)
        return list(self.cl.direct), self.cl.aliases, 0 if c is None else c.slot

    def nemesis(self, procs: list[Any], log: Any, probe: Any) -> Nemesis:
        from fencepost_server.config import duration_ms

        return Nemesis(None, None, procs, log, probe, cluster=self.cl,
                       skew_ms=duration_ms(self.cfg.max_clock_skew))

    def committed_tops(self) -> dict[str, int]:
        """Each run's last committed revision, as PostgreSQL has it now."""
        with self.cl.pg.connect(self.cl.dbname) as conn:
            return dict(conn.execute(
                "SELECT run_id, max(revision) FROM fencepost.changes GROUP BY run_id").fetchall())

    def check_alive(self) -> None:
        if self.cl.shards and not self.cl.settled(30.0):
            raise RuntimeError("the shards are not all held after the nemesis:\n" + "\n".join(
                c.log_tail(2000) for c in self.cl.coordinators))
        if self.cl.leader(30.0) is None:
            raise RuntimeError("no coordinator leads after the nemesis:\n" + "\n".join(
                c.log_tail(2000) for c in self.cl.coordinators))

    def stop(self, problems: list[str], faults_log: Any) -> None:
        faults_log.write(json.dumps({"kind": "stop-all", "t": time.monotonic_ns()}) + "\n")
        faults_log.flush()
        codes = self.cl.stop_all()
        self.cl.export(self.cfg.out / "committed.db")
        # -15: SIGTERM before a just-restarted coordinator had set its handlers up
        bad = {slot: rc for slot, rc in codes.items() if rc not in (0, 3, -15, None)}
        if bad:
            problems.append(f"graceful stop of the coordinators: exit codes {bad}")

    def close(self) -> None:
        if self.cl is not None:
            self.cl.close()


class _Watcher:
    """The watcher process (torture/watcher.py): started, and ready once its
    watch covers every shard; at the end told each shard's last committed
    revision, which it reads up to before it exits."""

    def __init__(self, out: Path, addrs: str | list[str], seed: int, certs: str | None,
                 log: Any) -> None:
        cfg = {"addr": addrs, "seed": seed, "out_dir": str(out), "certs": certs,
               "name": WATCHER}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torture.watcher", json.dumps(cfg)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)))
        self.log = out / "watch.log"
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=read, name="torture-watcher-out", daemon=True).start()
        try:
            line = lines.get(timeout=WATCHER_READY_S)
        except queue.Empty:
            line = ""
        if not line.startswith("ready "):
            self.kill()
            raise RuntimeError(f"the watcher did not watch every shard within "
                               f"{WATCHER_READY_S:.0f} s:\n{self._tail()}")
        self.count = int(line.split()[1])

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return ""

    def catch_up(self, tops: dict[str, int]) -> None:
        from fencepost_server.core.shards import shard_of

        upto: dict[int, int] = {}
        for run_id, rev in tops.items():
            shard = shard_of(run_id, self.count)
            upto[shard] = max(upto.get(shard, 0), int(rev))
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it is gone: its exit code says why
            self.proc.stdin.write(json.dumps({"upto": upto}) + "\n")
            self.proc.stdin.flush()
        try:
            rc = self.proc.wait(CATCH_UP_S + 30)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        if rc != 0:
            raise RuntimeError(f"the watcher exited {rc}:\n{self._tail()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(10)


def run(cfg: Config) -> Outcome:
    started = time.monotonic()
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    for old in (*out.glob("ops-*.jsonl"), *out.glob("snapshots-*.jsonl"), out / "faults.jsonl",
                out / "fencepost.db", out / "fencepost.db-wal", out / "fencepost.db-shm",
                out / "server.log", *out.glob("coordinator-*.log"), out / "cluster.jsonl",
                out / "committed.db", out / "postgres.log", out / "watch.jsonl",
                out / "watch.log"):
        old.unlink(missing_ok=True)
    runs = [f"t{i}" for i in range(cfg.runs)]
    args: tuple[str, ...] = ("--test-hooks",)
    if cfg.fault:
        args += ("--fault", cfg.fault)
    certs: str | None = None
    admin_creds = None
    if cfg.tls:
        from .certs import client_credentials, torture_certs

        names = [f"w{i}.{t}" for i in range(cfg.workers) for t in range(cfg.threads)]
        names += ["live", "final", "admin", WATCHER,
                  *(f"probe{n}" for n in range(MAX_PROBES))]
        cdir = out / "certs"
        shutil.rmtree(cdir, ignore_errors=True)
        torture_certs(cdir, names)
        certs = str(cdir)
        args += ("--tls-cert", str(cdir / "server.pem"), "--tls-key", str(cdir / "server-key.pem"),
                 "--client-ca", str(cdir / "ca.pem"))
        admin_creds = client_credentials(cdir, "admin")
    target: _Single | _Coordinators
    if cfg.lead_shards and cfg.store != "postgres":
        raise ValueError("lead_shards: needs store postgres")
    shards = cfg.shards if cfg.lead_shards else 0
    if cfg.store == "postgres":
        if cfg.tls:
            raise ValueError("--tls is not supported with --store postgres")
        target = _Coordinators(cfg, args)
    else:
        target = _Single(out, args, admin_creds)
    procs: list[subprocess.Popen[bytes]] = []
    files: list[Any] = []
    stop = threading.Event()
    nemesis: Nemesis | None = None
    nem_thread: threading.Thread | None = None
    liveness: list[dict[str, Any]] = []
    worker_problems: list[str] = []
    watcher: _Watcher | None = None
    try:
        target.start()
        files.append(open(out / "watch.log", "wb"))
        # before any worker writes: every change committed from here on counts
        watcher = _Watcher(out, target.worker_addrs, cfg.seed, certs, files[-1])
        now = time.monotonic_ns()
        deadline = now + int(cfg.duration_s * 1e9)
        hard_stop = deadline + int(cfg.drain_s * 1e9)
        for i in range(cfg.workers):
            wcfg = {"index": i, "threads": cfg.threads, "addr": target.worker_addrs,
                    "seed": cfg.seed * 100 + i, "runs": runs, "deadline_ns": deadline,
                    "hard_stop_ns": hard_stop, "out_dir": str(out), "profile": cfg.profile,
                    "transport": cfg.transport, "snapshots": cfg.snapshots,
                    "certs": certs, "shards": shards}
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

        def probe(n: int, killed: int) -> list[str]:
            addrs, aliases, first = target.probe_addrs()
            c = Client(f"probe{n % MAX_PROBES}", addrs, probe_out, seed=n,
                       hard_stop_ns=time.monotonic_ns() + int(30e9), transport=cfg.transport,
                       certs=certs, aliases=aliases, shards=shards)
            c.ep = first
            try:
                seen = {r: c.get_run(r) for r in runs}
                # a coordinator leading some shards lists only theirs
                return [] if shards else index_problems(c, seen, n)
            finally:
                c.close()

        nemesis = target.nemesis(procs, faults_log, probe)
        if cfg.store == "postgres":
            from fencepost_server.config import duration_ms

            plan = schedule_pg(cfg.seed, cfg.duration_s, cfg.nemesis, cfg.workers, MAX_TTL_MS,
                               duration_ms(cfg.leader_lease) / 1000,
                               duration_ms(cfg.max_clock_skew), shards=cfg.lead_shards)
        else:
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
        target.check_alive()
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
        liveness = drive_to_completion(target.worker_addrs, runs, cfg.liveness_bound_s,
                                       live_out, cfg.transport, certs)
        if cfg.snapshots:  # what a holder resuming now would read
            snap_final = open(out / "snapshots-final.jsonl", "w", buffering=1)
            files.append(snap_final)
            reader = Client("final", target.worker_addrs, live_out, seed=0,
                            snap_out=snap_final, certs=certs,
                            hard_stop_ns=time.monotonic_ns() + int(30e9))
            try:
                for r in runs:
                    reader.read_snapshot(r)
            finally:
                reader.close()
        watcher.catch_up(target.committed_tops())
        target.stop(worker_problems, faults_log)
    finally:
        stop.set()
        if watcher is not None:
            watcher.kill()
        if nemesis is not None:
            nemesis.resume_all()
        for p in procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(Exception):
                p.wait(10)
        target.close()
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
        saved.setdefault("lead_shards", False)
        cfg = Config(**saved)
    runs = [f"t{i}" for i in range(cfg.runs)]
    ops = read_ops(sorted(out.glob("ops-*.jsonl")))
    faults = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()
              if line.strip()]
    # the server's restarts: after a SIGKILL, or (one server) after a clean stop
    kills = [f for f in faults if f["kind"] in ("kill", "term")
             and not (cfg.lead_shards and f["kind"] == "term")]  # (a hand-over: no probe)
    liveness = json.loads((out / "liveness.json").read_text())
    pg = cfg.store == "postgres"
    snap = load(out / ("committed.db" if pg else "fencepost.db"))
    watched = Watched.load(out / "watch.jsonl")  # None: recorded before there was a watcher
    extra: list[Violation] = []
    figures: dict[str, Any] = {}
    extends: list[Op] = []
    if pg and cfg.lead_shards:
        from fencepost_server.config import duration_ms

        from . import sharding
        from .failover import clock_ahead

        t = time.perf_counter()
        stl = sharding.ShardTimeline.load(out / "cluster.jsonl", cfg.shards)
        extends, extra = sharding.extensions(stl, snap)
        t_ext = time.perf_counter() - t
        server_log = "\n".join(f.read_text(errors="replace")
                               for f in sorted(out.glob("coordinator-*.log")))
        checked = check_all(ops + extends, runs=runs, kills=kills, snap=snap, liveness=liveness,
                            liveness_bound_s=cfg.liveness_bound_s, server_log=server_log,
                            budget=cfg.budget, sharded=True, watched=watched,
                            clock=clock_ahead(stl.tl, faults))
        t = time.perf_counter()
        moved, attributed = sharding.check_shard_epochs(ops, stl)
        skew = duration_ms(cfg.max_clock_skew)
        extra += moved + sharding.check_exits(faults, stl) + sharding.check_struck(
            faults, stl, skew_ms=skew, clock_slack_ms=CLOCK_SLACK_MS)
        checked.timings["shard-epochs"] = time.perf_counter() - t + t_ext
        figures = {**sharding.summary(stl, faults, skew, CLOCK_SLACK_MS),
                   "answers_attributed": attributed["attributed"],
                   "answers_unattributed": attributed["unattributed"]}
    elif pg:
        from .failover import (
            Timeline,
            check_deposed,
            check_epochs,
            check_tenures,
            clock_ahead,
            extensions,
            summary,
        )

        t = time.perf_counter()
        tl = Timeline.load(out / "cluster.jsonl")
        extends, extra = extensions(tl, snap)
        t_ext = time.perf_counter() - t
        server_log = "\n".join(f.read_text(errors="replace")
                               for f in sorted(out.glob("coordinator-*.log")))
        checked = check_all(ops + extends, runs=runs, kills=kills, snap=snap, liveness=liveness,
                            liveness_bound_s=cfg.liveness_bound_s, server_log=server_log,
                            budget=cfg.budget, watched=watched, clock=clock_ahead(tl, faults))
        from fencepost_server.config import duration_ms

        t = time.perf_counter()
        epochs, attributed = check_epochs(ops, tl)
        epochs += check_tenures(tl, snap)
        deposed = check_deposed(faults, tl, skew_ms=duration_ms(cfg.max_clock_skew),
                                clock_slack_ms=CLOCK_SLACK_MS)
        checked.timings["epochs"] = time.perf_counter() - t + t_ext
        figures = {**summary(tl, faults), "answers_attributed": attributed["attributed"],
                   "answers_unattributed": attributed["unattributed"],
                   # a killed leader restarted before a standby took over: it
                   # found its own process gone and led without the lease
                   "in_place_takeovers": server_log.count("taking over without waiting")}
        extra += epochs + deposed
    else:
        checked = check_all(ops, runs=runs, kills=kills, snap=snap, liveness=liveness,
                            liveness_bound_s=cfg.liveness_bound_s,
                            server_log=(out / "server.log").read_text(errors="replace"),
                            budget=cfg.budget, watched=watched)
        extra += [Violation("clean-stop", f"restart #{f['restart']}: the clean stop (SIGTERM) "
                                          f"exited {f.get('exit')}, not 0")
                  for f in kills if f["kind"] == "term" and f.get("exit") != 0]
    extra += [Violation("index-restart", problem) for f in faults for problem in f.get("index", ())]
    for v in extra:
        checked.counts[v.check] = checked.counts.get(v.check, 0) + 1
        if sum(1 for k in checked.violations if k.check == v.check) < MAX_PER_CHECK:
            checked.violations.append(v)
    if cfg.snapshots:
        snap_ops = read_ops(sorted(out.glob("snapshots-*.jsonl")))
        t = time.perf_counter()
        stale, stats = check_snapshots(ops, snap_ops)
        checked.timings["stale-snapshot"] = time.perf_counter() - t
        checked.violations.extend(stale[:MAX_PER_CHECK])
        if stale:
            checked.counts["stale-snapshot"] = len(stale)
    outcome = _outcome(cfg, ops, faults, checked, liveness, wall)
    if pg:
        outcome.cluster = {**figures, "extend_ops": len(extends)}
        outcome.server_starts = figures["coordinator_starts"]
    if cfg.snapshots:
        outcome.snapshots = {"mode": cfg.snapshots, **stats.as_dict()}
    if watched is not None:
        outcome.watch = watched.summary()
    (out / "report.json").write_text(json.dumps(asdict(outcome), indent=1, default=str))
    (out / "report.txt").write_text(outcome.summary() + "\n")
    return outcome


def index_problems(c: Client, seen: dict[str, dict[str, Any]], n: int) -> list[str]:
    """What a restarted server's run index gets wrong, probed while no worker
    is connected (nothing moves): a ListRuns of each status must list exactly
    the runs GetRun just found in it (``seen``: the probe's GetRun entries).
    Nothing is concluded from a GetRun or a listing that went unanswered."""
    status_of: dict[str, int] = {}
    for run, e in seen.items():
        if e.get("st") == "ok" and e.get("rec") is not None:
            status_of[run] = int(e["rec"]["status"])
        elif not (e.get("st") == "fail" and e.get("code") == "RUN_NOT_FOUND"):
            return []
    problems = []
    try:
        for status in range(1, 7):
            page = c._conn().ledger.ListRuns(
                lpb.ListRunsRequest(statuses=[status], page_size=1000), timeout=10)
            listed = sorted(run.run_id for run in page.runs)
            want = sorted(r for r, st in status_of.items() if st == status)
            if listed != want:
                problems.append(f"restart #{n}: ListRuns of status {status} listed {listed}, "
                                f"where GetRun found {want}")
    except grpc.RpcError:
        pass
    return problems


def _config(cfg: Config) -> dict[str, Any]:
    conf = asdict(cfg)
    conf["out"] = str(cfg.out)
    return conf


def drive_to_completion(addr: str | list[str], runs: list[str], bound_s: float, out: Any,
                        transport: str = "unary", certs: str | None = None,
                        ) -> list[dict[str, Any]]:
    """Liveness: with the nemesis stopped, every run can be acquired and
    finished within ``bound_s`` (a finished run is deleted and started again, so
    every run id is acquired and finished)."""
    c = Client("live", addr, out, seed=0, hard_stop_ns=time.monotonic_ns()
               + int(bound_s * 1e9 * (len(runs) + 1)), transport=transport, certs=certs)
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
    pg = cfg.store == "postgres"
    kinds = SHARD_KINDS if cfg.lead_shards else PG_KINDS if pg else KINDS
    by_kind = {k: sum(1 for f in faults if f["kind"] == k) for k in kinds}
    restarts = by_kind["kill"] + (0 if pg else by_kind["term"])
    clocks = [f for f in faults if f["kind"] == "clock"]
    return Outcome(
        config=_config(cfg),
        ops=len(ops),
        ops_by_function=dict(sorted(by_f.items())),
        ops_by_transport=dict(sorted(by_tp.items(), key=lambda kv: (kv[0] != "stream", kv[0]))),
        unknown=unknown,
        faults={"by_kind": by_kind,
                "cut_connections": sum(f.get("connections", 0) for f in faults),
                "restarts": restarts,
                # starts after a clean stop that read the index entries it saved,
                # and starts after a kill -9 that read the last saved entries
                # with the blocks changed since
                "saved_index_starts": sum(1 for f in faults
                                          if f.get("saved_index") and f["kind"] == "term"),
                "saved_index_crash_starts": sum(1 for f in faults
                                                if f.get("saved_index") and f["kind"] == "kill"),
                # clean stops that saved some ids, and the starts after them
                # that did not read them (the entries should always match then)
                "index_saves": sum(1 for f in faults if f.get("saved")),
                "saved_index_misses": sum(1 for f in faults
                                          if f.get("saved") and not f.get("saved_index")),
                "clock_offset_ms": clocks[-1]["offset"] if clocks else 0,
                "lock_delay_ms": LOCK_DELAY_MS},
        checker_seconds={k: round(v, 3) for k, v in checked.timings.items()},
        linearizability=checked.lin,
        liveness=liveness,
        violations=checked.counts,
        violation_details=[str(v) for v in checked.violations],
        wall_seconds=round(wall, 1),
        server_starts=restarts + 1,
    )
