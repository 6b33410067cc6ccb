"""The ListRuns indexes (server/fencepost_server/index.py) agree with a full
scan after any sequence of puts and deletes, and a filtered walk visits only
the runs its index holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fencepost_server.core.records import Lease, Record, Status
from fencepost_server.writer.index import RunIndex

IDS = [f"run-{i:02d}" for i in range(12)]
OWNERS = ["", "w1", "w2", "w3"]


def _record(run_id: str, status: Status, owner: str) -> Record:
    lease = Lease(owner, 0, 1_000, 1_000) if owner else None
    return Record(run_id, 1, status, 1, 1, 0, 0, lease=lease)


def _admits(rec: Record, statuses: frozenset[Status], owner: str) -> bool:
    if statuses and rec.status not in statuses:
        return False
    return not owner or (rec.lease is not None and rec.lease.owner == owner)


ops = st.lists(
    st.tuples(st.sampled_from(IDS), st.none() | st.tuples(st.sampled_from(list(Status)),
                                                            st.sampled_from(OWNERS))),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, statuses=st.frozensets(st.sampled_from(list(Status)), max_size=3),
       owner=st.sampled_from(OWNERS), after=st.none() | st.sampled_from(IDS))
def test_index_walk_equals_a_full_scan(
    ops: list, statuses: frozenset[Status], owner: str, after: str | None
) -> None:
    runs: dict[str, Record] = {}
    index = RunIndex()
    for run_id, put in ops:
        old = runs.get(run_id)
        new = _record(run_id, *put) if put is not None else None
        if old is None and new is None:
            continue
        index.update(run_id, new)
        if new is None:
            del runs[run_id]
        else:
            runs[run_id] = new
    expected = [k for k in sorted(runs) if (after is None or k > after)
                and _admits(runs[k], statuses, owner)]
    walked = [k for k in index.candidates(after, statuses, owner)
              if _admits(runs[k], statuses, owner)]
    assert walked == expected
    assert list(RunIndex(runs.values()).candidates(after, statuses, owner)) == \
        list(index.candidates(after, statuses, owner))  # bulk build == incremental
    assert list(index) == sorted(runs)


def test_a_filtered_walk_visits_only_its_matches() -> None:
    runs = [_record(f"r{i:05d}", Status.COMPLETED, "") for i in range(10_000)]
    runs += [_record(f"r{i:05d}x", Status.RUNNING, f"w{i // 2000 % 2}")
             for i in range(0, 10_000, 2000)]
    index = RunIndex(runs)
    assert len(list(index.candidates(None, frozenset({Status.RUNNING}), ""))) == 5
    assert len(list(index.candidates(None, frozenset(), "w0"))) == 3
    assert list(index.candidates("r04000x", frozenset({Status.RUNNING, Status.QUEUED}), "")) == \
        ["r06000x", "r08000x"]


def test_the_same_move_twice_changes_nothing_more() -> None:
    """The writer may publish one batch twice (the test-only ack-before-commit
    build does): the index must not grow duplicates or fail on a second drop."""
    a = _record("a", Status.RUNNING, "w1")
    done = _record("a", Status.COMPLETED, "")
    index = RunIndex()
    for _ in range(2):
        index.update("a", a)
    assert list(index) == ["a"] and list(index.candidates(None, frozenset(), "w1")) == ["a"]
    for _ in range(2):
        index.update("a", done)
    assert list(index.candidates(None, frozenset({Status.RUNNING}), "")) == []
    assert list(index.candidates(None, frozenset({Status.COMPLETED}), "")) == ["a"]
    for _ in range(2):
        index.update("a", None)
    assert len(index) == 0 and not index.by_status and not index.by_owner


@settings(max_examples=300, deadline=None)
@given(ops=ops, statuses=st.frozensets(st.sampled_from(list(Status)), max_size=3),
       owner=st.sampled_from(OWNERS), prefix=st.sampled_from(["", "run-0", "run-1", "x"]),
       bound=st.none() | st.sampled_from(IDS), reverse=st.booleans())
def test_a_prefixed_walk_either_way_equals_a_full_scan(
    ops: list, statuses: frozenset[Status], owner: str, prefix: str, bound: str | None,
    reverse: bool,
) -> None:
    runs: dict[str, Record] = {}
    index = RunIndex()
    for run_id, put in ops:
        old, new = runs.get(run_id), (_record(run_id, *put) if put is not None else None)
        if old is None and new is None:
            continue
        index.update(run_id, new)
        runs.pop(run_id, None) if new is None else runs.__setitem__(run_id, new)
    keys = [k for k in sorted(runs) if k.startswith(prefix) and _admits(runs[k], statuses, owner)]
    if reverse:
        expected = [k for k in reversed(keys) if bound is None or k < bound]
        walk = index.walk(statuses, owner, prefix=prefix, before=bound, reverse=True)
    else:
        expected = [k for k in keys if bound is None or k > bound]
        walk = index.walk(statuses, owner, prefix=prefix, after=bound)
    assert [k for k in walk if _admits(runs[k], statuses, owner)] == expected


def _entries(index: RunIndex) -> tuple[list[str], dict[Status, list[str]], dict[str, list[str]]]:
    return (list(index), {k: list(v) for k, v in index.by_status.items()},
            {k: list(v) for k, v in index.by_owner.items()})


@settings(max_examples=200, deadline=None)
@given(
    runs=st.dictionaries(
        st.one_of(st.uuids().map(lambda u: u.hex),
                  st.integers(0, 10**6).map(lambda i: f"r{i:07d}")),
        st.tuples(st.sampled_from(list(Status)), st.sampled_from(OWNERS), st.booleans()),
        max_size=80,
    ),
    order=st.sampled_from(["sorted", "reversed", "shuffled"]),
    data=st.data(),
)
def test_the_bulk_build_from_groups_equals_inserts_one_at_a_time(
    runs: dict, order: str, data: st.DataObject
) -> None:
    """What start-up does (records in memory, the rest as (status, owner, ids)
    groups in whatever order the database gives them) builds exactly the
    index that inserting every run one at a time builds, for random (UUID)
    and sorted ids alike."""
    records = {k: _record(k, status, owner) for k, (status, owner, _) in runs.items()}
    one_by_one = RunIndex()
    for rec in data.draw(st.permutations(list(records.values()))):
        one_by_one.update(rec.run_id, rec)
    hot = [records[k] for k, (_, _, in_memory) in runs.items() if in_memory]
    groups: dict[tuple[int, str | None], list[str]] = {}
    for k, (status, owner, in_memory) in runs.items():
        if not in_memory:
            groups.setdefault((int(status), owner or None), []).append(k)
    cold = []
    for (status, owner), ids in groups.items():
        ids = sorted(ids, reverse=order == "reversed")
        if order == "shuffled":
            ids = data.draw(st.permutations(ids))
        # a group may come split in two (the log's replayed runs join as their own)
        cut = data.draw(st.integers(0, len(ids)))
        cold += [(status, owner, ids[:cut]), (status, owner, ids[cut:])]
    assert _entries(RunIndex(hot, cold=cold)) == _entries(one_by_one)


def test_a_move_leaves_no_entry_behind_whatever_the_caller_knew() -> None:
    """The index knows where each run is indexed, so moving a run (even one
    the caller only knows by id, as a finished run read back from the
    database is) takes it out of its old status and owner lists."""
    index = RunIndex([_record("a", Status.RUNNING, "w1"), _record("b", Status.RUNNING, "w2")],
                     cold=[(int(Status.COMPLETED), None, ["c"])])
    index.update("a", _record("a", Status.COMPLETED, ""))
    index.update("c", _record("c", Status.RUNNING, "w2"))
    assert list(index.candidates(None, frozenset({Status.RUNNING}), "")) == ["b", "c"]
    assert list(index.candidates(None, frozenset({Status.COMPLETED}), "")) == ["a"]
    assert list(index.candidates(None, frozenset(), "w1")) == []
    assert list(index.candidates(None, frozenset(), "w2")) == ["b", "c"]
    assert list(index) == ["a", "b", "c"] and "c" in index and "d" not in index
    index.update("d", None)  # never indexed: nothing to drop
    index.update("c", None)
    assert list(index) == ["a", "b"] and len(index) == 2 and index.status_of == {
        "a": Status.COMPLETED, "b": Status.RUNNING} and index.owner_of == {"b": "w2"}
