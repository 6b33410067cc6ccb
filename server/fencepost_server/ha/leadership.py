"""Leadership among coordinators sharing one PostgreSQL database.

One row (``fencepost_leader``) names the leader: its identity, its advertised
address, an epoch that increases on every change of leader, and an expiry the
leader renews every ``renew_ms``. Times in the row are the database's clock,
so taking over never depends on two coordinators' clocks agreeing.

- A coordinator that does not lead is a *standby*: it polls the row and takes
  over once the row has expired (``campaign``). Taking over locks the row,
  bumps the epoch and sets this coordinator as holder in one transaction;
  only then does it load the state, so it loads every batch the old leader
  committed, and every later batch of the old leader finds the epoch moved
  (storage/postgres.py checks it inside each batch's transaction).
- The leader renews the row on condition that it still holds its epoch
  (``keep``). It counts itself the leader only until ``valid_until``: the
  monotonic time it sent its last successful renewal plus the lease, less a
  margin. The row cannot expire, by the database's clock, before that renewal
  reached it plus the lease, so (with clocks that run at about the same rate)
  the old leader stops serving before anyone can take over — even after a
  pause (SIGSTOP, a long GC, a VM migration): on waking it finds
  ``valid_until`` passed and serves nothing more.
- Lease expiry stays decided by each coordinator's own injected clock. A
  coordinator refuses to lead while that clock differs from the database's
  by more than ``max_skew_ms`` (checked at takeover and at every renewal),
  so the leaders that follow one another agree on time.

- A coordinator restarted in place after a crash (the same advertised
  address, on the same machine) does not wait for its predecessor's lease:
  the row also names the leader's process (``process_proof``), and when that
  process is provably gone (same boot and PID namespace, and no process with
  that pid and start time runs, or only its zombie), nobody can still serve
  or commit under the old epoch, so it takes over at once. A standby at
  another address, or on another machine, waits for the row to expire: it
  cannot prove the leader dead, and failover times stay what they would be
  across machines.

All database calls run in one thread of their own, on their own connection
(not the writer's), so a slow renewal never delays a batch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..clock import Clock
from ..storage.postgres import (
    DRIVER_ERRORS,
    LockNotAvailable,
    PgConnection,
    connect,
    first_line,
)

log = logging.getLogger("fencepost.leadership")

# the database's clock, in ms: every time in a lease row
DB_NOW = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


class LeadershipLost(Exception):
    """This coordinator no longer leads (the reason is the message)."""


@dataclass(frozen=True)
class Takeover:
    """What a won campaign learned: the new epoch, the previous leader, and
    how long the coordinator was unavailable (the database's clock, ms: from
    the old leader's last renewal, or the moment it gave leadership up, to
    this takeover; 0 on a fresh database)."""

    epoch: int
    previous: str
    gap_ms: int


def default_identity() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def _stat(pid: int | str) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a process, or None
    when there is none with that pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields
    # that follow start after its last ")"
    fields = raw[raw.rfind(")") + 2:].split()
    return fields[0], fields[19]


def _here() -> tuple[str, str] | None:
    """(boot id, PID namespace) of this process, or None where /proc cannot say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return (boot, ns) if boot and " " not in ns else None


def process_proof(pid: int | None = None) -> str:
    """What names this process uniquely while the machine runs: boot id, PID
    namespace, pid, start time (Linux; '' where /proc cannot say)."""
    pid = os.getpid() if pid is None else pid
    here = _here()
    try:
        stat = _stat(pid)
    except OSError:
        return ""
    if here is None or stat is None:
        return ""
    return f"{here[0]} {here[1]} {pid} {stat[1]}"


def process_gone(proof: str) -> bool:
    """True only when ``proof`` names a process of this machine, since its
    last boot, in this PID namespace, that no longer runs: no process has its
    pid, or one started at another time does, or it is a zombie (it exited;
    its sockets are closed). False whenever that cannot be told."""
    parts = proof.split(" ")
    if len(parts) != 4:
        return False
    boot, ns, pid, start = parts
    if _here() != (boot, ns) or not pid.isdigit() or int(pid) <= 0:
        return False
    stat = _stat(pid)
    return stat is None or stat[1] != start or stat[0] in ("Z", "X")


