"""Test certificates made on the fly (the ``cryptography`` package): a CA, and
server or client leaves with any SANs and validity, written as PEM files.

Used by the TLS tests, the torture harness's mutual-TLS run and the TLS cost
in ``make bench``; never by the server itself.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM bytes and as files."""

    cert_pem: bytes
    key_pem: bytes
    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class CA:
    """A self-signed certificate authority that issues leaves into ``directory``."""

    def __init__(self, directory: Path, name: str = "fencepost test CA") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._name = subject
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(days=1))
            .not_valid_after(_now() + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        self.cert = self.dir / "ca.pem"
        self.cert.write_bytes(self.cert_pem)

    def issue(
        self,
        name: str,
        *,
        cn: str | None = None,
        dns: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        server: bool = False,
        expired: bool = False,
    ) -> Pair:
        """A leaf signed by this CA, written to ``{name}.pem`` / ``{name}-key.pem``."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else []
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if expired:
            start, end = _now() - dt.timedelta(days=10), _now() - dt.timedelta(days=1)
        else:
            start, end = _now() - dt.timedelta(hours=1), _now() + dt.timedelta(days=7)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(sans), critical=not attrs
            )
        cert_pem = builder.sign(self._key, hashes.SHA256()).public_bytes(
            serialization.Encoding.PEM
        )
        key_pem = _key_pem(key)
        cert_path, key_path = self.dir / f"{name}.pem", self.dir / f"{name}-key.pem"
        cert_path.write_bytes(cert_pem)
        key_path.write_bytes(key_pem)
        return Pair(cert_pem, key_pem, cert_path, key_path)

    def server(self, name: str = "server") -> Pair:
        """A server leaf for 127.0.0.1 and localhost."""
        return self.issue(name, cn="localhost", dns=("localhost",), ips=("127.0.0.1",),
                          server=True)


def torture_certs(directory: Path, names: list[str]) -> CA:
    """A CA, the server's certificate and one client certificate per name (its
    CN: the client's principal) for a mutual-TLS torture run."""
    ca = CA(directory, "fencepost torture CA")
    ca.server()
    for name in names:
        ca.issue(name, cn=name)
    return ca


def client_credentials(directory: str | Path, name: str) -> Any:
    """grpc channel credentials for the client ``name`` from ``directory``."""
    import grpc

    d = Path(directory)
    return grpc.ssl_channel_credentials(
        (d / "ca.pem").read_bytes(), (d / f"{name}-key.pem").read_bytes(),
        (d / f"{name}.pem").read_bytes(),
    )
