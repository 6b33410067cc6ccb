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
CORS preflight, which this server never grants). The page sends
``authorization: Bearer TOKEN`` with its actions when a token is entered;
``authorize`` is the one place that decides whether an action is allowed.

A metrics-only listener (``--metrics-listen``) serves just ``/metrics`` and
``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .core import ledger as L
from .core import validate
from .core.errors import Code, LedgerError
from .core.records import Record, Status
from .metrics import CONTENT_TYPE
from .storage.sqlite import KIND_DELETE
from .writer import ChangeEvent

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("fencepost.web")

PAGE_DEFAULT = 50
PAGE_MAX = 500
HISTORY_LIMIT = 2000  # changes read for one run's timeline (newest first)
SSE_FLUSH_S = 0.2  # changes are coalesced per run and sent at most this often
SSE_QUEUE_LIMIT = 50_000  # changes a dashboard may lag before it is told to reload
SSE_HEARTBEAT_S = 15.0
STATIC = resources.files("fencepost_server") / "web_static"
STATUS_NAMES = {s.name.lower(): s for s in Status}
_HTTP_STATUS = {
    Code.RUN_VALIDATION_ERROR: 400,
    Code.RUN_NOT_FOUND: 404,
    Code.STORAGE_FULL: 503,
    Code.STORAGE_UNAVAILABLE: 503,
    Code.SHUTTING_DOWN: 503,
}

Authorize = Callable[[web.Request, str], Awaitable[None]]


async def allow_all(request: web.Request, action: str) -> None:
    """The default: without identities every caller may act (the gRPC API lets
    anyone cancel too). Replace to check the bearer token against roles."""


# -- JSON forms ---------------------------------------------------------------------


def record_doc(rec: Record) -> dict[str, Any]:
    """A record for the page: times in ms since the epoch (server clock)."""
    d: dict[str, Any] = {
        "run_id": rec.run_id,
        "status": rec.status.name.lower(),
        "attempt": rec.attempt,
        "fencing_token": rec.fencing_token,
        "version": rec.version,
        "revision": rec.revision,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
        "lease": None,
        "checkpoint_ref": None,
        "outcome": None,
        "suspension": None,
    }
    if rec.lease is not None:
        le = rec.lease
        d["lease"] = {
            "owner": le.owner,
            "acquired_at": le.acquired_at,
            "expires_at": le.expires_at,
            "ttl_ms": le.ttl_ms,
            "lock_delay_ms": le.lock_delay_ms,
        }
    if rec.checkpoint_ref is not None:
        c = rec.checkpoint_ref
        d["checkpoint_ref"] = {"key": c.key, "snapshot_version": c.snapshot_version,
                               "saved_at": c.saved_at}
    if rec.outcome is not None:
        d["outcome"] = {"code": rec.outcome.code, "message": rec.outcome.message}
    if rec.suspension is not None:
        d["suspension"] = {"suspended_at": rec.suspension.suspended_at,
                           "pending_approval_ids": list(rec.suspension.pending_approval_ids)}
    return d


def timeline(changes: list[tuple[int, int, Record | None]]) -> list[dict[str, Any]]:
    """Retained changes of one run (oldest first) as timeline entries: what
    happened, who, when. Consecutive renewals are folded into one entry."""
    out: list[dict[str, Any]] = []
    prev: Record | None = None
    for i, (revision, kind, rec) in enumerate(changes):
        entry = _describe(prev, rec, kind, first=i == 0)
        entry["revision"] = revision
        entry["at"] = rec.updated_at if rec is not None else None
        if entry["event"] == "renewed" and out and out[-1]["event"] == "renewed":
            last = out[-1]
            last["count"] += 1
            last["until_revision"], last["last_at"] = revision, entry["at"]
            last["detail"] = entry["detail"]
        else:
            entry["count"] = 1
            out.append(entry)
        prev = rec
    return out


def _owner(rec: Record | None) -> str | None:
    return rec.lease.owner if rec is not None and rec.lease is not None else None


