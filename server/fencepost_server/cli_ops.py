"""Operator sub-commands of the ``fencepost`` CLI, over the SDK's SyncClient.

    fencepost get RUN_ID
    fencepost ls [--status S]... [--owner O] [--limit N]
    fencepost cancel RUN_ID [-m MESSAGE]
    fencepost resume RUN_ID
    fencepost delete RUN_ID
    fencepost watch [RUN_ID ...] [--from-revision N] [--limit N]
    fencepost ls --engine [--status S]... [--agent A] [--limit N]
    fencepost health [--service NAME]
    fencepost hold RUN_ID [--ttl TTL] [--wait] [--release] [--grace S] -- CMD ARGS...

Each takes ``--addr`` (env FENCEPOST_ADDR; see cli.default_addr) or
``--endpoints ADDR,ADDR...`` (env FENCEPOST_ENDPOINTS, which wins over
FENCEPOST_ADDR): several coordinators of which one leads; the command goes to
the leader, following a standby's NOT_LEADER as the SDK does. ``--timeout``
(seconds to keep retrying an unreachable server, or waiting for a new leader;
default 5, and 15 with several endpoints: room for a takeover) and
``--json``; for a server with TLS or tokens (docs/SECURITY.md),
``--cacert`` ``--cert`` ``--key`` ``--token`` (env FENCEPOST_CACERT,
FENCEPOST_CERT, FENCEPOST_KEY, FENCEPOST_TOKEN; any of the first three turns
TLS on).

``watch`` prints every committed change to the given runs (all runs when
none is given) as it happens, one line per change, until Ctrl-C (exit 0) or
``--limit`` changes. ``--from-revision N`` first replays the retained
changes from revision N. A dropped stream (server restart, a reader too
slow) is resumed from the last revision printed, with no change missed or
repeated; a server unreachable for longer than ``--timeout`` ends it (exit 3).

Output. Without ``--json``: key/value lines for one record, a table for
``ls`` (times in local time, the lease as time left, or marked ``EXPIRED``
or ``LOCK-DELAY`` when it has passed its expiry). With ``--json`` (stdout,
one document, newline-terminated):

    get, cancel, resume   one JSON object: the record (fencepost.RunRecord.to_dict():
                          status as "running"..., times as ISO 8601 UTC strings)
    ls                    one JSON array of such objects (``[]`` when none)
    ls --engine           one JSON array of engine-store runs: {"id", "agent", "status",
                          "concurrency_key", "claim": {"owner", "expires_at"} | null,
                          "created_at", "updated_at"}
    health                {"service", "status": "SERVING"|"NOT_SERVING"|...}; with several
                          endpoints also "endpoints": [{"address", "status"}] (a status
                          may be "UNREACHABLE") and "serving": [address...]
    delete                {"run_id", "deleted": true, "fencing_token", "revision"}
    watch                 one JSON object per line and change (JSON Lines):
                          {"revision", "kind": "put"|"delete", "run_id", "record"?}
                          (``record`` as for get; absent for a delete)

Human ``watch`` lines: ``REVISION put RUN_ID STATUS token=N attempt=N
owner=O version=N`` or ``REVISION delete RUN_ID``.

Errors go to stderr as ``fencepost: CODE: message``; with ``--json`` they go
to stdout instead, as one JSON object ``{"error": {"code", "message",
"field"?, "run"?}}`` (a usage error has the code ``USAGE``). Exit codes are
the table in ``cli.py``: 0 ok, 1 refused by the server (the code is printed),
2 usage, 3 the server could not be reached (or a mutation got no answer, so
its outcome is unknown).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from types import FrameType
from typing import Any, TextIO

import fencepost
from fencepost import (
    FencepostError,
    OutcomeUnknownError,
    RunRecord,
    UnavailableError,
    WatchEvent,
)
from fencepost._endpoints import parse_endpoints
from fencepost._records import format_time

from .cli import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE

COMMANDS = ("get", "ls", "cancel", "resume", "delete", "watch", "health", "hold")
DEFAULT_TIMEOUT_S = 5.0
# With several endpoints: room for a takeover (the default 5 s leader lease, then loading).
FAILOVER_TIMEOUT_S = 15.0
_STATUSES = [s.value for s in fencepost.RunStatus]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _revision(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def _endpoints(text: str) -> list[str]:
    try:
        return list(parse_endpoints(text, field="--endpoints"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--endpoints: ")) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def add_parsers(sub: argparse._SubParsersAction, *, default_addr: str) -> None:  # type: ignore[type-arg]
    """Add get, ls, cancel, resume, delete and watch to the ``fencepost`` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--addr",
        help=f"coordinator address (env FENCEPOST_ADDR; default {default_addr})",
    )
    common.add_argument(
        "--endpoints",
        type=_endpoints,
        metavar="ADDR,ADDR...",
        help="instead of --addr: several coordinators, one of which leads; the command "
        "follows the leader (env FENCEPOST_ENDPOINTS)",
    )
    common.set_defaults(default_addr=default_addr)
    common.add_argument(
        "--json", action="store_true", help="machine-readable output (see the module docs)"
    )
    env = os.environ
    common.add_argument("--cacert", default=env.get("FENCEPOST_CACERT") or None,
                        help="verify the server's TLS certificate with this PEM CA (env "
                        "FENCEPOST_CACERT; turns TLS on)")
    common.add_argument("--cert", default=env.get("FENCEPOST_CERT") or None,
                        help="client certificate for mutual TLS (env FENCEPOST_CERT)")
    common.add_argument("--key", default=env.get("FENCEPOST_KEY") or None,
                        help="the client certificate's private key (env FENCEPOST_KEY)")
    common.add_argument("--token", default=env.get("FENCEPOST_TOKEN") or None,
                        help="bearer token (env FENCEPOST_TOKEN; prefer the variable: "
                        "arguments show in the process list)")
    common.add_argument(
        "--timeout",
        type=_positive_float,
        help="seconds to keep retrying an unreachable server, or waiting for a new leader "
        f"(default {DEFAULT_TIMEOUT_S:g}; {FAILOVER_TIMEOUT_S:g} with several --endpoints)",
    )

    p = sub.add_parser("get", parents=[common], help="show one run")
    p.add_argument("run_id", metavar="RUN_ID")

    p = sub.add_parser("ls", parents=[common], help="list runs ordered by run id")
    p.add_argument(
        "--status",
        dest="statuses",
        action="append",
        default=[],
        help=f"only runs in this status (repeatable): {', '.join(_STATUSES)}; with "
        "--engine, the engine store's own statuses",
    )
    p.add_argument("--owner", help="only runs whose lease this owner holds")
    p.add_argument("--limit", type=_positive_int, help="at most this many runs (default all)")
    p.add_argument(
        "--engine", action="store_true", help="list the engine store's runs instead"
    )
    p.add_argument("--agent", help="with --engine: only this agent's runs")

    p = sub.add_parser(
        "health", parents=[common], help="check the server's health (exit 0 when SERVING)"
    )
    p.add_argument("--service", default="", help="a service name (default: the whole server)")
    # Where a server also answers health alone in plaintext (--health-listen,
    # for probes beside mutual TLS), that is where `health` asks by default.
    health_only = os.environ.get("FENCEPOST_HEALTH_LISTEN", "").strip()
    if health_only and not os.environ.get("FENCEPOST_ADDR"):
        from .cli import default_addr as _listen_addr

        p.set_defaults(default_addr=_listen_addr({"FENCEPOST_LISTEN": health_only}))

    from .cli_hold import add_hold_parser

    add_hold_parser(sub, common)

    p = sub.add_parser(
        "cancel",
        parents=[common],
        help="cancel a run (fences its worker); a cancelled run is left as is",
    )
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("-m", "--message", help="message stored in the outcome")

    p = sub.add_parser(
        "resume",
        parents=[common],
        help="make a suspended run (or one whose lease expired) queued again",
    )
    p.add_argument("run_id", metavar="RUN_ID")

    p = sub.add_parser("delete", parents=[common], help="hard-delete a run, fencing any holder")
    p.add_argument("run_id", metavar="RUN_ID")

    p = sub.add_parser(
        "watch",
        parents=[common],
        help="print committed changes as they happen (Ctrl-C to stop)",
    )
    p.add_argument("run_ids", metavar="RUN_ID", nargs="*", help="only these runs (default all)")
    p.add_argument(
        "--from-revision",
        type=_revision,
        default=0,
        help="first replay the retained changes from this revision (default 0: only new ones)",
    )
    p.add_argument("--limit", type=_positive_int, help="stop after this many changes")


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run one operator command; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    if args.command not in COMMANDS:
        print(f"fencepost: unknown command {args.command!r}", file=err)
        return EXIT_USAGE
    problem = _resolve_endpoints(args, os.environ)
    if problem:
        return _usage(args, out, err, problem)
    retry = fencepost.RetryPolicy(
        total_timeout_s=args.timeout, attempt_timeout_s=max(args.timeout, 1.0)
    )
    if args.command == "ls":
        problem = _check_ls(args)
        if problem:
            return _usage(args, out, err, problem)
    if args.command == "watch":
        return _guarded(args, out, err, lambda: _watch(args, retry, out))
    if args.command == "health":
        return _guarded(args, out, err, lambda: _health(args, out))
    if args.command == "hold":
        from .cli_hold import run_hold

        if not getattr(args, "cmd", None):
            return _usage(args, out, err, "give the command to run after --: hold RUN_ID -- CMD")
        return _guarded(args, out, err, lambda: run_hold(args, retry, err))
    doc: Any = None
    text = ""

    def one_shot() -> int:
        nonlocal doc, text
        with fencepost.SyncClient(args.endpoints, retry=retry, **_security(args)) as client:
            doc, text = _dispatch(client, args)
        return EXIT_OK

    code = _guarded(args, out, err, one_shot)
    if code != EXIT_OK:
        return code
    try:
        if args.json:
            out.write(json.dumps(doc, ensure_ascii=False) + "\n")
        else:
            out.write(text)
        out.flush()
    except BrokenPipeError:  # `fencepost ls | head`
        pass
    return EXIT_OK


