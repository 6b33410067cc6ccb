"""Identity and authorization on the wire, with certificates made in the test:
every RPC x every role (allowed, or refused with the exact code, reason and
``role``), every Execute command x every role, impersonation on every
owner-bearing path, TLS handshake failures, bearer tokens, identity sources,
the safe default for plaintext, and certificate reload."""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _db import Databases
from _tls import (
    ADMIN_TOKEN,
    PRINCIPALS,
    SCRIPT_TOKEN,
    Answer,
    Certs,
    answer_of,
    call,
    make_certs,
    methods,
    write_policy,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import (
    engine_store_pb2_grpc,
    ledger_pb2_grpc,
    record_pb2,
    run_store_pb2,
)
from fencepost.v1 import ledger_pb2 as pb
from fencepost_server.config import ConfigError, Settings
from fencepost_server.testing.server import ServerThread
from fencepost_server.tls import security

PD, UA, OK = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
              grpc.StatusCode.OK)

# The roles of the product, written out independently of the server's table.
WORKER_LEDGER = {"Acquire", "Renew", "RecordCheckpoint", "Suspend", "Finish", "Release",
                 "KeepAlive", "Execute", "Transact", "ValidateFence", "GetRun", "Shards"}
OPERATOR_LEDGER = {"Cancel", "RequestResume", "GetRun", "ListRuns", "WatchRuns",
                   "ValidateFence", "Execute", "Transact", "Shards", "MoveShard"}
WORKER_COMMANDS = {"acquire", "renew", "record_checkpoint", "suspend", "finish", "release",
                   "create_run", "update_run", "claim_run", "renew_claim", "append_step",
                   "save_checkpoint", "claim_key", "acquire_lock", "release_lock", "put_effect",
                   "kv_set", "doc_upsert", "doc_delete", "transaction"}
OPERATOR_COMMANDS = {"cancel", "request_resume", "transaction"}
ROLE_OF = {"admin": "admin", "op": "operator", "w1": "worker", "w2": "worker", "nobody": None}


def roles_allowed(method: str) -> set[str]:
    service, name = method.strip("/").split("/")
    allowed = {"admin"}
    if service == "fencepost.v1.EngineStore" or (name in WORKER_LEDGER and "Ledger" in service):
        allowed.add("worker")
    if "Ledger" in service and name in OPERATOR_LEDGER:
        allowed.add("operator")
    return allowed


def needed(allowed: set[str]) -> str:
    rest = sorted(allowed - {"admin"})
    return ",".join(rest) if rest else "admin"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _server(dbs: Databases, certs: Certs, name: str = "fencepost", **kw: Any) -> ServerThread:
    settings: dict[str, Any] = {"tls_cert": str(certs.server.cert),
                                "tls_key": str(certs.server.key)}
    settings.update(kw)
    return dbs.server(name, **settings).start()


@pytest.fixture(scope="module")
def authz_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs,
                 module_databases: Databases) -> Iterator[ServerThread]:
    """Mutual TLS + a policy with every role."""
    tmp = tmp_path_factory.mktemp("authz")
    srv = _server(module_databases, certs, "authz", client_ca=str(certs.ca.cert),
                  authz=str(write_policy(tmp / "policy.toml")))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def mtls_server(certs: Certs, module_databases: Databases) -> Iterator[ServerThread]:
    """Mutual TLS, no policy: every caller has every role; owners still bound."""
    srv = _server(module_databases, certs, "mtls", client_ca=str(certs.ca.cert))
    yield srv
    srv.close()


def _channels(srv: ServerThread, certs: Certs) -> Iterator[dict[str, grpc.Channel]]:
    """One channel per principal, each with its own client certificate."""
    chans = {who: grpc.secure_channel(srv.address, certs.creds(who)) for who in PRINCIPALS}
    yield chans
    for ch in chans.values():
        ch.close()


@pytest.fixture(scope="module")
def channels(authz_server: ServerThread, certs: Certs) -> Iterator[dict[str, grpc.Channel]]:
    yield from _channels(authz_server, certs)


@pytest.fixture(scope="module")
def mtls_channels(mtls_server: ServerThread, certs: Certs) -> Iterator[dict[str, grpc.Channel]]:
    yield from _channels(mtls_server, certs)


# -- every RPC x every role -----------------------------------------------------------

ALL_METHODS = sorted(methods())


def test_the_role_table_covers_every_rpc() -> None:
    from fencepost_server.auth import RPC_ROLES

    assert {m for m, _ in ALL_METHODS} <= set(RPC_ROLES)


