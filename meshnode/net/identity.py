"""This node's persistent identity: an ECDSA P-256 key and a self-signed certificate.

Theory of operation: the key pair is created once under ``NodePaths.identity`` (files
mode 0600) and reused on every start. The certificate is only a carrier for the public
key in the TLS 1.3 handshake; nobody verifies it against a CA. Trust comes from the
mesh-secret proof (:mod:`meshnode.net.auth`), which is bound to the SHA-256
fingerprints of both certificates, so a man in the middle cannot relay a proof.

The node id is derived from the public key (not the certificate), so re-issuing the
certificate keeps the id.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshnode.errors import MeshnodeError
from meshnode.fsutil import atomic_write

KEY_FILE = "node-key.pem"
CERT_FILE = "node-cert.pem"


class IdentityError(MeshnodeError):
    """The identity files exist but cannot be read."""


def node_id_of(public_key: ec.EllipticCurvePublicKey) -> str:
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()[:16]


def cert_fingerprint(cert: x509.Certificate) -> bytes:
    """SHA-256 of the certificate's DER encoding (32 bytes)."""
    return cert.fingerprint(hashes.SHA256())


def node_id_of_cert(cert: x509.Certificate) -> str:
    return node_id_of(cert.public_key())  # type: ignore[arg-type]


@dataclass(frozen=True)
class Identity:
    private_key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @property
    def node_id(self) -> str:
        return node_id_of(self.private_key.public_key())

    @property
    def fingerprint(self) -> bytes:
        return cert_fingerprint(self.certificate)

    @classmethod
    def generate(cls) -> "Identity":
        key = ec.generate_private_key(ec.SECP256R1())
        return cls(key, _self_signed(key))

    @classmethod
    def load_or_create(cls, directory: Path) -> "Identity":
        """Load the identity stored in ``directory``, creating it on first use.

        Raises :class:`IdentityError` when the files exist but are unreadable.
        """
        key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
        if key_path.exists():
            try:
                key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            except (ValueError, TypeError) as exc:
                raise IdentityError(f"cannot read node key {key_path}: {exc}") from exc
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise IdentityError(f"node key {key_path} is not an EC key")
            cert = None
            if cert_path.exists():
                try:
                    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
                except ValueError:
                    cert = None
            if cert is None or node_id_of_cert(cert) != node_id_of(key.public_key()):
                cert = _self_signed(key)
                _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
            return cls(key, cert)
        ident = cls.generate()
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        _write(
            key_path,
            ident.private_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        _write(cert_path, ident.certificate.public_bytes(serialization.Encoding.PEM))
        return ident


def _write(path: Path, data: bytes) -> None:
    with atomic_write(path) as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def _self_signed(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshnode-{node_id_of(key.public_key())}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