def _describe(prev: Record | None, rec: Record | None, kind: int, *, first: bool) -> dict[str, Any]:
    def ev(event: str, detail: str = "", who: str | None = None) -> dict[str, Any]:
        return {"event": event, "detail": detail, "who": who, "status":
                rec.status.name.lower() if rec is not None else None,
                "fencing_token": rec.fencing_token if rec is not None else None}

    if kind == KIND_DELETE or rec is None:
        return ev("deleted", "hard-deleted; its last fencing token is kept", _owner(prev))
    status = rec.status
    if prev is None:
        if not first or rec.version == 1:
            if rec.lease is not None:
                return ev("acquired", f"token {rec.fencing_token}, ttl {rec.lease.ttl_ms} ms",
                          rec.lease.owner)
            return ev("created", status.name.lower())
        return ev("earlier history compacted", f"first retained change: {status.name.lower()}",
                  _owner(rec))
    if status is not prev.status:
        if status is Status.CANCELLED:
            msg = rec.outcome.message if rec.outcome and rec.outcome.message else ""
            return ev("cancelled", msg, _owner(prev))
        if status in (Status.COMPLETED, Status.FAILED):
            code = rec.outcome.code if rec.outcome else ""
            return ev("finished", f"{status.name.lower()} {code}".strip(), _owner(prev))
        if status is Status.SUSPENDED:
            ids = rec.suspension.pending_approval_ids if rec.suspension else ()
            return ev("suspended", ", ".join(ids), _owner(prev))
        if status is Status.QUEUED and prev.status is Status.SUSPENDED:
            return ev("resumed", "queued again")
        if status is Status.QUEUED:
            if prev.lease is not None and prev.lease.expires_at <= rec.updated_at:
                return ev("resumed", "expired lease cleared; queued again", _owner(prev))
            return ev("released", "given back unfinished", _owner(prev))
    if rec.lease is not None and rec.fencing_token != prev.fencing_token:
        if prev.lease is not None:
            return ev("taken over", f"from {prev.lease.owner} (token {prev.fencing_token} -> "
                      f"{rec.fencing_token})", rec.lease.owner)
        return ev("acquired", f"token {rec.fencing_token}, attempt {rec.attempt}", rec.lease.owner)
    if rec.checkpoint_ref is not None and rec.checkpoint_ref != prev.checkpoint_ref:
        c = rec.checkpoint_ref
        return ev("checkpointed", f"{c.key} v{c.snapshot_version}", _owner(rec))
    if rec.lease is not None and prev.lease is not None and rec.lease.owner == prev.lease.owner:
        return ev("renewed", f"ttl {rec.lease.ttl_ms} ms", rec.lease.owner)
    return ev("updated", f"version {rec.version}", _owner(rec))


# -- the server ---------------------------------------------------------------------


