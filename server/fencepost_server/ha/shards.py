"""Which coordinator leads each shard of a PostgreSQL database.

The generalisation of ``Leadership`` (ha/leadership.py) from one row to a row
per shard (``fencepost_shards``: epoch, holder, address, expiry, process),
plus a row per taking-part coordinator (``fencepost_members``). Times in the
rows are the database's clock. Every round (``tick``, on this object's own
thread and connection):

- renews this coordinator's member row, and every shard it holds in one
  statement conditional on (shard, epoch, holder): a held shard that is not
  renewed is lost (another coordinator bumped its epoch);
- reads the live members and the shard rows, and computes the assignment
  (core/shards.py ``assign``: balanced, deterministic from the set of live
  members, so every coordinator computes the same one without talking);
- takes each shard assigned to it whose row has expired or was released:
  the row is locked FOR UPDATE, its epoch bumped and this coordinator set as
  holder in one transaction, so a batch of the old holder that checks the
  shard's epoch FOR KEY SHARE either commits first or commits nothing (as
  with the leader row; an expired holder caught mid-batch has its writer
  sessions ended). A coordinator restarted in place takes its
  predecessor's shards at once when that process is provably gone;
- reports the shards it holds that are assigned elsewhere (``surplus``): it
  keeps them until whoever uses them calls ``release``, which expires them
  at once, so the assigned member takes them on its next round.

A coordinator counts a shard as its own (``leads``) only until
``valid_until``: the monotonic time of its last successful renewal plus the
lease, less a margin, so it stops using a shard before anyone else can take
it, even after a pause. It refuses to hold shards while its clock differs
from the database's by more than ``max_skew_ms``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..clock import Clock
from ..core.shards import MAX_SHARDS, MIN_SHARDS, assign
from ..storage.postgres import (
    DRIVER_ERRORS,
    LockNotAvailable,
    PgConnection,
    first_line,
    listener,
    redact,
)
from .leadership import DB_NOW, RowLeases, Takeover, process_gone, process_proof

log = logging.getLogger("fencepost.shards")

CHANNEL = "fencepost_shards"  # NOTIFY: a member joined or left, or shards were released
# what ends a listening connection (RuntimeError: the event loop it wakes has closed)
_LISTEN_ERRORS: tuple[type[Exception], ...] = (*DRIVER_ERRORS, RuntimeError)

_ROW = "shard, epoch, holder, address, renewed_at, expires_at, process, pinned"


@dataclass(frozen=True)
class Owner:
    """A shard's holder as last read (holder '' : never held)."""

    holder: str
    address: str
    epoch: int


@dataclass(frozen=True)
class _Row:
    shard: int
    epoch: int
    holder: str
    address: str
    renewed_at: int
    expires_at: int
    process: str
    pinned: str  # the address an operator moved it to ("": none)


@dataclass
class Round:
    """What one round did: the shards taken, the shards lost (groups of
    shards, each with why), and the shards held but assigned elsewhere."""

    taken: dict[int, Takeover] = field(default_factory=dict)
    lost: list[tuple[list[int], str]] = field(default_factory=list)
    surplus: list[int] = field(default_factory=list)
    # ms until the first row assigned here but held by another runs out (None: none)
    due_in_ms: int | None = None


