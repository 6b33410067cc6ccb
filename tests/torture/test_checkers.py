"""The fencing, durability, token, liveness and committed-history checkers on
small hand-written histories, each with a good and a bad variant."""

from __future__ import annotations

from typing import Any

from _hist import op, rec

from torture import checkers as C
from torture.history import QUEUED, Op


def checks(*ops: Op) -> dict[str, int]:
    ops_ = sorted(ops, key=lambda o: o.inv)
    bad, results = C.check_linearizability(ops_)
    bad += C.check_fencing(results) + C.check_handles(ops_, results) + C.check_tokens(ops_)
    bad += C.check_answers(ops_)
    out: dict[str, int] = {}
    for v in bad:
        out[v.check] = out.get(v.check, 0) + 1
    return out


def test_a_clean_takeover_has_no_violation() -> None:
    assert checks(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("renew", 2, 3, r=rec(2), owner="A", token=1, since=1),
        op("acquire", 10, 11, r=rec(3, tok=2, owner="B", rev=3), owner="B", ttl=1000),
        op("renew", 12, 13, "fail", rec(3, tok=2, owner="B", rev=3), code="RUN_LEASE_LOST",
           owner="A", token=1, since=1),
        op("renew", 14, 15, r=rec(4, tok=2, owner="B"), owner="B", token=2, since=3),
    ) == {}


def test_a_write_accepted_from_the_wrong_owner_is_caught() -> None:
    # a raw CAS gives the lease to X under the same token; A's renew must then fail
    stolen = rec(2, owner="X", rev=2)
    found = checks(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("raw_cas", 2, 3, r=stolen, x={"swapped": True}, expected=1,
           next=dict(stolen, revision=0)),
        op("renew", 4, 5, r=rec(3, owner="X"), owner="A", token=1, since=1),
    )
    assert found.get("fencing") == 1  # at its linearization point
    assert found.get("handles") == 1  # in real time
    assert found.get("answers") == 1  # and the answer itself names another owner


def test_a_stale_token_write_is_caught_in_real_time() -> None:
    found = checks(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("acquire", 2, 3, r=rec(2, tok=2, owner="B"), owner="B", ttl=1000),
        # accepted although B's acquisition completed before it began
        op("release", 4, 5, r=rec(3, tok=1, owner=None, status=QUEUED), owner="A", token=1,
           since=1),
    )
    assert found.get("handles") == 1
    assert found.get("linearizability", 0) + found.get("tokens", 0) >= 1  # token went back


def test_a_converged_retry_is_not_a_second_write() -> None:
    done = rec(2, owner=None, status=QUEUED)
    assert checks(
        op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
        op("release", 2, 3, r=done, owner="A", token=1, since=1),
        op("get_run", 4, 5, r=done),
        op("release", 6, 7, r=done, owner="A", token=1, since=1),  # converged: unchanged
    ) == {}


def test_tokens_never_go_backwards_or_repeat() -> None:
    ops = [
        op("acquire", 0, 1, r=rec(1, tok=3), owner="A", ttl=1000),
        op("delete_run", 2, 3, x={"deleted": True, "revision": 2, "token": 3}),
        op("acquire", 4, 5, r=rec(1, tok=3, owner="B", rev=3), owner="B", ttl=1000),
    ]
    bad = C.check_tokens(ops)
    assert any("granted twice" in v.message for v in bad)
    assert any("had been observed" in v.message for v in bad)
    ok = [*ops[:2], op("acquire", 4, 5, r=rec(1, tok=4, owner="B", rev=3), owner="B", ttl=1000)]
    assert C.check_tokens(ok) == []


def _probe(n: int, inv: float, r: dict[str, Any] | None, run: str = "r") -> Op:
    if r is None:
        return op("get_run", inv, inv + 1, "fail", code="RUN_NOT_FOUND", client=f"probe{n}",
                  run=run)
    return op("get_run", inv, inv + 1, r=r, client=f"probe{n}", run=run,
              x={"revision": r["revision"]})


