"""The ``fencepost`` command.

    fencepost serve [--listen ADDR] [--db PATH] [--durability full|normal] ...
    fencepost get RUN_ID            fencepost ls [--status S]... [--owner O]
    fencepost cancel RUN_ID [-m M]  fencepost resume RUN_ID   fencepost delete RUN_ID

Every operator command takes ``--addr`` (env FENCEPOST_ADDR, default
127.0.0.1:50051) and ``--json`` for machine-readable output.

Exit codes (one table):
    0  ok
    1  the server refused the request (the error code is printed)
    2  usage error
    3  the server could not be reached
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from .storage.sqlite import Durability

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the coordinator")
    p.add_argument(
        "--listen", help="address to listen on (env FENCEPOST_LISTEN; default 127.0.0.1:50051)"
    )
    p.add_argument(
        "--db",
        dest="db_path",
        help="SQLite database file (env FENCEPOST_DB; default ./fencepost.db)",
    )
    p.add_argument(
        "--durability",
        choices=[d.value for d in Durability],
        help="full (default): acknowledged writes survive power loss; normal: they "
        "survive a process crash but the last ones may be lost on power loss "
        "(env FENCEPOST_DURABILITY)",
    )
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (env FENCEPOST_LOG_LEVEL)")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this loopback port (env "
        "FENCEPOST_METRICS_PORT; default off)",
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
        choices=["ack-before-commit", "fence-ignores-owner"],
        help="TEST ONLY: a deliberately broken build proving the torture checkers can "
        "fail; honoured only with --test-hooks (env FENCEPOST_FAULT)",
    )


def _run_serve(args: argparse.Namespace) -> int:
    from .app import Settings, serve

    settings = Settings.from_env(
        listen=args.listen,
        db_path=args.db_path,
        durability=Durability(args.durability) if args.durability else None,
        log_level=args.log_level,
        metrics_port=args.metrics_port,
        max_message_bytes=args.max_message_bytes,
        shutdown_grace_s=args.shutdown_grace_s,
        commit_delay_ms=args.commit_delay_ms,
        retain_terminal=args.retain_terminal,
        test_hooks=args.test_hooks,
        fault=args.fault,
    )
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        asyncio.run(serve(settings))
    except RuntimeError as exc:  # refused database, port in use...
        logging.getLogger("fencepost").error("%s", exc)
        return EXIT_REFUSED
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fencepost", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from . import cli_ops

    cli_ops.add_parsers(sub, default_addr=os.environ.get("FENCEPOST_ADDR", "127.0.0.1:50051"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and EXIT_USAGE
    if args.command == "serve":
        return _run_serve(args)
    from . import cli_ops

    return cli_ops.run(args)


if __name__ == "__main__":
    sys.exit(main())
