"""Operator sub-commands of the ``fencepost`` CLI, over the SDK's SyncClient.

    fencepost get RUN_ID
    fencepost ls [--status S]... [--owner O] [--limit N]
    fencepost cancel RUN_ID [-m MESSAGE]
    fencepost resume RUN_ID
    fencepost delete RUN_ID
    fencepost watch [RUN_ID ...] [--from-revision N | --cursor-file PATH] [--limit N]
    fencepost ls --engine [--status S]... [--agent A] [--limit N]
    fencepost health [--service NAME]
    fencepost hold RUN_ID [--ttl TTL] [--wait] [--release] [--grace S] -- CMD ARGS...

Each takes ``--addr`` (env FENCEPOST_ADDR; see cli.common.default_addr) or
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
``--cursor-file PATH`` watches by shards (docs/SPEC.md §6.2), as it must
where coordinators lead shards apart: it resumes from the cursor saved in
PATH (from now when PATH does not exist) and saves the cursor there after
each change printed, so a watch stopped at any point resumes after the last
change it printed.

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
                          {"revision", "kind": "put"|"delete", "run_id", "record"?,
                          "shard"? (a watch by shards)}
                          (``record`` as for get; absent for a delete)

Human ``watch`` lines: ``REVISION put RUN_ID STATUS token=N attempt=N
owner=O version=N`` or ``REVISION delete RUN_ID``.

Errors go to stderr as ``fencepost: CODE: message``; with ``--json`` they go
to stdout instead, as one JSON object ``{"error": {"code", "message",
"field"?, "run"?}}`` (a usage error has the code ``USAGE``). Exit codes are
the table in ``cli/main.py``: 0 ok, 1 refused by the server (the code is printed),
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
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import fencepost
from fencepost import (
    FencepostError,
    OutcomeUnknownError,
    RunRecord,
    UnavailableError,
)
from fencepost._endpoints import parse_endpoints

from . import format as fmt
from .common import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    endpoints,
    positive_float,
    positive_int,
    revision,
    security,
)
from .common import default_addr as address_from_env
from .hold import add_hold_parser, run_hold

COMMANDS = ("get", "ls", "cancel", "resume", "delete", "watch", "health", "hold", "shards")
DEFAULT_TIMEOUT_S = 5.0
# With several endpoints: room for a takeover (the default 5 s leader lease, then loading).
FAILOVER_TIMEOUT_S = 15.0
_STATUSES = [s.value for s in fencepost.RunStatus]


def add_parsers(sub: argparse._SubParsersAction, *, default_addr: str) -> None:  # type: ignore[type-arg]
    """Add the operator commands (get, ls, shards, cancel, resume, delete,
    watch, health, hold) to the ``fencepost`` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--addr",
        help=f"coordinator address (env FENCEPOST_ADDR; default {default_addr})",
    )
    common.add_argument(
        "--endpoints",
        type=endpoints,
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
        type=positive_float,
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
    p.add_argument("--limit", type=positive_int, help="at most this many runs (default all)")
    p.add_argument(
        "--engine", action="store_true", help="list the engine store's runs instead"
    )
    p.add_argument("--agent", help="with --engine: only this agent's runs")

    p = sub.add_parser("shards", parents=[common],
                       help="the shard map: each shard's owner, address, epoch, runs and "
                       "leases; `shards move SHARD --to ADDR` moves one (--lead-shards)")
    p.add_argument("action", nargs="?", choices=["move"], help="move: move SHARD to --to")
    p.add_argument("shard", nargs="?", type=int, metavar="SHARD")
    p.add_argument("--to", metavar="ADDR", help="with move: the address of the coordinator "
                   "to lead SHARD (as `fencepost shards` shows it)")

    p = sub.add_parser(
        "health", parents=[common], help="check the server's health (exit 0 when SERVING)"
    )
    p.add_argument("--service", default="", help="a service name (default: the whole server)")
    # Where a server also answers health alone in plaintext (--health-listen,
    # for probes beside mutual TLS), that is where `health` asks by default.
    health_only = os.environ.get("FENCEPOST_HEALTH_LISTEN", "").strip()
    if health_only and not os.environ.get("FENCEPOST_ADDR"):
        p.set_defaults(default_addr=address_from_env({"FENCEPOST_LISTEN": health_only}))

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
        type=revision,
        default=0,
        help="first replay the retained changes from this revision (default 0: only new ones)",
    )
    p.add_argument("--limit", type=positive_int, help="stop after this many changes")
    p.add_argument(
        "--cursor-file",
        type=Path,
        metavar="PATH",
        help="watch by shards: resume from the cursor saved in PATH (if it exists) and save "
        "it there after every change printed",
    )


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run one operator command; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    if args.command not in COMMANDS:
        print(f"fencepost: unknown command {args.command!r}", file=err)
        return EXIT_USAGE
    problem = _resolve_endpoints(args, os.environ)
    if args.command == "shards" and (args.action or args.shard is not None or args.to):
        if args.action != "move" or args.shard is None or not args.to:
            problem = "shards: `fencepost shards` shows the map; `fencepost shards move SHARD " \
                      "--to ADDR` moves one shard"
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
        if not getattr(args, "cmd", None):
            return _usage(args, out, err, "give the command to run after --: hold RUN_ID -- CMD")
        return _guarded(args, out, err, lambda: run_hold(args, retry, err))
    doc: Any = None
    text = ""

    def one_shot() -> int:
        nonlocal doc, text
        with fencepost.SyncClient(args.endpoints, retry=retry, **security(args)) as client:
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


