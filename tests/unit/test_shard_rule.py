"""The shard rule: the server's core and the Python SDK compute the shared
vectors (tests/vectors/shards.json, also checked by the TypeScript client's
tests) and agree with each other on generated keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fencepost
from fencepost_server.core import shards
from fencepost_server.core.validate import text

VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "shards.json").read_text("utf-8")
)["vectors"]


def test_the_vectors_cover_the_edges() -> None:
    keys = {v["key"] for v in VECTORS}
    counts = {v["shards"] for v in VECTORS}
    assert {1, 16, 64, 1024, shards.MAX_SHARDS} <= counts
    assert any(not k.isascii() for k in keys)
    assert any(len(k.encode()) == 1 for k in keys)
    assert any(shards.SEPARATOR in k for k in keys)
    for k in keys:  # every key is one the server accepts somewhere
        if shards.SEPARATOR not in k:
            text("key", k, 1024)


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: f"{v['key'][:12]!r}/{v['shards']}")
def test_the_server_and_the_sdk_compute_every_vector(vector: dict) -> None:
    assert shards.shard_of(vector["key"], vector["shards"]) == vector["shard"]
    assert fencepost.shard_of(vector["key"], vector["shards"]) == vector["shard"]


def test_nfc_and_nfd_forms_are_different_keys() -> None:
    """The bytes as sent: no Unicode normalisation."""
    assert shards.shard_of("\u00e9", 1024) != shards.shard_of("e\u0301", 1024)


@given(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40),
       st.integers(1, shards.MAX_SHARDS))
def test_the_server_and_the_sdk_agree(key: str, n: int) -> None:
    got = shards.shard_of(key, n)
    assert 0 <= got < n
    assert fencepost.shard_of(key, n) == got


@pytest.mark.parametrize("n", [0, -1, shards.MAX_SHARDS + 1])
def test_a_count_out_of_bounds_is_refused(n: int) -> None:
    with pytest.raises(ValueError, match="shards must be between 1 and 4096"):
        shards.shard_of("a", n)
    with pytest.raises(ValueError, match="shards must be between 1 and 4096"):
        fencepost.shard_of("a", n)


def test_a_compound_key_joins_its_parts_with_the_separator() -> None:
    assert shards.compound_key("billing", "charge-7") == "billing\x1fcharge-7"


@given(st.lists(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20)),
       st.integers(1, 70))
def test_tally_counts_each_key_in_its_shard(keys: list[str], n: int) -> None:
    counts = [0] * n
    shards.tally(keys, n, counts)
    expected = [0] * n
    for key in keys:
        expected[shards.shard_of(key, n)] += 1
    assert counts == expected
