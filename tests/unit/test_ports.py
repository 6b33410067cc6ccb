"""free_port: below the kernel's ephemeral range, free, never handed out twice."""

from __future__ import annotations

import itertools
import random
import socket

import pytest

from fencepost_devtools import ports


def test_ports_are_free_below_the_ephemeral_range_and_never_repeat() -> None:
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    assert all(ports.LOWEST <= p < low for p in got), got
    with socket.socket() as s:
        s.bind((ports.HOST, got[-1]))  # still free: nothing kept it


def test_a_taken_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    fallback = random.Random()  # made before random.Random is replaced below
    with socket.socket() as held:
        held.bind((ports.HOST, 0))
        taken = held.getsockname()[1]
        # The taken port first, then ordinary picks: whichever of those is
        # free at the moment is the answer, never the held one.
        picks = itertools.chain(
            [taken], iter(lambda: fallback.randrange(ports.LOWEST, 65536), None)
        )
        tried: list[int] = []

        class Fixed:
            def randrange(self, lo: int, hi: int) -> int:
                tried.append(next(picks))
                return tried[-1]

        monkeypatch.setattr(ports.random, "Random", Fixed)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
        got = ports.free_port()
        assert tried[0] == taken and got != taken
        assert got == tried[-1] and len(tried) >= 2
