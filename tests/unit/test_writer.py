"""The writer without gRPC: group commit, isolation of refusals, executors."""

from __future__ import annotations

import ast
import asyncio
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fencepost_server.core import codec
from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.records import Status
from fencepost_server.storage import SqliteStorage
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Reads, Writer

SERVER = Path(__file__).resolve().parents[2] / "server" / "fencepost_server"


@dataclass(frozen=True)
class Bump:
    key: str
    refuse: bool = False
    request_id: str = ""


@dataclass(frozen=True)
class Bumped:
    key: str
    value: int


codec.register(
    "test.bumped", Bumped, lambda b: {"k": b.key, "v": b.value}, lambda d: Bumped(d["k"], d["v"])
)


def bump(db: sqlite3.Connection, cmd: Bump, now: int) -> Bumped:
    db.execute("CREATE TABLE IF NOT EXISTS counters (k TEXT PRIMARY KEY, v INTEGER)")
    db.execute(
        "INSERT INTO counters VALUES (?, 1) ON CONFLICT (k) DO UPDATE SET v = v + 1", (cmd.key,)
    )
    if cmd.refuse:  # refused after writing: the savepoint must undo it
        raise LedgerError(Code.INVALID_RUN_STATE, "refused")
    (v,) = db.execute("SELECT v FROM counters WHERE k = ?", (cmd.key,)).fetchone()
    return Bumped(cmd.key, v)


@pytest.fixture
async def writer(tmp_path: Path) -> Any:
    w = Writer(SqliteStorage(tmp_path / "w.db"), ManualClock())
    w.register(Bump, bump)
    await w.start()
    yield w
    await w.close()


async def test_a_batch_commits_many_commands_at_once(writer: Writer) -> None:
    results = await asyncio.gather(*(writer.submit(L.Acquire(f"r{i}", "w")) for i in range(300)))
    assert [r.fencing_token for r in results] == [1] * 300  # type: ignore[union-attr]
    assert sorted(r.revision for r in results) == list(range(1, 301))  # type: ignore[union-attr]
    assert writer.stats.commands == 300 and writer.stats.batches < 300
    assert writer.stats.max_batch > 1


async def test_refusals_do_not_disturb_neighbours(writer: Writer) -> None:
    await writer.submit(L.Acquire("held", "a"))
    out = await asyncio.gather(
        writer.submit(L.Acquire("x", "w")),
        writer.submit(L.Acquire("held", "b")),  # refused: RUN_LEASE_HELD
        writer.submit(L.Acquire("y", "w")),
        return_exceptions=True,
    )
    assert isinstance(out[1], LedgerError) and out[1].code is Code.RUN_LEASE_HELD
    assert {"x", "y", "held"} <= set(writer.state.runs)


async def test_executor_refusal_rolls_back_only_its_own_writes(writer: Writer) -> None:
    out = await asyncio.gather(
        writer.submit(Bump("k")),  # type: ignore[arg-type]
        writer.submit(Bump("k", refuse=True)),  # type: ignore[arg-type]
        writer.submit(Bump("k")),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    assert out[0] == Bumped("k", 1)
    assert isinstance(out[1], LedgerError) and out[1].code is Code.INVALID_RUN_STATE
    assert out[2] == Bumped("k", 2)


async def test_executor_answers_are_replayed_for_request_ids(tmp_path: Path) -> None:
    clock = ManualClock()
    for attempt in range(2):  # the second time after a restart
        w = Writer(SqliteStorage(tmp_path / "w.db"), clock)
        w.register(Bump, bump)
        await w.start()
        first = await w.submit(Bump("k", request_id="once"))  # type: ignore[arg-type]
        assert first == Bumped("k", 1)
        again = await w.submit(Bump("k"))  # type: ignore[arg-type]
        assert again == Bumped("k", 2 + attempt)
        await w.close()


async def test_commit_failure_fails_the_batch_and_moves_nothing(writer: Writer) -> None:
    await writer.submit(L.Acquire("a", "w"))
    rev = writer.state.revision
    loop = asyncio.get_running_loop()
    db = writer.storage.db
    pages = await loop.run_in_executor(
        writer._executor, lambda: db.execute("PRAGMA page_count").fetchone()[0]
    )
    await loop.run_in_executor(
        writer._executor, lambda: db.execute(f"PRAGMA max_page_count={pages}")
    )
    with pytest.raises(LedgerError) as ei:
        await asyncio.gather(
            *(writer.submit(L.Acquire("x" * 400 + str(i), "w")) for i in range(100))
        )
    assert ei.value.code is Code.STORAGE_FULL
    assert writer.state.revision == rev and set(writer.state.runs) == {"a"}


async def test_a_cancelled_caller_abandons_its_reply_not_its_write(writer: Writer) -> None:
    task = asyncio.create_task(writer.submit(L.Acquire("c", "w")))
    await asyncio.sleep(0)  # the command is queued
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await writer.wait_idle()
    assert writer.state.runs["c"].lease is not None  # committed all the same
    assert writer.state.runs["c"].lease.owner == "w"  # type: ignore[union-attr]


# -- the commit delay (group-commit window) ------------------------------------------


@pytest.fixture
def busy_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer sees its loop's thread busy all the time (as a server short
    of CPU has it), measured every 20 ms: the load below can then sleep
    rather than spin, and leave the writer's thread the CPU it needs."""
    from fencepost_server.writer import commit_delay

    monkeypatch.setattr(commit_delay, "COMMIT_BUSY_SAMPLE_S", 0.02)
    monkeypatch.setattr(commit_delay, "loop_cpu_time", time.monotonic)


