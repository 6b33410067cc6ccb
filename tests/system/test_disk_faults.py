"""Disk faults at the process level (docs/SPEC.md §9): a ``fencepost serve`` process
whose database hits a file-size limit mid-load, and database files damaged
before start-up.

* ``test_file_size_limit_mid_load``: the server runs under ``RLIMIT_FSIZE``
  (SIGXFSZ ignored, so writes fail with EFBIG instead of killing it) while four
  clients write. Writes then fail with a storage error saying nothing changed,
  and change nothing; reads keep working; once the limit is raised (prlimit
  on the running process) writes resume; after a SIGKILL and restart every
  acknowledged write is there and the file passes ``integrity_check``.
* ``test_corrupt_database_is_refused``: a file damaged in its middle pages, in
  a table the server does not read at start-up, or truncated, is refused with
  a clear message and exit code 1, and left byte for byte untouched.
"""

from __future__ import annotations

import hashlib
import random
import resource
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from _history import check_acks, check_history, fmt, load
from _proc import CHANNEL_OPTIONS, FENCEPOST, ServerProc, reason

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

LIMIT = 1 << 20  # 1 MiB: the WAL reaches it after a few dozen big commits
STORAGE = {"STORAGE_FULL": grpc.StatusCode.RESOURCE_EXHAUSTED,
           "STORAGE_UNAVAILABLE": grpc.StatusCode.UNAVAILABLE}


def _file_size_limit(nbytes: int) -> str:
    """Set-up run in the server's process before it execs the server."""
    return (
        "import resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({nbytes}, hard))\n"
    )


