"""Which shard an item belongs to (docs/SPEC.md "Shards"). Pure, stdlib only.

The rule is written so that any language computes it with its standard
library: the first 4 bytes of SHA-256 over the key's UTF-8 bytes, read as a
big-endian unsigned integer, modulo the shard count. The same function is in
the Python SDK (``fencepost.shard_of``) and the TypeScript client
(``shardOf``); tests/vectors/shards.json holds the vectors all three check.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

# A database's shard count: fixed when it is created (``fencepost serve --shards``).
DEFAULT_SHARDS = 64
MIN_SHARDS = 1
MAX_SHARDS = 4096
# Joins the parts of a compound key (an idempotency key's scope and key, a
# state entry's agent and key): no validated field may hold a control
# character, so no two compound keys join to the same text.
SEPARATOR = "\x1f"


def shard_of(key: str, shards: int) -> int:
    """The shard (0 .. shards - 1) that ``key`` belongs to among ``shards``."""
    if not MIN_SHARDS <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be between {MIN_SHARDS} and {MAX_SHARDS} (got {shards})")
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % shards


def compound_key(*parts: str) -> str:
    """The shard key of an item named by several fields, in the order given."""
    return SEPARATOR.join(parts)


def tally(keys: Iterable[str], shards: int, counts: list[int]) -> None:
    """Add one to ``counts[shard_of(key, shards)]`` for each key (the rule
    inlined: about half a microsecond a key, for counting a million)."""
    sha256, from_bytes = hashlib.sha256, int.from_bytes
    for key in keys:
        counts[from_bytes(sha256(key.encode("utf-8")).digest()[:4], "big") % shards] += 1


def assign(members: Sequence[str], shards: int) -> list[str]:
    """The member that should lead each shard (index = shard), among the
    live ``members`` (identities; order and repeats do not matter).

    Rendezvous ranking with a cap: every (member, shard) pair is scored by
    the first 8 bytes of SHA-256 over ``member`` U+001F ``shard`` (decimal),
    big-endian; pairs are taken from the highest score down (ties: the
    smaller identity first), each shard going to the first member that still
    has room. Room is ``floor(N/k) + 1`` for the first ``N mod k`` members to
    reach it and ``floor(N/k)`` for the rest, so every member leads
    floor(N/k) or ceil(N/k) shards.

    Movement, measured (not proved; tests/unit/test_shard_assign.py): when
    one of k members leaves, its shards move plus at most ceil(N/k) + 3
    others; when one joins, it takes its share and at most ceil(N/(k+1)) + 3
    other shards change hands. At N = 4096 the others stay near a tenth of a
    share.
    """
    if not MIN_SHARDS <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be between {MIN_SHARDS} and {MAX_SHARDS} (got {shards})")
    if not members:
        raise ValueError("members must name at least one member")
    return list(_assign(tuple(sorted(set(members))), shards))


@functools.lru_cache(maxsize=16)
def _assign(members: tuple[str, ...], shards: int) -> tuple[str, ...]:
    base, extra = divmod(shards, len(members))
    pairs = sorted(
        (-int.from_bytes(hashlib.sha256(f"{m}{SEPARATOR}{s}".encode()).digest()[:8], "big"),
          m, s) for m in members for s in range(shards)
    )
    owner: list[str | None] = [None] * shards
    count = dict.fromkeys(members, 0)
    full = 0  # members that reached base + 1
    left = shards
    for _, m, s in pairs:
        if owner[s] is not None:
            continue
        n = count[m]
        if n >= (base + 1 if full < extra else base):
            continue
        owner[s] = m
        count[m] = n + 1
        full += n + 1 == base + 1
        left -= 1
        if not left:
            break
    return tuple(m for m in owner if m is not None)
