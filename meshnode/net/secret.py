"""The mesh secret: creation, storage (keyring or a 0600 file), join tokens, mesh id.

Theory of operation: a mesh *is* a random 32-byte secret. The first node creates it;
``meshnode invite`` prints it as a join token and ``meshnode join TOKEN`` stores it on
another node. Nodes advertise only the mesh id (a hash of the secret) over mDNS and
prove knowledge of the secret after the TLS handshake (:mod:`meshnode.net.auth`).

Storage: the system keyring (service ``meshnode``, user ``mesh-secret-<hash of the
config dir>`` so several homes on one machine keep separate secrets). Where no usable
keyring backend exists, or ``MESHNODE_KEYRING=file`` is set, a 0600 file
``mesh-secret`` in the node's config directory is used (one warning line when it is a
fallback rather than a choice). A keyring that accepts a secret and drops it (the
``null`` backend, a locked store) would make a new mesh on every start, so every save is
read back, and a keyring that does not return it sends the secret to the file. The file
is refused when other users may read it or write its directory (the fix is printed), and
when it does not hold exactly one 32-byte secret.

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


class SecretStoreError(MeshnodeError):
    """The stored secret cannot be used (unsafe permissions, damaged) or stored."""


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
    if len(raw) != 1 + SECRET_LEN + 4:
        # (checked first: a random word decodes to some "version" byte, which would mislead)
        raise InvalidTokenError(
            f"invalid join token: wrong length ({len(text)} characters; copy the whole token "
            "`meshnode invite` printed)"
        )
    if raw[0] != TOKEN_VERSION:
        raise InvalidTokenError(f"invalid join token: version {raw[0]}, this meshnode reads version "
                                f"{TOKEN_VERSION} (is the inviting node much newer or older?)")
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
        self._why: str | None = None   # why the keyring is not used (warned when saving)

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
        """The keyring is out (``why``). Reading the secret back from the file is routine,
        so it is only logged at debug level; :meth:`save` warns when it writes the file."""
        if self._why is None:
            self._why = why
            log.debug("%s; the mesh secret lives in %s", why, self.file)

    def load(self) -> bytes | None:
        kr = self._keyring()
        if kr is not None:
            try:
                value = kr.get_password(KEYRING_SERVICE, self._user)
            except Exception as exc:  # keyring backends raise many types
                self._warn(f"keyring failed ({type(exc).__name__})")
            else:
                if value:
                    return _decode(value, "the keyring entry")
                # fall through: a file written while the keyring was absent still counts
        return self._load_file()

    def _load_file(self) -> bytes | None:
        path = self.file
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        # Another user able to read the secret is a member; able to replace it, picks our mesh.
        if st.st_mode & 0o077:
            raise SecretStoreError(
                f"{path} is readable or writable by other users (mode {st.st_mode & 0o777:o}); "
                f"anyone who reads it can join the mesh. Run `chmod 600 {path}` (and consider "
                f"`meshnode mesh rotate`, since the secret may have been read)")
        if st.st_uid != os.getuid():
            raise SecretStoreError(f"{path} belongs to another user (uid {st.st_uid}); remove it or fix its owner")
        if st.st_size > 1024:
            raise SecretStoreError(f"{path} is {st.st_size} bytes, not a mesh secret; remove it or `meshnode join` again")
        return _decode(path.read_text(errors="replace").strip(), str(path))

    def save(self, secret: bytes) -> str:
        """Store ``secret``; returns where ("keyring" or the file path). Raises
        :class:`SecretStoreError` when it cannot be stored anywhere."""
        if len(secret) != SECRET_LEN:
            raise SecretStoreError(f"a mesh secret is {SECRET_LEN} bytes, not {len(secret)}")
        text = base64.b64encode(secret).decode("ascii")
        kr = self._keyring()
        if kr is not None:
            try:
                kr.set_password(KEYRING_SERVICE, self._user, text)
                stored = kr.get_password(KEYRING_SERVICE, self._user)
            except Exception as exc:
                self._warn(f"keyring failed ({type(exc).__name__})")
            else:
                if stored == text:
                    if self.file.exists():
                        self.file.unlink()
                    return "keyring"
                self._warn(f"the keyring ({type(kr.get_keyring()).__name__}) did not keep the secret")
        if self._backend != "file":
            log.warning("%s; keeping the mesh secret in %s (mode 0600)", self._why or "no keyring", self.file)
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(self.file) as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(text.encode("ascii") + b"\n")
        except OSError as exc:
            raise SecretStoreError(f"cannot store the mesh secret in {self.file}: {exc}") from exc
        return str(self.file)

    def load_or_create(self) -> bytes:
        secret = self.load()
        if secret is None:
            secret = new_secret()
            where = self.save(secret)
            log.info("created a new mesh %s (secret stored in %s)", mesh_id(secret), where)
        return secret


def _decode(text: str, where: str) -> bytes:
    try:
        secret = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        secret = b""
    if len(secret) != SECRET_LEN:
        raise SecretStoreError(f"{where} does not hold a mesh secret; remove it and run `meshnode join` "
                               f"(or start a node to make a new mesh)")
    return secret