def _resolve_endpoints(args: argparse.Namespace, env: Any) -> str:
    """Set ``args.endpoints`` (the coordinators to talk to) and ``args.addr``
    (the first of them): --endpoints, else --addr, else FENCEPOST_ENDPOINTS,
    else the default address (FENCEPOST_ADDR...). A usage problem, or ""."""
    if args.endpoints is not None and args.addr is not None:
        return "give --addr or --endpoints, not both"
    if args.endpoints is None:
        listed = env.get("FENCEPOST_ENDPOINTS", "").strip()
        if args.addr is not None:
            args.endpoints = [args.addr]
        elif listed:
            try:
                args.endpoints = list(parse_endpoints(listed, field="FENCEPOST_ENDPOINTS"))
            except ValueError as exc:
                return str(exc)
        else:
            args.endpoints = [args.default_addr]
    args.addr = args.endpoints[0]
    if args.timeout is None:
        args.timeout = FAILOVER_TIMEOUT_S if len(args.endpoints) > 1 else DEFAULT_TIMEOUT_S
    return ""


def _where(args: argparse.Namespace) -> str:
    return ", ".join(getattr(args, "endpoints", None) or [args.addr])


def _security(args: argparse.Namespace) -> dict[str, Any]:
    """``tls=`` and ``token=`` for the client, from the flags (or environment)."""
    tls = None
    if args.cacert or args.cert or args.key:
        tls = fencepost.TLS(ca=args.cacert, cert=args.cert, key=args.key)
    return {"tls": tls, "token": args.token}


