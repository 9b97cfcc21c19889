"""A throwaway CA, server and client certificates made at test time (no key is committed)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: trusting it must fail


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    ca: bool,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), True
        )
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_pki(directory: Path) -> Pki:
    """CA -> server cert (localhost, 127.0.0.1) and client cert, as PEM files."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("refitd test CA", ca_key, _name("refitd test CA"), ca_key, ca=True)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _cert("stranger CA", other_key, _name("stranger CA"), other_key, ca=True)
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv = _cert(
        "localhost",
        srv_key,
        ca.subject,
        ca_key,
        ca=False,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    cli_key = ec.generate_private_key(ec.SECP256R1())
    cli = _cert("refitd-agent", cli_key, ca.subject, ca_key, ca=False)
    p = Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        other_ca=directory / "other-ca.pem",
    )
    p.ca.write_bytes(_pem(ca))
    p.other_ca.write_bytes(_pem(other))
    p.server_cert.write_bytes(_pem(srv))
    p.client_cert.write_bytes(_pem(cli))
    _write_key(srv_key, p.server_key)
    _write_key(cli_key, p.client_key)
    return p
