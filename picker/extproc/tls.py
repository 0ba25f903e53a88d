"""TLS for the ext_proc port: a self-signed certificate made at start, or tls.crt/tls.key
from a directory, re-read when they change (checked at each new TLS handshake)."""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)


def self_signed_certificate(common_name: str = "picker") -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) valid for a year, as the reference EPP makes when no cert is given."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


class CertificateDirectory:
    """tls.crt and tls.key in a directory (a mounted Secret), reloaded when either changes."""

    def __init__(self, path: str | Path) -> None:
        self.crt = Path(path) / "tls.crt"
        self.key = Path(path) / "tls.key"
        self._stamp = self._current_stamp()

    def _current_stamp(self) -> tuple[float, float, int, int]:
        crt, key = os.stat(self.crt), os.stat(self.key)
        return crt.st_mtime, key.st_mtime, crt.st_ino, key.st_ino

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key.read_bytes(), self.crt.read_bytes())])

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake hook: a new configuration when the files changed, else None."""
        try:
            stamp = self._current_stamp()
            if stamp == self._stamp:
                return None
            config = self.configuration()
        except (OSError, ValueError) as e:
            log.warning("keeping the current certificate: %s", e)
            return None
        self._stamp = stamp
        log.info("reloaded the TLS certificate from %s", self.crt.parent)
        return config


def server_credentials(cert_path: str | None) -> grpc.ServerCredentials:
    """Credentials for the ext_proc server (ALPN h2 is negotiated by gRPC itself)."""
    if cert_path:
        directory = CertificateDirectory(cert_path)
        return grpc.dynamic_ssl_server_credentials(directory.configuration(), directory.fetch)
    key, cert = self_signed_certificate()
    return grpc.ssl_server_credentials([(key, cert)])
