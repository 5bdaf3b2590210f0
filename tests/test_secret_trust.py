"""The mesh secret (issue #17, finding 9): where it is kept, how it is typed, how it is replaced."""

from __future__ import annotations

import io
import os

import pytest

from meshnode.cli import main
from meshnode.mesh.fabric import MeshFabric
from meshnode.net.secret import SecretStore, SecretStoreError, make_token, mesh_id, new_secret
from meshnode.paths import NodePaths
from nodeproc import until


def _paths(tmp_path, name: str = "home") -> NodePaths:
    return NodePaths.resolve(tmp_path / name).ensure()


def test_keyring_that_drops_the_secret_falls_back_to_the_file(tmp_path, monkeypatch, caplog):
    keyring = pytest.importorskip("keyring")
    from keyring.backends import null

    monkeypatch.delenv("MESHNODE_KEYRING", raising=False)
    dropping = null.Keyring()   # accepts set_password, returns None on get (without probing real backends)
    for name in ("set_password", "get_password"):
        monkeypatch.setattr(keyring, name, getattr(dropping, name))
    monkeypatch.setattr(keyring, "get_keyring", lambda: dropping)
    store = SecretStore(_paths(tmp_path))
    s = new_secret()
    where = store.save(s)
    assert where == str(store.file)
    assert SecretStore(_paths(tmp_path)).load() == s   # the next start finds the same mesh
    assert "did not keep the secret" in caplog.text


def test_secret_file_readable_by_others_is_refused(tmp_path):
    store = SecretStore(_paths(tmp_path), backend="file")
    store.save(new_secret())
    assert os.stat(store.file).st_mode & 0o777 == 0o600
    os.chmod(store.file, 0o644)
    with pytest.raises(SecretStoreError, match="chmod 600"):
        store.load()


@pytest.mark.parametrize("content", [b"c2hvcnQ=\n", b"x" * 5000, b"not base64 !!\n"])
def test_damaged_secret_file_is_refused(tmp_path, content):
    store = SecretStore(_paths(tmp_path), backend="file")
    store.file.write_bytes(content)
    os.chmod(store.file, 0o600)
    with pytest.raises(SecretStoreError):
        store.load()


def _isolated(monkeypatch):
    monkeypatch.setenv("MESHNODE_KEYRING", "file")


def test_join_reads_the_token_from_stdin(tmp_path, monkeypatch, capsys):
    _isolated(monkeypatch)
    s = new_secret()
    monkeypatch.setattr("sys.stdin", io.StringIO(make_token(s) + "\n"))
    assert main(["join", "--home", str(tmp_path / "b")]) == 0
    assert SecretStore(_paths(tmp_path, "b")).load() == s
    assert "note:" not in capsys.readouterr().err


def test_join_prompts_without_echo_on_a_terminal(tmp_path, monkeypatch):
    _isolated(monkeypatch)
    s = new_secret()
    tty = io.StringIO()
    tty.isatty = lambda: True   # type: ignore[method-assign]
    monkeypatch.setattr("sys.stdin", tty)
    asked: list[str] = []
    monkeypatch.setattr("getpass.getpass", lambda prompt: asked.append(prompt) or make_token(s))
    assert main(["join", "-", "--home", str(tmp_path / "b")]) == 0
    assert asked and SecretStore(_paths(tmp_path, "b")).load() == s


def test_join_with_the_token_as_argument_still_works_and_warns(tmp_path, monkeypatch, capsys):
    _isolated(monkeypatch)
    s = new_secret()
    assert main(["join", make_token(s), "--home", str(tmp_path / "b")]) == 0
    assert "shell history" in capsys.readouterr().err


@pytest.mark.net
async def test_rotate_replaces_the_secret_on_online_members(tmp_path, monkeypatch):
    from meshnode.cli.mesh import rotate_mesh

    _isolated(monkeypatch)
    old = new_secret()
    homes = {n: _paths(tmp_path, n) for n in ("a", "b", "x")}
    for p in homes.values():
        SecretStore(p).save(old)
    a = MeshFabric(homes["a"], interfaces=["127.0.0.1"], name="a", discovery=False, capabilities={})
    await a.start()
    b = MeshFabric(homes["b"], interfaces=["127.0.0.1"], name="b", discovery=False, capabilities={},
                   static_peers=[f"127.0.0.1:{a.port}"])
    await b.start()
    late = None
    try:
        await until(lambda: len(a.peers()) == 1, 3.0)
        new = new_secret()
        done, failed = await rotate_mesh(homes["x"], old, new, [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"],
                                         timeout=3.0)
        assert set(done) == {a.node_id, b.node_id} and not failed
        for f, n in ((a, "a"), (b, "b")):
            assert f.secret == new and f.mesh_id == mesh_id(new)
            assert SecretStore(homes[n]).load() == new
        await until(lambda: [p.name for p in a.peers()] == ["b"], 2.0)   # the rotating tool left; a-b stays up
        # whoever still holds the leaked secret is refused; the new one gets in
        late = MeshFabric(_paths(tmp_path, "late"), secret=old, name="late", discovery=False,
                          capabilities={}, static_peers=[f"127.0.0.1:{a.port}"])
        await late.start()
        await until(lambda: len(a.peers()) >= 1, 1.0)
        import asyncio
        await asyncio.sleep(1.0)
        assert late.peers() == [] and [p.name for p in a.peers()] == ["b"]
        await late.stop()
        late = MeshFabric(_paths(tmp_path, "late2"), secret=new, name="late2", discovery=False,
                          capabilities={}, static_peers=[f"127.0.0.1:{a.port}"])
        await late.start()
        await until(lambda: sorted(p.name for p in a.peers()) == ["b", "late2"], 3.0)
    finally:
        if late is not None:
            await late.stop()
        await a.stop()
        await b.stop()