@pytest.mark.parametrize("who", PRINCIPALS)
def test_every_rpc_for_every_role(channels: dict[str, grpc.Channel], who: str) -> None:
    role = ROLE_OF[who]
    for method, kind in ALL_METHODS:
        allowed = roles_allowed(method)
        timeout = 0.5 if method.endswith("/WatchRuns") else 5.0
        got = call(channels[who], method, kind, timeout=timeout)
        if role in allowed:
            assert got.reason != "PERMISSION_DENIED" and got.code is not UA, (method, who, got)
        else:
            assert (got.code, got.reason, got.metadata.get("role"),
                    got.metadata.get("principal")) == (PD, "PERMISSION_DENIED",
                                                       needed(allowed), who), (method, got)


def _execute(channel: grpc.Channel, *commands: pb.Command, token: str | None = None,
             ) -> dict[int, pb.CommandResult]:
    md = (("authorization", f"Bearer {token}"),) if token else None
    stub = ledger_pb2_grpc.LedgerStub(channel)
    out: dict[int, pb.CommandResult] = {}
    for resp in stub.Execute(iter([pb.ExecuteRequest(commands=list(commands))]), metadata=md,
                             timeout=10):
        for r in resp.results:
            out[r.id] = r
    return out


def _error(result: pb.CommandResult) -> Answer:
    assert result.WhichOneof("kind") == "error", result
    return answer_of(result.error, grpc.StatusCode(
        next(c for c in grpc.StatusCode if c.value[0] == result.error.code)),
        result.error.message)


COMMAND_KINDS = [f.name for f in pb.Command.DESCRIPTOR.oneofs_by_name["kind"].fields]


@pytest.mark.parametrize("who", PRINCIPALS)
def test_every_execute_command_for_every_role(channels: dict[str, grpc.Channel], who: str) -> None:
    role = ROLE_OF[who]
    if role is None:  # no role: the stream itself is refused
        got = call(channels[who], "/fencepost.v1.Ledger/Execute", "stream_stream")
        assert (got.code, got.reason, got.metadata["role"]) == (PD, "PERMISSION_DENIED",
                                                                "operator,worker")
        return
    commands = []
    for i, kind in enumerate(COMMAND_KINDS, start=1):
        cmd = pb.Command(id=i)
        getattr(cmd, kind).SetInParent()
        commands.append(cmd)
    results = _execute(channels[who], *commands)
    assert set(results) == set(range(1, len(COMMAND_KINDS) + 1))
    for i, kind in enumerate(COMMAND_KINDS, start=1):
        allowed = {"admin"} | ({"worker"} if kind in WORKER_COMMANDS else set()) | (
            {"operator"} if kind in OPERATOR_COMMANDS else set())
        r = results[i]
        if role in allowed:
            assert r.WhichOneof("kind") != "error" or _error(r).reason != "PERMISSION_DENIED"
        else:
            e = _error(r)
            assert (e.code, e.reason, e.metadata["role"]) == (PD, "PERMISSION_DENIED",
                                                              needed(allowed)), (kind, e)


def test_health_and_reflection_stay_open(authz_server: ServerThread, certs: Certs) -> None:
    # a certificate is still needed to connect (mutual TLS), but no role
    with grpc.secure_channel(authz_server.address, certs.creds("nobody")) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        got = call(ch, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                   "stream_stream", [b"\x3a\x00"])  # list_services
        assert got.code is OK and got.responses


# -- owners bound to principals -------------------------------------------------------


def _owner_refused(got: Answer, owner: str, principal: str) -> None:
    assert (got.code, got.reason, got.metadata.get("owner"), got.metadata.get("principal")) == (
        PD, "OWNER_NOT_PERMITTED", owner, principal), got


def _rpc(ch: grpc.Channel, service: str, method: str, request: Any) -> Answer:
    return call(ch, f"/fencepost.v1.{service}/{method}", "unary_unary",
                request.SerializeToString())


@pytest.fixture(params=["authz", "mtls-only"])
def chans(request: pytest.FixtureRequest) -> dict[str, grpc.Channel]:
    name = "channels" if request.param == "authz" else "mtls_channels"
    chans: dict[str, grpc.Channel] = request.getfixturevalue(name)
    return chans


def test_a_worker_cannot_finish_another_workers_run(chans: dict[str, grpc.Channel]) -> None:
    """The reported hole: read the owner and token, then Finish as that owner."""
    w1, w2 = (ledger_pb2_grpc.LedgerStub(chans[w]) for w in ("w1", "w2"))
    run = f"victim-{time.monotonic_ns()}"
    tok = w2.Acquire(pb.AcquireRequest(run_id=run, owner="w2/job")).run.fencing_token
    seen = w1.GetRun(pb.GetRunRequest(run_id=run)).run
    assert seen.lease.owner == "w2/job"
    got = _rpc(chans["w1"], "Ledger", "Finish", pb.FinishRequest(
        run_id=run, owner=seen.lease.owner, fencing_token=tok,
        status=record_pb2.RUN_STATUS_COMPLETED))
    _owner_refused(got, "w2/job", "w1")
    assert w1.GetRun(pb.GetRunRequest(run_id=run)).run.status == record_pb2.RUN_STATUS_RUNNING


