"""The mesh secret: creation, storage (keyring or a 0600 file), join tokens, mesh id.

Theory of operation: a mesh *is* a random 32-byte secret. The first node creates it;
``meshnode invite`` prints it as a join token and ``meshnode join TOKEN`` stores it on
another node. Nodes advertise only the mesh id (a hash of the secret) over mDNS and
prove knowledge of the secret after the TLS handshake (:mod:`meshnode.net.auth`).

Storage: the system keyring (service ``meshnode``, user ``mesh-secret-<hash of the
config dir>`` so several homes on one machine keep separate secrets). Where no usable
keyring backend exists, or ``MESHNODE_KEYRING=file`` is set, a 0600 file
``mesh-secret`` in the node's config directory is used (one warning line when it is a
fallback rather than a choice).

Token format: ``base64url(version u8 | secret 32 bytes | sha256(version|secret)[:4])``
without padding, so a mistyped token is rejected with a clear error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import secrets
from pathlib import Path

from meshnode.errors import MeshnodeError
from meshnode.fsutil import atomic_write
from meshnode.paths import NodePaths

log = logging.getLogger(__name__)

SECRET_LEN = 32
TOKEN_VERSION = 1
KEYRING_SERVICE = "meshnode"
KEYRING_ENV = "MESHNODE_KEYRING"
SECRET_FILE = "mesh-secret"


class InvalidTokenError(MeshnodeError):
    """A join token that does not decode (typo, truncation, other version)."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_LEN)


def mesh_id(secret: bytes) -> str:
    """Public name of the mesh: a hash of the secret (safe to advertise)."""
    return hashlib.sha256(b"meshnode mesh id\0" + secret).hexdigest()[:16]


def make_token(secret: bytes) -> str:
    body = bytes([TOKEN_VERSION]) + secret
    raw = body + hashlib.sha256(body).digest()[:4]
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def parse_token(token: str) -> bytes:
    """The secret inside ``token``; raises :class:`InvalidTokenError` with the reason."""
    text = token.strip()
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidTokenError("invalid join token: not base64url text") from exc
    if len(raw) < 1:
        raise InvalidTokenError("invalid join token: empty")
    if raw[0] != TOKEN_VERSION:
        raise InvalidTokenError(f"invalid join token: unsupported version {raw[0]}")
    if len(raw) != 1 + SECRET_LEN + 4:
        raise InvalidTokenError(
            f"invalid join token: wrong length ({len(text)} characters; copy the whole token)"
        )
    body, check = raw[:-4], raw[-4:]
    if hashlib.sha256(body).digest()[:4] != check:
        raise InvalidTokenError("invalid join token: checksum mismatch (typo?)")
    return body[1:]


class SecretStore:
    """Load and save the mesh secret of one home.

    ``backend`` is ``"keyring"``, ``"file"`` or ``None`` (``$MESHNODE_KEYRING``, else
    keyring with file fallback).
    """

    def __init__(self, paths: NodePaths, backend: str | None = None) -> None:
        self._paths = paths
        self._backend = backend or os.environ.get(KEYRING_ENV) or "keyring"
        self._warned = False

    @property
    def file(self) -> Path:
        return self._paths.config / SECRET_FILE

    @property
    def _user(self) -> str:
        h = hashlib.sha256(str(self._paths.config).encode()).hexdigest()[:12]
        return f"mesh-secret-{h}"

    def _keyring(self):  # -> module | None
        if self._backend == "file":
            return None
        try:
            import keyring
            import keyring.backends.fail
            import keyring.errors
        except ImportError:
            self._warn("keyring is not installed")
            return None
        kr = keyring.get_keyring()
        if isinstance(kr, keyring.backends.fail.Keyring):
            self._warn("no keyring backend available")
            return None
        return keyring

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s; keeping the mesh secret in %s (mode 0600)", why, self.file)

    def load(self) -> bytes | None:
        kr = self._keyring()
        if kr is not None:
            try:
                value = kr.get_password(KEYRING_SERVICE, self._user)
            except Exception as exc:  # keyring backends raise many types
                self._warn(f"keyring failed ({type(exc).__name__})")
            else:
                if value:
                    return base64.b64decode(value)
                # fall through: a file written while the keyring was absent still counts
        if self.file.exists():
            return base64.b64decode(self.file.read_text().strip())
        return None

    def save(self, secret: bytes) -> str:
        """Store ``secret``; returns where ("keyring" or the file path)."""
        text = base64.b64encode(secret).decode("ascii")
        kr = self._keyring()
        if kr is not None:
            try:
                kr.set_password(KEYRING_SERVICE, self._user, text)
            except Exception as exc:
                self._warn(f"keyring failed ({type(exc).__name__})")
            else:
                if self.file.exists():
                    self.file.unlink()
                return "keyring"
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(self.file) as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text.encode("ascii") + b"\n")
        return str(self.file)

    def load_or_create(self) -> bytes:
        secret = self.load()
        if secret is None:
            secret = new_secret()
            where = self.save(secret)
            log.info("created a new mesh %s (secret stored in %s)", mesh_id(secret), where)
        return secret
