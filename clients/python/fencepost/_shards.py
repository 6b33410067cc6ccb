"""Which shard a key belongs to, as the server computes it (docs/SPEC.md
"Shards"): the first 4 bytes of SHA-256 over the key's UTF-8 bytes, read as a
big-endian unsigned integer, modulo the shard count."""

from __future__ import annotations

import hashlib

MAX_SHARDS = 4096
# Joins the parts of a compound key (an idempotency key's scope and key).
SEPARATOR = "\x1f"


def shard_of(key: str, shards: int) -> int:
    """The shard (0 .. shards - 1) that ``key`` belongs to among ``shards``."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be between 1 and {MAX_SHARDS} (got {shards})")
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % shards
