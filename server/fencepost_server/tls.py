"""The server's certificate files, one place for both ports: the gRPC port's
credentials and the dashboard's TLS context are built from the same
``--tls-cert``/``--tls-key``/``--client-ca`` and re-read when a file's
modification time or size changes. New handshakes use the renewed files;
established connections keep theirs. A half-written renewal keeps the old ones."""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path
from typing import Any

import grpc

from .auth import Authenticator, Policy, PolicyError
from .config import ConfigError, Settings, check

log = logging.getLogger("fencepost.tls")


class _Files:
    """The three paths and the stamp (mtime, size) they were last read at."""

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.paths = tuple(p for p in (cert, key, client_ca) if p)
        self._stamp = self._stat()

    def _stat(self) -> tuple[tuple[int, int], ...]:
        return tuple((st.st_mtime_ns, st.st_size) for st in map(os.stat, self.paths))

    def _changed(self) -> tuple[tuple[int, int], ...] | None:
        """The new stamp when a file changed, else None (OSError: unreadable)."""
        stamp = self._stat()
        return None if stamp == self._stamp else stamp


class CertificateFiles(_Files):
    """The gRPC port's credentials (grpc's certificate-config fetcher)."""

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        super().__init__(cert, key, client_ca)
        self.config = self._load()  # raises OSError/ValueError on a bad start

    def _load(self) -> Any:
        cert = Path(self.cert).read_bytes()
        key = Path(self.key).read_bytes()
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        for name, data in (("--tls-cert", cert), ("--tls-key", key), ("--client-ca", ca)):
            if data is not None and b"-----BEGIN" not in data:
                raise ValueError(f"{name}: not a PEM file")
        return grpc.ssl_server_certificate_configuration([(key, cert)], ca)

    def fetch(self) -> Any:
        """Called by grpc before each handshake: a new config, or None (keep)."""
        try:
            stamp = self._changed()
            if stamp is None:
                return None
            config = self._load()
        except (OSError, ValueError) as exc:  # half-written renewal: keep the old one
            log.warning("TLS files changed but could not be loaded (%s); keeping the "
                        "previous certificate", exc)
            return None
        self._stamp = stamp
        log.info("TLS certificate files reloaded")
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.config, self.fetch, require_client_authentication=self.client_ca is not None
        )


class ContextFiles(_Files):
    """The dashboard's ``ssl`` context, rebuilt before a handshake when one of
    the files changed (as the gRPC port does)."""

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        super().__init__(cert, key, client_ca)
        self.context = self._build()
        self.context.sni_callback = self._check  # called on every handshake, SNI or not
        self.current = self.context

    def _build(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.client_ca)
        return ctx

    def _check(self, conn: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        try:
            stamp = self._changed()
            if stamp is not None:
                self._stamp = stamp
                self.current = self._build()
                log.info("dashboard TLS certificate files reloaded")
        except (OSError, ssl.SSLError, ValueError) as exc:  # half-written: keep the old one
            log.warning("TLS files changed but could not be loaded for the dashboard (%s); "
                        "keeping the previous certificate", exc)
        if self.current is not ctx:
            conn.context = self.current


def security(s: Settings) -> tuple[Authenticator | None, grpc.ServerCredentials | None]:
    """Check the TLS/identity flags together and build the authenticator and
    the listener's credentials (None: plaintext). Raises ConfigError."""
    check(s)
    policy = None
    if s.authz:
        try:
            policy = Policy.load(s.authz)
        except PolicyError as exc:
            raise ConfigError(str(exc)) from None
    if policy is not None and not s.client_ca and not policy.tokens:
        raise ConfigError(
            "--authz names roles, but callers have no identity: add --client-ca (mutual TLS) "
            "or a [tokens] table"
        )
    credentials = None
    if s.tls_cert:
        try:
            credentials = CertificateFiles(s.tls_cert, s.tls_key, s.client_ca or None)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"TLS files: {exc}") from None
    authn = Authenticator(mtls=bool(s.client_ca), policy=policy, identity_from=s.identity_from)
    if not authn.identities:
        return None, credentials.credentials() if credentials else None
    return authn, credentials.credentials() if credentials else None
