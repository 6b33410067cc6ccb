"""Which owner a coordinator leading shards apart names when it refuses a
call (ha/sharded.py ``named_owners``): during a move the two coordinators
must never name each other, or a client goes back and forth between them."""

from __future__ import annotations

from fencepost_server.ha.sharded import named_owners
from fencepost_server.ha.shards import Owner

A, B, C = "127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"


def _rows(**held: str) -> dict[int, Owner]:
    return {int(s[1:]): Owner(holder=addr, address=addr, epoch=7) for s, addr in held.items()}


def test_a_shard_led_elsewhere_names_its_holder() -> None:
    assert named_owners(A, frozenset({0}), {0: A, 1: B}, _rows(s0=A, s1=B)) == {
        0: (A, 7), 1: (B, 7)}


def test_mid_move_the_giver_names_the_taker_and_the_taker_names_nobody() -> None:
    # shard 1 moves from A to B: A holds its row but no longer admits it
    rows, assigned = _rows(s1=A), {1: B}
    assert named_owners(A, frozenset(), assigned, rows) == {1: (B, 7)}
    # B has not taken the row yet (or has, and is loading it): ask again here
    assert named_owners(B, frozenset(), assigned, rows) == {1: ("", 7)}
    assert named_owners(B, frozenset(), assigned, _rows(s1=B)) == {1: ("", 7)}
    assert named_owners(B, frozenset(), assigned, {1: Owner("", "", 7)}) == {1: ("", 7)}
    # a third coordinator names the row's holder, as always
    assert named_owners(C, frozenset(), assigned, rows) == {1: (A, 7)}
