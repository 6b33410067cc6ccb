"""The ``fencepost`` command as a newcomer meets it: --version, health, usage
errors (one line, exit 2, the sub-command's usage, no abbreviations, JSON
with --json), readable ``ls`` tables with lease markers, ``ls --engine``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

import fencepost
from fencepost import SyncClient
from fencepost.v1 import ledger_pb2, ledger_pb2_grpc
from fencepost_server.cli import format as cli_format
from fencepost_server.cli import main
from fencepost_server.cli.common import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE
from fencepost_server.config import Settings, SettingsError
from fencepost_server.testing.server import ServerThread

FENCEPOST = Path(sys.executable).parent / "fencepost"


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [str(FENCEPOST), *argv], capture_output=True, text=True, timeout=60,
        env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == EXIT_OK
    from importlib.metadata import version

    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"fencepost {version('fencepost')}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--log-level", "LOUD"], {}, "--log-level"),
        (["--commit-delay-ms", "500"], {}, "--commit-delay-ms"),
        (["--listen", "localhost:port"], {}, "--listen"),
        (["--http-listen", "[::1"], {}, "--http-listen"),
        (["--max-message-bytes", "ten"], {}, "--max-message-bytes"),
        (["--js"], {}, "--js"),
        ([], {"FENCEPOST_DURABILITY": "off"}, "FENCEPOST_DURABILITY"),
        ([], {"FENCEPOST_COMMIT_DELAY_MS": "500"}, "FENCEPOST_COMMIT_DELAY_MS"),
        ([], {"FENCEPOST_LOG_LEVEL": "LOUD"}, "FENCEPOST_LOG_LEVEL"),
        ([], {"FENCEPOST_MAX_MESSAGE_BYTES": "lots"}, "FENCEPOST_MAX_MESSAGE_BYTES"),
        ([], {"FENCEPOST_LISTEN": "a:b:c"}, "FENCEPOST_LISTEN"),
    ],
)
def test_bad_serve_flags_and_env_exit_2_in_one_message(
    tmp_path: Path, argv: list[str], env: dict[str, str], names: str
) -> None:
    db = tmp_path / "never.db"
    done = _cli("serve", "--db", str(db), *argv, env=env)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stderr
    assert names in done.stderr.splitlines()[-1]
    assert len(done.stderr.splitlines()) <= 12  # a usage block at most, then the line
    assert not db.exists()  # nothing was started


def test_a_flag_wins_over_a_bad_environment_value() -> None:
    s = Settings.from_env({"FENCEPOST_COMMIT_DELAY_MS": "500"}, commit_delay_ms=2.0)
    assert s.commit_delay_ms == 2.0
    with pytest.raises(SettingsError, match="FENCEPOST_COMMIT_DELAY_MS"):
        Settings.from_env({"FENCEPOST_COMMIT_DELAY_MS": "500"})


@pytest.mark.parametrize(
    ("given", "listen"),
    [("localhost", "localhost:50051"), ("0.0.0.0", "0.0.0.0:50051"),
     ("[::1]", "[::1]:50051"), ("[::]:7000", "[::]:7000"), ("h:0", "h:0")],
)
def test_listen_without_a_port_means_50051(given: str, listen: str) -> None:
    assert Settings.from_env({}, listen=given).listen == listen
    assert Settings.from_env({"FENCEPOST_LISTEN": given}).listen == listen


def test_http_listen_default_and_off() -> None:
    assert Settings.from_env({}).http_listen == "127.0.0.1:8233"
    assert Settings.from_env({}, http_listen="off").http_listen == ""
    assert Settings.from_env({}, http_listen="0.0.0.0").http_listen == "0.0.0.0:8233"


def test_usage_errors_name_the_subcommand_and_refuse_abbreviations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["ls", "--js"]) == EXIT_USAGE  # not --json
    err = capsys.readouterr().err
    assert err.startswith("usage: fencepost ls ")
    assert "unrecognized arguments: --js" in err
    assert main(["ls", "--lim", "3"]) == EXIT_USAGE
    assert "fencepost ls" in capsys.readouterr().err
    assert main(["get", "--bogus", "x"]) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("usage: fencepost get ")


def test_json_usage_and_refusal_errors_are_json_on_stdout(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", "--json", "--status", "finished", "--addr", server.address]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["code"] == "USAGE" and "finished" in out and err == ""
    assert main(["get", "--json", "--bogus"]) == EXIT_USAGE
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "USAGE"
    assert main(["get", "nope", "--json", "--addr", server.address]) == EXIT_REFUSED
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["code"] == "RUN_NOT_FOUND" and err == ""


def test_health(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--addr", server.address]) == EXIT_OK
    assert capsys.readouterr().out == "SERVING\n"
    assert main(["health", "--json", "--service", "fencepost.v1.Ledger",
                 "--addr", server.address]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == {
        "service": "fencepost.v1.Ledger", "status": "SERVING"}
    assert main(["health", "--service", "no.Such", "--addr", server.address]) == EXIT_REFUSED
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["health", "--addr", "127.0.0.1:1", "--timeout", "0.5"]) == EXIT_UNREACHABLE


def test_ls_marks_expired_and_lock_delay_leases_in_local_time(
    make_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with make_server() as srv, SyncClient(srv.address, owner="w") as c:
        c.acquire("live", ttl_ms=60_000)
        c.acquire("quiet").release()
        _short_lease(srv.address, "gone", 0)
        _short_lease(srv.address, "delayed", 60_000)
        time.sleep(0.2)
        assert main(["ls", "--addr", srv.address]) == EXIT_OK
        rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
        assert main(["ls", "--json", "--addr", srv.address]) == EXIT_OK
        docs = {d["run_id"]: d for d in json.loads(capsys.readouterr().out)}
        gone = c.get("gone")
    assert " left" in rows["live"] and "EXPIRED" not in rows["live"]
    assert "EXPIRED" in rows["gone"] and " ago" in rows["gone"]
    assert "LOCK-DELAY" in rows["delayed"]
    assert rows["quiet"].split()[5] == "-"
    updated = datetime.fromisoformat(docs["live"]["updated_at"].replace("Z", "+00:00"))
    assert updated.astimezone().strftime("%Y-%m-%d %H:%M:%S") in rows["live"]
    assert docs["gone"]["lease"]["expires_at"].endswith("Z")  # --json keeps machine fields
    text = dict(line.split(None, 1) for line in cli_format.record_text(gone).splitlines())
    assert text["lease.state"].startswith("EXPIRED")


def _short_lease(address: str, run_id: str, lock_delay_ms: int) -> None:
    """A 100 ms lease nobody renews (a unary Acquire, no SDK renewal)."""
    with grpc.insecure_channel(address) as ch:
        ledger_pb2_grpc.LedgerStub(ch).Acquire(ledger_pb2.AcquireRequest(
            run_id=run_id, owner="w2", lease_ttl_ms=100, lock_delay_ms=lock_delay_ms), timeout=10)


def test_lease_state_and_durations() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    info = fencepost.LeaseInfo("o", now, now + timedelta(seconds=190), 1000, 0)
    rec = fencepost.RunRecord("r", 1, fencepost.RunStatus.RUNNING, 1, 1, now, now, info)
    assert cli_format.lease_state(rec, now) == "3m10s left"
    assert cli_format.lease_state(rec, now + timedelta(hours=3)) == "EXPIRED 2h56m ago"
    assert [cli_format.duration(s) for s in (0.25, 12, 3 * 86400 + 3600)] == [
        "250ms", "12s", "3d01h"]


def test_ls_engine_lists_engine_store_runs(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    with SyncClient(server.address) as c:
        c.store.create_run("e-1", agent="agent-a", status="pending")
        c.store.create_run("e-2", agent="agent-b", status="running")
        assert c.store.claim_run("e-2", "worker-9", 30_000)
    assert main(["ls", "--engine", "--json", "--addr", server.address]) == EXIT_OK
    docs = json.loads(capsys.readouterr().out)
    assert [(d["id"], d["agent"], d["status"]) for d in docs] == [
        ("e-1", "agent-a", "pending"), ("e-2", "agent-b", "running")]
    assert docs[1]["claim"]["owner"] == "worker-9" and docs[0]["claim"] is None
    assert main(["ls", "--engine", "--agent", "agent-b", "--addr", server.address]) == EXIT_OK
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["ID", "AGENT", "STATUS", "CLAIMED_BY"]
    assert [r.split()[:4] for r in rows] == [["e-2", "agent-b", "running", "worker-9"]]
    assert main(["ls", "--agent", "x", "--addr", server.address]) == EXIT_USAGE


def test_refused_acquire_names_the_owner_and_a_readable_time(server: ServerThread) -> None:
    with SyncClient(server.address, owner="alice") as a, SyncClient(server.address,
                                                                    owner="bob") as b:
        a.acquire("r")
        with pytest.raises(fencepost.LeaseHeldError) as caught:
            b.acquire("r")
    msg = caught.value.message
    assert "'alice'" in msg and "Z (in " in msg and " ms" not in msg
