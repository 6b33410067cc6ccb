"""What the ``fencepost`` sub-commands share: the exit codes (the table in
``cli/main.py``), argument types, the default address, TLS and token flags."""

from __future__ import annotations

import argparse
from typing import Any

import fencepost
from fencepost._endpoints import parse_endpoints

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_LOST = 4


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def revision(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def endpoints(text: str) -> list[str]:
    try:
        return list(parse_endpoints(text, field="--endpoints"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--endpoints: ")) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def default_addr(env: Any) -> str:
    """Where the operator commands connect by default: FENCEPOST_ADDR, else the
    server's own FENCEPOST_LISTEN (a wildcard host as loopback: inside a
    container, `fencepost health` follows the configured port), else
    127.0.0.1:50051."""
    if env.get("FENCEPOST_ADDR"):
        return str(env["FENCEPOST_ADDR"])
    listen = env.get("FENCEPOST_LISTEN", "").strip()
    if listen:
        host, _, port = listen.rpartition(":")
        if not host or port.endswith("]"):  # no port given: the default one
            host, port = listen, "50051"
        if host in ("0.0.0.0", "[::]", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{port}"
    return "127.0.0.1:50051"


def security(args: argparse.Namespace) -> dict[str, Any]:
    """``tls=`` and ``token=`` for the client, from the flags (or environment)."""
    tls = None
    if args.cacert or args.cert or args.key:
        tls = fencepost.TLS(ca=args.cacert, cert=args.cert, key=args.key)
    return {"tls": tls, "token": args.token}