def test_impersonation_on_every_unary_ledger_call(chans: dict[str, grpc.Channel]) -> None:
    ch = chans["w1"]
    run = f"u-{time.monotonic_ns()}"
    for method, req in (
        ("Acquire", pb.AcquireRequest(run_id=run, owner="w2")),
        ("Acquire", pb.AcquireRequest(run_id=run, owner="w1x")),  # a prefix is not enough
        ("Renew", pb.RenewRequest(run_id=run, owner="w2", fencing_token=1)),
        ("RecordCheckpoint", pb.RecordCheckpointRequest(run_id=run, owner="w2", fencing_token=1,
                                                        key="k")),
        ("Suspend", pb.SuspendRequest(run_id=run, owner="w2", fencing_token=1)),
        ("Finish", pb.FinishRequest(run_id=run, owner="w2", fencing_token=1,
                                    status=record_pb2.RUN_STATUS_COMPLETED)),
        ("Release", pb.ReleaseRequest(run_id=run, owner="w2", fencing_token=1)),
    ):
        _owner_refused(_rpc(ch, "Ledger", method, req), req.owner, "w1")
    # its own name and its own sub-names are fine
    w1 = ledger_pb2_grpc.LedgerStub(ch)
    rec = w1.Acquire(pb.AcquireRequest(run_id=run, owner="w1/a")).run
    assert rec.lease.owner == "w1/a"
    w1.Release(pb.ReleaseRequest(run_id=run, owner="w1/a", fencing_token=rec.fencing_token))
    assert w1.Acquire(pb.AcquireRequest(run_id=run + "b", owner="w1")).run.fencing_token == 1


def test_the_fence_still_applies_to_the_right_identity(chans: dict[str, grpc.Channel]) -> None:
    w1 = ledger_pb2_grpc.LedgerStub(chans["w1"])
    run = f"stale-{time.monotonic_ns()}"
    old = w1.Acquire(pb.AcquireRequest(run_id=run, owner="w1/a")).run.fencing_token
    w1.Release(pb.ReleaseRequest(run_id=run, owner="w1/a", fencing_token=old))
    w1.Acquire(pb.AcquireRequest(run_id=run, owner="w1/b"))
    got = _rpc(chans["w1"], "Ledger", "Finish", pb.FinishRequest(
        run_id=run, owner="w1/a", fencing_token=old, status=record_pb2.RUN_STATUS_COMPLETED))
    assert (got.code, got.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "RUN_LEASE_LOST")


def test_impersonation_on_keepalive_hello(chans: dict[str, grpc.Channel]) -> None:
    hello = pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w2")).SerializeToString()
    got = call(chans["w1"], "/fencepost.v1.Ledger/KeepAlive", "stream_stream", [hello])
    _owner_refused(got, "w2", "w1")
    # renew and track are made as the hello's owner: another's lease is not renewed
    w2 = ledger_pb2_grpc.LedgerStub(chans["w2"])
    run = f"ka-{time.monotonic_ns()}"
    tok = w2.Acquire(pb.AcquireRequest(run_id=run, owner="w2")).run.fencing_token
    q: queue.Queue[pb.KeepAliveRequest | None] = queue.Queue()
    q.put(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w1")))
    q.put(pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id=run, fencing_token=tok)))
    q.put(pb.KeepAliveRequest(track=pb.KeepAliveTrack(run_id=run, fencing_token=tok)))
    responses = ledger_pb2_grpc.LedgerStub(chans["w1"]).KeepAlive(iter(q.get, None), timeout=10)
    first = next(responses)
    first = first.batch[0] if first.batch else first
    # the renewal was made as w1, who does not hold the lease: lost, not renewed
    assert first.WhichOneof("kind") == "lost", first
    q.put(None)
    responses.cancel()
    assert w2.GetRun(pb.GetRunRequest(run_id=run)).run.lease.owner == "w2"