class RowLeases:
    """What a coordinator needs to hold lease rows in PostgreSQL, shared by
    ``Leadership`` (one row) and ``ShardLeases`` (ha/shards.py, a row per
    shard): its own thread and connection, the clock-skew check, the proof
    that a predecessor's process is gone, and ending the writer sessions of
    an expired holder that keeps a row locked."""

    ROLE = "fencepost-leadership"  # the thread's and the connection's name
    WHAT = "leader"  # in messages: the leader lease, the shard lease
    _log = log

    def __init__(
        self,
        url: str,
        clock: Clock,
        *,
        address: str,
        identity: str | None = None,
        lease_ms: int = 5000,
        renew_ms: int = 1000,
        max_skew_ms: int = 500,
    ) -> None:
        if not 0 < renew_ms < lease_ms:
            raise ValueError(f"the {self.WHAT} renewal interval must be shorter than the "
                             f"{self.WHAT} lease")
        self.url = url
        self.clock = clock
        self.address = address
        self.identity = identity or default_identity()
        self.lease_ms = lease_ms
        self.renew_ms = renew_ms
        self.max_skew_ms = max_skew_ms
        # a holder serves until this monotonic time unless it renews again
        self.margin_s = min(lease_ms * 0.2, 1000) / 1000
        self.valid_until = 0.0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=self.ROLE)
        self._db: PgConnection | None = None

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._drop)
        self._thread.shutdown(wait=False)

    # -- helpers (this object's thread) ------------------------------------------

    def _conn(self) -> PgConnection:
        if self._db is None or self._db.broken:
            self._drop()
            self._db = connect(self.url, f"{self.ROLE} {self.identity}")
            # a takeover waits this long for a batch holding the row
            self._db.execute(f"SET lock_timeout = {max(100, self.renew_ms)}")
        return self._db

    def _drop(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _unblock_row(self, db: PgConnection, where: str, params: tuple[Any, ...],
                     what: str) -> int:
        """The row (``FROM {where}``) is locked by a batch of its holder that
        has not finished within ``lock_timeout``: if the row has expired
        meanwhile, that holder was paused or cut off mid-batch while holding
        the lock, and waiting for it would wait for as long as its connection
        lives, so end its sessions (the open batch rolls back: it was never
        acknowledged). Returns the ms to wait before trying again."""
        holder, expires_at, now, address, process = db.execute(
            f"SELECT holder, expires_at, {DB_NOW}, address, process FROM {where}", params
        ).fetchone() or ("", 0, 0, "", "")
        if expires_at > now and not self._replaces(address, process):
            return min(self.renew_ms, expires_at - now + 50)
        ended = db.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = ?",
            (writer_name(holder),),
        ).fetchone()
        self._log.warning("the %s %s (expired, or no longer running) held %s mid-batch: "
                          "ended %s of its sessions", self.WHAT, holder, what,
                          ended[0] if ended else 0)
        return 50

    def _replaces(self, address: str, process: str) -> bool:
        """May take over before the row expires: this coordinator is the
        holder's own restart (its address) and the holder's process is gone."""
        return bool(address) and address == self.address and process_gone(process)

    def _skew(self, db: PgConnection) -> str | None:
        """None while this coordinator's clock is within the bound of the
        database's, else why not (the round trip is the uncertainty)."""
        if not self.max_skew_ms:
            return None
        before = self.clock.now_ms()
        row: Any = db.execute(f"SELECT {DB_NOW}").fetchone()
        after = self.clock.now_ms()
        offset = row[0] - (before + after) / 2
        if abs(offset) - (after - before) / 2 > self.max_skew_ms:
            return (f"this coordinator's clock differs from the database's by {offset:+.0f} ms, "
                    f"more than --max-clock-skew {self.max_skew_ms} ms")
        return None


