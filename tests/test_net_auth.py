"""The mesh-secret handshake, identity and join tokens, in memory (no sockets)."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from meshnode.net.auth import AuthHandshake, AuthState
from meshnode.net.identity import Identity
from meshnode.net.secret import (
    InvalidTokenError,
    SecretStore,
    make_token,
    mesh_id,
    new_secret,
    parse_token,
)
from meshnode.paths import NodePaths
from meshnode.wire import AuthResult, Claim, FrameDecoder, Hello, encode

PROTO = 1


def _side(ident: Identity, peer: Identity, secret: bytes, *, is_client: bool, mesh: str | None = None,
          nonce: bytes | None = None, peer_fp: bytes | None = None) -> AuthHandshake:
    hello = Hello(ref=0, node_id=ident.node_id, name="n", mesh_id=mesh or mesh_id(secret),
                  protocol=PROTO, capabilities={"cores": 2})
    return AuthHandshake(
        secret=secret, is_client=is_client, hello=hello, nonce=nonce or os.urandom(32),
        local_fp=ident.fingerprint, peer_fp=peer_fp or peer.fingerprint,
        peer_node_id=peer.node_id, protocol=PROTO,
    )


def _pump(a: AuthHandshake, b: AuthHandshake, rounds: int = 10) -> None:
    """Deliver messages both ways through the real codec until quiet."""
    da, db = FrameDecoder(), FrameDecoder()
    a.start()
    for _ in range(rounds):
        out_a, out_b = a.messages_to_send(), b.messages_to_send()
        if not out_a and not out_b:
            return
        for m in db.feed(b"".join(encode(x) for x in out_a)):
            b.receive(m)
        for m in da.feed(b"".join(encode(x) for x in out_b)):
            a.receive(m)


@pytest.fixture(scope="module")
def idents() -> tuple[Identity, Identity, Identity]:
    return Identity.generate(), Identity.generate(), Identity.generate()


def test_same_secret_authenticates(idents):
    ia, ib, _ = idents
    s = new_secret()
    a, b = _side(ia, ib, s, is_client=True), _side(ib, ia, s, is_client=False)
    _pump(a, b)
    assert a.state is AuthState.AUTHENTICATED and b.state is AuthState.AUTHENTICATED
    assert a.peer.node_id == ib.node_id and b.peer.capabilities == {"cores": 2}


def test_wrong_secret_is_refused_on_both_sides(idents):
    ia, ib, _ = idents
    s1, s2 = new_secret(), new_secret()
    # Same advertised mesh id, different secrets: only the proof can tell.
    a = _side(ia, ib, s1, is_client=True)
    b = _side(ib, ia, s2, is_client=False, mesh=mesh_id(s1))
    _pump(a, b)
    assert a.state is AuthState.FAILED and b.state is AuthState.FAILED
    assert "wrong mesh secret" in a.reason and "wrong mesh secret" in b.reason


def test_other_mesh_id_is_refused_with_reason(idents):
    ia, ib, _ = idents
    a, b = _side(ia, ib, new_secret(), is_client=True), _side(ib, ia, new_secret(), is_client=False)
    _pump(a, b)
    assert a.state is AuthState.FAILED and b.state is AuthState.FAILED
    for side in (a, b):
        assert "another mesh" in side.reason or "refused by peer" in side.reason


def test_proof_is_bound_to_certificate_fingerprints(idents):
    # A relay in the middle sees another certificate than the real peer: proofs fail.
    ia, ib, ic = idents
    s = new_secret()
    a = _side(ia, ib, s, is_client=True)
    b = _side(ib, ia, s, is_client=False, peer_fp=ic.fingerprint)
    _pump(a, b)
    assert a.state is AuthState.FAILED and b.state is AuthState.FAILED


def test_hello_node_id_must_match_certificate(idents):
    ia, ib, ic = idents
    s = new_secret()
    a = _side(ia, ib, s, is_client=True)
    b = AuthHandshake(secret=s, is_client=False,
                      hello=Hello(ref=0, node_id=ib.node_id, name="b", mesh_id=mesh_id(s), protocol=PROTO, capabilities={}),
                      nonce=os.urandom(32), local_fp=ib.fingerprint, peer_fp=ia.fingerprint,
                      peer_node_id=ic.node_id, protocol=PROTO)
    _pump(a, b)
    assert b.state is AuthState.FAILED and "certificate" in b.reason


def test_nothing_else_accepted_before_authentication(idents):
    ia, ib, _ = idents
    s = new_secret()
    b = _side(ib, ia, s, is_client=False)
    b.receive(Claim.__new__(Claim))  # any non-auth message
    assert b.state is AuthState.FAILED and "before authentication" in b.reason


def test_peer_result_alone_is_not_enough(idents):
    ia, ib, _ = idents
    a = _side(ia, ib, new_secret(), is_client=True)
    a.start()
    a.receive(AuthResult(ref=0, ok=True, reason=""))
    assert a.state is not AuthState.AUTHENTICATED


def test_token_roundtrip_and_errors():
    s = new_secret()
    tok = make_token(s)
    assert parse_token(tok) == s and parse_token(f"  {tok}\n") == s
    for bad in ("", "hello", tok[:-3], tok[:10] + ("A" if tok[10] != "A" else "B") + tok[11:], "!!!" + tok):
        with pytest.raises(InvalidTokenError):
            parse_token(bad)
    assert mesh_id(s) != mesh_id(new_secret()) and s.hex() not in mesh_id(s)
    # each mistake named for what it is: a stray word is not "an unsupported version"
    with pytest.raises(InvalidTokenError, match="wrong length"):
        parse_token("garbage")
    other = base64.urlsafe_b64decode(tok + "=" * (-len(tok) % 4))
    with pytest.raises(InvalidTokenError, match="version 9, this meshnode reads version"):
        parse_token(base64.urlsafe_b64encode(bytes([9]) + other[1:]).decode().rstrip("="))


def test_identity_persists_with_private_files(tmp_path):
    p = NodePaths.resolve(tmp_path).ensure()
    a = Identity.load_or_create(p.identity)
    b = Identity.load_or_create(p.identity)
    assert a.node_id == b.node_id and a.fingerprint == b.fingerprint
    for f in p.identity.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_secret_file_backend(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MESHNODE_KEYRING", "file")
    p = NodePaths.resolve(tmp_path).ensure()
    st = SecretStore(p)
    assert st.load() is None
    s = st.load_or_create()
    assert SecretStore(p).load() == s
    assert stat.S_IMODE(st.file.stat().st_mode) == 0o600
