"""The SDK over TLS, mutual TLS and bearer tokens (async and sync clients,
both transports); PERMISSION_DENIED and UNAUTHENTICATED become typed errors
that are never retried."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _db import Databases

import fencepost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from _tls import ADMIN_TOKEN, Certs, make_certs, write_policy

from fencepost_server.testing.server import ServerThread


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs: Certs,
           module_databases: Databases) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("srv")
    with module_databases.server("tls", tls_cert=str(certs.server.cert),
                                 tls_key=str(certs.server.key), client_ca=str(certs.ca.cert),
                                 authz=str(write_policy(tmp / "policy.toml"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory,
                 module_databases: Databases) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("tok")
    with module_databases.server("tokens",
                                 authz=str(write_policy(tmp / "policy.toml"))) as srv:
        yield srv


def tls_for(certs: Certs, who: str) -> fencepost.TLS:
    pair = certs.clients[who]
    return fencepost.TLS(ca=certs.ca.cert, cert=pair.cert, key=pair.key)


class Counter(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        name = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls[name] = self.calls.get(name, 0) + 1
        return await continuation(details, request)


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_a_worker_over_mutual_tls(server: ServerThread, certs: Certs,
                                        transport: str) -> None:
    async with fencepost.Client(server.address, owner="w1/job", tls=tls_for(certs, "w1"),
                                transport=transport) as client:  # type: ignore[arg-type]
        async with client.acquire(f"sdk-{transport}", ttl_ms=5_000) as lease:
            await lease.record_checkpoint("k", snapshot_version=1)
            await lease.finish("completed")
        with pytest.raises(fencepost.PermissionDeniedError) as ei:
            await client.delete(f"sdk-{transport}")
        assert ei.value.metadata["role"] == "admin"
    async with fencepost.Client(server.address, owner="w2", tls=tls_for(certs, "w1"),
                                transport=transport) as client:  # type: ignore[arg-type]
        with pytest.raises(fencepost.OwnerNotPermittedError) as oe:
            async with client.acquire(f"sdk-x-{transport}"):
                pass
        assert (oe.value.metadata["owner"], oe.value.metadata["principal"]) == ("w2", "w1")
        assert isinstance(oe.value, fencepost.PermissionDeniedError)


async def test_clients_of_one_identity_share_a_stream_and_each_command_is_authorized(
    server: ServerThread, certs: Certs
) -> None:
    from fencepost._execute import SharedDispatcher

    def shared(client: fencepost.Client) -> Any:
        assert isinstance(client._connection.dispatcher, SharedDispatcher)
        return client._connection.dispatcher._shared

    async with fencepost.Client(server.address, owner="w1/a", tls=tls_for(certs, "w1")) as mine, \
            fencepost.Client(server.address, owner="w2", tls=tls_for(certs, "w1")) as other, \
            fencepost.Client(server.address, owner="w2/b", tls=tls_for(certs, "w2")) as w2:
        for c in (mine, other, w2):  # open the streams (the first mutation goes unary)
            with pytest.raises(fencepost.PermissionDeniedError):
                await c.delete("warm-up")
        assert shared(mine) is shared(other)  # one identity, one stream
        assert shared(w2) is not shared(mine)  # another identity has its own
        dispatcher = mine._connection.dispatcher
        assert dispatcher is not None
        for _ in range(500):
            if dispatcher.is_open:
                break
            await asyncio.sleep(0.01)
        assert dispatcher.is_open
        sent = shared(mine).dispatcher._session.commands_sent
        with pytest.raises(fencepost.OwnerNotPermittedError) as oe:
            await other.acquire("shared-x").__aenter__()  # w1 may not act as w2
        assert (oe.value.metadata["owner"], oe.value.metadata["principal"]) == ("w2", "w1")
        lease = await mine.acquire("shared-ok")  # the stream still carries commands
        await lease.finish()
        # both went on the shared stream, the refusal and the grant alike
        assert shared(mine).dispatcher._session.commands_sent == sent + 3
        assert (await w2.acquire("shared-w2")).owner == "w2/b"


async def test_refusals_are_never_retried(server: ServerThread, token_server: ServerThread,
                                          certs: Certs) -> None:
    retry = fencepost.RetryPolicy(max_attempts=10, total_timeout_s=30)
    counter = Counter()
    async with fencepost.Client(server.address, owner="w2", tls=tls_for(certs, "w1"),
                                transport="unary", retry=retry,
                                interceptors=[counter]) as client:
        with pytest.raises(fencepost.OwnerNotPermittedError):
            await client.acquire("never").__aenter__()
        with pytest.raises(fencepost.PermissionDeniedError):
            await client.cancel("never")
    assert counter.calls == {"/fencepost.v1.Ledger/Acquire": 1,
                             "/fencepost.v1.Ledger/Cancel": 1}
    counter = Counter()
    async with fencepost.Client(token_server.address, token="wrong", retry=retry,
                                transport="unary", interceptors=[counter]) as client:
        with pytest.raises(fencepost.UnauthenticatedError):
            await client.get("x")
    assert counter.calls == {"/fencepost.v1.Ledger/GetRun": 1}


async def test_bearer_tokens(token_server: ServerThread) -> None:
    async with fencepost.Client(token_server.address, token=ADMIN_TOKEN) as client:
        with pytest.raises(fencepost.RunNotFoundError):
            await client.get("nope")
    async with fencepost.Client(token_server.address) as client:
        with pytest.raises(fencepost.UnauthenticatedError):
            await client.get("nope")


def test_the_sync_client(server: ServerThread, token_server: ServerThread,
                         certs: Certs) -> None:
    with fencepost.SyncClient(server.address, owner="w1", tls=tls_for(certs, "w1")) as client:
        lease = client.acquire("sync-run", ttl_ms=5_000)
        lease.finish("completed")
        with pytest.raises(fencepost.PermissionDeniedError):
            client.cancel("sync-run")
        # the raw sync stubs use the same credentials
        from fencepost.v1 import ledger_pb2

        got = client.stubs.ledger.GetRun(ledger_pb2.GetRunRequest(run_id="sync-run"))
        assert got.run.status == 4  # RUN_STATUS_COMPLETED
    with fencepost.SyncClient(token_server.address, token=ADMIN_TOKEN) as client:
        with pytest.raises(fencepost.RunNotFoundError):
            client.get("nope")
    with fencepost.SyncClient(token_server.address, token="nope") as client, \
            pytest.raises(fencepost.UnauthenticatedError):
        client.get("nope")


def test_bad_client_security_options(certs: Certs) -> None:
    with pytest.raises(ValueError, match="cert and key"):
        fencepost.TLS(ca=certs.ca.cert, cert=certs.clients["w1"].cert)
    with pytest.raises(ValueError, match="only over TLS"):
        fencepost.Client("10.0.0.1:50051", token="t")
    with pytest.raises(ValueError, match="empty"):
        fencepost.Client("127.0.0.1:50051", token=" ")


async def test_a_plaintext_client_cannot_reach_a_tls_server(server: ServerThread) -> None:
    retry = fencepost.RetryPolicy(total_timeout_s=1.0, attempt_timeout_s=0.5)
    async with fencepost.Client(server.address, retry=retry) as client:
        with pytest.raises(fencepost.UnavailableError):
            await client.get("x")


# -- the CLI ---------------------------------------------------------------------------


def test_cli_flags_and_environment(server: ServerThread, token_server: ServerThread,
                                   certs: Certs, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from fencepost_server.cli import main

    admin = certs.clients["admin"]
    tls = ["--cacert", str(certs.ca.cert), "--cert", str(admin.cert), "--key", str(admin.key)]
    assert main(["get", "nope", "--addr", server.address, *tls]) == 1
    assert "RUN_NOT_FOUND" in capsys.readouterr().err
    # no certificate: the handshake fails, the server is unreachable for this client
    assert main(["get", "nope", "--addr", server.address, "--timeout", "0.3"]) == 3
    capsys.readouterr()
    w1 = certs.clients["w1"]
    monkeypatch.setenv("FENCEPOST_CACERT", str(certs.ca.cert))
    monkeypatch.setenv("FENCEPOST_CERT", str(w1.cert))
    monkeypatch.setenv("FENCEPOST_KEY", str(w1.key))
    assert main(["cancel", "nope", "--addr", server.address, "--json"]) == 1
    assert '"code": "PERMISSION_DENIED"' in capsys.readouterr().out  # --json: errors on stdout
    monkeypatch.delenv("FENCEPOST_KEY")
    assert main(["get", "nope", "--addr", server.address]) == 2
    assert "cert and key" in capsys.readouterr().err
    for var in ("FENCEPOST_CACERT", "FENCEPOST_CERT"):
        monkeypatch.delenv(var)
    assert main(["get", "nope", "--addr", token_server.address, "--token", "bad"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("FENCEPOST_TOKEN", ADMIN_TOKEN)
    assert main(["ls", "--addr", token_server.address, "--json"]) == 0
    assert capsys.readouterr().out.strip() == "[]"


async def test_a_store_of_its_own_over_mutual_tls(server: ServerThread, certs: Certs) -> None:
    store = fencepost.AsyncStore.connect(server.address, tls=tls_for(certs, "w1"))
    try:
        await store.create_run("store-tls", agent="a")
        assert await store.claim_run("store-tls", "w1/x", ttl_ms=1000)
        with pytest.raises(fencepost.OwnerNotPermittedError):
            await store.claim_run("store-tls", "w2", ttl_ms=1000)
    finally:
        await store.aclose()
