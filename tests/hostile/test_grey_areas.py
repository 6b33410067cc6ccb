"""What the docs now settle: request ids belong to the principal that sent
them, the raw seam under mutual TLS without a policy, and how much a full
disk must get back before writes resume (docs/SECURITY.md, RELIABILITY.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc, record_pb2, run_store_pb2
from fencepost_server.core import codec
from fencepost_server.core import ledger as L
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

TESTS = Path(__file__).resolve().parents[1]
for sub in ("service", "system"):
    if str(TESTS / sub) not in sys.path:
        sys.path.insert(0, str(TESTS / sub))

from _proc import ServerProc  # noqa: E402
from _tls import Answer, Certs, call, make_certs  # noqa: E402

OK, INVALID, DENIED = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                       grpc.StatusCode.PERMISSION_DENIED)
T0 = 1_700_000_000_000


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def mtls(make_server: Any, certs: Certs) -> Iterator[tuple[ServerThread, dict[str, grpc.Channel]]]:
    """Mutual TLS and no policy (every caller has every role), on a manual
    clock; one channel per principal."""
    with make_server(clock=ManualClock(T0), tls_cert=str(certs.server.cert),
                     tls_key=str(certs.server.key), client_ca=str(certs.ca.cert)) as srv:
        chans = {who: grpc.secure_channel(srv.address, certs.creds(who))
                 for who in ("w1", "w2")}
        yield srv, chans
        for ch in chans.values():
            ch.close()


def rpc(ch: grpc.Channel, service: str, method: str, request: Any) -> Answer:
    return call(ch, f"/fencepost.v1.{service}/{method}", "unary_unary",
                request.SerializeToString())


def execute(ch: grpc.Channel, command: pb.Command) -> tuple[grpc.StatusCode, str]:
    """One command on an Execute stream: its result's (code, reason)."""
    got = call(ch, "/fencepost.v1.Ledger/Execute", "stream_stream",
               [pb.ExecuteRequest(commands=[command]).SerializeToString()])
    assert got.code is OK, got
    (result,) = pb.ExecuteResponse.FromString(got.responses[0]).results
    if result.WhichOneof("kind") != "error":
        return OK, ""
    info = error_details_pb2.ErrorInfo()
    result.error.details[0].Unpack(info)
    return grpc.StatusCode(next(c for c in grpc.StatusCode
                                if c.value[0] == result.error.code)), info.reason


def kv_set(rid: str, value: str = "1") -> epb.EngineKvSetRequest:
    return epb.EngineKvSetRequest(agent="a", key="k", value=epb.JsonValue(json=value),
                                  request_id=rid)


# -- request ids -------------------------------------------------------------------


def test_another_principals_request_id_is_refused_on_every_path(mtls: Any) -> None:
    """w2 resending w1's write with w1's request id gets RUN_VALIDATION_ERROR
    naming request_id (before: w1's stored answer, OK), on the engine store,
    the ledger, Transact, Execute and the raw seam; w1's own retry still gets
    its answer."""
    _, ch = mtls
    led = ch["w1"]
    run = rpc(led, "Ledger", "Acquire", pb.AcquireRequest(run_id="r", owner="w1"))
    assert run.code is OK
    rid = {k: uuid.uuid4().hex for k in ("kv", "cancel", "tx", "exec", "raw")}
    tx = pb.TransactionRequest(request_id=rid["tx"], commands=[
        pb.Command(id=1, kv_set=epb.EngineKvSetRequest(agent="a", key="t",
                                                       value=epb.JsonValue(json="2")))])
    cases = [
        ("EngineStore", "KvSet", kv_set(rid["kv"])),
        ("Ledger", "Cancel", pb.CancelRequest(run_id="r", request_id=rid["cancel"])),
        ("Ledger", "Transact", tx),
        ("RunStore", "Delete", run_store_pb2.DeleteRequest(run_id="gone",
                                                           request_id=rid["raw"])),
    ]
    for service, method, req in cases:
        first = rpc(ch["w1"], service, method, req)
        assert first.code is OK, (method, first)
        again = rpc(ch["w1"], service, method, req)
        assert (again.code, again.responses) == (OK, first.responses), (method, again)
        other = rpc(ch["w2"], service, method, req)
        assert (other.code, other.reason, other.metadata.get("field")) == (
            INVALID, "RUN_VALIDATION_ERROR", "request_id"), (method, other)
    cmd = pb.Command(id=1, kv_set=kv_set(rid["exec"], "3"))
    assert execute(ch["w1"], cmd) == (OK, "")
    assert execute(ch["w1"], cmd) == (OK, "")
    assert execute(ch["w2"], cmd) == (INVALID, "RUN_VALIDATION_ERROR")