def _guarded(args: argparse.Namespace, out: TextIO, err: TextIO, body: Any) -> int:
    """Run ``body()``; map the SDK's errors to the exit-code table (errors on
    stderr, or as JSON on stdout with ``--json``)."""
    if args.json:
        err = out
    try:
        return int(body())
    except ValueError as exc:  # --cert without --key, a token in plaintext...
        err.write(f"fencepost: {exc}\n")
        return EXIT_USAGE
    except UnavailableError as exc:
        if isinstance(exc, OutcomeUnknownError):
            msg = (
                f"no answer from {_where(args)}; the {args.command} may or may not have been "
                f"applied ({exc.message})"
            )
        else:
            msg = f"cannot reach the server at {_where(args)} ({exc.message})"
        _error(err, args.json, exc.code, msg, exc)
        return EXIT_UNREACHABLE
    except FencepostError as exc:
        _error(err, args.json, exc.code, exc.message, exc)
        return EXIT_REFUSED


def _watch(args: argparse.Namespace, retry: fencepost.RetryPolicy, out: TextIO) -> int:
    """Print changes until --limit, Ctrl-C (exit 0 either way) or an error.

    Runs the async client under ``asyncio.run`` and owns Ctrl-C itself (see
    ``_CtrlC``): the first one cancels the watch task, and cancellation
    unwinds the stream (its call cancelled) and the client (its channel
    closed) on the loop (a KeyboardInterrupt raised at an arbitrary point of a
    blocking call could leave the SyncClient's private loop waiting)."""
    ctrl_c = _CtrlC()

    async def watch() -> None:
        ctrl_c.task = asyncio.current_task()
        if ctrl_c.seen:
            return  # Ctrl-C before the loop ran
        printed = 0
        async with fencepost.Client(args.endpoints, retry=retry, **_security(args)) as client:
            # aclosing: the stream's call is cancelled here, before the channel
            # closes, not by the generator's finalizer at some later point
            events = client.watch(args.run_ids, from_revision=args.from_revision)
            async with contextlib.aclosing(events):
                async for ev in events:
                    if args.json:
                        out.write(json.dumps(ev.to_dict(), ensure_ascii=False) + "\n")
                    else:
                        out.write(_event_text(ev))
                    out.flush()
                    printed += 1
                    if args.limit is not None and printed >= args.limit:
                        return

    owned = ctrl_c.install()
    try:
        asyncio.run(watch())
    except asyncio.CancelledError:
        if not ctrl_c.seen:
            raise
    except KeyboardInterrupt:
        pass  # Ctrl-C where SIGINT is not ours to handle (not the main thread...)
    except BrokenPipeError:  # `fencepost watch | head`
        pass
    finally:
        if owned and not ctrl_c.seen:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return EXIT_OK


