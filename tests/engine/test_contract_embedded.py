"""The reusable EngineStore contract suite (``fencepost.store_contract``), run
against the embedded server: once with a test clock (the exact instant of
expiry is checked) and once in real time (as a deployment without a test clock
would run it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fencepost.store_contract import *  # noqa: F403
from fencepost_server.clock import ManualClock, SystemClock
from fencepost_server.harness import ServerThread


@pytest.fixture(scope="module", params=["test-clock", "real-time"])
def embedded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    clock = ManualClock() if request.param == "test-clock" else SystemClock()
    path: Path = tmp_path_factory.mktemp("contract") / "fencepost.db"
    with ServerThread(path, clock=clock) as srv:
        yield srv


@pytest.fixture(scope="module")
def store_endpoint(embedded: ServerThread) -> str:
    return embedded.address


@pytest.fixture
def advance_clock(embedded: ServerThread) -> Callable[[int], object] | None:
    return embedded.clock.advance if isinstance(embedded.clock, ManualClock) else None


def test_the_suite_exports_every_test() -> None:
    """``from fencepost.store_contract import *`` must bring every test along."""
    import fencepost.store_contract as suite

    tests = {name for name in vars(suite) if name.startswith("test_")}
    assert tests and tests <= set(suite.__all__)