class ShardLeases(RowLeases):
    ROLE = "fencepost-shards"
    WHAT = "shard"
    _log = log

    def __init__(
        self,
        url: str,
        clock: Clock,
        *,
        address: str,
        shards: int,
        identity: str | None = None,
        lease_ms: int = 5000,
        renew_ms: int = 1000,
        max_skew_ms: int = 500,
    ) -> None:
        if not MIN_SHARDS <= shards <= MAX_SHARDS:
            raise ValueError(f"shards must be between {MIN_SHARDS} and {MAX_SHARDS} "
                             f"(got {shards})")
        super().__init__(url, clock, address=address, identity=identity, lease_ms=lease_ms,
                         renew_ms=renew_ms, max_skew_ms=max_skew_ms)
        self.shards = shards
        self.held: dict[int, int] = {}  # shard -> epoch; replaced whole, never edited
        self.surplus: list[int] = []
        self._owners: dict[int, Owner] = {}
        # shard -> the address of the member the last round assigned it to
        self.assigned_to: dict[int, str] = {}
        self._last: tuple[list[_Row], list[tuple[str, str]]] | None = None  # the last round's read
        self._process = process_proof()
        # shards given up (release, a lapse seen by run) while a round was
        # out: that round must not count them held again
        self._dropped: set[int] = set()
        self._lock = threading.Lock()
        self._stop: asyncio.Event | None = None
        self._closed = False
        self._joined = False  # a round has announced this member (NOTIFY)

    # -- state -------------------------------------------------------------------

    def leads(self, shard: int) -> bool:
        """Holds ``shard`` right now: taken, not lost, renewed recently enough."""
        return shard in self.held and time.monotonic() < self.valid_until

    def owners(self) -> dict[int, Owner]:
        """Every shard's holder, address and epoch, as the last round read them."""
        return dict(self._owners)

    # -- one round ---------------------------------------------------------------

    def tick(self) -> Round:
        """One round (blocking: run it on this object's thread, as ``run``
        does; DRIVER_ERRORS when the database fails it, nothing held lost)."""
        out = Round()
        with self._lock:
            self._dropped.clear()
            held = dict(self.held)
        if held and time.monotonic() >= self.valid_until:
            out.lost.append((sorted(held), "the shard rows were not renewed within the "
                                           "shard lease"))
            held = {}
        db = self._conn()
        skew = self._skew(db)
        if skew is not None:
            if held:
                out.lost.append((sorted(held), skew))
            log.error("refusing to lead shards: %s", skew)
            # not a member while it refuses: the others leave it out of the assignment
            db.execute("DELETE FROM fencepost_members WHERE identity = ?", (self.identity,))
            self._read(db)
            self._apply({}, None, [])
            return out
        sent = time.monotonic()
        db.execute(
            "INSERT INTO fencepost_members (identity, address, renewed_at, expires_at) "
            f"VALUES (?, ?, {DB_NOW}, {DB_NOW} + ?) ON CONFLICT (identity) DO UPDATE SET "
            "address = EXCLUDED.address, renewed_at = EXCLUDED.renewed_at, "
            "expires_at = EXCLUDED.expires_at",
            (self.identity, self.address, self.lease_ms),
        )
        if held:
            shards = sorted(held)
            renewed = {r[0] for r in db.execute(
                f"UPDATE fencepost_shards SET renewed_at = {DB_NOW}, expires_at = {DB_NOW} + ? "
                "FROM unnest(?::integer[], ?::bigint[]) AS h (shard, epoch) "
                "WHERE fencepost_shards.shard = h.shard AND fencepost_shards.epoch = h.epoch "
                "AND holder = ? RETURNING fencepost_shards.shard",
                (self.lease_ms, shards, [held[s] for s in shards], self.identity),
            ).fetchall()}
            gone = [s for s in shards if s not in renewed]
            if gone:
                out.lost.append((gone, "another coordinator took these shards over"))
                held = {s: e for s, e in held.items() if s in renewed}
        rows, members, now = self._read(db)
        self._last = (rows, members)
        assigned = self._assign(members, rows)
        at = dict(members)
        self.assigned_to = {s: at.get(m, "") for s, m in enumerate(assigned)}
        mine = [s for s, m in enumerate(assigned) if m == self.identity and s not in held]
        want = [s for s in mine if self._takeable(rows[s], now)]
        waiting = [rows[s].expires_at - now for s in mine if s not in want]
        out.due_in_ms = min(waiting) if waiting else None
        if not self._joined:  # the others recompute the assignment now, not next round
            self._joined = True
            db.execute(f"NOTIFY {CHANNEL}")
        if want:
            out.taken = self._take(db, want)
            held.update({s: t.epoch for s, t in out.taken.items()})
        out.surplus = sorted(s for s in held if assigned[s] != self.identity)
        self._apply(held, sent, out.surplus)
        for shards, why in out.lost:
            log.error("lost shards %s: %s", _ranges(shards), why)
        if out.taken:
            log.info("took shards %s", _ranges(out.taken))
        return out

    def _read(self, db: PgConnection) -> tuple[list[_Row], list[tuple[str, str]], int]:
        """The shard rows, the live members (identity, address), the database's now."""
        now = db.execute(f"SELECT {DB_NOW}").fetchone()[0]  # type: ignore[index]
        rows = [_Row(*r) for r in db.execute(
            f"SELECT {_ROW} FROM fencepost_shards ORDER BY shard").fetchall()]
        if [r.shard for r in rows] != list(range(self.shards)):
            raise RuntimeError(
                f"{redact(self.url)} has {len(rows)} shard rows; this coordinator was started "
                f"for {self.shards} shards (the stored count): refusing to lead shards")
        members = [(r[0], r[1]) for r in db.execute(
            "SELECT identity, address FROM fencepost_members WHERE expires_at > ?", (now,)
        ).fetchall()]
        self._owners = {r.shard: Owner(r.holder, r.address, r.epoch) for r in rows}
        return rows, members, now

    def _assign(self, members: list[tuple[str, str]], rows: list[_Row],
                leaving: bool = False) -> list[str]:
        """Each shard's member: ``assign``'s, but for a shard an operator moved
        to a live member's address, which goes there (``pin``)."""
        live = self._members(members, rows, leaving)
        assigned = assign(live, self.shards)
        at = {address: identity for identity, address in members if identity in live}
        for r in rows:
            if r.pinned and r.pinned in at:
                assigned[r.shard] = at[r.pinned]
        return assigned

    def pin(self, shard: int, to: str) -> Owner:
        """Move ``shard`` to the live member advertised at ``to`` (blocking:
        this object's thread); its holder then hands it over. Returns who led
        it. ValueError naming what is wrong."""
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard: {shard} is not a shard (0 .. {self.shards - 1})")
        db = self._conn()
        rows, members, _ = self._read(db)
        if to not in {address for identity, address in members
                      if identity in self._members(members, rows)}:
            known = ", ".join(sorted({a for _, a in members})) or "none"
            raise ValueError(f"to: no coordinator taking part is advertised at {to!r} "
                             f"(those taking part: {known})")
        db.execute("UPDATE fencepost_shards SET pinned = ? WHERE shard = ?", (to, shard))
        db.execute(f"NOTIFY {CHANNEL}")
        r = rows[shard]
        log.info("shard %d moved to %s (led by %s)", shard, to, r.address or "nobody")
        return Owner(r.holder, r.address, r.epoch)

    def _members(self, members: list[tuple[str, str]], rows: list[_Row],
                 leaving: bool = False) -> list[str]:
        """The members the assignment is over: the live ones, but for a
        predecessor at this coordinator's address whose process is provably
        gone (it held shards, and every one names a process that is gone);
        this one among them unless ``leaving``."""
        out = []
        for identity, address in members:
            if identity == self.identity and leaving:
                continue
            if identity != self.identity and address == self.address:
                procs = {r.process for r in rows if r.holder == identity}
                if procs and all(process_gone(p) for p in procs):
                    continue
            out.append(identity)
        return out if self.identity in out or leaving else [*out, self.identity]

    def _takeable(self, row: _Row, now: int) -> bool:
        return (row.expires_at <= now or row.holder == self.identity
                or self._replaces(row.address, row.process))

    def _take(self, db: PgConnection, want: list[int]) -> dict[int, Takeover]:
        """Take the ``want`` shards whose rows are still takeable once locked:
        those no batch holds, in one transaction; then those a batch held,
        one at a time with ``lock_timeout``, until one cannot be locked."""
        taken = self._take_locked(db, want, "SKIP LOCKED")
        for shard in want:
            if shard in taken:
                continue
            try:
                taken.update(self._take_locked(db, [shard], ""))
            except LockNotAvailable:
                self._unblock_row(db, "fencepost_shards WHERE shard = ?", (shard,),
                                  f"shard {shard}'s row")
                break  # the rest on the next round: ending its sessions freed them
        return taken

    def _take_locked(self, db: PgConnection, want: list[int], skip: str) -> dict[int, Takeover]:
        db.execute("BEGIN")
        try:
            try:
                locked = [_Row(*r) for r in db.execute(
                    f"SELECT {_ROW} FROM fencepost_shards WHERE shard = ANY(?) "
                    f"ORDER BY shard FOR UPDATE {skip}", (want,)).fetchall()]
                now = db.execute(f"SELECT {DB_NOW}").fetchone()[0]  # type: ignore[index]
            except LockNotAvailable:
                db.execute("ROLLBACK")
                raise
            rows = [r for r in locked if self._takeable(r, now)]
            for r in rows:
                if r.expires_at > now and r.holder != self.identity:
                    log.warning("the holder %s of shard %d (this coordinator's address, this "
                                "machine) is no longer running: taking it without waiting "
                                "%d ms for its lease", r.holder, r.shard, r.expires_at - now)
            if rows:
                db.execute(
                    "UPDATE fencepost_shards SET epoch = epoch + 1, holder = ?, address = ?, "
                    f"renewed_at = {DB_NOW}, expires_at = {DB_NOW} + ?, process = ? "
                    "WHERE shard = ANY(?)",
                    (self.identity, self.address, self.lease_ms, self._process,
                     [r.shard for r in rows]),
                )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        taken = {}
        for r in rows:
            gap = max(0, now - r.renewed_at) if r.holder and r.renewed_at else 0
            taken[r.shard] = Takeover(r.epoch + 1, r.holder, gap)
            self._owners[r.shard] = Owner(self.identity, self.address, r.epoch + 1)
        return taken

    def _apply(self, held: dict[int, int], sent: float | None, surplus: list[int]) -> None:
        with self._lock:
            held = {s: e for s, e in held.items() if s not in self._dropped}
            if sent is not None:
                self.valid_until = max(self.valid_until,
                                       sent + self.lease_ms / 1000 - self.margin_s)
            self.held = held
            self.surplus = [s for s in surplus if s in held]

    # -- giving shards up --------------------------------------------------------

    async def move(self, shard: int, to: str) -> Owner:
        """``pin``, on this object's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.pin, shard, to)

    async def release(self, shards: Iterable[int]) -> None:
        """Give ``shards`` up at once (the caller has stopped using them): their
        rows expire now, so their assigned member takes them on its next round
        without waiting for the lease. Never raises; logs what it could not do."""
        asked = set(shards)
        with self._lock:
            gone = {s: e for s, e in self.held.items() if s in asked}
            self._dropped.update(gone)
            self.held = {s: e for s, e in self.held.items() if s not in gone}
            self.surplus = [s for s in self.surplus if s not in gone]
        if gone:
            await self._call(self._release, gone)

    def _release(self, gone: dict[int, int]) -> None:
        shards = sorted(gone)
        self._conn().execute(  # renewed_at: when it stopped (the next holder's gap)
            f"UPDATE fencepost_shards SET renewed_at = {DB_NOW}, expires_at = {DB_NOW} "
            "FROM unnest(?::integer[], ?::bigint[]) AS h (shard, epoch) "
            "WHERE fencepost_shards.shard = h.shard AND fencepost_shards.epoch = h.epoch "
            "AND holder = ?",
            (shards, [gone[s] for s in shards], self.identity),
        )
        self._conn().execute(f"NOTIFY {CHANNEL}")  # their new owners take them now
        log.info("released shards %s", _ranges(shards))

    def assign_without_me(self) -> None:
        """Before a clean stop (no round running): where each shard goes once
        this member has left, as ``assigned_to``, so that the refusals while
        it hands them over name the coordinator that will take each."""
        if self._last is None:
            return
        rows, members = self._last
        if self._members(members, rows, leaving=True):
            at = dict(members)
            self.assigned_to = {s: at.get(m, "")
                                for s, m in enumerate(self._assign(members, rows, True))}

    async def resign(self) -> None:
        """Leave the members, then give every held shard up (a clean stop): the
        others' round on the release's NOTIFY already assigns without this one,
        and takes the shards at once."""
        held = list(self.held)
        await self._call(self._leave, not held)
        await self.release(held)

    def _leave(self, notify: bool = True) -> None:
        db = self._conn()
        db.execute("DELETE FROM fencepost_members WHERE identity = ?", (self.identity,))
        if notify:
            db.execute(f"NOTIFY {CHANNEL}")

    async def _call(self, fn: Callable[..., None], *args: Any) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(2):  # not wait_for (see Leadership.keep)
                await loop.run_in_executor(self._thread, fn, *args)
        except TimeoutError as exc:
            log.warning("could not give shards up: %r", exc)
        except DRIVER_ERRORS as exc:
            log.warning("could not give shards up: %s", first_line(exc))
            await loop.run_in_executor(self._thread, self._drop)

    # -- the loop ----------------------------------------------------------------

    async def run(
        self,
        on_taken: Callable[[dict[int, Takeover]], None] | None = None,
        on_lost: Callable[[list[int], str], None] | None = None,
        on_round: Callable[[], None] | None = None,
    ) -> None:
        """Run a round every ``renew_ms`` until ``close``, calling ``on_taken``
        and ``on_lost`` (on the event loop) with what each round took and lost,
        and ``on_round`` after each round (``surplus``, ``owners`` are new).
        A held shard whose renewal does not come back within the lease is
        reported lost without waiting for the round. Raises RuntimeError when
        the database's shard rows are not the ``shards`` it was given."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        listener = threading.Thread(target=self._listen, args=(loop, self._stop),
                                    name="fencepost-shards-listen", daemon=True)
        listener.start()
        while not self._closed:
            pending = loop.run_in_executor(self._thread, self.tick)
            next_in = self.renew_ms / 1000
            try:
                done = await self._wait(pending, on_lost)
            except DRIVER_ERRORS as exc:
                log.warning("shard lease round failed: %s", first_line(exc))
                await loop.run_in_executor(self._thread, self._drop)
            else:
                if done.due_in_ms is not None:  # take it as soon as its row runs out
                    next_in = min(next_in, max(done.due_in_ms, 0) / 1000 + 0.005)
                if done.taken and on_taken is not None:
                    on_taken(done.taken)
                for shards, why in done.lost:
                    if on_lost is not None:
                        on_lost(shards, why)
                if on_round is not None:
                    on_round()
            try:
                async with asyncio.timeout(next_in):
                    await self._stop.wait()
            except TimeoutError:
                pass
            if not self._closed:
                self._stop.clear()  # (set by a notification: a round now)

    def _listen(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        """Wake the rounds when another coordinator joins, leaves or releases
        shards (NOTIFY), so a hand-over waits for no renewal interval. Its own
        thread and connection; reconnects until ``close``."""
        while not self._closed:
            try:
                conn = listener(self.url, CHANNEL, f"{self.ROLE}-listen {self.identity}")
                try:
                    while not self._closed:
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            loop.call_soon_threadsafe(wake.set)
                finally:
                    conn.close()
            except _LISTEN_ERRORS:
                if not self._closed:
                    time.sleep(0.5)

    async def _wait(self, pending: asyncio.Future[Round],
                    on_lost: Callable[[list[int], str], None] | None) -> Round:
        while True:
            left = self.valid_until - time.monotonic() if self.held else None
            done, _ = await asyncio.wait({pending}, timeout=None if left is None else max(0, left))
            if done:
                return pending.result()
            with self._lock:  # the round is stuck past the lease: what it holds is lost
                lapsed = sorted(self.held)
                self._dropped.update(lapsed)
                self.held, self.surplus = {}, []
            why = "the shard rows were not renewed within the shard lease"
            log.error("lost shards %s: %s", _ranges(lapsed), why)
            if on_lost is not None and lapsed:
                on_lost(lapsed, why)

    async def close(self) -> None:
        self._closed = True
        if self._stop is not None:
            self._stop.set()
        await super().close()


def _ranges(shards: Iterable[int]) -> str:
    """0-3,7,9-10: a set of shards, short enough for a log line."""
    out: list[str] = []
    run: list[int] = []
    for s in sorted(shards):
        if run and s == run[-1] + 1:
            run.append(s)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"
