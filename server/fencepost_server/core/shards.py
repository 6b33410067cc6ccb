"""Which shard an item belongs to (docs/SPEC.md "Shards"). Pure, stdlib only.

The rule is written so that any language computes it with its standard
library: the first 4 bytes of SHA-256 over the key's UTF-8 bytes, read as a
big-endian unsigned integer, modulo the shard count. The same function is in
the Python SDK (``fencepost.shard_of``) and the TypeScript client
(``shardOf``); tests/vectors/shards.json holds the vectors all three check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

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