def test_durability_after_restart() -> None:
    acked = [op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
             op("renew", 2, 3, r=rec(2), owner="A", token=1, since=1)]
    kill = [{"restart": 1, "killed": int(4e6)}]
    assert C.check_durability_restarts([*acked, _probe(1, 6, rec(2))], kill) == []
    lost = C.check_durability_restarts([*acked, _probe(1, 6, rec(1))], kill)
    assert len(lost) == 2 and "renew" in lost[-1].message  # the run, and the revision
    # a write acknowledged after the kill (a retry answered by the new server) is not owed
    late = [*acked[:1], op("renew", 2, 7, r=rec(2), owner="A", token=1, since=1)]
    assert C.check_durability_restarts([*late, _probe(1, 5, rec(1))], kill) == []
    # gone after the restart: only fine when a delete was acknowledged
    gone = C.check_durability_restarts([*acked, _probe(1, 6, None)], kill)
    assert len(gone) == 1
    deleted = [*acked, op("delete_run", 3.5, 3.9, x={"deleted": True, "revision": 3, "token": 1})]
    assert C.check_durability_restarts([*deleted, _probe(1, 6, None)], kill) == []


def test_a_probe_name_reused_by_a_later_restart_belongs_to_that_restart() -> None:
    """Probe clients' names repeat past runner.MAX_PROBES restarts: a later
    restart's probe (the run deleted by then) is not restart #1's."""
    acked = [op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
             op("delete_run", 10, 11, x={"deleted": True, "revision": 2, "token": 1})]
    kills = [{"restart": 1, "killed": int(4e6)}, {"restart": 65, "killed": int(20e6)}]
    assert C.check_durability_restarts([*acked, _probe(1, 6, rec(1)), _probe(1, 22, None)],
                                       kills) == []
    lost = C.check_durability_restarts([*acked, _probe(1, 6, None), _probe(1, 22, None)], kills)
    assert len(lost) == 1 and "restart #1" in lost[0].message


def _snap(changes: list[tuple[int, str, int, dict[str, Any] | None]],
          integrity: tuple[str, ...] = ("ok",)) -> Any:
    from _history import Change, Snapshot

    chs = [Change(rev, run, kind, r, 0) for rev, run, kind, r in changes]
    runs: dict[str, Any] = {}
    for c in chs:
        if c.kind == 2:
            runs.pop(c.run_id, None)
        else:
            assert c.rec is not None
            runs[c.run_id] = {"record": c.rec}
    meta = chs[-1].revision if chs else 0
    return Snapshot(chs, runs, meta, list(integrity))


def test_every_acknowledged_value_is_committed() -> None:
    snap = _snap([(1, "r", 1, rec(1)), (2, "r", 1, rec(2))])
    ops = [op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000),
           op("renew", 2, 3, r=rec(2), owner="A", token=1, since=1)]
    assert C.check_durability_final(ops, snap) == []
    lost = [*ops, op("renew", 4, 5, r=rec(3), owner="A", token=1, since=1)]
    assert len(C.check_durability_final(lost, snap)) == 1
    other = [*ops, op("get_run", 4, 5, r=rec(2, owner="Z"))]  # a value never committed
    assert len(C.check_durability_final(other, snap)) == 1


def test_committed_history_rules() -> None:
    good = _snap([(1, "r", 1, rec(1)), (2, "r", 1, rec(2, owner=None, status=4)),
                  (3, "r", 2, None), (4, "r", 1, rec(1, tok=2, rev=4))])
    assert C.check_committed(good, []) == []
    assert C.check_committed(_snap([(1, "r", 1, rec(1))], integrity=("bad page",)), [])
    gap = _snap([(1, "r", 1, rec(1)), (3, "r", 1, rec(2, rev=3))])
    assert any("gap" in v.message for v in C.check_committed(gap, []))
    reopened = _snap([(1, "r", 1, rec(1)), (2, "r", 1, rec(2, owner=None, status=4)),
                      (3, "r", 1, rec(3, tok=2, owner="B"))])
    assert any("terminal" in v.message for v in C.check_committed(reopened, []))
    early = dict(rec(2, tok=2, owner="B"), attempt=2)
    early["lease"] = ["B", 500, 1500, 1000, 0]  # A's lease (0..1000) was still live at 500
    taken = _snap([(1, "r", 1, rec(1)), (2, "r", 1, early)])
    assert any("held until" in v.message for v in C.check_committed(taken, []))
    recreated_low = _snap([(1, "r", 1, rec(1, tok=5)), (2, "r", 2, None),
                           (3, "r", 1, rec(1, tok=5, rev=3))])
    assert any("recreated" in v.message for v in C.check_tokens([], recreated_low))


