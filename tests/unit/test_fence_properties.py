"""Property: no fenced write ever commits under a token that was not current
at its commit.

Hypothesis generates programs that interleave ownership changes of a ledger
run and of a keyed lock (takeover after expiry, release then acquire, delete
then re-acquire, finish) with fenced writes (single writes and transactions
of several) made with the token of any earlier holder, current or stale. The
program runs against a real writer (real SQLite, the engine store's
executors), in groups submitted together so that many land in one batch and
takeovers happen between writes of the same batch.

The writer applies commands in queue order, so the order of submission is
the order of commit. The oracle walks that order and learns who holds the run
and the lock from the answers of the ownership commands only (never from a
fenced write's answer): each fenced write must be accepted exactly when its
token is current at its position, and at the end the stored rows must be
exactly the accepted writes (the last accepted checkpoint, kv value and lock
document; every accepted step, in order; no refused write visible)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencepost_server.core import engine as E
from fencepost_server.core import ledger as L
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.fence import Fence
from fencepost_server.core.records import Record, Status
from fencepost_server.storage import SqliteStorage
from fencepost_server.storage import engine_sql as Q
from fencepost_server.testing.clock import ManualClock
from fencepost_server.writer import Writer

RUN = "R"
LOCK = "LK"
TTL = 1_000
OWNERS = ("a", "b", "c")

# ops: ("tick",) advances the clock past every ttl (only between groups);
# ownership: ("acquire", owner) ("release", h) ("delete",) ("finish", h)
#            ("lock", owner) ("unlock", h)
# writes:    ("write", t, kind) ("tx", t, n) ("lock_write", t)
# h picks an earlier holder (any, current or stale) by index; a write's token
# is t % 8 + 1 -- tokens are small and sequential, so a write often carries
# the token a takeover earlier in the same batch has just granted, or the one
# it has just made stale.
holder = st.integers(0, 30)
op = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(OWNERS)),
    st.tuples(st.just("release"), holder),
    st.tuples(st.just("delete")),
    st.tuples(st.just("finish"), holder),
    st.tuples(st.just("lock"), st.sampled_from(OWNERS)),
    st.tuples(st.just("unlock"), holder),
    st.tuples(st.just("write"), holder, st.sampled_from(["checkpoint", "kv", "step"])),
    st.tuples(st.just("write"), holder, st.sampled_from(["checkpoint", "kv", "step"])),
    st.tuples(st.just("tx"), holder, st.integers(1, 3)),
    st.tuples(st.just("lock_write"), holder),
)
group = st.tuples(st.booleans(), st.lists(op, min_size=1, max_size=8))  # (tick first?, ops)
program = st.lists(group, min_size=1, max_size=10)


@dataclass
class Write:
    """One fenced write (or transaction) and the token it was made with."""

    seq: int
    fence: Fence
    kinds: tuple[str, ...]


def _fenced_commands(seq: int, kinds: tuple[str, ...], fence: Fence | None) -> list[Any]:
    out: list[Any] = []
    for kind in kinds:
        if kind == "checkpoint":
            out.append(E.SaveCheckpoint(RUN, seq, json.dumps({"seq": seq}), fence=fence))
        elif kind == "kv":
            out.append(E.KvSet("agent", "k", json.dumps(seq), fence=fence))
        elif kind == "step":
            out.append(E.AppendStep(RUN, f"step-{seq}", fence=fence))
        else:  # the lock-fenced document
            out.append(E.DocUpsert("agent", "docs", "d", json.dumps({"seq": seq}), fence=fence))
    return out


async def _run(tmp: Path, prog: list[tuple[bool, list[tuple[Any, ...]]]]) -> tuple[int, int]:
    """Run the program; returns (accepted, refused) fenced writes."""
    clock = ManualClock()
    writer = Writer(SqliteStorage(tmp / "p.db"), clock)
    writer.attach_engine(Q.WriterHooks())
    await writer.start()
    run_holders: list[tuple[str, int]] = []  # (owner, token) of every grant, in order
    lock_holders: list[tuple[str, int]] = []
    # the oracle's view, learned from ownership answers only
    run_state: Record | None = None
    lock_state: tuple[str | None, int] | None = None  # (owner, token)
    accepted: list[Write] = []
    refused = 0
    seq = 0
    try:
        for tick, ops in prog:
            if tick:
                clock.advance(TTL + 1)
            cmds: list[Any] = []
            meta: list[tuple[str, Any]] = []
            for o in ops:
                seq += 1
                name = o[0]
                if name == "acquire":
                    cmds.append(L.Acquire(RUN, o[1], TTL))
                    meta.append(("run", None))
                elif name in ("release", "finish"):
                    if not run_holders:
                        continue
                    owner, token = run_holders[o[1] % len(run_holders)]
                    cmds.append(
                        L.Release(RUN, owner, token)
                        if name == "release"
                        else L.Finish(RUN, owner, token, Status.COMPLETED)
                    )
                    meta.append(("run", None))
                elif name == "delete":
                    cmds.append(L.DeleteRun(RUN))
                    meta.append(("deleted", None))
                elif name == "lock":
                    cmds.append(E.AcquireLock(LOCK, o[1], TTL))
                    meta.append(("lock", o[1]))
                elif name == "unlock":
                    if not lock_holders:
                        continue
                    owner, _ = lock_holders[o[1] % len(lock_holders)]
                    cmds.append(E.ReleaseLock(LOCK, owner))
                    meta.append(("unlock", owner))
                elif name == "lock_write":
                    token = o[1] % 8 + 1
                    fence = Fence(token, lock_key=LOCK)
                    cmds.extend(_fenced_commands(seq, ("doc",), fence))
                    meta.append(("write", Write(seq, fence, ("doc",))))
                else:  # write / tx
                    token = o[1] % 8 + 1
                    fence = Fence(token, run_id=RUN)
                    if name == "write":
                        kinds: tuple[str, ...] = (o[2],)
                        cmds.extend(_fenced_commands(seq, kinds, fence))
                    else:
                        kinds = ("checkpoint", "kv", "step")[: o[2]]
                        cmds.append(L.Transaction(tuple(_fenced_commands(seq, kinds, None)), fence))
                    meta.append(("write", Write(seq, fence, kinds)))
            # submitted in this order, so queued (and committed) in this order
            answers = await asyncio.gather(
                *(writer.submit(c) for c in cmds), return_exceptions=True
            )
            for (what, info), answer in zip(meta, answers, strict=True):
                ok = not isinstance(answer, BaseException)
                if isinstance(answer, BaseException) and not isinstance(answer, LedgerError):
                    raise answer
                if what == "run" and ok:
                    run_state = answer
                    assert isinstance(answer, Record)
                    if answer.lease is not None and (
                        not run_holders or run_holders[-1][1] != answer.fencing_token
                    ):
                        run_holders.append((answer.lease.owner, answer.fencing_token))
                elif what == "deleted" and ok:
                    run_state = None
                elif what == "lock" and ok and answer.acquired:
                    lock_state = (info, answer.fencing_token)
                    if (info, answer.fencing_token) not in lock_holders:
                        lock_holders.append((info, answer.fencing_token))
                elif what == "unlock" and ok and answer.ok:
                    assert lock_state is not None
                    lock_state = (None, lock_state[1])
                elif what == "write":
                    w: Write = info
                    if w.fence.run_id:
                        current = (
                            run_state is not None
                            and run_state.status is Status.RUNNING
                            and run_state.lease is not None
                            and run_state.fencing_token == w.fence.fencing_token
                        )
                        lost = {Code.RUN_LEASE_LOST, Code.RUN_NOT_FOUND}
                    else:
                        current = (
                            lock_state is not None
                            and lock_state[0] is not None
                            and lock_state[1] == w.fence.fencing_token
                        )
                        lost = {Code.LOCK_LOST, Code.RUN_NOT_FOUND}
                    if current:
                        assert ok, f"write {w} under the current token was refused: {answer!r}"
                        accepted.append(w)
                    else:
                        assert not ok, f"write {w} committed under a stale token"
                        refused += 1
                        assert answer.code in lost, answer  # type: ignore[union-attr]
    finally:
        await writer.close()
    _check_rows(tmp / "p.db", accepted)
    return len(accepted), refused


def _check_rows(path: Path, accepted: list[Write]) -> None:
    """The stored rows are exactly what the accepted writes left."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        def last(kind: str) -> int | None:
            seqs = [w.seq for w in accepted if kind in w.kinds]
            return seqs[-1] if seqs else None

        row = db.execute("SELECT step_index, state FROM engine_checkpoints").fetchone()
        want = last("checkpoint")
        assert (row is None) if want is None else row == (want, json.dumps({"seq": want}))
        row = db.execute("SELECT value FROM engine_kv").fetchone()
        want = last("kv")
        assert (row is None) if want is None else row == (json.dumps(want),)
        row = db.execute("SELECT doc FROM engine_docs").fetchone()
        want = last("doc")
        assert (row is None) if want is None else row == (json.dumps({"seq": want}),)
        steps = [r[0] for r in db.execute("SELECT name FROM engine_steps ORDER BY seq")]
        assert steps == [f"step-{w.seq}" for w in accepted if "step" in w.kinds]
    finally:
        db.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program)
def test_no_fenced_write_commits_under_a_token_that_is_not_current(
    prog: list[tuple[bool, list[tuple[Any, ...]]]],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_run(Path(tmp), prog))


def test_the_oracle_sees_stale_writes_refused() -> None:
    """A fixed program: the property's oracle is not vacuous (both outcomes
    happen, and a stale write after a takeover in the same batch is refused)."""
    prog = [
        (False, [("acquire", "a"), ("write", 0, "kv"), ("lock", "a"), ("lock_write", 0)]),
        (True, [("acquire", "b"), ("write", 0, "checkpoint"), ("write", 1, "step"),
                ("tx", 0, 3), ("tx", 1, 3), ("lock", "b"), ("lock_write", 0),
                ("lock_write", 1)]),
        (False, [("release", 1), ("acquire", "c"), ("write", 1, "kv"), ("delete",),
                 ("write", 2, "kv"), ("acquire", "a"), ("write", 3, "step")]),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        accepted, refused = asyncio.run(_run(Path(tmp), prog))
    # accepted: a's kv and lock write; b's step, tx and lock write (in the batch
    # of their takeover); a's step after the delete and re-acquire (token 4)
    assert (accepted, refused) == (6, 5)
