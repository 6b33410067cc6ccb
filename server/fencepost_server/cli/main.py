"""The ``fencepost`` command.

    fencepost serve [--listen ADDR] [--db PATH|postgresql://...] [--durability full|normal] ...
    fencepost get RUN_ID            fencepost ls [--status S]... [--owner O]
    fencepost shards                (each shard's owner, address, epoch, runs, leases)
    fencepost cancel RUN_ID [-m M]  fencepost resume RUN_ID   fencepost delete RUN_ID
    fencepost hold RUN_ID [--ttl MS] [--wait] [--release] -- CMD ARGS...
    fencepost health                fencepost --version

Every operator command takes ``--addr`` (env FENCEPOST_ADDR, else the port
of FENCEPOST_LISTEN on loopback, else 127.0.0.1:50051) and ``--json`` for
machine-readable output; ``--endpoints A,B`` (env FENCEPOST_ENDPOINTS) names
several coordinators instead, and the command follows the leader. Flags are
never abbreviated.

Exit codes (one table):
    0  ok
    1  the server refused the request (the error code is printed)
    2  usage error
    3  the server could not be reached
    4  ``hold``: the lease was lost while CMD ran (CMD was stopped)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from ..storage.sqlite import Durability
from . import ops
from .common import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, default_addr

if TYPE_CHECKING:
    from ..config import Settings

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class UsageError(Exception):
    """A command line argparse refused; raised instead of argparse's exit so
    ``main`` prints the right sub-command's usage (or JSON with ``--json``)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    """No abbreviations (``--js`` is not ``--json``); errors raise UsageError."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)} (got {text!r})")
    return text.upper()


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # a short usage line: the flags are many; --help lists them
    p = sub.add_parser("serve", help="run the coordinator",
                       usage="fencepost serve [--listen ADDR] [--db FILE] [options] "
                       "(fencepost serve --help lists them)")
    p.add_argument(
        "--listen", help="address to listen on (env FENCEPOST_LISTEN; default 127.0.0.1:50051)"
    )
    p.add_argument(
        "--db",
        dest="db_path",
        help="SQLite database file, or a postgresql://USER@HOST:PORT/DBNAME URL for "
        "coordinators sharing one PostgreSQL database, one leading at a time "
        "(env FENCEPOST_DB; default ./fencepost.db)",
    )
    p.add_argument(
        "--durability",
        choices=[d.value for d in Durability],
        help="full (default): acknowledged writes survive power loss; normal: they "
        "survive a process crash but the last ones may be lost on power loss "
        "(env FENCEPOST_DURABILITY)",
    )
    p.add_argument(
        "--shards",
        type=int,
        metavar="N",
        help="the database's shard count, 1-4096, fixed when the database is created: a "
        "later start with another count is refused (env FENCEPOST_SHARDS; default: the "
        "stored count, 64 for a new database)",
    )
    p.add_argument(
        "--log-level",
        type=_log_level,
        help="DEBUG, INFO, WARNING, ERROR (env FENCEPOST_LOG_LEVEL)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="shorthand for --metrics-listen 127.0.0.1:PORT (env FENCEPOST_METRICS_PORT)",
    )
    p.add_argument(
        "--http-listen",
        help="address of the web dashboard, its JSON API and /metrics (env "
        "FENCEPOST_HTTP_LISTEN; default 127.0.0.1:8233; 'off' turns it off)",
    )
    p.add_argument(
        "--metrics-listen",
        help="also serve only /metrics and /healthz on this address, for scraping "
        "from outside without exposing the dashboard (env FENCEPOST_METRICS_LISTEN; "
        "default off)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        help="largest request accepted (env FENCEPOST_MAX_MESSAGE_BYTES; 4 MiB)",
    )
    p.add_argument(
        "--commit-delay-ms",
        type=float,
        help="under concurrent load, hold a batch open up to this long so more writes "
        "share one commit and fsync (env FENCEPOST_COMMIT_DELAY_MS; default 8; 0 off)",
    )
    p.add_argument(
        "--shutdown-grace",
        dest="shutdown_grace_s",
        type=float,
        help="seconds in-flight calls get on SIGTERM (default 5)",
    )
    _security_flags(p)
    _web_flags(p)
    _leadership_flags(p)
    p.add_argument(
        "--retain-terminal",
        dest="retain_terminal",
        metavar="DURATION",
        help="delete runs finished longer ago than this (e.g. 90s, 30m, 12h, 7d; their "
        "tombstones keep the token guarantee), through the ordinary write path "
        "(env FENCEPOST_RETAIN_TERMINAL; default off: finished runs are kept)",
    )
    p.add_argument(
        "--test-hooks",
        action="store_true",
        default=None,
        help="TEST ONLY, never in production: an offset clock and the TestHooks service "
        "that jumps it forward, for the torture harness (env FENCEPOST_TEST_HOOKS=1)",
    )
    p.add_argument(
        "--fault",
        choices=["ack-before-commit", "fence-ignores-owner", "no-epoch-check",
                 "watch-drops-change"],
        help="TEST ONLY: a deliberately broken build proving the torture checkers can "
        "fail; honoured only with --test-hooks (env FENCEPOST_FAULT)",
    )


