"""The single writer: queue, group commit, revision, change feed.

Every write — ledger, raw seam, the engine store — is a command put on one
bounded queue. One task takes whatever is queued (up to ``max_batch``; when
the server is short of CPU it first holds the batch up to ``commit_delay_ms``
for more, commit_delay.py), decides each command in order against the
committed state plus the batch's own earlier changes, writes the rows and
commits once (apply.py: a small batch decided on the loop, a larger one on the
writer's one thread, every COMMIT on that thread);
only after that commit is durable are the callers answered, the in-memory
committed state moved and the change feed published. A refused command does
not disturb its neighbours; a failed commit fails every command of the batch
and moves nothing. Committed reads are reads.py's; renewals answered from
memory are renewals.py's.

Only this module (through the storage's ``open``) opens a write connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..clock import Clock
from ..core import ledger as L
from ..core.errors import Code, LedgerError, not_owner
from ..core.placement import Ownership
from ..core.records import TERMINAL, Record
from ..core.shards import shard_of
from ..scope import REQUEST_SCOPE
from ..storage.sql import (
    COLD_STATUSES,
    LEASES_EXACT,
    SAVED_INDEX_WRITTEN,
    Batch,
    LoadedState,
    SqlStorage,
)
from .apply import Answer, Apply, Decide, EngineHooks, Executor, Item
from .commit_delay import CommitDelay
from .index import RunIndex
from .renewals import FLUSH_TICK_S, Renewals, RenewRule
from .state import ChangeEvent, LedgerState, WriterStats

log = logging.getLogger("fencepost.writer")

# A batch up to this many commands (and flushed expiries) is decided on the
# loop: a thread hop per batch cost more than its deciding (about 1 ms).
LOOP_BATCH = 64
# The loop waits this long for such a batch's COMMIT (the GIL released), then
# awaits it: a stalled disk stops the loop no longer than this.
COMMIT_WAIT_S = 0.002
_STOP = object()
_FLUSH = object()  # queued by the flush timer: commit a flush chunk even when idle

# TEST-ONLY broken build: called on the writer thread inside a batch's
# transaction, before its COMMIT, with a function that answers the batch now.
AckBeforeCommit = Callable[[Callable[[], None]], None]


class _Barrier:
    """Answered once every batch before it has committed and been published
    (``Writer.drop``); writes nothing."""

    request_id = ""


class WriterClosed(LedgerError):
    def __init__(self) -> None:
        super().__init__(Code.SHUTTING_DOWN, "the server is shutting down; nothing was done")


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
        memory_ok: Callable[[], bool] | None = None,
        on_failed_commit: Callable[[LedgerError], None] | None = None,
        decide: Decide = L.decide,
        renewed_in_memory: RenewRule = L.renewed_in_memory,
        ack_before_commit: AckBeforeCommit | None = None,
    ) -> None:
        """``memory_ok``: False while renewals may not be answered from memory
        (a PostgreSQL coordinator that cannot be sure it still leads).
        ``on_failed_commit``: called on the loop with the error of a batch that
        could not commit (a NOT_LEADER there: this coordinator was deposed).
        ``decide``, ``renewed_in_memory``: the ledger's rules (core.ledger's;
        a broken build hands in others). ``ack_before_commit``: TEST-ONLY."""
        if request_retention_ms < 10 * 60_000:
            raise ValueError("request ids must be remembered for at least 10 minutes")
        self.storage = storage
        self.clock = clock
        self.max_batch = max_batch
        self.commit_delay = CommitDelay(commit_delay_ms)
        self.stats = WriterStats()
        self.renewals = Renewals(clock, self.stats, lease_flush_ms, memory_ok=memory_ok,
                                 rule=renewed_in_memory)
        self.decide = decide
        self.renewed_in_memory = renewed_in_memory
        self.ack_before_commit = ack_before_commit
        # Finished runs leave memory once the runs table reflects them (not
        # for an in-memory database, which has no second connection to read).
        self.evict_finished = str(storage.path) != ":memory:"
        self._apply = Apply(
            storage,
            renew=self.renewals.in_batch,
            decide=decide,
            request_retention_ms=request_retention_ms,
            history_revisions=history_revisions,
            history_max_age_ms=history_max_age_ms,
            prune_every_ms=prune_every_ms,
            materialize_after_ms=materialize_after_ms,
            evict_finished=self.evict_finished,
            before_commit=None if ack_before_commit is None else self._ack_early,
        )
        self._apply.register(_Barrier, lambda db, cmd, now: True)
        self._sure: Callable[[], bool] = lambda: True  # (lead_while)
        self._on_failed_commit = on_failed_commit
        self._flush_timer: asyncio.Task[None] | None = None
        self._saved_at = -1  # the revision of the saved index entries load() used
        self.state = LedgerState()
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencepost-writer")
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._listeners: list[Callable[[list[ChangeEvent]], None]] = []
        self._batch_observers: list[Callable[[int, float], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Open the database and load the committed state (leading shards
        apart: load nothing yet; ``take`` loads each shard taken)."""
        loop = asyncio.get_running_loop()
        load = self._open_empty if self.storage.sharing else self._open_and_load
        self.state = await loop.run_in_executor(self._executor, load)
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="fencepost-writer")
        self._flush_timer = asyncio.create_task(self._flush_ticks(), name="fencepost-flush")

    def _open_and_load(self) -> LedgerState:
        """The committed state, index included, built in the writer thread: with
        a million runs the index takes seconds, which on the event loop would
        stall every call, and a new leader's renewals (ha/leadership.py) for long
        enough to lose the leadership it has just won."""
        self.storage.open()
        built: list[RunIndex] = []

        def index(state: LoadedState) -> None:
            # inside load(): on SQLite the index is built while the integrity
            # check still reads the file (SQLite's work leaves the GIL free)
            built.append(RunIndex(state.runs.values(), cold=state.cold))
            state.cold = []  # no longer needed: the index holds the ids

        loaded = self.storage.load(index)
        self._apply.materialized = loaded.revision  # load() wrote every replayed change
        # the saved index entries still match as long as nothing is written
        self._saved_at = loaded.revision if loaded.saved else -1
        self._apply.pending.clear()
        self.renewals.restart(self.storage, loaded.runs)
        return LedgerState(
            runs=loaded.runs,
            tombstones=loaded.tombstones,
            revision=loaded.revision,
            index=built[0],
            compacted=loaded.compacted,
        )

    def _open_empty(self) -> LedgerState:
        """Leading shards apart: open (the first such coordinator converts the
        database, storage/shared.py), hold no run until a shard is taken."""
        self.storage.open()
        db = self.storage.db
        top = db.execute("SELECT max(block) FROM runs").fetchone()[0]
        self.storage._block, self.storage._in_block = (0 if top is None else top + 1), 0
        self.renewals.start_empty()
        self._apply.prunes = False
        return LedgerState(index=RunIndex(), compacted=self.storage._compacted(db, 0))

    async def take(self, shards: frozenset[int], gaps: dict[int, int]) -> L.LeasesExtended:
        """Shards just taken (their epochs already in the storage's check):
        load their runs, then extend their leases as SPEC §13 says, durably,
        before any command of theirs is accepted (the caller then widens the
        ownership). ``gaps``: ms each went unled."""
        loop = asyncio.get_running_loop()
        stale = self._forget(shards)  # what memory still holds of them (a give-up cut short)
        try:
            loaded = await loop.run_in_executor(self._executor, self._reload, shards, stale)
        except self.storage.ERRORS as exc:  # (the writer's connection: it reconnects next batch)
            raise self.storage._storage_error(exc) from exc
        st = self.state
        for run_id, rec in loaded.runs.items():
            st.runs[run_id] = rec
            st.index.update(run_id, rec)
        st.index.add_cold(loaded.cold)
        st.tombstones.update(loaded.tombstones)
        done = await self.submit(L.TakeShards(
            shards, tuple(loaded.runs), loaded.floors, gaps, self.renewals.stored))
        assert isinstance(done, L.LeasesExtended)
        return done

    async def drop(self, shards: frozenset[int]) -> list[str]:
        """Forget shards no longer led (the ownership already refuses their
        commands): once every batch before now is answered, their runs leave
        memory. Returns the run ids dropped."""
        # answered (committed or failed with its batch) after every batch before it
        with contextlib.suppress(LedgerError):
            await self.submit(_Barrier())  # type: ignore[arg-type]
        gone = self._forget(shards)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._forget_rows, gone)
        return gone

    def _forget(self, shards: frozenset[int]) -> list[str]:
        """Every run of ``shards`` out of memory (loop): records, index entries,
        tombstones, renewals to write. Returns their ids."""
        n = self.storage.shards
        st = self.state
        gone = [run_id for run_id in {*st.index, *st.runs} if shard_of(run_id, n) in shards]
        for run_id in gone:
            st.runs.pop(run_id, None)
            st.index.update(run_id, None)
        for run_id in [k for k in st.tombstones if shard_of(k, n) in shards]:
            del st.tombstones[run_id]
        self.renewals.forget(gone)
        return gone

    def _forget_rows(self, run_ids: list[str]) -> None:
        rows = self.storage.rows
        for run_id in run_ids:
            rows.pop(run_id, None)

    def _reload(self, shards: frozenset[int], stale: list[str]) -> Any:
        """Writer thread: forget the stale rows' blocks, read the shards anew."""
        self._forget_rows(stale)
        return self.storage.load_shards(shards)

    @property
    def shard_commands(self) -> list[int]:
        """Leading shards apart: commands committed here per shard ([]: none yet)."""
        return self._apply.shard_commands

    def leads_shard_zero(self, yes: bool) -> None:
        """Leading shards apart, only shard 0's owner prunes the shared history."""
        self._apply.prunes = yes

    async def close(self) -> None:
        """Stop accepting, finish everything queued, close the database."""
        if self._closing:
            return
        self._closing = True
        self.commit_delay.cancel()
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

    def _close_storage(self) -> None:
        """Copy every pending run into the runs table (a clean shutdown leaves
        it current), save the finished runs' index entries for the next start,
        then close. Writer thread."""
        applier = self._apply
        try:
            if not self.storage.is_open or self._task is None:  # never loaded: wrote nothing
                return
            revision = self.state.revision
            runs = self.state.runs
            pending = applier.pending
            # every expiry renewed from memory goes to the runs table, and the
            # next start finds them exact
            leases = self.renewals.unwritten(runs, pending)
            with self.storage.transaction():
                if self.storage.sharing:
                    n = self.storage.shards
                    self.storage.touch_shards({shard_of(k, n) for k, _ in leases})
                out = Batch(revision=revision)
                out.materialize = [(k, runs.get(k)) for k in pending]
                out.expiries = leases
                out.materialized = revision if pending else applier.materialized
                out.lease_floor = LEASES_EXACT
                self.storage.write(out)
            if pending:
                pending.clear()
                applier.materialized = revision
            self.renewals.clear()
            # (an in-memory database has no next start; entries read at the
            # start and still matching need no rewrite)
            if self.evict_finished and applier.materialized == revision != self._saved_at \
                    and not self.storage.sharing:
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

    async def submit(self, cmd: L.Command) -> L.Result:
        """Queue a command; return its result once its commit is durable, or
        raise its LedgerError. If the caller is cancelled the write still
        happens (a cancelled request abandons its reply, not its write)."""
        if self._closing:
            raise WriterClosed()
        if type(cmd) is L.Renew:
            got = self._from_memory(cmd)
            if isinstance(got, LedgerError):
                raise got
            if got is not None:
                return got  # type: ignore[no-any-return]
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._idle.clear()
        queue = self._queue
        item = self._name(Item(cmd, fut, None, REQUEST_SCOPE.get()))
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
        if type(cmd) is L.Renew and self._renewed(Item(cmd, fut)):
            return fut
        try:
            self._queue.put_nowait(self._name(Item(cmd, fut, None, REQUEST_SCOPE.get())))
        except asyncio.QueueFull:
            self.renewals.unname(cmd)
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
        if type(cmd) is L.Renew and self._renewed(Item(cmd, None, answer)):
            return True
        try:
            self._queue.put_nowait(self._name(Item(cmd, None, answer, REQUEST_SCOPE.get())))
        except asyncio.QueueFull:
            self.renewals.unname(cmd)
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
        if type(cmd) is L.Renew and self._renewed(Item(cmd, None, answer)):
            return
        self._idle.clear()
        await self._queue.put(self._name(Item(cmd, None, answer, REQUEST_SCOPE.get())))
        self._arrived()

    def _renewed(self, item: Item) -> bool:
        """Answer a renewal from memory; False: queue it instead."""
        got = self._from_memory(item.cmd)
        if got is None:
            return False
        item.deliver(got)
        return True

    def _from_memory(self, cmd: Any) -> Any:
        """``Renewals.from_memory``, after the check every command meets
        first: NOT_OWNER for a run in a shard led elsewhere."""
        owned = self._apply.ownership
        if owned is not None and (refused := owned.refusal(cmd)) is not None:
            return refused
        return self.renewals.from_memory(cmd, self.state.runs)

    def _name(self, item: Item) -> Item:
        self.renewals.name(item.cmd)
        return item

    async def _flush_ticks(self) -> None:
        """Commit flush chunks while the writer is idle (no batch carries them)."""
        while not self._closing:
            await asyncio.sleep(FLUSH_TICK_S)
            if self.renewals.flush_due() and self._queue.empty() and not self._busy:
                with contextlib.suppress(asyncio.QueueFull):
                    self._queue.put_nowait(_FLUSH)

    # -- seams: what others hand in ---------------------------------------------

    def register(self, command_type: type, executor: Executor) -> None:
        """Route commands of this type to ``executor(db, cmd, now) -> result``
        in the writer thread, inside the batch's transaction and a savepoint of
        its own: it reads the rows it needs, calls its pure decision, writes,
        and returns the result or raises LedgerError (its writes are then
        rolled back to the savepoint). Its results need a codec entry
        (core.codec.register) for request ids."""
        self._apply.register(command_type, executor)

    def attach_engine(self, hooks: EngineHooks) -> None:
        """The engine store's executors (as ``register``), its lock fence
        check, and its share of a takeover's lease extension."""
        self._apply.attach_engine(hooks)

    def subscribe(self, listener: Callable[[list[ChangeEvent]], None]) -> Callable[[], None]:
        """Call ``listener(events)`` on the loop after every commit that changed
        records. The listener must not block; returns an unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def subscribe_renewals(self, listener: Callable[[str, Record], None]) -> Callable[[], None]:
        """Call ``listener(run id, record)`` on the loop after each renewal
        answered from memory (it makes no change event); returns an
        unsubscribe function."""
        return self.renewals.subscribe(listener)

    def observe_batches(self, observer: Callable[[int, float], None]) -> Callable[[], None]:
        """Call ``observer(commands, seconds)`` on the loop after each committed
        batch; returns a function that stops it."""
        self._batch_observers.append(observer)
        return lambda: self._batch_observers.remove(observer)

    async def wait_idle(self) -> None:
        """Wait until nothing is queued or in flight (for tests)."""
        while not (self._queue.empty() and not self._busy):
            self._idle.clear()
            await self._idle.wait()

    @property
    def ownership(self) -> Ownership | None:
        """The shards this coordinator leads (None: every one); the writer
        refuses a command keyed in another with NOT_OWNER, before deciding it."""
        return self._apply.ownership

    def lead_only(self, ownership: Ownership | None) -> None:
        """From the next batch on, lead only ``ownership``'s shards (None: all)."""
        self._apply.ownership = ownership

    def check_led(self, *keys: str) -> None:
        """Raise NOT_OWNER unless this coordinator leads the shard of every
        key right now (a read keyed in another shard; or in one whose lease
        this coordinator cannot be sure of: it names no owner, retry soon)."""
        owned = self._apply.ownership
        if owned is not None:
            for key in keys:
                if (refused := owned.refusal_for_key(key)) is not None:
                    raise refused
            if not self._sure():
                shard = shard_of(keys[0], owned.shards) if keys else 0
                raise not_owner(shard, "", 0)

    def check_led_shards(self, shards: list[int]) -> None:
        """Raise NOT_OWNER unless this coordinator leads every one of
        ``shards`` right now (as ``check_led``, by shard)."""
        owned = self._apply.ownership
        if owned is not None:
            for shard in shards:
                if (refused := owned.refusal_for_shard(shard)) is not None:
                    raise refused
            if shards and not self._sure():
                raise not_owner(shards[0], "", 0)

    def leads_key(self, key: str) -> bool:
        """Whether this coordinator leads ``key``'s shard right now."""
        owned = self._apply.ownership
        return owned is None or (owned.refusal_for_key(key) is None and self._sure())

    def lead_while(self, sure: Callable[[], bool]) -> None:
        """Leading shards apart: what it leads counts only while ``sure()``
        (its shard rows renewed recently enough)."""
        self._sure = sure

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # -- the loop ----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self.commit_delay
        stopping = False
        while not stopping:
            first = await self._queue.get()
            batch: list[Item] = []
            if first is _STOP:
                stopping = True
            elif first is not _FLUSH:
                batch.append(first)
                if not self._closing and delay.holds(self._queue.qsize() + 1):
                    in_vain, ran_out = await delay.hold(self._queue.qsize)
                    self.stats.held += 1
                    self.stats.held_in_vain += in_vain
                    self.stats.held_to_window += ran_out
            while len(batch) < self.max_batch and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is _STOP:
                    stopping = True
                    continue
                if item is not _FLUSH:
                    batch.append(item)
            flush, floor = ([], None) if stopping else self.renewals.take_flush()
            if batch or flush or floor is not None:
                if batch:
                    delay.took(len(batch))
                delay.measure_busy(loop.time())
                self._busy = True
                try:
                    await self._commit(loop, batch, flush, floor)
                finally:
                    self._busy = False
                    for item in batch:
                        self.renewals.unname(item.cmd)
            if self._queue.empty():
                self._idle.set()
        # anything queued after the stop marker (cannot happen: submit refuses)

    def _arrived(self) -> None:
        self.commit_delay.arrived(self._queue.qsize())

    async def _commit(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[Item],
        flush: list[str] | None = None,
        floor: int | None = None,
    ) -> None:
        now = self.clock.now_ms()
        started = time.perf_counter()
        try:
            if self._on_loop(batch, flush, now):
                apply, storage = self._apply, self.storage
                ready = storage.prepare(
                    lambda: apply.prepare(batch, self.state, now, flush or (), floor))
                committing = self._executor.submit(storage.commit_prepared)
                try:  # the loop waits (GIL released) while the disk is quick
                    committing.result(COMMIT_WAIT_S)
                except concurrent.futures.TimeoutError:
                    await asyncio.wrap_future(committing)
                done = apply.settle(ready)
            else:
                done = await loop.run_in_executor(
                    self._executor, self._apply, batch, self.state, now, flush or (), floor
                )
        except LedgerError as exc:  # the commit failed: nothing moved
            self.renewals.failed(flush or [])
            self.stats.failed_commits += 1
            log.error("commit failed for %d commands: %s", len(batch), exc.message)
            for item in batch:
                item.deliver(LedgerError(exc.code, exc.message, metadata=exc.metadata))
            if self._on_failed_commit is not None:
                self._on_failed_commit(exc)
            return
        except BaseException as exc:  # a bug: fail the batch, keep serving
            self.renewals.failed(flush or [])
            self.stats.failed_commits += 1
            log.exception("writer batch crashed")
            for item in batch:
                item.deliver(
                    LedgerError(Code.STORAGE_UNAVAILABLE, f"internal writer error: {exc!r}")
                )
            return
        self.stats.leases_flushed += len(flush or ())
        if floor is not None:
            self.renewals.stored = floor
        if batch:
            self.stats.batches += 1
            self.stats.commands += len(batch)
            self.stats.max_batch = max(self.stats.max_batch, len(batch))
            elapsed = time.perf_counter() - started
            self.stats.commit_seconds += elapsed
            for observer in list(self._batch_observers):
                observer(len(batch), elapsed)
        self._publish_state(done.overlay, done.tombs, done.revision, done.evict)
        if done.compacted is not None:
            self.state.compacted = done.compacted
        if done.renewed:
            self.renewals.committed(done.renewed, self.state.runs)
        for item, answer in zip(batch, done.answers, strict=True):
            if type(item.cmd) is L.TakeShards and isinstance(answer, L.LeasesExtended):
                # logged as committed, whether or not the take goes on to lead them
                log.info("shards %s taken: %d leases extended (%d claims and locks), from "
                         "revision %d", sorted(item.cmd.shards), answer.runs, answer.others,
                         answer.first_revision)
            item.deliver(answer)
        if done.events:
            for listener in list(self._listeners):
                try:
                    listener(done.events)
                except Exception:
                    log.exception("change-feed listener failed")

    def _on_loop(self, batch: list[Item], flush: list[str] | None, now: int) -> bool:
        """Whether to decide and write this batch on the loop's thread, only
        its COMMIT on the writer's: a small batch of ledger commands on a
        local file."""
        return (len(batch) + len(flush or ()) <= LOOP_BATCH and self.ack_before_commit is None
                and self.storage.loop_can_prepare()
                and self._apply.light(batch, now, self.state.revision))

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

    def _ack_early(
        self,
        batch: list[Item],
        answers: list[Any],
        overlay: dict[str, Record | None],
        tombs: dict[str, int],
        rev: int,
        events: list[ChangeEvent],
    ) -> None:
        """TEST-ONLY (``ack_before_commit``): hand the fault a function that
        answers the batch's callers and publishes its state on the loop before
        the COMMIT. Writer thread, inside the transaction; the normal path then
        finds every future done and no events."""
        loop = self._loop
        fault = self.ack_before_commit
        assert loop is not None and fault is not None
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

        def answer_now() -> None:
            loop.call_soon_threadsafe(deliver)

        fault(answer_now)
