"""The serving process's full-collection schedule (upkeep/gcpolicy.py)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from fencepost_server.upkeep.gcpolicy import NEVER, FullCollections


class Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_automatic_full_collections_stop_and_the_schedule_collects_cycles() -> None:
    before = gc.get_threshold()
    young_before = gc.get_stats()[0]["collections"]
    schedule = FullCollections(every_s=0.2)
    schedule.start()
    try:
        assert gc.get_threshold() == (before[0], before[1], NEVER)
        full_before = gc.get_stats()[2]["collections"]
        for _ in range(200_000):  # plenty of young collections, no full one
            Cycle()
        assert gc.get_stats()[0]["collections"] > young_before
        assert gc.get_stats()[2]["collections"] == full_before
        Cycle()
        await asyncio.sleep(0.5)  # the schedule's collection frees the cycle
        assert schedule.collections >= 1
        assert gc.get_stats()[2]["collections"] > full_before
        assert not any(isinstance(o, Cycle) for o in gc.get_objects())
    finally:
        await schedule.stop()
    assert gc.get_threshold() == before  # CPython's own rule again


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="every_s"):
        FullCollections(every_s=0)
