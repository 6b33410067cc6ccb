"""The batch on the writer thread: request-id dedupe, dispatch (ledger
decisions, registered executors, transactions in savepoints, lease
extension), then materialisation and pruning, written and committed once.
Reads the committed state, never moves it (the writer does, after the commit)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core import codec
from ..core import fence as F
from ..core import ledger as L
from ..core.errors import Code, LedgerError, in_transaction, validation
from ..core.placement import Ownership, shards_of
from ..core.records import TERMINAL, Record
from ..core.shards import shard_of
from ..storage.shared import exact
from ..storage.sql import KIND_DELETE, KIND_PUT, Batch, SqlStorage
from .state import ChangeEvent, LedgerState

log = logging.getLogger("fencepost.writer")

# Runs copied into the runs table per batch, at most: 4096 stalled a batch for
# ~50 ms, 512 takes ~5-10 ms (DESIGN.md, "Copying into runs").
MATERIALIZE_CHUNK = 512
MAX_PENDING = 65_536  # past this many unwritten runs, copy without waiting

Executor = Callable[[Any, Any, int], Any]  # (connection, command, now) -> result
Answer = Callable[[Any], None]  # called once with the result or the LedgerError
# (command, current record, tombstone, now, next revision) -> its decision
Decide = Callable[[Any, Record | None, int, int, int], L.Decision]
# (renewal, current record, now) -> renewed record, LedgerError, or None: decide it
RenewInBatch = Callable[[L.Renew, Record | None, int], Any]


class EngineHooks(Protocol):
    """What the writer needs of the engine store (storage/engine_sql.py
    provides it): its executors, its lock fence check, and its share of a
    takeover's lease extension. Called on the writer thread, in the batch's
    transaction, with the writer's connection."""

    @property
    def executors(self) -> Mapping[type, Executor]: ...

    def check_lock_fence(self, db: Any, fence: F.Fence) -> None: ...

    def extend_leases(self, db: Any, by_ms: int, alive_at: int,
                      shards: tuple[frozenset[int], int] | None = None) -> int: ...


