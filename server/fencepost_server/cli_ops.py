"""Operator sub-commands of the ``fencepost`` CLI, over the SDK's SyncClient.

    fencepost get RUN_ID
    fencepost ls [--status S]... [--owner O] [--limit N]
    fencepost cancel RUN_ID [-m MESSAGE]
    fencepost resume RUN_ID
    fencepost delete RUN_ID
    fencepost watch [RUN_ID ...] [--from-revision N] [--limit N]

Each takes ``--addr`` (env FENCEPOST_ADDR, default 127.0.0.1:50051),
``--timeout`` (seconds to keep retrying an unreachable server, default 5)
and ``--json``; for a server with TLS or tokens (docs/SECURITY.md),
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
``ls``. With ``--json`` (stdout, one document, newline-terminated):

    get, cancel, resume   one JSON object: the record (fencepost.RunRecord.to_dict():
                          status as "running"..., times as ISO 8601 UTC strings)
    ls                    one JSON array of such objects (``[]`` when none)
    delete                {"run_id", "deleted": true, "fencing_token", "revision"}
    watch                 one JSON object per line and change (JSON Lines):
                          {"revision", "kind": "put"|"delete", "run_id", "record"?}
                          (``record`` as for get; absent for a delete)

Human ``watch`` lines: ``REVISION put RUN_ID STATUS token=N attempt=N
owner=O version=N`` or ``REVISION delete RUN_ID``.

Errors go to stderr: ``fencepost: CODE: message`` or, with ``--json``, a JSON
object ``{"error": {"code", "message", "field"?, "run"?}}``. Exit codes are
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

from .cli import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE

COMMANDS = ("get", "ls", "cancel", "resume", "delete", "watch")
DEFAULT_TIMEOUT_S = 5.0
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
        default=default_addr,
        help=f"coordinator address (env FENCEPOST_ADDR; default {default_addr})",
    )
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
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to keep retrying an unreachable server (default {DEFAULT_TIMEOUT_S:g})",
    )

    p = sub.add_parser("get", parents=[common], help="show one run")
    p.add_argument("run_id", metavar="RUN_ID")

    p = sub.add_parser("ls", parents=[common], help="list runs ordered by run id")
    p.add_argument(
        "--status",
        dest="statuses",
        action="append",
        default=[],
        choices=_STATUSES,
        help="only runs in this status (repeatable)",
    )
    p.add_argument("--owner", help="only runs whose lease this owner holds")
    p.add_argument("--limit", type=_positive_int, help="at most this many runs (default all)")

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
    retry = fencepost.RetryPolicy(
        total_timeout_s=args.timeout, attempt_timeout_s=max(args.timeout, 1.0)
    )
    if args.command == "watch":
        return _guarded(args, err, lambda: _watch(args, retry, out))
    doc: Any = None
    text = ""

    def one_shot() -> int:
        nonlocal doc, text
        with fencepost.SyncClient(args.addr, retry=retry, **_security(args)) as client:
            doc, text = _dispatch(client, args)
        return EXIT_OK

    code = _guarded(args, err, one_shot)
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


def _security(args: argparse.Namespace) -> dict[str, Any]:
    """``tls=`` and ``token=`` for the client, from the flags (or environment)."""
    tls = None
    if args.cacert or args.cert or args.key:
        tls = fencepost.TLS(ca=args.cacert, cert=args.cert, key=args.key)
    return {"tls": tls, "token": args.token}


def _guarded(args: argparse.Namespace, err: TextIO, body: Any) -> int:
    """Run ``body()``; map the SDK's errors to the exit-code table."""
    try:
        return int(body())
    except ValueError as exc:  # --cert without --key, a token in plaintext...
        err.write(f"fencepost: {exc}\n")
        return EXIT_USAGE
    except UnavailableError as exc:
        if isinstance(exc, OutcomeUnknownError):
            msg = (
                f"no answer from {args.addr}; the {args.command} may or may not have been "
                f"applied ({exc.message})"
            )
        else:
            msg = f"cannot reach the server at {args.addr} ({exc.message})"
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
        async with fencepost.Client(args.addr, retry=retry, **_security(args)) as client:
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
    """Key/value lines, nested fields as dotted keys (lease.owner ...)."""
    rows = _flatten(rec.to_dict())
    width = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in rows)


_COLUMNS = ("RUN_ID", "STATUS", "TOKEN", "ATTEMPT", "OWNER", "EXPIRES_AT", "UPDATED_AT")


def _table(records: list[RunRecord]) -> str:
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for r in records:
        d = r.to_dict()
        lease = d.get("lease", {})
        rows.append(
            (
                d["run_id"],
                d["status"],
                str(d["fencing_token"]),
                str(d["attempt"]),
                lease.get("owner", "-"),
                lease.get("expires_at", "-"),
                d["updated_at"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        for row in rows
    )
