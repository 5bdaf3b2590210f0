"""Mesh authentication after the TLS handshake: a sans-IO state machine.

Rules (both sides run the same machine; the QUIC client is side ``a``, the server ``b``):

1. Each side sends ``Hello`` (node id, mesh id, protocol: what the proof needs; name and
   capabilities empty) and then ``AuthChallenge`` carrying a fresh 32-byte nonce. The
   client starts; the server starts when the client's first message arrives (it cannot
   send on the client's control stream earlier). Anyone who connects gets this much,
   and no more.
2. A side that holds the peer's Hello and challenge checks the Hello (protocol
   version, mesh id, and that the node id is the one derived from the peer's TLS
   certificate) and sends ``AuthProof(mac)`` with
   ``mac = HMAC-SHA256(secret, nonce_a | nonce_b | fp_a | fp_b | role)`` where ``fp``
   are SHA-256 fingerprints of the certificates seen in the TLS handshake and ``role``
   is the prover's side (``b"a"``/``b"b"``), so a proof cannot be reflected or
   relayed to another connection.
3. A side that receives the proof verifies it (constant-time) and answers
   ``AuthResult(ok, reason)``; when ok, ``Profile`` (name, capabilities) follows: only a
   peer that proved it holds the secret learns the host name, models and memory.
4. The connection is authenticated when our check of the peer's proof passed, the
   peer's ``AuthResult`` said ok and its ``Profile`` arrived and checked out. Any
   failure, or any other message before that, moves the machine to FAILED with a reason;
   it never leaves FAILED.

Every field the peer sends is checked here before anything else reads it (docs/security.md: a
``quic_port`` of ``"x"`` once made the failure log itself raise, so the connection
outlived its deadline): sizes, types and ranges of the Hello and of the Profile's
capabilities (:func:`check_capabilities`). The frames themselves are bounded by the
link (a few KB before the proof).

No sockets, clocks or randomness here: the nonce is passed in. The adapter feeds
received messages with :meth:`AuthHandshake.receive`, sends what
:meth:`AuthHandshake.messages_to_send` returns, and reads :attr:`state` / :attr:`reason`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from meshnode.limits import MAX_GPU_PAD_ROWS, MAX_STAGE_THREADS
from meshnode.wire import AuthChallenge, AuthProof, AuthResult, Error, ErrorCode, Hello, Message, Profile
from meshnode.wire.messages import MAX_NAME_LEN

log = logging.getLogger(__name__)

NONCE_LEN = 32
MAX_CAPABILITIES_BYTES = 64 * 1024   # a Profile's capabilities as JSON (~300 models)
MAX_MODELS = 256
_MAX_BYTES = 1 << 62                 # free_ram, free_vram, a model's size
_HEX64 = re.compile(r"[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")   # terminal control characters (C0, DEL, C1)


def _show(value: Any) -> str:
    """A peer's value in a log line or reason: short, one line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _str(value: Any, hi: int) -> bool:
    return isinstance(value, str) and len(value) <= hi and not _CONTROL.search(value)


