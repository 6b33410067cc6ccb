"""The operator commands of the ``fencepost`` CLI over a real server: in
process through ``cli.main`` and once through the installed binary."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fencepost
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


@pytest.fixture
def seeded(server: ServerThread) -> Iterator[ServerThread]:
    """run-a running (worker-a, checkpointed), run-b suspended, run-c failed."""
    with SyncClient(server.address, owner="worker-a") as client:
        client.acquire("run-a").record_checkpoint("ckpt/a", 2)
        client.acquire("run-b").suspend(["approval-1"])
        client.acquire("run-c").finish("failed", "boom", "it broke")
        yield server


def run_cli(
    capsys: pytest.CaptureFixture[str], server: ServerThread, *argv: str
) -> tuple[int, str, str]:
    code = main([*argv, "--addr", server.address])
    out, err = capsys.readouterr()
    return code, out, err


def test_get_json_and_text(seeded: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, seeded, "get", "run-a", "--json")
    assert (code, err) == (EXIT_OK, "")
    doc = json.loads(out)
    assert doc["run_id"] == "run-a" and doc["status"] == "running"
    assert doc["lease"]["owner"] == "worker-a"
    assert doc["checkpoint_ref"] == {"key": "ckpt/a", "snapshot_version": 2,
                                     "saved_at": doc["checkpoint_ref"]["saved_at"]}
    assert doc["created_at"].endswith("Z")

    code, out, _ = run_cli(capsys, seeded, "get", "run-b")
    assert code == EXIT_OK
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert lines["status"] == "suspended"
    assert lines["suspension.pending_approval_ids"] == "approval-1"


def test_ls(seeded: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, seeded, "ls", "--json")
    assert code == EXIT_OK
    assert [d["run_id"] for d in json.loads(out)] == ["run-a", "run-b", "run-c"]

    code, out, _ = run_cli(capsys, seeded, "ls", "--json", "--status", "suspended",
                           "--status", "failed")
    assert [(d["run_id"], d["status"]) for d in json.loads(out)] == [
        ("run-b", "suspended"), ("run-c", "failed")]

    code, out, _ = run_cli(capsys, seeded, "ls", "--json", "--owner", "worker-a")
    assert [d["run_id"] for d in json.loads(out)] == ["run-a"]

    code, out, _ = run_cli(capsys, seeded, "ls", "--json", "--limit", "2")
    assert [d["run_id"] for d in json.loads(out)] == ["run-a", "run-b"]

    code, out, _ = run_cli(capsys, seeded, "ls", "--json", "--owner", "nobody")
    assert (code, json.loads(out)) == (EXIT_OK, [])

    code, out, _ = run_cli(capsys, seeded, "ls")
    header, *rows = out.splitlines()
    assert header.split() == ["RUN_ID", "STATUS", "TOKEN", "ATTEMPT", "OWNER", "LEASE",
                              "UPDATED"]
    assert [r.split()[:2] for r in rows] == [["run-a", "running"], ["run-b", "suspended"],
                                             ["run-c", "failed"]]


def test_cancel_resume_delete(seeded: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, seeded, "cancel", "run-a", "-m", "operator stop", "--json")
    doc = json.loads(out)
    assert code == EXIT_OK and doc["status"] == "cancelled" and doc["fencing_token"] == 2
    assert doc["outcome"] == {"code": "cancelled", "message": "operator stop"}

    code, out, _ = run_cli(capsys, seeded, "resume", "run-b", "--json")
    assert code == EXIT_OK and json.loads(out)["status"] == "queued"

    code, out, _ = run_cli(capsys, seeded, "delete", "run-c", "--json")
    doc = json.loads(out)
    assert code == EXIT_OK and doc["run_id"] == "run-c" and doc["deleted"] is True
    assert doc["fencing_token"] == 1

    code, out, _ = run_cli(capsys, seeded, "delete", "run-b")
    assert code == EXIT_OK and out.startswith("deleted run-b")


def test_refusals_exit_1_with_the_code(
    seeded: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, seeded, "get", "missing")
    assert (code, out) == (EXIT_REFUSED, "")
    assert "RUN_NOT_FOUND" in err

    code, out, err = run_cli(capsys, seeded, "cancel", "run-c", "--json")
    assert (code, err) == (EXIT_REFUSED, "")  # --json: the error is the document, on stdout
    body = json.loads(out)["error"]
    assert body["code"] == "RUN_ALREADY_TERMINAL" and body["run"]["status"] == "failed"

    code, out, _ = run_cli(capsys, seeded, "get", "bad\x01id", "--json")
    assert code == EXIT_REFUSED
    assert json.loads(out)["error"]["field"] == "run_id"


def test_usage_errors_exit_2(seeded: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, seeded, "ls", "--status", "finished")[0] == EXIT_USAGE
    assert run_cli(capsys, seeded, "ls", "--limit", "0")[0] == EXIT_USAGE
    assert run_cli(capsys, seeded, "get")[0] == EXIT_USAGE
    assert main(["frobnicate"]) == EXIT_USAGE


def _closed_port() -> int:
    return free_port()


def test_unreachable_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    addr = f"127.0.0.1:{_closed_port()}"
    assert main(["get", "run-a", "--addr", addr, "--timeout", "0.3"]) == EXIT_UNREACHABLE
    assert main(["cancel", "run-a", "--addr", addr, "--timeout", "0.3", "--json"]) == 3
    out, err = capsys.readouterr()
    assert "cannot reach" in err.splitlines()[0]
    assert json.loads(out)["error"]["code"] == "UNAVAILABLE"


@pytest.mark.slow
def test_installed_binary(seeded: ServerThread) -> None:
    exe = Path(sys.executable).parent / "fencepost"
    assert exe.exists(), exe
    done = subprocess.run(
        [str(exe), "ls", "--json", "--status", "running", "--addr", seeded.address],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert [d["run_id"] for d in json.loads(done.stdout)] == ["run-a"]
    refused = subprocess.run(
        [str(exe), "get", "missing", "--addr", seeded.address],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode == EXIT_REFUSED and "RUN_NOT_FOUND" in refused.stderr


# -- watch ------------------------------------------------------------------------------


def _run_watch(server: ServerThread, *argv: str) -> tuple[int, str, str]:
    """``fencepost watch`` in process, output captured in buffers (usable from
    a thread, unlike capsys)."""
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["watch", *argv, "--addr", server.address])
    code = cli_ops.run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_watch_json_replays_with_limit(seeded: ServerThread) -> None:
    code, out, err = _run_watch(seeded, "--from-revision", "1", "--limit", "3", "--json")
    assert (code, err) == (EXIT_OK, "")
    docs = [json.loads(line) for line in out.splitlines()]
    assert [(d["revision"], d["kind"], d["run_id"]) for d in docs] == [
        (1, "put", "run-a"), (2, "put", "run-a"), (3, "put", "run-b")]
    assert docs[1]["record"]["checkpoint_ref"]["key"] == "ckpt/a"
    assert docs[0]["record"]["status"] == "running" and docs[0]["record"]["revision"] == 1


def test_watch_live_text_filtered(seeded: ServerThread) -> None:
    with SyncClient(seeded.address, owner="operator") as op:
        start = op.get("run-c").revision + 1  # after everything seeded
        result: list[tuple[int, str, str]] = []
        t = threading.Thread(target=lambda: result.append(_run_watch(
            seeded, "run-a", "run-x", "--from-revision", str(start), "--limit", "3")))
        t.start()
        op.cancel("run-a", "stop")
        op.acquire("run-b-other")  # not watched
        op.acquire("run-x").release()
        t.join(10)
    assert not t.is_alive()
    code, out, err = result[0]
    assert (code, err) == (EXIT_OK, "")
    lines = out.splitlines()
    assert [line.split()[1:4] for line in lines] == [
        ["put", "run-a", "cancelled"], ["put", "run-x", "running"], ["put", "run-x", "queued"]]
    assert lines[0].split()[0] == str(start)
    assert "token=2" in lines[0] and "owner=-" in lines[0]
    assert "owner=operator" in lines[1]

    with SyncClient(seeded.address) as op:
        op.delete("run-x")
        rev = op.get("run-a").revision
    code, out, _ = _run_watch(seeded, "run-x", "--from-revision", str(rev), "--limit", "3")
    assert out.splitlines()[-1].split()[1:] == ["delete", "run-x"]


def test_watch_errors(seeded: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, seeded, "watch", "--from-revision", "-1")[0] == EXIT_USAGE
    assert run_cli(capsys, seeded, "watch", "--limit", "0")[0] == EXIT_USAGE
    addr = f"127.0.0.1:{_closed_port()}"
    assert main(["watch", "--addr", addr, "--timeout", "0.3", "--json"]) == EXIT_UNREACHABLE
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "UNAVAILABLE"


def test_watch_resumes_from_its_cursor_file(seeded: ServerThread, tmp_path: Path) -> None:
    cursor = tmp_path / "cursor"
    with SyncClient(seeded.address, owner="operator") as op:
        done: list[tuple[int, str, str]] = []
        t = threading.Thread(target=lambda: done.append(_run_watch(
            seeded, "--cursor-file", str(cursor), "--limit", "2", "--json")))
        t.start()
        for i in range(500):  # changes until the watch printed two
            if not t.is_alive():
                break
            op.acquire(f"cf-warm-{i}")
            time.sleep(0.01)
        t.join(10)
        assert not t.is_alive() and done[0][0] == EXIT_OK, done
        printed = [json.loads(line) for line in done[0][1].splitlines()]
        assert len(printed) == 2 and cursor.exists()
        # written while no watch ran: printed next, right after the last one printed
        op.acquire("cf-missed-1")
        op.acquire("cf-missed-2")
        now = op.get("cf-missed-2").revision
        after = printed[-1]["revision"]
        code, out, err = _run_watch(seeded, "--cursor-file", str(cursor), "--limit",
                                    str(now - after), "--json")
    assert (code, err) == (EXIT_OK, "")
    again = [json.loads(line) for line in out.splitlines()]
    assert [d["revision"] for d in again] == list(range(after + 1, now + 1))
    assert [d["run_id"] for d in again][-2:] == ["cf-missed-1", "cf-missed-2"]
    assert all("shard" in d for d in again + printed)
    cursor.write_text("fpw1:x")
    code, out, err = _run_watch(seeded, "--cursor-file", str(cursor), "--limit", "1")
    assert code == EXIT_USAGE and "--cursor-file" in err and "cursor" in err
    code, _, err = _run_watch(seeded, "--cursor-file", str(tmp_path / "new"),
                              "--from-revision", "3", "--limit", "1")
    assert code == EXIT_USAGE and "from_revision" in err


def test_watch_compacted_exits_1(make_server: Any) -> None:
    with make_server(history_revisions=3, prune_every_s=0) as srv:
        with SyncClient(srv.address) as client:
            lease = client.acquire("run-1")
            for i in range(5):
                lease.record_checkpoint("k", i)
        code, out, err = _run_watch(srv, "--from-revision", "1", "--json")
    assert (code, err) == (EXIT_REFUSED, "")
    assert json.loads(out)["error"]["code"] == "RUN_REVISION_COMPACTED"


# Run by a fresh interpreter (no gRPC in it): give the CLI the SIGINT
# disposition a terminal user's Ctrl-C meets, then become the CLI.
_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _spawn_cli(*argv: str) -> subprocess.Popen[bytes]:
    """The installed ``fencepost`` binary with SIGINT at its default (a shell
    starts background jobs with SIGINT ignored, and children inherit that).

    Not with ``preexec_fn``: that makes subprocess fork() this process, which
    runs gRPC (the in-process server, the clients). gRPC's fork handlers then
    restart its event engine in the child (a new epoll fd, poller threads),
    the child closes every fd before exec (close_fds), and a poller thread
    that reached epoll_wait in between aborted the child ("epoll_wait error:
    Bad file descriptor", or "Check failed: next_worker->state == KICKED")
    before the CLI ever ran: a few spawns in a hundred, more under load.
    Without preexec_fn subprocess spawns with vfork (no fork handlers run) a
    fresh interpreter that resets SIGINT and execs."""
    exe = Path(sys.executable).parent / "fencepost"
    return subprocess.Popen(
        [sys.executable, "-S", "-c", _WITH_DEFAULT_SIGINT, str(exe), *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _first_line(proc: subprocess.Popen[bytes]) -> str:
    """The CLI's first line ("" if it exited first), read byte by byte: a
    buffered readline takes the lines after it along, and communicate(),
    which reads the pipe itself, never sees them."""
    assert proc.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(proc.stdout.fileno(), 1)
        if not byte:
            break
        line += byte
    return line.decode()


def _stop(proc: subprocess.Popen[bytes]) -> tuple[str, str]:
    """Its remaining stdout and its stderr once it has exited (killed if it
    has not within 20 s)."""
    try:
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out.decode(), err.decode()


def _assert_clean_exit(proc: subprocess.Popen[bytes], first: str, err: str) -> None:
    assert first, f"the CLI printed nothing (exit {proc.returncode}): {err}"
    assert proc.returncode == EXIT_OK, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.slow
def test_watch_binary_stops_cleanly_on_ctrl_c(seeded: ServerThread) -> None:
    proc = _spawn_cli("watch", "--json", "--from-revision", "1", "--addr", seeded.address)
    try:
        first = _first_line(proc)  # it is up and streaming
        if first:
            time.sleep(0.2)  # now blocked waiting for live changes
            proc.send_signal(signal.SIGINT)
    finally:
        _, err = _stop(proc)
    _assert_clean_exit(proc, first, err)
    assert json.loads(first)["revision"] == 1


REPLAY_CHANGES = 600  # ~250 KB of JSON lines: several times a pipe's buffer


def _add_changes(server: ServerThread, n: int) -> None:
    """``n`` more committed changes (one acquire each, sent together)."""

    async def acquire_all() -> None:
        async with fencepost.Client(server.address, owner="worker-h") as client:
            await asyncio.gather(*(client.acquire(f"bulk-{i:04d}") for i in range(n)))

    asyncio.run(acquire_all())


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2], ids=["once", "twice"])
def test_watch_binary_stops_cleanly_on_ctrl_c_during_replay(
    seeded: ServerThread, presses: int
) -> None:
    """Ctrl-C while the replay is still printing: exit 0, no traceback, the
    lines printed whole and a gapless prefix of the history.

    The interrupt lands mid-replay every time: the test reads one line and no
    more before it, so with a history several pipe buffers long the CLI is
    still printing (blocked on the full pipe), its stream still delivering.
    A second press (an impatient user) comes while the CLI unwinds or exits:
    when asyncio.run's own handler took Ctrl-C, it raised KeyboardInterrupt
    there and the CLI was killed by the signal or printed a traceback (this
    case failed in 30 runs of 30, idle or under load; the CLI once hung)."""
    _add_changes(seeded, REPLAY_CHANGES)
    for _ in range(5):
        proc = _spawn_cli("watch", "--json", "--from-revision", "1", "--addr", seeded.address)
        second = threading.Timer(0.02, proc.send_signal, (signal.SIGINT,))
        try:
            first = _first_line(proc)
            if first:
                proc.send_signal(signal.SIGINT)
                if presses == 2:
                    second.start()
        finally:
            out, err = _stop(proc)
            second.cancel()
            if second.is_alive():
                second.join()
        _assert_clean_exit(proc, first, err)
        revisions = [json.loads(line)["revision"] for line in (first + out).splitlines()]
        assert revisions == list(range(1, len(revisions) + 1))
        assert len(revisions) < REPLAY_CHANGES  # it was stopped mid-replay


def test_shards_json_and_text(seeded: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    """One line per shard; run-a holds a lease (run-b is suspended, run-c finished)."""
    code, out, err = run_cli(capsys, seeded, "shards", "--json")
    assert (code, err) == (EXIT_OK, "")
    doc = json.loads(out)
    assert doc["shard_count"] == len(doc["shards"]) == 64 and doc["revision"] >= 3
    assert [s["shard"] for s in doc["shards"]] == list(range(64))
    runs, leases = [0] * 64, [0] * 64
    for run_id in ("run-a", "run-b", "run-c"):
        runs[fencepost.shard_of(run_id, 64)] += 1
    leases[fencepost.shard_of("run-a", 64)] += 1
    assert [s["runs"] for s in doc["shards"]] == runs
    assert [s["leases"] for s in doc["shards"]] == leases
    assert {(s["address"], s["epoch"]) for s in doc["shards"]} == {
        (seeded.address, 0 if seeded.app.leadership is None else seeded.app.leadership.epoch)}

    code, out, _ = run_cli(capsys, seeded, "shards")
    header, *rows = out.splitlines()
    assert code == EXIT_OK
    assert header.split() == ["SHARD", "OWNER", "ADDRESS", "EPOCH", "RUNS", "LEASES"]
    assert len(rows) == 64
    cells = [r.split() for r in rows]
    assert [int(c[0]) for c in cells] == list(range(64))
    assert [(int(c[4]), int(c[5])) for c in cells] == list(zip(runs, leases, strict=True))
    assert {c[2] for c in cells} == {seeded.address}
    assert run_cli(capsys, seeded, "shards", "move")[0] == EXIT_USAGE