def test_impersonation_on_execute_is_refused_per_command(chans: dict[str, grpc.Channel]) -> None:
    run = f"ex-{time.monotonic_ns()}"
    results = _execute(
        chans["w1"],
        pb.Command(id=1, acquire=pb.AcquireRequest(run_id=run, owner="w2")),
        pb.Command(id=2, finish=pb.FinishRequest(run_id=run, owner="w2", fencing_token=1,
                                                 status=record_pb2.RUN_STATUS_COMPLETED)),
        pb.Command(id=3, claim_run=epb.EngineClaimRunRequest(id=run, owner="w2", ttl_ms=1000)),
        pb.Command(id=4, acquire_lock=epb.EngineAcquireLockRequest(key=run, owner="w2",
                                                                    ttl_ms=1000)),
        pb.Command(id=5, release_lock=epb.EngineReleaseLockRequest(key=run, owner="w2")),
        pb.Command(id=6, renew_claim=epb.EngineRenewClaimRequest(id=run, owner="w2",
                                                                  ttl_ms=1000)),
        pb.Command(id=7, update_run=epb.EngineUpdateRunRequest(id=run, expect_owner="w2")),
        pb.Command(id=8, acquire=pb.AcquireRequest(run_id=run, owner="w1/ok")),
    )
    fields = {1: "acquire.owner", 2: "finish.owner", 3: "claim_run.owner",
              4: "acquire_lock.owner", 5: "release_lock.owner", 6: "renew_claim.owner",
              7: "update_run.expect_owner"}
    for i, field in fields.items():
        e = _error(results[i])
        _owner_refused(e, "w2", "w1")
        assert e.metadata["field"] == field
    assert results[8].acquire.run.lease.owner == "w1/ok"  # the stream went on


def test_every_command_of_a_transaction_is_checked_as_if_sent_alone(
    channels: dict[str, grpc.Channel],
) -> None:
    """Ledger.Transact and Execute's transaction: a command inside may not name
    another's owner, nor be one the caller's role may not send, and a refusal
    names the command; nothing of the transaction is applied."""
    run = f"tx-{time.monotonic_ns()}"

    def tx(*cmds: pb.Command) -> pb.TransactionRequest:
        return pb.TransactionRequest(commands=list(cmds))

    ok = pb.Command(acquire=pb.AcquireRequest(run_id=run, owner="w1/ok"))
    impersonating = tx(ok, pb.Command(claim_run=epb.EngineClaimRunRequest(
        id=run, owner="w2", ttl_ms=1000)))
    got = _rpc(channels["w1"], "Ledger", "Transact", impersonating)
    _owner_refused(got, "w2", "w1")
    assert got.metadata["field"] == "commands[1].claim_run.owner"
    e = _error(_execute(channels["w1"], pb.Command(id=1, transaction=impersonating))[1])
    _owner_refused(e, "w2", "w1")
    assert e.metadata["field"] == "transaction.commands[1].claim_run.owner"
    # an operator may send a transaction, but not a worker's command inside it
    got = _rpc(channels["op"], "Ledger", "Transact", tx(pb.Command(
        acquire=pb.AcquireRequest(run_id=run, owner="op"))))
    assert (got.code, got.reason, got.metadata.get("role")) == (PD, "PERMISSION_DENIED",
                                                                 "worker")
    e = _error(_execute(channels["op"], pb.Command(id=1, transaction=tx(pb.Command(
        acquire=pb.AcquireRequest(run_id=run, owner="op")))))[1])
    assert (e.code, e.reason) == (PD, "PERMISSION_DENIED")
    ledger = ledger_pb2_grpc.LedgerStub(channels["admin"])
    with pytest.raises(grpc.RpcError):  # none of it was applied
        ledger.GetRun(pb.GetRunRequest(run_id=run))
    # the worker's own transaction goes through
    done = ledger_pb2_grpc.LedgerStub(channels["w1"]).Transact(tx(ok))
    assert done.results[0].acquire.run.lease.owner == "w1/ok"


def test_impersonation_on_the_engine_store(chans: dict[str, grpc.Channel]) -> None:
    ch = chans["w1"]
    run = f"es-{time.monotonic_ns()}"
    store = engine_store_pb2_grpc.EngineStoreStub(ch)
    store.CreateRun(epb.EngineCreateRunRequest(run=epb.EngineRun(id=run, agent="a",
                                                                 status="queued")))
    for method, req in (
        ("ClaimRun", epb.EngineClaimRunRequest(id=run, owner="w2", ttl_ms=1000)),
        ("RenewClaim", epb.EngineRenewClaimRequest(id=run, owner="w2", ttl_ms=1000)),
        ("AcquireLock", epb.EngineAcquireLockRequest(key=run, owner="w2", ttl_ms=1000)),
        ("ReleaseLock", epb.EngineReleaseLockRequest(key=run, owner="w2")),
        ("UpdateRun", epb.EngineUpdateRunRequest(id=run, expect_owner="w2")),
    ):
        _owner_refused(_rpc(ch, "EngineStore", method, req), "w2", "w1")
    assert store.ClaimRun(epb.EngineClaimRunRequest(id=run, owner="w1/x", ttl_ms=1000)).claimed
    assert store.AcquireLock(epb.EngineAcquireLockRequest(key=run, owner="w1",
                                                          ttl_ms=1000)).acquired


