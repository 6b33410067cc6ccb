"""The PostgreSQL mode's cluster: a throwaway PostgreSQL
(``fencepost_devtools.pgcluster.Cluster``), N ``fencepost serve --db
postgresql://...`` coordinators on one database, each behind a loopback proxy
of its own and advertised at the proxy's address (so a NOT_LEADER names an
address the workers reach through the proxy), a supervisor that restarts any
coordinator that exits, as systemd or Kubernetes would (exit code 3: it lost
leadership), and a watcher of the leader row.

Everything the harness sees of them goes to ``cluster.jsonl``, one JSON
object a line, times in CLOCK_MONOTONIC ns like the history:

* ``spawn`` / ``exit`` (slot, pid, exit code) of every coordinator process;
* ``line``: the log lines that matter, with when the harness read them:
  ``taking`` ("taking over (epoch N): loaded revision R"), ``extended``
  ("epoch N: extended K leases ... by G ms", printed once the takeover's
  lease extension is committed: revisions R+1..R+K), ``leading`` (it serves)
  and ``lost``;
* ``epoch``: the watcher saw the leader row's epoch move, with ``before``
  (when the last poll that still showed an older epoch was sent: the
  takeover committed after it), ``before_db`` (the database's clock, ms, as
  that poll ran) and ``seen`` (when the first poll showing it returned).

Coordinators leading shards apart (``shards``: every one started with
``--lead-shards --shards N``) log other lines, noted as ``took``,
``leading-shards`` (the shards a coordinator admits from now on, the
leases its take extended and the first revision they were written at),
``handed-over``, ``gave-up`` and ``lost-shards``; and the watcher reads
every shard row instead of the leader row: ``shard`` entries, one per
change of a shard's epoch, with its new ``holder`` (the identity, whose
pid is ``pid``) and the same ``before``/``seen`` times.

torture/failover.py and torture/sharding.py read it back for the checkers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import grpc
from _proc import CHANNEL_OPTIONS, FENCEPOST, free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .nemesis import Proxy

RESTART_DELAY_S = 0.25  # the supervisor's pause before it restarts an exited coordinator
WATCH_EVERY_S = 0.05  # how often the watcher reads the leader row
LAST_WRITE = "INSERT INTO requests"  # a batch's last statement (storage/sql.py write())
WATCHER_NAME = "fencepost-torture-watcher"  # its application_name (no fault pattern matches)

TAKING = re.compile(r"taking over \(epoch (\d+)\): loaded revision (\d+)")
EXTENDED = re.compile(r"epoch (\d+): extended (\d+) leases and (\d+) claims and locks by "
                      r"(\d+) ms")
LEADING = re.compile(r"leading \(epoch (\d+)\) on (\S+) after ")
LOST = re.compile(r"lost leadership \(epoch (\S+)\): (.*)")
TOOK = re.compile(r"took shards (\S+)")
LEADING_SHARDS = re.compile(r"leading shards \[([\d, ]*)\]: (\d+) leases extended \((\d+) claims "
                            r"and locks\) in \S+ s, from revision (\d+)")
# a take's lease extensions, committed (logged whether or not it then leads the shards)
SHARDS_EXTENDED = re.compile(r"shards \[([\d, ]*)\] taken: (\d+) leases extended \((\d+) claims "
                             r"and locks\), from revision (\d+)")
GAVE_UP = re.compile(r"(handed over|gave up) shards \[([\d, ]*)\] \((\d+) runs\)")
LOST_SHARDS = re.compile(r"lost shards (\S+): (.*)")
HOLDER_PID = re.compile(r"/(\d+)/")


def shard_list(text: str) -> list[int]:
    """The shards of a log line: "[0, 3]" lists or "0-3,7" ranges."""
    out: list[int] = []
    for part in text.strip("[]").replace(" ", "").split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


def _signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Events:
    """``cluster.jsonl``: appended to by several threads."""

    def __init__(self, path: Path) -> None:
        self._f: IO[str] = open(path, "w", buffering=1)
        self._lock = threading.Lock()

    def write(self, **entry: Any) -> None:
        entry.setdefault("t", time.monotonic_ns())
        line = json.dumps(entry) + "\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)

    def close(self) -> None:
        with self._lock:
            self._f.close()


class Coordinator:
    """One coordinator slot: a fixed port, its proxy, and the process that
    runs there now (restarted by the supervisor)."""

    def __init__(self, slot: int, url: str, out: Path, args: tuple[str, ...],
                 env: dict[str, str], events: Events) -> None:
        self.slot = slot
        self.url = url
        self.port = free_port()
        self.proxy = Proxy(self.port).start()
        self.args = (*args, "--advertise", self.proxy.address)
        self.env = env
        self.events = events
        self.log_path = out / f"coordinator-{slot}.log"
        self._log = open(self.log_path, "ab")
        self._log_lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.stopped = False  # SIGSTOPped by the nemesis
        self.down_until = 0.0  # monotonic: the supervisor restarts it no earlier
        self.exited_at = 0.0  # monotonic: when the supervisor saw the last exit
        self.offset_ms = 0  # this process's clock jumps so far
        self._reported: set[int] = set()  # pids whose exit is recorded

    @property
    def address(self) -> str:
        """The coordinator itself (the harness's own calls skip the proxy)."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        cmd = [str(FENCEPOST), "serve", "--listen", self.address, "--db", self.url, *self.args]
        self.starts += 1
        self.offset_ms = 0
        self.stopped = False
        with self._log_lock:
            self._log.write(f"\n=== start #{self.starts} ===\n".encode())
            self._log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
        self.proc = proc
        self.events.write(kind="spawn", slot=self.slot, pid=proc.pid, start=self.starts)
        threading.Thread(target=self._read, args=(proc,), name=f"coordinator-{self.slot}-log",
                         daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        """Copy the process's output to its log, noting the lines that matter."""
        assert proc.stdout is not None
        for raw in proc.stdout:
            t = time.monotonic_ns()
            with self._log_lock:
                if not self._log.closed:
                    self._log.write(raw)
                    self._log.flush()
            line = raw.decode(errors="replace")
            base = {"kind": "line", "slot": self.slot, "pid": proc.pid, "t": t}
            if m := TAKING.search(line):
                self.events.write(**base, what="taking", epoch=int(m[1]), loaded=int(m[2]))
            elif m := EXTENDED.search(line):
                self.events.write(**base, what="extended", epoch=int(m[1]), leases=int(m[2]),
                                  others=int(m[3]), gap=int(m[4]))
            elif m := LEADING.search(line):
                self.events.write(**base, what="leading", epoch=int(m[1]), address=m[2])
            elif m := LOST.search(line):
                self.events.write(**base, what="lost", epoch=m[1], why=m[2].strip())
            elif m := TOOK.search(line):
                self.events.write(**base, what="took", shards=shard_list(m[1]))
            elif m := SHARDS_EXTENDED.search(line):
                self.events.write(**base, what="extended-shards", shards=shard_list(m[1]),
                                  leases=int(m[2]), others=int(m[3]), first=int(m[4]))
            elif m := LEADING_SHARDS.search(line):
                self.events.write(**base, what="leading-shards", shards=shard_list(m[1]),
                                  leases=int(m[2]), others=int(m[3]), first=int(m[4]))
            elif m := GAVE_UP.search(line):
                self.events.write(**base, what=m[1].replace(" ", "-"), shards=shard_list(m[2]),
                                  runs=int(m[3]))
            elif m := LOST_SHARDS.search(line):
                self.events.write(**base, what="lost-shards", shards=shard_list(m[1]),
                                  why=m[2].strip())

    def signal(self, sig: int) -> None:
        if self.running:
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def reap(self) -> int | None:
        """Record the exit of the process, once; its exit code (None: running)."""
        proc = self.proc
        if proc is None:
            return None
        rc = proc.poll()
        if rc is None:
            return None
        if proc.pid not in self._reported:
            self._reported.add(proc.pid)
            self.exited_at = time.monotonic()
            self.stopped = False
            self.events.write(kind="exit", slot=self.slot, pid=proc.pid, code=rc)
        return rc

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)

    def serving(self, timeout: float = 0.5) -> bool:
        """Health says SERVING (only the leader does)."""
        if not self.running or self.stopped:
            return False
        with self.channel() as ch:
            try:
                got = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            except grpc.RpcError:
                return False
        return bool(got.status == health_pb2.HealthCheckResponse.SERVING)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        self.proxy.stop()
        with self._log_lock:
            self._log.close()


class PgCluster:
    """PostgreSQL, the coordinators, their supervisor and the leader watcher."""

    def __init__(self, out: Path, n: int, *, args: tuple[str, ...], env: dict[str, str],
                 lease: str, renew: str, max_clock_skew: str, shards: int = 0) -> None:
        """``shards``: every coordinator leads a share of that many shards
        (``--lead-shards``); 0: one leads, the others stand by."""
        from fencepost_devtools.pgcluster import Cluster

        self.out = out
        self.events = Events(out / "cluster.jsonl")
        self.pg = Cluster.start()
        self.dbname = "torture"
        self.url = self.pg.create_database(self.dbname)
        self.events.write(kind="postgres", port=self.pg.port, pid=self.pg.pid)
        self.shards = shards
        self.owners: dict[int, tuple[int, str]] = {}  # shard -> (epoch, holder), as last read
        if shards:
            args = ("--lead-shards", "--shards", str(shards), *args)
        flags = ("--leader-lease", lease, "--leader-renew", renew, "--max-clock-skew",
                 max_clock_skew, "--http-listen", "off", *args)
        self.coordinators = [Coordinator(i, self.url, out, flags, env, self.events)
                             for i in range(n)]
        self._stopping = threading.Event()
        self._done = threading.Event()
        self.epoch = 0  # the leader row as the watcher last read it
        self.holder = ""
        self._threads: list[threading.Thread] = []

    # -- life cycle ------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> PgCluster:
        for c in self.coordinators:  # at (nearly) the same moment: exactly one must win
            c.spawn()
        for target, name in ((self._supervise, "supervisor"), (self._watch, "leader-watcher")):
            th = threading.Thread(target=target, name=f"torture-{name}", daemon=True)
            th.start()
            self._threads.append(th)
        if self.leader(timeout) is None:
            raise RuntimeError("no coordinator became leader:\n" + "\n".join(
                c.log_tail(1500) for c in self.coordinators))
        return self

    @property
    def proxies(self) -> list[Proxy]:
        return [c.proxy for c in self.coordinators]

    @property
    def addresses(self) -> list[str]:
        """Where the workers go: every coordinator's proxy, in slot order."""
        return [c.proxy.address for c in self.coordinators]

    @property
    def direct(self) -> list[str]:
        return [c.address for c in self.coordinators]

    @property
    def aliases(self) -> dict[str, str]:
        """Advertised (proxy) address -> the coordinator itself."""
        return {c.proxy.address: c.address for c in self.coordinators}

    def _supervise(self) -> None:
        while not self._done.is_set():
            now = time.monotonic()
            for c in self.coordinators:
                if c.reap() is None and c.proc is not None:
                    continue
                if self._stopping.is_set():
                    continue
                if now >= c.down_until and now >= c.exited_at + RESTART_DELAY_S:
                    try:
                        c.spawn()
                    except OSError as exc:  # pragma: no cover - the machine is in trouble
                        self.events.write(kind="spawn-failed", slot=c.slot, error=repr(exc))
            self._done.wait(0.05)

    def _polls(self, sql: str) -> Iterator[tuple[int, list[Any], int]]:
        """Run ``sql`` every WATCH_EVERY_S until the cluster stops: (when the
        poll was sent, its rows, when it returned), on a connection of its
        own, opened again after any failure (the failed poll is skipped)."""
        import psycopg

        conn: Any = None
        try:
            while not self._done.is_set():
                inv = time.monotonic_ns()
                try:
                    if conn is None:
                        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2,
                                               application_name=WATCHER_NAME)
                    rows = conn.execute(sql).fetchall()
                except psycopg.Error:
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            conn.close()
                    conn = None
                else:
                    yield inv, rows, time.monotonic_ns()
                self._done.wait(WATCH_EVERY_S)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def _watch(self) -> None:
        """Poll the leader row; record every change of epoch (see the module docstring)."""
        if self.shards:
            self._watch_shards()
            return
        last_inv = 0  # when the last poll showing the current epoch was sent
        last_db = 0  # and the database's clock (ms) as it ran
        for inv, rows, cmp in self._polls(
                "SELECT epoch, holder, address, (extract(epoch FROM clock_timestamp()) "
                "* 1000)::bigint FROM fencepost.fencepost_leader WHERE id = 1"):
            if rows:
                epoch, holder, address = int(rows[0][0]), str(rows[0][1]), str(rows[0][2])
                if epoch != self.epoch:
                    self.events.write(kind="epoch", epoch=epoch, prev=self.epoch, holder=holder,
                                      address=address, before=last_inv, before_db=last_db,
                                      seen=cmp)
                self.epoch, self.holder = epoch, holder
                last_db = int(rows[0][3])
            last_inv = inv

    def _watch_shards(self) -> None:
        """Poll the shard rows; record every change of a shard's epoch."""
        last_inv = 0
        for inv, rows, cmp in self._polls(
                "SELECT shard, epoch, holder, address, expires_at - (extract(epoch FROM "
                "clock_timestamp()) * 1000)::bigint FROM fencepost.fencepost_shards "
                "ORDER BY shard"):
            owners = {}
            for shard, epoch, holder, address, left in rows:
                prev = self.owners.get(shard, (0, ""))[0]
                if epoch != prev:
                    pid = HOLDER_PID.search(holder)
                    self.events.write(kind="shard", shard=shard, epoch=epoch, prev=prev,
                                      holder=holder, pid=int(pid[1]) if pid else 0,
                                      address=address, before=last_inv, seen=cmp)
                owners[shard] = (int(epoch), str(holder) if left > 0 else "")
            self.owners = owners
            last_inv = inv

    def settled(self, timeout: float) -> bool:
        """Every shard held (per the watcher's last read) by a coordinator
        running now and not stopped, within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            live = {f"/{c.pid}/" for c in self.coordinators if c.running and not c.stopped}
            owners = self.owners
            if len(owners) == self.shards and all(
                    any(p in holder for p in live) for _, holder in owners.values()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    # -- what the nemesis does --------------------------------------------------------

    def leader(self, timeout: float = 10.0) -> Coordinator | None:
        """The coordinator serving now (running, not stopped, health SERVING)."""
        deadline = time.monotonic() + timeout
        while True:
            for c in self.coordinators:
                if c.serving():
                    return c
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def kill(self, c: Coordinator, downtime_s: float) -> int:
        """SIGKILL; the supervisor restarts it after ``downtime_s``. The pid."""
        pid = c.pid
        c.down_until = time.monotonic() + downtime_s
        c.signal(signal.SIGKILL)
        if c.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(10)
        return pid

    def stop(self, c: Coordinator) -> None:
        c.stopped = True
        c.signal(signal.SIGSTOP)

    def stop_mid_batch(self, c: Coordinator, identity: str, within_s: float = 3.0) -> bool:
        """SIGSTOP ``c`` while its writer has a transaction open that has
        written something (``pg_stat_activity``: idle in transaction, with a
        transaction id), checked again once it is stopped; a stop that came too
        late is undone at once and tried again. False (not stopped) when no
        such moment came within ``within_s``."""
        name = f"fencepost-writer {identity}"[:63]
        query = ("SELECT state, xact_start, backend_xid::text FROM pg_stat_activity "
                 "WHERE datname = %s AND application_name = %s")
        deadline = time.monotonic() + within_s
        with self.pg.connect(self.dbname) as conn:
            while time.monotonic() < deadline and c.running:
                row = conn.execute(query, (self.dbname, name)).fetchone()
                if row is None or row[0] != "idle in transaction" or row[2] is None:
                    continue
                self.stop(c)
                again = conn.execute(query, (self.dbname, name)).fetchone()
                if again is not None and tuple(again) == tuple(row):
                    return True
                self.cont(c)  # it had moved on (sent its next statement) before it stopped
        return False

    def stall(self, identity: str, *, mid_commit: bool, within_s: float = 3.0,
              renewals: str = "fencepost-leadership") -> list[int]:
        """Stall a leader's database mid-batch, as a partition that holds its
        packets would: SIGSTOP the PostgreSQL backend of its write session
        once a batch has written everything (idle in transaction after the
        batch's last statement, the request ids: the leader's COMMIT then
        waits in the socket, a delayed packet), or (``mid_commit``) while its COMMIT is being
        executed (which may stop the backend holding the WAL's write lock:
        every commit then waits, as on a stalled disk), and the backend of its
        leadership session while it is idle (between renewals: holding no
        lock, so a takeover is not held up by it, only the leader's renewals
        are; ``renewals``: that session's role, "fencepost-shards" for the
        shard leases). Each state is checked again once the backend is stopped; a stop
        that came too late is undone at once and tried again. The stopped
        backends' pids ([] when no such moment came within ``within_s``)."""
        query = ("SELECT pid, state, query, xact_start, state_change, backend_xid::text "
                 "FROM pg_stat_activity WHERE datname = %s AND application_name = %s")
        deadline = time.monotonic() + within_s

        def stop_when(conn: Any, name: str, ok: Any) -> int | None:
            while time.monotonic() < deadline:
                row = conn.execute(query, (self.dbname, name)).fetchone()
                if row is None or not ok(row):
                    continue
                _signal_pids([row[0]], signal.SIGSTOP)
                again = conn.execute(query, (self.dbname, name)).fetchone()
                if again is not None and tuple(again) == tuple(row):
                    return int(row[0])
                _signal_pids([row[0]], signal.SIGCONT)  # it had moved on before it stopped
            return None

        with self.pg.connect(self.dbname) as conn:
            if mid_commit:
                writer = stop_when(conn, f"fencepost-writer {identity}"[:63],
                                   lambda r: r[1] == "active" and str(r[2]).strip() == "COMMIT")
            else:
                writer = stop_when(conn, f"fencepost-writer {identity}"[:63],
                                   lambda r: r[1] == "idle in transaction" and r[5] is not None
                                   and str(r[2]).lstrip().startswith(LAST_WRITE))
            if writer is None:
                return []
            renewer = stop_when(conn, f"{renewals} {identity}"[:63], lambda r: r[1] == "idle")
        return [writer] if renewer is None else [writer, renewer]

    def unstall(self, backends: list[int]) -> None:
        _signal_pids(backends, signal.SIGCONT)

    def cont(self, c: Coordinator) -> None:
        c.signal(signal.SIGCONT)
        c.stopped = False

    def jump_clock(self, c: Coordinator, ms: int) -> int:
        """Jump the coordinator's clock (TestHooks); its clock's time after."""
        from fencepost.v1 import testing_pb2, testing_pb2_grpc

        with c.channel() as ch:
            now = testing_pb2_grpc.TestHooksStub(ch).JumpClock(
                testing_pb2.JumpClockRequest(ms=ms), timeout=10).now_ms
        c.offset_ms += ms
        return int(now)

    def cut_database(self, pattern: str) -> int:
        """End the PostgreSQL sessions whose application_name matches (LIKE)."""
        return self.pg.terminate_connections(self.dbname, pattern)

    def by_pid(self, pid: int) -> Coordinator | None:
        return next((c for c in self.coordinators if c.pid == pid), None)

    def resume_all(self) -> None:
        for c in self.coordinators:
            if c.stopped:
                self.cont(c)

    # -- the end ------------------------------------------------------------------------

    def stop_all(self, timeout: float = 20.0) -> dict[int, int | None]:
        """No more restarts; SIGTERM every coordinator (a leader hands over at
        once) and wait. Exit codes by slot."""
        self._stopping.set()
        time.sleep(0.2)  # the supervisor has seen it: it restarts nothing from here on
        self.resume_all()
        for c in self.coordinators:
            c.signal(signal.SIGTERM)
        codes: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout
        for c in self.coordinators:
            if c.proc is not None:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.signal(signal.SIGKILL)
                    c.proc.wait(10)
            codes[c.slot] = c.reap()
        return codes

    def export(self, path: Path) -> None:
        """The committed state (changes, runs, meta), copied out of PostgreSQL
        into an SQLite file laid out like fencepost's own, for the checkers."""
        path.unlink(missing_ok=True)
        dst = sqlite3.connect(path)
        try:
            dst.executescript(
                "CREATE TABLE changes (revision INTEGER PRIMARY KEY, run_id TEXT NOT NULL, "
                "kind INTEGER NOT NULL, record TEXT, committed_at INTEGER NOT NULL);"
                "CREATE TABLE runs (run_id TEXT PRIMARY KEY, version INTEGER, status INTEGER, "
                "fencing_token INTEGER, owner TEXT, revision INTEGER, record TEXT);"
                "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER);")
            with self.pg.connect(self.dbname) as src:
                for table, cols in (
                    ("changes", "revision, run_id, kind, record, committed_at"),
                    ("runs", "run_id, version, status, fencing_token, owner, revision, record"),
                    ("meta", "key, value"),
                ):
                    rows = src.execute(f"SELECT {cols} FROM fencepost.{table}").fetchall()
                    marks = ",".join("?" * len(cols.split(",")))
                    dst.executemany(f"INSERT INTO {table} ({cols}) VALUES ({marks})", rows)
            dst.commit()
        finally:
            dst.close()

    def close(self) -> None:
        self._stopping.set()
        for c in self.coordinators:
            c.signal(signal.SIGCONT)
            c.signal(signal.SIGKILL)
            if c.proc is not None:
                with contextlib.suppress(Exception):
                    c.proc.wait(10)
            c.reap()
        self._done.set()
        for th in self._threads:
            th.join(10)
        for c in self.coordinators:
            c.close()
        with contextlib.suppress(Exception):
            (self.out / "postgres.log").write_text(self.pg.log_path.read_text(errors="replace"))
        self.pg.close()
        self.events.close()

    def server_log(self) -> str:
        return "\n".join(c.log_path.read_text(errors="replace") for c in self.coordinators
                         if c.log_path.exists())