def prune_step(history_revisions: int) -> int:
    """New revisions that bring the next prune forward, whatever its timer
    says: a quarter of the history limit, at least one (DESIGN.md)."""
    return max(1, history_revisions // 4)


@dataclass(slots=True)
class Item:
    """A queued command and whoever awaits its answer."""

    cmd: L.Command
    fut: asyncio.Future[Any] | None
    # Instead of a future: called on the loop, in the commit's own turn, with
    # the result or the exception (streams answering many commands use this:
    # no future and no scheduled callback per command).
    answer: Answer | None = None
    # the principal that sent it ("": no identities): its request id is its own
    scope: str = ""

    def deliver(self, answer: Any) -> None:
        cb = self.answer
        if cb is not None:
            self.answer = None
            try:
                cb(answer)
            except Exception:
                log.exception("answer callback failed")
            return
        fut = self.fut
        if fut is None or fut.done():
            return
        if isinstance(answer, BaseException):
            fut.set_exception(answer)
        else:
            fut.set_result(answer)


@dataclass(slots=True)
class Applied:
    """What a committed batch hands back to the loop."""

    answers: list[Any]  # one per command, in order: result or LedgerError
    overlay: dict[str, Record | None]  # the new records (None: deleted)
    tombs: dict[str, int]
    revision: int
    events: list[ChangeEvent]
    compacted: int | None  # the new watch floor, if the batch pruned
    evict: list[str]  # finished runs the runs table now reflects
    renewed: list[str]  # runs renewed as from memory (no change row)


@dataclass(slots=True)
class _Mark:
    """Where a batch stood, for ``_Step.undo``."""

    rev: int
    n_changes: int
    n_events: int
    overlay: dict[str, Record | None]
    tombs: dict[str, int]
    deletes: dict[str, Any]
    changed: dict[str, int]


@dataclass(slots=True)
class _Step:
    """The batch being decided: the committed state it starts from, the
    changes its commands made so far (overlay, tombstones, rows, events) and
    the last revision given out. Writer thread only."""

    committed: LedgerState
    out: Batch
    rev: int
    overlay: dict[str, Record | None] = field(default_factory=dict)
    tombs: dict[str, int] = field(default_factory=dict)
    events: list[ChangeEvent] = field(default_factory=list)
    changed: dict[str, int] = field(default_factory=dict)  # run_id -> its first change here
    # finished runs read from the runs table (committed state: never undone)
    cold: dict[str, Record | None] = field(default_factory=dict)
    renewed: list[str] = field(default_factory=list)  # renewed as from memory

    def mark(self) -> _Mark:
        """What ``undo`` needs to forget every change made after this call."""
        out = self.out
        return _Mark(self.rev, len(out.changes), len(self.events), dict(self.overlay),
                     dict(self.tombs), dict(out.deletes), dict(self.changed))

    def undo(self, mark: _Mark) -> None:
        self.rev = mark.rev
        del self.out.changes[mark.n_changes:]
        del self.events[mark.n_events:]
        for mine, saved in ((self.overlay, mark.overlay), (self.tombs, mark.tombs),
                            (self.out.deletes, mark.deletes), (self.changed, mark.changed)):
            mine.clear()
            mine.update(saved)  # type: ignore[arg-type]


@dataclass(slots=True)
class Prepared:
    """A batch decided and written, its transaction not yet committed."""

    st: _Step
    answers: list[Any]
    counted: list[int]
    taken: list[str]
    mark: int


# commands whose writes are not one row each: never decided on the loop
_HEAVY = frozenset({L.Transaction, L.ExtendLeases, L.TakeShards})


# Called inside the transaction, after the batch is written and before its
# COMMIT, with (batch, answers, overlay, tombstones, revision, events).
BeforeCommit = Callable[[list[Item], list[Any], dict[str, Record | None], dict[str, int], int,
                         list[ChangeEvent]], None]


class Apply:
    """Decides batches and commits them (writer thread), and keeps what the
    runs table still lacks (materialisation) and when to prune."""

    def __init__(
        self,
        storage: SqlStorage,
        *,
        renew: RenewInBatch,
        decide: Decide = L.decide,
        request_retention_ms: int,
        history_revisions: int,
        history_max_age_ms: int,
        prune_every_ms: int,
        materialize_after_ms: int,
        evict_finished: bool,
        before_commit: BeforeCommit | None = None,
    ) -> None:
        self.storage = storage
        self.renew = renew
        self.decide = decide
        self.request_retention_ms = request_retention_ms
        self.history_revisions = history_revisions
        self.history_max_age_ms = history_max_age_ms
        self.prune_every_ms = prune_every_ms
        # The runs table trails the change log (storage/sqlite.py): a changed
        # run is copied there about this long after its first unwritten change,
        # at most MATERIALIZE_CHUNK runs per batch (sooner past MAX_PENDING).
        self.materialize_after_ms = materialize_after_ms
        self.evict_finished = evict_finished
        self.before_commit = before_commit
        self.executors: dict[type, Executor] = {}
        self.engine: EngineHooks | None = None
        # run_id -> (its first change not yet in the runs table, when), oldest first
        self.pending: dict[str, tuple[int, int]] = {}
        self.materialized = 0
        # None: this coordinator leads every shard (Writer.ownership)
        self.ownership: Ownership | None = None
        # False: another coordinator prunes (leading shards apart, the owner
        # of shard 0 alone does: two pruning the same rows could deadlock)
        self.prunes = True
        # leading shards apart: commands committed per shard (their shards are
        # computed for the check anyway; one coordinator leading all pays nothing)
        self.shard_commands: list[int] = []
        self._last_prune = 0
        self._pruned_at = 0  # the revision the last prune was planned at
        self._prune_more = False

    def register(self, command_type: type, executor: Executor) -> None:
        self.executors[command_type] = executor

    def attach_engine(self, hooks: EngineHooks) -> None:
        self.engine = hooks
        for command_type, executor in hooks.executors.items():
            self.register(command_type, executor)

    def __call__(
        self,
        batch: list[Item],
        committed: LedgerState,
        now: int,
        flush: Any = (),
        floor: int | None = None,
    ) -> Applied:
        """Decide every command of the batch in order and commit once."""
        ready = self.storage.prepare(lambda: self.prepare(batch, committed, now, flush, floor))
        self.storage.commit_prepared()
        return self.settle(ready)

    def prepare(
        self,
        batch: list[Item],
        committed: LedgerState,
        now: int,
        flush: Any = (),
        floor: int | None = None,
    ) -> Prepared:
        """Decide every command of the batch in order and write it, inside the
        transaction ``storage.prepare`` opened; ``settle`` once it commits."""
        answered: dict[str, tuple[str, Any]] = {}
        out = Batch(now=now)
        st = _Step(committed, out, committed.revision)
        answers: list[Any] = []
        storage = self.storage
        sharing = storage.sharing
        counted: list[int] = []  # each command's shards (leading shards apart)
        st.rev = storage.first_revision(st.rev)
        rids = [item.cmd.request_id for item in batch if item.cmd.request_id]
        stored_answers = storage.lookup_requests(rids) if rids else {}
        owned = self.ownership
        for item in batch:
            cmd = item.cmd
            if owned is not None and (refused := owned.refusal(cmd)) is not None:
                answers.append(refused)  # not remembered: the owner answers the retry
                continue
            if sharing:  # checked before COMMIT (storage/shared.py), and counted
                if type(cmd) is L.TakeShards:
                    storage.touch_shards(cmd.shards)
                else:
                    keyed = shards_of(cmd, storage.shards) or ()
                    storage.touch_shards(keyed)
                    counted.extend(keyed)
            rid = cmd.request_id
            fp = ""
            if rid:
                fp = codec.fingerprint(cmd, item.scope)
                hit = answered.get(rid)
                if hit is None and rid in stored_answers:
                    stored_fp, stored_answer = stored_answers[rid]
                    hit = (stored_fp, codec.decode(stored_answer))
                if hit is not None:
                    answers.append(
                        hit[1]
                        if hit[0] == fp
                        else LedgerError(
                            Code.RUN_VALIDATION_ERROR,
                            "request_id: already used for a different request",
                            field="request_id",
                        )
                    )
                    continue
            answer = self._dispatch(cmd, st, now)
            if rid:
                answered[rid] = (fp, answer)
                out.requests.append((rid, fp, answer, now))
            answers.append(answer)
        overlay, tombs, events, changed = st.overlay, st.tombs, st.events, st.changed
        rev = st.rev
        out.revision = rev
        taken, mark = ([], rev) if sharing else self._plan_materialization(now, rev, changed)
        leases: list[tuple[str, Record | None]] = []
        expiries: list[tuple[str, Record]] = []
        if flush:  # expiries renewed from memory, into their runs rows
            skip = set(taken)
            pending = self.pending
            for k in flush:
                rec = overlay[k] if k in overlay else committed.runs.get(k)
                if rec is None or rec.status in TERMINAL or k in skip:
                    continue
                if owned is not None and owned.refusal_for_key(k) is not None:
                    continue  # a shard given up: its taker extends the lease instead
                if sharing:
                    storage.touch_shards((shard_of(k, storage.shards),))
                if k in changed or k in pending:
                    leases.append((k, rec))  # the row lags other changes: all of it
                else:
                    expiries.append((k, rec))  # the row is current but for the expiry
        out.expiries = expiries
        if sharing:  # every changed run's row in this batch: nothing lags
            out.materialize = [(k, overlay[k]) for k in changed] + [
                lease for lease in leases if lease[0] not in changed]
        elif taken or mark != self.materialized or leases:
            out.materialize = [
                (k, overlay[k] if k in overlay else committed.runs.get(k)) for k in taken
            ] + leases
            out.materialized = mark
        out.lease_floor = floor
        if self._prune_due(now, rev):
            age_cutoff = now - self.history_max_age_ms if self.history_max_age_ms else None
            out.prune = (
                now - self.request_retention_ms,
                rev - self.history_revisions + 1,
                age_cutoff,
                mark,
            )
        self.storage.write(out)
        if self.before_commit is not None:  # TEST-ONLY broken build
            self.before_commit(batch, answers, overlay, tombs, rev, events)
        return Prepared(st, answers, counted, taken, mark)

    def settle(self, ready: Prepared) -> Applied:
        """After the prepared batch's COMMIT: move the bookkeeping, hand back
        what the loop publishes."""
        st, out, answers, counted, taken, mark = (
            ready.st, ready.st.out, ready.answers, ready.counted, ready.taken, ready.mark)
        storage = self.storage
        sharing = storage.sharing
        now = out.now
        overlay, tombs, events, changed, rev = st.overlay, st.tombs, st.events, st.changed, st.rev
        if counted:
            tally = self.shard_commands or [0] * storage.shards
            for shard in counted:
                tally[shard] += 1
            self.shard_commands = tally
        # committed: move the materialization bookkeeping (a failed commit
        # raised above and moved nothing)
        pending = self.pending
        for k in taken:
            del pending[k]
        for k, first in () if sharing else changed.items():
            if k not in pending:
                pending[k] = (first, now)
        self.materialized = mark
        compacted = None
        if out.prune is not None:
            self._last_prune = now
            self._pruned_at = out.revision
            self._prune_more = out.prune_more  # a backlog: again in the next batch
            compacted = out.compacted
        # finished runs that the runs table now reflects leave memory
        evict = [
            k for k, rec in out.materialize
            if rec is not None and rec.status in TERMINAL and k not in pending
        ] if self.evict_finished else []
        return Applied(answers, overlay, tombs, rev, events, compacted, evict, st.renewed)

    def _dispatch(self, cmd: Any, st: _Step, now: int) -> Any:
        """One command's answer (result or LedgerError), its changes added to
        the batch."""
        executor = self.executors.get(type(cmd))
        if executor is not None:
            fence = getattr(cmd, "fence", None)
            try:
                if fence is not None:
                    self._check_fence(fence, st)
            except LedgerError as exc:
                return exc
            return self.storage.run_isolated(executor, cmd, now)
        if type(cmd) is L.Transaction:
            return self._transaction(cmd, st, now)
        if type(cmd) is L.ExtendLeases:
            return self._extend_leases(cmd, st, now)
        if type(cmd) is L.TakeShards:
            return self._take_shards(cmd, st, now)
        if type(cmd) is L.Renew:
            cur = self._current(cmd.run_id, st)
            renewed = self.renew(cmd, cur, now)
            if isinstance(renewed, Record):
                st.overlay[cmd.run_id] = renewed
                st.renewed.append(cmd.run_id)
            if renewed is not None:
                return renewed
        try:
            return self._decide(cmd, st, now)
        except LedgerError as exc:
            return exc

    def _current(self, run_id: str, st: _Step) -> Record | None:
        """A run's record as this batch sees it: its earlier changes, else the
        committed record (``_committed``)."""
        return st.overlay[run_id] if run_id in st.overlay else self._committed(run_id, st)

    def _committed(self, run_id: str, st: _Step) -> Record | None:
        """A run's committed record: held in memory, or — a finished run the
        index knows but memory no longer holds — read from the runs table,
        once per batch."""
        committed = st.committed
        rec = committed.runs.get(run_id)
        if rec is not None:
            return rec
        cold = st.cold
        if run_id in cold:
            return cold[run_id]
        if run_id not in committed.index:
            return None
        got = self.storage.read_runs([run_id]).get(run_id)
        cold[run_id] = got
        return got

    def _decide(self, cmd: Any, st: _Step, now: int) -> Any:
        """Decide one ledger command against the committed state plus the
        batch's earlier changes and add its change to the batch; returns its
        result or raises its LedgerError (nothing added then)."""
        run_id = cmd.run_id
        overlay = st.overlay
        cur = self._current(run_id, st)
        tomb = st.tombs.get(run_id, st.committed.tombstones.get(run_id, 0))
        if type(cmd) is L.RecordCheckpoint and cmd.fence is not None:
            self._check_fence(cmd.fence, st)
        decision = self.decide(cmd, cur, tomb, now, st.rev + 1)
        change = decision.change
        if change is not None:
            rev = st.rev = st.rev + 1
            if run_id not in st.changed:
                st.changed[run_id] = rev
            out = st.out
            if isinstance(change, L.Put):
                _put(st, rev, change.record, cur, type(cmd))
            else:
                overlay[run_id] = None
                st.tombs[run_id] = max(tomb, change.fencing_token)
                out.deletes[run_id] = (st.tombs[run_id], now)
                out.changes.append((rev, run_id, KIND_DELETE, None))
                st.events.append(ChangeEvent(rev, KIND_DELETE, run_id, None, cur, type(cmd)))
        return decision.result

    def _extend_leases(self, cmd: L.ExtendLeases, st: _Step, now: int) -> L.LeasesExtended:
        """A new leader's extension of every live lease (ha/leadership.py): the
        ledger's leases in memory (every leased run is held there), then the
        engine store's claims and locks in their tables."""
        runs = 0
        for run_id, committed in list(st.committed.runs.items()):
            cur = st.overlay[run_id] if run_id in st.overlay else committed
            if cur is None:
                continue
            rec = L.extend_lease(cur, cmd, now, st.rev + 1)
            if rec is not None:
                _put_next(st, rec, cur, L.ExtendLeases)
                runs += 1
        others = 0
        if self.engine is not None:
            others = self.engine.extend_leases(self.storage.db, cmd.by_ms, cmd.alive_at)
        return L.LeasesExtended(runs, others)

    def _take_shards(self, cmd: L.TakeShards, st: _Step, now: int) -> L.LeasesExtended:
        """Shards just taken from another coordinator: their leases extended
        (``L.take_lease``), their claims and locks by their gaps, their lease
        floors made this writer's (storage/shared.py)."""
        n = self.storage.shards
        runs = 0
        first = st.rev + 1
        for run_id in cmd.run_ids:
            cur = self._current(run_id, st)
            if cur is None:
                continue
            shard = shard_of(run_id, n)
            floor = cmd.floors.get(shard, 0)
            rec = L.take_lease(cur, now, st.rev + 1, None if exact(floor) else floor,
                               cmd.gaps.get(shard, 0))
            if rec is not None:
                _put_next(st, rec, cur, L.TakeShards)
                runs += 1
        others = 0
        if self.engine is not None:
            for shard in sorted(cmd.shards):
                gap = cmd.gaps.get(shard, 0)
                if gap > 0:
                    others += self.engine.extend_leases(
                        self.storage.db, gap, now - gap, shards=(frozenset([shard]), n))
        self.storage.set_lease_floor(cmd.floor, cmd.shards)
        return L.LeasesExtended(runs, others, first if runs else 0)

    def _check_fence(self, fence: F.Fence, st: _Step) -> None:
        """Raise unless ``fence`` holds right now: a run fence against the
        writer's authoritative records (committed plus this batch's earlier
        changes), a lock fence against the lock's row as this transaction
        sees it."""
        if fence.run_id:
            run_id = fence.run_id
            tomb = st.tombs.get(run_id, st.committed.tombstones.get(run_id, 0))
            F.check_run_fence(fence, self._current(run_id, st), tomb)
            return
        if self.engine is None:
            raise LedgerError(
                Code.RUN_VALIDATION_ERROR,
                "fence.lock_key: this server has no engine store (no keyed locks)",
                field="fence.lock_key",
            )
        self.engine.check_lock_fence(self.storage.db, fence)

    def _transaction(self, tx: L.Transaction, st: _Step, now: int) -> Any:
        """Apply every command of ``tx`` in order, the shared fence checked
        before each, in one savepoint: all of them, or (the first refusal,
        naming its command) none."""
        mark = st.mark()
        db = self.storage.db
        db.execute("SAVEPOINT tx")
        results: list[Any] = []
        try:
            for i, cmd in enumerate(tx.commands):
                try:
                    if tx.fence is not None:
                        self._check_fence(tx.fence, st)
                    executor = self.executors.get(type(cmd))
                    if type(cmd) is L.Transaction:
                        raise validation("commands", "a transaction cannot contain a transaction")
                    if executor is None:
                        results.append(self._decide(cmd, st, now))
                        continue
                    fence = getattr(cmd, "fence", None)
                    if fence is not None:
                        self._check_fence(fence, st)
                    results.append(executor(db, cmd, now))
                except LedgerError as exc:
                    raise in_transaction(exc, i) from None
        except LedgerError as exc:
            db.execute("ROLLBACK TO tx")
            db.execute("RELEASE tx")
            st.undo(mark)
            return exc
        except BaseException:
            db.execute("ROLLBACK TO tx")
            db.execute("RELEASE tx")
            st.undo(mark)
            raise
        db.execute("RELEASE tx")
        return L.TransactionDone(tuple(results))

    def _prune_due(self, now: int, rev: int) -> bool:
        return self.prunes and (
            self._prune_more
            or now - self._last_prune >= self.prune_every_ms
            or rev - self._pruned_at >= prune_step(self.history_revisions))

    def _copy_due(self, now: int, rev: int) -> bool:
        """Whether the pending runs' copying into the runs table is due."""
        pending = self.pending
        if not pending:
            return False
        first, since = next(iter(pending.values()))
        return (len(pending) > MAX_PENDING or first < rev - self.history_revisions + 1
                or since <= now - self.materialize_after_ms)

    def light(self, batch: list[Item], now: int, rev: int) -> bool:
        """Whether the batch, decided now (the committed revision ``rev``), only
        decides ledger commands in memory and writes their rows: no executor
        (an artifact's chunks, say), transaction or takeover's extension, and
        no pruning or copying due."""
        executors, heavy = self.executors, _HEAVY
        for item in batch:
            kind = type(item.cmd)
            if kind in executors or kind in heavy:
                return False
        return not self._prune_due(now, rev) and not self._copy_due(now, rev)

    def _plan_materialization(
        self, now: int, rev: int, changed: dict[str, int]
    ) -> tuple[list[str], int]:
        """Which pending runs this batch copies into the runs table (oldest
        first: those pending for materialize_after_ms, those whose change the
        history limit wants to prune, or any past MAX_PENDING), and the mark
        once it commits: just below the oldest change still not in runs,
        counting this batch's own changes as pending."""
        pending = self.pending
        taken: list[str] = []
        if self._copy_due(now, rev):
            prunable = rev - self.history_revisions + 1
            force = len(pending) > MAX_PENDING
            # due: take everything pending for half the delay too, so this
            # happens in a few batches a second, not in every batch
            cutoff = now - self.materialize_after_ms // 2
            for run_id, (first, since) in pending.items():
                if len(taken) >= MATERIALIZE_CHUNK or (
                    since > cutoff and first >= prunable and not force
                ):
                    break
                taken.append(run_id)
        if len(taken) < len(pending):
            oldest_left = next(itertools.islice(pending.values(), len(taken), None))[0]
            return taken, oldest_left - 1
        if changed:
            return taken, next(iter(changed.values())) - 1  # in revision order
        return taken, rev


def _put_next(st: _Step, rec: Record, cur: Record | None, cause: type) -> None:
    """``_put`` at the batch's next revision (a lease a new owner extends)."""
    rev = st.rev = st.rev + 1
    if rec.run_id not in st.changed:
        st.changed[rec.run_id] = rev
    _put(st, rev, rec, cur, cause)


def _put(st: _Step, rev: int, rec: Record, cur: Record | None, cause: type) -> None:
    """Add a PUT of ``rec`` (revision ``rev``, already taken) to the batch."""
    run_id = rec.run_id
    st.overlay[run_id] = rec
    st.out.deletes.pop(run_id, None)
    st.out.changes.append((rev, run_id, KIND_PUT, rec))
    st.events.append(ChangeEvent(rev, KIND_PUT, run_id, rec, cur, cause))