class _CtrlC:
    """SIGINT for ``watch``: the first one cancels the watch task and turns
    SIGINT to "ignore" for the rest of the process.

    Ignoring the next ones is the point: the unwinding is bounded (a cancelled
    call, a closed channel) and the process is on its way out, but a user's
    second Ctrl-C (asyncio.run's own handler raises KeyboardInterrupt on it)
    landed at an arbitrary point of that unwinding, of asyncio.run's teardown
    or of interpreter exit, where Python has put SIGINT back to its default
    action: the process was killed by the signal (no exit 0), printed
    tracebacks, or hung. An ignored SIGINT stays ignored through interpreter
    exit. Installed only where asyncio.run would install its own handler
    (the main thread, Python's default handler in place): a SIGINT ignored
    from the start (a shell's background job) stays ignored."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.seen = False

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        signal.signal(signal.SIGINT, self._on_sigint)
        return True

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.seen = True
        task = self.task
        if task is None:
            return  # watch() sees ``seen`` when it starts
        if not task.done() and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(task.cancel)


def _event_text(ev: WatchEvent) -> str:
    if ev.record is None:
        return f"{ev.revision} {ev.kind.value} {ev.run_id}\n"
    r = ev.record
    owner = r.lease.owner if r.lease is not None else "-"
    return (
        f"{ev.revision} {ev.kind.value} {ev.run_id} {r.status.value} token={r.fencing_token} "
        f"attempt={r.attempt} owner={owner} version={r.version}\n"
    )


def _dispatch(client: fencepost.SyncClient, args: argparse.Namespace) -> tuple[Any, str]:
    """(JSON document, human text) for one command."""
    match args.command:
        case "get":
            rec = client.get(args.run_id)
            return rec.to_dict(), _record_text(rec)
        case "cancel":
            rec = client.cancel(args.run_id, args.message)
            return rec.to_dict(), _record_text(rec)
        case "resume":
            rec = client.request_resume(args.run_id)
            return rec.to_dict(), _record_text(rec)
        case "delete":
            res = client.delete(args.run_id)
            doc = {
                "run_id": args.run_id,
                "deleted": True,
                "fencing_token": res.fencing_token,
                "revision": res.revision,
            }
            text = (
                f"deleted {args.run_id} (last fencing token {res.fencing_token}, "
                f"revision {res.revision})\n"
            )
            return doc, text
        case "ls" if args.engine:
            runs = client.store.list_runs(
                agent=args.agent, statuses=args.statuses or None, limit=args.limit
            ).runs
            return [_engine_doc(r) for r in runs], _engine_table(runs)
        case _:  # ls
            records = _take(
                client.list(
                    statuses=args.statuses, owner=args.owner, page_size=min(args.limit or 100, 1000)
                ),
                args.limit,
            )
            return [r.to_dict() for r in records], _table(records)


def _take(records: Iterable[RunRecord], limit: int | None) -> list[RunRecord]:
    out: list[RunRecord] = []
    if limit is not None and limit < 1:
        return out
    for rec in records:
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break  # before the iterator fetches another page
    return out


def _error(err: TextIO, as_json: bool, code: str, message: str, exc: FencepostError) -> None:
    if as_json:
        body: dict[str, Any] = {"code": code, "message": message}
        if exc.field is not None:
            body["field"] = exc.field
        if exc.record is not None:
            body["run"] = exc.record.to_dict()
        err.write(json.dumps({"error": body}, ensure_ascii=False) + "\n")
    else:
        err.write(f"fencepost: {code}: {message}\n")
    err.flush()


def _flatten(doc: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, value in doc.items():
        name = prefix + key
        if isinstance(value, dict):
            rows += _flatten(value, name + ".")
        elif isinstance(value, list):
            rows.append((name, ", ".join(map(str, value)) or "-"))
        else:
            rows.append((name, str(value)))
    return rows


def _record_text(rec: RunRecord) -> str:
    """Key/value lines, nested fields as dotted keys (lease.owner ...); the
    lease's state (time left, EXPIRED, LOCK-DELAY) as ``lease.state``."""
    rows = _flatten(rec.to_dict())
    if rec.lease is not None:
        rows.append(("lease.state", lease_state(rec, datetime.now(UTC))))
    width = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in rows)