def _cursor(path: Path | None) -> fencepost.WatchCursor | None:
    """The cursor saved at ``path`` (a new one when there is none yet);
    ``ValueError`` naming the file when it holds something else."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return fencepost.WatchCursor()
    try:
        return fencepost.WatchCursor.decode(text)
    except ValueError as bad:
        raise ValueError(f"--cursor-file {path}: {bad}") from None


def _save_cursor(path: Path, cursor: fencepost.WatchCursor) -> None:
    """Replace the file whole: a watch stopped mid-write leaves the last cursor."""
    part = path.with_name(path.name + ".part")
    part.write_text(cursor.encode() + "\n", encoding="utf-8")
    os.replace(part, path)


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
        cursor = _cursor(args.cursor_file)
        async with fencepost.Client(args.endpoints, retry=retry, **security(args)) as client:
            # aclosing: the stream's call is cancelled here, before the channel
            # closes, not by the generator's finalizer at some later point
            events = client.watch(args.run_ids, from_revision=args.from_revision, cursor=cursor)
            async with contextlib.aclosing(events):
                async for ev in events:
                    if args.json:
                        out.write(json.dumps(ev.to_dict(), ensure_ascii=False) + "\n")
                    else:
                        out.write(fmt.event_text(ev))
                    out.flush()
                    if cursor is not None:
                        _save_cursor(args.cursor_file, cursor)
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


def _dispatch(client: fencepost.SyncClient, args: argparse.Namespace) -> tuple[Any, str]:
    """(JSON document, human text) for one command."""
    match args.command:
        case "get":
            rec = client.get(args.run_id)
            return rec.to_dict(), fmt.record_text(rec)
        case "cancel":
            rec = client.cancel(args.run_id, args.message)
            return rec.to_dict(), fmt.record_text(rec)
        case "resume":
            rec = client.request_resume(args.run_id)
            return rec.to_dict(), fmt.record_text(rec)
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
        case "shards" if args.action == "move":
            return _move_shard(client, args)
        case "shards":
            shard_map = client.shards()
            doc = {"shard_count": shard_map.shard_count, "revision": shard_map.revision,
                   "shards": [fmt.shard_doc(sh) for sh in shard_map.shards]}
            return doc, fmt.shard_table(shard_map.shards)
        case "ls" if args.engine:
            runs = client.store.list_runs(
                agent=args.agent, statuses=args.statuses or None, limit=args.limit
            ).runs
            return [fmt.engine_doc(r) for r in runs], fmt.engine_table(runs)
        case _:  # ls
            records = _take(
                client.list(
                    statuses=args.statuses, owner=args.owner, page_size=min(args.limit or 100, 1000)
                ),
                args.limit,
            )
            return [r.to_dict() for r in records], fmt.table(records)


def _move_shard(client: fencepost.SyncClient, args: argparse.Namespace) -> tuple[Any, str]:
    """Pin the shard to ``--to``, then wait until the map shows it led there."""
    before = client.move_shard(args.shard, args.to)
    started = time.monotonic()
    deadline = started + (args.timeout or FAILOVER_TIMEOUT_S)
    while True:
        now = client.shards().shards[args.shard]
        if now.address == args.to and now.owner:
            break
        if time.monotonic() > deadline:
            raise fencepost.UnavailableError(
                f"shard {args.shard} is not led at {args.to} yet (led at {now.address or '?'}); "
                "the move stays asked for: see `fencepost shards`")
        time.sleep(0.05)
    took = time.monotonic() - started
    doc = {"shard": args.shard, "from": before.address, "to": args.to,
           "epoch": now.epoch, "seconds": round(took, 3)}
    return doc, (f"shard {args.shard} moved from {before.address or 'nobody'} to {args.to} "
                 f"(epoch {now.epoch}) in {took:.2f} s\n")


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

    sec = security(args)
    creds = channel_credentials(address, sec["tls"], sec["token"])
    return grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
