"""A local certificate authority for development mutual TLS (`gramserve up --tls-dir DIR`).

Writes, once, into DIR: `ca.crt` (the CA every component trusts), `tls.crt` / `tls.key` (one
certificate for the gateway, the workers and the grammar service, valid for serving and as a
client certificate, naming localhost, 127.0.0.1 and ::1) and `other-ca.crt` / `other.crt` /
`other.key` (a second CA and a certificate from it, which the components must refuse; the
tests use them). The CA's key is kept in `ca.key`. Files already in DIR are reused, so a
restarted system keeps its identity. For development only: production certificates come from
the cluster (cert-manager or the like; see the chart's `tls` values).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID_DAYS = 365


@dataclass(frozen=True)
class DevTls:
    """Paths of the files `ensure_dev_tls` wrote."""

    ca: Path
    cert: Path
    key: Path
    other_ca: Path
    other_cert: Path
    other_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gramserve development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _ca(common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(_name(common_name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
             x509.IPAddress(ipaddress.ip_address("::1"))]
    cert = (x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _write(path: Path, data: bytes, private: bool = False) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ensure_dev_tls(directory: str | os.PathLike) -> DevTls:
    """The development CA and certificates in `directory` (created when missing; reused
    when every file is already there). Private keys are written mode 0600."""
    d = Path(directory)
    files = DevTls(ca=d / "ca.crt", cert=d / "tls.crt", key=d / "tls.key",
                   other_ca=d / "other-ca.crt", other_cert=d / "other.crt",
                   other_key=d / "other.key")
    if all(p.is_file() for p in vars(files).values()) and (d / "ca.key").is_file():
        return files
    d.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    ca_key, ca_cert = _ca("gramserve development CA")
    key, cert = _leaf(ca_key, ca_cert, "gramserve")
    other_ca_key, other_ca_cert = _ca("gramserve untrusted CA")
    other_key, other_cert = _leaf(other_ca_key, other_ca_cert, "gramserve untrusted")
    _write(d / "ca.key", _pem_key(ca_key), private=True)
    _write(files.ca, ca_cert.public_bytes(pem))
    _write(files.key, _pem_key(key), private=True)
    _write(files.cert, cert.public_bytes(pem))
    _write(files.other_ca, other_ca_cert.public_bytes(pem))
    _write(files.other_key, _pem_key(other_key), private=True)
    _write(files.other_cert, other_cert.public_bytes(pem))
    return files
