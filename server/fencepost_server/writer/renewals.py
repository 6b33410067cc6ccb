"""Renewals answered from memory (DESIGN.md, "Renewals from memory"): a
renewal is checked and applied in the committed state with no commit; the
renewed expiries reach the runs table in flush cycles, and the lease floor
says which stored expiries a restart must treat as renewed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..clock import Clock
from ..core import ledger as L
from ..core.errors import LedgerError
from ..core.records import TERMINAL, Record
from ..storage.sql import LEASES_EXACT, SqlStorage
from .state import WriterStats

log = logging.getLogger("fencepost.writer")

# Expiries renewed from memory go into the runs table in cycles, at most this
# many runs a batch: 1024 held the GIL long enough to show in renewals' p99.
FLUSH_CHUNK = 256
FLUSH_TICK_S = 0.0125  # how often an idle writer commits the next flush chunk
ALL = "\x00all"  # what an ExtendLeases names: every run (run ids have no control characters)

# (renewal, current record, now, lease floor) -> the renewed record, None
# (write it instead), or raise the fence check's LedgerError
RenewRule = Callable[[L.Renew, Record | None, int, int], Record | None]


def names(cmd: Any) -> tuple[str, ...]:
    """The run ids a command names (commands of a transaction and fences too;
    an ExtendLeases names them all: ALL)."""
    kind = type(cmd)
    if kind is L.ExtendLeases:
        return (ALL,)
    run_id = getattr(cmd, "run_id", None)
    fence = getattr(cmd, "fence", None)
    if kind is not L.Transaction and fence is None:
        return (run_id,) if isinstance(run_id, str) else ()
    out = [run_id] if isinstance(run_id, str) else []
    for c in cmd.commands if kind is L.Transaction else ():
        out.extend(names(c))
    if fence is not None and fence.run_id:
        out.append(fence.run_id)
    return tuple(out)


class Renewals:
    """The renewals answered from memory and what they leave to write. Loop
    thread, but for ``restart`` (writer thread, at load) and ``in_batch``
    (writer thread, reading the floor the loop moves only between batches)."""

    def __init__(
        self,
        clock: Clock,
        stats: WriterStats,
        lease_flush_ms: int,
        *,
        memory_ok: Callable[[], bool] | None = None,
        rule: RenewRule = L.renewed_in_memory,
    ) -> None:
        self.clock = clock
        self.stats = stats
        self.lease_flush_ms = lease_flush_ms
        # False while renewals may not be answered from memory (a PostgreSQL
        # coordinator that cannot be sure it still leads)
        self.memory_ok = memory_ok
        self.rule = rule
        # the runs renewed (or extended at the start) and not copied since, each
        # with a lower bound of its stored expiry; those the current flush cycle
        # still has to copy, when it began, and the lease floor: a lease that
        # expired at or before it is written
        self.dirty: dict[str, int] = {}
        self.flushing: list[str] = []
        self.flush_at = 0
        self.floor = 0
        self.stored = 0  # the floor as last committed (``floor`` may be a cycle ahead)
        # How many queued or uncommitted commands name each run (ALL: an
        # ExtendLeases): a renewal of such a run is queued behind them, so
        # it never overtakes an earlier write, nor a decision its expiry.
        self.named: dict[str, int] = {}
        self._listeners: list[Callable[[str, Record], None]] = []

    def subscribe(self, listener: Callable[[str, Record], None]) -> Callable[[], None]:
        """Call ``listener(run id, record)`` on the loop after each renewal from
        memory, which makes no change event; returns an unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _notify(self, run_id: str, rec: Record) -> None:
        for listener in list(self._listeners):
            try:
                listener(run_id, rec)
            except Exception:  # a listener's bug must not keep a batch unanswered
                log.exception("renewal listener failed")

    def allowed(self) -> bool:
        return self.memory_ok is None or self.memory_ok()

    def restart(self, storage: SqlStorage, runs: dict[str, Record]) -> None:
        """docs/SPEC.md §4: after a crash or a takeover, every lease stored as
        live past the lease floor may have been renewed from memory until the
        previous process stopped; it is treated as renewed now. After a clean
        stop the stored expiries are exact; the floor becomes now, stored
        before anything is answered from memory. Writer thread, at load."""
        now = self.clock.now_ms()
        floor = storage.lease_floor()
        self.dirty.clear()
        self.flushing.clear()
        if floor == LEASES_EXACT:
            floor = now
            with storage.transaction():
                storage.set_lease_floor(floor)
        else:
            for run_id, rec in runs.items():
                renewed = L.renewed_at_start(rec, now, floor)
                if renewed is not None:
                    runs[run_id] = renewed
                    self.dirty[run_id] = rec.lease.expires_at  # type: ignore[union-attr]
            if self.dirty:
                log.info("%d leases treated as renewed at the start (stored as live past "
                         "the last flush of expiries)", len(self.dirty))
        self.floor = self.stored = floor
        self.flush_at = now

    def start_empty(self) -> None:
        """A writer that holds no run yet (leading shards apart: it takes them
        later): every lease it will hold is written or exact up to now."""
        self.dirty.clear()
        self.flushing.clear()
        self.floor = self.stored = self.flush_at = self.clock.now_ms()

    def from_memory(self, cmd: L.Renew, runs: dict[str, Record]) -> Any:
        """A renewal checked and applied in the committed ``runs``, on the
        loop, with no commit: the renewed record, or the fence check's
        LedgerError; None when it goes on the queue like any command: a queued
        or uncommitted command names the run (the batch decides it then, from
        memory too when it may), or it must be written (the rule says so)."""
        if not self.allowed():
            return None
        run_id = cmd.run_id
        named = self.named
        if named and (ALL in named or run_id in named):
            return None
        cur = runs.get(run_id)
        try:
            rec = self.rule(cmd, cur, self.clock.now_ms(), self.floor)
        except LedgerError as exc:
            return exc
        if rec is None:
            return None
        runs[run_id] = rec
        if run_id not in self.dirty:  # what the row holds is at most the expiry before
            self.dirty[run_id] = cur.lease.expires_at  # type: ignore[union-attr]
        self.stats.memory_renewals += 1
        self._notify(run_id, rec)
        return rec

    def in_batch(self, cmd: L.Renew, cur: Record | None, now: int) -> Any:
        """A renewal queued behind other commands on its run, decided in its
        place in the batch by the same rule: the renewed record, the fence
        check's LedgerError, or None: written instead. Writer thread."""
        if not self.allowed():
            return None
        try:
            return self.rule(cmd, cur, now, self.floor)
        except LedgerError as exc:
            return exc

    def committed(self, renewed: list[str], runs: dict[str, Record]) -> None:
        """A batch that renewed ``renewed`` in its place committed."""
        dirty = self.dirty
        for run_id in renewed:
            dirty.setdefault(run_id, 0)  # its stored expiry unknown here: copied next cycle
        self.stats.memory_renewals += len(renewed)
        for run_id in renewed:
            rec = runs.get(run_id)
            if rec is not None:
                self._notify(run_id, rec)

    def name(self, cmd: Any) -> None:
        """Count the runs a queued command names."""
        named = self.named
        for run_id in names(cmd):
            named[run_id] = named.get(run_id, 0) + 1

    def unname(self, cmd: Any) -> None:
        """The command is committed, failed or never queued: uncount it."""
        named = self.named
        for run_id in names(cmd):
            left = named[run_id] - 1
            if left:
                named[run_id] = left
            else:
                del named[run_id]

    def take_flush(self) -> tuple[list[str], int | None]:
        """The runs whose renewed expiries the next batch copies into the runs
        table, and the lease floor it stores once the cycle's last chunk
        commits. A cycle starts every lease_flush_ms, from the runs renewed
        since they were last copied; from then on the floor is its start (every
        expiry of that instant is copied by the time the floor is stored). A
        run whose stored expiry is past the new floor is left for a later
        cycle: the restart rule extends it as it is (SPEC §4)."""
        if not self.flushing:
            now = self.clock.now_ms()
            if not self.dirty or now - self.flush_at < self.lease_flush_ms:
                return [], None
            self.flush_at = now
            floor = self.floor = max(self.floor, now)
            later = {k: stored for k, stored in self.dirty.items() if stored > floor}
            self.flushing = [k for k in self.dirty if k not in later]
            self.dirty = later
            if not self.flushing:
                return [], self.flush_at  # nothing to copy: store the floor alone
        chunk = self.flushing[-FLUSH_CHUNK:]
        del self.flushing[-FLUSH_CHUNK:]
        return chunk, (None if self.flushing else self.flush_at)

    def flush_due(self) -> bool:
        """Whether a flush chunk waits to be committed."""
        return bool(self.flushing) or bool(
            self.dirty and self.clock.now_ms() - self.flush_at >= self.lease_flush_ms)

    def failed(self, flush: list[str]) -> None:
        """The batch carrying ``flush`` could not commit: copy them again."""
        self.flushing.extend(flush)

    def unwritten(self, runs: dict[str, Record], skip: dict[str, Any]) -> list[
            tuple[str, Record]]:
        """Every live lease renewed from memory and not yet in the runs table
        (those in ``skip``, whose rows lag other changes, aside), for a clean
        stop to write: their rows are current but for the expiry."""
        return [
            (k, rec) for k in {*self.flushing, *self.dirty}
            if k not in skip and (rec := runs.get(k)) is not None
            and rec.status not in TERMINAL
        ]

    def forget(self, run_ids: list[str]) -> None:
        """Runs no longer held here (their shard moved): nothing of theirs
        is written from here any more; their new owner extends their leases."""
        gone = set(run_ids)
        for run_id in gone:
            self.dirty.pop(run_id, None)
        if self.flushing and not gone.isdisjoint(self.flushing):
            self.flushing = [k for k in self.flushing if k not in gone]

    def clear(self) -> None:
        self.dirty.clear()
        self.flushing.clear()