def _held_by_w2_and_rewritten(chans: dict[str, grpc.Channel],
                              run: str) -> tuple[record_pb2.Run, record_pb2.Run]:
    """``run`` acquired by w2, and its next version that keeps w2's lease and
    only points the checkpoint elsewhere (a rewrite, no grant)."""
    cur = ledger_pb2_grpc.LedgerStub(chans["w2"]).Acquire(
        pb.AcquireRequest(run_id=run, owner="w2")).run
    nxt = record_pb2.Run()
    nxt.CopyFrom(cur)
    nxt.version += 1
    nxt.checkpoint_ref.key, nxt.checkpoint_ref.snapshot_version = "raw-k", 1
    return cur, nxt


def test_raw_seam_owners_are_bound_without_a_policy(mtls_channels: dict[str, grpc.Channel],
                                                    channels: dict[str, grpc.Channel]) -> None:
    run = f"raw-{time.monotonic_ns()}"
    rec = record_pb2.Run(schema=1, run_id=run, status=record_pb2.RUN_STATUS_RUNNING,
                         fencing_token=1, version=1, attempt=1,
                         lease=record_pb2.Lease(owner="w2"))
    got = _rpc(mtls_channels["w1"], "RunStore", "Create", run_store_pb2.CreateRequest(run=rec))
    _owner_refused(got, "w2", "w1")
    later = record_pb2.Run()
    later.CopyFrom(rec)
    later.version = 2
    got = _rpc(mtls_channels["w1"], "RunStore", "CompareAndSet",
               run_store_pb2.CompareAndSetRequest(run_id=run, expected_version=1, next=later))
    _owner_refused(got, "w2", "w1")
    # rewriting a record that keeps its current holder is no grant: allowed
    # to the holder, and refused to another principal while the lease is live
    cur, nxt = _held_by_w2_and_rewritten(mtls_channels, run)
    got = _rpc(mtls_channels["w1"], "RunStore", "CompareAndSet",
               run_store_pb2.CompareAndSetRequest(run_id=run, expected_version=cur.version,
                                                  next=nxt))
    _owner_refused(got, "w2", "w1")
    got = _rpc(mtls_channels["w2"], "RunStore", "CompareAndSet",
               run_store_pb2.CompareAndSetRequest(run_id=run, expected_version=cur.version,
                                                  next=nxt))
    assert got.code is OK, got
    # ... but expecting another version is judged as a grant
    nxt.version = cur.version + 5
    got = _rpc(mtls_channels["w1"], "RunStore", "CompareAndSet",
               run_store_pb2.CompareAndSetRequest(run_id=run, expected_version=cur.version + 4,
                                                  next=nxt))
    _owner_refused(got, "w2", "w1")
    # with a policy, the raw seam is the admin's, and an admin is not bound
    got = _rpc(channels["admin"], "RunStore", "Create", run_store_pb2.CreateRequest(run=rec))
    assert got.reason != "OWNER_NOT_PERMITTED", got


def test_a_raw_swap_that_kept_the_holder_is_answered_again_on_retry(
        mtls_channels: dict[str, grpc.Channel]) -> None:
    """A retry of a swap already made (its answer lost with the connection)
    gets that answer, though the version it expected is gone: the binding is
    judged against the version the swap replaced, after the request id. The
    same id from another principal is a different request."""
    cur, nxt = _held_by_w2_and_rewritten(mtls_channels, f"raw-retry-{time.monotonic_ns()}")
    run = cur.run_id
    req = run_store_pb2.CompareAndSetRequest(run_id=run, expected_version=cur.version,
                                             next=nxt, request_id=uuid.uuid4().hex)
    first = _rpc(mtls_channels["w2"], "RunStore", "CompareAndSet", req)
    again = _rpc(mtls_channels["w2"], "RunStore", "CompareAndSet", req)
    assert first.code is OK and again.code is OK, (first, again)
    answers = [run_store_pb2.CompareAndSetResponse.FromString(a.responses[0])
               for a in (first, again)]
    assert answers[0] == answers[1] and answers[0].swapped, answers
    assert answers[0].run.version == cur.version + 1
    other = _rpc(mtls_channels["nobody"], "RunStore", "CompareAndSet", req)
    assert (other.code, other.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                          "RUN_VALIDATION_ERROR"), other
    # a swap that would give the lease away is still refused, and so is its retry
    nxt.version = cur.version + 5
    give = run_store_pb2.CompareAndSetRequest(run_id=run, expected_version=cur.version + 4,
                                              next=nxt, request_id=uuid.uuid4().hex)
    for _ in range(2):
        _owner_refused(_rpc(mtls_channels["w1"], "RunStore", "CompareAndSet", give), "w2", "w1")


