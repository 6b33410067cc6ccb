"""The linearizability checker on small hand-written histories that are, and
are not, linearizable (a versioned register with compare-and-set; operations
with unknown outcome may or may not have taken effect)."""

from __future__ import annotations

import random
import time

from _hist import op, rec

from torture.history import QUEUED, SUSPENDED, Op
from torture.linearizability import check_run


def lin(*ops: Op) -> bool:
    return check_run(sorted(ops, key=lambda o: o.inv), "r").ok


def test_sequential_history_is_linearizable() -> None:
    assert lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, 3, r=rec(2), owner="A", token=1),
        op("get_run", 4, 5, r=rec(2)),
        op("release", 6, 7, r=rec(3, owner=None, status=QUEUED), owner="A", token=1),
        op("raw_get", 8, 9, r=rec(3, owner=None, status=QUEUED), x={"found": True}),
    )


def test_stale_read_after_a_completed_write_is_not() -> None:
    res = check_run([
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, 3, r=rec(2), owner="A", token=1),
        op("get_run", 4, 5, r=rec(1)),  # the renew completed before this read began
    ], "r")
    assert not res.ok
    assert "get_run" in res.message and "v2" in res.message


def test_read_concurrent_with_a_write_may_see_either_value() -> None:
    for seen in (rec(1), rec(2)):
        assert lin(
            op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
            op("renew", 2, 6, r=rec(2), owner="A", token=1),
            op("get_run", 3, 5, r=seen),
        )


def test_reads_must_agree_on_an_order() -> None:
    # two reads overlapping one write; the first to finish saw the new value,
    # the one that began after it finished saw the old one
    assert not lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, 10, r=rec(2), owner="A", token=1),
        op("get_run", 3, 4, r=rec(2)),
        op("get_run", 5, 6, r=rec(1)),
    )


def test_lost_update_two_writes_from_the_same_version() -> None:
    assert not lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("raw_cas", 2, 4, r=rec(2, owner="X", rev=2), x={"swapped": True}, expected=1,
           next=rec(2, owner="X", rev=0)),
        op("raw_cas", 3, 5, r=rec(2, owner="Y", rev=3), x={"swapped": True}, expected=1,
           next=rec(2, owner="Y", rev=0)),
    )


def test_writes_must_respect_real_time() -> None:
    # B's write completed before C's began, yet C's result precedes it
    assert not lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 5, 6, r=rec(3), owner="A", token=1),
        op("renew", 7, 8, r=rec(2), owner="A", token=1),
    )


def test_refusal_is_a_read_of_the_record_it_carries() -> None:
    assert lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("acquire", 2, 3, "fail", rec(1), code="RUN_LEASE_HELD", owner="B", ttl=1000),
    )
    assert not lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, 3, r=rec(2), owner="A", token=1),
        op("acquire", 4, 5, "fail", rec(1), code="RUN_LEASE_HELD", owner="B", ttl=1000),
    )


def test_unknown_write_may_have_taken_effect() -> None:
    unknown = op("renew", 2, None, "unknown", code="UNAVAILABLE", owner="A", token=1)
    assert lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        unknown,
        op("get_run", 5, 6, r=rec(2)),  # nobody known wrote v2: the unknown renew did
    )


def test_unknown_write_may_not_have_taken_effect() -> None:
    assert lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, None, "unknown", code="UNAVAILABLE", owner="A", token=1),
        op("get_run", 5, 6, r=rec(1)),
        op("renew", 7, 8, r=rec(2, rev=9), owner="A", token=1),
    )


def test_unknown_write_cannot_explain_a_value_it_could_not_have_written() -> None:
    # v2 is owned by B under token 1: no known op wrote it and A's unknown renew
    # keeps A as the owner
    assert not lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, None, "unknown", code="UNAVAILABLE", owner="A", token=1),
        op("get_run", 5, 6, r=rec(2, owner="B")),
    )


def test_unknown_fenced_write_needs_its_fence() -> None:
    # B took the run (token 2); A's unknown renew with token 1 cannot then write v3
    assert not lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("acquire", 2, 3, r=rec(2, tok=2, owner="B"), owner="B", ttl=1000),
        op("renew", 4, None, "unknown", code="UNAVAILABLE", owner="A", token=1),
        op("get_run", 6, 7, r=rec(3, tok=2, owner="A")),
    )


