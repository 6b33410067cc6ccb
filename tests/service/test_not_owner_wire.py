"""NOT_OWNER on real servers: a coordinator that leads only some shards
(here two servers, each told by the test-only shard map which shards it
leads) refuses every call keyed in another shard, unary or on the Execute
stream, write or read, naming the shard and its owner, and does nothing
with it: the same request id then succeeds at the owner."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2, ledger_pb2_grpc
from fencepost_devtools.ports import free_port
from fencepost_server.core.shards import compound_key, shard_of
from fencepost_server.testing.server import ServerThread

pytestmark = [pytest.mark.sqlite_only, pytest.mark.timeout(60)]

SHARDS = 4


def _run_in(shards: set[int], prefix: str = "r") -> str:
    """A run id whose shard is one of ``shards``."""
    return next(f"{prefix}-{i}" for i in range(1000) if shard_of(f"{prefix}-{i}", SHARDS) in shards)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ServerThread, ServerThread]]:
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    spec = f"{a}=0-1;{b}=2,3"
    with ServerThread(str(tmp_path / "a.db"), listen=a, shards=SHARDS, test_hooks=True,
                      test_shard_map=spec) as sa, \
            ServerThread(str(tmp_path / "b.db"), listen=b, shards=SHARDS, test_hooks=True,
                         test_shard_map=spec) as sb:
        yield sa, sb


def _stub(srv: ServerThread) -> ledger_pb2_grpc.LedgerStub:
    return ledger_pb2_grpc.LedgerStub(grpc.insecure_channel(srv.address))


def _not_owner(status: object) -> dict[str, str]:
    """The ErrorInfo metadata of a NOT_OWNER status."""
    for detail in status.details:  # type: ignore[attr-defined]
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            assert info.reason == "NOT_OWNER"
            return dict(info.metadata)
    raise AssertionError("no ErrorInfo")


def test_a_command_in_another_shard_is_refused_naming_its_owner(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    sa, sb = pair
    run = _run_in({0, 1})
    with pytest.raises(grpc.RpcError) as refused:
        _stub(sb).Acquire(ledger_pb2.AcquireRequest(run_id=run, owner="w", request_id="rq-1"))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    meta = _not_owner(rpc_status.from_call(refused.value))
    assert meta == {"shard": str(shard_of(run, SHARDS)), "owner": sa.address, "epoch": "1"}
    assert f"shard {meta['shard']}" in refused.value.details()
    # nothing was done there, and the request id was not remembered: the owner takes it
    got = _stub(sa).Acquire(ledger_pb2.AcquireRequest(run_id=run, owner="w", request_id="rq-1"))
    assert got.run.fencing_token == 1
    assert sb.writer.state.revision == 0
    # reads keyed in another shard are refused too
    for call in (lambda: _stub(sb).GetRun(ledger_pb2.GetRunRequest(run_id=run)),
                 lambda: _stub(sb).ValidateFence(
                     ledger_pb2.ValidateFenceRequest(run_id=run, fencing_token=1))):
        with pytest.raises(grpc.RpcError) as read:
            call()
        assert _not_owner(rpc_status.from_call(read.value))["owner"] == sa.address


def test_the_execute_stream_refuses_only_the_misrouted_command(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    _, sb = pair
    here, there = _run_in({2, 3}), _run_in({0, 1})
    msg = ledger_pb2.ExecuteRequest(commands=[
        ledger_pb2.Command(id=1, acquire=ledger_pb2.AcquireRequest(run_id=here, owner="w")),
        ledger_pb2.Command(id=2, acquire=ledger_pb2.AcquireRequest(run_id=there, owner="w")),
    ])
    results = {}
    for resp in _stub(sb).Execute(iter([msg])):
        for r in resp.results:
            results[r.id] = r
        if len(results) == 2:
            break
    assert results[1].acquire.run.fencing_token == 1
    assert results[2].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert _not_owner(results[2].error)["shard"] == str(shard_of(there, SHARDS))


def test_engine_store_writes_and_reads_follow_their_shard_keys(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    sa, sb = pair
    agent = next(f"ag{i}" for i in range(1000)
                 if shard_of(compound_key(f"ag{i}", "k"), SHARDS) in {0, 1})
    store = engine_store_pb2_grpc.EngineStoreStub(grpc.insecure_channel(sb.address))
    value = epb.JsonValue(json="1")
    for call in (lambda: store.KvSet(epb.EngineKvSetRequest(agent=agent, key="k", value=value)),
                 lambda: store.KvGet(epb.EngineKvGetRequest(agent=agent, key="k"))):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert _not_owner(rpc_status.from_call(refused.value))["owner"] == sa.address
    owner = engine_store_pb2_grpc.EngineStoreStub(grpc.insecure_channel(sa.address))
    owner.KvSet(epb.EngineKvSetRequest(agent=agent, key="k", value=value))
    assert owner.KvGet(epb.EngineKvGetRequest(agent=agent, key="k")).found


def test_the_map_names_each_shards_owner(pair: tuple[ServerThread, ServerThread]) -> None:
    sa, sb = pair
    for srv in pair:
        got = _stub(srv).Shards(ledger_pb2.ShardsRequest())
        assert [s.address for s in got.shards] == [sa.address] * 2 + [sb.address] * 2
    with urllib.request.urlopen(sb.http_url + "/api/shards", timeout=10) as resp:
        rows = json.loads(resp.read())["shards"]
    assert [(r["owner"] != "", r["address"]) for r in rows] == \
        [(False, sa.address)] * 2 + [(True, sb.address)] * 2  # the dashboard's view


def test_a_map_that_misses_a_shard_or_this_server_is_refused(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    for spec in (f"{addr}=0-2", "127.0.0.1:1=0-3", f"{addr}=0-1;{addr}=1-3", f"{addr}=0-x"):
        srv = ServerThread(str(tmp_path / "c.db"), listen=addr, shards=SHARDS, test_hooks=True,
                           test_shard_map=spec)
        try:
            with pytest.raises(RuntimeError, match="FENCEPOST_TEST_SHARD_MAP"):
                srv.start()
        finally:
            srv.close()


def test_keepalive_refuses_renewals_and_tracks_in_another_shard(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    """Answered from memory or not, a renewal (or a track) of a run in
    another shard is refused NOT_OWNER naming the owner, not taken for a
    lease lost: the client renews it at the owner."""
    sa, sb = pair
    run = _run_in({0, 1})
    msgs = [ledger_pb2.KeepAliveRequest(hello=ledger_pb2.KeepAliveHello(owner="w")),
            ledger_pb2.KeepAliveRequest(renew=ledger_pb2.KeepAliveRenew(
                run_id=run, fencing_token=1, lease_ttl_ms=30_000)),
            ledger_pb2.KeepAliveRequest(track=ledger_pb2.KeepAliveTrack(
                run_id=run, fencing_token=1))]
    errors = []
    call = _stub(sb).KeepAlive(iter(msgs))
    for resp in call:
        for one in resp.batch or (resp,):
            assert one.WhichOneof("kind") == "error", one
            errors.append(one.error)
        if len(errors) == 2:
            break
    call.cancel()
    assert [(e.run_id, e.code, e.metadata["owner"]) for e in errors] == [
        (run, "NOT_OWNER", sa.address)] * 2
