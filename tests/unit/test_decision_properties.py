"""Property tests: random command sequences through the pure decisions keep the
invariants of docs/SPEC.md §3 and §9 (tokens never go back, one holder at a time,
terminal is final, version +1 per write, legal transitions only)."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from fencepost_server.core import ledger as L
from fencepost_server.core.errors import LedgerError
from fencepost_server.core.records import Outcome, Record, Status, can_transition, is_terminal

OWNERS = ["a", "b", "c"]


@st.composite
def step(draw: st.DrawFn) -> tuple[int, L.Command]:
    dt = draw(st.integers(0, 400))
    owner = draw(st.sampled_from(OWNERS))
    tok = draw(st.integers(1, 8))
    kind = draw(st.integers(0, 10))
    cmd: L.Command
    if kind <= 2:
        cmd = L.Acquire(
            "r", owner, draw(st.sampled_from([100, 250, 1000])), draw(st.sampled_from([0, 0, 200]))
        )
    elif kind == 3:
        cmd = L.Renew("r", owner, tok, draw(st.none() | st.sampled_from([100, 500])))
    elif kind == 4:
        cmd = L.RecordCheckpoint("r", owner, tok, "k", draw(st.integers(0, 3)))
    elif kind == 5:
        cmd = L.Suspend("r", owner, tok, ("x",))
    elif kind == 6:
        status = draw(st.sampled_from([Status.COMPLETED, Status.FAILED, Status.CANCELLED]))
        cmd = L.Finish("r", owner, tok, status, Outcome("e") if status is Status.FAILED else None)
    elif kind == 7:
        cmd = L.Release("r", owner, tok)
    elif kind == 8:
        cmd = L.Cancel("r")
    elif kind == 9:
        cmd = L.RequestResume("r")
    else:
        cmd = L.DeleteRun("r") if draw(st.integers(0, 5)) == 0 else L.RequestResume("r")
    return dt, cmd


FENCED = (L.Renew, L.RecordCheckpoint, L.Suspend, L.Finish, L.Release)


@settings(max_examples=400, deadline=None)
@given(st.lists(step(), min_size=1, max_size=60))
def test_invariants_hold_over_random_histories(steps: list[tuple[int, L.Command]]) -> None:
    now, rev = 1_000, 0
    cur: Record | None = None
    tomb = 0
    max_token = 0
    for dt, cmd in steps:
        now += dt
        before = copy.deepcopy(cur), copy.deepcopy(cmd)
        try:
            d = L.decide(cmd, cur, tomb, now, rev + 1)
        except LedgerError:
            assert (cur, cmd) == before  # records are values: never mutated
            continue
        assert (cur, cmd) == before
        if d.change is None:
            continue
        rev += 1
        if isinstance(d.change, L.Delete):
            assert cur is not None
            tomb = max(tomb, d.change.fencing_token)
            cur = None
            continue
        new = d.change.record
        # tokens never go backwards and never repeat across deletes
        assert new.fencing_token >= max_token
        if cur is None:
            assert new.fencing_token > tomb and new.version == 1
        else:
            assert new.version == cur.version + 1
            # terminal is final; status moves are legal
            assert not is_terminal(cur.status)
            assert new.status is cur.status or can_transition(cur.status, new.status)
            if isinstance(cmd, FENCED):
                # a fenced write succeeds only for the current holder's token
                assert cur.lease is not None
                assert cmd.fencing_token == cur.fencing_token and cmd.owner == cur.lease.owner
                assert new.fencing_token == cur.fencing_token
            if isinstance(cmd, L.Acquire):
                assert new.fencing_token == cur.fencing_token + 1
                # never granted to another owner while a live lease (+delay) blocks it
                if cur.lease is not None and cur.lease.owner != cmd.owner:
                    assert not cur.lease.blocks_others(now)
        if new.lease is not None:
            assert new.status is Status.RUNNING
        max_token = max(max_token, new.fencing_token)
        cur = new


# -- request-id fingerprints ------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(step(), st.text(max_size=20))
def test_fingerprint_is_the_documented_repr_digest(dt_cmd: tuple[int, L.Command], rid: str) -> None:
    """Stored fingerprints outlive a release (request ids are kept >= 10 min), so
    the fast field-by-field form must equal the documented one exactly:
    blake2b of repr(dataclasses.replace(cmd, request_id="")), without the
    ``fence=None`` of an unfenced command (the form before fences existed)."""
    import dataclasses
    import hashlib

    from fencepost_server.core import codec

    cmd = dataclasses.replace(dt_cmd[1], request_id=rid)
    slow = repr(dataclasses.replace(cmd, request_id="")).replace(", fence=None)", ")")
    assert codec.fingerprint(cmd) == hashlib.blake2b(slow.encode(), digest_size=16).hexdigest()
    assert cmd.request_id == rid  # the command is not changed
