"""``fencepost ... --endpoints a,b`` (and FENCEPOST_ENDPOINTS): every client
command follows the leader past a standby, ``health`` reports each
endpoint, and bad endpoint lists are usage errors that change nothing."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _standby import Standby

from fencepost import SyncClient
from fencepost_devtools.ports import free_port
from fencepost_server.cli import ops as cli_ops
from fencepost_server.cli.common import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from fencepost_server.cli.main import build_parser, main
from fencepost_server.testing.server import ServerThread


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def standby(server: ServerThread) -> Iterator[Standby]:
    """A standby that names ``server`` as the leader."""
    with Standby(leader=server.address) as s:
        yield s


@pytest.fixture(autouse=True)
def _no_endpoint_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FENCEPOST_ENDPOINTS", "FENCEPOST_ADDR", "FENCEPOST_HEALTH_LISTEN"):
        monkeypatch.delenv(name, raising=False)


def test_health_reports_every_endpoint_so_the_leader_shows(
    server: ServerThread, standby: Standby, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = dead_address()
    both = f"{standby.address},{server.address}"
    assert main(["health", "--endpoints", both]) == EXIT_OK
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines == [[standby.address, "NOT_SERVING"], [server.address, "SERVING"]]
    assert main(["health", "--json", "--endpoints", f"{both},{dead}"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == {
        "service": "", "status": "SERVING", "serving": [server.address],
        "endpoints": [{"address": standby.address, "status": "NOT_SERVING"},
                      {"address": server.address, "status": "SERVING"},
                      {"address": dead, "status": "UNREACHABLE"}]}
    # nobody leads: 1; nobody answers: 3
    assert main(["health", "--endpoints", f"{standby.address},{dead}"]) == EXIT_REFUSED
    capsys.readouterr()
    assert main(["health", "--endpoints", f"{dead},{dead_address()}",
                 "--timeout", "0.5"]) == EXIT_UNREACHABLE
    out = capsys.readouterr().out
    assert out.count("UNREACHABLE") == 2 and dead in out
    # one endpoint: the output of --addr
    assert main(["health", "--endpoints", server.address]) == EXIT_OK
    assert capsys.readouterr().out == "SERVING\n"


def test_commands_follow_the_leader_past_a_standby(
    server: ServerThread, standby: Standby, capsys: pytest.CaptureFixture[str]
) -> None:
    with SyncClient(server.address, owner="w") as c:
        c.acquire("run-1", ttl_ms=60_000)
    both = f"{standby.address},{server.address}"
    assert main(["get", "run-1", "--json", "--endpoints", both]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["status"] == "running"
    assert main(["cancel", "run-1", "--endpoints", standby.address]) == EXIT_OK  # unlisted leader
    assert "cancelled" in capsys.readouterr().out
    assert main(["ls", "--json", "--endpoints", both]) == EXIT_OK
    assert [r["status"] for r in json.loads(capsys.readouterr().out)] == ["cancelled"]
    # a listing's first call asks the map (does one coordinator lead every shard?)
    assert {"GetRun", "Cancel", "Shards"} <= set(standby.methods())


def test_watch_follows_the_leader(server: ServerThread, standby: Standby) -> None:
    with SyncClient(server.address, owner="w") as c:
        c.acquire("run-1", ttl_ms=60_000).finish()
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["watch", "--from-revision", "1", "--limit", "2",
                                      "--endpoints", standby.address])
    assert cli_ops.run(args, out=out, err=err) == EXIT_OK, err.getvalue()
    assert [line.split()[:2] for line in out.getvalue().splitlines()] == [
        ["1", "put"], ["2", "put"]]


def test_fencepost_endpoints_environment(
    server: ServerThread, standby: Standby, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FENCEPOST_ADDR", dead_address())  # FENCEPOST_ENDPOINTS wins
    monkeypatch.setenv("FENCEPOST_ENDPOINTS", f"{standby.address},{server.address}")
    assert main(["ls", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == []
    assert main(["ls", "--json", "--addr", server.address]) == EXIT_OK  # a flag wins
    capsys.readouterr()
    monkeypatch.setenv("FENCEPOST_ENDPOINTS", "a:1,,b:2")
    assert main(["ls"]) == EXIT_USAGE
    assert "FENCEPOST_ENDPOINTS" in capsys.readouterr().err


def test_bad_endpoint_lists_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--endpoints", "a:1,,b:2"]) == EXIT_USAGE
    assert "--endpoints" in capsys.readouterr().err
    assert main(["ls", "--json", "--addr", "a:1", "--endpoints", "b:2"]) == EXIT_USAGE
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["code"] == "USAGE" and "not both" in doc["error"]["message"]


def test_unreachable_endpoints_exit_3_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    dead = [dead_address(), dead_address()]
    assert main(["ls", "--endpoints", ",".join(dead), "--timeout", "0.5"]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert all(err.count(address) >= 2 for address in dead), err  # where, and what was tried


def test_hold_gives_the_command_the_leader_and_the_endpoints(
    server: ServerThread, standby: Standby, tmp_path: Path
) -> None:
    seen = tmp_path / "env"
    script = ("import os, sys; open(sys.argv[1], 'w').write("
              "os.environ['FENCEPOST_ADDR'] + ' ' + os.environ['FENCEPOST_ENDPOINTS'])")
    both = f"{standby.address},{server.address}"
    code = main(["hold", "run-h", "--endpoints", both, "--", sys.executable, "-c", script,
                 str(seen)])
    assert code == EXIT_OK
    assert seen.read_text() == f"{server.address} {both}"
    with SyncClient(server.address) as c:
        assert c.get("run-h").status.value == "completed"
    assert os.environ.get("FENCEPOST_ENDPOINTS") is None


def test_the_default_timeout_leaves_room_for_a_takeover_with_several_endpoints() -> None:
    for argv, timeout in ((["ls", "--endpoints", "a:1,b:2"], cli_ops.FAILOVER_TIMEOUT_S),
                          (["ls", "--addr", "a:1"], cli_ops.DEFAULT_TIMEOUT_S),
                          (["ls", "--endpoints", "a:1"], cli_ops.DEFAULT_TIMEOUT_S),
                          (["ls", "--endpoints", "a:1,b:2", "--timeout", "2"], 2.0)):
        args = build_parser().parse_args(argv)
        assert cli_ops._resolve_endpoints(args, {}) == ""
        assert args.timeout == timeout, argv
    assert cli_ops.FAILOVER_TIMEOUT_S > 5 + 5  # the default leader lease, and a takeover


def test_hold_ttl_takes_milliseconds_or_a_duration(capsys: pytest.CaptureFixture[str]) -> None:
    from fencepost_server.cli.hold import _ttl_ms

    assert [_ttl_ms(t) for t in ("30000", "30s", "2m", "500ms")] == [30_000, 30_000, 120_000, 500]
    for bad in ("0", "soon", "1.5s", "-3s"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"duration|>= 1"):
            _ttl_ms(bad)
    assert main(["hold", "run-1", "--ttl", "soon", "--", "true"]) == EXIT_USAGE
    assert "--ttl" in capsys.readouterr().err
