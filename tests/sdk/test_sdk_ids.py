"""Request ids are UUIDv7: unique, and ordered by time (the server's request-id
index then appends instead of touching a random page per command)."""

from __future__ import annotations

import time
import uuid

from fencepost._ids import new_request_id


def test_request_ids_are_uuid7_hex_unique_and_time_ordered() -> None:
    ids = []
    for _ in range(5):
        ids.extend(new_request_id() for _ in range(200))
        time.sleep(0.002)
    assert len(set(ids)) == len(ids)
    for i in ids:
        u = uuid.UUID(hex=i)
        assert len(i) == 32 and u.version == 7 and u.variant == uuid.RFC_4122
    ms = [int(i[:12], 16) for i in ids]
    assert ms == sorted(ms)  # the 48-bit millisecond prefix never goes back
    assert abs(ms[-1] - time.time_ns() // 1_000_000) < 5_000
    assert sorted(ids[:200])[0] < sorted(ids[-200:])[0]  # later ids sort later