def test_unknown_raw_cas_writes_exactly_what_it_asked() -> None:
    asked = rec(2, owner="X", rev=0, checkpoint_ref=["raw:1", 0, 1])
    base = [op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
            op("raw_cas", 2, None, "unknown", code="DEADLINE_EXCEEDED", expected=1, next=asked)]
    assert lin(*base, op("get_run", 5, 6, r=dict(asked, revision=7)))
    wrong = dict(asked, revision=7, checkpoint_ref=["raw:2", 0, 1])
    assert not lin(*base, op("get_run", 5, 6, r=wrong))


def test_unknown_op_is_carried_across_segments() -> None:
    # the unknown acquire is invoked in the first segment and only observed much later
    assert lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("release", 2, 3, r=rec(2, owner=None, status=QUEUED), owner="A", token=1),
        op("acquire", 4, None, "unknown", code="UNAVAILABLE", owner="B", ttl=1000),
        op("get_run", 10, 11, r=rec(2, owner=None, status=QUEUED)),
        op("get_run", 20, 21, r=rec(3, tok=2, owner="B")),
    )


def test_segment_end_state_is_chosen_by_backtracking() -> None:
    # segment 1 can end with or without the unknown suspend; only "with" fits segment 2
    assert lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("suspend", 2, None, "unknown", code="UNAVAILABLE", owner="A", token=1),
        op("get_run", 3, 4, r=rec(1)),
        op("get_run", 10, 11, r=rec(2, owner=None, status=SUSPENDED)),
    )


def test_delete_and_recreate() -> None:
    assert lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("delete_run", 2, 3, x={"deleted": True, "revision": 2, "token": 1}),
        op("get_run", 4, 5, "fail", code="RUN_NOT_FOUND"),
        op("raw_get", 4, 5, x={"found": False}),
        op("acquire", 6, 7, r=rec(1, tok=2, owner="B", rev=3), owner="B", ttl=1000),
    )
    # a delete answering another token than the record's
    assert not lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("delete_run", 2, 3, x={"deleted": True, "revision": 2, "token": 5}),
    )


def test_converging_finish_is_a_read_when_already_done() -> None:
    done = rec(3, owner=None, status=4)
    assert lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, 3, r=rec(2), owner="A", token=1),
        op("finish", 4, 5, r=done, owner="A", token=1, status=4),
        op("finish", 6, 7, r=done, owner="A", token=1, status=4),  # the retry converged
    )


def test_validate_fence_is_a_partial_read() -> None:
    base = [op("acquire", 0, 1, r=rec(1, tok=3), owner="A", ttl=1000)]
    ok = {"found": True, "token": 3, "status": 2, "current": True}
    assert lin(*base, op("validate", 2, 3, x=ok, token=3))
    assert not lin(*base, op("validate", 2, 3, x=dict(ok, token=2), token=3))
    assert not lin(*base, op("validate", 2, 3, x=dict(ok, current=False), token=3))


def test_list_runs_entries_are_reads() -> None:
    assert not lin(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, 3, r=rec(2), owner="A", token=1),
        op("list", 4, 5, run="*", x={"runs": {"r": rec(1)}}),
    )


def test_a_long_contended_history_checks_fast() -> None:
    """5 000 operations of 8 concurrent clients, with unknowns: well under a second."""
    rng = random.Random(7)
    ops: list[Op] = []
    t, v = 0.0, 0
    cur = None
    for _ in range(5000):
        t += 1
        kind = rng.random()
        if kind < 0.5 or cur is None:
            v += 1
            cur = rec(v, rev=v)
            ops.append(op("renew", t, t + rng.uniform(0.5, 6), r=cur, owner="A", token=1))
            t += 0.2
        elif kind < 0.55:
            ops.append(op("renew", t, None, "unknown", code="UNAVAILABLE", owner="A", token=9))
        else:
            ops.append(op("get_run", t + 0.1, t + 0.3, r=cur))
    ops[0] = op("acquire", 0, 1, r=rec(1, rev=1), owner="A", ttl=1000)
    started = time.perf_counter()
    res = check_run(sorted(ops, key=lambda o: o.inv), "r")
    took = time.perf_counter() - started
    assert res.ok, res.message
    assert took < 5, f"{took:.1f} s"
