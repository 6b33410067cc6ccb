"""The single writer: queue, group commit, revision, change feed.

Every write — ledger, raw seam, later the engine store — is a command put on
one bounded queue. One task takes whatever is queued (up to ``max_batch``;
when the server is short of CPU it first waits up to ``commit_delay_ms`` for
more),
hands the whole batch to one dedicated thread that decides each command in
order against the committed state plus the batch's own earlier changes,
writes the rows and commits once; only after that commit is durable are the
callers answered, the in-memory committed state moved and the change feed
published. A refused command does not disturb its neighbours; a failed commit
fails every command of the batch and moves nothing.

Only this module (through the storage's ``open``) opens a write connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..clock import Clock
from ..core import codec
from ..core import fence as F
from ..core import ledger as L
from ..core.errors import Code, LedgerError, in_transaction, validation
from ..core.records import TERMINAL, Record, Status
from ..scope import REQUEST_SCOPE
from ..storage.sql import (
    COLD_STATUSES,
    KIND_DELETE,
    KIND_PUT,
    LEASES_EXACT,
    SAVED_INDEX_WRITTEN,
    Batch,
    LoadedState,
    SqlStorage,
    broken,
)
from .index import RunIndex

log = logging.getLogger("fencepost.writer")


@dataclass(slots=True)
class ChangeEvent:
    """One committed change to one record, in revision order."""

    revision: int
    kind: int  # KIND_PUT or KIND_DELETE
    run_id: str
    record: Record | None  # the new record (PUT) or None (DELETE)
    previous: Record | None  # the record before this change
    cause: type  # the command class that made the change (L.Acquire, L.Cancel...)


class WriterClosed(LedgerError):
    def __init__(self) -> None:
        super().__init__(Code.SHUTTING_DOWN, "the server is shutting down; nothing was done")


@dataclass
class WriterStats:
    batches: int = 0
    commands: int = 0
    failed_commits: int = 0
    max_batch: int = 0
    commit_seconds: float = 0.0
    held: int = 0  # batches held open by the commit delay
    held_in_vain: int = 0  # of those, the ones that gathered nothing
    memory_renewals: int = 0  # renewals answered from memory, no commit
    leases_flushed: int = 0  # lease expiries copied into the runs table

    @property
    def mean_batch(self) -> float:
        return self.commands / self.batches if self.batches else 0.0


@dataclass
class LedgerState:
    """The committed state, read by handlers on the event loop. Only the writer
    task moves it, and only after a commit."""

    # The runs held in memory ("hot"): every unfinished run, and finished ones
    # until the runs table reflects them; then they are read from there on
    # demand (``Writer.read_runs``). ``index`` knows every run, hot or not.
    runs: dict[str, Record] = field(default_factory=dict)
    tombstones: dict[str, int] = field(default_factory=dict)
    revision: int = 0
    index: RunIndex = field(default_factory=RunIndex)  # ListRuns: by id, status, owner
    # Changes at or below this revision are no longer retained (watch floor).
    compacted: int = 0


Answer = Callable[[Any], None]  # called once with the result or the LedgerError


def _wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


@dataclass(slots=True)
class _Item:
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


_STOP = object()
ALL = "\x00all"  # what an ExtendLeases names: every run (run ids have no control characters)


def _names(cmd: Any) -> tuple[str, ...]:
    """The run ids a command names, for ``Writer._named``."""
    kind = type(cmd)
    if kind is L.ExtendLeases:
        return (ALL,)
    run_id = getattr(cmd, "run_id", None)
    fence = getattr(cmd, "fence", None)
    if kind is not L.Transaction and fence is None:
        return (run_id,) if isinstance(run_id, str) else ()
    out = [run_id] if isinstance(run_id, str) else []
    for c in cmd.commands if kind is L.Transaction else ():
        out.extend(_names(c))
    if fence is not None and fence.run_id:
        out.append(fence.run_id)
    return tuple(out)
_FLUSH = object()  # queued by the flush timer: commit a flush chunk even when idle


def prune_step(history_revisions: int) -> int:
    """New revisions that bring the next prune forward, whatever its timer
    says: a quarter of the history limit, at least one (DESIGN.md)."""
    return max(1, history_revisions // 4)

# When a batch is held open for more commands, and why (DESIGN.md, "The commit
# delay"): only while the loop's thread is busy, and only for recent callers.
COMMIT_SIBLINGS = 4
COMMIT_GATHER = 32
COMMIT_GATHER_DECAY = 63 / 64
COMMIT_HOLD_BUSY = 0.5
COMMIT_BUSY_SAMPLE_S = 0.25
# The CPU seconds of the calling thread (the writer task runs on the loop's).
loop_cpu_time = time.thread_time

# Runs copied into the runs table per batch, at most: 4096 stalled a batch for
# ~50 ms, 512 takes ~5-10 ms (DESIGN.md, "Copying into runs").
MATERIALIZE_CHUNK = 512
MAX_PENDING = 65_536  # past this many unwritten runs, copy without waiting

# Renewals answered from memory (DESIGN.md, "Renewals from memory"): their
# expiries go into the runs table in cycles, at most this many runs a batch.
FLUSH_CHUNK = 1024
FLUSH_TICK_S = 0.05  # how often an idle writer commits the next flush chunk

Executor = Callable[[Any, Any, int], Any]  # (connection, command, now) -> result


class _Step:
    """The batch being decided: the committed state it starts from, the
    changes its commands made so far (overlay, tombstones, rows, events) and
    the last revision given out. Writer thread only."""

    __slots__ = ("changed", "cold", "committed", "events", "out", "overlay", "renewed", "rev",
                 "tombs")

    def __init__(self, committed: LedgerState, out: Batch, rev: int) -> None:
        self.committed = committed
        self.out = out
        self.rev = rev
        self.overlay: dict[str, Record | None] = {}
        self.tombs: dict[str, int] = {}
        self.events: list[ChangeEvent] = []
        self.changed: dict[str, int] = {}  # run_id -> its first change in this batch
        # finished runs read from the runs table (committed state: never undone)
        self.cold: dict[str, Record | None] = {}
        self.renewed: list[str] = []  # runs renewed as from memory (no change row)

    def mark(self) -> tuple[Any, ...]:
        """What ``undo`` needs to forget every change made after this call."""
        out = self.out
        return (
            self.rev,
            len(out.changes),
            len(self.events),
            dict(self.overlay),
            dict(self.tombs),
            dict(out.deletes),
            dict(self.changed),
        )

    def undo(self, mark: tuple[Any, ...]) -> None:
        rev, n_changes, n_events, overlay, tombs, deletes, changed = mark
        self.rev = rev
        del self.out.changes[n_changes:]
        del self.events[n_events:]
        self.overlay.clear()
        self.overlay.update(overlay)
        self.tombs.clear()
        self.tombs.update(tombs)
        self.out.deletes.clear()
        self.out.deletes.update(deletes)
        self.changed.clear()
        self.changed.update(changed)


class Writer:
    def __init__(
        self,
        storage: SqlStorage,
        clock: Clock,
        *,
        max_batch: int = 1024,
        queue_size: int = 16_384,
        request_retention_ms: int = 15 * 60_000,
        history_revisions: int = 100_000,
        history_max_age_ms: int = 0,
        prune_every_ms: int = 30_000,
        materialize_after_ms: int = 1_000,
        commit_delay_ms: float = 0.0,
        lease_flush_ms: int = 30_000,
    ) -> None:
        if request_retention_ms < 10 * 60_000:
            raise ValueError("request ids must be remembered for at least 10 minutes")
        self.storage = storage
        self.clock = clock
        self.max_batch = max_batch
        self.request_retention_ms = request_retention_ms
        self.history_revisions = history_revisions
        self.history_max_age_ms = history_max_age_ms
        self.prune_every_ms = prune_every_ms
        # The runs table trails the change log (storage/sqlite.py): a changed
        # run is copied there about this long after its first unwritten change,
        # at most MATERIALIZE_CHUNK runs per batch (sooner past MAX_PENDING).
        self.materialize_after_ms = materialize_after_ms
        # Group-commit window (PostgreSQL's commit_delay, MySQL's
        # binlog_group_commit_sync_delay): under concurrent load, hold a batch
        # open up to this long so more commands share its transaction, its
        # fsync and its thread hop. Never while idle or lightly loaded: only
        # after a batch of COMMIT_SIBLINGS or more, only while the event loop
        # is busy, and only until as many commands are queued as the largest
        # recent batch had.
        if not 0 <= commit_delay_ms <= 100:
            raise ValueError("commit_delay_ms must be between 0 and 100")
        self.commit_delay_s = commit_delay_ms / 1000
        self._last_batch = 0
        self._gather = 0.0  # the largest recent batch, decaying
        self._loop_busy = 0.0  # the loop thread's CPU share, last measured
        self._busy_since = 0.0  # loop.time() and thread CPU time of that measure
        self._busy_cpu = 0.0
        self._hold_wake: asyncio.Future[None] | None = None  # while a batch is held
        self._hold_target = 0  # commands queued (with the held one) that end the hold
        # run_id -> (its first change not yet in the runs table, when), oldest
        # first. Writer thread only.
        self._pending: dict[str, tuple[int, int]] = {}
        # Renewals from memory (DESIGN.md). Loop thread only: the runs renewed
        # (or extended at the start) since the current flush cycle began, those
        # the cycle still has to copy, when it began, and the lease floor: a
        # lease that expired at or before it is renewed by a write instead.
        self.lease_flush_ms = lease_flush_ms
        self._dirty: set[str] = set()
        self._flushing: list[str] = []
        self._flush_at = 0
        self._lease_floor = 0
        # How many queued or uncommitted commands name each run (ALL: an
        # ExtendLeases): a renewal of such a run is queued behind them, so
        # it never overtakes an earlier write, nor a decision its expiry.
        self._named: dict[str, int] = {}
        # False while renewals may not be answered from memory (app.py: a
        # PostgreSQL coordinator that cannot be sure it still leads)
        self.memory_ok: Callable[[], bool] | None = None
        # Called on the loop with (run id, record) after each renewal from
        # memory, which makes no change event (streams.py: re-arms expiries)
        self.on_renewed: Callable[[str, Record], None] | None = None
        self._flush_timer: asyncio.Task[None] | None = None
        self._materialized = 0
        self._saved_at = -1  # the revision of the saved index entries load() used
        self.state = LedgerState()
        self.stats = WriterStats()
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencepost-writer")
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_prune = 0
        self._pruned_at = 0  # the revision the last prune was planned at
        self._prune_more = False  # writer thread only
        self._listeners: list[Callable[[list[ChangeEvent]], None]] = []
        # Called on the loop after each committed batch with (commands, seconds)
        # (metrics.py: the commit latency and batch size histograms).
        self.on_batch: Callable[[int, float], None] | None = None
        self._executors: dict[type, Executor] = {}
        # Finished runs leave memory once the runs table reflects them (not
        # for an in-memory database, which has no second connection to read).
        self.evict_finished = str(storage.path) != ":memory:"
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencepost-reader")
        self._reader_db: Any = None
        # Checks a lock fence against its row (registered with the engine
        # store's executors): (sqlite3.Connection, Fence) -> None or raise.
        self.lock_fence: Callable[[Any, F.Fence], None] | None = None
        # Extends the engine store's live claims and locks at a takeover
        # (registered with its executors): (connection, by_ms, alive_at) -> count.
        self.extend_other_leases: Callable[[Any, int, int], int] | None = None
        # Called on the loop with the error of a batch that could not commit
        # (app.py: a NOT_LEADER there means this coordinator was deposed).
        self.on_failed_commit: Callable[[LedgerError], None] | None = None
        # TEST-ONLY broken build (``--test-hooks --fault ack-before-commit``, set by
        # app.py): seconds between answering a batch and committing it. 0: never.
        self.unsafe_ack_before_commit_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.state = await loop.run_in_executor(self._executor, self._open_and_load)
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="fencepost-writer")
        self._flush_timer = asyncio.create_task(self._flush_ticks(), name="fencepost-flush")

    def _open_and_load(self) -> LedgerState:
        """The committed state, index included, built in the writer thread: with
        a million runs the index takes seconds, which on the event loop would
        stall every call, and a new leader's renewals (leadership.py) for long
        enough to lose the leadership it has just won."""
        self.storage.open()
        built: list[RunIndex] = []

        def index(state: LoadedState) -> None:
            # inside load(): on SQLite the index is built while the integrity
            # check still reads the file (SQLite's work leaves the GIL free)
            built.append(RunIndex(state.runs.values(), cold=state.cold))
            state.cold = []  # no longer needed: the index holds the ids

        loaded = self.storage.load(index)
        self._materialized = loaded.revision  # load() wrote every replayed change
        # the saved index entries still match as long as nothing is written
        self._saved_at = loaded.revision if loaded.saved else -1
        self._pending.clear()
        self._restart_rule(loaded.runs)
        return LedgerState(
            runs=loaded.runs,
            tombstones=loaded.tombstones,
            revision=loaded.revision,
            index=built[0],
            compacted=loaded.compacted,
        )

    def _restart_rule(self, runs: dict[str, Record]) -> None:
        """docs/SPEC.md §4: after a crash or a takeover, every lease stored as
        live past the lease floor may have been renewed from memory until the
        previous process stopped; it is treated as renewed now. After a clean
        stop the stored expiries are exact; the floor becomes now, stored
        before anything is answered from memory. Writer thread, at load."""
        now = self.clock.now_ms()
        floor = self.storage.lease_floor()
        self._dirty.clear()
        self._flushing.clear()
        if floor == LEASES_EXACT:
            floor = now
            with self.storage.transaction():
                self.storage.set_lease_floor(floor)
        else:
            for run_id, rec in runs.items():
                renewed = L.renewed_at_start(rec, now, floor)
                if renewed is not None:
                    runs[run_id] = renewed
                    self._dirty.add(run_id)
            if self._dirty:
                log.info("%d leases treated as renewed at the start (stored as live past "
                         "the last flush of expiries)", len(self._dirty))
        self._lease_floor = floor
        self._flush_at = now

    async def close(self) -> None:
        """Stop accepting, finish everything queued, close the database."""
        if self._closing:
            return
        self._closing = True
        _wake(self._hold_wake)
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush_timer
        if self._task is not None:
            await self._queue.put(_STOP)
            await self._task
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._close_storage)
        self._executor.shutdown(wait=True)
        await loop.run_in_executor(self._reader, self._close_reader)
        self._reader.shutdown(wait=True)

    def _close_reader(self) -> None:
        if self._reader_db is not None:
            self._reader_db.close()
            self._reader_db = None

    def _close_storage(self) -> None:
        """Copy every pending run into the runs table (a clean shutdown leaves
        it current), save the finished runs' index entries for the next start,
        then close. Writer thread."""
        try:
            if not self.storage.is_open or self._task is None:  # never loaded: wrote nothing
                return
            revision = self.state.revision
            runs = self.state.runs
            # every expiry renewed from memory goes to the runs table, and the
            # next start finds them exact
            leases: list[tuple[str, Record | None]] = [
                (k, rec) for k in {*self._flushing, *self._dirty}
                if k not in self._pending and (rec := runs.get(k)) is not None
                and rec.status not in TERMINAL
            ]
            with self.storage.transaction():
                out = Batch(revision=revision)
                out.materialize = [(k, runs.get(k)) for k in self._pending] + leases
                out.materialized = revision if self._pending else self._materialized
                out.lease_floor = LEASES_EXACT
                self.storage.write(out)
            if self._pending:
                self._pending.clear()
                self._materialized = revision
            self._dirty.clear()
            self._flushing.clear()
            # (an in-memory database has no next start; entries read at the
            # start and still matching need no rewrite)
            if self.evict_finished and self._materialized == revision != self._saved_at:
                groups = self.state.index.groups(COLD_STATUSES)
                with self.storage.transaction():
                    saved = self.storage.save_index(groups, revision)
                log.info("%d finished runs' ids %s", saved, SAVED_INDEX_WRITTEN)
        except LedgerError as exc:  # the change log still has it all: load() replays
            log.warning("could not bring the runs table up to date and save the index at "
                        "shutdown (the next start reads them from the change log and the "
                        "table): %s", exc.message)
        finally:
            self.storage.close()

    # -- the API -----------------------------------------------------------------

    def is_cold(self, run_id: str) -> bool:
        """A finished run that memory no longer holds (``read_runs`` reads it)."""
        return run_id not in self.state.runs and run_id in self.state.index

    async def read_run(self, run_id: str) -> Record | None:
        """The run's committed record (None: no such run), as ``read_runs``."""
        rec = self.state.runs.get(run_id)
        if rec is not None or run_id not in self.state.index:
            return rec
        return (await self.read_runs([run_id])).get(run_id)

    async def read_runs(self, run_ids: list[str]) -> dict[str, Record]:
        """Committed records by id: from memory, and for finished runs memory
        no longer holds, from the runs table on a read-only connection in a
        thread of its own (the event loop never waits on SQLite). A run
        leaves memory only once the table reflects its last change, and any
        later change brings it back before it is published, so a record read
        there is never older than the state when this call began."""
        st = self.state
        out: dict[str, Record] = {}
        missing: list[str] = []
        for run_id in run_ids:
            rec = st.runs.get(run_id)
            if rec is not None:
                out[run_id] = rec
            elif run_id in st.index:
                missing.append(run_id)
        if missing:
            loop = asyncio.get_running_loop()
            got = await loop.run_in_executor(self._reader, self._read_cold, missing)
            for run_id in missing:
                # the writer may have changed it meanwhile: memory is newer
                rec = st.runs.get(run_id) or got.get(run_id)
                if rec is not None:
                    out[run_id] = rec
        return out

    async def page_runs(
        self,
        statuses: frozenset[Status],
        owner: str,
        limit: int,
        *,
        prefix: str = "",
        after: str | None = None,
        before: str | None = None,
    ) -> tuple[list[Record], bool]:
        """Up to ``limit`` committed records with one of ``statuses`` (any:
        empty) and lease ``owner`` (any: ""), in run-id order past ``after``
        (or, backwards, below ``before``) among the ids starting with
        ``prefix``; and whether another match lies beyond them. Walks the
        narrowest index the filters allow (index.py), a chunk at a time,
        reading finished runs memory no longer holds in bulk, so a page costs
        its matches plus what that index holds that the other filter refuses,
        not the size of the table. Each chunk walks afresh from the last id
        seen: the index may move while a read is awaited."""
        page: list[Record] = []
        while True:
            walk = self.state.index.walk(statuses, owner, prefix=prefix, after=after,
                                         before=before, reverse=before is not None)
            chunk = list(itertools.islice(walk, limit + 1 - len(page)))
            if not chunk:
                return page, False
            if before is not None:
                before = chunk[-1]
            else:
                after = chunk[-1]
            records = await self.read_runs(chunk)
            for k in chunk:
                rec = records.get(k)  # None: deleted meanwhile
                if rec is None or (statuses and rec.status not in statuses):
                    continue
                if owner and (rec.lease is None or rec.lease.owner != owner):
                    continue
                if len(page) == limit:
                    return page, True
                page.append(rec)

    def _read_cold(self, run_ids: list[str]) -> dict[str, Record]:
        return self.storage.read_runs(run_ids, self._read_only())

    def _read_only(self) -> Any:
        if self._reader_db is not None and broken(self._reader_db):
            with contextlib.suppress(Exception):
                self._reader_db.close()
            self._reader_db = None
        if self._reader_db is None:
            self._reader_db = self.storage.reader()
        return self._reader_db

    async def finished_before(
        self, cutoff_ms: int, limit: int, after: tuple[int, str] | None = None
    ) -> list[tuple[str, int, int]]:
        """(run id, version, finished at) of finished runs the runs table holds,
        last changed before ``cutoff_ms``, oldest first from ``after`` (for
        retention), read off the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._reader,
            lambda: self.storage.finished_before(self._read_only(), cutoff_ms, limit, after),
        )

    async def submit(self, cmd: L.Command) -> L.Result:
        """Queue a command; return its result once its commit is durable, or
        raise its LedgerError. If the caller is cancelled the write still
        happens (a cancelled request abandons its reply, not its write)."""
        if self._closing:
            raise WriterClosed()
        if type(cmd) is L.Renew:
            got = self._renew_from_memory(cmd)
            if isinstance(got, LedgerError):
                raise got
            if got is not None:
                return got  # type: ignore[no-any-return]
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._idle.clear()
        queue = self._queue
        item = self._name(_Item(cmd, fut, None, REQUEST_SCOPE.get()))
        if queue.full():  # back-pressure: wait for room
            await queue.put(item)
        else:
            queue.put_nowait(item)
        self._arrived()
        result = await fut
        return result  # type: ignore[no-any-return]

    def submit_nowait(self, cmd: L.Command) -> asyncio.Future[Any]:
        """Queue a command without awaiting; the future resolves as ``submit``
        would. For streams that answer many commands by callback. Raises
        WriterClosed, or LedgerError(STORAGE_UNAVAILABLE) when the queue is full."""
        if self._closing:
            raise WriterClosed()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if type(cmd) is L.Renew and self._renewed(_Item(cmd, fut)):
            return fut
        try:
            self._queue.put_nowait(self._name(_Item(cmd, fut, None, REQUEST_SCOPE.get())))
        except asyncio.QueueFull:
            self._unname(_Item(cmd, fut))
            raise LedgerError(Code.STORAGE_UNAVAILABLE, "writer queue is full; retry") from None
        self._idle.clear()
        self._arrived()
        return fut

    def submit_with_answer(self, cmd: L.Command, answer: Answer) -> bool:
        """Queue a command whose result (or LedgerError) is passed to
        ``answer(result)`` on the loop once its commit is durable — or at once,
        for WriterClosed. False, queueing nothing, when the queue is full
        (``submit_with_answer_waiting`` then)."""
        if self._closing:
            answer(WriterClosed())
            return True
        if type(cmd) is L.Renew and self._renewed(_Item(cmd, None, answer)):
            return True
        try:
            self._queue.put_nowait(self._name(_Item(cmd, None, answer, REQUEST_SCOPE.get())))
        except asyncio.QueueFull:
            self._unname(_Item(cmd, None, answer))
            return False
        self._idle.clear()
        self._arrived()
        return True

    async def submit_with_answer_waiting(self, cmd: L.Command, answer: Answer) -> None:
        """``submit_with_answer``, waiting for room in the queue (back-pressure:
        a stream stops reading while the writer is full, as a unary call waits)."""
        if self._closing:
            answer(WriterClosed())
            return
        if type(cmd) is L.Renew and self._renewed(_Item(cmd, None, answer)):
            return
        self._idle.clear()
        await self._queue.put(self._name(_Item(cmd, None, answer, REQUEST_SCOPE.get())))
        self._arrived()

    # -- renewals from memory ----------------------------------------------------

    def _renew_from_memory(self, cmd: L.Renew) -> Any:
        """A renewal checked and applied in the committed state, on the loop,
        with no commit (DESIGN.md, "Renewals from memory"): the renewed
        record, or the fence check's LedgerError; None when it goes on the
        queue like any command: a queued or uncommitted command names the
        run (the batch decides it then, from memory too when it may), or it
        must be written (L.renewed_in_memory)."""
        if self.memory_ok is not None and not self.memory_ok():
            return None
        run_id = cmd.run_id
        named = self._named
        if named and (ALL in named or run_id in named):
            return None
        runs = self.state.runs
        try:
            rec = L.renewed_in_memory(cmd, runs.get(run_id), self.clock.now_ms(),
                                      self._lease_floor)
        except LedgerError as exc:
            return exc
        if rec is None:
            return None
        runs[run_id] = rec
        self._dirty.add(run_id)
        self.stats.memory_renewals += 1
        if self.on_renewed is not None:
            self.on_renewed(run_id, rec)
        return rec

    def _renewed(self, item: _Item) -> bool:
        """Answer a renewal from memory; False: queue it instead."""
        got = self._renew_from_memory(item.cmd)  # type: ignore[arg-type]
        if got is None:
            return False
        item.deliver(got)
        return True

    def _name(self, item: _Item) -> _Item:
        """Count the runs a queued command names (commands of a transaction
        and fences too; an ExtendLeases names them all)."""
        named = self._named
        for run_id in _names(item.cmd):
            named[run_id] = named.get(run_id, 0) + 1
        return item

    def _unname(self, item: _Item) -> None:
        """The command is committed, failed or never queued: uncount it."""
        named = self._named
        for run_id in _names(item.cmd):
            left = named[run_id] - 1
            if left:
                named[run_id] = left
            else:
                del named[run_id]

    def _take_flush(self) -> tuple[list[str], int | None]:
        """The runs whose renewed expiries the next batch copies into the runs
        table, and the lease floor it stores once the cycle's last chunk
        commits. A cycle starts every lease_flush_ms, from the runs renewed
        since the last one began; from then on the floor is its start (every
        expiry of that instant is copied by the time the floor is stored).
        Loop thread."""
        if not self._flushing:
            now = self.clock.now_ms()
            if not self._dirty or now - self._flush_at < self.lease_flush_ms:
                return [], None
            self._flush_at = now
            self._lease_floor = max(self._lease_floor, now)
            self._flushing = list(self._dirty)
            self._dirty = set()
        chunk = self._flushing[-FLUSH_CHUNK:]
        del self._flushing[-FLUSH_CHUNK:]
        return chunk, (None if self._flushing else self._flush_at)

    async def _flush_ticks(self) -> None:
        """Commit flush chunks while the writer is idle (no batch carries them)."""
        while not self._closing:
            await asyncio.sleep(FLUSH_TICK_S)
            due = self._flushing or (
                self._dirty and self.clock.now_ms() - self._flush_at >= self.lease_flush_ms)
            if due and self._queue.empty() and not self._busy:
                with contextlib.suppress(asyncio.QueueFull):
                    self._queue.put_nowait(_FLUSH)

    def register(self, command_type: type, executor: Executor) -> None:
        """Route commands of this type (e.g. the engine store's) to
        ``executor(db, cmd, now) -> result`` in the writer thread, inside the
        batch's transaction and a savepoint of its own: it reads the rows it
        needs, calls its pure decision, writes, and returns the result or
        raises LedgerError (its writes are then rolled back to the savepoint).
        Its results need a codec entry (core.codec.register) for request ids."""
        self._executors[command_type] = executor

    def subscribe(self, listener: Callable[[list[ChangeEvent]], None]) -> Callable[[], None]:
        """Call ``listener(events)`` on the loop after every commit that changed
        records. The listener must not block; returns an unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    async def wait_idle(self) -> None:
        """Wait until nothing is queued or in flight (for tests)."""
        while not (self._queue.empty() and not self._busy):
            self._idle.clear()
            await self._idle.wait()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # -- the loop ----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            first = await self._queue.get()
            batch: list[_Item] = []
            if first is _STOP:
                stopping = True
            elif first is not _FLUSH:
                batch.append(first)
                if self._holds(self._queue.qsize() + 1):
                    await self._hold()
            while len(batch) < self.max_batch and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is _STOP:
                    stopping = True
                    continue
                if item is not _FLUSH:
                    batch.append(item)
            flush, floor = ([], None) if stopping else self._take_flush()
            if batch or flush:
                if batch:
                    self._last_batch = len(batch)
                    self._gather = max(float(len(batch)), self._gather * COMMIT_GATHER_DECAY)
                self._measure_busy(loop.time())
                self._busy = True
                try:
                    await self._commit(loop, batch, flush, floor)
                finally:
                    self._busy = False
                    for item in batch:
                        self._unname(item)
            if self._queue.empty():
                self._idle.set()
        # anything queued after the stop marker (cannot happen: submit refuses)

    def _holds(self, queued: int) -> bool:
        """Whether to hold this batch (of ``queued`` so far) open for more."""
        return not (
            not self.commit_delay_s
            or self._closing
            or self._last_batch < COMMIT_SIBLINGS
            or self._loop_busy < COMMIT_HOLD_BUSY
            or queued >= self._gather_target()
        )

    def _gather_target(self) -> int:
        """How many commands (the held one included) end a hold."""
        return min(COMMIT_GATHER, int(self._gather))

    def _measure_busy(self, now: float) -> None:
        """The loop thread's share of CPU since the last measure, at most every
        COMMIT_BUSY_SAMPLE_S (this task runs on the loop's thread)."""
        since = now - self._busy_since
        if since < COMMIT_BUSY_SAMPLE_S:
            return
        cpu = loop_cpu_time()
        self._loop_busy = (cpu - self._busy_cpu) / since
        self._busy_since, self._busy_cpu = now, cpu

    async def _hold(self) -> None:
        """Hold the batch open until as many commands are queued as the
        largest recent batch had (at most COMMIT_GATHER), or the window ends."""
        loop = asyncio.get_running_loop()
        first = self._queue.qsize()
        wake = self._hold_wake = loop.create_future()
        self._hold_target = self._gather_target()
        timer = loop.call_later(self.commit_delay_s, _wake, wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._hold_wake = None
        self.stats.held += 1
        if self._queue.qsize() == first:
            self.stats.held_in_vain += 1

    def _arrived(self) -> None:
        """A command was queued: if a batch is held, end the hold once the
        target is queued."""
        if self._hold_wake is not None and self._queue.qsize() + 1 >= self._hold_target:
            _wake(self._hold_wake)

    async def _commit(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[_Item],
        flush: list[str] | None = None,
        floor: int | None = None,
    ) -> None:
        now = self.clock.now_ms()
        started = time.perf_counter()
        try:
            outcome = await loop.run_in_executor(
                self._executor, self._apply, batch, now, flush or (), floor
            )
        except LedgerError as exc:  # the commit failed: nothing moved
            self._flushing.extend(flush or ())
            self.stats.failed_commits += 1
            log.error("commit failed for %d commands: %s", len(batch), exc.message)
            for item in batch:
                item.deliver(LedgerError(exc.code, exc.message, metadata=exc.metadata))
            if self.on_failed_commit is not None:
                self.on_failed_commit(exc)
            return
        except BaseException as exc:  # a bug: fail the batch, keep serving
            self._flushing.extend(flush or ())
            self.stats.failed_commits += 1
            log.exception("writer batch crashed")
            for item in batch:
                item.deliver(
                    LedgerError(Code.STORAGE_UNAVAILABLE, f"internal writer error: {exc!r}")
                )
            return
        answers, overlay, tombs, revision, events, compacted, evict, renewed = outcome
        if renewed:
            self._dirty.update(renewed)
            self.stats.memory_renewals += len(renewed)
        self.stats.leases_flushed += len(flush or ())
        if batch:
            self.stats.batches += 1
            self.stats.commands += len(batch)
            self.stats.max_batch = max(self.stats.max_batch, len(batch))
            elapsed = time.perf_counter() - started
            self.stats.commit_seconds += elapsed
            if self.on_batch is not None:
                self.on_batch(len(batch), elapsed)
        self._publish_state(overlay, tombs, revision, evict)
        if compacted is not None:
            self.state.compacted = compacted
        if renewed and self.on_renewed is not None:
            for run_id in renewed:
                rec = self.state.runs.get(run_id)
                if rec is not None:
                    self.on_renewed(run_id, rec)
        for item, answer in zip(batch, answers, strict=True):
            item.deliver(answer)
        if events:
            for listener in list(self._listeners):
                try:
                    listener(events)
                except Exception:
                    log.exception("change-feed listener failed")

    def _publish_state(
        self,
        overlay: dict[str, Record | None],
        tombs: dict[str, int],
        revision: int,
        evict: list[str] | None = None,
    ) -> None:
        """Move the committed state after a commit. ``evict``: finished runs
        the runs table now reflects, no longer held."""
        st = self.state
        runs, index = st.runs, st.index
        for run_id, rec in overlay.items():
            index.update(run_id, rec)
            if rec is None:
                runs.pop(run_id, None)
            else:
                runs[run_id] = rec
        for run_id in evict or ():
            rec = runs.get(run_id)
            if rec is not None and rec.status in TERMINAL:
                del runs[run_id]
        st.tombstones.update(tombs)
        st.revision = revision

    # -- the writer thread -------------------------------------------------------

    def _apply(
        self, batch: list[_Item], now: int, flush: Any = (), floor: int | None = None
    ) -> tuple[Any, ...]:
        """Decide every command of the batch in order and commit once.
        Runs in the writer thread; reads the committed state, never moves it."""
        committed = self.state
        answered: dict[str, tuple[str, Any]] = {}
        out = Batch(now=now)
        st = _Step(committed, out, committed.revision)
        answers: list[Any] = []
        with self.storage.transaction():
            rids = [item.cmd.request_id for item in batch if item.cmd.request_id]
            stored_answers = self.storage.lookup_requests(rids) if rids else {}
            for item in batch:
                cmd = item.cmd
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
                answer: Any
                executor = self._executors.get(type(cmd))
                if executor is not None:
                    fence = getattr(cmd, "fence", None)
                    try:
                        if fence is not None:
                            self._check_fence(fence, st)
                    except LedgerError as exc:
                        answer = exc
                    else:
                        answer = self.storage.run_isolated(executor, cmd, now)
                elif type(cmd) is L.Transaction:
                    answer = self._transaction(cmd, st, now)  # type: ignore[arg-type]
                elif type(cmd) is L.ExtendLeases:
                    answer = self._extend_leases(cmd, st, now)  # type: ignore[arg-type]
                elif type(cmd) is L.Renew and (
                    renewed := self._renew_in_batch(cmd, st, now)  # type: ignore[arg-type]
                ) is not None:
                    answer = renewed
                else:
                    try:
                        answer = self._decide(cmd, st, now)
                    except LedgerError as exc:
                        answer = exc
                if rid:
                    answered[rid] = (fp, answer)
                    out.requests.append((rid, fp, answer, now))
                answers.append(answer)
            overlay, tombs, events, changed = st.overlay, st.tombs, st.events, st.changed
            rev = st.rev
            out.revision = rev
            taken, mark = self._plan_materialization(now, rev, changed)
            leases: list[tuple[str, Record | None]] = []
            if flush:  # expiries renewed from memory, into their runs rows
                skip = set(taken)
                for k in flush:
                    rec = overlay[k] if k in overlay else committed.runs.get(k)
                    if rec is not None and rec.status not in TERMINAL and k not in skip:
                        leases.append((k, rec))
            if taken or mark != self._materialized or leases:
                out.materialize = [
                    (k, overlay[k] if k in overlay else committed.runs.get(k)) for k in taken
                ] + leases
                out.materialized = mark
            out.lease_floor = floor
            if (
                self._prune_more
                or now - self._last_prune >= self.prune_every_ms
                or rev - self._pruned_at >= prune_step(self.history_revisions)
            ):
                age_cutoff = now - self.history_max_age_ms if self.history_max_age_ms else None
                out.prune = (
                    now - self.request_retention_ms,
                    rev - self.history_revisions + 1,
                    age_cutoff,
                    mark,
                )
            self.storage.write(out)
            if self.unsafe_ack_before_commit_s:  # TEST-ONLY broken build
                self._unsafe_ack_early(batch, answers, overlay, tombs, rev, events)
        # committed: move the materialization bookkeeping (a failed commit
        # raised above and moved nothing)
        pending = self._pending
        for k in taken:
            del pending[k]
        for k, first in changed.items():
            if k not in pending:
                pending[k] = (first, now)
        self._materialized = mark
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
        return answers, overlay, tombs, rev, events, compacted, evict, st.renewed

    def _committed(self, run_id: str, cold: dict[str, Record | None]) -> Record | None:
        """A run's committed record: held in memory, or — a finished run the
        index knows but memory no longer holds — read from the runs table,
        once per batch. Writer thread (the loop moves the state only between
        batches)."""
        rec = self.state.runs.get(run_id)
        if rec is not None:
            return rec
        if run_id in cold:
            return cold[run_id]
        if run_id not in self.state.index:
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
        committed = st.committed
        cur = overlay[run_id] if run_id in overlay else self._committed(run_id, st.cold)
        tomb = st.tombs.get(run_id, committed.tombstones.get(run_id, 0))
        if type(cmd) is L.RecordCheckpoint and cmd.fence is not None:
            self._check_fence(cmd.fence, st)
        decision = L.decide(cmd, cur, tomb, now, st.rev + 1)
        change = decision.change
        if change is not None:
            rev = st.rev = st.rev + 1
            if run_id not in st.changed:
                st.changed[run_id] = rev
            out = st.out
            if isinstance(change, L.Put):
                self._put(st, rev, change.record, cur, type(cmd))
            else:
                overlay[run_id] = None
                st.tombs[run_id] = max(tomb, change.fencing_token)
                out.deletes[run_id] = (st.tombs[run_id], now)
                out.changes.append((rev, run_id, KIND_DELETE, None))
                st.events.append(ChangeEvent(rev, KIND_DELETE, run_id, None, cur, type(cmd)))
        return decision.result

    @staticmethod
    def _put(st: _Step, rev: int, rec: Record, cur: Record | None, cause: type) -> None:
        """Add a PUT of ``rec`` (revision ``rev``, already taken) to the batch."""
        run_id = rec.run_id
        st.overlay[run_id] = rec
        st.out.deletes.pop(run_id, None)
        st.out.changes.append((rev, run_id, KIND_PUT, rec))
        st.events.append(ChangeEvent(rev, KIND_PUT, run_id, rec, cur, cause))

    def _renew_in_batch(self, cmd: L.Renew, st: _Step, now: int) -> Any:
        """A renewal queued behind other commands on its run, decided in its
        place in the batch by the rule of renewals from memory: its expiry
        into the overlay, no change row, no revision. None: written instead.
        Writer thread."""
        if self.memory_ok is not None and not self.memory_ok():
            return None
        run_id = cmd.run_id
        cur = st.overlay[run_id] if run_id in st.overlay else self._committed(run_id, st.cold)
        try:
            rec = L.renewed_in_memory(cmd, cur, now, self._lease_floor)
        except LedgerError as exc:
            return exc
        if rec is not None:
            st.overlay[run_id] = rec
            st.renewed.append(run_id)
        return rec

    def _extend_leases(self, cmd: L.ExtendLeases, st: _Step, now: int) -> L.LeasesExtended:
        """A new leader's extension of every live lease (leadership.py): the
        ledger's leases in memory (every leased run is held there), then the
        engine store's claims and locks in their tables. Writer thread."""
        runs = 0
        for run_id, committed in list(st.committed.runs.items()):
            cur = st.overlay[run_id] if run_id in st.overlay else committed
            if cur is None:
                continue
            rec = L.extend_lease(cur, cmd, now, st.rev + 1)
            if rec is None:
                continue
            rev = st.rev = st.rev + 1
            if run_id not in st.changed:
                st.changed[run_id] = rev
            self._put(st, rev, rec, cur, L.ExtendLeases)
            runs += 1
        others = 0
        if self.extend_other_leases is not None:
            others = self.extend_other_leases(self.storage.db, cmd.by_ms, cmd.alive_at)
        return L.LeasesExtended(runs, others)

    def _check_fence(self, fence: F.Fence, st: _Step) -> None:
        """Raise unless ``fence`` holds right now: a run fence against the
        writer's authoritative records (committed plus this batch's earlier
        changes), a lock fence against the lock's row as this transaction
        sees it. Writer thread, in the step that applies the fenced write."""
        if fence.run_id:
            run_id = fence.run_id
            cur = st.overlay[run_id] if run_id in st.overlay else self._committed(run_id, st.cold)
            tomb = st.tombs.get(run_id, st.committed.tombstones.get(run_id, 0))
            F.check_run_fence(fence, cur, tomb)
            return
        if self.lock_fence is None:
            raise LedgerError(
                Code.RUN_VALIDATION_ERROR,
                "fence.lock_key: this server has no engine store (no keyed locks)",
                field="fence.lock_key",
            )
        self.lock_fence(self.storage.db, fence)

    def _transaction(self, tx: L.Transaction, st: _Step, now: int) -> Any:
        """Apply every command of ``tx`` in order, the shared fence checked
        before each, in one savepoint: all of them, or (the first refusal,
        naming its command) none. Writer thread."""
        mark = st.mark()
        db = self.storage.db
        db.execute("SAVEPOINT tx")
        results: list[Any] = []
        try:
            for i, cmd in enumerate(tx.commands):
                try:
                    if tx.fence is not None:
                        self._check_fence(tx.fence, st)
                    executor = self._executors.get(type(cmd))
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

    def _plan_materialization(
        self, now: int, rev: int, changed: dict[str, int]
    ) -> tuple[list[str], int]:
        """Which pending runs this batch copies into the runs table (oldest
        first: those pending for materialize_after_ms, those whose change the
        history limit wants to prune, or any past MAX_PENDING), and the mark
        once it commits: just below the oldest change still not in runs,
        counting this batch's own changes as pending."""
        pending = self._pending
        taken: list[str] = []
        if pending:
            prunable = rev - self.history_revisions + 1
            force = len(pending) > MAX_PENDING
            first, since = next(iter(pending.values()))
            if force or first < prunable or since <= now - self.materialize_after_ms:
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

    def _unsafe_ack_early(
        self,
        batch: list[_Item],
        answers: list[Any],
        overlay: dict[str, Record | None],
        tombs: dict[str, int],
        rev: int,
        events: list[ChangeEvent],
    ) -> None:
        """TEST-ONLY (``--fault ack-before-commit``): answer the batch's callers
        and publish its state *before* its COMMIT, then hold the COMMIT back, so
        a SIGKILL in between loses acknowledged writes. Writer thread, inside the
        transaction; the normal path then finds every future done and no events."""
        loop = self._loop
        assert loop is not None
        published = list(events)
        events.clear()

        def deliver() -> None:
            self._publish_state(overlay, tombs, rev)
            for item, answer in zip(batch, answers, strict=True):
                item.deliver(answer)
            for listener in list(self._listeners) if published else []:
                try:
                    listener(published)
                except Exception:
                    log.exception("change-feed listener failed")

        loop.call_soon_threadsafe(deliver)
        time.sleep(self.unsafe_ack_before_commit_s)
