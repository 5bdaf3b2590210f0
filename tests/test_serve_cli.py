"""`meshnode serve`: a malformed option is refused by the parser, named, with no traceback.

The checks run :func:`meshnode.cli.main` in this process; the ``slow`` test runs the real
``meshnode`` command.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import meshnode.serve.service  # noqa: F401 - _node_kwargs loads it; ifaddr's import starts a process
from meshnode.cli import build_parser
from meshnode.cli.run import _node_kwargs
from meshnode.node import DEFAULT_SHUTDOWN_GRACE
from meshnode.paths import NodePaths
from nodeproc import NodeProc, env, meshnode_argv, meshnode_cmd, start_node, wait_for


@pytest.mark.parametrize("option, value", [
    ("--max-memory", "lots"),
    ("--max-memory", "-3GB"),
    ("--split", "x"),
    ("--ctx", "0"),
    ("--wire-dtype", "f8"),
    ("--shutdown-grace", "-1"),
    ("--shutdown-grace", "soon"),
    ("--shutdown-grace", "1e9"),
    ("--shutdown-grace", "nan"),
    ("--draft-max", "33"),
    ("--draft-initial", "0"),
    ("--parallel", "257"),
])
def test_malformed_serve_options_are_refused_up_front(tmp_path, option, value, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", option, value)
    assert r.returncode == 2
    assert f"argument {option}" in r.stderr and "Traceback" not in r.stderr


def test_a_smallest_window_above_the_largest_is_refused_up_front(tmp_path, meshnode_main):
    # (both flags are the user's: refused before anything starts, not served without speculation)
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", "--draft-min", "5", "--draft-max", "2")
    assert r.returncode != 0
    assert "--draft-min 5 is larger than --draft-max 2" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()   # nothing was fetched


@pytest.mark.parametrize("content, expect", [
    (None, "model file not found: "),
    (b"garbage\n", "is not a GGUF file"),
    (b"GGUF" + bytes(60), "GGUF"),
])
def test_a_model_path_that_is_not_a_model_is_refused_up_front(tmp_path, content, expect, meshnode_main):
    model = tmp_path / "m.gguf"
    if content is not None:
        model.write_bytes(content)
    r = meshnode_main("--home", str(tmp_path / "home"), "serve", "--headless", "--model", str(model))
    assert r.returncode != 0
    assert expect in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "home" / "state").exists()   # no node was started


@pytest.mark.parametrize("argv, expect", [
    (("confg",), "unknown command 'confg' (commands: bench, "),     # a mistyped command
    (("--port", "0", "stauts"), "unknown command 'stauts'"),
    (("--port", "0", "--bogus"), "unrecognized arguments: --bogus"),
])
def test_a_mistyped_command_is_named_as_one(tmp_path, argv, expect, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), *argv)
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_the_meshnode_command_refuses_a_malformed_serve_option(tmp_path):
    r = meshnode_cmd("--home", str(tmp_path), "serve", "--headless", "--split", "x")
    assert r.returncode == 2
    assert "argument --split" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_served_node_takes_its_start_up_heap_out_of_the_garbage_collectors_walks(tmp_path):
    # (a full collection holds the event loop as long as it walks every object: ~55 ms
    # over a started node's heap on a 2-core VM, meshnode/node.py freeze_startup_heap)
    node = start_node(tmp_path, "a", "--no-model", "--no-discovery").wait_up(60)
    try:
        wait_for(lambda: "start-up heap frozen" in node.log(), 20)
        frozen = [line for line in node.log().splitlines() if "start-up heap frozen" in line]
        assert len(frozen) == 1 and int(frozen[0].split("frozen: ")[1].split(" ")[0]) > 10_000
    finally:
        node.stop()


@pytest.mark.slow
def test_meshnode_without_a_terminal_serves_headless_and_says_so(tmp_path):
    # `meshnode` from a script or a service: no full-screen app writing escape codes into
    # its log, but the node, served as `serve --headless` would
    home = tmp_path / "a"
    home.mkdir()
    log_path = home / "node.log"
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(meshnode_argv("--home", str(home), "--port", "0", "--name", "a", "--no-model",
                                              "--no-discovery"),
                                env=env(), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
    node = NodeProc(name="a", home=home, proc=proc, log_path=log_path).wait_up(60)
    try:
        assert node.status()["node"]["name"] == "a"
        assert "not a terminal: running headless" in node.log() and "\x1b[" not in node.log()
    finally:
        assert node.stop() == 0


@pytest.mark.slow
def test_a_taken_http_port_is_one_clear_error_and_the_node_stops(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = meshnode_cmd("--home", str(tmp_path), "serve", "--headless", "--no-model", "--no-discovery",
                         "--port", str(port), timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"meshnode: error: cannot serve HTTP on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "Traceback" not in r.stderr and "ERROR:" not in r.stderr   # not uvicorn's own line


@pytest.mark.slow
def test_a_taken_quic_port_is_one_clear_error(tmp_path):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("0.0.0.0", 0))
        port = taken.getsockname()[1]
        r = meshnode_cmd("--home", str(tmp_path), "serve", "--headless", "--no-model", "--no-discovery",
                         "--quic-port", str(port), "--port", "0", timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"meshnode: error: cannot listen for peers on UDP 0.0.0.0:{port}: Address already in use" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_node_removes_what_killed_writes_left_in_its_store(tmp_path):
    # a fetch or slice killed mid-write leaves its hidden temp file (gigabytes for a big
    # model): a starting node removes those nobody has touched for an hour, and nothing else
    paths = NodePaths.resolve(tmp_path / "a").ensure()
    model_dir = paths.models / "big"
    model_dir.mkdir()
    stale = [model_dir / ".big.gguf.k1ll3d00.part", paths.slices / ".pkg.gguf.abcdefgh.part"]
    fresh = model_dir / ".big.gguf.wr1t1ng0.part"              # another process is writing it
    resumable = paths.models / "pulled.gguf.part"               # a pull's, kept to resume
    for f in (*stale, fresh, resumable):
        f.write_bytes(b"x" * 1000)
    long_ago = time.time() - 2 * 3600
    for f in (*stale, resumable):
        os.utime(f, (long_ago, long_ago))
    node = start_node(tmp_path / "a", "a", "--no-model", "--no-discovery").wait_up(60)
    try:
        assert not any(f.exists() for f in stale)
        assert fresh.exists() and resumable.exists()
        assert "removed 2 temp file(s) of interrupted writes" in node.log()
    finally:
        node.stop()


@pytest.mark.parametrize("config, flags, expect", [
    ("", (), DEFAULT_SHUTDOWN_GRACE),
    ("[node]\nshutdown_grace = 10\n", (), 10.0),            # config.toml
    ("[node]\nshutdown_grace = 10\n", ("--shutdown-grace", "0.5"), 0.5),   # the flag wins
])
def test_shutdown_grace_from_flag_over_config(tmp_path, monkeypatch, config, flags, expect):
    monkeypatch.delenv("MESHNODE_API_KEY", raising=False)
    paths = NodePaths.resolve(tmp_path).ensure()
    paths.config_file.write_text(config)
    args = build_parser().parse_args(["--home", str(tmp_path), "serve", "--headless", "--no-model", *flags])
    assert _node_kwargs(args, paths)["shutdown_grace"] == expect
