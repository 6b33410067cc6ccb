"""``fencepost hold RUN_ID -- CMD``: real server process, real ``fencepost``
binary, real commands (small Python scripts that report what they saw)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _proc import FENCEPOST, ServerProc

import fencepost
from fencepost import SyncClient

pytestmark = pytest.mark.slow

# The command under hold: writes its environment to REPORT, then behaves as
# MODE says ("exit:N", "sleep:S" exiting 0 on SIGTERM, "stubborn:S" ignoring it).
CMD = r"""
import json, os, signal, sys, time
report, mode = sys.argv[1], sys.argv[2]
keys = ("FENCEPOST_RUN_ID", "FENCEPOST_OWNER", "FENCEPOST_FENCING_TOKEN", "FENCEPOST_ADDR")
def write(**extra):
    with open(report, "a") as f:
        f.write(json.dumps({**{k: os.environ.get(k) for k in keys}, **extra}) + "\n")
kind, _, arg = mode.partition(":")
if kind == "exit":
    write(event="started")
    sys.exit(int(arg))
if kind == "sleep":
    signal.signal(signal.SIGTERM, lambda *a: (write(event="sigterm"), sys.exit(0)))
elif kind == "stubborn":
    signal.signal(signal.SIGTERM, lambda *a: write(event="sigterm-ignored"))
write(event="started")
end = time.monotonic() + float(arg)
while time.monotonic() < end:
    time.sleep(0.02)
write(event="finished")
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    srv = ServerProc(tmp_path / "fp.db", tmp_path / "server.log")
    srv.start()
    try:
        yield srv
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            os.kill(srv.proc.pid, signal.SIGCONT)
        srv.kill()


def _hold(server: ServerProc, report: Path, mode: str, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(FENCEPOST), "hold", *flags, "--addr", server.address, "--",
         sys.executable, "-c", CMD, str(report), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def _events(report: Path) -> list[dict[str, str]]:
    if not report.exists():
        return []
    return [json.loads(line) for line in report.read_text().splitlines()]


def _wait_for(report: Path, event: str, timeout: float = 15) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in _events(report):
            if ev["event"] == event:
                return ev
        time.sleep(0.02)
    raise AssertionError(f"no {event!r} in {_events(report)}")


def test_exit_0_completes_the_run_with_the_lease_in_the_environment(
    server: ServerProc, tmp_path: Path
) -> None:
    report = tmp_path / "r.jsonl"
    code, err = _finish(_hold(server, report, "exit:0", "job-ok", "--owner", "cron-1"))
    assert code == 0, err
    (started,) = _events(report)
    with SyncClient(server.address) as c:
        rec = c.get("job-ok")
    assert rec.status is fencepost.RunStatus.COMPLETED
    assert started["FENCEPOST_RUN_ID"] == "job-ok" and started["FENCEPOST_OWNER"] == "cron-1"
    assert started["FENCEPOST_FENCING_TOKEN"] == str(rec.fencing_token)
    assert started["FENCEPOST_ADDR"] == server.address


def test_exit_3_fails_the_run_with_exit_3_and_hold_exits_3(
    server: ServerProc, tmp_path: Path
) -> None:
    code, err = _finish(_hold(server, tmp_path / "r.jsonl", "exit:3", "job-bad"))
    assert code == 3, err
    with SyncClient(server.address) as c:
        rec = c.get("job-bad")
    assert rec.status is fencepost.RunStatus.FAILED
    assert rec.outcome is not None and rec.outcome.code == "EXIT_3"


def test_release_gives_the_run_back_and_renewal_outlives_the_ttl(
    server: ServerProc, tmp_path: Path
) -> None:
    report = tmp_path / "r.jsonl"
    start = time.monotonic()
    code, err = _finish(_hold(server, report, "sleep:2.5", "job-rel", "--ttl", "1200",
                              "--release"))
    assert code == 0, err
    assert time.monotonic() - start >= 2.5
    assert [e["event"] for e in _events(report)] == ["started", "finished"]  # never stopped
    with SyncClient(server.address) as c:
        rec = c.get("job-rel")
    assert rec.status is fencepost.RunStatus.QUEUED and rec.lease is None
    assert rec.attempt == 1  # held throughout: renewed, never expired and re-taken


def test_operator_cancel_stops_the_command_and_hold_exits_4(
    server: ServerProc, tmp_path: Path
) -> None:
    report = tmp_path / "r.jsonl"
    proc = _hold(server, report, "sleep:60", "job-cancel")
    _wait_for(report, "started")
    with SyncClient(server.address) as op:
        op.cancel("job-cancel", "operator says stop")
    t0 = time.monotonic()
    code, err = _finish(proc)
    assert code == 4, err
    assert time.monotonic() - t0 < 5
    assert "cancelled" in err
    assert [e["event"] for e in _events(report)] == ["started", "sigterm"]
    with SyncClient(server.address) as c:
        assert c.get("job-cancel").status is fencepost.RunStatus.CANCELLED


def test_a_command_ignoring_sigterm_is_killed_after_the_grace(
    server: ServerProc, tmp_path: Path
) -> None:
    report = tmp_path / "r.jsonl"
    proc = _hold(server, report, "stubborn:60", "job-stubborn", "--grace", "0.5")
    _wait_for(report, "started")
    with SyncClient(server.address) as op:
        op.delete("job-stubborn")
    code, err = _finish(proc)
    assert code == 4, err
    assert [e["event"] for e in _events(report)] == ["started", "sigterm-ignored"]


@pytest.mark.parametrize("outage", ["sigstop", "sigkill"])
def test_coordinator_outage_stops_the_command_before_another_may_hold(
    server: ServerProc, tmp_path: Path, outage: str
) -> None:
    report = tmp_path / "r.jsonl"
    proc = _hold(server, report, "sleep:60", "job-outage", "--ttl", "1500")
    _wait_for(report, "started")
    assert server.proc is not None
    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGSTOP if outage == "sigstop" else signal.SIGKILL)
    sigterm = _wait_for(report, "sigterm", timeout=10)
    stopped_after = time.monotonic() - t0
    code, err = _finish(proc)
    assert code == 4, err
    assert sigterm["FENCEPOST_RUN_ID"] == "job-outage"
    # stopped once the lease could no longer be assumed held: within its ttl
    # of the last answered renewal, so at most ~one ttl after the outage
    assert stopped_after < 1.5 + 1.0, stopped_after
    assert "can no longer be assumed held" in err


