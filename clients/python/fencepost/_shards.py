"""Which shard a key belongs to, as the server computes it (docs/SPEC.md
"Shards"): the first 4 bytes of SHA-256 over the key's UTF-8 bytes, read as a
big-endian unsigned integer, modulo the shard count."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

MAX_SHARDS = 4096
# Joins the parts of a compound key (an idempotency key's scope and key).
SEPARATOR = "\x1f"


def shard_of(key: str, shards: int) -> int:
    """The shard (0 .. shards - 1) that ``key`` belongs to among ``shards``."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be between 1 and {MAX_SHARDS} (got {shards})")
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % shards


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard of the map: the coordinator that leads it (``owner``, its
    identity, and ``address``, where clients reach it), the ``epoch`` it leads
    under (0 on SQLite), and the ledger runs and live leases in it."""

    index: int
    owner: str
    address: str
    epoch: int
    runs: int
    leases: int


@dataclass(frozen=True, slots=True)
class ShardMap:
    """``Client.shards()``: the database's shard count and every shard by
    index; ``revision`` is the server revision the run counts reflect."""

    shard_count: int
    shards: tuple[ShardInfo, ...]
    revision: int

    def shard_of(self, key: str) -> int:
        """The shard ``key`` belongs to in this database."""
        return shard_of(key, self.shard_count)


def shard_info_from_pb(s: Any) -> ShardInfo:
    return ShardInfo(index=s.index, owner=s.owner, address=s.address, epoch=s.epoch,
                     runs=s.runs, leases=s.leases)


def shard_map_from_pb(resp: Any) -> ShardMap:
    """A ``ShardsResponse`` as a ``ShardMap``."""
    return ShardMap(
        shard_count=int(resp.shard_count),
        shards=tuple(shard_info_from_pb(s) for s in resp.shards),
        revision=int(resp.revision),
    )