_COLUMNS = ("RUN_ID", "STATUS", "TOKEN", "ATTEMPT", "OWNER", "LEASE", "UPDATED")
_ENGINE_COLUMNS = ("ID", "AGENT", "STATUS", "CLAIMED_BY", "CLAIM", "CREATED", "UPDATED")


def _table(records: list[RunRecord], now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for r in records:
        rows.append(
            (
                r.run_id,
                r.status.value,
                str(r.fencing_token),
                str(r.attempt),
                r.lease.owner if r.lease is not None else "-",
                lease_state(r, now),
                local_time(r.updated_at),
            )
        )
    return _columns(rows)


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        for row in rows
    )


def lease_state(rec: RunRecord, now: datetime) -> str:
    """``12s left``; past its expiry ``LOCK-DELAY 4s left`` while another owner
    must still wait, then ``EXPIRED 3m10s ago``; ``-`` without a lease."""
    lease = rec.lease
    if lease is None:
        return "-"
    left = (lease.expires_at - now).total_seconds()
    if left > 0:
        return f"{duration(left)} left"
    delay_left = left + lease.lock_delay_ms / 1000
    if delay_left > 0:
        return f"LOCK-DELAY {duration(delay_left)} left"
    return f"EXPIRED {duration(-left)} ago"


def duration(seconds: float) -> str:
    """850ms, 12s, 3m10s, 2h05m, 3d04h."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def local_time(t: datetime) -> str:
    """In the machine's time zone, to the second: ``2026-12-01 10:21:05``."""
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _engine_doc(run: Any) -> dict[str, Any]:
    claim = run.claim
    return {
        "id": run.id,
        "agent": run.agent,
        "status": run.status,
        "concurrency_key": run.concurrency_key,
        "claim": None
        if claim is None
        else {"owner": claim.owner, "expires_at": format_time(claim.expires_at)},
        "created_at": format_time(run.created_at),
        "updated_at": format_time(run.updated_at),
    }


