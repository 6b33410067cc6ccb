"""docs/SPEC.md §3: every row of the lifecycle table, and nothing else."""

from __future__ import annotations

import itertools

import pytest

from fencepost_server.core.records import Status, can_transition, is_terminal

Q, R, S, C, F, X = (
    Status.QUEUED,
    Status.RUNNING,
    Status.SUSPENDED,
    Status.COMPLETED,
    Status.FAILED,
    Status.CANCELLED,
)

LEGAL = {
    (Q, R),
    (Q, X),
    (Q, F),
    (R, S),
    (R, C),
    (R, F),
    (R, X),
    (R, Q),
    (S, Q),
    (S, R),
    (S, X),
    (S, F),
}


@pytest.mark.parametrize("src,dst", list(itertools.product(Status, Status)))
def test_transition_table(src: Status, dst: Status) -> None:
    assert can_transition(src, dst) is ((src, dst) in LEGAL)


def test_same_status_is_not_a_transition() -> None:
    assert not any(can_transition(s, s) for s in Status)


def test_terminal_statuses() -> None:
    assert {s for s in Status if is_terminal(s)} == {C, F, X}
    for t in (C, F, X):
        assert not any(can_transition(t, d) for d in Status)