def _rate(value: Any) -> bool:
    """A measured figure (speed, bytes/s): a finite number in 0..1e12."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value <= 1e12)


def check_capabilities(caps: Any) -> str | None:
    """Why ``caps`` (a peer's Profile.capabilities) is unacceptable, or None.

    The schema of :mod:`meshnode.net.caps` plus ``quic_port``: every known key, when
    present, has its type and range (``peers()``, ``/status`` and the planner read them
    without further checks); unknown keys are allowed (later versions add fields) and
    bounded by the total size."""
    if not isinstance(caps, dict):
        return "capabilities are not an object"
    size = len(json.dumps(caps, separators=(",", ":")))
    if size > MAX_CAPABILITIES_BYTES:
        return f"capabilities of {size} bytes (at most {MAX_CAPABILITIES_BYTES})"
    checks = {
        "quic_port": lambda v: _int(v, 1, 65535),
        "free_ram": lambda v: _int(v, 0, _MAX_BYTES),
        "free_vram": lambda v: _int(v, 0, _MAX_BYTES),
        "cores": lambda v: _int(v, 1, 1 << 16),
        "speed": _rate,
        "fetch": _rate,
        "backend": lambda v: _str(v, 32),
        "gpu_pad": lambda v: _int(v, 0, MAX_GPU_PAD_ROWS),
        "stage_threads": lambda v: isinstance(v, list) and len(v) == 2 and all(_int(x, 0, MAX_STAGE_THREADS) for x in v),
        "models": lambda v: isinstance(v, list) and len(v) <= MAX_MODELS,
    }
    for key, ok in checks.items():
        if key in caps and not ok(caps[key]):
            return f"capabilities: bad {key} {_show(caps[key])}"
    for m in caps.get("models", ()):
        if not (isinstance(m, dict) and _str(m.get("name"), 256) and isinstance(m.get("sha256"), str)
                and _HEX64.fullmatch(m["sha256"]) and _int(m.get("layers"), 1, 1 << 16)
                and _int(m.get("size", 0), 0, _MAX_BYTES)):
            return f"capabilities: bad model entry {_show(m)}"
    return None


def check_name(name: Any) -> str | None:
    """Why ``name`` (a peer's display name) is unacceptable, or None: a label of at most
    MAX_NAME_LEN characters without terminal control characters."""
    if not _str(name, MAX_NAME_LEN):
        return f"bad name {_show(name)} (at most {MAX_NAME_LEN} printable characters)"
    return None


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
    from the peer's certificate (the Hello must claim the same id). ``hello`` is our
    self-description: its node id, mesh id and protocol go out in the Hello, its name and
    capabilities in the Profile after the peer's proof verified.
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
        # what goes out before the proof: only what the proof needs
        self._hello = Hello(ref=0, node_id=hello.node_id, name="", mesh_id=hello.mesh_id,
                            protocol=hello.protocol, capabilities={})
        # our own name goes out as the peer will accept it: printable, at most MAX_NAME_LEN
        self._profile = Profile(ref=0, name=_CONTROL.sub("", hello.name)[:MAX_NAME_LEN],
                                capabilities=dict(hello.capabilities))
        self._nonce = nonce
        self._local_fp = local_fp
        self._peer_fp = peer_fp
        self._peer_node_id = peer_node_id
        self._protocol = protocol
        self._out: list = []
        self._peer_hello: Hello | None = None
        self._peer_nonce: bytes | None = None
        self._peer_profile: Profile | None = None
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

    @property
    def peer_verified(self) -> bool:
        """The peer's proof verified: it holds the mesh secret (the handshake may still be
        finishing). The link lifts its pre-authentication limits from here on."""
        return self._verified_peer and self.state is not AuthState.FAILED

    def receive(self, msg: Message) -> None:
        """Feed one message received on the control stream before authentication."""
        if self.state in (AuthState.FAILED, AuthState.AUTHENTICATED):
            return
        self.start()
        match msg:
            case Hello():
                if self._peer_hello is not None:
                    return self._fail("peer sent Hello twice", ErrorCode.BAD_FIELD)
                if msg.protocol != self._protocol:
                    return self._fail(
                        f"protocol version mismatch (ours {self._protocol}, peer {msg.protocol})",
                        ErrorCode.BAD_VERSION,
                    )
                if msg.node_id != self._peer_node_id:
                    return self._fail("peer's node id does not match its certificate", ErrorCode.AUTH_FAILED)
                # (protocol 2 sends name and capabilities in the Profile; whatever a peer
                # puts here is never read)
                self._peer_hello = Hello(ref=0, node_id=msg.node_id, name="", mesh_id=msg.mesh_id,
                                         protocol=msg.protocol, capabilities={})
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
                self._out += [AuthResult(ref=0, ok=True, reason=""), self._profile]
            case AuthResult():
                if not msg.ok:
                    self.refused_by_peer = True
                    return self._fail(f"refused by peer: {msg.reason}", None)
                # (the peer may accept us before we verified its proof: we still wait for it)
                self._accepted_by_peer = True
            case Profile():
                if not (self._verified_peer and self._accepted_by_peer) or self._peer_profile is not None:
                    return self._fail("unexpected Profile", ErrorCode.BAD_FIELD)
                why = check_name(msg.name) or check_capabilities(msg.capabilities)
                if why is not None:
                    return self._fail(f"peer's profile refused: {why}", ErrorCode.AUTH_FAILED)
                self._peer_profile = msg
            case Error():
                self.refused_by_peer = True
                return self._fail(f"refused by peer: {msg.message}", None)
            case _:
                return self._fail(
                    f"{type(msg).__name__} received before authentication", ErrorCode.NOT_AUTHENTICATED
                )
        if self._verified_peer and self._accepted_by_peer and self._peer_profile is not None:
            self._set_state(AuthState.AUTHENTICATED)

    def messages_to_send(self) -> list:
        out, self._out = self._out, []
        return out

    # ---- results --------------------------------------------------------------

    @property
    def peer(self) -> PeerHello | None:
        """The peer's Hello and Profile (name ``""`` and capabilities ``{}`` until the
        Profile arrived; trusted only when AUTHENTICATED). Every field passed the checks."""
        h, p = self._peer_hello, self._peer_profile
        if h is None:
            return None
        return PeerHello(h.node_id, p.name if p else "", h.mesh_id, h.protocol,
                         dict(p.capabilities) if p else {})

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