def _web_flags(p: argparse.ArgumentParser) -> None:
    """The dashboard port's Host allow-list and event-stream bounds (docs/SECURITY.md)."""
    g = p.add_argument_group("the dashboard port (docs/SECURITY.md)")
    g.add_argument("--http-allowed-hosts", action="append", metavar="HOST[:PORT]",
                   help="a Host the dashboard answers besides its listen address and "
                   "localhost/127.0.0.1/[::1]; repeatable (a name without a port: any port). "
                   "Others get 421 (env FENCEPOST_HTTP_ALLOWED_HOSTS, comma-separated)")
    g.add_argument("--http-max-event-streams", type=int, metavar="N",
                   help="live-update streams open at once, every client together; more get "
                   "429 (env FENCEPOST_HTTP_MAX_EVENT_STREAMS; default 1024)")
    g.add_argument("--http-event-streams-per-client", type=int, metavar="N",
                   help="live-update streams per remote address, and per principal with "
                   "identities on; more get 429 (env FENCEPOST_HTTP_EVENT_STREAMS_PER_CLIENT; "
                   "default 32)")
    g.add_argument("--http-event-queue", type=int, metavar="N",
                   help="changed runs a live-update stream may have unsent before it is "
                   "dropped (env FENCEPOST_HTTP_EVENT_QUEUE; default 10000)")


def _leadership_flags(p: argparse.ArgumentParser) -> None:
    """Several coordinators on one PostgreSQL database (docs/OPERATIONS.md)."""
    g = p.add_argument_group("coordinators on PostgreSQL (docs/OPERATIONS.md)")
    g.add_argument("--advertise", metavar="ADDR", help="the address clients reach this "
                   "coordinator at, told to them by the standbys (env FENCEPOST_ADVERTISE; "
                   "default the listen address)")
    g.add_argument("--lead-shards", action="store_true", default=None,
                   help="lead only the shards assigned to this coordinator, every coordinator "
                   "of the database started so: they all lead at once (env "
                   "FENCEPOST_LEAD_SHARDS; PostgreSQL only; the leader lease and renewal "
                   "below are each shard's)")
    g.add_argument("--leader-lease", metavar="DURATION", help="a leader that has not renewed "
                   "for this long is replaced (env FENCEPOST_LEADER_LEASE; default 5s)")
    g.add_argument("--leader-renew", metavar="DURATION", help="how often the leader renews "
                   "(env FENCEPOST_LEADER_RENEW; default 1s)")
    g.add_argument("--max-clock-skew", metavar="DURATION", help="refuse to lead while this "
                   "coordinator's clock differs from the database's by more "
                   "(env FENCEPOST_MAX_CLOCK_SKEW; default 500ms; 0: no check)")


def _security_flags(p: argparse.ArgumentParser) -> None:
    """TLS, identity and per-connection limits (docs/SECURITY.md)."""
    g = p.add_argument_group("security and limits (docs/SECURITY.md)")
    g.add_argument("--tls-cert", help="serve TLS only, with this PEM certificate chain "
                   "(env FENCEPOST_TLS_CERT); renewed files are picked up by new connections")
    g.add_argument("--tls-key", help="the certificate's PEM private key (env FENCEPOST_TLS_KEY)")
    g.add_argument("--client-ca", help="mutual TLS: every connection needs a client "
                   "certificate signed by this PEM CA; its identity becomes the caller's "
                   "principal, and lease owners are bound to it (env FENCEPOST_CLIENT_CA)")
    g.add_argument("--authz", help="TOML policy file: [roles] and [tokens] (env FENCEPOST_AUTHZ)")
    g.add_argument("--identity-from", choices=["auto", "spiffe", "dns", "cn"],
                   help="which certificate field names the principal; auto (default): the "
                   "SPIFFE id, else the first DNS SAN, else the CN (env FENCEPOST_IDENTITY_FROM)")
    g.add_argument("--allow-insecure", action="store_true", default=None,
                   help="allow plaintext on a non-loopback address: only on a network you "
                   "trust completely (env FENCEPOST_ALLOW_INSECURE=1)")
    g.add_argument("--health-listen", help="also serve gRPC health alone, in plaintext, on this "
                   "address (for probes that cannot do TLS; env FENCEPOST_HEALTH_LISTEN)")
    g.add_argument("--max-concurrent-streams", type=int,
                   help="concurrent calls per connection (env FENCEPOST_MAX_CONCURRENT_STREAMS;"
                   " default 1024)")
    g.add_argument("--max-tracked-per-stream", type=int,
                   help="leases one KeepAlive stream may track (env "
                   "FENCEPOST_MAX_TRACKED_PER_STREAM; default 100000)")
    g.add_argument("--max-inflight-per-stream", type=int,
                   help="unanswered commands per Execute stream before the server stops "
                   "reading it (env FENCEPOST_MAX_INFLIGHT_PER_STREAM; default 4096)")
    g.add_argument("--max-tracked-per-connection", type=int,
                   help="leases all KeepAlive streams of one connection may track (env "
                   "FENCEPOST_MAX_TRACKED_PER_CONNECTION; default 100000)")
    g.add_argument("--max-tracked-per-principal", type=int,
                   help="with identities on: leases all streams of one principal may track "
                   "(env FENCEPOST_MAX_TRACKED_PER_PRINCIPAL; default 1000000)")
    g.add_argument("--max-queued-per-stream", type=int, dest="stream_queue_limit",
                   metavar="MAX_QUEUED_PER_STREAM",
                   help="KeepAlive messages, WatchRuns events or Execute results queued for a "
                   "client that does not read before its stream is dropped with "
                   "STREAM_TOO_SLOW (env FENCEPOST_MAX_QUEUED_PER_STREAM; default 65536)")
    g.add_argument("--max-queued-per-connection", type=int,
                   help="the same over all streams of one connection; past it its slowest "
                   "stream is dropped (env FENCEPOST_MAX_QUEUED_PER_CONNECTION; default 131072)")
    g.add_argument("--max-queued-per-principal", type=int,
                   help="with identities on: the same over all streams of one principal "
                   "(env FENCEPOST_MAX_QUEUED_PER_PRINCIPAL; default 262144)")


