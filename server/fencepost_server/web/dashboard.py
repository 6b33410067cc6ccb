"""The HTTP side port: the web dashboard, its JSON API and ``/metrics``, on
the coordinator's own event loop (aiohttp).

    GET  /                      the runs page          GET /runs/RUN_ID   a run's page
    GET  /static/FILE           its HTML, CSS and JS (package data; nothing fetched)
    GET  /api/runs              a page of runs: ?status=S (repeatable) &owner=O
                                &prefix=P &after=ID | &before=ID &limit=N (1-500, 50)
    GET  /api/runs/RUN_ID       the record and its retained history as a timeline
    POST /api/cancel            {"run_id", "message"?}  (JSON in, the record out)
    POST /api/resume            {"run_id"}
    GET  /api/engine/runs       engine-store runs: ?status=S &agent=A &offset=N &limit=N
    GET  /api/events            server-sent events fed by the change feed (?run=ID: one run)
    GET  /metrics               Prometheus text format
    GET  /healthz               200 "SERVING" while the gRPC health is SERVING, else 503

Every other path is 404. Paging happens here, on the sorted id list the
writer keeps, so a page costs the same at 100 000 runs as at 10. POSTs must
be ``application/json`` (a form on another site cannot send one without a
CORS preflight, which this server never grants).

Before any handler (``_guard``): a ``Host`` the port does not serve is 421
(DNS rebinding), a state-changing request from another ``Origin`` is 403, and
each API route needs the roles of the gRPC call that does the same thing
(``ROUTE_RPC``), with the principal found as on the gRPC port (auth.py):
the side port grants nothing the gRPC port refuses. With TLS on, the port
serves TLS with the same files (and asks for client certificates the same
way); every response carries the framing and sniffing headers.

A metrics-only listener (``--metrics-listen``) serves just ``/metrics`` and
``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from importlib import resources
from typing import Any, Protocol

from aiohttp import web

from ..addresses import host_entry, split_address
from ..auth import (
    OPEN,
    RPC_ROLES,
    Authenticator,
    Principal,
    certificate_fields,
    check_role,
    is_loopback,
)
from ..clock import Clock
from ..core import engine as E
from ..core import ledger as L
from ..core import validate
from ..core.errors import Code, LedgerError, validation
from ..core.records import KIND_DELETE, Record, Status
from ..metrics import CONTENT_TYPE, Metrics
from ..tls import ContextFiles
from ..writer import ChangeEvent, History, Reads, Writer
from .queries import engine_doc, record_doc, timeline

log = logging.getLogger("fencepost.web")

PAGE_DEFAULT = 50
PAGE_MAX = 500
HISTORY_LIMIT = 2000  # changes read for one run's timeline (newest first)
SSE_FLUSH_S = 0.2  # changes are coalesced per run and sent at most this often
SSE_HEARTBEAT_S = 15.0
SSE_POLL_S = 1.0  # an idle stream notices this often that its client has gone
SSE_CHUNK = 200  # changes per event message: a client that stops reading holds one
SSE_WRITE_TIMEOUT_S = 10.0  # a message the client does not take in this long: dropped
SSE_RESET_TIMEOUT_S = 1.0  # ...and the last word to a stream already dropped
STATIC = resources.files("fencepost_server.web") / "static"
STATUS_NAMES = {s.name.lower(): s for s in Status}
LOOPBACK_NAMES = frozenset({"localhost", "[::1]"})
# Every response: no framing (clickjacking the Cancel buttons), no sniffing,
# and the pages may load only their own assets.
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
# API route -> the gRPC call whose roles it needs (auth.RPC_ROLES).
ROUTE_RPC = {
    "runs": "/fencepost.v1.Ledger/ListRuns",
    "run": "/fencepost.v1.Ledger/GetRun",
    "events": "/fencepost.v1.Ledger/WatchRuns",
    "engine_runs": "/fencepost.v1.EngineStore/ListRuns",
    "cancel": "/fencepost.v1.Ledger/Cancel",
    "resume": "/fencepost.v1.Ledger/RequestResume",
    "shards": "/fencepost.v1.Ledger/Shards",
}
_DIGITS = re.compile(r"[0-9]{1,19}")
PRINCIPAL = web.RequestKey("principal", Principal)  # who made an API request (_guard)
_HTTP_STATUS = {
    Code.RUN_VALIDATION_ERROR: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.RUN_NOT_FOUND: 404,
    Code.STORAGE_FULL: 503,
    Code.STORAGE_UNAVAILABLE: 503,
    Code.SHUTTING_DOWN: 503,
}


# -- the server ---------------------------------------------------------------------


class _Change:
    """One change as the event streams send it, serialised once for all of them."""

    __slots__ = ("_event", "_json", "run_id")

    def __init__(self, event: ChangeEvent) -> None:
        self.run_id = event.run_id
        self._event: ChangeEvent | None = event
        self._json = ""

    def json(self) -> str:
        if self._event is not None:
            e, self._event = self._event, None
            self._json = json.dumps(
                {"revision": e.revision, "run_id": e.run_id,
                 "kind": "delete" if e.kind == KIND_DELETE else "put",
                 "run": record_doc(e.record) if e.record else None},
                separators=(",", ":"), ensure_ascii=False)
        return self._json


class _Stream:
    """One open event stream: the changes it has not sent yet, latest per run."""

    __slots__ = ("ended", "only", "pending", "request", "wake", "writing")

    def __init__(self, request: web.Request, only: str | None) -> None:
        self.request = request
        self.only = only
        self.pending: dict[str, _Change] = {}
        self.wake = asyncio.Event()
        self.ended = ""  # why it ends: "stop", or the drop reason
        self.writing = False


class Settings(Protocol):
    """The settings the dashboard reads."""

    @property
    def tls_cert(self) -> str: ...
    @property
    def tls_key(self) -> str: ...
    @property
    def client_ca(self) -> str: ...
    @property
    def authz(self) -> str: ...
    @property
    def http_allowed_hosts(self) -> tuple[str, ...]: ...
    @property
    def http_max_event_streams(self) -> int: ...
    @property
    def http_event_streams_per_client(self) -> int: ...
    @property
    def http_event_queue(self) -> int: ...


class Source(Protocol):
    """What the dashboard reads and drives (the coordinator's ``App``)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def writer(self) -> Writer | None: ...
    @property
    def reads(self) -> Reads | None: ...
    @property
    def writer_state(self) -> Any: ...
    @property
    def authn(self) -> Authenticator | None: ...
    @property
    def metrics(self) -> Metrics | None: ...
    @property
    def serving(self) -> bool: ...

    @property
    def history(self) -> History | None: ...

    def shard_owner(self) -> tuple[str, str, int]: ...

    async def run_history(self, run_id: str, limit: int) -> list[Any]: ...

    async def engine_runs(self, *, agent: str | None, statuses: list[str], limit: int,
                          offset: int) -> tuple[list[Any], int]: ...


class Dashboard:
    """The aiohttp application of one coordinator (its writer, metrics, health)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        s = source.settings
        self.max_streams = s.http_max_event_streams
        self.per_client = s.http_event_streams_per_client
        self.queue_limit = s.http_event_queue
        self._runners: list[web.AppRunner] = []
        self._streams: set[_Stream] = set()
        self._open = 0
        self._per_address: Counter[str] = Counter()
        self._per_principal: Counter[str] = Counter()
        self._hosts: list[tuple[str, int | None]] = []  # besides the loopback names
        self._tls: ContextFiles | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self.ports: list[int] = []  # every port listened on
        self.http_port = 0  # the dashboard's (0: not served)

    # -- lifecycle

    def _application(self, full: bool) -> web.Application:
        application = web.Application(client_max_size=64 * 1024,
                                      middlewares=[self._guard] if full else [])
        application.on_response_prepare.append(_security_headers)
        routes = [web.get("/metrics", self.metrics), web.get("/healthz", self.healthz)]
        if full:
            routes += [
                web.get("/", self.page("index.html")),
                web.get("/runs/{run_id:.+}", self.page("run.html")),
                web.get("/static/{name}", self.static),
                web.get("/api/runs", self.list_runs, name="runs"),
                web.get("/api/runs/{run_id:.+}", self.get_run, name="run"),
                web.post("/api/cancel", self.cancel, name="cancel"),
                web.post("/api/resume", self.resume, name="resume"),
                web.get("/api/engine/runs", self.engine_runs, name="engine_runs"),
                web.get("/api/events", self.events, name="events"),
                web.get("/api/shards", self.shards, name="shards"),
            ]
        application.add_routes(routes)
        return application

    async def start(self, http_listen: str, metrics_listen: str, default: str = "") -> None:
        """Listen on both addresses ("" skips one). The default dashboard
        address being taken (another fencepost on this machine) is a warning;
        an address asked for that cannot be had is an error."""
        s = self.source.settings
        assert self.source.writer is not None
        if s.tls_cert and http_listen:
            self._tls = ContextFiles(s.tls_cert, s.tls_key, s.client_ca or None)
        self._hosts = [host_entry(h) for h in s.http_allowed_hosts]
        self._unsubscribe = self.source.writer.subscribe(self._on_changes)
        for address, full in ((http_listen, True), (metrics_listen, False)):
            if not address:
                continue
            host, port = split_address(address, 8233)
            runner = web.AppRunner(self._application(full), access_log=None,
                                   handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            tls = self._tls.context if full and self._tls is not None else None
            site = web.TCPSite(runner, host.strip("[]"), port, reuse_address=True,
                               ssl_context=tls)
            try:
                await site.start()
            except OSError as exc:
                await runner.cleanup()
                if full and address == default:
                    log.warning("dashboard off: could not listen on %s (%s); pass "
                                "--http-listen ADDR to choose another", address, exc)
                    continue
                raise RuntimeError(f"could not listen on {address} (HTTP): {exc}") from exc
            self._runners.append(runner)
            server = site._server
            sockets = getattr(server, "sockets", None) or []
            self.ports.append(sockets[0].getsockname()[1] if sockets else port)
            if full:
                self.http_port = self.ports[-1]
                self._announce(host, self.http_port)
            else:
                log.info("/metrics on http://%s:%d/", host, self.ports[-1])

    def _announce(self, host: str, port: int) -> None:
        """Log where the dashboard is, and say loudly what it will not answer."""
        s = self.source.settings
        wildcard = host.strip("[]") in ("0.0.0.0", "::")
        if not wildcard:
            self._hosts.append((host.lower(), port))
        scheme = "https" if self._tls is not None else "http"
        log.info("dashboard and /metrics on %s://%s:%d/ (%s)", scheme, host, port,
                 "roles from --authz" if self.source.authn is not None and s.authz else
                 "client certificates or tokens required" if self.source.authn is not None
                 else "no identities: every caller may read and cancel")
        if not is_loopback(f"{host}:{port}"):
            if self._tls is None:
                log.warning("THE DASHBOARD IS SERVED IN PLAINTEXT on %s:%d (--allow-insecure): "
                            "bearer tokens and every run cross the network in the clear", host,
                            port)
            if self.source.authn is None:
                log.warning("THE DASHBOARD ON %s:%d HAS NO IDENTITIES: anyone who reaches it "
                            "can read and cancel every run (use --client-ca or --authz with "
                            "[tokens])", host, port)
            if wildcard and not s.http_allowed_hosts:
                log.warning("the dashboard on %s:%d answers only Host localhost, 127.0.0.1 and "
                            "[::1]: pass --http-allowed-hosts NAME for the names browsers use",
                            host, port)

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for st in list(self._streams):
            st.ended = "stop"  # every event stream is told to reload, and ends
            st.wake.set()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()

    def _on_changes(self, events: list[ChangeEvent]) -> None:
        if not self._streams:
            return
        changes = [_Change(e) for e in events]
        for st in list(self._streams):
            pending = st.pending
            for c in changes:
                if st.only is None or c.run_id == st.only:
                    pending[c.run_id] = c
            if len(pending) > self.queue_limit:
                self._drop(st, "queue_full")
            elif pending:
                st.wake.set()

    def _drop(self, st: _Stream, reason: str) -> None:
        """Free a stream's queue; one that is stuck writing to a client that
        does not read is cut at once, one that reads is told to reload."""
        first = not st.ended
        st.ended, st.pending = st.ended or reason, {}
        self._streams.discard(st)
        st.wake.set()
        transport = st.request.transport
        if st.writing and transport is not None:
            transport.abort()
        if first:
            if self.source.metrics is not None:
                self.source.metrics.events_dropped.labels(reason).inc()
            log.info("dashboard event stream of %s dropped (%s)", st.request.remote, reason)

    # -- the guard: Host, Origin, identity and role

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        host = request.headers.get("Host")
        if host is not None and not self._host_ok(host):
            return self._refuse(421, "host", "HOST_NOT_ALLOWED",
                                f"this server does not answer for Host {host[:300]!r}; it "
                                "answers its listen address, localhost, 127.0.0.1, [::1] and "
                                "the names given with --http-allowed-hosts")
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            origin = request.headers.get("Origin")
            if origin is not None and not self._same_origin(origin, host):
                return self._refuse(403, "origin", "ORIGIN_NOT_ALLOWED",
                                    f"a request from Origin {origin[:300]!r} may not change "
                                    "anything here: only the dashboard's own pages may")
        rpc = ROUTE_RPC.get(request.match_info.route.name or "")
        try:
            if rpc is not None:
                principal = self.principal(request)
                check_role(principal, RPC_ROLES[rpc], f"{request.method} {request.path}")
                request[PRINCIPAL] = principal
            return await handler(request)
        except LedgerError as err:
            if err.code is Code.UNAUTHENTICATED:
                self._count("unauthenticated")
            elif err.code is Code.PERMISSION_DENIED:
                self._count("permission_denied")
            resp = _error(err)
            if err.code is Code.UNAUTHENTICATED:
                resp.headers["WWW-Authenticate"] = 'Bearer realm="fencepost"'
            return resp

    def principal(self, request: web.Request) -> Principal:
        """Who is asking: the bearer token's principal, else the client
        certificate's (auth.Authenticator, as on the gRPC port)."""
        authn = self.source.authn
        if authn is None:
            return OPEN

        def certificate() -> Mapping[str, list[bytes]]:
            transport = request.transport
            conn = transport.get_extra_info("ssl_object") if transport is not None else None
            return certificate_fields(conn.getpeercert() if conn is not None else None)

        return authn.identify(request.headers.get("Authorization"), certificate)

    def _host_ok(self, header: str) -> bool:
        try:
            name, port = host_entry(header)
        except ValueError:
            return False
        if name in LOOPBACK_NAMES:
            return True  # any port: a port-forward may move it; no page can own these names
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(name).is_loopback:
                return True
        return any(h == name and (p is None or p == port) for h, p in self._hosts)

    def _same_origin(self, origin: str, host: str | None) -> bool:
        """``Origin`` names the host and port asked (either scheme: a proxy in
        front may terminate TLS)."""
        scheme, sep, netloc = origin.strip().lower().partition("://")
        if host is None or not sep or scheme not in ("http", "https"):
            return False
        default = ":443" if scheme == "https" else ":80"
        return netloc.removesuffix(default) == host.strip().lower().removesuffix(default)

    def _count(self, reason: str) -> None:
        if self.source.metrics is not None:
            self.source.metrics.http_refused.labels(reason).inc()

    def _refuse(self, status: int, reason: str, code: str, message: str) -> web.Response:
        self._count(reason)
        return _json({"error": {"code": code, "message": message}}, status=status)

    # -- pages

    def page(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=(STATIC / name).read_bytes(), content_type="text/html",
                                charset="utf-8", headers=_NO_CACHE)

        return handler

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
        ext = name[name.rfind("."):] if "." in name else ""
        f = STATIC / name
        if "/" in name or name.startswith(".") or ext not in types or not f.is_file():
            raise web.HTTPNotFound()
        return web.Response(body=f.read_bytes(), content_type=types[ext], charset="utf-8",
                            headers=_NO_CACHE)

    async def metrics(self, request: web.Request) -> web.Response:
        m = self.source.metrics
        body = await m.render_async() if m is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.source.serving
        return web.Response(text="SERVING\n" if ok else "NOT_SERVING\n", status=200 if ok else 503)

    # -- API

    async def list_runs(self, request: web.Request) -> web.Response:
        q = request.query
        statuses: set[Status] = set()
        for raw in q.getall("status", []):
            for name in filter(None, raw.split(",")):
                if name not in STATUS_NAMES:
                    return _bad("status", f"unknown status {name[:64]!r}; one of "
                                + ", ".join(STATUS_NAMES))
                statuses.add(STATUS_NAMES[name])
        limit = _int_param(q, "limit", PAGE_DEFAULT, 1, PAGE_MAX)
        owner = _text_param(q, "owner", validate.MAX_OWNER_BYTES) or None
        prefix = _text_param(q, "prefix", validate.MAX_RUN_ID_BYTES) or ""
        after = _text_param(q, "after", validate.MAX_RUN_ID_BYTES)
        before = _text_param(q, "before", validate.MAX_RUN_ID_BYTES)
        if after is not None and before is not None:
            return _bad("before", "give after or before, not both")
        writer, reads = self.source.writer, self.source.reads
        assert writer is not None and reads is not None
        state = writer.state
        revision = state.revision

        backward = before is not None  # the page before `before`, walking backwards
        stored = self.source.history if writer.storage.sharing else None
        if stored is not None:  # every shard's runs, whoever leads them
            page, more = await stored.stored_runs(frozenset(statuses), owner or "", limit,
                                                  prefix=prefix, after=after, before=before)
            # those led here as memory has them (a lease renewed from memory)
            page = [state.runs.get(r.run_id, r) if writer.leads_key(r.run_id) else r
                    for r in page]
        else:
            page, more = await reads.page_runs(frozenset(statuses), owner or "", limit,
                                               prefix=prefix, after=after, before=before)
        if backward:
            page.reverse()
            has_prev, has_next = more, True
        else:
            has_prev, has_next = after is not None, more
        return _json({
            "runs": [record_doc(r) for r in page],
            "has_prev": has_prev and bool(page),
            "has_next": has_next and bool(page),
            "revision": revision,
            "total": len(state.index) if stored is None else await stored.stored_count(),
            "now": self.source.clock.now_ms(),
        })

    async def get_run(self, request: web.Request) -> web.Response:
        run_id = validate.run_id(request.match_info["run_id"])
        assert self.source.reads is not None
        rec = await self.source.reads.read_run(run_id)
        stored = self.source.history
        writer = self.source.writer
        if (rec is None and stored is not None and writer is not None
                and writer.storage.sharing and not writer.leads_key(run_id)):
            rec = await stored.stored_run(run_id)  # led elsewhere: as last committed
        changes = await self.source.run_history(run_id, HISTORY_LIMIT)
        if rec is None and not changes:
            return _error(LedgerError(Code.RUN_NOT_FOUND, f"run {run_id!r} not found"))
        return _json({
            "run": record_doc(rec) if rec is not None else None,
            "timeline": timeline(changes),
            "truncated": len(changes) >= HISTORY_LIMIT,
            "now": self.source.clock.now_ms(),
        })

    async def shards(self, request: web.Request) -> web.Response:
        """Every shard: who leads it and, for those led here, runs and live
        leases (the Shards call's map)."""
        writer, reads = self.source.writer, self.source.reads
        assert writer is not None and reads is not None
        n, now = writer.storage.shards, self.source.clock.now_ms()
        revision, rows = await reads.shard_map(n, now, self.source.shard_owner(),
                                               writer.ownership)
        return _json({"shard_count": n, "revision": revision, "now": now,
                      "shards": [dataclasses.asdict(r) for r in rows]})

    async def cancel(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        message = body.get("message") or None
        if message is not None and not isinstance(message, str):
            return _bad("message", "must be a string")
        return await self._act(L.Cancel(str(body.get("run_id", "")), message))

    async def resume(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        return await self._act(L.RequestResume(str(body.get("run_id", ""))))

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        if request.content_type != "application/json":
            return _bad("content-type", "send application/json")
        try:
            body = await request.json()
        except ValueError:
            return _bad("request", "not valid JSON")
        if not isinstance(body, dict):
            return _bad("request", "must be a JSON object")
        if not isinstance(body.get("run_id"), str):
            return _bad("run_id", "required, a string")
        return body

    async def _act(self, cmd: L.Command) -> web.Response:
        try:
            validate.command(cmd)
            assert self.source.writer is not None
            result = await self.source.writer.submit(cmd)
        except LedgerError as err:
            return _error(err)
        rec = result if isinstance(result, Record) else getattr(result, "record", None)
        return _json({"run": record_doc(rec) if isinstance(rec, Record) else None})

    async def engine_runs(self, request: web.Request) -> web.Response:
        q = request.query
        limit = _int_param(q, "limit", PAGE_DEFAULT, 1, PAGE_MAX)
        offset = _int_param(q, "offset", 0, 0, validate.MAX_INT64)
        agent = _text_param(q, "agent", E.MAX_NAME_BYTES) or None
        statuses = [s for s in q.getall("status", []) if s]
        if len(statuses) > E.MAX_FILTER_VALUES:
            return _bad("status", f"at most {E.MAX_FILTER_VALUES} values (got {len(statuses)})")
        for value in statuses:
            E.ident("status", value, E.MAX_STATUS_BYTES)
        runs, total = await self.source.engine_runs(
            agent=agent, statuses=statuses, limit=limit, offset=offset)
        now = self.source.clock.now_ms()
        return _json({"runs": [engine_doc(r) for r in runs], "total": total, "offset": offset,
                      "now": now})

    # -- live updates

    def _admit(self, address: str, principal: Principal) -> str:
        """Why one more event stream is refused ("": it is not)."""
        if self._open >= self.max_streams:
            return (f"{self._open} live-update streams are open, the most this server allows "
                    "(--http-max-event-streams)")
        if self._per_address[address] >= self.per_client:
            return (f"{address} has {self.per_client} live-update streams open, the most one "
                    "client may (--http-event-streams-per-client)")
        if principal.name and self._per_principal[principal.name] >= self.per_client:
            return (f"{principal.name!r} has {self.per_client} live-update streams open, the "
                    "most one principal may (--http-event-streams-per-client)")
        return ""

    async def events(self, request: web.Request) -> web.StreamResponse:
        only = request.query.get("run")
        if only is not None:
            validate.run_id(only, "run")
        principal = request.get(PRINCIPAL, OPEN)
        address = request.remote or ""
        refused = self._admit(address, principal)
        if refused:
            return self._refuse(429, "too_many_streams", "TOO_MANY_STREAMS", refused)
        st = _Stream(request, only)
        self._streams.add(st)
        self._open += 1
        self._per_address[address] += 1
        if principal.name:
            self._per_principal[principal.name] += 1
        gauge = self.source.metrics.open_streams.labels("dashboard_events") if (
            self.source.metrics is not None) else None
        if gauge is not None:
            gauge.inc()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(request)
            hello = {"revision": self.source.writer_state.revision,
                     "now": self.source.clock.now_ms()}
            await self._write(st, resp, _sse("hello", hello))
            await self._follow(st, resp)
        except ConnectionError:
            pass  # the client went, or was dropped
        finally:
            self._streams.discard(st)
            st.pending = {}
            self._open -= 1
            _release(self._per_address, address)
            if principal.name:
                _release(self._per_principal, principal.name)
            if gauge is not None:
                gauge.dec()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def _follow(self, st: _Stream, resp: web.StreamResponse) -> None:
        idle = 0.0
        while True:
            if not st.pending and not st.ended:
                try:
                    # not wait_for, which may swallow a cancellation (Leadership.keep)
                    async with asyncio.timeout(SSE_POLL_S):
                        await st.wake.wait()
                except TimeoutError:
                    transport = st.request.transport
                    if transport is None or transport.is_closing():
                        return  # the client has gone
                    idle += SSE_POLL_S
                    if idle >= SSE_HEARTBEAT_S:
                        idle = 0.0
                        await self._write(st, resp, b": heartbeat\n\n")
                    continue
            idle = 0.0
            await asyncio.sleep(SSE_FLUSH_S)  # let a burst gather, then coalesce
            st.wake.clear()
            if st.ended:  # a client that does not take even this is cut soon
                await self._write(st, resp, _sse("reset", {}), SSE_RESET_TIMEOUT_S)
                return
            batch, st.pending = list(st.pending.values()), {}
            now = self.source.clock.now_ms()
            for i in range(0, len(batch), SSE_CHUNK):
                body = ",".join(c.json() for c in batch[i:i + SSE_CHUNK])
                await self._write(st, resp, (f'event: changes\ndata: {{"now":{now},'
                                             f'"changes":[{body}]}}\n\n').encode())

    async def _write(self, st: _Stream, resp: web.StreamResponse, data: bytes,
                     timeout_s: float | None = None) -> None:
        st.writing = True
        try:
            async with asyncio.timeout(timeout_s or SSE_WRITE_TIMEOUT_S):
                await resp.write(data)
        except TimeoutError:
            self._drop(st, "write_timeout")
            raise ConnectionResetError("the client stopped reading") from None
        finally:
            st.writing = False


def _release(counts: Counter[str], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(SECURITY_HEADERS)


def _int_param(q: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = q.get(name)
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw):
        raise validation(name, f"must be a whole number between {lo} and {hi}")
    return validate.int_range(name, int(raw), lo, hi)


def _text_param(q: Mapping[str, str], name: str, max_bytes: int) -> str | None:
    raw = q.get(name)
    return None if raw is None else validate.text(name, raw, max_bytes, min_bytes=0)


_NO_CACHE = {"Cache-Control": "no-cache"}


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(doc, ensure_ascii=False), status=status,
                        content_type="application/json", headers=_NO_CACHE)


def _bad(field: str, message: str) -> web.Response:
    return _error(LedgerError(Code.RUN_VALIDATION_ERROR, f"{field}: {message}", field=field))


def _error(err: LedgerError) -> web.Response:
    body: dict[str, Any] = {"code": err.code.value, "message": err.message}
    if err.field:
        body["field"] = err.field
    if isinstance(err.record, Record):
        body["run"] = record_doc(err.record)
    return _json({"error": body}, status=_HTTP_STATUS.get(err.code, 409))