def test_an_admin_may_use_any_owner(channels: dict[str, grpc.Channel]) -> None:
    admin = ledger_pb2_grpc.LedgerStub(channels["admin"])
    run = f"adm-{time.monotonic_ns()}"
    rec = admin.Acquire(pb.AcquireRequest(run_id=run, owner="w2")).run
    admin.Finish(pb.FinishRequest(run_id=run, owner="w2", fencing_token=rec.fencing_token,
                                  status=record_pb2.RUN_STATUS_COMPLETED))


# -- TLS failures ---------------------------------------------------------------------


def _health(ch: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError as err:
        return err.code()  # type: ignore[attr-defined,no-any-return]
    return OK


def test_plaintext_client_against_a_tls_server(mtls_server: ServerThread) -> None:
    with grpc.insecure_channel(mtls_server.address) as ch:
        assert _health(ch) is grpc.StatusCode.UNAVAILABLE


def test_no_untrusted_or_expired_client_certificate(mtls_server: ServerThread, certs: Certs,
                                                    tmp_path: Path) -> None:
    from torture.certs import CA

    other = CA(tmp_path / "other", "some other CA")
    stranger = other.issue("w1", cn="w1")
    expired = certs.ca.issue("expired", cn="w1", expired=True)
    cases = {
        "no client certificate": grpc.ssl_channel_credentials(certs.ca.cert_pem),
        "signed by another CA": grpc.ssl_channel_credentials(
            certs.ca.cert_pem, stranger.key_pem, stranger.cert_pem),
        "expired": grpc.ssl_channel_credentials(certs.ca.cert_pem, expired.key_pem,
                                                expired.cert_pem),
    }
    for what, creds in cases.items():
        with grpc.secure_channel(mtls_server.address, creds) as ch:
            assert _health(ch) is grpc.StatusCode.UNAVAILABLE, what
    with grpc.secure_channel(mtls_server.address, certs.creds("w1")) as ch:
        assert _health(ch) is OK


def test_tls_without_client_certificates_changes_nothing_else(databases: Databases,
                                                              certs: Certs) -> None:
    srv = _server(databases, certs)
    try:
        with grpc.secure_channel(srv.address, certs.creds(None)) as ch:
            led = ledger_pb2_grpc.LedgerStub(ch)
            assert led.Acquire(pb.AcquireRequest(run_id="r", owner="anyone")).run.fencing_token
        with grpc.insecure_channel(srv.address) as ch:  # TLS only: no plaintext port
            assert _health(ch) is grpc.StatusCode.UNAVAILABLE
    finally:
        srv.close()


# -- bearer tokens ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory,
                 module_databases: Databases) -> Iterator[ServerThread]:
    """Plaintext on loopback with a [tokens] table: callers need a token."""
    tmp = tmp_path_factory.mktemp("tokens")
    srv = module_databases.server("tokens", authz=str(write_policy(tmp / "p.toml"))).start()
    yield srv
    srv.close()


def test_bearer_tokens_right_wrong_and_missing(token_server: ServerThread) -> None:
    get = pb.GetRunRequest(run_id="nope").SerializeToString()
    m = "/fencepost.v1.Ledger/GetRun"
    with grpc.insecure_channel(token_server.address) as ch:
        assert call(ch, m, "unary_unary", get, token=ADMIN_TOKEN).reason == "RUN_NOT_FOUND"
        for bad in ("wrong", SCRIPT_TOKEN + "x"):
            got = call(ch, m, "unary_unary", get, token=bad)
            assert (got.code, got.reason) == (UA, "UNAUTHENTICATED"), got
        got = call(ch, m, "unary_unary", get)
        assert (got.code, got.reason) == (UA, "UNAUTHENTICATED")
        md = (("authorization", "Basic dXNlcjpwYXNz"),)
        with pytest.raises(grpc.RpcError) as ei:
            ledger_pb2_grpc.LedgerStub(ch).GetRun(pb.GetRunRequest(run_id="x"), metadata=md)
        assert ei.value.code() is UA  # type: ignore[attr-defined]
        # a token's principal has the roles the policy gives it: "script" has none
        got = call(ch, m, "unary_unary", get, token=SCRIPT_TOKEN)
        assert (got.code, got.reason, got.metadata["principal"]) == (
            PD, "PERMISSION_DENIED", "script")
        # health stays open without credentials
        assert _health(ch) is OK


def test_a_token_on_a_mutual_tls_connection_names_the_principal(
        channels: dict[str, grpc.Channel]) -> None:
    run = f"tok-{time.monotonic_ns()}"
    acq = pb.AcquireRequest(run_id=run, owner="w2").SerializeToString()
    # w1's certificate with the admin token: the admin may use any owner
    got = call(channels["w1"], "/fencepost.v1.Ledger/Acquire", "unary_unary", acq,
               token=ADMIN_TOKEN)
    assert got.code is OK, got
    results = _execute(channels["nobody"],
                       pb.Command(id=1, cancel=pb.CancelRequest(run_id=run)),
                       token=ADMIN_TOKEN)
    assert results[1].cancel.run.status == record_pb2.RUN_STATUS_CANCELLED