def _engine_table(runs: list[Any], now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    rows: list[tuple[str, ...]] = [_ENGINE_COLUMNS]
    for r in runs:
        claim = "-"
        if r.claim is not None:
            left = (r.claim.expires_at - now).total_seconds()
            claim = f"{duration(left)} left" if left > 0 else f"EXPIRED {duration(-left)} ago"
        rows.append(
            (
                r.id,
                r.agent,
                r.status,
                r.claim.owner if r.claim is not None else "-",
                claim,
                local_time(r.created_at),
                local_time(r.updated_at),
            )
        )
    return _columns(rows)


def _check_ls(args: argparse.Namespace) -> str:
    if args.engine:
        if args.owner is not None:
            return "--owner does not apply to --engine (engine runs have claims: see CLAIMED_BY)"
        return ""
    if args.agent is not None:
        return "--agent needs --engine"
    bad = [s for s in args.statuses if s not in _STATUSES]
    if bad:
        return f"argument --status: invalid choice: {bad[0]!r} (choose from {', '.join(_STATUSES)})"
    return ""


def _usage(args: argparse.Namespace, out: TextIO, err: TextIO, message: str) -> int:
    if args.json:
        out.write(json.dumps({"error": {"code": "USAGE", "message": message}}) + "\n")
    else:
        err.write(f"fencepost {args.command}: error: {message}\n")
    return EXIT_USAGE


def _health(args: argparse.Namespace, out: TextIO) -> int:
    """One gRPC health check: exit 0 when SERVING, 1 otherwise, 3 unreachable.
    With several endpoints, every one is asked (at the same time) and
    reported: exit 0 when one is SERVING (the leader), 3 when none could be
    reached, 1 otherwise."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service=args.service)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name
    channels = [_health_channel(args, address) for address in args.endpoints]
    try:
        calls = [health_pb2_grpc.HealthStub(ch).Check.future(request, timeout=args.timeout)
                 for ch in channels]
        answers: list[tuple[str, str]] = []
        for address, call in zip(args.endpoints, calls, strict=True):
            try:
                answers.append((address, name(call.result().status)))
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if len(channels) == 1:
                    if code == grpc.StatusCode.NOT_FOUND:
                        msg = f"no such service {args.service!r}"
                        raise FencepostError(msg, code="NOT_FOUND") from None
                    raise UnavailableError(str(exc.details())) from None  # type: ignore[attr-defined]
                unreachable = code in (grpc.StatusCode.UNAVAILABLE,
                                       grpc.StatusCode.DEADLINE_EXCEEDED)
                answers.append((address, "UNREACHABLE" if unreachable else code.name))
    finally:
        for ch in channels:
            ch.close()
    serving = [address for address, status in answers if status == "SERVING"]
    if len(answers) == 1:
        status = answers[0][1]
        doc: dict[str, Any] = {"service": args.service, "status": status}
        text = f"{status}\n"
    else:
        status = "SERVING" if serving else "NOT_SERVING"
        doc = {"service": args.service, "status": status, "serving": serving,
               "endpoints": [{"address": a, "status": st} for a, st in answers]}
        width = max(len(a) for a, _ in answers)
        text = "".join(f"{a:<{width}}  {st}\n" for a, st in answers)
    out.write(json.dumps(doc) + "\n" if args.json else text)
    out.flush()
    if serving:
        return EXIT_OK
    if all(st == "UNREACHABLE" for _, st in answers):
        return EXIT_UNREACHABLE
    return EXIT_REFUSED


def _health_channel(args: argparse.Namespace, address: str) -> Any:
    import grpc

    from fencepost._security import channel_credentials

    sec = _security(args)
    creds = channel_credentials(address, sec["tls"], sec["token"])
    return grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
