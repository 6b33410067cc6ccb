"""The dashboard port against a hostile client: identities and roles (mutual
TLS, bearer tokens), DNS rebinding and foreign origins, framing headers,
event streams that never read, and query parameters out of range. Every
test here failed on the dashboard built with an allow-all policy."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_server.auth import token_digest
from fencepost_server.config import ConfigError, Settings
from fencepost_server.testing.server import ServerThread
from fencepost_server.tls import security

TESTS = Path(__file__).resolve().parents[1]
for sub in ("service", "system"):
    if str(TESTS / sub) not in sys.path:
        sys.path.insert(0, str(TESTS / sub))

from _proc import ServerProc, free_port  # noqa: E402
from _tls import ADMIN_TOKEN, SCRIPT_TOKEN, Certs, make_certs, write_policy  # noqa: E402

FRAMING = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
}


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> dict[str, Any]:
        return dict(self.json()["error"])


def request(port: int, method: str, path: str, *, ctx: ssl.SSLContext | None = None,
            headers: dict[str, str] | None = None, body: Any = None) -> Answer:
    """One HTTP request to 127.0.0.1:port (HTTPS with ``ctx``); the Host header
    is ours to set."""
    conn: http.client.HTTPConnection
    if ctx is not None:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    hdrs = dict(headers or {})
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def client_ctx(certs: Certs, who: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca.cert))
    if who is not None:
        pair = certs.clients[who]
        ctx.load_cert_chain(pair.cert, pair.key)
    return ctx


def status_of(srv: ServerThread, run_id: str) -> str:
    assert srv.app is not None
    rec = srv.app.writer_state.runs.get(run_id)
    return rec.status.name.lower() if rec is not None else "absent"


def metric(port: int, name: str, ctx: ssl.SSLContext | None = None, **labels: str) -> float:
    text = request(port, "GET", "/metrics", ctx=ctx).body.decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name} {labels} not exposed")


def hold(srv: ServerThread, run_id: str, owner: str = "w1", **kw: Any) -> None:
    """A live lease on ``run_id`` (through the writer: no credentials needed)."""
    from fencepost_server.core import ledger as L

    async def acquire() -> None:
        await srv.writer.submit(L.Acquire(run_id, owner, 600_000))

    srv.call(acquire)


# -- servers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def authz_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs
                 ) -> Iterator[ServerThread]:
    """Mutual TLS and a policy: admin, op (operator), w1/w2 (worker), nobody."""
    tmp = tmp_path_factory.mktemp("authz")
    with ServerThread(tmp / "fp.db", tls_cert=str(certs.server.cert),
                      tls_key=str(certs.server.key), client_ca=str(certs.ca.cert),
                      authz=str(write_policy(tmp / "policy.toml"))) as srv:
        yield srv


def token_policy(tmp_path: Path) -> str:
    """Bearer tokens: ops and ops2 (operators), w (a worker)."""
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[roles]\noperator = ["ops", "ops2"]\nworker = ["w"]\n[tokens]\n'
                      f'ops = "{token_digest("ops-token")}"\nw = "{token_digest("w-token")}"\n'
                      f'ops2 = "{token_digest("ops2-token")}"\n')
    return str(policy)


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[ServerThread]:
    """Bearer tokens only, plaintext on loopback."""
    with ServerThread(tmp_path / "fp.db", authz=token_policy(tmp_path)) as srv:
        yield srv


@pytest.fixture
def open_server(tmp_path: Path) -> Iterator[ServerThread]:
    """The default: loopback, no identities."""
    with ServerThread(tmp_path / "fp.db") as srv:
        yield srv


def port_of(srv: ServerThread) -> int:
    assert srv.app is not None
    return srv.app.http_port


# -- identities and roles -----------------------------------------------------------


def test_mutual_tls_authz_dashboard_needs_a_certificate_and_a_role(
    authz_server: ServerThread, certs: Certs
) -> None:
    port = port_of(authz_server)
    hold(authz_server, "victim", "w2")
    # the port speaks TLS only: plaintext HTTP gets no answer
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        request(port, "GET", "/api/runs")
    # no client certificate: the handshake is refused, nothing is read
    with pytest.raises((ssl.SSLError, ConnectionError)):
        request(port, "GET", "/api/runs", ctx=client_ctx(certs, None))
    # a certificate whose principal has no role
    got = request(port, "GET", "/api/runs", ctx=client_ctx(certs, "nobody"))
    assert (got.status, got.error["code"]) == (403, "PERMISSION_DENIED")
    assert "nobody" in got.error["message"]
    for path in ("/api/engine/runs", "/api/runs/victim", "/api/events"):
        assert request(port, "GET", path, ctx=client_ctx(certs, "nobody")).status == 403, path
    # the operator lists runs; a worker reads one run and the engine store,
    # exactly the gRPC calls its role allows (GetRun, EngineStore.ListRuns)
    got = request(port, "GET", "/api/runs", ctx=client_ctx(certs, "op"))
    assert got.status == 200 and [r["run_id"] for r in got.json()["runs"]] == ["victim"]
    w1 = client_ctx(certs, "w1")
    assert request(port, "GET", "/api/runs/victim", ctx=w1).status == 200
    assert request(port, "GET", "/api/engine/runs", ctx=w1).status == 200
    assert request(port, "GET", "/api/runs", ctx=w1).status == 403
    # the principal is read from the certificate as on the gRPC port: the one
    # SPIFFE id, else the first DNS SAN, else the CN
    for name, kw, status in (("dns-op", {"cn": "nobody", "dns": ("op",)}, 200),
                             ("uris-op", {"cn": "op", "uris": ("spiffe://a/1", "spiffe://a/2")},
                              200),
                             ("spiffe-op", {"cn": "op", "uris": ("spiffe://example.org/op",)},
                              403)):
        pair = certs.ca.issue(name, **kw)
        ctx = client_ctx(certs, None)
        ctx.load_cert_chain(pair.cert, pair.key)
        assert request(port, "GET", "/api/runs", ctx=ctx).status == status, name
    # pages and their assets carry no data; /metrics and /healthz stay readable
    for path in ("/", "/static/app.js", "/healthz", "/metrics"):
        assert request(port, "GET", path, ctx=client_ctx(certs, "nobody")).status == 200, path


def test_a_made_up_bearer_token_is_refused_never_anonymous(
    authz_server: ServerThread, certs: Certs, token_server: ServerThread
) -> None:
    port = port_of(authz_server)
    hold(authz_server, "guarded", "w1")
    made_up = {"Authorization": "Bearer not-a-token-anyone-was-given"}
    # the token wins over the certificate, as on the gRPC port: unknown is 401
    got = request(port, "POST", "/api/cancel", ctx=client_ctx(certs, "op"), headers=made_up,
                  body={"run_id": "guarded"})
    assert (got.status, got.error["code"]) == (401, "UNAUTHENTICATED")
    assert got.headers["www-authenticate"].startswith("Bearer")
    assert status_of(authz_server, "guarded") == "running"
    # tokens on a plaintext loopback server: none, malformed and made-up are 401
    tport = port_of(token_server)
    hold(token_server, "t-run", "w")
    for headers in ({}, made_up, {"Authorization": "Basic b3BzOm9wcw=="}):
        for method, path, body in (("GET", "/api/runs", None),
                                   ("GET", "/api/events", None),
                                   ("POST", "/api/cancel", {"run_id": "t-run"})):
            got = request(tport, method, path, headers=headers, body=body)
            assert (got.status, got.error["code"]) == (401, "UNAUTHENTICATED"), (headers, path)
    assert status_of(token_server, "t-run") == "running"
    got = request(tport, "GET", "/api/runs", headers={"Authorization": "Bearer ops-token"})
    assert got.status == 200 and got.json()["runs"][0]["run_id"] == "t-run"
    assert metric(tport, "fencepost_http_refused_total", reason="unauthenticated") == 9


def test_cancel_needs_the_operator_role(authz_server: ServerThread, certs: Certs) -> None:
    port = port_of(authz_server)
    for run in ("c-1", "c-2", "c-3"):
        hold(authz_server, run, "w2")
    # a reader (a worker may read the run) may not cancel it, nor resume
    for who in ("w1", "w2"):
        got = request(port, "POST", "/api/cancel", ctx=client_ctx(certs, who),
                      body={"run_id": "c-1"})
        assert (got.status, got.error["code"]) == (403, "PERMISSION_DENIED")
        assert "operator" in got.error["message"]
    got = request(port, "POST", "/api/resume", ctx=client_ctx(certs, "w1"),
                  body={"run_id": "c-1"})
    assert got.status == 403
    token_no_role = {"Authorization": f"Bearer {SCRIPT_TOKEN}"}  # "script" has no role
    got = request(port, "POST", "/api/cancel", ctx=client_ctx(certs, "op"),
                  headers=token_no_role, body={"run_id": "c-1"})
    assert got.status == 403
    assert status_of(authz_server, "c-1") == "running"
    # the operator may, and so may an admin token
    got = request(port, "POST", "/api/cancel", ctx=client_ctx(certs, "op"),
                  body={"run_id": "c-1", "message": "ops"})
    assert got.status == 200 and got.json()["run"]["status"] == "cancelled"
    got = request(port, "POST", "/api/cancel", ctx=client_ctx(certs, "w1"),
                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, body={"run_id": "c-2"})
    assert got.status == 200
    assert [status_of(authz_server, r) for r in ("c-1", "c-2", "c-3")] == [
        "cancelled", "cancelled", "running"]


def test_tls_without_client_certificates_and_plaintext_off_loopback(
    certs: Certs, tmp_path: Path
) -> None:
    with ServerThread(tmp_path / "fp.db", tls_cert=str(certs.server.cert),
                      tls_key=str(certs.server.key)) as srv:
        port = port_of(srv)
        assert request(port, "GET", "/api/runs", ctx=client_ctx(certs, None)).status == 200
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            request(port, "GET", "/api/runs")
    # a plaintext dashboard off loopback needs TLS or an explicit --allow-insecure
    with pytest.raises(ConfigError, match="dashboard in plaintext"):
        security(Settings(http_listen="0.0.0.0:8233"))
    security(Settings(http_listen="0.0.0.0:8233", allow_insecure=True))
    security(Settings(http_listen="0.0.0.0:8233", tls_cert=str(certs.server.cert),
                      tls_key=str(certs.server.key)))


def test_the_dashboard_picks_up_a_renewed_certificate(certs: Certs, tmp_path: Path) -> None:
    import shutil

    cert, key = tmp_path / "server.pem", tmp_path / "server-key.pem"
    shutil.copy(certs.server.cert, cert)
    shutil.copy(certs.server.key, key)
    with ServerThread(tmp_path / "fp.db", tls_cert=str(cert), tls_key=str(key)) as srv:
        port = port_of(srv)

        def served() -> bytes:
            ctx = client_ctx(certs, None)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                    ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                der = tls.getpeercert(binary_form=True)
                assert der is not None
                return der

        first = served()
        renewed = certs.ca.server("renewed")
        cert.write_bytes(renewed.cert_pem)
        key.write_bytes(renewed.key_pem)
        assert served() != first
        assert served() == ssl.PEM_cert_to_DER_cert(renewed.cert_pem.decode())


# -- DNS rebinding, origins, framing -------------------------------------------------


def test_a_rebinding_host_is_refused(open_server: ServerThread, tmp_path: Path) -> None:
    port = port_of(open_server)
    hold(open_server, "r-1")
    evil = {"Host": f"attacker.example:{port}", "Origin": f"http://attacker.example:{port}"}
    got = request(port, "GET", "/api/runs", headers={"Host": evil["Host"]})
    assert (got.status, got.error["code"]) == (421, "HOST_NOT_ALLOWED")
    assert "--http-allowed-hosts" in got.error["message"]
    got = request(port, "POST", "/api/cancel", headers=evil, body={"run_id": "r-1"})
    assert got.status == 421 and status_of(open_server, "r-1") == "running"
    for path in ("/", "/api/events", "/metrics"):
        assert request(port, "GET", path, headers={"Host": evil["Host"]}).status == 421
    # the names it serves: loopback on any port (a port-forward moves it) and
    # the listen address with its port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost:9999", f"[::1]:{port}"):
        assert request(port, "GET", "/api/runs", headers={"Host": host}).status == 200, host
    for host in ("fp.internal", "127.0.0.1.attacker.example", "", "a b"):
        assert request(port, "GET", "/api/runs", headers={"Host": host}).status == 421, host
    assert metric(port, "fencepost_http_refused_total", reason="host") == 9
    # and the names given with --http-allowed-hosts (without a port: any port)
    with ServerThread(tmp_path / "named.db",
                      http_allowed_hosts=("fp.internal", "other.example:1")) as named:
        port = port_of(named)
        for host, status in ((f"fp.internal:{port}", 200), ("FP.internal", 200),
                             ("other.example:1", 200), (f"other.example:{port}", 421),
                             ("fp.internal.attacker.example", 421)):
            got = request(port, "GET", "/api/runs", headers={"Host": host})
            assert got.status == status, host


def test_a_foreign_origin_cannot_change_anything(open_server: ServerThread) -> None:
    port = port_of(open_server)
    for run in ("o-1", "o-2", "o-3"):
        hold(open_server, run)
    for origin in ("http://attacker.example", f"http://localhost:{port + 1}", "null",
                   f"http://127.0.0.1:{port}.attacker.example", f"ftp://127.0.0.1:{port}"):
        got = request(port, "POST", "/api/cancel", headers={"Origin": origin},
                      body={"run_id": "o-1"})
        assert (got.status, got.error["code"]) == (403, "ORIGIN_NOT_ALLOWED"), origin
        assert request(port, "POST", "/api/resume", headers={"Origin": origin},
                       body={"run_id": "o-1"}).status == 403
    assert status_of(open_server, "o-1") == "running"
    # the page's own origin, and a client that sends none (curl, scripts)
    got = request(port, "POST", "/api/cancel", headers={"Origin": f"http://127.0.0.1:{port}"},
                  body={"run_id": "o-2"})
    assert got.status == 200
    assert request(port, "POST", "/api/cancel", body={"run_id": "o-3"}).status == 200
    # a read from another origin is answered (the browser keeps it from the page:
    # no CORS headers are ever sent)
    got = request(port, "GET", "/api/runs", headers={"Origin": "http://attacker.example"})
    assert got.status == 200 and "access-control-allow-origin" not in got.headers


def test_every_response_carries_the_framing_and_sniffing_headers(
    open_server: ServerThread,
) -> None:
    port = port_of(open_server)
    hold(open_server, "h-1")
    cases = [("GET", "/", None, {}), ("GET", "/runs/h-1", None, {}),
             ("GET", "/static/app.js", None, {}), ("GET", "/static/style.css", None, {}),
             ("GET", "/api/runs", None, {}), ("GET", "/api/runs/h-1", None, {}),
             ("GET", "/api/runs/none", None, {}), ("GET", "/api/runs?limit=0", None, {}),
             ("GET", "/nowhere", None, {}), ("GET", "/metrics", None, {}),
             ("GET", "/healthz", None, {}), ("POST", "/api/cancel", {"run_id": "h-1"}, {}),
             ("GET", "/api/runs", None, {"Host": "attacker.example"})]
    for method, path, body, headers in cases:
        got = request(port, method, path, body=body, headers=headers)
        for name, value in FRAMING.items():
            assert got.headers.get(name) == value, (path, name, got.headers)
        csp = got.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "default-src 'self'" in csp, path

    async def stream_headers() -> dict[str, str]:
        import aiohttp

        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{port}/api/events") as resp:
            return {k.lower(): v for k, v in resp.headers.items()}

    headers = asyncio.run(stream_headers())
    assert headers["content-type"].startswith("text/event-stream")
    assert {k: headers.get(k) for k in FRAMING} == FRAMING
    assert "frame-ancestors 'none'" in headers["content-security-policy"]


def test_the_metrics_only_listener_checks_no_host(tmp_path: Path) -> None:
    """Probes and scrapers reach it by whatever name or address they use; it
    serves nothing but /metrics and /healthz."""
    with ServerThread(tmp_path / "fp.db", metrics_listen="127.0.0.1:0") as srv:
        assert srv.app is not None and srv.app.dashboard is not None
        metrics_port = srv.app.dashboard.ports[1]
        for path in ("/healthz", "/metrics"):
            got = request(metrics_port, "GET", path, headers={"Host": "10.1.2.3:9464"})
            assert got.status == 200 and got.headers["x-frame-options"] == "DENY", path
        assert request(metrics_port, "GET", "/api/runs").status == 404
        assert request(port_of(srv), "GET", "/healthz",
                       headers={"Host": "10.1.2.3:9464"}).status == 421


# -- query parameters ---------------------------------------------------------------


def test_query_parameters_out_of_range_are_400_naming_the_parameter(
    open_server: ServerThread,
) -> None:
    port = port_of(open_server)
    cases = {
        "/api/engine/runs?offset=99999999999999999999999": "offset",
        "/api/engine/runs?offset=9223372036854775808": "offset",
        "/api/engine/runs?offset=-1": "offset",
        "/api/engine/runs?offset=1e3": "offset",
        "/api/engine/runs?limit=99999999999999999999999": "limit",
        "/api/engine/runs?limit=%D9%A3": "limit",  # an Arabic-Indic digit
        "/api/engine/runs?agent=" + "a" * 300: "agent",
        "/api/engine/runs?status=%01": "status",
        "/api/engine/runs?" + "&".join(["status=s"] * 101): "status",
        "/api/runs?limit=" + "9" * 5000: "limit",
        "/api/runs?limit=501": "limit",
        "/api/runs?owner=" + "o" * 300: "owner",
        "/api/runs?prefix=" + "p" * 600: "prefix",
        "/api/runs?after=a&before=b": "before",
        "/api/runs?after=%00": "after",
        "/api/events?run=": "run",
        "/api/runs/" + "r" * 600: "run_id",
    }
    for path, field in cases.items():
        got = request(port, "GET", path)
        assert got.status == 400, (path, got.status, got.body[:200])
        assert (got.error["code"], got.error["field"]) == ("RUN_VALIDATION_ERROR", field), path
    got = request(port, "GET", "/api/engine/runs?offset=9223372036854775807&limit=500")
    assert got.status == 200 and got.json()["runs"] == []


# -- event streams that never read ---------------------------------------------------


def _open_streams(port: int, n: int, source: str = "127.0.0.1",
                  headers: str = "") -> list[tuple[socket.socket, int]]:
    """``n`` event streams whose client reads the status line and then never
    reads again (a tiny receive buffer: the server's writes back up at once)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}\r\n".encode())
        s.settimeout(10)
        status = int(s.recv(12).split()[1])
        out.append((s, status))
    return out


def _burst(address: str, runs: int) -> None:
    """``runs`` acquires of distinct runs, 100 to a transaction."""
    with grpc.insecure_channel(address) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        for start in range(0, runs, 100):
            stub.Transact(pb.TransactionRequest(commands=[
                pb.Command(id=j + 1, acquire=pb.AcquireRequest(
                    run_id=f"burst-{start + j:06d}", owner="w", lease_ttl_ms=600_000))
                for j in range(100)]), timeout=30)


@pytest.mark.slow  # a server process, for its RSS
def test_event_streams_are_capped_and_one_that_never_reads_is_dropped(tmp_path: Path) -> None:
    """200 streams that never read, then 20 000 changes: before the bounds the
    server grew by about 500 MB here and kept it; now the streams past the cap
    are refused with 429, those that back up are dropped and their memory
    freed, and the slots come back when the clients go."""
    http_port = free_port()
    srv = ServerProc(tmp_path / "fp.db", tmp_path / "server.log",
                     args=("--http-listen", f"127.0.0.1:{http_port}"),
                     env={"FENCEPOST_HTTP_EVENT_QUEUE": "2000"})
    srv.start()
    try:
        assert srv.proc is not None
        proc = psutil.Process(srv.proc.pid)
        before = proc.memory_info().rss
        streams = _open_streams(http_port, 200)
        statuses = [status for _, status in streams]
        assert statuses.count(200) == 32 and statuses.count(429) == 168
        assert metric(http_port, "fencepost_open_streams", kind="dashboard_events") == 32
        refused = request(http_port, "GET", "/api/events")
        assert (refused.status, refused.error["code"]) == (429, "TOO_MANY_STREAMS")
        assert "--http-event-streams-per-client" in refused.error["message"]

        _burst(srv.address, 20_000)
        deadline = time.monotonic() + 15
        while metric(http_port, "fencepost_open_streams", kind="dashboard_events") > 0:
            assert time.monotonic() < deadline, "the streams that never read were not dropped"
            time.sleep(0.1)
        grown = proc.memory_info().rss - before
        dropped = {reason: metric(http_port, "fencepost_dashboard_event_streams_dropped_total",
                                  reason=reason) for reason in ("queue_full", "write_timeout")}
        print(f"\nRSS grew {grown / 2**20:.0f} MiB over 200 streams and 20 000 changes; "
              f"streams dropped: {dropped}")
        assert sum(dropped.values()) == 32
        assert grown < 150 * 2**20, grown
        assert metric(http_port, "fencepost_http_refused_total",
                      reason="too_many_streams") == 169
        for s, _ in streams:
            s.close()
        # the slots are free again: a client that reads gets its stream
        again = _open_streams(http_port, 32)
        assert [status for _, status in again] == [200] * 32
        for s, _ in again:
            s.close()
        deadline = time.monotonic() + 10
        while metric(http_port, "fencepost_open_streams", kind="dashboard_events") > 0:
            assert time.monotonic() < deadline, "closed streams kept their slots"
            time.sleep(0.1)
    finally:
        srv.kill()


def test_a_stream_that_takes_nothing_is_dropped_after_the_write_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fencepost_server.web import dashboard as web

    monkeypatch.setattr(web, "SSE_WRITE_TIMEOUT_S", 0.5)  # 10 s in production
    with ServerThread(tmp_path / "fp.db", http_event_queue=1_000_000) as srv:
        port = port_of(srv)
        (stuck, status), = _open_streams(port, 1)
        assert status == 200
        _burst(srv.address, 20_000)  # more than the socket buffers take
        deadline = time.monotonic() + 10
        while metric(port, "fencepost_open_streams", kind="dashboard_events") > 0:
            assert time.monotonic() < deadline, "the stream that takes nothing was not dropped"
            time.sleep(0.05)
        assert metric(port, "fencepost_dashboard_event_streams_dropped_total",
                      reason="write_timeout") == 1
        stuck.close()


def test_event_streams_are_capped_per_principal(tmp_path: Path) -> None:
    with ServerThread(tmp_path / "fp.db", authz=token_policy(tmp_path),
                      http_event_streams_per_client=2) as srv:
        _capped_per_principal(port_of(srv))


def _capped_per_principal(port: int) -> None:
    ops = "Authorization: Bearer ops-token\r\n"
    first = _open_streams(port, 3, "127.0.0.1", ops)
    assert [status for _, status in first] == [200, 200, 429]  # per address (cap 2)
    # the same principal from another address: still capped, as a principal
    other = _open_streams(port, 1, "127.0.0.2", ops)
    assert other[0][1] == 429
    # another principal from that address is not; a worker may not follow at all
    ops2 = _open_streams(port, 1, "127.0.0.2", "Authorization: Bearer ops2-token\r\n")
    assert ops2[0][1] == 200
    worker = _open_streams(port, 1, "127.0.0.3", "Authorization: Bearer w-token\r\n")
    assert worker[0][1] == 403  # WatchRuns needs the operator role
    for s, _ in first + other + ops2 + worker:
        s.close()


def test_a_reading_client_still_gets_its_changes(open_server: ServerThread) -> None:
    port = port_of(open_server)

    async def follow() -> list[str]:
        import aiohttp

        seen: list[str] = []
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{port}/api/events") as resp:
            assert resp.status == 200
            async with asyncio.timeout(10):
                async for raw in resp.content:
                    line = raw.decode()
                    if line.startswith("event: hello"):
                        await asyncio.get_running_loop().run_in_executor(
                            None, _burst, open_server.address, 500)
                    elif line.startswith("data: ") and '"changes"' in line:
                        seen += [c["run_id"] for c in json.loads(line[6:])["changes"]]
                        if len(seen) >= 500:
                            return seen
        return seen

    seen = asyncio.run(follow())
    assert sorted(seen) == [f"burst-{i:06d}" for i in range(500)]


# -- flags -------------------------------------------------------------------------


def test_the_limits_are_flags_and_bad_values_are_refused(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from fencepost_server import cli

    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--http-allowed-hosts", "--http-max-event-streams",
                 "--http-event-streams-per-client", "--http-event-queue"):
        assert flag in out, flag
    for args, where in ((["--http-allowed-hosts", "http://x/"], "--http-allowed-hosts"),
                        (["--http-event-queue", "0"], "--http-event-queue")):
        assert cli.main(["serve", "--db", "/nonexistent/x.db", *args]) == 2
        assert where in capsys.readouterr().err
    assert Settings.from_env({"FENCEPOST_HTTP_ALLOWED_HOSTS": "a.example, B.example:8233"}
                             ).http_allowed_hosts == ("a.example", "b.example:8233")