# -- identity sources -----------------------------------------------------------------


def _principal_seen(ch: grpc.Channel) -> str:
    got = _rpc(ch, "Ledger", "Acquire", pb.AcquireRequest(run_id="who", owner="-probe-"))
    assert got.reason == "OWNER_NOT_PERMITTED", got
    return got.metadata["principal"]


@pytest.mark.parametrize("source,expected", [
    ("auto", "spiffe://example.org/worker/a"),
    ("spiffe", "spiffe://example.org/worker/a"),
    ("dns", "a.workers.example"),
    ("cn", "cn-a"),
])
def test_identity_sources(databases: Databases, certs: Certs, source: str, expected: str
                          ) -> None:
    full = certs.ca.issue(f"full-{source}", cn="cn-a", dns=("a.workers.example", "b.example"),
                          uris=("spiffe://example.org/worker/a",))
    srv = _server(databases, certs, client_ca=str(certs.ca.cert), identity_from=source)
    try:
        creds = grpc.ssl_channel_credentials(certs.ca.cert_pem, full.key_pem, full.cert_pem)
        with grpc.secure_channel(srv.address, creds) as ch:
            assert _principal_seen(ch) == expected
        # auto: two URI SANs are no SPIFFE id -> the DNS SAN; no SAN -> the CN
        if source == "auto":
            two = certs.ca.issue("two-uris", cn="cn-b", dns=("b.workers.example",),
                                 uris=("spiffe://example.org/x", "spiffe://example.org/y"))
            for pair, want in ((two, "b.workers.example"), (certs.clients["w1"], "w1")):
                creds = grpc.ssl_channel_credentials(certs.ca.cert_pem, pair.key_pem,
                                                     pair.cert_pem)
                with grpc.secure_channel(srv.address, creds) as ch:
                    assert _principal_seen(ch) == want
        if source == "spiffe":  # a certificate without the chosen field: UNAUTHENTICATED
            with grpc.secure_channel(srv.address, certs.creds("w1")) as ch:
                got = _rpc(ch, "Ledger", "GetRun", pb.GetRunRequest(run_id="x"))
                assert (got.code, got.reason) == (UA, "UNAUTHENTICATED")
    finally:
        srv.close()


# -- start-up checks -------------------------------------------------------------------


def test_plaintext_on_a_public_address_refuses_to_start(tmp_path: Path) -> None:
    from fencepost_server.cli import main

    for listen in ("0.0.0.0:0", "[::]:0", "10.1.2.3:50051", "example.com:50051"):
        with pytest.raises(ConfigError, match="--allow-insecure"):
            security(Settings(listen=listen))
    for listen in ("127.0.0.1:0", "localhost:50051", "[::1]:0", "127.8.0.1:1"):
        security(Settings(listen=listen))
    security(Settings(listen="0.0.0.0:0", allow_insecure=True))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "fencepost"), "serve", "--listen", "0.0.0.0:0",
         "--db", str(tmp_path / "x.db")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert proc.stderr.count("\n") == 1 and "--tls-cert" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.db").exists()
    assert main(["serve", "--listen", "0.0.0.0:0", "--tls-cert", "x"]) == 2


def test_bad_security_flags_are_refused(tmp_path: Path, certs: Certs) -> None:
    bad_policy = tmp_path / "bad.toml"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tls_cert": str(certs.server.cert)}, "go together"),
        ({"client_ca": str(certs.ca.cert)}, "needs --tls-cert"),
        ({"tls_cert": str(tmp_path / "none.pem"), "tls_key": str(certs.server.key)},
         "TLS files"),
        ({"tls_cert": str(certs.server.key), "tls_key": str(certs.server.key),
          "client_ca": str(tmp_path / "x")}, "TLS files"),
        ({"authz": str(bad_policy)}, "roles.boss: unknown role"),
        ({"identity_from": "email"}, "--identity-from"),
        ({"max_inflight_per_stream": 0}, "--max-inflight-per-stream"),
    ]
    bad_policy.write_text('[roles]\nboss = ["x"]\n')
    for kw, match in cases:
        with pytest.raises(ConfigError, match=match):
            security(Settings(**kw))
    for text, match in (
        ('[tokens]\nx = "abc"\n', "64 hex"),
        ('[roles]\nworker = "w"\n', "list"),
        ("[groups]\n", "unknown table"),
        ("[roles\n", "authz"),
    ):
        bad_policy.write_text(text)
        with pytest.raises(ConfigError, match=match):
            security(Settings(authz=str(bad_policy), client_ca=str(certs.ca.cert),
                              tls_cert=str(certs.server.cert), tls_key=str(certs.server.key)))
    bad_policy.write_text('[roles]\nworker = ["w*"]\n')
    with pytest.raises(ConfigError, match="no identity"):
        security(Settings(authz=str(bad_policy)))