def _run_serve(args: argparse.Namespace) -> int:
    # here, not at the top: the operator commands start without loading the server
    from ..app import serve
    from ..config import ConfigError, Settings, SettingsError
    from ..tls import security

    try:
        settings = _serve_settings(args, Settings)
    except SettingsError as exc:
        print(f"fencepost serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        security(settings)
    except ConfigError as exc:
        print(f"fencepost serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        asyncio.run(serve(settings))
    except RuntimeError as exc:  # refused database, port in use...
        logging.getLogger("fencepost").error("%s", exc)
        return EXIT_REFUSED
    return EXIT_OK


def _serve_settings(args: argparse.Namespace, settings_cls: type[Settings]) -> Settings:
    return settings_cls.from_env(
        listen=args.listen,
        db_path=args.db_path,
        durability=Durability(args.durability) if args.durability else None,
        shards=args.shards,
        log_level=args.log_level,
        metrics_port=args.metrics_port,
        max_message_bytes=args.max_message_bytes,
        shutdown_grace_s=args.shutdown_grace_s,
        commit_delay_ms=args.commit_delay_ms,
        retain_terminal=args.retain_terminal,
        test_hooks=args.test_hooks,
        fault=args.fault,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        client_ca=args.client_ca,
        authz=args.authz,
        identity_from=args.identity_from,
        allow_insecure=args.allow_insecure,
        lead_shards=args.lead_shards,
        health_listen=args.health_listen,
        max_concurrent_streams=args.max_concurrent_streams,
        max_tracked_per_stream=args.max_tracked_per_stream,
        max_inflight_per_stream=args.max_inflight_per_stream,
        stream_queue_limit=args.stream_queue_limit,
        max_queued_per_connection=args.max_queued_per_connection,
        max_queued_per_principal=args.max_queued_per_principal,
        max_tracked_per_connection=args.max_tracked_per_connection,
        max_tracked_per_principal=args.max_tracked_per_principal,
        advertise=args.advertise,
        leader_lease=args.leader_lease,
        leader_renew=args.leader_renew,
        max_clock_skew=args.max_clock_skew,
        **_web_overrides(args),
    )


def _web_overrides(args: argparse.Namespace) -> dict[str, Any]:
    hosts = args.http_allowed_hosts
    return {"http_listen": args.http_listen, "metrics_listen": args.metrics_listen,
            "http_allowed_hosts": tuple(hosts) if hosts else None,
            "http_max_event_streams": args.http_max_event_streams,
            "http_event_streams_per_client": args.http_event_streams_per_client,
            "http_event_queue": args.http_event_queue}


class _Version(argparse.Action):
    # not argparse's own: it rewraps lines, and the schemas import psycopg only when asked
    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        from .. import version_text

        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fencepost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the release, API and storage schema versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    ops.add_parsers(sub, default_addr=default_addr(os.environ))
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]  # type: ignore[no-any-return]
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse, with unknown flags refused by the sub-command's parser (its usage,
    not the top level's) and ``hold``'s command taken verbatim after ``--``."""
    command: list[str] = []
    if "hold" in argv and "--" in argv and argv.index("hold") < argv.index("--"):
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args, extra = parser.parse_known_args(argv)
    if extra:
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "hold":
        args.cmd = command
    return args


def _usage_error(exc: UsageError, argv: list[str]) -> int:
    if "--json" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        body = {"error": {"code": "USAGE", "message": exc.message}}
        sys.stdout.write(json.dumps(body) + "\n")
        sys.stdout.flush()
    else:
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {exc.message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(parser, argv)
    except UsageError as exc:
        return _usage_error(exc, argv)
    except SystemExit as exc:  # --help, --version
        return int(exc.code or 0) and EXIT_USAGE
    if args.command == "serve":
        return _run_serve(args)
    return ops.run(args)

