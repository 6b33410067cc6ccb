"""The SDK sends each call to its shard's coordinator: two real servers (each
told by the test-only shard map which of the 4 shards it leads) and a client
given only one of them. It keeps sending everything there until the first
NOT_OWNER, then fetches the map and routes every call, renewal and store
write or read to the owner of its shard."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import fencepost
from fencepost._errors import from_rpc_error
from fencepost.v1 import ledger_pb2, ledger_pb2_grpc
from fencepost_devtools.ports import free_port
from fencepost_server.core.shards import shard_of
from fencepost_server.testing.server import ServerThread

pytestmark = [pytest.mark.sqlite_only, pytest.mark.timeout(60)]

SHARDS = 4
A_LEADS, B_LEADS = {0, 1}, {2, 3}


def _key_in(shards: set[int], prefix: str = "r") -> str:
    """A run id (or key) whose shard is one of ``shards``."""
    return next(f"{prefix}-{i}" for i in range(1000) if shard_of(f"{prefix}-{i}", SHARDS) in shards)


def _pair(tmp_path: Path, spec_a: str, spec_b: str, a: str, b: str
          ) -> tuple[ServerThread, ServerThread]:
    return (ServerThread(str(tmp_path / "a.db"), listen=a, shards=SHARDS, test_hooks=True,
                         test_shard_map=spec_a),
            ServerThread(str(tmp_path / "b.db"), listen=b, shards=SHARDS, test_hooks=True,
                         test_shard_map=spec_b))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ServerThread, ServerThread]]:
    """A leads shards 0-1, B leads 2-3; both know the whole map."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    spec = f"{a}=0-1;{b}=2,3"
    sa, sb = _pair(tmp_path, spec, spec, a, b)
    with sa, sb:
        yield sa, sb


def test_a_refusal_maps_to_not_owner_error_naming_the_owner(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    sa, sb = pair
    run = _key_in(A_LEADS)
    stub = ledger_pb2_grpc.LedgerStub(grpc.insecure_channel(sb.address))
    with pytest.raises(grpc.RpcError) as refused:
        stub.GetRun(ledger_pb2.GetRunRequest(run_id=run))
    err = from_rpc_error(refused.value, mutation=False)
    assert type(err) is fencepost.NotOwnerError
    assert isinstance(err, fencepost.UnavailableError)
    assert (err.shard, err.owner, err.epoch) == (shard_of(run, SHARDS), sa.address, 1)
    assert err.code == "NOT_OWNER"