class Leadership(RowLeases):
    # RowLeases' constructor; these start as below and are set per instance
    epoch: int | None = None
    leader_address = ""  # the leader's advertised address, as last read
    lost: str | None = None  # why this coordinator stopped leading

    # -- state -------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        """Leads right now: won, not lost, and renewed recently enough."""
        return self.epoch is not None and self.lost is None and \
            time.monotonic() < self.valid_until

    # -- the campaign (standby) --------------------------------------------------

    async def campaign(self) -> Takeover:
        """Wait until this coordinator takes over; returns what it learned."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                won, wait_ms = await loop.run_in_executor(self._thread, self._try_take_over)
            except DRIVER_ERRORS as exc:
                log.warning("leader election: %s", first_line(exc))
                self._drop()
                won, wait_ms = None, self.renew_ms
            if won is not None:
                return won
            await asyncio.sleep(max(0.05, min(wait_ms, self.renew_ms) / 1000))

    def _try_take_over(self) -> tuple[Takeover | None, int]:
        """One attempt: (the takeover, 0) or (None, ms until the row expires)."""
        db = self._conn()
        skew = self._skew(db)
        db.execute("BEGIN")
        try:
            try:
                row = db.execute(
                    f"SELECT epoch, holder, address, renewed_at, expires_at, {DB_NOW}, "
                    "process FROM fencepost_leader WHERE id = 1 FOR UPDATE"
                ).fetchone()
            except LockNotAvailable:
                db.execute("ROLLBACK")
                return None, self._unblock(db)
            assert row is not None, "the leader row is created by the schema migration"
            epoch, holder, address, renewed_at, expires_at, now, process = row
            if expires_at > now and holder != self.identity:
                if not self._replaces(address, process):
                    db.execute("ROLLBACK")
                    self.leader_address = address
                    return None, expires_at - now + 50
                log.warning("the leader %s (this coordinator's address, this machine) is no "
                            "longer running: taking over without waiting %d ms for its lease",
                            holder, expires_at - now)
            if skew is not None:
                db.execute("ROLLBACK")
                self.leader_address = address if expires_at > now else ""
                log.error("refusing to lead: %s", skew)
                return None, self.renew_ms
            sent = time.monotonic()
            db.execute(
                "UPDATE fencepost_leader SET epoch = ?, holder = ?, address = ?, "
                f"renewed_at = {DB_NOW}, expires_at = {DB_NOW} + ?, process = ? WHERE id = 1",
                (epoch + 1, self.identity, self.address, self.lease_ms, process_proof()),
            )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self.epoch = epoch + 1
        self.valid_until = sent + self.lease_ms / 1000 - self.margin_s
        self.leader_address = self.address
        gap = max(0, now - renewed_at) if holder and renewed_at else 0
        return Takeover(epoch + 1, holder, gap), 0

    # -- keeping it (leader) -----------------------------------------------------

    async def keep(self) -> str:
        """Renew until leadership is lost; returns why (never raises)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.renew_ms / 1000)
            if self.lost is not None:
                return self.lost
            if time.monotonic() >= self.valid_until:
                return self._lose("the leader row was not renewed within the leader lease")
            sent = time.monotonic()
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for returns the
                # result when a cancellation lands as the renewal completes,
                # and the cancelled keeper would renew on forever (a stop hangs)
                async with asyncio.timeout(max(0.01, self.valid_until - time.monotonic())):
                    why = await loop.run_in_executor(self._thread, self._renew)
            except TimeoutError:
                return self._lose("the leader row was not renewed within the leader lease")
            except DRIVER_ERRORS as exc:
                log.warning("leader renewal failed: %s", first_line(exc))
                self._drop()
                continue
            if why:
                return self._lose(why)
            self.valid_until = max(self.valid_until, sent + self.lease_ms / 1000 - self.margin_s)

    def _renew(self) -> str:
        """Renew the row; '' on success, else why leadership is lost."""
        db = self._conn()
        skew = self._skew(db)
        if skew is not None:
            return skew
        row = db.execute(
            f"UPDATE fencepost_leader SET renewed_at = {DB_NOW}, "
            f"expires_at = {DB_NOW} + ? WHERE id = 1 AND epoch = ? AND holder = ? "
            "RETURNING epoch",
            (self.lease_ms, self.epoch, self.identity),
        ).fetchone()
        if row is None:
            current = db.execute(
                "SELECT epoch, address FROM fencepost_leader WHERE id = 1"
            ).fetchone()
            if current is not None:
                self.leader_address = current[1]
            return f"another coordinator took over (epoch {current[0] if current else '?'})"
        return ""

    def lose(self, why: str) -> None:
        """Stop counting as leader (a batch found the epoch moved...)."""
        self._lose(why)

    def _lose(self, why: str) -> str:
        if self.lost is None:
            self.lost = why
            self.valid_until = 0.0
            log.error("lost leadership (epoch %s): %s", self.epoch, why)
        return self.lost

    async def resign(self) -> None:
        """Give leadership up at once (a clean stop): the row expires now, so
        a standby takes over without waiting for the lease."""
        if self.epoch is None:
            return
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(2):  # not wait_for (see keep)
                await loop.run_in_executor(self._thread, self._resign)
        except TimeoutError as exc:
            log.warning("could not give leadership up: %r", exc)
        except DRIVER_ERRORS as exc:
            log.warning("could not give leadership up: %r", exc)

    def _resign(self) -> None:
        self._conn().execute(  # renewed_at: when it stopped (the next leader's gap)
            f"UPDATE fencepost_leader SET renewed_at = {DB_NOW}, expires_at = {DB_NOW} - 1 "
            "WHERE id = 1 AND epoch = ? AND holder = ?",
            (self.epoch, self.identity),
        )

    # -- helpers (leadership thread) ---------------------------------------------

    def _unblock(self, db: PgConnection) -> int:
        return self._unblock_row(db, "fencepost_leader WHERE id = 1", (), "the leader row")


def writer_name(identity: str) -> str:
    """The ``application_name`` of a coordinator's write connection."""
    return f"fencepost-writer {identity}"[:63]

