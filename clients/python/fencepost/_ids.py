"""Request ids (docs/SPEC.md §5.5): unique, and time-ordered.

The server keeps every answered request id in a B-tree for at least ten
minutes. Random ids (uuid4) land on a random page each, so under load nearly
every command dirtied its own 4 KiB page of that index and the writer slowed
down about 3.5x (bench/writer microbenchmark, 256-command batches: 63 -> 244
us per command). Ids in the UUIDv7 layout — 48 bits of Unix milliseconds, then
random bits — sort by time, so the ids of one batch share the index's newest
pages.
"""

from __future__ import annotations

import os
import time

_VERSION_7 = 0x7 << 76
_VARIANT = 0x2 << 62
_RANDOM_MASK = ~((0xF << 76) | (0x3 << 62)) & ((1 << 80) - 1)


def new_request_id() -> str:
    """A UUIDv7 (RFC 9562) as 32 hex digits: time-ordered, 74 random bits."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big") & _RANDOM_MASK
    return f"{(ms & ((1 << 48) - 1)) << 80 | _VERSION_7 | _VARIANT | rand:032x}"
