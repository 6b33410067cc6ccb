"""Channel security for the SDK: ``TLS`` (server verification, and a client
certificate for mutual TLS) and bearer tokens, turned into gRPC channel
credentials in one place for the async and the sync client."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

PathOrPem = str | Path | bytes


def _read(value: PathOrPem | None, what: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as exc:
        raise ValueError(f"TLS {what}: cannot read {value}: {exc.strerror}") from None


@dataclass(frozen=True)
class TLS:
    """Connect over TLS. ``ca``: the CA that signed the server's certificate
    (a PEM file path or PEM bytes; None: the system's roots). ``cert`` and
    ``key``: this client's certificate chain and private key, for a server
    that requires mutual TLS (its identity is then this client's principal).
    ``server_name``: the name to verify the server's certificate against when
    it differs from the address's host."""

    ca: PathOrPem | None = None
    cert: PathOrPem | None = None
    key: PathOrPem | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS: cert and key go together")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            _read(self.ca, "ca"), _read(self.key, "key"), _read(self.cert, "cert")
        )


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` (or a bare host) names this machine only."""
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def channel_credentials(
    address: str, tls: TLS | None, token: str | None
) -> grpc.ChannelCredentials | None:
    """The credentials for a channel, or None for a plaintext one. A token
    travels only over TLS, or in plaintext to a loopback address."""
    if token is not None and not token.strip():
        raise ValueError("token must not be empty")
    if tls is None and token is None:
        return None
    if tls is not None:
        creds = tls.credentials()
    elif is_loopback(address):
        creds = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    else:
        raise ValueError(
            f"a bearer token is sent only over TLS or to a loopback address, not in "
            f"plaintext to {address}: pass tls=fencepost.TLS(...)"
        )
    if token is not None:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(token.strip())
        )
    return creds


# Every channel the SDK opens starts from these; the caller's options win.
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    # Reconnect quickly after a coordinator restart, so retries (bounded at
    # ~10 s by default) land on the new process.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # While calls are open, ping the coordinator every 2 s and drop the
    # connection when a ping goes unanswered for 2 s: a frozen process
    # (SIGSTOP, a VM paused) or a machine gone without a word keeps its TCP
    # connection open, and its calls would otherwise wait for their deadline.
    # Dropped, they fail UNAVAILABLE and are retried (same request id) on the
    # endpoint that leads. The server allows pings this often.
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.http2.ping_timeout_ms", 2_000),  # what gRPC 1.6x+ waits for the ack by
    ("grpc.http2.max_pings_without_data", 0),
)


def channel_options(
    tls: TLS | None, options: Iterable[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    """The defaults, then the caller's ``options``, then the TLS name override."""
    merged = dict(DEFAULT_CHANNEL_OPTIONS)
    merged.update(dict(options))
    if tls is not None and tls.server_name:
        merged["grpc.ssl_target_name_override"] = tls.server_name
    return list(merged.items())


def aio_channel(
    address: str,
    *,
    tls: TLS | None,
    token: str | None,
    options: Iterable[tuple[str, Any]],
    interceptors: Any = None,
) -> grpc.aio.Channel:
    creds = channel_credentials(address, tls, token)
    opts = channel_options(tls, options)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, options=opts, interceptors=interceptors)


def sync_channel(
    address: str, *, tls: TLS | None, token: str | None, options: Iterable[tuple[str, Any]]
) -> grpc.Channel:
    creds = channel_credentials(address, tls, token)
    opts = channel_options(tls, options)
    if creds is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, creds, options=opts)