def test_an_acquisition_before_an_acknowledged_renewal_ran_out_is_caught() -> None:
    """Renewals are answered from memory: the history holds the acquire's
    expiry (0..1000), the client the renewal's (until 3000 + lock-delay)."""
    renewed = rec(1)
    renewed["lease"] = ["A", 0, 3000, 1000, 200]
    hist = [(1, "r", 1, dict(rec(1), lease=["A", 0, 1000, 1000, 200]))]
    ack = op("renew", 10, 11, "ok", renewed, owner="A", token=1)

    def taken_at(at: int) -> Any:
        took = dict(rec(2, tok=2, owner="B"), attempt=2, lease=["B", at, at + 1000, 1000, 0])
        return _snap([*hist, (2, "r", 1, took)])

    early = C.check_committed(taken_at(3100), [ack])
    assert [v.check for v in early] == ["renewals"] and "until 3200" in early[0].message
    assert C.check_committed(taken_at(3200), [ack]) == []
    assert C.check_committed(taken_at(3100), []) == []  # no renewal: the history's 1200 rules


def test_liveness_bound() -> None:
    assert C.check_liveness([{"run": "r", "ok": True, "seconds": 1.0}], 10) == []
    assert len(C.check_liveness([{"run": "r", "ok": True, "seconds": 12.0}], 10)) == 1
    assert len(C.check_liveness([{"run": "r", "ok": False, "seconds": 10.0, "why": "x"}],
                                10)) == 1


def test_invalid_status_is_reported() -> None:
    bad = C.check_answers([op("renew", 0, None, "unknown", code="INTERNAL", owner="A", token=1)])
    assert len(bad) == 1


def test_a_recreated_run_is_not_mistaken_for_the_one_before() -> None:
    """Two records of version 1 a delete apart, the later writes answered
    after retries that span the others: only the revisions tell the order.
    An order that put B's renew on A's record would be a fencing violation
    that never happened."""
    assert checks(
        op("get_run", 0, 1, "fail", code="RUN_NOT_FOUND"),
        op("raw_delete", 1, 40, x={"deleted": True, "revision": 48}),
        op("acquire", 1, 41, r=rec(1, tok=52, owner="B", rev=49), owner="B", ttl=1000),
        op("acquire", 20, 21, r=rec(1, tok=51, owner="A", rev=46), owner="A", ttl=1000),
        op("renew", 50, 51, r=rec(2, tok=52, owner="B", rev=53), owner="B", token=52, since=1),
    ) == {}
    # and a renew of B's record with no delete between the two is still caught
    assert checks(
        op("get_run", 0, 1, "fail", code="RUN_NOT_FOUND"),
        op("acquire", 20, 21, r=rec(1, tok=51, owner="A", rev=46), owner="A", ttl=1000),
        op("renew", 50, 51, r=rec(2, tok=52, owner="B", rev=53), owner="B", token=52, since=1),
    ).get("fencing") == 1


def test_a_probe_refused_not_owner_is_not_read_as_the_run_gone() -> None:
    """Leading shards apart, a probe refused NOT_OWNER (its shard still
    moving) read nothing; only RUN_NOT_FOUND says the run is gone."""
    acked = [op("acquire", 0, 1, r=rec(1), owner="A", ttl=1000)]
    kill = [{"restart": 1, "killed": int(4e6)}]
    refused = op("get_run", 6, 7, "fail", code="NOT_OWNER", client="probe1", run="r")
    assert C.check_durability_restarts([*acked, refused], kill, sharded=True) == []
    gone = C.check_durability_restarts([*acked, _probe(1, 6, None)], kill, sharded=True)
    assert len(gone) == 1 and "gone" in gone[0].message
