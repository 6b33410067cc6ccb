"""The serving process's full-collection schedule (upkeep/gcpolicy.py)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from fencepost_server.app import App
from fencepost_server.config import Settings
from fencepost_server.upkeep.gcpolicy import NEVER, FullCollections


class Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_automatic_full_collections_stop_and_the_schedule_collects_cycles() -> None:
    before = gc.get_threshold()
    young_before = gc.get_stats()[0]["collections"]
    schedule = FullCollections(every_s=0.2)
    async with asyncio.TaskGroup() as tasks:
        schedule.start(tasks)
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


async def test_a_served_app_runs_the_schedule_in_its_task_group(tmp_path: Path) -> None:
    """``serve`` hands the App its schedule: it runs among the App's tasks
    once listening, and stops (CPython's rule back) in the shutdown."""
    before = gc.get_threshold()
    app = App(Settings(listen="127.0.0.1:0", db_path=str(tmp_path / "f.db")),
              collections=FullCollections(every_s=3600))
    await app.start()
    try:
        assert gc.get_threshold() == (before[0], before[1], NEVER)
        assert "fencepost-gc" in {t.get_name() for t in asyncio.all_tasks()}
    finally:
        await app.stop(0)
    assert gc.get_threshold() == before
    assert "fencepost-gc" not in {t.get_name() for t in asyncio.all_tasks()}