class Dashboard:
    """The aiohttp application of one App (its writer, metrics, health)."""

    def __init__(self, app: App, authorize: Authorize = allow_all) -> None:
        self.app = app
        self.authorize = authorize
        self._runners: list[web.AppRunner] = []
        self._streams: set[asyncio.Queue[ChangeEvent | None]] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self.ports: list[int] = []  # every port listened on
        self.http_port = 0  # the dashboard's (0: not served)

    # -- lifecycle

    def _application(self, full: bool) -> web.Application:
        application = web.Application(client_max_size=64 * 1024)
        routes = [web.get("/metrics", self.metrics), web.get("/healthz", self.healthz)]
        if full:
            routes += [
                web.get("/", self.page("index.html")),
                web.get("/runs/{run_id:.+}", self.page("run.html")),
                web.get("/static/{name}", self.static),
                web.get("/api/runs", self.list_runs),
                web.get("/api/runs/{run_id:.+}", self.get_run),
                web.post("/api/cancel", self.cancel),
                web.post("/api/resume", self.resume),
                web.get("/api/engine/runs", self.engine_runs),
                web.get("/api/events", self.events),
            ]
        application.add_routes(routes)
        return application

    async def start(self, http_listen: str, metrics_listen: str, default: str = "") -> None:
        """Listen on both addresses ("" skips one). The default dashboard
        address being taken (another fencepost on this machine) is a warning;
        an address asked for that cannot be had is an error."""
        from .app import split_address

        assert self.app.writer is not None
        self._unsubscribe = self.app.writer.subscribe(self._on_changes)
        for address, full in ((http_listen, True), (metrics_listen, False)):
            if not address:
                continue
            host, port = split_address(address, 8233)
            runner = web.AppRunner(self._application(full), access_log=None,
                                   handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            site = web.TCPSite(runner, host.strip("[]"), port, reuse_address=True)
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
            log.info("%s on http://%s:%d/", "dashboard and /metrics" if full else "/metrics",
                     host, self.ports[-1])

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for q in list(self._streams):
            q.put_nowait(None)  # every event stream ends
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()

    def _on_changes(self, events: list[ChangeEvent]) -> None:
        for q in list(self._streams):
            if q.qsize() + len(events) > SSE_QUEUE_LIMIT:
                q.put_nowait(None)  # too slow: told to reload, then dropped
                self._streams.discard(q)
                continue
            for e in events:
                q.put_nowait(e)

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
        m = self.app.metrics
        body = await m.render_async() if m is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.app.serving
        return web.Response(text="SERVING\n" if ok else "NOT_SERVING\n", status=200 if ok else 503)

    # -- API

    async def list_runs(self, request: web.Request) -> web.Response:
        q = request.query
        statuses: set[Status] = set()
        for raw in q.getall("status", []):
            for name in filter(None, raw.split(",")):
                if name not in STATUS_NAMES:
                    return _bad("status", f"unknown status {name!r}; one of "
                                + ", ".join(STATUS_NAMES))
                statuses.add(STATUS_NAMES[name])
        try:
            limit = int(q.get("limit", PAGE_DEFAULT))
        except ValueError:
            return _bad("limit", "not an integer")
        if not 1 <= limit <= PAGE_MAX:
            return _bad("limit", f"must be between 1 and {PAGE_MAX}")
        owner, prefix = q.get("owner") or None, q.get("prefix", "")
        after, before = q.get("after"), q.get("before")
        writer = self.app.writer
        assert writer is not None
        state = writer.state
        revision = state.revision

        backward = before is not None  # the page before `before`, walking backwards
        page, more = await writer.page_runs(frozenset(statuses), owner or "", limit,
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
            "total": len(state.index),
            "now": self.app.clock.now_ms(),
        })

    async def get_run(self, request: web.Request) -> web.Response:
        run_id = request.match_info["run_id"]
        assert self.app.writer is not None
        rec = await self.app.writer.read_run(run_id)
        changes = await self.app.run_history(run_id, HISTORY_LIMIT)
        if rec is None and not changes:
            return _error(LedgerError(Code.RUN_NOT_FOUND, f"run {run_id!r} not found"))
        return _json({
            "run": record_doc(rec) if rec is not None else None,
            "timeline": timeline(changes),
            "truncated": len(changes) >= HISTORY_LIMIT,
            "now": self.app.clock.now_ms(),
        })

    async def cancel(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        message = body.get("message") or None
        if message is not None and not isinstance(message, str):
            return _bad("message", "must be a string")
        return await self._act(request, "cancel",
                               L.Cancel(str(body.get("run_id", "")), message))

    async def resume(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        return await self._act(request, "resume", L.RequestResume(str(body.get("run_id", ""))))

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

    async def _act(self, request: web.Request, action: str, cmd: L.Command) -> web.Response:
        try:
            await self.authorize(request, action)
            validate.command(cmd)
            assert self.app.writer is not None
            result = await self.app.writer.submit(cmd)
        except LedgerError as err:
            return _error(err)
        except web.HTTPException as exc:
            return _json({"error": {"code": exc.reason.upper().replace(" ", "_"),
                                    "message": exc.text or exc.reason}}, status=exc.status)
        rec = result if isinstance(result, Record) else getattr(result, "record", None)
        return _json({"run": record_doc(rec) if isinstance(rec, Record) else None})

    async def engine_runs(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            limit = int(q.get("limit", PAGE_DEFAULT))
            offset = int(q.get("offset", 0))
        except ValueError:
            return _bad("limit", "limit and offset are integers")
        if not 1 <= limit <= PAGE_MAX or offset < 0:
            return _bad("limit", f"limit 1-{PAGE_MAX}, offset >= 0")
        runs, total = await self.app.engine_runs(
            agent=q.get("agent") or None, statuses=[s for s in q.getall("status", []) if s],
            limit=limit, offset=offset)
        now = self.app.clock.now_ms()
        return _json({"runs": [_engine_doc(r) for r in runs], "total": total, "offset": offset,
                      "now": now})

    async def events(self, request: web.Request) -> web.StreamResponse:
        only = request.query.get("run")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        q: asyncio.Queue[ChangeEvent | None] = asyncio.Queue()
        self._streams.add(q)
        gauge = self.app.metrics.open_streams.labels("dashboard_events") if (
            self.app.metrics is not None) else None
        if gauge is not None:
            gauge.inc()
        try:
            await resp.write(_sse("hello", {"revision": self.app.writer_state.revision,
                                            "now": self.app.clock.now_ms()}))
            while True:
                try:
                    # not wait_for, which may swallow a cancellation (Leadership.keep)
                    async with asyncio.timeout(SSE_HEARTBEAT_S):
                        first = await q.get()
                except TimeoutError:
                    await resp.write(b": heartbeat\n\n")
                    continue
                await asyncio.sleep(SSE_FLUSH_S)  # let a burst gather, then coalesce
                batch = [first, *(q.get_nowait() for _ in range(q.qsize()))]
                if None in batch:
                    await resp.write(_sse("reset", {}))
                    break
                latest: dict[str, ChangeEvent] = {}
                for ev in batch:
                    if ev is not None and (only is None or ev.run_id == only):
                        latest[ev.run_id] = ev
                if latest:
                    await resp.write(_sse("changes", {
                        "now": self.app.clock.now_ms(),
                        "changes": [{"revision": e.revision, "run_id": e.run_id,
                                     "kind": "delete" if e.kind == KIND_DELETE else "put",
                                     "run": record_doc(e.record) if e.record else None}
                                    for e in latest.values()]}))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._streams.discard(q)
            if gauge is not None:
                gauge.dec()
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await resp.write_eof()
        return resp


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


def _engine_doc(run: Any) -> dict[str, Any]:
    return {
        "id": run.id,
        "agent": run.agent,
        "status": run.status,
        "concurrency_key": run.concurrency_key,
        "claim": None if run.claim is None else {"owner": run.claim.owner,
                                                 "expires_at": run.claim.expires_at},
        "created_at": run.created_at,
        "updated_at": run.updated_at,
    }
