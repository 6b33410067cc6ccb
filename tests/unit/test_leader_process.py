"""When a coordinator may call the leader's process gone (and take over in
place without waiting for the leader lease): only when it provably no longer
runs on this machine. Real processes: started, paused, exited, reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fencepost_server.ha.leadership import process_gone, process_proof

pytestmark = pytest.mark.skipif(not process_proof(), reason="needs Linux /proc")


def _child(code: str = "import time; time.sleep(60)") -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def _proof_when_up(p: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proof = process_proof(p.pid)
        if proof:
            return proof
        time.sleep(0.01)
    raise AssertionError("no /proc entry for the child")


def test_a_running_process_is_not_gone_and_names_boot_namespace_pid_and_start() -> None:
    mine = process_proof()
    boot, ns, pid, start = mine.split(" ")
    assert len(boot) == 36 and ns.startswith("pid:[") and pid == str(os.getpid())
    assert int(start) > 0
    assert not process_gone(mine)


def test_a_paused_process_is_not_gone() -> None:
    p = _child()
    try:
        proof = _proof_when_up(p)
        p.send_signal(signal.SIGSTOP)
        assert not process_gone(proof)
    finally:
        p.kill()
        p.wait()


def test_an_exited_process_is_gone_reaped_or_not() -> None:
    p = _child()
    proof = _proof_when_up(p)
    assert not process_gone(proof)
    p.kill()
    deadline = time.monotonic() + 10
    while not process_gone(proof):  # a zombie until reaped: gone already
        assert time.monotonic() < deadline, "a killed child still counts as running"
        time.sleep(0.01)
    assert os.path.exists(f"/proc/{p.pid}"), "the zombie was reaped before the check"
    p.wait()
    assert process_gone(proof)


def test_a_pid_reused_by_a_later_process_is_gone() -> None:
    boot, ns, pid, start = process_proof().split(" ")
    # this very pid, started at another time: another process
    assert process_gone(f"{boot} {ns} {pid} {int(start) + 1}")


def test_a_command_name_with_spaces_and_parentheses_is_read_right() -> None:
    """The same process before and after it renames itself "a) b (c": a
    parser that split the stat line at the first ")" or at every space would
    read another field as its start time after the rename."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.stdin.readline(); "
         "open('/proc/self/comm', 'w').write('a) b (c'); time.sleep(60)"],
        stdin=subprocess.PIPE)
    try:
        before = _proof_when_up(p)
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.flush()
        deadline = time.monotonic() + 10
        while "a) b (c" not in open(f"/proc/{p.pid}/stat").read():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proof = process_proof(p.pid)
        assert proof == before
        assert not process_gone(proof)
    finally:
        p.kill()
        p.wait()
        if p.stdin is not None:
            p.stdin.close()
    assert process_gone(proof)


@pytest.mark.parametrize("proof", [
    "",  # a leader row written before processes were recorded
    "not a proof",
    "00000000-0000-0000-0000-000000000000 {ns} 999999999 1",  # another machine or boot
    "{boot} pid:[1] 999999999 1",  # another PID namespace (a container)
    "{boot} {ns} -1 1",
    "{boot} {ns} 0 1",
    "{boot} {ns} x 1",
])
def test_what_cannot_be_told_is_never_gone(proof: str) -> None:
    boot, ns, _, _ = process_proof().split(" ")
    assert not process_gone(proof.format(boot=boot, ns=ns))