def test_request_id_fingerprints_without_identities_are_unchanged() -> None:
    """Stored fingerprints must still match after an upgrade: without a
    principal (no identities) a command's is the digest of its repr with an
    empty request id, as it always was; with one it differs."""
    cmds = [L.Cancel("r", "m", request_id="x"),
            L.RawCompareAndSet("r", 1, None, request_id="x"),  # type: ignore[arg-type]
            L.RawDelete("r", request_id="x")]
    for cmd in cmds:
        legacy = repr(dataclasses.replace(cmd, request_id=""))
        legacy = legacy.replace(", bound_to=None", "")
        want = hashlib.blake2b(legacy.encode(), digest_size=16).hexdigest()
        assert codec.fingerprint(cmd) == codec.fingerprint(cmd, "") == want
        assert codec.fingerprint(cmd, "w1") != want
    bound = L.RawDelete("r", request_id="x", bound_to="w1")
    assert codec.fingerprint(bound, "w1") == codec.fingerprint(bound)


# -- the raw seam under mutual TLS without a policy ----------------------------------


def test_raw_seam_cannot_move_another_principals_live_lease(mtls: Any) -> None:
    """With mutual TLS and no policy every caller has every role, yet w2 may
    not move w1's live lease to itself through the raw seam (before: swapped),
    nor rewrite or delete w1's run while that lease is live; once it has
    expired, the run is free to it, as to an Acquire."""
    srv, ch = mtls
    held = rpc(ch["w1"], "Ledger", "Acquire",
               pb.AcquireRequest(run_id="r", owner="w1", lease_ttl_ms=10_000))
    cur = pb.AcquireResponse.FromString(held.responses[0]).run
    steal = record_pb2.Run()
    steal.CopyFrom(cur)
    steal.version += 1
    steal.fencing_token += 1
    steal.lease.owner = "w2"
    swap = run_store_pb2.CompareAndSetRequest(run_id="r", expected_version=cur.version,
                                              next=steal)
    got = rpc(ch["w2"], "RunStore", "CompareAndSet", swap)
    assert (got.code, got.reason, got.metadata.get("owner"), got.metadata.get("principal"),
            got.metadata.get("field")) == (DENIED, "OWNER_NOT_PERMITTED", "w1", "w2",
                                           "run_id"), got
    touch = record_pb2.Run()
    touch.CopyFrom(cur)
    touch.version += 1
    touch.checkpoint_ref.key = "elsewhere"
    got = rpc(ch["w2"], "RunStore", "CompareAndSet", run_store_pb2.CompareAndSetRequest(
        run_id="r", expected_version=cur.version, next=touch))
    assert (got.code, got.reason) == (DENIED, "OWNER_NOT_PERMITTED"), got
    got = rpc(ch["w2"], "RunStore", "Delete", run_store_pb2.DeleteRequest(run_id="r"))
    assert (got.code, got.reason) == (DENIED, "OWNER_NOT_PERMITTED"), got
    now = rpc(ch["w1"], "RunStore", "Get", run_store_pb2.GetRequest(run_id="r"))
    assert run_store_pb2.GetResponse.FromString(now.responses[0]).run == cur
    # the holder itself may rewrite its own run
    assert rpc(ch["w1"], "RunStore", "CompareAndSet", run_store_pb2.CompareAndSetRequest(
        run_id="r", expected_version=cur.version, next=touch)).code is OK
    # expired (and past its lock delay): free, as an Acquire would find it
    srv.clock.advance(10_001 + cur.lease.lock_delay_ms)
    steal.version = touch.version + 1
    got = rpc(ch["w2"], "RunStore", "CompareAndSet", run_store_pb2.CompareAndSetRequest(
        run_id="r", expected_version=touch.version, next=steal))
    assert got.code is OK, got
    assert run_store_pb2.CompareAndSetResponse.FromString(got.responses[0]).swapped