def test_wait_blocks_until_the_holder_lets_go(server: ServerProc, tmp_path: Path) -> None:
    report = tmp_path / "r.jsonl"
    with SyncClient(server.address, owner="other") as other:
        lease = other.acquire("job-wait", ttl_ms=30_000)
        refused = _hold(server, tmp_path / "no.jsonl", "exit:0", "job-wait")
        code, err = _finish(refused)
        assert code == 1 and "RUN_LEASE_HELD" in err and "'other'" in err
        proc = _hold(server, report, "exit:0", "job-wait", "--wait")
        assert proc.stderr is not None
        waiting = proc.stderr.readline()  # it tried, and waits
        assert "waiting for 'job-wait'" in waiting and "'other'" in waiting
        time.sleep(1.5)
        assert proc.poll() is None and not report.exists()  # still waiting
        lease.release()
        t0 = time.monotonic()
        _wait_for(report, "started")
        assert time.monotonic() - t0 < 1.5
    code, err = _finish(proc)
    assert code == 0, err
    with SyncClient(server.address) as c:
        assert c.get("job-wait").status is fencepost.RunStatus.COMPLETED


def test_a_missing_command_exits_127_and_releases(server: ServerProc, tmp_path: Path) -> None:
    done = subprocess.run(
        [str(FENCEPOST), "hold", "job-missing", "--addr", server.address, "--",
         str(tmp_path / "no-such-binary")],
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 127 and "cannot run" in done.stderr
    with SyncClient(server.address) as c:
        rec = c.get("job-missing")
    assert rec.status is fencepost.RunStatus.QUEUED and rec.lease is None
    no_cmd = subprocess.run([str(FENCEPOST), "hold", "job-x", "--addr", server.address],
                            capture_output=True, text=True, timeout=30)
    assert no_cmd.returncode == 2 and "after --" in no_cmd.stderr