class Writer(threading.Thread):
    """Acquires big new runs and checkpoints them until it has seen enough refusals."""

    def __init__(self, idx: int, addr: str, stop: threading.Event) -> None:
        super().__init__(name=f"writer-{idx}", daemon=True)
        self.idx, self.addr, self.stop = idx, addr, stop
        self.acks: list[dict[str, Any]] = []
        self.refused: list[tuple[str, grpc.StatusCode, str, str]] = []  # (run, code, why, msg)
        self.failure: BaseException | None = None

    def ack(self, op: str, run: Any, sent: int | None) -> None:
        self.acks.append({"op": op, "run_id": run.run_id, "owner": self.name, "sent_token": sent,
                          "token": run.fencing_token, "version": run.version,
                          "revision": run.revision, "status": int(run.status)})

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.addr, options=CHANNEL_OPTIONS) as ch:
                stub = ledger_pb2_grpc.LedgerStub(ch)
                n = 0
                while not self.stop.is_set() and len(self.refused) < 8:
                    n += 1
                    run_id = f"w{self.idx}-{n:05d}-" + "p" * 400
                    try:
                        got = stub.Acquire(pb.AcquireRequest(run_id=run_id, owner=self.name),
                                           timeout=10).run
                        self.ack("acquire", got, None)
                        got = stub.RecordCheckpoint(pb.RecordCheckpointRequest(
                            run_id=run_id, owner=self.name, fencing_token=got.fencing_token,
                            key="k" * 1000, snapshot_version=n), timeout=10).run
                        self.ack("checkpoint", got, got.fencing_token)
                    except grpc.RpcError as err:
                        self.refused.append((run_id, err.code(), reason(err),
                                             err.details() or ""))
        except BaseException as exc:
            self.failure = exc


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_file_size_limit_mid_load(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "fencepost.db", tmp_path / "server.log",
                     prelude=_file_size_limit(LIMIT))
    stop = threading.Event()
    writers: list[Writer] = []
    try:
        srv.start()
        writers = [Writer(i, srv.address, stop) for i in range(4)]
        for w in writers:
            w.start()
        for w in writers:
            w.join(60)
        stop.set()
        assert not any(w.is_alive() for w in writers), "a writer hung"
        assert all(w.failure is None for w in writers), [w.failure for w in writers]
        acks = [a for w in writers for a in w.acks]
        refused = [r for w in writers for r in w.refused]
        assert len(acks) >= 20, "the limit was hit before any load"
        whys = Counter(why for _, _, why, _ in refused)
        print(f"\n{len(acks)} writes acknowledged, then refused: {dict(whys)}")
        # a clear storage error that says nothing changed
        for _run_id, code, why, msg in refused:
            assert why in STORAGE and code == STORAGE[why], (why, code, msg)
            assert "nothing changed" in msg, msg
        assert srv.proc is not None and srv.proc.poll() is None, "the server died:\n" + \
            srv.log_tail()

        with grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
            stub = ledger_pb2_grpc.LedgerStub(ch)
            # refused writes changed nothing: no refused run exists, the revision did not move
            last = max(a["revision"] for a in acks)
            for run_id, *_ in refused:
                if not any(a["run_id"] == run_id for a in acks):
                    with pytest.raises(grpc.RpcError) as gone:
                        stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=5)
                    assert reason(gone.value) == "RUN_NOT_FOUND"
            # reads keep working and show every acknowledged write
            latest: dict[str, dict[str, Any]] = {}
            for a in acks:
                latest[a["run_id"]] = a
            for run_id, a in latest.items():
                resp = stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=5)
                assert (resp.run.version, resp.run.revision) == (a["version"], a["revision"])
                assert resp.revision == last
            # the cause clears: writes resume on the same process
            psutil.Process(srv.proc.pid).rlimit(
                psutil.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            resumed = stub.Acquire(pb.AcquireRequest(run_id="after-the-limit", owner="x"),
                                   timeout=10).run
            assert resumed.revision == last + 1
        # nothing acknowledged is lost across a crash
        srv.kill()
        srv.prelude = ""
        srv.start()
        srv.kill()
        snap = load(srv.db_path)
        problems = check_history(snap) + check_acks(snap, acks)
        assert not problems, fmt(problems)
        assert snap.meta_revision == last + 1
    finally:
        stop.set()
        srv.kill()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database a server wrote and closed cleanly (built once per module)."""
    tmp_path = tmp_path_factory.mktemp("pristine")
    srv = ServerProc(tmp_path / "fencepost.db", tmp_path / "server.log")
    try:
        srv.start()
        with grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
            stub = ledger_pb2_grpc.LedgerStub(ch)
            for i in range(300):
                stub.Acquire(pb.AcquireRequest(run_id=f"run-{i:04d}-" + "y" * 200, owner="w"),
                             timeout=10)
        assert srv.stop() == 0  # checkpoints: everything is in the main file
    finally:
        srv.kill()
    assert not (tmp_path / "fencepost.db-wal").exists() or \
        (tmp_path / "fencepost.db-wal").stat().st_size == 0
    return srv.db_path


def _damage(db: Path, how: str) -> None:
    data = bytearray(db.read_bytes())
    page = 4096
    pages = len(data) // page
    rng = random.Random(how)
    if how == "middle-pages":
        for p in range(pages // 2, pages // 2 + 3):
            data[p * page:(p + 1) * page] = rng.randbytes(page)
    elif how == "unread-table-page":
        # a page of the `changes` table, which start-up does not read
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            leaves = [r[0] for r in con.execute(
                "SELECT pageno FROM dbstat WHERE name = 'changes' AND pagetype = 'leaf'")]
        finally:
            con.close()
        p = leaves[len(leaves) // 2] - 1
        data[p * page + 100:p * page + 4000] = rng.randbytes(3900)
    elif how == "truncated":
        del data[(pages // 2) * page:]
    db.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["middle-pages", "unread-table-page", "truncated"])
def test_corrupt_database_is_refused(tmp_path: Path, pristine: Path, how: str) -> None:
    db = tmp_path / "fencepost.db"
    shutil.copyfile(pristine, db)
    _damage(db, how)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    proc = subprocess.Popen(
        [str(FENCEPOST), "serve", "--listen", "127.0.0.1:0", "--db", str(db)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the server started on a damaged database ({how}):\n{out[-2000:]}")
    assert proc.returncode == 1, out
    assert "refusing to start" in out, out
    assert "Traceback" not in out, out
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before, "the file was modified"
    time.sleep(0.1)
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == "zombie"