# -- certificate reload ----------------------------------------------------------------


def test_renewed_certificate_files_are_picked_up_without_dropping_connections(
        tmp_path: Path, certs: Certs, databases: Databases) -> None:
    from torture.certs import CA

    live = tmp_path / "live"
    live.mkdir()
    for src, dst in ((certs.server.cert, "cert.pem"), (certs.server.key, "key.pem"),
                     (certs.ca.cert, "ca.pem")):
        shutil.copy(src, live / dst)
    srv = databases.server(tls_cert=str(live / "cert.pem"), tls_key=str(live / "key.pem"),
                           client_ca=str(live / "ca.pem")).start()
    try:
        old = grpc.secure_channel(srv.address, certs.creds("w1"))
        stream_req = pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner="w1"))
        q: queue.Queue[pb.KeepAliveRequest | None] = queue.Queue()
        q.put(stream_req)
        responses = ledger_pb2_grpc.LedgerStub(old).KeepAlive(iter(q.get, None))
        assert _health(old) is OK
        # renew: a new CA, a new server certificate, a new client CA
        new = CA(tmp_path / "new", "renewed CA")
        new_server = new.server("server2")
        new_client = new.issue("w1-new", cn="w1")
        time.sleep(0.01)
        shutil.copy(new_server.cert, live / "cert.pem")
        shutil.copy(new_server.key, live / "key.pem")
        shutil.copy(new.cert, live / "ca.pem")
        # the established connection and its stream keep working
        assert _health(old) is OK
        run = f"reload-{time.monotonic_ns()}"
        tok = ledger_pb2_grpc.LedgerStub(old).Acquire(
            pb.AcquireRequest(run_id=run, owner="w1")).run.fencing_token
        q.put(pb.KeepAliveRequest(renew=pb.KeepAliveRenew(run_id=run, fencing_token=tok)))
        first = next(responses)
        assert (first.renewed.run_id or first.batch[0].renewed.run_id) == run, first
        # new connections get the renewed certificate and trust the new client CA
        creds = grpc.ssl_channel_credentials(new.cert_pem, new_client.key_pem,
                                             new_client.cert_pem)
        with grpc.secure_channel(srv.address, creds) as ch:
            assert _health(ch) is OK
        with grpc.secure_channel(srv.address, certs.creds("w1")) as ch:  # the old CA: refused
            assert _health(ch) is grpc.StatusCode.UNAVAILABLE
        q.put(None)
        responses.cancel()
        old.close()
    finally:
        srv.close()



def test_a_plaintext_health_port_for_probes_beside_mutual_tls(databases: Databases,
                                                              certs: Certs) -> None:
    srv = _server(databases, certs, client_ca=str(certs.ca.cert), health_listen="127.0.0.1:0")
    try:
        assert srv.app is not None and srv.app.health_port
        with grpc.insecure_channel(f"127.0.0.1:{srv.app.health_port}") as ch:
            assert _health(ch) is OK
            # only health: the ledger is not served there
            got = _rpc(ch, "Ledger", "GetRun", pb.GetRunRequest(run_id="x"))
            assert got.code is grpc.StatusCode.UNIMPLEMENTED
    finally:
        srv.close()


def test_every_security_setting_has_its_environment_variable() -> None:
    env = {"FENCEPOST_TLS_CERT": "c.pem", "FENCEPOST_TLS_KEY": "k.pem",
           "FENCEPOST_CLIENT_CA": "ca.pem", "FENCEPOST_AUTHZ": "p.toml",
           "FENCEPOST_IDENTITY_FROM": "dns", "FENCEPOST_ALLOW_INSECURE": "1",
           "FENCEPOST_HEALTH_LISTEN": "127.0.0.1:9", "FENCEPOST_MAX_CONCURRENT_STREAMS": "7",
           "FENCEPOST_MAX_TRACKED_PER_STREAM": "8", "FENCEPOST_MAX_INFLIGHT_PER_STREAM": "9"}
    s = Settings.from_env(env)
    assert (s.tls_cert, s.tls_key, s.client_ca, s.authz, s.identity_from, s.allow_insecure,
            s.health_listen, s.max_concurrent_streams, s.max_tracked_per_stream,
            s.max_inflight_per_stream) == ("c.pem", "k.pem", "ca.pem", "p.toml", "dns", True,
                                           "127.0.0.1:9", 7, 8, 9)
    # a flag wins over the environment
    assert Settings.from_env(env, identity_from="cn").identity_from == "cn"
