"""free_port: below the kernel's ephemeral range, free, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from fencepost_server import ports


def test_ports_are_free_below_the_ephemeral_range_and_never_repeat() -> None:
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    assert all(ports.LOWEST <= p < low for p in got), got
    with socket.socket() as s:
        s.bind((ports.HOST, got[-1]))  # still free: nothing kept it


def test_a_taken_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind((ports.HOST, 0))
        taken = held.getsockname()[1]
        picks = iter([taken, taken + 1 if taken + 1 < 65536 else taken - 1])

        class Fixed:
            def randrange(self, lo: int, hi: int) -> int:
                return next(picks)

        monkeypatch.setattr(ports.random, "Random", Fixed)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
        assert ports.free_port() != taken