# -- recovering from a full disk -----------------------------------------------------

# Run in the server's process before it execs: a mount namespace of its own
# (and a user namespace, when not root) with a small tmpfs over FP_TMPFS_DIR,
# so the test fills a real file system without touching the machine's.
TMPFS_PRELUDE = '''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x00020000 | (0 if uid == 0 else 0x10000000)) != 0:
    raise SystemExit(f"unshare: {os.strerror(ctypes.get_errno())}")
if uid != 0:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
libc.mount(b"none", b"/", None, 0x4000 | (1 << 18), None)  # MS_REC | MS_PRIVATE
size = f"size={os.environ['FP_TMPFS_SIZE']}".encode()
if libc.mount(b"tmpfs", os.environ["FP_TMPFS_DIR"].encode(), b"tmpfs", 0, size) != 0:
    raise SystemExit(f"mount: {os.strerror(ctypes.get_errno())}")
'''
MiB = 2**20


def _acquires(led: Any, prefix: str, n: int) -> str | None:
    """``n`` acquires on one Execute stream: the first refusal's reason, or None."""
    msg = pb.ExecuteRequest(commands=[pb.Command(id=i + 1, acquire=pb.AcquireRequest(
        run_id=f"{prefix}-{i}", owner="w")) for i in range(n)])
    for resp in led.Execute(iter([msg]), timeout=30):
        for res in resp.results:
            if res.WhichOneof("kind") == "error":
                info = error_details_pb2.ErrorInfo()
                res.error.details[0].Unpack(info)
                return str(info.reason)
    return None


@pytest.mark.slow
@pytest.mark.sqlite_only
def test_freeing_twice_the_wal_lets_writes_resume_and_keep_going(tmp_path: Path) -> None:
    """docs/RELIABILITY.md: after STORAGE_FULL, freeing twice the size of the
    WAL file plus 1 MiB lets writes resume at once and keep going (1,000
    more), though the database first takes room to catch up (the checkpoint
    copies the WAL into it, and the runs table the runs written just before)."""
    data = tmp_path / "data"
    data.mkdir()
    srv = ServerProc(data / "fencepost.db", tmp_path / "server.log", prelude=TMPFS_PRELUDE,
                     env={"FP_TMPFS_DIR": str(data), "FP_TMPFS_SIZE": "24m"},
                     args=("--http-listen", "off"))
    try:
        srv.start()
    except RuntimeError as exc:
        if "unshare:" in str(exc) or "mount:" in str(exc):
            pytest.skip(f"no tmpfs in a namespace of its own here: {exc}")
        raise
    try:
        seen = Path(f"/proc/{srv.proc.pid}/root") / str(data).lstrip("/")  # type: ignore[union-attr]
        fs = free_bytes(seen)
        assert fs < 25 * MiB, "the database is not on the test's tmpfs"
        filler = seen / "filler"
        filler.write_bytes(b"\0" * (fs - 4 * MiB))
        with grpc.insecure_channel(srv.address) as ch:
            led = ledger_pb2_grpc.LedgerStub(ch)
            why = None
            deadline = time.monotonic() + 60
            for n in range(100_000):  # a steady load until the disk is full
                assert time.monotonic() < deadline, "the disk never filled"
                why = _acquires(led, f"{'x' * 200}{n}", 50)
                if why is not None:
                    break
                time.sleep(0.05)
            assert why == "STORAGE_FULL"
            wal = (seen / "fencepost.db-wal").stat().st_size
            freed = 2 * wal + MiB
            filler.write_bytes(b"\0" * (filler.stat().st_size - freed))
            for n in range(20):
                assert _acquires(led, f"after-{n}", 50) is None, (
                    f"refused after {n * 50} writes having freed {freed / MiB:.1f} MiB "
                    f"(WAL {wal / MiB:.1f} MiB)")
                time.sleep(0.1)  # span the runs table's catch-up (about a second)
            got = led.GetRun(pb.GetRunRequest(run_id="after-19-49"), timeout=10).run
            assert got.fencing_token == 1
    finally:
        srv.kill()


def free_bytes(path: Path) -> int:
    """Bytes free on the file system holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
