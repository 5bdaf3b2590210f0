"""Mesh authentication after the TLS handshake: a sans-IO state machine.

Rules (both sides run the same machine; the QUIC client is side ``a``, the server ``b``):

1. Each side sends ``Hello`` (node id, name, mesh id, protocol, capabilities) and then
   ``AuthChallenge`` carrying a fresh 32-byte nonce. The client starts; the server
   starts when the client's first message arrives (it cannot send on the client's
   control stream earlier).
2. A side that holds the peer's Hello and challenge checks the Hello (protocol
   version, mesh id, and that the node id is the one derived from the peer's TLS
   certificate) and sends ``AuthProof(mac)`` with
   ``mac = HMAC-SHA256(secret, nonce_a | nonce_b | fp_a | fp_b | role)`` where ``fp``
   are SHA-256 fingerprints of the certificates seen in the TLS handshake and ``role``
   is the prover's side (``b"a"``/``b"b"``), so a proof cannot be reflected or
   relayed to another connection.
3. A side that receives the proof verifies it (constant-time) and answers
   ``AuthResult(ok, reason)``.
4. The connection is authenticated when our check of the peer's proof passed *and* the
   peer's ``AuthResult`` said ok. Any failure, or any other message before that, moves
   the machine to FAILED with a reason; it never leaves FAILED.

No sockets, clocks or randomness here: the nonce is passed in. The adapter feeds
received messages with :meth:`AuthHandshake.receive`, sends what
:meth:`AuthHandshake.messages_to_send` returns, and reads :attr:`state` / :attr:`reason`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
from dataclasses import dataclass

from meshnode.wire import AuthChallenge, AuthProof, AuthResult, Error, ErrorCode, Hello, Message

log = logging.getLogger(__name__)

NONCE_LEN = 32


class AuthState(enum.Enum):
    STARTING = "starting"            # nothing sent yet
    HANDSHAKING = "handshaking"      # our Hello + challenge sent
    AUTHENTICATED = "authenticated"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PeerHello:
    """What the peer said about itself, once its proof verified."""

    node_id: str
    name: str
    mesh_id: str
    protocol: int
    capabilities: dict


def compute_mac(secret: bytes, nonce_a: bytes, nonce_b: bytes, fp_a: bytes, fp_b: bytes, role: bytes) -> bytes:
    return hmac.new(secret, b"".join((nonce_a, nonce_b, fp_a, fp_b, role)), hashlib.sha256).digest()


class AuthHandshake:
    """One side of the mesh-secret proof on one connection.

    ``is_client``: we are the QUIC client (side ``a``). ``local_fp``/``peer_fp``: SHA-256
    fingerprints of our and the peer's TLS certificates. ``peer_node_id``: the id derived
    from the peer's certificate (the Hello must claim the same id).
    """

    def __init__(
        self,
        *,
        secret: bytes,
        is_client: bool,
        hello: Hello,
        nonce: bytes,
        local_fp: bytes,
        peer_fp: bytes,
        peer_node_id: str,
        protocol: int,
    ) -> None:
        if len(nonce) != NONCE_LEN:
            raise ValueError(f"nonce must be {NONCE_LEN} bytes")
        self._secret = secret
        self._is_client = is_client
        self._hello = hello
        self._nonce = nonce
        self._local_fp = local_fp
        self._peer_fp = peer_fp
        self._peer_node_id = peer_node_id
        self._protocol = protocol
        self._out: list = []
        self._peer_hello: Hello | None = None
        self._peer_nonce: bytes | None = None
        self._verified_peer = False
        self._accepted_by_peer = False
        self.state = AuthState.STARTING
        self.reason = ""
        self.refused_by_peer = False

    # ---- commands -------------------------------------------------------------

    def start(self) -> None:
        """Queue our Hello and challenge (idempotent)."""
        if self.state is AuthState.STARTING:
            self._out += [self._hello, AuthChallenge(ref=0, nonce=self._nonce)]
            self._set_state(AuthState.HANDSHAKING)

    def receive(self, msg: Message) -> None:
        """Feed one message received on the control stream before authentication."""
        if self.state in (AuthState.FAILED, AuthState.AUTHENTICATED):
            return
        self.start()
        match msg:
            case Hello():
                if self._peer_hello is not None:
                    return self._fail("peer sent Hello twice", ErrorCode.BAD_FIELD)
                self._peer_hello = msg
                if msg.protocol != self._protocol:
                    return self._fail(
                        f"protocol version mismatch (ours {self._protocol}, peer {msg.protocol})",
                        ErrorCode.BAD_VERSION,
                    )
                if msg.node_id != self._peer_node_id:
                    return self._fail("peer's node id does not match its certificate", ErrorCode.AUTH_FAILED)
                if msg.mesh_id != self._hello.mesh_id:
                    return self._fail(
                        f"peer is in another mesh ({msg.mesh_id}, ours {self._hello.mesh_id}): wrong mesh secret",
                        ErrorCode.AUTH_FAILED,
                    )
            case AuthChallenge():
                if self._peer_hello is None or self._peer_nonce is not None:
                    return self._fail("unexpected AuthChallenge", ErrorCode.BAD_FIELD)
                if len(msg.nonce) != NONCE_LEN:
                    return self._fail("bad challenge nonce length", ErrorCode.BAD_FIELD)
                self._peer_nonce = msg.nonce
                self._out.append(AuthProof(ref=0, mac=self._mac(self._local_role)))
            case AuthProof():
                if self._peer_nonce is None:
                    return self._fail("AuthProof before challenge", ErrorCode.BAD_FIELD)
                expected = self._mac(self._peer_role)
                if not hmac.compare_digest(expected, msg.mac):
                    return self._fail("mesh secret proof did not verify: wrong mesh secret", ErrorCode.AUTH_FAILED)
                self._verified_peer = True
                self._out.append(AuthResult(ref=0, ok=True, reason=""))
            case AuthResult():
                if not msg.ok:
                    self.refused_by_peer = True
                    return self._fail(f"refused by peer: {msg.reason}", None)
                if not self._verified_peer:
                    # The peer accepted us; we still wait for its proof.
                    pass
                self._accepted_by_peer = True
            case Error():
                self.refused_by_peer = True
                return self._fail(f"refused by peer: {msg.message}", None)
            case _:
                return self._fail(
                    f"{type(msg).__name__} received before authentication", ErrorCode.NOT_AUTHENTICATED
                )
        if self._verified_peer and self._accepted_by_peer:
            self._set_state(AuthState.AUTHENTICATED)

    def messages_to_send(self) -> list:
        out, self._out = self._out, []
        return out

    # ---- results --------------------------------------------------------------

    @property
    def peer(self) -> PeerHello | None:
        """The peer's Hello (available once received; trusted only when AUTHENTICATED)."""
        h = self._peer_hello
        if h is None:
            return None
        return PeerHello(h.node_id, h.name, h.mesh_id, h.protocol, dict(h.capabilities))

    # ---- internals ------------------------------------------------------------

    @property
    def _local_role(self) -> bytes:
        return b"a" if self._is_client else b"b"

    @property
    def _peer_role(self) -> bytes:
        return b"b" if self._is_client else b"a"

    def _mac(self, role: bytes) -> bytes:
        assert self._peer_nonce is not None
        if self._is_client:
            na, nb, fa, fb = self._nonce, self._peer_nonce, self._local_fp, self._peer_fp
        else:
            na, nb, fa, fb = self._peer_nonce, self._nonce, self._peer_fp, self._local_fp
        return compute_mac(self._secret, na, nb, fa, fb, role)

    def _fail(self, reason: str, code: ErrorCode | None) -> None:
        self.reason = reason
        if code is ErrorCode.AUTH_FAILED or code is ErrorCode.BAD_VERSION:
            self._out.append(AuthResult(ref=0, ok=False, reason=reason))
        elif code is not None:
            self._out.append(Error(ref=0, code=code, message=reason))
        self._set_state(AuthState.FAILED)

    def _set_state(self, state: AuthState) -> None:
        log.debug("auth %s -> %s%s", self.state.value, state.value, f" ({self.reason})" if self.reason else "")
        self.state = state
