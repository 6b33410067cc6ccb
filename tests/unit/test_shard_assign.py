"""Which member leads each shard (core/shards.py ``assign``): the same from
the same set of identities, balanced to floor/ceil of N/k, and with little
movement when a member leaves or joins (the bound its docstring states)."""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import pytest

from fencepost_server.core import shards

COUNTS = [1, 7, 64, 4096]


def _members(k: int, tag: str = "") -> list[str]:
    return [f"host-{i}{tag}/{1000 + i}/{hashlib.sha256(f'{tag}{i}'.encode()).hexdigest()[:8]}"
            for i in range(k)]


def _moved(before: list[str], after: list[str], *, besides: str) -> int:
    """Shards whose member changed, not counting those of ``besides``
    (the leaver's before, or the joiner's after)."""
    return sum(1 for b, a in zip(before, after, strict=True) if b != a and besides not in (a, b))


def test_the_same_set_in_any_order_gives_the_same_assignment() -> None:
    members = _members(5)
    first = shards.assign(members, 64)
    for seed in range(5):
        shuffled = members + members[:2]  # repeats count once
        random.Random(seed).shuffle(shuffled)
        assert shards.assign(shuffled, 64) == first
    assert shards.assign(list(reversed(members)), 64) == first


def test_it_is_rendezvous_ranking_over_sha256() -> None:
    """One member per shard: the highest score wins (the rule, spelled out
    independently, so another implementation can check itself against it)."""
    members = _members(3)

    def score(m: str, s: int) -> int:
        return int.from_bytes(hashlib.sha256(f"{m}\x1f{s}".encode()).digest()[:8], "big")

    assert shards.assign(members, 1) == [max(members, key=lambda m: score(m, 0))]
    got = shards.assign(members, 7)
    top = max((score(m, s), m, s) for m in members for s in range(7))
    assert got[top[2]] == top[1]  # the best pair of all is always kept


@pytest.mark.parametrize("n", COUNTS)
def test_every_member_leads_floor_or_ceil(n: int) -> None:
    for k in range(1, 11):
        got = shards.assign(_members(k), n)
        assert len(got) == n
        counts = Counter(got)
        assert set(counts) <= set(_members(k))
        per = [counts.get(m, 0) for m in _members(k)]
        assert min(per) >= n // k and max(per) <= -(-n // k), (k, per)
        assert sum(per) == n


@pytest.mark.parametrize("n", COUNTS)
def test_a_leave_moves_its_shards_and_few_others(n: int) -> None:
    for k in range(2, 11):
        members = _members(k, f"L{n}")
        before = shards.assign(members, n)
        # every leaver at small N; a few at N = 4096 (each assignment costs ~50 ms)
        leavers = members if n < 4096 else members[:2]
        for leaver in leavers:
            after = shards.assign([m for m in members if m != leaver], n)
            assert leaver not in after
            assert _moved(before, after, besides=leaver) <= -(-n // k) + 3, (k, leaver)


@pytest.mark.parametrize("n", COUNTS)
def test_a_join_takes_its_share_and_moves_few_others(n: int) -> None:
    for k in range(1, 10):
        members = _members(k, f"J{n}")
        before = shards.assign(members, n)
        after = shards.assign([*members, "newcomer"], n)
        assert after.count("newcomer") in (n // (k + 1), -(-n // (k + 1)))
        assert _moved(before, after, besides="newcomer") <= -(-n // (k + 1)) + 3, k


def test_at_4096_shards_a_leave_moves_under_an_eighth_of_a_share_more() -> None:
    members = _members(8, "big")
    before = shards.assign(members, 4096)
    after = shards.assign(members[1:], 4096)
    assert _moved(before, after, besides=members[0]) <= 4096 // 8 // 8


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="members"):
        shards.assign([], 8)
    with pytest.raises(ValueError, match="shards"):
        shards.assign(["a"], 0)
    with pytest.raises(ValueError, match="shards"):
        shards.assign(["a"], shards.MAX_SHARDS + 1)