async def test_the_writer_measures_how_busy_its_loop_is(tmp_path: Path) -> None:
    w = Writer(SqliteStorage(tmp_path / "busy.db"), ManualClock(), commit_delay_ms=8.0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    w.commit_delay.measure_busy(start)
    # 0.3 s of this thread's CPU, measured as if over 0.3 s of the loop's
    # clock: on a machine shared with other tests the spin may take longer
    # in wall time, and that is the machine's business, not the measure's
    cpu = time.thread_time()
    while time.thread_time() - cpu < 0.3:
        pass
    w.commit_delay.measure_busy(start + 0.3)
    assert w.commit_delay.loop_busy >= 0.8
    await asyncio.sleep(0.3)
    w.commit_delay.measure_busy(loop.time())
    assert w.commit_delay.loop_busy <= 0.2
    w.commit_delay.measure_busy(loop.time())  # too soon: the last measure stands
    assert w.commit_delay.loop_busy <= 0.2


async def _busy_arrivals(w: Writer, producers: int, turns: int) -> list[Any]:
    """Open-loop load: each producer submits one Acquire per loop turn, then
    keeps the loop's thread 0.2 ms (the ``busy_loop`` fixture says it is
    busy; sleeping lets the writer's thread run)."""
    pending: list[asyncio.Future[Any]] = []

    async def produce(p: int) -> None:
        for t in range(turns):
            pending.append(asyncio.ensure_future(w.submit(L.Acquire(f"s{p}-{t}", "w"))))
            time.sleep(0.0002)  # noqa: ASYNC251 - holds up the loop on purpose
            await asyncio.sleep(0)

    await asyncio.gather(*(produce(p) for p in range(producers)))
    return await asyncio.gather(*pending)


async def test_commit_delay_gathers_bigger_batches_on_a_busy_loop(
    tmp_path: Path, busy_loop: None
) -> None:
    means, held = {}, {}
    for delay in (0.0, 20.0):
        w = Writer(SqliteStorage(tmp_path / f"d{delay}.db"), ManualClock(), commit_delay_ms=delay)
        await w.start()
        try:
            results = await _busy_arrivals(w, 4, 200)
            assert [r.fencing_token for r in results] == [1] * 800
            assert len(w.state.runs) == 800 and w.state.revision == 800
            means[delay], held[delay] = w.stats.mean_batch, w.stats.held
        finally:
            await w.close()
    assert held[0.0] == 0 and held[20.0] >= 5, held
    assert means[20.0] >= 1.5 * means[0.0], means


async def test_commit_delay_holds_nothing_while_the_loop_has_cpu_to_spare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same load, the loop's thread measured as it is (it mostly sleeps):
    no batch is held, since holding would save CPU nobody is short of."""
    from fencepost_server.writer import commit_delay

    monkeypatch.setattr(commit_delay, "COMMIT_BUSY_SAMPLE_S", 0.02)
    w = Writer(SqliteStorage(tmp_path / "idle.db"), ManualClock(), commit_delay_ms=20.0)
    await w.start()
    try:
        await _busy_arrivals(w, 4, 200)
        assert w.stats.held == 0, w.stats
        assert w.commit_delay.loop_busy < 0.5
    finally:
        await w.close()


async def test_commit_delay_never_holds_a_lone_caller(tmp_path: Path) -> None:
    """One caller at a time is never delayed: 20 sequential writes with a 100 ms
    window take well under the 2 s that waiting would cost."""
    w = Writer(SqliteStorage(tmp_path / "lone.db"), ManualClock(), commit_delay_ms=100.0)
    await w.start()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(20):
            await w.submit(L.Acquire(f"l{i}", "w"))
        assert loop.time() - started < 1.0
        assert w.stats.max_batch == 1
    finally:
        await w.close()


async def _closed_loop(w: Writer, callers: int, rounds: int, think_s: float) -> float:
    """``callers`` that each send their next write once the last is answered,
    after ``think_s`` times (its number mod 4) of work elsewhere (so their
    commands trickle in); the seconds it all took."""
    loop = asyncio.get_running_loop()

    async def caller(c: int) -> None:
        for i in range(rounds):
            await w.submit(L.Acquire(f"c{c}-{i}", "w"))
            if think_s:
                await asyncio.sleep(think_s * (c % 4))

    started = loop.time()
    await asyncio.gather(*(caller(c) for c in range(callers)))
    assert w.state.revision == callers * rounds
    return loop.time() - started


@pytest.mark.parametrize("think_s", [0.0, 0.0005])
async def test_commit_delay_costs_a_closed_loop_on_a_busy_server_nothing(
    tmp_path: Path, busy_loop: None, think_s: float
) -> None:
    """16 callers in a closed loop (an engine with 16 runs in flight on one
    stream, or 16 worker processes with a run each) can never queue 32
    commands, so a 100 ms window must cost them nothing, even on a server
    short of CPU: all at once, nothing is held (16 is the most there ever
    are); trickling in, a batch is held until all 16 are in, not for the
    window. It used to hold them, batch after batch, for as long as the
    recent arrival rate needed to reach 32: each hold ran to the window."""
    w = Writer(SqliteStorage(tmp_path / "c.db"), ManualClock(), commit_delay_ms=100.0)
    await w.start()
    try:
        await _closed_loop(w, 16, 60, think_s)
        assert w.stats.max_batch <= 16, w.stats
        if think_s:
            assert w.stats.held >= 10, w.stats
        else:
            assert w.stats.held == 0, w.stats
        assert w.stats.held_to_window == 0, w.stats  # every hold ended by the 16th command
    finally:
        await w.close()


@pytest.mark.parametrize("delay", [-1.0, 100.5])
def test_commit_delay_out_of_range_is_refused(tmp_path: Path, delay: float) -> None:
    with pytest.raises(ValueError, match="commit_delay_ms"):
        Writer(SqliteStorage(tmp_path / "x.db"), ManualClock(), commit_delay_ms=delay)


# -- the runs table is a checkpoint of the change log -------------------------------


def _runs_table(path: Path) -> tuple[dict[str, int], int]:
    """run_id -> version in the runs table, and meta.materialized (read-only)."""
    from fencepost_server.storage.sqlite import open_read_only

    db = open_read_only(path)
    try:
        runs = dict(db.execute("SELECT run_id, version FROM runs"))
        (mark,) = db.execute("SELECT value FROM meta WHERE key = 'materialized'").fetchone()
        return runs, mark
    finally:
        db.close()


async def test_runs_table_trails_the_log_and_catches_up(tmp_path: Path) -> None:
    clock = ManualClock()
    w = Writer(SqliteStorage(tmp_path / "m.db"), clock, materialize_after_ms=1_000)
    await w.start()
    try:
        a = await w.submit(L.Acquire("a", "w"))
        await w.submit(L.RecordCheckpoint("a", "w", a.fencing_token, "k", 1))
        await w.submit(L.Acquire("b", "w"))
        runs, mark = _runs_table(tmp_path / "m.db")
        assert runs == {} and mark == 0  # in the log only: nothing rewritten per command
        clock.advance(1_000)
        await w.submit(L.Acquire("c", "w"))  # this batch copies a and b (pending 1 s)
        runs, mark = _runs_table(tmp_path / "m.db")
        assert runs == {"a": 2, "b": 1} and mark == 3  # c (revision 4) is still pending
        await w.submit(L.DeleteRun("a"))
        clock.advance(1_000)
        await w.submit(L.Acquire("d", "w"))
        runs, mark = _runs_table(tmp_path / "m.db")
        assert runs == {"b": 1, "c": 1} and mark == 5
    finally:
        await w.close()
    runs, mark = _runs_table(tmp_path / "m.db")
    assert runs == {"b": 1, "c": 1, "d": 1} and mark == 6  # a clean close leaves it current


async def test_a_crash_before_materializing_loses_nothing(tmp_path: Path) -> None:
    """What kill -9 leaves: changes committed to the log but not yet copied to
    runs. A new writer replays them, so the state is exact, and writes them."""
    path = tmp_path / "c.db"
    clock = ManualClock()
    w = Writer(SqliteStorage(path), clock)
    await w.start()
    a = await w.submit(L.Acquire("a", "w"))
    await w.submit(L.Finish("a", "w", a.fencing_token, Status.COMPLETED))
    b = await w.submit(L.Acquire("b", "w"))
    await w.submit(L.DeleteRun("b"))
    await w.submit(L.Acquire("e", "w"))
    before = dict(w.state.runs)  # records are never mutated, only replaced
    assert _runs_table(path) == ({}, 0)
    w._apply.pending.clear()  # "dies" with everything pending: close() copies nothing
    await w.close()
    assert _runs_table(path) == ({}, 0)
    w2 = Writer(SqliteStorage(path), clock)
    await w2.start()
    try:
        # the finished run is reflected in runs again, so memory no longer holds it
        assert w2.state.runs == {"e": before["e"]} and w2.state.revision == 5
        reads = Reads(w2.storage, lambda: w2.state)
        assert await reads.read_runs(["a", "e", "b"]) == {"a": before["a"], "e": before["e"]}
        await reads.close()
        assert set(w2.state.index) == {"a", "e"}
        assert w2.state.tombstones == {"b": b.fencing_token}
        assert _runs_table(path) == ({"a": 2, "e": 1}, 5)  # replayed, then written
        again = await w2.submit(L.Acquire("b", "w"))
        assert again.fencing_token > b.fencing_token  # the tombstone held
    finally:
        await w2.close()


async def test_history_pruning_never_drops_an_unmaterialized_change(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    clock = ManualClock()
    w = Writer(SqliteStorage(path), clock, history_revisions=10, prune_every_ms=0,
               materialize_after_ms=60_000)
    await w.start()
    try:
        for i in range(30):
            await w.submit(L.Acquire(f"r{i}", "w"))
        from fencepost_server.storage.sqlite import open_read_only

        db = open_read_only(path)
        (low,) = db.execute("SELECT min(revision) FROM changes").fetchone()
        db.close()
        runs, mark = _runs_table(path)
        # pruned down to the limit, and everything pruned is in runs
        assert low == 30 - 10 + 1 and mark >= low - 1
        assert {f"r{i}" for i in range(low - 1)} <= set(runs)
    finally:
        await w.close()


async def test_a_schema_2_database_keeps_its_runs(tmp_path: Path) -> None:
    from fencepost_server.storage.sqlite import MIGRATIONS

    path = tmp_path / "v2.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    for stmts in MIGRATIONS[:2]:
        for stmt in stmts:
            db.execute(stmt)
    db.execute("PRAGMA user_version=2")
    rec = ('{"schema":1,"run_id":"old","version":3,"status":2,"attempt":1,"fencing_token":4,'
           '"created_at":1,"updated_at":2,"revision":7,"lease":["w",1,99999999999999,60000,0]}')
    db.execute("INSERT INTO runs VALUES ('old', 3, 2, 4, 'w', 7, ?)", (rec,))
    db.execute("INSERT INTO changes VALUES (7, 'old', 1, ?, 2)", (rec,))
    db.execute("UPDATE meta SET value = 7 WHERE key = 'revision'")
    db.close()
    w = Writer(SqliteStorage(path), ManualClock())
    await w.start()
    try:
        assert w.state.runs["old"].fencing_token == 4 and w.state.revision == 7
        assert _runs_table(path) == ({"old": 3}, 7)
        r = await w.submit(L.RecordCheckpoint("old", "w", 4, "k", 1))
        assert r.version == 4 and r.revision == 8
    finally:
        await w.close()


async def test_the_history_limit_prunes_before_the_timer_comes_round(tmp_path: Path) -> None:
    """However fast revisions come, the changes table holds about 1.25 times
    history_revisions (prune_step): the count brings a prune forward, and
    the timer is only the age limit's and the request ids' schedule."""
    from fencepost_server.storage import sqlite as storage_sqlite
    from fencepost_server.writer.apply import prune_step

    path = tmp_path / "count.db"
    w = Writer(SqliteStorage(path), ManualClock(), history_revisions=8,
               prune_every_ms=3_600_000, materialize_after_ms=0)
    await w.start()
    try:
        counts = []
        for i in range(60):  # the clock never moves: the timer never comes round
            await w.submit(L.Acquire(f"r{i}", "w"))
            db = storage_sqlite.open_read_only(path)
            try:
                low, high, count = db.execute(
                    "SELECT min(revision), max(revision), count(*) FROM changes").fetchone()
            finally:
                db.close()
            assert count == high - low + 1, "the history has a hole"
            counts.append(count)
        assert max(counts) <= 8 + prune_step(8), counts
        assert prune_step(8) == 2
        assert counts[-1] >= 8  # never below the limit
    finally:
        await w.close()


async def test_a_pruning_backlog_goes_in_bounded_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch prunes at most PRUNE_CHUNK changes; a backlog is pruned in the
    batches that follow (not one stall every prune_every_ms), oldest first,
    leaving one contiguous history."""
    from fencepost_server.storage import sql as storage_sql
    from fencepost_server.storage import sqlite as storage_sqlite

    monkeypatch.setattr(storage_sql, "PRUNE_CHUNK", 4)
    path = tmp_path / "chunks.db"
    clock = ManualClock()
    # the backlog is one of age: a count limit prunes as the history grows
    w = Writer(SqliteStorage(path), clock, history_revisions=10**9, history_max_age_ms=1_000,
               prune_every_ms=3_600_000, materialize_after_ms=0)
    await w.start()

    def history() -> tuple[int, int, int]:
        db = storage_sqlite.open_read_only(path)
        try:
            return db.execute("SELECT min(revision), max(revision), count(*) FROM changes"
                              ).fetchone()
        finally:
            db.close()

    try:
        for i in range(40):
            await w.submit(L.Acquire(f"r{i}", "w"))
        low, high, count = history()
        assert count == high - low + 1 == 40  # the timer has not come round again
        clock.advance(3_600_000)
        counts = []
        for i in range(40, 52):
            await w.submit(L.Acquire(f"r{i}", "w"))
            low, high, count = history()
            assert count == high - low + 1, "the history has a hole"
            counts.append(count)
        # each batch added one change and pruned at most 4 of the 40 old ones;
        # then the backlog is gone and pruning waits for its timer again
        assert counts == [37, 34, 31, 28, 25, 22, 19, 16, 13, 10, 11, 12], counts
    finally:
        await w.close()


async def test_the_age_limit_prunes_old_changes_and_keeps_young_ones(tmp_path: Path) -> None:
    from fencepost_server.storage import sqlite as storage_sqlite

    path = tmp_path / "age.db"
    clock = ManualClock()
    w = Writer(SqliteStorage(path), clock, history_max_age_ms=1_000, prune_every_ms=0,
               materialize_after_ms=0)
    await w.start()
    try:
        for i in range(5):
            await w.submit(L.Acquire(f"old{i}", "w"))
        clock.advance(5_000)
        for i in range(3):
            await w.submit(L.Acquire(f"young{i}", "w"))
        db = storage_sqlite.open_read_only(path)
        rows = [r for (r,) in db.execute("SELECT run_id FROM changes ORDER BY revision")]
        db.close()
        assert rows == ["young0", "young1", "young2"], rows
        assert w.state.compacted >= 5
    finally:
        await w.close()


async def test_start_builds_the_index_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the state, the run index included, runs in the writer thread:
    with a million runs the index takes seconds, and the event loop must go on
    serving (a new leader's renewals run on it) meanwhile."""
    w = Writer(SqliteStorage(tmp_path / "w.db"), ManualClock())
    await w.start()
    for i in range(20):
        await w.submit(L.Acquire(f"r{i}", "o", ttl_ms=60_000))
    await w.close()

    import threading

    from fencepost_server.writer import writer as writer_module

    built_on: list[threading.Thread] = []
    real = writer_module.RunIndex

    class Spy(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built_on.append(threading.current_thread())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(writer_module, "RunIndex", Spy)
    again = Writer(SqliteStorage(tmp_path / "w.db"), ManualClock())
    await again.start()
    try:
        assert len(again.state.index) == 20
        assert built_on and threading.main_thread() not in built_on, built_on
    finally:
        await again.close()


def test_no_module_assigns_the_writers_attributes() -> None:
    """The writer's seams are handed in (constructor arguments, registration
    methods): no module outside writer/ sets an attribute on a writer."""
    found = []
    for path in sorted(SERVER.rglob("*.py")):
        if path.parent.name == "writer":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value).endswith("writer"):
                    found.append(f"{path.relative_to(SERVER)}:{node.lineno}: {ast.unparse(t)}")
    assert found == []


async def test_engine_hooks_are_handed_in_and_a_lock_fence_reaches_them(tmp_path: Path) -> None:
    """A lock fence goes to the hooks ``attach_engine`` handed in; without
    them it is refused, naming the field."""
    from fencepost_server.core import fence as F

    seen: list[str] = []

    class Hooks:
        executors: dict[type, Any] = {}

        def check_lock_fence(self, db: Any, fence: F.Fence) -> None:
            seen.append(fence.lock_key)

        def extend_leases(self, db: Any, by_ms: int, alive_at: int) -> int:
            return 0

    for attached in (False, True):
        w = Writer(SqliteStorage(tmp_path / f"e{attached}.db"), ManualClock())
        if attached:
            w.attach_engine(Hooks())
        await w.start()
        try:
            fence = F.Fence(fencing_token=1, lock_key="k")
            got = await w.submit(L.Transaction((L.Acquire("r", "w"),), fence=fence))
        except LedgerError as exc:
            got = exc
        finally:
            await w.close()
        if attached:
            assert isinstance(got, L.TransactionDone) and seen == ["k"]
        else:
            assert isinstance(got, LedgerError) and "fence.lock_key" in got.message, got


# -- small batches decided on the loop, their COMMIT on the writer's thread -------------


class StallingStorage(SqliteStorage):
    """A real SQLite file whose COMMITs wait for ``go``: a disk that stalls."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.go = threading.Event()
        self.go.set()
        self.committing = threading.Event()

    def _commit(self, db: sqlite3.Connection) -> None:
        self.committing.set()
        self.go.wait(10)  # bounded: a loop blocked here shows as a failure, not a hang
        super()._commit(db)


async def test_a_stalled_commit_leaves_the_loop_answering_renewals(tmp_path: Path) -> None:
    """A small batch is decided on the loop, but its COMMIT (the fsync) waits
    on the writer's thread: a disk that stalls must not stop renewals from
    memory, which need no disk."""
    storage = StallingStorage(tmp_path / "s.db")
    w = Writer(storage, ManualClock())
    await w.start()
    try:
        held = await w.submit(L.Acquire("held", "a", ttl_ms=60_000))
        storage.go.clear()
        storage.committing.clear()
        write = asyncio.create_task(w.submit(L.Acquire("other", "b")))
        assert await asyncio.to_thread(storage.committing.wait, 5)
        renewed = await w.submit(L.Renew("held", "a", held.fencing_token))  # type: ignore[union-attr]
        assert renewed.lease is not None and not write.done()  # type: ignore[union-attr]
        storage.go.set()
        assert (await write).lease.owner == "b"  # type: ignore[union-attr]
    finally:
        storage.go.set()
        await w.close()


async def test_small_batches_of_ledger_commands_are_decided_on_the_loop(
    tmp_path: Path,
) -> None:
    """Up to LOOP_BATCH ledger commands a thread hop costs more than the
    deciding; a larger batch, or one with an executor's command (an artifact's
    chunks, say), is decided on the writer's thread."""
    from fencepost_server.writer.writer import LOOP_BATCH

    decided: list[threading.Thread] = []
    executed: list[threading.Thread] = []

    def spy_decide(*args: Any) -> L.Decision:
        decided.append(threading.current_thread())
        return L.decide(*args)

    def spy_bump(db: sqlite3.Connection, cmd: Bump, now: int) -> Bumped:
        executed.append(threading.current_thread())
        return bump(db, cmd, now)

    w = Writer(SqliteStorage(tmp_path / "t.db"), ManualClock(), decide=spy_decide)
    w.register(Bump, spy_bump)
    await w.start()
    try:
        await w.submit(L.Acquire("first", "o"))  # waits for the start-up check, off the loop
        decided.clear()
        await w.submit(L.Acquire("small", "o"))
        assert decided == [threading.main_thread()]
        decided.clear()
        await asyncio.gather(*(w.submit(L.Acquire(f"r{i}", "o")) for i in range(2 * LOOP_BATCH)))
        assert decided and threading.main_thread() not in decided
        decided.clear()
        await asyncio.gather(w.submit(L.Acquire("with-bump", "o")), w.submit(Bump("k")))
        assert executed and threading.main_thread() not in executed + decided
    finally:
        await w.close()
